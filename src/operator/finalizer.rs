//! cnat's finalizer on the pods it creates (`pod::build` adds it): the one rule for when it may
//! go (`may_go`) and the one way it is removed (`remove`).
//! See docs/src/design/decisions.md, "Never twice".

use crate::api::{At, Phase};
use crate::operator::{key, patch_params};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Patch;
use kube::{Api, Client, ResourceExt};

/// Finalizer on every pod cnat creates: the pod stays (terminating) until the At's status
/// records it, so the next leader sees a pod deleted before that write landed (see `may_go`).
pub const FINALIZER: &str = "cnat.programming-kubernetes.info/run-once";

/// A pod's finalizers the pod cache keeps whole (each at most 316 characters): of a pod with more,
/// it keeps cnat's own and [`ELIDED`], so a pod labelled as cnat's cannot bloat the cache.
pub const CACHED_FINALIZERS: usize = 16;

/// Stands, in a cached pod, for finalizers the cache did not keep (`trim`): no finalizer, and
/// never written; `remove` reads such a pod again before it writes.
pub const ELIDED: &str = "cnat.programming-kubernetes.info/finalizers-not-cached";

/// Bounds `finalizers` for the pod cache: at most [`CACHED_FINALIZERS`] whole, or else cnat's
/// own (if there) and [`ELIDED`].
pub fn trim(finalizers: &mut Vec<String>) {
    if finalizers.len() > CACHED_FINALIZERS {
        let own = finalizers.iter().any(|f| f == FINALIZER);
        finalizers.clear();
        finalizers.extend(own.then(|| FINALIZER.to_owned()));
        finalizers.push(ELIDED.to_owned());
        finalizers.shrink_to_fit();
    }
}

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
/// `at`: always when the At is gone, is another At by that name, or both are being deleted.
/// Otherwise once the At's status names the pod: while a leader records, DONE and settled, or
/// RUNNING and settled with the pod being deleted; with no recorder, RUNNING or DONE.
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

/// The At of `namespace` named by `pod`'s controller reference, as the API server holds it now
/// (`None`: no controller reference, or no such At).
pub async fn controlling_at(
    client: &Client,
    namespace: &str,
    pod: &Pod,
) -> Result<Option<At>, kube::Error> {
    match key::controller(pod) {
        Some(owner) => {
            Api::<At>::namespaced(client.clone(), namespace)
                .get_opt(&owner.name)
                .await
        }
        None => Ok(None),
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

/// Removes cnat's finalizer from `found` if `allowed` says so, by a merge patch, which replaces
/// the whole list: guarded by its resourceVersion, so a finalizer added meanwhile is never lost
/// (other finalizers stay); a conflict reads and judges the pod again, up to
/// `conflicts` writes in all, then is the error. An [`ELIDED`] pod is read again first.
pub async fn remove(
    pods: &Api<Pod>,
    mut found: Pod,
    allowed: impl Fn(&Pod) -> bool,
    conflicts: usize,
) -> Result<Removed, kube::Error> {
    let params = patch_params();
    let name = found.name_any();
    if found.finalizers().iter().any(|f| f == ELIDED) {
        match pods.get_opt(&name).await? {
            Some(fresh) => found = fresh,
            None => return Ok(Removed::Gone),
        }
    }
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

/// The merge patch that removes cnat's finalizer from `pod`: the whole list less cnat's, guarded
/// by its resourceVersion.
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

    #[test]
    fn the_cache_keeps_a_few_finalizers_whole_and_of_more_only_cnat_s() {
        let many = |n: usize, own: bool| -> Vec<String> {
            let mut list: Vec<String> = (0..n).map(|i| format!("tenant.example/f{i}")).collect();
            if own {
                list.insert(n / 2, FINALIZER.into());
            }
            list
        };
        let mut few = many(CACHED_FINALIZERS - 1, true);
        trim(&mut few);
        assert_eq!(few, many(CACHED_FINALIZERS - 1, true), "kept whole");
        let mut more = many(CACHED_FINALIZERS, true);
        trim(&mut more);
        assert_eq!(more, [FINALIZER, ELIDED]);
        let mut others = many(CACHED_FINALIZERS + 1, false);
        trim(&mut others);
        assert_eq!(others, [ELIDED]);
    }

    /// `remove` of a cached pod whose finalizers were elided reads it first, and writes the
    /// list it read less cnat's (never the placeholder).
    #[tokio::test]
    async fn a_pod_whose_finalizers_the_cache_elided_is_read_before_the_patch() {
        use http_body_util::BodyExt;
        use kube::client::Body;
        let (service, mut handle) =
            tower_test::mock::pair::<http::Request<Body>, http::Response<Body>>();
        let fresh = {
            let mut fresh = pod(true);
            fresh.metadata.resource_version = Some("8".into());
            fresh.metadata.finalizers = Some(many_finalizers());
            fresh
        };
        let server = tokio::spawn(async move {
            let (request, respond) = handle.next_request().await.unwrap();
            assert_eq!(
                (request.method().as_str(), request.uri().path()),
                ("GET", "/api/v1/namespaces/ns/pods/x-pod")
            );
            respond.send_response(http::Response::new(Body::from(
                serde_json::to_vec(&fresh).unwrap(),
            )));
            let (request, respond) = handle.next_request().await.unwrap();
            assert_eq!(request.method().as_str(), "PATCH");
            let body = request.into_body().collect().await.unwrap().to_bytes();
            let patch: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let mut released = fresh.clone();
            released.metadata.finalizers = Some(many_finalizers()[1..].to_vec());
            respond.send_response(http::Response::new(Body::from(
                serde_json::to_vec(&released).unwrap(),
            )));
            patch
        });
        let mut cached = pod(true);
        cached.metadata.finalizers = Some(many_finalizers());
        let cached_list = cached.metadata.finalizers.as_mut().unwrap();
        trim(cached_list);
        assert!(cached_list.iter().any(|f| f == ELIDED));
        let pods: Api<Pod> = Api::namespaced(kube::Client::new(service, "ns"), "ns");
        let removed = remove(&pods, cached, |_| true, 2).await.unwrap();
        assert!(matches!(removed, Removed::Released(_)), "{removed:?}");
        let patch = server.await.unwrap();
        let written = patch["metadata"]["finalizers"].as_array().unwrap();
        assert_eq!(written.len(), CACHED_FINALIZERS + 1, "{patch}");
        assert_eq!(patch["metadata"]["resourceVersion"], "8");
        assert!(!written.iter().any(|f| f == FINALIZER || f == ELIDED));
    }

    fn many_finalizers() -> Vec<String> {
        let mut list = vec![FINALIZER.to_owned()];
        list.extend((0..=CACHED_FINALIZERS).map(|i| format!("tenant.example/f{i}")));
        list
    }
}
