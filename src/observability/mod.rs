//! Observability: what cnat tells about itself, as metrics, logs and traces.
//! See docs/src/operating/observability.md, and docs/src/development.md, "Source layout".

pub mod collector_tls;
pub mod exporter;
pub mod metrics;
pub mod telemetry;
pub mod throttle;

/// The first of `names` (OTLP variables, the most specific first) that `var` (the environment)
/// sets to more than blanks, with its value trimmed.
fn first_set(
    var: impl Fn(&str) -> Option<String>,
    names: [&'static str; 2],
) -> Option<(&'static str, String)> {
    names.into_iter().find_map(|name| {
        let value = var(name).filter(|v| !v.trim().is_empty())?;
        Some((name, value.trim().to_owned()))
    })
}

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
