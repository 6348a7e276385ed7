//! The CRD's CEL transition rule (`status.phase` never goes back) on kube-apiserver v1.24. CEL
//! validation is alpha in 1.24 (feature gate `CustomResourceValidationExpressions`, off by
//! default; on in this control plane, as `../shared/envtest` recommends); with the gate on, 1.24
//! evaluates transition rules (`oldSelf`) too. What 1.24 does is recorded here, so a change
//! shows.

use crate::lifecycle::at;
use cnat::api::At;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;

#[tokio::test]
async fn on_1_24_with_the_cel_gate_on_the_transition_rule_is_enforced() {
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
    // The control plane here runs with the gate on (as `../shared/envtest` recommends): the rule
    // holds. A 1.24 server with the gate off (the default) accepts the write instead; the
    // validating webhook's status rule does not cover it either (ats/status is not in its rules,
    // so the operator never depends on the webhook), which leaves the operator's own
    // resourceVersion-guarded writes as the guarantee there.
    let refused = back.expect_err("Done -> Pending is refused by the transition rule");
    assert!(
        refused.to_string().contains("status.phase cannot go back"),
        "{refused}"
    );
}
