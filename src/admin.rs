//! The plain-HTTP admin endpoints every replica serves: `/healthz` (liveness) and `/readyz`
//! (readiness). Readiness never depends on leadership, or a rolling upgrade would deadlock
//! waiting for a new pod that cannot become leader while the old one holds the Lease.

use crate::leader::Leadership;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What the probes report on.
#[derive(Debug)]
pub struct Health {
    pub leadership: Arc<Leadership>,
    /// A leader that has not renewed for longer than this is stuck.
    pub lease_duration: Duration,
    ready: AtomicBool,
}

impl Health {
    pub fn new(leadership: Arc<Leadership>, lease_duration: Duration) -> Self {
        Health {
            leadership,
            lease_duration,
            ready: AtomicBool::new(true),
        }
    }

    /// Shutting down: report not ready so the endpoint is taken out of Services.
    pub fn set_not_ready(&self) {
        self.ready.store(false, Ordering::SeqCst);
    }

    fn liveness(&self) -> Result<(), String> {
        match self.leadership.since_renewal() {
            Some(since) if since > self.lease_duration => Err(format!(
                "leader has not renewed its lease for {since:.1?}, longer than the lease duration {:?}",
                self.lease_duration
            )),
            _ => Ok(()),
        }
    }

    fn readiness(&self) -> Result<(), String> {
        if self.ready.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("shutting down".into())
        }
    }
}

/// The admin routes.
pub fn router(health: Arc<Health>) -> Router {
    Router::new()
        .route(
            "/healthz",
            get(|State(h): State<Arc<Health>>| async move { probe(h.liveness()) }),
        )
        .route(
            "/readyz",
            get(|State(h): State<Arc<Health>>| async move { probe(h.readiness()) }),
        )
        .with_state(health)
}

fn probe(result: Result<(), String>) -> (StatusCode, String) {
    match result {
        Ok(()) => (StatusCode::OK, "ok\n".into()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}
