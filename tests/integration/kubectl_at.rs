//! The real `kubectl-at` binary against the project's test API server: create (TIME, stdin,
//! dry run), `-l`, `-r`, `-c`, `--wait` with the command's exit code, kubeconfig flags, and
//! refusals made before anything is sent.

use crate::support;

use cnat::api::At;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use support::apiserver::{ApiServer, Resource};
use tokio::io::AsyncWriteExt;

const NS: &str = "team-a";
const WAIT: Duration = Duration::from_secs(10);

struct Cluster {
    server: ApiServer,
    kubeconfig: PathBuf,
}

async fn cluster(name: &str) -> Cluster {
    let server = ApiServer::new();
    let path = std::env::temp_dir().join(format!(
        "cnat-kubectl-at-{name}-{}.kubeconfig",
        std::process::id()
    ));
    std::fs::write(&path, ApiServer::kubeconfig(server.serve_http().await, NS)).unwrap();
    Cluster {
        server,
        kubeconfig: path,
    }
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Cluster {
    fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_kubectl-at"));
        command
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("TZ", "Europe/Berlin")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command
    }

    async fn run(&self, args: &[&str]) -> Run {
        self.run_with_input(args, "").await
    }

    async fn run_with_input(&self, args: &[&str], input: &str) -> Run {
        let mut child = self.command(args).spawn().unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.as_bytes()).await.unwrap();
        drop(stdin);
        finished(child).await
    }

    fn at(&self, name: &str) -> Option<At> {
        self.server
            .get(Resource::Ats, NS, name)
            .map(|v| serde_json::from_value(v).unwrap())
    }

    fn names(&self) -> Vec<String> {
        self.server
            .list(Resource::Ats)
            .iter()
            .map(|v| v["metadata"]["name"].as_str().unwrap().to_owned())
            .collect()
    }

    /// Writes an At's status as the operator would.
    async fn status(&self, name: &str, status: Value) {
        let ats: Api<At> = Api::namespaced(self.server.client(), NS);
        ats.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .unwrap();
    }
}

async fn finished(child: tokio::process::Child) -> Run {
    let output = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .expect("kubectl-at did not finish")
        .unwrap();
    Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

#[tokio::test]
async fn creates_an_at_for_an_at_1_time_and_says_when_it_runs() {
    let c = cluster("create").await;
    let run = c
        .run(&[
            "now",
            "+",
            "5",
            "minutes",
            "--name",
            "hello",
            "--",
            "echo",
            "hello world",
        ])
        .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stderr.starts_with("at: job team-a/hello at "),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains(" CET (") && run.stderr.ends_with(" UTC, in 5m)\n"),
        "{}",
        run.stderr
    );
    let at = c.at("hello").expect("created");
    assert_eq!(at.spec.command, "echo 'hello world'");
    let due: chrono::DateTime<chrono::Utc> = at.spec.schedule.parse().unwrap();
    let ahead = due - chrono::Utc::now();
    assert!((290..=300).contains(&ahead.num_seconds()), "{ahead}");
    assert_eq!(
        at.metadata.labels.unwrap()["app.kubernetes.io/created-by"],
        "kubectl-at"
    );
}

#[tokio::test]
async fn reads_the_command_from_standard_input_and_names_the_at_after_it() {
    let c = cluster("stdin").await;
    let run = c
        .run_with_input(
            &[
                "--in",
                "1h",
                "--image",
                "alpine",
                "--image-pull-policy",
                "Always",
            ],
            "./backup.sh --full\n",
        )
        .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let names = c.names();
    assert_eq!(names.len(), 1);
    assert!(
        names[0].starts_with("backup-sh-") && names[0].len() == "backup-sh-".len() + 5,
        "{names:?}"
    );
    let at = c.at(&names[0]).unwrap();
    assert_eq!(
        (
            at.spec.command.as_str(),
            at.spec.template.image.as_deref(),
            at.spec.template.image_pull_policy
        ),
        (
            "./backup.sh --full",
            Some("alpine"),
            Some(cnat::api::ImagePullPolicy::Always)
        )
    );
    assert!(
        run.stderr.contains(&format!("job team-a/{} at", names[0])),
        "{}",
        run.stderr
    );
}

