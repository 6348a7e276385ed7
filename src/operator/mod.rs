//! The operator: running each At's command in a pod once it falls due, and recording how it
//! went, against the API server.
//!
//! - `controller`: wires the reconciler to the cluster: watches and kube-runtime's `Controller`.
//! - `reconcile`: the pure state machine (`reconcile::decide`) and carrying its decisions out.
//! - `events`: the one queue of Kubernetes Events, in per-object lanes; nothing waits for one.
//! - `priority`: pod creates before status writes before events, when many Ats fall due.
//! - `slow_start`: the first pod creates of a wave go out few at a time, so the first pods come soon.
//! - `reachability`: resumes work when an unreachable API server answers again.
//! - `pod`: the pod an At runs in: name, labels, spec and the summary `decide` reads; pure.
//! - `policy`: operator-wide run policy (`cnat run --default-*`) for what an At leaves out.
//! - `cache`: the Ats as every replica caches them, leader or not (compact `CachedAt`).
//! - `shrink`: gives back the table a per-At map grew to in a burst.
//! - `key`: `AtKey`, how the operator names an At everywhere.
//! - `triggers`: what brings an At to a reconcile: the cache's changes, first looks, sweeps.
//! - `finalizer`: cnat's finalizer on its pods: when it may go, and the one way it is removed.
//! - `release`: `cnat release`, every pod let go of cnat's finalizer (helm uninstall's hook).
//! - `quarantine`: a panic in the loop is caught, logged with its At and ends the loop.

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

/// The field manager of every write cnat makes.
pub const FIELD_MANAGER: &str = "cnat";
