//! The `At` custom resource: spec, status, phases and conditions. The CRD is generated from these
//! types (`cnat crd`), so every doc comment here is what `kubectl explain at` prints.

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::{EnvVar, LocalObjectReference, ResourceRequirements, Toleration};
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// API group of the At resource.
pub const GROUP: &str = "cnat.programming-kubernetes.info";
/// Image that runs the command when `spec.image` is not set.
pub const DEFAULT_IMAGE: &str = "busybox";

/// Run a shell command once, at a given time, in a pod.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "cnat.programming-kubernetes.info",
    version = "v1alpha1",
    kind = "At",
    plural = "ats",
    singular = "at",
    namespaced,
    status = "AtStatus",
    doc = "At runs a shell command once, at a given time, in a pod.",
    printcolumn = r#"{"name":"Schedule","type":"string","jsonPath":".spec.schedule"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Outcome","type":"string","jsonPath":".status.outcome"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.reason"}"#,
    printcolumn = r#"{"name":"Exit Code","type":"integer","jsonPath":".status.exitCode","priority":1}"#,
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".status.podName","priority":1}"#,
    printcolumn = r#"{"name":"Message","type":"string","jsonPath":".status.message","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AtSpec {
    /// When to run the command: an RFC 3339 time with `Z` or an explicit UTC offset, for example
    /// `2019-04-12T10:12:00Z` or `2019-04-12T12:12:00+02:00`; or, with `timeZone`, a wall-clock
    /// time without offset, e.g. `2019-04-12T12:12:00`. A time in the past runs at once (unless
    /// `startingDeadlineSeconds` has passed).
    pub schedule: String,
    /// Shell command to run, passed to `/bin/sh -c`, so quoting, pipes and `&&` work as in a
    /// shell. It runs once; its exit code decides the outcome.
    pub command: String,
    /// Container image that runs the command; it must provide `/bin/sh`. Defaults to `busybox`.
    #[serde(default = "default_image")]
    pub image: String,
    /// IANA time zone (e.g. `Europe/Berlin`) in which a `schedule` without offset is read, as in
    /// a CronJob. A wall-clock time that does not exist there (skipped by a daylight-saving
    /// change) or exists twice is refused with both instants it could mean.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    /// If the command cannot start within this many seconds after its schedule (operator down,
    /// quota, policy), it never runs: the At ends `DONE` with outcome `Missed`. Without it, an At
    /// runs however late. As in a CronJob.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 2147483647))]
    pub starting_deadline_seconds: Option<i64>,
    /// The command's time limit in seconds, counted from the pod's start; a command that runs
    /// longer is stopped and the At ends `DONE`, outcome `Failed`, reason `DeadlineExceeded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2147483647))]
    pub active_deadline_seconds: Option<i64>,
    /// Delete the At (and its pod) this many seconds after it is `DONE`, as for a Job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 2147483647))]
    pub ttl_seconds_after_finished: Option<i32>,
    /// CPU and memory requests and limits of the command's container. Needed in namespaces whose
    /// ResourceQuota limits `requests.*` or `limits.*` (unless the operator sets defaults).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Environment variables of the command: `value`, or `valueFrom` a Secret, ConfigMap or
    /// field of the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<EnvVar>>,
    /// Service account the pod runs as. Its API token is mounted only when this is set; by
    /// default the pod has no token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Node labels the pod's node must have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Taints the pod tolerates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// Secrets (in the At's namespace) holding credentials to pull `image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
}

impl Default for AtSpec {
    fn default() -> Self {
        AtSpec {
            schedule: String::new(),
            command: String::new(),
            image: default_image(),
            time_zone: None,
            starting_deadline_seconds: None,
            active_deadline_seconds: None,
            ttl_seconds_after_finished: None,
            resources: None,
            env: None,
            service_account_name: None,
            node_selector: None,
            tolerations: None,
            image_pull_secrets: None,
        }
    }
}

fn default_image() -> String {
    DEFAULT_IMAGE.to_owned()
}

/// What happened to this At so far, written only by the operator. Defaults to `PENDING`: the
/// apiserver drops status sent on create, and this schema default shows on every read.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend(
    "default" = {"phase": "PENDING"},
    "x-kubernetes-validations" = [{
        "rule": "!has(oldSelf.phase) || self.phase == oldSelf.phase || oldSelf.phase == 'PENDING' || (oldSelf.phase == 'RUNNING' && self.phase == 'DONE')",
        "message": "status.phase cannot go back (PENDING -> RUNNING -> DONE): an At runs at most once; create a new At to run the command again"
    }]
))]
pub struct AtStatus {
    /// `PENDING` until the schedule is due, `RUNNING` while the pod runs, `DONE` once it ended.
    #[serde(default)]
    pub phase: Phase,
    /// Name of the pod that runs (or ran) the command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// The instant `schedule` names (read in `timeZone` when it has no offset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduled_time: Option<DateTime<Utc>>,
    /// When the operator created the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<DateTime<Utc>>,
    /// When the command finished, or when the operator found that it never will.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<DateTime<Utc>>,
    /// `Succeeded` when the command exited 0, `Failed` when it did not, or ran out of time or its
    /// pod was lost, `Missed` when it could not start before `startingDeadlineSeconds`; set once
    /// `DONE`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// Exit code of the command, when it ran to the end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = -2147483648, max = 2147483647))]
    pub exit_code: Option<i32>,
    /// Machine-readable reason of the last change, e.g. `Scheduled`, `PodForbidden`, `Succeeded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Human-readable account of the current state, including what to fix when something is wrong.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Standard conditions: `Scheduled`, `PodCreated`, and `Complete` or `Failed` once `DONE`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Lifecycle phase of an At; the spelling is the book's.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum Phase {
    /// Waiting for the schedule (or for a problem in the spec to be fixed).
    #[default]
    Pending,
    /// The pod has been created and the command has not finished.
    Running,
    /// Finished; the At never runs again.
    Done,
}

impl At {
    /// The phase, `PENDING` while no status was written (the schema default).
    pub fn phase(&self) -> Phase {
        self.status.as_ref().map(|s| s.phase).unwrap_or_default()
    }
}

impl Phase {
    /// The API spelling: `PENDING`, `RUNNING` or `DONE`.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "PENDING",
            Phase::Running => "RUNNING",
            Phase::Done => "DONE",
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a finished At ended.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Outcome {
    /// The command exited with code 0.
    Succeeded,
    /// The command exited non-zero, ran out of time, or its pod failed or disappeared before it
    /// finished.
    Failed,
    /// The command could not start before `startingDeadlineSeconds` passed; it never ran.
    Missed,
}

/// A standard Kubernetes condition (the shape of `metav1.Condition`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Condition type, e.g. `Scheduled`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// Machine-readable reason in CamelCase, e.g. `InvalidSchedule`.
    pub reason: String,
    /// Human-readable details.
    pub message: String,
    /// When `status` last changed.
    pub last_transition_time: DateTime<Utc>,
    /// The `metadata.generation` this condition was set for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The CRD manifest as YAML, exactly as committed in `crds/`.
pub fn crd_yaml() -> String {
    let yaml = serde_saphyr::to_string(&At::crd()).expect("the CRD type always serializes");
    format!("# Generated by `cnat crd`; do not edit.\n---\n{yaml}")
}
