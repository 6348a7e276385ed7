//! Whether a replica's admin server says it is ready, as a kubelet's readiness probe asks.

use std::net::SocketAddr;
use std::time::Duration;

/// Whether `GET /readyz` on `admin` answers 200.
pub async fn ready(admin: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let asked = async {
        let mut stream = tokio::net::TcpStream::connect(admin).await.ok()?;
        stream
            .write_all(b"GET /readyz HTTP/1.1\r\nHost: cnat\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await.ok()?;
        Some(head.ends_with(b"200"))
    };
    tokio::time::timeout(Duration::from_secs(1), asked)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}
