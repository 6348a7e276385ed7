//! `scripts/demo`: cnat tried in one command, with no cluster and no container image.
//!
//! It starts the control plane the tests use (etcd, kube-apiserver and kube-controller-manager
//! of `KUBEBUILDER_ASSETS`, see `tests/support/envtest.rs`) in a temporary folder, installs the
//! CRD, runs three `cnat run` replicas that compete for the Lease and serve the webhooks behind
//! one address (as a Service would), applies the book's example and a malformed At, plays the
//! kubelet (there is none) so that pods end, stops the leader to show a handover, and prints the
//! `kubectl` commands to go on by hand. Then it waits: Ctrl-C, SIGTERM or `scripts/demo stop`
//! stops every process it started and removes the folder.

#[path = "../tests/support/mod.rs"]
mod support;

use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::WebhookClientConfig;
use kube::api::PostParams;
use kube::{Api, Client};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};
use support::envtest::{self, ControlPlane, Replica};
use support::service::Service;

/// Where the Ats go: the namespace `kubectl` uses by default.
const NAMESPACE: &str = "default";
const LEASE_NAMESPACE: &str = "cnat-system";
const LEASE: &str = "cnat";
const REPLICAS: [&str; 3] = ["cnat-0", "cnat-1", "cnat-2"];
/// The line after which the demo only waits (the test of `scripts/demo` reads up to it).
const READY_LINE: &str = "The demo runs until Ctrl-C";

const EXAMPLE: &str = r#"apiVersion: cnat.programming-kubernetes.info/v1
kind: At
metadata: {name: example-at}
spec:
  schedule: "2019-04-12T10:12:00Z"
  command: "echo YAY"
"#;

const MALFORMED: &str = r#"apiVersion: cnat.programming-kubernetes.info/v1
kind: At
metadata: {name: malformed}
spec:
  schedule: "next tuesday"
  command: ""
"#;

const FAILING: &str = r#"apiVersion: cnat.programming-kubernetes.info/v1
kind: At
metadata: {name: fails}
spec:
  schedule: "2019-04-12T10:12:00Z"
  command: "echo 'about to fail' >&2; exit 3"
"#;

#[tokio::main]
async fn main() -> ExitCode {
    stop_on_signal();
    match run().await {
        // The replicas and the Service's forwarder run while this holds them.
        Ok(_running) => std::future::pending().await,
        Err(why) => {
            eprintln!("cnat demo: {why}");
            ExitCode::FAILURE
        }
    }
}

/// Ctrl-C or SIGTERM ends the process; its exit handler (`tests/support/envtest.rs`) kills
/// every process of the control plane and the replicas, and removes their folder.
fn stop_on_signal() {
    tokio::spawn(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("a SIGTERM handler");
        // The terminal closed.
        let mut hangup = signal(SignalKind::hangup()).expect("a SIGHUP handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
            _ = hangup.recv() => {}
        }
        // Not println!: with nobody reading any more, it would panic and nothing would stop.
        use std::io::Write;
        let _ = writeln!(
            std::io::stdout(),
            "\nStopping: the replicas, kube-controller-manager, kube-apiserver and etcd; removing their folder."
        );
        // `exit` runs the exit handlers: the one that stops everything this process started,
        // and `forget_pidfile`.
        std::process::exit(0);
    });
}

/// The file `scripts/demo stop` reads this process's id from.
fn pidfile() -> Option<PathBuf> {
    std::env::var_os("CNAT_DEMO_PIDFILE").map(PathBuf::from)
}

/// Removes the pidfile however the process exits (a signal, an error, a panic in `main`'s
/// thread): a stale one would name a process id that may come to be another's.
extern "C" fn forget_pidfile() {
    if let Some(pidfile) = pidfile() {
        let _ = std::fs::remove_file(pidfile);
    }
}

/// What must live while the demo waits: the replicas (dropping one kills it) and the address
/// standing for the webhook Service.
struct Running {
    _replicas: Vec<Replica>,
    _service: Service,
}

