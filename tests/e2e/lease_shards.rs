//! Lease shards (`cnat run --shards`) on the real control plane: the replicas split the shards'
//! Leases evenly, each caches and reconciles only its shards' Ats, shards move to a replica that
//! joins (in the middle of a burst), from one that stops and from one that dies, and every At's
//! pod is created exactly once through it all; a pod started before Lease shards (no shard
//! label) gets its At's label from shard 0's leader.

use crate::never_twice::{metric, Creations, SCHEDULER_QPS};
use crate::support::envtest::{install_crd, lease_holder, ControlPlane, Replica};
use crate::support::until_some as until;
use cnat::api::{At, Phase};
use cnat::shard::{self, Shards, LABEL};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use std::collections::BTreeMap;
use std::time::Duration;

const SHARDS: usize = 6;

/// Who holds each shard's Lease (`cnat-0-of-6` ...).
async fn holders(admin: &Client, lease_ns: &str) -> Vec<Option<String>> {
    let mut holders = Vec::new();
    for shard in 0..SHARDS {
        let name = cnat::leader::members::shard_lease_name("cnat", shard, SHARDS);
        holders.push(lease_holder(admin, lease_ns, &name).await);
    }
    holders
}

/// Waits until the replicas hold exactly these numbers of shards (and no shard is free).
async fn settle(admin: &Client, lease_ns: &str, expected: &[(&str, usize)], replicas: &[&Replica]) {
    let settled = until(Duration::from_secs(60), async || {
        let holders = holders(admin, lease_ns).await;
        let held = |id: &str| holders.iter().filter(|h| h.as_deref() == Some(id)).count();
        let all = expected.iter().map(|(_, n)| n).sum::<usize>() == SHARDS;
        (all && expected.iter().all(|(id, n)| held(id) == *n)).then_some(())
    })
    .await;
    if settled.is_none() {
        let logs: Vec<String> = replicas.iter().map(|r| r.log_text()).collect();
        panic!(
            "never settled on {expected:?}: {:?}\n{}",
            holders(admin, lease_ns).await,
            logs.join("\n---\n")
        );
    }
}

/// An At running `true` at `due`, labelled with its shard as the mutating webhook labels it
/// (the replicas here serve no webhooks); `unlabelled`: without one, as created while the
/// webhook was not called (shard 0's).
fn at(ns: &str, name: &str, due: chrono::DateTime<chrono::Utc>, unlabelled: bool) -> At {
    let mut at = crate::lifecycle::at(name, due, "true");
    if !unlabelled {
        let value = shard::assign(&format!("{ns}/{name}"));
        at.metadata.labels = Some([(LABEL.to_owned(), value)].into());
    }
    at
}

/// Creates Ats `prefix-0` .. due from `due` on, one every `every`, the first two without a
/// shard label.
async fn create(
    ats: &Api<At>,
    ns: &str,
    prefix: &str,
    count: usize,
    due: chrono::DateTime<chrono::Utc>,
    every: chrono::Duration,
) {
    futures::stream::iter(0..count)
        .for_each_concurrent(8, |i| {
            let ats = ats.clone();
            async move {
                let when = due + every * i32::try_from(i).unwrap();
                let new = at(ns, &format!("{prefix}-{i}"), when, i < 2);
                ats.create(&PostParams::default(), &new).await.unwrap();
            }
        })
        .await;
}

/// Waits until `count` Ats are DONE.
async fn all_done(ats: &Api<At>, count: usize, replicas: &[&Replica]) {
    let done = until(Duration::from_secs(120), async || {
        let list = ats.list(&ListParams::default()).await.unwrap();
        let done = list
            .items
            .iter()
            .filter(|at| at.status.as_ref().is_some_and(|s| s.phase == Phase::Done))
            .count();
        (done == count).then_some(())
    })
    .await;
    if done.is_none() {
        let logs: Vec<String> = replicas.iter().map(|r| r.log_text()).collect();
        panic!("not every At DONE\n{}", logs.join("\n---\n"));
    }
}

