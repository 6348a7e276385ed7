pub mod api;
pub mod schedule;
pub mod pod;
