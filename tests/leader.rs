//! Several replicas competing for the Lease on a fake API server that enforces Lease semantics
//! (resourceVersion conflicts, holder, renewTime). kube-leader-election reads the wall clock, so
//! these run in real time with short durations: lease 3s, renew deadline 2s, retry period 0.5s.

mod support;

use chrono::Utc;
use cnat::leader::{self, Leadership, Timing};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::apiserver::{ApiServer, Partition, Resource};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const TIMING: Timing = Timing {
    lease_duration: Duration::from_secs(3),
    renew_deadline: Duration::from_secs(2),
    retry_period: Duration::from_millis(500),
};
/// Scheduling and request latency on a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(400);

/// When each replica's reconcile loop ran.
#[derive(Default)]
struct Activity(Mutex<Vec<(String, Instant, Option<Instant>)>>);

impl Activity {
    fn running(&self) -> Vec<String> {
        let log = self.0.lock().unwrap();
        log.iter()
            .filter(|(_, _, end)| end.is_none())
            .map(|(id, _, _)| id.clone())
            .collect()
    }

    fn started_after(&self, t: Instant) -> Option<(String, Instant)> {
        let log = self.0.lock().unwrap();
        log.iter()
            .find(|(_, start, _)| *start > t)
            .map(|(id, start, _)| (id.clone(), *start))
    }

    fn ended(&self, id: &str) -> Option<Instant> {
        let log = self.0.lock().unwrap();
        log.iter()
            .rev()
            .find(|(who, _, _)| who == id)
            .and_then(|(_, _, end)| *end)
    }

    fn runs(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// No two replicas' reconcile loops ever ran at the same time.
    fn assert_never_overlapped(&self) {
        let log = self.0.lock().unwrap();
        let now = Instant::now();
        for (i, (a, a0, a1)) in log.iter().enumerate() {
            for (b, b0, b1) in &log[i + 1..] {
                let overlap = *a0 < b1.unwrap_or(now) && *b0 < a1.unwrap_or(now);
                assert!(!overlap, "{a} and {b} reconciled at the same time: {log:?}");
            }
        }
    }
}

/// Records the end of a run however it ends: graceful stop or abort.
struct EndOnDrop(Arc<Activity>, usize);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0 .0.lock().unwrap()[self.1].2 = Some(Instant::now());
    }
}

/// Stands in for the reconcile loop: runs until asked to stop, or aborted.
async fn work(id: String, activity: Arc<Activity>, stop: CancellationToken) {
    let index = {
        let mut log = activity.0.lock().unwrap();
        log.push((id, Instant::now(), None));
        log.len() - 1
    };
    let _end = EndOnDrop(activity, index);
    stop.cancelled().await;
}

struct Replica {
    id: String,
    shutdown: CancellationToken,
    partition: Partition,
    leadership: Arc<Leadership>,
    task: JoinHandle<()>,
}

fn replica(server: &ApiServer, id: &str, activity: &Arc<Activity>) -> Replica {
    let (client, partition) = server.partitionable_client();
    let settings = leader::Settings {
        lease_name: "cnat".into(),
        namespace: "cnat-system".into(),
        identity: id.into(),
        timing: TIMING,
    };
    let shutdown = CancellationToken::new();
    let leadership = Arc::new(Leadership::default());
    let (who, log) = (id.to_owned(), activity.clone());
    let task = tokio::spawn(leader::run(
        client.clone(),
        settings,
        leadership.clone(),
        support::events(&client, id),
        move |stop| work(who.clone(), log.clone(), stop),
        shutdown.clone(),
    ));
    Replica {
        id: id.into(),
        shutdown,
        partition,
        leadership,
        task,
    }
}

fn replicas(server: &ApiServer, activity: &Arc<Activity>) -> Vec<Replica> {
    ["cnat-0", "cnat-1", "cnat-2"]
        .iter()
        .map(|id| replica(server, id, activity))
        .collect()
}

async fn leader_of(replicas: &[Replica], activity: &Activity) -> usize {
    assert!(
        support::until(Duration::from_secs(5), || activity.running().len() == 1).await,
        "no leader"
    );
    let id = activity.running().remove(0);
    replicas.iter().position(|r| r.id == id).unwrap()
}

