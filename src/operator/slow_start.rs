//! Slow start for pod creates: a wave's first creates go out `FIRST` at a time, the window widens
//! while in use; the decisions (`admit`, `answered`, `reply`) are pure, `SlowStart` holds it.
//! See docs/src/design/decisions.md, "Slow start for pod creates".

use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Creates let out at once when a wave starts.
pub const FIRST: usize = 2;
/// The longest a create waits for the window.
pub const MAX_WAIT: Duration = Duration::from_millis(50);
/// The window grows no further: the reconciles' limit (`--concurrency`) binds long before,
/// unless it is 0 (none).
const LIMIT: usize = 4096;

/// The window, and the creates in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Window {
    /// How many creates may be in flight.
    pub open: usize,
    /// How many are.
    pub in_flight: usize,
    /// How often the window was halved: only the answers of creates sent since the last cut
    /// widen it or cut it again.
    pub cuts: u64,
    /// Creates let in since the window was made (in it, or past it after `MAX_WAIT`).
    pub entered: u64,
}

impl Window {
    /// A window of `FIRST`, empty.
    pub fn new() -> Self {
        Window {
            open: FIRST,
            ..Window::default()
        }
    }
}

/// The window once a create is let in; `None` while it is full.
pub fn admit(window: Window) -> Option<Window> {
    (window.in_flight < window.open).then_some(Window {
        in_flight: window.in_flight + 1,
        entered: window.entered + 1,
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
    /// No answer to count: the request could not be made, or the reconcile ended before its
    /// answer.
    NotSent,
}

/// What `result`, the result of a create, says of the server.
pub fn reply<T>(result: &Result<T, kube::Error>) -> Reply {
    match result {
        Ok(_) => Reply::Answered,
        Err(kube::Error::Api(status)) if status.code == 429 || status.code >= 500 => {
            Reply::Overloaded
        }
        // An answer, if one cnat could not read.
        Err(kube::Error::Api(_) | kube::Error::SerdeError(_)) => Reply::Answered,
        // No answer.
        Err(error) if crate::operator::reachability::unanswered(error) => Reply::Overloaded,
        // Not sent (credentials, the request's own form): says nothing of the server.
        Err(_) => Reply::NotSent,
    }
}

/// The window once a create let in (or past it, after `MAX_WAIT`) when the window had been cut
/// `sent_at` times ended with `reply`.
pub fn answered(window: Window, reply: Reply, sent_at: u64) -> Window {
    debug_assert!(window.in_flight > 0, "an answer for a create not in flight");
    let in_use = 2 * window.in_flight >= window.open;
    let since_cut = sent_at == window.cuts;
    let mut after = Window {
        in_flight: window.in_flight.saturating_sub(1),
        ..window
    };
    match reply {
        Reply::Answered if in_use && since_cut => after.open = (window.open + 1).min(LIMIT),
        // Half the creates in flight (RFC 5681's FlightSize / 2), once for that moment; those
        // past the window after `MAX_WAIT` do not make it wider.
        Reply::Overloaded if since_cut => {
            after.open = (window.in_flight.min(window.open) / 2).max(FIRST);
            after.cuts += 1;
        }
        Reply::Answered | Reply::Overloaded | Reply::NotSent => {}
    }
    if !in_use {
        // Not in use: no wider than twice the creates that were in flight.
        after.open = after.open.min((2 * window.in_flight).max(FIRST));
    }
    after
}

/// The window pod creates share (one per leader).
pub struct SlowStart(watch::Sender<Window>);

impl Default for SlowStart {
    fn default() -> Self {
        SlowStart(watch::Sender::new(Window::new()))
    }
}

/// A create in flight, until `answered` (or dropped: given up before it went out).
#[must_use = "the create is in the window only while this is held"]
pub struct InWindow<'a> {
    slow_start: &'a SlowStart,
    reply: Reply,
    /// The window's cuts when this create entered.
    sent_at: u64,
}

impl InWindow<'_> {
    /// The create ended with `reply`: its place is free, and the window changes by it.
    pub fn answered(mut self, reply: Reply) {
        self.reply = reply;
    }
}

impl Drop for InWindow<'_> {
    fn drop(&mut self) {
        let (reply, sent_at) = (self.reply, self.sent_at);
        self.slow_start
            .0
            .send_modify(|window| *window = answered(*window, reply, sent_at));
    }
}

