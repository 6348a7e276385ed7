//! Leadership: replicas compete for a `coordination.k8s.io/v1` Lease, and only the holder runs
//! the reconcile loop. Leases give no fencing, so correctness never rests on this alone: pods
//! have fixed names and status writes carry resourceVersion preconditions.

use crate::events::EventSink;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::{Api, Client, Resource, ResourceExt};
use kube_leader_election::{LeaseLock, LeaseLockParams, LeaseLockResult};
use serde_json::json;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;
use tokio::time::{sleep, sleep_until, timeout, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{info, warn};

/// How leadership is kept; the defaults and invariants are client-go's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How long a Lease stays valid after its last renewal; others wait this long to take over.
    pub lease_duration: Duration,
    /// How long a leader keeps leading without a successful renewal before it stops.
    pub renew_deadline: Duration,
    /// How often candidates try to acquire and the leader renews.
    pub retry_period: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// A timing that cannot keep a single leader. Messages name the flags and the fix.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TimingError {
    #[error("--lease-duration {0:?} must be a whole number of seconds, at least 1s (Lease.spec.leaseDurationSeconds is an integer)")]
    LeaseNotWholeSeconds(Duration),
    #[error("--lease-duration {lease:?} must be longer than --renew-deadline {renew:?}, or a new leader can start before the old one stops")]
    RenewNotBelowLease { lease: Duration, renew: Duration },
    #[error("--renew-deadline {renew:?} must be longer than 1.2 x --retry-period {retry:?}, so a leader gets at least one retry before it gives up")]
    RetryTooLong { renew: Duration, retry: Duration },
    #[error("--retry-period must be longer than zero")]
    ZeroRetry,
}

impl Timing {
    /// Checks lease duration > renew deadline > 1.2 x retry period > 0.
    pub fn validate(&self) -> Result<(), TimingError> {
        let lease = self.lease_duration;
        if lease.subsec_nanos() != 0 || lease.is_zero() {
            return Err(TimingError::LeaseNotWholeSeconds(lease));
        }
        if self.retry_period.is_zero() {
            return Err(TimingError::ZeroRetry);
        }
        if lease <= self.renew_deadline {
            return Err(TimingError::RenewNotBelowLease {
                lease,
                renew: self.renew_deadline,
            });
        }
        if self.renew_deadline.as_secs_f64() <= 1.2 * self.retry_period.as_secs_f64() {
            return Err(TimingError::RetryTooLong {
                renew: self.renew_deadline,
                retry: self.retry_period,
            });
        }
        Ok(())
    }
}

/// Which Lease to compete for, as whom, and how.
#[derive(Debug, Clone)]
pub struct Settings {
    pub lease_name: String,
    pub namespace: String,
    pub identity: String,
    pub timing: Timing,
}

/// What health checks and metrics can read about this replica's leadership.
#[derive(Debug, Default)]
pub struct Leadership {
    leading: AtomicBool,
    transitions: AtomicU64,
    last_renewal: Mutex<Option<Instant>>,
}

impl Leadership {
    pub fn is_leader(&self) -> bool {
        self.leading.load(Ordering::SeqCst)
    }

    /// How many times this replica became or stopped being leader.
    pub fn transitions(&self) -> u64 {
        self.transitions.load(Ordering::SeqCst)
    }

    /// While leading, the time since the last successful renewal.
    pub fn since_renewal(&self) -> Option<Duration> {
        let last = *self.last_renewal.lock().unwrap_or_else(|e| e.into_inner());
        last.filter(|_| self.is_leader()).map(|t| t.elapsed())
    }

    pub(crate) fn set_leading(&self, leading: bool) {
        if self.leading.swap(leading, Ordering::SeqCst) != leading {
            self.transitions.fetch_add(1, Ordering::SeqCst);
        }
        if leading {
            self.renewed();
        }
    }

    fn renewed(&self) {
        *self.last_renewal.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }
}

/// Competes for the Lease until `shutdown`; while holding it, runs `work`. `work` gets a token
/// that asks it to stop gracefully (on shutdown); on lost leadership it is aborted at once.
pub async fn run<W, F>(
    client: Client,
    settings: Settings,
    leadership: Arc<Leadership>,
    events: EventSink,
    work: W,
    shutdown: CancellationToken,
) where
    W: Fn(CancellationToken) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    let elector = Elector::new(client, settings, leadership, events);
    let mut failures = 0u32;
    loop {
        match elector.try_acquire().await {
            Ok(Some(lease)) => {
                failures = 0;
                if elector.lead(&lease, &work, &shutdown).await == Ended::Released {
                    return;
                }
            }
            Ok(None) => failures = 0,
            Err(error) => {
                failures += 1;
                warn!(lease = %elector.name(), %error, failures, "could not acquire the lease; retrying");
            }
        }
        let pause = elector.settings.timing.retry_period * failures.clamp(1, 5);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = sleep(pause) => {}
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// Shutdown: the work stopped and the Lease was released.
    Released,
    /// Leadership lost: the work was aborted.
    Lost,
}

