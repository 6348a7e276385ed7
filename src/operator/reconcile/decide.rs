//! The At state machine, pure: the At, what is known of its pod and the time now decide the next
//! step (PENDING -> RUNNING -> DONE; the pod is created before RUNNING is written).
//! See docs/src/design/decisions.md, "Functional core, imperative shell" and "Never twice".

use crate::api::{At, AtStatus, Condition, Outcome, Phase};
use crate::operator::finalizer::{self, Candidate, Recorder};
use crate::operator::pod::{self, PodEnd, PodView, Waiting};
use crate::operator::policy::RunPolicy;
use crate::{limits, schedule};
use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use kube::ResourceExt;
use std::time::Duration;

/// Condition types.
pub const SCHEDULED: &str = "Scheduled";
pub const POD_CREATED: &str = "PodCreated";
/// `PodStarted` lives beside the kinds of trouble it names (`pod::POD_STARTED`).
pub use crate::operator::pod::POD_STARTED;
pub const COMPLETE: &str = "Complete";
pub const FAILED: &str = "Failed";

/// How often an At blocked by a pod it does not control looks again; deleting that pod usually
/// triggers a reconcile sooner.
pub const CONFLICT_RECHECK: Duration = Duration::from_secs(60);

/// What is known of the pod named after the At.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodObservation {
    /// Not in the cache; it may still exist (the cache lags the API server).
    NotCached,
    /// The API server says it does not exist.
    Missing,
    /// It exists and this At controls it.
    Owned(PodView),
    /// It exists and this At does not control it.
    Foreign,
    /// The API server found the pod invalid (HTTP 400 or 422), with this reason: a spec problem.
    Rejected(String),
    /// The API server refused the pod (HTTP 403: quota, Pod Security, a policy webhook), with
    /// this reason: may pass later, so it is retried with backoff.
    Refused(String),
}

/// The one API call a reconcile needs next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Nothing,
    /// Create the pod, then write the decided status.
    CreatePod,
    /// Ask the API server whether the pod exists, then decide again.
    LookUpPod,
    /// Delete the At (its pod goes with it): `ttlSecondsAfterFinished` has passed.
    DeleteAt,
    /// Remove cnat's finalizer from the pod, which is being deleted: the At's status records it
    /// (or the At is going too), so nothing depends on the pod object any more.
    ReleasePod,
    /// Delete the pod (`activeDeadlineSeconds` passed before it ended), then write the decided
    /// status.
    DeletePod,
}

/// Severity of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Normal,
    Warning,
}

/// An event to publish on the At, and the log line that goes with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub severity: Severity,
    pub reason: &'static str,
    /// For the At's status and event: may quote the command's output.
    pub message: String,
    /// For the operator's log: the message without the command's output.
    pub summary: String,
}

/// The outcome of one decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub call: Call,
    /// The status to write, only when it differs from the current one.
    pub status: Option<AtStatus>,
    /// The event of this transition, only when the status changes.
    pub note: Option<Note>,
    /// When to look again without any change; `None` waits for a change of the At or its pod.
    pub requeue: Option<Duration>,
    /// Retry with backoff after writing the status: the API server refused the pod.
    pub retry: bool,
}

impl Decision {
    fn idle() -> Self {
        Decision {
            call: Call::Nothing,
            status: None,
            note: None,
            requeue: None,
            retry: false,
        }
    }
}

/// Decides the next step for `at` given what is known of its pod at time `now`, with `policy`
/// supplying what the At leaves out.
pub fn decide(at: &At, pod: &PodObservation, now: DateTime<Utc>, policy: &RunPolicy) -> Decision {
    let decision = match at.status.as_ref().map(|s| s.phase) {
        Some(Phase::Done) => finished(at, now, policy),
        Some(Phase::Running) => running(at, pod, now, policy),
        Some(Phase::Pending) | None => pending(at, pod, now, policy),
    };
    match pod {
        PodObservation::Owned(view) if releases(at, view, &decision) => Decision {
            call: Call::ReleasePod,
            ..decision
        },
        _ => decision,
    }
}

