//! Logging setup: structured JSON lines in a cluster, readable text on a terminal.

use crate::cli::LogFormat;
use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// Installs the global log subscriber. `directives` are `RUST_LOG`-style, e.g. `info,cnat=debug`.
pub fn init(
    format: LogFormat,
    directives: &str,
) -> Result<(), tracing_subscriber::filter::ParseError> {
    let filter = EnvFilter::builder().parse(directives)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal());
    if json(format) {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init();
    } else {
        builder.init();
    }
    Ok(())
}

fn json(format: LogFormat) -> bool {
    match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => std::env::var_os("KUBERNETES_SERVICE_HOST").is_some(),
    }
}
