//! The integration tests that need no real API server or cluster, in one binary (one build of
//! `support` and one link instead of sixteen): the chart, the CRD, the docs, the image, the
//! process, the fake API server's controller and leader tests, the webhooks, observability.
//! Each file is a module; `cargo nextest run --test integration -E 'test(/^chart::/)'` runs one.

mod support;

#[path = "integration/alerts.rs"]
mod alerts;
#[path = "integration/chart.rs"]
mod chart;
#[path = "integration/controller.rs"]
mod controller;
#[path = "integration/crd.rs"]
mod crd;
#[path = "integration/docs.rs"]
mod docs;
#[path = "integration/image.rs"]
mod image;
#[path = "integration/krew.rs"]
mod krew;
#[path = "integration/kubectl_at.rs"]
mod kubectl_at;
#[path = "integration/leader.rs"]
mod leader;
#[path = "integration/manifests.rs"]
mod manifests;
#[path = "integration/observability.rs"]
mod observability;
#[path = "integration/perf_guard.rs"]
mod perf_guard;
#[path = "integration/process.rs"]
mod process;
#[path = "integration/prometheus.rs"]
mod prometheus;
#[path = "integration/properties.rs"]
mod properties;
#[path = "integration/structure.rs"]
mod structure;
#[path = "integration/webhook.rs"]
mod webhook;
