//! cnat on a real one-node cluster (`scripts/cluster up`, v1.37, or `scripts/cluster up 1.24`:
//! etcd, kube-apiserver, kube-controller-manager, kube-scheduler, a kubelet running containerd
//! and runc, kube-proxy, a CNI bridge), installed with Helm from the chart `scripts/release`
//! packages (its image the release's) and upgraded to `charts/cnat`, with the commands
//! docs/src/operating/install.md and upgrading.md show. Pods really run: the output, exit codes
//! and deadlines the Ats record come from containers, webhooks are called through their
//! Service, and the Deployment's own rollout replaces the replicas.
//!
//! The cluster is named by `CNAT_CLUSTER_KUBECONFIG`; it must have the images `cnat:<appVersion>`
//! and `cnat:<appVersion>-next` (the build under test, twice: the upgrade changes the tag),
//! [`RELEASED`]`:<appVersion>` (from target/dist) and `busybox:1.36` (which the test tags
//! [`MIRROR`] on the node, the operator's default image for a cluster without Docker Hub).
//! `scripts/test` does all of it (`scripts/test-steps cluster-artifacts`, then `cluster-up`); by
//! hand, after a build of the `suite` profile:
//!
//! ```sh
//! scripts/test-steps cluster-artifacts   # scripts/image twice and scripts/release, into target/
//! scripts/test-steps cluster-up 1.37     # scripts/cluster up, then scripts/cluster load of those
//! CNAT_CLUSTER_KUBECONFIG=/tmp/cnat-cluster/admin.kubeconfig cargo nextest run --cargo-profile suite --test cluster
//! ```
//!
//! Without `CNAT_CLUSTER_KUBECONFIG` the test is skipped with one line (it fails instead with
//! `CNAT_REQUIRE_REAL_SERVER=1`, as `scripts/test` runs it). The steps run in order in one test:
//! one release on one cluster, as a user has it.

mod support;

use cnat::api::{At, Outcome, Phase};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, ResourceExt};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;
use support::otlp::Collector;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// The release and its namespace, as the install page names them.
const RELEASE: &str = "cnat";
const SYSTEM: &str = "cnat-system";
/// Where the user's Ats go.
const TEAM: &str = "team-a";
/// The namespace of an At running when cnat is uninstalled without its hook.
const LEFT_BEHIND: &str = "team-b";
/// The image repository of the release the test packages (scripts/release --repository).
const RELEASED: &str = "cnat.test/release/cnat";
/// The node's address (scripts/cluster): pods reach the host there.
const NODE_ADDRESS: &str = "10.244.0.1";
/// The operator's default image, as a cluster without Docker Hub has it: busybox, on the node
/// under a name of its own (no registry serves it), never pulled (`imagePullPolicy: Never`).
const MIRROR: &str = "cnat.test/mirror/busybox:1.36";
/// A real pod: scheduling, a container start, the kubelet's status report, on a busy machine.
const DONE_WITHIN: Duration = Duration::from_secs(90);

struct Cluster {
    kubeconfig: PathBuf,
    /// scripts/cluster's folder: the containerd socket, the scratch space of the tools run here.
    dir: PathBuf,
    client: Client,
    app_version: String,
}

async fn cluster() -> Option<Cluster> {
    let Some(kubeconfig) = std::env::var_os("CNAT_CLUSTER_KUBECONFIG").map(PathBuf::from) else {
        assert!(
            std::env::var("CNAT_REQUIRE_REAL_SERVER").as_deref() != Ok("1"),
            "CNAT_CLUSTER_KUBECONFIG is not set and CNAT_REQUIRE_REAL_SERVER=1 forbids skipping: \
             start a cluster with scripts/cluster up (see tests/cluster.rs)"
        );
        eprintln!("skipped: no cluster; set CNAT_CLUSTER_KUBECONFIG (see tests/cluster.rs)");
        return None;
    };
    let dir = kubeconfig
        .parent()
        .expect("the cluster's folder")
        .to_path_buf();
    let config = kube::Config::from_custom_kubeconfig(
        Kubeconfig::read_from(&kubeconfig).expect("the cluster's kubeconfig"),
        &KubeConfigOptions::default(),
    )
    .await
    .expect("a client configuration");
    let client = Client::try_from(config).expect("a client");
    let chart = std::fs::read_to_string(Path::new(ROOT).join("charts/cnat/Chart.yaml")).unwrap();
    let app_version = chart
        .lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .expect("appVersion in Chart.yaml")
        .trim()
        .trim_matches('"')
        .to_owned();
    Some(Cluster {
        kubeconfig,
        dir,
        client,
        app_version,
    })
}

impl Cluster {
    /// `program` with this cluster's KUBECONFIG, and every cache and config of kubectl and helm
    /// in the cluster's folder (none in the home folder).
    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new(program);
        let scratch = self.dir.join("clients");
        command
            .env("KUBECONFIG", &self.kubeconfig)
            // Never the cluster this test may itself run in.
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("KUBECACHEDIR", scratch.join("kube-cache"))
            .env("HELM_CACHE_HOME", scratch.join("helm-cache"))
            .env("HELM_CONFIG_HOME", scratch.join("helm-config"))
            .env("HELM_DATA_HOME", scratch.join("helm-data"));
        command
    }

    fn kubectl(&self, args: &[&str], input: Option<&str>) -> Output {
        let kubectl = Path::new(ROOT).join(".tools/envtest-1.37/kubectl");
        run(self.command(kubectl).args(args), input)
    }

    /// `helm ARGS`, which must succeed: its standard output.
    fn helm(&self, args: &[&str]) -> String {
        let helm = Path::new(ROOT).join(".tools/helm");
        let output = run(self.command(helm).args(args), None);
        succeeded(&format!("helm {args:?}"), &output)
    }

    /// The containerd socket of the node (scripts/cluster's layout).
    fn containerd(&self) -> PathBuf {
        self.dir.join("containerd/containerd.sock")
    }
}

