use super::*;
use http::{Request, Response};
use http_body_util::BodyExt;
use kube::client::Body;
use serde_json::Value;
use tokio::task::JoinHandle;

/// Where a request came from when the caller does not say (`check`, `cached`).
const UNKNOWN_CLIENT: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED);

/// The reviewer as the tests ask it, for a request without an address or arrival time.
impl AccessReviewer {
    /// The verdict from a cached answer, without waiting: `None` when there is none (then
    /// `check`). An answer past half its life is refreshed in the background.
    fn cached(&self, user: &UserInfo, namespace: &str) -> Option<Result<(), Denial>> {
        self.cached_for(UNKNOWN_CLIENT, user, namespace)
    }

    /// `Ok` when `user` may create pods in `namespace`, else the denial message.
    async fn check(&self, user: &UserInfo, namespace: &str) -> Result<(), Denial> {
        self.check_for(UNKNOWN_CLIENT, user, namespace).await
    }

    /// `check`, for a request from `client`: its review counts against the budgets of new or
    /// known identities, in all and for `client` (see [`NEW_PER_SECOND`]).
    async fn check_for(
        &self,
        client: std::net::IpAddr,
        user: &UserInfo,
        namespace: &str,
    ) -> Result<(), Denial> {
        self.check_received(client, user, namespace, Instant::now())
            .await
    }
}

fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/api-k8s-1.24/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The guard as it was before the background upkeep refreshed answers: only requests do.
fn without_keep_warm() -> Settings {
    Settings {
        keep_warm: Duration::ZERO,
        ..Settings::default()
    }
}

