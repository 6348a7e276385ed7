//! Prometheus metrics, served by `admin` on `/metrics` in the OpenMetrics text format. Counters
//! and histograms are updated where things happen; leadership and the At count are read from
//! their owners at scrape time, so they can never drift from the truth.

use crate::api::Phase;
use crate::leader::Leadership;
use crate::operator::cache::CachedAt;
use crate::operator::pod::Stuck;
use crate::sync::lock;
use kube::runtime::reflector::Store;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeLabelValue, EncodeMetric,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The `Content-Type` of `/metrics` in the OpenMetrics format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The `Content-Type` of `/metrics` in Prometheus's classic text format.
pub const CLASSIC_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The classic Prometheus text format (0.0.4) of `Metrics::encode`'s OpenMetrics text: a
/// counter's `HELP` and `TYPE` name `x_total`, and no `# EOF`, `# UNIT` or `_created` lines.
pub fn classic(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let sample = line.split(['{', ' ']).next().unwrap_or_default();
        if sample
            .strip_suffix("_created")
            .is_some_and(|name| counters.contains(name))
        {
            continue;
        }
        let described = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let (name, tail) = line.strip_prefix(prefix)?.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        out.push_str(described.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// Seconds between a schedule and its pod's creation: the run lateness buckets.
const LATENESS_BUCKETS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0,
    3600.0,
];

/// One admission request.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct AdmissionLabels {
    /// `validating` or `mutating`.
    pub webhook: &'static str,
    /// `CREATE`, `UPDATE`, `DELETE`, `CONNECT`, or `UNKNOWN` for a body that is no AdmissionReview.
    pub operation: &'static str,
    pub allowed: bool,
}

/// Any other label set: (name, value) pairs, encoded in this order (as a derived
/// `EncodeLabelSet` encodes its fields).
type Labels<const N: usize> = [(&'static str, &'static str); N];

/// The `reason` values of `cnat_pods_refused_total`.
const REFUSAL_REASONS: [&str; 5] = [
    "quota_needs_resources",
    "quota_exceeded",
    "pod_security",
    "policy",
    "invalid",
];

/// How a status write ended: the `result` of `cnat_status_writes_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteResult {
    Written,
    /// The At changed since the version decided on (409): decided again from the newer one.
    Conflict,
    /// The At was deleted meanwhile (404).
    Gone,
    /// The API server refuses any status for this version: its spec holds a value outside the
    /// CRD's bounds (told in an event; not retried until the At changes).
    Refused,
    /// Any other error, or no answer: retried with backoff.
    Failed,
}

impl WriteResult {
    /// Every result, each reported from 0 for every phase.
    const ALL: [WriteResult; 5] = [
        WriteResult::Written,
        WriteResult::Conflict,
        WriteResult::Gone,
        WriteResult::Refused,
        WriteResult::Failed,
    ];

    fn label(self) -> &'static str {
        match self {
            WriteResult::Written => "written",
            WriteResult::Conflict => "conflict",
            WriteResult::Gone => "gone",
            WriteResult::Refused => "refused",
            WriteResult::Failed => "failed",
        }
    }
}

/// Every metric cnat exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// By `result`: `ok`, or `error` when the reconcile is retried with backoff.
    reconciles: Family<Labels<1>, Counter>,
    reconcile_duration: Histogram,
    admissions: Family<AdmissionLabels, Counter>,
    /// By `webhook`.
    admission_duration: Family<Labels<1>, Histogram, fn() -> Histogram>,
    /// By `trigger` (`request` or `refresh`) and `outcome` (`allowed`, `denied`, `unanswered`).
    access_reviews: Family<Labels<2>, Histogram, fn() -> Histogram>,
    /// By `result`: `success`, or `failure` when the review was answered with a Failure.
    conversions: Family<Labels<1>, Counter>,
    lateness: Histogram,
    /// By `reason`: one of `REFUSAL_REASONS`.
    pods_refused: Family<Labels<1>, Counter>,
    /// By `place`: `reconcile` (an At's reconcile), `look` (deciding whether an At needs one)
    /// or `task` (another task of the reconcile loop).
    panics: Family<Labels<1>, Counter>,
    events_dropped: Counter,
    /// By `phase` (`PENDING`, `RUNNING` or `DONE`: the phase written) and `result`
    /// (`WriteResult::label`).
    status_writes: Family<Labels<2>, Counter>,
    creates: PodCreates,
    ats: Arc<AtCount>,
}

