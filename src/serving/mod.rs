//! Serving: what every replica listens with, apart from the webhooks' own handlers.
//! See docs/src/development.md, "Source layout".

pub mod admin;
pub mod bounded;
pub mod drain;
pub mod guard;
pub mod listen;
pub mod tls;
