use super::*;

fn args(line: &[&str]) -> Args {
    Args::try_parse_from(std::iter::once("kubectl-at").chain(line.iter().copied())).unwrap()
}

fn clock() -> Clock {
    Clock {
        now: "2026-11-22T12:48:20Z".parse().unwrap(),
        zone: TimeZone::get("Europe/Berlin").unwrap(),
    }
}

#[test]
fn the_command_line_is_well_formed() {
    <Args as clap::CommandFactory>::command().debug_assert();
}

#[test]
fn time_words_and_the_command_after_the_dashes() {
    let a = args(&["now", "+", "5", "minutes", "--", "echo", "hello world"]);
    assert_eq!(a.time, ["now", "+", "5", "minutes"]);
    assert_eq!(
        due(&a, &clock()).unwrap().to_string(),
        "2026-11-22T12:53:20Z"
    );
    assert_eq!(
        command(&a, || unreachable!()).unwrap(),
        "echo 'hello world'"
    );
    // One argument is a shell snippet, used as written.
    let a = args(&["18:00", "--", "echo a | wc -c && exit 3"]);
    assert_eq!(
        command(&a, || unreachable!()).unwrap(),
        "echo a | wc -c && exit 3"
    );
    assert_eq!(
        due(&a, &clock()).unwrap().to_string(),
        "2026-11-22T17:00:00Z"
    );
    // Without `--`, standard input, as at(1) reads it.
    let a = args(&["noon", "tomorrow"]);
    assert_eq!(
        command(&a, || Ok("./backup.sh\n".into())).unwrap(),
        "./backup.sh"
    );
    let empty = command(&a, || Ok(" \n".into())).unwrap_err().to_string();
    assert!(
        empty.starts_with("no command: give it after `--`"),
        "{empty}"
    );
}

#[test]
fn in_and_tz_and_the_past() {
    let a = args(&["--in", "10m", "--", "true"]);
    assert_eq!(
        due(&a, &clock()).unwrap().to_string(),
        "2026-11-22T12:58:20Z"
    );
    let a = args(&["--in", "1h30m", "--", "true"]);
    assert_eq!(
        due(&a, &clock()).unwrap().to_string(),
        "2026-11-22T14:18:20Z"
    );
    let past = args(&["noon", "today", "--", "true"]);
    let refused = due(&past, &clock()).unwrap_err().to_string();
    assert_eq!(
        refused,
        "TIME noon today is in the past (Sun Nov 22 12:00:00 2026 CET, 1h48m ago); give a later time, or --allow-past to run it at once"
    );
    let allowed = args(&["noon", "today", "--allow-past", "--", "true"]);
    assert_eq!(
        due(&allowed, &clock()).unwrap().to_string(),
        "2026-11-22T11:00:00Z"
    );
    assert!(Clock::system(Some("Mars/Olympus")).is_err());
    assert!(Args::try_parse_from(["kubectl-at", "--in", "soon"]).is_err());
    assert!(Args::try_parse_from(["kubectl-at", "noon", "--in", "5m"]).is_err());
    assert!(Args::try_parse_from(["kubectl-at", "-l", "noon"]).is_err());
    // `--dry-run` alone means client, as kubectl's; what follows it is the TIME.
    let a = args(&["--dry-run", "6pm", "--", "x"]);
    assert_eq!(
        (a.dry_run, a.time.as_slice()),
        (Some(DryRun::Client), &["6pm".to_owned()][..])
    );
    // A dry run only creates nothing: it is refused with -r, -l, -c and --wait.
    for other in [&["-r", "x"][..], &["-l"], &["-c", "x"], &["now", "--wait"]] {
        let line = [&["kubectl-at", "--dry-run=client"][..], other].concat();
        assert!(Args::try_parse_from(line).is_err(), "{other:?}");
    }
}

