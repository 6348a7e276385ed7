//! A private, real Kubernetes control plane for tests, the envtest way: `KUBEBUILDER_ASSETS`
//! names a folder with `etcd`, `kube-apiserver`, `kubectl` and (here) `kube-controller-manager`,
//! as controller-runtime's `setup-envtest` lays it out; `scripts/envtest` prepares one in
//! `.tools/envtest` from `../shared/envtest` (v1.24; where that is not there, it builds one from
//! the Go module proxy into `.tools/envtest-1.24`), and `scripts/envtest 1.37` one in
//! `.tools/envtest-1.37` (built from the Go module proxy). The flags follow the version
//! `kube-apiserver --version` says (`ControlPlane::minor`).
//!
//! `control_plane()` starts etcd, kube-apiserver and kube-controller-manager once per test
//! process on free loopback ports in a temporary folder, waits for `/readyz`, and hands out
//! clients: an admin one, and others that impersonate a user or ServiceAccount, so that a test
//! binds exactly the RBAC it means to test. Each test takes its own namespace.
//!
//! Clean-up: the processes die with the test process (`PR_SET_PDEATHSIG`, from a thread that
//! lives as long as the process), and are stopped and the folder removed when the process exits
//! normally (after a test panicked too); a folder left by an interrupted run is removed by the
//! next start. Under `cargo nextest` every test is a process of its own, so each gets its own
//! control plane; under `cargo test`, the tests of a binary share one.
//!
//! Without the binaries, `control_plane()` returns `None` after printing one line on how to get
//! them, and the test passes as skipped; with `CNAT_REQUIRE_REAL_SERVER=1` (which `scripts/test`
//! sets unless `CNAT_SKIP_REAL_SERVER=1`), that is a failure instead.

use k8s_openapi::api::core::v1::Namespace;
use kube::api::PostParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const ADMIN_TOKEN: &str = "cnat-envtest-admin";
/// Where every control plane's folder goes, one per process id.
const FOLDERS: &str = "cnat-envtest";

/// A running control plane.
pub struct ControlPlane {
    /// `https://127.0.0.1:PORT`.
    pub server: String,
    /// Its folder: certificates, etcd data, kubeconfig, logs.
    pub dir: PathBuf,
    /// An admin kubeconfig file (token auth, the apiserver's own CA).
    pub kubeconfig: PathBuf,
    /// The Kubernetes version its kube-apiserver says (`v1.24.0+0`, `v1.37.2`).
    pub version: String,
    ca: Vec<u8>,
}

impl ControlPlane {
    /// The minor version of its kube-apiserver (24 for v1.24.0).
    pub fn minor(&self) -> u32 {
        minor_of(&self.version)
    }
}

fn minor_of(version: &str) -> u32 {
    version
        .trim_start_matches('v')
        .trim_start_matches("1.")
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("not a Kubernetes version: {version:?}"))
}

/// The version `kube-apiserver --version` says, and its minor number.
fn apiserver_version(binary: &Path) -> (String, u32) {
    let out = Command::new(binary)
        .arg("--version")
        .output()
        .expect("kube-apiserver --version runs");
    assert!(
        out.status.success(),
        "{} --version failed: {}",
        binary.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    let version = said.trim().trim_start_matches("Kubernetes ").to_owned();
    let minor = minor_of(&version);
    (version, minor)
}

/// What is running (processes and folder of each control plane), for the exit handler.
static RUNNING: Mutex<Vec<(Vec<u32>, PathBuf)>> = Mutex::new(Vec::new());
static SHARED: OnceLock<Result<Option<ControlPlane>, String>> = OnceLock::new();

/// The `cnat` binary replicas run: this build's, unless `CNAT_BENCH_BINARY` names another
/// (`scripts/bench-side-by-side` runs the benches on an older build that way).
pub fn cnat_binary() -> PathBuf {
    match std::env::var_os("CNAT_BENCH_BINARY") {
        Some(other) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!(
                    "replicas run {} (CNAT_BENCH_BINARY)",
                    other.to_string_lossy()
                )
            });
            PathBuf::from(other)
        }
        None => this_build(),
    }
}

/// This build's `cnat` binary. An example (`scripts/demo`) has no `CARGO_BIN_EXE_*`: there it
/// is the one beside the example's folder (`target/PROFILE/examples/demo` -> `target/PROFILE/cnat`).
pub fn this_build() -> PathBuf {
    option_env!("CARGO_BIN_EXE_cnat").map_or_else(
        || {
            let exe = std::env::current_exe().expect("the running executable");
            let profile = exe.parent().and_then(Path::parent).expect("target/PROFILE");
            profile.join("cnat")
        },
        PathBuf::from,
    )
}

/// The folder with the binaries, if `KUBEBUILDER_ASSETS` names one that has them all.
pub fn assets() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("KUBEBUILDER_ASSETS")?);
    ["etcd", "kube-apiserver"]
        .iter()
        .all(|b| dir.join(b).is_file())
        .then_some(dir)
}

/// The control plane of this test process, started on first use; `None` (after one line on
/// stderr saying how to enable it) when there are no binaries. Panics when it cannot start, or
/// when binaries are missing in CI where they should be.
pub fn control_plane() -> Option<&'static ControlPlane> {
    // A start that failed is not tried again by every later test of the process.
    let shared = SHARED.get_or_init(|| {
        std::panic::catch_unwind(|| Some(start(&assets_or_skip()?))).map_err(|panic| {
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default()
        })
    });
    match shared {
        Ok(plane) => plane.as_ref(),
        Err(why) => panic!("the control plane did not start: {why}"),
    }
}

