//! The real `cnat run` binary against the fake API server over HTTP: it serves probes, takes the
//! Lease, reconciles, and on SIGTERM stops reconciling, releases the Lease, turns unready, keeps
//! serving for the shutdown delay, and exits 0. Bad flags fail fast with a clear message.

use crate::support;

use serde_json::json;
use std::net::{TcpListener, TcpStream};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};
use support::apiserver::{ApiServer, Resource};
use support::ports::{bound, ANY_PORTS};
use support::process::{cnat, dev_certs, holder, kubeconfig, probe, sigterm};

#[tokio::test]
async fn a_replica_leads_reconciles_and_shuts_down_in_order() {
    let server = ApiServer::new();
    let config = kubeconfig(server.serve_http().await, "lifecycle");
    let (_, [cert, key]) = dev_certs("lifecycle");
    let mut child = cnat(
        &[
            ANY_PORTS[0],
            ANY_PORTS[1],
            &cert,
            &key,
            "--identity=cnat-0",
            "--lease-duration=3s",
            "--renew-deadline=2s",
            "--retry-period=500ms",
            "--shutdown-delay=1s",
            "--shutdown-timeout=5s",
            "--log-format=text",
            "--log=warn",
        ],
        &config,
    )
    .stderr(Stdio::inherit())
    .spawn()
    .unwrap();
    let (admin, webhook) = bound(&mut child, true, String::new);

    assert!(
        support::until(Duration::from_secs(5), || probe(admin, "/readyz")
            == Some(200))
        .await,
        "never ready"
    );
    assert_eq!(probe(admin, "/healthz"), Some(200));
    assert!(
        support::until(Duration::from_secs(5), || holder(&server).as_deref()
            == Some("cnat-0"))
        .await,
        "never leader"
    );
    // The lease is in the context's namespace, as no flag or POD_NAMESPACE said otherwise.
    server.create(
        Resource::Ats,
        json!({"metadata": {"name": "now", "namespace": "default"},
               "spec": {"schedule": "2019-04-12T10:12:00Z", "command": "true", "image": "busybox"}}),
    );
    let reconciled = support::until(Duration::from_secs(5), || {
        server.get(Resource::Pods, "default", "now-pod").is_some()
    })
    .await;
    assert!(reconciled, "the leader did not reconcile");

    let term = Instant::now();
    sigterm(&child);
    assert!(
        support::until(Duration::from_millis(500), || probe(admin, "/readyz")
            == Some(503))
        .await,
        "still ready"
    );
    assert!(
        support::until(Duration::from_millis(500), || holder(&server).as_deref()
            == Some(""))
        .await,
        "lease not released"
    );
    // Still serving during the shutdown delay, so requests in flight to it succeed.
    assert_eq!(probe(admin, "/healthz"), Some(200));
    assert!(
        TcpStream::connect_timeout(&webhook, Duration::from_millis(200)).is_ok(),
        "webhooks closed early"
    );

    let exit = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    let took = term.elapsed();
    assert!(exit.success(), "{exit:?}");
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(probe(admin, "/healthz"), None, "admin server still up");
    assert!(
        TcpStream::connect_timeout(&webhook, Duration::from_millis(200)).is_err(),
        "webhooks still up"
    );
    let _ = std::fs::remove_file(config);
}

/// Two real processes with the default timings (lease 15 s): the candidate watches the Lease
/// over HTTP and takes it the moment the leader releases it, not when it would expire.
#[tokio::test]
async fn a_released_lease_is_taken_over_through_the_watch() {
    let server = ApiServer::new();
    let config = kubeconfig(server.serve_http().await, "handover");
    let spawn = |id: &str| {
        let identity = format!("--identity={id}");
        cnat(
            &[
                ANY_PORTS[0],
                &identity,
                "--webhooks=false",
                "--shutdown-delay=100ms",
                "--log-format=text",
                "--log=warn",
            ],
            &config,
        )
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
    };
    let mut first = spawn("cnat-0");
    assert!(
        support::until(Duration::from_secs(5), || holder(&server).as_deref()
            == Some("cnat-0"))
        .await,
        "never leader"
    );
    let mut second = spawn("cnat-1");
    // Let the candidate start its watch.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(holder(&server).as_deref(), Some("cnat-0"));
    let term = Instant::now();
    sigterm(&first);
    assert!(
        support::until(Duration::from_secs(3), || holder(&server).as_deref()
            == Some("cnat-1"))
        .await,
        "no takeover within 3 s of the release (an expiry takes 15 s)"
    );
    println!("SIGTERM -> cnat-1 holds the Lease: {:?}", term.elapsed());
    assert_eq!(server.unguarded_lease_writes(), 0);
    let _ = second.kill();
    let _ = first.wait();
    let _ = second.wait();
    let _ = std::fs::remove_file(config);
}

fn run_to_exit(args: &[&str], kubeconfig: &std::path::Path) -> Output {
    cnat(args, kubeconfig).output().unwrap()
}

#[test]
fn invalid_timing_is_refused_before_anything_starts() {
    let nowhere = std::path::Path::new("/nonexistent");
    let long_name = format!("--lease-name={}", "a".repeat(64));
    for (args, message) in [
        (
            vec!["--lease-duration=10s", "--renew-deadline=10s"],
            "--lease-duration 10s must be longer than --renew-deadline 10s",
        ),
        (
            vec!["--step-down-grace=5s"],
            "--step-down-grace 5s must be shorter than half the --renew-deadline 10s",
        ),
        (
            vec!["--renew-deadline=2s", "--retry-period=2s"],
            "must be longer than 1.2 x --retry-period 2s",
        ),
        (
            vec!["--shutdown-delay=30s"],
            "--shutdown-delay 30s must be shorter than --shutdown-timeout 25s",
        ),
        (
            vec!["--lease-duration=1500ms"],
            "must be a whole number of seconds",
        ),
        (
            vec!["--shards=3", &long_name],
            "with --shards it names the membership Leases by the label cnat.programming-kubernetes.info/member-of, whose value may have at most 63: use a shorter name",
        ),
    ] {
        let output = run_to_exit(&args, nowhere);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}

#[tokio::test]
async fn a_missing_webhook_certificate_is_reported() {
    let server = ApiServer::new();
    let config = kubeconfig(server.serve_http().await, "nocert");
    let flags = [
        ANY_PORTS[0].to_owned(),
        "--tls-cert=/nonexistent/tls.crt".to_owned(),
    ];
    let output = tokio::task::spawn_blocking(move || {
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        run_to_exit(&flags, &config)
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "webhook certificate (--tls-cert, --tls-key): /nonexistent/tls.crt: No such file"
        ),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_busy_admin_port_is_reported() {
    let server = ApiServer::new();
    let config = kubeconfig(server.serve_http().await, "busy");
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let flag = format!("--admin-addr={}", taken.local_addr().unwrap());
    let output = tokio::task::spawn_blocking(move || run_to_exit(&[&flag], &config))
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--admin-addr 127.0.0.1:") && stderr.contains("in use"),
        "{stderr}"
    );
}
