//! `cargo bench --bench due -- --real [SIZES]`: the burst scenario on a real kube-apiserver (the
//! version `KUBEBUILDER_ASSETS` holds: `scripts/envtest 1.24` or `scripts/envtest 1.37`)
//! with etcd and kube-controller-manager (the control plane of `tests/support/envtest.rs`,
//! `KUBEBUILDER_ASSETS`), the `cnat run` release binary as its own process. For each size `n`,
//! in the same run:
//!
//! - floors: `n` bare pod creates over 8 connections, and over 32 (the operator's default
//!   `--concurrency`), and `n` of cnat's own pods (`pod::build`) over 32 (A B C C B A,
//!   averaged), each with the cores the control plane kept busy meanwhile (its CPU seconds over
//!   the wall time; 2 is all this machine has); `n` bare At status merge patches over 8
//!   connections (both by this process, in namespaces the operator does not watch); the same
//!   status patches on copies of the CRD without the CEL transition rule and with a minimal
//!   schema (like kazk/cnat-rs's), to show what our CRD's status writes cost the server;
//! - `n` Ats due at one instant: the first / median / last pod after due (from a pod watch, as
//!   each ADDED event arrives here), the last as a ratio to the create floor, and the control
//!   plane's busy cores (and the operator's) from due to the last pod;
//! - then a kubelet stand-in ends all `n` pods at once (their status written over 8
//!   connections): how long after the last pod ended every At said DONE, and as a ratio to the
//!   status-patch floor; and when a reader listing the Ats every 50 ms (each list read from
//!   etcd) first saw every At done, as `v1` and as `v1alpha1` (each of those lists converted by
//!   the operator's conversion webhook, to which the CRD points for the run);
//! - the operator's resident memory at the end.

use crate::envtest::{self, ControlPlane};
use crate::service::ready;
use cnat::api::At;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Connections the floors and the kubelet stand-in use, as the operator's own writers.
const CONNECTIONS: usize = 8;
/// Connections of the wide create floor: as many creates at once as the operator's default
/// `--concurrency` allows.
const WIDE: usize = 32;

/// The control plane with the CRD installed, and the table's header printed.
pub async fn start(header: &str) -> (&'static ControlPlane, Client) {
    let Some(plane) = envtest::control_plane() else {
        panic!("--real needs a real control plane: run scripts/envtest and set KUBEBUILDER_ASSETS");
    };
    let admin = plane.admin().await;
    envtest::install_crd(&admin, &cnat::api::crd_yaml()).await;
    for copy in [CrdCopy::WithoutCel, CrdCopy::Minimal] {
        envtest::install_crd(&admin, &crd_copy(copy, copy.group())).await;
    }
    // The server rebuilds its OpenAPI and discovery for new CRDs: let that pass before timing.
    tokio::time::sleep(Duration::from_secs(10)).await;
    println!(
        "On a real kube-apiserver {} + etcd {} + kube-controller-manager (envtest), this machine:",
        plane.version,
        etcd_version()
    );
    println!();
    println!("{header}");
    println!("{}|", "|---".repeat(header.matches('|').count() - 1));
    (plane, admin)
}

/// What `etcd --version` of the control plane says (its first line's version).
fn etcd_version() -> String {
    let assets = std::env::var("KUBEBUILDER_ASSETS").unwrap_or_default();
    std::process::Command::new(std::path::Path::new(&assets).join("etcd"))
        .arg("--version")
        .output()
        .ok()
        .and_then(|out| {
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let first = text.lines().next()?.to_owned();
            first.rsplit(' ').next().map(str::to_owned)
        })
        .unwrap_or_else(|| "(version unknown)".into())
}

pub async fn run(sizes: &[usize]) {
    let (plane, admin) = start("| Ats due at once | bare pod creates (floor) | the same over 32 connections | cnat's pods over 32 connections, by this process | the server's cores busy: floor / over 32 / cnat's pods over 32 / burst (cnat's own) | pod after due (first / p50 / last) | last pod / floor | bare status patches (floor) | the same without the CEL rule / with a minimal schema | every At DONE after the last pod ended | DONE / floor | the same as a reader listing every 50 ms sees it, v1 / v1alpha1 (one list once all is quiet) | every Succeeded event after the last DONE | every pod let go of cnat's finalizer after the last DONE | operator RSS after the burst (before any At) |").await;
    for &n in sizes {
        burst(plane, &admin, n).await;
    }
}

pub fn bare_pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }))
    .unwrap()
}

pub fn at(name: &str, schedule: chrono::DateTime<chrono::Utc>) -> At {
    serde_json::from_value(json!({
        "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
        "metadata": {"name": name},
        "spec": {"schedule": schedule.to_rfc3339(), "command": "true", "image": "busybox"},
    }))
    .unwrap()
}

/// Creates Ats `{prefix}-0` .. `{prefix}-{n-1}`, all due at `when`, `CONNECTIONS` at once.
pub async fn create_ats(
    ats: &Api<At>,
    n: usize,
    prefix: &str,
    when: chrono::DateTime<chrono::Utc>,
) {
    concurrently(n, |i| {
        let ats = ats.clone();
        async move {
            ats.create(&PostParams::default(), &at(&format!("{prefix}-{i}"), when))
                .await
                .unwrap();
        }
    })
    .await;
}

/// Cores busy: `cpu` seconds of `processes` over `wall` time, with how far off `/proc`'s 10 ms
/// ticks can make it (user and system time each truncated, at both ends); "-" under 0.5 s.
fn cores(cpu: f64, processes: usize, wall: Duration) -> String {
    if wall < Duration::from_millis(500) {
        return "-".into();
    }
    let wall = wall.as_secs_f64();
    format!("{:.2}±{:.2}", cpu / wall, 0.02 * processes as f64 / wall)
}

/// Runs `each(i)` for `0..n`, `CONNECTIONS` at once; returns how long it took.
async fn concurrently<F, Fut>(n: usize, each: F) -> Duration
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    concurrently_over(n, CONNECTIONS, each).await
}

/// Runs `each(i)` for `0..n`, `connections` at once; returns how long it took.
async fn concurrently_over<F, Fut>(n: usize, connections: usize, each: F) -> Duration
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let started = Instant::now();
    futures::stream::iter(0..n)
        .for_each_concurrent(connections, each)
        .await;
    started.elapsed()
}

