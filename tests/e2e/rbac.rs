//! The chart's RBAC on a real API server: its ClusterRole, Role and bindings, rendered by helm
//! and applied, and `cnat run` as the chart's ServiceAccount with exactly those rights: the
//! Lease (created, watched by name with a field selector under `resourceNames`, renewed), Ats
//! from PENDING to DONE, pods created and released, events. Then three such replicas: one
//! leader, a graceful handover, a killed leader replaced after the lease, one pod per At.

use crate::lifecycle::{at, event_reasons};
use crate::support::envtest::{lease_holder, wait_at, ControlPlane, Replica};
use cnat::api::{At, Outcome, Phase};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::Discovery;
use kube::{Api, Client};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// `helm template` of the chart into `namespace` with `sets`; every object rendered.
pub fn render(namespace: &str, sets: &[&str]) -> Vec<Value> {
    let helm = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/helm");
    assert!(
        helm.exists(),
        "no helm at {}: run scripts/fetch-helm",
        helm.display()
    );
    let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/cnat");
    let mut command = Command::new(helm);
    command.args(["template", "cnat", chart, "--namespace", namespace]);
    for set in sets {
        command.args(["--set", set]);
    }
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&String::from_utf8_lossy(&output.stdout)).unwrap();
    docs.into_iter().filter(Value::is_object).collect()
}

/// Applies `objects` (server-side apply, as `kubectl apply --server-side` would), namespaced
/// ones without a namespace into `namespace` (as helm does).
pub async fn apply(client: &Client, namespace: &str, objects: &[Value]) {
    let discovery = Discovery::new(client.clone()).run().await.unwrap();
    for object in objects {
        let object: DynamicObject = serde_json::from_value(object.clone()).unwrap();
        let types = object.types.clone().unwrap();
        let gvk = kube::core::GroupVersionKind::try_from(&types).unwrap();
        let (resource, caps) = discovery.resolve_gvk(&gvk).expect("a known kind");
        let api: Api<DynamicObject> = match caps.scope {
            kube::discovery::Scope::Namespaced => Api::namespaced_with(
                client.clone(),
                object.metadata.namespace.as_deref().unwrap_or(namespace),
                &resource,
            ),
            kube::discovery::Scope::Cluster => Api::all_with(client.clone(), &resource),
        };
        let name = object.metadata.name.clone().unwrap();
        api.patch(
            &name,
            &PatchParams::apply("cnat-e2e").force(),
            &Patch::Apply(&object),
        )
        .await
        .unwrap_or_else(|e| panic!("{} {name}: {e}", types.kind));
    }
}

/// The chart's RBAC objects for a release in `ns` (with `sets`), applied, with its
/// ServiceAccount.
async fn chart_rbac(plane: &ControlPlane, ns: &str, sets: &[&str]) {
    let admin = plane.admin().await;
    let rbac: Vec<Value> = render(ns, sets)
        .into_iter()
        .filter(|o| {
            let kind = o["kind"].as_str().unwrap_or_default();
            kind.ends_with("Role") || kind.ends_with("RoleBinding") || kind == "ServiceAccount"
        })
        // The helm test's own Role and ServiceAccount are not the operator's.
        .filter(|o| o["metadata"]["annotations"]["helm.sh/hook"].is_null())
        .collect();
    let kinds: Vec<&str> = rbac.iter().filter_map(|o| o["kind"].as_str()).collect();
    assert!(
        kinds.contains(&"ClusterRole") && kinds.contains(&"Role"),
        "{kinds:?}"
    );
    apply(&admin, ns, &rbac).await;
    let accounts: Api<ServiceAccount> = Api::namespaced(admin, ns);
    assert!(accounts.get_opt("cnat").await.unwrap().is_some());
}

fn as_chart_account(plane: &ControlPlane, identity: &str, ns: &str) -> Replica {
    plane.replica_as(
        identity,
        ns,
        &[&format!("--namespace={ns}")],
        &format!("system:serviceaccount:{ns}:cnat"),
    )
}

