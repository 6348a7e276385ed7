//! Wires the reconciler to the cluster: a trimmed watch of Ats, a watch of only the pods cnat
//! created (by label), and kube-runtime's `Controller` for queueing, requeues and concurrency.

use crate::api::At;
use crate::events::EventSink;
use crate::metrics::Metrics;
use crate::pod;
use crate::policy::RunPolicy;
use crate::reconcile::{error_policy, reconcile, Context};
use chrono::Utc;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::{self, Controller};
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// What `cnat run` tells the controller.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Watch this namespace only; `None` watches all.
    pub namespace: Option<String>,
    /// Most reconciles at once; 0 means no limit.
    pub concurrency: u16,
    /// Defaults for what Ats leave out, and the RUNNING re-check interval.
    pub policy: RunPolicy,
}

/// Runs the reconcile loop until `stop` is cancelled; reconciles in flight then finish.
pub async fn run(
    client: Client,
    settings: Settings,
    events: EventSink,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    let (ats, pods) = apis(&client, settings.namespace.as_deref());
    let (at_store, at_writer) = reflector::store();
    let at_events = watcher(ats, watcher::Config::default())
        .default_backoff()
        .modify(trim_at)
        .reflect(at_writer)
        .applied_objects();
    let (pod_store, pod_writer) = reflector::store();
    let pod_events = watcher(pods, watcher::Config::default().labels(pod::SELECTOR))
        .default_backoff()
        .modify(pod::trim)
        .reflect(pod_writer)
        // Deletions too: a pod that vanishes must end its At.
        .touched_objects();

    metrics.count_ats(at_store.clone());
    let _forget = ForgetAts(metrics.clone());
    let ctx = Arc::new(Context::new(
        client,
        pod_store,
        events,
        Box::new(Utc::now),
        metrics,
        settings.policy.clone(),
    ));
    info!(
        namespace = settings.namespace.as_deref().unwrap_or("<all>"),
        "reconciling Ats"
    );
    // Both exist once per context, which was just made.
    let (Some(followups), Some(retriggers)) = (ctx.followup_writer(), ctx.retriggers()) else {
        unreachable!("a new context hands out its follow-up writer and retriggers");
    };
    // Status writes queued behind pod creates live and die with the loop: a stopping leader
    // drops what it has not written, and its successor writes it from what it observes.
    let followups = tokio::spawn(followups);
    let _stop_followups = AbortOnDrop(followups);
    Controller::for_stream(at_events, at_store)
        .owns_stream(pod_events)
        .reconcile_on(retriggers)
        .with_config(controller::Config::default().concurrency(settings.concurrency))
        .graceful_shutdown_on(stop.cancelled_owned())
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            // Reconcile failures were logged by the error policy; these are the runtime's own.
            if let Err(
                error @ (controller::Error::ObjectNotFound(_) | controller::Error::QueueError(_)),
            ) = result
            {
                warn!(%error, "controller");
            }
        })
        .await;
    info!("reconcile loop stopped");
}

/// Aborts the follow-up writer when the loop ends, also when it is aborted on lost leadership.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Stops the At count when the loop ends, also when it is aborted on lost leadership.
struct ForgetAts(Arc<Metrics>);

impl Drop for ForgetAts {
    fn drop(&mut self) {
        self.0.forget_ats();
    }
}

fn apis(client: &Client, namespace: Option<&str>) -> (Api<At>, Api<Pod>) {
    match namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    }
}

/// Drops what the reconciler never reads, so the cache stays small.
fn trim_at(at: &mut At) {
    at.metadata.managed_fields = None;
    at.metadata.annotations = None;
}
