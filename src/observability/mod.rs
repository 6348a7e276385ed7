//! Observability: what cnat tells about itself, as metrics, logs and traces.
//!
//! - `metrics`: Prometheus metrics, served by `serving::admin` on `/metrics`.
//! - `telemetry`: log lines carrying trace and span ids, and OpenTelemetry traces over OTLP.

pub mod metrics;
pub mod telemetry;
