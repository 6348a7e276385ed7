//! No At can stop the operator, on a real API server with the webhooks not registered (as for
//! Ats admitted while the webhook was down or before it existed): extreme but schema-valid
//! values, an At stored before the CRD had its bounds, odd time zones and a 120 KiB command (under the 131,071-byte bound). The
//! `cnat run` binary keeps the Lease, logs no panic, gives each extreme At a phase or a reason,
//! and runs a normal At due a few seconds later on time.

use crate::lifecycle::at;
use crate::support::envtest::{install_crd, lease_holder, wait_at};
use cnat::api::{At, Phase};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::Api;
use serde_json::{json, Value};
use std::time::Duration;

/// Waits for an event `reason` about `name`; returns its note.
async fn wait_event(client: &kube::Client, ns: &str, name: &str, reason: &str) -> String {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let found = events
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
            });
        if let Some(event) = found {
            return event.note.unwrap_or_default();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {reason} event about {name}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The CRD as it was before it bounded the numbers (no `maximum`), and without `format: int32`,
/// which kube-apiserver checks from 1.36 on (1.24 did not): what let the poison At in.
pub(crate) fn unbounded_crd() -> String {
    let yaml = cnat::api::crd_yaml();
    let body = yaml.split_once("---\n").unwrap().1;
    let mut crd: Value = serde_saphyr::from_str(body).unwrap();
    fn strip(value: &mut Value) {
        match value {
            Value::Object(map) => {
                map.remove("maximum");
                map.remove("minimum");
                if map.get("type").is_some_and(|t| t == "integer") {
                    map.remove("format");
                }
                map.values_mut().for_each(strip);
            }
            Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    strip(&mut crd);
    serde_json::to_string(&crd).unwrap()
}

fn spec(schedule: &str, extra: Value) -> Value {
    let mut spec = json!({"schedule": schedule, "command": "true"});
    json_patch::merge(&mut spec, &extra);
    spec
}

#[tokio::test]
async fn no_at_stops_a_replica_and_each_extreme_at_shows_a_phase_or_a_reason() {
    // It changes cluster-wide objects (the CRD, the chart's ClusterRole): a control plane of its own.
    let Some(plane) = crate::support::envtest::own_control_plane() else {
        return;
    };
    let admin = plane.admin().await;
    let ns = plane.namespace("bad-input", &[]).await;
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let raw: Api<kube::core::DynamicObject> = Api::namespaced_with(
        admin.clone(),
        &ns,
        &kube::discovery::ApiResource::erase::<At>(&()),
    );
    let create = |name: &str, spec: Value| {
        let raw = raw.clone();
        let object: kube::core::DynamicObject = serde_json::from_value(json!({
            "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
            "metadata": {"name": name}, "spec": spec,
        }))
        .unwrap();
        async move { raw.create(&PostParams::default(), &object).await }
    };

    // The poison At of the report, stored under the CRD without bounds; then today's CRD.
    install_crd(&admin, &unbounded_crd()).await;
    let poison = spec(
        "2020-01-01T00:00:00Z",
        json!({"startingDeadlineSeconds": 10_000_000_000_000_i64}),
    );
    create("poison", poison.clone())
        .await
        .expect("stored before the bounds");
    // Without the bounds (and, from 1.36 on, without `format: int32`), a status writer could
    // store an exit code no i32 holds. Such an At must not stop the list of every At.
    create(
        "exit-code-beyond-int32",
        spec("2020-01-01T00:00:00Z", json!({})),
    )
    .await
    .unwrap();
    let beyond = json!({"status": {"phase": "Done", "exitCode": 3_000_000_000_i64}});
    raw.patch_status(
        "exit-code-beyond-int32",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&beyond),
    )
    .await
    .expect("stored: the CRD of before bounds no integer");
    install_crd(&admin, &cnat::api::crd_yaml()).await;
    // The server takes a new schema asynchronously: wait until it refuses.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let refused = loop {
        match create("poison-again", poison.clone()).await {
            Err(refused) => break refused,
            Ok(_) => {
                raw.delete("poison-again", &Default::default())
                    .await
                    .unwrap();
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the bounds never applied"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(
        refused.to_string().contains("spec.startingDeadlineSeconds"),
        "{refused}"
    );

    let max = i64::from(i32::MAX);
    let maxed = json!({"startingDeadlineSeconds": max, "activeDeadlineSeconds": max,
                       "ttlSecondsAfterFinished": max});
    let extremes: Vec<(&str, Value)> = vec![
        (
            "max-values-past",
            spec("2020-01-01T00:00:00Z", maxed.clone()),
        ),
        (
            "max-values-future",
            spec("9999-12-31T23:59:59Z", maxed.clone()),
        ),
        ("year-0", spec("0000-01-01T00:00:00Z", maxed.clone())),
        (
            "year-0-no-deadline",
            spec("0000-01-01T00:00:00Z", json!({})),
        ),
        (
            "year-9999",
            spec("9999-12-31T23:59:59.999999999Z", json!({})),
        ),
        (
            "widest-offset-east",
            spec("0000-01-01T23:59:00+23:59", json!({})),
        ),
        (
            "widest-offset-west",
            spec("9999-12-31T23:59:59-23:59", json!({})),
        ),
        (
            "zone-kiritimati",
            spec(
                "9999-12-31T12:00:00",
                json!({"timeZone": "Pacific/Kiritimati"}),
            ),
        ),
        (
            "zone-adak-past-9999",
            spec("9999-12-31T23:00:00", json!({"timeZone": "America/Adak"})),
        ),
        (
            "zone-link",
            spec(
                "2020-01-01T00:00:00",
                json!({"timeZone": "America/Argentina/ComodRivadavia"}),
            ),
        ),
        (
            "zone-etc",
            spec("2020-01-01T00:00:00", json!({"timeZone": "Etc/GMT+12"})),
        ),
        (
            "zone-path",
            spec(
                "2020-01-01T00:00:00",
                json!({"timeZone": "../../../../etc/passwd"}),
            ),
        ),
        (
            "zone-empty",
            spec("2020-01-01T00:00:00", json!({"timeZone": ""})),
        ),
        (
            "zone-nul",
            spec(
                "2020-01-01T00:00:00",
                json!({"timeZone": "Europe/\u{0}Berlin"}),
            ),
        ),
        (
            "huge-command",
            json!({"schedule": "2020-01-01T00:00:00Z", "command": format!("echo {}", "x".repeat(120 * 1024))}),
        ),
    ];
    for (name, spec) in &extremes {
        create(name, spec.clone())
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }

    let mut replica = plane.replica("cnat-0", &ns, &[&format!("--namespace={ns}")]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while lease_holder(&admin, &ns, "cnat").await.as_deref() != Some("cnat-0") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never leader: {}",
            replica.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A normal At due a few seconds later runs on time.
    let due = chrono::Utc::now() + chrono::Duration::seconds(4);
    ats.create(&PostParams::default(), &at("normal", due, "true"))
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let pod = loop {
        if let Some(pod) = pods.get_opt("normal-pod").await.unwrap() {
            break pod;
        }
        assert!(
            chrono::Utc::now() < due + chrono::Duration::seconds(10),
            "the normal At did not run: {}",
            replica.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let created = cnat::schedule::to_chrono(pod.metadata.creation_timestamp.as_ref().unwrap());
    // Creation timestamps have whole seconds.
    assert!(
        created <= due + chrono::Duration::seconds(2)
            && created >= due - chrono::Duration::seconds(1),
        "the normal At ran at {created}, due {due}"
    );

    // Every extreme At shows a phase, and those that cannot run say why.
    let reason = |name: &str| {
        let ats = ats.clone();
        let name = name.to_owned();
        async move {
            wait_at(&ats, &name, Duration::from_secs(30), |at| {
                at.status.as_ref().is_some_and(|s| s.reason.is_some())
            })
            .await
            .status
            .unwrap()
        }
    };
    // Its event says why, once.
    let told = wait_event(&admin, &ns, "poison", "InvalidSpec").await;
    assert!(
        told.starts_with("spec.startingDeadlineSeconds: 10000000000000 is out of range"),
        "{told}"
    );
    if plane.minor() < 30 {
        // Without CRD validation ratcheting (on by default since 1.30), the API server validates
        // the whole At on a status write: the poison At can take no status, and its event
        // quotes the server's words.
        assert!(
            told.contains("should be less than or equal to 2147483647"),
            "{told}"
        );
        let stored = ats.get("poison").await.unwrap().status.unwrap();
        assert_eq!((stored.phase, stored.reason), (Phase::Pending, None));
    } else {
        // With it, the unchanged spec does not stop the status write: the status says why.
        let status = reason("poison").await;
        assert_eq!(status.phase, Phase::Pending);
        assert_eq!(status.reason.as_deref(), Some("InvalidSpec"));
    }
    let told = wait_event(&admin, &ns, "exit-code-beyond-int32", "Unreadable").await;
    assert!(told.contains("cnat cannot read this At"), "{told}");
    for name in ["widest-offset-west", "zone-adak-past-9999"] {
        let status = reason(name).await;
        assert_eq!(status.reason.as_deref(), Some("InvalidSchedule"), "{name}");
        assert!(
            status.message.unwrap().contains("years 0000 to 9999"),
            "{name}"
        );
    }
    for name in ["zone-path", "zone-empty", "zone-nul"] {
        assert_eq!(
            reason(name).await.reason.as_deref(),
            Some("InvalidTimeZone"),
            "{name}"
        );
    }
    for name in ["max-values-future", "year-9999", "zone-kiritimati"] {
        let status = reason(name).await;
        assert_eq!(
            (status.phase, status.reason.as_deref()),
            (Phase::Pending, Some("Scheduled")),
            "{name}"
        );
    }
    // Past and runnable: each got its pod (RUNNING), or missed its deadline (DONE).
    for name in [
        "max-values-past",
        "year-0-no-deadline",
        "widest-offset-east",
        "zone-link",
        "zone-etc",
        "huge-command",
    ] {
        let status = reason(name).await;
        assert_eq!(
            (status.phase, status.reason.as_deref()),
            (Phase::Running, Some("PodCreated")),
            "{name}"
        );
    }
    let year_0 = reason("year-0").await;
    assert_eq!(
        (year_0.phase, year_0.reason.as_deref()),
        (Phase::Done, Some("MissedDeadline"))
    );

    // Still the leader, never lost it, and no panic anywhere in its log.
    assert_eq!(
        lease_holder(&admin, &ns, "cnat").await.as_deref(),
        Some("cnat-0")
    );
    let log = replica.log_text();
    assert!(!log.contains("panic"), "{log}");
    assert!(
        !log.contains("LeaderLost") && !log.contains("lost leadership"),
        "{log}"
    );
    assert!(
        replica.child.try_wait().unwrap().is_none(),
        "the replica exited: {log}"
    );
    replica.kill();
}