/// The binaries' folder; or, without one, `None` after saying how to get them (a failure in CI
/// where they should be).
pub fn assets_or_skip() -> Option<PathBuf> {
    if let Some(dir) = assets() {
        return Some(dir);
    }
    // scripts/test sets it (unless CNAT_SKIP_REAL_SERVER=1): its run never passes on skips.
    assert!(
        std::env::var("CNAT_REQUIRE_REAL_SERVER").as_deref() != Ok("1"),
        "CNAT_REQUIRE_REAL_SERVER=1, but KUBEBUILDER_ASSETS names no folder with etcd and kube-apiserver: run scripts/envtest (or set CNAT_SKIP_REAL_SERVER=1 for scripts/test to skip the real-server tests)"
    );
    eprintln!("skipped: no real control plane; set KUBEBUILDER_ASSETS to a folder with etcd and kube-apiserver (and kube-controller-manager for quotas): KUBEBUILDER_ASSETS=$(scripts/envtest), or `setup-envtest use 1.24 -p path`");
    None
}

/// A control plane of the calling test's own (not shared), for tests that change cluster-wide
/// state others would trip over (webhook configurations of a whole chart, say); `None` as for
/// `control_plane()`.
pub fn own_control_plane() -> Option<&'static ControlPlane> {
    Some(Box::leak(Box::new(start(&assets_or_skip()?))))
}

/// `control_plane()`, or return from the test (skipped) when there is none.
#[macro_export]
macro_rules! real_control_plane {
    () => {
        match $crate::support::envtest::control_plane() {
            Some(plane) => plane,
            None => return,
        }
    };
}

impl ControlPlane {
    /// A client with every right (`system:masters`).
    pub async fn admin(&self) -> Client {
        self.client_as(None).await
    }

    /// A client acting as `user` in `groups` (impersonation by the admin): it has exactly the
    /// rights RBAC gives that user, and webhooks see it as the requester.
    pub async fn user(&self, user: &str, groups: &[&str]) -> Client {
        self.client_as(Some((user, groups))).await
    }

    /// A client acting as ServiceAccount `namespace/name`.
    pub async fn service_account(&self, namespace: &str, name: &str) -> Client {
        let user = format!("system:serviceaccount:{namespace}:{name}");
        let ns_group = format!("system:serviceaccounts:{namespace}");
        self.user(
            &user,
            &["system:serviceaccounts", &ns_group, "system:authenticated"],
        )
        .await
    }

    async fn client_as(&self, who: Option<(&str, &[&str])>) -> Client {
        let mut config = kube::Config::from_custom_kubeconfig(
            self.kubeconfig_value(),
            &KubeConfigOptions::default(),
        )
        .await
        .expect("the envtest kubeconfig is usable");
        if let Some((user, groups)) = who {
            config.auth_info.impersonate = Some(user.to_owned());
            config.auth_info.impersonate_groups =
                Some(groups.iter().map(|g| (*g).to_owned()).collect());
        }
        // Tests make many requests at once; the default 5 s read timeout is plenty per request.
        config.read_timeout = Some(Duration::from_secs(30));
        Client::try_from(config).expect("a client")
    }

    fn kubeconfig_value(&self) -> Kubeconfig {
        Kubeconfig::from_yaml(&self.kubeconfig_yaml()).expect("a kubeconfig")
    }

