//! How many Lease shards a replica leads: pure decisions (`Standing`), and the `Balance` one
//! replica's shard elections share. Whatever the counts say, no shard stays without a leader.
//! See docs/src/design/decisions.md, "Lease shards".

use crate::sync::lock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::leadership::Leadership;

/// What the election's Leases say (`members::view`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct View {
    /// Live replicas of this layout, this one included.
    pub replicas: usize,
    /// The fewest shards another live replica leads (`None`: no other replica).
    pub fewest_of_others: Option<usize>,
    /// This replica is the one to give a shard up for evenness: it leads most, and of those
    /// that do, its identity sorts first (so one gives up, not all of them at once).
    pub first_to_give: bool,
    /// Shards of this layout no live holder leads.
    pub free: usize,
    /// A Lease of another layout is held.
    pub another_layout_leads: bool,
    /// A Lease of a layout that outranks this one is held.
    pub outranked: bool,
}

impl Default for View {
    /// Before the first list: alone, nothing known.
    fn default() -> Self {
        View {
            replicas: 1,
            fewest_of_others: None,
            first_to_give: true,
            free: 0,
            another_layout_leads: false,
            outranked: false,
        }
    }
}

/// Lease durations after a rescue (a shard free a whole lease duration, taken by a replica at or
/// over its share, or one only rescuing) during which
/// the replica gives no shard up, so a stuck replica's shard is not passed back and forth.
const KEEP_AFTER_RESCUE: u32 = 10;

/// Lease durations after giving a shard up during which this replica takes it again only as a
/// rescue (so that another replica takes it first).
pub const RESCUE_ONLY_AFTER_GIVING_UP: u32 = 2;

/// One replica's standing: how many shards it leads (and is taking), of how many, and what the
/// Leases say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    pub leading: usize,
    pub shards: usize,
    pub view: View,
    /// It took a shard free for a whole lease duration within `KEEP_AFTER_RESCUE`.
    pub rescued: bool,
}

impl Standing {
    /// How many shards this replica aims to lead: `ceil(shards / replicas)`.
    pub fn share(&self) -> usize {
        self.shards.div_ceil(self.view.replicas.max(1))
    }

    /// Whether to take a shard's Lease that has been free (released, expired or missing) for
    /// `free_for`.
    pub fn may_take(&self, free_for: Duration, lease_duration: Duration) -> bool {
        !self.view.another_layout_leads
            && (self.leading < self.share() || free_for >= lease_duration)
    }

    /// Whether to give one shard up: any while outranked; else, with no shard free and no recent
    /// rescue, when over its share or (first to give) two above the replica leading fewest.
    pub fn gives_one_up(&self) -> bool {
        if self.view.outranked {
            return self.leading > 0;
        }
        let uneven = self.view.first_to_give
            && self
                .view
                .fewest_of_others
                .is_some_and(|fewest| self.leading >= fewest + 2);
        !self.rescued && self.view.free == 0 && (self.leading > self.share() || uneven)
    }
}

/// What one replica's shard elections share: the shards it leads and is taking, what the Leases
/// say (written by `members`), and whether a shard is being given up.
#[derive(Debug)]
pub struct Balance {
    shards: usize,
    leadership: Arc<Leadership>,
    lease_duration: Duration,
    state: Mutex<State>,
    yielding: AtomicBool,
    /// Cancelled once two looks at the Leases in a row counted the same replicas.
    counted: CancellationToken,
    /// Cancelled once the Leases were looked at.
    looked: CancellationToken,
    /// Asks for a look at the Leases now: an election was refused a free shard on a count that
    /// may be stale.
    look: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct State {
    view: View,
    /// When the look at the Leases that `view` is of was sent (`None`: none yet).
    view_sent: Option<Instant>,
    /// When the last shard given up was let go: the next waits for a look sent after it.
    yielded_at: Option<Instant>,
    /// Shards being taken: won campaigns not yet counted as led.
    taking: usize,
    /// When it last led a shard taken as a rescue.
    rescued_at: Option<Instant>,
    /// When the Leases last said another layout leads: a shard left free meanwhile was not
    /// free for this layout.
    foreign_at: Option<Instant>,
}

impl State {
    fn rescued(&self, lease_duration: Duration) -> bool {
        self.rescued_at
            .is_some_and(|at| at.elapsed() < lease_duration * KEEP_AFTER_RESCUE)
    }
}

impl Balance {
    pub fn new(shards: usize, leadership: Arc<Leadership>, lease_duration: Duration) -> Self {
        Balance {
            shards,
            leadership,
            lease_duration,
            state: Mutex::default(),
            yielding: AtomicBool::new(false),
            counted: CancellationToken::new(),
            looked: CancellationToken::new(),
            look: tokio::sync::Notify::new(),
        }
    }

