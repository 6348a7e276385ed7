//! `cargo bench --bench due -- --real --vs-jobs [N]`: cnat beside the peer users would pick
//! instead, the Job controller (kube-controller-manager with its stock settings), on the real
//! control plane `KUBEBUILDER_ASSETS` holds, in one run: N Jobs of one pod each created at
//! once, then N Ats due at their creation, then N Jobs again (a server that slows down or speeds
//! up over the run favours neither). Each round has three phases:
//!
//! - **to the last pod**: from the first create to the last pod seen (a pod watch here);
//! - **to finished**: a kubelet stand-in ends every pod at once (exit 0, its status written over
//!   8 connections), until every Job is `Complete` / every At `Done`; with `--kwok`, the real
//!   kube-scheduler binds the pods to KWOK nodes (⌈N/100⌉, for the whole run) and KWOK runs and
//!   ends them (`ControlPlane::kwok_nodes`), as a node's kubelet would;
//! - **to released**: until no pod holds its controller's finalizer any more (the Job
//!   controller's `batch.kubernetes.io/job-tracking`, cnat's `run-once`) and kube-apiserver
//!   answered no request for 3 s (events and late status writes are counted where they land).
//!
//! Per phase: the wall time, kube-apiserver's CPU seconds (from `/proc`) and the requests it
//! answered (`apiserver_request_total`, every client: the bench's own creates, the stand-in's
//! (or KWOK's) pod-status writes and watches are the same N in both), by verb and resource; then
//! per Job and per At
//! over the whole life. The operator is the `cnat run` release binary, one replica. Lease
//! requests are left out of the totals and of "quiet": cnat's replica renews its Lease every
//! 2 s whatever it does, and envtest's kube-controller-manager runs without leader election (in
//! a cluster it renews its own Lease too); they are listed with the verbs. The replica serves
//! the CRD's conversion webhook, which the CRD points at for its round, as a Service would. After
//! each round (not measured) its pods and Jobs or Ats are deleted, so that no round runs beside
//! another's objects. The Ats round starts [`SETTLE`] after that re-install (kube-apiserver's
//! work for a changed CRD, reported, is not the round's). `--only-v1`: the CRD lists `v1` alone
//! for the Ats round, as `crd.serveV1alpha1=false` installs it (no conversion webhook calls).
//! After the table: the conversions kube-apiserver had the webhook make (by version) and the
//! ConversionReviews the replica answered; kube-apiserver's CPU with nothing to do, read for
//! [`IDLE`] before the first round and after the last, and each round's CPU per object less
//! the two readings' mean rate times the round's wall time.

use crate::envtest::{self, ControlPlane};
use crate::real::{self, requests_answered, watch_pods};
use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// The Job controller's finalizer on the pods it tracks.
const JOB_TRACKING: &str = "batch.kubernetes.io/job-tracking";
/// How long kube-apiserver must answer no request for a round to be over.
const QUIET: Duration = Duration::from_secs(3);
/// How long the Ats round waits after re-installing the CRD (with the replica's conversion
/// webhook) before it starts: kube-apiserver's work for a changed CRD is not the round's.
const SETTLE: Duration = Duration::from_secs(10);
/// The replica's count of the ConversionReviews it answered.
const REVIEWS: &str = "cnat_conversion_reviews_total";
/// How long the bench reads kube-apiserver's CPU with nothing to do, before the first round and
/// again after the last.
const IDLE: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Jobs,
    Ats,
}

/// One phase of a round: its wall time, kube-apiserver's CPU seconds and requests answered.
struct Phase {
    took: Duration,
    /// The wall time `cpu` was read over (`took`, but for the last phase also the quiet wait).
    wall: Duration,
    cpu: f64,
    requests: HashMap<String, f64>,
    /// The CPU seconds of cnat's replica (a process of its own); none for the Job controller
    /// (inside kube-controller-manager, beside the other controllers).
    controller: f64,
}