/// What stood between a pod create decided on and the create (issue 39, "never twice").
#[derive(Debug)]
struct PodCreates {
    /// How the API server confirmed the At before the create, by `by`: `read` (a quorum read
    /// of the At) or `own_write` (the cached version is one this leader's own status write
    /// made: no request).
    confirmed: Family<Labels<1>, Counter>,
    /// Creates not made: the API server's copy was not the cache's.
    unconfirmed: Counter,
    /// Creates put off: the At cache was behind.
    deferred: Counter,
}

/// Registers `metric` as `name`, returning it to be updated.
fn register<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// A counter family with each of `label_sets` at 0 from the start, so the first count is an
/// increase.
fn from_zero<const N: usize>(
    label_sets: impl IntoIterator<Item = Labels<N>>,
) -> Family<Labels<N>, Counter> {
    let family = Family::default();
    for labels in label_sets {
        drop(family.get_or_create(&labels));
    }
    family
}

impl Metrics {
    /// The registry, reading leadership from `leadership` at each scrape.
    pub fn new(leadership: Arc<Leadership>) -> Self {
        let mut registry = Registry::default();
        let r = &mut registry;
        let status_writes = [Phase::Pending, Phase::Running, Phase::Done]
            .into_iter()
            .flat_map(|phase| {
                let phase = phase.metric_label();
                WriteResult::ALL.map(|result| [("phase", phase), ("result", result.label())])
            });
        // The struct's fields register in the order written: the order of /metrics.
        Metrics {
            reconciles: register(
                r,
                "cnat_reconciles",
                "Reconciles of an At, by result",
                Family::default(),
            ),
            reconcile_duration: register(
                r,
                "cnat_reconcile_duration_seconds",
                "Time one reconcile took, API calls included",
                Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            ),
            admissions: register(
                r,
                "cnat_admission_requests",
                "AdmissionReviews answered, by webhook, operation and whether they were allowed",
                Family::default(),
            ),
            admission_duration: register(
                r,
                "cnat_admission_duration_seconds",
                "Time from receiving an AdmissionReview to answering it, by webhook",
                Family::<_, _, fn() -> Histogram>::new_with_constructor(|| {
                    Histogram::new(exponential_buckets(0.0001, 2.0, 14))
                }),
            ),
            access_reviews: register(
                r,
                "cnat_access_review_duration_seconds",
                "SubjectAccessReviews the escalation guard sent and how long each took, by trigger (request: an admission found no cached answer and waited for it; refresh: of a cached answer, ahead of expiry or a retry, which an admission waits for only when the answer expired meanwhile) and outcome (allowed, denied, unanswered)",
                Family::<_, _, fn() -> Histogram>::new_with_constructor(|| {
                    Histogram::new(exponential_buckets(0.0005, 2.0, 14))
                }),
            ),
            conversions: register(
                r,
                "cnat_conversion_reviews",
                "ConversionReviews answered (At objects between v1alpha1 and v1), by result",
                from_zero(["success", "failure"].map(|result| [("result", result)])),
            ),
            lateness: register(
                r,
                "cnat_run_lateness_seconds",
                "How long after its schedule an At's pod was created",
                Histogram::new(LATENESS_BUCKETS),
            ),
            pods_refused: register(
                r,
                "cnat_pods_refused",
                "Pod creates the API server refused, by reason: a quota (quota_needs_resources, quota_exceeded), pod_security, another policy, or invalid; the At stays Pending and is retried (invalid: until its spec changes)",
                from_zero(REFUSAL_REASONS.map(|reason| [("reason", reason)])),
            ),
            panics: register(
                r,
                "cnat_panics",
                "Panics in the reconcile loop, by place (reconcile, look, task); each ends leadership, releases the Lease and starts the loop again",
                from_zero(["reconcile", "look", "task"].map(|place| [("place", place)])),
            ),
            events_dropped: register(
                r,
                "cnat_events_dropped",
                "Kubernetes Events not published because the queue of events waiting was full (the At's status holds the same facts)",
                Counter::default(),
            ),
            status_writes: register(
                r,
                "cnat_status_writes",
                "At status writes (each a compare-and-swap on the version decided on), by the phase written and result: written, conflict (the At changed since; decided again), gone (deleted), refused (the API server refuses any status for this At: a spec value outside the CRD's bounds) or failed (retried with backoff)",
                from_zero(status_writes),
            ),
            creates: PodCreates {
                confirmed: register(
                    r,
                    "cnat_pod_create_confirmations",
                    "Pod creates whose At the API server confirmed as the cache showed it, by how: read (a quorum read of the At just before: it exists with that uid and spec, not being deleted, not started) or own_write (the cached version is the one this leader's own last status write left Pending: no request)",
                    from_zero(["read", "own_write"].map(|by| [("by", by)])),
                ),
                unconfirmed: register(
                    r,
                    "cnat_pod_creates_unconfirmed",
                    "Pod creates not made because the API server's copy of the At (a quorum read just before) was not the cache's: DONE, deleted, changed or another At by that name; the cache was behind",
                    Counter::default(),
                ),
                deferred: register(
                    r,
                    "cnat_pod_creates_deferred",
                    "Pod create attempts put off because the At cache was behind the API server (listing, no watch open, or its watch silent for 75 s); the At is decided again as soon as the cache has caught up, or after 1 s",
                    Counter::default(),
                ),
            },
            ats: {
                r.register(
                    "cnat_leader_handover_seconds",
                    "On the replica that became leader: time from seeing the Lease released or expired until it led",
                    leadership.handovers().clone(),
                );
                r.register_collector(Box::new(LeaderCollector(leadership)));
                let ats = Arc::new(AtCount::default());
                r.register_collector(Box::new(ats.clone()));
                ats
            },
            registry,
        }
    }

