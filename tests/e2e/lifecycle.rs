//! The At lifecycle on a real API server: the book example, a failing command, a bad schedule,
//! a quota that refuses and later allows, a namespace enforcing PodSecurity `restricted`.

use crate::support;
use crate::support::envtest::{wait_at, Target};
use cnat::api::{At, AtSpec, Outcome, Phase};
use cnat::observability::metrics::Metrics;
use k8s_openapi::api::core::v1::{Pod, ResourceQuota};
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Long enough for a pod on a real cluster (image pull) and for a loaded 2-core machine.
const DONE_WITHIN: Duration = Duration::from_secs(120);

pub fn at(name: &str, schedule: chrono::DateTime<chrono::Utc>, command: &str) -> At {
    At::new(
        name,
        AtSpec {
            schedule: schedule.to_rfc3339(),
            command: command.into(),
            ..AtSpec::default()
        },
    )
}

/// The reconcile loop, watching `ns` only, until the handle is dropped.
pub fn start_operator(client: &Client, ns: &str) -> tokio_util::task::AbortOnDropHandle<()> {
    let settings = cnat::operator::controller::Settings {
        namespace: Some(ns.to_owned()),
        selector: None,
        concurrency: 32,
        policy: Default::default(),
        // As `cnat run` has it: a Secret, here in the test's namespace, made on first use.
        signing: cnat::operator::signing::Source::secret(ns, "cnat-pod-signing"),
    };
    let events = support::events(client, "cnat-e2e");
    tokio_util::task::AbortOnDropHandle::new(tokio::spawn(cnat::operator::controller::run(
        client.clone(),
        settings,
        events,
        Arc::new(Metrics::new(Default::default())),
        CancellationToken::new(),
    )))
}

fn phase_is(phase: Phase) -> impl Fn(&At) -> bool {
    move |at| at.status.as_ref().is_some_and(|s| s.phase == phase)
}

/// The reasons of the events about At `name`, oldest first.
pub async fn event_reasons(client: &Client, ns: &str, name: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let mut found: Vec<Event> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect();
    found.sort_by_key(|e| e.metadata.creation_timestamp.clone());
    found.into_iter().filter_map(|e| e.reason).collect()
}

