//! The `At` custom resource: spec, status, phases and conditions. The CRD is generated from these
//! types (`cnat crd`), so every doc comment here is what `kubectl explain at` prints.

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::{EnvVar, LocalObjectReference, ResourceRequirements, Toleration};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceConversion, CustomResourceDefinition, CustomResourceDefinitionVersion,
    ServiceReference, WebhookClientConfig, WebhookConversion,
};
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// API group of the At resource.
pub const GROUP: &str = "cnat.programming-kubernetes.info";
/// Image that runs the command when neither `spec.template.image` nor the operator
/// (`cnat run --default-image`) names one: pinned (a tag other than `latest`), so that kubelets
/// use the copy they have (`IfNotPresent`) and every run gets the same image.
pub const DEFAULT_IMAGE: &str = "busybox:1.36";

/// Run a shell command once, at a given time, in a pod.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "cnat.programming-kubernetes.info",
    version = "v1",
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
    #[schemars(length(max = crate::limits::bounds::MAX_SCHEDULE))]
    pub schedule: String,
    /// IANA time zone (e.g. `Europe/Berlin`) in which a `schedule` without offset is read, as in
    /// a CronJob. A wall-clock time that does not exist there (skipped by a daylight-saving
    /// change) or exists twice is refused with both instants it could mean.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = crate::limits::bounds::MAX_TIME_ZONE))]
    pub time_zone: Option<String>,
    /// Shell command to run, passed to `/bin/sh -c`, so quoting, pipes and `&&` work as in a
    /// shell. It runs once; its exit code decides the outcome. At most 131,071 bytes (what Linux
    /// passes to a program as one argument): a longer script belongs in the image.
    #[schemars(length(max = crate::limits::bounds::MAX_COMMAND))]
    pub command: String,
    /// If the command cannot start within this many seconds after its schedule (operator down,
    /// quota, policy), it never runs: the At ends `Done` with outcome `Missed`. Without it, an At
    /// runs however late. As in a CronJob.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 2147483647))]
    pub starting_deadline_seconds: Option<i64>,
    /// The command's time limit in seconds, counted from the pod's start; a command that runs
    /// longer is stopped and the At ends `Done`, outcome `Failed`, reason `DeadlineExceeded`.
    /// As in a Job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2147483647))]
    pub active_deadline_seconds: Option<i64>,
    /// Delete the At (and its pod) this many seconds after it is `Done`, as for a Job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 2147483647))]
    pub ttl_seconds_after_finished: Option<i32>,
    /// The pod that runs the command: its image, resources, environment and placement.
    #[serde(default)]
    #[schemars(extend("default" = {}))]
    pub template: AtPodTemplate,
}

/// The settings of the pod that runs the command, with the names and types of a pod's and a
/// container's own fields. The pod always runs one container, `command`, as `/bin/sh -c` under
/// the `restricted` Pod Security profile; nothing here reaches its security context, volumes,
/// host namespaces or ports.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = crate::limits::bounds::bound_template_schema)]
pub struct AtPodTemplate {
    /// Labels and annotations added to the pod (cnat's own labels win over these).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<PodMetadata>,
    /// Container image that runs the command; it must provide `/bin/sh`. Without it, the
    /// operator's default image runs it (`busybox:1.36` unless the operator names another).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = crate::limits::bounds::MAX_IMAGE))]
    pub image: Option<String>,
    /// When the node pulls `image`: `Always`, `IfNotPresent` or `Never`, as for any container.
    /// Without it, the operator's default, else Kubernetes' (`Always` for an image tagged
    /// `latest` or not tagged, `IfNotPresent` otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<ImagePullPolicy>,
    /// CPU and memory requests and limits of the command's container. Needed in namespaces whose
    /// ResourceQuota limits `requests.*` or `limits.*` (unless the operator sets defaults).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Environment variables of the command: `value`, or `valueFrom` a Secret, ConfigMap or
    /// field of the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = crate::limits::bounds::MAX_ENV))]
    pub env: Option<Vec<EnvVar>>,
    /// Service account the pod runs as. Its API token is mounted only when this is set; by
    /// default the pod has no token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = crate::limits::bounds::MAX_NAME))]
    pub service_account_name: Option<String>,
    /// Node labels the pod's node must have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = crate::limits::bounds::MAX_ENTRIES))]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Taints the pod tolerates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = crate::limits::bounds::MAX_TOLERATIONS))]
    pub tolerations: Option<Vec<Toleration>>,
    /// Secrets (in the At's namespace) holding credentials to pull `image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = crate::limits::bounds::MAX_PULL_SECRETS))]
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
}

// When the node pulls a container's image (a container's `imagePullPolicy`). No doc comment:
// schemars would put it in the CRD in place of the field's own description.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ImagePullPolicy {
    /// Pull on every start.
    Always,
    /// Pull only when the node does not have the image.
    IfNotPresent,
    /// Never pull: the image must be on the node already.
    Never,
}

