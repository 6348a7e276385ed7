//! Three to five replicas competing for the Lease on the fake API server, which serves Lease
//! watches and refuses any Lease write without a `resourceVersion` precondition. Time is paused
//! (tokio's virtual clock), so the client-go default timings run as they would in production
//! (lease 15 s, renew deadline 10 s, retry 2 s) in milliseconds of real time, and durations are
//! measured exactly: API latency is injected, every replica's wall clock is skewed by up to
//! +/- 5 s (the election must not care), and no assertion depends on machine speed.

use crate::support;

use chrono::Utc;
use cnat::leader::{self, Leadership, Timing, WallClock};
use serde_json::json;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::apiserver::{ApiServer, Partition, Resource};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const TIMING: Timing = Timing {
    lease_duration: Duration::from_secs(15),
    renew_deadline: Duration::from_secs(10),
    retry_period: Duration::from_secs(2),
    step_down_grace: Duration::from_millis(200),
};
/// About what a real API server takes per write with 8 in flight.
const LATENCY: Duration = Duration::from_millis(5);
/// Wall-clock offsets of the replicas.
const SKEWS: [i64; 5] = [-5_000, 5_000, 0, -2_500, 2_500];

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

    /// No two replicas' reconcile loops ever ran at the same instant.
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

/// Logs a run of `inner` (the reconcile loop or a stand-in) from its start to its end or abort.
async fn logged(id: String, activity: Arc<Activity>, inner: impl Future<Output = ()>) {
    let index = {
        let mut log = activity.0.lock().unwrap();
        log.push((id, Instant::now(), None));
        log.len() - 1
    };
    let _end = EndOnDrop(activity, index);
    inner.await;
}

struct Replica {
    id: String,
    shutdown: CancellationToken,
    partition: Partition,
    leadership: Arc<Leadership>,
    task: JoinHandle<()>,
}

fn settings(id: &str, skew_ms: i64) -> leader::Settings {
    leader::Settings {
        lease_name: "cnat".into(),
        balance: None,
        handover: None,
        namespace: "cnat-system".into(),
        identity: id.into(),
        timing: TIMING,
        clock: WallClock::new(move || {
            jiff::Timestamp::now() + jiff::SignedDuration::from_millis(skew_ms)
        }),
    }
}

/// A replica whose work is a stand-in that runs until asked to stop.
fn replica(server: &ApiServer, id: &str, skew_ms: i64, activity: &Arc<Activity>) -> Replica {
    let (who, log) = (id.to_owned(), activity.clone());
    replica_with(server, id, skew_ms, move |_client, stop| {
        logged(
            who.clone(),
            log.clone(),
            async move { stop.cancelled().await },
        )
    })
}

fn replica_with<W, F>(server: &ApiServer, id: &str, skew_ms: i64, work: W) -> Replica
where
    W: Fn(kube::Client, CancellationToken) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let (client, partition) = server.named_client(id);
    let shutdown = CancellationToken::new();
    let leadership = Arc::new(Leadership::default());
    let work_client = client.clone();
    let task = tokio::spawn(leader::run(
        client.clone(),
        settings(id, skew_ms),
        leadership.clone(),
        support::events(&client, id),
        std::future::ready(()),
        move |stop| work(work_client.clone(), stop),
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

fn replicas(server: &ApiServer, n: usize, activity: &Arc<Activity>) -> Vec<Replica> {
    (0..n)
        .map(|i| replica(server, &format!("cnat-{i}"), SKEWS[i], activity))
        .collect()
}

async fn leader_of(replicas: &[Replica], activity: &Activity) -> usize {
    assert!(
        support::until(TIMING.lease_duration, || activity.running().len() == 1).await,
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

/// When `id` last wrote the Lease.
fn last_lease_write(server: &ApiServer, id: &str) -> Instant {
    server
        .calls_by(id)
        .into_iter()
        .filter(|(what, _)| what == "PATCH leases" || what == "POST leases")
        .map(|(_, at)| at)
        .next_back()
        .expect("a lease write")
}

#[tokio::test(start_paused = true)]
async fn exactly_one_of_five_skewed_replicas_leads_in_steady_state() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    let activity = Arc::new(Activity::default());
    let replicas = replicas(&server, 5, &activity);
    let leader = leader_of(&replicas, &activity).await;
    tokio::time::sleep(TIMING.lease_duration * 10).await; // many renewals and re-reads
    assert_eq!(activity.running(), [replicas[leader].id.clone()]);
    assert_eq!(activity.runs(), 1, "leadership flapped");
    assert_eq!(holder(&server), replicas[leader].id);
    let leading: Vec<bool> = replicas.iter().map(|r| r.leadership.is_leader()).collect();
    assert_eq!(leading.iter().filter(|l| **l).count(), 1, "{leading:?}");
    assert_eq!(replicas[leader].leadership.transitions(), 1);
    assert!(replicas[leader].leadership.since_renewal().unwrap() <= TIMING.retry_period);
    // The leader renews every retry period: 150 s / 2 s.
    let renewals = server
        .calls_by(&replicas[leader].id)
        .iter()
        .filter(|(what, _)| what == "PATCH leases")
        .count();
    assert!((70..=80).contains(&renewals), "{renewals} renewals");
    assert_eq!(server.unguarded_lease_writes(), 0);
    assert_eq!(server.event_reasons("cnat"), ["LeaderElected"]);
    activity.assert_never_overlapped();
}

#[tokio::test(start_paused = true)]
async fn every_lease_write_carries_a_precondition() {
    // The check can fail: a merge patch without resourceVersion is refused and counted.
    let server = ApiServer::new();
    let (client, _) = server.named_client("other");
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(client, "cnat-system");
    let activity = Arc::new(Activity::default());
    let replicas = replicas(&server, 3, &activity);
    leader_of(&replicas, &activity).await;
    let blind = json!({"spec": {"holderIdentity": "intruder"}});
    let refused = leases
        .patch(
            "cnat",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&blind),
        )
        .await;
    assert!(refused.is_err());
    assert_eq!(server.unguarded_lease_writes(), 1);
    // Every write the replicas made (acquire, renew) was accepted.
    tokio::time::sleep(TIMING.lease_duration).await;
    assert_eq!(server.unguarded_lease_writes(), 1);
    assert_ne!(holder(&server), "intruder");
}

#[tokio::test(start_paused = true)]
async fn graceful_handovers_take_under_half_a_second() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    let activity = Arc::new(Activity::default());
    let mut replicas = replicas(&server, 5, &activity);
    let leaderships: Vec<Arc<Leadership>> = replicas.iter().map(|r| r.leadership.clone()).collect();
    leader_of(&replicas, &activity).await;
    // A rolling upgrade: the leader is stopped four times in a row.
    let mut took = Vec::new();
    for _ in 0..4 {
        tokio::time::sleep(TIMING.retry_period * 3).await;
        let leader = leader_of(&replicas, &activity).await;
        let stopping = replicas.remove(leader);
        let asked = Instant::now();
        stopping.shutdown.cancel();
        assert!(
            support::until(Duration::from_secs(1), || activity
                .started_after(asked)
                .is_some())
            .await,
            "no handover within 1 s"
        );
        let (new, started) = activity.started_after(asked).unwrap();
        took.push(started - asked);
        stopping.task.await.unwrap(); // returns after the release
        assert!(!stopping.leadership.is_leader());
        assert!(activity.ended(&stopping.id).unwrap() <= started);
        assert_eq!(holder(&server), new);
    }
    assert!(
        took.iter().all(|t| *t < Duration::from_millis(500)),
        "{took:?}"
    );
    assert_eq!(server.unguarded_lease_writes(), 0);
    let reasons = server.event_reasons("cnat");
    assert_eq!(
        reasons.iter().filter(|r| *r == "LeaderReleased").count(),
        4,
        "{reasons:?}"
    );
    // The new leaders measured their handover (seen released -> leading).
    let measured: u64 = leaderships
        .iter()
        .map(|leadership| {
            let scrape = scrape(leadership);
            scrape
                .lines()
                .find_map(|l| l.strip_prefix("cnat_leader_handover_seconds_count "))
                .map_or(0, |n| n.trim().parse().unwrap())
        })
        .sum();
    assert_eq!(measured, 4, "one handover measured per takeover");
    activity.assert_never_overlapped();
    println!("graceful handovers (virtual time, {LATENCY:?} API latency): {took:?}");
}

fn scrape(leadership: &Arc<Leadership>) -> String {
    let metrics = cnat::observability::metrics::Metrics::new(leadership.clone());
    metrics.encode()
}

#[tokio::test(start_paused = true)]
async fn a_crashed_leader_is_replaced_within_lease_duration_plus_retry_period() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    let activity = Arc::new(Activity::default());
    let replicas = replicas(&server, 5, &activity);
    tokio::time::sleep(TIMING.retry_period * 3).await;
    let leader = leader_of(&replicas, &activity).await;
    let killed = Instant::now();
    let last_write = last_lease_write(&server, &replicas[leader].id);
    replicas[leader].task.abort(); // a crash: nothing is released
    assert!(
        support::until(Duration::from_millis(50), || activity.running().is_empty()).await,
        "work outlived its election"
    );
    let limit = TIMING.lease_duration + TIMING.retry_period;
    assert!(
        support::until(limit, || activity.running().len() == 1).await,
        "no new leader within lease duration + retry period"
    );
    let (new, started) = activity.started_after(killed).unwrap();
    assert_ne!(new, replicas[leader].id);
    assert!(started - killed <= limit, "{:?}", started - killed);
    // Nobody took over before a lease duration had passed since the last renewal.
    assert!(
        started - last_write >= TIMING.lease_duration,
        "{:?}",
        started - last_write
    );
    assert_eq!(holder(&server), new);
    let elected = server.event_reasons("cnat");
    assert_eq!(
        elected.iter().filter(|r| *r == "LeaderElected").count(),
        2,
        "exactly one candidate won the expired lease: {elected:?}"
    );
    assert_eq!(server.unguarded_lease_writes(), 0);
    activity.assert_never_overlapped();
}

