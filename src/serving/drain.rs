//! Draining before shutdown: from SIGTERM until the webhook server closes, every answer says
//! `Connection: close`, so clients retire their keep-alive connections one request at a time.
//! See docs/src/operating/high-availability.md, "Shutdown".

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Whether this replica is draining; clones share the flag.
#[derive(Clone, Debug, Default)]
pub struct Draining(Arc<AtomicBool>);

impl Draining {
    /// From now on every answer closes its connection.
    pub fn start(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Middleware: `Connection: close` on every answer while draining.
pub async fn close_connections(
    State(draining): State<Draining>,
    request: Request,
    next: Next,
) -> Response {
    let mut response = next.run(request).await;
    if draining.is_draining() {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}