impl SlowStart {
    /// Waits for room in the window, `MAX_WAIT` at most, and counts the create in flight until
    /// the returned guard is dropped.
    pub async fn enter(&self) -> InWindow<'_> {
        let deadline = Instant::now() + MAX_WAIT;
        let mut changed = self.0.subscribe();
        loop {
            let mut let_in = None;
            // Letting one in frees no room: nobody else is woken for it.
            self.0.send_if_modified(|window| {
                if let Some(admitted) = admit(*window) {
                    *window = admitted;
                    let_in = Some(window.cuts);
                }
                false
            });
            if let Some(sent_at) = let_in {
                return self.in_window(sent_at);
            }
            // Subscribed before the try: an answer since then is seen here.
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                // Waited long enough (or, impossibly, the window is gone): in past the window.
                Ok(Err(_)) | Err(_) => {
                    let mut sent_at = 0;
                    self.0.send_if_modified(|window| {
                        window.in_flight += 1;
                        window.entered += 1;
                        sent_at = window.cuts;
                        false
                    });
                    return self.in_window(sent_at);
                }
            }
        }
    }

    fn in_window(&self, sent_at: u64) -> InWindow<'_> {
        InWindow {
            slow_start: self,
            reply: Reply::NotSent,
            sent_at,
        }
    }

    /// The window now.
    #[cfg(test)]
    pub fn window(&self) -> Window {
        *self.0.borrow()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The window once a create sent since its last cut ended with `reply`.
    fn answer(window: Window, reply: Reply) -> Window {
        answered(window, reply, window.cuts)
    }

    #[test]
    fn a_wave_starts_with_two_and_each_answer_lets_one_more_out() {
        let mut window = admit(admit(Window::new()).unwrap()).unwrap();
        assert_eq!(admit(window), None, "a third waits");
        window = answer(window, Reply::Answered);
        assert_eq!((window.open, window.in_flight), (3, 1));
        window = admit(admit(window).unwrap()).unwrap();
        assert_eq!(admit(window), None);
    }

    /// Admits creates until the window is full.
    fn fill(mut window: Window) -> Window {
        while let Some(admitted) = admit(window) {
            window = admitted;
        }
        window
    }

    /// The window after a burst: creates answered one by one, each answer letting waiting ones
    /// in, for `rounds` round trips.
    fn burst(mut window: Window, rounds: usize) -> Window {
        window = fill(window);
        for _ in 0..rounds {
            for _ in 0..window.open {
                window = fill(answer(window, Reply::Answered));
            }
        }
        window
    }

    #[test]
    fn while_creates_wait_the_window_doubles_each_round_trip_up_to_its_limit() {
        let mut window = fill(Window::new());
        for round in 0..5 {
            window = burst(window, 1);
            assert_eq!(window.open, FIRST << (round + 1));
            assert_eq!(window.in_flight, window.open);
        }
        window.open = LIMIT;
        window.in_flight = LIMIT;
        assert_eq!(answer(window, Reply::Answered).open, LIMIT);
    }

    #[test]
    fn a_wave_s_end_and_creates_that_trickle_in_leave_the_window_small() {
        let mut window = burst(Window::new(), 5);
        assert_eq!(window.open, 64);
        // The wave ends: nothing waits, each answer narrows the window.
        while window.in_flight > 0 {
            window = answer(window, Reply::Answered);
        }
        assert_eq!(window.open, FIRST, "{window:?}");
        // Creates one at a time, each answered before the next.
        for _ in 0..1000 {
            window = answer(admit(window).unwrap(), Reply::Answered);
            assert!(window.open <= FIRST + 1, "{window:?}");
        }
        // The next wave starts with at most three at once, not with dozens.
        assert!(fill(window).in_flight <= FIRST + 1);
        // A create that hangs through a trickle keeps it small too.
        window = admit(window).unwrap();
        for _ in 0..1000 {
            window = answer(admit(window).unwrap(), Reply::Answered);
        }
        assert!(
            window.open <= 2 * 2 + 1,
            "twice the two in flight, and one: {window:?}"
        );
    }

    #[test]
    fn in_a_long_wave_the_concurrency_limit_holds_the_creates_and_the_window_never_does() {
        // 32 reconciles at most, so at most 32 creates in flight: once the wave's first round
        // trips widened the window, it settles at about twice that and lets every reconcile's
        // create in, however long the wave lasts.
        let mut window = Window::new();
        let mut held_after_start = 0;
        for step in 0..10_000 {
            while window.in_flight < 32 {
                match admit(window) {
                    Some(admitted) => window = admitted,
                    None => {
                        held_after_start += usize::from(step >= 100);
                        break;
                    }
                }
            }
            window = answer(window, Reply::Answered);
            // Now and then fewer reconciles are at their create.
            if step % 7 == 0 {
                window = answer(window, Reply::Answered);
            }
        }
        assert_eq!(held_after_start, 0);
        assert!((60..=66).contains(&window.open), "{window:?}");
    }

    #[test]
    fn an_overloaded_server_cuts_the_window_to_half_the_creates_in_flight_once_per_moment() {
        let mut window = Window::new();
        window.open = 40;
        window = fill(window);
        let sent_before = window.cuts;
        window = answer(window, Reply::Overloaded);
        assert_eq!((window.open, window.in_flight, window.cuts), (20, 39, 1));
        // The others sent before the cut tell of the same moment: no second cut...
        for _ in 0..19 {
            window = answered(window, Reply::Overloaded, sent_before);
        }
        assert_eq!((window.open, window.in_flight), (20, 20));
        // ...and their quick answers widen nothing.
        for _ in 0..10 {
            window = answered(window, Reply::Answered, sent_before);
        }
        assert_eq!((window.open, window.in_flight), (20, 10));
        // A create sent since the cut and refused as well cuts again: to half of 11.
        window = answer(admit(window).unwrap(), Reply::Overloaded);
        assert_eq!((window.open, window.in_flight, window.cuts), (5, 10, 2));
        // A create given up changes nothing but its place.
        let given_up = answer(window, Reply::NotSent);
        assert_eq!((given_up.open, given_up.in_flight), (5, 9));
        // Creates past the window (after `MAX_WAIT`) do not make a cut wider than the window.
        let past = Window {
            open: 8,
            in_flight: 20,
            ..Window::new()
        };
        assert_eq!(answer(past, Reply::Overloaded).open, 4);
        // Never below where a wave starts.
        let small = answer(fill(Window::new()), Reply::Overloaded);
        assert_eq!((small.open, small.in_flight), (FIRST, 1));
    }

    #[test]
    fn a_wave_that_ends_in_overloaded_answers_leaves_the_window_small() {
        let mut window = burst(Window::new(), 5);
        assert_eq!((window.open, window.in_flight), (64, 64));
        let sent_at = window.cuts;
        while window.in_flight > 0 {
            window = answered(window, Reply::Overloaded, sent_at);
        }
        assert_eq!(window.open, FIRST, "{window:?}");
        // So does one whose last creates were given up or answered before a cut.
        let mut window = burst(Window::new(), 5);
        while window.in_flight > 0 {
            window = answered(window, Reply::NotSent, window.cuts);
        }
        assert_eq!(window.open, FIRST, "{window:?}");
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
        let unreadable = serde_json::from_str::<u8>("x").unwrap_err();
        assert_eq!(
            reply(&Err::<(), _>(kube::Error::SerdeError(unreadable))),
            Reply::Answered
        );
        assert_eq!(
            reply(&Err::<(), _>(kube::Error::TlsRequired)),
            Reply::NotSent
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
            (slow.window().open, slow.window().in_flight),
            (FIRST + 2, 1),
            "two answers with the window in use: the first and the third"
        );
        // With the window full and nothing answered, a create waits `MAX_WAIT`, then goes.
        let (_a, _b, _c) = (slow.enter().await, slow.enter().await, slow.enter().await);
        let full = Instant::now();
        let past = slow.enter().await;
        assert_eq!(full.elapsed(), MAX_WAIT);
        assert_eq!((slow.window().in_flight, slow.window().entered), (5, 7));
        // A create given up while it waits takes no place; one given up once in frees its own.
        let gave_up = tokio::time::timeout(MAX_WAIT / 2, slow.enter()).await;
        assert!(gave_up.is_err());
        assert_eq!(slow.window().in_flight, 5);
        drop((past, second));
        assert_eq!(slow.window().in_flight, 3);
        assert_eq!(slow.window().open, FIRST + 2, "given up: no wider");
    }
}