#[tokio::test(start_paused = true)]
async fn a_leader_cut_off_from_the_api_stops_within_the_renew_deadline() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    let activity = Arc::new(Activity::default());
    let replicas = replicas(&server, 3, &activity);
    let leader = leader_of(&replicas, &activity).await;
    tokio::time::sleep(TIMING.retry_period * 2 + Duration::from_millis(500)).await;
    let last_write = last_lease_write(&server, &replicas[leader].id);
    replicas[leader].partition.cut();

    let id = replicas[leader].id.clone();
    assert!(
        support::until(TIMING.renew_deadline, || activity.ended(&id).is_some()).await,
        "still reconciling"
    );
    // Counted from when the last successful renewal was sent.
    let stopped = activity.ended(&id).unwrap() - last_write;
    assert!(stopped <= TIMING.renew_deadline, "{stopped:?}");
    assert!(!replicas[leader].leadership.is_leader());

    // The others wait for the lease to expire, then one takes over.
    assert!(support::until(TIMING.lease_duration, || activity.running().len() == 1).await);
    let (new, started) = activity.started_after(last_write).unwrap();
    assert_ne!(new, id);
    assert!(started - last_write >= TIMING.lease_duration);
    activity.assert_never_overlapped();
}

#[tokio::test(start_paused = true)]
async fn a_slow_api_server_never_gives_two_leaders() {
    // 300 ms per request: renewals, takes and releases all race with each other.
    let server = ApiServer::new();
    server.set_latency(Duration::from_millis(300));
    let activity = Arc::new(Activity::default());
    let mut replicas = replicas(&server, 5, &activity);
    for round in 0..4 {
        let leader = leader_of(&replicas, &activity).await;
        tokio::time::sleep(TIMING.retry_period * 2).await;
        let stopping = replicas.remove(leader);
        if round % 2 == 0 {
            stopping.shutdown.cancel();
            stopping.task.await.unwrap();
        } else {
            stopping.task.abort();
            let id = stopping.id.clone();
            assert!(
                support::until(Duration::from_millis(50), || activity.ended(&id).is_some()).await
            );
        }
        let limit = TIMING.lease_duration + TIMING.retry_period + Duration::from_secs(2);
        assert!(
            support::until(limit, || activity.running().len() == 1).await,
            "round {round}: no new leader"
        );
    }
    assert_eq!(activity.runs(), 5);
    assert_eq!(server.unguarded_lease_writes(), 0);
    activity.assert_never_overlapped();
}