#[test]
fn the_at_carries_the_pod_settings_and_a_generated_name() {
    let a = args(&[
        "18:00",
        "--image",
        "alpine:3.20",
        "-e",
        "MODE=full",
        "--requests",
        "cpu=100m,memory=64Mi",
        "--limits",
        "memory=128Mi",
        "--service-account",
        "backup",
        "--node-selector",
        "disk=ssd",
        "--toleration",
        "dedicated=batch:NoSchedule",
        "--image-pull-secret",
        "regcred",
        "--starting-deadline",
        "5m",
        "--active-deadline",
        "1h",
        "--ttl-after-finished",
        "1h",
        "--",
        "./backup.sh --full",
    ]);
    let command = command(&a, || unreachable!()).unwrap();
    let at = build(&a, "team-a", command, due(&a, &clock()).unwrap(), "x7k2q").unwrap();
    assert_eq!(
        serde_json::to_value(&at).unwrap(),
        serde_json::json!({
            "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
            "metadata": {"name": "backup-sh-x7k2q", "namespace": "team-a",
                         "labels": {"app.kubernetes.io/created-by": "kubectl-at"}},
            "spec": {
                "schedule": "2026-11-22T17:00:00Z", "command": "./backup.sh --full",
                "startingDeadlineSeconds": 300,
                "activeDeadlineSeconds": 3600, "ttlSecondsAfterFinished": 3600,
                "template": {
                    "image": "alpine:3.20",
                    "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
                    "env": [{"name": "MODE", "value": "full"}],
                    "serviceAccountName": "backup",
                    "nodeSelector": {"disk": "ssd"},
                    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "batch", "effect": "NoSchedule"}],
                    "imagePullSecrets": [{"name": "regcred"}]
                }
            }
        })
    );
    let yaml = render(&at, Output::Yaml).unwrap();
    assert!(
        yaml.starts_with("apiVersion: cnat.programming-kubernetes.info/v1\n"),
        "{yaml}"
    );
    assert!(!yaml.contains("status"), "{yaml}");
    assert_eq!(
        render(&at, Output::Name).unwrap(),
        "at.cnat.programming-kubernetes.info/backup-sh-x7k2q\n"
    );
    let json: serde_json::Value =
        serde_json::from_str(&render(&at, Output::Json).unwrap()).unwrap();
    assert_eq!(json["spec"]["command"], "./backup.sh --full");
}

#[test]
fn the_webhooks_rules_apply_before_anything_is_sent() {
    let a = args(&[
        "18:00",
        "--image",
        "Not An Image",
        "--name",
        "Bad_Name",
        "--",
        "true",
    ]);
    let refused = build(&a, "team-a", "true".into(), due(&a, &clock()).unwrap(), "x")
        .unwrap_err()
        .to_string();
    assert!(
        refused.starts_with("At team-a/Bad_Name has 2 problems:\n- metadata.name"),
        "{refused}"
    );
    assert!(refused.contains("spec.template.image"), "{refused}");
    let a = args(&["18:00", "--requests", "cpu", "--", "true"]);
    let refused = build(&a, "team-a", "true".into(), due(&a, &clock()).unwrap(), "x")
        .unwrap_err()
        .to_string();
    assert_eq!(refused, "--requests \"cpu\": expected KEY=VALUE");
    let a = args(&["18:00", "--requests", "cpu=lots", "--", "true"]);
    let refused = build(&a, "team-a", "true".into(), due(&a, &clock()).unwrap(), "x")
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("spec.template.resources.requests.cpu"),
        "{refused}"
    );
}

#[test]
fn names_come_from_the_commands_first_word() {
    for (command, stem_) in [
        ("./backup.sh --full", "backup-sh"),
        ("/usr/bin/curl -fsS x", "curl"),
        ("echo hi", "echo"),
        ("  ", "at"),
        ("42", "at"),
        ("ÜBER_tool", "ber-tool"),
        ("a".repeat(100).as_str(), &"a".repeat(40)),
    ] {
        assert_eq!(stem(command), stem_, "{command:?}");
    }
    let suffix = random_suffix();
    assert_eq!(suffix.len(), 5);
    assert!(suffix
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()));
}

#[test]
fn tolerations_read_like_taints() {
    let t = toleration("gpu:NoSchedule");
    assert_eq!(
        (
            t.key.as_deref(),
            t.operator.as_deref(),
            t.value,
            t.effect.as_deref()
        ),
        (Some("gpu"), Some("Exists"), None, Some("NoSchedule"))
    );
    let t = toleration("dedicated=batch");
    assert_eq!(
        (
            t.key.as_deref(),
            t.operator.as_deref(),
            t.value.as_deref(),
            t.effect
        ),
        (Some("dedicated"), Some("Equal"), Some("batch"), None)
    );
}