fn run(command: &mut Command, input: Option<&str>) -> Output {
    command.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command
        .spawn()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    if let Some(input) = input {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    child.wait_with_output().unwrap()
}

fn succeeded(what: &str, output: &Output) -> String {
    assert!(
        output.status.success(),
        "{what}: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Polls `check` every 200 ms until it gives a value; panics with `what` after `within`.
async fn eventually<T>(
    what: &str,
    within: Duration,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> T {
    support::until_some(within, async || {
        let found = check().await;
        if found.is_none() {
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        found
    })
    .await
    .unwrap_or_else(|| panic!("{what}: not within {within:?}"))
}

async fn done(ats: &Api<At>, name: &str) -> At {
    eventually(&format!("At {name} Done"), DONE_WITHIN, async || {
        ats.get_opt(name)
            .await
            .ok()
            .flatten()
            .filter(|at| at.status.as_ref().is_some_and(|s| s.phase == Phase::Done))
    })
    .await
}

/// The pods of the At with this uid (its owner reference), wherever they are.
async fn pods_of(pods: &Api<Pod>, at: &At) -> Vec<Pod> {
    let uid = at.uid().expect("a stored At");
    pods.list(&ListParams::default())
        .await
        .expect("pods listed")
        .items
        .into_iter()
        .filter(|pod| pod.owner_references().iter().any(|o| o.uid == uid))
        .collect()
}

/// The At `name` once Done: it ran once (one pod) and its command succeeded. Its status and pod.
async fn ran_once(ats: &Api<At>, pods: &Api<Pod>, name: &str) -> (cnat::api::AtStatus, Pod) {
    let at = done(ats, name).await;
    let mut ran = pods_of(pods, &at).await;
    assert_eq!(ran.len(), 1, "At {name}: {} pods", ran.len());
    let status = at.status.expect("a Done At has a status");
    assert_eq!(
        status.outcome,
        Some(Outcome::Succeeded),
        "{name}: {status:?}"
    );
    (status, ran.remove(0))
}

fn pod_time(
    time: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) -> chrono::DateTime<chrono::Utc> {
    cnat::schedule::to_chrono(time)
}

/// One At due at `due` (RFC 3339), running `command`.
fn at(name: &str, due: chrono::DateTime<chrono::Utc>, command: &str) -> At {
    At::new(
        name,
        cnat::api::AtSpec {
            schedule: due.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            command: command.into(),
            ..Default::default()
        },
    )
}

/// The operator's pods, by name, with their IPs.
async fn replicas(cluster: &Cluster) -> BTreeMap<String, String> {
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), SYSTEM);
    let selector = format!("app.kubernetes.io/instance={RELEASE},app.kubernetes.io/name=cnat");
    pods.list(&ListParams::default().labels(&selector))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let ip = p.status.as_ref()?.pod_ip.clone()?;
            Some((p.name_any(), ip))
        })
        .collect()
}

async fn lease_holder(cluster: &Cluster) -> Option<String> {
    support::envtest::lease_holder(&cluster.client, SYSTEM, "cnat").await
}

/// A pod's `/metrics` on its admin port (8080), read from the host at the pod's address.
async fn metrics(ip: &str) -> String {
    let url = format!("http://{ip}:8080/metrics");
    let output = tokio::process::Command::new("curl")
        .args(["-sf", "--max-time", "5", &url])
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "curl {url}: {}", output.status);
    String::from_utf8(output.stdout).unwrap()
}

/// A validating review of an At create, posted to a replica's webhook port (8443) at its pod's
/// address: it must be allowed.
async fn review(ip: &str, name: &str) {
    let uid = format!("cluster-test-{name}");
    let body = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid, "operation": "CREATE", "namespace": TEAM, "name": "direct",
            "kind": {"group": "cnat.programming-kubernetes.info", "version": "v1", "kind": "At"},
            "resource": {"group": "cnat.programming-kubernetes.info", "version": "v1", "resource": "ats"},
            "userInfo": {"username": "admin", "groups": ["system:masters", "system:authenticated"]},
            "object": serde_json::to_value(at("direct", chrono::Utc::now(), "true")).unwrap(),
        }
    });
    let url = format!("https://{ip}:8443/validating");
    let output = tokio::process::Command::new("curl")
        .args([
            "-sfk",
            "--max-time",
            "5",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
        ])
        .arg(body.to_string())
        .arg(&url)
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "curl {url}: {}", output.status);
    let answer: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(answer["response"]["uid"], uid.as_str(), "{answer}");
    assert_eq!(answer["response"]["allowed"], true, "{name}: {answer}");
}

/// The sum of a counter's samples on a metrics page.
fn counter(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn installed_as_users_do_cnat_runs_real_pods_survives_upgrades_and_kills_and_uninstalls() {
    let Some(cluster) = cluster().await else {
        return;
    };
    // The collector on the host, where the replicas' pods reach it (the node's address).
    let (collector, otlp) = Collector::grpc_on(NODE_ADDRESS).await;

    let begun = std::time::Instant::now();
    let step = |name: &str| {
        eprintln!(
            "cluster test: {name} (at {:.1} s)",
            begun.elapsed().as_secs_f64()
        )
    };
    step("helm install");
    let notes = install(&cluster, otlp).await;
    step("pods that cannot start, deadlines: started");
    start_pods_that_cannot_start_and_deadlines(&cluster).await;
    step("the NOTES' example");
    the_notes_example_runs(&cluster, &notes).await;
    step("a malformed At");
    a_malformed_at_is_refused_by_the_webhook_through_its_service(&cluster);
    step("a caBundle that does not match the certificate");
    a_foreign_ca_bundle_is_written_back_by_cnat(&cluster).await;
    step("a failing command");
    a_failing_command_records_its_exit_code_and_output(&cluster).await;
    step("kubectl at --wait");
    kubectl_at_wait_returns_the_exit_code(&cluster);
    step("admin commands: kubectl cnat, kubectl exec");
    admin_commands_run_as_a_kubectl_plugin_and_from_the_image(&cluster);
    step("a ResourceQuota");
    a_quota_refusal_shows_on_the_at(&cluster).await;
    step("pods that cannot start show on their Ats; deadlines met");
    pods_that_cannot_start_show_on_their_ats(&cluster).await;
    deadlines_stop_a_running_and_a_never_started_pod_on_time(&cluster).await;
    step("webhooks, metrics, traces");
    every_replica_serves_webhooks_and_metrics_and_traces_reach_the_collector(&cluster, &collector)
        .await;
    step("helm upgrade under load");
    an_upgrade_under_load_fails_no_apply_and_runs_every_at_once_on_time(&cluster).await;
    step("the pod whose Secret was missing started");
    the_pod_started_once_its_secret_existed(&cluster).await;
    step("helm template | kubectl apply under load");
    let mut values = install_values(otlp);
    values.push(format!("image.tag={}-next", cluster.app_version));
    gitops_re_applies_fail_no_admission(&cluster, &values).await;
    step("the leader killed");
    killing_the_leader_runs_every_at_once(&cluster).await;
    step("helm uninstall while Ats fall due");
    uninstall_leaves_no_finalizer_and_namespaces_delete(&cluster).await;
    // On the newest version only: what it checks is Helm's and the Job controller's, the same
    // on every version, and it costs the hook's 30 s deadline.
    let version = cluster.client.apiserver_version().await.unwrap();
    if version
        .minor
        .trim_end_matches('+')
        .parse::<u32>()
        .unwrap_or(0)
        >= 30
    {
        step("helm uninstall whose hook cannot run");
        an_uninstall_whose_hook_cannot_run_fails_within_its_deadline(&cluster).await;
    }
    step("done");
}

/// The values the release is installed with: three replicas, the Ats' default image
/// [`MIRROR`] (on the node, never pulled), traces to the collector at `otlp`.
fn install_values(otlp: std::net::SocketAddr) -> Vec<String> {
    vec![
        "replicaCount=3".into(),
        format!("runDefaults.image={MIRROR}"),
        "runDefaults.imagePullPolicy=Never".into(),
        format!("tracing.otlpEndpoint=http://{otlp}"),
    ]
}

/// `helm install` as the install page shows it for a cluster without Docker Hub (three
/// replicas, the Ats' default image [`MIRROR`], on the node and never pulled), plus the
/// collector; the Deployment Ready, one Lease holder, `helm test` passes. Returns the NOTES.
async fn install(cluster: &Cluster, otlp: std::net::SocketAddr) -> String {
    // The node has busybox under the mirror's name too, as an air-gapped node would have it.
    let tagged = Command::new("ctr")
        .arg("--address")
        .arg(cluster.containerd())
        .args(["-n", "k8s.io", "images", "tag", "--force"])
        .args(["docker.io/library/busybox:1.36", MIRROR])
        .output()
        .unwrap();
    succeeded("ctr images tag", &tagged);
    // The chart as a release publishes it (scripts/release, run by scripts/test-steps
    // cluster-artifacts): packaged, its image the release's, the archives' checksums right.
    let dist = Path::new(ROOT).join("target/dist");
    let chart = dist.join(format!("cnat-{}.tgz", cluster.app_version));
    assert!(
        chart.exists(),
        "{}: run scripts/release --binaries target/suite --repository {RELEASED} target/dist, and load its image",
        chart.display()
    );
    let checked = run(
        Command::new("sha256sum")
            .args(["--check", "--strict", "SHA256SUMS"])
            .current_dir(&dist),
        None,
    );
    succeeded("sha256sum --check SHA256SUMS", &checked);
    let mut args = vec![
        "install",
        RELEASE,
        chart.to_str().unwrap(),
        "-n",
        SYSTEM,
        "--create-namespace",
        "--wait",
        "--timeout",
        "300s",
    ];
    let values = install_values(otlp);
    for value in &values {
        args.extend(["--set", value.as_str()]);
    }
    let out = cluster.helm(&args);
    let deployments: Api<Deployment> = Api::namespaced(cluster.client.clone(), SYSTEM);
    let deployment = deployments.get(RELEASE).await.unwrap();
    let pod_spec = deployment.spec.template.spec.as_ref();
    let image = pod_spec.and_then(|p| p.containers[0].image.clone());
    assert_eq!(image, Some(format!("{RELEASED}:{}", cluster.app_version)));
    let status = deployment.status.unwrap();
    assert_eq!(status.ready_replicas, Some(3), "{status:?}");
    let replicas = replicas(cluster).await;
    // One of them leads (a Lease an earlier release left behind names a pod that is gone: it
    // expires first).
    eventually(
        &format!("one of {replicas:?} holding the Lease"),
        Duration::from_secs(60),
        async || {
            lease_holder(cluster)
                .await
                .filter(|h| replicas.contains_key(h))
        },
    )
    .await;
    cluster.helm(&["test", RELEASE, "-n", SYSTEM]);
    let namespaces: Api<Namespace> = Api::all(cluster.client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": TEAM}})).unwrap(),
        )
        .await
        .unwrap();
    // Pods need the namespace's ServiceAccount, which a controller writes.
    eventually(
        "team-a's default ServiceAccount",
        Duration::from_secs(30),
        async || {
            let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
                Api::namespaced(cluster.client.clone(), TEAM);
            accounts.get_opt("default").await.ok().flatten()
        },
    )
    .await;
    out
}

/// The NOTES' "Try it" At, applied with kubectl exactly as shown: a real pod prints YAY,
/// `kubectl logs` (the API server through the kubelet) shows it.
async fn the_notes_example_runs(cluster: &Cluster, notes: &str) {
    let start = notes
        .find("kubectl apply -f - <<'YAML'")
        .expect("the NOTES show an At to apply");
    let body: String = notes[start..]
        .lines()
        .skip(1)
        .take_while(|l| l.trim() != "YAML")
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect();
    let applied = cluster.kubectl(&["apply", "-n", TEAM, "-f", "-"], Some(&body));
    succeeded("kubectl apply of the NOTES' At", &applied);
    let name = "example-at";
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), TEAM);
    let status = done(&ats, name).await.status.unwrap();
    assert_eq!(status.outcome, Some(Outcome::Succeeded), "{status:?}");
    assert_eq!(status.exit_code, Some(0), "{status:?}");
    let pod = status.pod_name.expect("the pod's name");
    let logs = cluster.kubectl(&["logs", "-n", TEAM, &pod], None);
    assert_eq!(succeeded("kubectl logs", &logs).trim(), "YAY");
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), TEAM);
    let ran = pods.get(&pod).await.unwrap();
    assert_eq!(ran.status.unwrap().phase.as_deref(), Some("Succeeded"));
    // The NOTES' At names no image: the operator's default ran it, never pulled.
    let container = &ran.spec.unwrap().containers[0];
    assert_eq!(
        (
            container.image.as_deref(),
            container.image_pull_policy.as_deref()
        ),
        (Some(MIRROR), Some("Never"))
    );
}

