//! The pod an At runs in: its name, labels and spec, the trimmed copy the cache keeps, and the
//! summary of it that the state machine reads. Pure: no client, no clock.

use crate::api::{At, AtStatus};
use crate::operator::finalizer;
use crate::operator::key::controller;
use crate::operator::policy::RunPolicy;
use crate::operator::signing::{Key, Signing, SIGNATURE_LEN};
use crate::schedule::to_chrono;
use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerStatus, Pod, PodCondition, PodSecurityContext, PodSpec,
    PodStatus, SeccompProfile, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::{Resource, ResourceExt};
use thiserror::Error;

/// Label that marks pods created by cnat; the operator watches and caches only these.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of `MANAGED_BY_LABEL`.
pub const MANAGED_BY: &str = "cnat";
/// Label selector for the pods the operator caches.
pub const SELECTOR: &str = "app.kubernetes.io/managed-by=cnat";
/// Label that names the At a pod belongs to, so `kubectl get pods -l` finds it.
pub const AT_LABEL: &str = "cnat.programming-kubernetes.info/at";
/// Annotation with cnat's signature of the pod (`signing::Key::sign`): a pod without it (or
/// with another) was not created by cnat, whatever its name and controller reference say.
pub const SIGNATURE: &str = "cnat.programming-kubernetes.info/signature";
/// Name of the container that runs the command.
pub const CONTAINER: &str = "command";
/// Numeric non-root user the command runs as (`nobody`), as the `restricted` profile demands.
pub const RUN_AS_USER: i64 = 65534;
/// Label values are limited to 63 characters, and the At name is one.
const MAX_LABEL_VALUE: usize = 63;
/// Longest termination message kept in status; pods may report up to 4 KiB.
const MAX_MESSAGE: usize = 512;

/// An At name from which no valid pod can be derived. Messages name the field, value and fix.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum NameError {
    #[error(
        "metadata.name: {name:?} is {len} characters, but At names may have at most 63, because the name is the value of the pod label {AT_LABEL}; use a shorter name"
    )]
    TooLong { name: String, len: usize },
    #[error(
        "metadata.name: pod name {pod:?} derived from it is not a valid DNS subdomain (lowercase letters, digits, '-' and '.', starting and ending with a letter or digit); rename the At"
    )]
    InvalidPodName { pod: String },
}

/// The book's naming: the pod of At `x` is `x-pod`.
pub fn name_for(at_name: &str) -> String {
    format!("{at_name}-pod")
}

/// Checks that `at_name` yields a valid pod name and label value.
pub fn check_name(at_name: &str) -> Result<(), NameError> {
    let len = at_name.chars().count();
    if len > MAX_LABEL_VALUE {
        return Err(NameError::TooLong {
            name: at_name.to_owned(),
            len,
        });
    }
    let pod = name_for(at_name);
    if !is_dns_subdomain(&pod) {
        return Err(NameError::InvalidPodName { pod });
    }
    Ok(())
}

/// RFC 1123 subdomain, as Kubernetes requires of pod names.
pub(crate) fn is_dns_subdomain(name: &str) -> bool {
    let label_ok = |label: &str| {
        let bytes = label.as_bytes();
        !bytes.is_empty()
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
            && bytes[0] != b'-'
            && bytes[bytes.len() - 1] != b'-'
    };
    name.len() <= 253 && name.split('.').all(label_ok)
}

