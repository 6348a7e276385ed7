//! The Helm chart against a real API server: install with default values and with three
//! replicas, upgrade, rollback, uninstall. Every object must be accepted, and after uninstall
//! nothing cluster-scoped is left but the CRD (which Helm never deletes, as the chart README
//! says). No kubelet runs here, so the operator's pods stay Pending: this checks the objects,
//! not the pods' work (the other e2e tests run the operator itself).

use kube::api::ListParams;
use kube::core::{DynamicObject, GroupVersionKind};
use kube::discovery::Discovery;
use kube::Api;
use std::path::PathBuf;
use std::process::Command;

fn helm(kubeconfig: &std::path::Path, args: &[&str]) -> String {
    let helm = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/helm");
    assert!(
        helm.exists(),
        "no helm at {}: run scripts/fetch-helm",
        helm.display()
    );
    let output = Command::new(helm)
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env(
            "HELM_CACHE_HOME",
            std::env::temp_dir().join("cnat-e2e-helm-cache"),
        )
        .env(
            "HELM_CONFIG_HOME",
            std::env::temp_dir().join("cnat-e2e-helm-config"),
        )
        .env(
            "HELM_DATA_HOME",
            std::env::temp_dir().join("cnat-e2e-helm-data"),
        )
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "helm {args:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn kubectl(kubeconfig: &std::path::Path, args: &[&str]) {
    let output = Command::new("kubectl")
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Names of the objects of `kind` (cluster-scoped) labelled as this release's.
async fn released(
    client: &kube::Client,
    discovery: &Discovery,
    group: &str,
    version: &str,
    kind: &str,
) -> Vec<String> {
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let (resource, _) = discovery.resolve_gvk(&gvk).expect("a known kind");
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    api.list(&ListParams::default().labels("app.kubernetes.io/instance=cnat"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|o| o.metadata.name)
        .collect()
}

async fn replicas(client: &kube::Client) -> i32 {
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), "cnat-system");
    deployments
        .get("cnat")
        .await
        .unwrap()
        .spec
        .unwrap()
        .replicas
        .unwrap()
}

