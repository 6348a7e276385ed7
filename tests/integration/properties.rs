//! Properties of the parsers that face user and network input: they never panic, round-trip
//! what they accept, and keep their messages bounded; defaulting is idempotent.

use chrono::{DateTime, FixedOffset, TimeZone, Utc};
use cnat::admission::defaulting::{self, Target};
use cnat::{admission::webhook, schedule};
use proptest::prelude::*;
use serde_json::{json, Value};

fn fixture() -> Value {
    let path = format!(
        "{}/tests/fixtures/admission-review-k8s-1.24/validating-create.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let capture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    capture["review"].clone()
}

/// Any JSON value, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        ".{0,20}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("[a-z]{1,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #[test]
    fn schedule_parsing_never_panics_and_messages_stay_short(raw in ".{0,300}") {
        if let Err(err) = schedule::parse(&raw, None) {
            let message = err.to_string();
            prop_assert!(message.starts_with("spec.schedule"));
            prop_assert!(message.chars().count() < 260, "{}", message);
        }
    }

    #[test]
    fn every_rfc3339_instant_parses_back_to_itself(
        secs in -62_135_596_800i64..253_402_300_799,
        nanos in 0u32..1_000_000_000,
        offset_minutes in -1439i32..1440,
    ) {
        let instant = Utc.timestamp_opt(secs, nanos).single().unwrap();
        let offset = FixedOffset::east_opt(offset_minutes * 60).unwrap();
        let written = instant.with_timezone(&offset).to_rfc3339();
        prop_assert_eq!(schedule::parse(&written, None), Ok(instant), "{}", written);
    }

    #[test]
    fn wall_clock_times_in_a_zone_round_trip_or_are_refused_as_gap_or_fold(
        secs in 0i64..4_102_444_800, // 1970 to 2100
        zone in prop::sample::select(vec![
            "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata",
            "America/Sao_Paulo", "Pacific/Chatham", "UTC", "Africa/Casablanca",
        ]),
    ) {
        let instant = Utc.timestamp_opt(secs, 0).single().unwrap();
        let tz = jiff::tz::TimeZone::get(zone).unwrap();
        let local = jiff::Timestamp::from_second(secs).unwrap().to_zoned(tz).datetime();
        let written = local.strftime("%Y-%m-%dT%H:%M:%S").to_string();
        match schedule::parse(&written, Some(zone)) {
            Ok(parsed) => prop_assert_eq!(parsed, instant, "{} in {}", written, zone),
            // The same wall-clock time twice: the message offers this instant.
            Err(schedule::ScheduleError::Fold { first, second, .. }) => {
                let want = instant.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);
                prop_assert!(first == want || second == want, "{} {} {}", first, second, want);
            }
            Err(other) => prop_assert!(false, "{} in {}: {}", written, zone, other),
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = webhook::validating(&bytes);
        let _ = webhook::mutating(&bytes);
    }

    #[test]
    fn decoding_a_corrupted_review_never_panics(position in 0usize..2000, byte in any::<u8>()) {
        let mut body = serde_json::to_vec(&fixture()).unwrap();
        let index = position % body.len();
        body[index] = byte;
        // Where the body is still valid JSON, any answer echoes its uid. (Invalid UTF-8 in a
        // field the fast path skips is no reason to refuse a review.)
        let (validated, mutated) = (webhook::validating(&body), webhook::mutating(&body));
        if let Ok(json) = serde_json::from_slice::<Value>(&body) {
            let uid = &json["request"]["uid"];
            if let Ok(verdict) = validated {
                prop_assert_eq!(&Value::from(verdict.response.uid), uid);
            }
            if let Ok(verdict) = mutated {
                prop_assert_eq!(&Value::from(verdict.response.uid), uid);
            }
        }
    }

    #[test]
    fn any_spec_is_reviewed_without_panicking(spec in json_value(), status in json_value()) {
        let mut review = fixture();
        review["request"]["object"]["spec"] = spec;
        review["request"]["object"]["status"] = status;
        let body = serde_json::to_vec(&review).unwrap();
        let response = webhook::validating(&body).unwrap().response;
        prop_assert_eq!(&response.uid, review["request"]["uid"].as_str().unwrap());
        if !response.allowed {
            prop_assert!(!response.result.message.is_empty());
        }
        prop_assert!(webhook::mutating(&body).is_ok());
    }

    #[test]
    fn defaulting_is_idempotent(spec in json_value(), status in json_value(), create in any::<bool>()) {
        let object = json!({"apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
                            "metadata": {"name": "x"}, "spec": spec, "status": status});
        for target in [Target::Object { create }, Target::Status] {
            let patch = defaulting::patch(&object, target, "v1");
            let mut defaulted = object.clone();
            json_patch::patch(&mut defaulted, &patch).unwrap();
            prop_assert!(defaulting::patch(&defaulted, target, "v1").0.is_empty());
        }
    }
}

