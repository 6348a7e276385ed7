//! The validating webhook's path for an At whose stored copy does not decode.

use super::*;
use serde_json::{json, Value};

/// A v1 update review by `user` of an At whose stored copy holds a number no i32 holds (as
/// one stored before the CRD bounded it), with `status` stored and `spec` as the new spec.
fn unreadable_update(user: &str, status: Value, spec: Value) -> Vec<u8> {
    let stored_spec = json!({"schedule": "2999-01-01T00:00:00Z", "command": "true",
                             "ttlSecondsAfterFinished": 3_000_000_000_i64});
    let at = |spec: &Value| {
        let mut at = json!({"apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
                            "metadata": {"name": "x", "namespace": "fx"}, "spec": spec});
        if !status.is_null() {
            at["status"] = status.clone();
        }
        at
    };
    let gvk = json!({"group": "cnat.programming-kubernetes.info", "version": "v1", "kind": "At"});
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "u-1", "kind": gvk, "name": "x", "namespace": "fx", "operation": "UPDATE",
            "resource": {"group": "cnat.programming-kubernetes.info", "version": "v1", "resource": "ats"},
            "userInfo": {"username": user, "groups": ["system:authenticated"]},
            "object": at(&spec), "oldObject": at(&stored_spec),
        }
    }))
    .unwrap()
}

fn fixed(command: &str) -> Value {
    json!({"schedule": "2999-01-01T00:00:00Z", "command": command, "ttlSecondsAfterFinished": 60,
           "template": {"serviceAccountName": "cluster-admin"}})
}

#[test]
fn the_fix_of_a_pending_unreadable_at_is_checked_whole_and_needs_permission_to_create_pods() {
    let verdict = validating(&unreadable_update("mallory", Value::Null, fixed("steal"))).unwrap();
    assert!(verdict.response.allowed, "{:?}", verdict.response.result);
    assert_eq!(verdict.response.uid, "u-1");
    let (user, namespace) = verdict.access.expect("the escalation guard is asked");
    assert_eq!(
        (user.username.as_deref(), namespace.as_str()),
        (Some("mallory"), "fx")
    );
    // Pending is not started.
    let status = json!({"phase": "Pending"});
    let verdict = validating(&unreadable_update("m", status, fixed("steal"))).unwrap();
    assert!(verdict.response.allowed && verdict.access.is_some());
    // The fix is checked whole: a bad schedule is refused.
    let mut bad = fixed("steal");
    bad["schedule"] = "tomorrow".into();
    let verdict = validating(&unreadable_update("mallory", Value::Null, bad)).unwrap();
    assert!(!verdict.response.allowed);
    assert!(
        verdict.response.result.message.contains("\"tomorrow\""),
        "{}",
        verdict.response.result.message
    );
}

#[test]
fn once_the_stored_copy_says_it_may_have_run_its_spec_never_changes() {
    for status in [
        json!({"phase": "Running"}),
        json!({"phase": "Done"}),
        json!({"phase": 7}),
        json!("not a status"),
    ] {
        let verdict = validating(&unreadable_update("admin", status.clone(), fixed("x"))).unwrap();
        assert!(!verdict.response.allowed, "{status}");
        assert!(
            verdict
                .response
                .result
                .message
                .starts_with("spec: cannot change: the stored At does not decode as an At"),
            "{}",
            verdict.response.result.message
        );
    }
}

#[test]
fn metadata_and_status_edits_of_an_unreadable_at_pass_without_asking() {
    let stored = json!({"schedule": "2999-01-01T00:00:00Z", "command": "true",
                        "ttlSecondsAfterFinished": 3_000_000_000_i64});
    let verdict = validating(&unreadable_update(
        "mallory",
        json!({"phase": "Done"}),
        stored,
    ))
    .unwrap();
    assert!(verdict.response.allowed, "{:?}", verdict.response.result);
    assert!(verdict.access.is_none());
    // A new spec that still does not decode is refused, saying why.
    let mut broken = fixed("x");
    broken["ttlSecondsAfterFinished"] = 4_000_000_000_i64.into();
    let verdict = validating(&unreadable_update("mallory", Value::Null, broken)).unwrap();
    assert!(!verdict.response.allowed);
    assert!(verdict
        .response
        .result
        .message
        .contains("the object is not a valid At"));
}

