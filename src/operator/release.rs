//! `cnat release`: removes cnat's finalizer from every pod that still holds it, for when no
//! replica will run again (`helm uninstall` runs it in a pre-delete hook). A pod whose At is
//! RUNNING then records nothing more: its At stays RUNNING until a replica runs again, and the
//! pod, no longer kept, can be deleted (a namespace being deleted goes) before its outcome is
//! read. Each pod is patched with its resourceVersion as precondition (other finalizers stay);
//! one that changed meanwhile is read again.

use crate::operator::pod;
use crate::operator::reconcile::FIELD_MANAGER;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};

/// Pods released at once.
const CONCURRENCY: usize = 8;
/// Writes of one pod that may conflict in a row before it is reported.
const MAX_CONFLICTS: usize = 10;

/// What a release did.
#[derive(Debug, Default, PartialEq)]
pub struct Released {
    /// Pods that held the finalizer and no longer do.
    pub released: usize,
    /// Pods (namespace/name) that could not be released, with why.
    pub failed: Vec<(String, String)>,
}

/// Why the pods could not be listed.
#[derive(Debug, thiserror::Error)]
#[error("listing cnat's pods ({selector}): {source}. May you list pods in {scope}?")]
pub struct ListError {
    selector: &'static str,
    scope: String,
    source: kube::Error,
}

/// Releases every pod cnat created, in `namespace` or in all namespaces.
pub async fn release_all(client: Client, namespace: Option<&str>) -> Result<Released, ListError> {
    let pods: Api<Pod> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let list = pods
        .list(&ListParams::default().labels(pod::SELECTOR))
        .await
        .map_err(|source| ListError {
            selector: pod::SELECTOR,
            scope: namespace.map_or("every namespace".into(), |ns| format!("namespace {ns}")),
            source,
        })?;
    let held: Vec<Pod> = list.items.into_iter().filter(pod::is_held).collect();
    let outcomes: Vec<(String, Result<bool, kube::Error>)> = futures::stream::iter(held)
        .map(|found| {
            let client = client.clone();
            async move {
                let ns = found.namespace().unwrap_or_default();
                let name = format!("{ns}/{}", found.name_any());
                (name, release(Api::namespaced(client, &ns), found).await)
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let mut released = Released::default();
    for (name, outcome) in outcomes {
        match outcome {
            Ok(true) => released.released += 1,
            Ok(false) => {}
            Err(error) => released.failed.push((name, error.to_string())),
        }
    }
    released.failed.sort();
    Ok(released)
}

/// Removes cnat's finalizer from `found`: `true` once removed, `false` if gone or not held.
async fn release(pods: Api<Pod>, mut found: Pod) -> Result<bool, kube::Error> {
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    let name = found.name_any();
    for _ in 0..MAX_CONFLICTS {
        if !pod::is_held(&found) {
            return Ok(false);
        }
        let patch = Patch::Merge(pod::release_patch(&found));
        match pods.patch(&name, &params, &patch).await {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(false),
            Err(kube::Error::Api(s)) if s.is_conflict() => match pods.get_opt(&name).await? {
                Some(fresh) => found = fresh,
                None => return Ok(false),
            },
            Err(error) => return Err(error),
        }
    }
    Err(kube::Error::Service(
        format!("{MAX_CONFLICTS} writes in a row conflicted with other writers").into(),
    ))
}
