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

/// `helm install` of the chart as release `cnat` in `cnat-system`, with `--set` values.
fn install(kubeconfig: &std::path::Path, sets: &[&str]) {
    let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/cnat");
    let mut args = vec![
        "install",
        "cnat",
        chart,
        "--namespace",
        "cnat-system",
        "--create-namespace",
    ];
    for set in sets {
        args.extend(["--set", set]);
    }
    helm(kubeconfig, &args);
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
    install(kubeconfig, &[]);
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

    uninstall(kubeconfig);
    for (group, version, kind) in cluster_scoped {
        let left = released(&admin, &discovery, group, version, kind).await;
        assert!(left.is_empty(), "{kind} left after uninstall: {left:?}");
    }
    assert!(
        ats.get_opt("kept").await.unwrap().is_some(),
        "the At went with the chart"
    );
    // In mode operator (the default) the chart renders no Secret: the replicas make theirs
    // (kept on uninstall, the operator's, not Helm's), and none ran here. Nothing is left.
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
    assert!(kept.is_empty(), "{kept:?}");
    // The CRD stays (helm.sh/resource-policy: keep), with every At in it.
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(admin.clone());
    assert!(crds
        .get_opt("ats.cnat.programming-kubernetes.info")
        .await
        .unwrap()
        .is_some());

    // A release whose chart generated its certificate (mode chart, as every release before mode
    // operator) keeps it on `helm upgrade` with the new default `auto` (what `--reset-values`, or
    // `--reuse-values` from a chart without the value, gives): a render without its caBundle
    // would delete it before any replica could write one.
    install(kubeconfig, &["webhook.certs.mode=chart"]);
    let bundle = || async {
        use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
        let configs: Api<MutatingWebhookConfiguration> = Api::all(admin.clone());
        let config = configs.get("cnat").await.unwrap();
        config.webhooks.unwrap()[0].client_config.ca_bundle.clone()
    };
    let generated = bundle().await;
    assert!(generated.is_some());
    let upgrade = ["upgrade", "cnat", chart, "--namespace", "cnat-system"];
    helm(kubeconfig, &[&upgrade[..], &["--reset-values"]].concat());
    assert_eq!(
        bundle().await,
        generated,
        "the upgrade kept the chart's caBundle"
    );
    let env = || async {
        let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
            Api::namespaced(admin.clone(), "cnat-system");
        let deployment = deployments.get("cnat").await.unwrap();
        let spec = deployment.spec.template.spec.unwrap();
        let env = spec.containers[0].env.clone().unwrap_or_default();
        env.into_iter().map(|e| e.name).collect::<Vec<_>>()
    };
    let names = env().await;
    assert!(
        names.contains(&"CNAT_TLS_CERT".to_owned())
            && !names.contains(&"CNAT_WEBHOOK_CERTS_SECRET".to_owned()),
        "{names:?}"
    );
    // Moved on purpose (upgrading.md): mode operator, no caBundle rendered any more.
    let moved = [
        &upgrade[..],
        &["--reuse-values", "--set", "webhook.certs.mode=operator"],
    ];
    helm(kubeconfig, &moved.concat());
    assert_eq!(
        bundle().await,
        None,
        "helm removed the caBundle it rendered before"
    );
    assert!(env()
        .await
        .contains(&"CNAT_WEBHOOK_CERTS_SECRET".to_owned()));
    uninstall(kubeconfig);
}

#[tokio::test]
async fn the_chart_installs_with_three_replicas() {
    let Some(plane) = crate::support::envtest::own_control_plane() else {
        return;
    };
    let admin = plane.admin().await;
    install(&plane.kubeconfig, &["replicaCount=3"]);
    assert_eq!(replicas(&admin).await, 3);
    let budgets: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(admin.clone(), "cnat-system");
    assert_eq!(
        budgets.list(&Default::default()).await.unwrap().items.len(),
        1
    );
}

/// One At of the policy test: its spec as given, with an image (the webhook's rules need one).
fn sample(name: &str, schedule: &str, zone: Option<&str>, command: &str) -> cnat::api::At {
    cnat::api::At::new(
        name,
        cnat::api::AtSpec {
            schedule: schedule.into(),
            time_zone: zone.map(str::to_owned),
            command: command.into(),
            template: cnat::api::AtPodTemplate {
                image: Some("busybox:1.36".into()),
                ..Default::default()
            },
            ..Default::default()
        },
    )
}

