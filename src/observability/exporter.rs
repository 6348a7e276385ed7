//! The OTLP span exporter for the endpoint and protocol the standard `OTEL_*` variables name;
//! over TLS, with connections made by `collector_tls` (its files read again for each one).
//! See docs/src/operating/observability.md, "Traces" and "TLS to the collector".

use super::collector_tls::{self, TlsFileError, TlsFiles};
use super::throttle::{Throttle, REPORT_EVERY};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tracing::warn;

/// The OTLP variables that name a trace endpoint, the most specific first.
pub const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];
const PROTOCOL_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
];
const INSECURE_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
    "OTEL_EXPORTER_OTLP_INSECURE",
];
const TIMEOUT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
];
/// How long a diagnosing connection waits for the collector to refuse it.
const DIAGNOSIS: Duration = Duration::from_secs(2);
/// The OTLP default export timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Error)]
pub enum Error {
    #[error("OTLP trace exporter: {0}; check OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_EXPORTER_OTLP_PROTOCOL (grpc or http/protobuf)")]
    Build(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("TLS to the trace collector: {0}")]
    Tls(#[from] TlsFileError),
    #[error("{var}={endpoint:?}: not a usable collector URL ({reason})")]
    Endpoint {
        var: &'static str,
        endpoint: String,
        reason: String,
    },
}

/// How spans leave: the protocol, and the endpoint when cnat makes the TLS connection itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Left to opentelemetry-otlp: plain HTTP, or a protocol it refuses with its own error.
    Library,
    /// OTLP/gRPC over TLS to `url` (named by `var`).
    GrpcTls { var: &'static str, url: String },
    /// OTLP/HTTP (protobuf) over TLS to the host and port of `url` (named by `var`); the
    /// library resolves the path.
    HttpTls { var: &'static str, url: String },
}

/// The route the variables ask for (`var` reads the environment).
pub fn route(var: impl Fn(&str) -> Option<String>) -> Route {
    let Some((endpoint_var, endpoint)) = super::first_set(&var, ENDPOINT_VARS) else {
        return Route::Library;
    };
    // As opentelemetry-otlp reads them: the first protocol it knows (any case), else its
    // default; INSECURE from the traces variable when set at all, else the generic one.
    let protocol = PROTOCOL_VARS
        .iter()
        .find_map(|name| {
            let value = var(name)?.trim().to_ascii_lowercase();
            ["grpc", "http/protobuf"]
                .contains(&value.as_str())
                .then_some(value)
        })
        .unwrap_or_else(|| "http/protobuf".to_owned());
    let insecure = INSECURE_VARS
        .iter()
        .find_map(|name| var(name))
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    // A scheme is what comes before "://", when no path, query or fragment starts earlier.
    let scheme = endpoint
        .split_once("://")
        .filter(|(scheme, _)| !scheme.contains(['/', '?', '#']))
        .map(|(scheme, _)| scheme.to_ascii_lowercase());
    match (protocol.as_str(), scheme.as_deref()) {
        ("grpc", Some("https")) => Route::GrpcTls {
            var: endpoint_var,
            url: endpoint,
        },
        // The OTLP rule: a schemeless gRPC endpoint is secure unless INSECURE says otherwise.
        ("grpc", None) if !insecure => Route::GrpcTls {
            var: endpoint_var,
            url: format!("https://{endpoint}"),
        },
        ("http/protobuf", Some("https")) => Route::HttpTls {
            var: endpoint_var,
            url: endpoint,
        },
        _ => Route::Library,
    }
}

/// The export timeout the variables set, in milliseconds (default 10 s).
fn timeout(var: impl Fn(&str) -> Option<String>) -> Duration {
    TIMEOUT_VARS
        .iter()
        .find_map(|name| var(name)?.trim().parse::<u64>().ok())
        .map_or(DEFAULT_TIMEOUT, Duration::from_millis)
}

/// The span exporter the environment asks for. Must run inside the tokio runtime: the TLS
/// connections live on it.
pub fn build() -> Result<Reported<opentelemetry_otlp::SpanExporter>, Error> {
    let var = |name: &str| std::env::var(name).ok();
    let builder = opentelemetry_otlp::SpanExporter::builder();
    let (name, url, grpc) = match route(var) {
        Route::Library => {
            return Ok(Reported {
                exporter: builder.build()?,
                tls: None,
                complaints: Throttle::every(REPORT_EVERY),
            })
        }
        Route::GrpcTls { var, url } => (var, url, true),
        Route::HttpTls { var, url } => (var, url, false),
    };
    let config = collector_tls::client_config(TlsFiles::from_env(var)?)?;
    let uri = parse(name, &url)?;
    let runtime = tokio::runtime::Handle::current();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config((*config).clone())
        .https_only();
    let (exporter, alpn): (_, &[u8]) = if grpc {
        let channel = tonic::transport::Endpoint::from(uri.clone())
            .timeout(timeout(var))
            .connect_with_connector_lazy(connector.enable_http2().build());
        let exporter = builder.with_tonic().with_channel(channel).build()?;
        (exporter, b"h2")
    } else {
        let connector = connector.enable_http1().build();
        let client = opentelemetry_http::hyper::HyperClient::new(connector, timeout(var), None);
        let on_runtime = OnRuntime {
            runtime: runtime.clone(),
            client: Arc::new(client),
        };
        let exporter = builder
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_http_client(on_runtime)
            .build()?;
        (exporter, b"http/1.1")
    };
    Ok(Reported {
        exporter,
        tls: Some(Diagnosis {
            config: with_alpn(&config, alpn),
            uri,
            runtime,
        }),
        complaints: Throttle::every(REPORT_EVERY),
    })
}

/// `url` (from variable `var`) as a URI with a host.
fn parse(var: &'static str, url: &str) -> Result<http::Uri, Error> {
    let invalid = |reason: String| Error::Endpoint {
        var,
        endpoint: url.to_owned(),
        reason,
    };
    let uri: http::Uri = url
        .parse()
        .map_err(|e: http::uri::InvalidUri| invalid(e.to_string()))?;
    match uri.host() {
        Some(_) => Ok(uri),
        None => Err(invalid("no host in it".into())),
    }
}

/// `config` offering `protocol` in ALPN, as the exporter's connections do (a gRPC collector
/// closes a connection that does not offer `h2`).
fn with_alpn(config: &Arc<rustls::ClientConfig>, protocol: &[u8]) -> Arc<rustls::ClientConfig> {
    let mut config = (**config).clone();
    config.alpn_protocols = vec![protocol.to_vec()];
    Arc::new(config)
}

/// How to find out why exports over TLS fail: a connection of our own with the same TLS
/// config, made on the runtime.
#[derive(Debug)]
struct Diagnosis {
    config: Arc<rustls::ClientConfig>,
    uri: http::Uri,
    runtime: tokio::runtime::Handle,
}

/// Runs an HTTP client's requests on the tokio runtime: the batch span processor exports from a
/// thread of its own, where hyper's connections could not be spawned.
#[derive(Debug)]
struct OnRuntime<C> {
    runtime: tokio::runtime::Handle,
    client: Arc<C>,
}

#[async_trait::async_trait]
impl<C: opentelemetry_http::HttpClient + 'static> opentelemetry_http::HttpClient for OnRuntime<C> {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let client = self.client.clone();
        self.runtime
            .spawn(async move { client.send_bytes(request).await })
            .await?
    }
}