/// Whether cnat's finalizer on `view` goes now (`finalizer::may_go`, this reconcile recording):
/// "settled" when this decision writes nothing more.
fn releases(at: &At, view: &PodView, decision: &Decision) -> bool {
    let candidate = Candidate {
        name: &view.name,
        deleting: view.deleting,
        controller: at.metadata.uid.as_deref(),
    };
    let settled = decision.status.is_none() && decision.call == Call::Nothing;
    view.finalizer && finalizer::may_go(candidate, Some(at), Recorder::Leader { settled })
}

fn pending(at: &At, pod: &PodObservation, now: DateTime<Utc>, policy: &RunPolicy) -> Decision {
    let next = Next::new(at, Phase::Pending, now);
    if let Err(err) = pod::check_name(&at.name_any()) {
        return next.invalid("InvalidName", err.to_string());
    }
    if let PodObservation::Owned(view) = pod {
        return from_pod(at, view, now, policy);
    }
    let due = match due_instant(at) {
        Ok(due) => due,
        Err((reason, message)) => return next.invalid(reason, message),
    };
    let mut next = next;
    next.status.scheduled_time = Some(due);
    if let Some(left) = schedule::until_due(due, now) {
        let message = runs_at(due);
        return next
            .condition(SCHEDULED, true, "Scheduled", &message)
            .note(Severity::Normal, "Scheduled", message)
            .decide(Call::Nothing, Some(left));
    }
    // An At being deleted starts nothing (its pod would be orphaned at once, and cnat's
    // finalizer on that pod is already let go).
    if at.metadata.deletion_timestamp.is_some() {
        return Decision::idle();
    }
    let deadline = at
        .spec
        .starting_deadline_seconds
        .or(policy.starting_deadline_seconds);
    if let Some(seconds) = deadline.filter(|s| after(due, *s).is_some_and(|end| now > end)) {
        return match pod {
            // It may exist already (the cache lags): a pod that runs must be reported, not missed.
            PodObservation::NotCached => Decision {
                call: Call::LookUpPod,
                ..Decision::idle()
            },
            _ => missed(at, now, due, seconds),
        };
    }
    due_now(at, pod, next, due, now)
}

/// The instant a PENDING At is due, or why it cannot run as stored (a reason and a message):
/// a spec outside the CRD's bounds, a schedule or time zone that does not parse.
fn due_instant(at: &At) -> Result<DateTime<Utc>, (&'static str, String)> {
    let out_of_range = limits::problems(&at.spec, |_| true);
    if !out_of_range.is_empty() {
        let message = format!(
            "{}; cnat does not run an At with a value outside its range: fix the field (kubectl edit) and it runs",
            out_of_range.join("; ")
        );
        return Err(("InvalidSpec", message));
    }
    match schedule::parse(&at.spec.schedule, at.spec.time_zone.as_deref()) {
        Ok(due) => Ok(due),
        Err(err @ schedule::ScheduleError::UnknownZone(_)) => {
            Err(("InvalidTimeZone", err.to_string()))
        }
        Err(err) => Err(("InvalidSchedule", err.to_string())),
    }
}