/// A schedule the admission policy lets through (it looks like a date) and the webhook refuses
/// (February has no 30th): kubectl shows the webhook's words.
fn a_malformed_at_is_refused_by_the_webhook_through_its_service(cluster: &Cluster) {
    let at = "apiVersion: cnat.programming-kubernetes.info/v1\nkind: At\nmetadata: {name: feb-30}\nspec:\n  schedule: \"2026-02-30T10:00:00Z\"\n  command: \"echo never\"\n";
    let refused = cluster.kubectl(&["apply", "-n", TEAM, "-f", "-"], Some(at));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "applied: {stderr}");
    assert!(
        stderr.contains(
            "admission webhook \"validate.ats.cnat.programming-kubernetes.info\" denied the request"
        ) && stderr.contains("spec.schedule"),
        "{stderr}"
    );
}

/// The mutating webhook's `caBundle` replaced by another CA (here the cluster's own), as a
/// hand-made configuration or another tool can leave it: cnat writes its own back; then At
/// writes pass.
async fn a_foreign_ca_bundle_is_written_back_by_cnat(cluster: &Cluster) {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    use kube::api::{Patch, PatchParams};
    let configs: Api<MutatingWebhookConfiguration> = Api::all(cluster.client.clone());
    let config = configs
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|c| {
            c.webhooks
                .iter()
                .flatten()
                .any(|w| w.name.starts_with("default.ats."))
        })
        .expect("cnat's MutatingWebhookConfiguration");
    let index = config
        .webhooks
        .iter()
        .flatten()
        .position(|w| w.name.starts_with("default.ats."))
        .unwrap();
    let original = config.webhooks.as_ref().unwrap()[index]
        .client_config
        .ca_bundle
        .clone()
        .expect("a caBundle");
    let kubeconfig = Kubeconfig::read_from(&cluster.kubeconfig).unwrap();
    let named = kubeconfig.clusters[0].cluster.clone().unwrap();
    let foreign = named.certificate_authority_data.unwrap_or_else(|| {
        use base64::Engine;
        let file = named.certificate_authority.expect("the cluster's CA");
        base64::engine::general_purpose::STANDARD.encode(std::fs::read(file).unwrap())
    });
    let set = |bundle: serde_json::Value| {
        let configs = configs.clone();
        let name = config.name_any();
        async move {
            let patch = serde_json::json!([{"op": "replace",
                "path": format!("/webhooks/{index}/clientConfig/caBundle"), "value": bundle}]);
            configs
                .patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::<()>::Json(serde_json::from_value(patch).unwrap()),
                )
                .await
                .unwrap();
        }
    };
    let at = "apiVersion: cnat.programming-kubernetes.info/v1\nkind: At\nmetadata: {name: x509-probe}\nspec:\n  schedule: \"2030-01-01T00:00:00Z\"\n  command: \"echo never\"\n";
    let dry_run = || {
        cluster.kubectl(
            &["apply", "--dry-run=server", "-n", TEAM, "-f", "-"],
            Some(at),
        )
    };
    set(serde_json::Value::String(foreign)).await;
    let changed = std::time::Instant::now();
    // cnat keeps the caBundle (webhook.certs.mode operator, the default): it writes its own
    // back. Until then writes may be refused with an x509 error naming the webhook (the
    // troubleshooting page quotes it).
    let mut refused = None;
    let mut restored = None;
    while changed.elapsed() < Duration::from_secs(30) {
        let output = dry_run();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        if !output.status.success() && stderr.contains("x509") {
            refused.get_or_insert(stderr);
        }
        let live = configs.get(&config.name_any()).await.unwrap();
        let bundle = live.webhooks.unwrap()[index]
            .client_config
            .ca_bundle
            .clone();
        if bundle.as_ref() == Some(&original) {
            restored = Some(changed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let Some(restored) = restored else {
        set(serde_json::to_value(&original).unwrap()).await;
        panic!("cnat did not write its caBundle back within 30 s");
    };
    eprintln!("cluster test: a foreign caBundle written back by cnat after {restored:?}; refusal seen meanwhile: {refused:?}");
    if let Some(refused) = refused {
        assert!(
            refused.contains(
                "failed calling webhook \"default.ats.cnat.programming-kubernetes.info\""
            ),
            "{refused}"
        );
    }
    eventually(
        "At writes admitted again with the caBundle restored",
        Duration::from_secs(30),
        async || dry_run().status.success().then_some(()),
    )
    .await;
}

/// The release as GitOps tools deploy it: rendered by `helm template` (no lookup, no hooks),
/// with the values and chart it runs with since the upgrade step, applied by kubectl twice client-side, then server-side by
/// another field manager, under a stream of At creates: no create fails (the caBundle cnat
/// writes is in no manifest, so no apply removes it).
async fn gitops_re_applies_fail_no_admission(cluster: &Cluster, values: &[String]) {
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), TEAM);
    let stop = tokio_util::sync::CancellationToken::new();
    let creator = creates_until(&ats, "gitops", &stop);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The chart the upgrade step installed (this checkout's, its image cnat:<appVersion>-next).
    let chart = Path::new(ROOT).join("charts/cnat");
    let mut args = vec![
        "template",
        RELEASE,
        chart.to_str().unwrap(),
        "-n",
        SYSTEM,
        "--no-hooks",
    ];
    for value in values {
        args.extend(["--set", value.as_str()]);
    }
    let rendered = cluster.helm(&args);
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&rendered).unwrap();
    for doc in docs.iter().filter(|d| d.is_object()) {
        let hooks = doc["webhooks"].as_array().into_iter().flatten();
        let conversion = &doc["spec"]["conversion"]["webhook"]["clientConfig"];
        assert!(
            hooks
                .chain([conversion])
                .all(|h| h["clientConfig"]["caBundle"].is_null() && h["caBundle"].is_null()),
            "mode operator renders no caBundle: {doc}"
        );
    }
    // cnat would write a removed caBundle back within a second: its write's time in the
    // configuration's managedFields shows whether an apply removed it.
    let injected = async || {
        use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
        let configs: Api<MutatingWebhookConfiguration> = Api::all(cluster.client.clone());
        let config = configs.get(RELEASE).await.unwrap();
        let fields = config.metadata.managed_fields.unwrap_or_default();
        let entry = fields
            .into_iter()
            .find(|f| f.manager.as_deref() == Some("cnat-ca-injector"));
        entry.and_then(|f| f.time).map(|t| t.0)
    };
    let before = injected().await;
    assert!(before.is_some(), "no caBundle written by cnat-ca-injector");
    for extra in [
        &[][..],
        &[],
        &[
            "--server-side",
            "--force-conflicts",
            "--field-manager=gitops",
        ],
    ] {
        let mut apply = vec!["apply", "-f", "-"];
        apply.extend(extra);
        let output = cluster.kubectl(&apply, Some(&rendered));
        succeeded(&format!("kubectl {apply:?}"), &output);
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let created = all_created(&stop, creator, 30).await;
    assert_eq!(
        injected().await,
        before,
        "an apply removed the caBundle (cnat wrote it again)"
    );
    eprintln!(
        "cluster test: helm template | kubectl apply twice, then --server-side: {} creates meanwhile, none failed",
        created.len()
    );
}

/// A command that fails, in an image the At names itself (which wins over the operator's).
async fn a_failing_command_records_its_exit_code_and_output(cluster: &Cluster) {
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), TEAM);
    let command = "echo 'the disk is full' >&2; exit 3";
    let mut fails = at("fails", chrono::Utc::now(), command);
    fails.spec.template.image = Some("busybox:1.36".into());
    ats.create(&PostParams::default(), &fails).await.unwrap();
    let status = done(&ats, "fails").await.status.unwrap();
    assert_eq!(status.outcome, Some(Outcome::Failed), "{status:?}");
    assert_eq!(status.exit_code, Some(3), "{status:?}");
    let message = status.message.unwrap_or_default();
    assert!(message.contains("the disk is full"), "{message}");
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), TEAM);
    let pod = pods.get(&status.pod_name.unwrap()).await.unwrap();
    assert_eq!(
        pod.spec.unwrap().containers[0].image.as_deref(),
        Some("busybox:1.36")
    );
}

