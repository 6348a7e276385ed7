//! TLS to the trace collector: the CA bundle and client certificate the OTLP variables name,
//! read again for every new connection (a file that cannot be used keeps the previous ones).
//! See docs/src/operating/observability.md, "TLS to the collector".

use super::first_set;
use crate::observability::throttle::{Throttle, REPORT_EVERY};
use crate::sync::lock;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use thiserror::Error;
use tracing::{info, warn};

/// The CA bundle variables, the most specific first.
pub const CA_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
];
/// The client certificate chain variables, the most specific first.
pub const CERT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
];
/// The client key variables, the most specific first.
pub const KEY_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
    "OTEL_EXPORTER_OTLP_CLIENT_KEY",
];

/// A file named by a variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileVar {
    pub var: &'static str,
    pub path: PathBuf,
}

impl FileVar {
    /// The `File` error: this file cannot be used, for `problem`.
    fn error(&self, problem: String) -> TlsFileError {
        TlsFileError::File {
            file: self.clone(),
            problem,
        }
    }
}

impl std::fmt::Display for FileVar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.var, self.path.display())
    }
}

/// The files the variables name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsFiles {
    /// The CA bundle; without it, the system's roots.
    pub ca: Option<FileVar>,
    /// The client certificate chain and its key, for mutual TLS.
    pub client: Option<(FileVar, FileVar)>,
}

/// Why the collector's TLS files cannot be used. Each names the variable, the file and the fix.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TlsFileError {
    #[error("{file}: {problem}")]
    File { file: FileVar, problem: String },
    #[error("{file} is set but {missing} is not: mutual TLS needs both the client certificate and its key")]
    Half {
        file: FileVar,
        missing: &'static str,
    },
    #[error("{cert} and {key}: the key does not belong to the certificate ({reason})")]
    Mismatch {
        cert: FileVar,
        key: FileVar,
        reason: String,
    },
    #[error("an https:// collector, but no CA to verify it: this system has no CA certificates; set OTEL_EXPORTER_OTLP_CERTIFICATE to the collector's CA bundle (PEM)")]
    NoRoots,
}

impl TlsFiles {
    /// The files named by `var` (the environment), the `_TRACES_` variables first.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Self, TlsFileError> {
        let first = |names: [&'static str; 2]| {
            first_set(&var, names).map(|(name, path)| FileVar {
                var: name,
                path: PathBuf::from(path),
            })
        };
        let client = match (first(CERT_VARS), first(KEY_VARS)) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (Some(file), None) => {
                return Err(TlsFileError::Half {
                    file,
                    missing: KEY_VARS[1],
                })
            }
            (None, Some(file)) => {
                return Err(TlsFileError::Half {
                    file,
                    missing: CERT_VARS[1],
                })
            }
            (None, None) => None,
        };
        Ok(TlsFiles {
            ca: first(CA_VARS),
            client,
        })
    }
}

/// The files' contents as last read, to see whether they changed.
#[derive(Debug, PartialEq, Eq, Clone)]
struct Contents {
    ca: Option<Vec<u8>>,
    cert: Option<Vec<u8>>,
    key: Option<Vec<u8>>,
}

/// What the files hold, ready for a handshake.
#[derive(Debug)]
struct Loaded {
    contents: Contents,
    verifier: Arc<WebPkiServerVerifier>,
    client: Option<Arc<CertifiedKey>>,
}

/// Reads every file; an unreadable one is a `File` error naming it.
fn read(files: &TlsFiles) -> Result<Contents, TlsFileError> {
    let read = |file: &FileVar| {
        std::fs::read(&file.path).map_err(|e| file.error(format!("cannot read it: {e}")))
    };
    Ok(Contents {
        ca: files.ca.as_ref().map(read).transpose()?,
        cert: files.client.as_ref().map(|(c, _)| read(c)).transpose()?,
        key: files.client.as_ref().map(|(_, k)| read(k)).transpose()?,
    })
}

/// PEM certificates in `bytes`, or a `File` error for `file`.
fn certificates(
    file: &FileVar,
    bytes: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let mut certs = Vec::new();
    for cert in CertificateDer::pem_slice_iter(bytes) {
        certs.push(cert.map_err(|e| file.error(format!("not a PEM certificate file: {e}")))?);
    }
    if certs.is_empty() {
        return Err(
            file.error("no PEM certificate in it (expected -----BEGIN CERTIFICATE-----)".into())
        );
    }
    Ok(certs)
}

/// Parses `contents` (read from `files`) into a verifier and a client identity.
fn load(
    files: &TlsFiles,
    contents: Contents,
    provider: &Arc<CryptoProvider>,
    system_roots: impl Fn() -> Vec<CertificateDer<'static>>,
) -> Result<Loaded, TlsFileError> {
    let mut roots = RootCertStore::empty();
    match (&files.ca, &contents.ca) {
        (Some(file), Some(bytes)) => {
            for cert in certificates(file, bytes)? {
                roots
                    .add(cert)
                    .map_err(|e| file.error(format!("not a usable CA certificate: {e}")))?;
            }
        }
        _ => {
            roots.add_parsable_certificates(system_roots());
            if roots.is_empty() {
                return Err(TlsFileError::NoRoots);
            }
        }
    }
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| match &files.ca {
            Some(file) => file.error(format!("not a usable CA bundle: {e}")),
            None => TlsFileError::NoRoots,
        })?;
    let client = match (&files.client, &contents.cert, &contents.key) {
        (Some((cert_file, key_file)), Some(cert), Some(key)) => {
            let chain = certificates(cert_file, cert)?;
            let key_der = PrivateKeyDer::from_pem_slice(key)
                .map_err(|e| key_file.error(format!("no usable PEM private key in it ({e})")))?;
            let identity = CertifiedKey::from_der(chain, key_der, provider).map_err(|e| {
                TlsFileError::Mismatch {
                    cert: cert_file.clone(),
                    key: key_file.clone(),
                    reason: e.to_string(),
                }
            })?;
            Some(Arc::new(identity))
        }
        _ => None,
    };
    Ok(Loaded {
        contents,
        verifier,
        client,
    })
}

