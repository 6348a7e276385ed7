//! TLS for the webhook server: the certificate and key from files (a mounted Secret), reloaded
//! when their contents change, and `cnat certs`' development CA and serving certificate.
//! See docs/src/operating/admission-webhooks.md, "Certificates".

use crate::certs::material::Pair;
use axum_server::tls_rustls::RustlsConfig;
use chrono::{Datelike, Utc};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Where the serving certificate chain and its key are, and the CA bundle that signed the
/// client certificates to require (`None`: no client certificate asked for).
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

/// Why a certificate could not be loaded or made. Messages name the file and the fix.
#[derive(Debug, Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no PEM certificate found (expected a file starting with -----BEGIN CERTIFICATE-----)")]
    NoCertificate { path: PathBuf },
    #[error("{path}: no usable PEM private key ({reason})")]
    Key { path: PathBuf, reason: String },
    #[error("certificate {cert} and key {key} do not form a usable TLS identity: {source}")]
    Config {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
    #[error("{path}: no usable PEM CA certificate for client certificates ({reason}); give the CA bundle that signed the API server's client certificate (--webhook-client-ca)")]
    ClientCa { path: PathBuf, reason: String },
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("{path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A server config for `files`: TLS 1.2 or 1.3, HTTP/1.1, and, with `client_ca`, client
/// certificates verified: one the CA did not sign fails the handshake; a client that presents
/// none gets through, marked so ([`Certified`]), and the admission webhooks refuse it
/// (kube-apiserver's conversion calls carry none, whatever its admission configuration says).
pub fn server_config(files: &CertFiles) -> Result<Arc<ServerConfig>, TlsError> {
    let (cert_pem, key_pem) = (read(&files.cert)?, read(&files.key)?);
    server_config_from(&cert_pem, &key_pem, files)
}

/// `server_config` for a certificate and key given as PEM (`files` names them in errors).
fn server_config_from(
    cert_pem: &[u8],
    key_pem: &[u8],
    files: &CertFiles,
) -> Result<Arc<ServerConfig>, TlsError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .filter_map(Result::ok)
        .collect();
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: files.cert.clone(),
        });
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::Key {
        path: files.key.clone(),
        reason: e.to_string(),
    })?;
    let config_error = |source| TlsError::Config {
        cert: files.cert.clone(),
        key: files.key.clone(),
        source,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(config_error)?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => builder.with_client_cert_verifier(client_verifier(path, provider)?),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(config_error)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A verifier that checks a client certificate, when one is presented, against the CA in the
/// PEM bundle at `path` (a client that presents none is marked, not refused: see [`Certified`]).
fn client_verifier(
    path: &Path,
    provider: Arc<rustls::crypto::CryptoProvider>,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    let bad = |reason: String| TlsError::ClientCa {
        path: path.to_owned(),
        reason,
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&read(path)?) {
        let cert = cert.map_err(|e| bad(e.to_string()))?;
        roots.add(cert).map_err(|e| bad(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(bad("no certificate in the file".into()));
    }
    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .allow_unauthenticated()
        .build()
        .map_err(|e| bad(e.to_string()))
}

/// Whether a request's client presented a certificate in its TLS handshake (one the client CA
/// signed: the handshake fails for any other), as a request extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientCertificate(pub bool);

/// A TLS connection that can tell whether its client presented a certificate.
pub trait Peer {
    fn presented_certificate(&self) -> bool;
}

impl<S> Peer for tokio_rustls::server::TlsStream<S> {
    fn presented_certificate(&self) -> bool {
        self.get_ref()
            .1
            .peer_certificates()
            .is_some_and(|chain| !chain.is_empty())
    }
}

/// A TLS connection whose place among the listener's connections can move into the pool of
/// certified clients (`guard::Connections`).
pub trait Certifiable {
    fn certify(&self) -> bool;
}

impl<S: crate::serving::guard::Tracked> Certifiable for tokio_rustls::server::TlsStream<S> {
    fn certify(&self) -> bool {
        self.get_ref().0.certify()
    }
}

/// An acceptor around a TLS one that marks every request with its [`ClientCertificate`], and
/// moves a certified client's connection into its own pool (closing it when that has no room).
#[derive(Clone)]
pub struct Certified<A>(pub A);

impl<A, I, S> axum_server::accept::Accept<I, S> for Certified<A>
where
    A: axum_server::accept::Accept<I, S>,
    A::Stream: Peer + Certifiable + Send + 'static,
    A::Service: Send + 'static,
    A::Future: Send + 'static,
{
    type Stream = A::Stream;
    type Service = axum::middleware::AddExtension<A::Service, ClientCertificate>;
    type Future = std::pin::Pin<
        Box<
            dyn std::future::Future<Output = std::io::Result<(Self::Stream, Self::Service)>> + Send,
        >,
    >;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        let accepted = self.0.accept(stream, service);
        Box::pin(async move {
            let (stream, service) = accepted.await?;
            let mark = ClientCertificate(stream.presented_certificate());
            if mark.0 && !stream.certify() {
                return Err(std::io::Error::other(
                    "too many connections of certified clients to this port",
                ));
            }
            Ok((
                stream,
                tower_layer::Layer::layer(&axum::Extension(mark), service),
            ))
        })
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Reloads `config` from `files` whenever their contents change, checking every `interval`,
/// until `stop`. A broken new pair is reported and the previous certificate kept.
pub async fn reload_on_change(
    files: CertFiles,
    config: RustlsConfig,
    interval: Duration,
    stop: CancellationToken,
) {
    let contents = |files: &CertFiles| {
        (
            std::fs::read(&files.cert).ok(),
            std::fs::read(&files.key).ok(),
            files
                .client_ca
                .as_ref()
                .and_then(|ca| std::fs::read(ca).ok()),
        )
    };
    let mut loaded = contents(&files);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let current = contents(&files);
        if current == loaded {
            continue;
        }
        match server_config(&files) {
            Ok(new) => {
                config.reload_from_config(new);
                loaded = current;
                info!(cert = %files.cert.display(), "reloaded the webhook certificate");
            }
            Err(error) => {
                warn!(%error, "the webhook certificate changed but cannot be used; keeping the previous one")
            }
        }
    }
}

/// How the keys of the Secret `source` names read in errors.
fn secret_files(source: &str, client_ca: Option<PathBuf>) -> CertFiles {
    CertFiles {
        cert: PathBuf::from(format!("{source} tls.crt")),
        key: PathBuf::from(format!("{source} tls.key")),
        client_ca,
    }
}

/// `server_config` for a leaf from the Secret `source` names.
pub fn identity_config(
    pair: &Pair,
    source: &str,
    client_ca: Option<PathBuf>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let files = secret_files(source, client_ca);
    server_config_from(pair.cert.as_bytes(), pair.key.as_bytes(), &files)
}

/// Serves each leaf `identities` sends (`certs::run`'s, from the Secret `source` names), with
/// the client CA file read anew at each, and whenever that file changes (checked every
/// `interval`), until `stop`. A leaf that cannot be used is reported and the previous one kept.
pub async fn follow_identities(
    mut identities: watch::Receiver<Option<Pair>>,
    source: &str,
    client_ca: Option<PathBuf>,
    config: RustlsConfig,
    interval: Duration,
    stop: CancellationToken,
) {
    let files = secret_files(source, client_ca);
    let ca_contents = |files: &CertFiles| {
        files
            .client_ca
            .as_ref()
            .and_then(|ca| std::fs::read(ca).ok())
    };
    let mut loaded_ca = None;
    let mut first = true;
    loop {
        if !first {
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = identities.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(interval) => {
                    if ca_contents(&files) == loaded_ca {
                        continue;
                    }
                }
            }
        }
        first = false;
        let Some(pair) = identities.borrow_and_update().clone() else {
            continue;
        };
        let ca = ca_contents(&files);
        match server_config_from(pair.cert.as_bytes(), pair.key.as_bytes(), &files) {
            Ok(new) => {
                config.reload_from_config(new);
                loaded_ca = ca;
                info!(%source, "loaded the webhook certificate");
            }
            Err(error) => {
                warn!(%error, "the webhook certificate cannot be used; keeping the previous one")
            }
        }
    }
}

/// A development CA and a serving certificate it signed, as PEM.
pub struct DevCerts {
    pub ca_cert: String,
    pub cert: String,
    pub key: String,
}

/// Makes a CA and a serving certificate for the webhook Service `service` in `namespace` (the
/// name kube-apiserver checks is `<service>.<namespace>.svc`), also valid for localhost.
pub fn generate(service: &str, namespace: &str, days: u32) -> Result<DevCerts, TlsError> {
    let until = Utc::now() + chrono::Duration::days(days.into());
    let not_after = rcgen::date_time_ymd(until.year(), until.month() as u8, until.day() as u8);
    let yesterday = Utc::now() - chrono::Duration::days(1);
    let not_before = rcgen::date_time_ymd(
        yesterday.year(),
        yesterday.month() as u8,
        yesterday.day() as u8,
    );

    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "cnat webhook CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    (ca.not_before, ca.not_after) = (not_before, not_after);
    let ca_cert = ca.self_signed(&ca_key)?;

    let dns = format!("{service}.{namespace}.svc");
    let names = vec![
        dns.clone(),
        format!("{dns}.cluster.local"),
        format!("{service}.{namespace}"),
        service.to_owned(),
        "localhost".to_owned(),
        "127.0.0.1".to_owned(),
    ];
    let key = KeyPair::generate()?;
    let mut serving = CertificateParams::new(names)?;
    serving.distinguished_name.push(DnType::CommonName, dns);
    serving.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    serving.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    (serving.not_before, serving.not_after) = (not_before, not_after);
    let cert = serving.signed_by(&key, &Issuer::new(ca, ca_key))?;
    Ok(DevCerts {
        ca_cert: ca_cert.pem(),
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

impl DevCerts {
    /// Writes `ca.crt`, `tls.crt` and `tls.key` (the key readable by the owner only) into `dir`.
    pub fn write(&self, dir: &Path) -> Result<CertFiles, TlsError> {
        let write = |name: &str, contents: &str| {
            let path = dir.join(name);
            std::fs::write(&path, contents).map_err(|source| TlsError::Write {
                path: path.clone(),
                source,
            })?;
            Ok::<_, TlsError>(path)
        };
        std::fs::create_dir_all(dir).map_err(|source| TlsError::Write {
            path: dir.to_owned(),
            source,
        })?;
        write("ca.crt", &self.ca_cert)?;
        let cert = write("tls.crt", &self.cert)?;
        let key = write("tls.key", &self.key)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).map_err(
            |source| TlsError::Write {
                path: key.clone(),
                source,
            },
        )?;
        Ok(CertFiles {
            cert,
            key,
            client_ca: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cnat-tls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn generated_certificates_load() {
        let dir = temp_dir("load");
        let files = generate("cnat-webhook", "cnat-system", 30)
            .unwrap()
            .write(&dir)
            .unwrap();
        let config = server_config(&files).unwrap();
        assert_eq!(config.alpn_protocols, [b"http/1.1".to_vec()]);
        let mode = std::fs::metadata(&files.key).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
    }

    #[test]
    fn bad_files_say_which_file_and_what_is_wrong() {
        let dir = temp_dir("bad");
        let files = generate("s", "ns", 1).unwrap().write(&dir).unwrap();
        let missing = CertFiles {
            cert: dir.join("nope.crt"),
            key: files.key.clone(),
            client_ca: None,
        };
        let err = server_config(&missing).unwrap_err().to_string();
        assert!(
            err.contains("nope.crt") && err.contains("No such file"),
            "{err}"
        );

        std::fs::write(dir.join("garbage.crt"), "hello").unwrap();
        let garbage = CertFiles {
            cert: dir.join("garbage.crt"),
            key: files.key.clone(),
            client_ca: None,
        };
        assert!(server_config(&garbage)
            .unwrap_err()
            .to_string()
            .contains("no PEM certificate found"));

        let swapped = CertFiles {
            cert: files.cert.clone(),
            key: files.cert.clone(),
            client_ca: None,
        };
        assert!(server_config(&swapped)
            .unwrap_err()
            .to_string()
            .contains("no usable PEM private key"));

        let other = generate("s", "ns", 1)
            .unwrap()
            .write(&dir.join("other"))
            .unwrap();
        let mismatched = CertFiles {
            cert: files.cert.clone(),
            key: other.key,
            client_ca: None,
        };
        let err = server_config(&mismatched).unwrap_err().to_string();
        assert!(err.contains("do not form a usable TLS identity"), "{err}");
    }

    /// A CA and a client certificate it signed (PEM: CA, certificate, key).
    fn client_pki(name: &str) -> (String, String, String) {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut client = CertificateParams::new(Vec::<String>::new()).unwrap();
        client.distinguished_name.push(DnType::CommonName, name);
        client.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = client.signed_by(&key, &Issuer::new(ca, ca_key)).unwrap();
        (ca_cert.pem(), cert.pem(), key.serialize_pem())
    }

    /// The server side of a handshake with `client`: `None` when it failed, else whether the
    /// client presented a certificate.
    async fn handshake(server: Arc<ServerConfig>, client: rustls::ClientConfig) -> Option<bool> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let tls = tokio_rustls::TlsAcceptor::from(server)
                .accept(stream)
                .await
                .ok()?;
            Some(tls.presented_certificate())
        });
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let _ = tokio_rustls::TlsConnector::from(Arc::new(client))
            .connect(name, stream)
            .await;
        accepted.await.unwrap()
    }

    #[tokio::test]
    async fn with_a_client_ca_clients_it_signed_are_marked_and_others_refused() {
        let dir = temp_dir("client-ca");
        let served = generate("s", "ns", 1).unwrap().write(&dir).unwrap();
        let (ca, cert, key) = client_pki("kube-apiserver");
        std::fs::write(dir.join("client-ca.crt"), &ca).unwrap();
        let files = CertFiles {
            client_ca: Some(dir.join("client-ca.crt")),
            ..served.clone()
        };
        let server = server_config(&files).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        for der in CertificateDer::pem_file_iter(dir.join("ca.crt")).unwrap() {
            roots.add(der.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = || {
            rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots.clone())
        };
        let with_cert = |cert: &str, key: &str| {
            let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
                .map(Result::unwrap)
                .collect();
            let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
            builder().with_client_auth_cert(chain, key).unwrap()
        };
        // Without a certificate: through, unmarked (the conversion webhook takes it, the
        // admission webhooks do not).
        let none = handshake(server.clone(), builder().with_no_client_auth()).await;
        assert_eq!(none, Some(false));
        assert_eq!(
            handshake(server.clone(), with_cert(&cert, &key)).await,
            Some(true)
        );
        let (_, stranger, stranger_key) = client_pki("some-pod");
        let stranger = handshake(server.clone(), with_cert(&stranger, &stranger_key)).await;
        assert_eq!(
            stranger, None,
            "a certificate the CA did not sign is refused"
        );
        // Without a client CA, nobody is asked for one (the default).
        let open = server_config(&served).unwrap();
        assert_eq!(handshake(open, with_cert(&cert, &key)).await, Some(false));
        // A client CA file without a certificate is an error naming the file and the flag.
        std::fs::write(dir.join("empty.crt"), "").unwrap();
        let broken = CertFiles {
            client_ca: Some(dir.join("empty.crt")),
            ..served
        };
        let error = server_config(&broken).unwrap_err().to_string();
        assert!(
            error.contains("empty.crt: no usable PEM CA certificate")
                && error.contains("--webhook-client-ca"),
            "{error}"
        );
    }
}