/// The pod that runs `at`'s command: controlled by the At, never restarted, with the At's pod
/// settings (the policy's defaults where it has none), within the `restricted` Pod Security
/// profile whatever the At says (docs/src/operating/security.md, "Locked-down pods").
pub fn build(at: &At, policy: &RunPolicy) -> Pod {
    let spec = &at.spec;
    let at_name = at.name_any();
    // The At's pod labels, then cnat's own (which win: the pod watch and `kubectl get pods -l`
    // rely on them), and the At's pod annotations.
    let metadata = spec.template.metadata.clone().unwrap_or_default();
    let mut labels = metadata.labels.unwrap_or_default();
    labels.extend([
        (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
        (AT_LABEL.to_owned(), at_name.clone()),
    ]);
    // The At's shard, so a Lease shard's pod watch selects its Ats' pods (and only them).
    match crate::shard::value_of(at.metadata.labels.as_ref()) {
        Some(value) => labels.insert(crate::shard::LABEL.to_owned(), value.to_string()),
        None => labels.remove(crate::shard::LABEL),
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(name_for(&at_name)),
            namespace: at.namespace(),
            labels: Some(labels),
            annotations: metadata.annotations.filter(|a| !a.is_empty()),
            owner_references: at.controller_owner_ref(&()).map(|owner| vec![owner]),
            finalizers: Some(vec![finalizer::FINALIZER.to_owned()]),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            // A token only for a service account the At names.
            automount_service_account_token: Some(spec.template.service_account_name.is_some()),
            service_account_name: spec.template.service_account_name.clone(),
            active_deadline_seconds: spec
                .active_deadline_seconds
                .or(policy.active_deadline_seconds),
            node_selector: spec.template.node_selector.clone(),
            tolerations: spec.template.tolerations.clone(),
            image_pull_secrets: spec.template.image_pull_secrets.clone(),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(RUN_AS_USER),
                run_as_group: Some(RUN_AS_USER),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    ..SeccompProfile::default()
                }),
                ..PodSecurityContext::default()
            }),
            containers: vec![Container {
                name: CONTAINER.into(),
                image: Some(policy.image(spec.template.image.as_deref())),
                image_pull_policy: policy.image_pull_policy(spec.template.image_pull_policy),
                command: Some(vec!["/bin/sh".into(), "-c".into(), at.spec.command.clone()]),
                env: spec.template.env.clone(),
                resources: policy.resources(spec.template.resources.as_ref()),
                // The log tail becomes the termination message, so a failure explains itself.
                termination_message_policy: Some("FallbackToLogsOnError".into()),
                security_context: Some(SecurityContext {
                    allow_privilege_escalation: Some(false),
                    capabilities: Some(Capabilities {
                        drop: Some(vec!["ALL".into()]),
                        ..Capabilities::default()
                    }),
                    ..SecurityContext::default()
                }),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// The pod labels cnat reads (which it sets on every pod it creates).
const CACHED_LABELS: [&str; 3] = [MANAGED_BY_LABEL, AT_LABEL, crate::shard::LABEL];

/// Drops what the operator never reads, so the cache stays small.
pub fn trim(pod: &mut Pod) {
    pod.metadata.managed_fields = None;
    // Of its annotations only cnat's signature, when it has a signature's length.
    if let Some(annotations) = pod.metadata.annotations.as_mut() {
        annotations.retain(|key, value| key == SIGNATURE && value.len() == SIGNATURE_LEN);
    }
    if pod
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.is_empty())
    {
        pod.metadata.annotations = None;
    }
    // Whoever may create pods may label one as cnat's: of its labels only cnat's own, of its
    // owners only its controller, of its finalizers a bounded few.
    if let Some(finalizers) = pod.metadata.finalizers.as_mut() {
        finalizer::trim(finalizers);
    }
    if let Some(labels) = pod.metadata.labels.as_mut() {
        labels.retain(|key, _| CACHED_LABELS.contains(&key.as_str()));
    }
    if let Some(owners) = pod.metadata.owner_references.as_mut() {
        owners.retain(|owner| owner.controller == Some(true));
        owners.truncate(1);
    }
    // Only its deadline (`view` reads it).
    pod.spec = pod
        .spec
        .take()
        .and_then(|spec| spec.active_deadline_seconds)
        .map(|seconds| PodSpec {
            active_deadline_seconds: Some(seconds),
            ..PodSpec::default()
        });
    // Only what `view` reads: of the conditions the scheduler's refusal (`waiting_of`), of the
    // containers the command's, its state.
    pod.status = pod.status.take().map(|status| {
        let conditions: Vec<PodCondition> = status
            .conditions
            .into_iter()
            .flatten()
            .filter(|c| c.type_ == "PodScheduled" && c.status == "False")
            .map(|c| PodCondition {
                type_: c.type_,
                status: c.status,
                reason: c.reason,
                message: c.message,
                ..PodCondition::default()
            })
            .collect();
        let container = status
            .container_statuses
            .into_iter()
            .flatten()
            .find(|c| c.name == CONTAINER)
            .map(|c| ContainerStatus {
                name: c.name,
                state: c.state,
                ..ContainerStatus::default()
            });
        PodStatus {
            phase: status.phase,
            reason: status.reason,
            message: status.message,
            conditions: (!conditions.is_empty()).then_some(conditions),
            container_statuses: container.map(|c| vec![c]),
            ..PodStatus::default()
        }
    });
}

/// Signs `pod` as cnat's pod of the At whose uid is `at_uid` (a `SIGNATURE` among the At's
/// pod annotations is replaced).
pub fn sign(pod: &mut Pod, at_uid: &str, key: &Key) {
    let signature = key.sign(at_uid, &pod.name_any());
    pod.annotations_mut()
        .insert(SIGNATURE.to_owned(), signature);
}

/// Whether `pod` carries cnat's signature as the pod of the At whose uid is `at_uid`.
pub fn is_signed(pod: &Pod, at_uid: &str, key: &Key) -> bool {
    pod.annotations()
        .get(SIGNATURE)
        .is_some_and(|signature| key.verifies(at_uid, &pod.name_any(), signature))
}

/// Whether `pod` (by the name of `at`'s pod) is the pod cnat created for `at`: controlled by
/// it, and signed by cnat for it, or named by its status once it is RUNNING or DONE, or created,
/// as was its At, no later than the second of `Signing::since` (the API server's clock, in whole
/// seconds: a release that did not sign made it).
pub fn is_cnats(pod: &Pod, at: &At, signing: &Signing) -> bool {
    let Some(at_uid) = at.metadata.uid.as_deref() else {
        return false;
    };
    let named = at.status.as_ref().is_some_and(|status| {
        status.phase != crate::api::Phase::Pending
            && status.pod_name.as_deref() == pod.metadata.name.as_deref()
    });
    // All three times are whole seconds: what was made in the key's second counts as before it.
    let before = |created: Option<&Time>| matches!((created.map(to_chrono), signing.since), (Some(c), Some(s)) if c <= s);
    let before_signing = before(pod.metadata.creation_timestamp.as_ref())
        && before(at.metadata.creation_timestamp.as_ref());
    is_controlled_by(pod, at_uid)
        && (named || before_signing || is_signed(pod, at_uid, &signing.key))
}

/// Whether `pod` is controlled by the At with this uid.
pub fn is_controlled_by(pod: &Pod, at_uid: &str) -> bool {
    controller(pod).is_some_and(|owner| owner.uid == at_uid)
}

/// What the state machine needs to know about a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    pub name: String,
    pub created_at: Option<DateTime<Utc>>,
    pub end: Option<PodEnd>,
    /// Being deleted (it has a deletionTimestamp).
    pub deleting: bool,
    /// Carries cnat's finalizer (`finalizer::FINALIZER`).
    pub finalizer: bool,
    /// Why it has not started the command, when it is stuck (not merely on its way).
    pub waiting: Option<Waiting>,
    /// It runs the command (phase `Running`).
    pub running: bool,
    /// Its own `activeDeadlineSeconds`, as cnat created it: the deadline cnat enforces (a
    /// later change of the At's spec or of the operator's default does not move it).
    pub active_deadline_seconds: Option<i64>,
}