pub async fn run(n: usize, kwok: bool, only_v1: bool) {
    let (plane, admin) = real::start(
        "| round | N | to the last pod: time / kube-apiserver CPU / requests | to finished | to released and quiet | whole life per object: requests / kube-apiserver CPU ms (cnat's replica's CPU ms) |",
    )
    .await;
    // The nodes' processes run until `_nodes` goes, at the end of the run.
    let nodes = n.div_ceil(crate::kwok::PODS_PER_NODE);
    let _nodes = if kwok {
        Some(plane.kwok_nodes(&admin, nodes, None).await)
    } else {
        None
    };
    let idle_before = idle(plane, &admin).await;
    let mut rounds = Vec::new();
    let mut net = Vec::new();
    let mut notes = Vec::new();
    for (index, kind) in [Kind::Jobs, Kind::Ats, Kind::Jobs].into_iter().enumerate() {
        let Round {
            phases,
            settling,
            reviews,
        } = round(plane, &admin, (kind, kwok, only_v1), n, index).await;
        notes.extend(settling.map(|cpu| {
            format!("kube-apiserver's CPU in the {SETTLE:?} after the CRD's re-install for the Ats round (left out): {cpu:.1} s")
        }));
        notes.extend(reviews.map(|reviews| {
            let counted = (phases.iter()).fold(0.0, |sum, p| sum + real::conversions(&p.requests));
            format!("ConversionReviews cnat's replica answered over the Ats round: {reviews} (kube-apiserver counted {counted:.0} conversions)")
        }));
        let name = name_of(kind);
        let cells: Vec<String> = phases
            .iter()
            .map(|p| {
                format!(
                    "{:.1?} / {:.1} s / {:.0}",
                    p.took,
                    p.cpu,
                    total(&p.requests)
                )
            })
            .collect();
        let requests: f64 = phases.iter().map(|p| total(&p.requests)).sum();
        let cpu: f64 = phases.iter().map(|p| p.cpu).sum();
        let wall: f64 = phases.iter().map(|p| p.wall.as_secs_f64()).sum();
        net.push((name_of(kind), wall, cpu));
        let controller: f64 = phases.iter().map(|p| p.controller).sum();
        let controller = match kind {
            Kind::Jobs => String::new(),
            Kind::Ats => format!(" ({:.2})", controller * 1e3 / n as f64),
        };
        println!(
            "| {name} | {n} | {} | {:.2} / {:.2}{controller} |",
            cells.join(" | "),
            requests / n as f64,
            cpu * 1e3 / n as f64
        );
        rounds.push((name, phases));
    }
    println!();
    println!("Requests per object over the whole life, by verb and resource (every client):");
    for (name, phases) in &rounds {
        let mut whole: HashMap<&str, f64> = HashMap::new();
        for phase in phases {
            for (what, count) in &phase.requests {
                *whole.entry(what.as_str()).or_default() += count;
            }
        }
        // What rounds to 0.00 per object is summed into one figure at the end.
        let (mut rows, rest): (Vec<(&str, f64)>, Vec<_>) = (whole.into_iter())
            .filter(|(_, c)| *c >= 1.0)
            .partition(|(_, c)| c / n as f64 >= 0.005);
        rows.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
        let mut rows: Vec<String> = rows
            .iter()
            .map(|(what, count)| format!("{what} {:.2}", count / n as f64))
            .collect();
        if !rest.is_empty() {
            let count: f64 = rest.iter().map(|(_, c)| c).sum();
            rows.push(format!(
                "and {} more kinds, {count:.0} over the round ({:.3} per object)",
                rest.len(),
                count / n as f64
            ));
        }
        println!("- {name}: {}", rows.join(", "));
    }
    println!();
    for note in notes {
        println!("{note}");
    }
    println!(
        "kube-apiserver's conversion counts over the run, by version: {}",
        conversions_by_version(&admin).await
    );
    let idle_after = idle(plane, &admin).await;
    println!(
        "kube-apiserver's CPU with nothing to do ({IDLE:?} before the first round, and after the last): {:.1} and {:.1} ms a second",
        idle_before * 1e3,
        idle_after * 1e3
    );
    let rate = (idle_before + idle_after) / 2.0;
    let net: Vec<(&str, f64, f64)> = (net.iter())
        .map(|(name, wall, cpu)| (*name, *wall, (cpu - rate * wall) * 1e3 / n as f64))
        .collect();
    let shown: Vec<String> = (net.iter())
        .map(|(name, wall, ms)| format!("{name} {ms:.2} ms per object ({wall:.0} s)"))
        .collect();
    println!(
        "each round's CPU less the two readings' mean rate times its wall time: {}",
        shown.join(", ")
    );
    let jobs: Vec<f64> = (net.iter())
        .filter(|(name, ..)| *name == "Jobs")
        .map(|(.., ms)| *ms)
        .collect();
    if let Some((.., ats)) = net.iter().find(|(name, ..)| *name == "Ats") {
        let mean = jobs.iter().sum::<f64>() / jobs.len() as f64;
        println!(
            "so the Ats' {ats:.2} ms is {:.3}x the Jobs rounds' mean",
            ats / mean
        );
    }
}