/// Waits until the events about `name` include every one of `reasons`.
async fn wait_events(client: &Client, ns: &str, name: &str, reasons: &[&str]) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let told = event_reasons(client, ns, name).await;
        if reasons.iter().all(|r| told.iter().any(|t| t == r)) {
            return told;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name}: events {told:?}, expected {reasons:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs the pod of At `name` to its end: on a real cluster by itself, else as a kubelet would.
async fn run_pod(target: &Target, ns: &str, name: &str, exit_code: i32, message: &str) {
    let ats: Api<At> = Api::namespaced(target.client.clone(), ns);
    // With a kubelet, a short command may be DONE before anyone looks.
    wait_at(&ats, name, DONE_WITHIN, |at| {
        at.status.as_ref().is_some_and(|s| {
            s.phase == Phase::Running || (target.kubelet && s.phase == Phase::Done)
        })
    })
    .await;
    target
        .finish_pod(ns, &format!("{name}-pod"), exit_code, message)
        .await;
}

#[tokio::test]
async fn the_book_example_runs_once_and_failures_and_bad_schedules_show_on_the_at() {
    let target = crate::e2e_target!();
    target.install_crd().await;
    let ns = target
        .namespace(
            "lifecycle",
            &[("pod-security.kubernetes.io/enforce", "restricted")],
        )
        .await;
    let _operator = start_operator(&target.client, &ns);
    let ats: Api<At> = Api::namespaced(target.client.clone(), &ns);
    let params = PostParams::default();
    let due = chrono::Utc::now() + chrono::Duration::seconds(3);

    // Created without status, it reads PENDING at once (the CRD's default).
    let created = ats
        .create(&params, &at("example-at", due, "echo YAY"))
        .await
        .unwrap();
    assert_eq!(created.status.map(|s| s.phase), Some(Phase::Pending));
    ats.create(
        &params,
        &at("fails", due, "echo 'about to fail' >&2; exit 3"),
    )
    .await
    .unwrap();
    let mut bad = at("bad-schedule", due, "true");
    bad.spec.schedule = "tomorrow noon".into();
    ats.create(&params, &bad).await.unwrap();

    run_pod(&target, &ns, "example-at", 0, "").await;
    let done = wait_at(&ats, "example-at", DONE_WITHIN, phase_is(Phase::Done)).await;
    let status = done.status.unwrap();
    assert_eq!(
        (status.outcome, status.exit_code),
        (Some(Outcome::Succeeded), Some(0))
    );
    // Not before its time, and admitted in a namespace that enforces `restricted`.
    let pods: Api<Pod> = Api::namespaced(target.client.clone(), &ns);
    let pod = pods.get("example-at-pod").await.unwrap();
    let created = cnat::schedule::to_chrono(pod.metadata.creation_timestamp.as_ref().unwrap());
    assert!(
        created >= due - chrono::Duration::seconds(1),
        "ran early: {created} < {due}"
    );
    let told = wait_events(
        &target.client,
        &ns,
        "example-at",
        &["Scheduled", "PodCreated", "Succeeded"],
    )
    .await;
    assert_eq!(
        told.iter().filter(|r| *r == "PodCreated").count(),
        1,
        "{told:?}"
    );

    run_pod(&target, &ns, "fails", 3, "about to fail").await;
    let failed = wait_at(&ats, "fails", DONE_WITHIN, phase_is(Phase::Done)).await;
    let failed = failed.status.unwrap();
    assert_eq!(
        (failed.outcome, failed.exit_code),
        (Some(Outcome::Failed), Some(3))
    );
    assert_eq!(failed.reason.as_deref(), Some("CommandFailed"));
    assert!(failed.message.unwrap().contains("about to fail"));
    wait_events(&target.client, &ns, "fails", &["CommandFailed"]).await;

    let bad = wait_at(&ats, "bad-schedule", Duration::from_secs(30), |at| {
        at.status.as_ref().is_some_and(|s| s.reason.is_some())
    })
    .await;
    let bad = bad.status.unwrap();
    assert_eq!(
        (bad.phase, bad.reason.as_deref()),
        (Phase::Pending, Some("InvalidSchedule"))
    );
    assert!(bad
        .message
        .unwrap()
        .contains("\"tomorrow noon\" is not an RFC 3339 time"));
    wait_events(&target.client, &ns, "bad-schedule", &["InvalidSchedule"]).await;
    // Exactly one pod per At that ran.
    let all = pods.list(&ListParams::default()).await.unwrap().items;
    let mut names: Vec<String> = all.into_iter().filter_map(|p| p.metadata.name).collect();
    names.sort();
    assert_eq!(names, ["example-at-pod", "fails-pod"]);
}

/// A namespace whose ResourceQuota requires limits and has room for one small pod: an At
/// without resources shows the server's own refusal as `PodForbidden`; a second sized At waits
/// (quota exceeded) until the first pod ends and frees the quota, then runs.
#[tokio::test]
async fn a_quota_refusal_shows_on_the_at_and_it_runs_once_the_quota_allows() {
    let target = crate::e2e_target!();
    target.install_crd().await;
    let ns = target.namespace("quota", &[]).await;
    let quota: ResourceQuota = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "compute"},
        "spec": {"hard": {"limits.cpu": "100m", "limits.memory": "64Mi", "pods": "1"}},
    }))
    .unwrap();
    let quotas: Api<ResourceQuota> = Api::namespaced(target.client.clone(), &ns);
    quotas.create(&PostParams::default(), &quota).await.unwrap();
    // The quota admission refuses every pod until the controller manager computed its usage.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while quotas
        .get("compute")
        .await
        .unwrap()
        .status
        .and_then(|s| s.used)
        .is_none()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "quota usage never computed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _operator = start_operator(&target.client, &ns);
    let ats: Api<At> = Api::namespaced(target.client.clone(), &ns);
    let now = chrono::Utc::now();
    // On a real cluster the first runs for a while, so the second finds the quota used up.
    let first_command = if target.kubelet { "sleep 20" } else { "true" };
    let sized = |name: &str, command: &str| {
        let mut sized = at(name, now, command);
        sized.spec.template.resources = Some(
            serde_json::from_value(
                serde_json::json!({"limits": {"cpu": "100m", "memory": "64Mi"}}),
            )
            .unwrap(),
        );
        sized
    };
    ats.create(&PostParams::default(), &at("unsized", now, "true"))
        .await
        .unwrap();
    let refused = wait_at(&ats, "unsized", Duration::from_secs(60), |at| {
        at.status
            .as_ref()
            .is_some_and(|s| s.reason.as_deref() == Some("PodForbidden"))
    })
    .await
    .status
    .unwrap();
    assert_eq!(refused.phase, Phase::Pending);
    let message = refused.message.unwrap();
    // The server's own words, and cnat's advice.
    assert!(
        message.contains("failed quota: compute: must specify limits.cpu"),
        "{message}"
    );
    assert!(message.contains("set spec.template.resources"), "{message}");

    // One pod at a time: the second waits (quota exceeded) while the first runs...
    ats.create(&PostParams::default(), &sized("first", first_command))
        .await
        .unwrap();
    wait_at(&ats, "first", DONE_WITHIN, phase_is(Phase::Running)).await;
    ats.create(&PostParams::default(), &sized("second", "true"))
        .await
        .unwrap();
    let waiting = wait_at(&ats, "second", Duration::from_secs(60), |at| {
        at.status
            .as_ref()
            .is_some_and(|s| s.reason.as_deref() == Some("PodForbidden"))
    })
    .await;
    let message = waiting.status.unwrap().message.unwrap();
    assert!(message.contains("exceeded quota: compute"), "{message}");
    // ... and runs once the first pod ended (a finished pod no longer counts).
    run_pod(&target, &ns, "first", 0, "").await;
    wait_at(&ats, "first", DONE_WITHIN, phase_is(Phase::Done)).await;
    run_pod(&target, &ns, "second", 0, "").await;
    let second = wait_at(&ats, "second", DONE_WITHIN, phase_is(Phase::Done)).await;
    assert_eq!(second.status.unwrap().outcome, Some(Outcome::Succeeded));
}

