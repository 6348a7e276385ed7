//! `cargo bench --bench due -- --real --shards=S [SIZES]`: Lease shards (`cnat run --shards S`)
//! on a real kube-apiserver (`KUBEBUILDER_ASSETS`), the `cnat run` release binary as its own
//! processes. For each size `n`, in one run:
//!
//! - `n` Ats created over 16 connections, due in two hours, each labelled with its shard as the
//!   mutating webhook labels it (no webhooks run: the replicas here serve none);
//! - three replicas with `--shards=S` start: how long until every At has its `Pending` status
//!   (each shard's leader lists its Ats and writes them; counted from the replicas' metrics,
//!   `pending_written`), and each replica's RSS 10 s later (the share of shards it leads);
//! - beside them, one replica with one Lease (`--shards 1`, another Lease name) starts cold:
//!   how long until it caches every At, and its RSS 10 s later: the floor a replica holds
//!   without shards (up to `SINGLE_UP_TO` Ats);
//! - a replica stopped (SIGTERM, as by a rolling update) 100 ms before 200 Ats fall due, one
//!   every 75 ms (over the handovers of its shards, whenever they come): how late each pod is,
//!   for the Ats of the shards it led and for the others;
//! - with three replicas again, 10,000 Ats due at once: the last pod after due, as a ratio to
//!   10,000 bare pod creates over 16 connections (the floor, measured in the same run), and
//!   to the same creates seen by a pod watch like the one the bench times the wave with (the
//!   watched floor, printed beside).
//!
//! `cargo bench --bench due -- --real --shards=S --write-memory [SIZES]`: instead, what one
//! replica holds once it has written `n` Ats' statuses, leading all `S` shards and with one
//! Lease, beside a replica that only lists them (`write_memory`). `CNAT_BENCH_BINARY` runs
//! another binary as the replicas (e.g. one under heaptrack, docs/src/development.md).

use crate::envtest::{self, ControlPlane, Replica};
use crate::real;
use cnat::api::At;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::{Api, Client};
use std::time::{Duration, Instant};

/// The most Ats the cold one-Lease replica beside the shards is started for (`scenario`).
const SINGLE_UP_TO: usize = 100_000;
/// Connections creating the Ats and the floor's pods.
const CONNECTIONS: usize = 16;
/// Ats due at once in the burst.
const BURST: usize = 10_000;
/// Ats falling due, one every `SPACING`, from just after a replica is stopped: across its
/// shards' handovers, whenever they come.
const TAKEN_OVER: usize = 200;
const SPACING: Duration = Duration::from_millis(75);
/// The longest the bench waits, from due, for the burst's pods.
const WAVE_TIMEOUT: Duration = Duration::from_secs(300);

pub async fn run(shards: usize, sizes: &[usize]) {
    if std::env::args().any(|a| a == "--write-memory") {
        let header = format!("| Ats | one replica with --shards {shards} (leading every shard): RSS once every PENDING status is written, 10 s later | one replica, one Lease: the same | one replica, one Lease, cold (every status written already): RSS 10 s after it cached every At |");
        let (plane, admin) = real::start(&header).await;
        for &n in sizes {
            write_memory(plane, &admin, shards, n).await;
        }
        return;
    }
    let header = format!("| Ats pending | created in | 3 replicas, --shards {shards}: every PENDING status after | their RSS 10 s later | one replica, one Lease: every At cached after / RSS 10 s later | a replica stopped 100 ms before {TAKEN_OVER} Ats fall due, one every {SPACING:?}: pod after due, its shards' (max) / the others' (max) | {BURST} Ats due at once: bare pod creates (floor) / last pod after due / ratio |");
    let (plane, admin) = real::start(&header).await;
    for &n in sizes {
        scenario(plane, &admin, shards, n).await;
    }
}

/// An At running `true` at `due`, labelled with its shard as the webhook labels it.
fn labelled(ns: &str, name: &str, due: chrono::DateTime<chrono::Utc>) -> At {
    let mut at = real::at(name, due);
    let value = cnat::shard::assign(&format!("{ns}/{name}"));
    at.metadata.labels = Some([(cnat::shard::LABEL.to_owned(), value)].into());
    at
}

