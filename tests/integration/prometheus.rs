//! A real Prometheus server (Debian's 2.42, installed by scripts/fetch-prometheus) scrapes the
//! real `cnat run` binary, which runs against the project's test API server, and the test asks
//! it with PromQL what a user would: is there one leader, how many Ats are in which phase, is an
//! At overdue (while a quota refuses its pod) and does that clear once its pod is created, how
//! late did runs start. Then every query of the Grafana dashboard must parse and return data.

use crate::support;

use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::apiserver::{ApiServer, Resource};
use support::https::{client, post_with};
use support::ports::{bound, ANY_PORTS};
use support::process::{cnat, dev_certs, free_port, kubeconfig};

const WAIT: Duration = Duration::from_secs(60);

/// Kills a child process when dropped, so a failed assertion leaves nothing running.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A real Prometheus scraping `target` every second.
fn prometheus(dir: &Path, target: SocketAddr) -> (Killed, SocketAddr) {
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n  - job_name: cnat\n    static_configs: [{{targets: ['{target}'], labels: {{pod: cnat-0}}}}]\n"
        ),
    )
    .unwrap();
    let listen = free_port();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={listen}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("no prometheus on PATH: run scripts/fetch-prometheus (scripts/test installs it)");
    (Killed(child), listen)
}

/// A plain HTTP/1.0 GET (so the answer is never chunked): status and body, `None` when nothing
/// listens yet.
fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: prometheus\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, response.split_once("\r\n\r\n")?.1.to_owned()))
}

/// An instant query's result vector (None until Prometheus answers).
fn query(prometheus: SocketAddr, promql: &str) -> Option<Vec<Value>> {
    let encoded: String = form_urlencoded::byte_serialize(promql.as_bytes()).collect();
    let (status, body) = get(prometheus, &format!("/api/v1/query?query={encoded}"))?;
    let answer: Value = serde_json::from_str(&body).ok()?;
    assert_eq!(status, 200, "{promql}: {answer}");
    answer["data"]["result"].as_array().cloned()
}

