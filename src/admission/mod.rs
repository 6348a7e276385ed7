//! Admission: the rules an At must follow before the API server stores it, the webhooks that
//! apply them, and the same rules offline.
//!
//! - `webhook`: the webhooks' HTTP side: AdmissionReview in and out, over TLS.
//! - `validation`: the rules an At must follow, shared with `cnat check`; pure.
//! - `defaulting`: the mutating webhook's defaults as RFC 6902 JSON patches; pure.
//! - `access_review`: the escalation guard: an At's author must be allowed to create its pod.
//! - `check`: `cnat check`: the validating webhook's rules, offline, over manifest files.

pub mod access_review;
pub mod check;
pub mod defaulting;
pub mod validation;
pub mod webhook;
