//! Never twice, on the real control plane, with a replica's At cache made stale on purpose (a
//! proxy between it and the API server holds its At watch, or ends it and holds the relist):
//! the replica leads after the old leader ran the Ats, and creates no pod again; and a handover
//! in the middle of a burst creates each At's pod exactly once.

use crate::support::envtest::{
    finish_pod, garbage_collector_maps_ats, install_crd, lease_holder, ControlPlane, Replica,
};
use crate::support::process::{get, probe};
use crate::support::proxy::Proxy;
use crate::support::until_some as until;
use cnat::api::{At, Phase};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Every pod ever created in a namespace, by name: the uid of each object by that name (two
/// uids: created twice), from a watch that runs until dropped.
pub(crate) struct Creations {
    seen: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>>,
    _watch: tokio_util::task::AbortOnDropHandle<()>,
}

impl Creations {
    pub(crate) async fn watch(client: &Client, namespace: &str) -> Creations {
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let seen: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>> = Arc::default();
        let (noted, started) = (seen.clone(), tokio::sync::oneshot::channel::<()>());
        let (ready, listed) = started;
        let task = tokio::spawn(async move {
            let mut ready = Some(ready);
            let mut events = watcher(pods, watcher::Config::default()).boxed();
            while let Some(event) = events.next().await {
                let pod = match event {
                    Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => pod,
                    Ok(watcher::Event::InitDone) => {
                        if let Some(ready) = ready.take() {
                            let _ = ready.send(());
                        }
                        continue;
                    }
                    _ => continue,
                };
                let uid = pod.uid().unwrap_or_default();
                noted
                    .lock()
                    .unwrap()
                    .entry(pod.name_any())
                    .or_default()
                    .insert(uid);
            }
        });
        listed.await.expect("the pod watch lists");
        Creations {
            seen,
            _watch: tokio_util::task::AbortOnDropHandle::new(task),
        }
    }

    pub(crate) fn of(&self, pod: &str) -> usize {
        self.seen.lock().unwrap().get(pod).map_or(0, BTreeSet::len)
    }

    pub(crate) fn pods(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// Pods created more than once, with their uids.
    pub(crate) fn twice(&self) -> Vec<(String, BTreeSet<String>)> {
        let seen = self.seen.lock().unwrap();
        let twice = seen.iter().filter(|(_, uids)| uids.len() > 1);
        twice.map(|(n, u)| (n.clone(), u.clone())).collect()
    }
}

/// The value of sample `name` (labels included) on a replica's `/metrics`; `None` if the
/// replica did not answer or does not export it.
pub(crate) fn metric(replica: &Replica, name: &str) -> Option<u64> {
    let (_, body) = get(replica.admin, "/metrics")?;
    body.lines()
        .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
}

const UNCONFIRMED: &str = "cnat_pod_creates_unconfirmed_total";
const DEFERRED: &str = "cnat_pod_creates_deferred_total";
const READ: &str = "cnat_pod_create_confirmations_total{by=\"read\"}";

/// An At running `true` when due.
fn at(name: &str, due: chrono::DateTime<chrono::Utc>, ttl: Option<i32>) -> At {
    let mut at = crate::lifecycle::at(name, due, "true");
    at.spec.ttl_seconds_after_finished = ttl;
    at
}

/// One test's cluster: its namespace (the Lease in one of its own), every pod created there,
/// and two replicas: `a` leading, talking to the API server directly, and `b`, a ready standby,
/// through `proxy` if there is one.
struct Scene {
    admin: Client,
    ns: String,
    lease_ns: String,
    creations: Creations,
    proxy: Option<Proxy>,
    a: Replica,
    b: Replica,
}

impl Scene {
    async fn start(plane: &ControlPlane, test: &str, proxied: bool) -> Scene {
        let admin = plane.admin().await;
        install_crd(&admin, &cnat::api::crd_yaml()).await;
        let lease_ns = plane.namespace(&format!("{test}-lease"), &[]).await;
        let ns = plane.namespace(test, &[]).await;
        if plane.has_controller_manager() {
            garbage_collector_maps_ats(&admin, &ns).await;
        }
        let creations = Creations::watch(&admin, &ns).await;
        let proxy = match proxied {
            true => Some(Proxy::start(admin.clone()).await),
            false => None,
        };
        let flags = [format!("--namespace={ns}"), "--webhooks=false".into()];
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let a = plane.replica("a", &lease_ns, &flags);
        let leads = until(Duration::from_secs(30), async || {
            let holder = lease_holder(&admin, &lease_ns, "cnat").await;
            (holder.as_deref() == Some("a")).then_some(())
        });
        assert!(leads.await.is_some(), "a never led: {}", a.log_text());
        let b = match &proxy {
            Some(proxy) => plane.replica_through("b", &lease_ns, &flags, &proxy.url),
            None => plane.replica("b", &lease_ns, &flags),
        };
        let ready = until(Duration::from_secs(30), async || {
            (probe(b.admin, "/readyz") == Some(200)).then_some(())
        });
        assert!(ready.await.is_some(), "b never ready: {}", b.log_text());
        Scene {
            admin,
            ns,
            lease_ns,
            creations,
            proxy,
            a,
            b,
        }
    }

    fn ats(&self) -> Api<At> {
        Api::namespaced(self.admin.clone(), &self.ns)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), &self.ns)
    }

    fn proxy(&self) -> &Proxy {
        self.proxy.as_ref().expect("a proxied scene")
    }

    /// Creates Ats running `true` at `due`, each with its `ttlSecondsAfterFinished`.
    async fn create(&self, due: chrono::DateTime<chrono::Utc>, ats: &[(&str, Option<i32>)]) {
        for (name, ttl) in ats {
            let new = at(name, due, *ttl);
            self.ats()
                .create(&PostParams::default(), &new)
                .await
                .unwrap();
        }
    }

    /// Stops `a` as a rolling update does and waits until `b` leads.
    async fn hand_over(&mut self) {
        self.a.terminate();
        let leads = until(Duration::from_secs(30), async || {
            let holder = lease_holder(&self.admin, &self.lease_ns, "cnat").await;
            (holder.as_deref() == Some("b")).then_some(())
        });
        assert!(leads.await.is_some(), "b never led: {}", self.b.log_text());
    }
}