/// Why an acquisition attempt failed.
#[derive(Debug, Error)]
enum AcquireError {
    #[error(transparent)]
    Lease(#[from] kube_leader_election::Error),
    #[error("confirming the acquired lease: {0}")]
    Confirm(kube::Error),
    #[error("no answer from the API server within {0:?}")]
    Timeout(Duration),
}

struct Elector {
    lock: LeaseLock,
    leases: Api<Lease>,
    settings: Settings,
    leadership: Arc<Leadership>,
    events: EventSink,
}

impl Elector {
    fn new(
        client: Client,
        settings: Settings,
        leadership: Arc<Leadership>,
        events: EventSink,
    ) -> Self {
        let params = LeaseLockParams {
            lease_name: settings.lease_name.clone(),
            holder_id: settings.identity.clone(),
            lease_ttl: settings.timing.lease_duration,
        };
        Elector {
            lock: LeaseLock::new(client.clone(), &settings.namespace, params),
            leases: Api::namespaced(client, &settings.namespace),
            settings,
            leadership,
            events,
        }
    }

    fn name(&self) -> String {
        format!("{}/{}", self.settings.namespace, self.settings.lease_name)
    }

    /// One candidate attempt; `Some(lease)` when this replica now holds it.
    async fn try_acquire(&self) -> Result<Option<Lease>, AcquireError> {
        let retry = self.settings.timing.retry_period;
        let attempt = timeout(retry, self.lock.try_acquire_or_renew());
        match attempt.await.map_err(|_| AcquireError::Timeout(retry))? {
            Ok(LeaseLockResult::Acquired(lease)) => self.confirm(lease).await,
            Ok(LeaseLockResult::NotAcquired(_)) => Ok(None),
            // Another candidate created the Lease first.
            Err(kube_leader_election::Error::CreateLease(kube::Error::Api(s)))
                if s.is_already_exists() =>
            {
                Ok(None)
            }
            Err(error) => Err(error.into()),
        }
    }

    /// The crate acquires with a merge patch that has no precondition, so two candidates can
    /// both "acquire" an expired Lease. Rewriting our holder with the acquired resourceVersion
    /// as a precondition fails if anyone wrote since, which narrows that window.
    async fn confirm(&self, lease: Lease) -> Result<Option<Lease>, AcquireError> {
        let patch = json!({
            "metadata": { "resourceVersion": lease.resource_version() },
            "spec": { "holderIdentity": self.settings.identity },
        });
        let (name, params, patch) = (
            lease.name_any(),
            PatchParams::default(),
            Patch::Merge(&patch),
        );
        let confirm = self.leases.patch(&name, &params, &patch);
        let retry = self.settings.timing.retry_period;
        match timeout(retry, confirm)
            .await
            .map_err(|_| AcquireError::Timeout(retry))?
        {
            Ok(confirmed) => Ok(Some(confirmed)),
            Err(kube::Error::Api(s)) if s.is_conflict() => {
                info!(lease = %self.name(), "another candidate acquired the lease at the same time; standing back");
                Ok(None)
            }
            Err(error) => Err(AcquireError::Confirm(error)),
        }
    }