async fn burst(plane: &'static ControlPlane, admin: &Client, n: usize) {
    // The control plane's CPU (kube-apiserver, etcd, kube-controller-manager), to tell how busy
    // the server is during the floor and the burst: cores used over the wall time.
    let server = crate::rss::processes_under(&plane.dir);
    let server_cpu = || -> f64 {
        server
            .iter()
            .map(|(_, pid)| crate::rss::cpu_seconds(*pid))
            .sum()
    };
    // The Ats of the status-patch floors (floor 2, below), on cnat's CRD and on two copies of
    // it; those on cnat's own own the pods of floor 1's third kind.
    let floor_ns = plane.namespace(&format!("floor-{n}"), &[]).await;
    let copies = [CrdCopy::Shipped, CrdCopy::WithoutCel, CrdCopy::Minimal];
    for copy in copies {
        for round in ["a", "b"] {
            create_copies(admin, &floor_ns, n, copy, round).await;
        }
    }
    // Floor 1: pod creates by this process: bare pods over `CONNECTIONS`; bare pods over as
    // many as the operator's reconciles at once (`--concurrency`, 32): whether the server had
    // room for more at once; and cnat's own pods (`pod::build`, owned by Ats of the floor
    // namespace, which no operator watches) over 32: what its pods cost the server beside bare
    // ones. Each kind twice, in the order A B C C B A, and averaged, as floor 2.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &floor_ns);
    let owners: Vec<At> = Api::<At>::namespaced(admin.clone(), &floor_ns)
        .list(&Default::default())
        .await
        .unwrap()
        .items;
    let policy = cnat::operator::policy::RunPolicy::default();
    let cnat_pods = |round: &str| -> Vec<Pod> {
        let prefix = format!("bare-{round}-");
        let mut built: Vec<Pod> = owners
            .iter()
            .filter(|at| at.name_any().starts_with(&prefix))
            .map(|at| cnat::operator::pod::build(at, &policy))
            .collect();
        built.sort_by_key(|p| p.name_any());
        assert_eq!(
            built.len(),
            n,
            "an At of cnat's CRD for each of cnat's pods"
        );
        built
    };
    let mut spent = [(Duration::ZERO, 0.0); 3];
    for (index, round) in [(0, "a"), (1, "a"), (2, "a"), (2, "b"), (1, "b"), (0, "b")] {
        let connections = [CONNECTIONS, WIDE, WIDE][index];
        let cnat_shaped = if index == 2 {
            cnat_pods(round)
        } else {
            Vec::new()
        };
        let cpu = server_cpu();
        let took = concurrently_over(n, connections, |i| {
            let pods = pods.clone();
            let pod = match cnat_shaped.get(i) {
                Some(built) => built.clone(),
                None => bare_pod(&format!("bare-{connections}-{round}-{i}")),
            };
            async move {
                pods.create(&PostParams::default(), &pod).await.unwrap();
            }
        })
        .await;
        spent[index].0 += took / 2;
        spent[index].1 += server_cpu() - cpu;
    }
    let [(create_floor, floor_cpu), (wide_floor, wide_cpu), (cnat_floor, cnat_cpu)] = spent;
    let floor_cores = cores(floor_cpu, 2 * server.len(), create_floor * 2);
    let wide_cores = cores(wide_cpu, 2 * server.len(), wide_floor * 2);
    let cnat_cores = cores(cnat_cpu, 2 * server.len(), cnat_floor * 2);
    // Floor 2: bare At status patches, on Ats nobody reconciles; and the same on copies of the
    // CRD without the CEL transition rule, and with a schema as small as kazk/cnat-rs's
    // (installed at the start of the run). Each twice, in the order A B C C B A, on Ats of
    // their own, and averaged: a server that slows down or speeds up during the run favours
    // none of them.
    let mut floors = [Duration::ZERO; 3];
    let mut refused = 0;
    for (index, round) in [(0, "a"), (1, "a"), (2, "a"), (2, "b"), (1, "b"), (0, "b")] {
        let (took, refusals) = status_patch_floor(admin, &floor_ns, n, copies[index], round).await;
        floors[index] += took / 2;
        refused += refusals;
    }
    let [patch_floor, no_cel_floor, minimal_floor] = floors;

    // The operator, watching its own namespace.
    let ns = plane.namespace(&format!("burst-{n}"), &[]).await;
    let mut operator = plane.replica(
        &format!("bench-{n}"),
        &ns,
        &[&format!("--namespace={ns}"), "--log=warn"],
    );
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    // The CRD's conversion webhook: this operator (a Service's work, for one replica).
    while !ready(operator.admin).await {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // What the operator holds before any At: its start, one empty list and its servers.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_idle = crate::rss::rss_kib(&operator.child.id().to_string());
    converting_by(admin, &operator).await;
    // Time to create them and let their PENDING writes settle before they fall due.
    let lead = Duration::from_secs(5) + create_floor * 4;
    let due_instant = Instant::now() + lead;
    let due = chrono::Utc::now() + chrono::Duration::from_std(lead).unwrap();
    let pod_seen = tokio::spawn(watch_pods(pods.clone(), n));
    create_ats(&ats, n, "at", due).await;
    assert!(
        wait_phases_until(&ats, n, "Pending", due_instant).await,
        "the Ats' PENDING writes did not settle before due"
    );
    // Scraped before due: building the metrics page is work for the server.
    let requests_at_due = requests_answered(admin).await;
    assert!(
        Instant::now() < due_instant,
        "the Ats fell due before the bench read the server's request counts"
    );
    tokio::time::sleep_until(due_instant.into()).await;
    let operator_cpu = || crate::rss::cpu_seconds(operator.child.id());
    let (cpu_at_due, operator_at_due) = (server_cpu(), operator_cpu());
    let seen = tokio::time::timeout(Duration::from_secs(120), pod_seen)
        .await
        .expect("every pod within two minutes of due")
        .unwrap();
    let burst_cores = cores(
        server_cpu() - cpu_at_due,
        server.len(),
        due_instant.elapsed(),
    );
    let operator_cores = cores(operator_cpu() - operator_at_due, 1, due_instant.elapsed());
    let requests = requests_since(
        requests_at_due.as_ref(),
        requests_answered(admin).await.as_ref(),
    );
    eprintln!(
        "burst of {n}: requests the control plane answered from due to the last pod (every client, watches counted when they end): {requests}"
    );
    let mut after: Vec<Duration> = seen
        .values()
        .map(|t| t.saturating_duration_since(due_instant))
        .collect();
    after.sort();
    let early = seen
        .values()
        .filter(|t| **t + Duration::from_millis(50) < due_instant)
        .count();
    assert_eq!(early, 0, "a pod was created before its At was due");

    // Every At RUNNING, then every pod ends at once.
    wait_phases(&ats, n, "Running").await;
    let done_seen = tokio::spawn(watch_done(ats.clone(), n));
    let released_seen = tokio::spawn(watch_released(pods.clone(), n));
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(admin.clone(), &ns);
    let told = tokio::spawn(watch_succeeded_events(events, n));
    let read_v1 = tokio::spawn(list_until_done(admin.clone(), ns.clone(), "v1", n));
    let read_v1alpha1 = tokio::spawn(list_until_done(admin.clone(), ns.clone(), "v1alpha1", n));
    end_every_pod(&pods, n).await;
    let last_ended = Instant::now();
    let done = tokio::time::timeout(Duration::from_secs(120), done_seen)
        .await
        .expect("every At DONE within two minutes")
        .unwrap();
    let all_done = done.saturating_duration_since(last_ended);
    let mut readers = Vec::new();
    for reader in [read_v1, read_v1alpha1] {
        let seen = tokio::time::timeout(Duration::from_secs(120), reader)
            .await
            .expect("every At done in a list within two minutes")
            .unwrap();
        readers.push(seen.saturating_duration_since(last_ended));
    }
    // Events follow the status writes they describe: when the last `Succeeded` one is out
    // (seen by a watch started before the pods ended, not by lists that would load the server).
    let told = tokio::time::timeout(Duration::from_secs(300), told)
        .await
        .expect("every Succeeded event within five minutes")
        .unwrap();
    let events_after = told.saturating_duration_since(done);
    // cnat lets go of each pod once its outcome is recorded (an older build, only when the
    // pod or its At is deleted: "never" here).
    let released = match tokio::time::timeout(Duration::from_secs(60), released_seen).await {
        Ok(Ok(released)) => format!("{:.2?}", released.saturating_duration_since(done)),
        _ => {
            // Which pods, and what the operator said (its log is gone with the control plane).
            let held = crate::envtest::pods_held(&pods).await;
            let kept = std::env::temp_dir().join(format!("cnat-bench-never-{n}.log"));
            let _ = std::fs::copy(&operator.log, &kept);
            eprintln!(
                "{} pods still hold cnat's finalizer 60 s after the last DONE, e.g. {:?}; the operator's log: {}",
                held.len(),
                held.iter().take(5).collect::<Vec<_>>(),
                kept.display()
            );
            "never".to_owned()
        }
    };
    let rss = crate::rss::rss_kib(&operator.child.id().to_string());
    // What one list takes once the server is quiet again: the readers' floor.
    let mut quiet = Vec::new();
    for version in ["v1", "v1alpha1"] {
        let ats = dynamic_ats(admin.clone(), &ns, version);
        let mut took = Vec::new();
        let calls = || async {
            let counts = requests_answered(admin)
                .await
                .expect("the server's metrics");
            conversions(&counts)
        };
        let calls_before = calls().await;
        for _ in 0..3 {
            let start = Instant::now();
            ats.list(&Default::default()).await.unwrap();
            took.push(start.elapsed());
        }
        took.sort();
        quiet.push(took[1]);
        // Where the server converts each At of a list by a call of its own (v1.24) or serves
        // the list from a watch cache that converted each At once, as it was written (v1.37).
        eprintln!(
            "three quiet lists of {n} Ats as {version}: {:.0} conversions by the webhook (the server's count)",
            calls().await - calls_before
        );
    }
    let created = pods.list(&Default::default()).await.unwrap().items.len();
    assert_eq!(created, n, "one pod per At");
    let q = |p: f64| after[((after.len() - 1) as f64 * p).round() as usize];
    println!(
        "| {n} | {create_floor:.2?} | {wide_floor:.2?} | {cnat_floor:.2?} | {floor_cores} / {wide_cores} / {cnat_cores} / {burst_cores} (cnat {operator_cores}) | {:.0?} / {:.0?} / {:.2?} | {:.2}x | {patch_floor:.2?} ({refused} refused by the CEL error, sent again) | {no_cel_floor:.2?} / {minimal_floor:.2?} | {all_done:.2?} | {:.2}x | {:.2?} / {:.2?} ({:.0?} / {:.0?}) | {events_after:.2?} | {released} | {:.0} MiB (idle {:.0} MiB) |",
        q(0.0),
        q(0.5),
        q(1.0),
        q(1.0).as_secs_f64() / create_floor.as_secs_f64(),
        all_done.as_secs_f64() / patch_floor.as_secs_f64(),
        readers[0],
        readers[1],
        quiet[0],
        quiet[1],
        rss as f64 / 1024.0,
        rss_idle as f64 / 1024.0
    );
    operator.kill();
}

/// The kubelet stand-in: every pod `at-{i}-pod` ends (exit 0), `CONNECTIONS` status writes at
/// once.
pub async fn end_every_pod(pods: &Api<Pod>, n: usize) {
    let names: Vec<String> = (0..n).map(|i| format!("at-{i}-pod")).collect();
    end_pods(pods, &names).await;
}

/// The kubelet stand-in: every pod of `names` ends (exit 0), `CONNECTIONS` status writes at once.
pub async fn end_pods(pods: &Api<Pod>, names: &[String]) {
    concurrently(names.len(), |i| {
        let (pods, name) = (pods.clone(), &names[i]);
        async move {
            let now = jiff::Timestamp::now().to_string();
            let status = json!({"status": {"phase": "Succeeded", "containerStatuses": [{
                "name": "command", "image": "busybox", "imageID": "", "ready": false,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                         "startedAt": now, "finishedAt": now}}}]}});
            pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
                .await
                .unwrap();
        }
    })
    .await;
}