/// `kubectl ARGS` with the `cnat` binary on the `PATH` as the kubectl plugin `kubectl-cnat`, as
/// the command line page has users install it: its standard output; it must succeed.
fn kubectl_cnat(cluster: &Cluster, args: &[&str]) -> String {
    let bin = cluster.dir.join("clients/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_cnat"), bin.join("kubectl-cnat")).unwrap();
    let path = std::env::join_paths(
        std::iter::once(bin).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap())),
    )
    .unwrap();
    let kubectl = Path::new(ROOT).join(".tools/envtest-1.37/kubectl");
    let output = run(
        cluster.command(&kubectl).env("PATH", &path).args(args),
        None,
    );
    succeeded(&format!("kubectl {args:?}"), &output)
}

/// The admin commands as the command line page shows them: `kubectl cnat migrate-storage` (the
/// user's own kubeconfig and rights: it rewrites Ats and the CRD's status), and `cnat crd` from
/// the operator's image with `kubectl exec` (its conversion CA as mounted).
fn admin_commands_run_as_a_kubectl_plugin_and_from_the_image(cluster: &Cluster) {
    let migrated = kubectl_cnat(cluster, &["cnat", "migrate-storage"]);
    eprintln!("cluster test: kubectl cnat migrate-storage: {migrated}");
    assert!(
        migrated.starts_with("ats.cnat.programming-kubernetes.info: ")
            && migrated.contains("storedVersions"),
        "{migrated}"
    );
    let crd = succeeded(
        "kubectl exec deploy/cnat -- /cnat crd",
        &cluster.kubectl(
            &[
                "exec",
                "-n",
                SYSTEM,
                &format!("deploy/{RELEASE}"),
                "--",
                "/cnat",
                "crd",
            ],
            None,
        ),
    );
    // In mode operator cnat writes the applied CRD's caBundle itself.
    assert!(
        crd.contains("kind: CustomResourceDefinition") && crd.contains("name: cnat-webhook"),
        "{crd}"
    );
}

/// The plugin as users run it: its exit code is the container's, its output the pod's log.
fn kubectl_at_wait_returns_the_exit_code(cluster: &Cluster) {
    let output = run(
        cluster.command(env!("CARGO_BIN_EXE_kubectl-at")).args([
            "-n",
            TEAM,
            "--wait",
            "--timeout",
            "90s",
            "now",
            "--",
            "echo waited; exit 4",
        ]),
        None,
    );
    assert_eq!(
        output.status.code(),
        Some(4),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).contains("waited"));
}

