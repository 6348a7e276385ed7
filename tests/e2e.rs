//! End-to-end against a real cluster. Ignored (shown as skipped) in the normal test run; run it
//! with `CNAT_E2E_KUBECONFIG` naming the kubeconfig of a disposable cluster (kind, k3d, ...). It
//! installs the CRD, runs the operator in-process, and follows Ats in a fresh namespace that
//! enforces the `restricted` Pod Security profile.
//!
//!     kind create cluster --name cnat-e2e
//!     kind get kubeconfig --name cnat-e2e > /tmp/cnat-e2e.kubeconfig
//!     CNAT_E2E_KUBECONFIG=/tmp/cnat-e2e.kubeconfig cargo nextest run --test e2e --run-ignored all

use cnat::api::{At, AtSpec, Outcome, Phase};
use cnat::observability::metrics::Metrics;
use cnat::operator::events::EventSink;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, LogParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::events::Reporter;
use kube::runtime::wait::{await_condition, conditions};
use kube::{Api, Client, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const ENV: &str = "CNAT_E2E_KUBECONFIG";

async fn cluster() -> Client {
    let path = std::env::var_os(ENV)
        .unwrap_or_else(|| panic!("set {ENV} to the kubeconfig of a disposable cluster"));
    let kubeconfig = Kubeconfig::read_from(&path).expect("readable kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("usable kubeconfig");
    Client::try_from(config).expect("client")
}

async fn install_crd(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd: CustomResourceDefinition =
        serde_saphyr::from_str(cnat::api::crd_yaml().split_once("---\n").unwrap().1).unwrap();
    let name = crd.name_any();
    crds.patch(
        &name,
        &PatchParams::apply("cnat-e2e").force(),
        &Patch::Apply(&crd),
    )
    .await
    .unwrap();
    let established = await_condition(crds, &name, conditions::is_crd_established());
    tokio::time::timeout(Duration::from_secs(30), established)
        .await
        .unwrap()
        .unwrap();
}

async fn restricted_namespace(client: &Client) -> String {
    restricted_namespace_named(client, &format!("cnat-e2e-{}", std::process::id())).await
}

async fn restricted_namespace_named(client: &Client, name: &str) -> String {
    let name = name.to_owned();
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}}
    }))
    .unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    name
}

fn at(name: &str, schedule: chrono::DateTime<chrono::Utc>, command: &str) -> At {
    At::new(
        name,
        AtSpec {
            schedule: schedule.to_rfc3339(),
            command: command.into(),
            image: "busybox".into(),
            ..AtSpec::default()
        },
    )
}

/// The reconcile loop, watching `ns` only, until aborted.
fn start_operator(client: &Client, ns: &str) -> tokio::task::JoinHandle<()> {
    let settings = cnat::operator::controller::Settings {
        namespace: Some(ns.to_owned()),
        concurrency: 32,
        policy: Default::default(),
    };
    let reporter = Reporter {
        controller: "cnat".into(),
        instance: Some("cnat-e2e".into()),
    };
    let events = EventSink::start(client.clone(), reporter);
    tokio::spawn(cnat::operator::controller::run(
        client.clone(),
        settings,
        events,
        Arc::new(Metrics::new(Default::default())),
        CancellationToken::new(),
    ))
}

async fn wait_done(ats: &Api<At>, name: &str) -> At {
    let done = await_condition(ats.clone(), name, |at: Option<&At>| {
        at.and_then(|a| a.status.as_ref())
            .is_some_and(|s| s.phase == Phase::Done)
    });
    tokio::time::timeout(Duration::from_secs(180), done)
        .await
        .expect("DONE within 3 minutes")
        .unwrap();
    ats.get(name).await.unwrap()
}

