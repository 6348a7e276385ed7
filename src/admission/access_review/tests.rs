use super::*;
use http::{Request, Response};
use http_body_util::BodyExt;
use kube::client::Body;
use serde_json::Value;
use tokio::task::JoinHandle;

fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/api-k8s-1.24/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn alice() -> UserInfo {
    UserInfo {
        username: Some("alice".into()),
        uid: Some("u-1".into()),
        groups: Some(vec!["system:authenticated".into(), "devs".into()]),
        extra: Some([("scopes".into(), vec!["x".into()])].into()),
    }
}

/// A scripted API server: each SubjectAccessReview POST gets the next reply (`None`: never
/// answered); returns the reviews it received.
fn server(replies: Vec<Option<(u16, Value)>>) -> (Client, JoinHandle<Vec<Value>>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let task = tokio::spawn(async move {
        let mut seen = Vec::new();
        let mut pending = Vec::new();
        for reply in replies {
            let Some((request, respond)) = handle.next_request().await else {
                break;
            };
            assert_eq!(
                (request.method().as_str(), request.uri().path()),
                ("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews")
            );
            let body = request.into_body().collect().await.unwrap().to_bytes();
            seen.push(serde_json::from_slice(&body).unwrap());
            match reply {
                Some((code, body)) => respond.send_response(
                    Response::builder()
                        .status(code)
                        .body(Body::from(serde_json::to_vec(&body).unwrap()))
                        .unwrap(),
                ),
                None => pending.push(respond),
            }
        }
        seen
    });
    (Client::new(service, "default"), task)
}

#[tokio::test]
async fn an_allowed_user_passes_and_the_review_carries_their_identity() {
    let (client, task) = server(vec![Some((
        201,
        fixture("subjectaccessreview-allowed.json"),
    ))]);
    let reviewer = AccessReviewer::new(client, Settings::default());
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    drop(reviewer);
    let seen = task.await.unwrap();
    assert_eq!(
        seen[0]["spec"],
        serde_json::json!({
            "user": "alice", "uid": "u-1", "groups": ["system:authenticated", "devs"],
            "extra": {"scopes": ["x"]},
            "resourceAttributes": {"namespace": "fx", "verb": "create", "group": "", "resource": "pods"},
        })
    );
}

#[tokio::test]
async fn a_denied_user_gets_a_message_naming_the_permission_and_namespace() {
    let (client, _task) = server(vec![Some((
        201,
        fixture("subjectaccessreview-denied.json"),
    ))]);
    let reviewer = AccessReviewer::new(client, Settings::default());
    let denied = reviewer.check(&alice(), "fx").await.unwrap_err();
    assert!(
        denied.starts_with("alice may not create pods in namespace fx, and an At runs a pod there"),
        "{denied}"
    );
    assert!(denied.contains("ask for create on pods in fx"), "{denied}");
}

