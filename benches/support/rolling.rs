//! `cargo bench --bench due -- --real --rolling [N]` (default 50,000): a rolling replacement of
//! three replicas on the real control plane, as a Deployment with `maxSurge: 1` and
//! `maxUnavailable: 0` does it, while Ats keep coming.
//!
//! Three replicas (`cnat run` release binaries sharing one webhook certificate, as the pods of a
//! Deployment share one Secret) serve the webhooks behind a stand-in for their Service: a TCP
//! proxy that sends each new connection to a ready replica (by `/readyz`, polled every 500 ms,
//! as a readiness probe and the endpoints controller would). N Ats are created (due in an hour)
//! and their PENDING statuses written. Then 5 Ats per second are created through the webhooks
//! (without an image: the stored At has one only if the mutating webhook ran), each due 2 s
//! after its create, from 5 s before the first replacement to 5 s after the last; meanwhile each
//! old replica in turn is replaced: a new one starts, and once it is ready the old one gets
//! SIGTERM (it leaves the Service at the next poll after its readiness fails, and keeps serving
//! for its shutdown delay; connections already open stay with it until it closes them). The
//! bench reports failed creates, what a pod watch saw for each At (exactly one pod, never
//! deleted; pods of no load At), how early or late each pod came (signed), the Lease holders
//! over time and the lateness of the Ats due within 2 s after each handover, and the Service's
//! forwarded and dropped connections.

use crate::envtest::{self, ControlPlane, Replica};
use crate::service::Service;
use cnat::api::At;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Ats created per second during the replacement.
const RATE: u64 = 5;
/// How long after its create each of those Ats is due.
const DUE_AFTER: Duration = Duration::from_secs(2);

pub async fn run(n: usize) {
    let (plane, admin) = crate::real::start("| Ats pending | replicas replaced in | Ats created by the load (5/s, due 2 s later) | failed creates | pods | pod after due (earliest / p50 / worst) | Lease handovers | new replicas: ready after start (each) | new replicas' RSS |").await;
    rolling(plane, &admin, n).await;
}

/// The Lease's holder (or none), from when.
type Holders = Vec<(Instant, Option<String>)>;

/// What the pod watch saw of one pod name.
#[derive(Clone)]
struct Seen {
    first: Instant,
    uids: std::collections::HashSet<String>,
    deleted: bool,
}

/// The Ats of `ns`, untyped: the load sends them without an image.
fn dynamic_ats(admin: &Client, ns: &str) -> Api<kube::api::DynamicObject> {
    use kube::api::ApiResource;
    let resource = ApiResource::erase::<At>(&());
    Api::namespaced_with(admin.clone(), ns, &resource)
}

/// An At due at `due` without a shard label (the mutating webhook adds one).
fn steady_at(name: &str, due: chrono::DateTime<chrono::Utc>) -> kube::api::DynamicObject {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
        "metadata": {"name": name},
        "spec": {"schedule": due.to_rfc3339(), "command": "true"},
    }))
    .unwrap()
}