#[tokio::test]
#[ignore = "needs a real cluster: set CNAT_E2E_KUBECONFIG and pass --run-ignored all"]
async fn ats_run_once_at_their_time_in_a_restricted_namespace() {
    let client = cluster().await;
    install_crd(&client).await;
    let ns = restricted_namespace(&client).await;
    let operator = start_operator(&client, &ns);

    let ats: Api<At> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let due = chrono::Utc::now() + chrono::Duration::seconds(5);
    let params = PostParams::default();
    ats.create(&params, &at("example-at", due, "echo YAY"))
        .await
        .unwrap();
    ats.create(
        &params,
        &at("fails", due, "echo 'about to fail' >&2; exit 3"),
    )
    .await
    .unwrap();
    let mut bad = at("bad-schedule", due, "true");
    bad.spec.schedule = "tomorrow noon".into();
    ats.create(&params, &bad).await.unwrap();

    let ok = wait_done(&ats, "example-at").await;
    let status = ok.status.unwrap();
    assert_eq!(status.outcome, Some(Outcome::Succeeded));
    assert_eq!(status.exit_code, Some(0));
    let pod = pods.get("example-at-pod").await.unwrap();
    let created = pod
        .metadata
        .creation_timestamp
        .as_ref()
        .map(cnat::operator::pod::to_chrono)
        .unwrap();
    assert!(
        created >= due - chrono::Duration::seconds(1),
        "ran early: {created} < {due}"
    );
    let log = pods
        .logs("example-at-pod", &LogParams::default())
        .await
        .unwrap();
    assert_eq!(log.trim(), "YAY");

    let failed = wait_done(&ats, "fails").await.status.unwrap();
    assert_eq!(
        (failed.outcome, failed.exit_code),
        (Some(Outcome::Failed), Some(3))
    );
    assert!(failed.message.unwrap().contains("about to fail"));

    // Without any operator or webhook, a new At reads as PENDING (the CRD's status default).
    let unwatched = restricted_namespace_named(&client, &format!("{ns}-unwatched")).await;
    let elsewhere: Api<At> = Api::namespaced(client.clone(), &unwatched);
    let fresh = elsewhere
        .create(
            &params,
            &at("later", due + chrono::Duration::days(1), "true"),
        )
        .await
        .unwrap();
    assert_eq!(fresh.status.map(|s| s.phase), Some(Phase::Pending));
    Api::<Namespace>::all(client.clone())
        .delete(&unwatched, &DeleteParams::default())
        .await
        .unwrap();

    let bad = ats.get("bad-schedule").await.unwrap().status.unwrap();
    assert_eq!(bad.phase, Phase::Pending);
    assert!(bad
        .message
        .unwrap()
        .contains("\"tomorrow noon\" is not an RFC 3339 time"));

    operator.abort();
    Api::<Namespace>::all(client)
        .delete(&ns, &DeleteParams::default())
        .await
        .unwrap();
}

/// A namespace whose ResourceQuota limits `limits.cpu`/`limits.memory`: an At with resources
/// runs; one without shows `PodForbidden` on its status, with the server's message.
#[tokio::test]
#[ignore = "needs a real cluster: set CNAT_E2E_KUBECONFIG and pass --run-ignored all"]
async fn in_a_quota_governed_namespace_pods_need_resources_and_refusals_are_shown() {
    use k8s_openapi::api::core::v1::ResourceQuota;
    let client = cluster().await;
    install_crd(&client).await;
    let ns = restricted_namespace_named(&client, &format!("cnat-e2e-quota-{}", std::process::id()))
        .await;
    let quota: ResourceQuota = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "compute"},
        "spec": {"hard": {"limits.cpu": "2", "limits.memory": "1Gi"}},
    }))
    .unwrap();
    Api::<ResourceQuota>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &quota)
        .await
        .unwrap();
    let operator = start_operator(&client, &ns);
    let ats: Api<At> = Api::namespaced(client.clone(), &ns);
    let now = chrono::Utc::now();
    let mut sized = at("sized", now, "echo sized");
    sized.spec.resources = Some(
        serde_json::from_value(serde_json::json!({"limits": {"cpu": "100m", "memory": "64Mi"}}))
            .unwrap(),
    );
    ats.create(&PostParams::default(), &sized).await.unwrap();
    ats.create(&PostParams::default(), &at("unsized", now, "echo unsized"))
        .await
        .unwrap();

    let done = wait_done(&ats, "sized").await.status.unwrap();
    assert_eq!(done.outcome, Some(Outcome::Succeeded));

    let refused = await_condition(ats.clone(), "unsized", |at: Option<&At>| {
        at.and_then(|a| a.status.as_ref())
            .is_some_and(|s| s.reason.as_deref() == Some("PodForbidden"))
    });
    tokio::time::timeout(Duration::from_secs(60), refused)
        .await
        .expect("PodForbidden within a minute")
        .unwrap();
    let status = ats.get("unsized").await.unwrap().status.unwrap();
    assert_eq!(status.phase, Phase::Pending);
    assert!(status.message.unwrap().contains("must specify limits"));

    operator.abort();
    Api::<Namespace>::all(client)
        .delete(&ns, &DeleteParams::default())
        .await
        .unwrap();
}
