//! cnat: a Kubernetes operator for the `At` resource, "run this shell command once, at this time".
//!
//! The state machine (`reconcile::decide`), schedule parsing (`schedule`) and pod naming and spec
//! (`pod`) are pure; Kubernetes I/O lives in `reconcile` and `controller`.

pub mod api;
pub mod cli;
pub mod controller;
pub mod events;
pub mod pod;
pub mod reconcile;
pub mod schedule;
pub mod telemetry;

use thiserror::Error;

/// Why `cnat run` could not reach a cluster.
#[derive(Debug, Error)]
pub enum ConnectError {
    #[error("no Kubernetes configuration: not running in a cluster, and {0}; set KUBECONFIG or create ~/.kube/config")]
    NoConfig(kube::config::InferConfigError),
    #[error("cannot build a Kubernetes client from the configuration: {0}")]
    Client(kube::Error),
}

/// A client for the cluster found the standard way: the in-cluster service account when running
/// in a pod, else `KUBECONFIG` or `~/.kube/config`.
pub async fn client() -> Result<kube::Client, ConnectError> {
    let config = match kube::Config::incluster() {
        Ok(config) => config,
        Err(_) => kube::Config::infer()
            .await
            .map_err(ConnectError::NoConfig)?,
    };
    kube::Client::try_from(config).map_err(ConnectError::Client)
}

/// This replica's name: the pod name from the downward API, else the host name.
pub fn instance_name() -> String {
    ["POD_NAME", "HOSTNAME"]
        .iter()
        .find_map(|var| std::env::var(var).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| "cnat".into())
}
