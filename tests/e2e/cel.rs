//! The CRD's CEL transition rule (`status.phase` never goes back) on each supported
//! kube-apiserver. CEL validation is alpha in 1.24 (feature gate
//! `CustomResourceValidationExpressions`, off by default; on in the 1.24 control plane here, as
//! `../shared/envtest` recommends), beta and on by default from 1.25, GA in 1.29; with it,
//! transition rules (`oldSelf`) hold. What each server does is recorded here, so a change
//! shows.

use crate::lifecycle::at;
use cnat::api::At;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;

#[tokio::test]
async fn the_transition_rule_is_enforced_by_the_api_server() {
    let plane = crate::real_control_plane!();
    let admin = plane.admin().await;
    crate::support::envtest::install_crd(&admin, &cnat::api::crd_yaml()).await;
    let ns = plane.namespace("cel", &[]).await;
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    ats.create(
        &PostParams::default(),
        &at("once", chrono::Utc::now(), "true"),
    )
    .await
    .unwrap();
    let status = |phase: &str| json!({"status": {"phase": phase}});
    let params = PatchParams::default();
    ats.patch_status("once", &params, &Patch::Merge(&status("Done")))
        .await
        .expect("Pending -> Done is allowed");
    let back = ats
        .patch_status("once", &params, &Patch::Merge(&status("Pending")))
        .await;
    // Every control plane here runs with CEL on (1.24 with its gate on, as `../shared/envtest`
    // recommends): the rule holds. A 1.24 server with the gate off (its default) accepts the
    // write instead; the validating webhook's status rule does not cover it either (ats/status is not in its rules,
    // so the operator never depends on the webhook), which leaves the operator's own
    // resourceVersion-guarded writes as the guarantee there.
    let refused = back.expect_err("Done -> Pending is refused by the transition rule");
    assert!(
        refused.to_string().contains("status.phase cannot go back"),
        "{refused}"
    );
}