fn holder(server: &ApiServer) -> String {
    let lease = server
        .get(Resource::Leases, "cnat-system", "cnat")
        .expect("a lease");
    lease["spec"]["holderIdentity"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn exactly_one_replica_leads_in_steady_state() {
    let server = ApiServer::new();
    let activity = Arc::new(Activity::default());
    let replicas = replicas(&server, &activity);
    let leader = leader_of(&replicas, &activity).await;
    tokio::time::sleep(TIMING.lease_duration * 2).await; // several renewals and retries
    assert_eq!(activity.running(), [replicas[leader].id.clone()]);
    assert_eq!(activity.runs(), 1, "leadership flapped");
    assert_eq!(holder(&server), replicas[leader].id);
    let leading: Vec<bool> = replicas.iter().map(|r| r.leadership.is_leader()).collect();
    assert_eq!(leading.iter().filter(|l| **l).count(), 1, "{leading:?}");
    assert_eq!(replicas[leader].leadership.transitions(), 1);
    assert!(replicas[leader].leadership.since_renewal().unwrap() <= TIMING.retry_period + SLACK);
    assert!(
        server.count("PATCH leases") >= 6,
        "the leader renews every retry period"
    );
    assert_eq!(server.event_reasons("cnat"), ["LeaderElected"]);
    activity.assert_never_overlapped();
}

#[tokio::test]
async fn a_killed_leader_is_replaced_within_lease_duration_plus_retry_period() {
    let server = ApiServer::new();
    let activity = Arc::new(Activity::default());
    let replicas = replicas(&server, &activity);
    let leader = leader_of(&replicas, &activity).await;
    let killed = Instant::now();
    replicas[leader].task.abort(); // a crash: nothing is released
    assert!(
        support::until(Duration::from_millis(200), || activity.running().is_empty()).await,
        "work outlived its election"
    );

    let took_over = support::until(TIMING.lease_duration + TIMING.retry_period + SLACK, || {
        activity.running().len() == 1
    })
    .await;
    assert!(
        took_over,
        "no new leader within lease duration + retry period"
    );
    let (new, started) = activity.started_after(killed).unwrap();
    assert_ne!(new, replicas[leader].id);
    // Nobody took over before the lease could have expired.
    assert!(
        started - killed >= TIMING.lease_duration - TIMING.retry_period,
        "{:?}",
        started - killed
    );
    assert_eq!(holder(&server), new);
    activity.assert_never_overlapped();
}

#[tokio::test]
async fn a_released_lease_is_taken_over_within_about_one_retry_period() {
    let server = ApiServer::new();
    let activity = Arc::new(Activity::default());
    let mut replicas = replicas(&server, &activity);
    let leader = leader_of(&replicas, &activity).await;
    let stopping = replicas.remove(leader);
    let asked = Instant::now();
    stopping.shutdown.cancel();
    stopping.task.await.unwrap(); // returns once the work stopped and the lease was released
    assert!(activity.ended(&stopping.id).is_some());
    assert!(!stopping.leadership.is_leader());

    // kube-leader-election releases by setting a 1s lease with no holder.
    let limit = Duration::from_secs(1) + TIMING.retry_period + SLACK;
    assert!(
        support::until(limit, || activity.running().len() == 1).await,
        "no handover within {limit:?}"
    );
    let (new, started) = activity.started_after(asked).unwrap();
    assert!(
        started - asked < TIMING.lease_duration,
        "as slow as an expiry: {:?}",
        started - asked
    );
    assert_eq!(holder(&server), new);
    assert!(server
        .event_reasons("cnat")
        .contains(&"LeaderReleased".to_owned()));
    activity.assert_never_overlapped();
}

#[tokio::test]
async fn a_leader_cut_off_from_the_api_stops_reconciling_within_the_renew_deadline() {
    let server = ApiServer::new();
    let activity = Arc::new(Activity::default());
    let replicas = replicas(&server, &activity);
    let leader = leader_of(&replicas, &activity).await;
    let cut = Instant::now();
    replicas[leader].partition.cut();

    let id = replicas[leader].id.clone();
    assert!(
        support::until(TIMING.renew_deadline + SLACK, || activity
            .ended(&id)
            .is_some())
        .await,
        "still reconciling"
    );
    let stopped = activity.ended(&id).unwrap() - cut;
    assert!(stopped <= TIMING.renew_deadline + SLACK, "{stopped:?}");
    assert!(!replicas[leader].leadership.is_leader());

    // The others wait for the lease to expire, then one takes over.
    assert!(
        support::until(
            TIMING.lease_duration + TIMING.retry_period + SLACK,
            || activity.running().len() == 1
        )
        .await
    );
    assert_ne!(activity.running(), [id]);
    activity.assert_never_overlapped();
}

#[tokio::test]
async fn two_replicas_that_both_believe_they_lead_still_run_each_at_once() {
    let server = ApiServer::new();
    let first = support::run_controller(server.client());
    let second = support::run_controller(server.client());
    let due = (Utc::now() + chrono::Duration::milliseconds(700)).to_rfc3339();
    let names: Vec<String> = (0..50).map(|i| format!("at-{i}")).collect();
    for name in &names {
        server.create(
            Resource::Ats,
            json!({"metadata": {"name": name, "namespace": "default"},
                   "spec": {"schedule": due, "command": "true", "image": "busybox"}}),
        );
    }
    let phase = |s: &ApiServer, name: &str| {
        s.get(Resource::Ats, "default", name)
            .map(|a| a["status"]["phase"].clone())
    };
    let running = server
        .wait_for(Duration::from_secs(10), |s| {
            names.iter().all(|n| phase(s, n) == Some(json!("RUNNING")))
        })
        .await;
    assert!(running);
    for name in &names {
        server.finish_pod("default", &format!("{name}-pod"), 0);
    }
    let done = server
        .wait_for(Duration::from_secs(10), |s| {
            names.iter().all(|n| phase(s, n) == Some(json!("DONE")))
        })
        .await;
    assert!(done);
    tokio::time::sleep(Duration::from_millis(300)).await;

    assert_eq!(server.list(Resource::Pods).len(), 50, "one pod per At");
    for name in &names {
        assert_eq!(
            server.event_reasons(name),
            ["Scheduled", "PodCreated", "Succeeded"],
            "{name}"
        );
    }
    // Both tried: the losers of each race got AlreadyExists or Conflict, not a second run.
    assert!(server.count("POST pods") >= 50);
    first.abort();
    second.abort();
}

mod scripted {
    //! Election against a scripted API server with paused time: the exact requests and pauses.

    use super::*;
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::Value;

    fn fixture(name: &str) -> Value {
        let path = format!(
            "{}/tests/fixtures/api-k8s-1.24/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// Answers each request with the next reply, records "METHOD path" and the (paused) time.
    fn scripted(
        replies: Vec<(u16, Value)>,
    ) -> (
        kube::Client,
        JoinHandle<Vec<(String, tokio::time::Instant)>>,
    ) {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut replies = replies.into_iter();
            while let Some((request, respond)) = handle.next_request().await {
                seen.push((
                    format!("{} {}", request.method(), request.uri().path()),
                    tokio::time::Instant::now(),
                ));
                let Some((code, body)) = replies.next() else {
                    break;
                };
                let response = Response::builder()
                    .status(code)
                    .body(Body::from(serde_json::to_vec(&body).unwrap()));
                respond.send_response(response.unwrap());
            }
            seen
        });
        (kube::Client::new(service, "cnat-system"), server)
    }

    fn settings(namespace: &str) -> leader::Settings {
        leader::Settings {
            lease_name: "cnat".into(),
            namespace: namespace.into(),
            identity: "cnat-0".into(),
            timing: TIMING,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_missing_namespace_is_retried_with_growing_pauses_and_never_leads() {
        let mut missing = fixture("status-404-not-found.json");
        missing["message"] = r#"namespaces "nope" not found"#.into();
        let mut replies = Vec::new();
        for _ in 0..7 {
            replies.push((404, fixture("status-404-not-found.json"))); // GET lease
            replies.push((404, missing.clone())); // POST lease
        }
        let (client, server) = scripted(replies);
        let activity = Arc::new(Activity::default());
        let leadership = Arc::new(Leadership::default());
        let shutdown = CancellationToken::new();
        let log = activity.clone();
        let election = tokio::spawn(leader::run(
            client.clone(),
            settings("nope"),
            leadership.clone(),
            support::events(&client, "cnat-0"),
            move |stop| work("cnat-0".into(), log.clone(), stop),
            shutdown.clone(),
        ));
        tokio::time::sleep(Duration::from_secs(12)).await;
        shutdown.cancel();
        election.await.unwrap(); // no panic, and it stops when asked
        drop(client);
        let seen = server.await.unwrap();
        assert_eq!(activity.runs(), 0);
        assert!(!leadership.is_leader());
        let gets: Vec<_> = seen
            .iter()
            .filter(|(r, _)| r.starts_with("GET"))
            .map(|(_, t)| *t)
            .collect();
        assert_eq!(
            seen[1].0,
            "POST /apis/coordination.k8s.io/v1/namespaces/nope/leases"
        );
        let pauses: Vec<Duration> = gets.windows(2).map(|w| w[1] - w[0]).collect();
        let retry = TIMING.retry_period;
        assert_eq!(
            pauses,
            [retry, retry * 2, retry * 3, retry * 4, retry * 5, retry * 5],
            "backoff"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn losing_the_confirm_race_means_not_leading() {
        // An expired lease held by r1; our acquire lands, but someone wrote before our confirm.
        let expired = fixture("lease-created.json");
        let mut acquired = expired.clone();
        acquired["spec"]["holderIdentity"] = "cnat-0".into();
        acquired["metadata"]["resourceVersion"] = "28935".into();
        let (client, server) = scripted(vec![
            (200, expired),
            (200, acquired),
            (
                409,
                fixture("status-409-conflict-stale-resourceversion.json"),
            ),
        ]);
        let activity = Arc::new(Activity::default());
        let shutdown = CancellationToken::new();
        let log = activity.clone();
        let election = tokio::spawn(leader::run(
            client.clone(),
            settings("fx"),
            Arc::new(Leadership::default()),
            support::events(&client, "cnat-0"),
            move |stop| work("cnat-0".into(), log.clone(), stop),
            shutdown.clone(),
        ));
        tokio::time::sleep(TIMING.retry_period / 2).await;
        shutdown.cancel();
        election.await.unwrap();
        drop(client);
        let seen: Vec<String> = server.await.unwrap().into_iter().map(|(r, _)| r).collect();
        assert_eq!(
            seen,
            [
                "GET /apis/coordination.k8s.io/v1/namespaces/fx/leases/cnat",
                "PATCH /apis/coordination.k8s.io/v1/namespaces/fx/leases/cnat",
                "PATCH /apis/coordination.k8s.io/v1/namespaces/fx/leases/cnat",
            ]
        );
        assert_eq!(activity.runs(), 0, "led without winning the confirm");
    }
}
