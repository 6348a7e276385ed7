use super::*;
use crate::api::{At, AtSpec, AtStatus, Condition, Outcome, Phase};
use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, ResourceExt};
use serde_json::Value;
use std::collections::BTreeMap;

/// An At as the real API server stored it (managed fields, uid, resourceVersion, a status).
fn captured() -> Value {
    let path = format!(
        "{}/tests/fixtures/admission-review-k8s-1.24/validating-update-status.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let capture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    // Captured as v1alpha1: the API server's JSON for the same At as v1.
    let object = capture["review"]["request"]["object"].clone();
    crate::conversion::convert(0, object, crate::conversion::V1).unwrap()
}

/// An At with every field the reconciler reads set, and what it does not read.
fn full_at() -> At {
    let mut at: At = serde_json::from_value(captured()).unwrap();
    at.metadata.annotations = Some(BTreeMap::from([("note".into(), "x".repeat(500))]));
    at.metadata.labels = Some(BTreeMap::from([("team".into(), "a".into())]));
    at.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2026-11-22T03:00:00Z".parse().unwrap(),
    ));
    at.spec = AtSpec {
        schedule: "2026-11-22T12:00:00".into(),
        command: "echo 'a b' | tr a-z A-Z && exit 3".into(),
        time_zone: Some("Europe/Berlin".into()),
        starting_deadline_seconds: Some(60),
        active_deadline_seconds: Some(600),
        ttl_seconds_after_finished: Some(0),
        template: crate::api::AtPodTemplate {
            metadata: None,
            image: Some("alpine:3.20".into()),
            image_pull_policy: Some(crate::api::ImagePullPolicy::IfNotPresent),
            resources: Some(ResourceRequirements {
                limits: Some(BTreeMap::from([("memory".into(), Quantity("64Mi".into()))])),
                requests: Some(BTreeMap::from([("cpu".into(), Quantity("10m".into()))])),
                ..ResourceRequirements::default()
            }),
            env: Some(vec![EnvVar {
                name: "GREETING".into(),
                value: Some("héllo \"world\"\n".into()),
                value_from: None,
            }]),
            service_account_name: Some("runner".into()),
            node_selector: Some(BTreeMap::from([("disk".into(), "ssd".into())])),
            tolerations: Some(vec![Toleration {
                key: Some("dedicated".into()),
                operator: Some("Exists".into()),
                ..Toleration::default()
            }]),
            image_pull_secrets: None,
        },
    };
    at.status = Some(AtStatus {
        phase: Phase::Done,
        pod_name: Some("example-at-pod".into()),
        scheduled_time: Some("2026-11-22T11:00:00.123456789Z".parse().unwrap()),
        start_time: Some("2026-11-22T11:00:00.2Z".parse().unwrap()),
        completion_time: Some("2026-11-22T11:00:03Z".parse().unwrap()),
        outcome: Some(Outcome::Failed),
        exit_code: Some(3),
        reason: Some("Failed".into()),
        message: Some("the command exited with code 3".into()),
        conditions: vec![Condition {
            type_: "Complete".into(),
            status: "False".into(),
            reason: "Failed".into(),
            message: "the command exited with code 3".into(),
            last_transition_time: "2026-11-22T11:00:03.5Z".parse().unwrap(),
            observed_generation: Some(2),
        }],
        observed_generation: Some(2),
    });
    at
}

/// `At` has no `PartialEq`: its parts do.
fn assert_same(read: &At, expected: &At) {
    assert_eq!(read.metadata, expected.metadata);
    assert_eq!(read.spec, expected.spec);
    assert_eq!(read.status, expected.status);
}

#[test]
fn reads_back_the_at_it_cached_without_what_the_operator_never_reads() {
    let at = full_at();
    let cached = CachedAt::from(at.clone());
    let mut expected = at;
    expected.metadata.managed_fields = None;
    expected.metadata.annotations = None;
    expected.metadata.labels = None;
    assert_same(&cached.at().unwrap(), &expected);
    // What the runtime keys on, and what the metrics read without reading the At back.
    assert_eq!(cached.name_any(), "example-at");
    assert_eq!(cached.namespace().as_deref(), Some("capture"));
    assert_eq!(cached.phase(), Phase::Done);
    // 12:00 in Berlin in November is 11:00 UTC.
    assert_eq!(cached.due(), Some("2026-11-22T11:00:00Z".parse().unwrap()));
    // Nothing else is kept as metadata: no second copy of uid, labels, timestamps.
    assert_eq!(
        cached.meta(),
        &ObjectMeta {
            name: Some("example-at".into()),
            namespace: Some("capture".into()),
            resource_version: Some("28914".into()),
            ..ObjectMeta::default()
        }
    );
}

