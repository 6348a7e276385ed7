//! The Helm chart, rendered by a real `helm` (scripts/fetch-helm installs it into .tools/) for
//! several value sets, parsed into k8s-openapi types and checked: what users are promised about
//! replicas, upgrades, probes, pod security, least-privilege RBAC and webhook certificates.

use base64::Engine;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{PodTemplateSpec, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule, Role};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{pem::PemObject, CertificateDer, ServerName, UnixTime};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/cnat");

/// Helm 4 (`.tools/helm`), or Helm 3 (`.tools/helm3`), as scripts/fetch-helm installs them.
fn helm_named(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(".tools")
        .join(name);
    assert!(
        path.exists(),
        "no helm at {}: run scripts/fetch-helm (scripts/test does)",
        path.display()
    );
    path
}

fn helm() -> PathBuf {
    helm_named("helm")
}

/// `helm template` (Helm 4) with `--set` values; the rendered objects, or helm's error.
fn render(sets: &[&str]) -> Result<Vec<Value>, String> {
    render_with(&helm(), sets)
}

fn render_with(helm: &std::path::Path, sets: &[&str]) -> Result<Vec<Value>, String> {
    render_args(helm, &[], sets)
}

/// `helm template` with `args` besides the `--set` values.
fn render_args(helm: &std::path::Path, args: &[&str], sets: &[&str]) -> Result<Vec<Value>, String> {
    let mut command = Command::new(helm);
    command.args(["template", "cnat", CHART, "--namespace", "cnat-system"]);
    command.args(args);
    for set in sets {
        command.args(["--set", set]);
    }
    let output = command.output().unwrap();
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&String::from_utf8_lossy(&output.stdout)).unwrap();
    Ok(docs.into_iter().filter(|d| d.is_object()).collect())
}

struct Rendered(Vec<Value>);

impl Rendered {
    fn new(sets: &[&str]) -> Self {
        Rendered(render(sets).unwrap_or_else(|e| panic!("helm template {sets:?}: {e}")))
    }

    fn all<T: DeserializeOwned>(&self, kind: &str) -> Vec<T> {
        self.0
            .iter()
            .filter(|d| d["kind"] == kind)
            .map(|d| serde_json::from_value(d.clone()).unwrap_or_else(|e| panic!("{kind}: {e}")))
            .collect()
    }

    fn one<T: DeserializeOwned>(&self, kind: &str) -> T {
        let mut all = self.all(kind);
        assert_eq!(all.len(), 1, "expected one {kind}");
        all.remove(0)
    }

    fn named<T: DeserializeOwned>(&self, kind: &str, name: &str) -> T {
        let doc = self
            .0
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"));
        serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{kind} {name}: {e}"))
    }

    /// The operator Deployment's pod template.
    fn pod_template(&self) -> PodTemplateSpec {
        let deployment: Deployment = self.one("Deployment");
        deployment.spec.template
    }

    fn kinds(&self) -> Vec<String> {
        let mut kinds: Vec<String> = self
            .0
            .iter()
            .map(|d| d["kind"].as_str().unwrap().to_owned())
            .collect();
        kinds.sort();
        kinds
    }
}

/// `helm lint --strict` with `helm`; its report when the chart does not pass.
fn lint_strictly(helm: &std::path::Path) -> Result<(), String> {
    let output = Command::new(helm)
        .args(["lint", "--strict", CHART])
        .output()
        .unwrap();
    match output.status.success() {
        true => Ok(()),
        false => Err(String::from_utf8_lossy(&output.stdout).into_owned()),
    }
}

#[test]
fn the_chart_lints_strictly() {
    if let Err(report) = lint_strictly(&helm()) {
        panic!("{report}");
    }
}

#[test]
fn the_chart_crd_is_the_generated_crd() {
    let chart = std::fs::read_to_string(format!("{CHART}/files/at.yaml")).unwrap();
    assert!(
        chart == cnat::api::crd_yaml(),
        "charts/cnat/files/at.yaml is out of date: cp crds/at.yaml charts/cnat/files/"
    );
}

#[test]
fn defaults_run_two_replicas_that_upgrade_without_losing_one() {
    let rendered = Rendered::new(&[]);
    let deployment: Deployment = rendered.one("Deployment");
    let spec = deployment.spec;
    assert_eq!(spec.replicas, Some(2));
    let rolling = spec.strategy.unwrap().rolling_update.unwrap();
    assert_eq!(serde_json::to_value(rolling.max_unavailable).unwrap(), 0);
    assert_eq!(serde_json::to_value(rolling.max_surge).unwrap(), 1);

    let pod = spec.template.spec.unwrap();
    let container = &pod.containers[0];
    assert_eq!(container.args.clone().unwrap(), ["run"]);
    let env: Vec<(String, Option<String>, Option<String>)> = container
        .env
        .iter()
        .flatten()
        .map(|e| {
            let field = e
                .value_from
                .as_ref()
                .and_then(|v| v.field_ref.as_ref())
                .map(|f| f.field_path.clone());
            (e.name.clone(), e.value.clone(), field)
        })
        .collect();
    assert!(env.contains(&("POD_NAME".into(), None, Some("metadata.name".into()))));
    assert!(env.contains(&(
        "POD_NAMESPACE".into(),
        None,
        Some("metadata.namespace".into())
    )));
    assert!(env.contains(&("CNAT_LOG_FORMAT".into(), Some("json".into()), None)));
    let liveness = container
        .liveness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    let readiness = container
        .readiness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    assert_eq!(
        (liveness.path.as_deref(), readiness.path.as_deref()),
        (Some("/healthz"), Some("/readyz"))
    );

    // Graceful shutdown fits: the grace period outlasts the operator's own shutdown timeout.
    let timeout = env
        .iter()
        .find(|e| e.0 == "CNAT_SHUTDOWN_TIMEOUT")
        .and_then(|e| e.1.clone())
        .unwrap();
    assert_eq!(timeout, "25s");
    assert!(pod.termination_grace_period_seconds.unwrap() > 25);

    // Spread across nodes.
    let anti = pod.affinity.unwrap().pod_anti_affinity.unwrap();
    let term = &anti
        .preferred_during_scheduling_ignored_during_execution
        .unwrap()[0]
        .pod_affinity_term;
    assert_eq!(term.topology_key, "kubernetes.io/hostname");

    let pdb: PodDisruptionBudget = rendered.one("PodDisruptionBudget");
    assert_eq!(
        serde_json::to_value(pdb.spec.unwrap().min_available).unwrap(),
        1
    );
}