/// The Secret the At `no-secret` needs, created only once the At shows it missing.
const SECRET: &str = "cnat-test-token";
/// An image no registry serves: the pull is refused at once (nothing listens on port 1).
const NO_IMAGE: &str = "127.0.0.1:1/cnat/nothing:1";
/// An image the node does not have, which the operator's `imagePullPolicy: Never` forbids
/// pulling.
const NOT_ON_NODE: &str = "cnat.test/mirror/alpine:3.20";

/// Ats whose pods cannot start (an image that cannot be pulled, one not on the node and never
/// pulled, a missing Secret, no node that fits), and two with `activeDeadlineSeconds`: a
/// `sleep 600` that runs (3 s) and a pod no node takes (5 s). Started here, checked after the
/// steps between.
async fn start_pods_that_cannot_start_and_deadlines(cluster: &Cluster) {
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), TEAM);
    let now = chrono::Utc::now();
    let mut no_image = at("no-image", now, "true");
    no_image.spec.template.image = Some(NO_IMAGE.into());
    // The At's own policy wins over the operator's `Never`.
    no_image.spec.template.image_pull_policy = Some(cnat::api::ImagePullPolicy::IfNotPresent);
    let mut never_pulled = at("never-pulled", now, "true");
    never_pulled.spec.template.image = Some(NOT_ON_NODE.into());
    let mut no_secret = at("no-secret", now, "test \"$TOKEN\" = t0ken");
    no_secret.spec.template.env = Some(vec![serde_json::from_value(serde_json::json!({
        "name": "TOKEN",
        "valueFrom": {"secretKeyRef": {"name": SECRET, "key": "token"}}
    }))
    .unwrap()]);
    let mut sleeper = at("sleeper", now, "sleep 600");
    sleeper.spec.active_deadline_seconds = Some(3);
    let mut no_node = at("no-node", now, "true");
    no_node.spec.template.node_selector =
        Some([("cnat.dev/no-such-node".to_owned(), "true".to_owned())].into());
    no_node.spec.active_deadline_seconds = Some(5);
    for at in [no_image, never_pulled, no_secret, sleeper, no_node] {
        ats.create(&PostParams::default(), &at).await.unwrap();
    }
}

/// The At's status once its reason is `reason` (RUNNING, `PodStarted=False`).
async fn stuck_as(ats: &Api<At>, name: &str, reason: &str) -> cnat::api::AtStatus {
    let status = eventually(
        &format!("At {name} shows {reason}"),
        DONE_WITHIN,
        async || {
            let status = ats.get(name).await.ok()?.status?;
            (status.reason.as_deref() == Some(reason)).then_some(status)
        },
    )
    .await;
    assert_eq!(status.phase, Phase::Running, "{status:?}");
    let started = status.conditions.iter().find(|c| c.type_ == "PodStarted");
    assert_eq!(
        started.map(|c| (c.status.as_str(), c.reason.as_str())),
        Some(("False", reason)),
        "{status:?}"
    );
    status
}

/// What `kubectl get at NAME -o wide` and `kubectl describe at NAME` show.
fn shown(cluster: &Cluster, name: &str) -> (String, String) {
    let get = cluster.kubectl(&["get", "at", name, "-n", TEAM, "-o", "wide"], None);
    let describe = cluster.kubectl(&["describe", "at", name, "-n", TEAM], None);
    (
        succeeded("kubectl get at -o wide", &get),
        succeeded("kubectl describe at", &describe),
    )
}

/// Whether `kubectl describe`'s output lists an event of this type and reason.
fn has_event(describe: &str, type_: &str, reason: &str) -> bool {
    describe.lines().any(|line| {
        let mut words = line.split_whitespace();
        words.next() == Some(type_) && words.next() == Some(reason)
    })
}

/// A failing pull, an image never pulled and a missing Secret show on the At as the kubelet says
/// them (`REASON`, the `PodStarted` condition, a warning event); then the Secret is created.
async fn pods_that_cannot_start_show_on_their_ats(cluster: &Cluster) {
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), TEAM);
    let status = stuck_as(&ats, "no-image", "ImagePullBackOff").await;
    let message = status.message.unwrap_or_default();
    assert!(
        message.contains("no-image-pod cannot start the command") && message.contains(NO_IMAGE),
        "{message}"
    );
    let (get, describe) = shown(cluster, "no-image");
    eprintln!("cluster test: kubectl get at no-image -o wide:\n{get}");
    assert!(
        get.contains("Running") && get.contains("ImagePullBackOff"),
        "{get}"
    );
    assert!(
        has_event(&describe, "Warning", "ImagePullBackOff") && describe.contains("PodStarted"),
        "{describe}"
    );
    ats.delete("no-image", &DeleteParams::default())
        .await
        .unwrap();

    let status = stuck_as(&ats, "never-pulled", "ErrImageNeverPull").await;
    let message = status.message.unwrap_or_default();
    assert!(message.contains(NOT_ON_NODE), "{message}");
    let (get, describe) = shown(cluster, "never-pulled");
    assert!(get.contains("ErrImageNeverPull"), "{get}");
    assert!(
        has_event(&describe, "Warning", "ErrImageNeverPull"),
        "{describe}"
    );
    ats.delete("never-pulled", &DeleteParams::default())
        .await
        .unwrap();

    let status = stuck_as(&ats, "no-secret", "CreateContainerConfigError").await;
    let message = status.message.unwrap_or_default();
    // The kubelet says either that the Secret is not found or, when its watch of that Secret has
    // not synced in time (seen with kubelet v1.37 on kube-apiserver v1.24), that its secret cache
    // did not sync; the At shows whichever the pod shows.
    assert!(
        message.contains("no-secret-pod cannot start the command: CreateContainerConfigError: ")
            && (message.contains(&format!("secret \"{SECRET}\" not found"))
                || message.contains("failed to sync secret cache")),
        "{message}"
    );
    let (get, _) = shown(cluster, "no-secret");
    assert!(get.contains("CreateContainerConfigError"), "{get}");
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(cluster.client.clone(), TEAM);
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "metadata": {"name": SECRET}, "stringData": {"token": "t0ken"}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
}

/// The At `no-secret`, its Secret created (`pods_that_cannot_start_show_on_their_ats`), ran
/// once and succeeded, and shows `PodStarted=True` and the events of both (a `PodStarted` event
/// too when cnat saw the pod running: `true` may run and end between two looks). Checked a while
/// after the Secret was created: the kubelet retries a container's configuration with backoff.
async fn the_pod_started_once_its_secret_existed(cluster: &Cluster) {
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), TEAM);
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), TEAM);
    let (status, _) = ran_once(&ats, &pods, "no-secret").await;
    let started = status.conditions.iter().find(|c| c.type_ == "PodStarted");
    assert_eq!(
        started.map(|c| c.status.as_str()),
        Some("True"),
        "{status:?}"
    );
    let (_, describe) = shown(cluster, "no-secret");
    assert!(
        has_event(&describe, "Warning", "CreateContainerConfigError")
            && has_event(&describe, "Normal", "Succeeded"),
        "{describe}"
    );
}

