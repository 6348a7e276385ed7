//! Draining before shutdown. From SIGTERM until the webhook server closes (the shutdown delay),
//! every answer says `Connection: close`, so clients retire their keep-alive connections to
//! this replica one request at a time, cleanly. Without it the connections still open when the
//! server stops are closed under the client, and a request it sends at that moment fails:
//! kube-apiserver's webhook client (Go) does not resend a POST that was already written, so
//! that would be a failed `kubectl apply` (measured: one in the upgrade test's rolling update).

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