/// A PENDING At that is due (`due`) and not past its starting deadline: its pod is created,
/// or what stands in the way (a foreign pod, a refusal) is recorded.
fn due_now(
    at: &At,
    pod: &PodObservation,
    next: Next,
    due: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Decision {
    let pod_name = pod::name_for(&at.name_any());
    match pod {
        PodObservation::Foreign => {
            let message = format!(
                "pod {pod_name} already exists and was not created by cnat for this At (it is not controlled by this At, or lacks cnat's signature); cnat never adopts a pod it did not create. Delete or rename that pod and this At runs"
            );
            next.condition(POD_CREATED, false, "PodNameConflict", &message)
                .note(Severity::Warning, "PodNameConflict", message)
                .decide(Call::Nothing, Some(CONFLICT_RECHECK))
        }
        PodObservation::Rejected(reason) => {
            let message = format!(
                "the API server rejected pod {pod_name} as invalid: {reason}; fix the At's spec and apply it again"
            );
            next.condition(POD_CREATED, false, "PodInvalid", &message)
                .note(Severity::Warning, "PodInvalid", message)
                .decide(Call::Nothing, None)
        }
        PodObservation::Refused(reason) => {
            let message = format!(
                "the API server refused pod {pod_name}: {reason}; {}",
                refusal_advice(reason)
            );
            let mut decision = next
                .condition(POD_CREATED, false, "PodForbidden", &message)
                .note(Severity::Warning, "PodForbidden", message)
                .decide(Call::Nothing, None);
            decision.retry = true;
            decision
        }
        _ => {
            let mut next = Next::new(at, Phase::Running, now).condition(
                SCHEDULED,
                true,
                "Scheduled",
                &runs_at(due),
            );
            next.status.scheduled_time = Some(due);
            next.status.start_time = Some(now);
            next.started(&pod_name).decide(Call::CreatePod, None)
        }
    }
}

/// Whether the API server's copy of an At (`fresh`; `None`: gone) confirms a decision made on
/// `cached` to create its pod: the same At (uid), not being deleted, its spec and shard label
/// value unchanged, and not started (PENDING or no status yet).
pub fn confirms_create(cached: &At, fresh: Option<&At>) -> bool {
    let value = |at: &At| crate::shard::value_of(at.metadata.labels.as_ref());
    fresh.is_some_and(|fresh| {
        fresh.metadata.uid == cached.metadata.uid
            && fresh.metadata.deletion_timestamp.is_none()
            && fresh.spec == cached.spec
            && value(fresh) == value(cached)
            && fresh
                .status
                .as_ref()
                .is_none_or(|s| s.phase == Phase::Pending)
    })
}

/// What to do about a pod the API server refused (HTTP 403), judged from its message.
fn refusal_advice(reason: &str) -> &'static str {
    match Refusal::of(reason) {
        Refusal::QuotaNeedsResources => "set spec.template.resources (requests and limits for what the quota names), or have the operator default them (cnat run --default-requests / --default-limits); cnat retries with backoff",
        Refusal::QuotaExceeded => "the namespace's ResourceQuota is used up; cnat retries with backoff until it frees up, or raise the quota",
        Refusal::PodSecurity => "the namespace's Pod Security admission refused it; cnat retries with backoff, so relax the namespace's pod-security.kubernetes.io/enforce level or ask its administrator",
        Refusal::Policy => "a quota or admission policy refused it; cnat retries with backoff, so fix what the message names",
    }
}

/// Why the API server refused (403) a pod, from its message: the kinds the metrics count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A ResourceQuota requires requests or limits the pod does not set.
    QuotaNeedsResources,
    /// A ResourceQuota is used up.
    QuotaExceeded,
    /// Pod Security admission.
    PodSecurity,
    /// Anything else: a policy webhook (Kyverno, Gatekeeper), another admission plugin.
    Policy,
}

impl Refusal {
    pub fn of(message: &str) -> Refusal {
        if message.contains("must specify") {
            Refusal::QuotaNeedsResources
        } else if message.contains("exceeded quota") {
            Refusal::QuotaExceeded
        } else if message.contains("PodSecurity") {
            Refusal::PodSecurity
        } else {
            Refusal::Policy
        }
    }

    /// The `reason` label of `cnat_pods_refused_total`.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::QuotaNeedsResources => "quota_needs_resources",
            Refusal::QuotaExceeded => "quota_exceeded",
            Refusal::PodSecurity => "pod_security",
            Refusal::Policy => "policy",
        }
    }
}

/// The schedule passed more than `startingDeadlineSeconds` ago and no pod ran: it never will.
fn missed(at: &At, now: DateTime<Utc>, due: DateTime<Utc>, seconds: i64) -> Decision {
    let message = format!(
        "did not start within spec.startingDeadlineSeconds ({seconds} s) after its schedule {}; the command never ran. Create a new At to run it",
        due.to_rfc3339_opts(SecondsFormat::AutoSi, true)
    );
    let mut next = Next::new(at, Phase::Done, now);
    next.status.scheduled_time = Some(due);
    next.status.outcome = Some(Outcome::Missed);
    next.status.completion_time = Some(now);
    next.condition(FAILED, true, "MissedDeadline", &message)
        .note(Severity::Warning, "MissedDeadline", message)
        .decide(Call::Nothing, None)
}

