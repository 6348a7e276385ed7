//! Prometheus metrics, served by `admin` on `/metrics` in the OpenMetrics text format. Counters
//! and histograms are updated where things happen; leadership and the At count are read from
//! their owners at scrape time, so they can never drift from the truth.

use crate::api::{At, Phase};
use crate::leader::Leadership;
use kube::runtime::reflector::Store;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The `Content-Type` of `/metrics`.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Seconds between a schedule and its pod's creation: the run lateness buckets.
const LATENESS_BUCKETS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0,
    3600.0,
];

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReconcileLabels {
    /// `ok`, or `error` when the reconcile is retried with backoff.
    result: &'static str,
}

/// One admission request.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct AdmissionLabels {
    /// `validating` or `mutating`.
    pub webhook: &'static str,
    /// `CREATE`, `UPDATE`, `DELETE`, `CONNECT`, or `UNKNOWN` for a body that is no AdmissionReview.
    pub operation: &'static str,
    pub allowed: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WebhookLabels {
    webhook: &'static str,
}

/// Every metric cnat exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ReconcileLabels, Counter>,
    reconcile_duration: Histogram,
    admissions: Family<AdmissionLabels, Counter>,
    admission_duration: Family<WebhookLabels, Histogram, fn() -> Histogram>,
    lateness: Histogram,
    ats: Arc<AtCount>,
}

impl Metrics {
    /// The registry, reading leadership from `leadership` at each scrape.
    pub fn new(leadership: Arc<Leadership>) -> Self {
        let reconciles = Family::default();
        let reconcile_duration = Histogram::new(exponential_buckets(0.001, 2.0, 14));
        let admissions = Family::default();
        let admission_duration: Family<_, _, fn() -> Histogram> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0001, 2.0, 14)));
        let lateness = Histogram::new(LATENESS_BUCKETS);
        let ats = Arc::new(AtCount::default());
        let mut registry = Registry::default();
        registry.register(
            "cnat_reconciles",
            "Reconciles of an At, by result",
            reconciles.clone(),
        );
        registry.register(
            "cnat_reconcile_duration_seconds",
            "Time one reconcile took, API calls included",
            reconcile_duration.clone(),
        );
        registry.register(
            "cnat_admission_requests",
            "AdmissionReviews answered, by webhook, operation and whether they were allowed",
            admissions.clone(),
        );
        registry.register(
            "cnat_admission_duration_seconds",
            "Time from receiving an AdmissionReview to answering it, by webhook",
            admission_duration.clone(),
        );
        registry.register(
            "cnat_run_lateness_seconds",
            "How long after its schedule an At's pod was created",
            lateness.clone(),
        );
        registry.register(
            "cnat_leader_handover_seconds",
            "On the replica that became leader: time from seeing the Lease released or expired until it led",
            leadership.handovers().clone(),
        );
        registry.register_collector(Box::new(LeaderCollector(leadership)));
        registry.register_collector(Box::new(ats.clone()));
        Metrics {
            registry,
            reconciles,
            reconcile_duration,
            admissions,
            admission_duration,
            lateness,
            ats,
        }
    }

    pub fn reconciled(&self, ok: bool, took: Duration) {
        let result = if ok { "ok" } else { "error" };
        self.reconciles
            .get_or_create(&ReconcileLabels { result })
            .inc();
        self.reconcile_duration.observe(took.as_secs_f64());
    }

    pub fn admitted(&self, labels: AdmissionLabels, took: Duration) {
        let webhook = WebhookLabels {
            webhook: labels.webhook,
        };
        self.admissions.get_or_create(&labels).inc();
        self.admission_duration
            .get_or_create(&webhook)
            .observe(took.as_secs_f64());
    }

    /// A pod was created `late` after its At's schedule (zero when early, which cannot happen).
    pub fn ran_late(&self, late: Duration) {
        self.lateness.observe(late.as_secs_f64());
    }

    /// Counts Ats by phase from `store` (the leader's cache) until `forget_ats`.
    pub fn count_ats(&self, store: Store<At>) {
        *self.ats.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(store);
    }

    /// Stops counting Ats: a replica that does not lead has no cache to count.
    pub fn forget_ats(&self) {
        *self.ats.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
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
        let leader = ConstGauge::new(i64::from(self.0.is_leader()));
        let metric = encoder.encode_descriptor(
            "cnat_leader",
            "1 while this replica holds the Lease and runs the reconcile loop",
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
        transitions.encode(metric)
    }
}

/// The leader's At cache, when there is one.
#[derive(Debug, Default)]
struct AtCount(Mutex<Option<Store<At>>>);

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PhaseLabels {
    phase: &'static str,
}

impl Collector for AtCount {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(store) = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            return Ok(());
        };
        let ats = store.state();
        let mut family = encoder.encode_descriptor(
            "cnat_ats",
            "Ats by phase, as the leader sees them (only the leader reports this)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for phase in [Phase::Pending, Phase::Running, Phase::Done] {
            let labels = PhaseLabels {
                phase: phase.as_str(),
            };
            let count = ats.iter().filter(|at| at.phase() == phase).count();
            ConstGauge::new(count as i64).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
