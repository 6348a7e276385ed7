//! Readable logs when many Ats go at once: an At deleted while its reconcile was queued, and
//! events refused because their namespace is being deleted, are normal and logged at debug.

use crate::support::envtest::{install_crd, lease_holder};
use cnat::api::At;
use futures::StreamExt;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::Api;
use std::time::Duration;

#[tokio::test]
async fn deleting_a_thousand_ats_and_then_their_namespace_logs_no_warnings() {
    let plane = crate::real_control_plane!();
    let admin = plane.admin().await;
    install_crd(&admin, &cnat::api::crd_yaml()).await;
    let lease_ns = plane.namespace("mass-deletion-lease", &[]).await;
    let ns = plane.namespace("mass-deletion", &[]).await;
    let mut replica = plane.replica(
        "cnat-0",
        &lease_ns,
        &[&format!("--namespace={ns}"), "--log=info"],
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while lease_holder(&admin, &lease_ns, "cnat").await.as_deref() != Some("cnat-0") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never leader: {}",
            replica.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // 1000 Ats: half due now (their pods are created), half due in an hour.
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let (now, later) = (
        chrono::Utc::now(),
        chrono::Utc::now() + chrono::Duration::hours(1),
    );
    futures::stream::iter(0..1000)
        .for_each_concurrent(8, |i| {
            let ats = ats.clone();
            async move {
                let when = if i % 2 == 0 { now } else { later };
                let at = crate::lifecycle::at(&format!("at-{i}"), when, "true");
                ats.create(&PostParams::default(), &at).await.unwrap();
            }
        })
        .await;
    // Deleted at once while the leader is still busy with them. On a loaded machine the server
    // may take longer than the client's 30 s read timeout to delete a thousand objects in one
    // request: a second request deletes whatever is left.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while let Err(error) = ats
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the Ats were never deleted: {error}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !ats
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .is_empty()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the Ats are still there"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Then the namespace, while events about those Ats may still be queued.
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(admin.clone());
    namespaces
        .delete(&ns, &DeleteParams::default())
        .await
        .unwrap();
    if plane.has_controller_manager() {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        while namespaces.get_opt(&ns).await.unwrap().is_some() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "namespace {ns} not deleted"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = replica.log_text();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(r#""level":"WARN""#) || l.contains(r#""level":"ERROR""#))
        .filter(|l| !l.contains("Server cert bypassed"))
        .collect();
    assert!(
        warnings.is_empty(),
        "{} warnings, e.g.:\n{}",
        warnings.len(),
        warnings
            .iter()
            .take(5)
            .copied()
            .collect::<Vec<_>>()
            .join("\n")
    );
    // It did the work it was given (it is not quiet because it was idle).
    assert!(
        log.contains("PodCreated") || log.contains("pod created") || log.contains("RUNNING"),
        "{}",
        log.lines().take(20).collect::<Vec<_>>().join("\n")
    );
    replica.terminate();
}