#[test]
fn a_replica_listing_many_ats_is_started_by_readiness_and_not_killed_by_liveness() {
    let probe = |sets: &[&str]| {
        let deployment: Deployment = Rendered::new(sets).one("Deployment");
        let pod = deployment.spec.template.spec.unwrap();
        pod.containers[0].startup_probe.clone().unwrap()
    };
    let startup = probe(&[]);
    let get = startup.http_get.as_ref().unwrap();
    assert_eq!(get.path.as_deref(), Some("/readyz"));
    assert_eq!(
        serde_json::to_value(&get.port).unwrap(),
        serde_json::json!("admin")
    );
    assert_eq!(
        (startup.period_seconds, startup.failure_threshold),
        (Some(2), Some(300)),
        "600 s by default"
    );
    let sized = probe(&[
        "startupProbe.periodSeconds=5",
        "startupProbe.failureThreshold=720",
    ]);
    assert_eq!(
        (sized.period_seconds, sized.failure_threshold),
        (Some(5), Some(720))
    );
}

#[test]
fn the_operator_pod_runs_locked_down() {
    let pod = Rendered::new(&[]).pod_template().spec.unwrap();
    let psc = pod.security_context.unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    assert!(psc.run_as_user.unwrap() > 0);
    assert_eq!(psc.seccomp_profile.unwrap().type_, "RuntimeDefault");
    let sc = pod.containers[0].security_context.clone().unwrap();
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.capabilities.unwrap().drop.unwrap(), ["ALL"]);
    // In mode chart the certificate Secret is mounted whole: a subPath mount never sees a
    // renewed certificate. (In mode operator, the default, nothing is mounted.)
    let pod = Rendered::new(&["webhook.certs.mode=chart"])
        .pod_template()
        .spec
        .unwrap();
    let mounts = pod.containers[0].volume_mounts.clone().unwrap();
    assert!(mounts.iter().all(|m| m.sub_path.is_none()));
    assert_eq!(mounts[0].mount_path, "/etc/cnat/tls");
}

fn rule(groups: &[&str], resources: &[&str], verbs: &[&str], names: Option<&[&str]>) -> PolicyRule {
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    PolicyRule {
        api_groups: Some(strings(groups)),
        resources: Some(strings(resources)),
        verbs: strings(verbs),
        resource_names: names.map(strings),
        non_resource_urls: None,
    }
}

#[test]
fn rbac_is_exactly_what_the_operator_uses() {
    let rendered = Rendered::new(&[]);
    let cluster: ClusterRole = rendered.one("ClusterRole");
    assert_eq!(
        cluster.rules.unwrap(),
        [
            rule(
                &["cnat.programming-kubernetes.info"],
                &["ats"],
                &["get", "list", "watch", "delete"],
                None
            ),
            rule(
                &["cnat.programming-kubernetes.info"],
                &["ats/status"],
                &["patch"],
                None
            ),
            rule(
                &[""],
                &["pods"],
                &["get", "list", "watch", "create", "patch", "delete"],
                None
            ),
            rule(&["events.k8s.io"], &["events"], &["create", "patch"], None),
            // The webhook certificate cnat keeps (webhook.certs.mode operator, the default for
            // a new install): the caBundle of its own configurations and of the At CRD.
            rule(
                &["admissionregistration.k8s.io"],
                &[
                    "mutatingwebhookconfigurations",
                    "validatingwebhookconfigurations"
                ],
                &["get", "list", "watch", "patch"],
                Some(&["cnat"])
            ),
            rule(
                &["apiextensions.k8s.io"],
                &["customresourcedefinitions"],
                &["get", "list", "watch", "patch"],
                Some(&["ats.cnat.programming-kubernetes.info"])
            ),
            rule(
                &["authorization.k8s.io"],
                &["subjectaccessreviews"],
                &["create"],
                None
            ),
        ]
    );
    // Without the escalation guard, no access reviews; with the chart's certificate, nothing
    // for webhook configurations or CRDs.
    let unguarded: ClusterRole =
        Rendered::new(&["webhook.accessReview.enabled=false"]).one("ClusterRole");
    assert_eq!(unguarded.rules.unwrap().len(), 6);
    for sets in [
        "webhook.certs.mode=chart",
        "certManager.enabled=true",
        "webhook.certs.existingSecret=mine",
    ] {
        let rendered = render(&[sets, "webhook.certs.caBundle=Q0E="]).unwrap();
        let rules = |kind: &str| {
            rendered
                .iter()
                .filter(|o| o["kind"] == kind)
                .flat_map(|o| o["rules"].as_array().cloned().unwrap_or_default())
                .map(|r| r.to_string())
                .collect::<String>()
        };
        let (cluster, roles) = (rules("ClusterRole"), rules("Role"));
        assert!(
            !cluster.contains("webhookconfigurations")
                && !cluster.contains("customresourcedefinitions"),
            "{sets}: {cluster}"
        );
        assert!(!roles.contains("webhook-certs"), "{sets}: {roles}");
    }
    let role: Role = rendered
        .all::<Role>("Role")
        .into_iter()
        .find(|r| r.metadata.name.as_deref() == Some("cnat-leader-election"))
        .unwrap();
    assert_eq!(role.metadata.namespace.as_deref(), Some("cnat-system"));
    assert_eq!(
        role.rules.unwrap(),
        [
            rule(
                &["coordination.k8s.io"],
                &["leases"],
                &["get", "list", "watch", "patch"],
                Some(&["cnat"])
            ),
            rule(&["coordination.k8s.io"], &["leases"], &["create"], None),
            // The pod signing key's Secret, which the first replica that needs it makes.
            rule(&[""], &["secrets"], &["get"], Some(&["cnat-pod-signing"])),
            rule(&[""], &["secrets"], &["create"], None),
            // The webhook certificate's Secret, which the first replica makes.
            rule(
                &[""],
                &["secrets"],
                &["get", "list", "watch", "update"],
                Some(&["cnat-webhook-certs"])
            ),
        ]
    );
    // The replicas are told that Secret's name.
    let deployment: Value = rendered.one("Deployment");
    let env = &deployment["spec"]["template"]["spec"]["containers"][0]["env"];
    assert!(
        env.as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "CNAT_POD_SIGNING_SECRET" && e["value"] == "cnat-pod-signing"),
        "{env}"
    );
    // The only other Roles are the helm test hook's and the uninstall hook's (see below).
    assert_eq!(rendered.all::<Value>("ClusterRole").len(), 1);
    assert_eq!(rendered.all::<Value>("Role").len(), 3);
}