/// A pod that has not ended and cannot start its command as things stand: what a user must
/// fix (or wait out), from the scheduler's or the kubelet's own words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    /// What kind of trouble: the same through the kubelet's and the scheduler's retries (which
    /// reword the message, and alternate `ErrImagePull` with `ImagePullBackOff`).
    pub stuck: Stuck,
    /// `Reason: message` as the pod says it, shortened.
    pub detail: String,
}

/// The kinds of trouble that keep a pod from starting its command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stuck {
    /// No node takes it (`PodScheduled=False`, reason `Unschedulable`).
    Unschedulable,
    /// Its image cannot be pulled (`ErrImagePull`, `ImagePullBackOff`).
    ImagePullBackOff,
    /// Its image is not on the node and `imagePullPolicy: Never` forbids pulling it.
    ErrImageNeverPull,
    /// Its image's name is not a valid reference.
    InvalidImageName,
    /// Its container cannot be configured (a missing Secret or ConfigMap in `env`).
    CreateContainerConfigError,
    /// Its container cannot be created.
    CreateContainerError,
}

/// The At condition that is False while its pod cannot start the command, with the kind of
/// trouble as its reason; True once it could after all; absent while nothing stood in its way.
pub const POD_STARTED: &str = "PodStarted";

impl Stuck {
    /// Every kind, in the order the metrics list them.
    pub const ALL: [Stuck; 6] = [
        Stuck::Unschedulable,
        Stuck::ImagePullBackOff,
        Stuck::ErrImageNeverPull,
        Stuck::InvalidImageName,
        Stuck::CreateContainerConfigError,
        Stuck::CreateContainerError,
    ];

    /// The kind of trouble an At's status shows (`PodStarted=False`), if any.
    pub fn shown(status: &AtStatus) -> Option<Stuck> {
        let condition = status
            .conditions
            .iter()
            .find(|c| c.type_ == POD_STARTED && c.status == "False")?;
        Stuck::ALL
            .into_iter()
            .find(|stuck| stuck.reason() == condition.reason)
    }

    /// The At's reason (and event reason) for it.
    pub fn reason(self) -> &'static str {
        match self {
            Stuck::Unschedulable => "Unschedulable",
            Stuck::ImagePullBackOff => "ImagePullBackOff",
            Stuck::ErrImageNeverPull => "ErrImageNeverPull",
            Stuck::InvalidImageName => "InvalidImageName",
            Stuck::CreateContainerConfigError => "CreateContainerConfigError",
            Stuck::CreateContainerError => "CreateContainerError",
        }
    }

    /// The kind a container's waiting reason names, if it is stuck: `ContainerCreating` and
    /// `PodInitializing` are on their way.
    fn of_container(reason: &str) -> Option<Stuck> {
        Some(match reason {
            "ErrImagePull" | "ImagePullBackOff" => Stuck::ImagePullBackOff,
            "ErrImageNeverPull" => Stuck::ErrImageNeverPull,
            "InvalidImageName" => Stuck::InvalidImageName,
            "CreateContainerConfigError" => Stuck::CreateContainerConfigError,
            "CreateContainerError" => Stuck::CreateContainerError,
            _ => return None,
        })
    }
}

/// How a pod ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodEnd {
    pub succeeded: bool,
    /// The command's exit code, when the container ran to the end.
    pub exit_code: Option<i32>,
    /// Why it ended, from the container or the pod (`Error`, `Evicted`, termination message).
    pub detail: Option<String>,
    /// The pod's own reason, e.g. `DeadlineExceeded` when `activeDeadlineSeconds` stopped it.
    pub pod_reason: Option<String>,
    pub finished_at: Option<DateTime<Utc>>,
}

impl PodEnd {
    /// A failure nothing is known of (the pod went, or was ended, before it said how).
    pub fn unknown() -> PodEnd {
        PodEnd {
            succeeded: false,
            exit_code: None,
            detail: None,
            pod_reason: None,
            finished_at: None,
        }
    }
}

/// Summarizes a pod: whether and how it ended.
pub fn view(pod: &Pod) -> PodView {
    PodView {
        name: pod.name_any(),
        created_at: pod.metadata.creation_timestamp.as_ref().map(to_chrono),
        end: end_of(pod),
        deleting: pod.metadata.deletion_timestamp.is_some(),
        finalizer: finalizer::is_present(pod),
        waiting: waiting_of(pod),
        running: pod
            .status
            .as_ref()
            .is_some_and(|s| s.phase.as_deref() == Some("Running")),
        active_deadline_seconds: pod.spec.as_ref().and_then(|s| s.active_deadline_seconds),
    }
}

