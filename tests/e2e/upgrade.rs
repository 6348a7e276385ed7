//! The upgrade to API `v1` on a real kube-apiserver, as one `helm upgrade` does it from the
//! release before `v1` (`scripts/previous-release` builds that release, which serves `v1alpha1`
//! and already answers `/convert`, into `.tools/cnat-0.1.0-5e30406`).
//!
//! Before: the CRD as it was (`v1alpha1` alone, stored), Ats stored as `v1alpha1` (some due
//! within the minute, some with pod settings, some `DONE`, some far off) and two old replicas
//! leading and answering the webhooks behind a stand-in for the chart's webhook Service (ready
//! replicas only; admission and conversion alike). Then, under a steady load of `kubectl apply`
//! (as `v1alpha1` throughout; as `v1` too once no old replica is left, see
//! docs/src/operating/upgrading.md): the new CRD (both versions, `v1` stored, conversion by cnat), a rolling
//! replacement of the two old replicas by new ones (one at a time, the old one stopped once the
//! new one is ready), and a rolling restart of a new one. Then every replica stops at once and
//! two new ones start while Ats are still stored as `v1alpha1` (reading one from etcd needs the
//! conversion webhook, which the Service sends only to ready replicas; on 1.24 a quorum list
//! does too); then `cnat migrate-storage`; last the CRD without `v1alpha1`
//! (`crd.serveV1alpha1=false`), refused before the migration and taken after it.

use crate::support::envtest::{
    install_crd, own_control_plane, register_webhooks, ControlPlane, Replica,
};
use crate::support::service::Service;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, WebhookClientConfig,
};
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::{Api, ResourceExt};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The At CRD's name.
const CRD: &str = "ats.cnat.programming-kubernetes.info";
/// The release before `v1`, as `scripts/previous-release` builds it.
const PREVIOUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/.tools/cnat-0.1.0-5e30406");
const GROUP: &str = "cnat.programming-kubernetes.info";
/// Replicas' flags: a shutdown delay that outlasts the Services' readiness poll (500 ms), as
/// the chart's does the endpoints controller's.
const FLAGS: [&str; 2] = ["--shutdown-delay=2s", "--shutdown-timeout=10s"];

/// The CRD as the release before `v1` shipped it: its `v1alpha1` (frozen since in
/// `src/api/v1alpha1.yaml`), stored and not deprecated, no conversion.
fn v1alpha1_only() -> CustomResourceDefinition {
    let mut crd = cnat::api::crd_with(WebhookClientConfig::default());
    crd.spec.versions.retain(|v| v.name == "v1alpha1");
    let version = &mut crd.spec.versions[0];
    version.storage = true;
    version.deprecated = None;
    version.deprecation_warning = None;
    crd.spec.conversion = None;
    crd
}

fn ats(client: &kube::Client, ns: &str, version: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(GROUP, version, "At");
    Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::from_gvk_with_plural(&gvk, "ats"),
    )
}

fn at(version: &str, name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/{version}"), "kind": "At",
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap()
}

