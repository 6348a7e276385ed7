//! Whether the At cache is caught up with the API server (a pod is created from it only then),
//! judged by a pure function of where the follower is, when its watch last spoke, and the time.
//! See docs/src/design/decisions.md, "Freshness".

use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// A watch that said nothing (not even a bookmark) for this long is not trusted, and is
/// started again (docs/src/design/decisions.md, "Freshness").
pub const SILENCE: Duration = Duration::from_secs(75);

/// Where the follower is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Following {
    /// Listing, or about to: what the store holds may be any age.
    Listing,
    /// No watch open: lists done and the watch not yet started, or a watch ended, failed or
    /// silent and not yet started again.
    Connecting,
    /// A watch is open: the store is what the API server holds, as of the last thing the watch
    /// said.
    Watching,
}

/// What the follower last said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heard {
    pub following: Following,
    /// When the watch last opened or said something (an event, a bookmark).
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
    /// The follower is now `following`, and heard from its watch if `heard`. Subscribers are woken
    /// only when that may change whether the cache is caught up, not for each event of a watch.
    pub fn set(&self, following: Following, heard: bool) {
        let now = Instant::now();
        self.heard.send_if_modified(|last| {
            let changed = last.following != following || (heard && !caught_up(*last, now));
            last.following = following;
            if heard {
                last.at = now;
            }
            changed
        });
    }

    /// The watch said something (an event or a bookmark) while `following`.
    #[cfg(test)]
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

    /// A receiver that says when the follower says something (a change of where it is, an
    /// event, a bookmark).
    pub fn subscribe(&self) -> watch::Receiver<Heard> {
        self.heard.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_open_watch_heard_from_within_the_bound_is_caught_up() {
        let start = Instant::now();
        let heard = |following| Heard {
            following,
            at: start,
        };
        for following in [Following::Listing, Following::Connecting] {
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
    async fn the_follower_s_words_make_it_caught_up_and_silence_makes_it_behind() {
        let freshness = Freshness::default();
        assert!(!freshness.is_caught_up(), "a new cache lists first");
        let mut words = freshness.subscribe();
        freshness.set(Following::Connecting, false);
        assert!(words.has_changed().unwrap());
        assert!(!freshness.is_caught_up(), "no watch open");
        words.borrow_and_update();
        freshness.heard(Following::Watching);
        assert!(words.has_changed().unwrap(), "waiters hear of it");
        assert!(freshness.is_caught_up());
        words.borrow_and_update();
        freshness.set(Following::Watching, false);
        assert!(!words.has_changed().unwrap(), "nothing new: no wakeup");
        tokio::time::sleep(SILENCE / 2).await;
        freshness.heard(Following::Watching);
        assert!(
            !words.has_changed().unwrap(),
            "an event of a watch already caught up: no wakeup"
        );
        assert_eq!(freshness.last().at, Instant::now(), "but its time is kept");

        // Silent past the bound: behind, until the watch says something again.
        tokio::time::sleep(SILENCE + Duration::from_secs(1)).await;
        assert!(!freshness.is_caught_up());
        words.borrow_and_update();
        freshness.heard(Following::Watching);
        assert!(
            words.has_changed().unwrap(),
            "caught up again: waiters hear of it"
        );
        assert!(freshness.is_caught_up());
    }
}