impl ImagePullPolicy {
    /// Every policy, in the order the API lists them.
    pub const ALL: [ImagePullPolicy; 3] = [
        ImagePullPolicy::Always,
        ImagePullPolicy::IfNotPresent,
        ImagePullPolicy::Never,
    ];

    /// The API spelling: `Always`, `IfNotPresent` or `Never`.
    pub fn as_str(self) -> &'static str {
        match self {
            ImagePullPolicy::Always => "Always",
            ImagePullPolicy::IfNotPresent => "IfNotPresent",
            ImagePullPolicy::Never => "Never",
        }
    }
}

/// Labels and annotations for the pod, e.g. to opt it out of a service mesh's sidecar or to
/// label it for cost allocation.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct PodMetadata {
    /// Labels of the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = crate::limits::bounds::MAX_ENTRIES))]
    pub labels: Option<BTreeMap<String, String>>,
    /// Annotations of the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = crate::limits::bounds::MAX_ENTRIES))]
    pub annotations: Option<BTreeMap<String, String>>,
}

/// What happened to this At so far, written only by the operator. Defaults to `Pending`: the
/// apiserver drops status sent on create, and this schema default shows on every read.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend(
    "default" = {"phase": "Pending"},
    "x-kubernetes-validations" = [{
        "rule": "!has(oldSelf.phase) || self.phase == oldSelf.phase || oldSelf.phase == 'Pending' || (oldSelf.phase == 'Running' && self.phase == 'Done')",
        "message": "status.phase cannot go back (Pending -> Running -> Done): an At runs at most once; create a new At to run the command again"
    }]
))]
pub struct AtStatus {
    /// `Pending` until the schedule is due, `Running` while the pod runs, `Done` once it ended.
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
    /// `Done`.
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
    /// Standard conditions: `Scheduled`, `PodCreated`, and `Complete` or `Failed` once `Done`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A policy as the API spells it (the flags that set one read it so).
impl std::str::FromStr for ImagePullPolicy {
    type Err = String;

    fn from_str(raw: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|policy| policy.as_str() == raw)
            .ok_or_else(|| {
                format!("{raw:?} is not an imagePullPolicy; give Always, IfNotPresent or Never")
            })
    }
}

/// Lifecycle phase of an At, in CamelCase as the API conventions spell enum values.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
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
    /// The phase, `Pending` while no status was written (the schema default).
    pub fn phase(&self) -> Phase {
        self.status.as_ref().map(|s| s.phase).unwrap_or_default()
    }
}

impl Phase {
    /// The API spelling: `Pending`, `Running` or `Done`.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "Pending",
            Phase::Running => "Running",
            Phase::Done => "Done",
        }
    }

    /// The `phase` label of `cnat_ats`: `PENDING`, `RUNNING` or `DONE`, as since v1alpha1, so
    /// that dashboards and alerts keep working across the API change.
    pub fn metric_label(self) -> &'static str {
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

/// The `v1alpha1` version as it was served before `v1`: frozen (a deprecated version must not
/// change), served, not stored, with a warning naming `v1`.
const V1ALPHA1_VERSION: &str = include_str!("api/v1alpha1.yaml");

/// Where the API server sends `ConversionReview`s: cnat's webhook Service, as `webhooks/` and
/// the chart's defaults name it (namespace `cnat-system`, Service `cnat-webhook`, port 443).
pub fn conversion_service(namespace: &str, name: &str) -> WebhookClientConfig {
    WebhookClientConfig {
        service: Some(ServiceReference {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            path: Some("/convert".to_owned()),
            port: Some(443),
        }),
        ..WebhookClientConfig::default()
    }
}

/// The CRD: `v1` from the types above (stored), `v1alpha1` frozen, conversion between them by
/// cnat's webhook at `client` (its `caBundle` included when set).
pub fn crd_with(client: WebhookClientConfig) -> CustomResourceDefinition {
    let mut crd = At::crd();
    let old: Vec<CustomResourceDefinitionVersion> =
        serde_saphyr::from_str(V1ALPHA1_VERSION).expect("the frozen v1alpha1 version parses");
    crd.spec.versions.extend(old);
    crd.spec.conversion = Some(CustomResourceConversion {
        strategy: "Webhook".to_owned(),
        webhook: Some(WebhookConversion {
            client_config: Some(client),
            conversion_review_versions: vec!["v1".to_owned()],
        }),
    });
    crd
}

/// `crd` as YAML, the way `cnat crd` prints it.
pub fn crd_to_yaml(crd: &CustomResourceDefinition) -> String {
    let yaml = serde_saphyr::to_string(crd).expect("the CRD type always serializes");
    format!("# Generated by `cnat crd`; do not edit.\n---\n{yaml}")
}