/// A DONE At waits for `ttlSecondsAfterFinished`, then is deleted; without one it stays.
fn finished(at: &At, now: DateTime<Utc>, policy: &RunPolicy) -> Decision {
    let ttl = at
        .spec
        .ttl_seconds_after_finished
        .or(policy.ttl_seconds_after_finished);
    let (Some(ttl), Some(done_at)) = (ttl, at.status.as_ref().and_then(|s| s.completion_time))
    else {
        return Decision::idle();
    };
    // Past what a time can hold: it never expires.
    let Some(expires) = after(done_at, i64::from(ttl)) else {
        return Decision::idle();
    };
    match schedule::until_due(expires, now) {
        Some(left) => Decision {
            requeue: Some(left),
            ..Decision::idle()
        },
        None => Decision {
            call: Call::DeleteAt,
            ..Decision::idle()
        },
    }
}

fn running(at: &At, pod: &PodObservation, now: DateTime<Utc>, policy: &RunPolicy) -> Decision {
    let pod_name = pod::name_for(&at.name_any());
    match pod {
        PodObservation::NotCached => Decision {
            call: Call::LookUpPod,
            ..Decision::idle()
        },
        PodObservation::Owned(view) => from_pod(at, view, now, policy),
        PodObservation::Missing => lost(at, now, format!("pod {pod_name} was deleted")),
        PodObservation::Foreign => lost(
            at,
            now,
            format!("pod {pod_name} was replaced by a pod this At does not control"),
        ),
        // Only a creation attempt yields these, and a RUNNING At never creates.
        PodObservation::Rejected(_) | PodObservation::Refused(_) => Decision::idle(),
    }
}

/// An owned pod is the truth: RUNNING while it runs (looked at again every `running_recheck`
/// and at its deadline), DONE once it ended. Not ended `activeDeadlineSeconds` after its start,
/// it is deleted and the At DONE with `DeadlineExceeded`; so too if it ended past that while
/// being deleted (the status write after cnat's delete may have been lost).
fn from_pod(at: &At, view: &PodView, now: DateTime<Utc>, policy: &RunPolicy) -> Decision {
    let deadline = view.active_deadline_seconds;
    let mut next = Next::new(at, Phase::Running, now);
    let start = next.status.start_time.or(view.created_at).unwrap_or(now);
    let ends = deadline.and_then(|seconds| Some((seconds, after(start, seconds)?)));
    let Some(end) = &view.end else {
        next.status.start_time = Some(start);
        if let Some((seconds, _)) = ends.filter(|(_, end)| now >= *end) {
            return deadline_exceeded(next, &view.name, seconds, None);
        }
        let next = match &view.waiting {
            Some(waiting) => next.started(&view.name).stuck(&view.name, waiting),
            None if view.running => next.started(&view.name).unstuck(&view.name),
            // On its way again after it was stuck (pulling, creating the container): the At
            // says what it said until the pod runs or is stuck again.
            None if next.stuck_before() => next,
            None => next.started(&view.name),
        };
        let recheck = match ends.and_then(|(_, end)| schedule::until_due(end, now)) {
            Some(left) => left.min(policy.running_recheck),
            None => policy.running_recheck,
        };
        return next.decide(Call::Nothing, Some(recheck));
    };
    let ended_late = |(_, deadline_end): &(i64, DateTime<Utc>)| {
        view.deleting && *deadline_end <= end.finished_at.unwrap_or(now)
    };
    let killed_by_kubelet = end.pod_reason.as_deref() == Some("DeadlineExceeded");
    if let Some((seconds, _)) = ends.filter(ended_late).filter(|_| !killed_by_kubelet) {
        next.status.start_time = Some(start);
        return deadline_exceeded(next, &view.name, seconds, Some(end));
    }
    let deadline = deadline
        .or(at.spec.active_deadline_seconds)
        .or(policy.active_deadline_seconds);
    let (reason, message) = match (end.succeeded, end.exit_code) {
        (false, _) if end.pod_reason.as_deref() == Some("DeadlineExceeded") => (
            "DeadlineExceeded",
            format!(
                "the command in pod {} ran longer than spec.activeDeadlineSeconds ({} s) and was stopped",
                view.name,
                deadline.map_or_else(|| "?".to_owned(), |d| d.to_string())
            ),
        ),
        (true, _) => (
            "Succeeded",
            format!("the command in pod {} succeeded", view.name),
        ),
        (false, Some(code)) => (
            "CommandFailed",
            format!("the command in pod {} exited with code {code}", view.name),
        ),
        (false, None) => (
            "PodFailed",
            format!("pod {} failed before the command finished", view.name),
        ),
    };
    let told = match &end.detail {
        Some(detail) if !end.succeeded => format!("{message}: {detail}"),
        _ => message.clone(),
    };
    let mut next = Next::new(at, Phase::Done, now);
    next.status.pod_name = Some(view.name.clone());
    next.status.start_time = next.status.start_time.or(view.created_at);
    let mut decision = next.ran(end).finish(end, reason, told);
    if let Some(note) = decision.note.as_mut() {
        note.summary = message;
    }
    decision
}