/// Why `pod`, which has not ended, cannot start its command, if it is stuck: its container's
/// waiting reason, else the scheduler's `PodScheduled=False` condition.
pub fn waiting_of(pod: &Pod) -> Option<Waiting> {
    let status = pod.status.as_ref()?;
    if matches!(
        status.phase.as_deref(),
        Some("Succeeded" | "Failed" | "Running")
    ) {
        return None;
    }
    let waiting = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == CONTAINER)
        .and_then(|c| c.state.as_ref()?.waiting.as_ref());
    if let Some(waiting) = waiting {
        let reason = waiting.reason.as_deref().unwrap_or_default();
        return Stuck::of_container(reason).map(|stuck| Waiting {
            stuck,
            detail: shorten(&join(Some(reason), waiting.message.as_deref()).unwrap_or_default()),
        });
    }
    status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .filter(|c| c.reason.as_deref() == Some("Unschedulable"))
        .map(|c| Waiting {
            stuck: Stuck::Unschedulable,
            detail: shorten(&join(c.reason.as_deref(), c.message.as_deref()).unwrap_or_default()),
        })
}

/// Whether `pod` ended (`Succeeded` or `Failed`): it changes no more.
pub fn has_ended(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed"))
}

fn end_of(pod: &Pod) -> Option<PodEnd> {
    let status = pod.status.as_ref()?;
    let succeeded = match status.phase.as_deref() {
        Some("Succeeded") => true,
        Some("Failed") => false,
        _ => return None,
    };
    let terminated = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c: &&ContainerStatus| c.name == CONTAINER)
        .and_then(|c| c.state.as_ref()?.terminated.as_ref());
    let detail = terminated
        .and_then(|t| join(t.reason.as_deref(), t.message.as_deref()))
        .or_else(|| join(status.reason.as_deref(), status.message.as_deref()));
    Some(PodEnd {
        succeeded,
        exit_code: terminated.map(|t| t.exit_code),
        detail: detail.map(|d| shorten(&d)),
        pod_reason: status.reason.clone(),
        finished_at: terminated
            .and_then(|t| t.finished_at.as_ref())
            .map(to_chrono),
    })
}

fn join(reason: Option<&str>, message: Option<&str>) -> Option<String> {
    let message = message.map(str::trim).filter(|m| !m.is_empty());
    match (reason, message) {
        (Some(r), Some(m)) => Some(format!("{r}: {m}")),
        (Some(r), None) => Some(r.to_owned()),
        (None, Some(m)) => Some(m.to_owned()),
        (None, None) => None,
    }
}

