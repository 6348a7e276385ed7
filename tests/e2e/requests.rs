//! What one At's life costs the API server, on the real control plane: every request the leader
//! sends from the At's creation to `Done` and its pod's release (cnat's finalizer gone), counted
//! by verb and resource at a proxy between the replica and the API server, against a committed
//! budget. Any count above its budget fails; one below it asks for the budget to be lowered
//! (in this file, saying why). The Lease's renewals (a replica's, whatever the Ats) are left
//! out. See docs/src/performance/measurements.md, "Beside the Job controller".

use crate::lifecycle::at;
use crate::support::envtest::{finish_pod, install_crd, lease_holder};
use crate::support::process::probe;
use crate::support::proxy::Proxy;
use crate::support::until_some as until;
use cnat::api::{At, Phase};
use cnat::operator::finalizer;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::Api;
use std::collections::BTreeMap;
use std::time::Duration;

/// The requests one At's life costs, by verb and resource: the committed budget.
const BUDGET: &[(&str, usize)] = &[
    // The quorum read before the pod's create: the cache's version of the At is the API
    // server's (no pod twice after a handover, docs/src/operating/security.md "Never twice");
    // skipped only where this leader's own PENDING write made that version.
    ("get ats", 1),
    // The pod that runs the command.
    ("create pods", 1),
    // RUNNING (with the pod's name), then DONE.
    ("patch ats/status", 2),
    // Events: PodCreated, Succeeded.
    ("create events", 2),
    // cnat's finalizer off the pod once DONE is recorded.
    ("patch pods", 1),
];

/// How long the replica's requests must have stopped for the At's life to be over.
const QUIET: Duration = Duration::from_secs(3);

#[tokio::test]
async fn one_ats_life_costs_at_most_its_budget_of_requests() {
    let plane = crate::real_control_plane!();
    let admin = plane.admin().await;
    install_crd(&admin, &cnat::api::crd_yaml()).await;
    let lease_ns = plane.namespace("requests-lease", &[]).await;
    let ns = plane.namespace("requests", &[]).await;
    let proxy = Proxy::start(admin.clone()).await;
    let flags = [format!("--namespace={ns}"), "--webhooks=false".into()];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let replica = plane.replica_through("a", &lease_ns, &flags, &proxy.url);
    let leads = until(Duration::from_secs(30), async || {
        let holder = lease_holder(&admin, &lease_ns, "cnat").await;
        let ready = probe(replica.admin, "/readyz") == Some(200);
        (holder.as_deref() == Some("a") && ready).then_some(())
    });
    assert!(leads.await.is_some(), "a never led: {}", replica.log_text());
    let before = quiet(&proxy).await.len();

    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    // Due already at the first look (2 s ago), so never first written PENDING with its
    // scheduled time: that write happens only when the replica sees it a moment before due.
    let new = at(
        "life",
        chrono::Utc::now() - chrono::Duration::seconds(2),
        "true",
    );
    ats.create(&PostParams::default(), &new).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let created = until(Duration::from_secs(30), async || {
        pods.get_opt("life-pod").await.unwrap()
    });
    assert!(created.await.is_some(), "no pod: {}", replica.log_text());
    finish_pod(&admin, &ns, "life-pod", 0, "").await;
    let over = until(Duration::from_secs(30), async || {
        let at = ats.get("life").await.unwrap();
        let pod = pods.get("life-pod").await.unwrap();
        let done = at.status.is_some_and(|s| s.phase == Phase::Done);
        (done && !finalizer::is_present(&pod)).then_some(())
    });
    assert!(
        over.await.is_some(),
        "never DONE and released: {}",
        replica.log_text()
    );
    let requests = quiet(&proxy).await;

    let mut counted: BTreeMap<&str, usize> = BTreeMap::new();
    for request in &requests[before..] {
        if !request.ends_with(" leases") {
            *counted.entry(request.as_str()).or_default() += 1;
        }
    }
    let budget: BTreeMap<&str, usize> = BUDGET.iter().copied().collect();
    let table: Vec<String> = (counted.keys().chain(budget.keys()))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|key| {
            let (n, b) = (counted.get(key), budget.get(key));
            format!("{key}: {} (budget {})", n.unwrap_or(&0), b.unwrap_or(&0))
        })
        .collect();
    eprintln!(
        "one At's life, requests by verb and resource:\n{}",
        table.join("\n")
    );
    let over: Vec<&String> = (table.iter())
        .filter(|row| {
            let key = row.split(':').next().unwrap_or_default();
            counted.get(key).unwrap_or(&0) > budget.get(key).unwrap_or(&0)
        })
        .collect();
    assert!(over.is_empty(), "over budget: {over:?}");
    let total: usize = counted.values().sum();
    let allowed: usize = budget.values().sum();
    assert_eq!(
        total, allowed,
        "fewer requests than the budget: lower BUDGET in tests/e2e/requests.rs ({table:?})"
    );
}

/// The replica's requests once none but the Lease's has come for [`QUIET`] (at most 60 s).
async fn quiet(proxy: &Proxy) -> Vec<String> {
    let others = || {
        let requests = proxy.requests();
        let n = requests.iter().filter(|r| !r.ends_with(" leases")).count();
        (n, requests)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let (mut seen, _) = others();
    loop {
        tokio::time::sleep(QUIET).await;
        let (now, requests) = others();
        if now == seen || tokio::time::Instant::now() > deadline {
            return requests;
        }
        seen = now;
    }
}