/// kube-apiserver's CPU seconds a second over [`IDLE`] once it answered nothing for [`QUIET`]
/// (its own periodic work, the controller manager's and, with `--kwok`, the nodes'
/// heartbeats): what accrues over a round's wall time whatever the round does, so that the
/// longer Jobs rounds gather more of it.
async fn idle(plane: &ControlPlane, admin: &Client) -> f64 {
    quiet(admin).await;
    let before = server_cpu(plane);
    tokio::time::sleep(IDLE).await;
    (server_cpu(plane) - before) / IDLE.as_secs_f64()
}

fn name_of(kind: Kind) -> &'static str {
    match kind {
        Kind::Jobs => "Jobs",
        Kind::Ats => "Ats",
    }
}

/// kube-apiserver's CPU seconds so far (its processes under the control plane's directory).
fn server_cpu(plane: &ControlPlane) -> f64 {
    let server: Vec<u32> = (crate::rss::processes_under(&plane.dir).into_iter())
        .filter(|(name, _)| name == "kube-apiserver")
        .map(|(_, pid)| pid)
        .collect();
    assert!(
        !server.is_empty(),
        "no kube-apiserver under {}",
        plane.dir.display()
    );
    server.into_iter().map(crate::rss::cpu_seconds).sum()
}

/// kube-apiserver's count of the conversions it had a CRD's conversion webhook make, by the
/// versions from and to, as `from -> to: count` pairs; "none" when there were none.
async fn conversions_by_version(admin: &Client) -> String {
    let counts = requests_answered(admin).await.unwrap_or_default();
    let mut pairs: Vec<String> = (counts.iter())
        .filter_map(|(what, count)| {
            let versions = what.strip_prefix(real::CONVERSIONS)?.trim();
            Some(format!("{versions}: {count:.0}"))
        })
        .collect();
    pairs.sort();
    if pairs.is_empty() {
        return "none".to_owned();
    }
    pairs.join(", ")
}

/// The requests of a phase but the Lease's (a replica renews its own every 2 s whatever the
/// Ats; kube-controller-manager runs here without leader election: see the module comment), and
/// but the count of the conversion webhook's calls, which are no requests to kube-apiserver.
fn total(requests: &HashMap<String, f64>) -> f64 {
    (requests.iter())
        .filter(|(what, _)| !what.ends_with(" leases") && !what.starts_with(real::CONVERSIONS))
        .fold(0.0, |sum, (_, count)| sum + count)
}

/// What one round measured.
struct Round {
    phases: Vec<Phase>,
    /// kube-apiserver's CPU seconds from the CRD's re-install (the Ats round's) to [`SETTLE`]
    /// later, left out of the round.
    settling: Option<f64>,
    /// The ConversionReviews cnat's replica answered over the Ats round (its own count).
    reviews: Option<u64>,
}

