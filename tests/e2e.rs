//! End-to-end against a real kube-apiserver: by default the private control plane of
//! `support::envtest` (kube-apiserver, etcd and kube-controller-manager from
//! `KUBEBUILDER_ASSETS`: v1.24, and v1.37 in a second run; no kubelet, so each test writes its
//! pods' ends or runs them on KWOK nodes, `ControlPlane::kwok_nodes`), or a disposable real
//! cluster named by `CNAT_E2E_KUBECONFIG` (kind, k3d, ...), where pods really run. Without
//! either, every test here is skipped with one line saying how to enable it (fails instead, with
//! `CNAT_REQUIRE_REAL_SERVER=1`, as `scripts/test` runs them).
//!
//!     KUBEBUILDER_ASSETS=$(scripts/envtest) cargo nextest run --test e2e        # v1.24
//!     KUBEBUILDER_ASSETS=$(scripts/envtest 1.37) cargo nextest run --test e2e   # v1.37
//!
//! The operator runs in-process (the reconcile loop, or the whole `cnat run` binary where
//! leadership, webhooks or logs are under test), each test in a namespace of its own.

mod support;

#[path = "e2e/admission.rs"]
mod admission;
#[path = "e2e/bad_input.rs"]
mod bad_input;
#[path = "e2e/cel.rs"]
mod cel;
#[path = "e2e/certs.rs"]
mod certs;
#[path = "e2e/chart.rs"]
mod chart;
#[path = "e2e/demo.rs"]
mod demo;
#[path = "e2e/hostile.rs"]
mod hostile;
#[path = "e2e/kwok.rs"]
mod kwok;
#[path = "e2e/lease_shards.rs"]
mod lease_shards;
#[path = "e2e/lifecycle.rs"]
mod lifecycle;
#[path = "e2e/list_shards.rs"]
mod list_shards;
#[path = "e2e/mass_deletion.rs"]
mod mass_deletion;
#[path = "e2e/never_twice.rs"]
mod never_twice;
#[path = "e2e/rbac.rs"]
mod rbac;
#[path = "e2e/release.rs"]
mod release;
#[path = "e2e/requests.rs"]
mod requests;
#[path = "e2e/storage_migration.rs"]
mod storage_migration;
#[path = "e2e/upgrade.rs"]
mod upgrade;
