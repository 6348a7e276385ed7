use super::*;
use crate::api::AtSpec;

const BOOK_SCHEDULE: &str = "2019-04-12T10:12:00Z";

fn time(raw: &str) -> DateTime<Utc> {
    schedule::parse(raw, None).unwrap()
}

/// Deciding with no operator defaults.
fn decide(at: &At, pod: &PodObservation, now: DateTime<Utc>) -> Decision {
    super::decide(at, pod, now, &RunPolicy::default())
}

fn at_named(name: &str, schedule: &str, status: Option<AtStatus>) -> At {
    let mut at = At::new(
        name,
        AtSpec {
            schedule: schedule.into(),
            command: "echo YAY".into(),
            template: crate::api::AtPodTemplate {
                image: Some("busybox".into()),
                ..Default::default()
            },
            ..AtSpec::default()
        },
    );
    at.metadata.namespace = Some("default".into());
    at.metadata.uid = Some("uid-1".into());
    at.metadata.generation = Some(1);
    at.status = status;
    at
}

pub(crate) fn at(schedule: &str, status: Option<AtStatus>) -> At {
    at_named("example-at", schedule, status)
}

/// The At after the decided status was written, as the next reconcile sees it.
fn written(mut at: At, decision: &Decision) -> At {
    if let Some(status) = &decision.status {
        at.status = Some(status.clone());
    }
    at
}

fn running_pod() -> PodView {
    PodView {
        name: "example-at-pod".into(),
        created_at: Some(time("2019-04-12T10:12:00.100Z")),
        end: None,
        deleting: false,
        finalizer: true,
        waiting: None,
        running: true,
        active_deadline_seconds: None,
    }
}

fn ended_pod(succeeded: bool, exit_code: Option<i32>, detail: Option<&str>) -> PodView {
    PodView {
        running: false,
        end: Some(PodEnd {
            succeeded,
            exit_code,
            detail: detail.map(str::to_owned),
            pod_reason: None,
            finished_at: Some(time("2019-04-12T10:12:03Z")),
        }),
        ..running_pod()
    }
}

fn condition<'a>(status: &'a AtStatus, type_: &str) -> &'a Condition {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| {
            panic!("no {type_} condition in {:?}", status.conditions);
        })
}

fn status_of(decision: &Decision) -> &AtStatus {
    decision.status.as_ref().expect("a status write")
}

fn note_of(decision: &Decision) -> &Note {
    decision.note.as_ref().expect("an event")
}

#[test]
fn a_future_at_waits_exactly_until_it_is_due() {
    let now = time("2019-04-12T10:11:58.500Z");
    let d = decide(&at(BOOK_SCHEDULE, None), &PodObservation::NotCached, now);
    assert_eq!(d.call, Call::Nothing);
    assert_eq!(d.requeue, Some(Duration::from_millis(1500)));
    let status = status_of(&d);
    assert_eq!(status.phase, Phase::Pending);
    assert_eq!(status.observed_generation, Some(1));
    assert_eq!(
        status.message.as_deref(),
        Some("runs at 2019-04-12T10:12:00Z")
    );
    let scheduled = condition(status, SCHEDULED);
    assert_eq!(
        (scheduled.status.as_str(), scheduled.reason.as_str()),
        ("True", "Scheduled")
    );
    assert_eq!(scheduled.last_transition_time, now);
    assert_eq!(note_of(&d).severity, Severity::Normal);
    assert_eq!(note_of(&d).reason, "Scheduled");
}

#[test]
fn waiting_again_writes_nothing_and_tells_nobody() {
    let first = decide(
        &at(BOOK_SCHEDULE, None),
        &PodObservation::NotCached,
        time("2019-04-12T10:00:00Z"),
    );
    let again = decide(
        &written(at(BOOK_SCHEDULE, None), &first),
        &PodObservation::NotCached,
        time("2019-04-12T10:11:00Z"),
    );
    assert_eq!(
        again,
        Decision {
            call: Call::Nothing,
            status: None,
            note: None,
            requeue: Some(Duration::from_secs(60)),
            retry: false,
        }
    );
}

#[test]
fn a_due_at_creates_its_pod_and_goes_running_without_a_prior_status_write() {
    for now in ["2019-04-12T10:12:00Z", "2026-11-22T00:00:00Z"] {
        let now = time(now);
        let d = decide(&at(BOOK_SCHEDULE, None), &PodObservation::NotCached, now);
        assert_eq!(d.call, Call::CreatePod);
        assert_eq!(d.requeue, None);
        let status = status_of(&d);
        assert_eq!(status.phase, Phase::Running);
        assert_eq!(status.pod_name.as_deref(), Some("example-at-pod"));
        assert_eq!(status.start_time, Some(now));
        assert_eq!(condition(status, SCHEDULED).status, "True");
        assert_eq!(condition(status, POD_CREATED).status, "True");
        assert_eq!(note_of(&d).reason, "PodCreated");
    }
}

#[test]
fn a_pending_at_whose_time_comes_creates_its_pod() {
    let waiting = decide(
        &at(BOOK_SCHEDULE, None),
        &PodObservation::NotCached,
        time("2019-04-12T10:00:00Z"),
    );
    let at = written(at(BOOK_SCHEDULE, None), &waiting);
    let now = time("2019-04-12T10:12:00.001Z");
    let d = decide(&at, &PodObservation::Missing, now);
    assert_eq!(d.call, Call::CreatePod);
    let status = status_of(&d);
    assert_eq!(status.phase, Phase::Running);
    // Still scheduled since the first look: the condition did not transition.
    assert_eq!(
        condition(status, SCHEDULED).last_transition_time,
        time("2019-04-12T10:00:00Z")
    );
    assert_eq!(condition(status, POD_CREATED).last_transition_time, now);
}