/// In mode chart, the webhook configurations point at the Service and trust a CA that signed
/// the served certificate.
#[test]
fn the_webhooks_trust_the_certificate_the_pods_serve() {
    let rendered = Rendered::new(&["webhook.certs.mode=chart"]);
    let service: Service = rendered.named("Service", "cnat-webhook");
    assert_eq!(service.metadata.name.as_deref(), Some("cnat-webhook"));
    let secret: Secret = rendered.one("Secret");
    let data = secret.data.unwrap();
    let validating: ValidatingWebhookConfiguration = rendered.one("ValidatingWebhookConfiguration");
    let mutating: MutatingWebhookConfiguration = rendered.one("MutatingWebhookConfiguration");
    let v = &validating.webhooks.unwrap()[0];
    let m = &mutating.webhooks.unwrap()[0];
    for (client, path) in [
        (&v.client_config, "/validating"),
        (&m.client_config, "/mutating"),
    ] {
        let svc = client.service.as_ref().unwrap();
        assert_eq!(
            (
                svc.name.as_str(),
                svc.namespace.as_str(),
                svc.path.as_deref()
            ),
            ("cnat-webhook", "cnat-system", Some(path))
        );
        assert_eq!(client.ca_bundle.as_ref().unwrap().0, data["ca.crt"].0);
    }
    assert_eq!(
        (v.side_effects.as_str(), v.failure_policy.as_deref()),
        ("None", Some("Fail"))
    );
    assert_eq!(v.admission_review_versions, ["v1"]);
    assert_eq!(m.reinvocation_policy.as_deref(), Some("IfNeeded"));
    // The CRD's conversion webhook: the same Service and CA, path /convert.
    let crd: CustomResourceDefinition = rendered.one("CustomResourceDefinition");
    let conversion = crd.spec.conversion.unwrap();
    assert_eq!(conversion.strategy, "Webhook");
    let conversion = conversion.webhook.unwrap();
    assert_eq!(conversion.conversion_review_versions, ["v1"]);
    let client = conversion.client_config.unwrap();
    let svc = client.service.unwrap();
    assert_eq!(
        (
            svc.name.as_str(),
            svc.namespace.as_str(),
            svc.path.as_deref(),
            svc.port
        ),
        ("cnat-webhook", "cnat-system", Some("/convert"), Some(443))
    );
    assert_eq!(client.ca_bundle.unwrap().0, data["ca.crt"].0);
    // Both versions are reviewed, each in its own version (Equivalent covers the other's writes).
    for hook in [v.rules.clone().unwrap(), m.rules.clone().unwrap()] {
        assert_eq!(hook[0].api_versions.as_deref().unwrap(), ["v1", "v1alpha1"]);
    }
    let resources = v.rules.clone().unwrap()[0].resources.clone().unwrap();
    // Not ats/status: the operator's status writes never depend on the webhook.
    assert_eq!(resources, ["ats"]);
    let operations = v.rules.clone().unwrap()[0].operations.clone().unwrap();
    assert_eq!(
        operations,
        ["CREATE", "UPDATE"],
        "not DELETE: the TTL deletes Ats"
    );

    // The generated certificate verifies against the caBundle for the name kube-apiserver checks.
    let roots = {
        let mut store = rustls::RootCertStore::empty();
        store
            .add(CertificateDer::from_pem_slice(&data["ca.crt"].0).unwrap())
            .unwrap();
        Arc::new(store)
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider)
        .build()
        .unwrap();
    let leaf = CertificateDer::from_pem_slice(&data["tls.crt"].0).unwrap();
    let name = ServerName::try_from("cnat-webhook.cnat-system.svc").unwrap();
    verifier
        .verify_server_cert(&leaf, &[], &name, &[], UnixTime::now())
        .expect("the certificate verifies");
    let elsewhere = ServerName::try_from("cnat-webhook.other.svc").unwrap();
    assert!(verifier
        .verify_server_cert(&leaf, &[], &elsewhere, &[], UnixTime::now())
        .is_err());
}

#[test]
fn replica_count_scales_and_a_single_replica_has_no_pdb() {
    let three = Rendered::new(&["replicaCount=3"]);
    assert_eq!(three.one::<Deployment>("Deployment").spec.replicas, Some(3));
    assert_eq!(three.all::<Value>("PodDisruptionBudget").len(), 1);
    let one = Rendered::new(&["replicaCount=1"]);
    assert!(
        one.all::<Value>("PodDisruptionBudget").is_empty(),
        "a PDB would block every drain"
    );
}

#[test]
fn cert_manager_issues_and_injects_the_certificate() {
    let rendered = Rendered::new(&["certManager.enabled=true"]);
    assert!(
        rendered.all::<Value>("Secret").is_empty(),
        "cert-manager owns the Secret"
    );
    let certificate = &rendered.all::<Value>("Certificate")[0];
    assert_eq!(certificate["spec"]["secretName"], "cnat-webhook-tls");
    assert_eq!(
        certificate["spec"]["dnsNames"][0],
        "cnat-webhook.cnat-system.svc"
    );
    assert_eq!(certificate["spec"]["issuerRef"]["name"], "cnat-selfsigned");
    assert_eq!(rendered.all::<Value>("Issuer").len(), 1);
    let validating: ValidatingWebhookConfiguration = rendered.one("ValidatingWebhookConfiguration");
    let annotations = validating.metadata.annotations.unwrap();
    assert_eq!(
        annotations["cert-manager.io/inject-ca-from"],
        "cnat-system/cnat-webhook"
    );
    assert!(validating.webhooks.unwrap()[0]
        .client_config
        .ca_bundle
        .is_none());
    let crd: CustomResourceDefinition = rendered.one("CustomResourceDefinition");
    assert_eq!(
        crd.metadata.annotations.unwrap()["cert-manager.io/inject-ca-from"],
        "cnat-system/cnat-webhook"
    );
    let conversion = crd.spec.conversion.unwrap().webhook.unwrap();
    assert!(conversion.client_config.unwrap().ca_bundle.is_none());

    let own_issuer = Rendered::new(&[
        "certManager.enabled=true",
        "certManager.issuerRef.name=corp-ca",
        "certManager.issuerRef.kind=ClusterIssuer",
    ]);
    assert!(own_issuer.all::<Value>("Issuer").is_empty());
    assert_eq!(
        own_issuer.all::<Value>("Certificate")[0]["spec"]["issuerRef"]["kind"],
        "ClusterIssuer"
    );
}

#[test]
fn a_user_provided_secret_is_mounted_with_its_ca() {
    let bundle = base64::engine::general_purpose::STANDARD.encode("-----BEGIN CERTIFICATE-----\n");
    let rendered = Rendered::new(&[
        "webhook.certs.existingSecret=my-tls",
        &format!("webhook.certs.caBundle={bundle}"),
    ]);
    assert!(rendered.all::<Value>("Secret").is_empty());
    let volumes = rendered.pod_template().spec.unwrap().volumes.unwrap();
    assert_eq!(
        volumes[0].secret.as_ref().unwrap().secret_name.as_deref(),
        Some("my-tls")
    );
    let validating: ValidatingWebhookConfiguration = rendered.one("ValidatingWebhookConfiguration");
    let ca = validating.webhooks.unwrap()[0]
        .client_config
        .ca_bundle
        .clone()
        .unwrap();
    assert_eq!(ca.0, b"-----BEGIN CERTIFICATE-----\n");
    let crd: CustomResourceDefinition = rendered.one("CustomResourceDefinition");
    let conversion = crd.spec.conversion.unwrap().webhook.unwrap();
    assert_eq!(conversion.client_config.unwrap().ca_bundle, Some(ca));

    let missing = render(&["webhook.certs.existingSecret=my-tls"]).unwrap_err();
    assert!(
        missing.contains("webhook.certs.caBundle is required"),
        "{missing}"
    );
}

