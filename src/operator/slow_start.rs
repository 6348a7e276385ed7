//! Slow start for pod creates: when many Ats fall due together, the first creates go out two at a
//! time and each create answered while the window was in use lets one more out, so the window
//! doubles each round trip until the reconciles' own limit (`--concurrency`) is what holds them.
//! The API server works on the creates it has at once side by side on the same cores: handed 32
//! at the same instant, it likely answers the first only after about 32 creates' work (17
//! bursts of 1000 on v1.24 and v1.37 put the first pod at 10-17 ms after due with slow start,
//! against 21-30 ms in eight bursts before). A create waits at most `MAX_WAIT` for the window, so a create that hangs holds
//! nothing up for longer than that; after `IDLE` without a create in flight the window starts
//! small again.
//!
//! As in TCP (RFC 5681, with RFC 7661's rule for a window not in use), only an answer while at
//! least half the window was in flight widens it: creates that trickle in one at a time keep it
//! small, so the next wave starts small even without an idle second. An answer that says the
//! server is overloaded (429, a 5xx, no answer) halves it; a create given up before it went out
//! frees its place and changes nothing else.
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

/// What became of a create let in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The server answered (created, or refused it: exists, forbidden, invalid).
    Answered,
    /// The server is overloaded or did not answer (429, a 5xx, a timeout or a lost connection).
    Overloaded,
    /// Given up before it went out (not confirmed, or the reconcile ended).
    NotSent,
}

/// What `result`, the result of a create, says of the server.
pub fn reply<T>(result: &Result<T, kube::Error>) -> Reply {
    match result {
        Ok(_) => Reply::Answered,
        Err(kube::Error::Api(status)) if status.code == 429 || status.code >= 500 => {
            Reply::Overloaded
        }
        Err(kube::Error::Api(_)) => Reply::Answered,
        Err(_) => Reply::Overloaded,
    }
}

/// The window once a create let in (or past it, after `MAX_WAIT`) ended at `now` with `reply`.
pub fn answered(window: Window, now: Instant, reply: Reply) -> Window {
    debug_assert!(window.in_flight > 0, "an answer for a create not in flight");
    let in_flight = window.in_flight.saturating_sub(1);
    let open = match reply {
        // The window was in use: widen it. One barely used says nothing about the server.
        Reply::Answered if 2 * window.in_flight >= window.open => (window.open + 1).min(LIMIT),
        Reply::Answered | Reply::NotSent => window.open,
        Reply::Overloaded => (window.open / 2).max(FIRST),
    };
    Window {
        open,
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

/// A create in flight, until `answered` (or dropped: given up before it went out).
#[must_use = "the create is in the window only while this is held"]
pub struct InWindow<'a> {
    slow_start: &'a SlowStart,
    reply: Reply,
}

impl InWindow<'_> {
    /// The create ended with `reply`: its place is free, and the window changes by it.
    pub fn answered(mut self, reply: Reply) {
        self.reply = reply;
    }
}

impl Drop for InWindow<'_> {
    fn drop(&mut self) {
        let reply = self.reply;
        self.slow_start
            .0
            .send_modify(|window| *window = answered(*window, Instant::now(), reply));
    }
}

