//! `cnat release`: removes cnat's finalizer from the pods that no longer need it
//! (`finalizer::may_go`), for when no replica will run again (`helm uninstall`'s pre-delete hook).
//! See docs/src/operating/install.md, "Uninstalling".

use crate::operator::finalizer::{self, Candidate, Recorder, Removed};
use crate::operator::{patch_params, pod, pod_api};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch};
use kube::core::PartialObjectMeta;
use kube::{Api, Client, ResourceExt};

/// Pods released at once.
const CONCURRENCY: usize = 8;
/// Pods per list page.
const PAGE: u32 = 500;
/// Writes of one pod that may conflict in a row before it is reported.
const MAX_CONFLICTS: usize = 10;

/// What a release did.
#[derive(Debug, Default, PartialEq)]
pub struct Released {
    /// Pods that held the finalizer and no longer do.
    pub released: usize,
    /// Pods (namespace/name) kept or failed, with why.
    pub kept: Vec<(String, String)>,
}

/// Why the pods could not be listed.
#[derive(Debug, thiserror::Error)]
#[error("listing cnat's pods ({selector}) in {scope}: {source}. May you list pods there?")]
pub struct ListError {
    selector: &'static str,
    scope: String,
    source: kube::Error,
}

/// What became of one pod.
enum Outcome {
    Released,
    /// Not held (any more), or gone.
    Nothing,
    Kept(String),
}

/// Why the operator's Deployment could not be stopped.
#[derive(Debug, thiserror::Error)]
#[error("stopping Deployment {namespace}/{name} (scale to 0, then wait for its pods): {source}. May you get and scale it, and list pods there?")]
pub struct StopError {
    namespace: String,
    name: String,
    source: kube::Error,
}

/// How the Deployment stopped.
#[derive(Debug, PartialEq, Eq)]
pub enum Stopped {
    /// Scaled to 0, and none of its pods left.
    Stopped,
    /// No such Deployment.
    Absent,
    /// Scaled to 0, but these many of its pods were still there when `wait` was up.
    StillRunning(usize),
    /// Scaled to 0; its pods not waited for (it selects them by no label).
    Scaled,
}

/// Scales Deployment `namespace/name` (the operator) to 0 and waits, up to `wait`, until none
/// of its pods is left, so that no pod is created or recorded once it returns `Stopped::Stopped`.
pub async fn stop_deployment(
    client: &Client,
    namespace: &str,
    name: &str,
    wait: std::time::Duration,
) -> Result<Stopped, StopError> {
    use k8s_openapi::api::apps::v1::Deployment;
    let fail = |source| StopError {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        source,
    };
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let Some(deployment) = deployments.get_opt(name).await.map_err(fail)? else {
        return Ok(Stopped::Absent);
    };
    let selector = deployment
        .spec
        .selector
        .match_labels
        .unwrap_or_default()
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(",");
    let scale = serde_json::json!({"spec": {"replicas": 0}});
    deployments
        .patch_scale(name, &patch_params(), &Patch::Merge(&scale))
        .await
        .map_err(fail)?;
    if selector.is_empty() {
        return Ok(Stopped::Scaled);
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let left = pods
            .list_metadata(&ListParams::default().labels(&selector))
            .await
            .map_err(fail)?
            .items
            .len();
        if left == 0 {
            return Ok(Stopped::Stopped);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(Stopped::StillRunning(left));
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// Releases the pods cnat created that no longer need its finalizer, in `namespace` or in all.
pub async fn release_all(client: Client, namespace: Option<&str>) -> Result<Released, ListError> {
    let pods = pod_api(&client, namespace);
    let mut released = Released::default();
    let mut token: Option<String> = None;
    loop {
        let mut params = ListParams::default().labels(pod::SELECTOR).limit(PAGE);
        if let Some(token) = &token {
            params = params.continue_token(token);
        }
        let page = pods
            .list_metadata(&params)
            .await
            .map_err(|source| ListError {
                selector: pod::SELECTOR,
                scope: namespace.map_or("every namespace".into(), |ns| format!("namespace {ns}")),
                source,
            })?;
        let held: Vec<Pod> = page
            .items
            .into_iter()
            .map(|meta: PartialObjectMeta<Pod>| Pod {
                metadata: meta.metadata,
                ..Pod::default()
            })
            .filter(finalizer::is_present)
            .collect();
        let outcomes: Vec<(String, Outcome)> = futures::stream::iter(held)
            .map(|found| {
                let client = client.clone();
                async move {
                    let ns = found.namespace().unwrap_or_default();
                    let name = format!("{ns}/{}", found.name_any());
                    (name, release_if_recorded(&client, &ns, found).await)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for (name, outcome) in outcomes {
            match outcome {
                Outcome::Released => released.released += 1,
                Outcome::Nothing => {}
                Outcome::Kept(why) => released.kept.push((name, why)),
            }
        }
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            break;
        }
    }
    released.kept.sort();
    Ok(released)
}

async fn release_if_recorded(client: &Client, namespace: &str, found: Pod) -> Outcome {
    let at = match finalizer::controlling_at(client, namespace, &found).await {
        Ok(at) => at,
        Err(error) => return Outcome::Kept(format!("reading its At: {error}")),
    };
    let allowed = |pod: &Pod| finalizer::may_go(Candidate::of(pod), at.as_ref(), Recorder::Nobody);
    if !allowed(&found) {
        return Outcome::Kept(
            "its At's status does not name it yet (its Running write had not landed): kept, so that it is never run twice; run cnat release again once a replica has recorded it".into(),
        );
    }
    let pods = Api::namespaced(client.clone(), namespace);
    match finalizer::remove(&pods, found, allowed, MAX_CONFLICTS).await {
        Ok(Removed::Released(_)) => Outcome::Released,
        Ok(Removed::Kept(_) | Removed::Gone) => Outcome::Nothing,
        Err(kube::Error::Api(s)) if s.is_conflict() => Outcome::Kept(format!(
            "{MAX_CONFLICTS} writes in a row conflicted with other writers; run cnat release again"
        )),
        Err(error) => Outcome::Kept(format!("{error}; run cnat release again")),
    }
}
