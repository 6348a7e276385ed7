//! Log lines (JSON in a cluster, text on a terminal) carrying their span's trace and span ids,
//! and OpenTelemetry traces, exported over OTLP when an `OTEL_*` variable sets an endpoint.
//! See docs/src/operating/observability.md, "Traces" and "Logs".

use crate::cli::LogFormat;
use opentelemetry::trace::{SpanId, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchSpanProcessor, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use std::io::IsTerminal;
use std::time::Duration;
use thiserror::Error;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::format::{Format, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::{LookupSpan, SpanRef};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use super::exporter::ENDPOINT_VARS;

#[derive(Debug, Error)]
pub enum Error {
    #[error(
        "--log / CNAT_LOG {directives:?}: {source}; use RUST_LOG syntax, e.g. info,cnat=debug"
    )]
    Directives {
        directives: String,
        source: tracing_subscriber::filter::ParseError,
    },
    #[error(transparent)]
    Exporter(#[from] super::exporter::Error),
    #[error("a log subscriber is already installed: {0}")]
    Installed(#[from] tracing_subscriber::util::TryInitError),
}

/// The installed tracer; `shutdown` flushes what is still buffered.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    exporting: bool,
}

impl Telemetry {
    /// Whether spans go to an OTLP endpoint.
    pub fn exporting(&self) -> bool {
        self.exporting
    }

    /// Exports the spans still buffered, waiting at most `limit` for the collector.
    pub async fn shutdown(self, limit: Duration) {
        let provider = self.provider;
        // The SDK call blocks until its exporter thread is done; keep it off the async workers.
        let flushed =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(limit)).await;
        if let Ok(Err(error)) = flushed {
            eprintln!("cnat: flushing traces: {error}");
        }
    }
}

/// Installs the global log subscriber and tracer. `directives` are `RUST_LOG`-style, e.g.
/// `info,cnat=debug`; `identity` names this replica in the trace resource.
pub fn init(format: LogFormat, directives: &str, identity: &str) -> Result<Telemetry, Error> {
    let filter = EnvFilter::builder()
        .parse(directives)
        .map_err(|source| Error::Directives {
            directives: directives.to_owned(),
            source,
        })?;
    let (provider, exporting) = tracer_provider(identity)?;
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    // With an exporter, spans go to OpenTelemetry whatever the log level: only cnat's own. No
    // busy/idle times (a clock read per span entry and exit), threads or source locations.
    // Without one, no OpenTelemetry span is built at all (see `continue_trace`).
    let traces = exporting.then(|| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("cnat"))
            .with_tracked_inactivity(false)
            .with_threads(false)
            .with_location(false)
            .with_filter(Targets::new().with_target("cnat", Level::INFO))
    });
    let registry = tracing_subscriber::registry().with(traces);
    if json(format) {
        registry.with(json_layer().with_filter(filter)).try_init()?;
    } else {
        let text = tracing_subscriber::fmt::layer()
            .with_ansi(std::io::stdout().is_terminal())
            .event_format(WithTraceIds(Format::default()));
        registry.with(text.with_filter(filter)).try_init()?;
    }
    Ok(Telemetry {
        provider,
        exporting,
    })
}

/// A tracer with the batch OTLP exporter when an endpoint is configured, else one that only
/// hands out ids. Sampler, batch sizes, protocol, headers and timeouts come from `OTEL_*`.
fn tracer_provider(identity: &str) -> Result<(SdkTracerProvider, bool), Error> {
    let builder = SdkTracerProvider::builder().with_resource(resource(identity));
    let var = |name: &str| std::env::var(name).ok();
    if !export_configured(var) {
        return Ok((builder.build(), false));
    }
    let exporter = super::exporter::build()?;
    let batch = BatchSpanProcessor::builder(exporter).build();
    Ok((builder.with_span_processor(batch).build(), true))
}

/// Whether the environment asks for trace export: an OTLP endpoint is set, and neither
/// `OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none` turns it off.
pub fn export_configured(var: impl Fn(&str) -> Option<String>) -> bool {
    let is = |name: &str, value: &str| var(name).is_some_and(|v| v.trim() == value);
    super::first_set(&var, ENDPOINT_VARS).is_some()
        && !is("OTEL_SDK_DISABLED", "true")
        && !is("OTEL_TRACES_EXPORTER", "none")
}

/// `service.name` (cnat unless `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES` say otherwise),
/// `service.version`, `service.instance.id` (the replica identity) and the pod, when known.
fn resource(identity: &str) -> Resource {
    // The SDK's detectors (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES), run once.
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_some_and(|name| !name.as_str().starts_with("unknown_service"));
    let mut builder = Resource::builder_empty().with_attributes(
        detected
            .iter()
            .map(|(key, value)| KeyValue::new(key.clone(), value.clone())),
    );
    if !named {
        builder = builder.with_service_name("cnat");
    }
    let pod = [
        ("k8s.pod.name", "POD_NAME"),
        ("k8s.namespace.name", "POD_NAMESPACE"),
    ]
    .into_iter()
    .filter_map(|(key, var)| {
        let value = std::env::var(var).ok().filter(|v| !v.is_empty())?;
        Some(KeyValue::new(key, value))
    });
    builder
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_attribute(KeyValue::new("service.instance.id", identity.to_owned()))
        .with_attributes(pod)
        .build()
}

fn json(format: LogFormat) -> bool {
    match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => std::env::var_os("KUBERNETES_SERVICE_HOST").is_some(),
    }
}

