//! After an API server outage, work resumes when the server answers again, not when each
//! waiter's backoff happens to end. See docs/src/design/decisions.md, "Recovery after an outage".

use crate::sync::lock;
use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;

/// How often an unreachable API server is asked again while something waits for it.
pub const PROBE_EVERY: Duration = Duration::from_millis(250);
/// How long one probe may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether `error` means the API server gave no answer (rather than answering no): the
/// connection failed, timed out, or broke off while the answer was read.
pub fn unanswered(error: &kube::Error) -> bool {
    matches!(
        error,
        kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::ReadEvents(_)
    )
}

/// What waits for the API server to answer again.
pub struct Reachability<T> {
    waiting: Mutex<HashSet<T>>,
    changed: Notify,
}

impl<T: Eq + Hash> Default for Reachability<T> {
    fn default() -> Self {
        Reachability {
            waiting: Mutex::default(),
            changed: Notify::new(),
        }
    }
}

impl<T: Eq + Hash> Reachability<T> {
    /// `item` waits for the next answer from the API server.
    pub fn wait(&self, item: T) {
        lock(&self.waiting).insert(item);
        self.changed.notify_one();
    }

    /// How many wait now.
    pub fn waiting(&self) -> usize {
        lock(&self.waiting).len()
    }

    fn take(&self) -> Vec<T> {
        let mut waiting = lock(&self.waiting);
        // Taken whole, not drained: after an outage the set would keep room for every At.
        std::mem::take(&mut *waiting).into_iter().collect()
    }

    /// Runs forever: while anything waits, calls `ask` every `every`; once `ask` returns true
    /// (the server answered), hands everything that waited to `release`.
    pub async fn probe<A, F>(&self, every: Duration, mut ask: A, mut release: impl FnMut(T))
    where
        A: FnMut() -> F,
        F: std::future::Future<Output = bool>,
    {
        loop {
            if self.waiting() == 0 {
                self.changed.notified().await;
                continue;
            }
            tokio::time::sleep(every).await;
            if ask().await {
                self.take().into_iter().for_each(&mut release);
            }
        }
    }
}

/// Asks `client` for the server's version: true on any answer, also an error status.
pub async fn answers(client: &kube::Client) -> bool {
    match tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version()).await {
        Ok(Ok(_)) => true,
        Ok(Err(error)) => !unanswered(&error),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn waiters_are_released_by_the_first_answer_and_not_before() {
        let reach = Arc::new(Reachability::<&str>::default());
        let up = Arc::new(AtomicBool::new(false));
        let asked = Arc::new(AtomicUsize::new(0));
        let (released, mut releases) = tokio::sync::mpsc::unbounded_channel();
        let probe = {
            let (reach, up, asked) = (reach.clone(), up.clone(), asked.clone());
            tokio::spawn(async move {
                reach
                    .probe(
                        PROBE_EVERY,
                        || {
                            asked.fetch_add(1, Ordering::SeqCst);
                            let up = up.load(Ordering::SeqCst);
                            async move { up }
                        },
                        |item| released.send(item).unwrap(),
                    )
                    .await
            })
        };
        // Nothing waits: nothing is asked.
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(asked.load(Ordering::SeqCst), 0);

        reach.wait("a");
        reach.wait("b");
        reach.wait("a");
        tokio::time::sleep(Duration::from_secs(10)).await;
        let probes = asked.load(Ordering::SeqCst);
        assert!((39..=41).contains(&probes), "{probes} probes in 10 s");
        assert!(releases.try_recv().is_err(), "released while unreachable");

        up.store(true, Ordering::SeqCst);
        let back = tokio::time::Instant::now();
        let mut got = vec![
            releases.recv().await.unwrap(),
            releases.recv().await.unwrap(),
        ];
        got.sort();
        assert_eq!(got, ["a", "b"]);
        assert!(back.elapsed() <= PROBE_EVERY);
        assert_eq!(reach.waiting(), 0);

        // Released once: with nothing waiting, the probing stops.
        let before = asked.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(asked.load(Ordering::SeqCst), before);
        assert!(releases.try_recv().is_err());
        probe.abort();
    }

    #[test]
    fn only_errors_without_an_answer_count_as_unreachable() {
        let refused: tower::BoxError =
            Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(unanswered(&kube::Error::Service(refused)));
        let answered = kube::Error::Api(
            serde_json::from_value(serde_json::json!({
                "status": "Failure", "code": 500, "reason": "InternalError",
                "message": "Internal error occurred: failed calling webhook \"validate.ats.cnat.programming-kubernetes.info\""
            }))
            .unwrap(),
        );
        assert!(!unanswered(&answered));
    }
}