/// One round: `n` Jobs or Ats in a namespace of their own, through the three phases.
async fn round(
    plane: &'static ControlPlane,
    admin: &Client,
    (kind, kwok, only_v1): (Kind, bool, bool),
    n: usize,
    index: usize,
) -> Round {
    let ns = plane.namespace(&format!("vs-jobs-{index}"), &[]).await;
    let operator = (kind == Kind::Ats).then(|| {
        plane.replica(
            &format!("vs-jobs-{index}"),
            &ns,
            &[&format!("--namespace={ns}"), "--log=warn"],
        )
    });
    let server_cpu = || server_cpu(plane);
    let mut settling = None;
    if let Some(operator) = &operator {
        real::wait_ready(operator, Duration::from_secs(30)).await;
        let before = server_cpu();
        let mut crd = real::crd_converting_by(operator);
        if only_v1 {
            // What `crd.serveV1alpha1=false` installs.
            crd.spec.versions.retain(|version| version.name == "v1");
        }
        envtest::install_crd(admin, &cnat::api::crd_to_yaml(&crd)).await;
        // kube-apiserver rebuilds the CRD's storage, OpenAPI and discovery for the re-installed
        // CRD: let that pass, as the bench's start does for the first install, so that it is
        // not counted as the round's.
        tokio::time::sleep(SETTLE).await;
        settling = Some(server_cpu() - before);
        let deadline = Instant::now() + Duration::from_secs(30);
        while envtest::lease_holder(admin, &ns, "cnat").await.is_none() {
            assert!(Instant::now() < deadline, "the operator never led");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let cpu = || -> (f64, f64) {
        let server = server_cpu();
        let controller = (operator.as_ref()).map_or(0.0, |o| crate::rss::cpu_seconds(o.child.id()));
        (server, controller)
    };
    quiet(admin).await;
    let reviews = || (operator.as_ref()).map(|o| real::metric_sum(o.admin, REVIEWS));
    let reviews_before = reviews();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let mut phases = Vec::new();
    let mut mark = Mark::now(admin, &cpu).await;

    // To the last pod.
    let seen = tokio::spawn(watch_pods(pods.clone(), n));
    match kind {
        Kind::Jobs => {
            let jobs: Api<Job> = Api::namespaced(admin.clone(), &ns);
            concurrently(n, |i| {
                let jobs = jobs.clone();
                async move {
                    jobs.create(&PostParams::default(), &job(&format!("job-{i}")))
                        .await
                        .unwrap();
                }
            })
            .await;
        }
        Kind::Ats => {
            let ats: Api<cnat::api::At> = Api::namespaced(admin.clone(), &ns);
            real::create_ats(&ats, n, "at", chrono::Utc::now()).await;
        }
    }
    let seen = tokio::time::timeout(Duration::from_secs(600), seen)
        .await
        .expect("every pod within ten minutes")
        .unwrap();
    phases.push(mark.phase(admin, &cpu).await);

    // To finished: every pod ends at once.
    let finished = tokio::spawn(watch_finished(admin.clone(), ns.clone(), kind, n));
    if !kwok {
        let names: Vec<String> = seen.into_keys().collect();
        real::end_pods(&pods, &names).await;
    }
    tokio::time::timeout(Duration::from_secs(600), finished)
        .await
        .expect("every one finished within ten minutes")
        .unwrap();
    phases.push(mark.phase(admin, &cpu).await);

    // To released and quiet.
    let finalizer = match kind {
        Kind::Jobs => JOB_TRACKING,
        Kind::Ats => cnat::operator::finalizer::FINALIZER,
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let list = pods.list(&Default::default()).await.unwrap();
        let held = list
            .items
            .iter()
            .filter(|pod| pod.finalizers().iter().any(|f| f == finalizer))
            .count();
        if held == 0 {
            break;
        }
        if Instant::now() > deadline {
            // What the operator said (its log goes with the control plane).
            let kept = std::env::temp_dir().join(format!("cnat-vs-jobs-{index}.log"));
            if let Some(operator) = &operator {
                let _ = std::fs::copy(&operator.log, &kept);
            }
            panic!(
                "{held} pods still hold {finalizer} after 300 s; the operator's log: {}",
                kept.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    quiet(admin).await;
    let mut last = mark.phase(admin, &cpu).await;
    // The quiet wait's own time and the lists above are the bench's, not the round's.
    last.took = last.took.saturating_sub(QUIET);
    phases.push(last);
    let reviews = reviews()
        .zip(reviews_before)
        .map(|(after, before)| after.saturating_sub(before));
    remove(admin, &ns, kind).await;
    Round {
        phases,
        settling,
        reviews,
    }
}

/// Deletes the round's pods, then its Jobs or Ats, and waits until all are gone.
async fn remove(admin: &Client, ns: &str, kind: Kind) {
    delete_all(Api::<Pod>::namespaced(admin.clone(), ns)).await;
    match kind {
        Kind::Jobs => delete_all(Api::<Job>::namespaced(admin.clone(), ns)).await,
        Kind::Ats => delete_all(Api::<cnat::api::At>::namespaced(admin.clone(), ns)).await,
    }
}

/// Deletes every object `api` reaches and waits until all are gone, at most 120 s.
async fn delete_all<K>(api: Api<K>)
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let everything = ListParams::default();
    let deadline = Instant::now() + Duration::from_secs(120);
    // A server slow to delete them all may answer after the client's read timeout: a second
    // request deletes whatever is left.
    while let Err(error) = api
        .delete_collection(&DeleteParams::default(), &everything)
        .await
    {
        assert!(
            Instant::now() < deadline,
            "deleting every {}: {error}",
            K::plural(&())
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    loop {
        let left = api.list_metadata(&everything).await.unwrap().items.len();
        if left == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{left} {} still there 120 s after their deletion",
            K::plural(&())
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Where a phase started: its instant, kube-apiserver's CPU seconds and request counts.
struct Mark {
    at: Instant,
    /// kube-apiserver's CPU seconds, the controller's.
    cpu: (f64, f64),
    requests: HashMap<String, f64>,
}

impl Mark {
    async fn now(admin: &Client, cpu: &impl Fn() -> (f64, f64)) -> Mark {
        Mark {
            requests: requests_answered(admin)
                .await
                .expect("the server's metrics"),
            at: Instant::now(),
            cpu: cpu(),
        }
    }

    /// The phase from this mark to now; this mark moves to now.
    async fn phase(&mut self, admin: &Client, cpu: &impl Fn() -> (f64, f64)) -> Phase {
        let next = Mark::now(admin, cpu).await;
        let requests = next
            .requests
            .iter()
            .map(|(what, count)| {
                let before = self.requests.get(what).copied().unwrap_or(0.0);
                (what.clone(), count - before)
            })
            .filter(|(_, count)| *count >= 0.5)
            .collect();
        let phase = Phase {
            took: next.at - self.at,
            wall: next.at - self.at,
            cpu: next.cpu.0 - self.cpu.0,
            requests,
            controller: next.cpu.1 - self.cpu.1,
        };
        *self = next;
        phase
    }
}

/// Until kube-apiserver answered no request (but the bench's scrapes) for [`QUIET`], at most a
/// minute (then it says so).
async fn quiet(admin: &Client) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = requests_answered(admin).await.map(|r| total(&r));
    while Instant::now() < deadline {
        tokio::time::sleep(QUIET).await;
        let now = requests_answered(admin).await.map(|r| total(&r));
        if now == last {
            return;
        }
        last = now;
    }
    eprintln!(
        "kube-apiserver still answered requests after a minute's wait for {QUIET:?} of quiet"
    );
}

/// A Job of one pod running `true`, as a script at the time (or a CronJob) would create it.
fn job(name: &str) -> Job {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "command", "image": "busybox", "command": ["sh", "-c", "true"]}],
            }},
        },
    }))
    .unwrap()
}