/// Whether the At watch events `proxy` passed on showed At `name` in `phase`.
fn saw(proxy: &Proxy, name: &str, phase: &str) -> bool {
    proxy.forwarded().lines().any(|line| {
        serde_json::from_str::<serde_json::Value>(line).is_ok_and(|event| {
            event["object"]["metadata"]["name"] == name
                && event["object"]["status"]["phase"] == phase
        })
    })
}

/// The pod of At `name` is created; then it ends, as the kubelet would say.
async fn run(admin: &Client, ns: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let pod = format!("{name}-pod");
    let created = until(Duration::from_secs(30), async || {
        pods.get_opt(&pod).await.unwrap()
    });
    assert!(created.await.is_some(), "{pod} never created");
    finish_pod(admin, ns, &pod, 0, "").await;
}

/// At `name` ran and is DONE; then its pod (let go of by cnat once DONE) is deleted by hand.
async fn done_then_pod_deleted_by_hand(admin: &Client, ns: &str, name: &str) {
    let ats: Api<At> = Api::namespaced(admin.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let done = until(Duration::from_secs(30), async || {
        let at = ats.get(name).await.unwrap();
        at.status
            .is_some_and(|s| s.phase == Phase::Done)
            .then_some(())
    });
    assert!(done.await.is_some(), "{name} never DONE");
    let pod = format!("{name}-pod");
    pods.delete(&pod, &DeleteParams::default()).await.unwrap();
    let deleted = until(Duration::from_secs(30), async || {
        pods.get_opt(&pod).await.unwrap().is_none().then_some(())
    });
    assert!(deleted.await.is_some(), "{pod} never went");
}

/// A standby whose At watch is stuck still shows two Ats as PENDING that ran meanwhile: one
/// deleted by its `ttlSecondsAfterFinished: 0` (its pod by the garbage collector), one DONE
/// whose pod was deleted by hand. It leads, decides to create both pods from that cache, and the
/// quorum read before each create stops it.
#[tokio::test]
async fn a_new_leader_whose_at_watch_is_stuck_runs_nothing_again() {
    let plane = crate::real_control_plane!();
    assert!(plane.has_controller_manager(), "the garbage collector runs");
    let mut scene = Scene::start(plane, "stuck-watch", true).await;
    let (admin, ns, proxy) = (scene.admin.clone(), scene.ns.clone(), scene.proxy());
    let due = chrono::Utc::now() + chrono::Duration::seconds(8);
    scene
        .create(due, &[("deleted", Some(0)), ("kept", None)])
        .await;
    // b's cache holds both as PENDING; from then on its watch passes nothing on.
    let seen = until(Duration::from_secs(30), async || {
        (saw(proxy, "deleted", "Pending") && saw(proxy, "kept", "Pending")).then_some(())
    });
    assert!(seen.await.is_some(), "b never saw them PENDING");
    proxy.hold_watches(true);

    run(&admin, &ns, "deleted").await;
    run(&admin, &ns, "kept").await;
    let (ats, pods) = (scene.ats(), scene.pods());
    let gone = until(Duration::from_secs(60), async || {
        let at = ats.get_opt("deleted").await.unwrap();
        let pod = pods.get_opt("deleted-pod").await.unwrap();
        (at.is_none() && pod.is_none()).then_some(())
    });
    assert!(gone.await.is_some(), "the TTL At and its pod never went");
    done_then_pod_deleted_by_hand(&admin, &ns, "kept").await;

    scene.hand_over().await;
    // b decides on its stale cache: both creates stopped by the API server's answer, or made.
    let pods_of = ["deleted-pod", "kept-pod"];
    let decided = until(Duration::from_secs(30), async || {
        let again = pods_of.iter().any(|pod| scene.creations.of(pod) > 1);
        (again || metric(&scene.b, UNCONFIRMED) >= Some(2)).then_some(())
    });
    let decided = decided.await;
    for pod in pods_of {
        assert_eq!(scene.creations.of(pod), 1, "{pod} created once");
        assert!(pods.get_opt(pod).await.unwrap().is_none(), "{pod} again");
    }
    assert!(decided.is_some(), "b never tried: {}", scene.b.log_text());
    scene.proxy().hold_watches(false);
    let kept = ats.get("kept").await.unwrap();
    assert_eq!(kept.status.map(|s| s.phase), Some(Phase::Done));
}

/// A standby whose At watch expired is listing again when it leads (its list held): its store
/// still shows as PENDING an At that ran meanwhile. It creates nothing while it lists (not even
/// a read), and nothing once the list shows the At DONE.
#[tokio::test]
async fn a_new_leader_that_is_listing_creates_nothing_until_its_cache_caught_up() {
    let plane = crate::real_control_plane!();
    let mut scene = Scene::start(plane, "relisting", true).await;
    let (admin, ns, proxy) = (scene.admin.clone(), scene.ns.clone(), scene.proxy());
    let due = chrono::Utc::now() + chrono::Duration::seconds(8);
    scene.create(due, &[("ran", None)]).await;
    let seen = until(Duration::from_secs(30), async || {
        saw(proxy, "ran", "Pending").then_some(())
    });
    assert!(seen.await.is_some(), "b never saw it PENDING");
    // b's watch ends with 410 Expired; its list waits.
    proxy.hold_lists(true);
    proxy.expire_watches();
    let listing = until(Duration::from_secs(30), async || {
        (proxy.lists_held() > 0).then_some(())
    });
    assert!(listing.await.is_some(), "b never listed again");

    run(&admin, &ns, "ran").await;
    done_then_pod_deleted_by_hand(&admin, &ns, "ran").await;

    scene.hand_over().await;
    let b = &scene.b;
    let deferred = until(Duration::from_secs(30), async || {
        (metric(b, DEFERRED) >= Some(1)).then_some(())
    });
    assert!(
        deferred.await.is_some(),
        "b never put a create off: {}",
        b.log_text()
    );
    assert_eq!(metric(b, READ), Some(0), "not even a read while listing");
    assert_eq!(scene.creations.of("ran-pod"), 1);

    // The list ends: b's cache shows the At DONE, and nothing is created.
    scene.proxy().hold_lists(false);
    let caught_up = until(Duration::from_secs(30), async || {
        let (_, body) = get(b.admin, "/metrics").unwrap_or_default();
        body.contains("\ncnat_ats{phase=\"DONE\"} 1\n")
            .then_some(())
    });
    assert!(
        caught_up.await.is_some(),
        "b never caught up: {}",
        b.log_text()
    );
    let pods = scene.pods();
    let recreated = until(Duration::from_secs(3), async || {
        pods.get_opt("ran-pod").await.unwrap()
    });
    assert!(recreated.await.is_none(), "ran-pod created again");
    assert_eq!(scene.creations.of("ran-pod"), 1);
    assert_eq!(
        metric(b, UNCONFIRMED),
        Some(0),
        "decided on the caught-up cache"
    );
}

/// The requests a second the scheduler of the tests' KWOK nodes may send: enough not to be what
/// the tests wait for (its default, 50, binds 500 pods in 10 s).
pub(crate) const SCHEDULER_QPS: u32 = 1000;

/// A leader stopped (as by a rolling update) while 500 Ats fall due at once, each deleted by
/// its `ttlSecondsAfterFinished: 0` as soon as its pod ended (the real kube-scheduler binds the
/// pods to KWOK nodes, which run each and end it; the garbage collector deletes the pods): the old
/// leader and the new one together create each At's pod exactly once.
#[tokio::test]
async fn a_handover_in_the_middle_of_a_burst_creates_each_pod_once() {
    const ATS: usize = 500;
    let plane = crate::real_control_plane!();
    assert!(plane.has_controller_manager(), "the garbage collector runs");
    let mut scene = Scene::start(plane, "burst-handover", false).await;
    let ats = scene.ats();
    // Nodes for the 500 pods (KWOK's, 110 pods each): each pod runs and ends (exit 0).
    let nodes = plane.kwok_nodes(&scene.admin, 6, Some(SCHEDULER_QPS)).await;
    let due = chrono::Utc::now() + chrono::Duration::seconds(10);
    futures::stream::iter(0..ATS)
        .for_each_concurrent(8, |i| {
            let ats = ats.clone();
            async move {
                let at = at(&format!("at-{i}"), due, Some(0));
                ats.create(&PostParams::default(), &at).await.unwrap();
            }
        })
        .await;
    let creations = &scene.creations;
    let started = until(Duration::from_secs(30), async || {
        (creations.pods() >= 1).then_some(())
    });
    assert!(
        started.await.is_some(),
        "the burst never started: {}",
        scene.a.log_text()
    );
    scene.hand_over().await;
    let at_handover = scene.creations.pods();
    let gone = until(Duration::from_secs(120), async || {
        let left = ats.list(&Default::default()).await.unwrap().items.len();
        let pods = scene
            .pods()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .len();
        (left == 0 && pods == 0).then_some(())
    });
    assert!(gone.await.is_some(), "not every At and pod went");
    drop(nodes);
    let creations = &scene.creations;
    assert_eq!(creations.twice(), vec![], "pods created twice");
    assert_eq!(creations.pods(), ATS);
    // Not vacuous: the new leader took over in the middle.
    assert!(at_handover < ATS, "the handover came after the burst");
}