#[test]
fn a_large_review_takes_the_bounded_path_and_gets_the_same_verdict() {
    let mut review: Value =
        serde_json::from_slice(&unreadable_update("m", Value::Null, fixed("x"))).unwrap();
    // A readable stored copy, and 300 KiB of annotations: over the fast path's bound.
    review["request"]["oldObject"]["spec"]["ttlSecondsAfterFinished"] = 60.into();
    let small = serde_json::to_vec(&review).unwrap();
    review["request"]["object"]["metadata"]["annotations"] = json!({"big": "a".repeat(300 << 10)});
    review["request"]["oldObject"]["metadata"]["annotations"] =
        json!({"big": "a".repeat(300 << 10)});
    let large = serde_json::to_vec(&review).unwrap();
    assert!(large.len() > FAST_PATH_BODY && small.len() < FAST_PATH_BODY);
    let (a, b) = (validating(&small).unwrap(), validating(&large).unwrap());
    assert_eq!(a.response.allowed, b.response.allowed);
    assert_eq!(a.response.result.message, b.response.result.message);
    assert_eq!(a.access.is_some(), b.access.is_some());
}

#[test]
fn a_status_write_cannot_take_an_unreadable_at_back_to_pending() {
    let stored = json!({"schedule": "2999-01-01T00:00:00Z", "command": "true",
                        "ttlSecondsAfterFinished": 3_000_000_000_i64});
    let mut review: Value =
        serde_json::from_slice(&unreadable_update("m", json!({"phase": "Done"}), stored)).unwrap();
    review["request"]["subResource"] = "status".into();
    let forward = serde_json::to_vec(&review).unwrap();
    assert!(
        validating(&forward).unwrap().response.allowed,
        "Done stays Done"
    );
    for back in [json!({"phase": "Pending"}), json!({})] {
        review["request"]["object"]["status"] = back.clone();
        let verdict = validating(&serde_json::to_vec(&review).unwrap()).unwrap();
        assert!(!verdict.response.allowed, "{back}");
        assert!(verdict
            .response
            .result
            .message
            .starts_with("status.phase: cannot go back"));
    }
}

#[test]
fn a_made_up_create_with_an_unreadable_old_object_is_judged_as_a_create() {
    let mut review: Value =
        serde_json::from_slice(&unreadable_update("m", Value::Null, fixed("x"))).unwrap();
    review["request"]["operation"] = "CREATE".into();
    let verdict = validating(&serde_json::to_vec(&review).unwrap()).unwrap();
    assert!(
        verdict.access.is_some(),
        "a create always asks the escalation guard"
    );
}

/// The verdict of the bounded path (`validating_review`, `judge_lean`) on `body`.
fn judged_lean(body: &[u8]) -> Verdict {
    let (types, request) = validating_review::decode(body).unwrap();
    judge_lean(types, request)
}

#[test]
fn a_v1alpha1_review_takes_the_typed_path_and_gets_the_bounded_path_s_verdict() {
    let mut reviews = Vec::new();
    for name in crate::admission::CAPTURED_REVIEWS {
        if name.starts_with("validating") {
            reviews.push(crate::admission::captured_review(name));
        }
    }
    let update = crate::admission::captured_review("validating-update.json");
    // A bad schedule, in v1alpha1's words; the spec changed once Running; the phase taken back.
    let mut bad = update.clone();
    bad["request"]["object"]["spec"]["schedule"] = json!("tomorrow");
    let mut started = update.clone();
    started["request"]["oldObject"]["status"] = json!({"phase": "RUNNING"});
    started["request"]["object"]["spec"]["image"] = json!("alpine");
    let mut back = crate::admission::captured_review("validating-update-status.json");
    back["request"]["oldObject"]["status"] = json!({"phase": "DONE"});
    back["request"]["object"]["status"] = json!({"phase": "PENDING"});
    // The shard label's value changed.
    let mut relabelled = update.clone();
    relabelled["request"]["oldObject"]["metadata"]["labels"] = json!({crate::shard::LABEL: "7"});
    relabelled["request"]["object"]["metadata"]["labels"] = json!({crate::shard::LABEL: "8"});
    let captured = reviews.len();
    reviews.extend([bad, started, back, relabelled]);
    for (i, review) in reviews.into_iter().enumerate() {
        assert_eq!(review["request"]["kind"]["version"], "v1alpha1");
        let body = serde_json::to_vec(&review).unwrap();
        assert!(names_v1alpha1(&body));
        assert!(typed_v1alpha1(&body).is_some(), "{review}");
        let (typed, lean) = (validating(&body).unwrap(), judged_lean(&body));
        assert_eq!(typed.response.uid, lean.response.uid);
        assert_eq!(typed.response.allowed, lean.response.allowed, "{review}");
        assert_eq!(typed.response.result.message, lean.response.result.message);
        assert_eq!(typed.access, lean.access);
        assert_eq!((typed.operation, &typed.kind), (lean.operation, &lean.kind));
        assert!(i < captured || !typed.response.allowed, "{review}");
        if !typed.response.allowed {
            // In v1alpha1's words: the fields in `spec` itself, the phases in capitals.
            let message = &typed.response.result.message;
            assert!(!message.contains("spec.template"), "{message}");
        }
    }
}