async fn run() -> Result<Running, String> {
    if let Some(pidfile) = pidfile() {
        std::fs::write(&pidfile, format!("{}\n", std::process::id()))
            .map_err(|e| format!("writing {}: {e}", pidfile.display()))?;
        // SAFETY: registering a plain extern "C" function, once.
        unsafe {
            libc::atexit(forget_pidfile);
        }
    }
    let Some(assets) = envtest::assets() else {
        return Err("no control plane binaries: KUBEBUILDER_ASSETS must name a folder with etcd and kube-apiserver (scripts/demo prepares one with scripts/envtest)".into());
    };
    say("Starting a local control plane (etcd, kube-apiserver, kube-controller-manager)");
    let plane = envtest::own_control_plane().ok_or("the control plane did not start")?;
    if !assets.join("kubectl").exists() {
        println!(
            "(no kubectl in {}: the one on PATH is used)",
            assets.display()
        );
    }
    println!(
        "kube-apiserver {} at {}, its files in {}",
        plane.version,
        plane.server,
        plane.dir.display()
    );
    let client = plane.admin().await;
    create_namespace(&client, LEASE_NAMESPACE).await?;

    // One serving certificate for every replica, as the chart's Secret.
    let certs = plane.dir.join("webhook-certs");
    cnat::serving::tls::generate("cnat-webhook", LEASE_NAMESPACE, 1)
        .and_then(|made| made.write(&certs))
        .map_err(|e| format!("webhook certificates: {e}"))?;
    let ca = certs.join("ca.crt");
    let service = Service::default();
    let address = service.start().await;

    say("Installing the At CRD (v1 stored, v1alpha1 served, conversion by the webhook)");
    let crd = cnat::api::crd_with(WebhookClientConfig {
        url: Some(format!("https://127.0.0.1:{}/convert", address.port())),
        ca_bundle: Some(k8s_openapi::ByteString(
            std::fs::read(&ca).map_err(|e| format!("{}: {e}", ca.display()))?,
        )),
        service: None,
    });
    envtest::install_crd(&client, &cnat::api::crd_to_yaml(&crd)).await;

    say("Starting three replicas: they compete for the Lease, each serves the webhooks");
    let mut replicas: Vec<Replica> = Vec::new();
    for identity in REPLICAS {
        let replica = plane.replica_sharing(identity, LEASE_NAMESPACE, &[], &certs);
        service.add(&replica);
        println!(
            "{identity}: webhooks on {}, /metrics and /readyz on {}, log {}",
            replica.webhook,
            replica.admin,
            replica.log.display()
        );
        replicas.push(replica);
    }
    for replica in &replicas {
        service.wait_ready(replica).await;
    }
    envtest::register_webhooks(&client, address, &ca, NAMESPACE).await;
    default_service_account(plane, &client).await?;
    let leader = wait_for(Duration::from_secs(30), "leader", || {
        envtest::lease_holder(&client, LEASE_NAMESPACE, LEASE)
    })
    .await?;
    println!("{leader} holds the Lease {LEASE_NAMESPACE}/{LEASE} and reconciles; the others wait");
    kubectl(plane, &["get", "lease", "-n", LEASE_NAMESPACE, LEASE], None);

    say("The book's example: due in the past, so it runs at once");
    kubectl(plane, &["apply", "-f", "-"], Some(EXAMPLE));
    say("A malformed At: the validating webhook refuses it, naming each field and the fix");
    kubectl(plane, &["apply", "-f", "-"], Some(MALFORMED));

    say("No kubelet here: the demo plays it, writing each pod's end into its status");
    wait_for_pod(&client, "example-at-pod").await?;
    kubectl(plane, &["get", "ats,pods"], None);
    envtest::end_pod(&client, NAMESPACE, "example-at-pod", 0, "")
        .await
        .map_err(|e| format!("ending pod example-at-pod: {e}"))?;
    println!("(pod example-at-pod: phase Succeeded, exit code 0)");
    wait_for_done(&client, "example-at").await?;
    kubectl(plane, &["get", "ats", "-o", "wide"], None);

    say("An At whose command fails: its output (the pod's termination message) shows in the At");
    kubectl(plane, &["apply", "-f", "-"], Some(FAILING));
    wait_for_pod(&client, "fails-pod").await?;
    // A kubelet puts the end of the log into the termination message of a container that failed
    // (the pod's terminationMessagePolicy is FallbackToLogsOnError).
    envtest::end_pod(&client, NAMESPACE, "fails-pod", 3, "about to fail\n")
        .await
        .map_err(|e| format!("ending pod fails-pod: {e}"))?;
    println!("(pod fails-pod: phase Failed, exit code 3, termination message \"about to fail\")");
    wait_for_done(&client, "fails").await?;
    kubectl(plane, &["get", "at", "fails", "-o", "wide"], None);

    // Leadership may have moved meanwhile (a loaded machine): stop the one leading now.
    let leader = wait_for(Duration::from_secs(30), "leader", || {
        envtest::lease_holder(&client, LEASE_NAMESPACE, LEASE)
    })
    .await?;
    say(&format!(
        "A handover: stopping the leader {leader} (SIGTERM, as a rolling upgrade does)"
    ));
    let stopped = Instant::now();
    let index = replicas
        .iter()
        .position(|r| r.identity == leader)
        .ok_or_else(|| format!("the leader {leader} is none of this demo's replicas"))?;
    service.remove(&replicas[index]);
    replicas[index].terminate();
    let next = wait_for(Duration::from_secs(30), "new leader", || async {
        envtest::lease_holder(&client, LEASE_NAMESPACE, LEASE)
            .await
            .filter(|holder| *holder != leader)
    })
    .await?;
    println!(
        "{next} took the Lease {:.1} s after {leader} was told to stop",
        stopped.elapsed().as_secs_f64()
    );
    let at = format!(
        "apiVersion: cnat.programming-kubernetes.info/v1\nkind: At\nmetadata: {{name: after-handover}}\nspec:\n  schedule: \"{}\"\n  command: \"date\"\n",
        chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    );
    kubectl(plane, &["apply", "-f", "-"], Some(&at));
    wait_for_pod(&client, "after-handover-pod").await?;
    envtest::end_pod(&client, NAMESPACE, "after-handover-pod", 0, "")
        .await
        .map_err(|e| format!("ending pod after-handover-pod: {e}"))?;
    wait_for_done(&client, "after-handover").await?;
    kubectl(plane, &["get", "ats"], None);

    say("Go on by hand");
    let plugin = envtest::this_build().with_file_name("kubectl-at");
    let folder = plugin.parent().map(Path::display);
    println!(
        "export KUBECONFIG={}\n\
         kubectl get ats -o wide                      # every At: phase, outcome, reason, pod\n\
         kubectl describe at example-at               # spec, status, conditions, events\n\
         kubectl get ats.v1alpha1.cnat.programming-kubernetes.info   # the same Ats, as the book's v1alpha1\n\
         kubectl get lease -n {LEASE_NAMESPACE} {LEASE} -o yaml       # who leads\n\
         export PATH={}:$PATH                     # the kubectl plugin (kubectl at), built with the demo\n\
         kubectl at now + 1 minute -- echo hello      # at(1) on Kubernetes\n\
         kubectl at -l                                # atq\n\
         kubectl patch pod NAME --subresource=status --type=merge -p '{{\"status\":{{\"phase\":\"Succeeded\"}}}}'   # play the kubelet\n\
         \n\
         {READY_LINE} (or `scripts/demo stop` from another terminal); that stops every process it started.",
        plane.kubeconfig.display(),
        folder.map(|f| f.to_string()).unwrap_or_default(),
    );
    Ok(Running {
        _replicas: replicas,
        _service: service,
    })
}

