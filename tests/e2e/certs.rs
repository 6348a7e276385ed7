//! The webhook certificate the operator keeps (`webhook.certs.mode=operator`) on a real
//! kube-apiserver: three replicas as the chart's ServiceAccount, with exactly the chart's RBAC,
//! make one Secret, write their webhook configurations' caBundle and serve one certificate; the
//! configurations applied again as GitOps tools do (kubectl client-side twice, then server-side)
//! and a CA rotation, all under a stream of At creates, fail no admission.

use crate::lifecycle::at;
use crate::rbac::{apply, render};
use crate::support::envtest::{install_crd, ControlPlane, Replica};
use crate::support::service::Service;
use cnat::api::At;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The release's webhook configurations as the chart renders them, calling `service` by URL
/// (there is no kube-proxy here) with the host name `localhost`, for Ats in `ns` only.
fn configurations(objects: &[Value], service: std::net::SocketAddr, ns: &str) -> Vec<Value> {
    let mut configs: Vec<Value> = objects
        .iter()
        .filter(|o| {
            let kind = o["kind"].as_str().unwrap_or_default();
            kind.ends_with("WebhookConfiguration")
        })
        .cloned()
        .collect();
    assert_eq!(configs.len(), 2);
    for config in &mut configs {
        for hook in config["webhooks"].as_array_mut().unwrap() {
            assert!(
                hook["clientConfig"]["caBundle"].is_null(),
                "mode operator renders no caBundle: {hook}"
            );
            let path = hook["clientConfig"]["service"]["path"]
                .as_str()
                .unwrap()
                .to_owned();
            hook["clientConfig"] = json!({
                "url": format!("https://localhost:{}{path}", service.port()),
            });
            hook["namespaceSelector"] = json!({"matchLabels": {"kubernetes.io/metadata.name": ns}});
        }
    }
    configs
}

/// `kubectl apply` of `objects` (a YAML list), with `extra` arguments.
fn kubectl_apply(plane: &ControlPlane, objects: &[Value], extra: &[&str]) {
    let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
    let file = std::env::temp_dir().join(format!("cnat-certs-{}.json", std::process::id()));
    std::fs::write(&file, list.to_string()).unwrap();
    let output = plane
        .kubectl()
        .args(["apply", "-f"])
        .arg(&file)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "kubectl apply {extra:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The certificate `replica` serves, if `bundle` (PEM) trusts it for the name `localhost`.
async fn served(replica: &Replica, bundle: &[u8]) -> Option<Vec<u8>> {
    let ca = replica.log.with_extension("bundle.pem");
    std::fs::write(&ca, bundle).unwrap();
    let config = crate::support::https::trusting_config(&ca);
    let stream = tokio::net::TcpStream::connect(replica.webhook)
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, stream)
        .await
        .ok()?;
    Some(tls.get_ref().1.peer_certificates()?[0].to_vec())
}

fn key<'a>(secret: &'a Secret, key: &str) -> &'a [u8] {
    &secret.data.as_ref().unwrap()[key].0
}

/// The DER of the first certificate in `pem`.
fn der(pem: &[u8]) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .next()
        .unwrap()
        .unwrap()
        .to_vec()
}

/// The caBundle every webhook of the release's mutating configuration has (one, or a panic).
async fn bundle_in_configuration(admin: &Client, name: &str) -> Option<Vec<u8>> {
    let config = Api::<MutatingWebhookConfiguration>::all(admin.clone())
        .get(name)
        .await
        .unwrap();
    let bundles: Vec<Option<Vec<u8>>> = config
        .webhooks
        .unwrap_or_default()
        .iter()
        .map(|h| h.client_config.ca_bundle.as_ref().map(|b| b.0.clone()))
        .collect();
    assert!(bundles.windows(2).all(|w| w[0] == w[1]), "{bundles:?}");
    bundles.into_iter().next().flatten()
}