#[test]
fn a_client_ca_secret_makes_the_webhooks_require_the_api_server_s_certificate() {
    let open = Rendered::new(&[]);
    assert!(!plain_env(&open).contains_key("CNAT_WEBHOOK_CLIENT_CA"));
    let rendered = Rendered::new(&["webhook.clientCASecret=apiserver-client-ca"]);
    let env = plain_env(&rendered);
    assert_eq!(
        env["CNAT_WEBHOOK_CLIENT_CA"],
        "/etc/cnat/webhook-client-ca/ca.crt"
    );
    let pod = rendered.pod_template().spec.unwrap();
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "webhook-client-ca")
        .expect("the client CA volume");
    let secret = volume.secret.as_ref().unwrap();
    assert_eq!(secret.secret_name.as_deref(), Some("apiserver-client-ca"));
    assert_eq!(secret.items.as_ref().unwrap()[0].key, "ca.crt");
    let mounted =
        pod.containers[0].volume_mounts.iter().flatten().any(|m| {
            m.name == "webhook-client-ca" && m.mount_path == "/etc/cnat/webhook-client-ca"
        });
    assert!(mounted);
    // The flag it sets is one `cnat run` has.
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_cnat"))
        .args(["run", "--help"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("[env: CNAT_WEBHOOK_CLIENT_CA=]"));
}

#[test]
fn bad_values_are_rejected_by_the_schema() {
    for (set, complaint) in [
        ("replicaCount=0", "/replicaCount"),
        ("logs.format=xml", "/logs/format"),
        ("webhook.failurePolicy=Sometimes", "/webhook/failurePolicy"),
        ("webhook.certs.mode=manual", "/webhook/certs/mode"),
        ("webhook.certs.caOverlap=soon", "/webhook/certs/caOverlap"),
        ("webhook.timeoutSeconds=60", "/webhook/timeoutSeconds"),
        (
            "leaderElection.leaseDuration=soon",
            "/leaderElection/leaseDuration",
        ),
        ("replicas=3", "additional properties 'replicas' not allowed"),
        ("tracing.protocol=http/json", "/tracing/protocol"),
        (
            "startupProbe.failureThreshold=0",
            "/startupProbe/failureThreshold",
        ),
        (
            "runDefaults.limits.memory=lots",
            "/runDefaults/limits/memory",
        ),
        (
            "runDefaults.activeDeadlineSeconds=0",
            "/runDefaults/activeDeadlineSeconds",
        ),
        (
            "runDefaults.ttlSecondsAfterFinished=-1",
            "/runDefaults/ttlSecondsAfterFinished",
        ),
        (
            "runDefaults.cpu=1",
            "additional properties 'cpu' not allowed",
        ),
        ("runDefaults.image=", "/runDefaults/image"),
        (
            "runDefaults.imagePullPolicy=Sometimes",
            "/runDefaults/imagePullPolicy",
        ),
        (
            "webhook.accessReview.onError=maybe",
            "/webhook/accessReview/onError",
        ),
        (
            "webhook.accessReview.keepWarm=2 minutes",
            "/webhook/accessReview/keepWarm",
        ),
        ("tracing.samplingRatio=2", "/tracing/samplingRatio"),
        ("tracing.samplingRatio=half", "/tracing/samplingRatio"),
        (
            "tracing.otlpEndpoint=otel-collector:4317",
            "/tracing/otlpEndpoint",
        ),
        (
            "tracing.otlpEndpoint=ftp://otel-collector:4317",
            "/tracing/otlpEndpoint",
        ),
        ("tracing.tls.caSecret=Collector_CA", "/tracing/tls/caSecret"),
        (
            "tracing.tls.clientSecret=-client",
            "/tracing/tls/clientSecret",
        ),
        (
            "tracing.tls.certificate=x",
            "additional properties 'certificate' not allowed",
        ),
        (
            "metrics.serviceMonitor.interval=often",
            "/metrics/serviceMonitor/interval",
        ),
        (
            "metrics.prometheusRule.overdue.for=soon",
            "/metrics/prometheusRule/overdue/for",
        ),
        (
            "metrics.prometheusRule.reconcileErrors.ratio=2",
            "/metrics/prometheusRule/reconcileErrors/ratio",
        ),
        (
            "metrics.prometheusRule.runbookUrl=README.md",
            "/metrics/prometheusRule/runbookUrl",
        ),
        (
            "metrics.prometheusRule.pagers=on",
            "additional properties 'pagers' not allowed",
        ),
    ] {
        let error = render(&[set]).unwrap_err();
        assert!(
            error.contains("don't meet the specifications of the schema")
                && error.contains(complaint),
            "{set}: {error}"
        );
    }
}

#[test]
fn the_default_install_renders_exactly_these_objects() {
    // Including the helm test hook's ServiceAccount, Role, RoleBinding and Pod, and the
    // pre-delete hook's Role, RoleBinding and Job (`cnat release --stop-deployment`).
    let expected = [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "Job",
        "MutatingWebhookConfiguration",
        "NetworkPolicy",
        "Pod",
        "PodDisruptionBudget",
        "Role",
        "Role",
        "Role",
        "RoleBinding",
        "RoleBinding",
        "RoleBinding",
        "Service",
        "Service",
        "ServiceAccount",
        "ServiceAccount",
        "ValidatingWebhookConfiguration",
    ];
    assert_eq!(Rendered::new(&[]).kinds(), expected);
}

/// The ValidatingAdmissionPolicy (and its binding) come where the cluster serves the API, unless
/// told not to; `helm template` without `--api-versions` leaves them out.
#[test]
fn the_admission_policy_is_rendered_where_the_cluster_serves_it() {
    const SERVED: &str = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy";
    let kinds = |args: &[&str], sets: &[&str]| -> Vec<String> {
        render_args(&helm(), args, sets)
            .unwrap()
            .iter()
            .filter_map(|d| d["kind"].as_str())
            .filter(|kind| kind.starts_with("ValidatingAdmissionPolicy"))
            .map(str::to_owned)
            .collect()
    };
    assert!(kinds(&[], &[]).is_empty());
    assert_eq!(
        kinds(&["--api-versions", SERVED], &[]),
        [
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding"
        ]
    );
    assert!(kinds(
        &["--api-versions", SERVED],
        &["admissionPolicy.enabled=false"]
    )
    .is_empty());
    let rendered = render_args(&helm(), &["--api-versions", SERVED], &[]).unwrap();
    let binding = rendered
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicyBinding")
        .unwrap();
    assert_eq!(binding["spec"]["policyName"], "cnat-at-rules");
    assert_eq!(
        binding["spec"]["validationActions"],
        serde_json::json!(["Deny"])
    );
}

