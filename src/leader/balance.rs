//! How many Lease shards (`cnat run --shards N`) a replica leads: pure decisions, and the
//! `Balance` the shards' elections of one replica share.
//!
//! Each replica aims at its share, `ceil(shards / replicas)`, the replicas being those whose
//! membership Lease is live (`members`). It takes a free or expired shard only while it leads
//! fewer than its share, so the replicas under theirs take a free shard first; one over its
//! share gives up one shard at a time (then the next, once that one is let go). No shard waits
//! for long whatever the counts say: a shard free for a whole lease duration is taken by anyone,
//! so a replica whose count of replicas is wrong or stale (one that died counted until its
//! membership expires) never leaves a shard without a leader.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::Leadership;

/// One replica's view: how many shards it leads, of how many, among how many live replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    pub leading: usize,
    pub shards: usize,
    pub replicas: usize,
}

impl Standing {
    /// How many shards this replica aims to lead: `ceil(shards / replicas)`, all of them when it
    /// knows of no replica (itself included).
    pub fn share(&self) -> usize {
        self.shards.div_ceil(self.replicas.max(1))
    }

    /// Whether to take a shard's Lease that has been free (released, expired or missing) for
    /// `free_for`.
    pub fn may_take(&self, free_for: Duration, lease_duration: Duration) -> bool {
        self.leading < self.share() || free_for >= lease_duration
    }

    /// Whether to give one shard up: this replica leads more than its share.
    pub fn over_share(&self) -> bool {
        self.leading > self.share()
    }
}

/// What the shard elections of one replica share: how many shards it leads (`Leadership`), how
/// many live replicas it knows of (written by `members`), and whether one of its shards is being
/// given up.
#[derive(Debug)]
pub struct Balance {
    shards: usize,
    leadership: Arc<Leadership>,
    replicas: AtomicUsize,
    lease_duration: Duration,
    yielding: AtomicBool,
    /// Cancelled once the replicas were first counted.
    counted: CancellationToken,
}

impl Balance {
    pub fn new(shards: usize, leadership: Arc<Leadership>, lease_duration: Duration) -> Self {
        Balance {
            shards,
            leadership,
            replicas: AtomicUsize::new(1),
            lease_duration,
            yielding: AtomicBool::new(false),
            counted: CancellationToken::new(),
        }
    }

    /// Completes once the replicas were counted (at once if they were).
    pub fn counted(&self) -> WaitForCancellationFutureOwned {
        self.counted.clone().cancelled_owned()
    }

    /// Live replicas, this one included, as the membership Leases last said.
    pub fn set_replicas(&self, replicas: usize) {
        self.replicas.store(replicas.max(1), Ordering::SeqCst);
        self.counted.cancel();
    }

    pub fn standing(&self) -> Standing {
        Standing {
            leading: self.leadership.leading(),
            shards: self.shards,
            replicas: self.replicas.load(Ordering::SeqCst),
        }
    }

    /// Whether a shard free for `free_for` may be taken now.
    pub fn may_take(&self, free_for: Duration) -> bool {
        self.standing().may_take(free_for, self.lease_duration)
    }

    /// Whether the caller is to give its shard up: `Some` for one shard at a time, while this
    /// replica leads more than its share; the shard is given up when the `Yielding` is dropped.
    pub fn try_yield(self: &Arc<Self>) -> Option<Yielding> {
        if !self.standing().over_share() {
            return None;
        }
        self.yielding
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .ok()
            .map(|_| Yielding(self.clone()))
    }
}

/// One shard being given up (`Balance::try_yield`); the next may be once it is dropped, after
/// the shard's Lease was released and the replica no longer counts it.
#[derive(Debug)]
pub struct Yielding(Arc<Balance>);

impl Drop for Yielding {
    fn drop(&mut self) {
        self.0.yielding.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(15);

    fn standing(leading: usize, shards: usize, replicas: usize) -> Standing {
        Standing {
            leading,
            shards,
            replicas,
        }
    }

    #[test]
    fn the_share_is_the_shards_over_the_replicas_rounded_up() {
        for (shards, replicas, share) in [
            (1, 1, 1),
            (4, 1, 4),
            (4, 2, 2),
            (4, 3, 2),
            (6, 3, 2),
            (7, 3, 3),
            (3, 5, 1),
            (4, 0, 4),
        ] {
            assert_eq!(
                standing(0, shards, replicas).share(),
                share,
                "{shards}/{replicas}"
            );
        }
    }

    #[test]
    fn a_replica_under_its_share_takes_at_once_one_at_it_only_a_long_free_shard() {
        let under = standing(1, 6, 3);
        assert!(under.may_take(Duration::ZERO, LEASE));
        let at = standing(2, 6, 3);
        assert!(!at.may_take(Duration::ZERO, LEASE));
        assert!(!at.may_take(LEASE - Duration::from_millis(1), LEASE));
        assert!(at.may_take(LEASE, LEASE));
        assert!(!at.over_share());
        assert!(standing(3, 6, 3).over_share());
    }

    /// Replicas that follow the rules, each knowing the true count, end with every shard led
    /// and shares that differ by at most one, whatever order they act in.
    #[test]
    fn replicas_following_the_rules_settle_on_even_shares() {
        for shards in 1..=12 {
            for replicas in 1..=5 {
                for first in 0..replicas {
                    // Worst start: one replica holds every shard.
                    let mut leading = vec![0; replicas];
                    leading[first] = shards;
                    let mut free = 0;
                    for _round in 0..(shards * replicas * 4) {
                        for led in leading.iter_mut() {
                            let s = standing(*led, shards, replicas);
                            if s.over_share() {
                                *led -= 1;
                                free += 1;
                            } else if free > 0 && s.may_take(Duration::ZERO, LEASE) {
                                *led += 1;
                                free -= 1;
                            }
                        }
                    }
                    assert_eq!(free, 0, "{shards} shards, {replicas} replicas: {leading:?}");
                    assert_eq!(leading.iter().sum::<usize>(), shards);
                    let share = shards.div_ceil(replicas);
                    assert!(leading.iter().all(|n| *n <= share), "{leading:?}");
                }
            }
        }
    }

    #[test]
    fn one_shard_is_given_up_at_a_time_and_only_over_the_share() {
        let leadership = Arc::new(Leadership::default());
        let balance = Arc::new(Balance::new(4, leadership.clone(), LEASE));
        for _ in 0..3 {
            leadership.set_leading(true);
        }
        // Alone: its share is every shard.
        assert!(balance.try_yield().is_none());
        balance.set_replicas(2);
        let first = balance.try_yield().expect("over its share of 2");
        assert!(
            balance.try_yield().is_none(),
            "a second while the first goes"
        );
        leadership.set_leading(false);
        drop(first);
        assert!(balance.try_yield().is_none(), "at its share");
        balance.set_replicas(0);
        assert_eq!(balance.standing().replicas, 1);
    }
}
