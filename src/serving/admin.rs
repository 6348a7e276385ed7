//! The plain-HTTP admin endpoints every replica serves: `/healthz`, `/readyz` and `/metrics`.
//! Readiness never depends on leadership, only on what `require` adds.
//! See docs/src/operating/high-availability.md, "Probes".

use crate::leader::Leadership;
use crate::observability::metrics::{self, Metrics};
use crate::serving::guard::{self, Limits};
use crate::sync::lock;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::routing::get;
use axum::Router;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A client that has not sent its request headers by then is dropped; so is a kept connection
/// idle for that long (the kubelet and Prometheus reconnect at no cost).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves `app` (the admin routes) on `listener` in plain HTTP/1.1 within `limits` (see
/// `serving::guard`) until `stop`; connections still open a second later are closed.
pub async fn serve(
    listener: std::net::TcpListener,
    app: Router,
    stop: CancellationToken,
    limits: Limits,
) -> std::io::Result<()> {
    let handle = axum_server::Handle::new();
    tokio::spawn({
        let handle = handle.clone();
        async move {
            stop.cancelled().await;
            handle.graceful_shutdown(Some(Duration::from_secs(1)));
        }
    });
    let acceptor = guard::Capped::new(axum_server::accept::DefaultAcceptor::new(), &limits);
    guard::http1_server(listener, acceptor, handle, HEADER_TIMEOUT)?
        .serve(
            guard::guarded(app, limits, "requests")
                .into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
}

/// What the probes report on.
pub struct Health {
    pub leadership: Arc<Leadership>,
    /// A leader that has not renewed for longer than this is stuck.
    pub lease_duration: Duration,
    webhooks_serving: AtomicBool,
    shutting_down: AtomicBool,
    /// More conditions of readiness, each saying why not.
    required: std::sync::Mutex<Vec<Requirement>>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("leadership", &self.leadership)
            .field("ready", &self.readiness())
            .finish_non_exhaustive()
    }
}

/// Why a requirement of readiness is not met; its message is the probe's answer.
pub type Unmet = Box<dyn std::error::Error + Send + Sync>;

/// A condition of readiness: `Err` says what is missing.
pub type Requirement = Box<dyn Fn() -> Result<(), Unmet> + Send + Sync>;

impl Health {
    /// Not ready until `set_webhooks_serving`, unless this replica serves no webhooks.
    pub fn new(leadership: Arc<Leadership>, lease_duration: Duration, webhooks: bool) -> Self {
        Health {
            leadership,
            lease_duration,
            webhooks_serving: AtomicBool::new(!webhooks),
            shutting_down: AtomicBool::new(false),
            required: std::sync::Mutex::default(),
        }
    }

    /// Not ready while `requirement` says `Err` (its message is the probe's answer).
    pub fn require(&self, requirement: impl Fn() -> Result<(), Unmet> + Send + Sync + 'static) {
        lock(&self.required).push(Box::new(requirement));
    }

    /// The webhook server listens with a loaded certificate.
    pub fn set_webhooks_serving(&self) {
        self.webhooks_serving.store(true, Ordering::SeqCst);
    }

    /// Shutting down: report not ready so the endpoint is taken out of Services.
    pub fn set_not_ready(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
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
        if self.shutting_down.load(Ordering::SeqCst) {
            Err("shutting down".into())
        } else if !self.webhooks_serving.load(Ordering::SeqCst) {
            Err("the webhook server is not serving yet".into())
        } else {
            let required = lock(&self.required);
            required
                .iter()
                .try_for_each(|requirement| requirement().map_err(|unmet| unmet.to_string()))
        }
    }
}