#[tokio::test]
async fn the_chart_installs_upgrades_rolls_back_and_uninstalls_on_a_real_server() {
    // Its webhooks are cluster-wide and no operator serves them here: a control plane of its own.
    let Some(plane) = crate::support::envtest::own_control_plane() else {
        return;
    };
    let admin = plane.admin().await;
    let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/cnat");
    let kubeconfig = &plane.kubeconfig;

    // An At from before (with the CRD applied first, as for an upgrade): uninstalling keeps it.
    // (While the chart is installed, its webhooks have no pods to answer: no At can be made.)
    crate::support::envtest::install_crd(&admin, &cnat::api::crd_yaml()).await;
    let ats: Api<cnat::api::At> = Api::namespaced(admin.clone(), "default");
    ats.create(
        &Default::default(),
        &crate::lifecycle::at(
            "kept",
            chrono::Utc::now() + chrono::Duration::days(1),
            "true",
        ),
    )
    .await
    .unwrap();

    // A CRD applied by hand (as charts before v1 required) is adopted as the chart README says.
    let crd = "crd/ats.cnat.programming-kubernetes.info";
    kubectl(
        kubeconfig,
        &[
            "annotate",
            crd,
            "meta.helm.sh/release-name=cnat",
            "meta.helm.sh/release-namespace=cnat-system",
        ],
    );
    kubectl(
        kubeconfig,
        &["label", crd, "app.kubernetes.io/managed-by=Helm"],
    );
    helm(
        kubeconfig,
        &[
            "install",
            "cnat",
            chart,
            "--namespace",
            "cnat-system",
            "--create-namespace",
        ],
    );
    let discovery = Discovery::new(admin.clone()).run().await.unwrap();
    let default_replicas = replicas(&admin).await;
    let cluster_scoped = [
        ("rbac.authorization.k8s.io", "v1", "ClusterRole"),
        ("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding"),
        (
            "admissionregistration.k8s.io",
            "v1",
            "ValidatingWebhookConfiguration",
        ),
        (
            "admissionregistration.k8s.io",
            "v1",
            "MutatingWebhookConfiguration",
        ),
    ];
    for (group, version, kind) in cluster_scoped {
        assert!(
            !released(&admin, &discovery, group, version, kind)
                .await
                .is_empty(),
            "no {kind} installed"
        );
    }
    // Every object of the release is on the server.
    let manifest = helm(
        kubeconfig,
        &["get", "manifest", "cnat", "--namespace", "cnat-system"],
    );
    let objects: Vec<serde_json::Value> = serde_saphyr::from_multiple(&manifest).unwrap();
    let objects: Vec<&serde_json::Value> = objects.iter().filter(|o| o.is_object()).collect();
    assert!(objects.len() >= 10, "{}", objects.len());
    for object in &objects {
        let (group, version) = match object["apiVersion"].as_str().unwrap().split_once('/') {
            Some((group, version)) => (group, version),
            None => ("", object["apiVersion"].as_str().unwrap()),
        };
        let kind = object["kind"].as_str().unwrap();
        let (resource, caps) = discovery
            .resolve_gvk(&GroupVersionKind::gvk(group, version, kind))
            .unwrap_or_else(|| panic!("{kind} is not served"));
        let name = object["metadata"]["name"].as_str().unwrap();
        let api: Api<DynamicObject> = match caps.scope {
            kube::discovery::Scope::Namespaced => {
                Api::namespaced_with(admin.clone(), "cnat-system", &resource)
            }
            kube::discovery::Scope::Cluster => Api::all_with(admin.clone(), &resource),
        };
        assert!(
            api.get_opt(name).await.unwrap().is_some(),
            "{kind} {name} missing"
        );
    }

    helm(
        kubeconfig,
        &[
            "upgrade",
            "cnat",
            chart,
            "--namespace",
            "cnat-system",
            "--set",
            "replicaCount=3",
        ],
    );
    assert_eq!(replicas(&admin).await, 3);
    helm(
        kubeconfig,
        &["rollback", "cnat", "1", "--namespace", "cnat-system"],
    );
    assert_eq!(replicas(&admin).await, default_replicas);

    // Without hooks: no kubelet runs the pre-delete hook's Job here, and helm would wait for it
    // (`tests/e2e/release.rs` runs the hook's command, `cnat release`).
    helm(
        kubeconfig,
        &[
            "uninstall",
            "cnat",
            "--namespace",
            "cnat-system",
            "--no-hooks",
        ],
    );
    for (group, version, kind) in cluster_scoped {
        let left = released(&admin, &discovery, group, version, kind).await;
        assert!(left.is_empty(), "{kind} left after uninstall: {left:?}");
    }
    assert!(
        ats.get_opt("kept").await.unwrap().is_some(),
        "the At went with the chart"
    );
    // The webhook certificate's Secret is kept on purpose (helm.sh/resource-policy: keep).
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(admin.clone(), "cnat-system");
    let kept: Vec<String> = secrets
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|s| s.metadata.name)
        .filter(|n| n.starts_with("cnat"))
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    // The CRD stays (helm.sh/resource-policy: keep), with every At in it.
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(admin.clone());
    assert!(crds
        .get_opt("ats.cnat.programming-kubernetes.info")
        .await
        .unwrap()
        .is_some());
}

#[tokio::test]
async fn the_chart_installs_with_three_replicas() {
    let Some(plane) = crate::support::envtest::own_control_plane() else {
        return;
    };
    let admin = plane.admin().await;
    let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/cnat");
    helm(
        &plane.kubeconfig,
        &[
            "install",
            "cnat",
            chart,
            "--namespace",
            "cnat-system",
            "--create-namespace",
            "--set",
            "replicaCount=3",
        ],
    );
    assert_eq!(replicas(&admin).await, 3);
    let budgets: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(admin.clone(), "cnat-system");
    assert_eq!(
        budgets.list(&Default::default()).await.unwrap().items.len(),
        1
    );
}