/// The CRD comes with the release unless told not to, and survives its uninstall.
#[test]
fn the_crd_is_installed_kept_on_uninstall_and_can_be_left_out() {
    let crd: CustomResourceDefinition = Rendered::new(&[]).one("CustomResourceDefinition");
    let annotations = crd.metadata.annotations.unwrap();
    assert_eq!(annotations["helm.sh/resource-policy"], "keep");
    let versions: Vec<(&str, bool, bool)> = crd
        .spec
        .versions
        .iter()
        .map(|v| (v.name.as_str(), v.served, v.storage))
        .collect();
    assert_eq!(versions, [("v1", true, true), ("v1alpha1", true, false)]);
    // Without v1alpha1 the CRD lists v1 alone, as before, with the same conversion webhook.
    let v1_only: CustomResourceDefinition =
        Rendered::new(&["crd.serveV1alpha1=false"]).one("CustomResourceDefinition");
    let versions: Vec<(&str, bool, bool)> = (v1_only.spec.versions.iter())
        .map(|v| (v.name.as_str(), v.served, v.storage))
        .collect();
    assert_eq!(versions, [("v1", true, true)]);
    assert_eq!(v1_only.spec.versions[0], crd.spec.versions[0]);
    assert_eq!(v1_only.spec.conversion, crd.spec.conversion);
    assert!(Rendered::new(&["crd.install=false"])
        .all::<Value>("CustomResourceDefinition")
        .is_empty());
    // `helm upgrade --reuse-values` from 0.1.0 brings values without a `crd` key at all.
    assert_eq!(
        Rendered::new(&["crd=null"])
            .all::<Value>("CustomResourceDefinition")
            .len(),
        1
    );
}

/// The operator container's environment, name to value (values only, not references).
fn plain_env(rendered: &Rendered) -> std::collections::BTreeMap<String, String> {
    let pod = rendered.pod_template().spec.unwrap();
    pod.containers[0]
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
        .collect()
}

#[test]
fn run_defaults_become_the_operators_default_flags() {
    let none = plain_env(&Rendered::new(&[]));
    let defaults: Vec<_> = none
        .iter()
        .filter(|(k, _)| k.starts_with("CNAT_DEFAULT_"))
        .collect();
    assert_eq!(
        defaults,
        [(
            &"CNAT_DEFAULT_IMAGE".to_owned(),
            &cnat::api::DEFAULT_IMAGE.to_owned()
        )],
        "no defaults unless asked, but the image, named where users see it"
    );
    let env = plain_env(&Rendered::new(&[
        "runDefaults.requests.cpu=100m",
        "runDefaults.requests.memory=64Mi",
        "runDefaults.limits.cpu=1",
        "runDefaults.limits.memory=256Mi",
        "runDefaults.activeDeadlineSeconds=3600",
        "runDefaults.startingDeadlineSeconds=0",
        "runDefaults.ttlSecondsAfterFinished=86400",
        "runDefaults.image=registry.example.com/mirror/busybox:1.36",
        "runDefaults.imagePullPolicy=IfNotPresent",
    ]));
    assert_eq!(env["CNAT_DEFAULT_REQUESTS"], "cpu=100m,memory=64Mi");
    assert_eq!(env["CNAT_DEFAULT_LIMITS"], "cpu=1,memory=256Mi");
    assert_eq!(env["CNAT_DEFAULT_ACTIVE_DEADLINE_SECONDS"], "3600");
    assert_eq!(
        env["CNAT_DEFAULT_STARTING_DEADLINE_SECONDS"], "0",
        "0 is a value, not unset"
    );
    assert_eq!(env["CNAT_DEFAULT_TTL_SECONDS_AFTER_FINISHED"], "86400");
    assert_eq!(
        env["CNAT_DEFAULT_IMAGE"],
        "registry.example.com/mirror/busybox:1.36"
    );
    assert_eq!(env["CNAT_DEFAULT_IMAGE_PULL_POLICY"], "IfNotPresent");
    // The flags parse as the operator reads them.
    for (flag, value) in &env {
        if let Some(name) = flag.strip_prefix("CNAT_DEFAULT_") {
            let arg = format!(
                "--default-{}={value}",
                name.to_lowercase().replace('_', "-")
            );
            let parsed = <cnat::cli::Cli as clap::Parser>::try_parse_from(["cnat", "run", &arg]);
            assert!(parsed.is_ok(), "{arg}: {parsed:?}");
        }
    }
}

