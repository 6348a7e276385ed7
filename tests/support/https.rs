//! An HTTPS client for the webhook server, trusting only the test CA.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

pub type Https = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// An HTTPS client that trusts only the CA in `ca`, restricted to `versions`.
pub fn client(ca: &Path, versions: &[&'static rustls::SupportedProtocolVersion]) -> Https {
    Client::builder(TokioExecutor::new()).build(connector(ca, versions))
}

/// A request body sent in pieces: what is sent on the channel, when it is sent.
pub type Trickle = http_body_util::StreamBody<
    futures::stream::BoxStream<'static, Result<hyper::body::Frame<Bytes>, std::io::Error>>,
>;

/// Posts to `path` a body of `length` bytes that arrives only as `pieces` sends it; returns the
/// HTTP status once the server answers.
pub async fn post_trickled(
    ca: &Path,
    addr: SocketAddr,
    path: &str,
    length: usize,
    pieces: tokio::sync::mpsc::Receiver<Bytes>,
) -> Result<u16, String> {
    post_trickled_answer(ca, addr, path, length, pieces)
        .await
        .map(|(status, _)| status)
}

/// As [`post_trickled`], with the whole answer's body (read to its end).
pub async fn post_trickled_answer(
    ca: &Path,
    addr: SocketAddr,
    path: &str,
    length: usize,
    pieces: tokio::sync::mpsc::Receiver<Bytes>,
) -> Result<(u16, Bytes), String> {
    use futures::StreamExt;
    use http_body_util::BodyExt;
    let client: Client<_, Trickle> =
        Client::builder(TokioExecutor::new()).build(connector(ca, rustls::DEFAULT_VERSIONS));
    let frames = futures::stream::unfold(pieces, |mut rx| async {
        rx.recv()
            .await
            .map(|piece| (Ok(hyper::body::Frame::data(piece)), rx))
    })
    .boxed();
    let request = http::Request::post(format!("https://localhost:{}{path}", addr.port()))
        .header("content-type", "application/json")
        .header("content-length", length.to_string())
        .body(http_body_util::StreamBody::new(frames))
        .unwrap();
    let response = client
        .request(request)
        .await
        .map_err(|e| format!("{e:?}"))?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await;
    Ok((status, body.map(|b| b.to_bytes()).unwrap_or_default()))
}

/// A TLS client configuration trusting the CA in `ca` (PEM), without a client certificate.
pub fn trusting_config(ca: &Path) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca).unwrap();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&pem) {
        roots.add(cert.unwrap()).unwrap();
    }
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth()
}

fn connector(
    ca: &Path,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> hyper_rustls::HttpsConnector<HttpConnector> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca).unwrap();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&pem) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(versions)
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .enable_http1()
        .build()
}

/// An HTTPS client that trusts only the CA in `ca` and presents `cert` with `key` (PEM).
pub fn client_with_certificate(ca: &Path, cert: &str, key: &str) -> Https {
    let mut roots = rustls::RootCertStore::empty();
    for der in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(der.unwrap()).unwrap();
    }
    use rustls::pki_types::pem::PemObject;
    let chain = rustls::pki_types::CertificateDer::pem_slice_iter(cert.as_bytes())
        .map(Result::unwrap)
        .collect();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_client_auth_cert(chain, key)
    .unwrap();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .enable_http1()
        .build();
    Client::builder(TokioExecutor::new()).build(connector)
}

pub async fn post(
    client: &Https,
    addr: SocketAddr,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), String> {
    post_with(client, addr, path, &[], body).await
}

/// `post` with extra request headers.
pub async fn post_with(
    client: &Https,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), String> {
    let mut request = http::Request::post(format!("https://localhost:{}{path}", addr.port()))
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(Bytes::from(body))).unwrap();
    let response = client
        .request(request)
        .await
        .map_err(|e| format!("{e:?}"))?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, body.to_vec()))
}

/// Reads one HTTP/1.1 answer from `stream` (its body as long as its `Content-Length`, none
/// without one) and returns its status code; an error when the stream ends first.
pub async fn read_answer(stream: &mut (impl tokio::io::AsyncRead + Unpin)) -> std::io::Result<u16> {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let end = loop {
        if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        seen.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
    let length: usize = (head.lines())
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while seen.len() < end + 4 + length {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        seen.extend_from_slice(&buf[..n]);
    }
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok());
    status.ok_or_else(|| std::io::Error::other(head.clone()))
}