/// cnat ends an At at its `activeDeadlineSeconds`, whether its pod runs (`sleep 600`) or never
/// started (no node fits it, which it first shows as `Unschedulable`): DONE, failed with
/// `DeadlineExceeded`, within 2 s of the deadline (within a second here unless the machine is
/// busy), and the pod deleted (the sleep's is still stopping: the kubelet waits out its grace
/// period for a shell that ignores SIGTERM).
async fn deadlines_stop_a_running_and_a_never_started_pod_on_time(cluster: &Cluster) {
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), TEAM);
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), TEAM);
    for (name, seconds) in [("sleeper", 3), ("no-node", 5)] {
        let status = done(&ats, name).await.status.unwrap();
        assert_eq!(status.outcome, Some(Outcome::Failed), "{status:?}");
        assert_eq!(
            status.reason.as_deref(),
            Some("DeadlineExceeded"),
            "{status:?}"
        );
        let took = status.completion_time.unwrap() - status.start_time.unwrap();
        let late = took - chrono::Duration::seconds(seconds);
        assert!(
            late >= chrono::Duration::zero() && late < chrono::Duration::seconds(2),
            "At {name} stopped {took} after its start, with activeDeadlineSeconds: {seconds}"
        );
        eprintln!("cluster test: At {name} stopped {late} after its deadline");
        let pod = status.pod_name.unwrap();
        let deleted = pods.get_opt(&pod).await.unwrap();
        assert!(
            deleted
                .as_ref()
                .is_none_or(|p| p.metadata.deletion_timestamp.is_some()),
            "pod {pod} not deleted: {deleted:?}"
        );
    }
    let (_, describe) = shown(cluster, "no-node");
    let events = describe.split("Events:").nth(1).unwrap_or_default();
    eprintln!("cluster test: kubectl describe at no-node, its events:{events}");
    assert!(
        has_event(&describe, "Warning", "Unschedulable")
            && has_event(&describe, "Warning", "DeadlineExceeded"),
        "{describe}"
    );
}

async fn a_quota_refusal_shows_on_the_at(cluster: &Cluster) {
    let quotas: Api<k8s_openapi::api::core::v1::ResourceQuota> =
        Api::namespaced(cluster.client.clone(), TEAM);
    quotas
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    eventually("the quota's usage", Duration::from_secs(30), async || {
        quotas.get("no-pods").await.ok()?.status?.used
    })
    .await;
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), TEAM);
    ats.create(
        &PostParams::default(),
        &at("refused", chrono::Utc::now(), "true"),
    )
    .await
    .unwrap();
    let status = eventually("At refused shows PodForbidden", DONE_WITHIN, async || {
        let status = ats.get("refused").await.ok()?.status?;
        (status.reason.as_deref() == Some("PodForbidden")).then_some(status)
    })
    .await;
    assert_eq!(status.phase, Phase::Pending);
    let message = status.message.unwrap_or_default();
    assert!(message.contains("exceeded quota: no-pods"), "{message}");
    // The quota goes, and the At runs.
    quotas
        .delete("no-pods", &DeleteParams::default())
        .await
        .unwrap();
    let status = done(&ats, "refused").await.status.unwrap();
    assert_eq!(status.outcome, Some(Outcome::Succeeded), "{status:?}");
}

/// The webhook Service's ready endpoints are the three replicas, each answers a review posted to
/// its own address and counts it on its `/metrics`; one replica leads; spans arrive from the pods.
async fn every_replica_serves_webhooks_and_metrics_and_traces_reach_the_collector(
    cluster: &Cluster,
    collector: &Collector,
) {
    let replicas = replicas(cluster).await;
    assert_eq!(replicas.len(), 3, "{replicas:?}");
    let mut before = BTreeMap::new();
    for (name, ip) in &replicas {
        before.insert(
            name.clone(),
            counter(&metrics(ip).await, "cnat_admission_requests_total"),
        );
    }
    // The API server keeps one connection to the Service, so one replica may get all its
    // reviews: the Service's endpoints are all three replicas, and each answers a review sent
    // to its own address.
    let slices: Api<k8s_openapi::api::discovery::v1::EndpointSlice> =
        Api::namespaced(cluster.client.clone(), SYSTEM);
    let selector = format!("kubernetes.io/service-name={RELEASE}-webhook");
    let ready: std::collections::BTreeSet<String> = slices
        .list(&ListParams::default().labels(&selector))
        .await
        .unwrap()
        .items
        .iter()
        .flat_map(|slice| slice.endpoints.iter().flatten())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .flat_map(|e| e.addresses.iter().cloned())
        .collect();
    let ips: std::collections::BTreeSet<String> = replicas.values().cloned().collect();
    assert_eq!(
        ready, ips,
        "the webhook Service's ready endpoints are the replicas"
    );
    for (name, ip) in &replicas {
        review(ip, name).await;
    }
    let mut leaders = 0;
    for (name, ip) in &replicas {
        let page = metrics(ip).await;
        let reviewed = counter(&page, "cnat_admission_requests_total") - before[name];
        assert!(reviewed > 0.0, "{name} counted no review");
        leaders += (counter(&page, "cnat_leader") > 0.0) as usize;
    }
    assert_eq!(leaders, 1, "exactly one replica leads");
    let spans = eventually(
        "spans from the replicas",
        Duration::from_secs(30),
        async || {
            let spans = collector.spans();
            (!spans.is_empty()).then_some(spans)
        },
    )
    .await;
    let from: std::collections::BTreeSet<_> = spans
        .iter()
        .filter_map(|s| s.resource.get("k8s.pod.name").cloned())
        .collect();
    assert!(
        from.iter().any(|pod| replicas.contains_key(pod)),
        "spans from pods {from:?}, replicas {replicas:?}"
    );
}