/// A values file's numbers reach Helm as floats: a large one must not render as `1e+06`, which
/// the operator would refuse at start.
#[test]
fn run_defaults_from_a_values_file_render_as_whole_seconds() {
    let dir = std::env::temp_dir().join(format!("cnat-chart-values-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("values.yaml");
    std::fs::write(
        &file,
        "runDefaults:\n  activeDeadlineSeconds: 2000000\n  startingDeadlineSeconds: 1000000\n  ttlSecondsAfterFinished: 31536000\n",
    )
    .unwrap();
    let rendered = render_args(&helm(), &["-f", file.to_str().unwrap()], &[])
        .unwrap_or_else(|e| panic!("helm template -f: {e}"));
    let _ = std::fs::remove_dir_all(&dir);
    let env = plain_env(&Rendered(rendered));
    assert_eq!(env["CNAT_DEFAULT_ACTIVE_DEADLINE_SECONDS"], "2000000");
    assert_eq!(env["CNAT_DEFAULT_STARTING_DEADLINE_SECONDS"], "1000000");
    assert_eq!(env["CNAT_DEFAULT_TTL_SECONDS_AFTER_FINISHED"], "31536000");
}

#[test]
fn by_default_metrics_have_a_service_and_no_traces_are_exported() {
    let rendered = Rendered::new(&[]);
    let env = plain_env(&rendered);
    assert_eq!(env["CNAT_LOG"], "info");
    assert_eq!(env["CNAT_LEASE_DURATION"], "15s");
    assert_eq!(env["CNAT_RENEW_DEADLINE"], "10s");
    assert_eq!(env["CNAT_RETRY_PERIOD"], "2s");
    assert_eq!(env["CNAT_STEP_DOWN_GRACE"], "200ms");
    assert_eq!(env["CNAT_ACCESS_REVIEW"], "true");
    assert_eq!(env["CNAT_ACCESS_REVIEW_ON_ERROR"], "deny");
    assert_eq!(env["CNAT_ACCESS_REVIEW_KEEP_WARM"], "2m");
    // Dual-stack listeners, so IPv6-only clusters work.
    assert_eq!(env["CNAT_ADMIN_ADDR"], "[::]:8080");
    assert_eq!(env["CNAT_WEBHOOK_ADDR"], "[::]:8443");
    assert_eq!(env["CNAT_LOG_FORMAT"], "json");
    assert_eq!(env["MIMALLOC_PURGE_DELAY"], "0");
    assert_eq!(env["OTEL_SERVICE_NAME"], "cnat");
    assert_eq!(env["OTEL_TRACES_SAMPLER"], "parentbased_traceidratio");
    assert_eq!(env["OTEL_TRACES_SAMPLER_ARG"], "1");
    assert!(!env.contains_key("OTEL_EXPORTER_OTLP_ENDPOINT"), "{env:?}");
    assert!(!env.contains_key("OTEL_RESOURCE_ATTRIBUTES"), "{env:?}");
    assert!(!rendered.kinds().contains(&"ServiceMonitor".to_owned()));

    let metrics: Service = rendered.named("Service", "cnat-metrics");
    let spec = metrics.spec.unwrap();
    let port = &spec.ports.unwrap()[0];
    assert_eq!((port.name.as_deref(), port.port), (Some("metrics"), 8080));
    assert_eq!(
        serde_json::to_value(&port.target_port).unwrap(),
        "admin",
        "the container port that serves /metrics"
    );
    let pod_labels = rendered.pod_template().metadata.unwrap().labels.unwrap();
    for (key, value) in spec.selector.unwrap() {
        assert_eq!(pod_labels.get(&key), Some(&value), "selector {key}");
    }
}

#[test]
fn the_prometheus_rule_is_off_by_default_and_takes_labels_thresholds_and_a_runbook() {
    assert!(Rendered::new(&[]).all::<Value>("PrometheusRule").is_empty());
    let rendered = Rendered::new(&[
        "metrics.prometheusRule.enabled=true",
        "metrics.prometheusRule.labels.release=prometheus",
        "metrics.prometheusRule.runbookUrl=https://docs.example.com/cnat/operating/runbook.html",
        "metrics.prometheusRule.runsLate.seconds=120",
        "metrics.prometheusRule.overdue.for=15m",
    ]);
    let rule: Value = rendered.one("PrometheusRule");
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(rule["metadata"]["labels"]["release"], "prometheus");
    let alerts = rule["spec"]["groups"][0]["rules"].as_array().unwrap();
    let names: Vec<&str> = alerts
        .iter()
        .map(|a| a["alert"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "CnatNoLeader",
            "CnatManyLeaders",
            "CnatAtsOverdue",
            "CnatRunsLate",
            "CnatReconcileErrors",
            "CnatPodsRefused",
            "CnatAdmissionDenialsSpiking",
            "CnatWebhookErrors",
            "CnatWebhookSlow",
        ]
    );
    for alert in alerts {
        let name = alert["alert"].as_str().unwrap();
        let annotations = &alert["annotations"];
        assert!(annotations["summary"].is_string(), "{name}");
        assert!(
            annotations["description"]
                .as_str()
                .unwrap()
                .contains(&format!("\"Alerts and runbook\", {name}")),
            "{name}"
        );
        assert_eq!(
            annotations["runbook_url"],
            format!(
                "https://docs.example.com/cnat/operating/runbook.html#{}",
                name.to_lowercase()
            ),
        );
    }
    let by_name = |name: &str| alerts.iter().find(|a| a["alert"] == name).unwrap();
    // Only this release's series: the job its ServiceMonitor gives them.
    assert_eq!(
        by_name("CnatManyLeaders")["expr"],
        "sum(cnat_leader{job=\"cnat-metrics\"}) > 1"
    );
    assert!(by_name("CnatRunsLate")["expr"]
        .as_str()
        .unwrap()
        .ends_with("> 120"));
    assert_eq!(by_name("CnatAtsOverdue")["for"], "15m");
    // Without a runbook URL there is no runbook_url annotation; a selector picks other series.
    let plain: Value = Rendered::new(&[
        "metrics.prometheusRule.enabled=true",
        "metrics.prometheusRule.selector=job=\"cnat\"\\,env=\"prod\"",
    ])
    .one("PrometheusRule");
    let first = &plain["spec"]["groups"][0]["rules"][0];
    assert!(first["annotations"]["runbook_url"].is_null());
    assert_eq!(
        first["expr"],
        "(sum(cnat_leader{job=\"cnat\",env=\"prod\"}) or vector(0)) < 1"
    );
}

#[test]
fn the_grafana_dashboard_is_an_optional_configmap_for_the_sidecar() {
    let named = |r: &Rendered| {
        r.all::<Value>("ConfigMap")
            .into_iter()
            .filter(|c| c["metadata"]["name"] == "cnat-dashboard")
            .collect::<Vec<_>>()
    };
    assert!(named(&Rendered::new(&[])).is_empty());
    let rendered = Rendered::new(&[
        "metrics.dashboard.enabled=true",
        "metrics.dashboard.namespace=monitoring",
    ]);
    let maps = named(&rendered);
    assert_eq!(maps.len(), 1);
    assert_eq!(maps[0]["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(maps[0]["metadata"]["namespace"], "monitoring");
    let shipped: Value =
        serde_json::from_str(maps[0]["data"]["cnat.json"].as_str().unwrap()).unwrap();
    let repo: Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{CHART}/dashboards/cnat.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(shipped, repo);
    assert_eq!(repo["uid"], "cnat-overview");
}

#[test]
fn collector_tls_secrets_are_mounted_whole_and_named_by_the_standard_variables() {
    let none = Rendered::new(&["tracing.otlpEndpoint=https://otel-gateway.observability:4317"]);
    let env = plain_env(&none);
    assert!(
        !env.keys()
            .any(|k| k.contains("CERTIFICATE") || k.contains("CLIENT_KEY")),
        "the image's CA bundle unless a Secret is named: {env:?}"
    );
    let pod = none.pod_template().spec.unwrap();
    assert!(
        pod.volumes.is_none(),
        "nothing mounted (mode operator: the certificate comes from the API)"
    );

    let rendered = Rendered::new(&[
        "tracing.otlpEndpoint=https://otel-gateway.observability:4317",
        "tracing.tls.caSecret=collector-ca",
        "tracing.tls.clientSecret=cnat-collector-client",
    ]);
    let env = plain_env(&rendered);
    assert_eq!(
        env["OTEL_EXPORTER_OTLP_ENDPOINT"],
        "https://otel-gateway.observability:4317"
    );
    let pod = rendered.pod_template().spec.unwrap();
    let mounts = pod.containers[0].volume_mounts.clone().unwrap();
    let volumes = pod.volumes.unwrap();
    for (var, volume, secret, key) in [
        (
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
            "collector-ca",
            "collector-ca",
            "ca.crt",
        ),
        (
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
            "collector-client",
            "cnat-collector-client",
            "tls.crt",
        ),
        (
            "OTEL_EXPORTER_OTLP_CLIENT_KEY",
            "collector-client",
            "cnat-collector-client",
            "tls.key",
        ),
    ] {
        let mount = mounts
            .iter()
            .find(|m| m.name == volume)
            .unwrap_or_else(|| panic!("no mount {volume}: {mounts:?}"));
        // Read-only and whole: a subPath mount would never see a renewed certificate.
        assert_eq!(mount.read_only, Some(true));
        assert_eq!(mount.sub_path, None);
        assert_eq!(env[var], format!("{}/{key}", mount.mount_path), "{var}");
        let source = volumes
            .iter()
            .find(|v| v.name == volume)
            .and_then(|v| v.secret.clone())
            .unwrap_or_else(|| panic!("no Secret volume {volume}"));
        assert_eq!(source.secret_name.as_deref(), Some(secret));
        let items = source.items.unwrap_or_default();
        assert!(
            items.iter().any(|i| i.key == key && i.path == key),
            "{items:?}"
        );
    }
}

#[test]
fn observability_values_become_the_standard_otel_variables_and_a_service_monitor() {
    let rendered = Rendered::new(&[
        "logs.level=info\\,cnat=debug",
        "logs.format=text",
        "tracing.otlpEndpoint=http://otel-collector.observability:4318",
        "tracing.protocol=http/protobuf",
        "tracing.serviceName=cnat-prod",
        "tracing.samplingRatio=0.25",
        "tracing.resourceAttributes=deployment.environment.name=prod",
        "extraEnv[0].name=OTEL_EXPORTER_OTLP_HEADERS",
        "extraEnv[0].value=x-token=abc",
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.interval=15s",
        "metrics.serviceMonitor.labels.release=prometheus",
    ]);
    let env = plain_env(&rendered);
    for (name, value) in [
        ("CNAT_LOG", "info,cnat=debug"),
        ("CNAT_LOG_FORMAT", "text"),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://otel-collector.observability:4318",
        ),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_SERVICE_NAME", "cnat-prod"),
        ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
        ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment.name=prod",
        ),
        ("OTEL_EXPORTER_OTLP_HEADERS", "x-token=abc"),
    ] {
        assert_eq!(env.get(name).map(String::as_str), Some(value), "{name}");
    }

    let monitors: Vec<Value> = rendered.all("ServiceMonitor");
    assert_eq!(monitors.len(), 1);
    let monitor = &monitors[0];
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(monitor["metadata"]["labels"]["release"], "prometheus");
    assert_eq!(
        monitor["spec"]["endpoints"],
        serde_json::json!([{"port": "metrics", "path": "/metrics", "interval": "15s"}])
    );
    // It selects the metrics Service, not the webhook one.
    let wanted = monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap();
    let selected: Vec<String> = rendered
        .all::<Service>("Service")
        .into_iter()
        .filter(|s| {
            let labels = s.metadata.labels.clone().unwrap_or_default();
            wanted
                .iter()
                .all(|(k, v)| labels.get(k).map(String::as_str) == v.as_str())
        })
        .filter_map(|s| s.metadata.name)
        .collect();
    assert_eq!(selected, ["cnat-metrics"]);
}

#[test]
fn helm_test_runs_the_smoke_test_with_its_own_minimal_rbac() {
    let rendered = Rendered::new(&[]);
    let hooks: Vec<&Value> = rendered
        .0
        .iter()
        .filter(|d| d["metadata"]["annotations"]["helm.sh/hook"] == "test")
        .collect();
    let kinds: Vec<&str> = hooks.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["ServiceAccount", "Role", "RoleBinding", "Pod"]);
    let pod = hooks[3];
    assert_eq!(pod["spec"]["containers"][0]["args"][0], "smoke-test");
    assert_eq!(pod["spec"]["serviceAccountName"], "cnat-smoke-test");
    let role: Role = serde_json::from_value(hooks[1].clone()).unwrap();
    assert_eq!(
        role.rules.unwrap(),
        [
            rule(
                &["cnat.programming-kubernetes.info"],
                &["ats"],
                &["create", "get", "delete"],
                None
            ),
            rule(&[""], &["pods"], &["create"], None),
        ]
    );
}

fn pod_labels_of(job: &Value) -> Value {
    job["spec"]["template"]["metadata"]["labels"].clone()
}

/// `helm uninstall` first lets go of every pod cnat keeps (`cnat release`), as the operator's
/// own ServiceAccount (which may patch pods for this), restricted like the operator; off on
/// request.
#[test]
fn uninstall_first_releases_the_pods_cnat_keeps() {
    let rendered = Rendered::new(&[]);
    let hooks: Vec<&Value> = rendered
        .0
        .iter()
        .filter(|d| d["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete")
        .collect();
    let kinds: Vec<&str> = hooks.iter().filter_map(|h| h["kind"].as_str()).collect();
    assert_eq!(kinds, ["Role", "RoleBinding", "Job"]);
    let job = hooks[2];
    assert_eq!(job["spec"]["activeDeadlineSeconds"], 120);
    let pod = &job["spec"]["template"]["spec"];
    // The operator is stopped first (within its grace period and 10 s), then the pods let go.
    assert_eq!(
        pod["containers"][0]["args"],
        serde_json::json!([
            "release",
            "--stop-deployment=cnat-system/cnat",
            "--stop-timeout=40s"
        ])
    );
    // For the hook only: the right to scale its own Deployment, created before the Job (a
    // lower weight) and gone with it.
    let (role, binding) = (hooks[0], hooks[1]);
    assert_eq!(
        role["rules"],
        serde_json::json!([
            {"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": ["cnat"],
             "verbs": ["get"]},
            {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": ["cnat"],
             "verbs": ["patch"]}
        ])
    );
    assert_eq!(binding["subjects"][0]["name"], "cnat");
    for rbac in [role, binding] {
        let annotations = &rbac["metadata"]["annotations"];
        assert_eq!(annotations["helm.sh/hook-weight"], "-1");
        assert_eq!(
            annotations["helm.sh/hook-delete-policy"],
            "before-hook-creation,hook-succeeded,hook-failed"
        );
    }
    assert_eq!(pod["serviceAccountName"], "cnat");
    assert_eq!(pod["restartPolicy"], "Never");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let container = &pod["containers"][0]["securityContext"];
    assert_eq!(container["allowPrivilegeEscalation"], false);
    assert_eq!(container["readOnlyRootFilesystem"], true);
    assert_eq!(
        container["capabilities"]["drop"],
        serde_json::json!(["ALL"])
    );
    let role = rendered
        .0
        .iter()
        .find(|d| d["kind"] == "ClusterRole")
        .unwrap();
    let pods_rule = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["resources"] == serde_json::json!(["pods"]))
        .unwrap();
    assert!(pods_rule["verbs"]
        .as_array()
        .unwrap()
        .contains(&serde_json::json!("patch")));
    // No Service, PodDisruptionBudget or anti-affinity takes a hook's pod for a replica.
    let selector = &rendered
        .0
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .unwrap()["spec"]["selector"]["matchLabels"];
    let hook_pods = [
        &pod_labels_of(job),
        &rendered.0.iter().find(|d| d["kind"] == "Pod").unwrap()["metadata"]["labels"],
    ];
    for labels in hook_pods {
        let selected = selector
            .as_object()
            .unwrap()
            .iter()
            .all(|(k, v)| &labels[k] == v);
        assert!(!selected, "{labels}");
    }
    let off = Rendered::new(&["releaseOnUninstall=false"]);
    assert!(!off.kinds().contains(&"Job".to_owned()));
    assert_eq!(off.all::<Value>("Role").len(), 2);
}

#[test]
fn helm_3_and_helm_4_both_lint_render_and_validate_the_chart() {
    let names = |docs: Vec<Value>| {
        let mut names: Vec<String> = docs
            .iter()
            .map(|d| format!("{} {}", d["kind"], d["metadata"]["name"]))
            .collect();
        names.sort();
        names
    };
    let mut rendered = Vec::new();
    for binary in ["helm", "helm3"] {
        let helm = helm_named(binary);
        if let Err(report) = lint_strictly(&helm) {
            panic!("{binary}: {report}");
        }
        rendered.push(names(render_with(&helm, &["replicaCount=3"]).unwrap()));
        let refused = render_with(&helm, &["replicaCount=0"]).unwrap_err();
        assert!(refused.contains("replicaCount"), "{binary}: {refused}");
    }
    assert_eq!(
        rendered[0], rendered[1],
        "Helm 3 and Helm 4 render different objects"
    );
}

/// GitOps tools render with `helm template`, where the chart cannot look up its Secret: in mode
/// chart the generated CA changes on every render (every sync rotates it). In mode operator (the
/// default), with cert-manager or with your own Secret, renders are identical.
#[test]
fn only_mode_chart_renders_a_new_ca_each_time() {
    let webhook_objects = |sets: &[&str]| -> Vec<Value> {
        render(sets)
            .unwrap()
            .into_iter()
            .filter(|d| {
                let kind = d["kind"].as_str().unwrap_or_default();
                kind.ends_with("WebhookConfiguration")
                    || kind == "Secret"
                    || kind == "Certificate"
                    || kind == "CustomResourceDefinition"
            })
            .collect()
    };
    let generated = webhook_objects(&["webhook.certs.mode=chart"]);
    assert_ne!(
        generated,
        webhook_objects(&["webhook.certs.mode=chart"]),
        "a new CA per render"
    );
    for sets in [
        vec![],
        vec!["webhook.certs.mode=operator"],
        vec!["certManager.enabled=true"],
        vec![
            "webhook.certs.existingSecret=my-tls",
            "webhook.certs.caBundle=Q0E=",
        ],
    ] {
        let first = webhook_objects(&sets);
        assert!(!first.is_empty());
        assert_eq!(
            first,
            webhook_objects(&sets),
            "{sets:?}: stable across renders"
        );
    }
    let notes = |sets: &[&str]| {
        let mut command = Command::new(helm());
        command.args([
            "install",
            "cnat",
            CHART,
            "--dry-run",
            "--namespace",
            "cnat-system",
        ]);
        for set in sets {
            command.args(["--set", set]);
        }
        String::from_utf8_lossy(&command.output().unwrap().stdout).into_owned()
    };
    let stdout = notes(&[]);
    assert!(
        stdout.contains("kept by cnat in the Secret cnat-webhook-certs")
            && stdout.contains("never replace"),
        "NOTES say who keeps the certificate: {stdout}"
    );
    let stdout = notes(&["webhook.certs.mode=chart"]);
    assert!(
        stdout.contains("helm template") && stdout.contains("webhook.certs.mode=operator"),
        "NOTES warn GitOps users of mode chart: {stdout}"
    );
}

/// In mode operator (the default of a new install, and always under `helm template`), the chart
/// renders no certificate, no caBundle and no certificate volume: the replicas are told the
/// Secret, configurations and Service whose certificate they keep.
#[test]
fn in_mode_operator_the_chart_renders_no_certificate_and_tells_the_replicas_what_to_keep() {
    for sets in [&[][..], &["webhook.certs.mode=operator"]] {
        let rendered = Rendered::new(sets);
        assert!(rendered.all::<Value>("Secret").is_empty(), "{sets:?}");
        for kind in [
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration",
        ] {
            let config: Value = rendered.one(kind);
            let hooks = config["webhooks"].as_array().unwrap();
            assert!(
                hooks
                    .iter()
                    .all(|h| h["clientConfig"]["caBundle"].is_null()),
                "{config}"
            );
            assert!(
                config["metadata"]["annotations"].is_null(),
                "no cert-manager injection"
            );
        }
        let crd: Value = rendered.one("CustomResourceDefinition");
        let client = &crd["spec"]["conversion"]["webhook"]["clientConfig"];
        assert!(client["caBundle"].is_null() && client["service"]["name"] == "cnat-webhook");
        let env = plain_env(&rendered);
        assert_eq!(env["CNAT_WEBHOOK_CERTS_SECRET"], "cnat-webhook-certs");
        assert_eq!(env["CNAT_WEBHOOK_CONFIGURATION"], "cnat");
        assert_eq!(env["CNAT_WEBHOOK_SERVICE"], "cnat-webhook");
        assert_eq!(env["CNAT_WEBHOOK_CA_OVERLAP"], "10m");
        assert!(!env.contains_key("CNAT_TLS_CERT"));
        let pod = rendered.pod_template().spec.unwrap();
        assert!(pod.volumes.is_none(), "{:?}", pod.volumes);
        assert!(pod.containers[0].volume_mounts.is_none());
    }
    // The other modes keep the certificate volume and files.
    let chart = Rendered::new(&["webhook.certs.mode=chart"]);
    assert_eq!(plain_env(&chart)["CNAT_TLS_CERT"], "/etc/cnat/tls/tls.crt");
    assert!(!plain_env(&chart).contains_key("CNAT_WEBHOOK_CERTS_SECRET"));
}

#[test]
fn the_network_policy_admits_only_the_webhook_and_admin_ports_from_the_peers_given() {
    let policy: Value = Rendered::new(&[]).one("NetworkPolicy");
    let ingress = policy["spec"]["ingress"].as_array().unwrap();
    let ports: Vec<&Value> = ingress
        .iter()
        .map(|rule| &rule["ports"][0]["port"])
        .collect();
    assert_eq!(ports, ["webhook", "admin"]);
    assert!(
        ingress.iter().all(|rule| rule.get("from").is_none()),
        "open by default: {policy}"
    );
    assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress"]));
    let narrowed: Value = Rendered::new(&[
        "networkPolicy.webhookFrom[0].ipBlock.cidr=10.0.0.0/24",
        "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring",
    ])
    .one("NetworkPolicy");
    assert_eq!(
        narrowed["spec"]["ingress"][0]["from"],
        json!([{"ipBlock": {"cidr": "10.0.0.0/24"}}])
    );
    assert_eq!(
        narrowed["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"]["team"],
        "monitoring"
    );
    assert!(Rendered::new(&["networkPolicy.enabled=false"])
        .all::<Value>("NetworkPolicy")
        .is_empty());
}
