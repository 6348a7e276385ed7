//! The operator: running each At's command in a pod once it falls due, and recording how it
//! went, against the API server. See docs/src/design/architecture.md, "The reconcile loop",
//! and, module by module, docs/src/development.md, "Source layout".

pub mod cache;
pub mod controller;
pub mod events;
pub mod finalizer;
pub mod key;
pub mod pod;
pub mod policy;
pub mod priority;
pub mod quarantine;
pub mod reachability;
pub mod reconcile;
pub mod release;
pub mod shrink;
pub mod signing;
pub mod slow_start;
pub mod triggers;

use k8s_openapi::api::core::v1::Pod;
use kube::api::PatchParams;
use kube::{Api, Client};

/// The field manager of every write cnat makes.
pub const FIELD_MANAGER: &str = "cnat";

/// The parameters of every patch cnat makes (as `FIELD_MANAGER`).
pub fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    }
}

/// The pods of `namespace`, or of every namespace.
pub fn pod_api(client: &Client, namespace: Option<&str>) -> Api<Pod> {
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}
