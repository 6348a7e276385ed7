//! Observability: what cnat tells about itself, as metrics, logs and traces.
//!
//! - `metrics`: Prometheus metrics, served by `serving::admin` on `/metrics`.
//! - `telemetry`: log lines carrying trace and span ids, and OpenTelemetry traces over OTLP.
//! - `collector_tls`: TLS and mutual TLS to the trace collector, its files re-read per connection.
//! - `exporter`: the OTLP span exporter for the configured endpoint and protocol.
//! - `throttle`: at most one report per period.

pub mod collector_tls;
pub mod exporter;
pub mod metrics;
pub mod telemetry;
pub mod throttle;

/// The environment as a test gives it: `vars`, nothing else.
#[cfg(test)]
pub(crate) mod test_env {
    pub fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        |name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    }
}