fn say(what: &str) {
    println!("\n== {what}");
}

/// Runs `kubectl ARGS` against `plane` (with `stdin`), printing the command and what it said.
fn kubectl(plane: &ControlPlane, args: &[&str], stdin: Option<&str>) {
    use std::io::Write;
    let shown = match stdin {
        Some(manifest) => format!("$ kubectl {} <<'EOF'\n{manifest}EOF", args.join(" ")),
        None => format!("$ kubectl {}", args.join(" ")),
    };
    println!("{shown}");
    let mut command = plane.kubectl();
    command
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let output = command.spawn().and_then(|mut child| {
        if let Some(mut input) = child.stdin.take() {
            input.write_all(stdin.unwrap_or_default().as_bytes())?;
        }
        child.wait_with_output()
    });
    match output {
        Ok(output) => {
            print!("{}", String::from_utf8_lossy(&output.stdout));
            print!("{}", String::from_utf8_lossy(&output.stderr));
        }
        Err(e) => println!("(kubectl did not run: {e})"),
    }
}

async fn create_namespace(client: &Client, name: &str) -> Result<(), String> {
    let namespace = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .map(drop)
        .map_err(|e| format!("creating namespace {name}: {e}"))
}

/// Polls `check` every 100 ms until it gives a value, for at most `within`.
async fn wait_for<T, F: std::future::Future<Output = Option<T>>>(
    within: Duration,
    what: &str,
    check: impl Fn() -> F,
) -> Result<T, String> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(found) = check().await {
            return Ok(found);
        }
        if Instant::now() > deadline {
            return Err(format!("no {what} within {} s", within.as_secs()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_for_pod(client: &Client, name: &str) -> Result<Pod, String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    wait_for(Duration::from_secs(60), &format!("pod {name}"), || async {
        pods.get_opt(name).await.ok().flatten()
    })
    .await
}

/// Waits until At `name` is `Done`.
async fn wait_for_done(client: &Client, name: &str) -> Result<(), String> {
    let ats: Api<cnat::api::At> = Api::namespaced(client.clone(), NAMESPACE);
    wait_for(
        Duration::from_secs(60),
        &format!("phase Done of At {name}"),
        || async {
            let at = ats.get_opt(name).await.ok().flatten()?;
            (at.status?.phase == cnat::api::Phase::Done).then_some(())
        },
    )
    .await
}

/// Waits for the `default` ServiceAccount of the Ats' namespace, which pods need: the
/// controller manager makes it (or, without one, this does).
async fn default_service_account(plane: &ControlPlane, client: &Client) -> Result<(), String> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
    if !plane.has_controller_manager() {
        let account = ServiceAccount {
            metadata: kube::api::ObjectMeta {
                name: Some("default".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        accounts
            .create(&PostParams::default(), &account)
            .await
            .map_err(|e| format!("creating ServiceAccount {NAMESPACE}/default: {e}"))?;
    }
    wait_for(
        Duration::from_secs(90),
        &format!("ServiceAccount {NAMESPACE}/default"),
        || async { accounts.get_opt("default").await.ok().flatten() },
    )
    .await
    .map(drop)
}