/// A pod made by someone else under an At's pod name, even as cnat would make it and with a
/// controller reference to the At, is never taken for the At's pod: the At says so
/// (`PodNameConflict`) and runs, in a pod cnat signed, once that pod is gone.
#[tokio::test]
async fn a_pod_someone_else_made_in_an_at_s_name_is_never_run_as_its_own() {
    use k8s_openapi::api::core::v1::Secret;
    let target = crate::e2e_target!();
    target.install_crd().await;
    let ns = target.namespace("forged", &[]).await;
    let _operator = start_operator(&target.client, &ns);
    let ats: Api<At> = Api::namespaced(target.client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(target.client.clone(), &ns);
    // A pod the API server created, as its At, before the signing key's Secret (or in its
    // second) is taken as made by a release that did not sign (security.md): the At is made
    // only once the leader made the key, and in a later second.
    let secrets: Api<Secret> = Api::namespaced(target.client.clone(), &ns);
    let signing_since = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Some(secret) = secrets.get_opt("cnat-pod-signing").await.unwrap() {
                break secret.metadata.creation_timestamp.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the leader makes its signing key within a minute");
    while jiff::Timestamp::now().as_second() <= signing_since.0.as_second() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let due = chrono::Utc::now() + chrono::Duration::seconds(4);
    let created = ats
        .create(&PostParams::default(), &at("victim", due, "echo real"))
        .await
        .unwrap();
    // The tenant's pod: cnat's own build (labels, controller reference), a made-up signature,
    // no finalizer, a command of its choosing.
    let mut forged = cnat::operator::pod::build(&created, &Default::default());
    forged.metadata.finalizers = None;
    forged.metadata.annotations = Some(
        [(
            cnat::operator::pod::SIGNATURE.to_owned(),
            "A".repeat(cnat::operator::signing::SIGNATURE_LEN),
        )]
        .into(),
    );
    if let Some(container) = forged.spec.as_mut().and_then(|s| s.containers.first_mut()) {
        container.command = Some(vec!["/bin/sh".into(), "-c".into(), "echo forged".into()]);
    }
    pods.create(&PostParams::default(), &forged).await.unwrap();
    let conflict = |at: &At| {
        at.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.reason == "PodNameConflict" && c.status == "False")
        })
    };
    let blocked = wait_at(&ats, "victim", DONE_WITHIN, conflict).await;
    let status = blocked.status.unwrap();
    assert_eq!(status.phase, Phase::Pending, "{status:?}");
    let condition = status
        .conditions
        .iter()
        .find(|c| c.reason == "PodNameConflict")
        .unwrap();
    assert!(
        condition.message.contains("lacks cnat's signature"),
        "{}",
        condition.message
    );
    wait_events(&target.client, &ns, "victim", &["PodNameConflict"]).await;
    // The key is in its Secret, made by the operator on first use.
    let key = secrets.get("cnat-pod-signing").await.unwrap();
    assert_eq!(
        key.data.unwrap()[cnat::operator::signing::SECRET_KEY]
            .0
            .len(),
        32
    );

    let now = kube::api::DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    pods.delete("victim-pod", &now).await.unwrap();
    run_pod(&target, &ns, "victim", 0, "").await;
    let done = wait_at(&ats, "victim", DONE_WITHIN, phase_is(Phase::Done)).await;
    assert_eq!(done.status.unwrap().outcome, Some(Outcome::Succeeded));
    let own = pods.get("victim-pod").await.unwrap();
    let command = own.spec.unwrap().containers[0].command.clone().unwrap();
    assert!(command.iter().any(|a| a == "echo real"), "{command:?}");
    let signature = &own.metadata.annotations.unwrap()[cnat::operator::pod::SIGNATURE];
    assert_eq!(signature.len(), cnat::operator::signing::SIGNATURE_LEN);
}