/// Of an At's labels only its shard label's value is kept (a text that is no value reads back
/// as no label: `shard::value_of` reads both alike).
#[test]
fn reads_back_the_shard_label_it_kept_as_its_value_whatever_the_other_labels() {
    let other = ("team".to_owned(), "a".to_owned());
    for (shard, others) in [
        ("0", false),
        ("3", true),
        ("7", false),
        ("59", true),
        ("60", false),
        ("07", true),
        ("", true),
        ("x", false),
    ] {
        let mut at = full_at();
        let mut labels = BTreeMap::from([(crate::shard::LABEL.to_owned(), shard.to_owned())]);
        if others {
            labels.insert(other.0.clone(), other.1.clone());
        }
        at.metadata.labels = Some(labels.clone());
        let cached = CachedAt::from(at);
        let value = crate::shard::value_of(Some(&labels));
        let expected =
            value.map(|v| BTreeMap::from([(crate::shard::LABEL.to_owned(), v.to_string())]));
        assert_eq!(cached.at().unwrap().metadata.labels, expected, "{shard}");
        assert_eq!(value.is_some(), ["0", "3", "7", "59"].contains(&shard));
        assert_eq!(
            cached.list(),
            crate::shard::list_of(cached.at().unwrap().metadata.labels.as_ref())
        );
    }
    // No labels at all stays no labels.
    let mut at = full_at();
    at.metadata.labels = None;
    let cached = CachedAt::from(at);
    assert_eq!(cached.at().unwrap().metadata.labels, None);
    assert_eq!(cached.list(), crate::shard::SHARDS);
}

#[test]
fn decodes_the_api_servers_json_as_an_at_and_trims_it() {
    let cached: CachedAt = serde_json::from_value(captured()).unwrap();
    let at = cached.at().unwrap();
    assert_eq!(at.metadata.managed_fields, None, "managed fields dropped");
    assert_eq!(
        at.metadata.uid.as_deref(),
        Some("d8145ff9-fa52-4f7f-92ec-300d1e253d72")
    );
    assert_eq!(at.metadata.resource_version.as_deref(), Some("28914"));
    assert_eq!(at.metadata.generation, Some(2));
    assert_eq!(at.spec.command, "echo YAY YAY");
    assert_eq!(
        at.spec.template.image, None,
        "no image named: the operator's default runs the command"
    );
    assert_eq!(cached.phase(), Phase::Running);
    assert_eq!(cached.due(), Some("2019-04-12T10:12:00Z".parse().unwrap()));
    // What is kept is a fraction of the server's JSON.
    assert!(cached.packed.len() < serde_json::to_string(&captured()).unwrap().len() / 3);
}

#[test]
fn an_at_without_status_is_pending_and_a_bad_schedule_is_never_due() {
    let mut at = At::new(
        "x",
        AtSpec {
            schedule: "tomorrow".into(),
            command: "true".into(),
            ..AtSpec::default()
        },
    );
    at.metadata.namespace = Some("default".into());
    let cached = CachedAt::from(at.clone());
    assert_eq!(cached.phase(), Phase::Pending);
    assert_eq!(cached.due(), None);
    assert_same(&cached.at().unwrap(), &at);
    // A DST gap in the At's zone does not parse either.
    at.spec.schedule = "2026-03-29T02:30:00".into();
    at.spec.time_zone = Some("Europe/Berlin".into());
    assert_eq!(CachedAt::from(at).due(), None);
}

#[test]
fn a_cached_copy_that_does_not_read_back_is_an_error_naming_the_at() {
    let mut cached = CachedAt::from(full_at());
    cached.packed = lz4_flex::block::compress_prepend_size(b"{\"spec\": 1}").into();
    let error = cached.at().unwrap_err().to_string();
    assert!(
        error.starts_with("At capture/example-at: the cached copy does not read back (decoding: "),
        "{error}"
    );
    assert!(error.contains("report this as a bug"), "{error}");
    assert!(read(&cached).is_none());
    // Bytes that do not decompress: the size says 1000, the data ends at once.
    cached.packed = vec![232, 3, 0, 0].into();
    let error = cached.at().unwrap_err().to_string();
    assert!(error.contains("(decompressing: "), "{error}");
}

#[test]
fn is_the_at_resource_to_the_api_and_to_pods_owner_references() {
    assert_eq!(CachedAt::kind(&()), "At");
    assert_eq!(CachedAt::api_version(&()), At::api_version(&()));
    assert_eq!(CachedAt::plural(&()), "ats");
    assert_eq!(
        CachedAt::url_path(&(), Some("team-a")),
        At::url_path(&(), Some("team-a"))
    );
    let at_ref = AtKey::new("team-a", "x");
    assert_eq!(
        CachedAt::key_of(&at_ref),
        ObjectRef::new("x").within("team-a")
    );
    assert_eq!(CachedAt::key_of(&AtKey::new("", "y")), ObjectRef::new("y"));
}

