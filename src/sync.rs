//! The one way a shared `Mutex` is locked.

use std::sync::{Mutex, MutexGuard};

/// Locks `mutex`; one whose holder panicked is still used, so one failed task does not stop every
/// other that shares it: every holder in cnat changes the
/// state by single whole operations (an insert, a remove, a counter), so a panic leaves it whole.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
