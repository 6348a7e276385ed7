//! An OTLP trace receiver, as an OpenTelemetry Collector would run one: gRPC (`TraceService`)
//! or HTTP (`POST /v1/traces`, protobuf), in plain text or over TLS (optionally requiring a
//! client certificate, its certificates replaceable while it runs). It keeps every span it was
//! sent.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// A received span with its resource's attributes, attributes as strings.
#[derive(Debug, Clone)]
pub struct Received {
    pub resource: HashMap<String, String>,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub attributes: HashMap<String, String>,
}

#[derive(Debug, Clone, Default)]
pub struct Collector {
    requests: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
}

impl Collector {
    /// A new collector and a listener on a free local port.
    async fn listening() -> (Self, tokio::net::TcpListener, SocketAddr) {
        Collector::listening_on("127.0.0.1").await
    }

    /// A new collector and a listener on a free port of `ip`, an address of this machine.
    async fn listening_on(ip: &str) -> (Self, tokio::net::TcpListener, SocketAddr) {
        let listener = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        (Collector::default(), listener, addr)
    }

    /// Receives OTLP/gRPC on a free local port.
    pub async fn grpc() -> (Self, SocketAddr) {
        Collector::grpc_on("127.0.0.1").await
    }

    /// Receives OTLP/gRPC on a free port of `ip` (e.g. where pods reach the host).
    pub async fn grpc_on(ip: &str) -> (Self, SocketAddr) {
        let (collector, listener, addr) = Collector::listening_on(ip).await;
        let service = TraceServiceServer::new(collector.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        (collector, addr)
    }

    /// Receives OTLP/HTTP with protobuf bodies on a free local port.
    pub async fn http() -> (Self, SocketAddr) {
        let (collector, listener, addr) = Collector::listening().await;
        let receiver = collector.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let io = hyper_util::rt::TokioIo::new(socket);
                tokio::spawn(receiver.clone().serve_http1(io));
            }
        });
        (collector, addr)
    }

    /// Receives OTLP over TLS with `tls` on a free local port: gRPC (HTTP/2) or HTTP/1.1.
    pub async fn tls(grpc: bool, tls: ServerTls) -> (Self, SocketAddr) {
        let (collector, listener, addr) = Collector::listening().await;
        let receiver = collector.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (receiver, tls_) = (receiver.clone(), tls.clone());
                let connection = tokio::spawn(async move {
                    let acceptor = tokio_rustls::TlsAcceptor::from(tls_.current());
                    // A refused handshake (no or a wrong client certificate) ends here.
                    let Ok(stream) = acceptor.accept(socket).await else {
                        tls_.refused
                            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        return;
                    };
                    let io = hyper_util::rt::TokioIo::new(stream);
                    if grpc {
                        let service = hyper_util::service::TowerToHyperService::new(
                            TraceServiceServer::new(receiver),
                        );
                        let _ = hyper::server::conn::http2::Builder::new(
                            hyper_util::rt::TokioExecutor::new(),
                        )
                        .serve_connection(io, service)
                        .await;
                    } else {
                        receiver.serve_http1(io).await;
                    }
                });
                tls.connections
                    .lock()
                    .unwrap()
                    .push(connection.abort_handle());
            }
        });
        (collector, addr)
    }

    /// Serves OTLP/HTTP on one HTTP/1.1 connection until it ends.
    async fn serve_http1<I>(self, io: I)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let service = hyper::service::service_fn(move |request| {
            let receiver = self.clone();
            async move { Ok::<_, Infallible>(receiver.http_export(request).await) }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(io, service)
            .await;
    }

    async fn http_export(
        &self,
        request: hyper::Request<hyper::body::Incoming>,
    ) -> hyper::Response<http_body_util::Full<bytes::Bytes>> {
        use http_body_util::BodyExt;
        let wanted = request.uri().path() == "/v1/traces"
            && request.headers().get("content-type").map(|v| v.as_bytes())
                == Some(b"application/x-protobuf");
        let body = request.into_body().collect().await.unwrap().to_bytes();
        let decoded = ExportTraceServiceRequest::decode(body);
        let (status, reply) = match decoded {
            Ok(export) if wanted => {
                self.requests.lock().unwrap().push(export);
                (200, ExportTraceServiceResponse::default().encode_to_vec())
            }
            _ => (400, Vec::new()),
        };
        hyper::Response::builder()
            .status(status)
            .header("content-type", "application/x-protobuf")
            .body(http_body_util::Full::new(reply.into()))
            .unwrap()
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Received> {
        let requests = self.requests.lock().unwrap();
        let mut spans = Vec::new();
        for resource_spans in requests.iter().flat_map(|r| &r.resource_spans) {
            let resource = resource_spans
                .resource
                .as_ref()
                .map(|r| strings(&r.attributes))
                .unwrap_or_default();
            for span in resource_spans.scope_spans.iter().flat_map(|s| &s.spans) {
                spans.push(received(&resource, span));
            }
        }
        spans
    }
}

/// A test PKI: a CA, a serving certificate for `localhost`/`127.0.0.1` and a client
/// certificate, signed by it; as PEM, and written as `ca.crt`, `server.crt`, `server.key`,
/// `client.crt`, `client.key` by `write`.
pub struct Pki {
    pub ca: String,
    pub server_cert: String,
    pub server_key: String,
    pub client_cert: String,
    pub client_key: String,
}

impl Pki {
    pub fn new() -> Self {
        use rcgen::{
            BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
        };
        let ca_key = KeyPair::generate().unwrap();
        static MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let made = MADE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.distinguished_name.push(
            rcgen::DnType::CommonName,
            format!("test collector CA {} {made}", std::process::id()),
        );
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        let leaf = |names: Vec<String>, usage| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(names).unwrap();
            params.extended_key_usages = vec![usage];
            let cert = params.signed_by(&key, &issuer).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(
            vec!["localhost".into(), "127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_cert, client_key) =
            leaf(vec!["cnat".into()], ExtendedKeyUsagePurpose::ClientAuth);
        Pki {
            ca: ca_cert.pem(),
            server_cert,
            server_key,
            client_cert,
            client_key,
        }
    }

    /// Writes the files into `dir`, each replaced at once (written aside, then renamed over),
    /// as a Secret volume's update appears to a reader.
    pub fn write(&self, dir: &std::path::Path) {
        std::fs::create_dir_all(dir).unwrap();
        for (name, contents) in [
            ("ca.crt", &self.ca),
            ("server.crt", &self.server_cert),
            ("server.key", &self.server_key),
            ("client.crt", &self.client_cert),
            ("client.key", &self.client_key),
        ] {
            let aside = dir.join(format!(".{name}.new"));
            std::fs::write(&aside, contents).unwrap();
            std::fs::rename(&aside, dir.join(name)).unwrap();
        }
    }
}

/// A collector's TLS: its serving certificate and, optionally, the CA client certificates must
/// chain to. `rotate` replaces them and closes the open connections.
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<Mutex<Arc<rustls::ServerConfig>>>,
    connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    /// Handshakes refused so far.
    pub refused: Arc<std::sync::atomic::AtomicUsize>,
}

impl ServerTls {
    /// Serving `pki`'s server certificate; requiring a client certificate from `pki`'s CA when
    /// `mutual`.
    pub fn new(pki: &Pki, mutual: bool) -> Self {
        ServerTls {
            config: Arc::new(Mutex::new(server_config(pki, mutual))),
            connections: Arc::default(),
            refused: Arc::default(),
        }
    }

    fn current(&self) -> Arc<rustls::ServerConfig> {
        self.config.lock().unwrap().clone()
    }

    /// Closes the open connections; the certificates and session tickets stay.
    pub fn drop_connections(&self) {
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }

    /// From now on, `pki`'s certificates; the open connections are closed.
    pub fn rotate(&self, pki: &Pki, mutual: bool) {
        *self.config.lock().unwrap() = server_config(pki, mutual);
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }
}

fn server_config(pki: &Pki, mutual: bool) -> Arc<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = vec![CertificateDer::from_pem_slice(pki.server_cert.as_bytes()).unwrap()];
    let key = PrivateKeyDer::from_pem_slice(pki.server_key.as_bytes()).unwrap();
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = if mutual {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(pki.ca.as_bytes()).unwrap())
            .unwrap();
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .unwrap();
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let mut config = builder.with_single_cert(chain, key).unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Arc::new(config)
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.requests.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn received(resource: &HashMap<String, String>, span: &Span) -> Received {
    Received {
        resource: resource.clone(),
        name: span.name.clone(),
        trace_id: hex(&span.trace_id),
        span_id: hex(&span.span_id),
        parent_span_id: hex(&span.parent_span_id),
        attributes: strings(&span.attributes),
    }
}

fn strings(attributes: &[KeyValue]) -> HashMap<String, String> {
    attributes
        .iter()
        .map(|kv| {
            let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => s.clone(),
                Some(any_value::Value::BoolValue(b)) => b.to_string(),
                Some(any_value::Value::IntValue(i)) => i.to_string(),
                Some(any_value::Value::DoubleValue(d)) => d.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), value)
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
