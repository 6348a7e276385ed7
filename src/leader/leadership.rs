//! What a replica's leadership shows health checks and metrics, and the wall clock its Lease
//! writes carry. See docs/src/operating/high-availability.md.

use crate::sync::lock;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// The wall clock whose time goes into `acquireTime`/`renewTime` (informational only: no
/// decision reads them). Injected so tests can give each replica a skewed clock.
#[derive(Clone)]
pub struct WallClock(Arc<dyn Fn() -> jiff::Timestamp + Send + Sync>);

impl WallClock {
    /// The system clock.
    pub fn system() -> Self {
        WallClock(Arc::new(jiff::Timestamp::now))
    }

    pub fn new(now: impl Fn() -> jiff::Timestamp + Send + Sync + 'static) -> Self {
        WallClock(Arc::new(now))
    }

    pub fn now(&self) -> jiff::Timestamp {
        (self.0)()
    }
}

impl Default for WallClock {
    fn default() -> Self {
        Self::system()
    }
}

impl fmt::Debug for WallClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WallClock({})", self.now())
    }
}

/// What health checks and metrics can read about this replica's leadership: of the one Lease,
/// or with Lease shards of every shard's.
#[derive(Debug)]
pub struct Leadership {
    /// The Leases this replica holds, each with when it was last renewed.
    held: Mutex<BTreeMap<String, Instant>>,
    transitions: AtomicU64,
    handovers: Histogram,
}

impl Default for Leadership {
    fn default() -> Self {
        Leadership {
            held: Mutex::default(),
            transitions: AtomicU64::new(0),
            // 10 ms to about 82 s.
            handovers: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
        }
    }
}

impl Leadership {
    fn held(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Instant>> {
        lock(&self.held)
    }

    /// Whether this replica holds a Lease (the Lease; with shards, any of them).
    pub fn is_leader(&self) -> bool {
        self.leading() > 0
    }

    /// How many Leases this replica holds.
    pub fn leading(&self) -> usize {
        self.held().len()
    }

    /// The names of the Leases this replica holds.
    pub fn leases(&self) -> Vec<String> {
        self.held().keys().cloned().collect()
    }

    /// How many times this replica became or stopped being leader (of any Lease).
    pub fn transitions(&self) -> u64 {
        self.transitions.load(Ordering::SeqCst)
    }

    /// While leading, the time since the last successful renewal of the Lease renewed longest
    /// ago (with shards, one stuck shard is not hidden by the others' renewals).
    pub fn since_renewal(&self) -> Option<Duration> {
        self.held().values().map(|renewed| renewed.elapsed()).max()
    }

    /// Seconds from the Lease being seen free (released) or expired until this replica led.
    pub fn handovers(&self) -> &Histogram {
        &self.handovers
    }

    /// Lease `lease` held (`true`) or no more (`false`).
    pub(crate) fn set_leading(&self, lease: &str, leading: bool) {
        let changed = if leading {
            self.held()
                .insert(lease.to_owned(), Instant::now())
                .is_none()
        } else {
            self.held().remove(lease).is_some()
        };
        if changed {
            self.transitions.fetch_add(1, Ordering::SeqCst);
        }
    }

    pub(super) fn renewed(&self, lease: &str) {
        if let Some(renewed) = self.held().get_mut(lease) {
            *renewed = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn leadership_counts_the_leases_held_and_each_change() {
        let leadership = Leadership::default();
        assert_eq!(
            (leadership.is_leader(), leadership.since_renewal()),
            (false, None)
        );
        leadership.set_leading("a", true);
        leadership.set_leading("a", true);
        leadership.set_leading("b", true);
        assert_eq!((leadership.is_leader(), leadership.leading()), (true, 2));
        assert_eq!(leadership.leases(), ["a", "b"]);
        assert!(leadership.since_renewal().unwrap() < Duration::from_secs(1));
        leadership.set_leading("a", false);
        assert!(leadership.is_leader());
        leadership.set_leading("b", false);
        leadership.set_leading("b", false);
        assert_eq!(
            (leadership.leading(), leadership.since_renewal()),
            (0, None)
        );
        assert_eq!(leadership.transitions(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn the_lease_renewed_longest_ago_is_the_one_liveness_sees() {
        let leadership = Leadership::default();
        leadership.set_leading("stuck", true);
        leadership.set_leading("fine", true);
        tokio::time::advance(Duration::from_secs(20)).await;
        leadership.renewed("fine");
        let since = leadership.since_renewal().unwrap();
        assert!(since >= Duration::from_secs(20), "{since:?}");
        leadership.set_leading("stuck", false);
        assert!(leadership.since_renewal().unwrap() < Duration::from_secs(1));
    }

    #[test]
    fn the_wall_clock_can_be_skewed() {
        let ahead = WallClock::new(|| jiff::Timestamp::now() + jiff::SignedDuration::from_secs(5));
        let gap = ahead.now().duration_since(WallClock::system().now());
        assert!(gap.as_secs_f64() > 4.9, "{gap:?}");
        assert!(format!("{ahead:?}").starts_with("WallClock("));
    }
}
