//! Slow start for pod creates: when many Ats fall due together, the first creates go out two at a
//! time and each answered create lets one more out, so the window doubles each round trip until
//! the reconciles' own limit (`--concurrency`) is what holds them. The API server works on the
//! creates it has at once side by side on the same cores: handed 32 at the same instant, it
//! answers the first only after about 32 creates' work. A create waits at most `MAX_WAIT` for the
//! window, so a create that hangs holds nothing up for longer than that; after `IDLE` without a
//! create in flight the window starts small again.
//!
//! The decisions (`admit`, `answered`) are pure and take the time; `SlowStart` holds the window
//! and wakes waiters.

use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Creates let out at once when a wave starts.
pub const FIRST: usize = 2;
/// The longest a create waits for the window.
pub const MAX_WAIT: Duration = Duration::from_millis(50);
/// No create in flight for this long: the next wave starts small again.
pub const IDLE: Duration = Duration::from_secs(1);
/// The window grows no further: the reconciles' limit (`--concurrency`) binds long before,
/// unless it is 0 (none).
const LIMIT: usize = 4096;

/// The window, and the creates in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// How many creates may be in flight.
    pub open: usize,
    /// How many are.
    pub in_flight: usize,
    /// When the last create in flight was answered (or the window was made).
    pub idle_since: Instant,
}

impl Window {
    /// A window of `FIRST`, idle since `now`.
    pub fn new(now: Instant) -> Self {
        Window {
            open: FIRST,
            in_flight: 0,
            idle_since: now,
        }
    }
}

/// The window once a create is let in at `now`; `None` while it is full. A window idle for
/// `IDLE` starts again at `FIRST`.
pub fn admit(window: Window, now: Instant) -> Option<Window> {
    let open = if window.in_flight == 0 && now.duration_since(window.idle_since) >= IDLE {
        FIRST
    } else {
        window.open
    };
    (window.in_flight < open).then_some(Window {
        open,
        in_flight: window.in_flight + 1,
        ..window
    })
}

/// The window once a create let in (or past it, after `MAX_WAIT`) was answered at `now`: one
/// wider.
pub fn answered(window: Window, now: Instant) -> Window {
    let in_flight = window.in_flight.saturating_sub(1);
    Window {
        open: (window.open + 1).min(LIMIT),
        in_flight,
        idle_since: if in_flight == 0 {
            now
        } else {
            window.idle_since
        },
    }
}

/// The window pod creates share (one per leader).
pub struct SlowStart(watch::Sender<Window>);

impl Default for SlowStart {
    fn default() -> Self {
        SlowStart(watch::Sender::new(Window::new(Instant::now())))
    }
}

/// A create in flight, until dropped (answered, or given up).
pub struct InWindow<'a>(&'a SlowStart);

impl Drop for InWindow<'_> {
    fn drop(&mut self) {
        self.0
             .0
            .send_modify(|window| *window = answered(*window, Instant::now()));
    }
}

impl SlowStart {
    /// Waits for room in the window, `MAX_WAIT` at most, and counts the create in flight until
    /// the returned guard is dropped.
    pub async fn enter(&self) -> InWindow<'_> {
        let deadline = Instant::now() + MAX_WAIT;
        let mut changed = self.0.subscribe();
        loop {
            let let_in = self
                .0
                .send_if_modified(|window| match admit(*window, Instant::now()) {
                    Some(admitted) => {
                        *window = admitted;
                        true
                    }
                    None => false,
                });
            if let_in {
                return InWindow(self);
            }
            // Subscribed before the try: an answer since then is seen here.
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                // Waited long enough (or, impossibly, the window is gone): in past the window.
                Ok(Err(_)) | Err(_) => {
                    self.0.send_modify(|window| window.in_flight += 1);
                    return InWindow(self);
                }
            }
        }
    }

    /// The window now.
    pub fn window(&self) -> Window {
        *self.0.borrow()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wave_starts_with_two_and_each_answer_lets_one_more_out() {
        let start = Instant::now();
        let mut window = Window::new(start);
        let now = start + Duration::from_millis(1);
        window = admit(window, now).unwrap();
        window = admit(window, now).unwrap();
        assert_eq!(admit(window, now), None, "a third waits");
        window = answered(window, now);
        assert_eq!((window.open, window.in_flight), (3, 1));
        window = admit(window, now).unwrap();
        window = admit(window, now).unwrap();
        assert_eq!(admit(window, now), None);
        // Answers while others fly do not count as idle.
        assert_eq!(window.idle_since, start);
    }

    #[test]
    fn the_window_doubles_each_round_trip_and_stops_growing_at_its_limit() {
        let now = Instant::now();
        let mut window = Window::new(now);
        for round in 0..4 {
            let open = window.open;
            for _ in 0..open {
                window = admit(window, now).unwrap();
            }
            assert_eq!(admit(window, now), None);
            for _ in 0..open {
                window = answered(window, now);
            }
            assert_eq!(window.open, FIRST << (round + 1));
        }
        window.open = LIMIT;
        assert_eq!(answered(window, now).open, LIMIT);
    }

    #[test]
    fn an_idle_second_starts_the_next_wave_small() {
        let start = Instant::now();
        let mut window = Window::new(start);
        window.open = 32;
        window = admit(window, start).unwrap();
        let last_answer = start + Duration::from_millis(5);
        window = answered(window, last_answer);
        assert_eq!((window.in_flight, window.idle_since), (0, last_answer));
        // Within a second of the last answer the window stays as wide...
        let soon = admit(window, last_answer + IDLE - Duration::from_millis(1)).unwrap();
        assert_eq!(soon.open, 33);
        // ...after it, the wave starts again at two.
        let later = admit(window, last_answer + IDLE).unwrap();
        assert_eq!((later.open, later.in_flight), (FIRST, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_create_goes_when_one_is_answered_or_after_the_longest_wait() {
        let slow = SlowStart::default();
        let started = Instant::now();
        let first = slow.enter().await;
        let _second = slow.enter().await;
        assert_eq!(started.elapsed(), Duration::ZERO);
        // The third is let in as soon as the first is answered.
        let third = async {
            let _in = slow.enter().await;
            started.elapsed()
        };
        let answer = async {
            tokio::time::sleep(Duration::from_millis(7)).await;
            drop(first);
        };
        let (waited, ()) = tokio::join!(third, answer);
        assert_eq!(waited, Duration::from_millis(7));
        assert_eq!(
            slow.window().open,
            FIRST + 2,
            "two answers: the first and the third"
        );
        // With the window full and nothing answered, a create waits `MAX_WAIT`, then goes.
        let (_a, _b, _c) = (slow.enter().await, slow.enter().await, slow.enter().await);
        let full = Instant::now();
        let _past = slow.enter().await;
        assert_eq!(full.elapsed(), MAX_WAIT);
        assert_eq!(slow.window().in_flight, 5);
    }
}