#[tokio::test]
async fn bad_input_is_refused_before_anything_is_sent() {
    let c = cluster("refused").await;
    let cases: [(&[&str], &str); 5] = [
        (&["soon", "--", "true"], "error: TIME \"soon\": it does not start with now, a time of day or a date; write it as at(1) does, e.g. now + 5 minutes"),
        (&["noon", "2020-01-01", "--", "true"], "error: TIME noon 2020-01-01 is in the past (Wed Jan  1 12:00:00 2020 CET, "),
        (&["18:00", "--image", "Not An Image", "--", "true"], "error: At team-a/true-"),
        (&["18:00", "--tz", "Mars/Olympus", "--", "true"], "error: --tz \"Mars/Olympus\" is not an IANA time zone"),
        (&["--", "true"], "error: no TIME given; write when to run, e.g. now + 5 minutes"),
    ];
    for (args, expected) in cases {
        let run = c.run(args).await;
        assert_eq!(run.code, 1, "{args:?}: {}", run.stderr);
        assert!(run.stderr.starts_with(expected), "{args:?}: {}", run.stderr);
    }
    let invalid = c
        .run(&["18:00", "--image", "Not An Image", "--", "true"])
        .await;
    assert!(
        invalid.stderr.contains("is invalid: spec.template.image"),
        "{}",
        invalid.stderr
    );
    assert_eq!(c.server.count("POST ats"), 0);
    assert_eq!(c.server.count("GET ats"), 0);
    // A usage error is clap's: exit code 2.
    let run = c.run(&["-l", "-c", "x"]).await;
    assert_eq!(run.code, 2, "{}", run.stderr);
}

#[tokio::test]
async fn a_client_dry_run_prints_the_at_and_creates_nothing() {
    let c = cluster("dry-run").await;
    let run = c
        .run(&[
            "noon",
            "tomorrow",
            "--dry-run=client",
            "-o",
            "yaml",
            "--name",
            "report",
            "--",
            "make report",
        ])
        .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let at: At = serde_saphyr::from_str(&run.stdout).unwrap();
    assert_eq!(at.metadata.name.as_deref(), Some("report"));
    assert_eq!(at.metadata.namespace.as_deref(), Some(NS));
    assert_eq!(at.spec.command, "make report");
    assert!(
        at.spec.schedule.ends_with(":00:00Z"),
        "{}",
        at.spec.schedule
    );
    let run = c
        .run(&[
            "--in",
            "10m",
            "--dry-run=client",
            "-o",
            "json",
            "-n",
            "other",
            "--",
            "true",
        ])
        .await;
    let at: At = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(at.metadata.namespace.as_deref(), Some("other"));
    assert!(at.metadata.name.unwrap().starts_with("true-"));
    assert_eq!(c.server.count("POST ats"), 0);
    assert!(c.names().is_empty());
}

