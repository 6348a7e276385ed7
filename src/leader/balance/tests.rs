use super::*;

const LEASE: Duration = Duration::from_secs(15);

fn standing(leading: usize, shards: usize, view: View) -> Standing {
    Standing {
        leading,
        shards,
        view,
        rescued: false,
    }
}

/// A look at the Leases sent now, saying `view`.
fn look(balance: &Balance, view: View) {
    balance.set_view(view, tokio::time::Instant::now());
}

fn view(replicas: usize, fewest_of_others: Option<usize>, free: usize) -> View {
    View {
        replicas,
        fewest_of_others,
        first_to_give: true,
        free,
        another_layout_leads: false,
        outranked: false,
    }
}

#[test]
fn the_share_is_the_shards_over_the_replicas_rounded_up() {
    for (shards, replicas, share) in [
        (1, 1, 1),
        (4, 1, 4),
        (4, 2, 2),
        (4, 3, 2),
        (6, 3, 2),
        (7, 3, 3),
        (3, 5, 1),
        (4, 0, 4),
    ] {
        let s = standing(0, shards, view(replicas, None, 0));
        assert_eq!(s.share(), share, "{shards}/{replicas}");
    }
}

#[test]
fn a_replica_under_its_share_takes_at_once_one_at_it_only_a_long_free_shard() {
    let under = standing(1, 6, view(3, Some(2), 1));
    assert!(under.may_take(Duration::ZERO, LEASE));
    let at = standing(2, 6, view(3, Some(1), 1));
    assert!(!at.may_take(Duration::ZERO, LEASE));
    assert!(!at.may_take(LEASE - Duration::from_millis(1), LEASE));
    assert!(at.may_take(LEASE, LEASE));
}

#[test]
fn nothing_is_given_up_while_a_shard_is_free_or_after_a_rescue() {
    // Over its share (a replica counted that leads nothing), but a shard is free.
    let over = standing(3, 6, view(3, Some(0), 1));
    assert!(!over.gives_one_up());
    let settled = standing(3, 6, view(3, Some(0), 0));
    assert!(settled.gives_one_up());
    let rescued = Standing {
        rescued: true,
        ..settled
    };
    assert!(!rescued.gives_one_up());
}

#[test]
fn two_more_than_the_fewest_is_uneven_even_within_the_share() {
    // 4 shards on 3 replicas: 2, 2, 0 is within everyone's share (2) but leaves one idle; the
    // first of the two leading most gives one up, not both.
    assert!(standing(2, 4, view(3, Some(0), 0)).gives_one_up());
    let second = View {
        first_to_give: false,
        ..view(3, Some(0), 0)
    };
    assert!(!standing(2, 4, second).gives_one_up());
    assert!(!standing(2, 4, view(3, Some(1), 0)).gives_one_up());
    assert!(!standing(1, 4, view(3, Some(1), 0)).gives_one_up());
}

#[test]
fn another_layout_leading_means_taking_nothing_and_if_it_outranks_giving_everything_up() {
    let leads = View {
        another_layout_leads: true,
        ..view(2, Some(1), 3)
    };
    assert!(!standing(0, 6, leads).may_take(LEASE * 10, LEASE));
    // Outranked by nothing: keeps what it leads (the other layout gives way).
    assert!(!standing(1, 6, leads).gives_one_up());
    let outranked = View {
        outranked: true,
        ..leads
    };
    assert!(standing(1, 6, outranked).gives_one_up());
    assert!(!standing(0, 6, outranked).gives_one_up());
    let rescued = Standing {
        rescued: true,
        ..standing(1, 6, outranked)
    };
    assert!(
        rescued.gives_one_up(),
        "a rescue does not hold out against a layout that outranks"
    );
}

/// A small deterministic generator (xorshift), so that every run checks the same orders.
struct Orders(u64);

impl Orders {
    fn next(&mut self, below: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % below as u64) as usize
    }
}

/// The view replica `me` has when `leading` is what each leads and `shards` are split.
fn true_view(me: usize, leading: &[usize], shards: usize) -> View {
    let fewest = (0..leading.len())
        .filter(|r| *r != me)
        .map(|r| leading[r])
        .min();
    let most = leading.iter().max().copied().unwrap_or_default();
    View {
        // The first of those leading most gives up for evenness.
        first_to_give: leading.iter().position(|n| *n == most) == Some(me),
        ..view(
            leading.len(),
            fewest,
            shards - leading.iter().sum::<usize>(),
        )
    }
}

/// Replicas that follow the rules, each knowing the true counts and acting in any order (one
/// election at a time: a take reserves its place), end with every shard led, shares that
/// differ by at most one, and nothing left to do; whatever replica held every shard first.
#[test]
fn replicas_following_the_rules_settle_on_shares_that_differ_by_at_most_one() {
    let mut orders = Orders(0x9e37_79b9_7f4a_7c15);
    for shards in 1..=12 {
        for replicas in 1..=5 {
            for start in 0..replicas + 1 {
                // Worst starts: one replica holds every shard, or no shard is led at all.
                let mut leading = vec![0; replicas];
                if start < replicas {
                    leading[start] = shards;
                }
                for _step in 0..(shards * replicas * 40) {
                    let r = orders.next(replicas);
                    let s = standing(leading[r], shards, true_view(r, &leading, shards));
                    if s.gives_one_up() {
                        leading[r] -= 1;
                    } else if s.view.free > 0 && s.may_take(Duration::ZERO, LEASE) {
                        leading[r] += 1;
                    }
                }
                let case =
                    format!("{shards} shards, {replicas} replicas, start {start}: {leading:?}");
                assert_eq!(leading.iter().sum::<usize>(), shards, "{case}");
                let (min, max) = (leading.iter().min().unwrap(), leading.iter().max().unwrap());
                assert!(max - min <= 1, "{case}");
                for r in 0..replicas {
                    let s = standing(leading[r], shards, true_view(r, &leading, shards));
                    assert!(!s.gives_one_up(), "{case}: {r} would give one up");
                }
            }
        }
    }
}