/// One JSON object per line: timestamp, level, message and fields, target, the span list, and
/// `trace_id`/`span_id` inside a span.
fn json_layer<S>() -> json_subscriber::JsonLayer<S, fn() -> std::io::Stdout>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let mut layer = json_subscriber::JsonLayer::stdout();
    layer
        .with_timer("timestamp", tracing_subscriber::fmt::time::SystemTime)
        .with_level("level")
        .with_flattened_event()
        .with_target("target")
        .with_span_list("spans");
    layer.add_multiple_dynamic_fields(|event, context, fields| {
        if let Some((trace, span)) = context.event_span(event).and_then(|s| ids(&s)) {
            let _ = fields.write_field("trace_id", trace.to_string());
            if let Some(span) = span {
                let _ = fields.write_field("span_id", span.to_string());
            }
        }
    });
    layer
}

/// The text format, prefixed with `trace_id=… span_id=…` inside a span.
struct WithTraceIds(Format);

impl<S, N> FormatEvent<S, N> for WithTraceIds
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        if let Some((trace, span)) = ctx.parent_span().and_then(|s| ids(&s)) {
            write!(writer, "trace_id={trace} ")?;
            if let Some(span) = span {
                write!(writer, "span_id={span} ")?;
            }
        }
        self.0.format_event(ctx, writer, event)
    }
}

/// The trace of a caller's request (its `traceparent`), kept on the span of ours that serves
/// it while no span is exported: no OpenTelemetry span of ours exists then, the caller's does.
#[derive(Debug, Clone, Copy)]
struct CallerTrace(TraceId);

/// Makes `span` part of the trace `caller` carries: with an exporter, its OpenTelemetry parent;
/// without, the trace id its log lines (and those of the spans inside it) carry, with no span
/// id, there being no span of ours. A `caller` without a valid span context changes nothing.
pub fn continue_trace(span: &tracing::Span, caller: opentelemetry::Context) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::registry::SpanData;
    let remote = caller.span().span_context().clone();
    if !remote.is_valid() || span.set_parent(caller).is_ok() {
        return;
    }
    span.with_subscriber(|(id, dispatch)| {
        let registry = dispatch.downcast_ref::<tracing_subscriber::Registry>();
        if let Some(data) = registry.and_then(|registry| registry.span_data(id)) {
            data.extensions_mut().insert(CallerTrace(remote.trace_id()));
        }
    });
}

/// The trace and span ids the log lines of `span` carry: its OpenTelemetry ids when spans are
/// exported, else a caller's trace id kept by [`continue_trace`] on it or a span around it.
/// Only the global subscriber (`init`'s) is reachable from inside a subscriber, not a scoped one.
fn ids<S>(span: &SpanRef<'_, S>) -> Option<(TraceId, Option<SpanId>)>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let exported = tracing::dispatcher::get_default(|dispatch| {
        tracing_opentelemetry::get_otel_context(&span.id(), dispatch)
    });
    if let Some(context) = exported {
        let span = context.span();
        let ids = span.span_context();
        return ids
            .is_valid()
            .then(|| (ids.trace_id(), Some(ids.span_id())));
    }
    span.scope()
        .find_map(|span| span.extensions().get::<CallerTrace>().copied())
        .map(|CallerTrace(trace)| (trace, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observability::test_env::env;
    use std::sync::{Arc, Mutex};

    /// Text log lines written while `log` runs, with ids from a tracer that exports nothing.
    /// Installs the global subscriber: call it once per test process.
    fn text_lines(log: impl FnOnce()) -> Vec<String> {
        let buffer = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = buffer.clone();
        let writer = move || SharedWriter(sink.clone());
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")))
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .with_writer(writer)
                    .event_format(WithTraceIds(Format::default())),
            );
        // Global, as in `init`: a scoped dispatcher cannot be reached from inside a subscriber.
        tracing::subscriber::set_global_default(subscriber).unwrap();
        log();
        let text = String::from_utf8(buffer.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_owned).collect()
    }

    struct SharedWriter(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for SharedWriter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn text_lines_inside_a_span_start_with_its_trace_and_span_id() {
        let lines = text_lines(|| {
            tracing::info!("outside");
            let span = tracing::info_span!("reconcile");
            span.in_scope(|| tracing::info!("inside"));
        });
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(!lines[0].contains("trace_id="), "{}", lines[0]);
        let words: Vec<&str> = lines[1].split(' ').collect();
        let trace = words[0].strip_prefix("trace_id=").unwrap();
        let span = words[1].strip_prefix("span_id=").unwrap();
        assert_eq!((trace.len(), span.len()), (32, 16), "{}", lines[1]);
        assert!(trace.chars().all(|c| c.is_ascii_hexdigit()) && trace != "0".repeat(32));
        assert!(
            lines[1].ends_with("reconcile: cnat::observability::telemetry::tests: inside"),
            "{}",
            lines[1]
        );
    }

    #[test]
    fn exports_only_when_an_endpoint_is_set_and_not_switched_off() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317");
        let traces = (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://c:4318/v1/traces",
        );
        assert!(!export_configured(env(&[])));
        assert!(!export_configured(env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            " "
        )])));
        assert!(!export_configured(env(&[(
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "http://c:4318"
        )])));
        assert!(export_configured(env(&[endpoint])));
        assert!(export_configured(env(&[traces])));
        assert!(!export_configured(env(&[
            endpoint,
            ("OTEL_TRACES_EXPORTER", "none")
        ])));
        assert!(!export_configured(env(&[
            traces,
            ("OTEL_SDK_DISABLED", "true")
        ])));
        assert!(export_configured(env(&[
            endpoint,
            ("OTEL_SDK_DISABLED", "false"),
            ("OTEL_TRACES_EXPORTER", "otlp")
        ])));
    }
}
