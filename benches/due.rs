//! How fast Ats due at the same instant get their pods, how fast they report DONE once their pods
//! end, and how much memory the operator holds. Runs the real release `cnat` binary as its own
//! process against the fake API server over HTTP on loopback, with writes costing what they cost
//! on a real API server (2 ms each through one storage lane, 8 admitted at once: 1000 pod
//! creates take about 2 s, as measured on kube-apiserver v1.24 + etcd on this machine). Each
//! size is also reported as a ratio to the floor: the same number of bare pod creates over 8
//! connections, measured in the same run.
//!
//! Then the API server goes down (every connection dropped, as when it is killed) while 100 Ats
//! fall due, for 6 s (the leader keeps its Lease) and for 16 s (past the renew deadline: it
//! steps down and must win the Lease again), and the bench reports how soon after the server is
//! back each pod comes.
//!
//! Sizes from 20,000 up run a different scenario: that many Ats already PENDING as a previous
//! leader left them (status already right), one of them due the moment the operator becomes
//! leader; it reports how soon that At's pod comes, how many writes the operator makes, and its
//! memory, also while 5,000 more Ats are created. Then a second replica starts (a candidate,
//! caching every At), and the leader gets SIGTERM 50 ms before another At is due.
//!
//!     cargo bench --bench due            # 100 and 1000 Ats, then the outages
//!     cargo bench --bench due -- --real  # the same burst on a real kube-apiserver (KUBEBUILDER_ASSETS)
//!     cargo bench --bench due -- --real --kwok 1000  # on KWOK nodes beside the stand-in, 10,000 pending
//!     cargo bench --bench due -- --real --vs-jobs 1000  # 1000 Jobs, 1000 Ats, 1000 Jobs: requests and CPU
//!     cargo bench --bench due -- --real --vs-jobs --kwok 1000  # the same, the pods on KWOK nodes
//!     cargo bench --bench due -- --real --vs-jobs --only-v1 1000  # the same, the CRD serving v1 alone
//!     cargo bench --bench due -- --real 100000  # pending Ats, a rolling step, five handovers
//!     cargo bench --bench due -- --real --rolling 50000  # a rolling replacement of 3 replicas
//!     cargo bench --bench due -- --real --shards=6 100000 300000  # Lease shards, 3 replicas
//!     cargo bench --bench due -- --real --shards=6 --write-memory 30000  # a writing replica's memory
//!     cargo bench --bench due -- 5000    # any sizes (no outages)
//!     cargo bench --bench due -- 100000  # 100,000 pending Ats

#[path = "../tests/support/apiserver.rs"]
mod apiserver;
#[allow(dead_code)] // the benches use part of it
#[path = "../tests/support/envtest.rs"]
mod envtest;
#[path = "support/jobs.rs"]
mod jobs;
#[path = "support/kwok.rs"]
mod kwok;
#[allow(dead_code)] // the benches use part of it
#[path = "../tests/support/ports.rs"]
mod ports;
#[path = "support/real.rs"]
mod real;
#[path = "support/rolling.rs"]
mod rolling;
#[allow(dead_code)] // the benches use part of it
#[path = "support/rss.rs"]
mod rss;
#[path = "../tests/support/service.rs"]
mod service;
#[path = "support/shards.rs"]
mod shards;

