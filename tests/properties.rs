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
        let object = json!({"apiVersion": "cnat.programming-kubernetes.info/v1alpha1", "kind": "At",
                            "metadata": {"name": "x"}, "spec": spec, "status": status});
        for target in [Target::Object { create }, Target::Status] {
            let patch = defaulting::patch(&object, target);
            let mut defaulted = object.clone();
            json_patch::patch(&mut defaulted, &patch).unwrap();
            prop_assert!(defaulting::patch(&defaulted, target).0.is_empty());
        }
    }
}

#[test]
fn round_trip_covers_the_book_example() {
    let book: DateTime<Utc> = "2019-04-12T10:12:00Z".parse().unwrap();
    assert_eq!(schedule::parse(&book.to_rfc3339(), None), Ok(book));
}