/// Creates `BURST` bare pods in `pods`' namespace, `CONNECTIONS` at once: how long until the
/// last create was answered (the bare-create floor).
async fn bare_creates(pods: Api<Pod>) -> Duration {
    let started = Instant::now();
    futures::stream::iter(0..BURST)
        .for_each_concurrent(CONNECTIONS, |i| {
            let pods = pods.clone();
            async move {
                pods.create(
                    &PostParams::default(),
                    &real::bare_pod(&format!("bare-{i}")),
                )
                .await
                .unwrap();
            }
        })
        .await;
    started.elapsed()
}

/// Creates Ats `{prefix}-0` ..., all due at `due`, `CONNECTIONS` at once; how long it took.
async fn create(
    ats: &Api<At>,
    ns: &str,
    prefix: &str,
    n: usize,
    due: chrono::DateTime<chrono::Utc>,
    spacing: Duration,
) -> Duration {
    let spacing = chrono::Duration::from_std(spacing).unwrap_or_default();
    let started = Instant::now();
    futures::stream::iter(0..n)
        .for_each_concurrent(CONNECTIONS, |i| {
            let ats = ats.clone();
            async move {
                let name = format!("{prefix}-{i:07}");
                // A create that got no answer may have been stored: AlreadyExists is success.
                for attempt in 1.. {
                    match ats
                        .create(
                            &PostParams::default(),
                            &labelled(ns, &name, due + spacing * i32::try_from(i).unwrap()),
                        )
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
    started.elapsed()
}

fn rss_mib(replica: &Replica) -> f64 {
    crate::rss::rss_kib(&replica.child.id().to_string()) as f64 / 1024.0
}

/// Who holds each shard's Lease (`cnat-0` ...).
async fn holders(admin: &Client, ns: &str, shards: usize) -> Vec<Option<String>> {
    let mut holders = Vec::new();
    for shard in 0..shards {
        let name = cnat::leader::members::shard_lease_name("cnat", shard, shards);
        holders.push(envtest::lease_holder(admin, ns, &name).await);
    }
    holders
}

/// Until every shard is led and no replica leads more than its share.
async fn balanced(admin: &Client, ns: &str, shards: usize, replicas: &[&Replica]) {
    let share = shards.div_ceil(replicas.len());
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let holders = holders(admin, ns, shards).await;
        let led = holders.iter().all(Option::is_some);
        let even = replicas.iter().all(|r| {
            holders
                .iter()
                .filter(|h| h.as_deref() == Some(r.identity.as_str()))
                .count()
                <= share
        });
        if led && even {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "shards never balanced: {holders:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// CPU seconds used so far by the control plane (kube-apiserver, etcd,
/// kube-controller-manager, each apart), by the replicas and by this process (the bench's
/// creates and watches): where a burst's CPU goes on a machine whose two cores it keeps busy.
#[derive(Clone, Copy)]
struct CpuSplit {
    apiserver: f64,
    etcd: f64,
    controller_manager: f64,
    replicas: f64,
    bench: f64,
}

impl CpuSplit {
    fn since(self, before: CpuSplit) -> CpuSplit {
        CpuSplit {
            apiserver: self.apiserver - before.apiserver,
            etcd: self.etcd - before.etcd,
            controller_manager: self.controller_manager - before.controller_manager,
            replicas: self.replicas - before.replicas,
            bench: self.bench - before.bench,
        }
    }
}

impl std::fmt::Display for CpuSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "control plane {:.1} (kube-apiserver {:.1}, etcd {:.1}, kube-controller-manager {:.1}), replicas {:.1}, the bench {:.1}",
            self.apiserver + self.etcd + self.controller_manager,
            self.apiserver,
            self.etcd,
            self.controller_manager,
            self.replicas,
            self.bench
        )
    }
}

fn cpu_split(plane: &ControlPlane, replicas: &[Replica]) -> CpuSplit {
    use crate::rss::{cpu_seconds, processes_under};
    let processes = processes_under(&plane.dir);
    let of = |program: &str| -> f64 {
        processes
            .iter()
            .filter(|(name, _)| name == program)
            .map(|(_, pid)| cpu_seconds(*pid))
            .sum()
    };
    CpuSplit {
        apiserver: of("kube-apiserver"),
        etcd: of("etcd"),
        controller_manager: of("kube-controller-manager"),
        replicas: replicas.iter().map(|r| cpu_seconds(r.child.id())).sum(),
        bench: cpu_seconds(std::process::id()),
    }
}

/// The Lease shard of the At whose pod is `pod` (`{at}-pod`), from the label the webhook gives
/// the At (`labelled`).
fn shard_of_pod(split: &cnat::shard::Shards, ns: &str, pod: &str) -> usize {
    let name = pod.trim_end_matches("-pod");
    let value = cnat::shard::assign(&format!("{ns}/{name}"));
    split.of(Some(&[(cnat::shard::LABEL.to_owned(), value)].into()))
}

/// The replicas' `--log`: `warn`, or `CNAT_BENCH_LOG` (`info` to see why a run was slow;
/// `CNAT_BENCH_LOGS` keeps the logs, `keep_logs`).
fn log_flag() -> String {
    let level = std::env::var("CNAT_BENCH_LOG")
        .ok()
        .filter(|level| !level.is_empty())
        .unwrap_or_else(|| "warn".to_owned());
    format!("--log={level}")
}

/// With `CNAT_BENCH_LOGS=DIR`, copies each sharded replica's log there as `{n}-{identity}.log`,
/// over any copy of an earlier run (the control plane's folder, and the logs in it, go when the
/// bench ends).
fn keep_logs(n: usize, replicas: &[&Replica]) {
    let Some(dir) = std::env::var("CNAT_BENCH_LOGS")
        .ok()
        .filter(|dir| !dir.is_empty())
    else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir).expect("the folder CNAT_BENCH_LOGS names");
    for replica in replicas {
        let to = dir.join(format!("{n}-{}.log", replica.identity));
        if let Err(error) = std::fs::copy(&replica.log, &to) {
            eprintln!("{}: not kept: {error}", replica.log.display());
        }
    }
}

fn start(plane: &'static ControlPlane, ns: &str, id: &str, shards: usize) -> Replica {
    let flags = [
        format!("--namespace={ns}"),
        format!("--shards={shards}"),
        "--webhooks=false".to_owned(),
        log_flag(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let timings = [
        "--lease-duration=15s",
        "--renew-deadline=10s",
        "--retry-period=2s",
        "--shutdown-delay=1s",
        "--shutdown-timeout=25s",
    ];
    let flags: Vec<&str> = flags.into_iter().chain(timings).collect();
    plane.replica(id, ns, &flags)
}

async fn scenario(plane: &'static ControlPlane, admin: &Client, shards: usize, n: usize) {
    let ns = plane.namespace(&format!("shards-{n}"), &[]).await;
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let later = chrono::Utc::now() + chrono::Duration::hours(2);
    let created = create(&ats, &ns, "at", n, later, Duration::ZERO).await;

    // Three replicas with shards: every PENDING status written, then their RSS.
    let started = Instant::now();
    let mut replicas: Vec<Replica> = (0..3)
        .map(|i| start(plane, &ns, &format!("r{i}"), shards))
        .collect();
    let written = pending_written(&ats, &replicas.iter().collect::<Vec<_>>(), "at", n).await;
    let statuses_after = written.saturating_duration_since(started);
    balanced(admin, &ns, shards, &replicas.iter().collect::<Vec<_>>()).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let sharded_rss: Vec<String> = replicas
        .iter()
        .map(|r| format!("{:.0}", rss_mib(r)))
        .collect();
    // Each figure as it comes, should a later step fail.
    eprintln!(
        "{n} Ats: created in {created:.0?}, every PENDING status after {statuses_after:.1?}, RSS {} MiB",
        sharded_rss.join(", ")
    );

    // One replica with one Lease of its own, cold: the floor without shards. Not above
    // `SINGLE_UP_TO`: its lists of every At come from kube-apiserver v1.24's watch cache, each
    // answered as one body built in memory, and with 300,000 Ats the API server ran out of this
    // machine's 24 GiB.
    let single = if n <= SINGLE_UP_TO {
        let (cached, rss) = single_cold(plane, &ns).await;
        eprintln!(
            "{n} Ats: one replica, one Lease, cached every At after {cached:.1?}, RSS {rss:.0} MiB"
        );
        format!("{cached:.1?} / {rss:.0} MiB")
    } else {
        "not run".to_owned()
    };

    // A replica stopped just before Ats fall due: those of its shards wait for a new leader.
    let before = holders(admin, &ns, shards).await;
    let stopped = replicas.remove(2);
    let its_shards: Vec<usize> = (0..shards)
        .filter(|s| before[*s].as_deref() == Some(stopped.identity.as_str()))
        .collect();
    let lead = Duration::from_secs(4);
    let due_instant = Instant::now() + lead;
    let due = chrono::Utc::now() + chrono::Duration::from_std(lead).unwrap();
    let pod_seen = tokio::spawn(real::watch_pods(pods.clone(), TAKEN_OVER));
    create(&ats, &ns, "due", TAKEN_OVER, due, SPACING).await;
    tokio::time::sleep_until((due_instant - Duration::from_millis(100)).into()).await;
    let mut stopped = stopped;
    let sigterm = Instant::now();
    stopped.terminate();
    // When each of its shards named another holder, to tell a late handover from a late list.
    let moves = tokio::spawn({
        let (admin, ns, name) = (admin.clone(), ns.clone(), stopped.identity.clone());
        let its_shards = its_shards.clone();
        async move {
            let mut moved: Vec<Option<(String, Duration)>> = vec![None; its_shards.len()];
            while moved.iter().any(Option::is_none) && sigterm.elapsed() < Duration::from_secs(120)
            {
                let now = holders(&admin, &ns, shards).await;
                for (slot, shard) in moved.iter_mut().zip(&its_shards) {
                    if let Some(holder) = now[*shard].as_ref().filter(|h| **h != name) {
                        slot.get_or_insert((holder.clone(), sigterm.elapsed()));
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            moved
        }
    });
    let seen = tokio::time::timeout(Duration::from_secs(300), pod_seen)
        .await
        .expect("every pod within five minutes")
        .unwrap();
    let split = cnat::shard::Shards::new(shards).unwrap();
    let (mut theirs, mut others) = (Duration::ZERO, Duration::ZERO);
    // Its shards' Ats late by more than a second: when each was due, after the SIGTERM.
    let mut late_ones: Vec<Duration> = Vec::new();
    for (pod, at) in &seen {
        let name = pod.trim_end_matches("-pod");
        let index: u32 = name.trim_start_matches("due-").parse().unwrap_or(0);
        let late = at.saturating_duration_since(due_instant + SPACING * index);
        if its_shards.contains(&shard_of_pod(&split, &ns, pod)) {
            theirs = theirs.max(late);
            if late > Duration::from_secs(1) {
                late_ones.push((due_instant + SPACING * index).saturating_duration_since(sigterm));
            }
        } else {
            others = others.max(late);
        }
    }
    let _ = stopped.child.wait();
    for (shard, moved) in its_shards.iter().zip(moves.await.unwrap_or_default()) {
        eprintln!("{n} Ats: the stopped replica's shard {shard}: another holder {moved:?} after its SIGTERM");
    }
    late_ones.sort();
    if let (Some(first), Some(last)) = (late_ones.first(), late_ones.last()) {
        eprintln!(
            "{n} Ats: {} of its shards' Ats more than 1 s late, due {:.2?} to {:.2?} after the SIGTERM",
            late_ones.len(),
            first,
            last
        );
    }
    eprintln!("{n} Ats: a replica stopped: its shards' Ats at most {theirs:.2?} late, the others' {others:.2?}");

    // Three replicas again; then 10,000 Ats due at once, against the bare-create floor.
    replicas.push(start(plane, &ns, "r3", shards));
    balanced(admin, &ns, shards, &replicas.iter().collect::<Vec<_>>()).await;
    tokio::time::sleep(Duration::from_secs(15)).await;
    let floor_ns = plane.namespace(&format!("shards-floor-{n}"), &[]).await;
    let requests_before_floor = real::requests_answered(admin).await;
    let cpu_before_floor = cpu_split(plane, &replicas);
    let floor = bare_creates(Api::namespaced(admin.clone(), &floor_ns)).await;
    let cpu_after_floor = cpu_split(plane, &replicas);
    let cpu_floor = cpu_after_floor.since(cpu_before_floor);
    let requests_after_floor = real::requests_answered(admin).await;
    // The same creates with the bench's pod watch open, as it is over the wave: that watch is
    // the bench's, not cnat's, and costs the server its share.
    let watched_ns = plane
        .namespace(&format!("shards-floor-watched-{n}"), &[])
        .await;
    let watched_pods: Api<Pod> = Api::namespaced(admin.clone(), &watched_ns);
    let (synced, listed) = tokio::sync::oneshot::channel();
    let watch = tokio::spawn(real::watch_pods_synced(watched_pods.clone(), BURST, synced));
    listed.await.expect("the watched floor's pod watch listed");
    let cpu_before_watched = cpu_split(plane, &replicas);
    let watched_started = Instant::now();
    let watched_created = bare_creates(watched_pods).await;
    let watched_seen = tokio::time::timeout(Duration::from_secs(300), watch)
        .await
        .expect("every watched floor pod seen within five minutes")
        .unwrap()
        .values()
        .map(|at| at.saturating_duration_since(watched_started))
        .max()
        .unwrap_or_default();
    let cpu_after_watched = cpu_split(plane, &replicas);
    let cpu_watched = cpu_after_watched.since(cpu_before_watched);
    eprintln!(
        "{n} Ats: the floor again with the bench's pod watch open: creates answered after {watched_created:.1?}, the last pod seen after {watched_seen:.1?} (the unwatched floor {floor:.1?}); CPU seconds: {cpu_watched}"
    );
    // Before due the server creates the Ats and takes each one's `Pending` status and event:
    // about three writes an At, which took 5.4-5.7 floors in two runs of 2026-11-28 (4 were
    // too few: the wave began while they went on).
    let lead = Duration::from_secs(10) + floor * 8;
    let due_instant = Instant::now() + lead;
    let due = chrono::Utc::now() + chrono::Duration::from_std(lead).unwrap();
    // Who leads each shard in the burst: each replica's last pod, to tell a slow replica from a
    // slow server.
    let led = holders(admin, &ns, shards).await;
    let burst_created = create(&ats, &ns, "burst", BURST, due, Duration::ZERO).await;
    eprintln!(
        "{n} Ats: the burst's {BURST} Ats created in {burst_created:.1?}, {:.1?} before due",
        due_instant.saturating_duration_since(Instant::now())
    );
    // Watching from two seconds before due (a watch silent for longer than the client's read
    // timeout fails); its list brings the pods already there.
    tokio::time::sleep_until((due_instant - Duration::from_secs(2)).into()).await;
    let pod_seen = tokio::spawn(real::watch_pods(pods.clone(), TAKEN_OVER + BURST));
    // Read before due: building the metrics pages is work for the server and the replicas.
    let (requests_at_due, counted_at_due) =
        tokio::join!(real::requests_answered(admin), replica_counts(&replicas));
    if Instant::now() > due_instant {
        eprintln!(
            "{n} Ats: the counts before the burst were read {:.1?} after due: the wave's counts miss its start",
            due_instant.elapsed()
        );
    }
    tokio::time::sleep_until(due_instant.into()).await;
    let cpu_at_due = cpu_split(plane, &replicas);
    let past_due = due_instant.elapsed();
    let seen = tokio::time::timeout(WAVE_TIMEOUT, pod_seen).await;
    let wave_ended = due_instant.elapsed();
    let cpu_wave = cpu_split(plane, &replicas).since(cpu_at_due);
    // The server and the replicas at once, as soon as the wave ended: the RUNNING writes that
    // follow its pods go out meanwhile, and what is read later counts more of them.
    let (requests_wave, counted_wave) =
        tokio::join!(real::requests_answered(admin), replica_counts(&replicas));
    let counts_read = due_instant.elapsed().saturating_sub(wave_ended);
    eprintln!(
        "{n} Ats: requests the control plane answered (every client, watches counted when they end) over the floor: {}; from just before due until the last burst pod was seen: {}",
        real::requests_since(requests_before_floor.as_ref(), requests_after_floor.as_ref()),
        real::requests_since(requests_at_due.as_ref(), requests_wave.as_ref()),
    );
    eprintln!(
        "{n} Ats: the replicas' counts from just before due until the last burst pod was seen: {}",
        counted_since(&counted_at_due, &counted_wave)
    );
    eprintln!("{n} Ats: (both read within {counts_read:.1?} after the last burst pod was seen)");
    eprintln!(
        "{n} Ats: CPU seconds over the floor ({floor:.1?}): {cpu_floor}; creating the burst's Ats (and whatever the replicas wrote of them meanwhile), until due: {}; from due (read {past_due:.1?} after it) until the last burst pod was seen ({wave_ended:.1?} after due): {cpu_wave}",
        cpu_at_due.since(cpu_after_watched)
    );
    // The logs of a slow run are what tells why: kept before a timeout ends the bench.
    keep_logs(n, &replicas.iter().chain([&stopped]).collect::<Vec<_>>());
    let seen = seen
        .unwrap_or_else(|_| panic!("every pod within {WAVE_TIMEOUT:?} of due"))
        .unwrap();
    // The burst's pods: how long after due each came, and in which shard.
    let burst: Vec<(usize, Duration)> = seen
        .iter()
        .filter(|(pod, _)| pod.starts_with("burst-"))
        .map(|(pod, at)| {
            (
                shard_of_pod(&split, &ns, pod),
                at.saturating_duration_since(due_instant),
            )
        })
        .collect();
    let last = burst
        .iter()
        .map(|(_, after)| *after)
        .max()
        .unwrap_or_default();
    if holders(admin, &ns, shards).await != led {
        eprintln!(
            "{n} Ats: the burst: a shard moved during it; the counts below are by who led before"
        );
    }
    let mut attributed = 0;
    for replica in &replicas {
        let its_pods: Vec<Duration> = burst
            .iter()
            .filter(|(shard, _)| led[*shard].as_deref() == Some(replica.identity.as_str()))
            .map(|(_, after)| *after)
            .collect();
        eprintln!(
            "{n} Ats: the burst: {} leads {} of its Ats, its last pod {:.1?} after due",
            replica.identity,
            its_pods.len(),
            its_pods.iter().max().copied().unwrap_or_default()
        );
        attributed += its_pods.len();
    }
    if attributed < BURST {
        eprintln!(
            "{n} Ats: the burst: {} of its Ats in shards no running replica led before it",
            BURST - attributed
        );
    }
    eprintln!(
        "{n} Ats: the burst's last pod {last:.1?} after due: {:.2}x the floor, {:.2}x the watched floor's last pod seen",
        last.as_secs_f64() / floor.as_secs_f64(),
        last.as_secs_f64() / watched_seen.as_secs_f64()
    );
    println!(
        "| {n} | {created:.0?} | {statuses_after:.1?} | {} MiB | {single} | {theirs:.2?} / {others:.2?} | {floor:.1?} / {last:.1?} / {:.2}x |",
        sharded_rss.join(", "),
        last.as_secs_f64() / floor.as_secs_f64()
    );
    for mut replica in replicas {
        replica.kill();
    }
}

/// The replicas' counters that tell what a wave of pods cost them beside the creates, each
/// summed over the replicas: (name printed, prefix of the metric's lines).
const REPLICA_COUNTERS: [(&str, &str); 9] = [
    ("reconciles", "cnat_reconciles_total"),
    (
        "creates confirmed by a read",
        r#"cnat_pod_create_confirmations_total{by="read"}"#,
    ),
    (
        "creates confirmed by their own write",
        r#"cnat_pod_create_confirmations_total{by="own_write"}"#,
    ),
    ("creates deferred", "cnat_pod_creates_deferred_total"),
    ("creates unconfirmed", "cnat_pod_creates_unconfirmed_total"),
    (
        "PENDING writes",
        r#"cnat_status_writes_total{phase="PENDING","#,
    ),
    (
        "RUNNING writes",
        r#"cnat_status_writes_total{phase="RUNNING","#,
    ),
    ("DONE writes", r#"cnat_status_writes_total{phase="DONE","#),
    ("events dropped", "cnat_events_dropped_total"),
];

/// `REPLICA_COUNTERS` read from each replica's metrics (every result of a status write);
/// `None` for a replica whose page did not answer in full.
async fn replica_counts(replicas: &[Replica]) -> Vec<Option<Vec<u64>>> {
    let texts = metrics_of(replicas.iter().map(|r| r.admin).collect()).await;
    texts
        .iter()
        .map(|text| {
            (!text.is_empty()).then(|| {
                REPLICA_COUNTERS
                    .iter()
                    .map(|(_, prefix)| real::sum_of(text, prefix))
                    .collect()
            })
        })
        .collect()
}

/// The metrics pages of the replicas at `admins` (an empty page for one that did not answer in
/// full).
async fn metrics_of(admins: Vec<std::net::SocketAddr>) -> Vec<String> {
    tokio::task::spawn_blocking(move || {
        admins
            .iter()
            .map(|a| real::metrics_text(*a))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap()
}

/// The counts between two `replica_counts`, named and summed over the replicas read both times.
fn counted_since(before: &[Option<Vec<u64>>], after: &[Option<Vec<u64>>]) -> String {
    let mut sums = [0u64; REPLICA_COUNTERS.len()];
    let mut missed = 0;
    for pair in before.iter().zip(after) {
        let (Some(before), Some(after)) = pair else {
            missed += 1;
            continue;
        };
        for (sum, (before, after)) in sums.iter_mut().zip(before.iter().zip(after)) {
            *sum += after.saturating_sub(*before);
        }
    }
    let mut counts: Vec<String> = REPLICA_COUNTERS
        .iter()
        .zip(sums)
        .map(|((name, _), count)| format!("{name} {count}"))
        .collect();
    if missed > 0 {
        counts.push(format!("{missed} replica(s) not read"));
    }
    counts.join(", ")
}

/// When `replicas` had written `n` `Pending` statuses between them (their
/// `cnat_status_writes_total`: each write a compare-and-swap on the version decided on, so no At
/// counts twice), read every second, within 30 minutes; then reads 100 of the Ats `{prefix}-…`,
/// spread over the names, and checks that each has the status a leader writes (its
/// `scheduledTime`). A write the API server stored but whose answer was lost counts as `failed`
/// and is never written again: when the count stops short for a minute, a list of the Ats (in
/// pages) says whether all `n` have it, and the instant the last PENDING write ended (whatever
/// its result) is the answer. Not a
/// watch of every At: with 300,000 the bench's own watch, listing again each time the busy
/// server ended it, failed the run (docs/src/performance/measurements.md).
async fn pending_written(ats: &Api<At>, replicas: &[&Replica], prefix: &str, n: usize) -> Instant {
    const WRITES: &str = r#"cnat_status_writes_total{phase="PENDING","#;
    const STALLED: Duration = Duration::from_secs(60);
    let admins: Vec<std::net::SocketAddr> = replicas.iter().map(|r| r.admin).collect();
    let deadline = Instant::now() + Duration::from_secs(1800);
    let (mut moved, mut looked) = (Instant::now(), Instant::now());
    // Each replica's counts as last read, never lower: a scrape that fails reads nothing.
    let mut written = vec![0u64; admins.len()];
    let mut attempted = vec![0u64; admins.len()];
    let done = loop {
        let texts = metrics_of(admins.clone()).await;
        let count =
            |prefix: &str| -> Vec<u64> { texts.iter().map(|t| real::sum_of(t, prefix)).collect() };
        let before: u64 = attempted.iter().sum();
        // Every result of a PENDING write, and the written ones.
        let (ended, stored) = (
            count(WRITES),
            count(&format!(r#"{WRITES}result="written"}}"#)),
        );
        for (seen, now) in written.iter_mut().zip(stored) {
            *seen = (*seen).max(now);
        }
        for (seen, now) in attempted.iter_mut().zip(ended) {
            *seen = (*seen).max(now);
        }
        // Any PENDING write that ended (a failed one may have been stored) moves the instant.
        if attempted.iter().sum::<u64>() > before {
            moved = Instant::now();
        }
        let written: u64 = written.iter().sum();
        if written >= n as u64 {
            break moved;
        }
        if moved.elapsed() > STALLED && looked.elapsed() > STALLED {
            looked = Instant::now();
            let listed = listed_with_status(ats).await;
            eprintln!(
                "PENDING writes stalled at {written} written of {n}; a list found {listed} with their status"
            );
            if listed >= n {
                eprintln!("every PENDING status written: by the list, not the count");
                break moved;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{written} of {n} PENDING statuses written within 30 minutes ({} ended otherwise)",
            attempted.iter().sum::<u64>().saturating_sub(written)
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    for i in (0..n).step_by(n.div_ceil(100).max(1)) {
        let name = format!("{prefix}-{i:07}");
        let at = ats.get(&name).await.unwrap();
        assert!(
            at.status.is_some_and(|s| s.scheduled_time.is_some()),
            "{name} has no PENDING status written, though the replicas counted {} written",
            written.iter().sum::<u64>()
        );
    }
    done
}

/// How many Ats have the status a leader writes, listed in pages of 500 from etcd; 0 when the
/// list fails (its continue token expired).
async fn listed_with_status(ats: &Api<At>) -> usize {
    let mut params = kube::api::ListParams::default().limit(500);
    let mut count = 0;
    loop {
        let page = match ats.list(&params).await {
            Ok(page) => page,
            Err(error) => {
                eprintln!("listing the Ats failed: {error}");
                return 0;
            }
        };
        count += page
            .items
            .iter()
            .filter(|at| {
                at.status
                    .as_ref()
                    .is_some_and(|s| s.scheduled_time.is_some())
            })
            .count();
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return count,
        }
    }
}

/// `--write-memory`: what a replica holds once it has written every At's `Pending` status, with
/// `shards` Lease shards (all led by it) and with one Lease, each in a namespace of its own with
/// `n` fresh Ats; then a cold replica with one Lease that only lists the first namespace's Ats
/// (their statuses written): the floor without the writes.
async fn write_memory(plane: &'static ControlPlane, admin: &Client, shards: usize, n: usize) {
    let later = chrono::Utc::now() + chrono::Duration::hours(2);
    let mut rss = Vec::new();
    let mut written_ns = None;
    for (i, shards) in [shards, 1].into_iter().enumerate() {
        let ns = plane.namespace(&format!("written-{i}-{n}"), &[]).await;
        let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
        create(&ats, &ns, "at", n, later, Duration::ZERO).await;
        let mut replica = start(plane, &ns, &format!("writer-{i}"), shards);
        pending_written(&ats, &[&replica], "at", n).await;
        tokio::time::sleep(Duration::from_secs(10)).await;
        rss.push(rss_mib(&replica));
        replica.kill();
        written_ns.get_or_insert(ns);
    }
    rss.push(single_cold(plane, &written_ns.unwrap_or_default()).await.1);
    println!(
        "| {n} | {:.0} MiB | {:.0} MiB | {:.0} MiB |",
        rss[0], rss[1], rss[2]
    );
}

/// Starts one replica with one Lease of its own (`single`) over `ns`, cold; once it caches every
/// At, waits 10 s, reads its RSS and stops it: how long it took to cache them, and the RSS (MiB).
async fn single_cold(plane: &'static ControlPlane, ns: &str) -> (Duration, f64) {
    let started = Instant::now();
    let flags = [
        format!("--namespace={ns}"),
        "--lease-name=single".to_owned(),
        "--webhooks=false".to_owned(),
        log_flag(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut single = plane.replica("single", ns, &flags);
    real::wait_ready(&single, Duration::from_secs(900)).await;
    let cached = started.elapsed();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let rss = rss_mib(&single);
    single.kill();
    (cached, rss)
}
