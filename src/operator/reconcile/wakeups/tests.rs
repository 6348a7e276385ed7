use super::*;
use crate::api::{AtStatus, Phase};
use crate::operator::key::AtKey;
use crate::operator::reconcile::decide::tests::at;

const NOW: &str = "2026-11-22T02:10:00Z";

fn now() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(NOW).unwrap().to_utc()
}

/// The At as its reconcile at `when` leaves it.
fn settled(mut at: At, when: DateTime<Utc>) -> At {
    let decided = decide(&at, &PodObservation::NotCached, when, &RunPolicy::default());
    at.status = decided.status.or(at.status);
    at
}

#[test]
fn only_ats_with_work_now_are_reconciled_at_once() {
    let policy = RunPolicy::default();
    let in_an_hour = "2026-11-22T03:10:00Z";
    // New: its PENDING status is to be written.
    assert_eq!(wake(&at(in_an_hour, None), now(), &policy), Wake::Now);
    // Settled by an earlier leader: nothing until it is due, to the millisecond.
    let pending = settled(at(in_an_hour, None), now() - chrono::Duration::minutes(5));
    assert_eq!(
        wake(&pending, now(), &policy),
        Wake::After(Duration::from_secs(3600))
    );
    // Due now, or overdue: its pod is created now.
    assert_eq!(
        wake(&pending, now() + chrono::Duration::hours(1), &policy),
        Wake::Now
    );
    assert_eq!(
        wake(&pending, now() + chrono::Duration::hours(5), &policy),
        Wake::Now
    );
    // A bad schedule, already reported: nothing until the At changes.
    let bad = settled(at("tomorrow noon", None), now());
    assert_eq!(bad.status.as_ref().unwrap().phase, Phase::Pending);
    assert_eq!(wake(&bad, now(), &policy), Wake::OnChange);
    // RUNNING: its pod is looked at now.
    let running = AtStatus {
        phase: Phase::Running,
        ..bad.status.clone().unwrap()
    };
    assert_eq!(
        wake(&at(in_an_hour, Some(running)), now(), &policy),
        Wake::Now
    );
}

#[test]
fn a_finished_at_waits_for_its_ttl_or_for_nothing() {
    let done = AtStatus {
        phase: Phase::Done,
        completion_time: Some(now()),
        ..AtStatus::default()
    };
    let finished = at("2026-11-22T02:00:00Z", Some(done));
    assert_eq!(
        wake(&finished, now(), &RunPolicy::default()),
        Wake::OnChange
    );
    let mut expiring = finished.clone();
    expiring.spec.ttl_seconds_after_finished = Some(60);
    assert_eq!(
        wake(&expiring, now(), &RunPolicy::default()),
        Wake::After(Duration::from_secs(60))
    );
    assert_eq!(
        wake(
            &expiring,
            now() + chrono::Duration::seconds(61),
            &RunPolicy::default()
        ),
        Wake::Now
    );
}

#[tokio::test(start_paused = true)]
async fn wakeups_come_in_order_once_each_and_a_later_entry_replaces_an_earlier() {
    let wakeups = std::sync::Arc::new(Wakeups::default());
    let (woken, mut order) = tokio::sync::mpsc::unbounded_channel();
    let runner = {
        let wakeups = wakeups.clone();
        tokio::spawn(async move {
            wakeups
                .run(|at| woken.send(at.name().to_owned()).unwrap())
                .await
        })
    };
    let start = Instant::now();
    let a = AtKey::new("default", "a");
    let b = AtKey::new("default", "b");
    let c = AtKey::new("default", "c");
    wakeups.set(a.clone(), start + Duration::from_secs(5));
    wakeups.set(b.clone(), start + Duration::from_secs(1));
    wakeups.set(a.clone(), start + Duration::from_secs(2));
    wakeups.set(c.clone(), start + Duration::from_secs(3));
    wakeups.clear(&c);
    assert_eq!(wakeups.len(), 2);

    assert_eq!(order.recv().await.unwrap(), "b");
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert_eq!(order.recv().await.unwrap(), "a");
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(order.try_recv().is_err(), "a was replaced, c cleared");
    assert!(wakeups.is_empty());

    // An entry set while the runner sleeps with nothing to do still wakes it.
    wakeups.set(c, Instant::now() + Duration::from_millis(300));
    assert_eq!(order.recv().await.unwrap(), "c");
    runner.abort();
}

