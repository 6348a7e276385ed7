//! Admission through a real API server: the webhook configurations cnat ships (`webhooks/`),
//! pointed at a `cnat run` replica by URL with its generated CA; denials with the real message,
//! defaults applied, the escalation guard on real RBAC and SubjectAccessReviews, and status
//! writes that never depend on the webhook.

use crate::lifecycle::{at, start_operator};
use crate::support::envtest::{wait_at, ControlPlane, Replica};
use cnat::api::{At, Phase};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::{json, Value};
use std::time::Duration;

pub(crate) async fn register(client: &Client, replica: &Replica, namespace: &str) {
    crate::support::envtest::register_webhooks(client, replica.webhook, &replica.ca(), namespace)
        .await;
}

/// A Role in `ns` granting `verbs` on `resources` (group, resource) to `user`.
pub(crate) async fn grant(client: &Client, ns: &str, user: &str, rules: Value) {
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": user}, "rules": rules,
    }))
    .unwrap();
    Api::<Role>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": user},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": user},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

/// Creates `at`, retrying while the API server has not yet picked up a new webhook
/// configuration or RBAC binding (both reach its caches asynchronously).
pub(crate) async fn create(ats: &Api<At>, at: &At) -> Result<At, kube::Error> {
    let mut tries = 0;
    loop {
        let result = ats.create(&PostParams::default(), at).await;
        match &result {
            Err(kube::Error::Api(s))
                if s.code == 403 && s.message.contains("cannot create") && tries < 50 => {}
            _ => return result,
        }
        tries += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) async fn ready(plane: &ControlPlane, replica: &Replica) {
    let _ = plane;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while crate::support::process::probe(replica.admin, "/readyz") != Some(200) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never ready: {}",
            replica.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn admission_denies_defaults_guards_and_never_blocks_status_writes() {
    let plane = crate::real_control_plane!();
    let admin = plane.admin().await;
    crate::support::envtest::install_crd(&admin, &cnat::api::crd_yaml()).await;
    let ns = plane.namespace("admission", &[]).await;
    // Serves the webhooks; reconciles nothing (it watches another namespace).
    let mut replica = plane.replica("cnat-0", &ns, &["--namespace=elsewhere"]);
    ready(plane, &replica).await;
    register(&admin, &replica, &ns).await;
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let soon = chrono::Utc::now() + chrono::Duration::seconds(30);

    // A bad schedule is denied with the webhook's message, as kubectl shows it. The first
    // creates may still pass before the API server loaded the configuration.
    let mut bad = at("bad", soon, "true");
    bad.spec.schedule = "tomorrow noon".into();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let denied = loop {
        match ats.create(&PostParams::default(), &bad).await {
            Err(kube::Error::Api(status)) => break status,
            Ok(_) => {
                ats.delete("bad", &Default::default()).await.unwrap();
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the webhook never applied"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(other) => panic!("{other}"),
        }
    };
    assert_eq!(denied.code, 400, "{denied:?}");
    assert!(
        denied.message.starts_with(
            "admission webhook \"validate.ats.cnat.programming-kubernetes.info\" denied the request: At"
        ),
        "{}",
        denied.message
    );
    assert!(
        denied
            .message
            .contains("\"tomorrow noon\" is not an RFC 3339 time"),
        "{}",
        denied.message
    );

    // Sizes: a command longer than Linux passes to a program is refused by the schema (the API
    // server's own words); a spec over its bytes in all, by the webhook, which names the bound.
    let mut long = at("long", chrono::Utc::now(), "true");
    long.spec.command = "x".repeat(cnat::limits::MAX_COMMAND + 1);
    let refused = ats
        .create(&PostParams::default(), &long)
        .await
        .expect_err("a command over its bound");
    let kube::Error::Api(refused) = refused else {
        panic!("{refused}")
    };
    assert!(
        refused.message.contains("spec.command") && refused.message.contains("131071"),
        "{}",
        refused.message
    );
    let mut heavy = at("heavy", chrono::Utc::now(), "true");
    heavy.spec.template.env = Some(
        (0..5)
            .map(|i| k8s_openapi::api::core::v1::EnvVar {
                name: format!("V{i}"),
                value: Some("v".repeat(60_000)),
                value_from: None,
            })
            .collect(),
    );
    let refused = ats
        .create(&PostParams::default(), &heavy)
        .await
        .expect_err("a spec over its bytes");
    let kube::Error::Api(refused) = refused else {
        panic!("{refused}")
    };
    assert!(
        refused
            .message
            .contains("more than the 262144 an At may hold"),
        "{}",
        refused.message
    );

    // Defaults: the shard label, and the phase that reads on every At; no image (the
    // operator's default image runs an At that names none).
    let raw: Api<kube::core::DynamicObject> = Api::namespaced_with(
        admin.clone(),
        &ns,
        &kube::discovery::ApiResource::erase::<At>(&()),
    );
    let bare: kube::core::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
        "metadata": {"name": "bare"},
        "spec": {"schedule": soon.to_rfc3339(), "command": "true"},
    }))
    .unwrap();
    let created = raw.create(&PostParams::default(), &bare).await.unwrap();
    assert!(
        created.data["spec"]["template"].get("image").is_none(),
        "no image: the operator's default runs it: {:?}",
        created.data
    );
    assert!(
        created
            .metadata
            .labels
            .as_ref()
            .is_some_and(|labels| labels.contains_key(cnat::shard::LABEL)),
        "the mutating webhook's shard label: {:?}",
        created.metadata
    );
    assert_eq!(created.data["status"]["phase"], "Pending");
    shard_label_is_fenced(&raw, created).await;
    // A blank image names none: the At keeps none (v1alpha1: tests/e2e/upgrade.rs).
    let blank_v1: kube::core::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
        "metadata": {"name": "blank-v1"},
        "spec": {"schedule": soon.to_rfc3339(), "command": "true", "template": {"image": " "}},
    }))
    .unwrap();
    let stored = raw.create(&PostParams::default(), &blank_v1).await.unwrap();
    assert!(
        stored.data["spec"]["template"].get("image").is_none(),
        "{:?}",
        stored.data
    );
    // The CRD defaults these too: the replica's metrics show the mutating webhook answered.
    let (_, metrics) = crate::support::process::get(replica.admin, "/metrics").unwrap();
    assert!(
        metrics.contains("cnat_admission_requests_total{webhook=\"mutating\",operation=\"CREATE\",allowed=\"true\"}"),
        "{metrics}"
    );

    // The escalation guard: alice may create Ats but not pods; bob may do both.
    let at_rules = json!([{"apiGroups": ["cnat.programming-kubernetes.info"], "resources": ["ats"],
                           "verbs": ["create", "get"]}]);
    grant(&admin, &ns, "alice", at_rules.clone()).await;
    let mut both = at_rules.as_array().unwrap().clone();
    both.push(json!({"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}));
    grant(&admin, &ns, "bob", Value::from(both)).await;
    let as_alice: Api<At> =
        Api::namespaced(plane.user("alice", &["system:authenticated"]).await, &ns);
    let as_bob: Api<At> = Api::namespaced(plane.user("bob", &["system:authenticated"]).await, &ns);
    let refused = create(&as_alice, &at("by-alice", soon, "true"))
        .await
        .unwrap_err();
    let kube::Error::Api(refused) = refused else {
        panic!("{refused}")
    };
    assert!(
        refused
            .message
            .contains("alice may not create pods in namespace"),
        "{}",
        refused.message
    );
    create(&as_bob, &at("by-bob", soon, "true")).await.unwrap();

    // With the webhook down, creates fail (failurePolicy Fail) but the operator's status
    // writes do not: the rules leave ats/status out.
    let due = chrono::Utc::now() + chrono::Duration::seconds(2);
    ats.create(&PostParams::default(), &at("while-down", due, "true"))
        .await
        .unwrap();
    replica.kill();
    let down = ats
        .create(
            &PostParams::default(),
            &at("refused-while-down", due, "true"),
        )
        .await
        .unwrap_err();
    assert!(
        down.to_string().contains("failed calling webhook"),
        "{down}"
    );
    let _operator = start_operator(&admin, &ns);
    let running = wait_at(&ats, "while-down", Duration::from_secs(60), |at| {
        at.status
            .as_ref()
            .is_some_and(|s| s.phase == Phase::Running)
    })
    .await;
    assert_eq!(
        running.status.unwrap().pod_name.as_deref(),
        Some("while-down-pod")
    );
    // The By-bob At got its Pending status written too.
    let scheduled = wait_at(&ats, "by-bob", Duration::from_secs(30), |at| {
        at.status
            .as_ref()
            .is_some_and(|s| s.reason.as_deref() == Some("Scheduled"))
    })
    .await;
    assert_eq!(scheduled.status.unwrap().phase, Phase::Pending);
}

/// The shard label the mutating webhook gave `created` keeps its value: a change is refused,
/// naming the label; a removal (a merge patch, or a replace of a manifest without labels or a
/// namespace) gets it back.
async fn shard_label_is_fenced(
    raw: &Api<kube::core::DynamicObject>,
    created: kube::core::DynamicObject,
) {
    use kube::ResourceExt;
    let label = cnat::shard::LABEL;
    let name = created.metadata.name.clone().unwrap();
    let value = created.labels()[label].clone();
    let other = ((value.parse::<usize>().unwrap() + 1) % cnat::shard::VALUES).to_string();
    let params = kube::api::PatchParams::default();
    let changed = raw
        .patch(
            &name,
            &params,
            &kube::api::Patch::Merge(json!({"metadata": {"labels": {label: other}}})),
        )
        .await
        .expect_err("a changed shard label");
    let kube::Error::Api(changed) = changed else {
        panic!("{changed}")
    };
    assert!(
        changed.message.contains(&format!(
            "metadata.labels[{label}]: cannot change from {value:?} to {other:?}"
        )),
        "{}",
        changed.message
    );
    let removed = raw
        .patch(
            &name,
            &params,
            &kube::api::Patch::Merge(json!({"metadata": {"labels": {label: null, "team": "a"}}})),
        )
        .await
        .expect("a merge patch that removes the shard label");
    assert_eq!(removed.labels().get(label), Some(&value));
    assert_eq!(removed.labels().get("team").map(String::as_str), Some("a"));
    let mut replaced = removed.clone();
    replaced.metadata.labels = None;
    replaced.metadata.namespace = None;
    let replaced = raw
        .replace(&name, &PostParams::default(), &replaced)
        .await
        .expect("a replace without labels");
    assert_eq!(
        replaced.metadata.labels,
        Some([(label.to_owned(), value)].into())
    );
}