    /// A panic in the reconcile loop, at `place` (`reconcile`, `look` or `task`).
    pub fn panicked(&self, place: &'static str) {
        self.panics.get_or_create(&[("place", place)]).inc();
    }

    /// An event was dropped: its queue was full.
    pub fn event_dropped(&self) {
        self.events_dropped.inc();
    }

    /// A status write of `phase` ended with `result`.
    pub fn status_written(&self, phase: Phase, result: WriteResult) {
        let labels = [("phase", phase.metric_label()), ("result", result.label())];
        self.status_writes.get_or_create(&labels).inc();
    }

    /// A pod create was not made: the API server's copy of the At was not the cache's.
    pub fn create_unconfirmed(&self) {
        self.creates.unconfirmed.inc();
    }

    /// The API server confirmed a pod create's At, `by` a read or the leader's own write.
    pub fn create_confirmed(&self, by: &'static str) {
        self.creates.confirmed.get_or_create(&[("by", by)]).inc();
    }

    /// A pod create was put off: the At cache was behind.
    pub fn create_deferred(&self) {
        self.creates.deferred.inc();
    }

    /// The API server refused a pod create for `reason` (a `Refusal` label, or `invalid`).
    pub fn pod_refused(&self, reason: &'static str) {
        self.pods_refused.get_or_create(&[("reason", reason)]).inc();
    }

    pub fn reconciled(&self, ok: bool, took: Duration) {
        let result = if ok { "ok" } else { "error" };
        self.reconciles.get_or_create(&[("result", result)]).inc();
        self.reconcile_duration.observe(took.as_secs_f64());
    }