/// The system's CA certificates (in cnat's image, Debian's bundle).
fn system_roots() -> Vec<CertificateDer<'static>> {
    rustls_native_certs::load_native_certs().certs
}

/// Verifies the collector and presents the client certificate with what the files hold now.
#[derive(Debug)]
struct Reloading {
    files: TlsFiles,
    provider: Arc<CryptoProvider>,
    loaded: Mutex<Arc<Loaded>>,
    /// Reports of a changed file that cannot be used.
    broken_files: Throttle,
    /// Reports of a collector whose certificate does not verify.
    unverified: Throttle,
}

impl Reloading {
    /// The files as they are now: read again, parsed again (outside the lock, so handshakes do
    /// not wait on each other's file reads) if they changed;
    /// a change that cannot be used is reported and the previous contents kept.
    fn current(&self) -> Arc<Loaded> {
        let held = lock(&self.loaded).clone();
        let fresh = read(&self.files).and_then(|contents| {
            if contents == held.contents {
                return Ok(None);
            }
            load(&self.files, contents, &self.provider, system_roots).map(Some)
        });
        match fresh {
            Ok(None) => held,
            Ok(Some(new)) => {
                let new = Arc::new(new);
                let mut loaded = lock(&self.loaded);
                // Another handshake may have loaded the same change meanwhile: one log line.
                if loaded.contents != new.contents {
                    info!(ca = ?self.files.ca.as_ref().map(|f| f.path.display().to_string()), client_certificate = ?self.files.client.as_ref().map(|(c, _)| c.path.display().to_string()), "reloaded the trace collector's TLS files");
                    *loaded = new;
                }
                loaded.clone()
            }
            Err(error) => {
                if self.broken_files.allow(std::time::Instant::now()) {
                    warn!(%error, "the trace collector's TLS files changed but cannot be used; keeping the previous ones");
                }
                held
            }
        }
    }
}

impl ServerCertVerifier for Reloading {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.current().verifier.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        );
        if let Err(error) = &verified {
            if self.unverified.allow(std::time::Instant::now()) {
                let ca = self.files.ca.as_ref().map_or_else(
                    || "the system's CA certificates".to_owned(),
                    ToString::to_string,
                );
                warn!(%error, server = ?server_name, %ca, "the trace collector's certificate does not verify; spans are not exported (check OTEL_EXPORTER_OTLP_CERTIFICATE and the endpoint's host name)");
            }
        }
        verified
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

impl ResolvesClientCert for Reloading {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.current().client.clone()
    }

    fn has_certs(&self) -> bool {
        self.files.client.is_some()
    }
}

/// A TLS client config for the collector (TLS 1.2 or 1.3; ALPN is the connector's to set),
/// its files read again for each new connection. Fails when a file cannot be used now.
pub fn client_config(files: TlsFiles) -> Result<Arc<ClientConfig>, TlsFileError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let loaded = load(&files, read(&files)?, &provider, system_roots)?;
    let mutual = files.client.is_some();
    let reloading = Arc::new(Reloading {
        files,
        provider: provider.clone(),
        loaded: Mutex::new(Arc::new(loaded)),
        broken_files: Throttle::every(REPORT_EVERY),
        unverified: Throttle::every(REPORT_EVERY),
    });
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports TLS 1.2 and 1.3")
        .dangerous()
        .with_custom_certificate_verifier(reloading.clone());
    let mut config = match mutual {
        true => builder.with_client_cert_resolver(reloading),
        false => builder.with_no_client_auth(),
    };
    // A resumed session skips both the verifier and the client certificate: every connection
    // is a full handshake with the files as they are (the exporters keep theirs open anyway).
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

/// Why a TLS connection to the collector at `uri` fails: its handshake, or (TLS 1.3) the alert
/// of a refused client certificate, which exporters show only as "broken pipe". `None` when the
/// connection is made and the collector says nothing within `wait`.
pub async fn diagnose(
    config: Arc<ClientConfig>,
    uri: http::Uri,
    wait: std::time::Duration,
) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let host = uri
        .host()?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = uri.port_u16().unwrap_or(443);
    let name = ServerName::try_from(host.clone()).ok()?;
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| format!("cannot connect to {host}:{port}: {e}"))?;
        let mut tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS handshake with {host}:{port} failed: {e}"))?;
        let mut byte = [0u8; 1];
        match tls.read(&mut byte).await {
            Err(e) => Err(format!(
                "the collector at {host}:{port} ended the TLS connection: {e}"
            )),
            Ok(0) => Err(format!(
                "the collector at {host}:{port} closed the TLS connection at once"
            )),
            Ok(_) => Ok(()),
        }
    };
    match tokio::time::timeout(wait, attempt).await {
        Ok(Err(reason)) => Some(reason),
        Ok(Ok(())) | Err(_) => None,
    }
}

#[cfg(test)]
mod tests;