#[test]
fn an_unparseable_schedule_is_reported_once_and_waits_for_a_fix() {
    let now = time("2026-11-22T00:00:00Z");
    let bad = at("tomorrow noon", None);
    let d = decide(&bad, &PodObservation::NotCached, now);
    assert_eq!((d.call, d.requeue), (Call::Nothing, None));
    let status = status_of(&d);
    assert_eq!(status.phase, Phase::Pending);
    let scheduled = condition(status, SCHEDULED);
    assert_eq!(
        (scheduled.status.as_str(), scheduled.reason.as_str()),
        ("False", "InvalidSchedule")
    );
    let expected = r#"spec.schedule: "tomorrow noon" is not an RFC 3339 time (expected e.g. 2019-04-12T10:12:00Z)"#;
    assert_eq!(scheduled.message, expected);
    assert_eq!(status.message.as_deref(), Some(expected));
    assert_eq!(note_of(&d).severity, Severity::Warning);

    let again = decide(&written(bad.clone(), &d), &PodObservation::NotCached, now);
    assert_eq!(again, Decision::idle());

    let mut fixed = written(bad, &d);
    fixed.spec.schedule = "2027-01-01T00:00:00Z".into();
    fixed.metadata.generation = Some(2);
    let later = time("2026-11-22T00:05:00Z");
    let d = decide(&fixed, &PodObservation::NotCached, later);
    let status = status_of(&d);
    assert_eq!(status.observed_generation, Some(2));
    let scheduled = condition(status, SCHEDULED);
    assert_eq!(
        (scheduled.status.as_str(), scheduled.last_transition_time),
        ("True", later)
    );
    assert_eq!(scheduled.observed_generation, Some(2));
    assert!(d.requeue.is_some());
}

#[test]
fn a_name_too_long_for_its_pod_label_never_runs() {
    let long = "a".repeat(64);
    let d = decide(
        &at_named(&long, BOOK_SCHEDULE, None),
        &PodObservation::NotCached,
        time("2026-01-01T00:00:00Z"),
    );
    assert_eq!(d.call, Call::Nothing);
    let scheduled = condition(status_of(&d), SCHEDULED);
    assert_eq!(scheduled.reason, "InvalidName");
    assert!(
        scheduled.message.contains("at most 63"),
        "{}",
        scheduled.message
    );
}

#[test]
fn a_pod_this_at_does_not_control_is_never_adopted() {
    let now = time("2026-01-01T00:00:00Z");
    let d = decide(&at(BOOK_SCHEDULE, None), &PodObservation::Foreign, now);
    assert_eq!(d.call, Call::Nothing);
    assert_eq!(d.requeue, Some(CONFLICT_RECHECK));
    let status = status_of(&d);
    assert_eq!(status.phase, Phase::Pending);
    let created = condition(status, POD_CREATED);
    assert_eq!(
        (created.status.as_str(), created.reason.as_str()),
        ("False", "PodNameConflict")
    );
    assert!(created.message.contains("example-at-pod"));
    assert_eq!(note_of(&d).severity, Severity::Warning);

    // Before the schedule is due the conflict does not matter yet.
    let early = decide(
        &at("2027-01-01T00:00:00Z", None),
        &PodObservation::Foreign,
        now,
    );
    assert_eq!(
        status_of(&early).message.as_deref(),
        Some("runs at 2027-01-01T00:00:00Z")
    );
}

#[test]
fn a_pod_the_api_server_rejects_is_reported_without_a_retry_loop() {
    let d = decide(
        &at(BOOK_SCHEDULE, None),
        &PodObservation::Rejected("spec.containers[0].image: Required value".into()),
        time("2026-01-01T00:00:00Z"),
    );
    assert_eq!((d.call, d.requeue), (Call::Nothing, None));
    let created = condition(status_of(&d), POD_CREATED);
    assert_eq!(created.reason, "PodInvalid");
    assert!(created
        .message
        .contains("spec.containers[0].image: Required value"));
}

#[test]
fn an_own_pod_found_while_pending_is_adopted_not_created_again() {
    // The pod was created but the RUNNING write was lost (crash, conflict, failover).
    let pending = decide(
        &at(BOOK_SCHEDULE, None),
        &PodObservation::NotCached,
        time("2019-04-12T10:00:00Z"),
    );
    let at = written(at(BOOK_SCHEDULE, None), &pending);
    let d = decide(
        &at,
        &PodObservation::Owned(running_pod()),
        time("2019-04-12T10:12:05Z"),
    );
    assert_eq!(d.call, Call::Nothing);
    let status = status_of(&d);
    assert_eq!(status.phase, Phase::Running);
    assert_eq!(status.start_time, running_pod().created_at);

    let finished = decide(
        &at,
        &PodObservation::Owned(ended_pod(true, Some(0), None)),
        time("2019-04-12T10:13:00Z"),
    );
    assert_eq!(status_of(&finished).phase, Phase::Done);
    assert_eq!(status_of(&finished).outcome, Some(Outcome::Succeeded));
}

#[test]
fn a_running_at_with_no_cached_pod_asks_the_api_server_first() {
    let created = decide(
        &at(BOOK_SCHEDULE, None),
        &PodObservation::NotCached,
        time("2026-01-01T00:00:00Z"),
    );
    let running = written(at(BOOK_SCHEDULE, None), &created);
    let d = decide(
        &running,
        &PodObservation::NotCached,
        time("2026-01-01T00:00:01Z"),
    );
    assert_eq!(
        d,
        Decision {
            call: Call::LookUpPod,
            ..Decision::idle()
        }
    );
}

fn running_at() -> At {
    let created = decide(
        &at(BOOK_SCHEDULE, None),
        &PodObservation::NotCached,
        time("2026-01-01T00:00:00Z"),
    );
    written(at(BOOK_SCHEDULE, None), &created)
}

#[test]
fn a_running_pod_changes_nothing() {
    let d = decide(
        &running_at(),
        &PodObservation::Owned(running_pod()),
        time("2026-01-01T00:00:01Z"),
    );
    // Nothing to write; look again in a while, in case the pod's deletion is never seen.
    assert_eq!(
        d,
        Decision {
            requeue: Some(RunPolicy::default().running_recheck),
            ..Decision::idle()
        }
    );
}

fn stuck_pod(stuck: pod::Stuck, detail: &str) -> PodView {
    PodView {
        running: false,
        waiting: Some(pod::Waiting {
            stuck,
            detail: detail.into(),
        }),
        ..running_pod()
    }
}

