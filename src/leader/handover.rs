//! What a handover of a Lease is made of: how a candidate readies itself to lead (with Lease
//! shards: lists the shard's Ats) and the successor a holder hands over to; the elector (`mod.rs`)
//! runs the protocol. See docs/src/design/decisions.md, "Lease shards".

use super::balance::Reservation;
use super::record::Seen;
use k8s_openapi::api::coordination::v1::Lease;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

/// Readies this replica to lead a Lease before it holds it.
pub trait Prepare: Send + Sync {
    /// Readies (with Lease shards: lists the shard's Ats into the cache its leadership will
    /// use); completes with `true` once ready, `false` if it could not be.
    fn prepare(&self) -> Pin<Box<dyn Future<Output = bool> + Send>>;

    /// What `prepare` readied will not be used (another replica was named, or the holder went
    /// on): let it go.
    fn discard(&self);
}

/// How this replica takes part in handovers of a Lease.
#[derive(Clone)]
pub struct Handover {
    pub prepare: Arc<dyn Prepare>,
    /// The longest a holder goes on reconciling while it waits for a ready successor; then it
    /// releases the Lease.
    pub limit: Duration,
    /// The same once the replica is shutting down (what its shutdown timeout leaves room for;
    /// zero: it releases at once).
    pub on_shutdown: Duration,
}

impl fmt::Debug for Handover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handover")
            .field("limit", &self.limit)
            .field("on_shutdown", &self.on_shutdown)
            .finish_non_exhaustive()
    }
}

/// A candidate readying itself for a Lease whose holder asked for a successor. Dropped without
/// `keep`, what was readied is discarded.
pub(super) struct Readying {
    prepare: Arc<dyn Prepare>,
    /// Its place among the shards this replica leads (`None` once readying failed): then a take
    /// need not reserve one.
    pub(super) reserved: Option<Reservation>,
    /// Running while `Some`.
    pub(super) task: Option<AbortOnDropHandle<bool>>,
    /// Ready to lead: time to say so on the Lease.
    pub(super) ready: bool,
    /// It named itself on the Lease.
    pub(super) offered: bool,
    kept: bool,
}

impl Readying {
    pub(super) fn start(handover: &Handover, reserved: Reservation) -> Self {
        let task = tokio::spawn(handover.prepare.prepare());
        Readying {
            prepare: handover.prepare.clone(),
            reserved: Some(reserved),
            task: Some(AbortOnDropHandle::new(task)),
            ready: false,
            offered: false,
            kept: false,
        }
    }

    /// Completes when readying ends (never, once it has).
    pub(super) async fn finished(&mut self) {
        let Some(task) = self.task.as_mut() else {
            return std::future::pending().await;
        };
        let ready = task.await.unwrap_or(false);
        self.task = None;
        self.ready = ready;
        if !ready {
            // Not ready: it takes no place among the shards, and nothing it readied is used
            // (the shard is taken as others would take it when it is free).
            self.reserved = None;
            self.prepare.discard();
        }
    }

    /// The Lease is this replica's: what was readied is used (the leadership's work finds it),
    /// and the place reserved goes to the leadership.
    pub(super) fn keep(mut self) -> Option<Reservation> {
        self.kept = true;
        self.reserved.take()
    }
}

impl Drop for Readying {
    fn drop(&mut self) {
        if !self.kept {
            self.prepare.discard();
        }
    }
}

/// The candidate a holder hands its Lease over to, as the Lease named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Successor {
    pub(super) identity: String,
    /// The version that named it: the handover is a compare-and-swap on it.
    pub(super) resource_version: String,
    pub(super) transitions: i32,
}

impl Successor {
    /// The ready candidate `lease` names, if it is held by `me` and asks for a successor.
    pub(super) fn named_on(lease: &Lease, me: &str) -> Option<Self> {
        // Only the annotations and holder are read: the durations do not matter here.
        let seen = Seen::observe(lease, None, Duration::ZERO, Instant::now());
        let ours = seen.holder.as_deref() == Some(me);
        match &seen.preferred_holder {
            Some(ready) if ours && seen.handing_over && ready != me => Some(Successor {
                identity: ready.clone(),
                resource_version: seen.resource_version.clone(),
                transitions: seen.transitions,
            }),
            _ => None,
        }
    }
}