/// Creates as `kubectl apply` does, as `v1alpha1` always and as `v1` once `v1` is set, every
/// 250 ms until stopped; keeps what failed.
#[derive(Clone, Default)]
struct Load {
    v1: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    created: Arc<Mutex<Vec<(String, &'static str)>>>,
    failed: Arc<Mutex<Vec<(tokio::time::Instant, String)>>>,
}

impl Load {
    fn start(
        &self,
        kubeconfig: PathBuf,
        ns: String,
        cache: PathBuf,
    ) -> tokio::task::JoinHandle<()> {
        let load = self.clone();
        tokio::spawn(async move {
            let mut i = 0;
            while !load.stop.load(Ordering::SeqCst) {
                let versions: &[&'static str] = if load.v1.load(Ordering::SeqCst) {
                    &["v1alpha1", "v1"]
                } else {
                    &["v1alpha1"]
                };
                for version in versions {
                    i += 1;
                    let name = format!("load-{i:04}");
                    let due = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339();
                    let manifest = at(version, &name, json!({"schedule": due, "command": "true"}));
                    let mut kubectl = tokio::process::Command::new("kubectl")
                        .args(["apply", "-n", &ns, "-f", "-", "--cache-dir"])
                        .arg(&cache)
                        .env("KUBECONFIG", &kubeconfig)
                        .stdin(std::process::Stdio::piped())
                        .stdout(std::process::Stdio::piped())
                        .stderr(std::process::Stdio::piped())
                        .spawn()
                        .expect("kubectl");
                    use tokio::io::AsyncWriteExt;
                    let mut stdin = kubectl.stdin.take().unwrap();
                    stdin
                        .write_all(&serde_json::to_vec(&manifest).unwrap())
                        .await
                        .unwrap();
                    drop(stdin);
                    let output = kubectl.wait_with_output().await.unwrap();
                    if output.status.success() {
                        load.created.lock().unwrap().push((name, version));
                    } else {
                        load.failed.lock().unwrap().push((
                            tokio::time::Instant::now(),
                            format!(
                                "{version} {name} at {}: {}",
                                chrono::Utc::now().format("%H:%M:%S%.3f"),
                                String::from_utf8_lossy(&output.stderr).trim()
                            ),
                        ));
                    }
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    }
}

/// Replaces `old` by a new replica named `identity` as a Deployment's rolling update does:
/// the new one starts, once the Service routes to it (ready) the old one gets SIGTERM (it
/// leaves the Service once its readiness fails, at the next poll), and it is dropped from the
/// endpoints once it has exited. Returns the new replica and when the old one was seen gone.
async fn replace(
    plane: &ControlPlane,
    service: &Service,
    old: &mut Replica,
    identity: &str,
    ns: &str,
    certs: &Path,
) -> (Replica, tokio::time::Instant) {
    let new = plane.replica_sharing(identity, ns, &FLAGS, certs);
    service.add(&new);
    service.wait_ready(&new).await;
    old.terminate();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while old.child.try_wait().unwrap().is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} did not stop",
            old.identity
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    service.remove(old);
    (new, tokio::time::Instant::now())
}

#[tokio::test]
async fn the_upgrade_to_v1_keeps_every_at_runs_each_once_and_fails_no_create() {
    let Some(plane) = own_control_plane() else {
        return;
    };
    let previous = PathBuf::from(PREVIOUS);
    assert!(
        previous.exists(),
        "no {PREVIOUS}: run scripts/previous-release (it builds the release before v1)"
    );
    let admin = plane.admin().await;
    install_crd(&admin, &cnat::api::crd_to_yaml(&v1alpha1_only())).await;
    let ns = plane.namespace("upgrade", &[]).await;
    let old_api = ats(&admin, &ns, "v1alpha1");
    let v1_api = ats(&admin, &ns, "v1");

    // Ats stored as v1alpha1: due every 5 s from 8 s on, Done, far off. Their specs as stored.
    let start = chrono::Utc::now();
    let mut before: BTreeMap<String, Value> = BTreeMap::new();
    let mut due = Vec::new();
    for i in 0..7 {
        let name = format!("due-{i}");
        let schedule = (start + chrono::Duration::seconds(8 + 5 * i)).to_rfc3339();
        let spec = match i {
            1 => {
                json!({"schedule": schedule, "command": "echo one", "image": "registry.example/tools:1.2",
                        "env": [{"name": "A", "value": "1"}], "nodeSelector": {"disk": "ssd"}})
            }
            2 => json!({"schedule": schedule, "command": "true", "activeDeadlineSeconds": 300,
                        "resources": {"requests": {"cpu": "10m"}}, "startingDeadlineSeconds": 600}),
            _ => json!({"schedule": schedule, "command": "true"}),
        };
        let created = old_api
            .create(&PostParams::default(), &at("v1alpha1", &name, spec))
            .await
            .unwrap();
        before.insert(name.clone(), created.data["spec"].clone());
        due.push(name);
    }
    for i in 0..2 {
        let name = format!("done-{i}");
        let spec = json!({"schedule": "2026-01-01T00:00:00Z", "command": "true"});
        let created = old_api
            .create(&PostParams::default(), &at("v1alpha1", &name, spec))
            .await
            .unwrap();
        before.insert(name.clone(), created.data["spec"].clone());
        let status = json!({"status": {"phase": "DONE", "outcome": "Succeeded", "exitCode": 0}});
        old_api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
    }
    for i in 0..10 {
        let name = format!("far-{i}");
        let schedule = (start + chrono::Duration::hours(2)).to_rfc3339();
        let spec = json!({"schedule": schedule, "command": "true", "ttlSecondsAfterFinished": 60});
        let created = old_api
            .create(&PostParams::default(), &at("v1alpha1", &name, spec))
            .await
            .unwrap();
        before.insert(name.clone(), created.data["spec"].clone());
    }

    // The release before v1: two replicas behind the webhook Service, webhooks registered.
    let certs = plane.dir.join("upgrade-certs");
    let service = Service::default();
    let service_addr = service.start().await;
    let mut old = Vec::new();
    for i in 0..2 {
        let replica = plane.replica_of(&previous, &format!("old-{i}"), &ns, &FLAGS, &certs);
        service.add(&replica);
        old.push(replica);
    }
    for replica in &old {
        service.wait_ready(replica).await;
    }
    let ca = certs.join("ca.crt");
    register_webhooks(&admin, service_addr, &ca, &ns).await;

    let load = Load::default();
    let loading = load.start(
        plane.kubeconfig.clone(),
        ns.clone(),
        plane.dir.join("upgrade-kubectl-cache"),
    );
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The new CRD, its conversion webhook behind the same Service.
    let crd = cnat::api::crd_with(WebhookClientConfig {
        url: Some(format!("https://127.0.0.1:{}/convert", service_addr.port())),
        ca_bundle: Some(k8s_openapi::ByteString(std::fs::read(&ca).unwrap())),
        service: None,
    });
    install_crd(&admin, &cnat::api::crd_to_yaml(&crd)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    // The rolling update: each old replica replaced by a new one.
    let mut new = Vec::new();
    let mut old_exits = Vec::new();
    for (i, mut replica) in old.into_iter().enumerate() {
        let (replacement, exited) = replace(
            plane,
            &service,
            &mut replica,
            &format!("new-{i}"),
            &ns,
            &certs,
        )
        .await;
        new.push(replacement);
        old_exits.push(exited);
    }
    // No old replica left: clients may write v1 too. Then a rolling restart of the new ones.
    load.v1.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut first = new.remove(0);
    let v1_creates = || {
        load.created
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, v)| *v == "v1")
            .count()
    };
    new.push(
        replace(plane, &service, &mut first, "new-2", &ns, &certs)
            .await
            .0,
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Enough load to tell (20 creates, 5 of them as v1), however slow kubectl is on this
    // machine: with the whole suite running beside it one apply can take a second.
    let all_creates = || load.created.lock().unwrap().len();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while (v1_creates() < 5 || all_creates() < 20) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    load.stop.store(true, Ordering::SeqCst);
    loading.await.unwrap();

    // The one failure allowed: 0.1.0 closes its keep-alive connections when it stops, and a
    // request the API server sends on one at that moment fails (EOF; Go does not resend a
    // POST). 0.2.0 drains instead (`serving::drain`): no failure at its replicas' exits.
    let failed = load.failed.lock().unwrap().clone();
    let created = load.created.lock().unwrap().clone();
    let unexplained: Vec<&String> = failed
        .iter()
        .filter(|(when, message)| {
            let at_old_exit = old_exits.iter().any(|exit| {
                let gap = if *when > *exit {
                    *when - *exit
                } else {
                    *exit - *when
                };
                gap < Duration::from_millis(500)
            });
            let closed = message.ends_with(": EOF")
                || message.contains("connection reset by peer")
                || message.contains("broken pipe");
            !(at_old_exit && closed)
        })
        .map(|(_, message)| message)
        .collect();
    assert!(
        unexplained.is_empty(),
        "{} of {} creates failed:\n{}",
        unexplained.len(),
        created.len() + failed.len(),
        failed
            .iter()
            .map(|(_, m)| m.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    if !failed.is_empty() {
        eprintln!("creates failed as a 0.1.0 replica stopped: {failed:?}");
    }
    let by_v1 = created.iter().filter(|(_, v)| *v == "v1").count();
    assert!(
        created.len() >= 20 && by_v1 >= 5,
        "too little load to tell: {} creates, {by_v1} as v1",
        created.len()
    );

    // Each due At ran exactly once: one pod, its own, not before it was due.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    for name in &due {
        let running = crate::support::envtest::wait_at(
            &Api::<cnat::api::At>::namespaced(admin.clone(), &ns),
            name,
            Duration::from_secs(60),
            |at| at.status.as_ref().is_some_and(|s| s.pod_name.is_some()),
        )
        .await;
        let uid = running.metadata.uid.clone().unwrap();
        let own: Vec<Pod> = pods
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|p| {
                p.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.uid == uid)
            })
            .collect();
        assert_eq!(own.len(), 1, "{name}: {} pods", own.len());
        let schedule: chrono::DateTime<chrono::Utc> = running.spec.schedule.parse().unwrap();
        let made = own[0].metadata.creation_timestamp.clone().unwrap().0;
        // creationTimestamp has whole seconds.
        assert!(
            made.as_second() + 1 >= schedule.timestamp(),
            "{name} ran early"
        );
    }
    let all_pods = pods.list(&Default::default()).await.unwrap().items.len();
    assert_eq!(all_pods, due.len(), "pods of Ats not due");

    // Every At from before reads as v1 and again as v1alpha1 with its spec unchanged.
    for (name, spec) in &before {
        let v1 = v1_api.get(name).await.unwrap();
        assert!(
            v1.data["spec"].get("image").is_none(),
            "{name}: {}",
            v1.data
        );
        assert_eq!(
            v1.data["spec"]["template"]["image"], spec["image"],
            "{name}"
        );
        let again = old_api.get(name).await.unwrap();
        assert_eq!(&again.data["spec"], spec, "{name}");
        if name.starts_with("done") {
            assert_eq!(v1.data["status"]["phase"], "Done");
            assert_eq!(again.data["status"]["phase"], "DONE");
        }
    }
    let mut load_images = std::collections::BTreeMap::new();
    let due_1 = v1_api.get("due-1").await.unwrap();
    assert_eq!(
        due_1.data["spec"]["template"]["nodeSelector"],
        json!({"disk": "ssd"})
    );
    // The load's Ats read in both versions, with the same image: the default of the CRD (or of
    // the webhook) that took the create, 0.1.0's `busybox` or the pinned one of v1 before the
    // operator's default image, or none (this release: the operator's default runs them).
    for (name, _) in &created {
        let v1 = v1_api.get(name).await.unwrap();
        let image = &v1.data["spec"]["template"]["image"];
        assert!(
            *image == "busybox" || *image == cnat::api::DEFAULT_IMAGE || image.is_null(),
            "{name}: {image}"
        );
        let older = old_api.get(name).await.unwrap();
        assert_eq!(&older.data["spec"]["image"], image, "{name}");
        load_images.insert(name.clone(), image.clone());
    }

    // An At created as v1 with what only v1 can say reads as v1alpha1, and back unchanged.
    let pod_labels = json!({"labels": {"team": "a"}, "annotations": {"note": "x"}});
    let schedule = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339();
    let made = v1_api
        .create(
            &PostParams::default(),
            &at(
                "v1",
                "made-as-v1",
                json!({"schedule": schedule, "command": "true",
                       "template": {"metadata": pod_labels, "image": "busybox:1.36"}}),
            ),
        )
        .await
        .unwrap();
    let older = old_api.get("made-as-v1").await.unwrap();
    assert_eq!(older.data["spec"]["image"], "busybox:1.36");
    assert!(older.data["spec"].get("template").is_none());
    let carried = older.annotations()[cnat::conversion::CARRIED_ANNOTATION].clone();
    let carried: Value = serde_json::from_str(&carried).unwrap();
    assert_eq!(carried, json!({"podMetadata": pod_labels}));
    // Written as v1alpha1 (a label added; the API server converts the stored v1 object to
    // v1alpha1, patches it and converts it back): nothing v1 said is lost.
    let label = json!({"metadata": {"labels": {"touched": "by-v1alpha1"}}});
    old_api
        .patch("made-as-v1", &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();
    let back = v1_api.get("made-as-v1").await.unwrap();
    assert_eq!(back.data["spec"], made.data["spec"]);
    assert_eq!(back.data["spec"]["template"]["metadata"], pod_labels);
    assert_eq!(back.labels()["touched"], "by-v1alpha1");
    assert!(!back
        .annotations()
        .contains_key(cnat::conversion::CARRIED_ANNOTATION));

    // One that names no image (the operator's default runs it) and only a pull policy: read as
    // v1alpha1 it has no image (no default is applied to a converted read), and both the policy
    // and the absence of an image in the envelope; after a v1alpha1 patch (which v1alpha1's
    // schema default gives the image `busybox`) it still names no image in v1.
    let bare = v1_api
        .create(
            &PostParams::default(),
            &at(
                "v1",
                "no-image-as-v1",
                json!({"schedule": schedule, "command": "true",
                       "template": {"imagePullPolicy": "Never"}}),
            ),
        )
        .await
        .unwrap();
    assert!(
        bare.data["spec"]["template"].get("image").is_none(),
        "{:?}",
        bare.data
    );
    let older = old_api.get("no-image-as-v1").await.unwrap();
    assert!(
        older.data["spec"].get("image").is_none(),
        "{:?}",
        older.data
    );
    assert_eq!(
        older.annotations()[cnat::conversion::CARRIED_ANNOTATION],
        r#"{"imagePullPolicy":"Never","noImage":true}"#
    );
    old_api
        .patch(
            "no-image-as-v1",
            &PatchParams::default(),
            &Patch::Merge(&label),
        )
        .await
        .unwrap();
    let back = v1_api.get("no-image-as-v1").await.unwrap();
    assert_eq!(back.data["spec"], bare.data["spec"]);
    // A blank image in a v1alpha1 request: the mutating webhook drops it and the API server
    // gives it v1alpha1's schema default.
    old_api
        .create(
            &PostParams::default(),
            &at(
                "v1alpha1",
                "blank-as-v1alpha1",
                json!({"schedule": schedule, "command": "true", "image": " "}),
            ),
        )
        .await
        .unwrap();
    let stored = v1_api.get("blank-as-v1alpha1").await.unwrap();
    assert_eq!(stored.data["spec"]["template"]["image"], "busybox");

    // Every replica stops at once (the whole Deployment restarted) while Ats from before are
    // still stored as v1alpha1. A read from etcd (a GET: quorum) of one then needs the
    // conversion webhook, which the Service sends only to ready replicas, and fails with the
    // message the At cache looks for (it then says ready so that conversions can reach it); so
    // does a list from etcd on 1.24 (newer servers serve a quorum list from their watch cache).
    // The cache's own lists come from the API server's watch cache, which holds the Ats in the
    // storage version already: new replicas list, turn ready and lead.
    for replica in &mut new {
        replica.kill();
        service.remove(replica);
    }
    let quorum = v1_api
        .get("done-0")
        .await
        .expect_err("Ats stored as v1alpha1 remain, and no replica answers");
    let listed = v1_api.list(&kube::api::ListParams::default()).await;
    if plane.minor() < 31 {
        let refused = listed.expect_err("a quorum list from etcd needs the webhook too");
        assert!(
            refused.to_string().contains("conversion webhook"),
            "{refused}"
        );
    } else {
        // Served from the watch cache (ConsistentListFromCache, on by default since 1.31).
        assert!(listed.is_ok(), "{listed:?}");
    }
    assert!(
        quorum.to_string().contains(
            "conversion webhook for cnat.programming-kubernetes.info/v1alpha1, Kind=At failed"
        ),
        "{quorum}"
    );
    let cold: Vec<Replica> = (0..2)
        .map(|i| plane.replica_sharing(&format!("cold-{i}"), &ns, &FLAGS, &certs))
        .collect();
    for replica in &cold {
        service.add(replica);
    }
    for replica in &cold {
        service.wait_ready(replica).await;
    }
    let after = (chrono::Utc::now() + chrono::Duration::seconds(2)).to_rfc3339();
    old_api
        .create(
            &PostParams::default(),
            &at(
                "v1alpha1",
                "after-restart",
                json!({"schedule": after, "command": "true"}),
            ),
        )
        .await
        .unwrap();
    crate::support::envtest::wait_at(
        &Api::<cnat::api::At>::namespaced(admin.clone(), &ns),
        "after-restart",
        Duration::from_secs(60),
        |at| at.status.as_ref().is_some_and(|s| s.pod_name.is_some()),
    )
    .await;

    // `crd.serveV1alpha1=false`, the CRD without v1alpha1, is refused while Ats may be stored
    // as v1alpha1, naming why.
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    let mut without_v1alpha1 = crd.clone();
    without_v1alpha1.spec.versions.retain(|v| v.name == "v1");
    let apply = PatchParams::apply("cnat-e2e").force();
    let refused = crds
        .patch(CRD, &apply, &Patch::Apply(&without_v1alpha1))
        .await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(e))
            if e.code == 422 && e.message.contains("storedVersions") && e.message.contains("v1alpha1")),
        "{refused:?}"
    );