#[test]
fn ats_of_one_name_in_two_namespaces_wake_apart_and_come_back_whole() {
    let wakeups = Wakeups::default();
    let start = Instant::now();
    let a = AtKey::new("team-a", "x");
    let b = AtKey::new("team-b", "x");
    let bare = AtKey::new("", "y");
    wakeups.set(a.clone(), start);
    wakeups.set(b.clone(), start + Duration::from_secs(1));
    wakeups.set(bare.clone(), start + Duration::from_secs(2));
    wakeups.clear(&AtKey::new("team-c", "x"));
    assert_eq!(wakeups.len(), 3);
    let (due, next) = wakeups.take_due(start + Duration::from_secs(1));
    let names: Vec<_> = due.iter().map(|at| (at.namespace(), at.name())).collect();
    assert_eq!(names, [("team-a", "x"), ("team-b", "x")]);
    assert_eq!(next, Some(start + Duration::from_secs(2)));
    let (due, next) = wakeups.take_due(start + Duration::from_secs(2));
    assert_eq!((due[0].namespace(), due[0].name()), ("", "y"));
    assert_eq!(next, None);
}

#[tokio::test(start_paused = true)]
async fn a_retry_does_not_put_off_an_earlier_wakeup_but_can_bring_it_forward() {
    let wakeups = Wakeups::default();
    let at = AtKey::new("ns", "a");
    let start = Instant::now();
    // Due in 10 s; a failed write's retry in 30 s keeps the 10 s.
    wakeups.set(at.clone(), start + Duration::from_secs(10));
    wakeups.set_earlier(at.clone(), start + Duration::from_secs(30));
    assert_eq!(wakeups.when(&at), Some(start + Duration::from_secs(10)));
    // A retry in 1 s comes first.
    wakeups.set_earlier(at.clone(), start + Duration::from_secs(1));
    assert_eq!(wakeups.when(&at), Some(start + Duration::from_secs(1)));
    assert_eq!(wakeups.len(), 1);
    // With no entry, it sets one.
    let other = AtKey::new("ns", "b");
    wakeups.set_earlier(other.clone(), start + Duration::from_secs(5));
    assert_eq!(wakeups.when(&other), Some(start + Duration::from_secs(5)));
}

#[tokio::test(start_paused = true)]
async fn the_index_holds_only_the_next_hour() {
    let wakeups = Wakeups::default();
    let start = Instant::now();
    assert!(within_horizon(start + HORIZON, start));
    assert!(!within_horizon(
        start + HORIZON + Duration::from_millis(1),
        start
    ));
    // Past instants are due now: within.
    tokio::time::advance(Duration::from_secs(10)).await;
    assert!(within_horizon(start, Instant::now()));

    let (near, far) = (AtKey::new("ns", "near"), AtKey::new("ns", "far"));
    let now = Instant::now();
    wakeups.set(near.clone(), now + HORIZON);
    wakeups.set(far.clone(), now + HORIZON + Duration::from_secs(1));
    assert_eq!(wakeups.when(&near), Some(now + HORIZON));
    assert_eq!(wakeups.when(&far), None, "beyond the horizon: no entry");
    assert_eq!(wakeups.len(), 1);
    // A later instant beyond the horizon takes the entry away (the look-ahead brings it back).
    wakeups.set(near.clone(), now + 2 * HORIZON);
    assert!(wakeups.is_empty());
    // A retry beyond the horizon keeps an earlier entry, and sets none where there is none.
    wakeups.set(near.clone(), now + Duration::from_secs(5));
    wakeups.set_earlier(near.clone(), now + 2 * HORIZON);
    wakeups.set_earlier(far.clone(), now + 2 * HORIZON);
    assert_eq!(wakeups.when(&near), Some(now + Duration::from_secs(5)));
    assert_eq!(wakeups.len(), 1);
}
