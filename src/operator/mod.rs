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

/// The field manager of every write cnat makes.
pub const FIELD_MANAGER: &str = "cnat";
