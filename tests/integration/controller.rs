//! The real controller (watches, owned-pod mapping, a wake-up at the due time) against a stateful
//! fake API server: Ats go PENDING -> RUNNING -> DONE, and no command ever runs twice.

use crate::support;

use chrono::{Duration as Span, Utc};
use cnat::api::{At, AtStatus, Outcome, Phase};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::apiserver::{ApiServer, Resource};
use tokio::task::JoinHandle;

const WAIT: Duration = Duration::from_secs(10);

fn start(server: &ApiServer) -> JoinHandle<()> {
    support::run_controller(server.client())
}

fn at_json(name: &str, schedule: &str, command: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": "default"},
           "spec": {"schedule": schedule, "command": command, "image": "busybox"}})
}

fn status(server: &ApiServer, name: &str) -> Option<AtStatus> {
    let at: At = serde_json::from_value(server.get(Resource::Ats, "default", name)?).unwrap();
    at.status
}

/// The phase a leader wrote: `None` while the At shows only the schema default (`Pending`, no
/// reason), as on a real API server before any status write.
fn phase(server: &ApiServer, name: &str) -> Option<Phase> {
    status(server, name)
        .filter(|s| *s != AtStatus::default())
        .map(|s| s.phase)
}

async fn wait_phase(server: &ApiServer, name: &str, want: Phase) {
    let reached = server
        .wait_for(WAIT, |s| phase(s, name) == Some(want))
        .await;
    assert!(
        reached,
        "{name} never reached {want}: {:?}",
        status(server, name)
    );
}

#[tokio::test]
async fn the_book_example_runs_once_at_its_time_and_ends_done() {
    let server = ApiServer::new();
    let operator = start(&server);
    let due = Utc::now() + Span::milliseconds(1500);
    let due_instant = Instant::now() + Duration::from_millis(1500);
    server.create(
        Resource::Ats,
        at_json("example-at", &due.to_rfc3339(), "echo YAY"),
    );

    wait_phase(&server, "example-at", Phase::Pending).await;
    assert_eq!(
        server.get(Resource::Pods, "default", "example-at-pod"),
        None
    );

    wait_phase(&server, "example-at", Phase::Running).await;
    let created = server
        .pod_created_at("default", "example-at-pod")
        .expect("pod");
    // The pod is created at the due time, not before (10 ms slack for the two clocks).
    assert!(
        created + Duration::from_millis(10) >= due_instant,
        "ran early"
    );
    let pod = server
        .get(Resource::Pods, "default", "example-at-pod")
        .unwrap();
    assert_eq!(
        pod["spec"]["containers"][0]["command"],
        json!(["/bin/sh", "-c", "echo YAY"])
    );
    assert_eq!(pod["metadata"]["ownerReferences"][0]["name"], "example-at");

    // At the due time the pod is created first, with no read or status write before it. (The
    // first leader of an install makes the pod signing key's Secret when it starts.)
    server.told("example-at", 2).await;
    let writes: Vec<String> = server
        .requests()
        .into_iter()
        .filter(|r| !r.starts_with("GET"))
        .collect();
    assert_eq!(
        writes,
        [
            "POST secrets",
            "PATCH ats/status",
            "POST events",
            "POST pods",
            "PATCH ats/status",
            "POST events"
        ]
    );
    server.finish_pod("default", "example-at-pod", 0);
    wait_phase(&server, "example-at", Phase::Done).await;
    let done = status(&server, "example-at").unwrap();
    assert_eq!(
        (done.outcome, done.exit_code),
        (Some(Outcome::Succeeded), Some(0))
    );
    assert_eq!(done.pod_name.as_deref(), Some("example-at-pod"));
    assert!(done.start_time.is_some() && done.completion_time.is_some());
    assert_eq!(done.observed_generation, Some(1));

    assert_eq!(server.count("POST pods"), 1);
    // Each transition is told once: no duplicate writes or events.
    assert_eq!(server.count("PATCH ats/status"), 3);
    let reasons = server.told("example-at", 3).await;
    assert_eq!(reasons, ["Scheduled", "PodCreated", "Succeeded"]);
    operator.abort();
}

#[tokio::test]
async fn a_past_schedule_fires_at_once_and_a_failing_command_is_recorded() {
    let server = ApiServer::new();
    let operator = start(&server);
    server.create(
        Resource::Ats,
        at_json("fails", "2019-04-12T10:12:00Z", "exit 3"),
    );
    wait_phase(&server, "fails", Phase::Running).await;
    server.finish_pod("default", "fails-pod", 3);
    wait_phase(&server, "fails", Phase::Done).await;
    let done = status(&server, "fails").unwrap();
    assert_eq!(
        (done.outcome, done.exit_code),
        (Some(Outcome::Failed), Some(3))
    );
    assert_eq!(
        server.told("fails", 2).await,
        ["PodCreated", "CommandFailed"]
    );
    operator.abort();
}

