//! Pods first: when many Ats fall due together, the API server's write capacity goes to their
//! pods before any status write or event of that wave, and to status writes before events.
//! See docs/src/design/decisions.md, "Pods first".

use crate::operator::slow_start::SlowStart;
use crate::sync::lock;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio::time::Instant;

/// How long pod creates and status writes must have been idle before an event goes out.
pub const QUIET: std::time::Duration = std::time::Duration::from_millis(20);

/// Counts work in flight (or queued) of one priority; lower priorities wait until it is idle.
#[derive(Clone)]
pub struct InFlight(Arc<Counted>);

struct Counted {
    count: watch::Sender<usize>,
    /// When the count last went to zero.
    idle_since: Mutex<Instant>,
}

impl Default for InFlight {
    fn default() -> Self {
        InFlight(Arc::new(Counted {
            count: watch::Sender::new(0),
            idle_since: Mutex::new(Instant::now()),
        }))
    }
}

/// One unit of work counted by `InFlight`, until dropped.
pub struct InFlightGuard(InFlight);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let counted = &self.0 .0;
        counted.count.send_modify(|n| {
            *n -= 1;
            if *n == 0 {
                *lock(&counted.idle_since) = Instant::now();
            }
        });
    }
}

impl InFlight {
    /// Counts one more unit until the returned guard is dropped.
    pub fn enter(&self) -> InFlightGuard {
        self.0.count.send_modify(|n| *n += 1);
        InFlightGuard(self.clone())
    }

    /// Returns once nothing is counted.
    pub async fn idle(&self) {
        let mut count = self.0.count.subscribe();
        // The sender lives as long as `self`, so waiting cannot fail.
        let _ = count.wait_for(|n| *n == 0).await;
    }

    /// Units counted now.
    pub fn in_flight(&self) -> usize {
        *self.0.count.borrow()
    }

    /// Since when nothing is counted, or `None` while something is.
    fn idle_since(&self) -> Option<Instant> {
        let count = self.0.count.borrow();
        (*count == 0).then(|| *lock(&self.0.idle_since))
    }
}

/// The three priorities of writes: pod creates, then status writes, then events.
#[derive(Clone, Default)]
pub struct Priority {
    /// Pod creates in flight (queued in `window` too).
    pub creating: InFlight,
    /// The window pod creates go out in (`slow_start`).
    pub window: Arc<SlowStart>,
    /// Status writes queued behind pod creates, or in flight.
    pub writing: InFlight,
}

impl Priority {
    /// Returns once neither pod creates nor status writes have been in flight for `QUIET`; then
    /// every waiter passes at once, so a wave's events pay the quiet period once.
    pub async fn quiet(&self) {
        loop {
            self.creating.idle().await;
            self.writing.idle().await;
            let (Some(created), Some(written)) =
                (self.creating.idle_since(), self.writing.idle_since())
            else {
                continue;
            };
            let quiet_from = created.max(written) + QUIET;
            if Instant::now() >= quiet_from {
                return;
            }
            tokio::time::sleep_until(quiet_from).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_wave_s_events_pay_the_quiet_period_once() {
        let priority = Priority::default();
        let started = Instant::now();
        let write = priority.writing.enter();
        tokio::time::advance(Duration::from_millis(5)).await;
        drop(write);
        // The first waiter waits until writes have been idle for the quiet period (20 ms)...
        priority.quiet().await;
        assert_eq!(started.elapsed(), Duration::from_millis(25));
        // ...and every later one passes at once, while nothing is written.
        let later = Instant::now();
        for _ in 0..100 {
            priority.quiet().await;
        }
        assert_eq!(later.elapsed(), Duration::ZERO);
        // A pod create starts the quiet period again.
        drop(priority.creating.enter());
        let after_create = Instant::now();
        priority.quiet().await;
        assert_eq!(after_create.elapsed(), Duration::from_millis(20));
    }
}