async fn rolling(plane: &'static ControlPlane, admin: &Client, n: usize) {
    let ns = plane.namespace(&format!("rolling-{n}"), &[]).await;
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let certs = plane.dir.join(format!("certs-rolling-{n}"));
    let flags = [
        format!("--namespace={ns}"),
        "--log=warn".to_owned(),
        // Longer than the Service takes to drop an endpoint that is no longer ready.
        "--shutdown-delay=2s".to_owned(),
        "--shutdown-timeout=10s".to_owned(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let service = Service::default();
    let mut old: Vec<Replica> = (0..3)
        .map(|i| plane.replica_sharing(&format!("old-{i}"), &ns, &flags, &certs))
        .collect();
    for replica in &old {
        service.add(replica);
    }
    let addr = service.start().await;
    for replica in &old {
        service.wait_ready(replica).await;
    }
    envtest::register_webhooks(admin, addr, &certs.join("ca.crt"), &ns).await;

    // 1. N pending Ats, their PENDING statuses written.
    let settled = tokio::spawn(crate::real::watch_statuses(ats.clone(), n));
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    futures::stream::iter(0..n)
        .for_each_concurrent(16, |i| {
            let ats = ats.clone();
            async move {
                let name = format!("pending-{i:06}");
                for attempt in 1.. {
                    match ats
                        .create(&PostParams::default(), &crate::real::at(&name, later))
                        .await
                    {
                        Ok(_) => return,
                        Err(kube::Error::Api(s)) if s.code == 409 && attempt > 1 => return,
                        Err(error) => assert!(attempt < 5, "{name}: {error}"),
                    }
                }
            }
        })
        .await;
    tokio::time::timeout(Duration::from_secs(900), settled)
        .await
        .expect("every PENDING status within 15 minutes")
        .unwrap();

    // 2. Ats keep coming, 5 a second, each due 2 s later; every pod's arrival is watched.
    let seen: Arc<Mutex<HashMap<String, Seen>>> = Arc::default();
    let watching = tokio::spawn({
        let (pods, seen) = (pods.clone(), seen.clone());
        async move {
            let stream = watcher(pods, watcher::Config::default())
                .default_backoff()
                .touched_objects();
            futures::pin_mut!(stream);
            while let Some(pod) = stream.next().await {
                // A watch error is retried with backoff; nothing is missed, as it resumes.
                let Ok(pod) = pod else { continue };
                let name = pod.metadata.name.clone().unwrap_or_default();
                let mut seen = seen.lock().unwrap();
                let entry = seen.entry(name).or_insert_with(|| Seen {
                    first: Instant::now(),
                    uids: Default::default(),
                    deleted: false,
                });
                entry.uids.extend(pod.metadata.uid.clone());
                entry.deleted |= pod.metadata.deletion_timestamp.is_some();
            }
        }
    });
    // Who holds the Lease, and since when.
    let holders: Arc<Mutex<Holders>> = Arc::default();
    let following = tokio::spawn({
        let (admin, ns, holders) = (admin.clone(), ns.clone(), holders.clone());
        async move {
            loop {
                let holder = envtest::lease_holder(&admin, &ns, "cnat").await;
                {
                    let mut holders = holders.lock().unwrap();
                    if holders.last().map(|(_, h)| h) != Some(&holder) {
                        holders.push((Instant::now(), holder));
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    let stop = tokio_util::sync::CancellationToken::new();
    let load = tokio::spawn({
        let (ats, stop) = (dynamic_ats(admin, &ns), stop.clone());
        async move {
            let mut sent = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(1000 / RATE));
            for i in 0.. {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                let name = format!("steady-{i:05}");
                let due_instant = Instant::now() + DUE_AFTER;
                let due = chrono::Utc::now() + chrono::Duration::from_std(DUE_AFTER).unwrap();
                // Sent on its own: a slow answer does not hold back the next create. Without
                // a shard label: the stored At has one only if the mutating webhook added it.
                let (ats, at) = (ats.clone(), steady_at(&name, due));
                let answer = tokio::spawn(async move {
                    let stored = ats.create(&PostParams::default(), &at).await?;
                    Ok::<bool, kube::Error>(
                        stored
                            .metadata
                            .labels
                            .as_ref()
                            .is_some_and(|labels| labels.contains_key(cnat::shard::LABEL)),
                    )
                });
                sent.push((name, due_instant, answer));
            }
            let mut created = Vec::new();
            let mut failed = Vec::new();
            let mut defaulted = 0;
            for (name, due, answer) in sent {
                match answer.await {
                    Ok(Ok(by_webhook)) => {
                        defaulted += usize::from(by_webhook);
                        created.push((name, due));
                    }
                    Ok(Err(error)) => failed.push(format!("{name}: {error}")),
                    Err(error) => failed.push(format!("{name}: {error}")),
                }
            }
            (created, failed, defaulted)
        }
    });
    tokio::time::sleep(Duration::from_secs(5)).await;

    // 3. The rolling replacement: one new replica at a time, the old one stopped once it is ready.
    let replacing = Instant::now();
    let mut new: Vec<Replica> = Vec::new();
    let mut ready_after = Vec::new();
    for (i, retiring) in old.iter_mut().enumerate() {
        let spawned = Instant::now();
        let replica = plane.replica_sharing(&format!("new-{i}"), &ns, &flags, &certs);
        service.add(&replica);
        service.wait_ready(&replica).await;
        ready_after.push(spawned.elapsed());
        new.push(replica);
        retiring.terminate();
        let exited = Instant::now();
        while retiring.child.try_wait().ok().flatten().is_none() {
            assert!(
                exited.elapsed() < Duration::from_secs(30),
                "{} never exited",
                retiring.identity
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        service.remove(retiring);
    }
    let replaced = replacing.elapsed();
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.cancel();
    let (created, failed, defaulted) = load.await.unwrap();

    // 4. Every one of them ran, once, and how late.
    let deadline = Instant::now() + Duration::from_secs(60);
    let all_seen = || {
        let seen = seen.lock().unwrap();
        created
            .iter()
            .all(|(name, _)| seen.contains_key(&format!("{name}-pod")))
    };
    while !all_seen() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    watching.abort();
    following.abort();
    let seen = seen.lock().unwrap().clone();
    let holders = holders.lock().unwrap().clone();
    // Signed: a pod before its due instant would show as negative.
    let mut offsets: Vec<(f64, &str)> = Vec::new();
    let (mut missing, mut not_one) = (Vec::new(), Vec::new());
    for (name, due) in &created {
        match seen.get(&format!("{name}-pod")) {
            Some(pod) => {
                let offset = if pod.first >= *due {
                    pod.first.duration_since(*due).as_secs_f64()
                } else {
                    -due.duration_since(pod.first).as_secs_f64()
                };
                offsets.push((offset * 1e3, name));
                if pod.uids.len() != 1 || pod.deleted {
                    not_one.push(name.clone());
                }
            }
            None => missing.push(name.clone()),
        }
    }
    offsets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let strays = seen
        .keys()
        .filter(|pod| {
            !created
                .iter()
                .any(|(name, _)| **pod == format!("{name}-pod"))
        })
        .count();
    // The Lease's holders over the run, and the Ats due within 2 s after each handover.
    let handovers: Vec<Instant> = holders.iter().skip(1).map(|(at, _)| *at).collect();
    let near: Vec<f64> = created
        .iter()
        .zip(0..)
        .filter(|((_, due), _)| {
            handovers
                .iter()
                .any(|h| *due >= *h && due.duration_since(*h) < Duration::from_secs(2))
        })
        .filter_map(|((name, _), _)| offsets.iter().find(|(_, n)| *n == name).map(|(o, _)| *o))
        .collect();
    let rss: Vec<String> = new
        .iter()
        .map(|r| {
            format!(
                "{:.0}",
                crate::rss::rss_kib(&r.child.id().to_string()) as f64 / 1024.0
            )
        })
        .collect();
    let ready_after: Vec<String> = ready_after.iter().map(|d| format!("{d:.1?}")).collect();
    let quantile = |p: f64| {
        offsets
            .get(((offsets.len().max(1) - 1) as f64 * p).round() as usize)
            .map_or_else(|| "none".to_owned(), |(ms, _)| format!("{ms:.0} ms"))
    };
    println!(
        "| {n} | {replaced:.1?} | {} ({} defaulted by the webhook) | {} | {} without a pod, {} with other than one, {strays} pods of no such At | {} / {} / {} | {} handovers; due within 2 s after one: {} Ats, worst {} | {} | {} MiB |",
        created.len() + failed.len(),
        defaulted,
        failed.len(),
        missing.len(),
        not_one.len(),
        quantile(0.0),
        quantile(0.5),
        quantile(1.0),
        handovers.len(),
        near.len(),
        near.iter().copied().fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))))
            .map_or_else(|| "none".to_owned(), |ms| format!("{ms:.0} ms")),
        ready_after.join(", "),
        rss.join(", "),
    );
    let holders: Vec<String> = holders
        .iter()
        .map(|(at, h)| {
            format!(
                "{:.1?} {}",
                at.duration_since(replacing.min(*at)),
                h.as_deref().unwrap_or("-")
            )
        })
        .collect();
    println!(
        "  Lease holders (time since the replacement began): {}",
        holders.join(", ")
    );
    println!(
        "  Service: connections forwarded per replica {:?}, dropped {}",
        service
            .forwarded
            .lock()
            .unwrap()
            .values()
            .collect::<Vec<_>>(),
        service.dropped.load(std::sync::atomic::Ordering::SeqCst)
    );
    for failure in failed.iter().take(5) {
        println!("  failed: {failure}");
    }
    for name in missing.iter().chain(&not_one).take(5) {
        println!("  not exactly one pod: {name}");
    }
    for replica in old.iter_mut().chain(new.iter_mut()) {
        replica.kill();
    }
}