#[test]
fn a_pod_that_cannot_start_shows_on_the_at_once_per_kind_of_trouble_and_clears_when_it_runs() {
    let now = time("2026-01-01T00:00:01Z");
    let pulling = stuck_pod(
        pod::Stuck::ImagePullBackOff,
        "ErrImagePull: failed to pull image \"busybox:9\"",
    );
    let stuck = decide(&running_at(), &PodObservation::Owned(pulling), now);
    let status = status_of(&stuck);
    assert_eq!(status.phase, Phase::Running);
    assert_eq!(status.reason.as_deref(), Some("ImagePullBackOff"));
    let message = "pod example-at-pod cannot start the command: ErrImagePull: failed to pull image \"busybox:9\"";
    assert_eq!(status.message.as_deref(), Some(message));
    let started = condition(status, POD_STARTED);
    assert_eq!(
        (started.status.as_str(), started.reason.as_str()),
        ("False", "ImagePullBackOff")
    );
    assert_eq!(note_of(&stuck).severity, Severity::Warning);
    assert_eq!(note_of(&stuck).reason, "ImagePullBackOff");
    // The kubelet retries, saying it otherwise: nothing to write, nobody told.
    let at = written(running_at(), &stuck);
    let retried = stuck_pod(
        pod::Stuck::ImagePullBackOff,
        "ImagePullBackOff: Back-off pulling image",
    );
    let again = decide(
        &at,
        &PodObservation::Owned(retried),
        time("2026-01-01T00:00:31Z"),
    );
    assert_eq!((again.status, again.note), (None, None));
    // Another kind of trouble: written and told once.
    let config = stuck_pod(
        pod::Stuck::CreateContainerConfigError,
        "CreateContainerConfigError: secret \"x\" not found",
    );
    let other = decide(&at, &PodObservation::Owned(config), now);
    assert_eq!(
        status_of(&other).reason.as_deref(),
        Some("CreateContainerConfigError")
    );
    assert_eq!(note_of(&other).reason, "CreateContainerConfigError");
    // It runs: cleared, told once, then quiet.
    let runs = decide(&at, &PodObservation::Owned(running_pod()), now);
    let status = status_of(&runs);
    assert_eq!(status.reason.as_deref(), Some("PodStarted"));
    let started = condition(status, POD_STARTED);
    assert_eq!(
        (started.status.as_str(), started.reason.as_str()),
        ("True", "PodStarted")
    );
    assert_eq!(note_of(&runs).severity, Severity::Normal);
    let at = written(at, &runs);
    let quiet = decide(&at, &PodObservation::Owned(running_pod()), now);
    assert_eq!((quiet.status, quiet.note), (None, None));
    // And the end is recorded as ever.
    let ended = decide(
        &at,
        &PodObservation::Owned(ended_pod(true, Some(0), None)),
        now,
    );
    assert_eq!(status_of(&ended).phase, Phase::Done);
}

#[test]
fn success_is_recorded_with_exit_code_and_completion_time() {
    let d = decide(
        &running_at(),
        &PodObservation::Owned(ended_pod(true, Some(0), Some("Completed"))),
        time("2026-01-01T00:00:05Z"),
    );
    let status = status_of(&d);
    assert_eq!(status.phase, Phase::Done);
    assert_eq!(status.outcome, Some(Outcome::Succeeded));
    assert_eq!(status.exit_code, Some(0));
    assert_eq!(status.completion_time, Some(time("2019-04-12T10:12:03Z")));
    assert_eq!(status.start_time, Some(time("2026-01-01T00:00:00Z")));
    assert_eq!(
        status.message.as_deref(),
        Some("the command in pod example-at-pod succeeded")
    );
    assert_eq!(condition(status, COMPLETE).status, "True");
    assert!(status.conditions.iter().all(|c| c.type_ != FAILED));
    assert_eq!(note_of(&d).severity, Severity::Normal);
    assert_eq!(note_of(&d).reason, "Succeeded");
}

#[test]
fn a_failing_command_is_recorded_with_its_exit_code_and_message() {
    let d = decide(
        &running_at(),
        &PodObservation::Owned(ended_pod(false, Some(3), Some("Error: boom"))),
        time("2026-01-01T00:00:05Z"),
    );
    let status = status_of(&d);
    assert_eq!(
        (status.phase, status.outcome, status.exit_code),
        (Phase::Done, Some(Outcome::Failed), Some(3))
    );
    let expected = "the command in pod example-at-pod exited with code 3: Error: boom";
    assert_eq!(status.message.as_deref(), Some(expected));
    let failed = condition(status, FAILED);
    assert_eq!(
        (failed.status.as_str(), failed.reason.as_str()),
        ("True", "CommandFailed")
    );
    assert_eq!(note_of(&d).severity, Severity::Warning);
}

#[test]
fn a_pod_that_failed_without_running_the_command_says_why() {
    let d = decide(
        &running_at(),
        &PodObservation::Owned(ended_pod(
            false,
            None,
            Some("Evicted: The node was low on resource: memory."),
        )),
        time("2026-01-01T00:00:05Z"),
    );
    let status = status_of(&d);
    assert_eq!(status.exit_code, None);
    assert_eq!(condition(status, FAILED).reason, "PodFailed");
    assert!(status
        .message
        .as_deref()
        .unwrap()
        .ends_with("Evicted: The node was low on resource: memory."));
}

#[test]
fn a_pod_that_vanishes_is_reported_and_never_recreated() {
    let now = time("2026-01-01T00:00:09Z");
    for (observation, words) in [
        (PodObservation::Missing, "was deleted"),
        (PodObservation::Foreign, "was replaced"),
    ] {
        let d = decide(&running_at(), &observation, now);
        assert_eq!(d.call, Call::Nothing);
        let status = status_of(&d);
        assert_eq!(
            (status.phase, status.outcome),
            (Phase::Done, Some(Outcome::Failed))
        );
        assert_eq!(status.completion_time, Some(now));
        let failed = condition(status, FAILED);
        assert_eq!(failed.reason, "PodLost");
        assert!(failed.message.contains(words) && failed.message.contains("never runs twice"));
    }
}