#[tokio::test(start_paused = true)]
async fn answers_are_cached_briefly_per_user_groups_and_namespace() {
    let (client, task) = server(vec![
        Some((201, fixture("subjectaccessreview-denied.json"))),
        Some((201, fixture("subjectaccessreview-allowed.json"))),
        Some((201, fixture("subjectaccessreview-allowed.json"))),
    ]);
    let reviewer = AccessReviewer::new(client, Settings::default());
    // A burst of applies costs one review.
    for _ in 0..5 {
        assert!(reviewer.check(&alice(), "fx").await.is_err());
    }
    // Groups in another order are the same key; another namespace is not.
    let mut reordered = alice();
    reordered.groups.as_mut().unwrap().reverse();
    assert!(reviewer.check(&reordered, "fx").await.is_err());
    assert_eq!(reviewer.check(&alice(), "other").await, Ok(()));
    // After the TTL (a RoleBinding was added meanwhile), it asks again.
    tokio::time::advance(Settings::default().cache_ttl).await;
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    drop(reviewer);
    assert_eq!(task.await.unwrap().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_review_that_fails_or_hangs_denies_by_default_and_is_not_cached() {
    let (client, task) = server(vec![
        Some((500, fixture("status-500-webhook-unreachable-create.json"))),
        None, // hangs
        Some((201, fixture("subjectaccessreview-allowed.json"))),
    ]);
    let reviewer = AccessReviewer::new(client, Settings::default());
    let failed = reviewer.check(&alice(), "fx").await.unwrap_err();
    assert!(
        failed.starts_with("cnat could not check whether you may create pods in namespace fx"),
        "{failed}"
    );
    let started = Instant::now();
    let hung = reviewer.check(&alice(), "fx").await.unwrap_err();
    assert!(hung.contains("no answer within 2s"), "{hung}");
    assert_eq!(started.elapsed(), Settings::default().timeout, "bounded");
    // Not cached: the next apply asks again and gets through.
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    drop(reviewer);
    assert_eq!(task.await.unwrap().len(), 3);
}

#[tokio::test]
async fn with_on_error_allow_a_failed_review_lets_the_at_through() {
    let (client, _task) = server(vec![Some((
        500,
        fixture("status-500-webhook-unreachable-create.json"),
    ))]);
    let settings = Settings {
        on_error: OnError::Allow,
        ..Settings::default()
    };
    let reviewer = AccessReviewer::new(client, settings);
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
}

#[tokio::test(start_paused = true)]
async fn the_cache_key_is_everything_the_review_sends() {
    let (client, task) = server(vec![
        Some((201, fixture("subjectaccessreview-denied.json"))),
        Some((201, fixture("subjectaccessreview-allowed.json"))),
        Some((201, fixture("subjectaccessreview-allowed.json"))),
    ]);
    let reviewer = AccessReviewer::new(client, Settings::default());
    assert!(reviewer.check(&alice(), "fx").await.is_err());
    // Same name and groups, another uid (a recreated user): asked again, not the cached "no".
    let mut other_uid = alice();
    other_uid.uid = Some("u-2".into());
    assert_eq!(reviewer.check(&other_uid, "fx").await, Ok(()));
    // Other extra (e.g. a scope that an authorizer reads): asked again.
    let mut other_extra = alice();
    other_extra.extra = Some([("scopes".into(), vec!["y".into()])].into());
    assert_eq!(reviewer.check(&other_extra, "fx").await, Ok(()));
    // The same extra again: cached.
    let mut reordered = alice();
    reordered.extra = Some([("scopes".into(), vec!["x".into()])].into());
    assert!(reviewer.check(&reordered, "fx").await.is_err());
    drop(reviewer);
    assert_eq!(task.await.unwrap().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_no_with_an_evaluation_error_is_no_answer_and_is_not_cached() {
    let mut undecided = fixture("subjectaccessreview-denied.json");
    undecided["status"]["evaluationError"] = "webhook authorizer: connection refused".into();
    let (client, task) = server(vec![
        Some((201, undecided)),
        Some((201, fixture("subjectaccessreview-allowed.json"))),
    ]);
    let reviewer = AccessReviewer::new(client, Settings::default());
    let failed = reviewer.check(&alice(), "fx").await.unwrap_err();
    assert!(
        failed.starts_with("cnat could not check whether you may create pods in namespace fx"),
        "{failed}"
    );
    assert!(
        failed.contains("evaluation error: webhook authorizer"),
        "{failed}"
    );
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()), "asked again");
    drop(reviewer);
    assert_eq!(task.await.unwrap().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn concurrent_requests_of_one_user_share_one_review() {
    let (client, task) = server(vec![
        Some((201, fixture("subjectaccessreview-allowed.json"))),
        Some((201, fixture("subjectaccessreview-denied.json"))),
    ]);
    let reviewer = AccessReviewer::new(client, Settings::default());
    // A cold start: 16 applies by alice arrive at once, and one by bob.
    let alice = alice();
    let mut bob = alice.clone();
    bob.username = Some("bob".into());
    let alices = futures::future::join_all((0..16).map(|_| reviewer.check(&alice, "fx")));
    let (alices, bobs) = futures::join!(alices, reviewer.check(&bob, "fx"));
    assert!(alices.iter().all(|a| a.is_ok()), "{alices:?}");
    let denied = bobs.unwrap_err();
    assert!(
        denied.starts_with("bob may not create pods in namespace fx"),
        "{denied}"
    );
    drop(reviewer);
    let seen = task.await.unwrap();
    assert_eq!(seen.len(), 2, "one review per user");
}

#[tokio::test(start_paused = true)]
async fn an_answer_in_use_is_refreshed_before_it_expires_and_no_request_waits_for_it() {
    let (client, task) = server(vec![
        Some((201, fixture("subjectaccessreview-allowed.json"))),
        // The RoleBinding was removed meanwhile.
        Some((201, fixture("subjectaccessreview-denied.json"))),
        None, // the next refresh never gets an answer
    ]);
    let ttl = Settings::default().cache_ttl;
    let reviewer = AccessReviewer::new(client, Settings::default());
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    // Past half its life: served at once, and refreshed behind the scenes.
    tokio::time::advance(ttl / 2).await;
    let started = Instant::now();
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    assert_eq!(started.elapsed(), Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(1)).await;
    // Past the first answer's life: the refreshed answer, at once (its own refresh, which
    // hangs, is asked in the background).
    tokio::time::advance(ttl / 2).await;
    let started = Instant::now();
    let denied = reviewer.check(&alice(), "fx").await.unwrap_err();
    assert!(denied.starts_with("alice may not create pods"), "{denied}");
    assert_eq!(started.elapsed(), Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(1)).await;
    drop(reviewer);
    assert_eq!(task.await.unwrap().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_review_whose_requests_went_away_still_ends_and_never_answers_a_later_request() {
    let (client, task) = server(vec![
        Some((201, fixture("subjectaccessreview-allowed.json"))),
        Some((201, fixture("subjectaccessreview-denied.json"))),
    ]);
    let reviewer = AccessReviewer::new(client, Settings::default());
    // The only request waiting for the first review goes away (kubectl interrupted).
    let gone = tokio::time::timeout(Duration::ZERO, reviewer.check(&alice(), "fx")).await;
    assert!(gone.is_err(), "it was still waiting");
    // The review still ends and caches its answer...
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    // ... which is not used past its life: a later request gets a fresh answer.
    tokio::time::advance(Settings::default().cache_ttl * 3).await;
    let denied = reviewer.check(&alice(), "fx").await.unwrap_err();
    assert!(denied.starts_with("alice may not create pods"), "{denied}");
    drop(reviewer);
    assert_eq!(task.await.unwrap().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_cached_answer_is_given_without_waiting_and_refreshed_and_none_past_its_life() {
    let (client, task) = server(vec![
        Some((201, fixture("subjectaccessreview-allowed.json"))),
        // The RoleBinding was removed meanwhile.
        Some((201, fixture("subjectaccessreview-denied.json"))),
    ]);
    let ttl = Settings::default().cache_ttl;
    let reviewer = AccessReviewer::new(client, Settings::default());
    assert_eq!(reviewer.cached(&alice(), "fx"), None, "nothing asked yet");
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    assert_eq!(reviewer.cached(&alice(), "fx"), Some(Ok(())));
    assert_eq!(reviewer.cached(&alice(), "other"), None, "per namespace");
    // Past half its life: still given, and a refresh is asked in the background.
    tokio::time::advance(ttl / 2).await;
    assert_eq!(reviewer.cached(&alice(), "fx"), Some(Ok(())));
    tokio::time::sleep(Duration::from_millis(1)).await;
    let refreshed = reviewer
        .cached(&alice(), "fx")
        .expect("the refreshed answer");
    assert!(
        refreshed
            .unwrap_err()
            .starts_with("alice may not create pods"),
        "the refresh's answer replaces the first"
    );
    // Past the refreshed answer's life, nothing is given: `check` asks again.
    tokio::time::advance(ttl).await;
    assert_eq!(reviewer.cached(&alice(), "fx"), None);
    drop(reviewer);
    assert_eq!(task.await.unwrap().len(), 2, "one review and one refresh");
}

/// An API server that answers every SubjectAccessReview at once, the `n`th (from 0) with
/// `reply(n)`, until the client is gone; returns how many it answered.
fn answering(reply: impl Fn(usize) -> Value + Send + 'static) -> (Client, JoinHandle<usize>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let task = tokio::spawn(async move {
        let mut answered = 0;
        while let Some((_, respond)) = handle.next_request().await {
            let body = serde_json::to_vec(&reply(answered)).unwrap();
            respond.send_response(Response::builder().status(201).body(body.into()).unwrap());
            answered += 1;
        }
        answered
    });
    (Client::new(service, "default"), task)
}

#[test]
fn upkeep_refreshes_warm_answers_past_half_their_life_and_drops_cold_expired_ones() {
    let settings = Settings::default(); // TTL 10 s, keep warm 120 s
    let s = Duration::from_secs;
    let cases = [
        // (age, idle since last use) -> upkeep
        ((s(0), s(0)), Upkeep::Keep),
        ((Duration::from_millis(4999), s(0)), Upkeep::Keep),
        ((s(5), s(5)), Upkeep::Refresh),
        ((s(9), s(120)), Upkeep::Refresh),
        ((s(30), s(30)), Upkeep::Refresh), // expired (a refresh failed), still in use
        ((s(9), s(121)), Upkeep::Keep),    // cold, but valid for another second
        ((s(10), s(121)), Upkeep::Drop),
        ((s(600), s(600)), Upkeep::Drop),
    ];
    for ((age, idle), expected) in cases {
        assert_eq!(
            upkeep(age, idle, &settings),
            expected,
            "age {age:?}, idle {idle:?}"
        );
    }
    let off = Settings {
        keep_warm: Duration::ZERO,
        ..settings
    };
    assert_eq!(upkeep(s(5), s(0), &off), Upkeep::Refresh, "just used");
    assert_eq!(upkeep(s(5), s(1), &off), Upkeep::Keep);
    assert_eq!(upkeep(s(10), s(1), &off), Upkeep::Drop);
}

#[tokio::test(start_paused = true)]
async fn an_answer_used_lately_is_kept_fresh_so_the_next_apply_after_a_pause_does_not_wait() {
    // The RoleBinding is removed after the fifth review.
    let (client, task) = answering(|n| match n {
        0..5 => fixture("subjectaccessreview-allowed.json"),
        _ => fixture("subjectaccessreview-denied.json"),
    });
    let reviewer = AccessReviewer::new(client, Settings::default());
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    // Alice pauses for a minute, six TTLs.
    tokio::time::sleep(Duration::from_secs(61)).await;
    let started = Instant::now();
    let denied = reviewer.cached(&alice(), "fx").expect("a fresh answer");
    assert!(denied.unwrap_err().starts_with("alice may not create pods"));
    let denied = reviewer.check(&alice(), "fx").await.unwrap_err();
    assert!(denied.starts_with("alice may not create pods"), "{denied}");
    assert_eq!(started.elapsed(), Duration::ZERO, "no wait");
    drop(reviewer);
    // Asked at 0 s, then refreshed every half TTL: 5 s, 10 s, ..., 60 s.
    assert_eq!(task.await.unwrap(), 13);
}

#[tokio::test(start_paused = true)]
async fn an_answer_not_used_within_keep_warm_stops_being_refreshed_and_is_forgotten() {
    let (client, task) = answering(|_| fixture("subjectaccessreview-allowed.json"));
    let settings = Settings {
        keep_warm: Duration::from_secs(30),
        ..Settings::default()
    };
    let reviewer = AccessReviewer::new(client, settings);
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    tokio::time::sleep(Duration::from_secs(300)).await;
    assert!(reviewer.inner.lock().answers.is_empty(), "forgotten");
    // Its next apply asks again (and is kept warm from then on).
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    drop(reviewer);
    // Asked at 0 s; refreshed at 5, 10, ..., 30 s (last used at 0 s, warm until 30 s); the
    // answer of 30 s expires at 40 s and is dropped; asked again at 300 s.
    assert_eq!(task.await.unwrap(), 1 + 6 + 1);
}

#[tokio::test(start_paused = true)]
async fn with_keep_warm_off_only_requests_refresh_answers() {
    let (client, task) = answering(|_| fixture("subjectaccessreview-allowed.json"));
    let settings = Settings {
        keep_warm: Duration::ZERO,
        ..Settings::default()
    };
    let reviewer = AccessReviewer::new(client, settings);
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    drop(reviewer);
    assert_eq!(
        task.await.unwrap(),
        2,
        "once at first, once after the pause"
    );
}

#[tokio::test(start_paused = true)]
async fn one_round_of_upkeep_starts_at_most_max_refreshes_the_oldest_answers_first() {
    let (client, _task) = answering(|_| fixture("subjectaccessreview-allowed.json"));
    let reviewer = AccessReviewer::new(client, Settings::default());
    let now = Instant::now() + Duration::from_secs(100);
    let users: Vec<UserInfo> = (0..MAX_REFRESHES + 44)
        .map(|i| UserInfo {
            username: Some(format!("user-{i}")),
            ..UserInfo::default()
        })
        .collect();
    {
        let mut reviews = reviewer.inner.lock();
        for (i, user) in users.iter().enumerate() {
            // All past half their life and used just now; user-0 asked longest ago.
            let asked = now - Duration::from_secs(9) + Duration::from_millis(i as u64);
            let answer = Answer {
                asked,
                used: now,
                reviewed: Reviewed::Allowed,
                question: review(user, "fx"),
            };
            reviews.answers.insert(Key::new(user, "fx"), answer);
        }
    }
    reviewer.inner.upkeep(now);
    let reviews = reviewer.inner.lock();
    assert_eq!(reviews.asking.len(), MAX_REFRESHES);
    let refreshed = |i: usize| reviews.asking.contains_key(&Key::new(&users[i], "fx"));
    assert!((0..MAX_REFRESHES).all(refreshed), "the oldest");
    assert!(
        !(MAX_REFRESHES..users.len()).any(refreshed),
        "the newest wait"
    );
}