fn metrics() -> Arc<Metrics> {
    Arc::new(Metrics::new(Default::default()))
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
/// answered), and any past the script none; returns the reviews it received (once the
/// reviewer and its reviews are gone).
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
        // Past the script: recorded (so counts see them) and never answered.
        while let Some((request, _respond)) = handle.next_request().await {
            let body = request.into_body().collect().await.unwrap().to_bytes();
            seen.push(serde_json::from_slice(&body).unwrap());
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
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
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
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
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
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
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
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
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
    let reviewer = AccessReviewer::new(client, settings, metrics());
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
}

#[tokio::test(start_paused = true)]
async fn the_cache_key_is_everything_the_review_sends() {
    let (client, task) = server(vec![
        Some((201, fixture("subjectaccessreview-denied.json"))),
        Some((201, fixture("subjectaccessreview-allowed.json"))),
        Some((201, fixture("subjectaccessreview-allowed.json"))),
    ]);
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
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
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
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
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
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
    // The RoleBinding is removed after the first review.
    let (client, task) = answering(|n| if n == 0 { allowed() } else { denied() });
    let ttl = Settings::default().cache_ttl;
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    // Past half its life: served at once (no wait for the review, which takes 100 ms), and
    // refreshed behind the scenes.
    tokio::time::advance(ttl / 2).await;
    let started = Instant::now();
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    assert_eq!(started.elapsed(), Duration::ZERO);
    tokio::time::sleep(2 * LATENCY).await;
    // Past the first answer's life: the refreshed answer, at once (and its own refresh).
    tokio::time::advance(ttl / 2).await;
    let started = Instant::now();
    let denied = reviewer.check(&alice(), "fx").await.unwrap_err();
    assert!(denied.starts_with("alice may not create pods"), "{denied}");
    assert_eq!(started.elapsed(), Duration::ZERO);
    drop(reviewer);
    assert_eq!(task.await.unwrap(), 3);
}

#[tokio::test(start_paused = true)]
async fn applies_retry_a_failed_refresh_only_half_a_ttl_after_it_started() {
    let (client, task) = answering(|n| if n == 0 { allowed() } else { failing() });
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
    let start = Instant::now();
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    // At 5 s an apply starts a refresh, which fails; the applies after it are served the
    // answer of 0 s, and start no refresh until 3.75 s after it (half a TTL, to the nearest
    // round of the upkeep).
    for at in [5000, 5500, 6000, 7000, 8000, 8700, 9000] {
        tokio::time::sleep_until(start + Duration::from_millis(at)).await;
        assert_eq!(reviewer.cached(&alice(), "fx"), Some(Ok(())), "at {at} ms");
    }
    drop(reviewer);
    assert_eq!(task.await.unwrap(), 3, "at 0 s, 5 s and 9 s");
}

#[tokio::test(start_paused = true)]
async fn a_review_whose_requests_went_away_still_ends_and_never_answers_a_later_request() {
    let (client, task) = server(vec![
        Some((201, fixture("subjectaccessreview-allowed.json"))),
        Some((201, fixture("subjectaccessreview-denied.json"))),
    ]);
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
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
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
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

/// How long the API server of [`answering`] takes to answer.
const LATENCY: Duration = Duration::from_millis(100);

/// An API server that answers every SubjectAccessReview after [`LATENCY`], the `n`th (from 0)
/// with `reply(n)` (status code and body), until the client is gone; returns how many it got.
fn answering(
    reply: impl Fn(usize) -> (u16, Value) + Send + 'static,
) -> (Client, JoinHandle<usize>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let task = tokio::spawn(async move {
        let mut received = 0;
        while let Some((_, respond)) = handle.next_request().await {
            let (code, body) = reply(received);
            let body = serde_json::to_vec(&body).unwrap();
            let response = Response::builder().status(code).body(body.into()).unwrap();
            tokio::spawn(async move {
                tokio::time::sleep(LATENCY).await;
                respond.send_response(response);
            });
            received += 1;
        }
        received
    });
    (Client::new(service, "default"), task)
}

fn allowed() -> (u16, Value) {
    (201, fixture("subjectaccessreview-allowed.json"))
}

fn denied() -> (u16, Value) {
    (201, fixture("subjectaccessreview-denied.json"))
}

fn failing() -> (u16, Value) {
    (500, fixture("status-500-webhook-unreachable-create.json"))
}

/// How many reviews `metrics` counted with this trigger and outcome.
fn counted(metrics: &Metrics, trigger: &str, outcome: &str) -> u64 {
    let labels = format!("{{trigger=\"{trigger}\",outcome=\"{outcome}\"}}");
    let line = format!("cnat_access_review_duration_seconds_count{labels} ");
    let text = metrics.encode();
    text.lines()
        .find_map(|l| l.strip_prefix(line.as_str()))
        .map_or(0, |count| count.trim().parse().unwrap())
}

#[test]
fn the_upkeep_runs_every_quarter_ttl_and_starts_at_most_100_reviews_a_second() {
    let with_ttl = |ms| Settings {
        cache_ttl: Duration::from_millis(ms),
        ..Settings::default()
    };
    let ms = Duration::from_millis;
    assert_eq!(cadence(&Settings::default()), (ms(2500), 250));
    assert_eq!(cadence(&with_ttl(1000)), (ms(250), 25));
    assert_eq!(cadence(&with_ttl(100)), (ms(100), 10), "at least 100 ms");
    assert_eq!(cadence(&with_ttl(0)), (ms(100), 10));
    // A refresh starts before the answer is 5 s + 1.25 s old; with the 2 s timeout it is in
    // time, with 4 s it may not be.
    assert_eq!(timeout_limit(&Settings::default()), ms(3750));
    assert!(refreshes_in_time(&Settings::default()));
    let slow = Settings {
        timeout: Duration::from_secs(4),
        ..Settings::default()
    };
    assert!(!refreshes_in_time(&slow));
    let in_time = Settings {
        timeout: Duration::from_millis(3700),
        ..Settings::default()
    };
    assert!(refreshes_in_time(&in_time), "under 3/8 of the TTL");
    assert!(!refreshes_in_time(&with_ttl(2000)), "2 s timeout, 2 s TTL");
}

#[test]
fn upkeep_refreshes_answers_used_lately_every_half_ttl_and_forgets_expired_cold_ones() {
    let settings = Settings::default(); // TTL 10 s, rounds every 2.5 s, keep warm 120 s
    let ms = Duration::from_millis;
    let since = |asked, tried, used| Since {
        asked: ms(asked),
        tried: ms(tried),
        used: ms(used),
    };
    let cases = [
        (since(0, 0, 0), Upkeep::Keep),
        // Due at the round nearest half its life: 3.75 s + half a round.
        (since(3749, 3749, 0), Upkeep::Keep),
        (since(3750, 3750, 0), Upkeep::Refresh),
        (since(9000, 9000, 120_000), Upkeep::Refresh),
        // Expired (refreshes failed), still in use: retried half a TTL after the last try.
        (since(30_000, 2500, 30_000), Upkeep::Keep),
        (since(30_000, 5000, 30_000), Upkeep::Refresh),
        // Not used lately: served until it expires, then forgotten.
        (since(9000, 9000, 120_001), Upkeep::Keep),
        (since(10_000, 10_000, 120_001), Upkeep::Drop),
        (since(600_000, 1000, 600_000), Upkeep::Drop),
    ];
    for (since, expected) in cases {
        assert_eq!(upkeep(since, &settings), expected, "{since:?}");
    }
    let off = without_keep_warm();
    assert_eq!(upkeep(since(9000, 9000, 1), &off), Upkeep::Keep);
    assert_eq!(upkeep(since(10_000, 10_000, 1), &off), Upkeep::Drop);
    assert_eq!(
        upkeep(since(9000, 9000, 0), &off),
        Upkeep::Keep,
        "used, but off"
    );
    // Rounds at least 100 ms apart cannot keep answers of a TTL under 200 ms fresh: none are
    // refreshed (with a TTL of 0 nothing is ever served), cold ones still forgotten.
    for ttl in [0, 150] {
        let short = Settings {
            cache_ttl: ms(ttl),
            ..settings
        };
        assert_eq!(
            upkeep(since(5000, 5000, 0), &short),
            Upkeep::Keep,
            "{ttl} ms"
        );
        assert_eq!(upkeep(since(5000, 5000, 200_000), &short), Upkeep::Drop);
    }
    let ttl_200 = Settings {
        cache_ttl: ms(200),
        ..settings
    };
    assert_eq!(upkeep(since(100, 100, 0), &ttl_200), Upkeep::Refresh);
}

#[tokio::test(start_paused = true)]
async fn an_answer_used_lately_is_kept_fresh_so_the_next_apply_after_a_pause_does_not_wait() {
    // The RoleBinding is removed after the fifth review.
    let (client, task) = answering(|n| if n < 5 { allowed() } else { denied() });
    let metrics = metrics();
    let reviewer = AccessReviewer::new(client, Settings::default(), metrics.clone());
    let started = Instant::now();
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    assert_eq!(started.elapsed(), LATENCY, "the first apply waits");
    // Alice pauses for a minute, six TTLs.
    tokio::time::sleep(Duration::from_secs(61)).await;
    let started = Instant::now();
    let denied = reviewer.check(&alice(), "fx").await.unwrap_err();
    assert!(denied.starts_with("alice may not create pods"), "{denied}");
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "no wait, and the answer is current"
    );
    // Asked at 0 s, then refreshed every half TTL: 5 s, 10 s, ..., 60 s.
    assert_eq!(counted(&metrics, "request", "allowed"), 1);
    assert_eq!(counted(&metrics, "refresh", "allowed"), 4);
    assert_eq!(counted(&metrics, "refresh", "denied"), 8);
    drop(reviewer);
    assert_eq!(task.await.unwrap(), 13);
}

#[tokio::test(start_paused = true)]
async fn an_answer_not_used_within_keep_warm_stops_being_refreshed_and_is_forgotten() {
    let (client, task) = answering(|_| allowed());
    let settings = Settings {
        keep_warm: Duration::from_secs(30),
        ..Settings::default()
    };
    let metrics = metrics();
    let reviewer = AccessReviewer::new(client, settings, metrics.clone());
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    tokio::time::sleep(Duration::from_secs(300)).await;
    assert!(reviewer.inner.lock().answers.is_empty(), "forgotten");
    // Refreshed at 5, 10, ..., 30 s (used at 0 s, warm until 30 s); the answer of 30 s
    // expired at 40 s and was dropped.
    assert_eq!(counted(&metrics, "refresh", "allowed"), 6);
    // The next apply waits for a review (and is kept warm from then on).
    let started = Instant::now();
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    assert_eq!(started.elapsed(), LATENCY);
    assert_eq!(counted(&metrics, "request", "allowed"), 2);
    drop(reviewer);
    assert_eq!(task.await.unwrap(), 1 + 6 + 1);
}

#[tokio::test(start_paused = true)]
async fn a_failed_refresh_is_retried_half_a_ttl_later_and_an_expired_answer_is_never_served() {
    // The API server fails after the first review.
    let (client, task) = answering(|n| if n == 0 { allowed() } else { failing() });
    let metrics = metrics();
    let reviewer = AccessReviewer::new(client, Settings::default(), metrics.clone());
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    // Refreshes at 5 s and 10 s fail; the answer of 0 s expires at 10 s.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(reviewer.cached(&alice(), "fx"), None, "expired");
    let started = Instant::now();
    let failed = reviewer.check(&alice(), "fx").await.unwrap_err();
    assert!(failed.starts_with("cnat could not check"), "{failed}");
    assert_eq!(started.elapsed(), LATENCY, "it asked, and waited");
    // Retried half a TTL after the last try (12 s): at 17.5 s, not at every round.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(counted(&metrics, "request", "allowed"), 1);
    assert_eq!(counted(&metrics, "request", "unanswered"), 1);
    assert_eq!(counted(&metrics, "refresh", "unanswered"), 3);
    drop(reviewer);
    assert_eq!(task.await.unwrap(), 5);
}

#[tokio::test(start_paused = true)]
async fn with_keep_warm_off_only_requests_refresh_answers_and_expired_ones_are_forgotten() {
    let (client, task) = answering(|_| allowed());
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(reviewer.inner.lock().answers.is_empty(), "forgotten");
    let started = Instant::now();
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    assert_eq!(started.elapsed(), LATENCY, "asked again");
    drop(reviewer);
    assert_eq!(
        task.await.unwrap(),
        2,
        "once at first, once after the pause"
    );
}

#[tokio::test(start_paused = true)]
async fn a_refresh_never_brings_back_an_answer_forgotten_meanwhile() {
    let (client, _task) = answering(|_| allowed());
    let reviewer = AccessReviewer::new(client, without_keep_warm(), metrics());
    assert_eq!(reviewer.check(&alice(), "fx").await, Ok(()));
    let key = Key::new(&alice(), "fx");
    let refresh = {
        let mut reviews = reviewer.inner.lock();
        let refresh = reviewer.inner.start(
            &mut reviews,
            key.clone(),
            review(&alice(), "fx"),
            Trigger::Refresh,
        );
        // Forgotten while the refresh is in flight (e.g. the cache was full).
        reviews.answers.remove(&key);
        refresh
    };
    assert!(matches!(refresh.await, Reviewed::Allowed));
    let reviews = reviewer.inner.lock();
    assert!(reviews.answers.is_empty() && reviews.asking.is_empty());
}

#[tokio::test(start_paused = true)]
async fn one_round_of_upkeep_starts_at_most_its_budget_the_answers_tried_longest_ago_first() {
    let (client, _task) = answering(|_| allowed());
    let reviewer = AccessReviewer::new(client, Settings::default(), metrics());
    let (_, budget) = cadence(&Settings::default());
    let now = Instant::now() + Duration::from_secs(100);
    let users: Vec<UserInfo> = (0..budget + 44)
        .map(|i| UserInfo {
            username: Some(format!("user-{i}")),
            ..UserInfo::default()
        })
        .collect();
    {
        let mut reviews = reviewer.inner.lock();
        for (i, user) in users.iter().enumerate() {
            // All due and used just now; user-0 tried longest ago, and asked most recently.
            let tried = now - Duration::from_secs(9) + Duration::from_millis(i as u64);
            let answer = Answer {
                asked: now - Duration::from_millis(i as u64),
                tried,
                used: now,
                uses: 2,
                client: UNKNOWN_CLIENT,
                reviewed: Reviewed::Allowed,
                question: review(user, "fx"),
                bytes: Key::new(user, "fx").bytes(),
            };
            reviews.bytes += answer.bytes;
            reviews.answers.insert(Key::new(user, "fx"), answer);
        }
    }
    reviewer.inner.upkeep(now);
    let reviews = reviewer.inner.lock();
    assert_eq!(reviews.asking.len(), budget);
    let refreshed = |i: usize| reviews.asking.contains_key(&Key::new(&users[i], "fx"));
    assert!((0..budget).all(refreshed), "tried longest ago");
    assert!(!(budget..users.len()).any(refreshed), "the rest wait");
}

fn user(name: &str, groups: usize, group_bytes: usize) -> UserInfo {
    UserInfo {
        username: Some(name.into()),
        groups: Some((0..groups).map(|i| format!("{i:0group_bytes$}")).collect()),
        ..UserInfo::default()
    }
}

#[tokio::test(start_paused = true)]
async fn an_identity_past_the_bound_is_denied_without_asking_the_api_server() {
    let (client, task) = answering(|_| allowed());
    let metrics = metrics();
    let reviewer = AccessReviewer::new(client, Settings::default(), metrics.clone());
    // 64 KiB passes (the bound: 1024 groups of 16 bytes and 48 a string, a 16-byte name).
    let at_bound = user(&"b".repeat(16), 1023, 16);
    assert_eq!(user_info_bytes(&at_bound), MAX_USER_INFO_BYTES);
    assert_eq!(reviewer.check(&at_bound, "fx").await, Ok(()));
    let one_more = user(&"b".repeat(17), 1023, 16);
    assert!(reviewer.check(&one_more, "fx").await.is_err());
    // The attack's size: 1.5 MB of groups.
    let huge = user("mallory", 50_000, 30);
    let denied = reviewer.check(&huge, "fx").await.unwrap_err();
    assert!(
        denied.starts_with("cnat refuses to check an identity of 3900055 bytes (50000 groups), over its bound of 65536 bytes"),
        "{denied}"
    );
    // Empty groups cost what a String costs: a million of them are no small identity.
    let empty = user("mallory", 1_000_000, 0);
    assert!(reviewer.check(&empty, "fx").await.is_err());
    assert_eq!(reviewer.cached(&huge, "fx"), Some(Err(denied)));
    assert_eq!(reviewer.inner.lock().answers.len(), 1, "not cached");
    drop(reviewer);
    assert_eq!(task.await.unwrap(), 1, "one review: bob's");
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_new_identities_gets_a_fixed_rate_of_reviews_and_leaves_the_api_server_s_share()
{
    let (client, task) = answering(|_| allowed());
    let metrics = metrics();
    let reviewer = Arc::new(AccessReviewer::new(
        client,
        Settings::default(),
        metrics.clone(),
    ));
    let (flood, apiserver) = ("10.0.0.66".parse().unwrap(), "10.0.0.1".parse().unwrap());
    // 200 new identities a second for 5 s from one caller.
    let mut admitted = 0;
    for second in 0..5 {
        let checks: Vec<_> = (0..200)
            .map(|i| {
                let reviewer = reviewer.clone();
                let who = user(&format!("made-up-{second}-{i}"), 1, 8);
                tokio::spawn(async move { reviewer.check_for(flood, &who, "fx").await })
            })
            .collect();
        for check in checks {
            match check.await.unwrap() {
                Ok(()) => admitted += 1,
                Err(busy) => assert!(busy.contains("too many identities at once"), "{busy}"),
            }
        }
        // Meanwhile the API server's callers' new identities are still asked about.
        let alice = user(&format!("alice-{second}"), 2, 8);
        assert_eq!(reviewer.check_for(apiserver, &alice, "fx").await, Ok(()));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // 20 a second from one caller (the first second's 20 saved up, then 20 a second).
    assert!((100..=120).contains(&admitted), "{admitted}");
    assert_eq!(counted(&metrics, "request", "refused"), 1000 - admitted);
    drop(reviewer);
    let reviews = task.await.unwrap();
    // The flood's and alice's requests; refreshes of answers used once wait behind none here.
    assert!(reviews <= admitted as usize + 5 + 50, "{reviews}");
}

#[tokio::test(start_paused = true)]
async fn the_cache_is_bounded_in_bytes_and_never_drops_an_answer_used_twice_to_make_room() {
    let (client, _task) = answering(|_| allowed());
    let reviewer = Arc::new(AccessReviewer::new(client, Settings::default(), metrics()));
    let alice = alice();
    assert_eq!(reviewer.check(&alice, "fx").await, Ok(()));
    // 60 KiB identities, 20 new ones a second for 25 s (two and a half cache TTLs): 500 x 120
    // KiB would be 59 MiB, the bound is 16. Alice applies every 10 s, without waiting for a
    // review.
    for second in 0..25 {
        let checks: Vec<_> = (0..20)
            .map(|i| {
                let (reviewer, big) = (
                    reviewer.clone(),
                    user(&format!("big-{second}-{i}"), 31, 1000),
                );
                tokio::spawn(async move {
                    reviewer
                        .check_for("10.0.0.66".parse().unwrap(), &big, "fx")
                        .await
                })
            })
            .collect();
        for check in checks {
            assert_eq!(check.await.unwrap(), Ok(()));
        }
        if second % 10 == 0 {
            assert_eq!(
                reviewer.cached(&alice, "fx"),
                Some(Ok(())),
                "second {second}"
            );
        }
        {
            let reviews = reviewer.inner.lock();
            assert!(reviews.bytes <= MAX_CACHED_BYTES, "{}", reviews.bytes);
            let mine = reviews.answers.get(&Key::new(&alice, "fx"));
            assert!(
                mine.is_some(),
                "second {second}: {} answers, {} bytes, {} asking",
                reviews.answers.len(),
                reviews.bytes,
                reviews.asking.len()
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let reviews = reviewer.inner.lock();
    let counted: usize = reviews.answers.values().map(|a| a.bytes).sum();
    assert_eq!(reviews.bytes, counted, "the count of bytes is kept exactly");
}

#[test]
fn a_bucket_gives_its_rate_and_saves_up_at_most_its_burst() {
    let start = Instant::now();
    let mut bucket = Bucket::new(20, 1, start);
    assert_eq!((0..30).filter(|_| bucket.take(start)).count(), 20);
    assert!(!bucket.take(start + Duration::from_millis(40)));
    assert!(bucket.take(start + Duration::from_millis(50)));
    let later = start + Duration::from_secs(100);
    assert_eq!(bucket.available(later), 20, "at most one second saved up");
    let mut three = Bucket::new(100, 3, start);
    assert_eq!(three.available(start), 300);
}

#[test]
fn keep_warm_serves_each_client_address_in_turn_so_a_flood_of_answers_starves_nobody() {
    let now = Instant::now();
    let (flood, apiserver): (std::net::IpAddr, std::net::IpAddr) =
        ("10.0.0.66".parse().unwrap(), "10.0.0.1".parse().unwrap());
    let key = |name: &str| Key::new(&user(name, 1, 4), "fx");
    // 500 made-up identities, each used twice and tried longer ago than alice's and bob's.
    let mut due: Vec<_> = (0..500)
        .map(|i| (false, now, flood, key(&format!("made-up-{i}"))))
        .collect();
    let later = now + Duration::from_secs(1);
    due.push((false, later, apiserver, key("alice")));
    due.push((true, later, apiserver, key("bob")));
    let chosen = fair(due, 50);
    assert_eq!(chosen.len(), 50);
    assert!(chosen.contains(&key("alice")) && chosen.contains(&key("bob")));
    // Within one address: used more than once first.
    let position = |name: &str| chosen.iter().position(|k| *k == key(name)).unwrap();
    assert!(position("alice") < position("bob"));
}

#[test]
fn one_caller_cannot_spend_the_known_budget_of_requests() {
    let now = Instant::now();
    let mut budgets = Budgets::new(now);
    let (flood, apiserver) = ("10.0.0.66".parse().unwrap(), "10.0.0.1".parse().unwrap());
    let spent = (0..1000)
        .filter(|_| budgets.take(flood, true, false, now))
        .count();
    assert_eq!(spent, KNOWN_PER_SECOND_PER_CLIENT as usize);
    let theirs = (0..1000)
        .filter(|_| budgets.take(apiserver, true, false, now))
        .count();
    assert_eq!(theirs, KNOWN_PER_SECOND_PER_CLIENT as usize);
    // New identities have budgets of their own.
    assert!(budgets.take(apiserver, false, false, now));
    // The upkeep leaves a second's worth of the known budget to requests.
    let mut fresh = Budgets::new(now);
    assert_eq!(fresh.for_upkeep(now), 3 * KNOWN_PER_SECOND as usize);
}

#[test]
fn a_few_addresses_inventing_identities_leave_the_reserve_to_an_address_asking_lightly() {
    let start = Instant::now();
    let mut budgets = Budgets::new(start);
    let attackers: Vec<std::net::IpAddr> = (1..=4)
        .map(|i| format!("10.0.1.{i}").parse().unwrap())
        .collect();
    let apiserver: std::net::IpAddr = "10.0.0.1".parse().unwrap();
    let (mut theirs, mut refused) = (0, 0);
    // 10 s: each attacker asks 100 new identities a second; the API server's address a first
    // apply by a new user twice a second (and four at once at the start).
    for tick in 0..1000u32 {
        let now = start + Duration::from_millis(10 * u64::from(tick));
        for attacker in &attackers {
            theirs += usize::from(budgets.take(*attacker, false, false, now));
        }
        let asks = match tick {
            0 => 4,
            t if t % 50 == 0 => 1,
            _ => 0,
        };
        for _ in 0..asks {
            refused += usize::from(!budgets.take(apiserver, false, false, now));
        }
    }
    assert_eq!(refused, 0, "the light address was refused");
    // The attackers get what is left: at most the whole rate, well under their own caps.
    assert!(theirs <= 10 * NEW_PER_SECOND as usize + 40, "{theirs}");
    assert!(theirs >= 10 * NEW_RESERVED_PER_SECOND as usize, "{theirs}");
    // Nine addresses asking as fast as they may do not empty the reserve either (4 a second
    // each as light callers, 36 of its 20 + 20): an address asking 2 a second still gets in.
    let mut budgets = Budgets::new(start);
    let nine: Vec<std::net::IpAddr> = (1..=9)
        .map(|i| format!("10.0.2.{i}").parse().unwrap())
        .collect();
    let mut refused = 0;
    for tick in 0..1000u32 {
        let now = start + Duration::from_millis(10 * u64::from(tick));
        for attacker in &nine {
            budgets.take(*attacker, false, false, now);
        }
        if tick % 50 == 25 {
            refused += usize::from(!budgets.take(apiserver, false, false, now));
        }
    }
    assert!(refused <= 2, "{refused} of 20 refused");
}

#[test]
fn resent_reviews_keep_a_share_while_a_few_addresses_resend_theirs_too() {
    let start = Instant::now();
    let mut budgets = Budgets::new(start);
    let attackers: Vec<std::net::IpAddr> = (1..=4)
        .map(|i| format!("10.0.1.{i}").parse().unwrap())
        .collect();
    let apiserver: std::net::IpAddr = "10.0.0.1".parse().unwrap();
    // 10 s: each attacker asks 100 new identities a second, every one of them also resent (all
    // refused ones are); the API server's address asks 5 new ones a second (not light), and
    // resends each one refused a second later, as kube-apiserver does on a 429.
    let (mut asked, mut answered, mut waiting) = (0, 0, Vec::new());
    let mut later_than_a_resend = 0;
    for tick in 0..1000u32 {
        let now = start + Duration::from_millis(10 * u64::from(tick));
        for attacker in &attackers {
            if !budgets.take(*attacker, false, false, now) {
                budgets.take(*attacker, false, true, now);
            }
        }
        let (due, still): (Vec<_>, Vec<_>) = waiting
            .into_iter()
            .partition(|(at, _)| now >= *at + Duration::from_secs(1));
        waiting = still;
        for (_, tries) in due {
            if budgets.take(apiserver, false, true, now) {
                answered += 1;
            } else if tries < 4 {
                waiting.push((now, tries + 1));
            } else {
                later_than_a_resend += 1;
            }
        }
        if tick % 20 == 0 {
            asked += 1;
            if budgets.take(apiserver, false, false, now) {
                answered += 1;
            } else {
                waiting.push((now, 1));
            }
        }
    }
    // Within the webhook's default 5 s timeout (four resends a second apart), none failed.
    assert_eq!(later_than_a_resend, 0, "{answered} of {asked} answered");
    // Without resends counting, the same load leaves some refused four times over.
    let mut budgets = Budgets::new(start);
    let mut waiting: Vec<(Instant, u32)> = Vec::new();
    let mut failed = 0;
    for tick in 0..1000u32 {
        let now = start + Duration::from_millis(10 * u64::from(tick));
        for attacker in &attackers {
            budgets.take(*attacker, false, false, now);
        }
        let (due, still): (Vec<_>, Vec<_>) = waiting
            .into_iter()
            .partition(|(at, _)| now >= *at + Duration::from_secs(1));
        waiting = still;
        for (_, tries) in due {
            if !budgets.take(apiserver, false, false, now) {
                match tries < 4 {
                    true => waiting.push((now, tries + 1)),
                    false => failed += 1,
                }
            }
        }
        if tick % 20 == 0 && !budgets.take(apiserver, false, false, now) {
            waiting.push((now, 1));
        }
    }
    assert!(failed > 0, "the share made no difference");
}

#[tokio::test(start_paused = true)]
async fn a_review_refused_as_busy_says_for_how_long_and_its_resend_may_use_the_reserve() {
    let (client, _task) = answering(|_| allowed());
    let reviewer = AccessReviewer::new(client, Settings::default(), metrics());
    let (apiserver, other) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
    // Only the reserve is left, and the API server's address asks too much to be light.
    let spend = |reviewer: &AccessReviewer| {
        let now = Instant::now();
        let mut reviews = reviewer.inner.lock();
        let budgets = &mut reviews.budgets;
        budgets.new.refill(now);
        budgets.new.tokens = f64::from(NEW_RESERVED_PER_SECOND);
        let light = bucket_of(
            &mut budgets.light_by_client,
            apiserver,
            LIGHT_PER_SECOND_PER_CLIENT,
            now,
        );
        light.refill(now);
        light.tokens = 0.0;
    };
    spend(&reviewer);
    let (first, second) = (alice(), user("bob", 1, 8));
    let denial = reviewer
        .check_for(apiserver, &first, "fx")
        .await
        .unwrap_err();
    assert_eq!(denial.busy_for(), Some(Duration::ZERO), "{denial:?}");
    assert!(denial.contains("too many identities at once"), "{denial}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    spend(&reviewer);
    // A new identity is refused again; the resent one is answered from the reserve.
    let denial = reviewer
        .check_for(apiserver, &second, "fx")
        .await
        .unwrap_err();
    assert_eq!(denial.busy_for(), Some(Duration::ZERO));
    let key = Key::new(&first, "fx");
    let now = Instant::now();
    {
        let reviews = reviewer.inner.lock();
        assert!(reviews.first_refused(apiserver, &key, now).is_some());
        assert!(
            reviews.first_refused(other, &key, now).is_none(),
            "another address"
        );
        assert!(
            reviews
                .first_refused(apiserver, &key, now + RETRY_WINDOW)
                .is_none(),
            "past the window"
        );
    }
    assert_eq!(reviewer.check_for(apiserver, &first, "fx").await, Ok(()));
    // Resent past its address's share: refused, and it says since when.
    tokio::time::sleep(Duration::from_secs(2)).await;
    spend(&reviewer);
    {
        let now = Instant::now();
        let mut reviews = reviewer.inner.lock();
        let retries = bucket_of(
            &mut reviews.budgets.retries_by_client,
            apiserver,
            RETRIES_PER_SECOND_PER_CLIENT,
            now,
        );
        retries.refill(now);
        retries.tokens = 0.0;
    }
    let denial = reviewer
        .check_for(apiserver, &second, "fx")
        .await
        .unwrap_err();
    // Refused first about 2 s ago (the answers above took some of the paused clock's time).
    let busy = denial.busy_for().unwrap();
    assert!(
        (Duration::from_secs(2)..Duration::from_secs(3)).contains(&busy),
        "{busy:?}"
    );
    // A denial by the API server is no busy refusal.
    let (client, _task) = answering(|_| denied());
    let reviewer = AccessReviewer::new(client, Settings::default(), metrics());
    let denial = reviewer.check(&alice(), "fx").await.unwrap_err();
    assert_eq!(denial.busy_for(), None);
}

#[tokio::test(start_paused = true)]
async fn an_identity_allowed_before_counts_as_known_after_its_answer_is_forgotten() {
    let (client, _task) = answering(|_| allowed());
    let reviewer = AccessReviewer::new(client, Settings::default(), metrics());
    let alice = alice();
    assert_eq!(reviewer.check(&alice, "fx").await, Ok(()));
    let key = Key::new(&alice, "fx");
    let now = Instant::now();
    {
        let mut reviews = reviewer.inner.lock();
        reviews.remove(&key);
        assert!(reviews.seen(&key, now));
        assert!(!reviews.seen(&Key::new(&alice, "elsewhere"), now));
        assert!(!reviews.seen(&key, now + SEEN_FOR));
    }
    // Denied identities are not remembered.
    let (client, _task) = answering(|_| denied());
    let reviewer = AccessReviewer::new(client, Settings::default(), metrics());
    assert!(reviewer.check(&alice, "fx").await.is_err());
    assert!(!reviewer.inner.lock().seen(&key, Instant::now()));
}

#[test]
fn refusals_are_remembered_for_a_bounded_number_of_addresses_and_past_that_not_resent() {
    let now = Instant::now();
    let mut reviews = Reviews::new(now);
    let key = Key::new(&alice(), "fx");
    for i in 0..2000u32 {
        let client = std::net::IpAddr::from((0x0a00_0000 + i).to_be_bytes());
        let first = reviews.refused(client, &key, now, now);
        // Past the bound: not remembered, so not to be resent.
        assert_eq!(
            first,
            (i < MAX_REFUSING_CLIENTS as u32).then_some(now),
            "{i}"
        );
    }
    assert_eq!(reviews.refused.len(), MAX_REFUSING_CLIENTS);
    // Past the window, the old ones make room (once a second at most).
    let later = now + RETRY_WINDOW;
    let newcomer = std::net::IpAddr::from([10, 9, 9, 9]);
    assert_eq!(reviews.refused(newcomer, &key, later, later), Some(later));
    assert_eq!(reviews.refused.len(), 1);
    // Refused again: since the first time.
    let again = later + Duration::from_secs(3);
    assert_eq!(reviews.refused(newcomer, &key, again, again), Some(later));
    // One address keeps its last 64 identities; once it had to forget one within the window,
    // none of its refusals is to be resent for the window's length.
    for n in 1..MAX_REFUSALS_PER_CLIENT {
        let who = user(&format!("u{n}"), 1, 8);
        assert_eq!(
            reviews.refused(newcomer, &Key::new(&who, "fx"), again, again),
            Some(again)
        );
    }
    let one_more = Key::new(&user("u-last", 1, 8), "fx");
    assert_eq!(reviews.refused(newcomer, &one_more, again, again), None);
    assert_eq!(
        reviews.refused[&newcomer].recent.len(),
        MAX_REFUSALS_PER_CLIENT
    );
    let still = again + Duration::from_secs(1);
    let other = Key::new(&user("u-other", 1, 8), "fx");
    assert_eq!(reviews.refused(newcomer, &other, still, still), None);
    let past = still + RETRY_WINDOW;
    let fresh = Key::new(&user("u-fresh", 1, 8), "fx");
    assert_eq!(reviews.refused(newcomer, &fresh, past, past), Some(past));
}