impl SlowStart {
    /// Waits for room in the window, `MAX_WAIT` at most, and counts the create in flight until
    /// the returned guard is dropped.
    pub async fn enter(&self) -> InWindow<'_> {
        let deadline = Instant::now() + MAX_WAIT;
        let mut changed = self.0.subscribe();
        loop {
            let mut let_in = false;
            // Letting one in frees no room: nobody else is woken for it.
            self.0.send_if_modified(|window| {
                if let Some(admitted) = admit(*window, Instant::now()) {
                    *window = admitted;
                    let_in = true;
                }
                false
            });
            if let_in {
                return self.in_window();
            }
            // Subscribed before the try: an answer since then is seen here.
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                // Waited long enough (or, impossibly, the window is gone): in past the window.
                Ok(Err(_)) | Err(_) => {
                    self.0.send_if_modified(|window| {
                        window.in_flight += 1;
                        false
                    });
                    return self.in_window();
                }
            }
        }
    }

    fn in_window(&self) -> InWindow<'_> {
        InWindow {
            slow_start: self,
            reply: Reply::NotSent,
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
        window = answered(window, now, Reply::Answered);
        assert_eq!((window.open, window.in_flight), (3, 1));
        window = admit(window, now).unwrap();
        window = admit(window, now).unwrap();
        assert_eq!(admit(window, now), None);
        // Answers while others fly do not count as idle.
        assert_eq!(window.idle_since, start);
    }

    /// Admits creates until the window is full.
    fn fill(mut window: Window, now: Instant) -> Window {
        while let Some(admitted) = admit(window, now) {
            window = admitted;
        }
        window
    }

    #[test]
    fn while_creates_wait_the_window_doubles_each_round_trip_up_to_its_limit() {
        let now = Instant::now();
        let mut window = fill(Window::new(now), now);
        for round in 0..5 {
            // The round's creates are answered one by one; each answer lets waiting ones in.
            for _ in 0..window.open {
                window = fill(answered(window, now, Reply::Answered), now);
            }
            assert_eq!(window.open, FIRST << (round + 1));
            assert_eq!(window.in_flight, window.open);
        }
        window.open = LIMIT;
        window.in_flight = LIMIT;
        assert_eq!(answered(window, now, Reply::Answered).open, LIMIT);
    }

    #[test]
    fn creates_that_trickle_in_one_at_a_time_keep_the_window_small() {
        let mut now = Instant::now();
        let mut window = Window::new(now);
        for _ in 0..1000 {
            // Two a second, each answered before the next: never an idle second.
            window = admit(window, now).unwrap();
            now += Duration::from_millis(10);
            window = answered(window, now, Reply::Answered);
            now += Duration::from_millis(490);
        }
        assert_eq!(window.open, FIRST + 1, "{window:?}");
        // A wave now starts with three at once, not with hundreds.
        assert_eq!(fill(window, now).in_flight, FIRST + 1);
    }

    #[test]
    fn an_overloaded_server_halves_the_window_and_a_create_not_sent_changes_nothing() {
        let now = Instant::now();
        let mut window = Window::new(now);
        window.open = 40;
        window = fill(window, now);
        let halved = answered(window, now, Reply::Overloaded);
        assert_eq!((halved.open, halved.in_flight), (20, 39));
        let not_sent = answered(window, now, Reply::NotSent);
        assert_eq!((not_sent.open, not_sent.in_flight), (40, 39));
        // Never below where a wave starts.
        let mut small = fill(Window::new(now), now);
        small = answered(small, now, Reply::Overloaded);
        assert_eq!((small.open, small.in_flight), (FIRST, 1));
    }

    #[test]
    fn an_idle_second_starts_the_next_wave_small() {
        let start = Instant::now();
        let mut window = Window::new(start);
        window.open = 32;
        window.in_flight = 16;
        let last_answer = start + Duration::from_millis(5);
        for _ in 0..16 {
            window = answered(window, last_answer, Reply::Answered);
        }
        assert_eq!((window.in_flight, window.idle_since), (0, last_answer));
        // Within a second of the last answer the window stays as wide...
        let soon = admit(window, last_answer + IDLE - Duration::from_millis(1)).unwrap();
        assert_eq!(soon.open, 33);
        // ...after it, the wave starts again at two...
        let later = admit(window, last_answer + IDLE).unwrap();
        assert_eq!((later.open, later.in_flight), (FIRST, 1));
        // ...but not while a create is still in flight, however long ago the last answer was.
        let flying = admit(soon, last_answer + 10 * IDLE).unwrap();
        assert_eq!((flying.open, flying.in_flight), (33, 2));
    }

    #[test]
    fn only_throttling_server_errors_and_no_answer_count_as_overloaded() {
        let api = |code: u16, reason: &str| -> Result<(), kube::Error> {
            Err(kube::Error::Api(
                serde_json::from_value(serde_json::json!({
                    "status": "Failure", "code": code, "reason": reason, "message": reason,
                }))
                .unwrap(),
            ))
        };
        assert_eq!(reply(&Ok::<(), kube::Error>(())), Reply::Answered);
        for (code, reason) in [(409, "AlreadyExists"), (403, "Forbidden"), (422, "Invalid")] {
            assert_eq!(reply(&api(code, reason)), Reply::Answered, "{code}");
        }
        for (code, reason) in [
            (429, "TooManyRequests"),
            (500, "InternalError"),
            (504, "Timeout"),
        ] {
            assert_eq!(reply(&api(code, reason)), Reply::Overloaded, "{code}");
        }
        let refused: tower::BoxError =
            Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(
            reply(&Err::<(), _>(kube::Error::Service(refused))),
            Reply::Overloaded
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_create_goes_when_one_is_answered_or_after_the_longest_wait() {
        let slow = SlowStart::default();
        let started = Instant::now();
        let first = slow.enter().await;
        let second = slow.enter().await;
        assert_eq!(started.elapsed(), Duration::ZERO);
        // The third is let in as soon as the first is answered.
        let third = async {
            let in_window = slow.enter().await;
            let waited = started.elapsed();
            in_window.answered(Reply::Answered);
            waited
        };
        let answer = async {
            tokio::time::sleep(Duration::from_millis(7)).await;
            first.answered(Reply::Answered);
        };
        let (waited, ()) = tokio::join!(third, answer);
        assert_eq!(waited, Duration::from_millis(7));
        assert_eq!(
            slow.window(),
            Window {
                open: FIRST + 2,
                in_flight: 1,
                idle_since: started
            },
            "two answers with the window in use: the first and the third"
        );
        // With the window full and nothing answered, a create waits `MAX_WAIT`, then goes.
        let (_a, _b, _c) = (slow.enter().await, slow.enter().await, slow.enter().await);
        let full = Instant::now();
        let past = slow.enter().await;
        assert_eq!(full.elapsed(), MAX_WAIT);
        assert_eq!(slow.window().in_flight, 5);
        // A create given up while it waits takes no place; one given up once in frees its own.
        let gave_up = tokio::time::timeout(MAX_WAIT / 2, slow.enter()).await;
        assert!(gave_up.is_err());
        assert_eq!(slow.window().in_flight, 5);
        drop((past, second));
        assert_eq!(slow.window().in_flight, 3);
        assert_eq!(slow.window().open, FIRST + 2, "given up: no wider");
    }
}