/// The pod passed its `activeDeadlineSeconds` (`seconds`) before it ended: it is deleted (or
/// was, and then `end` is how it ended), and the At DONE, failed with `DeadlineExceeded`.
fn deadline_exceeded(next: Next, pod_name: &str, seconds: i64, end: Option<&PodEnd>) -> Decision {
    let message = format!(
        "pod {pod_name} did not finish within spec.activeDeadlineSeconds ({seconds} s) of its start; cnat deleted it. Raise activeDeadlineSeconds if the command needs longer"
    );
    let mut next = match end {
        Some(end) => next.started(pod_name).ran(end),
        None => next.started(pod_name),
    };
    next.status.phase = Phase::Done;
    let failed = PodEnd {
        succeeded: false,
        ..end.cloned().unwrap_or_else(PodEnd::unknown)
    };
    let decision = next.finish(&failed, "DeadlineExceeded", message);
    match end {
        Some(_) => decision,
        None => Decision {
            call: Call::DeletePod,
            ..decision
        },
    }
}

/// The pod is gone or replaced before it finished: report it, never re-create it.
fn lost(at: &At, now: DateTime<Utc>, what: String) -> Decision {
    let message = format!(
        "{what} before the command finished; cnat does not re-create it, so the command never runs twice. Create a new At to run it again"
    );
    Next::new(at, Phase::Done, now).finish(&PodEnd::unknown(), "PodLost", message)
}

/// `seconds` after `start`, or `None` past what a time can hold.
fn after(start: DateTime<Utc>, seconds: i64) -> Option<DateTime<Utc>> {
    start.checked_add_signed(TimeDelta::try_seconds(seconds)?)
}

fn runs_at(due: DateTime<Utc>) -> String {
    format!(
        "runs at {}",
        due.to_rfc3339_opts(SecondsFormat::AutoSi, true)
    )
}

/// The status being decided, built from the current one so nothing recorded is lost.
struct Next<'a> {
    at: &'a At,
    now: DateTime<Utc>,
    status: AtStatus,
    note: Option<Note>,
}

impl<'a> Next<'a> {
    fn new(at: &'a At, phase: Phase, now: DateTime<Utc>) -> Self {
        let mut status = at.status.clone().unwrap_or_default();
        status.phase = phase;
        status.observed_generation = at.metadata.generation;
        Next {
            at,
            now,
            status,
            note: None,
        }
    }

    /// Sets a condition; its transition time moves only when its status does.
    fn condition(mut self, type_: &str, ok: bool, reason: &str, message: &str) -> Self {
        let status = if ok { "True" } else { "False" };
        let conditions = &mut self.status.conditions;
        let since = conditions
            .iter()
            .find(|c| c.type_ == type_ && c.status == status)
            .map_or(self.now, |c| c.last_transition_time);
        conditions.retain(|c| c.type_ != type_);
        conditions.push(Condition {
            type_: type_.to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message: message.to_owned(),
            last_transition_time: since,
            observed_generation: self.at.metadata.generation,
        });
        self
    }