    pub fn admitted(&self, labels: AdmissionLabels, took: Duration) {
        self.admissions.get_or_create(&labels).inc();
        self.admission_duration
            .get_or_create(&[("webhook", labels.webhook)])
            .observe(took.as_secs_f64());
    }

    /// The escalation guard's SubjectAccessReview ended: why it was sent (`request` or
    /// `refresh`), its `outcome` (`allowed`, `denied` or `unanswered`) and how long it took.
    pub fn access_reviewed(&self, trigger: &'static str, outcome: &'static str, took: Duration) {
        self.access_reviews
            .get_or_create(&[("trigger", trigger), ("outcome", outcome)])
            .observe(took.as_secs_f64());
    }

    /// A ConversionReview was answered: every object converted (`ok`) or a Failure.
    pub fn converted(&self, ok: bool) {
        let result = if ok { "success" } else { "failure" };
        self.conversions.get_or_create(&[("result", result)]).inc();
    }

    /// A pod was created `late` after its At's schedule (zero when early, which cannot happen).
    pub fn ran_late(&self, late: Duration) {
        self.lateness.observe(late.as_secs_f64());
    }

    /// Counts Ats by phase from `store` (the leader's cache; with Lease shards, one of the
    /// caches of the shards this replica leads) until `forget_ats` with the number returned.
    pub fn count_ats(&self, store: Store<CachedAt>) -> u64 {
        let mut counted = lock(&self.ats.0);
        counted.next += 1;
        let id = counted.next;
        counted.stores.push((id, store));
        id
    }

    /// Stops counting the Ats of the store `count_ats` numbered `id`: a replica that does not
    /// lead has no cache to count.
    pub fn forget_ats(&self, id: u64) {
        let mut counted = lock(&self.ats.0);
        counted.stores.retain(|(counted, _)| *counted != id);
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail; a collector error would only truncate the output.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

#[derive(Debug)]
struct LeaderCollector(Arc<Leadership>);

impl Collector for LeaderCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let leader = ConstGauge::new(i64::try_from(self.0.leading()).unwrap_or(i64::MAX));
        let metric = encoder.encode_descriptor(
            "cnat_leader",
            "1 while this replica holds the Lease and runs the reconcile loop (with --shards: how many shards' Leases it holds)",
            None,
            leader.metric_type(),
        )?;
        leader.encode(metric)?;
        let transitions = ConstCounter::new(self.0.transitions());
        let metric = encoder.encode_descriptor(
            "cnat_leader_transitions",
            "Times this replica became or stopped being the leader",
            None,
            transitions.metric_type(),
        )?;
        transitions.encode(metric)?;
        gauges(
            &mut encoder,
            "cnat_lease_held",
            "1 for each Lease this replica holds, by its name (with --shards, one per shard it leads)",
            "lease",
            self.0.leases().into_iter().map(|lease| (lease, 1)),
        )
    }
}

/// A gauge family `name`: one gauge for each (value of the label `label`, gauge) of `samples`.
fn gauges<V: EncodeLabelValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &'static str,
    samples: impl IntoIterator<Item = (V, usize)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (value, count) in samples {
        ConstGauge::new(count as i64).encode(family.encode_family(&[(label, value)])?)?;
    }
    Ok(())
}

/// The leader's At cache, when there is one.
#[derive(Debug, Default)]
struct AtCount(Mutex<CountedStores>);

/// The caches whose Ats are counted, each with the number `count_ats` gave it.
#[derive(Debug, Default)]
struct CountedStores {
    next: u64,
    stores: Vec<(u64, Store<CachedAt>)>,
}

