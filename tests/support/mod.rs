//! Test doubles shared by the integration tests and benchmarks.

pub mod apiserver;
