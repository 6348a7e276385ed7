//! An OTLP trace receiver, as an OpenTelemetry Collector would run one: gRPC (`TraceService`)
//! or HTTP (`POST /v1/traces`, protobuf). It keeps every span it was sent.

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
    /// Receives OTLP/gRPC on a free local port.
    pub async fn grpc() -> (Self, SocketAddr) {
        let collector = Collector::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
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
        let collector = Collector::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let receiver = collector.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let receiver = receiver.clone();
                let service = hyper::service::service_fn(move |request| {
                    let receiver = receiver.clone();
                    async move { Ok::<_, Infallible>(receiver.http_export(request).await) }
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(socket), service),
                );
            }
        });
        (collector, addr)
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