/// Creates an At in team-a every 100 ms until `stop`, named `PREFIX-load-I` for the one in ten
/// that falls due 2 to 6 s later (about one pod a second: what one 2-core node starts without a
/// backlog) and `PREFIX-later-I` for the rest (due an hour later); the names created and the
/// failures.
fn creates_until(
    ats: &Api<At>,
    prefix: &'static str,
    stop: &tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<(Vec<String>, Vec<String>)> {
    let ats = ats.clone();
    let stop = stop.clone();
    tokio::spawn(async move {
        let mut created = Vec::new();
        let mut failed = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        // A stalled create delays the next ones rather than firing a burst after it.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut i = 0u32;
        while !stop.is_cancelled() {
            tick.tick().await;
            let runs = i.is_multiple_of(10);
            let name = if runs {
                format!("{prefix}-load-{i}")
            } else {
                format!("{prefix}-later-{i}")
            };
            let wait = if runs {
                2000 + (i as i64 / 10 % 5) * 1000
            } else {
                3_600_000
            };
            let due = chrono::Utc::now() + chrono::Duration::milliseconds(wait);
            match ats
                .create(&PostParams::default(), &at(&name, due, "true"))
                .await
            {
                Ok(_) => created.push(name),
                Err(e) => failed.push(format!("{name}: {e}")),
            }
            i += 1;
        }
        (created, failed)
    })
}

/// `helm upgrade` to the second tag as the upgrading page shows it, while a client creates an
/// At every 100 ms (one in ten due 2 to 6 s later, the rest in an hour): no create fails, every
/// At due runs once, on time.
/// Stops `creator` (of `creates_until`); the names it created, once none failed and more than
/// `at_least` were created.
async fn all_created(
    stop: &tokio_util::sync::CancellationToken,
    creator: tokio::task::JoinHandle<(Vec<String>, Vec<String>)>,
    at_least: usize,
) -> Vec<String> {
    stop.cancel();
    let (created, failed) = creator.await.unwrap();
    assert!(
        failed.is_empty(),
        "{} of {} creates failed: {failed:?}",
        failed.len(),
        created.len() + failed.len()
    );
    assert!(
        created.len() > at_least,
        "only {} Ats created",
        created.len()
    );
    created
}

async fn an_upgrade_under_load_fails_no_apply_and_runs_every_at_once_on_time(cluster: &Cluster) {
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), TEAM);
    let stop = tokio_util::sync::CancellationToken::new();
    let creator = creates_until(&ats, "upgrade", &stop);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let chart = Path::new(ROOT).join("charts/cnat");
    let tag = format!("image.tag={}-next", cluster.app_version);
    let upgrade = {
        let args: Vec<String> = [
            "upgrade",
            RELEASE,
            chart.to_str().unwrap(),
            "-n",
            SYSTEM,
            "--reset-then-reuse-values",
            "--wait",
            "--timeout",
            "300s",
            "--set",
            &tag,
        ]
        .map(str::to_owned)
        .to_vec();
        let mut command = cluster.command(Path::new(ROOT).join(".tools/helm"));
        command.args(&args);
        tokio::task::spawn_blocking(move || run(&mut command, None))
    };
    let upgraded = upgrade.await.unwrap();
    succeeded("helm upgrade", &upgraded);
    // Ats keep falling due after the rollout, on the new replicas.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let created = all_created(&stop, creator, 50).await;
    let deployments: Api<Deployment> = Api::namespaced(cluster.client.clone(), SYSTEM);
    let image = deployments
        .get(RELEASE)
        .await
        .unwrap()
        .spec
        .template
        .spec
        .unwrap()
        .containers[0]
        .image
        .clone()
        .unwrap();
    assert!(
        image.ends_with(&format!(":{}-next", cluster.app_version)),
        "{image}"
    );
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), TEAM);
    let mut late = Vec::new();
    for name in created.iter().filter(|n| n.contains("-load-")) {
        let (status, pod) = ran_once(&ats, &pods, name).await;
        // The run's start as cnat records it (status.startTime, when it decided to create the
        // pod), and the pod's creation as the API server records it (whole seconds).
        let due = status.scheduled_time.unwrap();
        let lateness = status.start_time.unwrap() - due;
        let created = pod
            .metadata
            .creation_timestamp
            .as_ref()
            .map(pod_time)
            .unwrap();
        if lateness > chrono::Duration::seconds(1) || created > due + chrono::Duration::seconds(2) {
            late.push(format!(
                "{name}: started {lateness} after due, pod created at {created}, due {due}"
            ));
        }
    }
    assert!(
        late.is_empty(),
        "pods created more than 1 s after their At was due: {late:?}"
    );
    eprintln!(
        "cluster test: {} Ats created during the upgrade, {} of them due: each ran once, none late",
        created.len(),
        created.iter().filter(|n| n.contains("-load-")).count()
    );
}

/// The leader's pod deleted at once (`--grace-period=0 --force`; another replica takes the
/// Lease), then the leader's container killed on the node (`kill -9`; the kubelet restarts it),
/// each while Ats fall due: each At runs, once.
async fn killing_the_leader_runs_every_at_once(cluster: &Cluster) {
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), TEAM);
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), TEAM);
    let mut names = Vec::new();
    for round in 0..2 {
        let leader = eventually("a Lease holder", Duration::from_secs(60), async || {
            lease_holder(cluster).await
        })
        .await;
        let now = chrono::Utc::now();
        for i in 0..8 {
            let name = format!("kill-{round}-{i}");
            let due = now + chrono::Duration::milliseconds(1000 + i * 1000);
            ats.create(&PostParams::default(), &at(&name, due, "true"))
                .await
                .unwrap();
            names.push(name);
        }
        tokio::time::sleep(Duration::from_millis(2500)).await;
        if round == 0 {
            let deleted = cluster.kubectl(
                &[
                    "delete",
                    "pod",
                    "-n",
                    SYSTEM,
                    &leader,
                    "--grace-period=0",
                    "--force",
                ],
                None,
            );
            succeeded("kubectl delete pod --force", &deleted);
        } else {
            let restarts = restart_count(cluster, &leader).await;
            kill_container(cluster, &leader).await;
            eventually(
                "the killed container restarted",
                Duration::from_secs(60),
                async || (restart_count(cluster, &leader).await > restarts).then_some(()),
            )
            .await;
        }
        eventually("a new Lease holder", Duration::from_secs(60), async || {
            lease_holder(cluster)
                .await
                .filter(|h| *h != leader || round == 1)
        })
        .await;
    }
    // Each ran: Done, Succeeded, by its one pod (a second pod for an At could not be created:
    // its name is the At's, and the API server refuses a second).
    for name in &names {
        ran_once(&ats, &pods, name).await;
    }
}

async fn restart_count(cluster: &Cluster, pod: &str) -> i32 {
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), SYSTEM);
    pods.get(pod)
        .await
        .ok()
        .and_then(|p| {
            p.status?
                .container_statuses?
                .first()
                .map(|c| c.restart_count)
        })
        .unwrap_or(0)
}

/// `kill -9` of the container's process, found as containerd's task of the pod's container.
async fn kill_container(cluster: &Cluster, pod: &str) {
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), SYSTEM);
    let status = pods.get(pod).await.unwrap().status.unwrap();
    let id = status.container_statuses.unwrap()[0]
        .container_id
        .clone()
        .expect("a container id")
        .trim_start_matches("containerd://")
        .to_owned();
    let tasks = Command::new("ctr")
        .arg("--address")
        .arg(cluster.containerd())
        .args(["-n", "k8s.io", "tasks", "ls"])
        .output()
        .unwrap();
    let tasks = String::from_utf8_lossy(&tasks.stdout);
    let pid = tasks
        .lines()
        .find_map(|l| {
            let mut fields = l.split_whitespace();
            (fields.next()? == id).then(|| fields.next().map(str::to_owned))?
        })
        .unwrap_or_else(|| panic!("no task {id} in {tasks}"));
    let killed = Command::new("kill").args(["-9", &pid]).status().unwrap();
    assert!(killed.success(), "kill -9 {pid}");
}