/// The Ats a replica's `/metrics` counts (it counts the caches of the shards it leads).
fn counted(replica: &Replica) -> u64 {
    ["PENDING", "RUNNING", "DONE"]
        .iter()
        .filter_map(|phase| metric(replica, &format!("cnat_ats{{phase=\"{phase}\"}}")))
        .sum()
}

/// Whether replica `identity`'s membership Lease exists.
async fn member(admin: &Client, lease_ns: &str, identity: &str) -> bool {
    let leases: Api<Lease> = Api::namespaced(admin.clone(), lease_ns);
    let name = cnat::leader::members::lease_name("cnat", identity);
    leases.get_opt(&name).await.unwrap().is_some()
}

#[tokio::test]
async fn shards_spread_over_the_replicas_and_each_at_runs_once_as_they_come_and_go() {
    let plane: &ControlPlane = crate::real_control_plane!();
    let admin = plane.admin().await;
    install_crd(&admin, &cnat::api::crd_yaml()).await;
    let lease_ns = plane.namespace("lease-shards-lease", &[]).await;
    let ns = plane.namespace("lease-shards", &[]).await;
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let creations = Creations::watch(&admin, &ns).await;
    // An At running in a pod started before Lease shards: the pod has no shard label, so only
    // shard 0's pod watch sees it, and its At is in another shard.
    let old = old_at_in_another_shard(&ats, &pods, &ns).await;
    let flags = [
        format!("--namespace={ns}"),
        "--webhooks=false".into(),
        format!("--shards={SHARDS}"),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();

    // Two replicas: three shards each.
    let a = plane.replica("a", &lease_ns, &flags);
    let mut b = plane.replica("b", &lease_ns, &flags);
    settle(&admin, &lease_ns, &[("a", 3), ("b", 3)], &[&a, &b]).await;
    // Shard 0's leader gives the old pod its At's label, so the At's leader sees it end at once
    // (not at its RUNNING re-check, a minute on).
    let value = old.labels()[LABEL].clone();
    let labelled = until(Duration::from_secs(20), async || {
        let pod = pods.get(&format!("{}-pod", old.name_any())).await.unwrap();
        (pod.labels().get(LABEL) == Some(&value)).then_some(())
    });
    assert!(
        labelled.await.is_some(),
        "the old pod never got its label: {}",
        a.log_text()
    );
    let running = until(Duration::from_secs(20), async || {
        let at = ats.get(&old.name_any()).await.unwrap();
        at.status
            .is_some_and(|s| s.phase == Phase::Running)
            .then_some(())
    });
    assert!(running.await.is_some(), "the old At never ran");
    crate::support::envtest::finish_pod(&admin, &ns, &format!("{}-pod", old.name_any()), 0, "")
        .await;
    let done = until(Duration::from_secs(20), async || {
        let at = ats.get(&old.name_any()).await.unwrap();
        at.status
            .is_some_and(|s| s.phase == Phase::Done)
            .then_some(())
    });
    assert!(
        done.await.is_some(),
        "the old At was not DONE within 20 s of its pod's end"
    );
    // Nodes for the pods (KWOK's): each pod runs and ends (exit 0).
    let _nodes = plane.kwok_nodes(&admin, 4, Some(SCHEDULER_QPS)).await;

    // 300 Ats fall due over 9 s; a third replica joins as their pods are being created, and
    // shards move to it one at a time, in the middle of the burst.
    let due = chrono::Utc::now() + chrono::Duration::seconds(6);
    create(
        &ats,
        &ns,
        "burst",
        300,
        due,
        chrono::Duration::milliseconds(30),
    )
    .await;
    let started = until(Duration::from_secs(30), async || {
        (creations.pods() >= 1).then_some(())
    });
    assert!(
        started.await.is_some(),
        "the burst never started: {}",
        a.log_text()
    );
    let mut c = plane.replica("c", &lease_ns, &flags);
    settle(
        &admin,
        &lease_ns,
        &[("a", 2), ("b", 2), ("c", 2)],
        &[&a, &b, &c],
    )
    .await;
    all_done(&ats, 301, &[&a, &b, &c]).await;
    assert_eq!(creations.twice(), vec![], "pods created twice");
    assert_eq!(creations.pods(), 301);
    // Not vacuous: c took shards before the burst was over, and ran some of it (a pod's
    // lateness is observed by the replica whose create was answered: a create in flight when a
    // shard is given up lands unobserved, so the three need not add up to 300).
    let ran = |r: &Replica| metric(r, "cnat_run_lateness_seconds_count").unwrap_or(0);
    let by = [ran(&a), ran(&b), ran(&c)];
    assert!(by[2] > 0, "c ran none of the burst: {by:?}");
    // The shards a and b gave up went to c by handovers: c listed each while its holder led on,
    // and was named holder once ready (a move whose successor is not ready within the limit is
    // released instead; both moves of this join are, at most, one such).
    let to_c = handed_over(&a, "c") + handed_over(&b, "c");
    assert!(to_c >= 1, "no shard handed over to c: {}", a.log_text());

    // Every pod carries its At's shard, and each replica caches only its shards' Ats: the
    // counts of the three add up to the Ats, none holds them all.
    let shards = Shards::new(SHARDS).unwrap();
    let mut per_shard = BTreeMap::<usize, usize>::new();
    for at in ats.list(&ListParams::default()).await.unwrap() {
        let pod = pods.get(&format!("{}-pod", at.name_any())).await.unwrap();
        assert_eq!(
            pod.labels().get(LABEL),
            at.labels().get(LABEL),
            "{}",
            at.name_any()
        );
        *per_shard.entry(shards.of(Some(at.labels()))).or_default() += 1;
    }
    assert_eq!(
        per_shard.len(),
        SHARDS,
        "every shard had Ats: {per_shard:?}"
    );
    let counts = until(Duration::from_secs(30), async || {
        let counts = [counted(&a), counted(&b), counted(&c)];
        (counts.iter().sum::<u64>() == 301).then_some(counts)
    })
    .await;
    let counts = counts.expect("the replicas' counts add up to the Ats");
    assert!(counts.iter().all(|n| *n > 0 && *n < 301), "{counts:?}");

    // c stops, as at the end of a rolling update: its shards go back to a and b, its
    // membership Lease is deleted, and new Ats run once each.
    c.terminate();
    settle(&admin, &lease_ns, &[("a", 3), ("b", 3)], &[&a, &b]).await;
    let from_c = until(Duration::from_secs(10), async || {
        (handed_over(&c, "a") + handed_over(&c, "b") >= 1).then_some(())
    });
    assert!(
        from_c.await.is_some(),
        "c handed no shard over: {}",
        c.log_text()
    );
    let left = until(Duration::from_secs(10), async || {
        (!member(&admin, &lease_ns, "c").await).then_some(())
    });
    assert!(left.await.is_some(), "c's membership Lease stayed");
    let due = chrono::Utc::now() + chrono::Duration::seconds(2);
    create(&ats, &ns, "after-c", 60, due, chrono::Duration::zero()).await;
    all_done(&ats, 361, &[&a, &b]).await;

    // b dies: its shards expire and a takes every one; b's membership Lease is deleted once
    // it has been still for four lease durations (3 s each here).
    b.kill();
    settle(&admin, &lease_ns, &[("a", SHARDS)], &[&a]).await;
    let due = chrono::Utc::now() + chrono::Duration::seconds(2);
    create(&ats, &ns, "after-b", 30, due, chrono::Duration::zero()).await;
    all_done(&ats, 391, &[&a]).await;
    let forgotten = until(Duration::from_secs(30), async || {
        (!member(&admin, &lease_ns, "b").await).then_some(())
    });
    assert!(
        forgotten.await.is_some(),
        "b's membership Lease was never deleted"
    );
    assert_eq!(creations.twice(), vec![], "pods created twice");
    assert_eq!(creations.pods(), 391);
}

/// How many Leases `replica` handed over to replica `to` (its log says so once each).
fn handed_over(replica: &Replica, to: &str) -> usize {
    replica
        .log_text()
        .matches(&format!("handed the lease over to {to},"))
        .count()
}

/// An At (labelled for a shard other than 0) due now, and its pod as a release before Lease
/// shards made it: cnat's labels but no shard label, cnat's finalizer, controlled by the At.
async fn old_at_in_another_shard(ats: &Api<At>, pods: &Api<Pod>, ns: &str) -> At {
    let shards = Shards::new(SHARDS).unwrap();
    let due = chrono::Utc::now();
    let name = (0..)
        .map(|i| format!("old-{i}"))
        .find(|name| shards.of(at(ns, name, due, false).metadata.labels.as_ref()) != 0)
        .unwrap();
    let created = ats
        .create(&PostParams::default(), &at(ns, &name, due, false))
        .await
        .unwrap();
    let mut pod = cnat::operator::pod::build(&created, &Default::default());
    if let Some(labels) = pod.metadata.labels.as_mut() {
        labels.remove(LABEL);
    }
    pods.create(&PostParams::default(), &pod).await.unwrap();
    created
}

/// Whether any shard Lease of `count` is held.
async fn any_shard_held(admin: &Client, lease_ns: &str, count: usize) -> bool {
    for shard in 0..count {
        let name = cnat::leader::members::shard_lease_name("cnat", shard, count);
        if lease_holder(admin, lease_ns, &name).await.is_some() {
            return true;
        }
    }
    false
}

/// A change of layout, as a rollout that changes `--shards` makes it: replicas of the new
/// layout take no shard while a Lease of the old one is held, and take over once the old
/// replicas stopped; going to one Lease, the new replica takes it at once and the sharded ones
/// give theirs up within about a retry period. Ats run once through every change.
#[tokio::test]
async fn a_change_of_layout_hands_over_without_two_layouts_leading() {
    let plane: &ControlPlane = crate::real_control_plane!();
    let admin = plane.admin().await;
    install_crd(&admin, &cnat::api::crd_yaml()).await;
    let lease_ns = plane.namespace("layouts-lease", &[]).await;
    let ns = plane.namespace("layouts", &[]).await;
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let creations = Creations::watch(&admin, &ns).await;
    // Nodes for the pods (KWOK's): each pod runs and ends (exit 0).
    let _nodes = plane.kwok_nodes(&admin, 4, Some(SCHEDULER_QPS)).await;
    let start = |id: &str, shards: usize| {
        let flags = [
            format!("--namespace={ns}"),
            "--webhooks=false".to_owned(),
            format!("--shards={shards}"),
        ];
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        plane.replica(id, &lease_ns, &flags)
    };
    let mut ran = 0;
    let mut run = async |prefix: &str, replicas: &[&Replica]| {
        create(
            &ats,
            &ns,
            prefix,
            10,
            chrono::Utc::now(),
            chrono::Duration::zero(),
        )
        .await;
        ran += 10;
        all_done(&ats, ran, replicas).await;
    };

    // One Lease to two shards: the sharded replicas wait while the one Lease is held.
    let mut single = start("single", 1);
    let led = until(Duration::from_secs(30), async || {
        lease_holder(&admin, &lease_ns, "cnat").await
    });
    assert_eq!(
        led.await.as_deref(),
        Some("single"),
        "{}",
        single.log_text()
    );
    let (mut p, mut q) = (start("p", 2), start("q", 2));
    saw_another_layout(&[&p, &q]).await;
    let waited = until(Duration::from_secs(5), async || {
        any_shard_held(&admin, &lease_ns, 2).await.then_some(())
    });
    assert!(
        waited.await.is_none(),
        "a shard was taken while the one Lease was held"
    );
    run("one", &[&single, &p, &q]).await;
    single.terminate();
    settle_layout(&admin, &lease_ns, 2, &[&p, &q]).await;
    run("two", &[&p, &q]).await;

    // Two shards to three: the new replicas wait while the old ones lead.
    let (r, s) = (start("r", 3), start("s", 3));
    saw_another_layout(&[&r, &s]).await;
    let waited = until(Duration::from_secs(5), async || {
        any_shard_held(&admin, &lease_ns, 3).await.then_some(())
    });
    assert!(
        waited.await.is_none(),
        "a shard of three was taken while two led"
    );
    run("three", &[&p, &q, &r, &s]).await;
    p.terminate();
    q.terminate();
    settle_layout(&admin, &lease_ns, 3, &[&r, &s]).await;
    // Both stopped at once: each released its shards once it saw the other's membership Lease
    // gone, without waiting out its handover's limit for a successor.
    let released = |r: &Replica| {
        r.log_text()
            .matches("no other replica is left to take the lease over")
            .count()
    };
    assert!(
        released(&p) + released(&q) >= 1,
        "{}\n{}",
        p.log_text(),
        q.log_text()
    );
    run("four", &[&r, &s]).await;

    // Three shards to one Lease: the new replica takes it at once, the sharded ones give
    // theirs up within a few retry periods (500 ms here: a look, then a renewal, then the
    // step-down grace); both layouts lead for no longer than that.
    let single = start("single-again", 1);
    let started = tokio::time::Instant::now();
    let mut both = Duration::ZERO;
    let mut last = started;
    loop {
        let held = any_shard_held(&admin, &lease_ns, 3).await;
        let single_leads =
            lease_holder(&admin, &lease_ns, "cnat").await.as_deref() == Some("single-again");
        let now = tokio::time::Instant::now();
        if held && single_leads {
            both += now - last;
        }
        last = now;
        if !held && single_leads {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the shards were kept: {}\n{}",
            r.log_text(),
            s.log_text()
        );
    }
    assert!(
        both < Duration::from_secs(5),
        "both layouts led for {both:?}"
    );
    run("five", &[&single, &r, &s]).await;
    assert_eq!(creations.twice(), vec![], "pods created twice");
    assert_eq!(creations.pods(), 50);
}

/// Until each of `replicas` has looked at the Leases and seen another layout lead (so that a
/// window in which they take nothing tests something).
async fn saw_another_layout(replicas: &[&Replica]) {
    let saw = until(Duration::from_secs(30), async || {
        let all = replicas
            .iter()
            .all(|r| r.log_text().contains("\"another_layout_leads\":true"));
        all.then_some(())
    });
    if saw.await.is_none() {
        let logs: Vec<String> = replicas.iter().map(|r| r.log_text()).collect();
        panic!("another layout never seen\n{}", logs.join("\n---\n"));
    }
}

/// Until every shard of `--shards count` is led by one of `replicas`, their shares even.
async fn settle_layout(admin: &Client, lease_ns: &str, count: usize, replicas: &[&Replica]) {
    let settled = until(Duration::from_secs(30), async || {
        let mut held = Vec::new();
        for shard in 0..count {
            let name = cnat::leader::members::shard_lease_name("cnat", shard, count);
            held.push(lease_holder(admin, lease_ns, &name).await?);
        }
        let shares: Vec<usize> = replicas
            .iter()
            .map(|r| held.iter().filter(|h| **h == r.identity).count())
            .collect();
        let (min, max) = (shares.iter().min()?, shares.iter().max()?);
        (shares.iter().sum::<usize>() == count && max - min <= 1).then_some(())
    });
    if settled.await.is_none() {
        let logs: Vec<String> = replicas.iter().map(|r| r.log_text()).collect();
        panic!("the {count} shards never split\n{}", logs.join("\n---\n"));
    }
}