async fn wait_holder(
    client: &Client,
    ns: &str,
    want: impl Fn(Option<&str>) -> bool,
) -> Option<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let holder = lease_holder(client, ns, "cnat").await;
        if want(holder.as_deref()) {
            return holder;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "lease holder stayed {holder:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_chart_s_rbac_is_all_the_operator_needs() {
    // It changes cluster-wide objects (the CRD, the chart's ClusterRole): a control plane of its own.
    let Some(plane) = crate::support::envtest::own_control_plane() else {
        return;
    };
    let admin = plane.admin().await;
    crate::support::envtest::install_crd(&admin, &cnat::api::crd_yaml()).await;
    let ns = plane.namespace("rbac", &[]).await;
    chart_rbac(plane, &ns, &[]).await;
    let replica = as_chart_account(plane, "cnat-0", &ns);
    let holder = wait_holder(&admin, &ns, |h| h.is_some()).await;
    assert_eq!(holder.as_deref(), Some("cnat-0"), "{}", replica.log_text());

    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let due = chrono::Utc::now() + chrono::Duration::seconds(1);
    ats.create(&PostParams::default(), &at("ran", due, "true"))
        .await
        .unwrap();
    // Its pod never runs (no node here): cnat deletes it at the deadline (pods delete).
    let mut late = at("late", due, "sleep 600");
    late.spec.active_deadline_seconds = Some(1);
    ats.create(&PostParams::default(), &late).await.unwrap();
    wait_at(&ats, "ran", Duration::from_secs(30), |at| {
        at.status
            .as_ref()
            .is_some_and(|s| s.phase == Phase::Running)
    })
    .await;
    plane_kubelet(plane, &ns, "ran-pod", 0).await;
    let done = wait_at(&ats, "ran", Duration::from_secs(30), |at| {
        at.status.as_ref().is_some_and(|s| s.phase == Phase::Done)
    })
    .await;
    assert_eq!(done.status.unwrap().outcome, Some(Outcome::Succeeded));
    // Its pod deleted: the finalizer is removed with the rights the chart gives (pods patch).
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    pods.delete("ran-pod", &Default::default()).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while pods.get_opt("ran-pod").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "pod kept: {}",
            replica.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stopped = wait_at(&ats, "late", Duration::from_secs(30), |at| {
        at.status.as_ref().is_some_and(|s| s.phase == Phase::Done)
    })
    .await;
    let status = stopped.status.unwrap();
    assert_eq!(
        status.reason.as_deref(),
        Some("DeadlineExceeded"),
        "{status:?}"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while pods.get_opt("late-pod").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "pod past its deadline kept: {}",
            replica.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Events go out after the writes, at a lower priority: wait for it.
    let told = crate::support::until_some(Duration::from_secs(30), async || {
        let reasons = event_reasons(&admin, &ns, "ran").await;
        reasons.contains(&"Succeeded".to_owned()).then_some(())
    });
    assert!(
        told.await.is_some(),
        "no Succeeded event: {}",
        replica.log_text()
    );
    // Nothing was refused (403 Forbidden) in the log, the Lease watch by name among them.
    let log = replica.log_text();
    assert!(!log.to_lowercase().contains("forbidden"), "{log}");
    assert!(!log.contains("cannot watch the lease"), "{log}");

    with_shards(plane).await;
}

/// With `leaderElection.shards=2`: two replicas as the chart's ServiceAccount lead a shard
/// each (the shards' Leases, and each its membership Lease: created, renewed, listed), run an
/// At of each shard, and the other deletes the membership Lease of one killed; nothing refused.
async fn with_shards(plane: &'static ControlPlane) {
    let admin = plane.admin().await;
    let ns = plane.namespace("rbac-shards", &[]).await;
    chart_rbac(plane, &ns, &["leaderElection.shards=2"]).await;
    let user = format!("system:serviceaccount:{ns}:cnat");
    let flags = [format!("--namespace={ns}"), "--shards=2".to_owned()];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let first = plane.replica_as("cnat-a", &ns, &flags, &user);
    let mut second = plane.replica_as("cnat-b", &ns, &flags, &user);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let holders = [
            lease_holder(&admin, &ns, "cnat-0-of-2").await,
            lease_holder(&admin, &ns, "cnat-1-of-2").await,
        ];
        let mut held: Vec<&str> = holders.iter().flatten().map(String::as_str).collect();
        held.sort();
        if held == ["cnat-a", "cnat-b"] {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "shards never split: {holders:?}\n{}\n{}",
            first.log_text(),
            second.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // An At in each shard (labelled with the value the webhook would give).
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let shards = cnat::shard::Shards::new(2).unwrap();
    let due = chrono::Utc::now() + chrono::Duration::seconds(1);
    let mut names = Vec::new();
    for i in 0.. {
        let name = format!("at-{i}");
        let value = cnat::shard::assign(&format!("{ns}/{name}"));
        let labels = [(cnat::shard::LABEL.to_owned(), value)].into();
        if names.len() == shards.of(Some(&labels)) {
            let mut new = at(&name, due, "true");
            new.metadata.labels = Some(labels);
            ats.create(&PostParams::default(), &new).await.unwrap();
            names.push(name);
        }
        if names.len() == 2 {
            break;
        }
    }
    for name in &names {
        wait_at(&ats, name, Duration::from_secs(30), |at| {
            at.status
                .as_ref()
                .is_some_and(|s| s.phase == Phase::Running)
        })
        .await;
        plane_kubelet(plane, &ns, &format!("{name}-pod"), 0).await;
        wait_at(&ats, name, Duration::from_secs(30), |at| {
            at.status.as_ref().is_some_and(|s| s.phase == Phase::Done)
        })
        .await;
    }
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(admin.clone(), &ns);
    let member = cnat::leader::members::lease_name("cnat", "cnat-b");
    assert!(leases.get_opt(&member).await.unwrap().is_some());
    // Killed: the other replica deletes its membership Lease once it has been still for four
    // lease durations (3 s each here), with the rights the chart gives.
    second.kill();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while leases.get_opt(&member).await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "membership Lease kept: {}",
            first.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for log in [first.log_text(), second.log_text()] {
        assert!(!log.to_lowercase().contains("forbidden"), "{log}");
        assert!(!log.contains("cannot renew the membership Lease"), "{log}");
        assert!(!log.contains("could not delete"), "{log}");
    }
}

async fn plane_kubelet(plane: &'static ControlPlane, ns: &str, pod: &str, exit_code: i32) {
    crate::support::envtest::Target {
        client: plane.admin().await,
        kubelet: false,
        plane: Some(plane),
    }
    .finish_pod(ns, pod, exit_code, "")
    .await;
}

/// Three replicas on the real Lease: one leader; a graceful handover (SIGTERM) within 0.5 s; a
/// killed leader replaced after the lease duration; one pod per At throughout.
#[tokio::test]
async fn three_replicas_elect_one_leader_and_hand_over() {
    // It changes cluster-wide objects (the CRD, the chart's ClusterRole): a control plane of its own.
    let Some(plane) = crate::support::envtest::own_control_plane() else {
        return;
    };
    let admin = plane.admin().await;
    crate::support::envtest::install_crd(&admin, &cnat::api::crd_yaml()).await;
    let ns = plane.namespace("election", &[]).await;
    chart_rbac(plane, &ns, &[]).await;
    let mut replicas: Vec<Replica> = (0..3)
        .map(|i| as_chart_account(plane, &format!("cnat-{i}"), &ns))
        .collect();
    let first = wait_holder(&admin, &ns, |h| h.is_some()).await.unwrap();
    let names: Vec<String> = replicas.iter().map(|r| r.identity.clone()).collect();
    let index = |name: &str| names.iter().position(|n| n == name).unwrap();
    // Only one leads: every replica answers, and only one says it leads.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let leading = loop {
        let answers: Vec<Option<bool>> = replicas
            .iter()
            .map(|r| {
                crate::support::process::get(r.admin, "/metrics")
                    .map(|(_, body)| body.contains("\ncnat_leader 1\n"))
            })
            .collect();
        if answers.iter().all(Option::is_some) {
            break answers;
        }
        if tokio::time::Instant::now() >= deadline {
            let silent: Vec<String> = replicas
                .iter()
                .zip(&answers)
                .filter(|(_, answer)| answer.is_none())
                .map(|(r, _)| format!("{}:\n{}", r.identity, r.log_text()))
                .collect();
            panic!("not every replica serves metrics: {silent:#?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let leaders: Vec<&str> = replicas
        .iter()
        .zip(&leading)
        .filter(|(_, leads)| **leads == Some(true))
        .map(|(r, _)| r.identity.as_str())
        .collect();
    assert_eq!(leaders, [first.as_str()]);

    // Ats due during the handovers.
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let now = chrono::Utc::now();
    for i in 0..10 {
        let due = now + chrono::Duration::milliseconds(500 * i);
        ats.create(&PostParams::default(), &at(&format!("at-{i}"), due, "true"))
            .await
            .unwrap();
    }

    // Graceful: SIGTERM, the Lease is released and another takes it at once.
    let terminated = tokio::time::Instant::now();
    replicas[index(&first)].terminate();
    let second = wait_holder(&admin, &ns, |h| h.is_some_and(|h| h != first))
        .await
        .unwrap();
    let handover = terminated.elapsed();
    assert!(
        handover < Duration::from_millis(500),
        "graceful handover took {handover:?}"
    );

    // Killed: the Lease expires (3 s) and a third replica takes it.
    let killed = tokio::time::Instant::now();
    replicas[index(&second)].kill();
    let third = wait_holder(&admin, &ns, |h| {
        h.is_some_and(|h| h != first && h != second)
    })
    .await
    .unwrap();
    let replaced = killed.elapsed();
    assert!(
        replaced >= Duration::from_secs(2) && replaced < Duration::from_secs(10),
        "a killed leader was replaced after {replaced:?} (lease 3 s)"
    );
    assert!(replicas[index(&third)].child.try_wait().unwrap().is_none());

    // Every At got exactly one pod.
    for i in 0..10 {
        let name = format!("at-{i}");
        wait_at(&ats, &name, Duration::from_secs(30), |at| {
            at.status
                .as_ref()
                .is_some_and(|s| s.phase == Phase::Running)
        })
        .await;
    }
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let mut names: Vec<String> = pods
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    names.sort();
    let mut expected: Vec<String> = (0..10).map(|i| format!("at-{i}-pod")).collect();
    expected.sort();
    assert_eq!(names, expected);
    // Pod names are fixed, so a second create would only fail: the events say each pod was
    // created once, by whichever replica led then.
    for i in 0..10 {
        let told = event_reasons(&admin, &ns, &format!("at-{i}")).await;
        assert!(
            told.iter().filter(|r| *r == "PodCreated").count() <= 1,
            "at-{i}: {told:?}"
        );
    }
    for replica in &mut replicas {
        replica.kill();
    }
}