#[tokio::test(start_paused = true)]
async fn candidates_racing_for_an_expired_lease_elect_one() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    // A Lease left behind by a replica that is gone; its renewTime is meaningless here.
    server.create(
        Resource::Leases,
        json!({"metadata": {"name": "cnat", "namespace": "cnat-system"},
               "spec": {"holderIdentity": "gone", "leaseDurationSeconds": 15,
                        "renewTime": "2026-11-22T02:00:00.000000Z", "leaseTransitions": 7}}),
    );
    let started = Instant::now();
    let activity = Arc::new(Activity::default());
    let replicas = replicas(&server, 5, &activity);
    // They all saw it at once, all wait one lease duration on their own clocks, all try at once.
    assert!(support::until(TIMING.lease_duration * 2, || activity.runs() == 1).await);
    let (_, at) = activity.started_after(started).unwrap();
    assert!(at - started >= TIMING.lease_duration, "{:?}", at - started);
    tokio::time::sleep(TIMING.lease_duration).await;
    assert_eq!(activity.runs(), 1, "only one won");
    assert_eq!(
        server.get(Resource::Leases, "cnat-system", "cnat").unwrap()["spec"]["leaseTransitions"],
        8
    );
    let lost_races: usize = replicas
        .iter()
        .filter(|r| !r.leadership.is_leader())
        .map(|r| {
            server
                .calls_by(&r.id)
                .iter()
                .filter(|(what, _)| what == "PATCH leases")
                .count()
        })
        .sum();
    assert!(lost_races >= 1, "the others tried and got 409");
    activity.assert_never_overlapped();
}

/// 3000 pending Ats; three replicas whose work is the real reconcile loop. The leader is
/// stopped `after` it started leading; `list` is how long its initial list of Ats takes. The
/// loop must stop and the Lease be released within the step-down grace, the old loop must
/// write nothing after it ended, and a successor must take over at once.
async fn stop_a_busy_leader(after: Duration, list: Duration) -> usize {
    let server = ApiServer::new();
    server.set_latency(Duration::from_millis(20));
    server.set_list_latency(list);
    let names: Vec<String> = (0..3000).map(|i| format!("at-{i}")).collect();
    for name in &names {
        server.create(
            Resource::Ats,
            json!({"metadata": {"name": name, "namespace": "default"},
                   "spec": {"schedule": "2999-01-01T00:00:00Z", "command": "true", "image": "busybox"}}),
        );
    }
    let activity = Arc::new(Activity::default());
    let controller = |id: &str| {
        let (who, log) = (id.to_owned(), activity.clone());
        move |client: kube::Client, stop: CancellationToken| {
            let settings = cnat::operator::controller::Settings {
                namespace: None,
                selector: None,
                concurrency: 32,
                policy: Default::default(),
                signing: cnat::operator::signing::Source::given(
                    cnat::operator::signing::Key::generate().0,
                ),
            };
            let events = support::events(&client, &who);
            let metrics = Arc::new(cnat::observability::metrics::Metrics::new(
                Default::default(),
            ));
            logged(
                who.clone(),
                log.clone(),
                cnat::operator::controller::run(client, settings, events, metrics, stop),
            )
        }
    };
    let mut replicas: Vec<Replica> = (0..3)
        .map(|i| {
            let id = format!("cnat-{i}");
            replica_with(&server, &id, SKEWS[i], controller(&id))
        })
        .collect();
    let leader = leader_of(&replicas, &activity).await;
    tokio::time::sleep(after).await;
    let stopping = replicas.remove(leader);
    let writes = |id: &str| {
        server
            .calls_by(id)
            .into_iter()
            .filter(|(what, _)| what.starts_with("PATCH ats") || what.starts_with("POST pods"))
            .map(|(_, at)| at)
            .collect::<Vec<_>>()
    };
    let before = writes(&stopping.id).len();
    let asked = Instant::now();
    stopping.shutdown.cancel();
    stopping.task.await.unwrap();
    let released = last_lease_write(&server, &stopping.id);
    assert!(
        released - asked <= TIMING.step_down_grace + Duration::from_millis(50),
        "release {:?} after SIGTERM",
        released - asked
    );
    let ended = activity.ended(&stopping.id).unwrap();
    assert!(ended <= released);
    assert!(
        writes(&stopping.id).iter().all(|t| *t <= ended),
        "the old loop wrote after it ended"
    );
    assert_eq!(holder(&server), "", "released");
    // A successor takes over at once.
    assert!(support::until(Duration::from_secs(1), || activity.running().len() == 1).await);
    let (new, started) = activity.started_after(asked).unwrap();
    assert_ne!(new, stopping.id);
    assert!(
        started - asked < Duration::from_millis(500),
        "{:?}",
        started - asked
    );
    activity.assert_never_overlapped();
    before
}

#[tokio::test(start_paused = true)]
async fn a_leader_stopped_amid_thousands_of_reconciles_steps_down_within_the_grace() {
    // 3000 status writes at 20 ms each, 32 at a time, take about 2 s: stop it half-way.
    let written = stop_a_busy_leader(Duration::from_millis(1000), Duration::ZERO).await;
    assert!(
        (100..3000).contains(&written),
        "{written} writes before the stop"
    );
}

#[tokio::test(start_paused = true)]
async fn a_leader_stopped_during_its_initial_list_steps_down_within_the_grace() {
    // kube-runtime holds reconciles until the initial list is in; a graceful stop then waits
    // for a list that never completes. The grace bounds it.
    let written = stop_a_busy_leader(Duration::from_millis(1000), Duration::from_secs(3)).await;
    assert_eq!(written, 0, "still listing");
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
            names.iter().all(|n| phase(s, n) == Some(json!("Running")))
        })
        .await;
    assert!(running);
    for name in &names {
        server.finish_pod("default", &format!("{name}-pod"), 0);
    }
    let done = server
        .wait_for(Duration::from_secs(10), |s| {
            names.iter().all(|n| phase(s, n) == Some(json!("Done")))
        })
        .await;
    assert!(done);
    tokio::time::sleep(Duration::from_millis(300)).await;

    assert_eq!(server.list(Resource::Pods).len(), 50, "one pod per At");
    for name in &names {
        // Each transition told once; two replicas publish their events independently, each
        // after its own writes, so their order across replicas may differ.
        let mut told = server.told(name, 3).await;
        told.sort();
        assert_eq!(told, ["PodCreated", "Scheduled", "Succeeded"], "{name}");
    }
    // Both tried: the losers of each race got AlreadyExists or Conflict, not a second run.
    assert!(server.count("POST pods") >= 50);
    first.abort();
    second.abort();
}

mod scripted {
    //! Election against a scripted API server with paused time: the exact requests and pauses.
    //! The Lease watch (a list and a watch with `fieldSelector`) is answered with an empty list
    //! and a watch that never sends anything, so only the reads and writes follow the script.

    use super::*;
    use http::{Request, Response};
    use http_body_util::BodyExt;
    use kube::client::Body;
    use serde_json::Value;