/// The CRD manifest as YAML, exactly as committed in `crds/`: conversion by the Service
/// `cnat-system/cnat-webhook`, no `caBundle` (`cnat crd --ca-bundle` adds one).
pub fn crd_yaml() -> String {
    crd_to_yaml(&crd_with(conversion_service("cnat-system", "cnat-webhook")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    /// The schema of `v1`, as the CRD will carry it.
    fn schema() -> serde_json::Value {
        let crd = serde_json::to_value(At::crd()).unwrap();
        assert_eq!(crd["spec"]["versions"][0]["name"], "v1");
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
    }

    #[test]
    fn the_template_is_defaulted_by_the_schema_and_its_image_by_the_operator() {
        let spec = &schema()["properties"]["spec"];
        assert_eq!(
            spec["properties"]["template"]["default"],
            serde_json::json!({})
        );
        let template = &spec["properties"]["template"]["properties"];
        // The sizes the schema can say (crate::limits).
        use crate::limits::*;
        assert_eq!(spec["properties"]["command"]["maxLength"], MAX_COMMAND);
        assert_eq!(spec["properties"]["schedule"]["maxLength"], MAX_SCHEDULE);
        assert_eq!(spec["properties"]["timeZone"]["maxLength"], MAX_TIME_ZONE);
        assert_eq!(template["image"]["maxLength"], MAX_IMAGE);
        assert_eq!(template["serviceAccountName"]["maxLength"], MAX_NAME);
        assert_eq!(template["env"]["maxItems"], MAX_ENV);
        assert_eq!(template["nodeSelector"]["maxProperties"], MAX_ENTRIES);
        assert_eq!(template["tolerations"]["maxItems"], MAX_TOLERATIONS);
        assert_eq!(template["imagePullSecrets"]["maxItems"], MAX_PULL_SECRETS);
        let pod_metadata = &template["metadata"]["properties"];
        assert_eq!(pod_metadata["labels"]["maxProperties"], MAX_ENTRIES);
        assert_eq!(pod_metadata["annotations"]["maxProperties"], MAX_ENTRIES);
        // Inside Kubernetes' own types too (`bound_template_schema`).
        let at = |path: &str| -> &serde_json::Value {
            path.split('/').fold(template, |schema, step| match step {
                "[]" => &schema["items"],
                "*" => &schema["additionalProperties"],
                name => match schema.get("properties") {
                    Some(properties) => &properties[name],
                    None => &schema[name],
                },
            })
        };
        let env = "env/[]";
        assert_eq!(at(&format!("{env}/value"))["maxLength"], MAX_ENV_VALUE);
        assert_eq!(at(&format!("{env}/name"))["maxLength"], MAX_FIELD);
        let secret = format!("{env}/valueFrom/secretKeyRef/key");
        assert_eq!(at(&secret)["maxLength"], MAX_FIELD);
        assert_eq!(at("tolerations/[]/key")["maxLength"], MAX_FIELD);
        assert_eq!(at("nodeSelector/*")["maxLength"], MAX_LABEL_VALUE);
        assert_eq!(at("metadata/labels/*")["maxLength"], MAX_LABEL_VALUE);
        assert_eq!(at("metadata/annotations/*")["maxLength"], MAX_SPEC_BYTES);
        assert_eq!(at("resources/limits")["maxProperties"], MAX_ENTRIES);
        assert_eq!(at("resources/claims")["maxItems"], MAX_ITEMS);
        // A quantity keeps Kubernetes' schema: no length, an int or a string.
        let quantity = at("resources/limits/*");
        assert_eq!(quantity["x-kubernetes-int-or-string"], true, "{quantity}");
        assert!(quantity.get("maxLength").is_none(), "{quantity}");
        // What already had a bound keeps it.
        assert_eq!(template["image"]["maxLength"], MAX_IMAGE);
        // No schema default: an At without an image runs the operator's default image.
        assert!(template["image"].get("default").is_none(), "{template}");
        assert_eq!(
            template["imagePullPolicy"]["enum"],
            serde_json::json!(["Always", "IfNotPresent", "Never"])
        );
        let required: Vec<&str> = spec["required"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert_eq!(required, ["command", "schedule"]);
        for field in crate::conversion::POD_FIELDS {
            assert!(template.get(field).is_some(), "spec.template.{field}");
            assert!(spec["properties"].get(field).is_none(), "spec.{field}");
        }
    }

    #[test]
    fn the_phase_is_camel_case_and_cannot_go_back() {
        let status = &schema()["properties"]["status"];
        assert_eq!(status["default"], serde_json::json!({"phase": "Pending"}));
        assert_eq!(
            status["properties"]["phase"]["enum"],
            serde_json::json!(["Pending", "Running", "Done"])
        );
        let rule = status["x-kubernetes-validations"][0]["rule"]
            .as_str()
            .unwrap();
        assert!(
            rule.contains("'Pending'") && !rule.contains("PENDING"),
            "{rule}"
        );
    }
}
