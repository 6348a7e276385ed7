//! Graceful handover with real processes: three `cnat run` replicas (release build, default
//! election timings) against the fake API server over HTTP on loopback, as in a rolling upgrade:
//! the leader gets SIGTERM and is replaced by a new replica, round after round. Measured on the
//! API server's side: SIGTERM -> the new leader's first request for pods (its reconcile loop
//! starting: every replica caches the Ats, only the leader watches pods), and an At due 50 ms
//! after the SIGTERM -> its pod.
//!
//!     cargo bench --bench handover          # 5 rounds
//!     cargo bench --bench handover -- 20    # any number of rounds

#[path = "../tests/support/apiserver.rs"]
mod apiserver;

use apiserver::{ApiServer, Resource};
use serde_json::json;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // test runners asking for tests: this binary has none
    }
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5);
    let server = ApiServer::new();
    let addr = server.serve_http().await;
    let kubeconfig = std::env::temp_dir().join(format!(
        "cnat-bench-handover-{}.kubeconfig",
        std::process::id()
    ));
    std::fs::write(&kubeconfig, ApiServer::kubeconfig(addr, "cnat-system")).unwrap();

    let mut replicas: Vec<(String, Child)> = (0..3)
        .map(|i| {
            let id = format!("cnat-{i}");
            let child = spawn(&kubeconfig, &id);
            (id, child)
        })
        .collect();
    let mut handovers = Vec::new();
    let mut lateness = Vec::new();
    for (round, next_id) in (0..rounds).zip(3..) {
        // Let the replicas settle: a leader, and the others watching.
        let led = poll(Duration::from_secs(30), || holder(&server).is_some()).await;
        assert!(led, "no leader");
        tokio::time::sleep(Duration::from_secs(3)).await;
        let leader = holder(&server).unwrap();
        let index = replicas.iter().position(|(id, _)| *id == leader).unwrap();
        let (_, mut stopping) = replicas.remove(index);

        let name = format!("due-{round}");
        let due = chrono::Utc::now() + chrono::Duration::milliseconds(50);
        server.create(
            Resource::Ats,
            json!({"metadata": {"name": name, "namespace": "default"},
                   "spec": {"schedule": due.to_rfc3339(), "command": "true", "image": "busybox"}}),
        );
        let due_instant = Instant::now() + Duration::from_millis(50);
        let signalled = Instant::now();
        sigterm(&stopping);

        let pod = format!("{name}-pod");
        let created = poll(Duration::from_secs(30), || {
            server.pod_created_at("default", &pod).is_some()
        })
        .await;
        assert!(
            created,
            "round {round}: the At due during the handover never ran"
        );
        let took = server
            .calls_by("http")
            .into_iter()
            .map(|(what, at)| (what, at.into_std()))
            .find(|(what, at)| what == "GET pods" && *at > signalled)
            .map(|(_, at)| at - signalled)
            .expect("the new leader lists pods");
        let new = holder(&server).unwrap_or_default();
        assert_ne!(new, leader, "round {round}: leadership did not move");
        handovers.push(took);
        let pod_at = server.pod_created_at("default", &pod).unwrap();
        lateness.push(pod_at.saturating_duration_since(due_instant));

        let _ = stopping.wait();
        let id = format!("cnat-{next_id}");
        let child = spawn(&kubeconfig, &id);
        replicas.push((id, child));
    }
    assert_eq!(server.unguarded_lease_writes(), 0);
    println!("| rounds | SIGTERM -> new leader reconciling (p50 / max) | At due 50 ms after SIGTERM: pod after due (p50 / max) |");
    println!("|---|---|---|");
    println!(
        "| {rounds} | {} | {} |",
        summary(handovers),
        summary(lateness)
    );
    for (_, mut child) in replicas {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_file(kubeconfig);
}

fn spawn(kubeconfig: &std::path::Path, id: &str) -> Child {
    let admin = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    Command::new(env!("CARGO_BIN_EXE_cnat"))
        .args([
            "run",
            "--log-format",
            "text",
            "--log",
            "warn",
            "--webhooks=false",
        ])
        .arg(format!("--identity={id}"))
        .arg(format!("--admin-addr={admin}"))
        .env("KUBECONFIG", kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the cnat binary")
}

fn holder(server: &ApiServer) -> Option<String> {
    let lease = server.get(Resource::Leases, "cnat-system", "cnat")?;
    lease["spec"]["holderIdentity"]
        .as_str()
        .filter(|h| !h.is_empty())
        .map(str::to_owned)
}

fn sigterm(child: &Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

fn summary(mut samples: Vec<Duration>) -> String {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    format!("{:.0?} / {:.0?}", at(0.5), at(1.0))
}

async fn poll(timeout: Duration, check: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    check()
}