/// Until all `n` Jobs of `namespace` are `Complete`, or all `n` Ats `Done`.
async fn watch_finished(admin: Client, namespace: String, kind: Kind, n: usize) {
    let mut finished = HashSet::new();
    match kind {
        Kind::Jobs => {
            let jobs: Api<Job> = Api::namespaced(admin, &namespace);
            let stream = watcher(jobs, watcher::Config::default())
                .default_backoff()
                .applied_objects();
            futures::pin_mut!(stream);
            while finished.len() < n {
                let Some(next) = stream.next().await else {
                    panic!("the Job watch ended");
                };
                let Ok(job) = next else {
                    continue;
                };
                let complete = job.status.as_ref().and_then(|s| s.conditions.as_ref());
                if complete.is_some_and(|c| {
                    c.iter()
                        .any(|c| c.type_ == "Complete" && c.status == "True")
                }) {
                    finished.insert(job.name_any());
                }
            }
        }
        Kind::Ats => {
            real::watch_done(Api::namespaced(admin, &namespace), n).await;
        }
    }
}

/// Runs `each(i)` for `0..n`, 8 at once (the connections of the floors and the stand-in).
async fn concurrently<F, Fut>(n: usize, each: F)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    futures::stream::iter(0..n)
        .for_each_concurrent(8, each)
        .await;
}