#[test]
fn round_trip_covers_the_book_example() {
    let book: DateTime<Utc> = "2019-04-12T10:12:00Z".parse().unwrap();
    assert_eq!(schedule::parse(&book.to_rfc3339(), None), Ok(book));
}

/// Any instant chrono can hold, often at the ends of its range and of RFC 3339's.
fn instant() -> impl Strategy<Value = DateTime<Utc>> {
    let (min, max) = (
        DateTime::<Utc>::MIN_UTC.timestamp(),
        DateTime::<Utc>::MAX_UTC.timestamp(),
    );
    prop_oneof![
        Just(DateTime::<Utc>::MIN_UTC),
        Just(DateTime::<Utc>::MAX_UTC),
        (-62_167_219_200i64..=253_402_300_799).prop_map(|s| Utc.timestamp_opt(s, 0).unwrap()),
        (min..=max).prop_map(|s| Utc.timestamp_opt(s, 0).unwrap()),
    ]
}

/// Schedules: RFC 3339 anywhere in years 0000-9999 with any offset, wall-clock times, the
/// ends, and garbage.
fn schedule_text() -> impl Strategy<Value = String> {
    prop_oneof![
        (-62_167_219_200i64..=253_402_300_799, -1439i32..1440).prop_map(|(s, m)| {
            let offset = FixedOffset::east_opt(m * 60).unwrap();
            Utc.timestamp_opt(s, 0)
                .unwrap()
                .with_timezone(&offset)
                .to_rfc3339()
        }),
        Just("0000-01-01T00:00:00Z".to_owned()),
        Just("9999-12-31T23:59:59-23:59".to_owned()),
        Just("0000-01-01T00:00:00+23:59".to_owned()),
        Just("9999-12-31T23:59:59".to_owned()),
        ".{0,40}",
    ]
}

fn seconds() -> impl Strategy<Value = Option<i64>> {
    prop_oneof![
        Just(None),
        Just(Some(i64::MAX)),
        Just(Some(i64::MIN)),
        Just(Some(i64::from(i32::MAX))),
        any::<i64>().prop_map(Some),
    ]
}

