//! `cargo bench --bench due -- --real --kwok [N...] [--pending=P]`: the burst where pods are
//! scheduled and run, beside the stand-in burst, in one run on the real control plane
//! (`KUBEBUILDER_ASSETS`, as `--real`).
//!
//! For each size `n` (default 1000), twice, each time in a namespace of its own with `P` more
//! Ats pending there (default 10,000; due an hour later, cached and waiting meanwhile) and an
//! operator of its own (`cnat run --namespace`, the release binary):
//!
//! 1. **KWOK** (`ControlPlane::kwok_nodes`): the real kube-scheduler of the control plane's
//!    version (its default settings: 50 requests a second, bursts of 100, as users have it)
//!    binds each pod to one of ⌈n/100⌉ KWOK nodes (110 pods a node), and KWOK plays the nodes'
//!    kubelets (`tests/support/kwok.yaml`): each pod Running once bound, then ended (exit
//!    0, `Succeeded`: a command like `true`), 8 pods at once.
//! 2. **The stand-in** (what `--real` measures): no scheduler, no node; once every At is
//!    `Running`, the bench writes every pod's end at once over 8 connections.
//!
//! KWOK runs first; its scheduler and KWOK are stopped before the stand-in's pods exist. Printed
//! for each: pods after due (first / p50 / last created), with KWOK the last bound and the last
//! ended; every At `Done` after the last pod ended and after due; the operator's RSS at the end.

use crate::envtest::{self, ControlPlane};
use crate::real;
use cnat::api::At;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// Pods a KWOK node takes (a kubelet's default `maxPods`, 110), and the pods a node is counted
/// for: some room, as a scheduler spreading pods leaves it.
pub const PODS_PER_NODE: usize = 100;
/// Ats pending beside each burst, unless `--pending=P` says otherwise.
const PENDING: usize = 10_000;

pub async fn run(sizes: &[usize], pending: Option<usize>) {
    let sizes = if sizes.is_empty() { &[1000][..] } else { sizes };
    let pending = pending.unwrap_or(PENDING);
    let Some(plane) = envtest::control_plane() else {
        panic!("--real needs a real control plane: run scripts/envtest and set KUBEBUILDER_ASSETS");
    };
    let admin = plane.admin().await;
    envtest::install_crd(&admin, &cnat::api::crd_yaml()).await;
    // The server rebuilds its OpenAPI and discovery for a new CRD: let that pass before timing.
    tokio::time::sleep(Duration::from_secs(10)).await;
    println!(
        "On a real kube-apiserver {} + kube-controller-manager (envtest), its kube-scheduler and KWOK {}, this machine; {pending} more Ats pending beside each burst:",
        plane.version,
        version_of(&envtest::tool_folder("kwok").join("kwok")),
    );
    println!();
    println!("| Ats due at once | pods run by | pod created after due: first / p50 / last | last pod bound after due | last pod ended after due | every At Done after the last pod ended | every At Done after due | operator RSS |");
    println!("|---|---|---|---|---|---|---|---|");
    for &n in sizes {
        let nodes = n.div_ceil(PODS_PER_NODE);
        let kwok = plane.kwok_nodes(&admin, nodes, None).await;
        burst(plane, &admin, n, pending, Ending::Kwok { nodes }).await;
        drop(kwok);
        remove_nodes(&admin).await;
        burst(plane, &admin, n, pending, Ending::StandIn).await;
    }
}

/// What ends the pods.
#[derive(Clone, Copy)]
enum Ending {
    /// The scheduler binds them to `nodes` KWOK nodes and KWOK ends them.
    Kwok { nodes: usize },
    /// The bench writes each pod's end once every At is `Running`.
    StandIn,
}

