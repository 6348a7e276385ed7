//! Observability of the real `cnat run` binary: spans reach an OTLP collector over gRPC and over
//! HTTP with their attributes, the resource and the caller's trace; JSON log lines carry the
//! same trace ids; `/metrics` counts what happened; an unreachable collector slows nothing down.

use crate::support;

use serde_json::{json, Value};
use std::io::BufRead;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::apiserver::{ApiServer, Resource};
use support::https::{client, post_with, Https};
use support::otlp::{Collector, Pki, Received, ServerTls};
use support::ports::{bound, ANY_PORTS};
use support::process::{cnat, dev_certs, get, holder, kubeconfig, probe, sigterm};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

/// A running `cnat run` with its API server, ports, CA and captured stdout.
struct Operator {
    child: Killed,
    server: ApiServer,
    admin: SocketAddr,
    webhook: SocketAddr,
    https: Https,
    stdout: Arc<Mutex<Vec<String>>>,
    kubeconfig: PathBuf,
}

impl Operator {
    /// Starts `cnat run` as leader-to-be `cnat-<name>` with `env`, JSON logs at `log`.
    async fn start(name: &str, env: &[(&str, String)], log: &str) -> Operator {
        let server = ApiServer::new();
        let kubeconfig = kubeconfig(server.serve_http().await, name);
        let (certs, [cert, key]) = dev_certs(name);
        let flags = [
            ANY_PORTS[0].to_owned(),
            ANY_PORTS[1].to_owned(),
            format!("--identity=cnat-{name}"),
            format!("--log={log}"),
            cert,
            key,
            "--log-format=json".into(),
            "--lease-duration=3s".into(),
            "--renew-deadline=2s".into(),
            "--retry-period=500ms".into(),
            "--shutdown-delay=100ms".into(),
            "--shutdown-timeout=10s".into(),
        ];
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let mut command = cnat(&flags, &kubeconfig);
        for (var, value) in env {
            command.env(var, value);
        }
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let (lines, pipe) = (stdout.clone(), child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        let (admin, webhook) = bound(&mut child, true, || stdout.lock().unwrap().join("\n"));
        let operator = Operator {
            child: Killed(child),
            server,
            admin,
            webhook,
            https: client(&certs.join("ca.crt"), rustls::DEFAULT_VERSIONS),
            stdout,
            kubeconfig,
        };
        // The Lease names it before it has confirmed; its own gauge says when it leads.
        let ready = support::until(Duration::from_secs(10), || {
            probe(admin, "/readyz") == Some(200)
                && holder(&operator.server).as_deref() == Some(&format!("cnat-{name}"))
                && get(admin, "/metrics").is_some_and(|(_, m)| m.contains("\ncnat_leader 1\n"))
        });
        assert!(ready.await, "cnat-{name} never became ready and leader");
        operator
    }

    /// Creates an At due at `due` and waits for its pod.
    async fn run_at(&self, name: &str, due: &str) {
        self.server.create(
            Resource::Ats,
            json!({"metadata": {"name": name, "namespace": "default"},
                   "spec": {"schedule": due, "command": "true", "image": "busybox"}}),
        );
        let pod = format!("{name}-pod");
        let created = support::until(Duration::from_secs(10), || {
            self.server.get(Resource::Pods, "default", &pod).is_some()
        });
        assert!(created.await, "no pod for At {name}");
    }

    /// Posts a captured AdmissionReview (kube-apiserver's path and headers, plus `extra`).
    async fn admit(&self, fixture: &str, extra: &[(&str, &str)]) -> (u16, Value) {
        let path = format!(
            "{}/tests/fixtures/admission-review-k8s-1.24/{fixture}",
            env!("CARGO_MANIFEST_DIR")
        );
        let capture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut headers = vec![("user-agent", "kube-apiserver-admission")];
        headers.extend_from_slice(extra);
        let url = capture["path"].as_str().unwrap();
        let body = serde_json::to_vec(&capture["review"]).unwrap();
        let (status, body) = post_with(&self.https, self.webhook, url, &headers, body)
            .await
            .unwrap();
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    fn metrics(&self) -> String {
        let (status, body) = get(self.admin, "/metrics").expect("admin server");
        assert_eq!(status, 200, "{body}");
        body
    }

    /// SIGTERM; returns how long the process took to exit.
    async fn stop(mut self) -> (Duration, Vec<Value>) {
        let signalled = Instant::now();
        sigterm(&self.child.0);
        let exit = loop {
            match self.child.0.try_wait().unwrap() {
                Some(exit) => break exit,
                None => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        };
        assert!(exit.success(), "{exit:?}");
        let took = signalled.elapsed();
        let _ = std::fs::remove_file(&self.kubeconfig);
        // The reader thread sees EOF once the process is gone; give it a moment to drain.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let lines = std::mem::take(&mut *self.stdout.lock().unwrap());
        let logs = lines
            .iter()
            .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
            .collect();
        (took, logs)
    }
}

/// The collector's endpoint, and its protocol unless `None` (the default: http/protobuf).
/// The operator process, killed if a failed test drops it still running.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn otlp_env(endpoint: String, protocol: Option<&str>) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment.name=test".into(),
        ),
    ];
    if let Some(protocol) = protocol {
        env.push(("OTEL_EXPORTER_OTLP_PROTOCOL", protocol.into()));
    }
    env
}