    fn kubeconfig_yaml(&self) -> String {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca);
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: envtest\n  cluster:\n    server: {}\n    certificate-authority-data: {ca}\nusers:\n- name: admin\n  user:\n    token: {ADMIN_TOKEN}\ncontexts:\n- name: envtest\n  context:\n    cluster: envtest\n    user: admin\n    namespace: default\ncurrent-context: envtest\n",
            self.server
        )
    }

    /// A new namespace named after `test` (unique in this control plane), with `labels`.
    pub async fn namespace(&self, test: &str, labels: &[(&str, &str)]) -> String {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let name: String = format!("{test}-{n}")
            .to_lowercase()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .take(55)
            .collect();
        create_namespace(&self.admin().await, &name, labels).await;
        // Pods need the namespace's `default` ServiceAccount, which the controller manager adds;
        // without one, it is made here.
        let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(self.admin().await, &name);
        if !self.has_controller_manager() {
            let account =
                serde_json::from_value(serde_json::json!({"metadata": {"name": "default"}}))
                    .unwrap();
            accounts
                .create(&PostParams::default(), &account)
                .await
                .expect("a ServiceAccount");
        }
        let deadline = Instant::now() + Duration::from_secs(90);
        while accounts.get_opt("default").await.ok().flatten().is_none() {
            assert!(
                Instant::now() < deadline,
                "no default ServiceAccount in {name}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        name
    }

    /// Whether kube-controller-manager runs (quota usage, garbage collection, namespace
    /// deletion, ServiceAccounts); `setup-envtest`'s folders have none.
    pub fn has_controller_manager(&self) -> bool {
        assets().is_some_and(|dir| dir.join("kube-controller-manager").exists())
    }

    /// Starts `command` beside this control plane (a kube-scheduler, KWOK), its output in
    /// `NAME.log` of its folder, stopped with it at the process's end.
    pub fn companion(&self, name: &str, command: Command) -> Child {
        let child = spawn(command, &self.dir.join(format!("{name}.log")));
        running(&self.dir, child.id());
        child
    }

    /// Nodes for this control plane's pods: the real kube-scheduler of its version (`scripts/envtest
    /// node-1.xx`, with its default settings) binds them to `count` KWOK nodes (`kwok-0`..),
    /// and KWOK (`scripts/envtest kwok`) plays their kubelets as `tests/support/kwok.yaml`
    /// says: a node Ready at once, a bound pod Running at once and then ended (exit code from
    /// the annotation `kwok.cnat.dev/exit-code`, else a trailing `exit N` in its command, else 0). Both run until the returned value is dropped; the nodes stay (creating those
    /// already there is not an error). `qps`: the scheduler's requests a second to the API
    /// server (bursts of twice that), where not its default (50, bursts of 100).
    pub async fn kwok_nodes(&self, admin: &Client, count: usize, qps: Option<u32>) -> KwokNodes {
        // The folders, from a thread that may wait (a first build takes minutes).
        let node = format!("node-1.{}", self.minor());
        let (node, kwok) =
            tokio::task::spawn_blocking(move || (tool_folder(&node), tool_folder("kwok")))
                .await
                .expect("the tools' folders");
        let scheduler = node.join("kube-scheduler");
        let mut command = Command::new(scheduler);
        command.args([
            format!("--kubeconfig={}", self.kubeconfig.display()),
            "--leader-elect=false".into(),
            // Nothing reads its health or metrics: no port to race for.
            "--secure-port=0".into(),
        ]);
        if let Some(qps) = qps {
            command.arg(format!("--kube-api-qps={qps}"));
            command.arg(format!("--kube-api-burst={}", 2 * qps));
        }
        let scheduler = self.companion("kube-scheduler", command);
        let mut command = Command::new(kwok.join("kwok"));
        command.args([
            format!("--kubeconfig={}", self.kubeconfig.display()),
            format!(
                "--config={}/tests/support/kwok.yaml",
                env!("CARGO_MANIFEST_DIR")
            ),
            "--manage-all-nodes=false".into(),
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake".into(),
            "--cidr=10.0.0.0/16".into(),
            "--node-ip=10.255.0.1".into(),
        ]);
        let kwok = self.companion("kwok", command);
        let nodes = KwokNodes {
            children: vec![scheduler, kwok],
        };
        add_kwok_nodes(self, admin, count).await;
        nodes
    }

    /// `kubectl` against this control plane, as admin.
    pub fn kubectl(&self) -> Command {
        let assets = assets().expect("assets");
        let kubectl = if assets.join("kubectl").exists() {
            assets.join("kubectl")
        } else {
            PathBuf::from("kubectl")
        };
        let mut command = Command::new(kubectl);
        command.env("KUBECONFIG", &self.kubeconfig);
        // Its discovery cache in the control plane's folder (removed with it), not in
        // ~/.kube/cache, where each control plane's port would leave a folder behind.
        command.env("KUBECACHEDIR", self.dir.join("kube-cache"));
        command
    }
}

/// A kube-scheduler and KWOK beside a control plane (`ControlPlane::kwok_nodes`), stopped when
/// dropped.
pub struct KwokNodes {
    children: Vec<Child>,
}

impl Drop for KwokNodes {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
            stopped(child.id());
        }
    }
}

