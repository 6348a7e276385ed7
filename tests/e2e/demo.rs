//! `scripts/demo`, as a newcomer runs it: one command shows cnat working on a local control
//! plane (the book's example `Done`, a malformed At refused, a failed command's output, a
//! handover), prints a `KUBECONFIG` that works, and `scripts/demo stop` leaves nothing running.

use crate::support::envtest;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The demo's last line before it only waits (`examples/demo.rs`).
const READY_LINE: &str = "The demo runs until Ctrl-C";

/// Ids of the processes whose command line names `folder` (the control plane's and the
/// replicas' files are all in it).
fn processes_using(folder: &Path) -> Vec<u32> {
    let needle = folder.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            // A zombie (exited, not yet reaped) has an empty command line: not running.
            cmdline.contains(&needle).then_some(pid)
        })
        .collect()
}

/// A folder removed however the test ends.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The demo's process group (`scripts/demo`, cargo, the demo): if the test ends early, stopped
/// as Ctrl-C in a terminal would (SIGINT to the group), then killed after 20 s.
struct Demo(std::process::Child);

impl Drop for Demo {
    fn drop(&mut self) {
        let group = self.0.id().cast_signed();
        if self.0.try_wait().ok().flatten().is_none() {
            // SAFETY: signalling the process group our child leads.
            unsafe {
                libc::kill(-group, libc::SIGINT);
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            while self.0.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        // SAFETY: as above; whatever of the group is left.
        unsafe {
            libc::kill(-group, libc::SIGKILL);
        }
        let _ = self.0.wait();
    }
}

#[test]
fn the_demo_shows_cnat_working_and_stop_leaves_nothing_running() {
    let Some(assets) = envtest::assets_or_skip() else {
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let scratch =
        Scratch(std::env::temp_dir().join(format!("cnat-demo-test-{}", std::process::id())));
    std::fs::create_dir_all(&scratch.0).unwrap();
    let scratch = &scratch.0;
    let pidfile = scratch.join("demo.pid");
    let stderr = scratch.join("demo.stderr");
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(root.join("scripts/demo"));
    // What cargo and nextest set for this test (its package's CARGO_MANIFEST_DIR, CARGO_PKG_*,
    // ...) is not the environment scripts/demo's cargo runs in for a user: build scripts that
    // watch such variables (ring's does) would be built again, and with them everything above
    // them, cnat included, here and in the next cargo run after this test.
    for (name, _) in std::env::vars_os() {
        let text = name.to_string_lossy();
        if text == "OUT_DIR" || CARGO_SETS.iter().any(|set| text.starts_with(set)) {
            command.env_remove(&name);
        }
    }
    let mut demo = Demo(
        command
            .current_dir(root)
            .process_group(0)
            .env("KUBEBUILDER_ASSETS", &assets)
            .env("CNAT_DEMO_PIDFILE", &pidfile)
            .env("CNAT_CARGO_PROFILE", cargo_profile())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("scripts/demo starts"),
    );

    // Its output up to the line after which it waits (or its end).
    let (lines, inbox) = std::sync::mpsc::channel();
    let stdout = demo.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(150);
    let mut output = String::new();
    let ready = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match inbox.recv_timeout(left) {
            Ok(line) => {
                // Shown as it comes, so that a test ended by the runner's timeout says how far
                // the demo got.
                eprintln!("demo: {line}");
                output.push_str(&line);
                output.push('\n');
                if line.starts_with(READY_LINE) {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    let context = || {
        format!(
            "{output}\n-- stderr:\n{}",
            std::fs::read_to_string(&stderr).unwrap_or_default()
        )
    };
    if !ready {
        panic!("the demo did not get ready within 150 s:\n{}", context());
    }

    // What it showed.
    let row = |name: &str, words: &[&str]| {
        output.lines().any(|line| {
            line.split_whitespace().next() == Some(name) && words.iter().all(|w| line.contains(w))
        })
    };
    assert!(
        output.contains("denied the request")
            && output.contains("spec.schedule: \"next tuesday\" is not an RFC 3339 time"),
        "the malformed At refused, naming the field:\n{}",
        context()
    );
    assert!(
        row("example-at", &["Done", "Succeeded", "example-at-pod"]),
        "the book's example Done:\n{}",
        context()
    );
    assert!(
        row(
            "fails",
            &["Done", "Failed", "CommandFailed", "about to fail"]
        ),
        "the failed command's output in its At:\n{}",
        context()
    );
    assert!(
        output.contains(" took the Lease ") && row("after-handover", &["Done", "Succeeded"]),
        "a handover, and the new leader runs an At:\n{}",
        context()
    );

    // The KUBECONFIG it prints works.
    let kubeconfig = output
        .lines()
        .find_map(|line| line.strip_prefix("export KUBECONFIG="))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("no KUBECONFIG printed:\n{}", context()));
    let kubectl = if assets.join("kubectl").exists() {
        assets.join("kubectl")
    } else {
        PathBuf::from("kubectl")
    };
    let listed = Command::new(&kubectl)
        .args(["get", "ats", "-o", "name"])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .expect("kubectl runs");
    assert_eq!(
        String::from_utf8_lossy(&listed.stdout),
        "at.cnat.programming-kubernetes.info/after-handover\nat.cnat.programming-kubernetes.info/example-at\nat.cnat.programming-kubernetes.info/fails\n",
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );

    // etcd, kube-apiserver, kube-controller-manager and the two replicas left.
    let folder = kubeconfig.parent().unwrap().to_owned();
    let started = processes_using(&folder);
    assert!(
        started.len() >= 5,
        "{} processes use {}: {started:?}",
        started.len(),
        folder.display()
    );

    let stop = Command::new(root.join("scripts/demo"))
        .arg("stop")
        .env("CNAT_DEMO_PIDFILE", &pidfile)
        .output()
        .expect("scripts/demo stop runs");
    assert!(
        stop.status.success(),
        "scripts/demo stop: {}",
        String::from_utf8_lossy(&stop.stderr)
    );
    let status = demo.0.wait().unwrap();
    assert!(status.success(), "the demo ended with {status}");
    let left = processes_using(&folder);
    assert!(left.is_empty(), "still running after stop: {left:?}");
    assert!(!folder.exists(), "{} not removed", folder.display());
    assert!(!pidfile.exists(), "{} not removed", pidfile.display());
}

/// The prefixes of what cargo and nextest set for a test process (and `OUT_DIR`).
const CARGO_SETS: &[&str] = &[
    "CARGO_MANIFEST_",
    "CARGO_PKG_",
    "CARGO_CRATE_NAME",
    "CARGO_BIN_",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_TARGET_TMPDIR",
    "CARGO_RUSTC_CURRENT_DIR",
    "NEXTEST_",
];

/// The cargo profile this test was built with (`target/PROFILE/deps/e2e-HASH`; the dev
/// profile's folder is `debug`), for the demo to build with: its binaries are then there.
fn cargo_profile() -> String {
    let exe = std::env::current_exe().expect("the test's own path");
    let folder = exe
        .parent()
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .and_then(|name| name.to_str())
        .expect("target/PROFILE/deps");
    match folder {
        "debug" => "dev".to_owned(),
        other => other.to_owned(),
    }
}