/// How `requests_answered` names the server's count of conversions by a webhook: this, then
/// ` from -> to` (the versions).
pub const CONVERSIONS: &str = "conversions by the webhook (the server's count)";

/// The conversions by a webhook in `requests_answered`'s counts, every version summed.
pub fn conversions(counts: &HashMap<String, f64>) -> f64 {
    (counts.iter())
        .filter(|(what, _)| what.starts_with(CONVERSIONS))
        .fold(0.0, |sum, (_, count)| sum + count) // not `sum()`: none would give -0
}

/// The requests answered between two `requests_answered`, most first, as `verb resource count`
/// joined by commas; "not read" when either scrape failed.
pub fn requests_since(
    before: Option<&HashMap<String, f64>>,
    after: Option<&HashMap<String, f64>>,
) -> String {
    let (Some(before), Some(after)) = (before, after) else {
        return "not read (the server's metrics did not answer)".to_owned();
    };
    let mut requests: Vec<(&String, f64)> = after
        .iter()
        .map(|(what, count)| (what, count - before.get(what).copied().unwrap_or(0.0)))
        .filter(|(_, count)| *count >= 1.0)
        .collect();
    requests.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    let requests: Vec<String> = requests
        .iter()
        .map(|(what, count)| format!("{what} {count:.0}"))
        .collect();
    requests.join(", ")
}