#[test]
fn done_is_final() {
    let done = decide(
        &running_at(),
        &PodObservation::Missing,
        time("2026-01-01T00:00:09Z"),
    );
    let mut at = written(running_at(), &done);
    at.spec.schedule = "garbage".into();
    at.metadata.generation = Some(7);
    for observation in observations() {
        // Nothing more is written or created; what is left is letting go of its pod.
        let held = matches!(&observation, PodObservation::Owned(view) if view.finalizer);
        let call = if held {
            Call::ReleasePod
        } else {
            Call::Nothing
        };
        assert_eq!(
            decide(&at, &observation, time("2030-01-01T00:00:00Z")),
            Decision {
                call,
                ..Decision::idle()
            },
            "{observation:?}"
        );
    }
}

/// cnat's finalizer keeps a pod until its outcome is recorded, and no longer.
#[test]
fn a_pod_is_let_go_once_its_outcome_is_recorded() {
    let now = time("2026-01-01T00:00:09Z");
    let ended = ended_pod(true, Some(0), None);
    // RUNNING, its pod ended: the decision records the outcome; the pod is kept until then.
    let running = running_at();
    let recording = decide(&running, &PodObservation::Owned(ended.clone()), now);
    assert_eq!(recording.call, Call::Nothing);
    assert_eq!(status_of(&recording).phase, Phase::Done);
    // Recorded: let go.
    let done = written(running.clone(), &recording);
    let release = decide(&done, &PodObservation::Owned(ended.clone()), now);
    assert_eq!(release.call, Call::ReleasePod);
    assert_eq!((release.status, release.note), (None, None));
    // Already let go, or another pod by that name: nothing.
    let free = PodView {
        finalizer: false,
        ..ended.clone()
    };
    assert_eq!(
        decide(&done, &PodObservation::Owned(free), now).call,
        Call::Nothing
    );
    let other = PodView {
        name: "other-pod".into(),
        ..ended.clone()
    };
    assert_eq!(
        decide(&done, &PodObservation::Owned(other), now).call,
        Call::Nothing
    );
    // A RUNNING At's running pod stays held.
    let decided = decide(&running, &PodObservation::Owned(running_pod()), now);
    assert_ne!(decided.call, Call::ReleasePod);
}

fn observations() -> Vec<PodObservation> {
    vec![
        PodObservation::NotCached,
        PodObservation::Missing,
        PodObservation::Foreign,
        PodObservation::Rejected("invalid".into()),
        PodObservation::Refused("exceeded quota".into()),
        PodObservation::Owned(running_pod()),
        PodObservation::Owned(stuck_pod(
            pod::Stuck::ImagePullBackOff,
            "ErrImagePull: pull access denied",
        )),
        PodObservation::Owned(stuck_pod(
            pod::Stuck::Unschedulable,
            "Unschedulable: 0/3 nodes are available",
        )),
        PodObservation::Owned(ended_pod(true, Some(0), None)),
        PodObservation::Owned(ended_pod(false, Some(2), Some("Error"))),
        PodObservation::Owned(ended_pod(false, None, Some("Evicted"))),
        // With a deadline (60 s after 10:12:00.100), running, stuck, and stopped late.
        PodObservation::Owned(PodView {
            active_deadline_seconds: Some(60),
            ..running_pod()
        }),
        PodObservation::Owned(PodView {
            active_deadline_seconds: Some(60),
            ..stuck_pod(pod::Stuck::Unschedulable, "Unschedulable: 0/3 nodes")
        }),
        PodObservation::Owned(PodView {
            active_deadline_seconds: Some(60),
            deleting: true,
            ..ended_pod(false, Some(143), Some("Error"))
        }),
    ]
}

fn rank(phase: Option<Phase>) -> u8 {
    match phase {
        None => 0,
        Some(Phase::Pending) => 1,
        Some(Phase::Running) => 2,
        Some(Phase::Done) => 3,
    }
}

/// Every At a controller can meet: all phases, schedules, names and pod observations.
fn starting_points() -> Vec<At> {
    let mut ats = Vec::new();
    for schedule in [BOOK_SCHEDULE, "2040-01-01T00:00:00+02:00", "not a time", ""] {
        for (name, deadline) in [
            ("example-at", None),
            ("example-at", Some(60)),
            (&*"n".repeat(64), None),
        ] {
            let mut fresh = at_named(name, schedule, None);
            fresh.spec.active_deadline_seconds = deadline;
            ats.push(fresh.clone());
            for observation in observations() {
                for now in ["2019-04-12T10:11:00Z", "2026-01-01T00:00:00Z"] {
                    let d = decide(&fresh, &observation, time(now));
                    let next = written(fresh.clone(), &d);
                    for observation in observations() {
                        let d2 = decide(&next, &observation, time("2026-06-01T00:00:00Z"));
                        ats.push(written(next.clone(), &d2));
                    }
                    ats.push(next);
                }
            }
        }
    }
    ats
}