/// `helm uninstall` as the install page shows it, while Ats fall due: the pre-delete hook stops
/// the operator, then lets go of every pod, so no pod keeps cnat's finalizer and the user's
/// namespace deletes; every At that got a pod names it (it ran once and its run is on record),
/// and one due after the operator stopped has none.
async fn uninstall_leaves_no_finalizer_and_namespaces_delete(cluster: &Cluster) {
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), TEAM);
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), TEAM);
    let now = chrono::Utc::now();
    let names: Vec<String> = (0..40).map(|i| format!("during-uninstall-{i}")).collect();
    let due = |i: usize| now + chrono::Duration::milliseconds(500 * i as i64);
    for (i, name) in names.iter().enumerate() {
        // One due now, then one every 500 ms for 20 s: some run before the stop, some while
        // the hook stops the operator, some after.
        let due = due(i);
        ats.create(&PostParams::default(), &at(name, due, "sleep 1"))
            .await
            .unwrap();
    }
    eventually(
        "the first At running",
        Duration::from_secs(60),
        async || {
            let first = ats.get(&names[0]).await.ok()?;
            first
                .status
                .filter(|s| s.phase != cnat::api::Phase::Pending)
        },
    )
    .await;
    cluster.helm(&["uninstall", RELEASE, "-n", SYSTEM]);
    let uninstalled = chrono::Utc::now();
    let kept = support::envtest::pods_held(&Api::all(cluster.client.clone())).await;
    assert!(kept.is_empty(), "pods keep cnat's finalizer: {kept:?}");
    let (mut ran, mut waiting) = (0, 0);
    for (i, name) in names.iter().enumerate() {
        let at = ats.get(name).await.unwrap();
        let status = at.status.clone().unwrap_or_default();
        let own = pods_of(&pods, &at).await;
        assert!(own.len() <= 1, "{name}: {} pods", own.len());
        match own.first() {
            Some(pod) => {
                ran += 1;
                assert_eq!(
                    status.pod_name.as_deref(),
                    Some(pod.name_any().as_str()),
                    "{name}: a pod its At does not name: {status:?}"
                );
            }
            None => {
                waiting += 1;
                assert!(status.pod_name.is_none(), "{name}: {status:?}");
            }
        }
        // Due after the uninstall ended: never run.
        if due(i) > uninstalled {
            assert!(own.is_empty(), "{name} ran after the uninstall");
        }
    }
    eprintln!("cluster test: {ran} Ats ran before the stop, {waiting} stayed Pending");
    assert!(ran >= 1, "the first At ran before the uninstall");
    let deleted = cluster.kubectl(&["delete", "namespace", TEAM, "--timeout=120s"], None);
    succeeded("kubectl delete namespace", &deleted);
}

/// The uninstall hook's pod cannot run (here: a quota of no pods in the release's namespace):
/// `helm uninstall` fails once the hook's deadline has passed, not after Helm's 5 minutes,
/// saying so; `helm uninstall --no-hooks` then removes the release, as the install page says.
async fn an_uninstall_whose_hook_cannot_run_fails_within_its_deadline(cluster: &Cluster) {
    let chart = Path::new(ROOT).join("charts/cnat");
    cluster.helm(&[
        "install",
        RELEASE,
        chart.to_str().unwrap(),
        "-n",
        SYSTEM,
        "--set",
        "releaseHookDeadlineSeconds=30",
    ]);
    // An At running when cnat goes away: its pod keeps cnat's finalizer (below, its namespace
    // then stays Terminating until `cnat release`).
    let namespaces: Api<Namespace> = Api::all(cluster.client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": LEFT_BEHIND}}))
                .unwrap(),
        )
        .await
        .unwrap();
    let ats: Api<At> = Api::namespaced(cluster.client.clone(), LEFT_BEHIND);
    let command = "trap 'exit 0' TERM; sleep 600 & wait";
    // Refused by the admission webhooks until a replica of the new release serves them.
    eventually("the At created", DONE_WITHIN, async || {
        ats.create(
            &PostParams::default(),
            &at("long", chrono::Utc::now(), command),
        )
        .await
        .ok()
    })
    .await;
    eventually("the At running", DONE_WITHIN, async || {
        let status = ats.get("long").await.ok()?.status?;
        (status.phase == Phase::Running).then_some(())
    })
    .await;
    let quota = serde_json::json!({"apiVersion": "v1", "kind": "ResourceQuota",
        "metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}});
    let quotas: Api<k8s_openapi::api::core::v1::ResourceQuota> =
        Api::namespaced(cluster.client.clone(), SYSTEM);
    quotas
        .create(
            &PostParams::default(),
            &serde_json::from_value(quota).unwrap(),
        )
        .await
        .unwrap();
    let helm = Path::new(ROOT).join(".tools/helm");
    let started = std::time::Instant::now();
    let output = run(
        cluster
            .command(&helm)
            .args(["uninstall", RELEASE, "-n", SYSTEM]),
        None,
    );
    let took = started.elapsed();
    let said = String::from_utf8_lossy(&output.stderr).into_owned();
    eprintln!("cluster test: helm uninstall with a hook that cannot run, after {took:.1?}: {said}");
    assert!(!output.status.success(), "{said}");
    // Helm 4's words: "resource Job/cnat-system/cnat-release not ready. status: Failed".
    assert!(
        said.contains("Job/cnat-system/cnat-release") && said.contains("Failed"),
        "{said}"
    );
    assert!(took < Duration::from_secs(90), "{took:?}");
    cluster.helm(&["uninstall", RELEASE, "-n", SYSTEM, "--no-hooks"]);
    quotas.delete("no-pods", &Default::default()).await.unwrap();
    // No replica left to let the pod go (the uninstall does not wait for them).
    eventually("every replica gone", Duration::from_secs(60), async || {
        // Deleted ones too: a replica shutting down may still lead.
        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), SYSTEM);
        let selector = format!("app.kubernetes.io/instance={RELEASE},app.kubernetes.io/name=cnat");
        let left = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .ok()?;
        left.items.is_empty().then_some(())
    })
    .await;
    a_namespace_stays_terminating_until_cnat_release(cluster).await;
    // The hook's Role and RoleBinding went with the failed hook (hook-failed).
    let roles: Api<k8s_openapi::api::rbac::v1::Role> =
        Api::namespaced(cluster.client.clone(), SYSTEM);
    let left: Vec<String> = roles
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|role| role.name_any())
        .collect();
    assert!(!left.contains(&format!("{RELEASE}-release")), "{left:?}");
}

/// The namespace of a pod that keeps cnat's finalizer, cnat gone: deleted, it stays
/// `Terminating` with the pod in it (as the troubleshooting page shows) until `cnat release`
/// lets the pod go (its At went with the namespace).
async fn a_namespace_stays_terminating_until_cnat_release(cluster: &Cluster) {
    let namespaces: Api<Namespace> = Api::all(cluster.client.clone());
    namespaces
        .delete(LEFT_BEHIND, &DeleteParams::default())
        .await
        .unwrap();
    // Its pod deleted, and there it stays.
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), LEFT_BEHIND);
    eventually(
        "the pod deleted, its finalizer kept",
        Duration::from_secs(60),
        async || {
            let pod = pods.get("long-pod").await.ok()?;
            pod.metadata.deletion_timestamp.is_some().then_some(())
        },
    )
    .await;
    let namespace = succeeded(
        "kubectl get namespace",
        &cluster.kubectl(&["get", "namespace", LEFT_BEHIND], None),
    );
    let left = succeeded(
        "kubectl get pods",
        &cluster.kubectl(
            &[
                "get",
                "pods",
                "-n",
                LEFT_BEHIND,
                "-o",
                "custom-columns=NAME:.metadata.name,DELETED:.metadata.deletionTimestamp,FINALIZERS:.metadata.finalizers",
            ],
            None,
        ),
    );
    eprintln!("cluster test: a namespace left behind:\n{namespace}{left}");
    assert!(namespace.contains("Terminating"), "{namespace}");
    assert!(
        left.contains("cnat.programming-kubernetes.info/run-once"),
        "{left}"
    );
    let released = kubectl_cnat(cluster, &["cnat", "release", "--namespace", LEFT_BEHIND]);
    assert_eq!(released.trim(), "released 1 pod(s) from cnat's finalizer");
    eventually(
        "the namespace gone",
        Duration::from_secs(90),
        async || match namespaces.get_opt(LEFT_BEHIND).await {
            Ok(None) => Some(()),
            _ => None,
        },
    )
    .await;
}