#[tokio::test]
async fn lists_prints_and_removes_like_atq_at_c_and_atrm() {
    let c = cluster("list").await;
    for (name, schedule, command) in [
        ("later", "2099-01-01T00:00:00Z", "echo later"),
        ("earlier", "2020-01-01T00:00:00Z", "exit 3"),
    ] {
        c.server.create(
            Resource::Ats,
            json!({"apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
                   "metadata": {"name": name, "namespace": NS},
                   "spec": {"schedule": schedule, "command": command, "image": "busybox"}}),
        );
    }
    c.status(
        "earlier",
        json!({"phase": "Done", "outcome": "Failed", "exitCode": 3}),
    )
    .await;

    let run = c.run(&["-l"]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", run.stdout);
    assert!(lines[0].starts_with("NAME      DUE"), "{}", run.stdout);
    assert!(
        lines[1].starts_with("earlier   Wed Jan  1 01:00:00 2020 CET   "),
        "{}",
        run.stdout
    );
    // The relative column's width depends on today's date: compare words, not padding.
    assert!(
        lines[1]
            .split_whitespace()
            .collect::<Vec<_>>()
            .ends_with(&["ago", "Done", "Failed", "3"]),
        "{}",
        run.stdout
    );
    assert!(
        lines[2].starts_with("later     Thu Jan  1 01:00:00 2099 CET   in "),
        "{}",
        run.stdout
    );
    assert!(lines[2].ends_with("Pending"), "{}", run.stdout);
    let names = c.run(&["-l", "-o", "name"]).await;
    assert_eq!(
        names.stdout,
        "at.cnat.programming-kubernetes.info/earlier\nat.cnat.programming-kubernetes.info/later\n"
    );
    let empty = c.run(&["-l", "-n", "nobody"]).await;
    assert_eq!(
        (empty.code, empty.stdout.as_str(), empty.stderr.as_str()),
        (0, "", "No Ats in nobody.\n")
    );

    let cat = c.run(&["-c", "earlier"]).await;
    assert_eq!((cat.code, cat.stdout.as_str()), (0, "exit 3\n"));
    let missing = c.run(&["-c", "nope"]).await;
    assert_eq!(missing.code, 1);
    assert!(
        missing
            .stderr
            .starts_with("error: get At team-a/nope: Error from server (NotFound): "),
        "{}",
        missing.stderr
    );

    let removed = c.run(&["-r", "earlier", "nope", "later"]).await;
    assert_eq!(removed.code, 1, "{}", removed.stderr);
    assert_eq!(
        removed.stdout,
        "at.cnat.programming-kubernetes.info \"earlier\" deleted\nat.cnat.programming-kubernetes.info \"later\" deleted\n"
    );
    assert!(
        removed
            .stderr
            .starts_with("error: delete At team-a/nope: Error from server (NotFound): "),
        "{}",
        removed.stderr
    );
    assert!(c.names().is_empty());
}

/// Plays the operator and the kubelet for the At `kubectl at --wait` created: runs it in a pod
/// that writes `log`, then ends it with `status`.
async fn operate(c: &Cluster, log: Option<&str>, done: Value) -> String {
    assert!(support::until(WAIT, || !c.names().is_empty()).await);
    let name = c.names()[0].clone();
    let pod = format!("{name}-pod");
    if let Some(log) = log {
        c.server.create(
            Resource::Pods,
            json!({"metadata": {"name": pod, "namespace": NS}}),
        );
        c.status(&name, json!({"phase": "Running", "podName": pod}))
            .await;
        c.server.set_pod_log(NS, &pod, log);
    }
    c.status(&name, done).await;
    name
}

#[tokio::test]
async fn wait_streams_the_output_and_exits_with_the_commands_exit_code() {
    let c = cluster("wait").await;
    let child = c
        .command(&["now", "--wait", "--", "echo working; exit 3"])
        .spawn()
        .unwrap();
    operate(
        &c,
        Some("working\n"),
        json!({"phase": "Done", "outcome": "Failed", "exitCode": 3, "reason": "Error"}),
    )
    .await;
    let run = finished(child).await;
    assert_eq!(run.code, 3, "{}", run.stderr);
    assert_eq!(run.stdout, "working\n");

    let c = cluster("wait-ok").await;
    let child = c
        .command(&["now", "--wait", "--", "echo fine"])
        .spawn()
        .unwrap();
    operate(
        &c,
        Some("fine\n"),
        json!({"phase": "Done", "outcome": "Succeeded", "exitCode": 0}),
    )
    .await;
    let run = finished(child).await;
    assert_eq!(
        (run.code, run.stdout.as_str()),
        (0, "fine\n"),
        "{}",
        run.stderr
    );
}

#[tokio::test]
async fn wait_says_why_when_the_command_never_ran() {
    let c = cluster("missed").await;
    let child = c.command(&["now", "--wait", "--", "true"]).spawn().unwrap();
    let name = operate(
        &c,
        None,
        json!({"phase": "Done", "outcome": "Missed", "reason": "Missed", "message": "startingDeadlineSeconds (60) passed"}),
    )
    .await;
    let run = finished(child).await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(
        run.stderr
            .contains(&format!("kubectl at: At {name} never had a pod")),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains(&format!(
            "error: At team-a/{name} never ran: Missed: startingDeadlineSeconds (60) passed"
        )),
        "{}",
        run.stderr
    );
}

#[tokio::test]
async fn wait_ends_when_the_at_is_deleted() {
    let c = cluster("deleted").await;
    let child = c.command(&["now", "--wait", "--", "true"]).spawn().unwrap();
    assert!(support::until(WAIT, || !c.names().is_empty()).await);
    let name = c.names()[0].clone();
    c.server.delete(Resource::Ats, NS, &name);
    let run = finished(child).await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert_eq!(
        run.stderr.lines().last(),
        Some(format!("error: At {name} was deleted while waiting for it").as_str())
    );
}

#[tokio::test]
async fn kubeconfig_and_context_flags_choose_the_cluster() {
    let c = cluster("flags").await;
    let mut command = c.command(&[
        "-l",
        "--kubeconfig",
        c.kubeconfig.to_str().unwrap(),
        "--context",
        "fake",
    ]);
    command.env_remove("KUBECONFIG").env("HOME", "/nonexistent");
    let run = finished(command.spawn().unwrap()).await;
    assert_eq!((run.code, run.stderr.as_str()), (0, "No Ats in team-a.\n"));
    let mut command = c.command(&["-l", "--context", "nope"]);
    command.env("HOME", "/nonexistent");
    let run = finished(command.spawn().unwrap()).await;
    assert_eq!(run.code, 1);
    assert!(
        run.stderr.starts_with("error: no usable kubeconfig: "),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("nope"), "{}", run.stderr);
}

#[tokio::test]
async fn prints_shell_completions() {
    let c = cluster("completion").await;
    for shell in ["bash", "zsh", "fish"] {
        let run = c.run(&["--completion", shell]).await;
        assert_eq!(run.code, 0, "{}", run.stderr);
        assert!(
            run.stdout.contains("kubectl-at") && run.stdout.contains("dry-run"),
            "{shell}"
        );
    }
}