    // Storage migration, with the operator running: every At rewritten as v1.
    let migrated = tokio::process::Command::new(env!("CARGO_BIN_EXE_cnat"))
        .arg("migrate-storage")
        .env("KUBECONFIG", &plane.kubeconfig)
        .output()
        .await
        .unwrap();
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let stored = crds
        .get(CRD)
        .await
        .unwrap()
        .status
        .unwrap()
        .stored_versions
        .unwrap();
    assert_eq!(stored, ["v1"]);
    for (name, spec) in &before {
        assert_eq!(
            &old_api.get(name).await.unwrap().data["spec"],
            spec,
            "{name}"
        );
        assert_eq!(
            v1_api.get(name).await.unwrap().data["spec"]["template"]["image"],
            spec["image"]
        );
    }
    for (name, _) in &created {
        assert_eq!(
            v1_api.get(name).await.unwrap().data["spec"]["template"]["image"],
            load_images[name],
            "{name}: the image it read with before the storage migration"
        );
    }
    assert_eq!(
        v1_api.get("made-as-v1").await.unwrap().data["spec"],
        made.data["spec"]
    );
    // Still one pod per due At, after the restart and the migration too.
    let pods_now = pods.list(&Default::default()).await.unwrap().items.len();
    assert_eq!(
        pods_now,
        due.len() + 1,
        "the due Ats and after-restart, once each"
    );

