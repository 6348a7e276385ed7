//! Observability: what cnat tells about itself, as metrics, logs and traces.
//! See docs/src/operating/observability.md, and docs/src/development.md, "Source layout".

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