use apiserver::{ApiServer, Resource};
use futures::StreamExt;
use serde_json::json;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LEAD: Duration = Duration::from_secs(4);
/// How long a candidate gets to list and cache every At before the leader is stopped.
const CANDIDATE_SETTLES: Duration = Duration::from_secs(20);
/// Sizes from this one up run the pending scenario.
const PENDING_SCENARIO: usize = 20_000;
/// A real API server's cost per write (see the module comment).
const WRITE_COST: Duration = Duration::from_millis(2);

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // test runners asking for tests: this binary has none
    }
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if std::env::args().any(|a| a == "--rolling") {
        rolling::run(sizes.first().copied().unwrap_or(50_000)).await;
        return;
    }
    let shards = std::env::args().find_map(|a| a.strip_prefix("--shards=")?.parse().ok());
    if let Some(shards) = shards {
        let sizes = if sizes.is_empty() {
            vec![100_000]
        } else {
            sizes
        };
        shards::run(shards, &sizes).await;
        return;
    }
    if std::env::args().any(|a| a == "--real") && std::env::args().any(|a| a == "--vs-jobs") {
        let kwok = std::env::args().any(|a| a == "--kwok");
        let only_v1 = std::env::args().any(|a| a == "--only-v1");
        jobs::run(sizes.first().copied().unwrap_or(1000), kwok, only_v1).await;
        return;
    }
    if std::env::args().any(|a| a == "--real") && std::env::args().any(|a| a == "--kwok") {
        let pending = std::env::args().find_map(|a| a.strip_prefix("--pending=")?.parse().ok());
        kwok::run(&sizes, pending).await;
        return;
    }
    if std::env::args().any(|a| a == "--real") {
        let sizes = if sizes.is_empty() {
            vec![100, 1000]
        } else {
            sizes
        };
        let (pending, bursts): (Vec<usize>, Vec<usize>) =
            sizes.into_iter().partition(|n| *n >= PENDING_SCENARIO);
        if !bursts.is_empty() {
            real::run(&bursts).await;
        }
        if !pending.is_empty() {
            real::pending_all(&pending).await;
        }
        return;
    }
    let outages = sizes.is_empty();
    let sizes = if sizes.is_empty() {
        vec![100, 1000]
    } else {
        sizes
    };
    println!("| Ats due at once | bare creates (floor) | pod created after due (first / p50 / max) | last pod / floor | DONE after pod ended, half the pods ending at once | DONE after pod ended, the other half paced 1 per 2 ms | operator RSS |");
    println!("|---|---|---|---|---|---|---|");
    let (pending_sizes, sizes): (Vec<usize>, Vec<usize>) =
        sizes.into_iter().partition(|n| *n >= PENDING_SCENARIO);
    for n in sizes {
        run(n).await;
    }
    if !pending_sizes.is_empty() {
        println!();
        println!("| Ats pending | leader -> due At's pod | status writes / events until settled | RSS settled | RSS max while 5,000 more are created | candidate RSS | At due 50 ms after the leader's SIGTERM: pod after due |");
        println!("|---|---|---|---|---|---|---|");
        for n in pending_sizes {
            pending(n).await;
        }
    }
    if outages {
        println!();
        println!("| API server down | Ats due meanwhile | pod created after the server was back (first / p50 / max) | pods |");
        println!("|---|---|---|---|");
        for down in [6, 16] {
            outage(100, Duration::from_secs(down)).await;
        }
    }
}

/// `n` Ats fall due in the middle of an API server outage lasting `down`.
async fn outage(n: usize, down: Duration) {
    let (server, kubeconfig) = modelled_server(&format!("outage-{}", down.as_secs())).await;
    let lead = LEAD + down / 2;
    let due = chrono::Utc::now() + chrono::Duration::from_std(lead).unwrap();
    let names: Vec<String> = (0..n).map(|i| format!("at-{i}")).collect();
    for name in &names {
        server.create(
            Resource::Ats,
            json!({"metadata": {"name": name, "namespace": "default"},
                   "spec": {"schedule": due.to_rfc3339(), "command": "true", "image": "busybox"}}),
        );
    }
    let _operator = spawn_operator(&kubeconfig);
    let pending = poll(&server, LEAD, |s| {
        names.iter().all(|a| {
            s.get(Resource::Ats, "default", a)
                .is_some_and(|v| written_pending(&v))
        })
    })
    .await;
    assert!(pending, "the Ats were not all PENDING before the outage");
    server.set_down(true);
    tokio::time::sleep(down).await;
    server.set_down(false);
    let back = Instant::now();
    let after = pods_after(&server, &names, back, Duration::from_secs(120)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Pod names are fixed, so a repeated create (its answer lost in the outage) gets a 409.
    let pods = server.list(Resource::Pods).len();
    assert_eq!(pods, n);
    println!(
        "| {:.0?} | {n} | {} | {pods} ({} creates sent) |",
        down,
        first_p50_max(after),
        server.count("POST pods")
    );
    let _ = std::fs::remove_file(kubeconfig);
}

/// The floor: `n` bare pod creates over 8 connections against the same modelled server.
async fn bare_creates(n: usize) -> Duration {
    let server = ApiServer::new();
    server.set_write_cost(WRITE_COST);
    let addr = server.serve_http().await;
    let config =
        kube::config::Kubeconfig::from_yaml(&ApiServer::kubeconfig(addr, "default")).unwrap();
    let config = kube::Config::from_custom_kubeconfig(config, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(client, "default");
    let started = Instant::now();
    futures::stream::iter(0..n)
        .for_each_concurrent(8, |i| {
            let pods = pods.clone();
            async move {
                let pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("bare-{i}")},
                    "spec": {"containers": [{"name": "c", "image": "busybox"}]},
                }))
                .unwrap();
                pods.create(&Default::default(), &pod).await.unwrap();
            }
        })
        .await;
    started.elapsed()
}