fn at_strategy() -> impl Strategy<Value = cnat::api::At> {
    use cnat::api::{At, AtSpec, AtStatus, Outcome, Phase};
    let spec = (
        schedule_text(),
        prop::option::of(prop::sample::select(vec![
            "UTC",
            "Europe/Berlin",
            "Pacific/Kiritimati",
            "America/Adak",
            "Etc/GMT+12",
            "Etc/GMT-14",
            "posix/Europe/Berlin",
            "../../etc/passwd",
            "",
            "Mars/Olympus",
        ])),
        seconds(),
        seconds(),
        prop::option::of(any::<i32>()),
    );
    let status = prop::option::of((
        prop::sample::select(vec![Phase::Pending, Phase::Running, Phase::Done]),
        prop::option::of(instant()),
        prop::option::of(instant()),
        prop::option::of(instant()),
        prop::option::of(prop::sample::select(vec![
            Outcome::Succeeded,
            Outcome::Failed,
            Outcome::Missed,
        ])),
        prop::option::of("[a-z-]{1,20}"),
    ));
    (spec, status, any::<bool>()).prop_map(|(spec, status, deleting)| {
        let (schedule, zone, starting, active, ttl) = spec;
        let mut at = At::new(
            "x",
            AtSpec {
                schedule,
                command: "true".into(),
                time_zone: zone.map(str::to_owned),
                starting_deadline_seconds: starting,
                active_deadline_seconds: active,
                ttl_seconds_after_finished: ttl,
                ..AtSpec::default()
            },
        );
        at.metadata.namespace = Some("default".into());
        at.metadata.uid = Some("uid".into());
        at.metadata.resource_version = Some("1".into());
        if deleting {
            at.metadata.deletion_timestamp = Some(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
            );
        }
        at.status = status.map(
            |(phase, scheduled, started, completed, outcome, pod)| AtStatus {
                phase,
                scheduled_time: scheduled,
                start_time: started,
                completion_time: completed,
                outcome,
                pod_name: pod,
                ..AtStatus::default()
            },
        );
        at
    })
}

fn pod_strategy() -> impl Strategy<Value = cnat::operator::reconcile::decide::PodObservation> {
    use cnat::operator::pod::{PodEnd, PodView};
    use cnat::operator::reconcile::decide::PodObservation;
    let end = prop::option::of((
        any::<bool>(),
        prop::option::of(any::<i32>()),
        prop::option::of(".{0,40}"),
        prop::option::of(prop::sample::select(vec!["DeadlineExceeded", "Evicted"])),
        prop::option::of(instant()),
    ))
    .prop_map(|end| {
        end.map(
            |(succeeded, exit_code, detail, reason, finished_at)| PodEnd {
                succeeded,
                exit_code,
                detail,
                pod_reason: reason.map(str::to_owned),
                finished_at,
            },
        )
    });
    use cnat::operator::pod::{Stuck, Waiting};
    let waiting = (prop::sample::select(Stuck::ALL.to_vec()), ".{0,20}")
        .prop_map(|(stuck, detail)| Waiting { stuck, detail });
    let view = (
        prop::option::of(instant()),
        end,
        any::<bool>(),
        any::<bool>(),
        prop::option::of(waiting),
        (any::<bool>(), seconds()),
    )
        .prop_map(
            |(created_at, end, deleting, finalizer, waiting, (running, deadline))| PodView {
                name: "x-pod".into(),
                created_at,
                end,
                deleting,
                finalizer,
                waiting,
                running,
                active_deadline_seconds: deadline,
            },
        );
    prop_oneof![
        Just(PodObservation::NotCached),
        Just(PodObservation::Missing),
        Just(PodObservation::Foreign),
        ".{0,20}".prop_map(PodObservation::Rejected),
        ".{0,20}".prop_map(PodObservation::Refused),
        view.prop_map(PodObservation::Owned),
    ]
}

proptest! {
    /// The whole decision path (not only the parser): any spec, any status, any pod, any time,
    /// the ends of every range included: deciding, waking, building the pod and caching the At
    /// never panic, and the cached At reads back with the same spec and status.
    #[test]
    fn the_whole_decision_path_never_panics(
        at in at_strategy(),
        pod in pod_strategy(),
        now in instant(),
        default_deadline in seconds(),
    ) {
        use cnat::operator::reconcile::{decide, wakeups};
        let policy = cnat::operator::policy::RunPolicy {
            starting_deadline_seconds: default_deadline,
            ..Default::default()
        };
        let decision = decide::decide(&at, &pod, now, &policy);
        if let Some(status) = &decision.status {
            // What is written serializes (the API server gets JSON).
            prop_assert!(serde_json::to_string(status).is_ok());
        }
        let _ = wakeups::wake(&at, now, &policy);
        let _ = cnat::operator::pod::build(&at, &policy);
        let cached = cnat::operator::cache::CachedAt::from(at.clone());
        let back = cached.at().unwrap();
        prop_assert_eq!((&back.spec, &back.status), (&at.spec, &at.status));
    }
}
