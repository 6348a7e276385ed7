//! cnat's alert rules and metrics with a real Prometheus's `promtool` (Debian's prometheus
//! package; scripts/fetch-prometheus installs it): the chart's PrometheusRule, rendered with its
//! default values, passes `promtool check rules` and the unit tests in
//! `tests/alerts/cnat.test.yaml` (series in, alerts out); a real scrape of the binary passes
//! `promtool check metrics`.

use crate::support;

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::apiserver::ApiServer;
use support::ports::{bound, ANY_PORTS};
use support::process::{cnat, get, kubeconfig};

fn promtool() -> Command {
    let found = Command::new("promtool").arg("--version").output().is_ok();
    assert!(
        found,
        "no promtool on PATH: run scripts/fetch-prometheus (scripts/test installs it)"
    );
    Command::new("promtool")
}

/// Runs `command`, feeding it `input`; its exit status and combined output.
fn run(mut command: Command, input: &str) -> (bool, String) {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// The chart's PrometheusRule groups as a Prometheus rule file, in a fresh directory beside a
/// copy of the unit tests.
fn rules_dir(sets: &[&str]) -> PathBuf {
    let helm = Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/helm");
    assert!(
        helm.exists(),
        "no helm: run scripts/fetch-helm (scripts/test does)"
    );
    let mut command = Command::new(helm);
    command.args([
        "template",
        "cnat",
        concat!(env!("CARGO_MANIFEST_DIR"), "/charts/cnat"),
    ]);
    command.args([
        "--show-only",
        "templates/prometheusrule.yaml",
        "--set",
        "metrics.prometheusRule.enabled=true",
    ]);
    for set in sets {
        command.args(["--set", set]);
    }
    let (ok, rendered) = run(command, "");
    assert!(ok, "{rendered}");
    let rule: Value = serde_saphyr::from_str(&rendered).unwrap();
    assert_eq!(rule["kind"], "PrometheusRule");
    let dir =
        std::env::temp_dir().join(format!("cnat-alerts-{}-{}", std::process::id(), sets.len()));
    std::fs::create_dir_all(&dir).unwrap();
    let groups = serde_json::json!({"groups": rule["spec"]["groups"]});
    std::fs::write(
        dir.join("rules.yaml"),
        serde_saphyr::to_string(&groups).unwrap(),
    )
    .unwrap();
    for tests in ["cnat.test.yaml", "cnat-shards.test.yaml"] {
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/alerts")
                .join(tests),
            dir.join(tests),
        )
        .unwrap();
    }
    dir
}

#[test]
fn the_rules_are_valid_and_every_alert_fires_when_it_should_and_only_then() {
    let dir = rules_dir(&[]);
    let mut check = promtool();
    check.args(["check", "rules"]).arg(dir.join("rules.yaml"));
    let (ok, said) = run(check, "");
    assert!(ok && said.contains("SUCCESS: 9 rules found"), "{said}");
    let mut test = promtool();
    test.args(["test", "rules"]).arg(dir.join("cnat.test.yaml"));
    let (ok, said) = run(test, "");
    assert!(ok && said.contains("SUCCESS"), "{said}");
    let _ = std::fs::remove_dir_all(dir);
}

/// With `leaderElection.shards=3`: a shard without a leader fires `CnatNoLeader` (whatever the
/// sum of `cnat_leader` says), a shard led twice fires `CnatManyLeaders`
/// (`tests/alerts/cnat-shards.test.yaml`).
#[test]
fn with_shards_the_leader_alerts_count_each_shard() {
    let dir = rules_dir(&["leaderElection.shards=3"]);
    let mut test = promtool();
    test.args(["test", "rules"])
        .arg(dir.join("cnat-shards.test.yaml"));
    let (ok, said) = run(test, "");
    assert!(ok && said.contains("SUCCESS"), "{said}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn thresholds_are_values_and_the_unit_tests_notice_a_change() {
    // With the overdue alert waiting 30 minutes instead of 5, the test that expects it at 7
    // minutes fails: the unit tests do test the rendered rules.
    let dir = rules_dir(&["metrics.prometheusRule.overdue.for=30m"]);
    let mut test = promtool();
    test.args(["test", "rules"]).arg(dir.join("cnat.test.yaml"));
    let (ok, said) = run(test, "");
    assert!(!ok, "{said}");
    assert!(
        said.contains("alertname: CnatAtsOverdue, time: 7m"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_real_scrape_of_the_binary_passes_promtool_check_metrics() {
    let server = ApiServer::new();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let config = kubeconfig(runtime.block_on(server.serve_http()), "alerts");
    let mut child = cnat(
        &["--webhooks=false", ANY_PORTS[0], "--identity=cnat-alerts"],
        &config,
    )
    .stdout(Stdio::null())
    .spawn()
    .unwrap();
    let (admin, _) = bound(&mut child, false, String::new);
    let started = Instant::now();
    let scrape = loop {
        if let Some((200, body)) = get(admin, "/metrics") {
            // The leader's gauge is set before its reconcile loop starts counting Ats.
            if body.contains("\ncnat_leader 1\n") && body.contains("\ncnat_ats{") {
                break body;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "cnat never led"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    for metric in [
        "cnat_ats{phase=\"PENDING\"} 0",
        "# TYPE cnat_ats_overdue gauge",
        "cnat_pods_refused_total{reason=\"quota_exceeded\"} 0",
    ] {
        assert!(scrape.contains(metric), "{metric}: {scrape}");
    }
    let mut check = promtool();
    check.args(["check", "metrics"]);
    let (ok, said) = run(check, &scrape);
    assert!(ok, "promtool check metrics: {said}\n{scrape}");
}
