use super::*;
use kube::core::conversion::{ConversionResponse, ConversionReview};
use kube::core::Status;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// Any JSON value, a few levels deep: what a field may hold as far as the conversion cares.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        r#"[a-z0-9 ./:"\\é\n-]{0,12}"#.prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-zA-Z]{1,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A map of strings, as labels and annotations are; never empty (the API server drops an empty
/// one, so no stored object has it).
fn strings() -> impl Strategy<Value = BTreeMapValue> {
    prop::collection::btree_map("[a-z0-9./-]{1,20}", "[a-zA-Z0-9 {}\":,.-]{0,16}", 1..4).prop_map(
        |m| {
            BTreeMapValue(Value::Object(
                m.into_iter().map(|(k, v)| (k, json!(v))).collect(),
            ))
        },
    )
}

#[derive(Debug, Clone)]
struct BTreeMapValue(Value);

/// What v1's `spec.template.metadata` can hold: null, or labels and annotations (each absent,
/// null or a map of strings).
fn pod_metadata() -> impl Strategy<Value = Value> {
    fn map() -> impl Strategy<Value = Option<Value>> {
        prop_oneof![
            Just(None),
            Just(Some(Value::Null)),
            strings().prop_map(|m| Some(m.0)),
        ]
    }
    prop_oneof![
        Just(Value::Null),
        (map(), map()).prop_map(|(labels, annotations)| {
            let mut map = Map::new();
            if let Some(labels) = labels {
                map.insert("labels".into(), labels);
            }
            if let Some(annotations) = annotations {
                map.insert("annotations".into(), annotations);
            }
            Value::Object(map)
        }),
    ]
}

/// What v1's `spec.template.imagePullPolicy` can hold: null or a policy.
fn image_pull_policy() -> impl Strategy<Value = Value> {
    prop::sample::select(vec![
        Value::Null,
        json!("Always"),
        json!("IfNotPresent"),
        json!("Never"),
    ])
}

