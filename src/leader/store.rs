//! The Lease on the API server: read, create, compare-and-swap merge patches, and a watch of
//! that one object. Every call is bounded in time; nothing here decides anything.

use super::record::Seen;
use futures::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Api;
use serde_json::Value;
use std::future::Future;
use std::time::Duration;
use thiserror::Error;
use tokio::time::timeout;

/// Why a Lease call failed (409 and 404 are answers, not errors: see `Written`).
#[derive(Debug, Error)]
pub enum LeaseError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("no answer from the API server within {0:?}")]
    Timeout(Duration),
    #[error(
        "cannot create Lease {0}: its namespace does not exist; create it or set --lease-namespace"
    )]
    NoNamespace(String),
    #[error("the Lease was deleted")]
    Gone,
    #[error("the Lease changed hands or no longer names the successor")]
    Changed,
}

impl LeaseError {
    /// Whether the API server gave no answer (down, unreachable, too slow).
    pub fn unanswered(&self) -> bool {
        match self {
            LeaseError::Api(error) => crate::operator::reachability::unanswered(error),
            LeaseError::Timeout(_) => true,
            LeaseError::NoNamespace(_) | LeaseError::Gone | LeaseError::Changed => false,
        }
    }
}

/// The answer to a write that carries a precondition.
#[derive(Debug)]
pub enum Written {
    /// It landed; this is the record as stored.
    Done(Box<Lease>),
    /// 409: the record changed since we read it (or, for a create, it exists).
    Conflict,
    /// 404: there is no Lease.
    Missing,
}

/// One Lease, by name, in one namespace.
#[derive(Clone)]
pub struct LeaseApi {
    api: Api<Lease>,
    name: String,
    /// The longest one call may take.
    limit: Duration,
}

impl LeaseApi {
    pub fn new(api: Api<Lease>, name: &str, limit: Duration) -> Self {
        LeaseApi {
            api,
            name: name.into(),
            limit,
        }
    }

    /// The Lease, or `None` when there is none.
    pub async fn get(&self) -> Result<Option<Lease>, LeaseError> {
        within(self.limit, self.api.get_opt(&self.name)).await
    }

    /// Creates it; `Conflict` when another candidate was first.
    pub async fn create(&self, lease: &Lease) -> Result<Written, LeaseError> {
        answer(within(self.limit, self.api.create(&PostParams::default(), lease)).await)
    }

    /// A merge patch carrying `metadata.resourceVersion`: the API server applies it only if the
    /// record is still at that version.
    pub async fn swap(&self, patch: &Value) -> Result<Written, LeaseError> {
        self.swap_within(patch, self.limit).await
    }

    /// `swap`, waiting up to `limit` for the answer: a late answer still keeps the Lease, and a
    /// renewal sent again would only load a busy API server more.
    pub async fn swap_within(&self, patch: &Value, limit: Duration) -> Result<Written, LeaseError> {
        debug_assert!(patch["metadata"]["resourceVersion"].is_string());
        let params = PatchParams::default();
        answer(
            within(
                limit,
                self.api.patch(&self.name, &params, &Patch::Merge(patch)),
            )
            .await,
        )
    }

    /// Every change of the Lease as `Some(lease)`, `None` when it is deleted; watch errors are
    /// retried with kube-runtime's backoff and yielded for the caller to log.
    pub fn watch(&self) -> impl Stream<Item = Result<Option<Lease>, watcher::Error>> + Send {
        let fields = format!("metadata.name={}", self.name);
        watcher(self.api.clone(), watcher::Config::default().fields(&fields))
            .default_backoff()
            .filter_map(|event| async move {
                match event {
                    Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l)) => {
                        Some(Ok(Some(l)))
                    }
                    Ok(watcher::Event::Delete(_)) => Some(Ok(None)),
                    Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
                    Err(error) => Some(Err(error)),
                }
            })
    }
}

pub(crate) async fn within<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, LeaseError> {
    timeout(limit, call)
        .await
        .map_err(|_| LeaseError::Timeout(limit))?
        .map_err(LeaseError::Api)
}

fn answer(result: Result<Lease, LeaseError>) -> Result<Written, LeaseError> {
    match result {
        Ok(lease) => Ok(Written::Done(Box::new(lease))),
        Err(LeaseError::Api(kube::Error::Api(s))) if s.is_conflict() || s.is_already_exists() => {
            Ok(Written::Conflict)
        }
        Err(LeaseError::Api(kube::Error::Api(s))) if s.is_not_found() => Ok(Written::Missing),
        Err(error) => Err(error),
    }
}

/// The holder a `Seen` names, for logs.
pub fn holder_name(seen: &Seen) -> &str {
    seen.holder.as_deref().unwrap_or("<nobody>")
}
