//! An unbounded queue whose receiving end is taken once, by the task that empties it: the
//! status writer's jobs and the Ats to reconcile again (`Controller::reconcile_on`).

use crate::sync::lock;
use tokio::sync::mpsc;

/// A queue's sending and receiving ends, as the reconciler holds them.
pub struct Queue<T> {
    sender: mpsc::UnboundedSender<T>,
    receiver: std::sync::Mutex<Option<mpsc::UnboundedReceiver<T>>>,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        Queue {
            sender,
            receiver: std::sync::Mutex::new(Some(receiver)),
        }
    }
}

impl<T> Queue<T> {
    /// Queues `item`; `false` once the receiving end was dropped (the loop is ending).
    pub fn send(&self, item: T) -> bool {
        self.sender.send(item).is_ok()
    }

    /// The receiving end as a stream; `None` once taken.
    pub fn take(&self) -> Option<impl futures::Stream<Item = T> + use<T>> {
        let mut rx = lock(&self.receiver).take()?;
        Some(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)))
    }
}