#[tokio::test]
async fn a_deleted_pod_ends_the_at_failed_and_is_not_recreated() {
    let server = ApiServer::new();
    let operator = start(&server);
    server.create(
        Resource::Ats,
        at_json("lost", "2019-04-12T10:12:00Z", "sleep 3600"),
    );
    wait_phase(&server, "lost", Phase::Running).await;
    server.delete(Resource::Pods, "default", "lost-pod");
    wait_phase(&server, "lost", Phase::Done).await;
    let done = status(&server, "lost").unwrap();
    assert_eq!(done.outcome, Some(Outcome::Failed));
    assert!(done
        .message
        .unwrap()
        .contains("was deleted before the command finished"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(server.count("POST pods"), 1);
    assert_eq!(server.get(Resource::Pods, "default", "lost-pod"), None);
    operator.abort();
}

/// A pod created, then deleted before its RUNNING write landed, with a leader change in
/// between: the next leader must not create it again (the command would run twice).
#[tokio::test]
async fn a_pod_deleted_before_its_running_write_landed_is_not_created_again() {
    let server = ApiServer::new();
    server.hold_status_writes(true);
    let first = start(&server);
    server.create(
        Resource::Ats,
        at_json("twice", "2019-04-12T10:12:00Z", "sleep 3600"),
    );
    assert!(support::until(Duration::from_secs(5), || server.count("POST pods") == 1).await);
    // The leader goes while its RUNNING write waits; the pod is deleted meanwhile.
    first.abort();
    let _ = first.await;
    server.delete(Resource::Pods, "default", "twice-pod");
    assert_eq!(phase(&server, "twice"), None, "RUNNING never landed");
    server.hold_status_writes(false);

    let second = start(&server);
    wait_phase(&server, "twice", Phase::Done).await;
    let done = status(&server, "twice").unwrap();
    assert_eq!(done.outcome, Some(Outcome::Failed));
    assert_eq!(done.reason.as_deref(), Some("PodLost"), "{done:?}");
    // Released by the new leader once the status named it, then gone.
    assert!(
        support::until(Duration::from_secs(5), || server
            .get(Resource::Pods, "default", "twice-pod")
            .is_none())
        .await
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(server.count("POST pods"), 1, "the command ran twice");
    second.abort();
}

/// The pod ended and was deleted while no leader could record it: the next leader records the
/// outcome, then lets the pod go (nothing else would bring it back: a terminating pod that
/// ended changes no more).
#[tokio::test]
async fn a_deleted_pod_that_ended_is_recorded_then_released() {
    let server = ApiServer::new();
    server.hold_status_writes(true);
    let first = start(&server);
    server.create(
        Resource::Ats,
        at_json("short", "2019-04-12T10:12:00Z", "true"),
    );
    assert!(support::until(Duration::from_secs(5), || server.count("POST pods") == 1).await);
    first.abort();
    let _ = first.await;
    server.finish_pod("default", "short-pod", 0);
    server.delete(Resource::Pods, "default", "short-pod");
    server.hold_status_writes(false);

    let second = start(&server);
    wait_phase(&server, "short", Phase::Done).await;
    assert_eq!(
        status(&server, "short").unwrap().outcome,
        Some(Outcome::Succeeded)
    );
    assert!(
        support::until(Duration::from_secs(5), || server
            .get(Resource::Pods, "default", "short-pod")
            .is_none())
        .await,
        "the pod stayed terminating"
    );
    assert_eq!(server.count("POST pods"), 1);
    second.abort();
}

/// The garbage collector deletes the pod of a deleted At; cnat's finalizer must not keep it.
#[tokio::test]
async fn the_pod_of_a_deleted_at_is_released() {
    let server = ApiServer::new();
    let operator = start(&server);
    server.create(
        Resource::Ats,
        at_json("gone", "2019-04-12T10:12:00Z", "sleep 3600"),
    );
    wait_phase(&server, "gone", Phase::Running).await;
    server.delete(Resource::Ats, "default", "gone");
    // As the garbage collector does once the owner is gone.
    server.delete(Resource::Pods, "default", "gone-pod");
    assert!(
        support::until(Duration::from_secs(5), || server
            .get(Resource::Pods, "default", "gone-pod")
            .is_none())
        .await,
        "the pod stayed terminating"
    );
    assert_eq!(server.count("POST pods"), 1);
    operator.abort();
}

/// An At stored before the CRD bounded its numbers: the API server refuses any status for it
/// (the whole object is validated), so the event says why, once, and nothing loops.
#[tokio::test]
async fn an_at_beyond_the_bounds_is_told_in_an_event_without_a_retry_loop() {
    let server = ApiServer::new();
    let operator = start(&server);
    let mut poison = at_json("poison", "2020-01-01T00:00:00Z", "true");
    poison["spec"]["startingDeadlineSeconds"] = 10_000_000_000_000_i64.into();
    server.create(Resource::Ats, poison);
    assert_eq!(server.told("poison", 1).await, ["InvalidSpec"]);
    let events = server.list(Resource::Events);
    let note = events[0]["note"].as_str().unwrap();
    assert!(
        note.starts_with("spec.startingDeadlineSeconds: 10000000000000 is out of range"),
        "{note}"
    );
    assert!(note.contains("the API server refuses any status"), "{note}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(server.count("PATCH ats/status"), 1, "no retry loop");
    assert_eq!(server.count("POST pods"), 0);
    assert_eq!(status(&server, "poison"), Some(AtStatus::default()));
    operator.abort();
}

#[tokio::test]
async fn a_restarted_operator_does_not_run_a_command_again() {
    let server = ApiServer::new();
    let first = start(&server);
    server.create(
        Resource::Ats,
        at_json("once", "2019-04-12T10:12:00Z", "sleep 10"),
    );
    wait_phase(&server, "once", Phase::Running).await;
    first.abort();
    let _ = first.await;

    let second = start(&server);
    // Give the new operator time to list, watch and reconcile everything it found.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.count("POST pods"), 1);
    server.finish_pod("default", "once-pod", 0);
    wait_phase(&server, "once", Phase::Done).await;
    assert_eq!(server.count("POST pods"), 1);
    second.abort();
}

/// A new leader lists the pods page by page; kube-runtime's reflector puts them into its pod
/// cache only when the list ends, after the reconciles the first pages' pods brought. The pods
/// of DONE Ats that still hold cnat's finalizer must be let go all the same: they change no more.
#[tokio::test]
async fn a_new_leader_lets_go_of_the_pods_of_done_ats_it_lists_page_by_page() {
    const ATS: usize = 30;
    let server = ApiServer::new();
    let first = start(&server);
    for i in 0..ATS {
        server.create(
            Resource::Ats,
            at_json(&format!("at-{i}"), "2019-04-12T10:12:00Z", "true"),
        );
    }
    for i in 0..ATS {
        wait_phase(&server, &format!("at-{i}"), Phase::Running).await;
    }
    first.abort();
    let _ = first.await;
    // While no leader runs: every pod ended, and its At was recorded DONE (as a leader that
    // stopped before letting the pods go would have left them).
    let done = json!({"phase": "Done", "outcome": "Succeeded", "exitCode": 0,
                      "reason": "Succeeded", "message": "the command exited 0"});
    for i in 0..ATS {
        server.finish_pod("default", &format!("at-{i}-pod"), 0);
        server.change_unseen(Resource::Ats, "default", &format!("at-{i}"), |at| {
            let pod_name = json!(format!("at-{i}-pod"));
            at["status"] = done.clone();
            at["status"]["podName"] = pod_name;
        });
    }
    // The pod list's pages (10 pods each) take long enough for the reconciles to run first.
    server.set_list_latency(Duration::from_millis(200));
    let second = start(&server);
    let holding = || {
        server
            .list(Resource::Pods)
            .iter()
            .filter(|pod| {
                pod["metadata"]["finalizers"]
                    .as_array()
                    .is_some_and(|f| !f.is_empty())
            })
            .count()
    };
    let released = support::until(Duration::from_secs(10), || holding() == 0).await;
    assert!(
        released,
        "{} of {ATS} pods still hold the finalizer",
        holding()
    );
    assert_eq!(server.count("POST pods"), ATS);
    // One finalizer removal a pod, none made twice.
    assert_eq!(server.count("PATCH pods"), ATS);
    second.abort();
}

#[tokio::test]
async fn a_pod_the_at_does_not_own_is_left_alone() {
    let server = ApiServer::new();
    server.create(
        Resource::Pods,
        json!({"metadata": {"name": "taken-pod", "namespace": "default", "labels": {"app": "other"}},
               "spec": {"containers": [{"name": "c", "image": "nginx"}]}}),
    );
    let operator = start(&server);
    server.create(
        Resource::Ats,
        at_json("taken", "2019-04-12T10:12:00Z", "true"),
    );
    let blocked = server
        .wait_for(WAIT, |s| {
            status(s, "taken")
                .is_some_and(|st| st.conditions.iter().any(|c| c.reason == "PodNameConflict"))
        })
        .await;
    assert!(blocked, "{:?}", status(&server, "taken"));
    assert_eq!(phase(&server, "taken"), Some(Phase::Pending));
    let pod = server.get(Resource::Pods, "default", "taken-pod").unwrap();
    assert!(
        pod["metadata"]["ownerReferences"].is_null(),
        "adopted a foreign pod"
    );
    assert_eq!(pod["spec"]["containers"][0]["image"], "nginx");
    assert_eq!(server.told("taken", 1).await, ["PodNameConflict"]);
    operator.abort();
}

#[tokio::test]
async fn an_unparseable_schedule_is_reported_once_without_a_hot_loop() {
    let server = ApiServer::new();
    let operator = start(&server);
    server.create(Resource::Ats, at_json("bad", "tomorrow noon", "true"));
    wait_phase(&server, "bad", Phase::Pending).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.count("PATCH ats/status"), 1);
    assert_eq!(server.count("POST pods"), 0);
    let message = status(&server, "bad").unwrap().message.unwrap();
    assert_eq!(
        message,
        r#"spec.schedule: "tomorrow noon" is not an RFC 3339 time (expected e.g. 2019-04-12T10:12:00Z)"#
    );
    assert_eq!(server.told("bad", 1).await, ["InvalidSchedule"]);
    operator.abort();
}

#[tokio::test]
async fn many_ats_due_together_each_get_exactly_one_pod() {
    let server = ApiServer::new();
    let operator = start(&server);
    let due = (Utc::now() + Span::milliseconds(800)).to_rfc3339();
    for i in 0..200 {
        server.create(Resource::Ats, at_json(&format!("at-{i}"), &due, "true"));
    }
    let all_running = server
        .wait_for(WAIT, |s| {
            (0..200).all(|i| phase(s, &format!("at-{i}")) == Some(Phase::Running))
        })
        .await;
    assert!(all_running);
    for i in 0..200 {
        server.finish_pod("default", &format!("at-{i}-pod"), 0);
    }
    let all_done = server
        .wait_for(WAIT, |s| {
            (0..200).all(|i| phase(s, &format!("at-{i}")) == Some(Phase::Done))
        })
        .await;
    assert!(all_done);
    assert_eq!(server.count("POST pods"), 200);
    assert_eq!(server.list(Resource::Pods).len(), 200);
    operator.abort();
}

/// A new leader's first look finds more Ats to write than kube-runtime's queue is handed at once
/// (`reconcile::backlog::LIMIT`): every one of them still gets its status, once (each leaves the
/// backlog as its reconcile starts, making room for the next).
#[tokio::test]
async fn a_first_look_past_the_backlog_limit_writes_every_status_once() {
    let server = ApiServer::new();
    let n = 2 * cnat::operator::reconcile::backlog::LIMIT + 100;
    let later = (Utc::now() + Span::hours(1)).to_rfc3339();
    for i in 0..n {
        server.create(Resource::Ats, at_json(&format!("at-{i}"), &later, "true"));
    }
    let operator = start(&server);
    let all_pending = server
        .wait_for(Duration::from_secs(20), |s| {
            (0..n).all(|i| phase(s, &format!("at-{i}")) == Some(Phase::Pending))
        })
        .await;
    let written = (0..n)
        .filter(|i| phase(&server, &format!("at-{i}")) == Some(Phase::Pending))
        .count();
    assert!(all_pending, "{written} of {n} statuses written");
    // Once: no second write follows.
    let again = server
        .wait_for(Duration::from_millis(500), |s| {
            s.count("PATCH ats/status") > n
        })
        .await;
    assert!(!again, "{} status writes", server.count("PATCH ats/status"));
    assert_eq!(server.list(Resource::Pods).len(), 0);
    operator.abort();
}

/// A status write never waits behind an event: with every event request hanging (all the
/// publishers busy), 40 Ats still go PENDING -> RUNNING -> DONE; their events follow once the
/// server answers again.
#[tokio::test(start_paused = true)]
async fn a_status_write_never_waits_behind_events() {
    let server = ApiServer::new();
    server.hold_events(true);
    let operator = start(&server);
    let names: Vec<String> = (0..40).map(|i| format!("at-{i}")).collect();
    for name in &names {
        server.create(Resource::Ats, at_json(name, "2019-04-12T10:12:00Z", "true"));
    }
    let all = |want: Phase| {
        let (server, names) = (server.clone(), names.clone());
        move || names.iter().all(|n| phase(&server, n) == Some(want))
    };
    assert!(support::until(WAIT, all(Phase::Running)).await);
    // Their `PodCreated` events are out, unanswered: the publishers hang.
    let hanging = || server.count("POST events") >= 1;
    assert!(support::until(WAIT, hanging).await, "no event was tried");
    for name in &names {
        server.finish_pod("default", &format!("{name}-pod"), 0);
    }
    assert!(support::until(WAIT, all(Phase::Done)).await);
    assert!(
        names.iter().all(|n| server.event_reasons(n).is_empty()),
        "an event was published while they were held"
    );
    server.hold_events(false);
    let told = || {
        names.iter().all(|n| {
            let reasons = server.event_reasons(n);
            ["PodCreated", "Succeeded"]
                .iter()
                .all(|want| reasons.iter().any(|r| r == want))
        })
    };
    assert!(
        support::until(WAIT, told).await,
        "the events never followed"
    );
    operator.abort();
}

/// Pods first: with writes costing the server time, 64 Ats due at once get every pod created
/// before any of their status writes goes out.
#[tokio::test(start_paused = true)]
async fn due_ats_get_their_pods_before_any_status_write() {
    let server = ApiServer::new();
    server.set_write_cost(Duration::from_millis(5));
    for i in 0..64 {
        server.create(
            Resource::Ats,
            at_json(&format!("at-{i}"), "2019-04-12T10:12:00Z", "true"),
        );
    }
    let operator = start(&server);
    let running = || (0..64).all(|i| phase(&server, &format!("at-{i}")) == Some(Phase::Running));
    assert!(support::until(WAIT, running).await);
    let requests = server.requests();
    let last_pod = requests.iter().rposition(|r| r == "POST pods").unwrap();
    let first_status = requests
        .iter()
        .position(|r| r == "PATCH ats/status")
        .unwrap();
    assert_eq!(server.count("POST pods"), 64);
    assert!(
        last_pod < first_status,
        "a status write (request {first_status}) went before the last pod (request {last_pod})"
    );
    operator.abort();
}

/// Plays the kubelet: every pod that appears ends with `exit_code`.
fn kubelet(server: &ApiServer, exit_code: i32) -> JoinHandle<()> {
    let server = server.clone();
    tokio::spawn(async move {
        loop {
            for pod in server.list(Resource::Pods) {
                if pod["status"]["phase"] == "Pending" {
                    let (ns, name) = (
                        pod["metadata"]["namespace"].as_str().unwrap(),
                        pod["metadata"]["name"].as_str().unwrap(),
                    );
                    server.finish_pod(ns, name, exit_code);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

#[tokio::test]
async fn the_smoke_test_passes_when_an_at_runs_and_cleans_up() {
    let server = ApiServer::new();
    let (operator, kubelet) = (start(&server), kubelet(&server, 0));
    let report = cnat::smoke_test::run(server.client(), "default", WAIT)
        .await
        .unwrap();
    assert!(report.contains("ran and succeeded"), "{report}");
    assert!(
        server.list(Resource::Ats).is_empty(),
        "the smoke test At was not deleted"
    );
    operator.abort();
    kubelet.abort();
}

#[tokio::test]
async fn the_smoke_test_fails_on_a_failed_run_or_no_operator() {
    let server = ApiServer::new();
    let (operator, kubelet) = (start(&server), kubelet(&server, 1));
    let error = cnat::smoke_test::run(server.client(), "default", WAIT)
        .await
        .unwrap_err();
    assert!(error.to_string().contains("ended Some(Failed)"), "{error}");
    operator.abort();
    kubelet.abort();

    let idle = ApiServer::new();
    let error = cnat::smoke_test::run(idle.client(), "default", Duration::from_millis(600))
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("was not Done within 600ms: is a cnat replica leading"),
        "{error}"
    );
}

#[tokio::test]
async fn the_smoke_test_waits_for_the_webhook_then_names_it() {
    // No replica serves the webhook yet: every create gets the captured 500.
    let server = ApiServer::new();
    server.refuse_creates(
        Resource::Ats,
        Some("status-500-webhook-unreachable-create.json"),
    );
    let (operator, kubelet) = (start(&server), kubelet(&server, 0));
    let lifted = server.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        lifted.refuse_creates(Resource::Ats, None);
    });
    let report = cnat::smoke_test::run(server.client(), "default", WAIT)
        .await
        .unwrap();
    assert!(report.contains("ran and succeeded"), "{report}");
    assert!(server.count("POST ats") >= 3, "retried");
    operator.abort();
    kubelet.abort();

    // It never comes: the message names the webhook and what to check.
    let down = ApiServer::new();
    down.refuse_creates(
        Resource::Ats,
        Some("status-500-webhook-unreachable-create.json"),
    );
    let error = cnat::smoke_test::run(down.client(), "default", Duration::from_millis(2500))
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("kept failing for"), "{error}");
    assert!(error.contains("failed calling webhook"), "{error}");
    assert!(
        error.contains("validate.ats.cnat.programming-kubernetes.info"),
        "{error}"
    );
}

mod production {
    //! What production throws at the operator: refused pods, deadlines, TTL, lost deletions.

    use super::*;
    use cnat::operator::policy::RunPolicy;

    fn past(seconds: i64) -> String {
        (Utc::now() - Span::seconds(seconds)).to_rfc3339()
    }

    #[tokio::test]
    async fn a_pod_refused_by_quota_shows_on_the_at_until_the_quota_allows_it() {
        let server = ApiServer::new();
        server.refuse_creates(
            Resource::Pods,
            Some("status-403-forbidden-quota-requires-limits.json"),
        );
        let operator = start(&server);
        server.create(Resource::Ats, at_json("quota", &past(1), "true"));
        let shown = server
            .wait_for(WAIT, |s| {
                status(s, "quota").is_some_and(|st| st.reason.as_deref() == Some("PodForbidden"))
            })
            .await;
        assert!(shown, "{:?}", status(&server, "quota"));
        let st = status(&server, "quota").unwrap();
        assert_eq!(st.phase, Phase::Pending);
        assert!(
            st.message.unwrap().contains("must specify limits.cpu"),
            "the server's words are shown"
        );
        // Retried with backoff (0.5 s, 1 s, ...): several attempts, one event.
        tokio::time::sleep(Duration::from_millis(2000)).await;
        assert!(
            server.count("POST pods") >= 3,
            "{}",
            server.count("POST pods")
        );
        assert_eq!(server.told("quota", 1).await, ["PodForbidden"]);

        // The quota is fixed: the next retry creates the pod.
        server.refuse_creates(Resource::Pods, None);
        wait_phase(&server, "quota", Phase::Running).await;
        let st = status(&server, "quota").unwrap();
        let created = st
            .conditions
            .iter()
            .find(|c| c.type_ == "PodCreated")
            .unwrap();
        assert_eq!(
            (created.status.as_str(), created.reason.as_str()),
            ("True", "PodCreated")
        );
        assert_eq!(
            server.told("quota", 2).await,
            ["PodForbidden", "PodCreated"]
        );
        operator.abort();
    }

    #[tokio::test]
    async fn an_at_that_cannot_start_before_its_deadline_is_missed_and_never_runs() {
        let server = ApiServer::new();
        server.refuse_creates(
            Resource::Pods,
            Some("status-403-forbidden-quota-exceeded.json"),
        );
        let operator = start(&server);
        let mut late = at_json("late", &past(0), "true");
        late["spec"]["startingDeadlineSeconds"] = 2.into();
        server.create(Resource::Ats, late);
        // Missed once the deadline passes: schedule + 2 s.
        wait_phase(&server, "late", Phase::Done).await;
        let st = status(&server, "late").unwrap();
        assert_eq!(st.outcome, Some(Outcome::Missed));
        assert_eq!(st.reason.as_deref(), Some("MissedDeadline"));
        assert_eq!(
            server.told("late", 2).await,
            ["PodForbidden", "MissedDeadline"]
        );
        // Even once pods are allowed, it never runs.
        server.refuse_creates(Resource::Pods, None);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(server.get(Resource::Pods, "default", "late-pod"), None);

        // An At already past its deadline when the operator sees it never runs either.
        let mut stale = at_json("stale", &past(3600), "true");
        stale["spec"]["startingDeadlineSeconds"] = 60.into();
        server.create(Resource::Ats, stale);
        wait_phase(&server, "stale", Phase::Done).await;
        assert_eq!(
            status(&server, "stale").unwrap().outcome,
            Some(Outcome::Missed)
        );
        assert_eq!(server.get(Resource::Pods, "default", "stale-pod"), None);
        operator.abort();
    }

    #[tokio::test]
    async fn a_finished_at_is_deleted_after_its_ttl() {
        let server = ApiServer::new();
        let operator = start(&server);
        let mut short = at_json("short", &past(0), "true");
        short["spec"]["ttlSecondsAfterFinished"] = 2.into();
        server.create(Resource::Ats, short);
        server.create(Resource::Ats, at_json("kept", &past(0), "true"));
        wait_phase(&server, "short", Phase::Running).await;
        wait_phase(&server, "kept", Phase::Running).await;
        server.finish_pod("default", "short-pod", 0);
        server.finish_pod("default", "kept-pod", 0);
        wait_phase(&server, "short", Phase::Done).await;
        let done = Instant::now();
        let gone = server
            .wait_for(WAIT, |s| s.get(Resource::Ats, "default", "short").is_none())
            .await;
        assert!(gone, "not deleted");
        assert!(
            done.elapsed() >= Duration::from_millis(900),
            "deleted before its TTL"
        );
        assert_eq!(server.count("DELETE ats"), 1);
        // Without a TTL a DONE At stays.
        assert_eq!(phase(&server, "kept"), Some(Phase::Done));
        operator.abort();
    }

    #[tokio::test]
    async fn a_pod_that_vanished_while_the_watch_relisted_still_ends_its_at() {
        let server = ApiServer::new();
        let policy = RunPolicy {
            running_recheck: Duration::from_millis(500),
            ..RunPolicy::default()
        };
        let operator = support::run_controller_with(server.client(), policy);
        server.create(Resource::Ats, at_json("orphan", &past(0), "sleep 3600"));
        wait_phase(&server, "orphan", Phase::Running).await;
        // The pod goes while the watch is down; the re-list finds it gone but nobody is told.
        server.vanish(Resource::Pods, "default", "orphan-pod");
        server.expire_watches(Resource::Pods);
        wait_phase(&server, "orphan", Phase::Done).await;
        let st = status(&server, "orphan").unwrap();
        assert_eq!(st.reason.as_deref(), Some("PodLost"));
        assert_eq!(st.outcome, Some(Outcome::Failed));
        operator.abort();
    }
}

#[tokio::test]
async fn an_at_fixed_while_the_at_watch_relisted_runs() {
    let server = ApiServer::new();
    let operator = start(&server);
    server.create(Resource::Ats, at_json("fixed", "tomorrow", "true"));
    let invalid = server
        .wait_for(WAIT, |s| {
            status(s, "fixed").and_then(|st| st.reason).as_deref() == Some("InvalidSchedule")
        })
        .await;
    assert!(invalid, "{:?}", status(&server, "fixed"));
    // Fixed while the watch is down: the re-list finds the new spec, but no event says so.
    let now = Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    server.change_unseen(Resource::Ats, "default", "fixed", |at| {
        at["spec"]["schedule"] = now.into();
        at["metadata"]["generation"] = 2.into();
    });
    server.expire_watches(Resource::Ats);
    let ran = server
        .wait_for(WAIT, |s| {
            s.get(Resource::Pods, "default", "fixed-pod").is_some()
        })
        .await;
    assert!(
        ran,
        "the fixed At never got its pod: {:?}",
        status(&server, "fixed")
    );
    operator.abort();
}

#[tokio::test]
async fn a_new_leader_starts_from_the_ats_it_cached_as_a_candidate() {
    let server = ApiServer::new();
    let later = (Utc::now() + Span::hours(1)).to_rfc3339();
    for i in 0..50 {
        server.create(
            Resource::Ats,
            at_json(&format!("later-{i}"), &later, "true"),
        );
    }
    // A first leader settles them, then goes.
    let first = start(&server);
    let settled = server
        .wait_for(WAIT, |s| {
            (0..50).all(|i| phase(s, &format!("later-{i}")) == Some(Phase::Pending))
        })
        .await;
    assert!(settled);
    first.abort();

    // A candidate caches every At while another replica leads.
    let client = server.client();
    let cache = cnat::operator::cache::AtCache::start(&client, None);
    assert!(
        support::until(WAIT, || cache.store().state().len() == 50).await,
        "the candidate never cached the Ats"
    );
    assert!(
        !cache.streams_lists(),
        "this server, as kube-apiserver v1.24, refuses streaming lists: the cache lists"
    );
    server.create(
        Resource::Ats,
        at_json("due", "2019-04-12T10:12:00Z", "true"),
    );
    assert!(support::until(WAIT, || cache.store().state().len() == 51).await);
    let (reads, writes) = (server.count("GET ats"), server.count("PATCH ats/status"));

    // It becomes leader: the due At runs, from the cache, without listing or watching Ats again
    // (its one read is the due At's, just before its pod) and without a write for the settled
    // ones.
    let settings = cnat::operator::controller::Settings {
        namespace: None,
        selector: None,
        concurrency: 32,
        policy: Default::default(),
        signing: cnat::operator::signing::Source::secret("default", "cnat-pod-signing"),
    };
    let events = support::events(&client, "cnat-1");
    let metrics = std::sync::Arc::new(cnat::observability::metrics::Metrics::new(
        Default::default(),
    ));
    let leader = tokio::spawn(cnat::operator::controller::run_with_cache(
        cache,
        client,
        settings,
        events,
        metrics,
        tokio_util::sync::CancellationToken::new(),
    ));
    wait_phase(&server, "due", Phase::Running).await;
    server.told("due", 1).await;
    assert_eq!(
        server.count("GET ats"),
        reads + 1,
        "the leader read Ats again beyond the due At's read before its pod"
    );
    assert_eq!(
        server.count("PATCH ats/status"),
        writes + 1,
        "only the due At's RUNNING"
    );
    assert_eq!(server.count("POST pods"), 1);
    leader.abort();
}

/// At `default/NAME` changes without a watch telling, then the At watches expire: `cache` must
/// list again and hold the change.
async fn changed_unseen_then_expired(
    server: &ApiServer,
    cache: &cnat::operator::cache::AtCache,
    name: &str,
) {
    server.change_unseen(Resource::Ats, "default", name, |at| {
        at["spec"]["command"] = json!("unseen");
    });
    server.expire_watches(Resource::Ats);
    assert!(
        support::until(WAIT, || cached_command(cache, name).as_deref()
            == Some("unseen"))
        .await,
        "never listed again"
    );
}

/// The command of At `default/NAME` as `cache` holds it, if it does.
fn cached_command(cache: &cnat::operator::cache::AtCache, name: &str) -> Option<String> {
    let key = kube::runtime::reflector::ObjectRef::new(name).within("default");
    cache
        .store()
        .get(&key)
        .map(|at| at.at().unwrap().spec.command)
}

#[tokio::test]
async fn the_at_cache_lists_once_follows_every_change_and_relists_no_older_after_a_410() {
    let server = ApiServer::new();
    // In a shard, in another, in none (created without the webhook), and in one this build
    // does not know.
    let names = ["at-0", "at-1", "at-2", "at-odd"];
    for (name, shard) in names
        .into_iter()
        .zip([Some("0"), Some("2"), None, Some("99")])
    {
        let mut at = at_json(name, "2999-01-01T00:00:00Z", "true");
        if let Some(shard) = shard {
            at["metadata"]["labels"] = json!({cnat::shard::LABEL: shard});
        }
        server.create(Resource::Ats, at);
    }
    let cache = cnat::operator::cache::AtCache::start(&server.client(), None);
    tokio::time::timeout(WAIT, cache.listed())
        .await
        .expect("never listed");
    assert_eq!(cache.readiness(), Ok(()));
    let mut cached: Vec<String> = cache
        .store()
        .state()
        .iter()
        .map(|at| kube::ResourceExt::name_any(at.as_ref()))
        .collect();
    cached.sort();
    assert_eq!(cached, names);
    // One request per shard and one for every other At, at once, from the API server's watch
    // cache: any version, no pages.
    let lists: Vec<String> = server
        .queries("GET ats")
        .into_iter()
        .filter(|q| !q.contains("watch=true"))
        .collect();
    assert_eq!(lists.len(), cnat::shard::SHARDS + 1, "{lists:?}");
    let selectors: std::collections::BTreeSet<String> = lists
        .iter()
        .map(|query| {
            assert!(query.contains("resourceVersion=0"), "{query}");
            assert!(!query.contains("limit="), "{query}");
            let selector = query
                .split('&')
                .find_map(|p| p.strip_prefix("labelSelector="))
                .unwrap_or_else(|| panic!("no selector: {query}"));
            form_urlencoded::parse(format!("s={selector}").as_bytes())
                .next()
                .unwrap()
                .1
                .into_owned()
        })
        .collect();
    assert_eq!(
        selectors,
        cnat::shard::selectors().into_iter().collect(),
        "{lists:?}"
    );
    let command = |name: &str| cached_command(&cache, name);
    // Watched: a new At, a deleted one.
    server.create(
        Resource::Ats,
        at_json("at-3", "2999-01-01T00:00:00Z", "new"),
    );
    server.delete(Resource::Ats, "default", "at-0");
    assert!(
        support::until(WAIT, || command("at-3").as_deref() == Some("new")
            && command("at-0").is_none())
        .await
    );
    // A change no watch told, then the watch expires: the cache lists again, at a version not
    // older than the last one it saw, and has the change.
    changed_unseen_then_expired(&server, &cache, "at-2").await;
    let lists: Vec<String> = server
        .queries("GET ats")
        .into_iter()
        .filter(|q| !q.contains("watch=true"))
        .collect();
    assert_eq!(lists.len(), 2 * (cnat::shard::SHARDS + 1), "{lists:?}");
    for relist in &lists[cnat::shard::SHARDS + 1..] {
        assert!(
            relist.contains("resourceVersionMatch=NotOlderThan")
                && !relist.contains("resourceVersion=0&"),
            "{relist}"
        );
    }
    assert_eq!(cache.store().state().len(), 4);
    assert_eq!(cache.readiness(), Ok(()));
    // And it watches on from there: no relist loop.
    server.create(
        Resource::Ats,
        at_json("at-4", "2999-01-01T00:00:00Z", "after"),
    );
    assert!(support::until(WAIT, || command("at-4").as_deref() == Some("after")).await);
    let relists = server
        .queries("GET ats")
        .into_iter()
        .filter(|q| !q.contains("watch=true"))
        .count();
    assert_eq!(relists, 2 * (cnat::shard::SHARDS + 1));
}

/// On a server that streams lists (kube-apiserver 1.34+), the cache lists by one streaming
/// list, no paged list, and follows changes on the same watch; after a 410 it streams again
/// from the version it last saw (never older), and holds what changed meanwhile.
#[tokio::test]
async fn a_streaming_list_fills_the_cache_and_after_a_410_streams_again_no_older() {
    let server = ApiServer::new();
    server.streams_lists();
    for name in ["at-0", "at-1"] {
        server.create(Resource::Ats, at_json(name, "2999-01-01T00:00:00Z", "true"));
    }
    let cache = cnat::operator::cache::AtCache::start(&server.client(), None);
    tokio::time::timeout(WAIT, cache.listed())
        .await
        .expect("never listed");
    assert!(cache.streams_lists());
    let command = |name: &str| cached_command(&cache, name);
    assert_eq!(cache.store().state().len(), 2);
    server.create(
        Resource::Ats,
        at_json("at-2", "2999-01-01T00:00:00Z", "new"),
    );
    assert!(support::until(WAIT, || command("at-2").as_deref() == Some("new")).await);
    let queries = server.queries("GET ats");
    assert_eq!(
        queries.len(),
        1,
        "one request, no page, no second watch: {queries:?}"
    );
    assert!(queries[0].contains("sendInitialEvents=true"), "{queries:?}");

    changed_unseen_then_expired(&server, &cache, "at-0").await;
    let queries = server.queries("GET ats");
    assert_eq!(queries.len(), 2, "{queries:?}");
    let relist = &queries[1];
    assert!(
        relist.contains("sendInitialEvents=true")
            && relist.contains("resourceVersionMatch=NotOlderThan")
            && !relist.contains("resourceVersion=0&")
            && !relist.ends_with("resourceVersion=0"),
        "{relist}"
    );
    assert_eq!(cache.store().state().len(), 3);
    assert_eq!(cache.readiness(), Ok(()));
}

/// A watch resumed from a compacted version may be refused with 410 as the answer's status
/// (kube-client 5 returns that as the watch request's error, not as its first event): the cache
/// lists again, as after a 410 event, instead of resuming from that version forever.
#[tokio::test]
async fn a_watch_refused_with_410_as_its_answer_s_status_lists_again() {
    let server = ApiServer::new();
    server.expire_by_status();
    server.create(
        Resource::Ats,
        at_json("at-0", "2999-01-01T00:00:00Z", "true"),
    );
    let cache = cnat::operator::cache::AtCache::start(&server.client(), None);
    tokio::time::timeout(WAIT, cache.listed())
        .await
        .expect("never listed");
    let lists = || {
        server
            .queries("GET ats")
            .into_iter()
            .filter(|q| !q.contains("watch=true"))
            .count()
    };
    let listed = lists();
    assert!(
        support::until(WAIT, || server
            .queries("GET ats")
            .iter()
            .any(|q| q.contains("watch=true") && !q.contains("sendInitialEvents")))
        .await,
        "never watched"
    );
    changed_unseen_then_expired(&server, &cache, "at-0").await;
    assert_eq!(lists(), 2 * listed, "one relist");
}

/// The message of a real kube-apiserver v1.24 for a list it could not convert because no
/// conversion webhook answered (captured by the upgrade test, tests/e2e/upgrade.rs).
const CONVERSION_FAILED: &str = "conversion webhook for cnat.programming-kubernetes.info/v1alpha1, Kind=At failed: Post \"https://127.0.0.1:46531/convert?timeout=30s\": EOF";

#[tokio::test(start_paused = true)]
async fn a_cache_whose_list_waits_for_the_conversion_webhook_says_ready_but_is_no_candidate() {
    let server = ApiServer::new();
    server.create(
        Resource::Ats,
        at_json("at-0", "2999-01-01T00:00:00Z", "true"),
    );
    server.fail_lists(Resource::Ats, Some(CONVERSION_FAILED));
    let client = server.client();
    let cache = cnat::operator::cache::AtCache::start(&client, None);
    tokio::time::sleep(Duration::from_secs(5)).await;
    // Ready: the webhook Service routes only to ready replicas, and the list needs this one's
    // /convert (all replicas started at once). Not a candidate for the Lease: nothing listed.
    assert_eq!(cache.readiness(), Ok(()));
    let listed = cache.listed();
    tokio::pin!(listed);
    assert!(futures::poll!(&mut listed).is_pending());
    // Any other failure keeps it unready: a conversion webhook that answered but cannot be
    // trusted (readiness would not help; the old leader should stay), or another error.
    for (other, named) in [
        ("conversion webhook for cnat.programming-kubernetes.info/v1alpha1, Kind=At failed: Post \"https://cnat-webhook.cnat-system.svc:443/convert?timeout=30s\": x509: certificate signed by unknown authority", "x509: certificate signed by unknown authority"),
        ("etcdserver: request timed out", "etcdserver: request timed out"),
    ] {
        server.fail_lists(Resource::Ats, Some(other));
        tokio::time::sleep(Duration::from_secs(60)).await;
        let why = cache.readiness().unwrap_err().to_string();
        assert!(why.contains(named), "{why}");
    }
    server.fail_lists(Resource::Ats, None);
    tokio::time::timeout(Duration::from_secs(65), listed)
        .await
        .expect("never listed once the server could convert");
    assert_eq!(cache.readiness(), Ok(()));
    assert_eq!(cache.store().state().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_cache_whose_list_gets_no_answer_gives_up_says_why_and_lists_once_it_can() {
    let server = ApiServer::new();
    server.create(
        Resource::Ats,
        at_json("at-0", "2999-01-01T00:00:00Z", "true"),
    );
    // The network to the API server is cut: requests hang, unanswered.
    let (client, partition) = server.partitionable_client();
    partition.cut();
    let cache = cnat::operator::cache::AtCache::start(&client, None);
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        cache.readiness().map_err(|why| why.to_string()),
        Err("listing Ats: 0 received so far; this replica leads and is ready once it holds them all".into())
    );
    // A list that gets no answer for 60 s is given up (kube-client has no read timeout).
    tokio::time::sleep(Duration::from_secs(31)).await;
    let why = cache.readiness().unwrap_err().to_string();
    assert!(
        why.contains("(the last attempt failed: ") && why.contains("no answer within 60s"),
        "{why}"
    );
    partition.heal();
    tokio::time::timeout(Duration::from_secs(65), cache.listed())
        .await
        .expect("never listed once the server answered");
    assert_eq!(cache.readiness(), Ok(()));
    assert_eq!(cache.store().state().len(), 1);
}