fn span<'a>(spans: &'a [Received], name: &str) -> &'a Received {
    spans
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no {name} span in {spans:#?}"))
}

fn log_line<'a>(logs: &'a [Value], message: &str) -> &'a Value {
    logs.iter()
        .find(|l| l["message"].as_str().is_some_and(|m| m.contains(message)))
        .unwrap_or_else(|| panic!("no log line with {message:?} in {logs:#?}"))
}

/// Spans of a reconcile and of an admission request reach the collector when the process exits;
/// the admission continues the caller's trace; logs carry the ids of the span they were written in.
async fn spans_reach_the_collector(
    name: &str,
    protocol: Option<&str>,
    collector: Collector,
    endpoint: String,
    tls: &[(&'static str, String)],
) {
    let mut env = otlp_env(endpoint, protocol);
    env.extend_from_slice(tls);
    // As the chart sets them from the downward API (the Lease stays in the context namespace).
    env.push(("POD_NAME", format!("cnat-{name}-7d9f8")));
    env.push(("POD_NAMESPACE", "cnat-system".into()));
    let operator = Operator::start(name, &env, "info,cnat::admission::webhook=debug").await;
    operator.run_at("now", "2019-04-12T10:12:00Z").await;
    let traceparent = format!("00-{TRACE_ID}-{PARENT_ID}-01");
    let (status, review) = operator
        .admit(
            "validating-create-dryrun.json",
            &[("traceparent", &traceparent)],
        )
        .await;
    assert_eq!(
        (status, &review["response"]["allowed"]),
        (200, &json!(false))
    );
    let (_, logs) = operator.stop().await;
    let spans = collector.spans();

    let admission = span(&spans, "admission");
    assert_eq!(admission.trace_id, TRACE_ID);
    assert_eq!(admission.parent_span_id, PARENT_ID);
    let attributes = &admission.attributes;
    assert_eq!(attributes["webhook"], "validating");
    assert_eq!(attributes["operation"], "CREATE");
    assert_eq!(
        attributes["kind"],
        "cnat.programming-kubernetes.info/v1alpha1/At"
    );
    assert_eq!(attributes["at.namespace"], "capture");
    assert_eq!(attributes["allowed"], "false");
    assert!(
        attributes["denial.reason"].contains("spec.schedule"),
        "{attributes:?}"
    );
    let latency: f64 = attributes["latency.ms"].parse().unwrap();
    assert!(latency > 0.0 && latency < 1000.0, "{latency}");

    let reconcile = spans
        .iter()
        .find(|s| {
            s.name == "reconcile"
                && s.attributes.get("action").map(String::as_str) == Some("create-pod")
        })
        .unwrap_or_else(|| panic!("no reconcile span that created the pod in {spans:#?}"));
    let attributes = &reconcile.attributes;
    assert_eq!(attributes["at.namespace"], "default");
    assert_eq!(attributes["at.name"], "now");
    assert_eq!(attributes["phase.before"], "Pending");
    assert_eq!(attributes["phase.after"], "Running");
    assert!(!attributes.contains_key("error"), "{attributes:?}");

    for span in [admission, reconcile] {
        let resource = &span.resource;
        assert_eq!(resource["service.name"], "cnat");
        assert_eq!(resource["service.version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(resource["service.instance.id"], format!("cnat-{name}"));
        assert_eq!(resource["deployment.environment.name"], "test");
        assert_eq!(resource["k8s.pod.name"], format!("cnat-{name}-7d9f8"));
        assert_eq!(resource["k8s.namespace.name"], "cnat-system");
    }

    // The log line of the pod's creation comes from the status write queued behind the pods in
    // flight: a child of the reconcile that created the pod, in its trace.
    let write = spans
        .iter()
        .find(|s| s.name == "status-write" && s.parent_span_id == reconcile.span_id)
        .unwrap_or_else(|| panic!("no status-write under the reconcile in {spans:#?}"));
    assert_eq!(write.trace_id, reconcile.trace_id);
    assert_eq!(write.attributes["phase"], "Running");
    assert!(!write.attributes.contains_key("error"), "{write:?}");
    let created = log_line(&logs, "runs the command");
    assert_eq!(created["trace_id"], reconcile.trace_id.as_str());
    assert_eq!(created["span_id"], write.span_id.as_str());
    let reviewed = log_line(&logs, "admission review");
    assert_eq!(reviewed["trace_id"], TRACE_ID);
    assert_eq!(reviewed["span_id"], admission.span_id.as_str());
    // Lines outside any span carry no ids.
    assert!(log_line(&logs, "cnat started").get("trace_id").is_none());
}

#[tokio::test]
async fn spans_reach_a_collector_over_grpc() {
    let (collector, addr) = Collector::grpc().await;
    spans_reach_the_collector(
        "grpc",
        Some("grpc"),
        collector,
        format!("http://{addr}"),
        &[],
    )
    .await;
}

#[tokio::test]
async fn spans_reach_a_collector_over_http_protobuf_the_default_protocol() {
    let (collector, addr) = Collector::http().await;
    spans_reach_the_collector("http", None, collector, format!("http://{addr}"), &[]).await;
}

/// The variables that point cnat at `dir`'s CA and, when `mutual`, its client certificate.
fn tls_env(dir: &std::path::Path, mutual: bool) -> Vec<(&'static str, String)> {
    let file = |name: &str| dir.join(name).display().to_string();
    let mut env = vec![("OTEL_EXPORTER_OTLP_CERTIFICATE", file("ca.crt"))];
    if mutual {
        env.push(("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", file("client.crt")));
        env.push(("OTEL_EXPORTER_OTLP_CLIENT_KEY", file("client.key")));
    }
    env
}

/// A folder of its own for a test's certificates, empty.
fn cert_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cnat-otlp-tls-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[tokio::test]
async fn spans_reach_a_collector_over_tls_with_a_private_ca_for_both_protocols() {
    let (pki, dir) = (Pki::new(), cert_dir("oneway"));
    pki.write(&dir);
    let tls = ServerTls::new(&pki, false);
    let (collector, addr) = Collector::tls(true, tls.clone()).await;
    let endpoint = format!("https://127.0.0.1:{}", addr.port());
    spans_reach_the_collector(
        "tls-grpc",
        Some("grpc"),
        collector,
        endpoint,
        &tls_env(&dir, false),
    )
    .await;
    let (collector, addr) = Collector::tls(false, tls).await;
    let endpoint = format!("https://localhost:{}", addr.port());
    spans_reach_the_collector("tls-http", None, collector, endpoint, &tls_env(&dir, false)).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sends admission requests until the collector holds a span named `admission`, or `tries`
/// requests 100 ms apart went by.
async fn admitted_span_arrives(operator: &Operator, collector: &Collector, tries: usize) -> bool {
    let arrived = || collector.spans().iter().any(|s| s.name == "admission");
    for _ in 0..tries {
        operator.admit("validating-create.json", &[]).await;
        if arrived() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    arrived()
}

#[tokio::test]
async fn a_collector_that_requires_a_client_certificate_gets_spans_only_from_one_that_has_it() {
    let (pki, dir) = (Pki::new(), cert_dir("mutual"));
    pki.write(&dir);
    for (grpc, protocol) in [(true, "grpc"), (false, "http/protobuf")] {
        let tls = ServerTls::new(&pki, true);
        let (collector, addr) = Collector::tls(grpc, tls.clone()).await;
        let mut env = otlp_env(format!("https://127.0.0.1:{}", addr.port()), Some(protocol));
        env.push(("OTEL_BSP_SCHEDULE_DELAY", "50".into()));
        let without = [env.clone(), tls_env(&dir, false)].concat();
        let operator = Operator::start(&format!("no-client-{grpc}"), &without, "info").await;
        assert!(!admitted_span_arrives(&operator, &collector, 20).await);
        let (_, logs) = operator.stop().await;
        assert!(tls.refused.load(std::sync::atomic::Ordering::SeqCst) > 0);
        assert!(collector.spans().is_empty());
        let failed: Vec<&Value> = logs
            .iter()
            .filter(|l| {
                l["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("spans could not be exported"))
            })
            .collect();
        assert_eq!(failed.len(), 1, "reported once a minute: {logs:#?}");
        // The exporters say "broken pipe" or "network error"; the reason is the collector's alert.
        let reason = failed[0]["tls"].as_str().unwrap_or_default();
        assert!(
            reason.ends_with("ended the TLS connection: received fatal alert: CertificateRequired"),
            "{protocol}: {:#?}",
            failed[0]
        );

        let with = [env, tls_env(&dir, true)].concat();
        let operator = Operator::start(&format!("client-{grpc}"), &with, "info").await;
        assert!(
            admitted_span_arrives(&operator, &collector, 100).await,
            "{protocol}"
        );
        operator.stop().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_collector_that_does_not_verify_is_reported_once_and_slows_no_admission() {
    let (collector_pki, other, dir) = (Pki::new(), Pki::new(), cert_dir("wrong-ca"));
    // cnat trusts another CA than the one that signed the collector's certificate.
    other.write(&dir);
    let (collector, addr) = Collector::tls(true, ServerTls::new(&collector_pki, false)).await;
    let mut env = otlp_env(format!("https://127.0.0.1:{}", addr.port()), Some("grpc"));
    env.push(("OTEL_BSP_SCHEDULE_DELAY", "20".into()));
    env.extend(tls_env(&dir, false));
    let wrong = Operator::start("wrong-ca", &env, "info").await;
    let baseline = Operator::start("wrong-ca-baseline", &[], "info").await;
    latencies(&baseline, 20).await;
    latencies(&wrong, 20).await;
    let normal = latencies(&baseline, 200).await;
    let with_wrong_ca = latencies(&wrong, 200).await;
    let (median, worst) = (with_wrong_ca[100], with_wrong_ca[199]);
    assert!(
        median <= 2.0 * normal[100] + 20.0 && worst < 1000.0,
        "with a collector that does not verify: median {median:.2} ms, worst {worst:.2} ms; normal: median {:.2} ms, worst {:.2} ms",
        normal[100],
        normal[199]
    );
    let (_, logs) = wrong.stop().await;
    baseline.stop().await;
    assert!(collector.spans().is_empty());
    let reports: Vec<&Value> = logs
        .iter()
        .filter(|l| {
            l["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("the trace collector's certificate does not verify"))
        })
        .collect();
    assert_eq!(reports.len(), 1, "at most once a minute: {logs:#?}");
    assert_eq!(reports[0]["level"], "WARN");
    let error = reports[0]["error"].as_str().unwrap();
    assert!(error.contains("UnknownIssuer"), "{error}");
    assert_eq!(
        reports[0]["ca"],
        format!(
            "OTEL_EXPORTER_OTLP_CERTIFICATE={}",
            dir.join("ca.crt").display()
        )
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_rotated_ca_and_client_certificate_are_used_without_a_restart() {
    let (first, second, dir) = (Pki::new(), Pki::new(), cert_dir("rotate"));
    first.write(&dir);
    for (grpc, protocol) in [(true, "grpc"), (false, "http/protobuf")] {
        first.write(&dir);
        let tls = ServerTls::new(&first, true);
        let (collector, addr) = Collector::tls(grpc, tls.clone()).await;
        let mut env = otlp_env(format!("https://127.0.0.1:{}", addr.port()), Some(protocol));
        env.push(("OTEL_BSP_SCHEDULE_DELAY", "50".into()));
        env.extend(tls_env(&dir, true));
        let operator = Operator::start(&format!("rotate-{grpc}"), &env, "info").await;
        assert!(
            admitted_span_arrives(&operator, &collector, 100).await,
            "{protocol}: before"
        );
        // Both sides move to a new CA; the collector drops its connections. Only a client that
        // reads the new CA and client certificate gets through again.
        second.write(&dir);
        tls.rotate(&second, true);
        let before = collector.spans().len();
        let arrived_again = {
            let mut arrived = false;
            for _ in 0..100 {
                operator.admit("validating-create.json", &[]).await;
                if collector.spans().len() > before {
                    arrived = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            arrived
        };
        assert!(arrived_again, "{protocol}: no span after the rotation");
        let (_, logs) = operator.stop().await;
        log_line(&logs, "reloaded the trace collector's TLS files");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_log_directive_is_refused_at_start() {
    let output = cnat(
        &["--log=info,cnat=loud"],
        std::path::Path::new("/nonexistent"),
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("cnat: --log / CNAT_LOG \"info,cnat=loud\": ")
            && stderr.contains("use RUST_LOG syntax, e.g. info,cnat=debug"),
        "{stderr}"
    );
}

/// A new connection is a full handshake with the files as they are: a CA taken out of cnat's
/// bundle is not trusted again through a resumed TLS session, though the collector would resume.
#[tokio::test]
async fn a_ca_removed_from_the_bundle_is_not_trusted_through_a_resumed_session() {
    let (pki, other, dir) = (Pki::new(), Pki::new(), cert_dir("resume"));
    pki.write(&dir);
    let tls = ServerTls::new(&pki, false);
    let (collector, addr) = Collector::tls(true, tls.clone()).await;
    let mut env = otlp_env(format!("https://127.0.0.1:{}", addr.port()), Some("grpc"));
    env.push(("OTEL_BSP_SCHEDULE_DELAY", "50".into()));
    env.extend(tls_env(&dir, false));
    let operator = Operator::start("resume", &env, "info").await;
    assert!(admitted_span_arrives(&operator, &collector, 100).await);
    // cnat now trusts another CA only; the collector keeps its certificate and sessions.
    other.write(&dir);
    tls.drop_connections();
    let before = collector.spans().len();
    for _ in 0..20 {
        operator.admit("validating-create.json", &[]).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        collector.spans().len(),
        before,
        "a span went over a resumed session"
    );
    let (_, logs) = operator.stop().await;
    log_line(&logs, "the trace collector's certificate does not verify");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_collector_tls_file_stops_the_start_with_one_line_naming_it() {
    let dir = cert_dir("bad-files");
    Pki::new().write(&dir);
    std::fs::write(dir.join("garbage.key"), "not a key\n").unwrap();
    let file = |name: &str| dir.join(name).display().to_string();
    let cases = [
        (
            vec![("OTEL_EXPORTER_OTLP_CERTIFICATE", file("missing.crt"))],
            format!("OTEL_EXPORTER_OTLP_CERTIFICATE={}: cannot read it: No such file or directory", file("missing.crt")),
        ),
        (
            vec![("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", file("client.key"))],
            format!("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE={}: no PEM certificate in it (expected -----BEGIN CERTIFICATE-----)", file("client.key")),
        ),
        (
            vec![
                ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", file("client.crt")),
                ("OTEL_EXPORTER_OTLP_CLIENT_KEY", file("garbage.key")),
            ],
            format!("OTEL_EXPORTER_OTLP_CLIENT_KEY={}: no usable PEM private key in it", file("garbage.key")),
        ),
        (
            vec![("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", file("client.crt"))],
            format!("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE={} is set but OTEL_EXPORTER_OTLP_CLIENT_KEY is not", file("client.crt")),
        ),
    ];
    for (vars, expected) in cases {
        let mut command = cnat(&[], std::path::Path::new("/nonexistent"));
        command.env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "https://otel-gateway.observability:4317",
        );
        command.env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc");
        for (var, value) in &vars {
            command.env(var, value);
        }
        let output = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.starts_with(&format!("cnat: TLS to the trace collector: {expected}")),
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_traces_endpoint_sampler_and_service_name_variables_are_honoured() {
    let (collector, addr) = Collector::http().await;
    // The signal's own endpoint wins over the generic one, and is used as is (with its path).
    let mut env = otlp_env("http://127.0.0.1:9".into(), Some("http/protobuf"));
    let traces = format!("http://{addr}/v1/traces");
    env.push(("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", traces));
    env.push(("OTEL_SERVICE_NAME", "cnat-prod".into()));
    env.push(("OTEL_TRACES_SAMPLER", "parentbased_traceidratio".into()));
    env.push(("OTEL_TRACES_SAMPLER_ARG", "0".into()));
    let operator = Operator::start("sampler", &env, "info").await;
    operator.run_at("now", "2019-04-12T10:12:00Z").await;
    let unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    for traceparent in [format!("00-{TRACE_ID}-{PARENT_ID}-01"), unsampled.into()] {
        let (status, _) = operator
            .admit("validating-create.json", &[("traceparent", &traceparent)])
            .await;
        assert_eq!(status, 200);
    }
    operator.stop().await;
    // Ratio 0 records no new trace; a caller's sampled trace is continued, an unsampled not.
    let spans = collector.spans();
    assert_eq!(spans.len(), 1, "{spans:#?}");
    assert_eq!(
        (spans[0].name.as_str(), spans[0].trace_id.as_str()),
        ("admission", TRACE_ID)
    );
    assert_eq!(spans[0].resource["service.name"], "cnat-prod");
}

#[tokio::test]
async fn nothing_is_exported_without_an_endpoint_and_ids_still_reach_the_logs() {
    // A protocol but no endpoint: no exporter (not one sending to the default localhost:4317).
    let env = vec![("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".to_owned())];
    let operator = Operator::start("noexport", &env, "info,cnat::admission::webhook=debug").await;
    let traceparent = format!("00-{TRACE_ID}-{PARENT_ID}-01");
    operator
        .admit("validating-create.json", &[("traceparent", &traceparent)])
        .await;
    let (_, logs) = operator.stop().await;
    assert_eq!(log_line(&logs, "admission review")["trace_id"], TRACE_ID);
    assert_eq!(log_line(&logs, "cnat started")["exporting_traces"], false);
}

/// Admission latencies (ms) of `count` sequential requests.
async fn latencies(operator: &Operator, count: usize) -> Vec<f64> {
    let mut took = Vec::with_capacity(count);
    for _ in 0..count {
        let started = Instant::now();
        let (status, _) = operator.admit("validating-create.json", &[]).await;
        assert_eq!(status, 200);
        took.push(started.elapsed().as_secs_f64() * 1e3);
    }
    took.sort_by(f64::total_cmp);
    took
}

#[tokio::test]
async fn an_unreachable_collector_slows_neither_admissions_nor_exit() {
    // A collector that accepts connections and never answers: exports hang until their timeout.
    let blackhole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut env = otlp_env(
        format!("http://{}", blackhole.local_addr().unwrap()),
        Some("grpc"),
    );
    env.push(("OTEL_BSP_SCHEDULE_DELAY", "20".into()));
    env.push(("OTEL_EXPORTER_OTLP_TIMEOUT", "30000".into()));
    let stuck = Operator::start("blackhole", &env, "info").await;
    let baseline = Operator::start("baseline", &[], "info").await;

    latencies(&baseline, 20).await; // warm up both
    latencies(&stuck, 20).await;
    let normal = latencies(&baseline, 200).await;
    let with_stuck_exporter = latencies(&stuck, 200).await;
    let (median, worst) = (with_stuck_exporter[100], with_stuck_exporter[199]);
    // A blocking exporter would take the 30 s export timeout; scheduling noise takes milliseconds.
    assert!(
        median <= 2.0 * normal[100] + 20.0 && worst < 1000.0,
        "with a stuck collector: median {median:.2} ms, worst {worst:.2} ms; normal: median {:.2} ms, worst {:.2} ms",
        normal[100],
        normal[199]
    );
    // The exporter did try: its connection waits in the blackhole's accept queue.
    blackhole.set_nonblocking(true).unwrap();
    assert!(blackhole.accept().is_ok(), "the exporter never connected");

    let (took, _) = stuck.stop().await;
    // Shutdown delay 100 ms, then at most 3 s for the flush.
    assert!(took < Duration::from_secs(5), "exit took {took:?}");
    baseline.stop().await;
}

#[tokio::test]
async fn metrics_count_what_happened() {
    let operator = Operator::start("metrics", &[], "warn").await;
    let before = operator.metrics();
    assert!(before.contains("\ncnat_leader 1\n"), "{before}");
    assert!(
        before.contains("\ncnat_leader_transitions_total 1\n"),
        "{before}"
    );
    assert!(
        before.contains("\ncnat_run_lateness_seconds_count 0\n"),
        "{before}"
    );

    // Due in two seconds: the pod comes a few milliseconds late.
    let due = chrono::Utc::now() + chrono::Duration::seconds(2);
    let due = due.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    operator.run_at("soon", &due).await;
    operator.admit("validating-create-dryrun.json", &[]).await;
    operator.admit("mutating-create.json", &[]).await;
    let (status, _) = post_with(
        &operator.https,
        operator.webhook,
        "/validating",
        &[],
        b"not json".to_vec(),
    )
    .await
    .unwrap();
    assert_eq!(status, 400);

    let running = support::until(Duration::from_secs(5), || {
        operator
            .metrics()
            .contains("\ncnat_ats{phase=\"RUNNING\"} 1\n")
    });
    assert!(running.await, "{}", operator.metrics());
    operator.server.finish_pod("default", "soon-pod", 0);
    let done = support::until(Duration::from_secs(5), || {
        operator
            .metrics()
            .contains("\ncnat_ats{phase=\"DONE\"} 1\n")
    });
    assert!(done.await, "{}", operator.metrics());

    let metrics = operator.metrics();
    for series in [
        "cnat_ats{phase=\"PENDING\"} 0",
        "cnat_ats{phase=\"RUNNING\"} 0",
        "cnat_run_lateness_seconds_count 1",
        "cnat_run_lateness_seconds_bucket{le=\"1.0\"} 1",
        "cnat_admission_requests_total{webhook=\"validating\",operation=\"CREATE\",allowed=\"false\"} 1",
        "cnat_admission_requests_total{webhook=\"mutating\",operation=\"CREATE\",allowed=\"true\"} 1",
        "cnat_admission_requests_total{webhook=\"validating\",operation=\"UNKNOWN\",allowed=\"false\"} 1",
        "cnat_admission_duration_seconds_count{webhook=\"validating\"} 2",
        "cnat_admission_duration_seconds_count{webhook=\"mutating\"} 1",
        "cnat_leader 1",
    ] {
        assert!(metrics.contains(&format!("\n{series}\n")), "{series} missing in\n{metrics}");
    }
    // PENDING (written once), RUNNING (pod created), DONE: at least three successful reconciles.
    let ok = value(&metrics, "cnat_reconciles_total{result=\"ok\"}");
    assert!(ok >= 3.0, "{metrics}");
    assert_eq!(value(&metrics, "cnat_reconcile_duration_seconds_count"), ok);
    let late = value(&metrics, "cnat_run_lateness_seconds_sum");
    assert!((0.0..1.0).contains(&late), "{late}");
    operator.stop().await;
}

/// The value of the sample `series` in an OpenMetrics text.
fn value(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{metrics}"))
}
