//! Running the real `cnat` binary: its flags, ports, certificates, probes and signals.

use super::apiserver::{ApiServer, Resource};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

pub fn kubeconfig(server: SocketAddr, name: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("cnat-{name}-{}.kubeconfig", std::process::id()));
    let yaml = ApiServer::kubeconfig(server, "cnat-system");
    std::fs::write(&path, yaml).unwrap();
    path
}

pub fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

pub fn cnat(args: &[&str], kubeconfig: &std::path::Path) -> Command {
    let mut command = Command::new(super::envtest::this_build());
    command
        .arg("run")
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE");
    command
}

/// The status code of a plain HTTP/1.1 GET, or `None` when nothing listens.
pub fn probe(addr: SocketAddr, path: &str) -> Option<u16> {
    get(addr, path).map(|(status, _)| status)
}

/// The status code and body of a plain HTTP/1.1 GET, or `None` when nothing listens.
pub fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: cnat\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}

pub fn holder(server: &ApiServer) -> Option<String> {
    let lease = server.get(Resource::Leases, "cnat-system", "cnat")?;
    lease["spec"]["holderIdentity"].as_str().map(str::to_owned)
}

pub fn sigterm(child: &Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// `cnat certs` into a fresh directory; returns it (with `ca.crt`) and the --tls-cert and
/// --tls-key flags.
pub fn dev_certs(name: &str) -> (PathBuf, [String; 2]) {
    let dir = std::env::temp_dir().join(format!("cnat-certs-{name}-{}", std::process::id()));
    let output = Command::new(super::envtest::this_build())
        .args(["certs", "--out-dir", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("cnat-webhook.cnat-system.svc"), "{stdout}");
    let flags = [
        format!("--tls-cert={}/tls.crt", dir.display()),
        format!("--tls-key={}/tls.key", dir.display()),
    ];
    (dir, flags)
}