/// A value for the carried annotation: envelopes as the conversion writes them (pod metadata,
/// a pull policy, a carried value, any of them together, nested), and values it must leave
/// alone (re-spaced, not JSON, JSON of another shape, an envelope that carries nothing an
/// envelope needs).
fn carried_annotation() -> impl Strategy<Value = String> {
    fn written() -> impl Strategy<Value = String> {
        (
            prop::option::of(pod_metadata()),
            prop::option::of(image_pull_policy()),
            any::<bool>(),
            prop::option::of(".{0,12}"),
        )
            .prop_filter(
                "an envelope carries something",
                |(pm, policy, no_image, _)| pm.is_some() || policy.is_some() || *no_image,
            )
            .prop_map(|(pm, policy, no_image, ann)| {
                let mut fields = json!({});
                if let Some(pm) = pm {
                    fields["podMetadata"] = pm;
                }
                if let Some(policy) = policy {
                    fields["imagePullPolicy"] = policy;
                }
                if no_image {
                    fields["noImage"] = json!(true);
                }
                if let Some(ann) = ann {
                    fields["annotation"] = json!(ann);
                }
                fields.to_string()
            })
    }
    prop_oneof![
        written(),
        written().prop_map(|inner| json!({"annotation": inner}).to_string()),
        Just(r#"{ "podMetadata": {"labels": {"a": "b"}} }"#.to_owned()),
        Just(r#"{"annotation":"x"}"#.to_owned()),
        Just(r#"{"podMetadata":{"foo":1}}"#.to_owned()),
        Just(r#"{"podMetadata":{"labels":{"a":1}}}"#.to_owned()),
        Just(r#"{"imagePullPolicy":"Sometimes"}"#.to_owned()),
        Just(r#"{"imagePullPolicy":1,"podMetadata":null}"#.to_owned()),
        Just(r#"{"noImage":false}"#.to_owned()),
        Just(r#"{"noImage":"yes","podMetadata":null}"#.to_owned()),
        Just("{}".to_owned()),
        Just("not json".to_owned()),
        Just("null".to_owned()),
        any_json().prop_map(|v| v.to_string()),
    ]
}

/// Metadata as stored: names, versions, labels, and annotations, maybe with one of the carried
/// annotation's name.
fn metadata() -> impl Strategy<Value = Map<String, Value>> {
    let annotation = prop::option::of(carried_annotation());
    (
        "[a-z][a-z0-9-]{0,20}",
        "[a-z][a-z0-9-]{0,10}",
        prop::option::of(strings()),
        prop::option::of(strings()),
        annotation,
        any::<u32>(),
        any::<u16>(),
    )
        .prop_map(
            |(name, namespace, labels, annotations, carried, rv, generation)| {
                let mut meta = Map::new();
                meta.insert("name".into(), json!(name));
                meta.insert("namespace".into(), json!(namespace));
                meta.insert("resourceVersion".into(), json!(rv.to_string()));
                meta.insert("generation".into(), json!(generation));
                if let Some(labels) = labels {
                    meta.insert("labels".into(), labels.0);
                }
                let mut annotations = annotations.map(|a| a.0);
                if let Some(text) = carried {
                    let map = annotations.get_or_insert_with(|| json!({}));
                    map[CARRIED_ANNOTATION] = json!(text);
                }
                if let Some(annotations) = annotations {
                    meta.insert("annotations".into(), annotations);
                }
                meta
            },
        )
}

/// The pod fields, each absent or holding anything.
fn pod_fields() -> impl Strategy<Value = Map<String, Value>> {
    prop::collection::vec(prop::option::of(any_json()), POD_FIELDS.len()).prop_map(|values| {
        POD_FIELDS
            .iter()
            .zip(values)
            .filter_map(|(field, value)| Some((field.to_string(), value?)))
            .collect()
    })
}

/// The pod fields, each absent or holding what a pod's field of that name takes, or anything.
fn typed_pod_fields() -> impl Strategy<Value = Map<String, Value>> {
    let valid = [
        json!("registry.example/tools:1"),
        json!({"limits": {"cpu": "100m"}, "requests": {"memory": "16Mi"}}),
        json!([{"name": "A", "value": "b"}, {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]),
        json!("runner"),
        json!({"disk": "ssd"}),
        json!([{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]),
        json!([{"name": "pull"}]),
    ];
    let each = valid.map(|value| {
        prop_oneof![3 => Just(None), 6 => Just(Some(value)), 1 => prop::option::of(any_json())]
    });
    // v1alpha1's default image too, which an envelope's `noImage` turns into no image.
    (each, any::<bool>()).prop_map(|(values, busybox)| {
        let mut fields: Map<String, Value> = POD_FIELDS
            .iter()
            .zip(values)
            .filter_map(|(field, value)| Some((field.to_string(), value?)))
            .collect();
        if busybox && fields.contains_key("image") {
            fields.insert("image".into(), json!("busybox"));
        }
        fields
    })
}

/// The fields both versions hold in `spec` itself.
fn common_spec() -> impl Strategy<Value = Map<String, Value>> {
    (
        "[0-9T:+ -]{0,25}",
        ".{0,30}",
        prop::option::of(prop_oneof![Just(json!("Europe/Berlin")), Just(Value::Null)]),
        prop::option::of(any::<i64>()),
        prop::option::of(any::<i64>()),
        prop::option::of(any::<i32>()),
    )
        .prop_map(|(schedule, command, zone, starting, active, ttl)| {
            let mut spec = Map::new();
            spec.insert("schedule".into(), json!(schedule));
            spec.insert("command".into(), json!(command));
            let optional = [
                ("timeZone", zone),
                ("startingDeadlineSeconds", starting.map(|n| json!(n))),
                ("activeDeadlineSeconds", active.map(|n| json!(n))),
                ("ttlSecondsAfterFinished", ttl.map(|n| json!(n))),
            ];
            for (field, value) in optional {
                if let Some(value) = value {
                    spec.insert(field.into(), value);
                }
            }
            spec
        })
}

/// A status as either version spells it (`phases` picks the spelling), or none.
fn status<const N: usize>(phases: [&'static str; N]) -> impl Strategy<Value = Option<Value>> {
    prop::option::of(
        (
            prop::sample::select(phases.to_vec()),
            prop::option::of("[a-z0-9-]{1,20}"),
            prop::option::of(prop::sample::select(vec!["Succeeded", "Failed", "Missed"])),
            prop::option::of(any::<i32>()),
            prop::option::of(any_json()),
        )
            .prop_map(|(phase, pod, outcome, exit, conditions)| {
                let mut status = json!({"phase": phase, "scheduledTime": "2026-11-24T10:00:00Z"});
                if let Some(pod) = pod {
                    status["podName"] = json!(pod);
                }
                if let Some(outcome) = outcome {
                    status["outcome"] = json!(outcome);
                }
                if let Some(exit) = exit {
                    status["exitCode"] = json!(exit);
                }
                if let Some(conditions) = conditions {
                    status["conditions"] = conditions;
                }
                status
            }),
    )
}

fn object(
    version: &str,
    metadata: Map<String, Value>,
    spec: Map<String, Value>,
    status: Option<Value>,
) -> Value {
    let mut object =
        json!({"apiVersion": version, "kind": "At", "metadata": metadata, "spec": spec});
    if let Some(status) = status {
        object["status"] = status;
    }
    object
}

/// A v1alpha1 At as stored: the pod fields in `spec`, phases in capitals; its annotations may
/// include one of the carried annotation's name.
fn v1alpha1_at() -> impl Strategy<Value = Value> {
    (
        metadata(),
        common_spec(),
        pod_fields(),
        status(["PENDING", "RUNNING", "DONE"]),
    )
        .prop_map(|(meta, mut spec, pod, status)| {
            spec.extend(pod);
            // v1alpha1's schema default gives every At it decodes an image (its `image` is not
            // nullable: a null is defaulted too); one whose envelope
            // says v1 named none is served without one (an image a v1alpha1 write then gives it
            // is that write's change, tested apart).
            if no_image_carried(&meta) {
                spec.remove("image");
            } else if spec.get("image").is_none_or(Value::is_null) {
                spec.insert("image".into(), json!("busybox"));
            }
            object(V1ALPHA1, meta, spec, status)
        })
}

/// A v1alpha1 At as a v1alpha1 write may leave it: one whose envelope says v1 named no image
/// may have one again (v1alpha1's default `busybox`, or one the writer chose, or null).
fn v1alpha1_written() -> impl Strategy<Value = Value> {
    (
        v1alpha1_at(),
        prop::sample::select(vec![
            None,
            Some(json!("busybox")),
            Some(json!("alpine:3.20")),
            Some(Value::Null),
        ]),
    )
        .prop_map(|(mut at, image)| {
            if let (Some(image), Some(spec)) = (image, at["spec"].as_object_mut()) {
                spec.insert("image".into(), image);
            }
            at
        })
}

/// Whether `meta` carries an envelope that says the v1 object named no image.
fn no_image_carried(meta: &Map<String, Value>) -> bool {
    meta.get("annotations")
        .and_then(|a| a.get(CARRIED_ANNOTATION))
        .and_then(Value::as_str)
        .and_then(envelope)
        .is_some_and(|envelope| envelope.no_image)
}

/// A v1 At as stored: `spec.template` always there (its schema default), maybe with pod
/// metadata and a pull policy, maybe with an annotation of the carried one's name (nothing
/// stops a user).
fn v1_at() -> impl Strategy<Value = Value> {
    (
        metadata(),
        common_spec(),
        pod_fields(),
        prop::option::of(pod_metadata()),
        prop::option::of(image_pull_policy()),
        status(["Pending", "Running", "Done"]),
    )
        .prop_map(
            |(meta, mut spec, mut template, pod_metadata, policy, status)| {
                if let Some(pod_metadata) = pod_metadata {
                    template.insert("metadata".into(), pod_metadata);
                }
                if let Some(policy) = policy {
                    template.insert("imagePullPolicy".into(), policy);
                }
                spec.insert("template".into(), Value::Object(template));
                object(V1, meta, spec, status)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn v1alpha1_to_v1_and_back_is_identity(at in v1alpha1_at()) {
        let v1 = convert(0, at.clone(), V1).unwrap();
        prop_assert_eq!(&v1["apiVersion"], &json!(V1));
        for field in POD_FIELDS {
            prop_assert!(v1["spec"].get(field).is_none(), "{} left in spec", field);
        }
        prop_assert_eq!(convert(0, v1, V1ALPHA1).unwrap(), at);
    }

    #[test]
    fn v1_to_v1alpha1_and_back_is_identity(at in v1_at()) {
        let old = convert(0, at.clone(), V1ALPHA1).unwrap();
        prop_assert_eq!(&old["apiVersion"], &json!(V1ALPHA1));
        prop_assert!(old["spec"].get("template").is_none());
        prop_assert_eq!(convert(0, old, V1).unwrap(), at);
    }

    #[test]
    fn converting_to_the_same_version_changes_nothing(at in prop_oneof![v1alpha1_at(), v1_at()]) {
        let version = at["apiVersion"].as_str().unwrap().to_owned();
        prop_assert_eq!(convert(3, at.clone(), &version).unwrap(), at);
    }

    #[test]
    fn the_typed_path_gives_the_at_that_converting_and_decoding_gives(
        (meta, mut spec, pod, status, version) in (
            metadata(),
            common_spec(),
            typed_pod_fields(),
            status(["PENDING", "RUNNING", "DONE", "Pending"]),
            prop::sample::select(vec![Some(V1ALPHA1), Some(V1ALPHA1), Some(V1ALPHA1), Some(V1), None]),
        )
    ) {
        spec.extend(pod);
        let mut at = object(version.unwrap_or_default(), meta, spec, status);
        if version.is_none() {
            at.as_object_mut().unwrap().remove("apiVersion");
        }
        let defined = model::convert(0, at.clone(), V1);
        prop_assert_eq!(&convert(0, at.clone(), V1), &defined);
        let slow = defined
            .map_err(|e| e.to_string())
            .and_then(|v1| serde_json::from_value::<crate::api::At>(v1).map_err(|e| e.to_string()));
        let text = serde_json::to_vec(&at).unwrap();
        let typed = serde_json::from_slice::<typed::AtV1alpha1>(&text).ok().and_then(typed::AtV1alpha1::into_v1);
        // The typed path takes exactly the v1alpha1 objects the slow path reads as Ats, and
        // reads them alike; any other object it leaves to the slow path.
        match (slow, typed) {
            (Ok(slow), Some(typed)) => prop_assert_eq!((slow.metadata, slow.spec, slow.status), (typed.metadata, typed.spec, typed.status)),
            (Ok(_), None) => prop_assert!(version != Some(V1ALPHA1), "{}", at),
            (Err(_), None) => {}
            (slow, typed) => prop_assert!(false, "{:?} but {:?} for {}", slow, typed, at),
        }
    }

    #[test]
    fn the_answer_holds_what_convert_makes_of_each_object(
        objects in prop::collection::vec(prop_oneof![4 => v1alpha1_written(), 4 => v1_at(), 1 => any_json()], 0..6),
        desired in prop::sample::select(vec![V1, V1ALPHA1]),
        pretty in any::<bool>(),
    ) {
        let body = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
            "request": {"uid": "u-p", "desiredAPIVersion": desired, "objects": objects}});
        let body = if pretty { serde_json::to_vec_pretty(&body) } else { serde_json::to_vec(&body) }.unwrap();
        let response = review(&body).response.unwrap();
        let converted: Result<Vec<Value>, ConversionError> = objects
            .iter()
            .enumerate()
            .map(|(i, object)| convert(i, object.clone(), desired))
            .collect();
        let expected: Result<Vec<Value>, ConversionError> = objects
            .into_iter()
            .enumerate()
            .map(|(i, object)| model::convert(i, object, desired))
            .collect();
        prop_assert_eq!(&converted, &expected);
        match expected {
            Ok(expected) => {
                prop_assert_eq!(response.result.message, "");
                prop_assert_eq!(response.uid, "u-p");
                prop_assert_eq!(response.converted_objects, expected);
            }
            Err(error) => {
                prop_assert!(response.converted_objects.is_empty());
                prop_assert!(response.result.message.contains(&error.to_string()), "{} / {}", response.result.message, error);
            }
        }
    }

    #[test]
    fn any_review_body_gets_an_answer(body in prop::collection::vec(any::<u8>(), 0..256)) {
        let answer = review(&body);
        prop_assert!(answer.response.is_some());
    }
}

#[test]
fn pod_metadata_travels_in_an_annotation_and_other_annotations_stay() {
    let v1 = json!({
        "apiVersion": V1, "kind": "At",
        "metadata": {"name": "backup", "namespace": "team-a", "annotations": {"owner": "ops"}},
        "spec": {"schedule": "2026-11-23T02:00:00", "timeZone": "Europe/Berlin",
            "command": "./backup.sh", "startingDeadlineSeconds": 300,
            "template": {
                "metadata": {"labels": {"team": "a"},
                    "annotations": {"sidecar.istio.io/inject": "false"}},
                "image": "registry.example.com/backup:1.4",
                "resources": {"limits": {"memory": "64Mi"}},
                "serviceAccountName": "backup"
            }},
        "status": {"phase": "Running", "podName": "backup-7f3a"}
    });
    let old = convert(0, v1.clone(), V1ALPHA1).unwrap();
    assert_eq!(
        old,
        json!({
            "apiVersion": V1ALPHA1, "kind": "At",
            "metadata": {"name": "backup", "namespace": "team-a", "annotations": {
                "owner": "ops",
                CARRIED_ANNOTATION: r#"{"podMetadata":{"annotations":{"sidecar.istio.io/inject":"false"},"labels":{"team":"a"}}}"#
            }},
            "spec": {"schedule": "2026-11-23T02:00:00", "timeZone": "Europe/Berlin",
                "command": "./backup.sh", "startingDeadlineSeconds": 300,
                "image": "registry.example.com/backup:1.4",
                "resources": {"limits": {"memory": "64Mi"}},
                "serviceAccountName": "backup"},
            "status": {"phase": "RUNNING", "podName": "backup-7f3a"}
        })
    );
    assert_eq!(convert(0, old.clone(), V1).unwrap(), v1);

    // The pull policy travels in the same envelope; an At without an image stays without one.
    let mut pulled = v1.clone();
    pulled["spec"]["template"] = json!({"imagePullPolicy": "Never"});
    let old_pulled = convert(0, pulled.clone(), V1ALPHA1).unwrap();
    assert_eq!(
        old_pulled["metadata"]["annotations"][CARRIED_ANNOTATION],
        json!(r#"{"imagePullPolicy":"Never","noImage":true}"#)
    );
    assert!(old_pulled["spec"].get("image").is_none());
    assert!(old_pulled["spec"].get("imagePullPolicy").is_none());
    assert_eq!(convert(0, old_pulled.clone(), V1).unwrap(), pulled);
    // Written as v1alpha1, the API server gives it that version's default image: it names no
    // image again in v1. An image a v1alpha1 writer sets is kept.
    let mut defaulted = old_pulled.clone();
    defaulted["spec"]["image"] = json!("busybox");
    assert_eq!(convert(0, defaulted, V1).unwrap(), pulled);
    let mut chosen = old_pulled;
    chosen["spec"]["image"] = json!("alpine:3.20");
    let chosen = convert(0, chosen, V1).unwrap();
    assert_eq!(chosen["spec"]["template"]["image"], "alpine:3.20");
    assert_eq!(chosen["spec"]["template"]["imagePullPolicy"], "Never");
    assert_eq!(
        in_v1alpha1_terms("spec.template.imagePullPolicy: Unsupported value"),
        format!("metadata.annotations[{CARRIED_ANNOTATION}].imagePullPolicy: Unsupported value")
    );

    // An annotation cnat did not write (re-spaced by hand) stays an annotation.
    let mut edited = old;
    let by_hand = r#"{ "podMetadata": {"labels": {}} }"#;
    edited["metadata"]["annotations"][CARRIED_ANNOTATION] = json!(by_hand);
    let up = convert(0, edited, V1).unwrap();
    assert_eq!(
        up["metadata"]["annotations"][CARRIED_ANNOTATION],
        json!(by_hand)
    );
    assert!(up["spec"]["template"].get("metadata").is_none());

    // A v1 object that has an annotation of that name itself, which would be taken for an
    // envelope, keeps it: the envelope carries it too.
    let mut odd = v1.clone();
    let lookalike = r#"{"podMetadata":{"labels":{"x":"y"}}}"#;
    odd["metadata"]["annotations"][CARRIED_ANNOTATION] = json!(lookalike);
    odd["spec"]["template"]
        .as_object_mut()
        .unwrap()
        .remove("metadata");
    let old = convert(0, odd.clone(), V1ALPHA1).unwrap();
    assert_eq!(
        old["metadata"]["annotations"][CARRIED_ANNOTATION],
        json!(serde_json::to_string(&json!({"annotation": lookalike})).unwrap())
    );
    assert_eq!(convert(0, old, V1).unwrap(), odd);
}

#[test]
fn a_missing_spec_or_status_is_not_an_error() {
    let bare = json!({"apiVersion": V1ALPHA1, "kind": "At", "metadata": {"name": "x"}});
    let mut expected = bare.clone();
    expected["apiVersion"] = json!(V1);
    assert_eq!(convert(0, bare, V1).unwrap(), expected);
}

#[test]
fn unknown_versions_and_non_objects_are_refused_by_name() {
    let at = json!({"apiVersion": "cnat.programming-kubernetes.info/v2", "kind": "At",
        "metadata": {"name": "x", "namespace": "ns"}});
    assert_eq!(
        convert(4, at.clone(), V1).unwrap_err().to_string(),
        "object 4 (ns/x) has apiVersion \"cnat.programming-kubernetes.info/v2\": cnat converts At objects between cnat.programming-kubernetes.info/v1alpha1 and cnat.programming-kubernetes.info/v1"
    );
    assert!(convert(0, at, "apps/v1")
        .unwrap_err()
        .to_string()
        .starts_with("cnat cannot convert to \"apps/v1\""));
    assert_eq!(
        convert(2, json!([1]), V1).unwrap_err(),
        ConversionError::NotAnObject {
            index: 2,
            found: "an array"
        }
    );
}

fn answer(body: &Value) -> kube::core::conversion::ConversionResponse {
    review(&serde_json::to_vec(body).unwrap()).response.unwrap()
}

#[test]
fn a_review_converts_every_object_and_echoes_the_uid() {
    let response = answer(&json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
        "request": {
            "uid": "0a9f-uid", "desiredAPIVersion": V1,
            "objects": [
                {"apiVersion": V1ALPHA1, "kind": "At", "metadata": {"name": "a"},
                 "spec": {"schedule": "s", "command": "c", "image": "busybox"},
                 "status": {"phase": "DONE", "outcome": "Succeeded"}},
                {"apiVersion": V1, "kind": "At", "metadata": {"name": "b"},
                 "spec": {"schedule": "s", "command": "c", "template": {"image": "alpine"}}}
            ]
        }
    }));
    assert_eq!(response.uid, "0a9f-uid");
    assert_eq!(
        response.result.status,
        Some(kube::core::response::StatusSummary::Success)
    );
    assert_eq!(
        response.converted_objects,
        vec![
            json!({"apiVersion": V1, "kind": "At", "metadata": {"name": "a"},
                "spec": {"schedule": "s", "command": "c", "template": {"image": "busybox"}},
                "status": {"phase": "Done", "outcome": "Succeeded"}}),
            json!({"apiVersion": V1, "kind": "At", "metadata": {"name": "b"},
                "spec": {"schedule": "s", "command": "c", "template": {"image": "alpine"}}}),
        ]
    );
}

#[test]
fn a_bad_review_gets_a_failure_with_a_message() {
    let unknown = answer(&json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
        "request": {"uid": "u1", "desiredAPIVersion": "cnat.programming-kubernetes.info/v9",
            "objects": [{"apiVersion": V1, "kind": "At"}]}
    }));
    assert_eq!(unknown.uid, "u1");
    assert_eq!(
        unknown.result.status,
        Some(kube::core::response::StatusSummary::Failure)
    );
    assert!(
        unknown.result.message.contains("v9"),
        "{}",
        unknown.result.message
    );
    assert!(unknown.converted_objects.is_empty());

    let no_request =
        answer(&json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview"}));
    assert_eq!(
        no_request.result.status,
        Some(kube::core::response::StatusSummary::Failure)
    );
    assert_eq!(
        no_request.result.message,
        "the ConversionReview has no request"
    );

    let garbage = review(b"{\"request\": 12").response.unwrap();
    assert_eq!(
        garbage.result.status,
        Some(kube::core::response::StatusSummary::Failure)
    );
    assert!(garbage
        .result
        .message
        .starts_with("the body is not a ConversionReview"));
}

#[test]
fn messages_to_v1alpha1_writers_name_their_own_fields_and_phases() {
    assert_eq!(
        in_v1alpha1_terms(r#"spec.template.image: "Busybox" is not a valid image reference"#),
        r#"spec.image: "Busybox" is not a valid image reference"#
    );
    assert_eq!(
        in_v1alpha1_terms(r#"spec.template.metadata.labels.team: "a b" is not a label value"#),
        format!(
            r#"metadata.annotations[{CARRIED_ANNOTATION}].podMetadata.labels.team: "a b" is not a label value"#
        )
    );
    assert_eq!(
        in_v1alpha1_terms("spec: cannot change once the At is Running: its command already ran"),
        "spec: cannot change once the At is RUNNING: its command already ran"
    );
    assert_eq!(
        in_v1alpha1_terms(
            "status.phase: cannot go back from Done to Pending: an At runs at most once"
        ),
        "status.phase: cannot go back from DONE to PENDING: an At runs at most once"
    );
    assert_eq!(
        in_v1alpha1_terms("status.phase: cannot be removed once Done; an At runs at most once"),
        "status.phase: cannot be removed once DONE; an At runs at most once"
    );
    // A user's value that happens to be a phase word, not after those words, stays.
    assert_eq!(
        in_v1alpha1_terms(r#"spec.command: "Done" runs nothing"#),
        r#"spec.command: "Done" runs nothing"#
    );
}

#[test]
fn keys_given_twice_escapes_and_spacing_read_as_json_readers_read_them() {
    let texts = [
        // `spec` twice (the last counts), a pod field twice, a phase spelled with an escape.
        r#"{"apiVersion":"cnat.programming-kubernetes.info/v1alpha1","spec":{"image":"a"},"spec":{"image":"b","image":"c","schedule":"s"},"status":{"phase":"\u0050ENDING"}}"#,
        // Keys with escapes, spaces and line breaks everywhere, a template twice.
        "{ \"api\\u0056ersion\" : \"cnat.programming-kubernetes.info/v1\" ,\n \"metadata\" : { \"name\" : \"x\" } ,\r\n \"spec\" : { \"template\" : 7 , \"template\" : { \"image\" : \"i\" , \"metadata\" : { \"labels\" : { \"a\" : \"b\" } } } } }",
        // The carried annotation twice (the last counts), an array where a spec would be.
        r#"{"apiVersion":"cnat.programming-kubernetes.info/v1alpha1","metadata":{"annotations":{"cnat.programming-kubernetes.info/v1-fields":"x","cnat.programming-kubernetes.info/v1-fields":"{\"podMetadata\":{\"labels\":{\"a\":\"b\"}}}"}},"spec":[1, 2]}"#,
        r#"{"apiVersion":"cnat.programming-kubernetes.info/v1alpha1","metadata":{"annotations":{"cnat.programming-kubernetes.info/v1-fields":"x","cnat.programming-kubernetes.info/v1-fields":"{\"podMetadata\":{\"labels\":{\"a\":\"b\"}}}"}},"spec":{"command":"c"}}"#,
    ];
    for text in texts {
        for desired in [V1, V1ALPHA1] {
            let body = format!(
                r#"{{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{{"uid":"u","desiredAPIVersion":"{desired}","objects":[ {text} , {text} ]}}}}"#
            );
            let object: Value = serde_json::from_str(text).unwrap();
            let expected = model::convert(0, object.clone(), desired).unwrap();
            assert_eq!(convert(0, object, desired).unwrap(), expected);
            let response = review(body.as_bytes()).response.unwrap();
            assert_eq!(response.result.message, "", "{text}");
            assert_eq!(response.converted_objects, vec![expected.clone(), expected]);
        }
    }
}

/// A ConversionReview of `objects` (JSON texts) to `desired`.
fn review_of(objects: &[String], desired: &str) -> String {
    format!(
        r#"{{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{{"uid":"u","desiredAPIVersion":"{desired}","objects":[{}]}}}}"#,
        objects.join(",")
    )
}

#[test]
fn a_body_read_a_byte_at_a_time_gets_the_same_answer() {
    // Every object boundary, escape and quote at the end of a read.
    struct Trickle<'a>(&'a [u8]);
    impl std::io::Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let Some((first, rest)) = self.0.split_first() else {
                return Ok(0);
            };
            buf[0] = *first;
            self.0 = rest;
            Ok(1)
        }
    }
    let at = json!({"apiVersion": V1ALPHA1, "kind": "At",
        "metadata": {"name": "a\"b\\", "annotations": {"k\"": "v\\\"", CARRIED_ANNOTATION: "{\"podMetadata\":{\"labels\":{\"a\":\"b\"}}}"}},
        "spec": {"schedule": "s", "command": "echo \"}]\\", "image": "i", "env": [{"name": "A", "value": "[{"}]},
        "status": {"phase": "DONE"}});
    let objects = vec![
        at.to_string(),
        at.to_string(),
        serde_json::to_string_pretty(&at).unwrap(),
    ];
    for desired in [V1, V1ALPHA1] {
        let body = review_of(&objects, desired);
        let mut whole = Vec::new();
        let mut trickled = Vec::new();
        let a = streaming::answer(body.as_bytes(), &mut whole).unwrap();
        let b = streaming::answer(Trickle(body.as_bytes()), &mut trickled).unwrap();
        assert_eq!(a, streaming::Answered::Converted(3));
        assert_eq!(b, a);
        assert_eq!(
            String::from_utf8(trickled).unwrap(),
            String::from_utf8(whole).unwrap()
        );
    }
}

#[test]
fn a_key_given_a_hundred_thousand_times_costs_a_pass_not_a_square() {
    // Linear work: a quadratic removal would move 5e9 entries here (many seconds); the budget
    // lets about 120,000 members through.
    let copies = r#""apiVersion":"x","#.repeat(100_000);
    let object = format!(r#"{{{copies}"apiVersion":"{V1}","spec":{{"template":{{}}}}}}"#);
    let response = review(review_of(&[object], V1ALPHA1).as_bytes())
        .response
        .unwrap();
    assert_eq!(response.result.message, "");
    let converted = &response.converted_objects[0];
    assert_eq!(converted["apiVersion"], V1ALPHA1);
}

#[test]
fn pod_metadata_moved_into_the_annotation_is_read_within_the_object_s_budget() {
    let huge = format!("[{}0]", "0,".repeat(2_000_000));
    let object = format!(r#"{{"apiVersion":"{V1}","spec":{{"template":{{"metadata":{huge}}}}}}}"#);
    let response = review(review_of(&[object], V1ALPHA1).as_bytes())
        .response
        .unwrap();
    assert!(
        response
            .result
            .message
            .starts_with("object 0: the value takes more than"),
        "{}",
        response.result.message
    );
    // A carried annotation longer than any envelope is not opened (and so not read as JSON).
    let long = json!({"podMetadata": {"labels": {"a": "b".repeat(3 << 20)}}}).to_string();
    assert!(envelope(&long).is_none());
    let short = json!({"podMetadata": {"labels": {"a": "b"}}}).to_string();
    assert!(envelope(&short).is_some());
}

/// The answer the webhook streams (`streaming::answer`) to a `ConversionReview` body, collected.
fn review(body: &[u8]) -> ConversionReview {
    let mut out = Vec::new();
    let failure = |why: String| {
        ConversionResponse::invalid(Status::failure(&why, "BadRequest")).into_review()
    };
    match streaming::answer(body, &mut out) {
        Ok(_) => serde_json::from_slice(&out)
            .unwrap_or_else(|e| failure(format!("cnat wrote an unreadable answer: {e}"))),
        Err(broken) => failure(broken.to_string()),
    }
}

/// The definition of the conversion, on a `Value`: what `convert` (the streamed parts) and the
/// typed path are tested against.
mod model {
    use crate::conversion::rules::*;
    use serde_json::{Map, Value};

    /// `object` (the `index`th of a request) as `desired` (`V1ALPHA1` or `V1`).
    pub(super) fn convert(
        index: usize,
        object: Value,
        desired: &str,
    ) -> Result<Value, ConversionError> {
        if desired != V1 && desired != V1ALPHA1 {
            return Err(ConversionError::UnknownTarget(desired.to_owned()));
        }
        let Value::Object(mut object) = object else {
            return Err(ConversionError::NotAnObject {
                index,
                found: kind_of(&object),
            });
        };
        let version = object
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        match version {
            v if v == desired => {}
            V1ALPHA1 => up(&mut object),
            V1 => down(&mut object),
            other => {
                return Err(ConversionError::UnknownSource {
                    index,
                    name: name_of(&object),
                    version: other.to_owned(),
                })
            }
        }
        object.insert("apiVersion".into(), Value::String(desired.to_owned()));
        Ok(Value::Object(object))
    }

    /// `v1alpha1` to `v1`, in place (`apiVersion` untouched).
    fn up(object: &mut Map<String, Value>) {
        let Some(Value::Object(spec)) = object.get_mut("spec") else {
            // No spec (the schema requires one): nothing to move, and the annotation stays.
            return phase(object, true);
        };
        let mut template = Map::new();
        for field in POD_FIELDS {
            if let Some(value) = spec.remove(field) {
                template.insert(field.to_owned(), value);
            }
        }
        // What this object held as v1 and v1alpha1 cannot: only an envelope as `down` writes it is
        // opened, so any other value stays where it is and comes back unchanged.
        let envelope = carried_annotation(object).and_then(envelope);
        if let Some(Envelope {
            fields,
            no_image,
            annotation,
        }) = envelope
        {
            for (field, value) in fields {
                template.insert(field.to_owned(), value);
            }
            if no_image && template.get("image").is_none_or(|i| i == V1ALPHA1_IMAGE) {
                template.remove("image");
            }
            set_annotation(object, annotation);
        }
        if let Some(Value::Object(spec)) = object.get_mut("spec") {
            spec.insert("template".into(), Value::Object(template));
        }
        phase(object, true);
    }

    /// `v1` to `v1alpha1`, in place (`apiVersion` untouched).
    fn down(object: &mut Map<String, Value>) {
        let mut carried = Map::new();
        if let Some(Value::Object(spec)) = object.get_mut("spec") {
            // (A template that is not an object, which the schema does not let through, is dropped.)
            if let Some(Value::Object(mut template)) = spec.remove("template") {
                for (field, key) in V1_ONLY {
                    if let Some(value) = template.remove(field) {
                        carried.insert(key.into(), value);
                    }
                }
                if template.get("image").is_none_or(Value::is_null) {
                    carried.insert(NO_IMAGE.into(), Value::Bool(true));
                }
                // Every other field of the template is a pod field: v1alpha1 has them in `spec`.
                spec.extend(template);
            }
        }
        let annotation = carried_annotation(object).map(str::to_owned);
        // An annotation of this name that `up` would not open stays as it is; one it would open
        // (a v1 object carrying what looks like an envelope) goes into the envelope itself.
        let wrap = !carried.is_empty() || annotation.as_deref().and_then(envelope).is_some();
        if wrap {
            if let Some(annotation) = annotation {
                carried.insert(ANNOTATION.into(), Value::String(annotation));
            }
            let text = serde_json::to_string(&Value::Object(carried)).unwrap_or_default();
            set_annotation(object, Some(text));
        }
        phase(object, false);
    }

    /// Respells `status.phase` by `PHASES`, to v1's spelling when `to_v1`, else to v1alpha1's; a
    /// value not in the table stays as it is.
    fn phase(object: &mut Map<String, Value>, to_v1: bool) {
        if let Some(Value::Object(status)) = object.get_mut("status") {
            respell(status, to_v1);
        }
    }

    /// The value of the carried annotation on `object`, if it has one.
    fn carried_annotation(object: &Map<String, Value>) -> Option<&str> {
        object
            .get("metadata")?
            .get("annotations")?
            .get(CARRIED_ANNOTATION)?
            .as_str()
    }

    /// Sets the carried annotation to `value`, or removes it (and the annotations map when it then
    /// holds nothing, as the API server never stores an empty one).
    fn set_annotation(object: &mut Map<String, Value>, value: Option<String>) {
        let meta = object
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        let Value::Object(meta) = meta else {
            return;
        };
        match value {
            Some(value) => {
                let annotations = meta
                    .entry("annotations")
                    .or_insert_with(|| Value::Object(Map::new()));
                if !annotations.is_object() {
                    *annotations = Value::Object(Map::new());
                }
                if let Value::Object(annotations) = annotations {
                    annotations.insert(CARRIED_ANNOTATION.into(), Value::String(value));
                }
            }
            None => {
                if let Some(Value::Object(annotations)) = meta.get_mut("annotations") {
                    annotations.remove(CARRIED_ANNOTATION);
                    if annotations.is_empty() {
                        meta.remove("annotations");
                    }
                }
            }
        }
    }

    fn name_of(object: &Map<String, Value>) -> String {
        let meta = object.get("metadata");
        let field = |f: &str| meta.and_then(|m| m.get(f)).and_then(Value::as_str);
        match (field("namespace"), field("name")) {
            (Some(ns), Some(name)) => format!("{ns}/{name}"),
            (None, Some(name)) => name.to_owned(),
            _ => "no name".to_owned(),
        }
    }

    fn kind_of(value: &Value) -> &'static str {
        match value {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Number(_) => "a number",
            Value::String(_) => "a string",
            Value::Array(_) => "an array",
            Value::Object(_) => "an object",
        }
    }
}
