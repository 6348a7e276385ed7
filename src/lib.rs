//! cnat: a Kubernetes operator for the `At` resource, "run this shell command once, at this time".
//! Modules are grouped by concern; see docs/src/development.md, "Source layout".

pub mod admission;
pub mod api;
pub mod certs;
pub mod cli;
pub mod conversion;
pub mod kubectl_at;
pub mod leader;
pub mod leading;
pub mod limits;
pub mod observability;
pub mod operator;
pub mod schedule;
pub mod serving;
pub mod shard;
pub mod smoke_test;
pub mod storage_migration;
pub mod sync;

use thiserror::Error;

/// Why `cnat run` could not reach a cluster.
#[derive(Debug, Error)]
pub enum ConnectError {
    #[error("no Kubernetes configuration: not running in a cluster, and {0}; set KUBECONFIG or create ~/.kube/config")]
    NoConfig(kube::config::InferConfigError),
    #[error("cannot build a Kubernetes client from the configuration: {0}")]
    Client(kube::Error),
}

/// A client for the cluster found the standard way: a `KUBECONFIG` that is set (as kubectl, so
/// that `kubectl cnat` in a pod talks to kubectl's cluster), else the in-cluster service account
/// when running in a pod, else `~/.kube/config`.
pub async fn client() -> Result<kube::Client, ConnectError> {
    let named = std::env::var_os("KUBECONFIG").is_some_and(|path| !path.is_empty());
    let config = match kube::Config::incluster() {
        Ok(config) if !named => config,
        _ => kube::Config::infer()
            .await
            .map_err(ConnectError::NoConfig)?,
    };
    kube::Client::try_from(config).map_err(ConnectError::Client)
}

/// This replica's identity: the pod name from the downward API, else the host name with a
/// random suffix (two processes on one host must not share an identity).
pub fn identity() -> String {
    if let Some(pod) = std::env::var("POD_NAME").ok().filter(|v| !v.is_empty()) {
        return pod;
    }
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "cnat".into());
    let random =
        std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0u8);
    format!("{host}-{:06x}", random & 0xff_ffff)
}