fn shorten(text: &str) -> String {
    match text.char_indices().nth(MAX_MESSAGE) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn build_default(at: &At) -> Pod {
        build(at, &RunPolicy::default())
    }
    use crate::api::AtSpec;
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateTerminated, PodStatus};

    fn at(name: &str) -> At {
        let mut at = At::new(
            name,
            AtSpec {
                schedule: "2019-04-12T10:12:00Z".into(),
                command: "echo 'a b' | tr a-z A-Z && exit 3".into(),
                template: crate::api::AtPodTemplate {
                    image: Some("busybox:1.36".into()),
                    ..Default::default()
                },
                ..AtSpec::default()
            },
        );
        at.metadata.namespace = Some("team-a".into());
        at.metadata.uid = Some("uid-1".into());
        at
    }

    #[test]
    fn the_pod_carries_its_ats_shard_value_and_no_other() {
        use crate::shard::LABEL;
        for (at_label, template_label, expected) in [
            (Some("7"), None, Some("7")),
            (Some("7"), Some("3"), Some("7")),
            (None, Some("3"), None),
            (Some("x"), Some("3"), None),
            (Some("07"), None, None),
        ] {
            let mut at = at("example-at");
            if let Some(value) = at_label {
                at.metadata.labels = Some([(LABEL.to_owned(), value.to_owned())].into());
            }
            if let Some(value) = template_label {
                let metadata = at
                    .spec
                    .template
                    .metadata
                    .get_or_insert_with(Default::default);
                metadata.labels = Some([(LABEL.to_owned(), value.to_owned())].into());
            }
            let labels = build_default(&at).metadata.labels.unwrap();
            assert_eq!(
                labels.get(LABEL).map(String::as_str),
                expected,
                "{at_label:?} {template_label:?}"
            );
        }
    }

    #[test]
    fn pod_runs_the_command_through_a_shell_once_under_the_restricted_profile() {
        let pod = build_default(&at("example-at"));
        assert_eq!(pod.metadata.name.as_deref(), Some("example-at-pod"));
        assert_eq!(pod.metadata.namespace.as_deref(), Some("team-a"));
        let labels = pod.metadata.labels.clone().unwrap();
        assert_eq!(labels[MANAGED_BY_LABEL], "cnat");
        assert_eq!(labels[AT_LABEL], "example-at");
        let owner = &pod.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str()),
            ("At", "example-at")
        );
        assert_eq!(owner.api_version, "cnat.programming-kubernetes.info/v1");
        assert_eq!(owner.controller, Some(true));
        assert!(is_controlled_by(&pod, "uid-1"));
        assert!(!is_controlled_by(&pod, "uid-2"));

        let spec = pod.spec.unwrap();
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.automount_service_account_token, Some(false));
        let psc = spec.security_context.unwrap();
        assert_eq!(psc.run_as_non_root, Some(true));
        assert!(psc.run_as_user.unwrap() > 0);
        assert_eq!(psc.seccomp_profile.unwrap().type_, "RuntimeDefault");
        let [container] = spec.containers.as_slice() else {
            panic!("one container")
        };
        assert_eq!(container.image.as_deref(), Some("busybox:1.36"));
        assert_eq!(container.image_pull_policy, None, "Kubernetes' default");
        assert_eq!(
            container.command.clone().unwrap(),
            ["/bin/sh", "-c", "echo 'a b' | tr a-z A-Z && exit 3"]
        );
        let sc = container.security_context.clone().unwrap();
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.capabilities.unwrap().drop.unwrap(), ["ALL"]);
        assert_eq!(container.resources, None);
        assert_eq!(spec.active_deadline_seconds, None);
    }

    #[test]
    fn the_ats_pod_settings_are_carried_into_the_pod_still_restricted() {
        let mut with = at("example-at");
        with.spec = serde_json::from_value(serde_json::json!({
            "schedule": "2019-04-12T10:12:00Z", "command": "backup",
            "activeDeadlineSeconds": 600,
            "template": {
                "image": "tools:1",
                "resources": {"limits": {"memory": "1Gi"}},
                "env": [{"name": "TARGET", "value": "s3://b"},
                        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}],
                "serviceAccountName": "backup-runner",
                "nodeSelector": {"kubernetes.io/arch": "arm64"},
                "tolerations": [{"key": "batch", "operator": "Exists", "effect": "NoSchedule"}],
                "imagePullSecrets": [{"name": "registry"}],
                "metadata": {
                    "labels": {"team": "storage", "app.kubernetes.io/managed-by": "someone-else"},
                    "annotations": {"sidecar.istio.io/inject": "false"},
                },
            },
        }))
        .unwrap();
        let policy = RunPolicy {
            requests: crate::operator::policy::parse_quantities("cpu=100m,memory=64Mi").unwrap(),
            limits: crate::operator::policy::parse_quantities("cpu=1,memory=256Mi").unwrap(),
            active_deadline_seconds: Some(3600),
            ..RunPolicy::default()
        };
        let pod = build(&with, &policy);
        let json = serde_json::to_value(&pod).unwrap();
        // The At's pod labels and annotations, cnat's own labels winning.
        assert_eq!(
            json["metadata"]["labels"],
            serde_json::json!({"team": "storage", "app.kubernetes.io/managed-by": "cnat",
                               "cnat.programming-kubernetes.info/at": "example-at"})
        );
        assert_eq!(
            json["metadata"]["annotations"],
            serde_json::json!({"sidecar.istio.io/inject": "false"})
        );
        let spec = &json["spec"];
        assert_eq!(spec["serviceAccountName"], "backup-runner");
        assert_eq!(
            spec["automountServiceAccountToken"], true,
            "a token for the named account"
        );
        assert_eq!(spec["activeDeadlineSeconds"], 600, "the At's own wins");
        assert_eq!(spec["nodeSelector"]["kubernetes.io/arch"], "arm64");
        assert_eq!(spec["tolerations"][0]["key"], "batch");
        assert_eq!(spec["imagePullSecrets"][0]["name"], "registry");
        let container = &spec["containers"][0];
        assert_eq!(
            container["env"][1]["valueFrom"]["secretKeyRef"]["key"],
            "token"
        );
        // Defaults fill in per resource; the At's memory limit wins.
        assert_eq!(
            container["resources"],
            serde_json::json!({"limits": {"cpu": "1", "memory": "1Gi"},
                               "requests": {"cpu": "100m", "memory": "64Mi"}})
        );
        // Still the restricted profile.
        assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
        assert_eq!(
            spec["securityContext"]["seccompProfile"]["type"],
            "RuntimeDefault"
        );
        assert_eq!(
            container["securityContext"]["allowPrivilegeEscalation"],
            false
        );
        assert_eq!(
            container["securityContext"]["capabilities"]["drop"][0],
            "ALL"
        );
        for absent in ["volumes", "hostNetwork", "hostPID", "hostIPC"] {
            assert!(spec.get(absent).is_none(), "{absent}");
        }
        // The default deadline applies when the At has none.
        with.spec.active_deadline_seconds = None;
        let pod = build(&with, &policy);
        assert_eq!(pod.spec.unwrap().active_deadline_seconds, Some(3600));
    }

    #[test]
    fn the_image_and_its_pull_policy_are_the_ats_else_the_operators() {
        use crate::api::ImagePullPolicy::{IfNotPresent, Never};
        let container = |at: &At, policy: &RunPolicy| {
            let pod = build(at, policy);
            let container = pod.spec.unwrap().containers.remove(0);
            (container.image.unwrap(), container.image_pull_policy)
        };
        let operator = RunPolicy {
            image: "registry.example.com/tools/busybox:1.36".into(),
            image_pull_policy: Some(IfNotPresent),
            ..RunPolicy::default()
        };
        let mut none = at("example-at");
        none.spec.template.image = None;
        assert_eq!(
            container(&none, &RunPolicy::default()),
            (crate::api::DEFAULT_IMAGE.to_owned(), None)
        );
        assert_eq!(
            container(&none, &operator),
            (
                "registry.example.com/tools/busybox:1.36".to_owned(),
                Some("IfNotPresent".to_owned())
            )
        );
        // A blank image (admission drops it; an At written past the webhook) counts as none.
        none.spec.template.image = Some(" ".into());
        assert_eq!(
            container(&none, &operator).0,
            "registry.example.com/tools/busybox:1.36"
        );
        let mut own = at("example-at");
        own.spec.template.image = Some("alpine:3.20".into());
        own.spec.template.image_pull_policy = Some(Never);
        assert_eq!(
            container(&own, &operator),
            ("alpine:3.20".to_owned(), Some("Never".to_owned()))
        );
    }

    #[test]
    fn names_that_cannot_make_a_pod_are_rejected_with_the_reason() {
        assert_eq!(check_name("example-at"), Ok(()));
        assert_eq!(check_name("a.b-c"), Ok(()));
        assert_eq!(check_name(&"a".repeat(63)), Ok(()));
        let long = "a".repeat(64);
        let err = check_name(&long).unwrap_err();
        assert_eq!(
            err,
            NameError::TooLong {
                name: long,
                len: 64
            }
        );
        assert!(err.to_string().contains("at most 63"));
        for bad in ["", "Upper", "under_score", "-lead", "a..b", "a.-b"] {
            assert!(
                matches!(check_name(bad), Err(NameError::InvalidPodName { .. })),
                "{bad:?}"
            );
        }
    }

    fn ended(phase: &str, terminated: Option<ContainerStateTerminated>) -> Pod {
        let mut pod = build_default(&at("x"));
        pod.status = Some(PodStatus {
            phase: Some(phase.into()),
            container_statuses: terminated.map(|t| {
                vec![ContainerStatus {
                    name: CONTAINER.into(),
                    state: Some(ContainerState {
                        terminated: Some(t),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        });
        pod
    }

    #[test]
    fn view_reports_exit_code_reason_and_message() {
        let finished: Time =
            serde_json::from_value(serde_json::json!("2026-11-22T02:06:09Z")).unwrap();
        let pod = ended(
            "Failed",
            Some(ContainerStateTerminated {
                exit_code: 3,
                reason: Some("Error".into()),
                message: Some("boom\n".into()),
                finished_at: Some(finished),
                ..Default::default()
            }),
        );
        let end = view(&pod).end.unwrap();
        assert!(!end.succeeded);
        assert_eq!(end.exit_code, Some(3));
        assert_eq!(end.detail.as_deref(), Some("Error: boom"));
        assert_eq!(
            end.finished_at.unwrap().to_rfc3339(),
            "2026-11-22T02:06:09+00:00"
        );
    }

    #[test]
    fn view_falls_back_to_the_pod_reason_when_no_container_ran() {
        let mut pod = ended("Failed", None);
        let status = pod.status.as_mut().unwrap();
        status.reason = Some("Evicted".into());
        status.message = Some("The node was low on resource: memory.".into());
        let end = view(&pod).end.unwrap();
        assert_eq!(end.exit_code, None);
        assert_eq!(
            end.detail.as_deref(),
            Some("Evicted: The node was low on resource: memory.")
        );
    }

    #[test]
    fn running_and_pending_pods_have_not_ended() {
        for phase in ["Pending", "Running", "Unknown"] {
            assert_eq!(view(&ended(phase, None)).end, None, "{phase}");
        }
        let mut no_status = build_default(&at("x"));
        no_status.status = None;
        assert_eq!(view(&no_status).end, None);
    }

    #[test]
    fn long_messages_are_shortened() {
        let pod = ended(
            "Failed",
            Some(ContainerStateTerminated {
                exit_code: 1,
                message: Some("ü".repeat(5000)),
                ..Default::default()
            }),
        );
        let detail = view(&pod).end.unwrap().detail.unwrap();
        assert_eq!(detail.chars().count(), MAX_MESSAGE + 1);
    }

    #[test]
    fn trim_keeps_what_view_reads() {
        let fixture = include_str!("../../tests/fixtures/api-k8s-1.24/pod-created.json");
        let mut pod: Pod = serde_json::from_str(fixture).unwrap();
        let before = view(&pod);
        trim(&mut pod);
        assert_eq!(view(&pod), before);
        assert!(pod.spec.is_none() && pod.metadata.managed_fields.is_none());
        assert!(serde_json::to_vec(&pod).unwrap().len() < fixture.len() / 3);
    }

    #[test]
    fn a_pod_labelled_as_cnat_s_costs_the_cache_little_whatever_it_carries() {
        let mut pod = build_default(&at("example-at"));
        let own_labels = pod.metadata.labels.clone();
        let own_owner = pod.metadata.owner_references.clone();
        let big = "x".repeat(60_000);
        let labels = pod.metadata.labels.get_or_insert_default();
        for i in 0..16 {
            labels.insert(format!("tenant.example/l{i}"), big.clone());
        }
        let finalizers = pod.metadata.finalizers.get_or_insert_default();
        for i in 0..4_000 {
            finalizers.push(format!("{}.tenant.example/f{i}", "d".repeat(250)));
        }
        let owners = pod.metadata.owner_references.get_or_insert_default();
        for i in 0..100 {
            owners.push(
                serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "ConfigMap", "name": format!("c{i}"),
                "uid": big.clone()}))
                .unwrap(),
            );
        }
        let mut status: PodStatus = serde_json::from_value(serde_json::json!({
            "phase": "Failed",
            "containerStatuses": (0..50).map(|i| serde_json::json!({
                "name": format!("sidecar-{i}"), "image": "", "imageID": "", "ready": false,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": 1, "message": big.clone()}},
            })).collect::<Vec<_>>(),
        }))
        .unwrap();
        status.container_statuses.as_mut().unwrap().push(
            serde_json::from_value(serde_json::json!({
                "name": CONTAINER, "image": "", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": 3, "message": "the disk is full"}},
            }))
            .unwrap(),
        );
        pod.status = Some(status);
        let before = view(&pod);
        assert!(serde_json::to_vec(&pod).unwrap().len() > 3_000_000);
        trim(&mut pod);
        assert_eq!(view(&pod), before, "what cnat reads is kept");
        assert_eq!(pod.metadata.labels, own_labels);
        assert_eq!(pod.metadata.owner_references, own_owner);
        let elided = [finalizer::FINALIZER, finalizer::ELIDED].map(String::from);
        assert_eq!(pod.metadata.finalizers.as_deref(), Some(&elided[..]));
        let size = serde_json::to_vec(&pod).unwrap().len();
        assert!(size < 1_500, "{size} bytes cached");
    }

    #[test]
    fn a_pod_is_the_at_s_own_when_controlled_and_signed_or_named_by_its_started_status() {
        let (key, _) = Key::generate();
        let mut at = at("example-at");
        at.metadata.uid = Some("uid-1".into());
        let mut signed = build_default(&at);
        sign(&mut signed, "uid-1", &key);
        let unsigned = build_default(&at);
        let mut uncontrolled = signed.clone();
        uncontrolled.metadata.owner_references = None;
        let signing = Signing::new(key.clone());
        assert!(is_cnats(&signed, &at, &signing));
        assert!(!is_cnats(&unsigned, &at, &signing));
        assert!(!is_cnats(&uncontrolled, &at, &signing));
        let (other, _) = Key::generate();
        assert!(!is_cnats(&signed, &at, &Signing::new(other)));
        // Created before cnat signed pods (a release before this one): its own, unsigned.
        let time =
            |t: &str| k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t.parse().unwrap());
        let mut older = unsigned.clone();
        older.metadata.creation_timestamp = Some(time("2026-11-29T10:00:00Z"));
        at.metadata.creation_timestamp = Some(time("2026-11-29T09:00:00Z"));
        let since = |t: &str| Signing {
            key: key.clone(),
            since: Some(to_chrono(&time(t))),
        };
        assert!(is_cnats(&older, &at, &since("2026-11-29T10:00:01Z")));
        assert!(
            is_cnats(&older, &at, &since("2026-11-29T10:00:00Z")),
            "the same second"
        );
        assert!(
            !is_cnats(&older, &at, &since("2026-11-29T09:59:59Z")),
            "after"
        );
        assert!(
            !is_cnats(&unsigned, &at, &since("2026-11-29T10:00:01Z")),
            "no creation time"
        );
        // Of an At made after the key (none of its pods can predate signing), or of unknown age.
        at.metadata.creation_timestamp = Some(time("2026-11-29T10:00:02Z"));
        assert!(
            !is_cnats(&older, &at, &since("2026-11-29T10:00:01Z")),
            "a newer At"
        );
        at.metadata.creation_timestamp = Some(time("2026-11-29T10:00:01Z"));
        assert!(
            is_cnats(&older, &at, &since("2026-11-29T10:00:01Z")),
            "the key's second"
        );
        at.metadata.creation_timestamp = None;
        assert!(
            !is_cnats(&older, &at, &since("2026-11-29T10:00:01Z")),
            "an At's age unknown"
        );
        at.metadata.creation_timestamp = Some(time("2026-11-29T09:00:00Z"));
        let mut forged_older = older.clone();
        forged_older.metadata.owner_references = None;
        assert!(!is_cnats(
            &forged_older,
            &at,
            &since("2026-11-29T10:00:01Z")
        ));
        // Once the status says cnat started it (a pod from before signatures, or a key
        // replaced since), the pod it names is the At's; not while PENDING, nor another name.
        for (phase, pod_name, own) in [
            (crate::api::Phase::Running, "example-at-pod", true),
            (crate::api::Phase::Done, "example-at-pod", true),
            (crate::api::Phase::Pending, "example-at-pod", false),
            (crate::api::Phase::Running, "other-pod", false),
        ] {
            at.status = Some(AtStatus {
                phase,
                pod_name: Some(pod_name.into()),
                ..AtStatus::default()
            });
            assert_eq!(
                is_cnats(&unsigned, &at, &signing),
                own,
                "{phase:?} {pod_name}"
            );
            assert!(!is_cnats(&uncontrolled, &at, &signing), "{phase:?}");
        }
    }

    #[test]
    fn a_signed_pod_keeps_its_signature_in_the_cache_and_nothing_forges_it() {
        let (key, _) = Key::generate();
        let mut pod = build_default(&at("example-at"));
        assert!(!is_signed(&pod, "uid-1", &key), "built unsigned");
        pod.annotations_mut()
            .insert("tenant.example/note".into(), "x".repeat(60_000));
        sign(&mut pod, "uid-1", &key);
        assert!(is_signed(&pod, "uid-1", &key));
        assert!(!is_signed(&pod, "uid-2", &key), "another At's");
        let mut renamed = pod.clone();
        renamed.metadata.name = Some("other-pod".into());
        assert!(!is_signed(&renamed, "uid-1", &key), "another pod's");
        trim(&mut pod);
        assert!(is_signed(&pod, "uid-1", &key), "kept by the cache");
        assert_eq!(pod.annotations().len(), 1);
        // A long value under the signature's key is not kept (and was no signature).
        let mut forged = build_default(&at("example-at"));
        forged
            .annotations_mut()
            .insert(SIGNATURE.into(), "A".repeat(100_000));
        assert!(!is_signed(&forged, "uid-1", &key));
        trim(&mut forged);
        assert_eq!(forged.metadata.annotations, None);
        // One among the At's pod annotations is no signature, and signing replaces it.
        let mut claimed = at("example-at");
        let template = claimed.spec.template.metadata.get_or_insert_default();
        let made_up = "A".repeat(SIGNATURE_LEN);
        template.annotations = Some([(SIGNATURE.to_owned(), made_up)].into());
        let mut built = build_default(&claimed);
        assert!(!is_signed(&built, "uid-1", &key));
        sign(&mut built, "uid-1", &key);
        assert!(is_signed(&built, "uid-1", &key));
    }
    /// A pod that has not ended, with the container's waiting reason and message, or the
    /// scheduler's condition.
    fn stuck_pod(waiting: Option<(&str, &str)>, scheduled: Option<(&str, &str, &str)>) -> Pod {
        let mut pod = build_default(&at("example-at"));
        pod.status = Some(
            serde_json::from_value(serde_json::json!({
                "phase": "Pending",
                "conditions": scheduled.map(|(status, reason, message)| vec![serde_json::json!({
                    "type": "PodScheduled", "status": status, "reason": reason, "message": message,
                    "lastTransitionTime": "2019-04-12T10:12:01Z",
                })]),
                "containerStatuses": waiting.map(|(reason, message)| vec![serde_json::json!({
                    "name": CONTAINER, "image": "busybox:1.36", "imageID": "", "ready": false,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": reason, "message": message}},
                })]),
            }))
            .unwrap(),
        );
        pod
    }

    #[test]
    fn a_pod_stuck_before_its_command_says_why_and_one_on_its_way_does_not() {
        let pull = "Back-off pulling image \"busybox:9\"";
        for (reason, stuck) in [
            ("ErrImagePull", Stuck::ImagePullBackOff),
            ("ImagePullBackOff", Stuck::ImagePullBackOff),
            ("ErrImageNeverPull", Stuck::ErrImageNeverPull),
            ("InvalidImageName", Stuck::InvalidImageName),
            (
                "CreateContainerConfigError",
                Stuck::CreateContainerConfigError,
            ),
            ("CreateContainerError", Stuck::CreateContainerError),
        ] {
            let waiting = waiting_of(&stuck_pod(Some((reason, pull)), None)).unwrap();
            assert_eq!(waiting.stuck, stuck, "{reason}");
            assert_eq!(waiting.detail, format!("{reason}: {pull}"));
        }
        // The kubelet's retries alternate the two pull reasons: one kind of trouble.
        assert_eq!(Stuck::ImagePullBackOff.reason(), "ImagePullBackOff");
        for on_its_way in ["ContainerCreating", "PodInitializing"] {
            assert_eq!(waiting_of(&stuck_pod(Some((on_its_way, "")), None)), None);
        }
        let message =
            "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector.";
        let unschedulable = stuck_pod(None, Some(("False", "Unschedulable", message)));
        let waiting = waiting_of(&unschedulable).unwrap();
        assert_eq!(waiting.stuck, Stuck::Unschedulable);
        assert_eq!(waiting.detail, format!("Unschedulable: {message}"));
        // Scheduled, or not yet looked at by the scheduler: not stuck.
        assert_eq!(waiting_of(&stuck_pod(None, Some(("True", "", "")))), None);
        assert_eq!(waiting_of(&stuck_pod(None, None)), None);
        // A running or ended pod is not waiting, whatever a stale condition says.
        let mut running = unschedulable.clone();
        running.status.as_mut().unwrap().phase = Some("Running".into());
        assert_eq!(waiting_of(&running), None);
    }

    #[test]
    fn trim_keeps_the_scheduler_s_refusal_and_drops_other_conditions() {
        let mut pod = stuck_pod(
            None,
            Some(("False", "Unschedulable", "0/1 nodes are available")),
        );
        pod.status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()
            .push(
                serde_json::from_value(serde_json::json!({"type": "Ready", "status": "False"}))
                    .unwrap(),
            );
        let before = view(&pod);
        trim(&mut pod);
        assert_eq!(view(&pod), before);
        let kept = pod.status.as_ref().unwrap().conditions.as_ref().unwrap();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].last_transition_time, None);
        let mut scheduled = stuck_pod(None, Some(("True", "", "")));
        trim(&mut scheduled);
        assert_eq!(scheduled.status.unwrap().conditions, None);
    }
}
