//! One renewal of a held Lease, and what it came to. See docs/src/design/architecture.md,
//! "The Lease and the election".

use super::handover::Successor;
use super::record::{self, Held, Reread};
use super::store::{LeaseApi, LeaseError, Written};
use k8s_openapi::api::coordination::v1::Lease;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::time::Instant;

/// The shortest wait for a renewal's answer, however close the renew deadline is (the loop stops
/// at the deadline whatever the renewal is doing).
const MIN_RENEWAL_WAIT: Duration = Duration::from_millis(100);

/// What one renewal attempt came to.
pub(super) enum Renewal {
    /// Renewed (`true`: with the ask for a successor, `record::HANDING_OVER`), and the ready
    /// successor the Lease names, if any.
    Renewed(Held, bool, Option<Successor>),
    /// A conflict, but the Lease is still ours at this newer version (and the successor it
    /// names: a candidate's write is a conflict for us).
    StillOurs(String, Option<Successor>),
    Gone(Option<String>),
    Failed(LeaseError),
}

pub(super) type RenewalFuture = Pin<Box<dyn Future<Output = Renewal> + Send>>;

/// One renewal on `version` by `me` (`asking`: for a successor), waiting `limit` (at least
/// `MIN_RENEWAL_WAIT`); on a conflict, a read tells a foreign write (still ours) from a takeover.
pub(super) fn renew(
    leases: LeaseApi,
    me: String,
    wall: jiff::Timestamp,
    version: String,
    limit: Duration,
    asking: bool,
) -> RenewalFuture {
    Box::pin(async move {
        let sent = Instant::now();
        let patch = record::renew_patch(&version, wall, asking.then_some(me.as_str()));
        match leases
            .swap_within(&patch, limit.max(MIN_RENEWAL_WAIT))
            .await
        {
            Ok(Written::Done(lease)) => {
                let successor = Successor::named_on(&lease, &me);
                Renewal::Renewed(held(&lease, sent), asking, successor)
            }
            Ok(Written::Missing) => Renewal::Gone(None),
            Ok(Written::Conflict) => match leases.get().await {
                Ok(lease) => match record::reread(lease.as_ref(), &me) {
                    Reread::StillOurs { resource_version } => {
                        let successor = lease
                            .as_ref()
                            .and_then(|lease| Successor::named_on(lease, &me));
                        Renewal::StillOurs(resource_version, successor)
                    }
                    Reread::Gone { holder } => Renewal::Gone(holder),
                },
                Err(error) => Renewal::Failed(error),
            },
            Err(error) => Renewal::Failed(error),
        }
    })
}

/// Our tenure from a write that landed, sent at `sent`.
pub(super) fn held(lease: &Lease, sent: Instant) -> Held {
    Held {
        resource_version: lease.metadata.resource_version.clone().unwrap_or_default(),
        sent,
    }
}
