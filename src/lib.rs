pub mod api;
pub mod pod;
pub mod reconcile;
pub mod schedule;
