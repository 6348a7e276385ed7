//! A faithful equivalent of kube-rs's `examples/admission_controller.rs`, built with the kube
//! version in Cargo.lock, for the webhook bench to compare against: warp over rustls, a `/mutate`
//! route taking `AdmissionReview<DynamicObject>` as JSON, `tracing_subscriber::fmt` logging (one
//! info line per accepted review), the example's own rule (deny an `illegal` label, else add an
//! `admission` label with a JSON patch) and its reply. Only the address and the certificate paths
//! come from the bench instead of fixed names. Written for this bench, not copied.

use json_patch::jsonptr::PointerBuf;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use kube::core::{DynamicObject, ResourceExt};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use warp::{reply, Filter, Reply};

/// Serves `/mutate` on `addr` with the certificate and key at the given paths until killed.
pub async fn serve(addr: SocketAddr, cert: &Path, key: &Path) {
    tracing_subscriber::fmt::init();
    let routes = warp::path("mutate")
        .and(warp::body::json())
        .and_then(handle)
        .with(warp::trace::request());
    warp::serve(warp::post().and(routes))
        .tls()
        .cert_path(cert)
        .key_path(key)
        .run(addr)
        .await;
}

async fn handle(body: AdmissionReview<DynamicObject>) -> Result<impl Reply, Infallible> {
    let request: AdmissionRequest<_> = match body.try_into() {
        Ok(request) => request,
        Err(error) => {
            tracing::error!("invalid request: {error}");
            let invalid = AdmissionResponse::invalid(error.to_string()).into_review();
            return Ok(reply::json(&invalid));
        }
    };
    let mut response = AdmissionResponse::from(&request);
    if let Some(object) = request.object {
        let name = object.name_any();
        response = match label(response.clone(), &object) {
            Ok(labelled) => {
                tracing::info!("accepted: {:?} on Foo {}", request.operation, name);
                labelled
            }
            Err(why) => {
                tracing::warn!("denied: {:?} on {} ({})", request.operation, name, why);
                response.deny(why)
            }
        };
    }
    Ok(reply::json(&response.into_review()))
}

/// The example's rule: refuse an `illegal` label, else make sure an `admission` label is there.
fn label(response: AdmissionResponse, object: &DynamicObject) -> Result<AdmissionResponse, String> {
    if object.labels().contains_key("illegal") {
        return Err("Resource contained 'illegal' label".into());
    }
    if object.labels().contains_key("admission") {
        return Ok(response);
    }
    let mut operations = Vec::new();
    if object.metadata.labels.is_none() {
        operations.push(json_patch::PatchOperation::Add(json_patch::AddOperation {
            path: PointerBuf::from_tokens(["metadata", "labels"]),
            value: serde_json::json!({}),
        }));
    }
    operations.push(json_patch::PatchOperation::Add(json_patch::AddOperation {
        path: PointerBuf::from_tokens(["metadata", "labels", "admission"]),
        value: "modified-by-admission-controller".into(),
    }));
    response
        .with_patch(json_patch::Patch(operations))
        .map_err(|e| e.to_string())
}