    /// Leads until shutdown (then stops `work` gracefully and releases the Lease) or until a
    /// renewal fails to land within the renew deadline (then aborts `work` at once).
    async fn lead<W, F>(&self, lease: &Lease, work: &W, shutdown: &CancellationToken) -> Ended
    where
        W: Fn(CancellationToken) -> F,
        F: Future<Output = ()> + Send + 'static,
    {
        let timing = self.settings.timing;
        self.leadership.set_leading(true);
        self.tell(
            lease,
            EventType::Normal,
            "LeaderElected",
            "became leader: reconciling Ats",
        )
        .await;
        let stop = CancellationToken::new();
        // Dropping the election (e.g. its task is aborted) aborts the work too: no reconcile
        // loop may outlive the leadership that started it.
        let mut task = AbortOnDropHandle::new(tokio::spawn(work(stop.clone())));
        let mut deadline = Instant::now() + timing.renew_deadline;
        let mut running = true;
        let why = loop {
            tokio::select! {
                _ = shutdown.cancelled() => {
                    stop.cancel();
                    let _ = (&mut task).await;
                    self.release().await;
                    self.leadership.set_leading(false);
                    self.tell(lease, EventType::Normal, "LeaderReleased", "released the lease on shutdown").await;
                    return Ended::Released;
                }
                result = &mut task => {
                    running = false;
                    break format!("the reconcile loop ended unexpectedly: {result:?}");
                }
                _ = sleep_until(deadline) => break format!("no renewal within the renew deadline {:?}", timing.renew_deadline),
                _ = sleep(timing.retry_period) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match timeout(left, self.lock.try_acquire_or_renew()).await {
                        Ok(Ok(LeaseLockResult::Acquired(_))) => {
                            deadline = Instant::now() + timing.renew_deadline;
                            self.leadership.renewed();
                        }
                        Ok(Ok(LeaseLockResult::NotAcquired(held))) => {
                            let holder = held.spec.and_then(|s| s.holder_identity).unwrap_or_default();
                            break format!("the lease is now held by {holder:?}");
                        }
                        Ok(Err(error)) => warn!(lease = %self.name(), %error, "could not renew the lease"),
                        Err(_) => break format!("no renewal within the renew deadline {:?}", timing.renew_deadline),
                    }
                }
            }
        };
        if running {
            // Abort at the next await point: no reconcile starts or continues after this.
            task.abort();
            let _ = task.await;
        }
        self.leadership.set_leading(false);
        warn!(lease = %self.name(), identity = %self.settings.identity, reason = %why, "lost leadership: reconciling stopped");
        self.tell(
            lease,
            EventType::Warning,
            "LeaderLost",
            &format!("stopped leading: {why}"),
        )
        .await;
        Ended::Lost
    }

    /// Gives the Lease up so another replica takes over without waiting for it to expire.
    async fn release(&self) {
        match timeout(self.settings.timing.retry_period, self.lock.step_down()).await {
            Ok(Ok(())) => info!(lease = %self.name(), "released the lease"),
            Ok(Err(error)) => {
                warn!(lease = %self.name(), %error, "could not release the lease; it expires by itself")
            }
            Err(_) => {
                warn!(lease = %self.name(), "releasing the lease timed out; it expires by itself")
            }
        }
    }

    async fn tell(&self, lease: &Lease, type_: EventType, reason: &str, note: &str) {
        info!(lease = %self.name(), identity = %self.settings.identity, reason, "{note}");
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(format!("{}: {note}", self.settings.identity)),
            action: "LeaderElection".into(),
            secondary: None,
        };
        self.events.send(event, lease.object_ref(&())).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(lease: u64, renew_ms: u64, retry_ms: u64) -> Timing {
        Timing {
            lease_duration: Duration::from_secs(lease),
            renew_deadline: Duration::from_millis(renew_ms),
            retry_period: Duration::from_millis(retry_ms),
        }
    }

    #[test]
    fn client_go_defaults_are_valid() {
        assert_eq!(Timing::default(), timing(15, 10_000, 2_000));
        assert_eq!(Timing::default().validate(), Ok(()));
        assert_eq!(timing(3, 2_000, 500).validate(), Ok(()));
    }

    #[test]
    fn invalid_timings_are_refused_with_the_rule_they_break() {
        let err = timing(10, 10_000, 2_000).validate().unwrap_err();
        assert!(matches!(err, TimingError::RenewNotBelowLease { .. }));
        assert!(
            err.to_string()
                .contains("--lease-duration 10s must be longer than --renew-deadline 10s"),
            "{err}"
        );

        // 1.2 x 2s = 2.4s: a 2.4s renew deadline is not longer.
        let err = timing(15, 2_400, 2_000).validate().unwrap_err();
        assert!(matches!(err, TimingError::RetryTooLong { .. }), "{err}");
        assert!(err.to_string().contains("1.2 x --retry-period"), "{err}");
        assert_eq!(timing(15, 2_401, 2_000).validate(), Ok(()));

        let fractional = Timing {
            lease_duration: Duration::from_millis(15_500),
            ..Timing::default()
        };
        assert!(matches!(
            fractional.validate(),
            Err(TimingError::LeaseNotWholeSeconds(_))
        ));
        assert!(matches!(
            timing(0, 0, 0).validate(),
            Err(TimingError::LeaseNotWholeSeconds(_))
        ));
        assert_eq!(
            timing(15, 10_000, 0).validate(),
            Err(TimingError::ZeroRetry)
        );
    }

    #[tokio::test]
    async fn transitions_count_changes_only() {
        let leadership = Leadership::default();
        assert_eq!(
            (leadership.is_leader(), leadership.since_renewal()),
            (false, None)
        );
        leadership.set_leading(true);
        leadership.set_leading(true);
        assert!(leadership.is_leader());
        assert!(leadership.since_renewal().unwrap() < Duration::from_secs(1));
        leadership.set_leading(false);
        assert_eq!(
            (leadership.transitions(), leadership.since_renewal()),
            (2, None)
        );
    }
}
