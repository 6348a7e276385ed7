//! A failed reconcile: each names the At and what was being done; it is retried with backoff
//! (`Scheduler::failed_reconcile`).

use crate::api::Phase;
use crate::operator::key::AtKey;
use thiserror::Error;

/// A failed reconcile; it is retried with backoff. Each names the At and what was being done.
#[derive(Debug, Error)]
pub enum Error {
    #[error("At {at}: creating pod {pod}: {source}")]
    CreatePod {
        at: AtKey,
        pod: String,
        source: kube::Error,
    },
    #[error("At {at}: reading pod {pod}: {source}")]
    ReadPod {
        at: AtKey,
        pod: String,
        source: kube::Error,
    },
    #[error("At {at}: writing status {phase}: {source}")]
    WriteStatus {
        at: AtKey,
        phase: Phase,
        source: kube::Error,
    },
    #[error("At {at}: reading it from the API server before creating its pod: {source}")]
    ConfirmAt { at: AtKey, source: kube::Error },
    #[error("At {at}: pod {pod} kept appearing and disappearing while being created")]
    PodChurn { at: AtKey, pod: String },
    #[error("At {at}: the API server refused pod {pod} (retried with backoff): {reason}")]
    PodRefused {
        at: AtKey,
        pod: String,
        reason: String,
    },
    #[error("At {at}: removing cnat's finalizer from pod {pod}, which is being deleted: {source}")]
    ReleasePod {
        at: AtKey,
        pod: String,
        source: kube::Error,
    },
    #[error("At {at}: deleting pod {pod}, past spec.activeDeadlineSeconds: {source}")]
    DeletePod {
        at: AtKey,
        pod: String,
        source: kube::Error,
    },
    #[error("At {at}: deleting it after ttlSecondsAfterFinished: {source}")]
    Delete { at: AtKey, source: kube::Error },
}

impl Error {
    /// The API error behind this failure, if there is one.
    pub fn api_error(&self) -> Option<&kube::Error> {
        match self {
            Error::CreatePod { source, .. }
            | Error::ReadPod { source, .. }
            | Error::ConfirmAt { source, .. }
            | Error::WriteStatus { source, .. }
            | Error::ReleasePod { source, .. }
            | Error::DeletePod { source, .. }
            | Error::Delete { source, .. } => Some(source),
            Error::PodChurn { .. } | Error::PodRefused { .. } => None,
        }
    }
}