#[test]
fn invariants_hold_for_every_at_observation_and_time() {
    let mut checked = 0;
    for at in starting_points() {
        let before = at.status.as_ref().map(|s| s.phase);
        let name_ok = pod::check_name(&at.name_any()).is_ok();
        for observation in observations()
            .into_iter()
            .chain([PodObservation::NotCached])
        {
            for now in [
                "2019-04-12T10:11:00Z",
                "2019-04-12T10:12:00Z",
                "2030-01-01T00:00:00Z",
            ] {
                let now = time(now);
                let d = decide(&at, &observation, now);
                let after = d.status.as_ref().map(|s| s.phase).or(before);
                let ctx = format!(
                    "{before:?} {observation:?} {:?} {now} -> {d:?}",
                    at.spec.schedule
                );

                assert!(rank(after) >= rank(before), "phase went back: {ctx}");
                assert_eq!(
                    d.note.is_some(),
                    d.status.is_some(),
                    "event without transition: {ctx}"
                );
                if let Some(requeue) = d.requeue {
                    // Waiting for the schedule or a foreign pod, or re-checking a running pod
                    // (sooner at its deadline).
                    let recheck = after == Some(Phase::Running)
                        && requeue <= RunPolicy::default().running_recheck;
                    assert!(
                        after == Some(Phase::Pending) || recheck,
                        "only waiting or running Ats requeue: {ctx}"
                    );
                }
                if d.call == Call::CreatePod {
                    let due = schedule::parse(&at.spec.schedule, None).map(|t| t <= now);
                    assert!(rank(before) <= 1 && name_ok && due == Ok(true), "{ctx}");
                    assert!(
                        matches!(
                            observation,
                            PodObservation::NotCached | PodObservation::Missing
                        ),
                        "created over an existing pod: {ctx}"
                    );
                    assert_eq!(after, Some(Phase::Running), "{ctx}");
                }
                if d.call == Call::DeletePod {
                    let PodObservation::Owned(view) = &observation else {
                        panic!("deleted a pod it does not control: {ctx}");
                    };
                    let status = d.status.as_ref().expect(&ctx);
                    assert!(
                        view.end.is_none()
                            && view.active_deadline_seconds.is_some()
                            && status.phase == Phase::Done
                            && status.reason.as_deref() == Some("DeadlineExceeded"),
                        "{ctx}"
                    );
                }
                if d.call == Call::LookUpPod {
                    assert_eq!(
                        (before, &observation),
                        (Some(Phase::Running), &PodObservation::NotCached),
                        "{ctx}"
                    );
                    continue;
                }
                if let Some(status) = &d.status {
                    assert_eq!(status.observed_generation, at.metadata.generation, "{ctx}");
                    if status.phase != Phase::Pending {
                        assert_eq!(
                            status.pod_name.as_deref(),
                            Some(pod::name_for(&at.name_any()).as_str()),
                            "{ctx}"
                        );
                    }
                    if status.phase == Phase::Done {
                        assert!(
                            status.outcome.is_some() && status.completion_time.is_some(),
                            "{ctx}"
                        );
                    }
                }
                // Level-based: deciding again on what was written changes nothing more.
                let next_observation = match (d.call, &observation) {
                    (Call::CreatePod, _) => PodObservation::Owned(running_pod()),
                    (Call::DeletePod, PodObservation::Owned(view)) => {
                        PodObservation::Owned(PodView {
                            deleting: true,
                            ..view.clone()
                        })
                    }
                    _ => observation.clone(),
                };
                let again = decide(&written(at.clone(), &d), &next_observation, now);
                assert_eq!(
                    (again.status, again.note),
                    (None, None),
                    "not a fixed point: {ctx}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 10_000, "{checked}");
}

mod production {
    //! Pod settings, refusals, deadlines, TTL and time zones.

    use super::*;

    fn fixture_message(name: &str) -> String {
        let path = format!(
            "{}/tests/fixtures/api-k8s-1.24/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        let status: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        status["message"].as_str().unwrap().to_owned()
    }

    fn with_spec(f: impl FnOnce(&mut AtSpec)) -> At {
        let mut at = at(BOOK_SCHEDULE, None);
        f(&mut at.spec);
        at
    }

    #[test]
    fn a_refused_pod_is_shown_once_per_distinct_refusal_and_retried_with_backoff() {
        let now = time("2026-01-01T00:00:00Z");
        for (file, advice) in [
            (
                "status-403-forbidden-quota-requires-limits.json",
                "set spec.template.resources",
            ),
            ("status-403-forbidden-quota-exceeded.json", "is used up"),
            (
                "status-403-forbidden-pod-security.json",
                "pod-security.kubernetes.io/enforce",
            ),
        ] {
            let reason = fixture_message(file);
            let refused = PodObservation::Refused(reason.clone());
            let d = decide(&at(BOOK_SCHEDULE, None), &refused, now);
            assert!(d.retry, "{file}: retried with backoff");
            assert_eq!((d.call, d.requeue), (Call::Nothing, None));
            let status = status_of(&d);
            assert_eq!(status.phase, Phase::Pending);
            assert_eq!(status.reason.as_deref(), Some("PodForbidden"));
            let created = condition(status, POD_CREATED);
            assert_eq!(
                (created.status.as_str(), created.reason.as_str()),
                ("False", "PodForbidden")
            );
            let message = status.message.as_deref().unwrap();
            assert!(message.contains(&reason), "{file}: {message}");
            assert!(message.contains(advice), "{file}: {message}");
            assert_eq!(note_of(&d).severity, Severity::Warning);

            // The same refusal again: nothing written, no second event, still retried.
            let again = decide(&written(at(BOOK_SCHEDULE, None), &d), &refused, now);
            assert_eq!(
                (again.status.is_none(), again.note.is_none(), again.retry),
                (true, true, true)
            );

            // Then the pod is created: the condition turns True.
            let created = decide(
                &written(at(BOOK_SCHEDULE, None), &d),
                &PodObservation::NotCached,
                now,
            );
            assert_eq!(created.call, Call::CreatePod);
            let c = condition(status_of(&created), POD_CREATED);
            assert_eq!(
                (c.status.as_str(), c.reason.as_str()),
                ("True", "PodCreated")
            );
        }
        // A different refusal is a new event.
        let first = decide(
            &at(BOOK_SCHEDULE, None),
            &PodObservation::Refused(fixture_message("status-403-forbidden-quota-exceeded.json")),
            now,
        );
        let second = decide(
            &written(at(BOOK_SCHEDULE, None), &first),
            &PodObservation::Refused(fixture_message("status-403-forbidden-pod-security.json")),
            now,
        );
        assert!(second.note.is_some());
    }

    #[test]
    fn an_at_that_could_not_start_before_its_starting_deadline_is_missed() {
        let late = with_spec(|s| s.starting_deadline_seconds = Some(60));
        // Within the deadline: it runs.
        let d = decide(
            &late,
            &PodObservation::NotCached,
            time("2019-04-12T10:13:00Z"),
        );
        assert_eq!(d.call, Call::CreatePod);
        // Past it: first make sure no pod exists (the cache lags) ...
        let after = time("2019-04-12T10:13:01Z");
        let d = decide(&late, &PodObservation::NotCached, after);
        assert_eq!((d.call, d.status.is_none()), (Call::LookUpPod, true));
        // ... a pod that does exist is reported, not missed ...
        let d = decide(&late, &PodObservation::Owned(running_pod()), after);
        assert_eq!(status_of(&d).phase, Phase::Running);
        // ... and without one it never runs.
        for observation in [
            PodObservation::Missing,
            PodObservation::Refused("exceeded quota".into()),
            PodObservation::Rejected("invalid".into()),
            PodObservation::Foreign,
        ] {
            let d = decide(&late, &observation, after);
            assert_eq!(d.call, Call::Nothing, "{observation:?}");
            let status = status_of(&d);
            assert_eq!(
                (status.phase, status.outcome),
                (Phase::Done, Some(Outcome::Missed))
            );
            assert_eq!(status.reason.as_deref(), Some("MissedDeadline"));
            assert_eq!(status.completion_time, Some(after));
            assert_eq!(condition(status, FAILED).reason, "MissedDeadline");
            let note = note_of(&d);
            assert_eq!(
                (note.severity, note.reason),
                (Severity::Warning, "MissedDeadline")
            );
            assert!(
                note.message.contains("spec.startingDeadlineSeconds (60 s)"),
                "{}",
                note.message
            );
        }
        // Without a deadline (the book's behaviour) it runs however late.
        let d = decide(
            &at(BOOK_SCHEDULE, None),
            &PodObservation::Missing,
            time("2030-01-01T00:00:00Z"),
        );
        assert_eq!(d.call, Call::CreatePod);
        // The operator's default applies when the At has none; the At's own wins.
        let policy = RunPolicy {
            starting_deadline_seconds: Some(0),
            ..RunPolicy::default()
        };
        let d = super::super::decide(
            &at(BOOK_SCHEDULE, None),
            &PodObservation::Missing,
            after,
            &policy,
        );
        assert_eq!(status_of(&d).outcome, Some(Outcome::Missed));
        let own = with_spec(|s| s.starting_deadline_seconds = Some(3600));
        let d = super::super::decide(&own, &PodObservation::Missing, after, &policy);
        assert_eq!(d.call, Call::CreatePod);
    }

    #[test]
    fn cnat_deletes_a_pod_at_its_active_deadline_whether_it_runs_or_never_started() {
        let with_deadline = |view: PodView| PodView {
            active_deadline_seconds: Some(30),
            ..view
        };
        let at = at(BOOK_SCHEDULE, None);
        // The deadline counts from the pod's start (10:12:00.100).
        let before = time("2019-04-12T10:12:30Z");
        let at_deadline = time("2019-04-12T10:12:30.100Z");
        let unschedulable = stuck_pod(pod::Stuck::Unschedulable, "Unschedulable: 0/1 nodes");
        for view in [running_pod(), unschedulable].map(with_deadline) {
            let observed = PodObservation::Owned(view.clone());
            let d = decide(&at, &observed, before);
            assert_eq!(d.call, Call::Nothing, "{view:?}");
            assert_eq!(
                d.requeue,
                Some(Duration::from_millis(100)),
                "looks again at it"
            );
            let running = written(at.clone(), &d);
            let d = decide(&running, &observed, at_deadline);
            assert_eq!(d.call, Call::DeletePod, "{view:?}");
            let status = status_of(&d);
            assert_eq!(
                (status.phase, status.outcome, status.exit_code),
                (Phase::Done, Some(Outcome::Failed), None)
            );
            assert_eq!(status.reason.as_deref(), Some("DeadlineExceeded"));
            assert_eq!(status.completion_time, Some(at_deadline));
            let message = status.message.as_deref().unwrap();
            assert!(
                message.contains(
                    "pod example-at-pod did not finish within spec.activeDeadlineSeconds (30 s)"
                ) && message.contains("Raise activeDeadlineSeconds"),
                "{message}"
            );
            assert_eq!(condition(status, FAILED).reason, "DeadlineExceeded");
            assert_eq!(condition(status, POD_CREATED).status, "True");
            assert_eq!(d.note.as_ref().unwrap().severity, Severity::Warning);
            // The pod being deleted: recorded, so cnat's finalizer goes and nothing else.
            let deleting = PodObservation::Owned(PodView {
                deleting: true,
                ..view.clone()
            });
            let again = decide(&written(running.clone(), &d), &deleting, at_deadline);
            assert_eq!((again.call, again.status), (Call::ReleasePod, None));
            // The DONE write lost after the delete: the pod, ended by its stop (SIGTERM: 143)
            // past the deadline, is still recorded as past its deadline, with its exit code.
            let mut stopped = with_deadline(PodView {
                deleting: true,
                ..ended_pod(false, Some(143), Some("Error"))
            });
            stopped.end.as_mut().unwrap().finished_at = Some(time("2019-04-12T10:12:31Z"));
            let stopped = PodObservation::Owned(stopped);
            let late = time("2019-04-12T10:12:45Z");
            let d = decide(&running, &stopped, late);
            let status = status_of(&d);
            assert_eq!(d.call, Call::Nothing);
            assert_eq!(
                (status.reason.as_deref(), status.exit_code),
                (Some("DeadlineExceeded"), Some(143))
            );
        }
        // The deadline is the pod's own: a later change of the At's spec (or of the operator's
        // default) does not move it.
        let edited = with_spec(|s| s.active_deadline_seconds = Some(1));
        let policy = RunPolicy {
            active_deadline_seconds: Some(1),
            ..RunPolicy::default()
        };
        let running = PodObservation::Owned(running_pod());
        let d = super::super::decide(&edited, &running, at_deadline, &policy);
        assert_eq!(d.call, Call::Nothing);
        // A pod that ended before its deadline is recorded as it ended, deleted or not.
        for deleting in [false, true] {
            let ended = PodObservation::Owned(PodView {
                deleting,
                ..with_deadline(ended_pod(true, Some(0), None))
            });
            let d = decide(&at, &ended, at_deadline);
            assert_eq!(
                (d.call, status_of(&d).outcome),
                (Call::Nothing, Some(Outcome::Succeeded))
            );
        }
    }

    #[test]
    fn started_is_said_only_once_the_pod_runs_after_it_was_stuck() {
        let now = time("2026-01-01T00:00:01Z");
        let stuck = stuck_pod(pod::Stuck::CreateContainerConfigError, "secret x not found");
        let d = decide(&at(BOOK_SCHEDULE, None), &PodObservation::Owned(stuck), now);
        let was_stuck = written(at(BOOK_SCHEDULE, None), &d);
        // Creating its container now: on its way, nothing said yet.
        let creating = PodView {
            running: false,
            ..running_pod()
        };
        let d = decide(&was_stuck, &PodObservation::Owned(creating), now);
        assert_eq!((d.status, d.note), (None, None));
        let d = decide(&was_stuck, &PodObservation::Owned(running_pod()), now);
        assert_eq!(condition(status_of(&d), POD_STARTED).status, "True");
        // Run and ended between two looks: it started, and the event is its end's.
        let ended = ended_pod(true, Some(0), None);
        let d = decide(&was_stuck, &PodObservation::Owned(ended), now);
        assert_eq!(condition(status_of(&d), POD_STARTED).status, "True");
        assert_eq!(d.note.unwrap().reason, "Succeeded");
        // Ended without a command (no exit code: evicted while stuck): it never started.
        let evicted = ended_pod(false, None, Some("Evicted"));
        let d = decide(&was_stuck, &PodObservation::Owned(evicted), now);
        assert_eq!(condition(status_of(&d), POD_STARTED).status, "False");
    }

    #[test]
    fn a_command_stopped_by_its_active_deadline_fails_with_deadline_exceeded() {
        let timed = with_spec(|s| s.active_deadline_seconds = Some(30));
        let mut pod = ended_pod(false, Some(137), Some("Error"));
        pod.end.as_mut().unwrap().pod_reason = Some("DeadlineExceeded".into());
        let d = decide(
            &timed,
            &PodObservation::Owned(pod),
            time("2019-04-12T10:13:00Z"),
        );
        let status = status_of(&d);
        assert_eq!(
            (status.phase, status.outcome),
            (Phase::Done, Some(Outcome::Failed))
        );
        assert_eq!(status.reason.as_deref(), Some("DeadlineExceeded"));
        assert!(
            status
                .message
                .as_deref()
                .unwrap()
                .contains("ran longer than spec.activeDeadlineSeconds (30 s)"),
            "{:?}",
            status.message
        );
    }

    #[test]
    fn a_finished_at_is_deleted_after_its_ttl() {
        let done_at = time("2019-04-12T10:12:03Z");
        let mut finished = with_spec(|s| s.ttl_seconds_after_finished = Some(100));
        finished.status = Some(AtStatus {
            phase: Phase::Done,
            completion_time: Some(done_at),
            outcome: Some(Outcome::Succeeded),
            ..AtStatus::default()
        });
        let d = decide(
            &finished,
            &PodObservation::NotCached,
            done_at + chrono::Duration::seconds(40),
        );
        assert_eq!(
            d,
            Decision {
                requeue: Some(Duration::from_secs(60)),
                ..Decision::idle()
            }
        );
        let d = decide(
            &finished,
            &PodObservation::NotCached,
            done_at + chrono::Duration::seconds(100),
        );
        assert_eq!(d.call, Call::DeleteAt);
        assert_eq!(d.status, None, "nothing written to an At about to go");
        // No TTL: DONE Ats stay; the operator's default applies when the At has none.
        let mut kept = finished.clone();
        kept.spec.ttl_seconds_after_finished = None;
        let far = done_at + chrono::Duration::days(365);
        assert_eq!(
            decide(&kept, &PodObservation::NotCached, far),
            Decision::idle()
        );
        let policy = RunPolicy {
            ttl_seconds_after_finished: Some(0),
            ..RunPolicy::default()
        };
        let d = super::super::decide(&kept, &PodObservation::NotCached, far, &policy);
        assert_eq!(d.call, Call::DeleteAt);
    }

    #[test]
    fn a_schedule_in_a_time_zone_resolves_to_an_instant_shown_in_status() {
        let berlin = with_spec(|s| {
            s.schedule = "2019-04-12T12:12:00".into();
            s.time_zone = Some("Europe/Berlin".into());
        });
        let d = decide(
            &berlin,
            &PodObservation::NotCached,
            time("2019-04-12T10:00:00Z"),
        );
        let status = status_of(&d);
        assert_eq!(status.scheduled_time, Some(time(BOOK_SCHEDULE)));
        assert_eq!(d.requeue, Some(Duration::from_secs(12 * 60)));
        assert_eq!(
            status.message.as_deref(),
            Some("runs at 2019-04-12T10:12:00Z")
        );

        let unknown = with_spec(|s| {
            s.schedule = "2019-04-12T12:12:00".into();
            s.time_zone = Some("Europe/Atlantis".into());
        });
        let d = decide(
            &unknown,
            &PodObservation::NotCached,
            time("2019-04-12T10:00:00Z"),
        );
        assert_eq!(d.call, Call::Nothing);
        assert_eq!(status_of(&d).reason.as_deref(), Some("InvalidTimeZone"));
        assert!(status_of(&d)
            .message
            .as_deref()
            .unwrap()
            .starts_with("spec.timeZone"));

        let gap = with_spec(|s| {
            s.schedule = "2026-03-29T02:30:00".into();
            s.time_zone = Some("Europe/Berlin".into());
        });
        let d = decide(
            &gap,
            &PodObservation::NotCached,
            time("2026-01-01T00:00:00Z"),
        );
        assert_eq!(status_of(&d).reason.as_deref(), Some("InvalidSchedule"));
    }
}

#[test]
fn the_poison_at_gets_invalid_spec_instead_of_a_panic() {
    // Stored before the bounds existed: the reproduction from the issue.
    let mut poison = at("2020-01-01T00:00:00Z", None);
    poison.spec.starting_deadline_seconds = Some(10_000_000_000_000);
    let d = decide(
        &poison,
        &PodObservation::NotCached,
        time("2026-11-24T00:00:00Z"),
    );
    assert_eq!((d.call, d.requeue, d.retry), (Call::Nothing, None, false));
    let status = status_of(&d);
    assert_eq!(status.phase, Phase::Pending);
    assert_eq!(status.reason.as_deref(), Some("InvalidSpec"));
    let message = status.message.as_deref().unwrap();
    assert!(
        message.starts_with("spec.startingDeadlineSeconds: 10000000000000 is out of range"),
        "{message}"
    );
    assert!(message.contains("fix the field"), "{message}");
    assert_eq!(note_of(&d).severity, Severity::Warning);
    // Reported once: the written status decides nothing more.
    let again = decide(
        &written(poison, &d),
        &PodObservation::NotCached,
        time("2026-11-24T00:00:01Z"),
    );
    assert_eq!(again, Decision::idle());
}

#[test]
fn extreme_values_in_range_decide_without_overflow() {
    let max = Some(crate::limits::MAX_SECONDS);
    for schedule in ["0000-01-01T00:00:00Z", "9999-12-31T23:59:59.999999999Z"] {
        let mut extreme = at(schedule, None);
        extreme.spec.starting_deadline_seconds = max;
        extreme.spec.active_deadline_seconds = max;
        extreme.spec.ttl_seconds_after_finished = Some(i32::MAX);
        for now in [
            "0000-01-01T00:00:00Z",
            "2026-11-24T00:00:00Z",
            "9999-12-31T23:59:59Z",
        ] {
            let d = decide(&extreme, &PodObservation::NotCached, time(now));
            // Either a status (scheduled, or due: running), or, past the deadline, a look for
            // a pod before it is reported missed.
            assert!(
                d.status.is_some() || d.call == Call::LookUpPod,
                "{schedule} at {now}: {d:?}"
            );
        }
    }
    // A DONE At whose completion plus TTL is past what a time can hold never expires.
    let mut done = at(BOOK_SCHEDULE, None);
    done.spec.ttl_seconds_after_finished = Some(i32::MAX);
    done.status = Some(AtStatus {
        phase: Phase::Done,
        completion_time: Some(DateTime::<Utc>::MAX_UTC),
        ..AtStatus::default()
    });
    assert_eq!(
        decide(&done, &PodObservation::NotCached, DateTime::<Utc>::MAX_UTC),
        Decision::idle()
    );
}

#[test]
fn a_failed_command_s_output_is_on_the_at_but_not_in_the_log_summary() {
    let view = ended_pod(false, Some(3), Some("Error: password=hunter2"));
    let d = decide(
        &running_at(),
        &PodObservation::Owned(view),
        time("2019-04-12T10:12:05Z"),
    );
    let note = note_of(&d);
    assert!(note.message.contains("hunter2"), "{}", note.message);
    assert!(status_of(&d)
        .message
        .as_deref()
        .unwrap()
        .contains("hunter2"));
    assert!(!note.summary.contains("hunter2"), "{}", note.summary);
    assert!(
        note.summary.contains("exited with code 3"),
        "{}",
        note.summary
    );
}

fn deleting(mut view: PodView) -> PodView {
    view.deleting = true;
    view
}

#[test]
fn a_deleted_pod_is_released_only_once_the_status_names_it() {
    let now = time("2019-04-12T10:12:05Z");
    // PENDING (the RUNNING write was lost with the old leader): record the pod first.
    let pending = at(BOOK_SCHEDULE, None);
    let d = decide(
        &pending,
        &PodObservation::Owned(deleting(running_pod())),
        now,
    );
    assert_eq!(d.call, Call::Nothing);
    assert_eq!(status_of(&d).phase, Phase::Running);
    assert_eq!(status_of(&d).pod_name.as_deref(), Some("example-at-pod"));
    // RUNNING with the pod named: the finalizer can go.
    let recorded = written(pending, &d);
    let d = decide(
        &recorded,
        &PodObservation::Owned(deleting(running_pod())),
        now,
    );
    assert_eq!(d.call, Call::ReleasePod);
    assert_eq!(d.status, None);
    // A pod that ended while being deleted: its outcome is recorded before the release.
    let ended = deleting(ended_pod(true, Some(0), None));
    let d = decide(&recorded, &PodObservation::Owned(ended.clone()), now);
    assert_eq!((d.call, status_of(&d).phase), (Call::Nothing, Phase::Done));
    let done = written(recorded.clone(), &d);
    assert_eq!(
        decide(&done, &PodObservation::Owned(ended), now).call,
        Call::ReleasePod
    );
    // Not being deleted, or without the finalizer: nothing to release.
    let d = decide(&recorded, &PodObservation::Owned(running_pod()), now);
    assert_eq!(d.call, Call::Nothing);
    let mut free = deleting(running_pod());
    free.finalizer = false;
    assert_eq!(
        decide(&recorded, &PodObservation::Owned(free), now).call,
        Call::Nothing
    );
    // An At that is itself being deleted lets its pod go at once.
    let mut going = at(BOOK_SCHEDULE, None);
    going.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
    ));
    let d = decide(&going, &PodObservation::Owned(deleting(running_pod())), now);
    assert_eq!(d.call, Call::ReleasePod);
}

/// The cache's dictionary (`cache::pack`) must keep matching the statuses `decide` writes: an
/// At through its whole life, as cached, packs to at most 60% of what LZ4 alone makes of its
/// JSON (printed with `--nocapture`; without a matching dictionary it would be about as much),
/// and reads back.
#[test]
fn the_cache_packs_an_at_to_a_fraction_of_lz4_alone_in_every_phase() {
    use crate::operator::cache::CachedAt;
    let mut at = at(BOOK_SCHEDULE, None);
    at.metadata.uid = Some("5f2c7a9e-81d3-4b6f-a0e2-3c9d8b7f6e51".into());
    at.metadata.resource_version = Some("1048576".into());
    at.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2019-04-12T09:58:41Z".parse().unwrap(),
    ));
    let steps = [
        (PodObservation::NotCached, time("2019-04-12T10:00:00Z")),
        (PodObservation::Missing, time("2019-04-12T10:12:00.003Z")),
        (
            PodObservation::Owned(ended_pod(true, Some(0), None)),
            time("2019-04-12T10:12:04Z"),
        ),
    ];
    let mut phases = Vec::new();
    for (pod, now) in steps {
        let decided = decide(&at, &pod, now);
        at = written(at, &decided);
        phases.push(at.phase());
        let cached = CachedAt::from(at.clone());
        let (packed, alone) = cached.packed_sizes();
        println!("{:?}: {packed} bytes packed, LZ4 alone {alone}", at.phase());
        assert!(
            packed * 5 <= alone * 3,
            "{:?}: {packed} bytes packed, LZ4 alone {alone}",
            at.phase()
        );
        let read = cached.at().unwrap();
        assert_eq!(
            (&read.metadata, &read.spec, &read.status),
            (&at.metadata, &at.spec, &at.status)
        );
    }
    assert_eq!(phases, [Phase::Pending, Phase::Running, Phase::Done]);
}