/// An exporter whose failures are logged at most once per `REPORT_EVERY`, with the exporter's
/// error and, over TLS, what a connection of our own finds out (`collector_tls::diagnose`).
#[derive(Debug)]
pub struct Reported<E> {
    exporter: E,
    tls: Option<Diagnosis>,
    complaints: Throttle,
}

impl<E: SpanExporter> SpanExporter for Reported<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let exported = self.exporter.export(batch).await;
        if let Err(error) = &exported {
            if self.complaints.allow(std::time::Instant::now()) {
                let (error, reason) = (error.to_string(), "spans could not be exported to the trace collector (reported at most once a minute)");
                match &self.tls {
                    // Found out on the runtime, so that this thread goes on exporting.
                    Some(d) => {
                        let asked =
                            collector_tls::diagnose(d.config.clone(), d.uri.clone(), DIAGNOSIS);
                        d.runtime.spawn(async move {
                            let tls = asked.await;
                            warn!(error, tls, spans, "{reason}");
                        });
                    }
                    None => warn!(error, spans, "{reason}"),
                }
            }
        }
        exported
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.exporter.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.exporter.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.exporter.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observability::test_env::env;

    #[test]
    fn https_endpoints_and_schemeless_grpc_ones_go_over_tls() {
        let grpc_tls = |url: &str| Route::GrpcTls {
            var: "OTEL_EXPORTER_OTLP_ENDPOINT",
            url: url.into(),
        };
        let grpc = ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc");
        let generic = |url| ("OTEL_EXPORTER_OTLP_ENDPOINT", url);
        assert_eq!(route(env(&[])), Route::Library);
        assert_eq!(route(env(&[generic("http://c:4318")])), Route::Library);
        let http_tls = |var, url: &str| Route::HttpTls {
            var,
            url: url.into(),
        };
        let generic_var = "OTEL_EXPORTER_OTLP_ENDPOINT";
        assert_eq!(
            route(env(&[generic("https://c:4318")])),
            http_tls(generic_var, "https://c:4318")
        );
        assert_eq!(
            route(env(&[generic("HTTPS://c:4318")])),
            http_tls(generic_var, "HTTPS://c:4318")
        );
        assert_eq!(
            route(env(&[generic("http://c:4317"), grpc])),
            Route::Library
        );
        assert_eq!(
            route(env(&[generic("https://c:4317"), grpc])),
            grpc_tls("https://c:4317")
        );
        // Schemeless gRPC: TLS unless INSECURE=true (the OTLP rule); the _TRACES_ one first.
        assert_eq!(
            route(env(&[generic("c:4317"), grpc])),
            grpc_tls("https://c:4317")
        );
        assert_eq!(
            route(env(&[
                generic("c:4317"),
                grpc,
                ("OTEL_EXPORTER_OTLP_INSECURE", "TRUE")
            ])),
            Route::Library
        );
        assert_eq!(
            route(env(&[
                generic("c:4317"),
                grpc,
                ("OTEL_EXPORTER_OTLP_INSECURE", "true"),
                ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "false")
            ])),
            grpc_tls("https://c:4317")
        );
        // The traces variables win over the generic ones.
        assert_eq!(
            route(env(&[
                generic("http://c:4318"),
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "https://t:4318/v1/traces"
                )
            ])),
            http_tls(
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "https://t:4318/v1/traces"
            )
        );
        assert_eq!(
            route(env(&[
                generic("https://c:4317"),
                grpc,
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
            ])),
            http_tls(generic_var, "https://c:4317")
        );
        // Protocols in any case, as the library reads them; one it does not know gives way to
        // the generic variable.
        assert_eq!(
            route(env(&[
                generic("https://c:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "GRPC")
            ])),
            grpc_tls("https://c:4317")
        );
        assert_eq!(
            route(env(&[
                generic("https://c:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", " HTTP/PROTOBUF ")
            ])),
            http_tls(generic_var, "https://c:4318")
        );
        assert_eq!(
            route(env(&[
                generic("https://c:4317"),
                grpc,
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "bogus")
            ])),
            grpc_tls("https://c:4317")
        );
        // An empty traces INSECURE is set, and not "true": TLS, whatever the generic one says.
        assert_eq!(
            route(env(&[
                generic("c:4317"),
                grpc,
                ("OTEL_EXPORTER_OTLP_INSECURE", "true"),
                ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "")
            ])),
            grpc_tls("https://c:4317")
        );
        // IPv6 literals keep their brackets.
        assert_eq!(
            route(env(&[generic("https://[fd00::1]:4317"), grpc])),
            grpc_tls("https://[fd00::1]:4317")
        );
        assert_eq!(
            parse("OTEL_EXPORTER_OTLP_ENDPOINT", "https://[fd00::1]:4317")
                .unwrap()
                .host(),
            Some("[fd00::1]")
        );
        assert!(parse("OTEL_EXPORTER_OTLP_ENDPOINT", "https://").is_err());
        // A protocol cnat is not built with (http/json) falls back to the default, as the
        // library itself does.
        assert_eq!(
            route(env(&[
                generic("https://c:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
            ])),
            http_tls(generic_var, "https://c:4318")
        );
    }

    #[test]
    fn the_timeout_comes_from_the_variables_in_milliseconds() {
        assert_eq!(timeout(env(&[])), DEFAULT_TIMEOUT);
        assert_eq!(
            timeout(env(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "2500")])),
            Duration::from_millis(2500)
        );
        assert_eq!(
            timeout(env(&[
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
                ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "300")
            ])),
            Duration::from_millis(300)
        );
        assert_eq!(
            timeout(env(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")])),
            DEFAULT_TIMEOUT
        );
    }
}