    // Then v1alpha1 can go: the Ats read as v1 as before; v1alpha1 is not found.
    let listed = v1_api.list(&Default::default()).await.unwrap().items.len();
    crds.patch(CRD, &apply, &Patch::Apply(&without_v1alpha1))
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match old_api.get("made-as-v1").await {
            Err(kube::Error::Api(e)) if e.code == 404 => break,
            other => assert!(
                std::time::Instant::now() < deadline,
                "v1alpha1 still served 30 s after the CRD left it out: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        v1_api.get("made-as-v1").await.unwrap().data["spec"],
        made.data["spec"]
    );
    assert_eq!(
        v1_api.list(&Default::default()).await.unwrap().items.len(),
        listed
    );
    // And no write needs the conversion webhook any more: v1 writes of an At once written as
    // v1alpha1, and a new At that runs, make no ConversionReview.
    // kube-apiserver tears the CRD's old storage down (its `v1alpha1` watch cache with it) about
    // a second after the change, and until then that cache still converts what is written: a
    // write whose conversion (made within milliseconds when there is one) has not come 2 s
    // later shows it gone.
    let reviews = || -> f64 { cold.iter().map(conversion_reviews).sum() };
    assert!(reviews() > 0.0, "the replicas answered conversions before");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for write in 0.. {
        let before = reviews();
        let label = json!({"metadata": {"labels": {"touched": format!("by-v1-{write}")}}});
        v1_api
            .patch("made-as-v1", &PatchParams::default(), &Patch::Merge(&label))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        if reviews() == before {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "At writes still converted 30 s after the CRD left v1alpha1 out"
        );
    }
    let reviews_before = reviews();
    let due = (chrono::Utc::now() + chrono::Duration::seconds(1)).to_rfc3339();
    v1_api
        .create(
            &PostParams::default(),
            &at(
                "v1",
                "after-v1alpha1",
                json!({"schedule": due, "command": "true"}),
            ),
        )
        .await
        .unwrap();
    crate::support::envtest::wait_at(
        &Api::<cnat::api::At>::namespaced(admin.clone(), &ns),
        "after-v1alpha1",
        Duration::from_secs(60),
        |at| at.status.as_ref().is_some_and(|s| s.pod_name.is_some()),
    )
    .await;
    assert_eq!(reviews(), reviews_before);
    drop(cold);
}

/// The ConversionReviews `replica` answered, by its own count.
fn conversion_reviews(replica: &Replica) -> f64 {
    let (_, metrics) =
        crate::support::process::get(replica.admin, "/metrics").expect("the replica's /metrics");
    (metrics.lines())
        .filter(|line| line.starts_with("cnat_conversion_reviews_total"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