async fn run(n: usize) {
    let floor = bare_creates(n).await;
    let (server, kubeconfig) = modelled_server(&n.to_string()).await;

    // Time for every At's PENDING status and event (two writes each) before they fall due, so
    // the burst is measured alone.
    let lead = LEAD + WRITE_COST * 5 * n as u32;
    let due_instant = Instant::now() + lead;
    let due = chrono::Utc::now() + chrono::Duration::from_std(lead).unwrap();
    for i in 0..n {
        server.create(
            Resource::Ats,
            json!({"metadata": {"name": format!("at-{i}"), "namespace": "default"},
                   "spec": {"schedule": due.to_rfc3339(), "command": "true", "image": "busybox"}}),
        );
    }
    let operator = spawn_operator(&kubeconfig);

    let names: Vec<String> = (0..n).map(|i| format!("at-{i}")).collect();
    let settled = poll(&server, lead, |s| {
        names.iter().all(|a| {
            s.get(Resource::Ats, "default", a)
                .is_some_and(|v| written_pending(&v))
        })
    })
    .await;
    assert!(
        settled && Instant::now() < due_instant,
        "the PENDING writes did not settle before the due time"
    );
    let late = pods_after(&server, &names, due_instant, lead + Duration::from_secs(60)).await;
    let early = names.iter().any(|a| {
        server
            .pod_created_at("default", &format!("{a}-pod"))
            .unwrap()
            + Duration::from_millis(10)
            < due_instant
    });
    assert!(!early, "a pod was created before its At was due");

    // Let the RUNNING writes settle, then every pod ends at once.
    let running = poll(&server, Duration::from_secs(60), |s| {
        names.iter().all(|a| {
            s.get(Resource::Ats, "default", a)
                .is_some_and(|v| v["status"]["phase"] == "Running")
        })
    })
    .await;
    assert!(running, "not every At reached RUNNING");
    let (burst, paced) = names.split_at(n / 2);
    let burst_done = finish(&server, burst, Duration::ZERO).await;
    let paced_done = finish(&server, paced, Duration::from_millis(2)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss = rss_kib(&operator);
    assert_eq!(server.count("POST pods"), n, "a command ran twice");

    let last = *late.iter().max().unwrap();
    println!(
        "| {n} | {floor:.2?} | {} | {:.2}x | {} | {} | {:.1} MiB |",
        first_p50_max(late),
        last.as_secs_f64() / floor.as_secs_f64(),
        summary(burst_done),
        summary(paced_done),
        rss as f64 / 1024.0
    );
    let _ = std::fs::remove_file(kubeconfig);
}

/// Waits (up to `timeout`) for the pod of every At in `ats`, and returns when each came after
/// `since`.
async fn pods_after(
    server: &ApiServer,
    ats: &[String],
    since: Instant,
    timeout: Duration,
) -> Vec<Duration> {
    let pod = |a: &String| format!("{a}-pod");
    let created = poll(server, timeout, |s| {
        ats.iter()
            .all(|a| s.pod_created_at("default", &pod(a)).is_some())
    })
    .await;
    assert!(created, "not every pod was created");
    ats.iter()
        .map(|a| {
            server
                .pod_created_at("default", &pod(a))
                .unwrap()
                .saturating_duration_since(since)
        })
        .collect()
}

/// A test API server with the modelled write cost, served over HTTP, and a kubeconfig for it
/// (named after `label`).
async fn modelled_server(label: &str) -> (ApiServer, std::path::PathBuf) {
    let server = ApiServer::new();
    server.set_write_cost(WRITE_COST);
    let addr = server.serve_http().await;
    let kubeconfig = std::env::temp_dir().join(format!(
        "cnat-bench-{}-{label}.kubeconfig",
        std::process::id()
    ));
    std::fs::write(&kubeconfig, ApiServer::kubeconfig(addr, "default")).unwrap();
    (server, kubeconfig)
}

/// The operator process, killed when dropped (also when the bench panics).
struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The operator as in production: leader election and the webhooks on, logs at warn.
fn spawn_operator(kubeconfig: &std::path::Path) -> Operator {
    spawn_operator_with_admin(kubeconfig).0
}

/// `spawn_operator`, also returning its admin (metrics) address.
fn spawn_operator_with_admin(kubeconfig: &std::path::Path) -> (Operator, std::net::SocketAddr) {
    let dir = kubeconfig.with_extension("certs");
    let certs = Command::new(envtest::cnat_binary())
        .args(["certs", "--out-dir", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(certs.status.success());
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    };
    let admin = free();
    let child = Command::new(envtest::cnat_binary())
        .args(["run", "--log-format", "text", "--log", "warn"])
        .arg(format!("--admin-addr={admin}"))
        .arg(format!("--webhook-addr={}", free()))
        .arg(format!("--tls-cert={}", dir.join("tls.crt").display()))
        .arg(format!("--tls-key={}", dir.join("tls.key").display()))
        .env("KUBECONFIG", kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the cnat binary");
    (Operator(child), admin)
}

fn rss_kib(operator: &Operator) -> u64 {
    rss::rss_kib(&operator.0.id().to_string())
}

fn first_p50_max(mut samples: Vec<Duration>) -> String {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    format!("{:.0?} / {:.0?} / {:.0?}", at(0.0), at(0.5), at(1.0))
}

fn summary(mut samples: Vec<Duration>) -> String {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    format!("{:.0?} / {:.0?} / {:.0?}", at(0.5), at(0.99), at(1.0))
}

/// Ends the pods of `ats` (`gap` apart) and returns how long after its pod each At said DONE.
async fn finish(server: &ApiServer, ats: &[String], gap: Duration) -> Vec<Duration> {
    let mut ended = Vec::with_capacity(ats.len());
    for at in ats {
        server.finish_pod("default", &format!("{at}-pod"), 0);
        ended.push(Instant::now());
        if !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
    }
    let done = poll(server, Duration::from_secs(60), |s| {
        ats.iter().all(|a| s.at_done_at("default", a).is_some())
    })
    .await;
    assert!(done, "not every At reached DONE");
    ats.iter()
        .zip(ended)
        .map(|(a, end)| {
            server
                .at_done_at("default", a)
                .unwrap()
                .saturating_duration_since(end)
        })
        .collect()
}

/// Whether an At (as the test server serves it) has the `Pending` status a leader writes: its
/// `scheduledTime`, not only the schema default every At shows from its creation on.
fn written_pending(at: &serde_json::Value) -> bool {
    at["status"]["phase"] == "Pending" && at["status"]["scheduledTime"].is_string()
}

/// Checks every 20 ms: the server stamps each event as it happens, so polling lazily changes no
/// measurement and leaves the CPU to the operator.
async fn poll(server: &ApiServer, timeout: Duration, check: impl Fn(&ApiServer) -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check(server) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check(server)
}

/// `n` Ats PENDING with the status a leader wrote for them, plus one already due, then the
/// operator starts.
async fn pending(n: usize) {
    use cnat::operator::reconcile::decide::{decide, PodObservation};
    let (server, kubeconfig) = modelled_server(&format!("pending-{n}")).await;
    let now = chrono::Utc::now();
    let create = |name: String, schedule: chrono::DateTime<chrono::Utc>, settled: bool| {
        let mut at = json!({"metadata": {"name": name, "namespace": "default", "generation": 1},
               "spec": {"schedule": schedule.to_rfc3339(), "command": "true", "image": "busybox"}});
        if settled {
            let typed: cnat::api::At = serde_json::from_value(at.clone()).unwrap();
            // As a leader wrote it a minute ago, when even the due one was still ahead.
            let then = now - chrono::Duration::minutes(1);
            let decided = decide(
                &typed,
                &PodObservation::NotCached,
                then,
                &Default::default(),
            );
            at["status"] = serde_json::to_value(decided.status.unwrap()).unwrap();
        }
        server.create(Resource::Ats, at);
    };
    for i in 0..n {
        create(format!("at-{i:06}"), now + chrono::Duration::hours(1), true);
    }
    // In the middle of the list, as likely as any to be reconciled last.
    create(format!("at-{:06}-due", n / 2), now, true);

    let (operator, admin) = spawn_operator_with_admin(&kubeconfig);
    let due_pod = format!("at-{:06}-due-pod", n / 2);
    let ran = poll(&server, Duration::from_secs(300), |s| {
        s.pod_created_at("default", &due_pod).is_some()
    })
    .await;
    assert!(
        ran,
        "the due At never got its pod; requests: {} status writes, {} lease writes, {} lists",
        server.count("PATCH ats/status"),
        server.count("PATCH leases") + server.count("POST leases"),
        server.count("GET ats")
    );
    let led = server
        .calls_by("http")
        .into_iter()
        .find(|(what, _)| what.starts_with("POST leases") || what.starts_with("PATCH leases"))
        .map(|(_, at)| at.into_std())
        .expect("the operator took the Lease");
    let to_pod = server
        .pod_created_at("default", &due_pod)
        .unwrap()
        .saturating_duration_since(led);

    // Settled: every At in the operator's cache, and no write for 3 s.
    let loaded = poll(&server, Duration::from_secs(300), |_| {
        real::metric_sum(admin, "cnat_ats{") > n as u64
    })
    .await;
    assert!(loaded, "the operator never cached every At");
    let mut last = (0, Instant::now());
    while last.1.elapsed() < Duration::from_secs(3) {
        let writes = server.count("PATCH ats/status") + server.count("POST events");
        if writes != last.0 {
            last = (writes, Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (writes, events) = (
        server.count("PATCH ats/status"),
        server.count("POST events"),
    );
    let rss_settled = rss_kib(&operator);

    // 5,000 more, as fast as the test server takes them; sample memory until they are PENDING.
    let mut rss_max = rss_settled;
    let later = now + chrono::Duration::hours(2);
    for i in 0..5000 {
        server.create(
            Resource::Ats,
            json!({"metadata": {"name": format!("new-{i:04}"), "namespace": "default"},
                   "spec": {"schedule": later.to_rfc3339(), "command": "true", "image": "busybox"}}),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        rss_max = rss_max.max(rss_kib(&operator));
        let done = (0..5000).all(|i| {
            server
                .get(Resource::Ats, "default", &format!("new-{i:04}"))
                .is_some_and(|v| written_pending(&v))
        });
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A candidate caches them too; then the leader gets SIGTERM 50 ms before an At is due.
    let (candidate, _) = spawn_operator_with_admin(&kubeconfig);
    tokio::time::sleep(CANDIDATE_SETTLES).await;
    let candidate_rss = rss_kib(&candidate);
    let due = chrono::Utc::now() + chrono::Duration::milliseconds(50);
    let due_instant = Instant::now() + Duration::from_millis(50);
    server.create(
        Resource::Ats,
        json!({"metadata": {"name": "handover-due", "namespace": "default"},
               "spec": {"schedule": due.to_rfc3339(), "command": "true", "image": "busybox"}}),
    );
    let status = Command::new("kill")
        .args(["-TERM", &operator.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let ran = poll(&server, Duration::from_secs(60), |s| {
        s.pod_created_at("default", "handover-due-pod").is_some()
    })
    .await;
    assert!(ran, "the At due at the handover never ran");
    let handover_late = server
        .pod_created_at("default", "handover-due-pod")
        .unwrap()
        .saturating_duration_since(due_instant);
    println!(
        "| {n} | {to_pod:.0?} | {writes} / {events} | {:.0} MiB | {:.0} MiB | {:.0} MiB | {handover_late:.0?} |",
        rss_settled as f64 / 1024.0,
        rss_max as f64 / 1024.0,
        candidate_rss as f64 / 1024.0
    );
    let _ = std::fs::remove_file(kubeconfig);
}