#[test]
fn an_at_that_does_not_decode_is_kept_as_unreadable_and_the_list_still_decodes() {
    let good = serde_json::json!({
        "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
        "metadata": {"name": "good", "namespace": "ns", "resourceVersion": "1", "uid": "u1"},
        "spec": {"schedule": "2020-01-01T00:00:00Z", "command": "true"},
    });
    let mut bad = good.clone();
    bad["metadata"]["name"] = "bad".into();
    bad["status"] = serde_json::json!({"phase": "Done", "exitCode": 3_000_000_000_i64});
    let list = serde_json::json!({"items": [good, bad]});
    #[derive(serde::Deserialize)]
    struct List {
        items: Vec<CachedAt>,
    }
    let decoded: List = serde_json::from_slice(&serde_json::to_vec(&list).unwrap()).unwrap();
    let [good, bad] = &decoded.items[..] else {
        panic!("two items")
    };
    assert!(good.unreadable().is_none());
    assert!(read(good).is_some());
    let why = bad.unreadable().unwrap();
    assert!(why.contains("3000000000"), "{why}");
    assert_eq!(
        (bad.name_any(), bad.namespace().as_deref()),
        ("bad".into(), Some("ns"))
    );
    assert_eq!(bad.uid().as_deref(), Some("u1"));
    assert!(read(bad).is_none());
    assert!(bad
        .at()
        .unwrap_err()
        .to_string()
        .contains("does not decode as an At"));
    // A watch event's object comes through serde's buffered content: it decodes too.
    for at in [&list["items"][0], &list["items"][1]] {
        let line = serde_json::json!({"type": "MODIFIED", "object": at}).to_string();
        let event: kube::core::WatchEvent<CachedAt> = serde_json::from_str(&line).unwrap();
        assert!(
            matches!(event, kube::core::WatchEvent::Modified(_)),
            "{line}"
        );
    }
}

#[test]
fn watch_retries_stay_within_a_second_and_start_over_after_success() {
    use kube::runtime::utils::Backoff;
    use std::time::Duration;
    let mut backoff = watch_backoff();
    let delays: Vec<Duration> = backoff.by_ref().take(20).collect();
    assert_eq!(delays.len(), 20, "never gives up");
    assert!(delays[0] >= Duration::from_millis(100) && delays[0] <= Duration::from_millis(200));
    assert!(
        delays.iter().all(|d| *d <= Duration::from_secs(1)),
        "{delays:?}"
    );
    assert!(
        delays[10..]
            .iter()
            .all(|d| *d >= Duration::from_millis(500)),
        "{delays:?}"
    );
    backoff.reset();
    assert!(backoff.next().unwrap() <= Duration::from_millis(200));
}

/// What its writer can make large in an At's metadata (labels, annotations, finalizers, owner
/// references, managed fields) costs the cache nothing: it keeps only what cnat reads.
#[test]
fn an_at_s_metadata_costs_the_cache_only_what_cnat_reads() {
    let mut at = full_at();
    let big = "x".repeat(60_000);
    let small = CachedAt::from(at.clone()).packed.len();
    let meta = &mut at.metadata;
    meta.labels = Some(
        (0..16)
            .map(|i| (format!("tenant.example/l{i}"), big.clone()))
            .collect(),
    );
    meta.labels
        .as_mut()
        .unwrap()
        .insert(crate::shard::LABEL.into(), "7".into());
    meta.annotations = Some([("a".to_owned(), big.clone())].into());
    meta.finalizers = Some(
        (0..16)
            .map(|i| format!("tenant.example/{i}{big}"))
            .collect(),
    );
    meta.owner_references = Some(
        (0..16)
            .map(|i| {
                serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "ConfigMap", "name": format!("c{i}"), "uid": big}))
                .unwrap()
            })
            .collect(),
    );
    meta.generate_name = Some(big.clone());
    let cached = CachedAt::from(at);
    assert!(
        cached.packed.len() <= small + 16,
        "{} bytes against {small}",
        cached.packed.len()
    );
    let read = cached.at().unwrap();
    assert_eq!(
        read.metadata.labels,
        Some([(crate::shard::LABEL.to_owned(), "7".to_owned())].into())
    );
    assert_eq!(
        read.metadata.uid.as_deref(),
        Some("d8145ff9-fa52-4f7f-92ec-300d1e253d72")
    );
    assert!(read.metadata.finalizers.is_none() && read.metadata.owner_references.is_none());
}
