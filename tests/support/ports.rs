//! The ports a `cnat run` process bound: started with `--admin-addr=127.0.0.1:0` and
//! `--webhook-addr=127.0.0.1:0`, it binds free ports itself, which are found in `/proc`. (A port
//! picked by the test and released could be taken by another process before cnat binds it: a
//! CI run failed so.)

use std::net::SocketAddr;
use std::process::Child;
use std::time::{Duration, Instant};

/// The flags that make `cnat run` bind free loopback ports itself.
pub const ANY_PORTS: [&str; 2] = ["--admin-addr=127.0.0.1:0", "--webhook-addr=127.0.0.1:0"];

/// The admin and webhook addresses of a starting `cnat run` bound to port 0, whatever its log
/// level: the loopback ports its process listens on (from `/proc`), the admin one being the one
/// that answers plain HTTP; the webhook one is `0.0.0.0:0` with `--webhooks=false`. Panics
/// with its log (`log()`) when it exits or does not listen within a minute.
pub fn bound(
    child: &mut Child,
    webhooks: bool,
    log: impl Fn() -> String,
) -> (SocketAddr, SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let wanted = if webhooks { 2 } else { 1 };
    loop {
        let ports = listening_ports(child.id());
        if ports.len() >= wanted {
            let addrs: Vec<SocketAddr> = ports
                .iter()
                .map(|port| SocketAddr::from(([127, 0, 0, 1], *port)))
                .collect();
            if let Some(admin) = addrs.iter().find(|a| answers_http(**a)) {
                let webhook = addrs
                    .iter()
                    .find(|a| *a != admin)
                    .copied()
                    .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
                return (*admin, webhook);
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the replica exited before it listened ({status}):\n{}",
                log()
            );
        }
        assert!(
            Instant::now() < deadline,
            "the replica did not listen within a minute:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether a plain HTTP/1.1 request to `addr` gets an HTTP answer (the admin port does, the
/// TLS webhook port does not).
fn answers_http(addr: SocketAddr) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500))
    else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let asked =
        stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: cnat\r\nConnection: close\r\n\r\n");
    let mut start = [0u8; 5];
    asked.is_ok() && stream.read_exact(&mut start).is_ok() && &start == b"HTTP/"
}

/// The TCP ports process `pid` listens on: its socket inodes (`/proc/PID/fd`) matched against
/// the listening sockets of `/proc/net/tcp` and `/proc/net/tcp6`.
fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_owned(),
            )
        })
        .collect();
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl, local_address, rem_address, st, ..., inode (the tenth).
            let (Some(local), Some(state), Some(inode)) =
                (fields.get(1), fields.get(3), fields.get(9))
            else {
                continue;
            };
            const LISTEN: &str = "0A";
            if *state != LISTEN || !inodes.contains(*inode) {
                continue;
            }
            let port = local
                .rsplit_once(':')
                .and_then(|(_, port)| u16::from_str_radix(port, 16).ok());
            ports.extend(port);
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}
