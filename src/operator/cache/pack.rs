//! How a cached At's JSON is packed: LZ4 with a dictionary of what every At's JSON repeats (its
//! keys, condition types and reasons, cnat's messages, the shape of its times), built in-process.
//! See docs/src/design/decisions.md, "The At cache".

use crate::api::{AtSpec, AtStatus, Condition, Outcome, Phase};
use chrono::{DateTime, TimeZone, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::{Deserialize, Serialize};
use std::sync::LazyLock;

/// What a cached At's packed JSON holds: the At without what `CachedAt` keeps apart (name,
/// namespace, resourceVersion) or the type says (apiVersion, kind).
#[derive(Serialize, Deserialize)]
pub struct Rest {
    pub metadata: ObjectMeta,
    pub spec: AtSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<AtStatus>,
}

static DICTIONARY: LazyLock<Vec<u8>> = LazyLock::new(dictionary);

/// `json` packed (its length first, then LZ4 against the dictionary).
pub fn pack(json: &[u8]) -> Box<[u8]> {
    lz4_flex::block::compress_prepend_size_with_dict(json, &DICTIONARY).into()
}

/// What `pack` packed.
pub fn unpack(packed: &[u8]) -> Result<Vec<u8>, lz4_flex::block::DecompressError> {
    lz4_flex::block::decompress_size_prepended_with_dict(packed, &DICTIONARY)
}

/// The JSON of an At in each phase as cnat leaves it (the form `CachedAt` packs: no name,
/// namespace, resourceVersion, annotations or managed fields), the most common last.
fn dictionary() -> Vec<u8> {
    let mut dictionary = Vec::new();
    for phase in [Phase::Done, Phase::Running, Phase::Pending] {
        // Serializing these types cannot fail: their maps have string keys.
        if let Ok(json) = serde_json::to_vec(&example(phase)) {
            dictionary.extend_from_slice(&json);
        }
    }
    dictionary
}

/// The JSON form of an At in `phase` (its pod `example-pod`), its times those of a typical At
/// (nanoseconds where cnat writes them).
fn example(phase: Phase) -> Rest {
    let at = |seconds: i64, nanos: u32| -> DateTime<Utc> {
        Utc.timestamp_opt(1_798_761_600 + seconds, nanos)
            .single()
            .unwrap_or_default()
    };
    let due = at(3600, 0);
    let pod = "example-pod";
    let runs_at = format!(
        "runs at {}",
        due.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
    );
    let condition = |type_: &str, reason: &str, message: &str, since| Condition {
        type_: type_.to_owned(),
        status: "True".to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        last_transition_time: since,
        observed_generation: Some(1),
    };
    let mut status = AtStatus {
        phase,
        scheduled_time: Some(due),
        reason: Some("Scheduled".to_owned()),
        message: Some(runs_at.clone()),
        conditions: vec![condition(
            "Scheduled",
            "Scheduled",
            &runs_at,
            at(1, 123_456_789),
        )],
        observed_generation: Some(1),
        ..AtStatus::default()
    };
    if phase != Phase::Pending {
        let started = at(3600, 12_345_678);
        let message = format!("pod {pod} runs the command");
        status.pod_name = Some(pod.to_owned());
        status.start_time = Some(started);
        status.reason = Some("PodCreated".to_owned());
        status.message = Some(message.clone());
        status
            .conditions
            .push(condition("PodCreated", "PodCreated", &message, started));
    }
    if phase == Phase::Done {
        let ended = at(3610, 0);
        let message = format!("the command in pod {pod} succeeded");
        status.outcome = Some(Outcome::Succeeded);
        status.exit_code = Some(0);
        status.completion_time = Some(ended);
        status.reason = Some("Succeeded".to_owned());
        status.message = Some(message.clone());
        status
            .conditions
            .push(condition("Complete", "Succeeded", &message, ended));
    }
    Rest {
        metadata: ObjectMeta {
            creation_timestamp: Some(Time(
                jiff::Timestamp::from_second(1_798_761_600).unwrap_or_default(),
            )),
            generation: Some(1),
            uid: Some("0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d".to_owned()),
            ..ObjectMeta::default()
        },
        spec: AtSpec {
            schedule: due.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            command: "echo hello".to_owned(),
            ..AtSpec::default()
        },
        status: Some(status),
    }
}