/// The admin routes.
pub fn router(health: Arc<Health>, metrics: Arc<Metrics>) -> Router {
    // OpenMetrics for scrapers that ask for it (Prometheus does); the classic text format for
    // everything else (curl, `promtool check metrics`), as Prometheus's Go client answers.
    let scrape = get(|headers: axum::http::HeaderMap| async move {
        let accept = headers
            .get_all(header::ACCEPT)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect::<Vec<_>>()
            .join(",");
        if accept.contains("application/openmetrics-text") {
            (
                [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
                metrics.encode(),
            )
        } else {
            (
                [(header::CONTENT_TYPE, metrics::CLASSIC_CONTENT_TYPE)],
                metrics::classic(&metrics.encode()),
            )
        }
    });
    Router::new()
        .route("/metrics", scrape)
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get(health: &Arc<Health>, path: &str) -> (StatusCode, String) {
        get_as(health, path, "*/*").await
    }

    async fn get_as(health: &Arc<Health>, path: &str, accept: &str) -> (StatusCode, String) {
        let request = Request::get(path)
            .header(header::ACCEPT, accept)
            .body(Body::empty())
            .unwrap();
        let metrics = Arc::new(Metrics::new(health.leadership.clone()));
        let response = router(health.clone(), metrics)
            .oneshot(request)
            .await
            .unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    fn health() -> Arc<Health> {
        Arc::new(Health::new(
            Arc::new(Leadership::default()),
            Duration::from_secs(15),
            false,
        ))
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_that_stopped_renewing_is_not_live() {
        let health = health();
        assert_eq!(
            get(&health, "/healthz").await,
            (StatusCode::OK, "ok\n".into())
        );
        health.leadership.set_leading("cnat", true);
        tokio::time::advance(Duration::from_secs(15)).await;
        assert_eq!(get(&health, "/healthz").await.0, StatusCode::OK);
        tokio::time::advance(Duration::from_secs(1)).await;
        let (status, body) = get(&health, "/healthz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            body.contains("has not renewed its lease for 16.0s"),
            "{body}"
        );
        // Readiness does not depend on leadership.
        assert_eq!(get(&health, "/readyz").await.0, StatusCode::OK);
        health.leadership.set_leading("cnat", false);
        assert_eq!(get(&health, "/healthz").await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn readiness_waits_for_the_webhook_server() {
        let health = Arc::new(Health::new(
            Arc::new(Leadership::default()),
            Duration::from_secs(15),
            true,
        ));
        let (status, body) = get(&health, "/readyz").await;
        assert_eq!(
            (status, body.as_str()),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "the webhook server is not serving yet\n"
            )
        );
        health.set_webhooks_serving();
        assert_eq!(get(&health, "/readyz").await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn readiness_waits_for_every_requirement_and_says_which_is_missing() {
        let health = health();
        let listed = Arc::new(AtomicBool::new(false));
        health.require({
            let listed = listed.clone();
            move || match listed.load(Ordering::SeqCst) {
                true => Ok(()),
                false => Err("the At cache is listing Ats".into()),
            }
        });
        assert_eq!(
            get(&health, "/readyz").await,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "the At cache is listing Ats\n".into()
            )
        );
        // Liveness does not wait for it.
        assert_eq!(get(&health, "/healthz").await.0, StatusCode::OK);
        listed.store(true, Ordering::SeqCst);
        assert_eq!(get(&health, "/readyz").await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn readiness_ends_with_shutdown_and_does_not_need_leadership() {
        let health = health();
        assert!(!health.leadership.is_leader());
        assert_eq!(
            get(&health, "/readyz").await,
            (StatusCode::OK, "ok\n".into())
        );
        health.set_not_ready();
        assert_eq!(
            get(&health, "/readyz").await,
            (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n".into())
        );
        assert_eq!(get(&health, "/healthz").await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn metrics_report_leadership_as_it_is_at_scrape_time() {
        let health = health();
        // What Prometheus asks for.
        let openmetrics = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        let (status, body) = get_as(&health, "/metrics", openmetrics).await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("\ncnat_leader 0\n"), "{body}");
        assert!(
            body.contains(
                "# TYPE cnat_leader_transitions counter\ncnat_leader_transitions_total 0\n"
            ),
            "{body}"
        );
        assert!(body.ends_with("# EOF\n"), "{body}");
        // Anyone else (curl, promtool) gets the classic text format.
        let (status, body) = get(&health, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            body.contains(
                "# TYPE cnat_leader_transitions_total counter\ncnat_leader_transitions_total 0\n"
            ),
            "{body}"
        );
        assert!(!body.contains("# EOF"), "{body}");
        health.leadership.set_leading("cnat", true);
        let body = get(&health, "/metrics").await.1;
        assert!(body.contains("\ncnat_leader 1\n"), "{body}");
        assert!(
            body.contains("\ncnat_leader_transitions_total 1\n"),
            "{body}"
        );
    }
}
