//! cnat's pod finalizer never outlives its purpose: a finished pod is let go once its outcome is
//! recorded, and `cnat release` (helm uninstall's pre-delete hook) lets go of the pods of Ats
//! still RUNNING, so that a namespace deleted while no replica runs goes.

use crate::lifecycle::{at, start_operator};
use crate::support::until_some as until;
use cnat::api::{At, Phase};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{DeleteParams, PostParams};
use kube::Api;
use std::time::Duration;

use cnat::operator::finalizer::is_present as held;

#[tokio::test]
async fn a_finished_pod_is_let_go_once_recorded_and_cnat_release_lets_go_of_the_rest() {
    let target = crate::e2e_target!();
    // The private control plane: this test plays the kubelet and runs the hook's command.
    let Some(plane) = target.plane else {
        return;
    };
    target.install_crd().await;
    let ns = target.namespace("release", &[]).await;
    let ats: Api<At> = Api::namespaced(target.client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(target.client.clone(), &ns);
    let operator = start_operator(&target.client, &ns);
    let now = chrono::Utc::now();
    for name in ["finished", "running"] {
        ats.create(&PostParams::default(), &at(name, now, "true"))
            .await
            .unwrap();
    }
    for name in ["finished", "running"] {
        let pod = format!("{name}-pod");
        let created = until(Duration::from_secs(30), async || {
            pods.get_opt(&pod).await.unwrap().filter(held)
        })
        .await;
        assert!(created.is_some(), "{pod} created with cnat's finalizer");
    }
    // One pod ends: once its At says DONE, the finalizer goes (the pod is left to whoever
    // deletes it).
    target.finish_pod(&ns, "finished-pod", 0, "").await;
    let released = until(Duration::from_secs(30), async || {
        let done = ats
            .get("finished")
            .await
            .unwrap()
            .status
            .is_some_and(|s| s.phase == Phase::Done);
        let pod = pods.get("finished-pod").await.unwrap();
        (done && !held(&pod)).then_some(())
    })
    .await;
    assert!(
        released.is_some(),
        "the finished pod still holds cnat's finalizer"
    );
    let running = ats.get("running").await.unwrap();
    assert_eq!(running.status.map(|s| s.phase), Some(Phase::Running));
    assert!(
        held(&pods.get("running-pod").await.unwrap()),
        "a running pod stays held"
    );

    // No replica runs any more; the namespace is deleted: the running pod's finalizer holds it.
    drop(operator);
    let namespaces: Api<Namespace> = Api::all(target.client.clone());
    namespaces
        .delete(&ns, &DeleteParams::default())
        .await
        .unwrap();
    if !plane.has_controller_manager() {
        return; // nothing deletes a namespace's contents without kube-controller-manager
    }
    let terminating = until(Duration::from_secs(60), async || {
        let pod = pods.get_opt("running-pod").await.unwrap()?;
        pod.metadata.deletion_timestamp.is_some().then_some(pod)
    })
    .await
    .expect("the namespace controller deletes the pod");
    assert!(held(&terminating), "kept by the finalizer");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        pods.get_opt("running-pod").await.unwrap().is_some(),
        "still kept"
    );
    assert!(namespaces.get_opt(&ns).await.unwrap().is_some());

    // The hook's command.
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_cnat"))
        .args(["release", "--namespace", &ns])
        .env("KUBECONFIG", &plane.kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(stdout.trim(), "released 1 pod(s) from cnat's finalizer");
    let gone = until(Duration::from_secs(90), async || {
        namespaces
            .get_opt(&ns)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert!(
        gone.is_some(),
        "namespace {ns} still there after cnat release"
    );
}