    /// Completes when an election asks for a look at the Leases (`try_reserve` refused).
    pub async fn look_asked(&self) {
        self.look.notified().await
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// What the election's Leases said last, in a look sent at `sent`.
    pub fn set_view(&self, view: View, sent: Instant) {
        let mut state = self.state();
        // Another layout led until this look, if the last one said so.
        if view.another_layout_leads || state.view.another_layout_leads {
            state.foreign_at = Some(Instant::now());
        }
        let settled = state.view_sent.is_some() && state.view.replicas == view.replicas;
        state.view = view;
        state.view_sent = Some(sent);
        drop(state);
        self.looked.cancel();
        if settled {
            self.counted.cancel();
        }
    }

    /// Completes once the Leases were looked at (at once if they were).
    pub fn looked(&self) -> WaitForCancellationFutureOwned {
        self.looked.clone().cancelled_owned()
    }

    pub fn view(&self) -> View {
        self.state().view
    }

    /// Completes once two looks at the Leases in a row counted the same replicas (at once if
    /// they did): replicas that start together see each other before any takes a shard.
    pub fn counted(&self) -> WaitForCancellationFutureOwned {
        self.counted.clone().cancelled_owned()
    }

    fn standing_of(&self, state: &State) -> Standing {
        Standing {
            leading: self.leadership.leading() + state.taking,
            shards: self.shards,
            view: state.view,
            rescued: state.rescued(self.lease_duration),
        }
    }

    #[cfg(test)]
    pub fn standing(&self) -> Standing {
        self.standing_of(&self.state())
    }

    /// A place among the shards this replica leads, for a shard free for `free_for`, if it may take
    /// one now (`rescue_only`: only if free a whole lease duration); held until led or dropped.
    pub fn try_reserve(
        self: &Arc<Self>,
        free_for: Duration,
        rescue_only: bool,
    ) -> Option<Reservation> {
        let mut state = self.state();
        let free_for = match state.foreign_at {
            Some(at) => free_for.min(at.elapsed()),
            None => free_for,
        };
        let standing = self.standing_of(&state);
        if !standing.may_take(free_for, self.lease_duration)
            || (rescue_only && free_for < self.lease_duration)
        {
            drop(state);
            self.look.notify_one();
            return None;
        }
        state.taking += 1;
        Some(Reservation {
            balance: self.clone(),
            // Beyond its share, or a shard it gave up: the counts were wrong.
            rescue: rescue_only || standing.leading >= standing.share(),
        })
    }

    /// `Some` if the caller is to give its shard up: one at a time, each after a newer look at the
    /// Leases (all at once while outranked); the next may follow once the `Yielding` drops.
    pub fn try_yield(self: &Arc<Self>) -> Option<Yielding> {
        let state = self.state();
        let standing = self.standing_of(&state);
        if !standing.gives_one_up() {
            return None;
        }
        if standing.view.outranked {
            return Some(Yielding(None));
        }
        let newer = match (state.view_sent, state.yielded_at) {
            (Some(sent), Some(yielded)) => sent > yielded,
            (sent, None) => sent.is_some(),
            (None, Some(_)) => false,
        };
        if !newer {
            return None;
        }
        drop(state);
        self.yielding
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .ok()
            .map(|_| Yielding(Some(self.clone())))
    }
}

/// A shard being taken (`Balance::try_reserve`), counted among those this replica leads until
/// dropped (once the shard is counted as led, or the take failed).
#[derive(Debug)]
pub struct Reservation {
    balance: Arc<Balance>,
    /// Taken beyond the share: a rescue.
    rescue: bool,
}

impl Reservation {
    /// The shard is led (and counted): a rescue starts the time it keeps its shards.
    pub fn led(self) {
        if self.rescue {
            self.balance.state().rescued_at = Some(Instant::now());
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut state = self.balance.state();
        state.taking = state.taking.saturating_sub(1);
    }
}

/// One shard being given up (`Balance::try_yield`): drop it once the shard's Lease is released
/// and no longer counted; the next waits for a newer look at the Leases.
#[derive(Debug)]
pub struct Yielding(Option<Arc<Balance>>);

impl Yielding {
    /// Given up because an outranking layout leads, not for the balance.
    pub fn outranked(&self) -> bool {
        self.0.is_none()
    }
}

impl Drop for Yielding {
    fn drop(&mut self) {
        if let Some(balance) = &self.0 {
            balance.state().yielded_at = Some(Instant::now());
            balance.yielding.store(false, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests;