/// The chart's ValidatingAdmissionPolicy, rendered where the server serves it (1.30 and
/// later), refuses malformed Ats while no replica answers (`webhook.failurePolicy=Ignore`, no
/// pod runs here); on older servers it is not rendered and such Ats are admitted (the operator
/// then says `InvalidSpec`). Every sample is judged by the webhook's own rules too: the policy
/// refuses only what the webhook refuses.
#[tokio::test]
async fn the_admission_policy_refuses_malformed_ats_while_no_replica_answers() {
    use kube::api::{Patch, PatchParams, PostParams};
    // Its webhooks are cluster-wide: a control plane of its own.
    let Some(plane) = crate::support::envtest::own_control_plane() else {
        return;
    };
    let admin = plane.admin().await;
    install(&plane.kubeconfig, &["webhook.failurePolicy=Ignore"]);
    let manifest = helm(
        &plane.kubeconfig,
        &["get", "manifest", "cnat", "--namespace", "cnat-system"],
    );
    let served = plane.minor() >= 30;
    for kind in [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ] {
        assert_eq!(
            manifest.contains(&format!("kind: {kind}\n")),
            served,
            "{kind} on {}",
            plane.version
        );
    }
    let ats: Api<cnat::api::At> = Api::namespaced(admin.clone(), "default");
    let post = PostParams::default();
    let webhook_refuses =
        |at: &cnat::api::At| !cnat::admission::validation::spec_problems(at, None).is_empty();
    // The API server loads a new policy asynchronously: until it refuses the first bad At.
    let first_bad = sample("first-bad", "tomorrow noon", None, "true");
    assert!(webhook_refuses(&first_bad));
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let refused = loop {
        match ats.create(&post, &first_bad).await {
            Err(kube::Error::Api(status)) => break Some(status),
            Ok(_) if !served => break None,
            Ok(_) => {
                ats.delete("first-bad", &Default::default()).await.unwrap();
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the policy never applied"
                );
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            Err(other) => panic!("{other}"),
        }
    };
    if let Some(status) = refused {
        assert_eq!(status.code, 422, "{status:?}");
        assert!(
            status.message.contains("cnat-at-rules")
                && status.message.contains("At default/first-bad is invalid: spec.schedule: \"tomorrow noon\" is not a date and time"),
            "{}",
            status.message
        );
    }

    // What the webhook admits, the policy admits.
    let good = [
        ("2030-01-01T00:00:00Z", None, "true"),
        ("2030-01-01t00:00:00.5z", None, "true"),
        ("2030-01-01 10:00:00+05:30", None, "echo YAY"),
        ("2030-01-01T10:00:00\u{2212}05:00", None, "true"),
        ("2030-06-01T09:00:00", Some("Europe/Berlin"), "true"),
        (
            " 2030-6-1T9:00:00",
            Some("America/Argentina/Buenos_Aires"),
            "true",
        ),
        ("2030-01-01T00:00:00.25", Some("Etc/GMT+5"), "\u{a0}x"),
    ];
    for (i, (schedule, zone, command)) in good.into_iter().enumerate() {
        let at = sample(&format!("good-{i}"), schedule, zone, command);
        assert!(!webhook_refuses(&at), "{schedule:?} {zone:?}");
        ats.create(&post, &at)
            .await
            .unwrap_or_else(|e| panic!("{schedule:?} {zone:?} {command:?}: {e}"));
    }
    // What the policy refuses (the webhook too), by field.
    let bad = [
        ("2030-01-01", None, "true", "spec.schedule: \"2030-01-01\""),
        ("10:12", None, "true", "spec.schedule: \"10:12\""),
        ("", None, "true", "spec.schedule: \"\""),
        (
            "2030-06-01T09:00:00",
            Some("Berlin time"),
            "true",
            "spec.timeZone: \"Berlin time\" is not a time zone name",
        ),
        (
            "2030-01-01T00:00:00Z",
            None,
            " \t\n",
            "spec.command is blank (3 whitespace characters)",
        ),
        // A value with a line break: the rule's message, without the value.
        (
            "2030-01-01\nT00:00:00Z",
            None,
            "true",
            "denied request: spec.schedule is not a date and time",
        ),
    ];
    for (i, (schedule, zone, command, says)) in bad.into_iter().enumerate() {
        let at = sample(&format!("bad-{i}"), schedule, zone, command);
        assert!(webhook_refuses(&at), "{schedule:?} {zone:?} {command:?}");
        match ats.create(&post, &at).await {
            Err(kube::Error::Api(status)) if served => {
                assert!(status.message.contains(says), "{says}: {}", status.message)
            }
            Ok(_) if !served => {}
            other => panic!(
                "{schedule:?} {zone:?} {command:?} on {}: {other:?}",
                plane.version
            ),
        }
    }

    // An explicit null (kept by the CRD for nullable fields) is no value, as for the webhook.
    let dynamic: Api<DynamicObject> = Api::namespaced_with(
        admin.clone(),
        "default",
        &kube::core::ApiResource::erase::<cnat::api::At>(&()),
    );
    let with_null: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
        "metadata": {"name": "null-zone"},
        "spec": {"schedule": "2030-01-01T00:00:00Z", "timeZone": null, "command": "true",
                 "template": {"image": "busybox:1.36"}}}))
    .unwrap();
    dynamic
        .create(&post, &with_null)
        .await
        .expect("an At whose timeZone is null");

    // A spec is frozen once RUNNING; other changes are not.
    ats.patch_status(
        "good-0",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"status": {"phase": "Running"}})),
    )
    .await
    .unwrap();
    let changed = ats
        .patch(
            "good-0",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"command": "echo again"}})),
        )
        .await;
    match changed {
        Err(kube::Error::Api(status)) if served => assert!(
            status
                .message
                .contains("spec: cannot change once the At is Running"),
            "{}",
            status.message
        ),
        Ok(_) if !served => {}
        other => panic!("on {}: {other:?}", plane.version),
    }
    ats.patch(
        "good-0",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"labels": {"team": "a"}}})),
    )
    .await
    .expect("a label on a RUNNING At");
    // The shard label keeps its value: changed or removed, refused (by the webhook too).
    let mut labelled = sample("labelled", "2030-01-01T00:00:00Z", None, "true");
    let label = cnat::shard::LABEL;
    labelled.metadata.labels = Some([(label.to_owned(), "7".to_owned())].into());
    let stored = ats.create(&post, &labelled).await.unwrap();
    for (change, value) in [("changed", Some("8")), ("removed", None)] {
        let mut edited = stored.clone();
        let labels = edited.metadata.labels.get_or_insert_default();
        match value {
            Some(value) => labels.insert(label.to_owned(), value.to_owned()),
            None => labels.remove(label),
        };
        assert!(
            !cnat::admission::validation::spec_problems(&edited, Some(&stored)).is_empty(),
            "{change}"
        );
        let patch = serde_json::json!({"metadata": {"labels": {label: value}}});
        let result = ats
            .patch("labelled", &PatchParams::default(), &Patch::Merge(&patch))
            .await;
        match result {
            Err(kube::Error::Api(status)) if served => assert!(
                status.message.contains(&format!(
                    "At default/labelled is invalid: metadata.labels[{label}]: cannot change or be removed (it is \"7\")"
                )),
                "{change}: {}",
                status.message
            ),
            Ok(_) if !served => {}
            other => panic!("{change} on {}: {other:?}", plane.version),
        }
    }
    if served {
        ats.patch(
            "labelled",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {"team": "a"}}})),
        )
        .await
        .expect("another label beside the shard label");
    }
    // Nulls where nothing was: the same spec to the webhook, so to the policy.
    let nulls: json_patch::Patch = serde_json::from_value(serde_json::json!([
        {"op": "add", "path": "/spec/timeZone", "value": null},
        {"op": "add", "path": "/spec/activeDeadlineSeconds", "value": null}
    ]))
    .unwrap();
    ats.patch("good-0", &PatchParams::default(), &Patch::Json::<()>(nulls))
        .await
        .expect("nulls in the spec of a RUNNING At");
}

/// `helm uninstall` of the release, without hooks: no kubelet runs the pre-delete hook's Job
/// here, and helm would wait for it (`tests/e2e/release.rs` runs the hook's command).
fn uninstall(kubeconfig: &std::path::Path) {
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
}
