//! cnat's finalizer on the pods it creates (`pod::build` adds it): the one rule for when it may
//! go (`may_go`) and the one way it is removed (`remove`), for the reconcile, the release of a
//! deleted At's pod and `cnat release`. It keeps a pod until its At's status names it, so that
//! a pod deleted before its `Running` write landed is seen by the next leader instead of run
//! again, and, while a leader records, until the pod's outcome is recorded.

use crate::api::{At, Phase};
use crate::operator::{key, FIELD_MANAGER};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};

/// Finalizer on every pod cnat creates: the pod object stays (terminating) until the At's status
/// records it, so a pod deleted before that write landed (a leader change in between) is still
/// seen by the next leader, which reports it instead of creating a second one. cnat removes it
/// as `may_go` says.
pub const FINALIZER: &str = "cnat.programming-kubernetes.info/run-once";

/// Whether `pod` carries cnat's finalizer.
pub fn is_present(pod: &Pod) -> bool {
    pod.finalizers().iter().any(|f| f == FINALIZER)
}

/// Whether `pod` waits for cnat alone to be deleted: terminating, with cnat's finalizer.
pub fn awaits_release(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some() && is_present(pod)
}

/// Who still records what becomes of a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorder {
    /// A leader; `settled` when its reconcile of the At has nothing more to write.
    Leader { settled: bool },
    /// Nobody: no replica runs again (`cnat release`).
    Nobody,
}

/// A pod carrying cnat's finalizer, as `may_go` reads it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub name: &'a str,
    /// Being deleted (it has a deletionTimestamp).
    pub deleting: bool,
    /// The uid of the At that controls it.
    pub controller: Option<&'a str>,
}

impl<'a> Candidate<'a> {
    /// `pod` as `may_go` reads it.
    pub fn of(pod: &'a Pod) -> Self {
        Candidate {
            name: pod.metadata.name.as_deref().unwrap_or_default(),
            deleting: pod.metadata.deletion_timestamp.is_some(),
            controller: key::controller(pod).map(|owner| owner.uid.as_str()),
        }
    }
}

/// Whether cnat's finalizer may go from `pod`, whose At (by its controller reference's name) is
/// `at`: always when the At is gone or is another At by that name (nothing is left to record
/// it), or when both are being deleted. Otherwise only once the At's status names the pod: while
/// a leader records, once it is DONE and the reconcile has nothing more to write, or RUNNING
/// with the pod being deleted (its end is then recorded from its absence); with no recorder,
/// once it is RUNNING or DONE.
pub fn may_go(pod: Candidate, at: Option<&At>, recorder: Recorder) -> bool {
    let Some(at) = at.filter(|at| at.metadata.uid.as_deref() == pod.controller) else {
        return true;
    };
    if pod.deleting && at.metadata.deletion_timestamp.is_some() {
        return true;
    }
    let named = at
        .status
        .as_ref()
        .filter(|s| s.pod_name.as_deref() == Some(pod.name))
        .map(|s| s.phase);
    match (named, recorder) {
        (Some(Phase::Done), Recorder::Leader { settled }) => settled,
        (Some(Phase::Running), Recorder::Leader { settled }) => pod.deleting && settled,
        (Some(Phase::Done | Phase::Running), Recorder::Nobody) => true,
        _ => false,
    }
}

/// What `remove` did.
#[derive(Debug)]
pub enum Removed {
    /// The finalizer went: the pod as the patch left it.
    Released(Pod),
    /// The pod does not carry it, or it may not go: the pod as last read.
    Kept(Pod),
    /// The pod is gone.
    Gone,
}

/// Removes cnat's finalizer from `found` if `allowed` says so of it, by a merge patch guarded by
/// its resourceVersion (a merge patch replaces the whole list, so a finalizer added meanwhile is
/// never lost; other finalizers stay). On a conflict the pod is read again and judged again,
/// up to `conflicts` writes in all; past that, the last conflict is the error.
pub async fn remove(
    pods: &Api<Pod>,
    mut found: Pod,
    allowed: impl Fn(&Pod) -> bool,
    conflicts: usize,
) -> Result<Removed, kube::Error> {
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    let name = found.name_any();
    for attempt in 1..=conflicts {
        if !is_present(&found) || !allowed(&found) {
            return Ok(Removed::Kept(found));
        }
        let patch = Patch::Merge(without_finalizer(&found));
        match pods.patch(&name, &params, &patch).await {
            Ok(released) => return Ok(Removed::Released(released)),
            Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(Removed::Gone),
            Err(kube::Error::Api(s)) if s.is_conflict() && attempt < conflicts => {
                match pods.get_opt(&name).await? {
                    Some(fresh) => found = fresh,
                    None => return Ok(Removed::Gone),
                }
            }
            Err(error) => return Err(error),
        }
    }
    Ok(Removed::Kept(found))
}