/// A range query over `since` until now: whether it parses, and its series.
fn query_range(prometheus: SocketAddr, promql: &str, since: u64) -> (Value, Vec<Value>) {
    let encoded: String = form_urlencoded::byte_serialize(promql.as_bytes()).collect();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let path = format!("/api/v1/query_range?query={encoded}&start={since}&end={now}&step=1");
    let (_, body) = get(prometheus, &path).expect("prometheus answers");
    let answer: Value = serde_json::from_str(&body).unwrap();
    let series = answer["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    (answer, series)
}

/// The single value of `promql` (`or vector(0)` makes an empty answer 0).
fn value(prometheus: SocketAddr, promql: &str) -> Option<f64> {
    let result = query(prometheus, &format!("({promql}) or vector(0)"))?;
    result.first()?["value"][1].as_str()?.parse().ok()
}

fn until(what: &str, check: impl Fn() -> bool) {
    let started = Instant::now();
    while !check() {
        assert!(started.elapsed() < WAIT, "never: {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_real_prometheus_answers_what_users_ask_and_every_dashboard_query_returns_data() {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let server = ApiServer::new();
    let config = kubeconfig(runtime.block_on(server.serve_http()), "prometheus");
    let dir = std::env::temp_dir().join(format!("cnat-prometheus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (certs, [cert, key]) = dev_certs("prometheus");
    let flags = [
        ANY_PORTS[0].to_owned(),
        ANY_PORTS[1].to_owned(),
        "--identity=cnat-0".into(),
        cert,
        key,
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut operator = Killed(cnat(&flags, &config).stdout(Stdio::null()).spawn().unwrap());
    let (admin, webhook) = bound(&mut operator.0, true, String::new);
    let (_prometheus, prom) = prometheus(&dir, admin);

    // What Prometheus asks every user first: one leader.
    until("one leader", || {
        value(prom, "sum(cnat_leader)") == Some(1.0)
    });
    assert_eq!(value(prom, "count(cnat_leader)"), Some(1.0));

    // A quota refuses pods: an At due a minute ago stays PENDING, overdue (more than 30 s late).
    server.refuse_creates(
        Resource::Pods,
        Some("status-403-forbidden-quota-exceeded.json"),
    );
    let due = (chrono::Utc::now() - chrono::Duration::seconds(60)).to_rfc3339();
    server.create(
        Resource::Ats,
        json!({"apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
               "metadata": {"name": "late", "namespace": "team-a"},
               "spec": {"schedule": due, "command": "true", "image": "busybox"}}),
    );
    until("the At is overdue in team-a", || {
        query(prom, "cnat_ats_overdue").is_some_and(|r| {
            r.len() == 1 && r[0]["metric"]["at_namespace"] == "team-a" && r[0]["value"][1] == "1"
        })
    });
    assert_eq!(value(prom, "sum(cnat_ats{phase=\"PENDING\"})"), Some(1.0));
    // Printed for a reader (`cargo nextest run --test integration -E 'test(/^prometheus::/)' --no-capture`).
    println!("cnat_ats_overdue: {:?}", query(prom, "cnat_ats_overdue"));
    until("the refusals are counted", || {
        value(
            prom,
            "sum(cnat_pods_refused_total{reason=\"quota_exceeded\"})",
        )
        .is_some_and(|v| v >= 1.0)
    });

    // Some admission traffic: an allowed create, a defaulting, and a body that is no review.
    let https = client(&certs.join("ca.crt"), rustls::DEFAULT_VERSIONS);
    runtime.block_on(async {
        for (path, fixture) in [
            ("/validating", "validating-create.json"),
            ("/mutating", "mutating-create.json"),
        ] {
            let capture: Value = serde_json::from_str(
                &std::fs::read_to_string(format!(
                    "{}/tests/fixtures/admission-review-k8s-1.24/{fixture}",
                    env!("CARGO_MANIFEST_DIR")
                ))
                .unwrap(),
            )
            .unwrap();
            let body = serde_json::to_vec(&capture["review"]).unwrap();
            let (status, _) = post_with(&https, webhook, path, &[], body).await.unwrap();
            assert_eq!(status, 200);
        }
        let (status, _) = post_with(&https, webhook, "/validating", &[], b"{}".to_vec())
            .await
            .unwrap();
        assert_eq!(status, 400);
    });

    // The quota frees up: the pod is created on the next retry and the overdue series clears.
    server.refuse_creates(Resource::Pods, None);
    until("no At overdue", || {
        value(prom, "sum(cnat_ats_overdue)") == Some(0.0)
    });
    until("the At is RUNNING", || {
        value(prom, "sum(cnat_ats{phase=\"RUNNING\"})") == Some(1.0)
    });
    // It ran at least a minute late (its schedule was in the past, then the quota).
    println!(
        "cnat_ats_overdue after: {:?}",
        query(prom, "cnat_ats_overdue")
    );
    println!(
        "lateness p50, p99: {:?}, {:?}",
        value(
            prom,
            "histogram_quantile(0.5, sum by (le) (cnat_run_lateness_seconds_bucket))"
        ),
        value(
            prom,
            "histogram_quantile(0.99, sum by (le) (cnat_run_lateness_seconds_bucket))"
        )
    );
    let p50 = value(
        prom,
        "histogram_quantile(0.5, sum by (le) (cnat_run_lateness_seconds_bucket))",
    )
    .unwrap();
    assert!((60.0..=300.0).contains(&p50), "p50 lateness {p50}");
    until("the admission counters are scraped", || {
        value(prom, "sum(cnat_admission_requests_total)").is_some_and(|v| v >= 3.0)
    });
    assert_eq!(
        value(
            prom,
            "sum(cnat_admission_requests_total{allowed=\"false\"})"
        ),
        Some(1.0)
    );

    // Every query of the dashboard parses and has data over the run, once every series has been
    // scraped a few times (a rate needs two samples in its window).
    for counter in ["cnat_pods_refused_total", "cnat_admission_requests_total"] {
        let scraped = format!("min(count_over_time({counter}[1m]))");
        until(&scraped, || value(prom, &scraped).is_some_and(|n| n >= 3.0));
    }
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/charts/cnat/dashboards/cnat.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "30s");
            let (answer, series) = query_range(prom, &expr, since);
            assert_eq!(
                answer["status"], "success",
                "{}: {expr}: {answer}",
                panel["title"]
            );
            assert!(
                !series.is_empty(),
                "{}: {expr} returned no data",
                panel["title"]
            );
            checked += 1;
        }
    }
    assert!(checked >= 13, "{checked} queries");
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(certs);
}