#[tokio::test]
async fn one_shard_is_given_up_at_a_time_and_only_over_the_share() {
    let leadership = Arc::new(Leadership::default());
    let balance = Arc::new(Balance::new(4, leadership.clone(), LEASE));
    for lease in ["a", "b", "c"] {
        leadership.set_leading(lease, true);
    }
    // Alone: its share is every shard.
    assert!(balance.try_yield().is_none());
    look(&balance, view(2, Some(1), 0));
    let first = balance.try_yield().expect("over its share of 2");
    assert!(
        balance.try_yield().is_none(),
        "a second while the first goes"
    );
    leadership.set_leading("c", false);
    drop(first);
    assert!(balance.try_yield().is_none(), "at its share");
}

#[tokio::test]
async fn places_are_reserved_so_concurrent_takes_keep_to_the_share() {
    let leadership = Arc::new(Leadership::default());
    let balance = Arc::new(Balance::new(6, leadership.clone(), LEASE));
    look(&balance, view(3, Some(0), 6));
    // Six elections see their shard free at once: two may take (the share).
    let reserved: Vec<Reservation> = (0..6)
        .filter_map(|_| balance.try_reserve(Duration::ZERO, false))
        .collect();
    assert_eq!(reserved.len(), 2);
    // One take failed (its place freed), the other led.
    drop(reserved);
    leadership.set_leading("x", true);
    assert!(balance.try_reserve(Duration::ZERO, false).is_some());
    let second = balance.try_reserve(Duration::ZERO, false);
    assert!(second.is_some());
    assert!(balance.try_reserve(Duration::ZERO, false).is_none());
    // A shard free for a lease duration is taken anyway, and kept for a while once led (not
    // when the take fails).
    let rescue = balance.try_reserve(LEASE, false);
    assert!(rescue.is_some());
    drop(rescue);
    assert!(!balance.standing().rescued);
    let rescue = balance.try_reserve(LEASE, false).unwrap();
    leadership.set_leading("y", true);
    rescue.led();
    assert!(balance.standing().rescued);
    // A shard given up is taken again only as a rescue.
    drop(second);
    leadership.set_leading("y", false);
    assert!(balance.try_reserve(Duration::ZERO, true).is_none());
    assert!(balance.try_reserve(LEASE, true).is_some());
}

#[tokio::test(start_paused = true)]
async fn the_next_shard_is_given_up_only_after_a_look_sent_after_the_last() {
    let leadership = Arc::new(Leadership::default());
    let balance = Arc::new(Balance::new(4, leadership.clone(), LEASE));
    for lease in ["a", "b", "c", "d"] {
        leadership.set_leading(lease, true);
    }
    look(&balance, view(2, Some(0), 0));
    let first = balance.try_yield().expect("4 > 2");
    let sent_before = tokio::time::Instant::now();
    tokio::time::advance(Duration::from_millis(10)).await;
    leadership.set_leading("d", false);
    drop(first);
    // The view still says the other leads none (it took the shard since): wait for a new one;
    // a look sent before the shard was let go, answered after, is no newer.
    assert!(balance.try_yield().is_none());
    balance.set_view(view(2, Some(0), 0), sent_before);
    assert!(balance.try_yield().is_none());
    tokio::time::advance(Duration::from_millis(10)).await;
    look(&balance, view(2, Some(1), 0));
    let second = balance.try_yield().expect("3 > 2");
    leadership.set_leading("c", false);
    drop(second);
    tokio::time::advance(Duration::from_millis(10)).await;
    look(&balance, view(2, Some(2), 0));
    assert!(balance.try_yield().is_none(), "at its share");
}

#[tokio::test]
async fn replicas_count_once_two_looks_agree() {
    let balance = Balance::new(4, Arc::new(Leadership::default()), LEASE);
    let counted = balance.counted();
    tokio::pin!(counted);
    look(&balance, view(1, None, 4));
    assert!(futures::poll!(&mut counted).is_pending());
    look(&balance, view(3, Some(0), 4));
    assert!(
        futures::poll!(&mut counted).is_pending(),
        "two replicas appeared"
    );
    look(&balance, view(3, Some(0), 4));
    assert!(futures::poll!(&mut counted).is_ready());
}

#[tokio::test(start_paused = true)]
async fn time_another_layout_led_does_not_count_as_free() {
    let leadership = Arc::new(Leadership::default());
    let balance = Arc::new(Balance::new(2, leadership.clone(), LEASE));
    look(
        &balance,
        View {
            another_layout_leads: true,
            ..view(2, Some(0), 2)
        },
    );
    tokio::time::advance(LEASE * 2).await;
    look(&balance, view(2, Some(0), 2));
    // Free (missing) for two lease durations, but another layout led until now: only the share.
    let first = balance.try_reserve(LEASE * 2, false);
    assert!(first.is_some());
    assert!(balance.try_reserve(LEASE * 2, false).is_none());
    tokio::time::advance(LEASE).await;
    assert!(
        balance.try_reserve(LEASE * 2, false).is_some(),
        "free for a lease duration since"
    );
}