/// `scripts/envtest WHAT`'s folder (built once per machine; a first build takes minutes).
pub fn tool_folder(what: &str) -> PathBuf {
    let output = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/envtest"))
        .arg(what)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(Stdio::inherit())
        .output()
        .expect("scripts/envtest runs");
    assert!(output.status.success(), "scripts/envtest {what} failed");
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

/// `count` KWOK nodes of 110 pods, Ready and schedulable.
async fn add_kwok_nodes(plane: &ControlPlane, admin: &Client, count: usize) {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Patch, PatchParams};
    let nodes: Api<Node> = Api::all(admin.clone());
    for i in 0..count {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": format!("kwok-{i}"),
                "annotations": {"kwok.x-k8s.io/node": "fake"},
                "labels": {"type": "kwok", "kubernetes.io/hostname": format!("kwok-{i}")},
            },
            "status": {
                "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "110"},
                "capacity": {"cpu": "32", "memory": "256Gi", "pods": "110"},
            },
        }))
        .expect("a Node");
        match nodes.create(&PostParams::default(), &node).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => panic!("creating node kwok-{i}: {e}"),
        }
    }
    // Ready (KWOK's node-ready stage) before any pod needs one.
    let deadline = Instant::now() + Duration::from_secs(60);
    let ours = |name: &str| {
        name.strip_prefix("kwok-")
            .and_then(|i| i.parse::<usize>().ok())
            .is_some_and(|i| i < count)
    };
    loop {
        let listed = nodes.list(&Default::default()).await.expect("nodes listed");
        let ready = listed
            .items
            .iter()
            .filter(|node| node.metadata.name.as_deref().is_some_and(ours))
            .filter(|node| {
                node.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .count();
        if ready >= count {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{ready} of {count} KWOK nodes Ready after 60 s; KWOK's log:\n{}",
            std::fs::read_to_string(plane.dir.join("kwok.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The API server taints a new node not-ready (admission: TaintNodesByCondition); the node
    // lifecycle controller, which lifts it once the node is Ready, is off in these control
    // planes (they have no real node): lifted here, as it would.
    for i in 0..count {
        nodes
            .patch(
                &format!("kwok-{i}"),
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"taints": null}})),
            )
            .await
            .expect("the node's taint lifted");
    }
}

/// Three distinct free ports (all held until each is chosen).
fn free_ports() -> (u16, u16, u16) {
    let listeners: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    let port = |i: usize| listeners[i].local_addr().expect("a port").port();
    (port(0), port(1), port(2))
}

/// Removes the folders of control planes whose process is gone (an interrupted run).
fn sweep(parent: &Path) {
    for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

extern "C" fn stop_at_exit() {
    let running = std::mem::take(&mut *RUNNING.lock().unwrap_or_else(|e| e.into_inner()));
    for (pids, dir) in running {
        // Nothing in it is worth a graceful stop: the folder goes next.
        for pid in pids.iter().rev() {
            // SAFETY: sending a signal to a process this process started.
            unsafe {
                libc::kill(pid.cast_signed(), libc::SIGKILL);
            }
        }
        for pid in &pids {
            // SAFETY: reaping a child of this process, so it leaves no zombie.
            unsafe {
                libc::waitpid(pid.cast_signed(), std::ptr::null_mut(), 0);
            }
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Forgets `pid` (reaped: the number may be reused by another process).
fn stopped(pid: u32) {
    let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    for (pids, _) in running.iter_mut() {
        pids.retain(|p| *p != pid);
    }
}

/// Records `pid` as part of the control plane in `dir`, for the exit handler.
fn running(dir: &Path, pid: u32) {
    let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    match running.iter_mut().find(|(_, d)| d == dir) {
        Some((pids, _)) => pids.push(pid),
        None => running.push((vec![pid], dir.to_owned())),
    }
}

/// Spawns `command` from the keeper thread, so that `PR_SET_PDEATHSIG` (which fires when the
/// spawning thread ends) kills it only when the process ends.
fn spawn(mut command: Command, log: &Path) -> Child {
    type Job = (Command, std::sync::mpsc::Sender<std::io::Result<Child>>);
    static KEEPER: OnceLock<std::sync::mpsc::Sender<Job>> = OnceLock::new();
    let keeper = KEEPER.get_or_init(|| {
        let (jobs, inbox) = std::sync::mpsc::channel::<Job>();
        std::thread::spawn(move || {
            // Never panics: its end would kill every process it started.
            for (mut command, reply) in inbox {
                let _ = reply.send(command.spawn());
            }
            // The channel lives in a static: this thread never ends before the process.
        });
        jobs
    });
    // Nothing from the test's environment that would change what they do (what the caller set
    // stays).
    let set: Vec<std::ffi::OsString> = command.get_envs().map(|(k, _)| k.to_owned()).collect();
    for (name, _) in std::env::vars_os() {
        let text = name.to_string_lossy();
        let foreign = ["CNAT_", "OTEL_", "ETCD_", "KUBE", "RUST_LOG"]
            .iter()
            .any(|prefix| text.starts_with(prefix));
        if foreign && !set.contains(&name) {
            command.env_remove(&name);
        }
    }
    let out = std::fs::File::create(log).expect("a log file");
    let err = out.try_clone().expect("a log file");
    command.stdout(Stdio::from(out)).stderr(Stdio::from(err));
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (reply, child) = std::sync::mpsc::channel();
    keeper
        .send((command, reply))
        .expect("the keeper thread runs");
    child
        .recv()
        .expect("the keeper thread answers")
        .unwrap_or_else(|e| panic!("starting {}: {e}", log.display()))
}

/// Stops what a start that failed had started (a panic unwinds through it).
struct Unstarted(PathBuf);

impl Drop for Unstarted {
    fn drop(&mut self) {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(index) = running.iter().position(|(_, dir)| *dir == self.0) {
            let (pids, dir) = running.remove(index);
            drop(running);
            for pid in &pids {
                // SAFETY: our own children, not yet reaped.
                unsafe {
                    libc::kill(pid.cast_signed(), libc::SIGKILL);
                    libc::waitpid(pid.cast_signed(), std::ptr::null_mut(), 0);
                }
            }
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn start(assets: &Path) -> ControlPlane {
    let parent = std::env::temp_dir().join(FOLDERS);
    std::fs::create_dir_all(&parent).expect("a folder for control planes");
    sweep(&parent);
    static PLANES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = PLANES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = parent.join(format!("{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("certs")).expect("a folder for the control plane");
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    // SAFETY: registering a plain extern "C" function, once.
    AT_EXIT.call_once(|| unsafe {
        libc::atexit(stop_at_exit);
    });

    // The ServiceAccount token signing key.
    let key = rcgen::KeyPair::generate().expect("a key");
    std::fs::write(dir.join("sa.key"), key.serialize_pem()).unwrap();
    std::fs::write(dir.join("sa.pub"), key.public_key_pem()).unwrap();
    std::fs::write(
        dir.join("tokens.csv"),
        format!("{ADMIN_TOKEN},admin,admin,system:masters\n"),
    )
    .unwrap();

    let (etcd_port, peer_port, api_port) = free_ports();
    let etcd_url = format!("http://127.0.0.1:{etcd_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let mut etcd = Command::new(assets.join("etcd"));
    etcd.args([
        "--data-dir",
        dir.join("etcd").to_str().unwrap(),
        "--listen-client-urls",
        &etcd_url,
        "--advertise-client-urls",
        &etcd_url,
        "--listen-peer-urls",
        &peer_url,
        "--initial-advertise-peer-urls",
        &peer_url,
        "--initial-cluster",
        &format!("default={peer_url}"),
        "--log-level",
        "warn",
    ]);
    running(&dir, spawn(etcd, &dir.join("etcd.log")).id());
    let unstarted = Unstarted(dir.clone());

    let d = |file: &str| dir.join(file).to_str().unwrap().to_owned();
    let (version, minor) = apiserver_version(&assets.join("kube-apiserver"));
    let mut apiserver = Command::new(assets.join("kube-apiserver"));
    apiserver.args([
        format!("--etcd-servers={etcd_url}"),
        "--bind-address=127.0.0.1".into(),
        "--advertise-address=127.0.0.1".into(),
        format!("--secure-port={api_port}"),
        format!("--cert-dir={}", d("certs")),
        format!("--token-auth-file={}", d("tokens.csv")),
        "--authorization-mode=Node,RBAC".into(),
        "--service-account-issuer=https://kubernetes.default.svc".into(),
        format!("--service-account-key-file={}", d("sa.pub")),
        format!("--service-account-signing-key-file={}", d("sa.key")),
        "--service-cluster-ip-range=10.96.0.0/16".into(),
        "--enable-admission-plugins=NamespaceLifecycle,ServiceAccount,MutatingAdmissionWebhook,ValidatingAdmissionWebhook,ResourceQuota".into(),
    ]);
    // CRD validation rules (CEL) are behind a gate before 1.25 (beta and on by default from
    // 1.25, GA and locked on in 1.29; the gate is gone from newer servers, which refuse it).
    if minor < 25 {
        apiserver.arg("--feature-gates=CustomResourceValidationExpressions=true");
    }
    // 1.37 refuses a loopback advertise address with the Endpoints reconciler of the
    // `kubernetes` Service, which nothing here uses; 1.24 runs as it always did here.
    if minor > 24 {
        apiserver.arg("--endpoint-reconciler-type=none");
    }
    running(&dir, spawn(apiserver, &dir.join("kube-apiserver.log")).id());

    // The serving certificate appears in the cert dir; it is its own CA.
    let ca_path = dir.join("certs/apiserver.crt");
    let deadline = Instant::now() + Duration::from_secs(60);
    // Written in place: wait until it holds the whole certificate (and its CA).
    let written = |pem: &[u8]| {
        String::from_utf8_lossy(pem)
            .matches("-----END CERTIFICATE-----")
            .count()
            >= 2
    };
    let ca = loop {
        match std::fs::read(&ca_path) {
            Ok(pem) if written(&pem) => break pem,
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "kube-apiserver wrote no certificate; see {}",
            dir.join("kube-apiserver.log").display()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let plane = ControlPlane {
        server: format!("https://127.0.0.1:{api_port}"),
        kubeconfig: dir.join("kubeconfig"),
        dir: dir.clone(),
        version,
        ca,
    };
    std::fs::write(&plane.kubeconfig, plane.kubeconfig_yaml()).unwrap();
    wait_ready(&plane, "kube-apiserver.log", deadline);

    let kubeconfig = plane.kubeconfig.to_str().unwrap().to_owned();
    let kcm_binary = assets.join("kube-controller-manager");
    if !kcm_binary.exists() {
        // As setup-envtest lays it out: namespaces get their ServiceAccount from `namespace()`.
        std::mem::forget(unstarted);
        return plane;
    }
    let mut kcm = Command::new(kcm_binary);
    kcm.args([
        format!("--kubeconfig={kubeconfig}"),
        format!("--authentication-kubeconfig={kubeconfig}"),
        format!("--authorization-kubeconfig={kubeconfig}"),
        "--leader-elect=false".into(),
        format!("--service-account-private-key-file={}", d("sa.key")),
        format!("--root-ca-file={}", ca_path.display()),
        "--controllers=*,-nodeipam,-nodelifecycle".into(),
        "--bind-address=127.0.0.1".into(),
        // Nothing here talks to it: no port to race for.
        "--secure-port=0".into(),
    ]);
    running(
        &dir,
        spawn(kcm, &dir.join("kube-controller-manager.log")).id(),
    );
    std::mem::forget(unstarted);
    plane
}

/// Waits until `/readyz` answers `ok` (asked from a runtime of its own: this runs inside the
/// first test's runtime, which is blocked meanwhile).
fn wait_ready(plane: &ControlPlane, log: &str, deadline: Instant) {
    let config = plane.kubeconfig_value();
    let ready = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            let config =
                kube::Config::from_custom_kubeconfig(config, &KubeConfigOptions::default())
                    .await
                    .expect("the envtest kubeconfig is usable");
            let client = Client::try_from(config).expect("a client");
            while Instant::now() < deadline {
                let request = http::Request::get("/readyz").body(Vec::new()).unwrap();
                if client.request_text(request).await.is_ok_and(|t| t == "ok") {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            false
        })
    });
    assert!(
        ready.join().unwrap_or(false),
        "kube-apiserver not ready; see {}",
        plane.dir.join(log).display()
    );
}

/// Where the end-to-end tests run: a real cluster named by `CNAT_E2E_KUBECONFIG` (with a
/// kubelet: pods really run), or else the private control plane (no kubelet: the test writes
/// each pod's end itself).
pub struct Target {
    pub client: Client,
    /// Pods run by themselves (a real cluster); otherwise `finish_pod` plays the kubelet.
    pub kubelet: bool,
    /// The private control plane, when that is the target.
    pub plane: Option<&'static ControlPlane>,
}

/// The kubeconfig of a disposable real cluster, for `Target`.
pub const CLUSTER_ENV: &str = "CNAT_E2E_KUBECONFIG";

/// The target of this run, or `None` (skipped, said on stderr) when there is none.
pub async fn target() -> Option<Target> {
    if let Some(path) = std::env::var_os(CLUSTER_ENV) {
        let kubeconfig = Kubeconfig::read_from(&path).expect("a readable kubeconfig");
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .expect("a usable kubeconfig");
        return Some(Target {
            client: Client::try_from(config).expect("a client"),
            kubelet: true,
            plane: None,
        });
    }
    let plane = control_plane()?;
    Some(Target {
        client: plane.admin().await,
        kubelet: false,
        plane: Some(plane),
    })
}

/// `target()`, or return from the test (skipped) when there is none.
#[macro_export]
macro_rules! e2e_target {
    () => {
        match $crate::support::envtest::target().await {
            Some(target) => target,
            None => return,
        }
    };
}

impl Target {
    /// A fresh namespace for `test` with `labels`.
    pub async fn namespace(&self, test: &str, labels: &[(&str, &str)]) -> String {
        match self.plane {
            Some(plane) => plane.namespace(test, labels).await,
            None => {
                let name = format!("cnat-e2e-{test}-{}", std::process::id());
                create_namespace(&self.client, &name, labels).await;
                name
            }
        }
    }

    /// Installs (or updates) the At CRD from `cnat crd` and waits until it is established.
    pub async fn install_crd(&self) {
        install_crd(&self.client, &cnat::api::crd_yaml()).await;
    }

    /// Plays the kubelet where there is none: pod `name` ran and its command exited with
    /// `exit_code`. On a real cluster, waits for the pod to end by itself.
    pub async fn finish_pod(&self, namespace: &str, name: &str, exit_code: i32, message: &str) {
        if !self.kubelet {
            finish_pod(&self.client, namespace, name, exit_code, message).await;
        }
    }
}

/// Plays the kubelet: pod `name` in `namespace` ended with `exit_code`, its container's
/// termination message `message`.
pub async fn finish_pod(
    client: &Client,
    namespace: &str,
    name: &str,
    exit_code: i32,
    message: &str,
) {
    end_pod(client, namespace, name, exit_code, message)
        .await
        .expect("pod status written");
}

/// `finish_pod`, saying whether the API server took it (the pod may be gone meanwhile).
pub async fn end_pod(
    client: &Client,
    namespace: &str,
    name: &str,
    exit_code: i32,
    message: &str,
) -> kube::Result<k8s_openapi::api::core::v1::Pod> {
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), namespace);
    let now = jiff::Timestamp::now().to_string();
    let phase = if exit_code == 0 {
        "Succeeded"
    } else {
        "Failed"
    };
    let patch = serde_json::json!({"status": {
        "phase": phase,
        "containerStatuses": [{
            "name": "command", "image": "busybox", "imageID": "", "ready": false,
            "restartCount": 0,
            "state": {"terminated": {"exitCode": exit_code,
                "reason": if exit_code == 0 { "Completed" } else { "Error" },
                "message": message, "startedAt": now, "finishedAt": now}},
        }],
    }});
    pods.patch_status(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    )
    .await
}

/// Creates namespace `name` with `labels`.
async fn create_namespace(client: &Client, name: &str, labels: &[(&str, &str)]) {
    let labels: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).into()))
        .collect();
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name, "labels": labels}}))
            .unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace created");
}

/// Applies the CRD in `yaml` (as `cnat crd` prints it) and waits until it is established.
pub async fn install_crd(client: &Client, yaml: &str) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::runtime::wait::{await_condition, conditions};
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let body = yaml.split_once("---\n").map_or(yaml, |(_, crd)| crd);
    let crd: CustomResourceDefinition = serde_saphyr::from_str(body).expect("a CRD");
    let name = crd.metadata.name.clone().expect("a CRD name");
    crds.patch(
        &name,
        &kube::api::PatchParams::apply("cnat-e2e").force(),
        &kube::api::Patch::Apply(&crd),
    )
    .await
    .expect("CRD applied");
    let established = await_condition(crds, &name, conditions::is_crd_established());
    tokio::time::timeout(Duration::from_secs(30), established)
        .await
        .expect("CRD established within 30 s")
        .expect("CRD watch");
}

/// Waits until kube-controller-manager's garbage collector can map the At kind, so that the
/// pods of deleted Ats go as in a cluster where the CRD is not new. It learns a new CRD at its
/// next discovery (every 30 s), and until then backs off, up to tens of seconds, on every object
/// whose owner it cannot map: a pod owned by an At deleted meanwhile stayed 41 s more. The probe
/// is a ConfigMap in `ns` owned by an At that does not exist, made anew every 2 s with another
/// owner (a new owner starts with no backoff) until the collector deletes one.
pub async fn garbage_collector_maps_ats(client: &Client, ns: &str) {
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
    use kube::api::DeleteParams;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let started = Instant::now();
    for attempt in 0.. {
        let name = format!("garbage-collector-probe-{attempt}");
        let probe = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                owner_references: Some(vec![OwnerReference {
                    api_version: cnat::conversion::V1.into(),
                    kind: "At".into(),
                    name: "no-such-at".into(),
                    // Another owner each time: the collector backs off per owner.
                    uid: format!("00000000-0000-0000-0000-{attempt:012}"),
                    ..OwnerReference::default()
                }]),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        };
        maps.create(&PostParams::default(), &probe)
            .await
            .expect("the garbage collector's probe created");
        let tried = Instant::now();
        while tried.elapsed() < Duration::from_secs(2) {
            if maps.get_opt(&name).await.expect("probe read").is_none() {
                let waited = started.elapsed();
                return eprintln!("the garbage collector maps Ats: after {waited:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the garbage collector never deleted a ConfigMap owned by a missing At within 120 s"
        );
        let _ = maps.delete(&name, &DeleteParams::default()).await;
    }
}

/// Waits up to `timeout` until `check` holds for At `name`, and returns it.
pub async fn wait_at(
    ats: &Api<cnat::api::At>,
    name: &str,
    timeout: Duration,
    check: impl Fn(&cnat::api::At) -> bool,
) -> cnat::api::At {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let at = ats.get_opt(name).await.expect("At read");
        if let Some(at) = at.filter(&check) {
            return at;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "At {name}: condition not reached within {timeout:?}: {:?}",
            ats.get_opt(name).await.ok().flatten().map(|a| a.status)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A `cnat run` process against this control plane; killed when dropped.
pub struct Replica {
    pub identity: String,
    pub child: Child,
    pub admin: std::net::SocketAddr,
    pub webhook: std::net::SocketAddr,
    /// Its log (JSON lines), stdout and stderr together.
    pub log: PathBuf,
    /// Its webhook certificates (`ca.crt`, `tls.crt`, `tls.key`).
    pub certs: PathBuf,
}

impl ControlPlane {
    /// Starts `cnat run` as `identity`, its Lease in `lease_namespace`, with `extra` flags;
    /// short election timings (lease 3 s, renew deadline 2 s, retry 500 ms).
    pub fn replica(&self, identity: &str, lease_namespace: &str, extra: &[&str]) -> Replica {
        self.start_replica(identity, lease_namespace, extra, &self.kubeconfig)
    }

    /// `replica`, acting as ServiceAccount `user` (`system:serviceaccount:NS:NAME`) with
    /// exactly the rights RBAC gives it.
    pub fn replica_as(
        &self,
        identity: &str,
        lease_namespace: &str,
        extra: &[&str],
        user: &str,
    ) -> Replica {
        let namespace = user.split(':').nth(2).unwrap_or_default();
        let kubeconfig = self.dir.join(format!("{identity}.kubeconfig"));
        let yaml = self.kubeconfig_yaml().replace(
            &format!("    token: {ADMIN_TOKEN}\n"),
            &format!(
                "    token: {ADMIN_TOKEN}\n    as: {user}\n    as-groups: [system:serviceaccounts, system:serviceaccounts:{namespace}, system:authenticated]\n"
            ),
        );
        assert!(
            yaml.contains(&format!("as: {user}")),
            "impersonation not set: {yaml}"
        );
        std::fs::write(&kubeconfig, yaml).expect("a kubeconfig");
        self.start_replica(identity, lease_namespace, extra, &kubeconfig)
    }

    /// `replica`, talking to the API server through the proxy at `url` (plain HTTP to it; see
    /// `support::proxy`).
    pub fn replica_through(
        &self,
        identity: &str,
        lease_namespace: &str,
        extra: &[&str],
        url: &str,
    ) -> Replica {
        let kubeconfig = self.dir.join(format!("{identity}-proxied.kubeconfig"));
        let yaml = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: proxy\n  cluster:\n    server: {url}\nusers:\n- name: admin\n  user:\n    token: {ADMIN_TOKEN}\ncontexts:\n- name: proxy\n  context:\n    cluster: proxy\n    user: admin\n    namespace: default\ncurrent-context: proxy\n"
        );
        std::fs::write(&kubeconfig, yaml).expect("a kubeconfig");
        self.start_replica(identity, lease_namespace, extra, &kubeconfig)
    }

    /// `replica` serving the webhook certificate in folder `certs` (made there by the first
    /// replica that uses it), as the pods of a Deployment share one Secret.
    pub fn replica_sharing(
        &self,
        identity: &str,
        lease_namespace: &str,
        extra: &[&str],
        certs: &Path,
    ) -> Replica {
        self.start_replica_with(
            identity,
            lease_namespace,
            extra,
            &self.kubeconfig,
            Some(certs),
        )
    }

    /// `replica_sharing`, running `binary` (another build of cnat, e.g. an earlier release)
    /// instead of this one.
    pub fn replica_of(
        &self,
        binary: &Path,
        identity: &str,
        lease_namespace: &str,
        extra: &[&str],
        certs: &Path,
    ) -> Replica {
        self.start_binary(
            binary,
            identity,
            lease_namespace,
            extra,
            &self.kubeconfig,
            Some(certs),
        )
    }

    fn start_replica(
        &self,
        identity: &str,
        lease_namespace: &str,
        extra: &[&str],
        kubeconfig: &Path,
    ) -> Replica {
        self.start_replica_with(identity, lease_namespace, extra, kubeconfig, None)
    }

    fn start_replica_with(
        &self,
        identity: &str,
        lease_namespace: &str,
        extra: &[&str],
        kubeconfig: &Path,
        shared: Option<&Path>,
    ) -> Replica {
        let binary = cnat_binary();
        self.start_binary(
            &binary,
            identity,
            lease_namespace,
            extra,
            kubeconfig,
            shared,
        )
    }

    /// Starts `binary` as a replica with the certificates in `shared` (made there, whole, if
    /// missing), or with its own. Each start has its own log and certificate folder, also when
    /// tests on one control plane use the same identity at once.
    fn start_binary(
        &self,
        binary: &Path,
        identity: &str,
        lease_namespace: &str,
        extra: &[&str],
        kubeconfig: &Path,
        shared: Option<&Path>,
    ) -> Replica {
        static STARTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let start = STARTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let certs = shared.map_or_else(
            || self.dir.join(format!("certs-{identity}-{start}")),
            Path::to_owned,
        );
        if !certs.join("tls.key").exists() {
            // Written aside, then renamed into place: a replica sharing the folder never sees
            // half of it.
            let aside = self.dir.join(format!("certs-{identity}-{start}.new"));
            cnat::serving::tls::generate("cnat-webhook", "cnat-system", 1)
                .and_then(|made| made.write(&aside))
                .expect("webhook certificates");
            if std::fs::rename(&aside, &certs).is_err() {
                // Another start made it first: use theirs.
                let _ = std::fs::remove_dir_all(&aside);
            }
        }
        let files = cnat::serving::tls::CertFiles {
            cert: certs.join("tls.crt"),
            key: certs.join("tls.key"),
            client_ca: None,
        };
        let log = self.dir.join(format!("{identity}-{start}.log"));
        let mut command = Command::new(binary);
        command
            .arg("run")
            // Port 0: the replica binds free ports itself (see `ports`).
            .args(super::ports::ANY_PORTS)
            .arg(format!("--tls-cert={}", files.cert.display()))
            .arg(format!("--tls-key={}", files.key.display()))
            .arg(format!("--identity={identity}"))
            .arg(format!("--lease-namespace={lease_namespace}"))
            // Defaults for tests, unless `extra` sets the same flag.
            .args(
                [
                    "--lease-duration=3s",
                    "--renew-deadline=2s",
                    "--retry-period=500ms",
                    "--shutdown-delay=200ms",
                    "--shutdown-timeout=5s",
                    "--log-format=json",
                ]
                .into_iter()
                .filter(|default| {
                    let flag = default.split('=').next().unwrap_or(default);
                    !extra.iter().any(|e| e.split('=').next() == Some(flag))
                }),
            )
            .args(extra)
            .env("KUBECONFIG", kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE");
        let mut child = spawn(command, &log);
        running(&self.dir, child.id());
        let webhooks = !extra.contains(&"--webhooks=false");
        let (admin, webhook) = super::ports::bound(&mut child, webhooks, || {
            std::fs::read_to_string(&log).unwrap_or_default()
        });
        Replica {
            identity: identity.to_owned(),
            child,
            admin,
            webhook,
            log,
            certs,
        }
    }
}

impl Replica {
    /// The CA that signed its webhook serving certificate.
    pub fn ca(&self) -> PathBuf {
        self.certs.join("ca.crt")
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends SIGTERM (a graceful stop, as a Deployment does).
    pub fn terminate(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: signalling a child of this process, not yet reaped.
            unsafe {
                libc::kill(self.child.id().cast_signed(), libc::SIGTERM);
            }
        }
    }

    /// Kills it at once (SIGKILL: a crash or a lost node).
    pub fn kill(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        stopped(self.child.id());
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Registers the webhook configurations cnat ships (`webhooks/`), pointed by URL at
/// `https://127.0.0.1:PORT` of `webhook` with the CA in file `ca`, for Ats in `namespace` only.
pub async fn register_webhooks(
    client: &Client,
    webhook: std::net::SocketAddr,
    ca: &Path,
    namespace: &str,
) {
    use base64::Engine;
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
    };
    let ca = std::fs::read(ca).expect("the webhook CA");
    let configuration = |file: &str| {
        let path = format!("{}/webhooks/{file}", env!("CARGO_MANIFEST_DIR"));
        let mut config: serde_json::Value =
            serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        config["metadata"]["name"] = format!("cnat-{namespace}").into();
        for hook in config["webhooks"].as_array_mut().unwrap() {
            let path = hook["clientConfig"]["service"]["path"]
                .as_str()
                .unwrap()
                .to_owned();
            hook["clientConfig"] = serde_json::json!({
                "url": format!("https://127.0.0.1:{}{path}", webhook.port()),
                "caBundle": base64::engine::general_purpose::STANDARD.encode(&ca),
            });
            hook["namespaceSelector"] =
                serde_json::json!({"matchLabels": {"kubernetes.io/metadata.name": namespace}});
        }
        config
    };
    let params = kube::api::PatchParams::apply("cnat-e2e").force();
    let validating: ValidatingWebhookConfiguration =
        serde_json::from_value(configuration("validating.yaml")).unwrap();
    let name = validating.metadata.name.clone().unwrap();
    Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .patch(&name, &params, &kube::api::Patch::Apply(&validating))
        .await
        .unwrap();
    let mutating: MutatingWebhookConfiguration =
        serde_json::from_value(configuration("mutating.yaml")).unwrap();
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .patch(&name, &params, &kube::api::Patch::Apply(&mutating))
        .await
        .unwrap();
}

/// The pods `pods` lists that still carry cnat's finalizer, as `namespace/name`.
pub async fn pods_held(pods: &Api<k8s_openapi::api::core::v1::Pod>) -> Vec<String> {
    pods.list(&Default::default())
        .await
        .expect("pods listed")
        .items
        .iter()
        .filter(|p| cnat::operator::finalizer::is_present(p))
        .map(|p| {
            use kube::ResourceExt;
            format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any())
        })
        .collect()
}

/// The holder of Lease `namespace/name`, if any.
pub async fn lease_holder(client: &Client, namespace: &str, name: &str) -> Option<String> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), namespace);
    leases
        .get_opt(name)
        .await
        .ok()
        .flatten()?
        .spec?
        .holder_identity
        .filter(|h| !h.is_empty())
}