    fn fixture(name: &str) -> Value {
        let path = format!(
            "{}/tests/fixtures/api-k8s-1.24/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn lease(holder: &str, rv: &str) -> Value {
        let mut lease = fixture("lease-created.json");
        lease["spec"]["holderIdentity"] = holder.into();
        lease["metadata"]["resourceVersion"] = rv.into();
        lease
    }

    /// What the scripted server saw: "METHOD path", the body, and the (paused) time.
    type Seen = Vec<(String, Value, Instant)>;

    /// Answers each request with the next reply, records what it saw.
    fn scripted(replies: Vec<(u16, Value)>) -> (kube::Client, JoinHandle<Seen>) {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut replies = replies.into_iter();
            let mut watches = Vec::new();
            while let Some((request, respond)) = handle.next_request().await {
                let query = request.uri().query().unwrap_or("").to_owned();
                if query.contains("fieldSelector") {
                    if query.contains("watch=true") {
                        watches.push(respond); // never answered
                    } else {
                        let list = json!({"apiVersion": "coordination.k8s.io/v1",
                            "kind": "LeaseList", "metadata": {"resourceVersion": "1"}, "items": []});
                        let body = Body::from(serde_json::to_vec(&list).unwrap());
                        respond.send_response(Response::new(body));
                    }
                    continue;
                }
                let what = format!("{} {}", request.method(), request.uri().path());
                let bytes = request.into_body().collect().await.unwrap().to_bytes();
                let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                seen.push((what, body, Instant::now()));
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

    /// Runs one candidate against the script until `stop_after`, then shuts it down.
    async fn elect(
        namespace: &str,
        replies: Vec<(u16, Value)>,
        stop_after: Duration,
    ) -> (Seen, Arc<Activity>, Arc<Leadership>) {
        let (client, server) = scripted(replies);
        let activity = Arc::new(Activity::default());
        let leadership = Arc::new(Leadership::default());
        let shutdown = CancellationToken::new();
        let log = activity.clone();
        let mut settings = settings("cnat-0", 0);
        settings.namespace = namespace.into();
        // Events go elsewhere, so that they do not take replies from the script.
        let elsewhere = ApiServer::new().client();
        let election = tokio::spawn(leader::run(
            client.clone(),
            settings,
            leadership.clone(),
            support::events(&elsewhere, "cnat-0"),
            std::future::ready(()),
            move |stop| {
                logged("cnat-0".into(), log.clone(), async move {
                    stop.cancelled().await
                })
            },
            shutdown.clone(),
        ));
        tokio::time::sleep(stop_after).await;
        shutdown.cancel();
        election.await.unwrap(); // no panic, and it stops when asked
        drop(client);
        (server.await.unwrap(), activity, leadership)
    }

    const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/fx/leases";
    const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/fx/leases/cnat";

    fn requests(seen: &Seen) -> Vec<String> {
        seen.iter().map(|(r, _, _)| r.clone()).collect()
    }

    /// The Lease is missing, we create it (version 100), then `rest`.
    fn created_then(rest: Vec<(u16, Value)>) -> Vec<(u16, Value)> {
        let mut replies = vec![
            (404, fixture("status-404-not-found.json")),
            (201, lease("cnat-0", "100")),
        ];
        replies.extend(rest);
        replies
    }

    fn conflict() -> (u16, Value) {
        let body = "status-409-conflict-lease-merge-patch-stale-resourceversion.json";
        (409, fixture(body))
    }

    fn created_patched_and_read() -> [String; 4] {
        [
            format!("GET {LEASE}"),
            format!("POST {LEASES}"),
            format!("PATCH {LEASE}"),
            format!("GET {LEASE}"),
        ]
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
        let (seen, activity, leadership) = elect("nope", replies, Duration::from_secs(45)).await;
        assert_eq!(activity.runs(), 0);
        assert!(!leadership.is_leader());
        assert_eq!(
            seen[1].0,
            "POST /apis/coordination.k8s.io/v1/namespaces/nope/leases"
        );
        let gets: Vec<Instant> = seen
            .iter()
            .filter(|(r, _, _)| r.starts_with("GET"))
            .map(|(_, _, t)| *t)
            .collect();
        let pauses: Vec<Duration> = gets.windows(2).map(|w| w[1] - w[0]).collect();
        let retry = TIMING.retry_period;
        assert_eq!(
            pauses,
            [retry, retry * 2, retry * 3, retry * 4, retry * 5, retry * 5],
            "backoff"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_conflict_with_another_holder_ends_leading_without_a_release() {
        let (seen, activity, leadership) = elect(
            "fx",
            created_then(vec![conflict(), (200, lease("cnat-1", "105"))]),
            TIMING.retry_period + Duration::from_millis(500),
        )
        .await;
        assert_eq!(
            requests(&seen),
            created_patched_and_read(),
            "no release after losing the lease"
        );
        assert_eq!(seen[2].1["metadata"]["resourceVersion"], "100");
        assert_eq!(activity.runs(), 1);
        assert!(activity.ended("cnat-0").unwrap() <= seen[3].2 + Duration::from_millis(1));
        assert!(!leadership.is_leader());
    }

    #[tokio::test(start_paused = true)]
    async fn a_foreign_write_to_our_lease_is_renewed_over() {
        let (seen, activity, _) = elect(
            "fx",
            created_then(vec![
                conflict(),
                (200, lease("cnat-0", "103")), // someone labelled it; still ours
                (200, lease("cnat-0", "104")), // renewed on the new version
                (200, lease("", "105")),       // released on shutdown
            ]),
            TIMING.retry_period + Duration::from_millis(500),
        )
        .await;
        let rvs: Vec<&Value> = seen
            .iter()
            .filter(|(r, _, _)| r.starts_with("PATCH"))
            .map(|(_, body, _)| &body["metadata"]["resourceVersion"])
            .collect();
        assert_eq!(rvs, ["100", "103", "104"]);
        assert_eq!(seen.last().unwrap().1["spec"]["holderIdentity"], "");
        assert_eq!(activity.runs(), 1, "kept leading throughout");
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_never_blanks_a_successor() {
        // Our last renewal timed out but a successor took the Lease meanwhile: the release
        // meets a conflict, reads the Lease, and leaves it alone.
        let (seen, _, _) = elect(
            "fx",
            created_then(vec![conflict(), (200, lease("cnat-2", "130"))]),
            Duration::from_millis(500),
        )
        .await;
        assert_eq!(requests(&seen), created_patched_and_read());
        assert_eq!(seen[2].1["spec"]["holderIdentity"], "");
        assert_eq!(seen[2].1["metadata"]["resourceVersion"], "100");
    }
}

/// A reconcile loop that panics (or ends) ends leadership: the Lease is released at once, and
/// the replica competes again and leads again after a retry period.
#[tokio::test(start_paused = true)]
async fn a_reconcile_loop_that_panics_releases_the_lease_and_leads_again() {
    let server = ApiServer::new();
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let replica = replica_with(&server, "cnat-0", 0, move |_client, stop| {
        let run = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move {
            if run == 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                panic!("a bug in the reconcile loop");
            }
            stop.cancelled().await
        }
    });
    let holder = |server: &ApiServer| {
        server
            .get(Resource::Leases, "cnat-system", "cnat")
            .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_owned))
    };
    assert!(
        support::until(TIMING.lease_duration, || holder(&server).as_deref()
            == Some("cnat-0"))
        .await
    );
    // Released (not left to expire) once the loop panicked ...
    assert!(
        support::until(Duration::from_secs(1), || holder(&server).as_deref()
            == Some(""))
        .await,
        "the lease was not released"
    );
    // ... and led again, with a fresh loop.
    assert!(
        support::until(TIMING.lease_duration, || runs
            .load(std::sync::atomic::Ordering::SeqCst)
            == 2
            && replica.leadership.is_leader())
        .await,
        "never led again"
    );
    assert_eq!(holder(&server).as_deref(), Some("cnat-0"));
    replica.shutdown.cancel();
    let _ = replica.task.await;
}

/// A replica as `cnat run` wires it: an At cache of its own, ready and a candidate only once
/// that cache holds every At, and the real reconcile loop while it leads.
struct CachingReplica {
    replica: Replica,
    cache: cnat::operator::cache::AtCache,
}

fn caching_replica(server: &ApiServer, id: &str) -> CachingReplica {
    let (client, partition) = server.named_client(id);
    let shutdown = CancellationToken::new();
    let leadership = Arc::new(Leadership::default());
    let cache = cnat::operator::cache::AtCache::start(&client, None);
    let (work_client, work_cache, who) = (client.clone(), cache.clone(), id.to_owned());
    let task = tokio::spawn(leader::run(
        client.clone(),
        settings(id, 0),
        leadership.clone(),
        support::events(&client, id),
        cache.listed(),
        move |stop| {
            let settings = cnat::operator::controller::Settings {
                namespace: None,
                selector: None,
                concurrency: 8,
                policy: Default::default(),
                signing: cnat::operator::signing::Source::given(
                    cnat::operator::signing::Key::generate().0,
                ),
            };
            cnat::operator::controller::run_with_cache(
                work_cache.clone(),
                work_client.clone(),
                settings,
                support::events(&work_client, &who),
                Arc::new(cnat::observability::metrics::Metrics::new(
                    Default::default(),
                )),
                stop,
            )
        },
        shutdown.clone(),
    ));
    CachingReplica {
        replica: Replica {
            id: id.into(),
            shutdown,
            partition,
            leadership,
            task,
        },
        cache,
    }
}

fn create_ats(server: &ApiServer, n: usize, schedule: &str) {
    for i in 0..n {
        server.create(
            Resource::Ats,
            json!({"metadata": {"name": format!("at-{i}"), "namespace": "default"},
                   "spec": {"schedule": schedule, "command": "true", "image": "busybox"}}),
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_replica_still_listing_ats_neither_competes_for_the_lease_nor_says_it_is_ready() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    create_ats(&server, 100, "2999-01-01T00:00:00Z");
    // The first list takes 30 s, as 100,000 Ats may on a real API server.
    server.set_list_latency(Duration::from_secs(30));
    let started = Instant::now();
    let x = caching_replica(&server, "cnat-0");
    tokio::time::sleep(Duration::from_secs(29)).await;
    let lease_calls = |server: &ApiServer| {
        server
            .calls_by("cnat-0")
            .into_iter()
            .filter(|(what, _)| what.contains("leases"))
            .count()
    };
    assert_eq!(
        lease_calls(&server),
        0,
        "competed before its cache was full"
    );
    assert!(!x.replica.leadership.is_leader());
    let why = x.cache.readiness().unwrap_err().to_string();
    assert!(why.starts_with("listing Ats: "), "{why}");
    // Once the list is in: ready, and leading at once (no other candidate).
    assert!(
        support::until(Duration::from_secs(2), || x.replica.leadership.is_leader()).await,
        "did not lead once its cache was full"
    );
    assert!(started.elapsed() >= Duration::from_secs(30));
    assert_eq!(x.cache.readiness(), Ok(()));
    assert_eq!(x.cache.store().len(), 100);
    assert_eq!(holder(&server), "cnat-0");
    x.replica.shutdown.cancel();
    x.replica.task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_standby_still_listing_leaves_the_lease_to_the_leader_and_takes_it_once_listed() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    create_ats(&server, 100, "2999-01-01T00:00:00Z");
    let old = caching_replica(&server, "cnat-old");
    assert!(support::until(TIMING.lease_duration, || old.replica.leadership.is_leader()).await);
    // The new replica's first list takes 30 s; the old one leads meanwhile.
    server.set_list_latency(Duration::from_secs(30));
    let new = caching_replica(&server, "cnat-new");
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(new.cache.readiness().is_err());
    assert_eq!(holder(&server), "cnat-old");
    // A rolling update stops the old pod only once the new one is ready.
    assert!(support::until(Duration::from_secs(11), || new.cache.readiness().is_ok()).await);
    let asked = Instant::now();
    old.replica.shutdown.cancel();
    old.replica.task.await.unwrap();
    assert!(
        support::until(Duration::from_millis(500), || new
            .replica
            .leadership
            .is_leader())
        .await,
        "the ready standby did not take over within 0.5 s"
    );
    assert!(asked.elapsed() < Duration::from_millis(500));
    assert_eq!(holder(&server), "cnat-new");
    new.replica.shutdown.cancel();
    new.replica.task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_leader_whose_watch_must_relist_keeps_leading_on_the_store_it_has() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    create_ats(&server, 100, "2999-01-01T00:00:00Z");
    // One At due long ago: it runs at once.
    server.create(
        Resource::Ats,
        json!({"metadata": {"name": "due", "namespace": "default"},
               "spec": {"schedule": "2000-01-01T00:00:00Z", "command": "true", "image": "busybox"}}),
    );
    let x = caching_replica(&server, "cnat-0");
    assert!(
        support::until(TIMING.lease_duration, || server
            .get(Resource::Pods, "default", "due-pod")
            .is_some())
        .await,
        "the due At never ran"
    );
    assert!(
        support::until(Duration::from_secs(2), || server
            .get(Resource::Ats, "default", "due")
            .is_some_and(|at| at["status"]["phase"] == "Running"))
        .await
    );
    // The At watch expires and its list takes 30 s.
    server.set_list_latency(Duration::from_secs(30));
    server.expire_watches(Resource::Ats);
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Still leading, still ready, and reconciling from the store it has: the pod ends and the
    // At says DONE long before the list is in.
    server.finish_pod("default", "due-pod", 0);
    assert!(
        support::until(Duration::from_secs(5), || server
            .get(Resource::Ats, "default", "due")
            .is_some_and(|at| at["status"]["phase"] == "Done"))
        .await,
        "the leader stopped reconciling while its watch relisted"
    );
    assert!(x.replica.leadership.is_leader());
    assert_eq!(x.replica.leadership.transitions(), 1);
    assert_eq!(x.cache.readiness(), Ok(()));
    assert_eq!(x.cache.store().len(), 101);
    // And after the list too.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(x.replica.leadership.is_leader());
    assert_eq!(x.replica.leadership.transitions(), 1);
    assert_eq!(holder(&server), "cnat-0");
    x.replica.shutdown.cancel();
    x.replica.task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_leader_whose_renewals_answer_slower_than_the_retry_period_keeps_leading() {
    // A loaded API server: every call takes 1.5 retry periods, well inside the renew deadline.
    // A renewal waits for its answer (it still keeps the Lease) instead of giving up after a
    // retry period and sending another one to a server that is already slow.
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    let activity = Arc::new(Activity::default());
    let replicas = replicas(&server, 1, &activity);
    let leader = leader_of(&replicas, &activity).await;
    server.set_latency(TIMING.retry_period * 3 / 2);
    tokio::time::sleep(TIMING.renew_deadline * 4).await;
    assert!(replicas[leader].leadership.is_leader(), "lost the lease");
    assert_eq!(activity.runs(), 1, "it never stopped leading");
    let renewals = server
        .calls_by(&replicas[leader].id)
        .iter()
        .filter(|(what, _)| what == "PATCH leases")
        .count();
    assert!(renewals >= 10, "it kept renewing: {renewals}");
}

/// A candidate's readying for a handover, as `cnat run` lists a shard's Ats: it takes `takes`.
struct Readying {
    id: String,
    takes: Duration,
    ready: bool,
    calls: Calls,
}

impl leader::handover::Prepare for Readying {
    fn prepare(&self) -> std::pin::Pin<Box<dyn Future<Output = bool> + Send>> {
        self.calls
            .lock()
            .unwrap()
            .push((self.id.clone(), "prepare", Instant::now()));
        let (calls, id, takes, ready) =
            (self.calls.clone(), self.id.clone(), self.takes, self.ready);
        Box::pin(async move {
            tokio::time::sleep(takes).await;
            calls.lock().unwrap().push((id, "ready", Instant::now()));
            ready
        })
    }

    fn discard(&self) {
        self.calls
            .lock()
            .unwrap()
            .push((self.id.clone(), "discard", Instant::now()));
    }
}

type Calls = Arc<Mutex<Vec<(String, &'static str, Instant)>>>;

/// A replica competing for shard 0 of 2, with handovers; its balance counts `replicas` live
/// replicas.
fn shard_replica(
    server: &ApiServer,
    id: &str,
    replicas: usize,
    readying: (Duration, bool),
    calls: &Calls,
    activity: &Arc<Activity>,
) -> Replica {
    let mut replica = sharded(
        server,
        id,
        replicas,
        readying,
        calls,
        std::slice::from_ref(activity),
    );
    replica.0.task = replica.2.remove(0);
    replica.0
}

/// A replica competing for the first `activities.len()` shards of 2 (each logging its runs
/// in its own `Activity`), with handovers, its balance counting `replicas` live replicas;
/// with its balance and one election task per shard (the `Replica`'s own task is a no-op).
fn sharded(
    server: &ApiServer,
    id: &str,
    replicas: usize,
    readying: (Duration, bool),
    calls: &Calls,
    activities: &[Arc<Activity>],
) -> (Replica, Arc<leader::balance::Balance>, Vec<JoinHandle<()>>) {
    let (client, partition) = server.named_client(id);
    let shutdown = CancellationToken::new();
    let leadership = Arc::new(Leadership::default());
    let balance = Arc::new(leader::balance::Balance::new(
        2,
        leadership.clone(),
        TIMING.lease_duration,
    ));
    let view = leader::balance::View {
        replicas,
        ..Default::default()
    };
    balance.set_view(view, Instant::now());
    let prepare = Arc::new(Readying {
        id: id.into(),
        takes: readying.0,
        ready: readying.1,
        calls: calls.clone(),
    });
    let elections = activities
        .iter()
        .enumerate()
        .map(|(shard, activity)| {
            let settings = leader::Settings {
                lease_name: format!("cnat-{shard}-of-2"),
                balance: Some(balance.clone()),
                handover: Some(leader::handover::Handover {
                    prepare: prepare.clone(),
                    limit: TIMING.renew_deadline,
                    on_shutdown: TIMING.renew_deadline,
                }),
                ..settings(id, 0)
            };
            let (who, log) = (id.to_owned(), activity.clone());
            tokio::spawn(leader::run(
                client.clone(),
                settings,
                leadership.clone(),
                support::events(&client, id),
                std::future::ready(()),
                move |stop: CancellationToken| {
                    logged(
                        who.clone(),
                        log.clone(),
                        async move { stop.cancelled().await },
                    )
                },
                shutdown.clone(),
            ))
        })
        .collect();
    let replica = Replica {
        id: id.into(),
        shutdown,
        partition,
        leadership,
        task: tokio::spawn(async {}),
    };
    (replica, balance, elections)
}

/// On a new API server: a leading shard 0 of 2 (readying in no time), then b (readying as
/// `readying` says) beside it; each counts two replicas.
async fn holder_and_candidate(
    server: &ApiServer,
    readying: (Duration, bool),
) -> (Arc<Activity>, Calls, Replica, Replica) {
    server.set_latency(LATENCY);
    let activity = Arc::new(Activity::default());
    let calls = Calls::default();
    let a = shard_replica(
        server,
        "cnat-a",
        2,
        (Duration::ZERO, true),
        &calls,
        &activity,
    );
    assert!(support::until(TIMING.lease_duration, || a.leadership.is_leader()).await);
    let b = shard_replica(server, "cnat-b", 2, readying, &calls, &activity);
    (activity, calls, a, b)
}

/// Shard 0's Lease gets a `told` event (events wait for quiet), and never a `never` one.
async fn assert_told(server: &ApiServer, told: &str, never: &str) {
    let reasons = || server.event_reasons("cnat-0-of-2");
    let came = support::until(Duration::from_secs(10), || {
        reasons().iter().any(|r| r == told)
    });
    assert!(came.await, "{:?}", reasons());
    assert!(!reasons().iter().any(|r| r == never), "{:?}", reasons());
}

fn shard_holder(server: &ApiServer) -> String {
    let lease = server
        .get(Resource::Leases, "cnat-system", "cnat-0-of-2")
        .expect("a lease");
    lease["spec"]["holderIdentity"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(start_paused = true)]
async fn a_stopping_holder_leads_on_until_a_ready_successor_and_hands_it_the_shard() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    let activity = Arc::new(Activity::default());
    let calls = Calls::default();
    let list = Duration::from_secs(3);
    let a = shard_replica(&server, "cnat-a", 3, (list, true), &calls, &activity);
    assert!(support::until(TIMING.lease_duration, || a.leadership.is_leader()).await);
    // Two candidates; both may take the shard (each leads none of its share of one).
    let b = shard_replica(&server, "cnat-b", 3, (list, true), &calls, &activity);
    let c = shard_replica(&server, "cnat-c", 3, (list, true), &calls, &activity);
    tokio::time::sleep(TIMING.retry_period * 2).await;
    assert_eq!(activity.running(), ["cnat-a"]);
    assert!(
        calls.lock().unwrap().is_empty(),
        "nobody readies before asked"
    );
    let asked = Instant::now();
    a.shutdown.cancel();
    a.task.await.unwrap();
    let stopped = activity.ended("cnat-a").expect("a stopped");
    // It led on while a candidate listed (3 s), then stopped.
    assert!(stopped >= asked + list, "{:?}", stopped - asked);
    assert!(
        stopped < asked + list + TIMING.retry_period,
        "{:?}",
        stopped - asked
    );
    let successor = shard_holder(&server);
    assert!(
        ["cnat-b", "cnat-c"].contains(&successor.as_str()),
        "{successor}"
    );
    assert!(
        support::until(Duration::from_secs(1), || activity.running()
            == [successor.clone()])
        .await
    );
    let (started_id, started) = activity.started_after(stopped).expect("a successor leads");
    assert_eq!(started_id, successor);
    // Led within a few API round trips of the holder's stop (no list, no expiry, no retry).
    assert!(
        started - stopped < Duration::from_millis(100),
        "{:?}",
        started - stopped
    );
    let log = calls.lock().unwrap().clone();
    let did = |id: &str, what: &str| {
        log.iter()
            .filter(|(who, w, _)| who == id && *w == what)
            .count()
    };
    let other = if successor == "cnat-b" {
        "cnat-c"
    } else {
        "cnat-b"
    };
    assert_eq!(did(&successor, "prepare"), 1, "{log:?}");
    assert_eq!(did(&successor, "discard"), 0, "{log:?}");
    // The other readied too, and let it go once the successor was named.
    assert_eq!(did(other, "prepare"), 1, "{log:?}");
    assert_eq!(did(other, "discard"), 1, "{log:?}");
    assert_told(&server, "LeaderHandedOver", "LeaderReleased").await;
    assert_eq!(server.unguarded_lease_writes(), 0);
    // What the handover wrote on the Lease is gone.
    let lease = server
        .get(Resource::Leases, "cnat-system", "cnat-0-of-2")
        .unwrap();
    assert!(
        lease["metadata"]["annotations"]
            .as_object()
            .is_none_or(|a| a.is_empty()),
        "{lease}"
    );
    activity.assert_never_overlapped();
    for r in [b, c] {
        r.shutdown.cancel();
        r.task.await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_holder_without_a_ready_successor_releases_the_shard_after_the_limit() {
    let server = ApiServer::new();
    // The candidate cannot ready itself (its list fails).
    let (activity, calls, a, b) =
        holder_and_candidate(&server, (Duration::from_secs(1), false)).await;
    tokio::time::sleep(TIMING.retry_period).await;
    let asked = Instant::now();
    a.shutdown.cancel();
    a.task.await.unwrap();
    let stopped = activity.ended("cnat-a").expect("a stopped");
    // It led on for the whole limit, then released the Lease; b takes it as a free shard.
    assert!(
        stopped >= asked + TIMING.renew_deadline,
        "{:?}",
        stopped - asked
    );
    assert!(stopped < asked + TIMING.renew_deadline + TIMING.retry_period);
    assert!(support::until(TIMING.retry_period * 2, || activity.running() == ["cnat-b"]).await);
    assert_told(&server, "LeaderReleased", "LeaderHandedOver").await;
    let log = calls.lock().unwrap().clone();
    assert_eq!(
        log.iter().filter(|(_, w, _)| *w == "prepare").count(),
        1,
        "{log:?}"
    );
    activity.assert_never_overlapped();
    b.shutdown.cancel();
    b.task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_holder_alone_releases_at_once() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    let activity = Arc::new(Activity::default());
    let calls = Calls::default();
    let a = shard_replica(
        &server,
        "cnat-a",
        1,
        (Duration::ZERO, true),
        &calls,
        &activity,
    );
    assert!(support::until(TIMING.lease_duration, || a.leadership.is_leader()).await);
    let asked = Instant::now();
    a.shutdown.cancel();
    a.task.await.unwrap();
    let stopped = activity.ended("cnat-a").expect("a stopped");
    assert!(
        stopped - asked <= TIMING.step_down_grace,
        "{:?}",
        stopped - asked
    );
    assert_eq!(shard_holder(&server), "");
}

#[tokio::test(start_paused = true)]
async fn a_holder_cut_off_while_handing_over_is_replaced_at_its_expiry_not_after_the_offer() {
    let server = ApiServer::new();
    // b takes 6 s to ready itself.
    let (activity, calls, a, b) =
        holder_and_candidate(&server, (Duration::from_secs(6), true)).await;
    tokio::time::sleep(TIMING.retry_period).await;
    a.shutdown.cancel();
    let asking = || {
        server
            .get(Resource::Leases, "cnat-system", "cnat-0-of-2")
            .is_some_and(|lease| {
                lease["metadata"]["annotations"][leader::record::HANDING_OVER] == "cnat-a"
            })
    };
    assert!(support::until(TIMING.retry_period, asking).await);
    // a is cut off from the API server right after it asked: it never sees b's offer, stops at
    // its renew deadline, and its Lease expires a lease duration after its last renewal.
    a.partition.cut();
    let renewed = last_lease_write(&server, "cnat-a");
    assert!(
        support::until(TIMING.lease_duration * 2, || activity.running()
            == ["cnat-b"])
        .await,
        "b never led"
    );
    let (_, started) = activity.started_after(renewed).expect("b leads");
    // b's offer (6 s after the ask) changed only an annotation: the expiry stays where a's
    // renewal put it (counted from when b saw it; b re-reads every retry period).
    assert!(
        started <= renewed + TIMING.lease_duration + TIMING.retry_period,
        "b led {:?} after a's last renewal",
        started - renewed
    );
    let log = calls.lock().unwrap().clone();
    let did = |what: &str| {
        log.iter()
            .filter(|(who, w, _)| who == "cnat-b" && *w == what)
            .count()
    };
    // It led with what it readied.
    assert_eq!(
        (did("prepare"), did("ready"), did("discard")),
        (1, 1, 0),
        "{log:?}"
    );
    activity.assert_never_overlapped();
    b.shutdown.cancel();
    b.task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_shard_given_up_for_the_balance_is_handed_over_too() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    let shards = [Arc::new(Activity::default()), Arc::new(Activity::default())];
    let calls = Calls::default();
    // a alone leads both shards.
    let (a, a_balance, a_elections) = sharded(
        &server,
        "cnat-a",
        1,
        (Duration::ZERO, true),
        &calls,
        &shards,
    );
    assert!(support::until(TIMING.lease_duration, || a.leadership.leading() == 2).await);
    // b joins; a's next look counts two replicas: its share is one, and it gives one shard up.
    let (b, _, b_elections) = sharded(
        &server,
        "cnat-b",
        2,
        (Duration::from_secs(1), true),
        &calls,
        &shards,
    );
    tokio::time::sleep(TIMING.retry_period).await;
    assert_eq!(b.leadership.leading(), 0, "b takes no shard a holds");
    let view = leader::balance::View {
        replicas: 2,
        fewest_of_others: Some(0),
        ..Default::default()
    };
    a_balance.set_view(view, Instant::now());
    assert!(
        support::until(TIMING.retry_period * 3, || b.leadership.leading() == 1).await,
        "b was handed no shard"
    );
    assert_eq!(a.leadership.leading(), 1);
    // By a handover: b readied once, and nobody released anything.
    let log = calls.lock().unwrap().clone();
    assert_eq!(
        log.iter()
            .filter(|(w, what, _)| w == "cnat-b" && *what == "prepare")
            .count(),
        1,
        "{log:?}"
    );
    let reasons: Vec<String> = (0..2)
        .flat_map(|shard| server.event_reasons(&format!("cnat-{shard}-of-2")))
        .collect();
    let handed = support::until(Duration::from_secs(10), || {
        (0..2).any(|shard| {
            server
                .event_reasons(&format!("cnat-{shard}-of-2"))
                .iter()
                .any(|r| r == "LeaderHandedOver")
        })
    });
    assert!(handed.await, "{reasons:?}");
    let reasons: Vec<String> = (0..2)
        .flat_map(|shard| server.event_reasons(&format!("cnat-{shard}-of-2")))
        .collect();
    assert!(
        !reasons
            .iter()
            .any(|r| r == "LeaderYielded" || r == "LeaderReleased"),
        "{reasons:?}"
    );
    for shard in &shards {
        shard.assert_never_overlapped();
    }
    // And it stays so: nobody gives a shard up at one each.
    tokio::time::sleep(TIMING.lease_duration * 2).await;
    assert_eq!((a.leadership.leading(), b.leadership.leading()), (1, 1));
    for (replica, elections) in [(a, a_elections), (b, b_elections)] {
        replica.shutdown.cancel();
        for election in elections {
            election.await.unwrap();
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_named_successor_that_stops_takes_its_name_back() {
    let server = ApiServer::new();
    let (_, _, a, b) = holder_and_candidate(&server, (Duration::from_secs(1), true)).await;
    tokio::time::sleep(TIMING.retry_period).await;
    let annotation = |key: &str| {
        server
            .get(Resource::Leases, "cnat-system", "cnat-0-of-2")
            .and_then(|lease| {
                lease["metadata"]["annotations"][key]
                    .as_str()
                    .map(str::to_owned)
            })
    };
    a.shutdown.cancel();
    assert!(
        support::until(TIMING.retry_period, || annotation(
            leader::record::HANDING_OVER
        )
        .is_some())
        .await
    );
    // a cannot hand over (cut off); b readies, names itself, then stops before it leads.
    a.partition.cut();
    assert!(
        support::until(TIMING.retry_period * 2, || {
            annotation(leader::record::PREFERRED_HOLDER).as_deref() == Some("cnat-b")
        })
        .await
    );
    b.shutdown.cancel();
    b.task.await.unwrap();
    assert_eq!(annotation(leader::record::PREFERRED_HOLDER), None);
    // Not handed to b, which will never lead it.
    assert_eq!(shard_holder(&server), "cnat-a");
}

#[tokio::test(start_paused = true)]
async fn a_holder_whose_other_replicas_all_left_releases_without_waiting_out_the_limit() {
    let server = ApiServer::new();
    server.set_latency(LATENCY);
    let activity = Arc::new(Activity::default());
    let calls = Calls::default();
    let (mut a, balance, mut elections) = sharded(
        &server,
        "cnat-a",
        2,
        (Duration::ZERO, true),
        &calls,
        std::slice::from_ref(&activity),
    );
    a.task = elections.remove(0);
    assert!(support::until(TIMING.lease_duration, || a.leadership.is_leader()).await);
    // b would list for longer than the handover's limit.
    let b = shard_replica(
        &server,
        "cnat-b",
        2,
        (TIMING.lease_duration * 4, true),
        &calls,
        &activity,
    );
    tokio::time::sleep(TIMING.retry_period).await;
    // Every replica stops at once (helm uninstall): a hands over, b readies for nothing.
    a.shutdown.cancel();
    b.shutdown.cancel();
    b.task.await.unwrap();
    tokio::time::sleep(TIMING.retry_period).await;
    assert_eq!(activity.running(), ["cnat-a"], "a leads on, handing over");
    // a's membership loop, looking on after its shutdown, finds b's membership Lease gone.
    let left = Instant::now();
    balance.set_view(
        leader::balance::View {
            replicas: 1,
            ..Default::default()
        },
        left,
    );
    a.task.await.unwrap();
    let stopped = activity.ended("cnat-a").expect("a stopped");
    // At its next renewal (a retry period at most) and the step-down grace, not the limit.
    assert!(
        stopped - left <= TIMING.retry_period + TIMING.step_down_grace,
        "{:?}",
        stopped - left
    );
    assert_eq!(shard_holder(&server), "");
    assert_told(&server, "LeaderReleased", "LeaderHandedOver").await;
    activity.assert_never_overlapped();
}
