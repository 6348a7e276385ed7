//! Admission throughput and latency of the real `cnat run` binary over TLS with keep-alive:
//! `wrk -t1 -c16 -d10s --latency` posting a captured AdmissionReview to the validating webhook,
//! with logging on as in production (JSON, info). Needs `wrk` (Debian package `wrk`).
//!
//!     cargo bench --bench webhook                  # validating, then mutating
//!     cargo bench --bench webhook -- -d30s         # other wrk arguments

#[path = "../tests/support/apiserver.rs"]
mod apiserver;

use apiserver::ApiServer;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // test runners asking for tests: this binary has none
    }
    let extra: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a.starts_with('-') && a != "--bench")
        .collect();
    let dir = std::env::temp_dir().join(format!("cnat-bench-webhook-{}", std::process::id()));
    let server = ApiServer::new();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        &kubeconfig,
        ApiServer::kubeconfig(server.serve_http().await, "cnat-system"),
    )
    .unwrap();
    run(&[
        env!("CARGO_BIN_EXE_cnat"),
        "certs",
        "--out-dir",
        dir.to_str().unwrap(),
    ]);

    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let admin = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut operator = Command::new(env!("CARGO_BIN_EXE_cnat"))
        .args(["run", "--log-format=json", "--log=info"])
        .arg(format!("--webhook-addr=127.0.0.1:{port}"))
        .arg(format!("--admin-addr={admin}"))
        .arg(format!("--tls-cert={}", dir.join("tls.crt").display()))
        .arg(format!("--tls-key={}", dir.join("tls.key").display()))
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the webhook server did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    println!("| webhook | requests/s | p50 | p99 |");
    println!("|---|---|---|---|");
    for (name, fixture) in [
        ("validating", "validating-create.json"),
        ("mutating", "mutating-create.json"),
    ] {
        let script = dir.join(format!("{name}.lua"));
        std::fs::write(&script, lua(fixture)).unwrap();
        let url = format!("https://127.0.0.1:{port}/{name}?timeout=10s");
        let mut wrk = vec![
            "wrk",
            "-t1",
            "-c16",
            "-d10s",
            "--latency",
            "-s",
            script.to_str().unwrap(),
        ];
        wrk.extend(extra.iter().map(String::as_str));
        wrk.push(&url);
        let report = run(&wrk);
        println!(
            "| {name} | {} | {} | {} |",
            field(&report, "Requests/sec:"),
            field(&report, "50%"),
            field(&report, "99%")
        );
        assert!(!report.contains("Non-2xx"), "{report}");
    }
    operator.kill().unwrap();
    let _ = operator.wait();
    let _ = std::fs::remove_dir_all(dir);
}

/// A wrk script that posts the captured AdmissionReview.
fn lua(fixture: &str) -> String {
    let path = format!(
        "{}/tests/fixtures/admission-review-k8s-1.24/{fixture}",
        env!("CARGO_MANIFEST_DIR")
    );
    let capture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let body = serde_json::to_string(&capture["review"]).unwrap();
    format!("wrk.method = \"POST\"\nwrk.headers[\"Content-Type\"] = \"application/json\"\nwrk.body = [==[{body}]==]\n")
}

fn run(command: &[&str]) -> String {
    let output = Command::new(command[0])
        .args(&command[1..])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", command[0]));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The value after `label` in wrk's report.
fn field(report: &str, label: &str) -> String {
    report
        .lines()
        .find_map(|l| l.trim().strip_prefix(label))
        .map(|v| v.split_whitespace().next().unwrap_or("?").to_owned())
        .unwrap_or_else(|| "?".into())
}
