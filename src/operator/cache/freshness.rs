//! Whether the At cache is caught up with the API server: the follower says where it is
//! (listing, replaying what its lists held, following a live watch) and when it last heard
//! from its watch (an event or a bookmark); a pod is created from the cache only while it is
//! caught up (`reconcile::calls`). Judged by a pure function of that and the time.
//!
//! A cache is behind while it lists (at start, or again after its watch expired: the store
//! keeps what it held before until the list ends), while its watch replays what its lists held,
//! and while its watch has been silent for longer than `SILENCE`: the follower then starts it
//! again from the last version it saw (one request, served from the API server's watch cache),
//! and the cache is caught up again once the new watch is open. A watch that is stuck (a proxy
//! holding it, a half-open connection) is therefore noticed within `SILENCE`, not at the end of
//! its 290 s timeout.

use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// A watch that said nothing (not even a bookmark) for this long is not trusted, and is
/// started again. kube-apiserver sends a quiet watch a bookmark about every 60 s (measured on
/// v1.24: README, "Never twice").
pub const SILENCE: Duration = Duration::from_secs(75);

/// Where the follower is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Following {
    /// Listing, or about to: what the store holds may be any age.
    Listing,
    /// Lists done, the watch not yet past what they held (or not started).
    Replaying,
    /// A watch is live and past the lists: the store is what the API server holds, as of the
    /// last thing the watch said.
    Watching,
}

/// What the follower last said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heard {
    pub following: Following,
    /// When the watch last said something (an event, a bookmark, or its start).
    pub at: Instant,
}

/// Whether a cache the follower last described as `heard` is caught up at `now`. Pure.
pub fn caught_up(heard: Heard, now: Instant) -> bool {
    heard.following == Following::Watching && now.saturating_duration_since(heard.at) <= SILENCE
}

/// The follower's side and the readers' side of one cache's freshness (cloned: one state).
#[derive(Clone, Debug)]
pub struct Freshness {
    heard: watch::Sender<Heard>,
}

impl Default for Freshness {
    fn default() -> Self {
        let heard = Heard {
            following: Following::Listing,
            at: Instant::now(),
        };
        Freshness {
            heard: watch::Sender::new(heard),
        }
    }
}

impl Freshness {
    /// The follower is now `following`, and heard from its watch if `heard`.
    pub fn set(&self, following: Following, heard: bool) {
        self.heard.send_if_modified(|last| {
            let changed = last.following != following || heard;
            last.following = following;
            if heard {
                last.at = Instant::now();
            }
            changed
        });
    }

    /// The watch said something (an event or a bookmark) while `following`.
    pub fn heard(&self, following: Following) {
        self.set(following, true);
    }

    /// What the follower last said.
    pub fn last(&self) -> Heard {
        *self.heard.borrow()
    }

    /// Whether the cache is caught up now.
    pub fn is_caught_up(&self) -> bool {
        caught_up(self.last(), Instant::now())
    }

    /// Waits until the cache is caught up, for at most `within`: whether it is.
    pub async fn caught_up_within(&self, within: Duration) -> bool {
        let mut changes = self.heard.subscribe();
        let deadline = Instant::now() + within;
        loop {
            if caught_up(*changes.borrow_and_update(), Instant::now()) {
                return true;
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                // Past the deadline, or the follower is gone.
                Ok(Err(_)) | Err(_) => return caught_up(*changes.borrow(), Instant::now()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_live_watch_past_its_lists_heard_from_within_the_bound_is_caught_up() {
        let start = Instant::now();
        let heard = |following| Heard {
            following,
            at: start,
        };
        for following in [Following::Listing, Following::Replaying] {
            assert!(!caught_up(heard(following), start), "{following:?}");
        }
        let watching = heard(Following::Watching);
        assert!(caught_up(watching, start));
        assert!(caught_up(watching, start + SILENCE));
        assert!(!caught_up(
            watching,
            start + SILENCE + Duration::from_millis(1)
        ));
        // A clock that went back (no such Instant, but the function must not panic).
        assert!(caught_up(
            Heard {
                following: Following::Watching,
                at: start + SILENCE
            },
            start
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_when_the_watch_is_back_or_at_its_deadline() {
        let freshness = Freshness::default();
        assert!(!freshness.is_caught_up(), "a new cache lists first");
        assert!(!freshness.caught_up_within(Duration::from_secs(5)).await);

        let follower = freshness.clone();
        let back = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            follower.set(Following::Replaying, false);
            tokio::time::sleep(Duration::from_secs(1)).await;
            follower.heard(Following::Watching);
        });
        let waited = Instant::now();
        assert!(freshness.caught_up_within(Duration::from_secs(10)).await);
        assert_eq!(
            waited.elapsed(),
            Duration::from_secs(3),
            "as soon as it is back"
        );
        back.await.unwrap();

        // Silent past the bound: behind, until the watch says something again.
        tokio::time::sleep(SILENCE + Duration::from_secs(1)).await;
        assert!(!freshness.is_caught_up());
        let follower = freshness.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(4)).await;
            follower.heard(Following::Watching);
        });
        assert!(!freshness.caught_up_within(Duration::from_secs(3)).await);
        assert!(freshness.caught_up_within(Duration::from_secs(3)).await);
    }
}