/// Creates an At every 100 ms until `stop`, counting failures.
fn stream_of_creates(
    admin: Client,
    ns: String,
    stop: Arc<AtomicBool>,
) -> (Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>) {
    let created = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let (count, failed) = (created.clone(), failures.clone());
    tokio::spawn(async move {
        let ats: Api<At> = Api::namespaced(admin, &ns);
        let due = chrono::Utc::now() + chrono::Duration::days(1);
        let mut n = 0;
        while !stop.load(Ordering::SeqCst) {
            n += 1;
            match ats
                .create(&PostParams::default(), &at(&format!("s-{n}"), due, "true"))
                .await
            {
                Ok(_) => {
                    count.fetch_add(1, Ordering::SeqCst);
                }
                Err(e) => failed.lock().unwrap().push(e.to_string()),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (created, failures)
}

#[tokio::test]
async fn replicas_keep_one_certificate_through_re_applies_and_a_ca_rotation() {
    let Some(plane) = crate::support::envtest::control_plane() else {
        return;
    };
    let admin = plane.admin().await;
    install_crd(&admin, &cnat::api::crd_yaml()).await;
    let ns = plane.namespace("certs", &[]).await;
    let fullname = format!("cnat-{ns}");
    let objects = render(
        &ns,
        &[
            format!("fullnameOverride={fullname}").as_str(),
            "webhook.certs.mode=operator",
        ],
    );
    let rbac: Vec<Value> = objects
        .iter()
        .filter(|o| {
            let kind = o["kind"].as_str().unwrap_or_default();
            kind.ends_with("Role") || kind.ends_with("RoleBinding") || kind == "ServiceAccount"
        })
        .filter(|o| o["metadata"]["annotations"]["helm.sh/hook"].is_null())
        .cloned()
        .collect();
    apply(&admin, &ns, &rbac).await;
    let service = Service::default();
    let address = service.start().await;
    let configs = configurations(&objects, address, &ns);
    kubectl_apply(plane, &configs, &[]);
    let secret_name = format!("{fullname}-webhook-certs");
    let flags = [
        format!("--namespace={ns}"),
        format!("--webhook-certs-secret={secret_name}"),
        format!("--webhook-configuration={fullname}"),
        format!("--webhook-service={fullname}-webhook"),
        "--webhook-cert-names=localhost".to_owned(),
        "--webhook-ca-overlap=5s".to_owned(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let user = format!("system:serviceaccount:{ns}:{fullname}");
    let replicas: Vec<Replica> = (0..3)
        .map(|i| plane.replica_as(&format!("cnat-{i}"), &ns, &flags, &user))
        .collect();
    for replica in &replicas {
        service.add(replica);
    }
    for replica in &replicas {
        service.wait_ready(replica).await;
    }
    let logs = || {
        replicas
            .iter()
            .map(|r| format!("--- {}\n{}", r.identity, r.log_text()))
            .collect::<String>()
    };

    // One Secret, its bundle in the configurations, its leaf served by every replica.
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), &ns);
    let secret = secrets.get(&secret_name).await.unwrap();
    let labels = secret.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("app.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("cnat")
    );
    let first_ca = key(&secret, "ca.crt").to_vec();
    let bundle = key(&secret, "ca-bundle.crt").to_vec();
    assert_eq!(
        bundle_in_configuration(&admin, &fullname).await,
        Some(bundle.clone()),
        "{}",
        logs()
    );
    for replica in &replicas {
        let serving = served(replica, &bundle).await;
        assert_eq!(
            serving,
            Some(der(key(&secret, "tls.crt"))),
            "{}",
            replica.identity
        );
    }

    // Under a stream of creates: the configurations applied again as they were, then
    // server-side, then a CA rotation asked for by hand.
    let stop = Arc::new(AtomicBool::new(false));
    let (created, failures) = stream_of_creates(admin.clone(), ns.clone(), stop.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    // cnat would write a removed caBundle back within a second: count its writes, so that an
    // apply that removed it cannot pass unseen.
    const WRITTEN: &str = "the webhook CA bundle written";
    let writes = || logs().matches(WRITTEN).count();
    let before = writes();
    kubectl_apply(plane, &configs, &[]);
    kubectl_apply(plane, &configs, &[]);
    assert_eq!(
        bundle_in_configuration(&admin, &fullname).await,
        Some(bundle.clone()),
        "client-side apply kept the caBundle"
    );
    kubectl_apply(
        plane,
        &configs,
        &["--server-side", "--field-manager=gitops"],
    );
    assert_eq!(
        bundle_in_configuration(&admin, &fullname).await,
        Some(bundle.clone()),
        "server-side apply kept the caBundle"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        writes(),
        before,
        "no apply removed the caBundle: {}",
        logs()
    );
    let rotate =
        json!({"metadata": {"annotations": {"cnat.programming-kubernetes.info/rotate": "ca"}}});
    secrets
        .patch(
            &secret_name,
            &PatchParams::default(),
            &Patch::Merge(&rotate),
        )
        .await
        .unwrap();
    // Published, switched after the overlap, the old CA retired after another: one CA again,
    // a new one, served by every replica.
    let rotated = crate::support::until_some(Duration::from_secs(90), async || {
        let secret = secrets.get(&secret_name).await.ok()?;
        let bundle = key(&secret, "ca-bundle.crt").to_vec();
        let one = cnat::certs::material::read(&bundle, "bundle").ok()?.len() == 1;
        (one && key(&secret, "ca.crt") != first_ca.as_slice()).then_some(secret)
    })
    .await
    .unwrap_or_else(|| panic!("no rotation within 90 s: {}", logs()));
    let bundle = key(&rotated, "ca-bundle.crt").to_vec();
    let configured = crate::support::until_some(Duration::from_secs(10), async || {
        (bundle_in_configuration(&admin, &fullname).await == Some(bundle.clone())).then_some(())
    });
    assert!(configured.await.is_some(), "{}", logs());
    for replica in &replicas {
        let want = der(key(&rotated, "tls.crt"));
        let serving = crate::support::until_some(Duration::from_secs(20), async || {
            (served(replica, &bundle).await.as_ref() == Some(&want)).then_some(())
        });
        assert!(
            serving.await.is_some(),
            "{} serves the old leaf: {}",
            replica.identity,
            logs()
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let failures = failures.lock().unwrap().clone();
    let created = created.load(Ordering::SeqCst);
    assert!(
        failures.is_empty(),
        "{} of {} creates failed: {failures:?}\n{}",
        failures.len(),
        created + failures.len(),
        logs()
    );
    assert!(created >= 30, "only {created} creates");
    // Nothing refused: the chart's RBAC is all the certificate keeper needs.
    let log = logs();
    assert!(!log.contains("cannot write the webhook"), "{log}");
    let injected = Api::<MutatingWebhookConfiguration>::all(admin.clone())
        .get(&fullname)
        .await
        .unwrap();
    let managers: Vec<String> = injected
        .metadata
        .managed_fields
        .unwrap_or_default()
        .iter()
        .filter_map(|m| m.manager.clone())
        .collect();
    assert!(
        managers.contains(&cnat::certs::FIELD_MANAGER.to_owned()),
        "{managers:?}"
    );
}
