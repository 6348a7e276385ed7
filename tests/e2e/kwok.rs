//! The fake nodes some real-server tests and the scale bench run their pods on
//! (`ControlPlane::kwok_nodes`, tests/support/kwok.yaml) end each pod as a kubelet would report
//! it: what the tests built on them take for granted, checked here.

use crate::support::until_some as until;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::Api;
use serde_json::json;
use std::time::Duration;

/// A pod of `restart` policy running `sh -c command`, with `annotations`.
fn pod(name: &str, restart: &str, command: &str, annotations: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "restartPolicy": restart,
            "containers": [{"name": "command", "image": "busybox:1.36",
                            "command": ["sh", "-c", command]}],
        },
    }))
    .expect("a Pod")
}

#[tokio::test]
async fn kwok_nodes_run_each_pod_and_end_it_with_its_exit_code() {
    let plane = crate::real_control_plane!();
    let admin = plane.admin().await;
    let _nodes = plane.kwok_nodes(&admin, 1, None).await;
    let ns = plane.namespace("kwok", &[]).await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    // (name, restart policy, command, annotations, phase, exit code)
    let cases = [
        ("succeeds", "Never", "true", json!({}), "Succeeded", 0),
        (
            "exits-3",
            "Never",
            "echo failing; exit 3\n",
            json!({}),
            "Failed",
            3,
        ),
        ("not-exit", "Never", "noexit 5", json!({}), "Succeeded", 0),
        ("wraps", "Never", "exit 300", json!({}), "Failed", 44),
        (
            "annotated",
            "Never",
            "true",
            json!({"kwok.cnat.dev/exit-code": "7"}),
            "Failed",
            7,
        ),
        (
            "runs-for",
            "Never",
            "sleep 2",
            json!({"kwok.cnat.dev/run-for": "2s"}),
            "Succeeded",
            0,
        ),
    ];
    for (name, restart, command, annotations, _, _) in &cases {
        pods.create(
            &PostParams::default(),
            &pod(name, restart, command, annotations.clone()),
        )
        .await
        .unwrap();
    }
    // A pod that restarts its container runs on: KWOK never ends it.
    pods.create(
        &PostParams::default(),
        &pod("serves", "Always", "exit 1", json!({})),
    )
    .await
    .unwrap();
    for (name, _, _, _, phase, code) in &cases {
        let ended = until(Duration::from_secs(60), async || {
            let pod = pods.get(name).await.ok()?;
            let status = pod.status?;
            matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")).then_some(status)
        })
        .await
        .unwrap_or_else(|| panic!("pod {name} did not end within 60 s"));
        assert_eq!(ended.phase.as_deref(), Some(*phase), "{name}: {ended:?}");
        let terminated = ended.container_statuses.as_ref().unwrap()[0]
            .state
            .as_ref()
            .and_then(|s| s.terminated.clone())
            .unwrap_or_else(|| panic!("{name}: no terminated state: {ended:?}"));
        assert_eq!(terminated.exit_code, *code, "{name}: {terminated:?}");
        assert_eq!(
            terminated.reason.as_deref(),
            Some(if *code == 0 { "Completed" } else { "Error" }),
            "{name}"
        );
        if *name == "runs-for" {
            // Ran about 2 s: its start and end (whole seconds) at least a second apart.
            let ran = (terminated.finished_at.unwrap().0)
                .duration_since(terminated.started_at.unwrap().0);
            assert!(ran.as_secs() >= 1, "runs-for ran {ran:?}");
        }
    }
    let serves = pods.get("serves").await.unwrap().status.unwrap();
    assert_eq!(serves.phase.as_deref(), Some("Running"), "{serves:?}");
}
