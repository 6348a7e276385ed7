//! Memory per cached At: N Ats as a leader leaves them PENDING, decoded from list pages of 500
//! into kube-runtime's store, once as typed `At`s (the floor: what the cache held before) and
//! once as `CachedAt`s, each in a fresh process (this bench runs itself again), with the
//! resident memory before and after; then how long reading every cached At back takes.
//!
//!     cargo bench --bench cache            # 100,000 Ats
//!     cargo bench --bench cache -- 20000

#[allow(dead_code)] // the benches use part of it
#[path = "support/rss.rs"]
mod rss;

use cnat::api::At;
use cnat::operator::cache::CachedAt;
use cnat::operator::reconcile::decide::{decide, PodObservation};
use kube::runtime::reflector::{self, Lookup};
use kube::runtime::watcher::Event;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::process::Command;
use std::time::Instant;

const FORM: &str = "CNAT_BENCH_CACHE_FORM";

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    match std::env::var(FORM).as_deref() {
        Ok("typed") => return fill::<At>(n, |_| 0),
        Ok("compact") => return fill::<CachedAt>(n, read_all),
        _ => {}
    }
    let typed = measure("typed", n);
    let compact = measure("compact", n);
    println!("| Ats | typed At: bytes per At | CachedAt: bytes per At | CachedAt / typed | reading every CachedAt back |");
    println!("|---|---|---|---|---|");
    println!(
        "| {n} | {:.0} | {:.0} | {:.2}x | {} ms |",
        typed.0,
        compact.0,
        compact.0 / typed.0,
        compact.1
    );
}

/// Runs this bench for one form; its bytes per At and read-back milliseconds.
fn measure(form: &str, n: usize) -> (f64, u64) {
    let out = Command::new(std::env::current_exe().unwrap())
        .arg(n.to_string())
        .env(FORM, form)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut fields = text.split_whitespace().map(|f| f.parse::<f64>().unwrap());
    (fields.next().unwrap(), fields.next().unwrap() as u64)
}

/// Fills a store with `n` Ats as `K` and prints the bytes each took and what `after` returns.
fn fill<K>(n: usize, after: fn(&[std::sync::Arc<K>]) -> u64)
where
    K: DeserializeOwned + Lookup + Clone + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let now = chrono::Utc::now();
    let pages: Vec<Vec<u8>> = (0..n)
        .collect::<Vec<_>>()
        .chunks(500)
        .map(|page| {
            let items: Vec<Value> = page.iter().map(|i| pending_at(*i, now)).collect();
            serde_json::to_vec(&json!({ "items": items })).unwrap()
        })
        .collect();
    let before = rss::rss_kib("self");
    let (store, mut writer) = reflector::store::<K>();
    writer.apply_watcher_event(&Event::Init);
    for page in &pages {
        #[derive(serde::Deserialize)]
        struct List<K> {
            items: Vec<K>,
        }
        let list: List<K> = serde_json::from_slice(page).unwrap();
        for at in list.items {
            writer.apply_watcher_event(&Event::InitApply(at));
        }
    }
    writer.apply_watcher_event(&Event::InitDone);
    let bytes = (rss::rss_kib("self") - before) as f64 * 1024.0 / n as f64;
    let state = store.state();
    assert_eq!(state.len(), n);
    println!("{bytes} {}", after(&state));
}

fn read_all(ats: &[std::sync::Arc<CachedAt>]) -> u64 {
    let started = Instant::now();
    let read = ats.iter().filter(|at| at.at().is_ok()).count();
    assert_eq!(read, ats.len());
    started.elapsed().as_millis() as u64
}

/// An At as the API server returns it after a leader wrote its PENDING status.
fn pending_at(i: usize, now: chrono::DateTime<chrono::Utc>) -> Value {
    let mut at = json!({
        "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
        "metadata": {"name": format!("at-{i:06}"), "namespace": "default", "generation": 1,
            "uid": format!("0b6b1f4e-2a55-4c2e-9b1a-{i:012}"),
            "resourceVersion": (1_000_000 + i).to_string(),
            "creationTimestamp": "2026-11-23T10:00:00Z"},
        "spec": {"schedule": (now + chrono::Duration::hours(1)).to_rfc3339(),
            "command": "true", "image": "busybox"}});
    let typed: At = serde_json::from_value(at.clone()).unwrap();
    let decided = decide(&typed, &PodObservation::NotCached, now, &Default::default());
    at["status"] = serde_json::to_value(decided.status.unwrap()).unwrap();
    at
}