impl Collector for AtCount {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stores: Vec<Store<CachedAt>> = {
            let counted = lock(&self.0);
            counted
                .stores
                .iter()
                .map(|(_, store)| store.clone())
                .collect()
        };
        if stores.is_empty() {
            return Ok(());
        }
        let ats: Vec<_> = stores.iter().flat_map(Store::state).collect();
        // Phases in v1alpha1's spelling, kept: dashboards and alerts select on it.
        gauges(
            &mut encoder,
            "cnat_ats",
            "Ats by phase, as the leader sees them (only the leader reports this)",
            "phase",
            [Phase::Pending, Phase::Running, Phase::Done].map(|phase| {
                let count = ats.iter().filter(|at| at.phase() == phase).count();
                (phase.metric_label(), count)
            }),
        )?;
        gauges(
            &mut encoder,
            "cnat_ats_stuck",
            "RUNNING Ats whose pod cannot start the command, by the kind of trouble their status shows (the At's reason: an image that cannot be pulled, a missing Secret, no node that fits; only the leader reports this)",
            "reason",
            Stuck::ALL.map(|stuck| {
                let count = ats
                    .iter()
                    .filter(|at| at.phase() == Phase::Running && at.stuck() == Some(stuck))
                    .count();
                (stuck.reason(), count)
            }),
        )?;
        // Not `namespace`: scrapers set that label to the operator's own namespace.
        gauges(
            &mut encoder,
            "cnat_ats_overdue",
            "Pending Ats more than 30 s past their schedule, by the Ats' namespace (only the leader reports this; a namespace appears only while it has some): they should be running",
            "at_namespace",
            overdue(ats.iter().map(|at| at.as_ref()), chrono::Utc::now()),
        )
    }
}

/// How long past its schedule a PENDING At must be to count as overdue: in a burst, Ats due
/// this instant wait a moment for their pods, which is not what the gauge is for.
pub const OVERDUE_AFTER: chrono::TimeDelta = chrono::TimeDelta::seconds(30);