    /// The event of this transition; its reason and message are also the status's.
    fn note(mut self, severity: Severity, reason: &'static str, message: String) -> Self {
        self.status.message = Some(message.clone());
        self.status.reason = Some(reason.to_owned());
        self.note = Some(Note {
            severity,
            reason,
            summary: message.clone(),
            message,
        });
        self
    }

    fn invalid(self, reason: &'static str, message: String) -> Decision {
        self.condition(SCHEDULED, false, reason, &message)
            .note(Severity::Warning, reason, message)
            .decide(Call::Nothing, None)
    }

    fn started(mut self, pod_name: &str) -> Self {
        let message = format!("pod {pod_name} runs the command");
        self.status.pod_name = Some(pod_name.to_owned());
        self.condition(POD_CREATED, true, "PodCreated", &message)
            .note(Severity::Normal, "PodCreated", message)
    }

    /// The pod cannot start the command: `PodStarted=False` with the kind of trouble, and a
    /// warning; while the kind stays the same, the first message stays, so retries write nothing.
    fn stuck(self, pod_name: &str, waiting: &Waiting) -> Self {
        let reason = waiting.stuck.reason();
        let recorded = self.at.status.as_ref().and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == POD_STARTED && c.status == "False" && c.reason == reason)
                .map(|c| c.message.clone())
        });
        let message = recorded.unwrap_or_else(|| {
            format!(
                "pod {pod_name} cannot start the command: {}",
                waiting.detail
            )
        });
        self.condition(POD_STARTED, false, reason, &message).note(
            Severity::Warning,
            reason,
            message,
        )
    }

    /// The pod can start the command: once it was stuck, `PodStarted=True` (and an event);
    /// never stuck, no condition at all.
    fn unstuck(self, pod_name: &str) -> Self {
        let was_stuck = self
            .at
            .status
            .as_ref()
            .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == POD_STARTED));
        if !was_stuck {
            return self;
        }
        let message = format!("pod {pod_name} started the command");
        self.condition(POD_STARTED, true, "PodStarted", &message)
            .note(Severity::Normal, "PodStarted", message)
    }

    /// Whether the status shows the pod stuck (`PodStarted=False`).
    fn stuck_before(&self) -> bool {
        self.status
            .conditions
            .iter()
            .any(|c| c.type_ == POD_STARTED && c.status == "False")
    }

    /// The pod ended with an exit code, so its command started: a `PodStarted=False` left from
    /// when it was stuck turns True. The event is the end's.
    fn ran(self, end: &PodEnd) -> Self {
        if end.exit_code.is_none() || !self.stuck_before() {
            return self;
        }
        let pod_name = self.status.pod_name.clone().unwrap_or_default();
        let message = format!("pod {pod_name} started the command");
        self.condition(POD_STARTED, true, "PodStarted", &message)
    }

    fn finish(mut self, end: &PodEnd, reason: &'static str, message: String) -> Decision {
        let (outcome, type_, severity) = if end.succeeded {
            (Outcome::Succeeded, COMPLETE, Severity::Normal)
        } else {
            (Outcome::Failed, FAILED, Severity::Warning)
        };
        self.status.outcome = Some(outcome);
        self.status.exit_code = end.exit_code;
        self.status.completion_time = end.finished_at.or(Some(self.now));
        self.condition(type_, true, reason, &message)
            .note(severity, reason, message)
            .decide(Call::Nothing, None)
    }

    /// Keeps the status and its event only if something changed, so repeats are silent.
    fn decide(self, call: Call, requeue: Option<Duration>) -> Decision {
        let changed = self.at.status.as_ref() != Some(&self.status);
        Decision {
            call,
            status: changed.then_some(self.status),
            note: self.note.filter(|_| changed),
            requeue,
            retry: false,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