/// kube-apiserver's count of requests answered so far (`apiserver_request_total`), by verb
/// and resource (with subresource), every client and code summed; and, as [`CONVERSIONS`]
/// followed by ` from -> to`, the conversions it had the CRDs' conversion webhooks make, by
/// the versions converted from and to (CRDs and outcomes summed). `None` when the server did
/// not answer.
pub async fn requests_answered(admin: &Client) -> Option<HashMap<String, f64>> {
    let request = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = admin.request_text(request).await.ok()?;
    let mut counts = HashMap::new();
    for line in text.lines() {
        // The calls of the CRDs' conversion webhooks (named so on v1.37,
        // `apiserver_crd_webhook_conversion_duration_seconds` on v1.24).
        let conversions = line
            .strip_prefix("apiserver_crd_conversion_webhook_duration_seconds_count{")
            .or_else(|| {
                line.strip_prefix("apiserver_crd_webhook_conversion_duration_seconds_count{")
            });
        let requests = line.strip_prefix("apiserver_request_total{");
        let Some((labels, value)) = (conversions.or(requests)).and_then(|r| r.rsplit_once("} "))
        else {
            continue;
        };
        let value = value.trim().parse::<f64>().unwrap_or(0.0);
        let label = |name: &str| {
            labels
                .split("\",")
                .find_map(|pair| pair.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        if conversions.is_some() {
            let (from, to) = (label("from_version"), label("to_version"));
            *counts
                .entry(format!("{CONVERSIONS} {from} -> {to}"))
                .or_insert(0.0) += value;
            continue;
        }
        let (verb, resource, sub) = (label("verb"), label("resource"), label("subresource"));
        if resource.is_empty() {
            continue; // a path such as /metrics: the bench's own scrape
        }
        let what = match sub.as_str() {
            "" => format!("{verb} {resource}"),
            _ => format!("{verb} {resource}/{sub}"),
        };
        *counts.entry(what).or_insert(0.0) += value;
    }
    Some(counts)
}

/// Which CRD the status-patch floor writes to.
#[derive(Clone, Copy, PartialEq)]
enum CrdCopy {
    /// cnat's own (`cnat crd`), on the Ats `bare-0..n` already created.
    Shipped,
    /// cnat's schema without its `x-kubernetes-validations` (the CEL transition rule), in
    /// group `nocel.cnat.programming-kubernetes.info`.
    WithoutCel,
    /// A schema like kazk/cnat-rs's: spec schedule and command, status phase, no bounds and no
    /// rule, in group `minimal.cnat.programming-kubernetes.info`.
    Minimal,
}

/// `n` bare status merge patches (DONE, Succeeded, exit code 0) over `CONNECTIONS`, on Ats of
/// the CRD `copy` in `ns` (created first, unless `Shipped`): how long they took, and how many
/// kube-apiserver v1.24 refused with its CEL `internal error ... evaluating rule` (422; sent
/// again, they pass).
/// The namespaced API of Ats of CRD `copy`.
fn copy_api(admin: &Client, ns: &str, copy: CrdCopy) -> Api<kube::api::DynamicObject> {
    use kube::api::ApiResource;
    use kube::core::GroupVersionKind;
    let resource =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(copy.group(), "v1", "At"), "ats");
    Api::namespaced_with(admin.clone(), ns, &resource)
}

/// Creates Ats `bare-{round}-0..n` of CRD `copy` in `ns`, due in a day.
async fn create_copies(admin: &Client, ns: &str, n: usize, copy: CrdCopy, round: &str) {
    let api = copy_api(admin, ns, copy);
    let later = chrono::Utc::now() + chrono::Duration::days(1);
    concurrently(n, |i| {
        let api = api.clone();
        let mut object = serde_json::to_value(at(&format!("bare-{round}-{i}"), later)).unwrap();
        object["apiVersion"] = json!(format!("{}/v1", copy.group()));
        async move {
            let object: kube::api::DynamicObject = serde_json::from_value(object).unwrap();
            api.create(&PostParams::default(), &object).await.unwrap();
        }
    })
    .await;
}

/// `n` bare status merge patches (DONE, Succeeded, exit code 0) over `CONNECTIONS`, on the
/// Ats `bare-{round}-0..n` of CRD `copy` in `ns`: how long they took, and how many
/// kube-apiserver v1.24 refused with its CEL `internal error ... evaluating rule` (422; sent
/// again, they pass).
async fn status_patch_floor(
    admin: &Client,
    ns: &str,
    n: usize,
    copy: CrdCopy,
    round: &str,
) -> (Duration, usize) {
    let api = copy_api(admin, ns, copy);
    let refused = std::sync::atomic::AtomicUsize::new(0);
    let took = concurrently(n, |i| {
        let (api, refused) = (api.clone(), &refused);
        async move {
            let status =
                json!({"status": {"phase": "Done", "outcome": "Succeeded", "exitCode": 0}});
            loop {
                let patched = api
                    .patch_status(
                        &format!("bare-{round}-{i}"),
                        &PatchParams::default(),
                        &Patch::Merge(&status),
                    )
                    .await;
                match patched {
                    Ok(_) => break,
                    Err(kube::Error::Api(s))
                        if s.code == 422 && s.message.contains("internal error") =>
                    {
                        refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    Err(other) => panic!("{other}"),
                }
            }
        }
    })
    .await;
    (took, refused.into_inner())
}

impl CrdCopy {
    fn group(self) -> &'static str {
        match self {
            CrdCopy::Shipped => "cnat.programming-kubernetes.info",
            CrdCopy::WithoutCel => "nocel.cnat.programming-kubernetes.info",
            CrdCopy::Minimal => "minimal.cnat.programming-kubernetes.info",
        }
    }
}

/// The YAML of CRD `copy` in `group`: cnat's schema without its CEL rules, or a minimal one.
fn crd_copy(copy: CrdCopy, group: &str) -> String {
    let yaml = cnat::api::crd_yaml();
    let body = yaml
        .split_once("---\n")
        .map_or(yaml.as_str(), |(_, crd)| crd);
    let mut crd: serde_json::Value = serde_saphyr::from_str(body).expect("cnat's CRD");
    crd["metadata"]["name"] = json!(format!("ats.{group}"));
    crd["spec"]["group"] = json!(group);
    // Only the storage version `v1`, which needs no conversion (and so no webhook).
    if let Some(spec) = crd["spec"].as_object_mut() {
        spec.remove("conversion");
    }
    crd["spec"]["versions"] = json!([crd["spec"]["versions"][0].clone()]);
    let schema = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    match copy {
        CrdCopy::Shipped => {}
        CrdCopy::WithoutCel => strip(schema, "x-kubernetes-validations"),
        CrdCopy::Minimal => {
            *schema = json!({
                "type": "object",
                "properties": {
                    "spec": {"type": "object", "properties": {
                        "schedule": {"type": "string"},
                        "command": {"type": "string"},
                        "image": {"type": "string"},
                    }},
                    "status": {"type": "object", "properties": {
                        "phase": {"type": "string"},
                        "outcome": {"type": "string"},
                        "exitCode": {"type": "integer"},
                    }},
                },
            });
        }
    }
    serde_json::to_string(&crd).unwrap()
}

/// Removes every `key` from `value`, at any depth.
fn strip(value: &mut serde_json::Value, key: &str) {
    match value {
        serde_json::Value::Object(map) => {
            map.remove(key);
            map.values_mut().for_each(|v| strip(v, key));
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(|v| strip(v, key)),
        _ => {}
    }
}

/// When each of `n` pods was first seen (ADDED), here.
pub async fn watch_pods(pods: Api<Pod>, n: usize) -> HashMap<String, Instant> {
    watch_pods_from(pods, n, None).await
}

/// `watch_pods`, saying on `synced` once the watch's first list is in: from then on a new pod is
/// timed as it comes, not as the list.
pub async fn watch_pods_synced(
    pods: Api<Pod>,
    n: usize,
    synced: tokio::sync::oneshot::Sender<()>,
) -> HashMap<String, Instant> {
    watch_pods_from(pods, n, Some(synced)).await
}

/// `watch_pods`, and `watch_pods_synced` when `synced` is given.
async fn watch_pods_from(
    pods: Api<Pod>,
    n: usize,
    mut synced: Option<tokio::sync::oneshot::Sender<()>>,
) -> HashMap<String, Instant> {
    let mut seen = HashMap::new();
    let stream = watcher(pods, watcher::Config::default());
    futures::pin_mut!(stream);
    while seen.len() < n {
        let Some(event) = stream.try_next().await.unwrap() else {
            panic!("the pod watch ended with {} of {n} pods seen", seen.len());
        };
        let Some(pod) = applied_or_synced(event, &mut synced) else {
            continue;
        };
        if let Some(name) = pod.metadata.name {
            seen.entry(name).or_insert_with(Instant::now);
        }
    }
    seen
}

/// The object a watch event brings (applied, or listed), if any; at the end of the first list,
/// says so on `synced` (once).
fn applied_or_synced<K>(
    event: watcher::Event<K>,
    synced: &mut Option<tokio::sync::oneshot::Sender<()>>,
) -> Option<K> {
    match event {
        watcher::Event::Apply(object) | watcher::Event::InitApply(object) => Some(object),
        watcher::Event::InitDone => {
            if let Some(synced) = synced.take() {
                let _ = synced.send(());
            }
            None
        }
        watcher::Event::Init | watcher::Event::Delete(_) => None,
    }
}

/// When a reader listing the Ats of `namespace` as `version` (`v1` or `v1alpha1`), every 50 ms
/// from the end of one list to the start of the next, each read from etcd, first had a list in
/// which all `n` said done.
async fn list_until_done(admin: Client, namespace: String, version: &str, n: usize) -> Instant {
    let ats = dynamic_ats(admin, &namespace, version);
    let done = if version == "v1" { "Done" } else { "DONE" };
    loop {
        if let Ok(list) = ats.list(&Default::default()).await {
            let seen = list
                .items
                .iter()
                .filter(|at| at.data["status"]["phase"] == done);
            if seen.count() >= n {
                return Instant::now();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The Ats of `namespace` as `version` (`v1` or `v1alpha1`), as JSON.
fn dynamic_ats(admin: Client, namespace: &str, version: &str) -> Api<kube::api::DynamicObject> {
    let resource = kube::api::ApiResource {
        group: cnat::api::GROUP.to_owned(),
        version: version.to_owned(),
        api_version: format!("{}/{version}", cnat::api::GROUP),
        kind: "At".to_owned(),
        plural: "ats".to_owned(),
    };
    Api::namespaced_with(admin, namespace, &resource)
}

/// When the last of `n` Ats was seen DONE.
pub async fn watch_done(ats: Api<At>, n: usize) -> Instant {
    let mut done = std::collections::HashSet::new();
    let stream = watcher(ats, watcher::Config::default()).applied_objects();
    futures::pin_mut!(stream);
    while done.len() < n {
        let Some(at) = stream.try_next().await.unwrap() else {
            break;
        };
        if at
            .status
            .as_ref()
            .is_some_and(|s| s.phase == cnat::api::Phase::Done)
        {
            done.insert(at.metadata.name.unwrap_or_default());
        }
    }
    Instant::now()
}

/// When the last of `n` pods was seen without cnat's finalizer.
async fn watch_released(pods: Api<Pod>, n: usize) -> Instant {
    let mut released = std::collections::HashSet::new();
    // A watch that fails (its connection idles out while nothing is released) starts again.
    let stream = watcher(pods, watcher::Config::default())
        .default_backoff()
        .applied_objects();
    futures::pin_mut!(stream);
    while released.len() < n {
        let Some(next) = stream.next().await else {
            break;
        };
        let Ok(pod) = next else {
            continue;
        };
        // Every pod held the finalizer when this watch was started (every At RUNNING), so one
        // seen without it was let go, even when its first sighting is the watch's own list,
        // which a busy server may answer after the first releases. (Counting only pods first
        // seen held, as before, waited forever for those.)
        if !cnat::operator::finalizer::is_present(&pod) {
            released.insert(pod.metadata.name.clone().unwrap_or_default());
        }
    }
    Instant::now()
}

/// When the `n`th `Succeeded` event was seen, here.
async fn watch_succeeded_events(
    events: Api<k8s_openapi::api::events::v1::Event>,
    n: usize,
) -> Instant {
    let mut told = std::collections::HashSet::new();
    let stream = watcher(events, watcher::Config::default()).applied_objects();
    futures::pin_mut!(stream);
    while told.len() < n {
        let Some(event) = stream.try_next().await.unwrap() else {
            break;
        };
        if event.reason.as_deref() == Some("Succeeded") {
            told.insert(event.metadata.name.unwrap_or_default());
        }
    }
    Instant::now()
}

async fn wait_phases(ats: &Api<At>, n: usize, phase: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    assert!(
        wait_phases_until(ats, n, phase, deadline).await,
        "not every one of {n} Ats {phase} within two minutes"
    );
}

/// Whether all `n` Ats of `ats` said `phase` before `deadline`, in a status a leader wrote: a
/// `Pending` one has its `scheduledTime` (every At shows the schema default, `Pending`, from its
/// creation on).
async fn wait_phases_until(ats: &Api<At>, n: usize, phase: &str, deadline: Instant) -> bool {
    loop {
        let list = ats.list(&Default::default()).await.unwrap();
        let count = list
            .items
            .iter()
            .filter(|a| {
                a.status.as_ref().is_some_and(|s| {
                    s.phase.as_str() == phase && (phase != "Pending" || s.scheduled_time.is_some())
                })
            })
            .count();
        if count == n {
            return Instant::now() < deadline;
        }
        if Instant::now() >= deadline {
            eprintln!("{count} of {n} Ats {phase} by the deadline");
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Ats already pending: the 100,000-At scenarios of a rolling upgrade, on the real server.
///
/// 1. A replica (the leader) starts, then `n` Ats are created over 16 connections, due in an
///    hour, through the webhook configurations cnat ships (served by that replica; the
///    mutating webhook labels each At with its list shard); the leader writes each one's
///    PENDING status. Its resident memory: at most while they
///    are created, and once every status is written.
/// 2. A second replica starts cold: how long until its `/readyz` says ready (every At cached),
///    as its log says too, and its memory then.
/// 3. The rolling step: the old leader gets SIGTERM (as a Deployment does once the new pod is
///    ready) and an At falls due 3 s later: how late its pod is (seen here through a pod
///    watch), and the new leader's memory once it has led for 10 s.
/// 4. Five graceful handovers in a row (`handovers`), each with an At due 50 ms after the
///    SIGTERM.
pub async fn pending_all(sizes: &[usize]) {
    let (plane, admin) = start("| Ats pending | created in | leader RSS: max while created / settled | cold replica: every At cached after | its RSS then | rolling step: At due 3 s after the SIGTERM, pod after due | new leader RSS after 10 s |").await;
    for &n in sizes {
        pending(plane, &admin, n).await;
    }
}

async fn pending(plane: &'static ControlPlane, admin: &Client, n: usize) {
    let ns = plane.namespace(&format!("pending-{n}"), &[]).await;
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let flags = [format!("--namespace={ns}"), "--log=info".to_owned()];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut old = plane.replica(&format!("old-{n}"), &ns, &flags);
    wait_ready(&old, Duration::from_secs(60)).await;
    // Created through the webhooks cnat ships, served by the leader, as with the chart: the
    // mutating webhook labels each At with its list shard.
    envtest::register_webhooks(admin, old.webhook, &old.ca(), &ns).await;
    let labelled = |at: &At| at.labels().contains_key(cnat::shard::LABEL);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !labelled(
        &ats.create(
            &PostParams::default(),
            &at("probe", chrono::Utc::now() + chrono::Duration::hours(1)),
        )
        .await
        .unwrap(),
    ) {
        ats.delete("probe", &Default::default()).await.unwrap();
        assert!(Instant::now() < deadline, "the webhooks never applied");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ats.delete("probe", &Default::default()).await.unwrap();

    // 1. Created while the leader watches; it writes every PENDING status.
    let settled = tokio::spawn(watch_statuses(ats.clone(), n));
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    let rss = |r: &envtest::Replica| crate::rss::rss_kib(&r.child.id().to_string());
    let max_rss = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampler = tokio::spawn({
        let (max_rss, pid) = (max_rss.clone(), old.child.id().to_string());
        async move {
            // Until the process is gone.
            while std::path::Path::new(&format!("/proc/{pid}/status")).exists() {
                max_rss.fetch_max(
                    crate::rss::rss_kib(&pid),
                    std::sync::atomic::Ordering::SeqCst,
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    });
    let started = Instant::now();
    let failed = std::sync::atomic::AtomicUsize::new(0);
    futures::stream::iter(0..n)
        .for_each_concurrent(16, |i| {
            let ats = ats.clone();
            let failed = &failed;
            async move {
                let name = format!("at-{i:06}");
                // A create that got no answer may have been stored: AlreadyExists is success.
                for attempt in 1.. {
                    match ats.create(&PostParams::default(), &at(&name, later)).await {
                        Ok(_) => return,
                        Err(kube::Error::Api(s)) if s.code == 409 && attempt > 1 => return,
                        Err(error) => {
                            assert!(attempt < 5, "{name}: {error}");
                            failed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                }
            }
        })
        .await;
    let created = started.elapsed();
    let failed = failed.into_inner();
    tokio::time::timeout(Duration::from_secs(900), settled)
        .await
        .expect("every PENDING status within 15 minutes")
        .unwrap();
    // Quiet for a moment: the events of those writes go out too.
    tokio::time::sleep(Duration::from_secs(10)).await;
    sampler.abort();
    let old_settled = rss(&old);
    let old_max = max_rss
        .load(std::sync::atomic::Ordering::SeqCst)
        .max(old_settled);

    // 2. Cold replicas, one after another: by paged lists (`--watch-list=false`) and by a
    //    streaming list where the server offers one, twice each in turn; the last one stays for
    //    the rolling step.
    let mut busy: Vec<(String, u32)> = crate::rss::processes_under(&plane.dir);
    busy.push(("old leader".into(), old.child.id()));
    let mut colds = Vec::new();
    let mut new = None;
    for (round, streaming) in [false, true, false, true].into_iter().enumerate() {
        if let Some(mut before) = new.take() {
            envtest::Replica::kill(&mut before);
        }
        // The API server settles after the last replica's requests.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let cold = cold_replica(plane, &ns, n, round, streaming, &busy).await;
        colds.push(cold.0);
        new = Some(cold.1);
    }
    let mut new = new.expect("a cold replica");
    let (cached_after, new_ready_rss, logged) =
        colds.last().cloned().expect("a cold replica").summary;

    // 3. The rolling step.
    let pod_seen = tokio::spawn(watch_pods(pods.clone(), 1));
    let due_instant = Instant::now() + Duration::from_secs(3);
    let due = chrono::Utc::now() + chrono::Duration::seconds(3);
    ats.create(&PostParams::default(), &at("rolling-due", due))
        .await
        .unwrap();
    old.terminate();
    let seen = tokio::time::timeout(Duration::from_secs(120), pod_seen)
        .await
        .expect("the At due during the rolling step ran within two minutes")
        .unwrap();
    let late = seen["rolling-due-pod"].saturating_duration_since(due_instant);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let holder = envtest::lease_holder(admin, &ns, "cnat").await;
    assert_eq!(
        holder.as_deref(),
        Some(new.identity.as_str()),
        "the new replica leads"
    );
    let new_rss = rss(&new);
    let created_pods = pods.list(&Default::default()).await.unwrap().items.len();
    assert_eq!(created_pods, 1, "only the due At ran");
    let handovers = handovers(plane, admin, &ns, n, &flags, &mut new).await;
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "| {n} | {created:.0?} ({failed} sent again) | {:.0} / {:.0} MiB | {cached_after:.1?} (its log: {logged}) | {:.0} MiB | {late:.0?} | {:.0} MiB |",
        mib(old_max),
        mib(old_settled),
        mib(new_ready_rss),
        mib(new_rss)
    );
    new.kill();
    old.kill();
    println!();
    println!("| Ats | cold replica lists by | every At cached after (its log) | its RSS then | CPU meanwhile |");
    println!("|---|---|---|---|---|");
    for cold in colds {
        println!("| {n} | {}", cold.row);
    }
    println!();
    println!("| Ats | graceful handover: SIGTERM to the successor's Lease | At due 50 ms after the SIGTERM: pod after due |");
    println!("|---|---|---|");
    for (round, (handed, late)) in handovers.iter().enumerate() {
        println!("| {n} | round {}: {handed:.0?} | {late:.0?} |", round + 1);
    }
    let worst = |pick: fn(&(Duration, Duration)) -> Duration| {
        handovers.iter().map(pick).max().unwrap_or_default()
    };
    println!(
        "| {n} | worst of {}: {:.0?} | {:.0?} |",
        handovers.len(),
        worst(|h| h.0),
        worst(|h| h.1)
    );
    println!();
}

/// Graceful handovers in a row.
const HANDOVERS: usize = 5;

/// `HANDOVERS` graceful handovers, as a rolling upgrade makes them, from `leader` (which leads
/// the Ats of `ns`, `n` of them): each round a successor starts and has every At cached (its
/// `/readyz`), the webhooks are pointed at it, an At is created due 1 s ahead and the leader
/// gets SIGTERM 50 ms before it is due. For each: from the SIGTERM to the Lease naming the successor (a Lease watch
/// here), and how late the At's pod came (a pod watch here). `leader` is the last successor
/// after.
async fn handovers(
    plane: &'static ControlPlane,
    admin: &Client,
    ns: &str,
    n: usize,
    flags: &[&str],
    leader: &mut envtest::Replica,
) -> Vec<(Duration, Duration)> {
    let ats: Api<At> = Api::namespaced(admin.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(admin.clone(), ns);
    let mut rounds = Vec::new();
    for round in 0..HANDOVERS {
        let successor = plane.replica(&format!("next-{n}-{round}"), ns, flags);
        wait_ready(&successor, Duration::from_secs(600)).await;
        envtest::register_webhooks(admin, successor.webhook, &successor.ca(), ns).await;
        // The server settles after the successor's list, and takes the new webhooks.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let existing = pods.list(&Default::default()).await.unwrap().items.len();
        let (pods_synced, pods_ready) = tokio::sync::oneshot::channel();
        let pod_seen = tokio::spawn(watch_pods_from(
            pods.clone(),
            existing + 1,
            Some(pods_synced),
        ));
        let identity = successor.identity.clone();
        let (lease_synced, lease_ready) = tokio::sync::oneshot::channel();
        let led = tokio::spawn(watch_holder(leases.clone(), identity, lease_synced));
        pods_ready.await.expect("the pod watch lists");
        lease_ready.await.expect("the Lease watch lists");
        // Due 1 s ahead (both clocks read together); the SIGTERM goes 50 ms before.
        let name = format!("handover-{round}");
        let (due, due_instant) = (
            chrono::Utc::now() + chrono::Duration::seconds(1),
            Instant::now() + Duration::from_secs(1),
        );
        ats.create(&PostParams::default(), &at(&name, due))
            .await
            .unwrap();
        let signal_at = due_instant - Duration::from_millis(50);
        assert!(
            Instant::now() < signal_at,
            "creating the At took longer than the lead"
        );
        tokio::time::sleep_until(signal_at.into()).await;
        let signalled = Instant::now();
        leader.terminate();
        let led = tokio::time::timeout(Duration::from_secs(120), led)
            .await
            .expect("the successor leads within two minutes")
            .unwrap();
        let seen = tokio::time::timeout(Duration::from_secs(120), pod_seen)
            .await
            .expect("the At due at the handover ran within two minutes")
            .unwrap();
        let pod = seen[&format!("{name}-pod")];
        assert!(
            pod + Duration::from_millis(50) >= due_instant,
            "the At's pod came before the At was due"
        );
        rounds.push((
            led.saturating_duration_since(signalled),
            pod.saturating_duration_since(due_instant),
        ));
        let mut stopped = std::mem::replace(leader, successor);
        let exited = tokio::time::timeout(Duration::from_secs(60), async {
            while stopped.child.try_wait().ok().flatten().is_none() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        assert!(exited.is_ok(), "a stopped leader exits within a minute");
        envtest::Replica::kill(&mut stopped);
    }
    let created = pods.list(&Default::default()).await.unwrap().items.len();
    assert_eq!(created, 1 + HANDOVERS, "one pod for each due At, no other");
    rounds
}

/// When the Lease `cnat` of the Leases `leases` first names `identity`, here; says on `synced`
/// once the watch's first list is in.
async fn watch_holder(
    leases: Api<k8s_openapi::api::coordination::v1::Lease>,
    identity: String,
    synced: tokio::sync::oneshot::Sender<()>,
) -> Instant {
    let config = watcher::Config::default().fields("metadata.name=cnat");
    let stream = watcher(leases, config);
    futures::pin_mut!(stream);
    let mut synced = Some(synced);
    while let Some(event) = stream.try_next().await.unwrap() {
        let Some(lease) = applied_or_synced(event, &mut synced) else {
            continue;
        };
        let holder = lease.spec.and_then(|s| s.holder_identity);
        if holder.as_deref() == Some(identity.as_str()) {
            return Instant::now();
        }
    }
    panic!("the Lease watch ended before {identity} held the Lease")
}

/// One cold replica's figures: its table row (after the count) and, for the main table, when it
/// had every At cached, its RSS then (KiB), and what its log said.
#[derive(Clone)]
struct Cold {
    row: String,
    summary: (Duration, u64, String),
}

/// Starts a cold replica listing by a streaming list (where the server offers one) or by paged
/// lists, and times it until ready (every At cached), with the CPU `busy` spent meanwhile.
async fn cold_replica(
    plane: &'static ControlPlane,
    ns: &str,
    n: usize,
    round: usize,
    streaming: bool,
    busy: &[(String, u32)],
) -> (Cold, envtest::Replica) {
    let flags = [
        format!("--namespace={ns}"),
        "--log=info".to_owned(),
        format!("--watch-list={streaming}"),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let before: Vec<f64> = busy
        .iter()
        .map(|(_, pid)| crate::rss::cpu_seconds(*pid))
        .collect();
    let spawned = Instant::now();
    let new = plane.replica(&format!("new-{n}-{round}"), ns, &flags);
    wait_ready(&new, Duration::from_secs(600)).await;
    let cached_after = spawned.elapsed();
    let spent: Vec<String> = busy
        .iter()
        .zip(&before)
        .map(|((name, pid), before)| {
            format!("{name} {:.1} s", crate::rss::cpu_seconds(*pid) - before)
        })
        .chain([format!(
            "the replica {:.1} s",
            crate::rss::cpu_seconds(new.child.id())
        )])
        .collect();
    let rss = crate::rss::rss_kib(&new.child.id().to_string());
    let line = new
        .log_text()
        .lines()
        .find(|l| l.contains("the At cache holds every At"))
        .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .unwrap_or_default();
    let logged = line["took"].as_str().unwrap_or("not logged").to_owned();
    let by = match line["streamed"].as_bool() {
        Some(true) => "a streaming list",
        Some(false) if streaming => "paged lists (the server refused a streaming list)",
        Some(false) => "paged lists (`--watch-list=false`)",
        None => "not logged",
    };
    let row = format!(
        "{by} | {cached_after:.1?} ({logged}) | {:.0} MiB | {} |",
        rss as f64 / 1024.0,
        spent.join(", ")
    );
    let summary = (cached_after, rss, logged);
    (Cold { row, summary }, new)
}

/// Points the CRD's conversion webhook at `operator` (a Service's work, for one replica).
pub async fn converting_by(admin: &Client, operator: &envtest::Replica) {
    let crd = crd_converting_by(operator);
    envtest::install_crd(admin, &cnat::api::crd_to_yaml(&crd)).await;
}

/// The At CRD whose conversion webhook is `operator`'s `/convert`.
pub fn crd_converting_by(
    operator: &envtest::Replica,
) -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    cnat::api::crd_with(
        k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::WebhookClientConfig {
            url: Some(format!(
                "https://127.0.0.1:{}/convert",
                operator.webhook.port()
            )),
            ca_bundle: Some(k8s_openapi::ByteString(
                std::fs::read(operator.ca()).unwrap(),
            )),
            service: None,
        },
    )
}

/// Until the replica's `/readyz` answers 200.
pub async fn wait_ready(replica: &envtest::Replica, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        if ready(replica.admin).await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} not ready within {timeout:?}: {}",
            replica.identity,
            replica
                .log_text()
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Until `n` Ats have a status a leader wrote (its `scheduledTime`, which the `Pending` status
/// sets and later ones keep): not merely a status, which every At shows from its creation on
/// (the CRD's schema default, `Pending`).
pub async fn watch_statuses(ats: Api<At>, n: usize) {
    let mut with_status = std::collections::HashSet::new();
    // From the API server's watch cache (any version): a list of 300,000 in pages from etcd
    // outlives its continue token (410 Expired) while the replicas write. Still, a watch that
    // falls behind is ended by the server and its relist may be paged from etcd: an error
    // only restarts the watcher (after a backoff), which lists again.
    let config = watcher::Config::default().any_semantic();
    let stream = watcher(ats, config).default_backoff().applied_objects();
    futures::pin_mut!(stream);
    while with_status.len() < n {
        match stream.next().await {
            None => break,
            Some(Ok(at)) => {
                if at.status.is_some_and(|s| s.scheduled_time.is_some()) {
                    with_status.insert(at.metadata.name.unwrap_or_default());
                }
            }
            Some(Err(error)) => eprintln!("the At watch failed, listing again: {error}"),
        }
    }
}

/// The samples of the metric lines starting with `prefix`, summed, from the admin server.
pub fn metric_sum(admin: std::net::SocketAddr, prefix: &str) -> u64 {
    sum_of(&metrics_text(admin), prefix)
}

/// The admin server's `/metrics` (classic text format): the body of a 200 read whole (up to
/// the server's close, and as long as its `Content-Length` says if it gives one); empty when
/// the server does not answer within five seconds, answers otherwise or the read is cut off.
pub fn metrics_text(admin: std::net::SocketAddr) -> String {
    use std::io::{Read, Write};
    let timeout = Duration::from_secs(5);
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&admin, timeout) else {
        return String::new();
    };
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: cnat\r\n\r\n");
    let mut response = String::new();
    if stream.read_to_string(&mut response).is_err() {
        return String::new();
    }
    whole_body(&response).unwrap_or_default().to_owned()
}

/// The body of `response` (an HTTP/1.0 answer read up to the server's close) when it is a 200
/// whose body is as long as its `Content-Length` says (any length when it gives none).
fn whole_body(response: &str) -> Option<&str> {
    let (head, body) = response.split_once("\r\n\r\n")?;
    let ok = head
        .lines()
        .next()
        .is_some_and(|status| status.split(' ').nth(1) == Some("200"));
    let length = head.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("content-length")
            .then(|| value.trim().parse::<usize>().ok())?
    });
    (ok && length.is_none_or(|length| length == body.len())).then_some(body)
}

/// The samples of the lines of `metrics` starting with `prefix`, summed.
pub fn sum_of(metrics: &str, prefix: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}
