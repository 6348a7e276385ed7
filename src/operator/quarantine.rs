//! Panics in the reconcile loop: caught with the At being worked on, they end the loop (the
//! Lease is released) and quarantine that version of the At.
//! See docs/src/design/decisions.md, "No At can stop the operator".

use crate::operator::key::AtKey;
use crate::sync::lock;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};

/// Most quarantined At versions kept; past this the map starts afresh (a version that panics
/// again is caught again).
const MAX_QUARANTINED: usize = 1000;
/// How long a version stays quarantined: the panic may have come from something passing (its
/// pod, a bug on a path since left), and an At that never changes must get another chance.
pub const QUARANTINE: std::time::Duration = std::time::Duration::from_secs(600);

thread_local! {
    /// Whether this thread runs inside a catch, and what the panic said.
    static CATCHING: Cell<bool> = const { Cell::new(false) };
    static CAUGHT: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// A panic caught by `catch` or `Caught`: its message and where it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Panicked(pub String);

impl std::fmt::Display for Panicked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Routes panic messages into the log (one `ERROR` line each) instead of stderr; a caught one
/// is left to its catch, which logs it with the At it concerns.
pub fn install_hook() {
    std::panic::set_hook(Box::new(|info| {
        let mut message = describe(info);
        // Only with RUST_BACKTRACE set, as Rust's own hook.
        let backtrace = std::backtrace::Backtrace::capture();
        if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
            message = format!("{message}\n{backtrace}");
        }
        if CATCHING.get() {
            CAUGHT.set(Some(message));
        } else {
            tracing::error!(panic = %message, "panic");
        }
    }));
}

fn describe(info: &std::panic::PanicHookInfo<'_>) -> String {
    let text = message_of(info.payload());
    match info.location() {
        Some(at) => format!("{text} at {}:{}", at.file(), at.line()),
        None => text,
    }
}

/// Runs `f`, turning a panic into `Err`.
pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, Panicked> {
    // A panic caught by someone else's catch_unwind in an earlier run left its message here.
    CAUGHT.take();
    let was = CATCHING.replace(true);
    let result = catch_unwind(AssertUnwindSafe(f));
    CATCHING.set(was);
    result.map_err(|payload| Panicked(CAUGHT.take().unwrap_or_else(|| message_of(&*payload))))
}

/// What a panic's payload says.
fn message_of(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}

/// A future whose panics (in any poll) become `Err`.
pub struct Caught<F>(Pin<Box<F>>);

impl<F: Future> Caught<F> {
    pub fn new(future: F) -> Self {
        Caught(Box::pin(future))
    }
}

impl<F: Future> Future for Caught<F> {
    type Output = Result<F::Output, Panicked>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = &mut self.0;
        match catch(|| inner.as_mut().poll(cx)) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(panicked) => Poll::Ready(Err(panicked)),
        }
    }
}

/// At versions (`namespace/name` and resourceVersion) whose handling panicked: skipped until
/// they change, are deleted, or `QUARANTINE` passed. Shared by every leadership of this replica.
#[derive(Debug, Default)]
pub struct Quarantine(Mutex<HashMap<AtKey, (String, tokio::time::Instant)>>);

impl Quarantine {
    pub fn add(&self, at: AtKey, resource_version: String) {
        let mut map = lock(&self.0);
        if map.len() >= MAX_QUARANTINED {
            map.clear();
        }
        let until = tokio::time::Instant::now() + QUARANTINE;
        map.insert(at, (resource_version, until));
    }

    /// Whether this version of `at` is quarantined; a newer version, or time, ends it.
    pub fn holds(&self, at: &AtKey, resource_version: Option<&str>) -> bool {
        let mut map = lock(&self.0);
        match map.get(at) {
            None => false,
            Some((rv, until))
                if Some(rv.as_str()) == resource_version
                    && tokio::time::Instant::now() < *until =>
            {
                true
            }
            Some(_) => {
                map.remove(at);
                false
            }
        }
    }

    pub fn remove(&self, at: &AtKey) {
        lock(&self.0).remove(at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caught_panic_names_its_message_and_place() {
        install_hook();
        let caught = catch(|| -> u8 { panic!("boom {}", 7) }).unwrap_err();
        assert!(
            caught
                .0
                .starts_with("boom 7 at src/operator/quarantine.rs:"),
            "{caught}"
        );
        assert_eq!(catch(|| 5), Ok(5));
        // The flag is reset: a later panic outside a catch is not taken for a caught one.
        assert!(!CATCHING.get());
    }

    #[tokio::test]
    async fn a_future_that_panics_in_a_later_poll_is_caught() {
        install_hook();
        let result = Caught::new(async {
            tokio::task::yield_now().await;
            let big: i64 = i64::MAX;
            chrono::TimeDelta::seconds(big)
        })
        .await;
        assert!(result
            .unwrap_err()
            .0
            .contains("TimeDelta::seconds out of bounds"));
        assert_eq!(Caught::new(async { 1 }).await, Ok(1));
    }

    #[tokio::test(start_paused = true)]
    async fn quarantine_ends_after_its_time() {
        let quarantine = Quarantine::default();
        quarantine.add(AtKey::new("ns", "a"), "7".into());
        tokio::time::advance(QUARANTINE - std::time::Duration::from_secs(1)).await;
        assert!(quarantine.holds(&AtKey::new("ns", "a"), Some("7")));
        tokio::time::advance(std::time::Duration::from_secs(1)).await;
        assert!(!quarantine.holds(&AtKey::new("ns", "a"), Some("7")));
    }

    #[tokio::test]
    async fn quarantine_holds_one_version_until_it_changes() {
        let quarantine = Quarantine::default();
        quarantine.add(AtKey::new("ns", "a"), "7".into());
        assert!(quarantine.holds(&AtKey::new("ns", "a"), Some("7")));
        assert!(!quarantine.holds(&AtKey::new("ns", "b"), Some("7")));
        assert!(
            !quarantine.holds(&AtKey::new("ns", "a"), Some("8")),
            "a newer version runs"
        );
        assert!(
            !quarantine.holds(&AtKey::new("ns", "a"), Some("7")),
            "and the entry is gone"
        );
        quarantine.add(AtKey::new("ns", "a"), "9".into());
        quarantine.remove(&AtKey::new("ns", "a"));
        assert!(!quarantine.holds(&AtKey::new("ns", "a"), Some("9")));
    }
}
