//! Listening sockets: `[::]` accepts IPv4 and IPv6 alike on Linux; on a host without IPv6 the
//! same port on `0.0.0.0` is used instead.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use tracing::info;

/// Connections the kernel may hold for a listener before it accepts them: under a flood, a
/// probe's or the API server's connection must not find the queue full. Linux caps it at
/// `net.core.somaxconn`.
pub const BACKLOG: i32 = 4096;

/// A non-blocking listener on `addr`, falling back from `[::]` to `0.0.0.0` when the host has
/// no IPv6.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let listener = match listen(addr) {
        Err(error) if is_any_v6(addr) && no_ipv6(&error) => {
            let v4 = SocketAddr::from((Ipv4Addr::UNSPECIFIED, addr.port()));
            info!(%addr, fallback = %v4, %error, "no IPv6 on this host; listening on IPv4 only");
            listen(v4)?
        }
        other => other?,
    };
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// A listener on `addr` with a queue of [`BACKLOG`]; `[::]` takes IPv4 clients too.
fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

fn is_any_v6(addr: SocketAddr) -> bool {
    matches!(addr, SocketAddr::V6(v6) if v6.ip().is_unspecified())
}

fn no_ipv6(error: &io::Error) -> bool {
    // EAFNOSUPPORT (97) or EADDRNOTAVAIL (99) on Linux.
    matches!(error.raw_os_error(), Some(97 | 99)) || error.kind() == io::ErrorKind::AddrNotAvailable
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;

    #[test]
    fn the_default_listens_for_ipv4_and_ipv6() {
        let listener = bind("[::]:0".parse().unwrap()).unwrap();
        let port = listener.local_addr().unwrap().port();
        // Reachable over IPv4 on a dual-stack host ...
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
        // ... and over IPv6 where the host has it.
        if listener.local_addr().unwrap().is_ipv6() {
            assert!(TcpStream::connect(("::1", port)).is_ok());
        }
    }

    #[test]
    fn a_busy_port_is_an_error_not_a_fallback() {
        let taken = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let error = bind(taken.local_addr().unwrap()).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::AddrInUse);
    }
}