#[test]
fn the_shard_label_of_an_unreadable_at_keeps_its_value_too() {
    let stored = json!({"schedule": "2999-01-01T00:00:00Z", "command": "true",
                        "ttlSecondsAfterFinished": 3_000_000_000_i64});
    let mut review: Value =
        serde_json::from_slice(&unreadable_update("m", json!({"phase": "Done"}), stored)).unwrap();
    review["request"]["oldObject"]["metadata"]["labels"] = json!({crate::shard::LABEL: "7"});
    for (labels, allowed) in [
        (json!({crate::shard::LABEL: "7", "team": "a"}), true),
        (json!({crate::shard::LABEL: "8"}), false),
        (json!({}), false),
    ] {
        review["request"]["object"]["metadata"]["labels"] = labels.clone();
        let verdict = validating(&serde_json::to_vec(&review).unwrap()).unwrap();
        assert_eq!(verdict.response.allowed, allowed, "{labels}");
        if !allowed {
            let message = &verdict.response.result.message;
            assert!(
                message.starts_with(&format!("metadata.labels[{}]: cannot", crate::shard::LABEL)),
                "{message}"
            );
        }
    }
}

#[test]
fn the_call_timeout_is_read_from_go_s_duration_in_the_url() {
    let timeout = |uri: &str| call_timeout(&uri.parse().unwrap());
    assert_eq!(timeout("/validating?timeout=5s"), Duration::from_secs(5));
    assert_eq!(
        timeout("/validating?x=1&timeout=30s"),
        Duration::from_secs(30)
    );
    assert_eq!(timeout("/validating?timeout=1m0s"), Duration::from_secs(60));
    assert_eq!(
        timeout("/validating?timeout=2.5s"),
        Duration::from_millis(2500)
    );
    for unreadable in [
        "/validating",
        "/validating?timeout=5",
        "/validating?timeout=-1s",
        "/validating?timeout=xs",
    ] {
        assert_eq!(timeout(unreadable), DEFAULT_CALL_TIMEOUT, "{unreadable}");
    }
}

#[test]
fn a_busy_review_is_answered_429_only_while_kube_apiserver_can_resend_it_in_time() {
    let s = Duration::from_secs;
    // The default 5 s: the first refusal (no time lost) and a resend a second later, not two.
    assert!(resend(Some(Duration::ZERO), s(5)));
    assert!(resend(Some(Duration::from_millis(1100)), s(5)));
    assert!(!resend(Some(s(2)), s(5)));
    // A first request that waited 2 s before its refusal: denied at once.
    assert!(!resend(Some(s(2)), s(5)));
    // Long timeouts: client-go resends at most 10 times; 5 s after the first at most.
    assert!(resend(Some(Duration::from_millis(4900)), s(30)));
    assert!(!resend(Some(s(5)), s(30)));
    // Not known since when, or not busy: never.
    assert!(!resend(Some(Duration::MAX), s(30)));
    assert!(!resend(None, s(30)));
    // A timeout too short for any resend.
    assert!(!resend(Some(Duration::ZERO), s(3)));
}
