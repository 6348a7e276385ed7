//! A stand-in for the webhook Service of a Deployment, where no kube-proxy runs: a TCP proxy
//! that sends each new connection to a ready replica, round robin, readiness polled from each
//! replica's `/readyz` every 500 ms as a readiness probe and the endpoints controller would.
//! A replica that stops being ready leaves at the next poll; connections already open stay with
//! it until it closes them. Used by the rolling bench and the API upgrade test.

use super::envtest::Replica;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// The Service's endpoints: each replica's admin and webhook address, and whether it is ready.
#[derive(Clone, Default)]
pub struct Service {
    pub endpoints: Arc<Mutex<Vec<(SocketAddr, SocketAddr, bool)>>>,
    /// Connections forwarded, per webhook address.
    pub forwarded: Arc<Mutex<HashMap<SocketAddr, usize>>>,
    /// Connections dropped: no ready endpoint, or the endpoint refused.
    pub dropped: Arc<std::sync::atomic::AtomicUsize>,
}

impl Service {
    /// Listens on a free loopback port and forwards each connection to a ready endpoint, round
    /// robin; polls every endpoint's `/readyz` every 500 ms.
    pub async fn start(&self) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = self.clone();
        tokio::spawn(async move {
            let mut next = 0usize;
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                let ready: Vec<SocketAddr> = service
                    .endpoints
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(_, _, ready)| *ready)
                    .map(|(_, webhook, _)| *webhook)
                    .collect();
                if ready.is_empty() {
                    // As a Service without ready endpoints: the connection is refused.
                    service
                        .dropped
                        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    continue;
                }
                next = next.wrapping_add(1);
                let target = ready[next % ready.len()];
                *service.forwarded.lock().unwrap().entry(target).or_default() += 1;
                let dropped = service.dropped.clone();
                tokio::spawn(async move {
                    match tokio::net::TcpStream::connect(target).await {
                        Ok(mut outbound) => {
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        }
                        Err(_) => {
                            dropped.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                });
            }
        });
        let service = self.clone();
        tokio::spawn(async move {
            loop {
                let admins: Vec<SocketAddr> = service
                    .endpoints
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(admin, _, _)| *admin)
                    .collect();
                for admin in admins {
                    let ready = ready(admin).await;
                    for endpoint in service.endpoints.lock().unwrap().iter_mut() {
                        if endpoint.0 == admin {
                            endpoint.2 = ready;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        addr
    }

    pub fn add(&self, replica: &Replica) {
        let endpoint = (replica.admin, replica.webhook, false);
        self.endpoints.lock().unwrap().push(endpoint);
    }

    pub fn remove(&self, replica: &Replica) {
        self.endpoints
            .lock()
            .unwrap()
            .retain(|(admin, _, _)| *admin != replica.admin);
    }

    /// Until `replica` is an endpoint that the Service found ready.
    pub async fn wait_ready(&self, replica: &Replica) {
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let endpoints = self.endpoints.lock().unwrap().clone();
            if endpoints.iter().any(|(a, _, r)| *a == replica.admin && *r) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} never ready",
                replica.identity
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