/// PENDING Ats whose schedule is more than `OVERDUE_AFTER` before `now`, counted by namespace.
/// An At whose schedule does not parse is never due, so never overdue (its status says why).
pub fn overdue<'a>(
    ats: impl Iterator<Item = &'a CachedAt>,
    now: chrono::DateTime<chrono::Utc>,
) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for at in ats.filter(|at| at.phase() == Phase::Pending) {
        if at.due().is_some_and(|due| due + OVERDUE_AFTER < now) {
            let namespace = kube::ResourceExt::namespace(at).unwrap_or_default();
            *counts.entry(namespace).or_insert(0) += 1;
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(namespace: &str, schedule: &str, phase: Option<Phase>) -> CachedAt {
        CachedAt::example("x", namespace, schedule, phase)
    }

    #[test]
    fn overdue_counts_pending_ats_past_their_schedule_by_namespace() {
        let now = "2026-11-22T12:00:00Z".parse().unwrap();
        let ats = [
            at("a", "2026-11-22T11:59:29Z", None),
            at("a", "2026-11-22T11:00:00Z", Some(Phase::Pending)),
            at("b", "2026-11-22T11:00:00Z", Some(Phase::Pending)),
            // Not overdue: due up to 30 s ago or later, started, finished, or never due.
            at("c", "2026-11-22T11:59:30Z", None),
            at("c", "2026-11-22T12:00:00Z", None),
            at("c", "2026-11-22T13:00:00Z", None),
            at("c", "2026-11-22T11:00:00Z", Some(Phase::Running)),
            at("c", "2026-11-22T11:00:00Z", Some(Phase::Done)),
            at("c", "tomorrow", None),
        ];
        let counts = overdue(ats.iter(), now);
        assert_eq!(
            counts.into_iter().collect::<Vec<_>>(),
            [("a".to_owned(), 2), ("b".to_owned(), 1)]
        );
        assert!(overdue(ats[3..].iter(), now).is_empty());
    }

    #[test]
    fn the_classic_format_names_counters_by_their_samples() {
        let openmetrics = "# HELP a_x Things.\n# TYPE a_x counter\na_x_total{k=\"v\"} 2\na_x_created 1.0\n# HELP g A gauge.\n# TYPE g gauge\n# UNIT g seconds\ng 1\n# HELP h A histogram.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 0.5\nh_count 1\n# EOF\n";
        assert_eq!(
            classic(openmetrics),
            "# HELP a_x_total Things.\n# TYPE a_x_total counter\na_x_total{k=\"v\"} 2\n# HELP g A gauge.\n# TYPE g gauge\ng 1\n# HELP h A histogram.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 0.5\nh_count 1\n"
        );
    }

    #[test]
    fn running_ats_whose_pods_cannot_start_are_counted_by_reason_every_reason_from_zero() {
        let metrics = Metrics::new(Arc::new(Leadership::default()));
        let (mut writer, store) = {
            let writer = kube::runtime::reflector::store::Writer::<CachedAt>::default();
            let store = writer.as_reader();
            (writer, store)
        };
        metrics.count_ats(store);
        let with = |name: &str, phase: Phase, started: Option<(&str, &str)>| {
            let mut at = crate::api::At::new(name, crate::api::AtSpec::default());
            at.metadata.namespace = Some("team".into());
            let mut status = crate::api::AtStatus {
                phase,
                ..Default::default()
            };
            if let Some((ok, reason)) = started {
                status.conditions.push(crate::api::Condition {
                    type_: crate::operator::pod::POD_STARTED.into(),
                    status: ok.into(),
                    reason: reason.into(),
                    message: String::new(),
                    last_transition_time: chrono::Utc::now(),
                    observed_generation: None,
                });
            }
            at.status = Some(status);
            CachedAt::from(at)
        };
        for at in [
            with("a", Phase::Running, Some(("False", "ImagePullBackOff"))),
            with("b", Phase::Running, Some(("False", "ImagePullBackOff"))),
            with("c", Phase::Running, Some(("False", "Unschedulable"))),
            // Not counted: it started after all, it never was stuck, it is done.
            with("d", Phase::Running, Some(("True", "PodStarted"))),
            with("e", Phase::Running, None),
            with(
                "f",
                Phase::Done,
                Some(("False", "CreateContainerConfigError")),
            ),
        ] {
            writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(at));
        }
        let text = metrics.encode();
        for stuck in Stuck::ALL {
            let count = match stuck {
                Stuck::ImagePullBackOff => 2,
                Stuck::Unschedulable => 1,
                _ => 0,
            };
            let line = format!("cnat_ats_stuck{{reason=\"{}\"}} {count}\n", stuck.reason());
            assert!(text.contains(&line), "{line} in {text}");
        }
    }

    #[test]
    fn refused_pods_are_counted_by_reason() {
        let metrics = Metrics::new(Arc::new(Leadership::default()));
        metrics.pod_refused("quota_exceeded");
        metrics.pod_refused("quota_exceeded");
        metrics.pod_refused("pod_security");
        let text = metrics.encode();
        assert!(
            text.contains("cnat_pods_refused_total{reason=\"quota_exceeded\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("cnat_pods_refused_total{reason=\"pod_security\"} 1\n"),
            "{text}"
        );
    }

    #[test]
    fn status_writes_are_counted_by_phase_and_result_every_pair_from_zero() {
        let metrics = Metrics::new(Arc::new(Leadership::default()));
        metrics.status_written(Phase::Pending, WriteResult::Written);
        metrics.status_written(Phase::Pending, WriteResult::Written);
        metrics.status_written(Phase::Done, WriteResult::Gone);
        let text = metrics.encode();
        let mut lines = 0;
        for phase in ["PENDING", "RUNNING", "DONE"] {
            for result in ["written", "conflict", "gone", "refused", "failed"] {
                let count = match (phase, result) {
                    ("PENDING", "written") => 2,
                    ("DONE", "gone") => 1,
                    _ => 0,
                };
                let line = format!(
                    "cnat_status_writes_total{{phase=\"{phase}\",result=\"{result}\"}} {count}\n"
                );
                assert!(text.contains(&line), "{line} in {text}");
                lines += 1;
            }
        }
        let series = text
            .lines()
            .filter(|l| l.starts_with("cnat_status_writes_total{"))
            .count();
        assert_eq!(series, lines, "{text}");
    }
}
