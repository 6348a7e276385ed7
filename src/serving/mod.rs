//! Serving: what every replica listens with, apart from the webhooks' own handlers.
//!
//! - `admin`: the plain-HTTP admin endpoints: `/healthz`, `/readyz` and `/metrics`.
//! - `bounded`: JSON from any caller decoded within a memory budget.
//! - `drain`: from SIGTERM until the servers close, answers close their connections.
//! - `guard`: what any client of a port may hold, in all and per client address: connections,
//!   requests in flight, body bytes, time per request.
//! - `listen`: listening sockets: dual-stack `[::]`, or `0.0.0.0` on a host without IPv6.
//! - `tls`: the webhook server's certificate, reloaded when it changes, and `cnat certs`.

pub mod admin;
pub mod bounded;
pub mod drain;
pub mod guard;
pub mod listen;
pub mod tls;