async fn burst(plane: &ControlPlane, admin: &Client, n: usize, pending: usize, ending: Ending) {
    let kind = match ending {
        Ending::Kwok { .. } => "kwok",
        Ending::StandIn => "standin",
    };
    let ns = plane.namespace(&format!("{kind}-{n}"), &[]).await;
    let mut operator = plane.replica(
        &format!("{kind}-{n}"),
        &ns,
        &[&format!("--namespace={ns}"), "--log=warn"],
    );
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    while !crate::service::ready(operator.admin).await {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The Ats' phases as a watch brings them (a list of 11,000 Ats every 100 ms would load the
    // server being measured; on v1.24 each is read from etcd).
    let phases = Phases::watch(ats.clone());
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    real::create_ats(&ats, pending, "later", later).await;
    assert!(
        phases
            .until(
                "later-",
                "Pending",
                pending,
                Instant::now() + Duration::from_secs(300)
            )
            .await,
        "the pending Ats' PENDING writes did not settle within 5 minutes"
    );
    // Time to create the burst's Ats and let their PENDING writes settle before they fall due.
    let lead = Duration::from_secs(5) + Duration::from_millis(5 * n as u64);
    let due_instant = Instant::now() + lead;
    let due = chrono::Utc::now() + chrono::Duration::from_std(lead).unwrap();
    let lives = tokio::spawn(watch_lives(pods.clone(), n, ending));
    let done_seen = tokio::spawn(real::watch_done(ats.clone(), n));
    real::create_ats(&ats, n, "at", due).await;
    assert!(
        phases.until("at-", "Pending", n, due_instant).await,
        "the Ats' PENDING writes did not settle before due"
    );
    let stand_in_ended = match ending {
        Ending::Kwok { .. } => None,
        Ending::StandIn => {
            let whenever = Instant::now() + Duration::from_secs(300);
            assert!(
                phases.until("at-", "Running", n, whenever).await,
                "the burst's Ats not all Running within 5 minutes"
            );
            real::end_every_pod(&pods, n).await;
            Some(Instant::now())
        }
    };
    let lives = tokio::time::timeout(Duration::from_secs(300), lives)
        .await
        .expect("every pod within five minutes of due")
        .unwrap();
    let done = tokio::time::timeout(Duration::from_secs(300), done_seen)
        .await
        .expect("every At Done within five minutes of due")
        .unwrap();
    let after = |t: Instant| t.saturating_duration_since(due_instant);
    let mut created: Vec<Duration> = lives.values().map(|l| after(l.created)).collect();
    created.sort();
    let early = lives
        .values()
        .filter(|l| l.created + Duration::from_millis(50) < due_instant)
        .count();
    assert_eq!(early, 0, "a pod was created before its At was due");
    let last = |f: fn(&Life) -> Option<Instant>| lives.values().filter_map(f).max();
    let last_bound = last(|l| l.bound);
    let last_ended = match stand_in_ended {
        Some(ended) => ended,
        None => last(|l| l.ended).expect("KWOK ended the pods"),
    };
    let count = pods.list(&Default::default()).await.unwrap().items.len();
    assert_eq!(count, n, "one pod per At due");
    let rss = crate::rss::rss_kib(&operator.child.id().to_string());
    let q = |p: f64| created[((created.len() - 1) as f64 * p).round() as usize];
    let (by, bound) = match ending {
        Ending::Kwok { nodes } => (
            format!("the scheduler and KWOK ({nodes} nodes)"),
            format!("{:.2?}", after(last_bound.expect("bound pods"))),
        ),
        Ending::StandIn => ("the stand-in (no node)".to_owned(), "-".to_owned()),
    };
    println!(
        "| {n} | {by} | {:.0?} / {:.0?} / {:.2?} | {bound} | {:.2?} | {:.2?} | {:.2?} | {:.0} MiB |",
        q(0.0),
        q(0.5),
        q(1.0),
        after(last_ended),
        done.saturating_duration_since(last_ended),
        after(done),
        rss as f64 / 1024.0,
    );
    operator.kill();
}

/// Each At's phase, as a watch of the namespace last said ("Pending" once its schedule is
/// written).
struct Phases {
    seen: std::sync::Arc<std::sync::Mutex<HashMap<String, String>>>,
    _watch: tokio_util::task::AbortOnDropHandle<()>,
}

impl Phases {
    fn watch(ats: Api<At>) -> Self {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(HashMap::new()));
        let into = seen.clone();
        let task = tokio::spawn(async move {
            let stream = watcher(ats, watcher::Config::default())
                .default_backoff()
                .applied_objects();
            futures::pin_mut!(stream);
            while let Some(next) = stream.next().await {
                let Ok(at) = next else { continue };
                let Some(status) = at.status else { continue };
                if status.phase == cnat::api::Phase::Pending && status.scheduled_time.is_none() {
                    continue;
                }
                let name = at.metadata.name.unwrap_or_default();
                into.lock()
                    .unwrap()
                    .insert(name, status.phase.as_str().to_owned());
            }
        });
        Phases {
            seen,
            _watch: tokio_util::task::AbortOnDropHandle::new(task),
        }
    }

    /// Whether the Ats named `prefix*` in `phase` numbered `n` before `deadline`.
    async fn until(&self, prefix: &str, phase: &str, n: usize, deadline: Instant) -> bool {
        loop {
            let count = self
                .seen
                .lock()
                .unwrap()
                .iter()
                .filter(|(name, p)| name.starts_with(prefix) && p.as_str() == phase)
                .count();
            if count >= n {
                return true;
            }
            if Instant::now() >= deadline {
                eprintln!("{count} of {n} Ats {prefix}* {phase} by the deadline");
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// When the bench first saw a pod: created, bound to a node, ended.
struct Life {
    created: Instant,
    bound: Option<Instant>,
    ended: Option<Instant>,
}

/// Watches the pods of the namespace until `n` were created and, with KWOK, `n` ended.
async fn watch_lives(pods: Api<Pod>, n: usize, ending: Ending) -> HashMap<String, Life> {
    let mut lives: HashMap<String, Life> = HashMap::new();
    let stream = watcher(pods, watcher::Config::default());
    futures::pin_mut!(stream);
    let finished = |lives: &HashMap<String, Life>| match ending {
        Ending::Kwok { .. } => lives.values().filter(|l| l.ended.is_some()).count() >= n,
        Ending::StandIn => lives.len() >= n,
    };
    while !finished(&lives) {
        let Some(event) = stream.try_next().await.unwrap() else {
            panic!("the pod watch ended with {} of {n} pods seen", lives.len());
        };
        let (watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) = event else {
            continue;
        };
        let now = Instant::now();
        let life = lives
            .entry(pod.metadata.name.clone().unwrap_or_default())
            .or_insert(Life {
                created: now,
                bound: None,
                ended: None,
            });
        if pod.spec.as_ref().is_some_and(|s| s.node_name.is_some()) {
            life.bound.get_or_insert(now);
        }
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            life.ended.get_or_insert(now);
        }
    }
    lives
}

fn version_of(binary: &Path) -> String {
    let output = Command::new(binary).arg("--version").output().unwrap();
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .find(|w| w.starts_with('v') && w[1..].starts_with(|c: char| c.is_ascii_digit()))
        .unwrap_or("?")
        .to_owned()
}

async fn remove_nodes(admin: &Client) {
    let nodes: Api<Node> = Api::all(admin.clone());
    let kwok = kube::api::ListParams::default().labels("type=kwok");
    nodes
        .delete_collection(&Default::default(), &kwok)
        .await
        .unwrap();
}