/// The merge patch that removes cnat's finalizer from `pod`, guarded by its resourceVersion.
fn without_finalizer(pod: &Pod) -> serde_json::Value {
    let others: Vec<&String> = pod
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .collect();
    serde_json::json!({
        "metadata": {
            "resourceVersion": pod.resource_version(),
            "finalizers": others,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{AtSpec, AtStatus};

    fn pod(deleting: bool) -> Pod {
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "x-pod", "namespace": "ns", "resourceVersion": "7",
                "finalizers": ["other", FINALIZER],
                "ownerReferences": [{"apiVersion": "cnat.programming-kubernetes.info/v1",
                    "kind": "At", "name": "x", "uid": "u1", "controller": true}]},
        }))
        .unwrap();
        if deleting {
            pod.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    "2026-11-30T10:00:00Z".parse().unwrap(),
                ));
        }
        pod
    }

    fn at(uid: &str, status: Option<(Phase, Option<&str>)>, deleting: bool) -> At {
        let mut at = At::new("x", AtSpec::default());
        at.metadata.uid = Some(uid.into());
        at.status = status.map(|(phase, pod)| AtStatus {
            phase,
            pod_name: pod.map(Into::into),
            ..AtStatus::default()
        });
        if deleting {
            at.metadata.deletion_timestamp = pod(true).metadata.deletion_timestamp;
        }
        at
    }

    const LEADER: [Recorder; 2] = [
        Recorder::Leader { settled: true },
        Recorder::Leader { settled: false },
    ];

    #[test]
    fn the_finalizer_goes_when_the_at_is_gone_or_another_whoever_records() {
        for deleting in [false, true] {
            let found = pod(deleting);
            for recorder in [Recorder::Nobody, LEADER[0], LEADER[1]] {
                assert!(may_go(Candidate::of(&found), None, recorder));
                let other = at("u2", Some((Phase::Pending, None)), false);
                assert!(may_go(Candidate::of(&found), Some(&other), recorder));
                // Both going: nobody runs it again.
                let going = at("u1", None, true);
                assert_eq!(
                    may_go(Candidate::of(&found), Some(&going), recorder),
                    deleting
                );
            }
        }
    }

    #[test]
    fn while_a_leader_records_the_finalizer_stays_until_the_outcome_is_recorded_and_settled() {
        let done = at("u1", Some((Phase::Done, Some("x-pod"))), false);
        let running = at("u1", Some((Phase::Running, Some("x-pod"))), false);
        for deleting in [false, true] {
            let found = pod(deleting);
            let held = Candidate::of(&found);
            assert!(may_go(held, Some(&done), LEADER[0]));
            assert!(!may_go(held, Some(&done), LEADER[1]));
            // RUNNING: only a pod being deleted, whose end is recorded from its absence.
            assert_eq!(may_go(held, Some(&running), LEADER[0]), deleting);
            assert!(!may_go(held, Some(&running), LEADER[1]));
        }
    }

    #[test]
    fn the_finalizer_never_goes_before_the_status_names_the_pod() {
        let unnamed = [
            at("u1", None, false),
            at("u1", Some((Phase::Pending, None)), false),
            at("u1", Some((Phase::Pending, Some("x-pod"))), false),
            at("u1", Some((Phase::Running, Some("other"))), false),
            at("u1", Some((Phase::Done, Some("other"))), false),
            // The At going, its pod not yet: the pod may still run, and be recorded.
            at("u1", Some((Phase::Running, None)), true),
        ];
        for deleting in [false, true] {
            let found = pod(deleting);
            for at in &unnamed {
                if deleting && at.metadata.deletion_timestamp.is_some() {
                    continue;
                }
                for recorder in [Recorder::Nobody, LEADER[0], LEADER[1]] {
                    assert!(
                        !may_go(Candidate::of(&found), Some(at), recorder),
                        "{at:?} {recorder:?}"
                    );
                }
            }
        }
        // With nobody to record, a status naming the pod RUNNING or DONE is enough.
        let found = pod(false);
        for phase in [Phase::Running, Phase::Done] {
            let named = at("u1", Some((phase, Some("x-pod"))), false);
            assert!(may_go(
                Candidate::of(&found),
                Some(&named),
                Recorder::Nobody
            ));
        }
    }

    #[test]
    fn the_patch_keeps_other_finalizers_and_is_guarded_by_the_resource_version() {
        assert_eq!(
            without_finalizer(&pod(false)),
            serde_json::json!({"metadata": {"resourceVersion": "7", "finalizers": ["other"]}})
        );
        assert!(
            is_present(&pod(false)) && !awaits_release(&pod(false)) && awaits_release(&pod(true))
        );
    }
}
