//! At most one report per period: a collector that keeps failing is worth a log line a minute,
//! not one per export or connection.

use crate::sync::lock;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often a failing collector or a broken file is reported at most.
pub const REPORT_EVERY: Duration = Duration::from_secs(60);

/// Allows one report per `every`; the clock is the caller's (`allow(now)`).
#[derive(Debug)]
pub struct Throttle {
    every: Duration,
    last: Mutex<Option<Instant>>,
}

impl Throttle {
    /// At most one report per `every`.
    pub fn every(every: Duration) -> Self {
        Throttle {
            every,
            last: Mutex::new(None),
        }
    }

    /// Whether a report may go out at `now`; if so, the next one may only go out `every` later.
    pub fn allow(&self, now: Instant) -> bool {
        let mut last = lock(&self.last);
        match *last {
            Some(then) if now.saturating_duration_since(then) < self.every => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_report_per_period() {
        let throttle = Throttle::every(Duration::from_secs(60));
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        assert!(throttle.allow(at(0)));
        assert!(!throttle.allow(at(1)));
        assert!(!throttle.allow(at(59)));
        assert!(throttle.allow(at(60)));
        assert!(!throttle.allow(at(119)));
        assert!(throttle.allow(at(200)));
        // A clock that went back allows nothing new.
        assert!(!throttle.allow(at(150)));
    }
}
