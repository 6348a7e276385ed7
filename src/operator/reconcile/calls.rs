//! The executor's API calls besides status writes (`writer`): looking up, creating and
//! releasing an At's pod, releasing the pod of a deleted At, labelling a pod with its At's
//! shard, and deleting a finished At.

use super::decide::{self, PodObservation};
use super::error::Error;
use super::ledger::Ledger;
use super::scheduler;
use crate::api::{At, Phase};
use crate::observability::metrics::Metrics;
use crate::operator::cache::freshness::Freshness;
use crate::operator::finalizer::{self, Candidate, Recorder, Removed};
use crate::operator::key::{self, AtKey};
use crate::operator::policy::RunPolicy;
use crate::operator::priority::Priority;
use crate::operator::signing::Signing;
use crate::operator::{patch_params, FIELD_MANAGER};
use crate::{operator::pod, operator::slow_start, schedule, shard};
use backon::Retryable;
use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};
use std::sync::Arc;
use tracing::{debug, info, warn};

/// Attempts to release the pod of a deleted At before leaving it to the next relist or leader.
const ORPHAN_ATTEMPTS: usize = 6;

/// The wall clock, injected so tests control time.
pub type Clock = Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>;

/// What the executor sees of the cluster besides the At it reconciles: this leadership's pod
/// cache, and whether the replica's At cache is caught up with the API server.
pub struct Caches {
    pub pods: Store<Pod>,
    pub ats: Freshness,
}

/// The API calls of one leadership besides status writes, and what they need.
pub struct Calls {
    pub(super) client: Client,
    pub(super) caches: Caches,
    /// Signs the pods this leader creates, and tells cnat's pods from others.
    pub(super) signing: Signing,
    pub(super) policy: RunPolicy,
    pub(super) metrics: Arc<Metrics>,
    /// Confirms creates by this leadership's own last write, and records those made.
    pub(super) ledger: Arc<Ledger>,
    pub(super) clock: Clock,
}

/// `at`'s namespace (`""` for none).
pub(super) fn namespace(at: &At) -> String {
    at.namespace().unwrap_or_default()
}

/// `namespace/name`, how logs and errors name an At, and what per-At maps are keyed by.
pub(super) fn key(at: &At) -> AtKey {
    AtKey::from(at)
}

impl Calls {
    fn at_api(&self, at: &At) -> Api<At> {
        Api::namespaced(self.client.clone(), &namespace(at))
    }

    fn pod_api(&self, at: &At) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &namespace(at))
    }

    /// The pods in the pod cache that wait for cnat's finalizer to go while `owner_gone` says
    /// their At is gone.
    pub fn pods_awaiting_release(&self, owner_gone: impl Fn(&Pod) -> bool) -> Vec<ObjectRef<Pod>> {
        self.cached_pods(|found| finalizer::awaits_release(found) && owner_gone(found))
            .iter()
            .map(|found| ObjectRef::from_obj(found.as_ref()))
            .collect()
    }

    /// The pods in the pod cache that `select` selects.
    pub fn cached_pods(&self, select: impl Fn(&Pod) -> bool) -> Vec<Arc<Pod>> {
        let mut pods = self.caches.pods.state();
        pods.retain(|found| select(found));
        pods
    }

    /// Whether `at` is DONE and its pod, in the pod cache, still holds cnat's finalizer.
    pub(super) fn finalizer_on_finished_pod(&self, at: &At) -> bool {
        let done = at.status.as_ref().is_some_and(|s| s.phase == Phase::Done);
        done && matches!(self.cached_pod(at), PodObservation::Owned(view) if view.finalizer)
    }

    pub(super) fn cached_pod(&self, at: &At) -> PodObservation {
        let name = pod::name_for(&at.name_any());
        match self
            .caches
            .pods
            .get(&ObjectRef::new(&name).within(&namespace(at)))
        {
            Some(found) => self.observe(&found, at),
            None => PodObservation::NotCached,
        }
    }

    /// What `found`, a pod by the name of `at`'s, is to `at` (`pod::is_cnats`).
    fn observe(&self, found: &Pod, at: &At) -> PodObservation {
        if pod::is_cnats(found, at, &self.signing) {
            PodObservation::Owned(pod::view(found))
        } else {
            PodObservation::Foreign
        }
    }

    pub(super) async fn fetch_pod(&self, at: &At) -> Result<PodObservation, Error> {
        let name = pod::name_for(&at.name_any());
        match self.pod_api(at).get_opt(&name).await {
            Ok(Some(found)) => Ok(self.observe(&found, at)),
            Ok(None) => Ok(PodObservation::Missing),
            Err(source) => Err(Error::ReadPod {
                at: key(at),
                pod: name,
                source,
            }),
        }
    }

    /// The pod of `at` if the pod cache shows it waiting for cnat's finalizer to go.
    pub fn pod_awaiting_release(&self, at: &AtKey) -> Option<ObjectRef<Pod>> {
        let name = pod::name_for(at.name());
        let key = ObjectRef::new(&name).within(at.namespace());
        self.caches
            .pods
            .get(&key)
            .filter(|found| finalizer::awaits_release(found))
            .map(|_| key)
    }

    /// Removes cnat's finalizer from a pod whose At is gone, asking the API server first: a pod
    /// whose At still exists is left to its reconcile, unless both are being deleted.
    pub async fn release_orphan(&self, found: &ObjectRef<Pod>) {
        // Retried here: a terminating pod changes no more, so no event would bring it back.
        let released = (|| self.try_release_orphan(found))
            .retry(scheduler::backoff().with_max_times(ORPHAN_ATTEMPTS - 1))
            .notify(|error, retry_in| debug!(pod = %found, %error, ?retry_in, "removing cnat's finalizer failed; retrying"))
            .await;
        match released {
            Ok(Removed::Released(_)) => debug!(pod = %found, "released the pod of a deleted At"),
            Ok(_) => {}
            Err(error) => {
                warn!(pod = %found, %error, attempts = ORPHAN_ATTEMPTS, "could not remove cnat's finalizer from the pod of a deleted At; the next relist or leader tries again")
            }
        }
    }

    /// Gives a pod without a shard value (started before Lease shards) its At's, so that the
    /// At's shard leader sees it; a pod of another At (by uid), or of an At without one, is left.
    pub async fn label_pod_with_shard(&self, found: &ObjectRef<Pod>) {
        let namespace = found.namespace.as_deref().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let labelled = async {
            let Some(current) = pods.get_opt(&found.name).await? else {
                return Ok(None);
            };
            if shard::value_of(current.metadata.labels.as_ref()).is_some() {
                return Ok(None);
            }
            let at = finalizer::controlling_at(&self.client, namespace, &current).await?;
            let owner = key::controller(&current).map(|owner| owner.uid.as_str());
            let Some(at) = at.filter(|at| at.uid().as_deref() == owner) else {
                return Ok(None);
            };
            let Some(value) = shard::value_of(at.metadata.labels.as_ref()) else {
                return Ok(None);
            };
            let patch =
                serde_json::json!({"metadata": {"labels": {shard::LABEL: value.to_string()}}});
            pods.patch(&found.name, &patch_params(), &Patch::Merge(patch))
                .await?;
            Ok::<_, kube::Error>(Some(value))
        };
        match labelled.await {
            Ok(Some(value)) => {
                info!(pod = %found, shard = value, "gave a pod started before Lease shards its At's shard label")
            }
            Ok(None) => {}
            Err(error) => {
                warn!(pod = %found, %error, "could not give a pod its At's shard label; its At notices its end at the RUNNING re-check")
            }
        }
    }

    async fn try_release_orphan(&self, found: &ObjectRef<Pod>) -> Result<Removed, kube::Error> {
        let namespace = found.namespace.as_deref().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let Some(current) = pods.get_opt(&found.name).await? else {
            return Ok(Removed::Gone);
        };
        if !finalizer::awaits_release(&current) {
            return Ok(Removed::Kept(current));
        }
        let at = finalizer::controlling_at(&self.client, namespace, &current).await?;
        let unrecorded = Recorder::Leader { settled: false };
        let allowed = |pod: &Pod| {
            finalizer::awaits_release(pod)
                && finalizer::may_go(Candidate::of(pod), at.as_ref(), unrecorded)
        };
        finalizer::remove(&pods, current, allowed, 1).await
    }

    /// Removes cnat's finalizer from the At's own pod (`decide` asks for it), then says what is
    /// left of it. The cached copy's resourceVersion guards the patch; read if missing or stale.
    pub(super) async fn release_pod(&self, at: &At) -> Result<PodObservation, Error> {
        let name = pod::name_for(&at.name_any());
        let fail = |source| Error::ReleasePod {
            at: key(at),
            pod: name.clone(),
            source,
        };
        let Some(found) = self.cached_or_read(at, &name).await.map_err(fail)? else {
            return Ok(PodObservation::Missing);
        };
        let ours = |found: &Pod| pod::is_controlled_by(found, &at.uid().unwrap_or_default());
        match finalizer::remove(&self.pod_api(at), found, ours, 2).await {
            Ok(Removed::Released(found) | Removed::Kept(found)) => Ok(self.observe(&found, at)),
            Ok(Removed::Gone) => Ok(PodObservation::Missing),
            Err(kube::Error::Api(s)) if s.is_conflict() => self.fetch_pod(at).await,
            Err(source) => Err(fail(source)),
        }
    }

    /// Creates the pod once the API server confirms the At as decided on (`confirm`).
    pub(super) async fn create_pod(&self, at: &At, priority: &Priority) -> Result<Created, Error> {
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PostParams::default()
        };
        if !self.caches.ats.is_caught_up() {
            self.metrics.create_deferred();
            debug!(at = %key(at), "the At cache is behind the API server (listing, or its watch not open or silent); the pod create waits for it");
            return Ok(Created::Behind);
        }
        let creating = priority.creating.enter();
        if !self.confirm(at).await? {
            return Ok(Created::Unconfirmed);
        }
        let window = priority.window.enter().await;
        let created = self.pod_api(at).create(&params, &self.signed_pod(at)).await;
        window.answered(slow_start::reply(&created));
        drop(creating);
        match created {
            Ok(_) => {
                // No later create may rely on the version this one was decided on.
                if let Some(version) = &at.metadata.resource_version {
                    self.ledger.replaced(&key(at), version);
                }
                self.record_lateness(at);
                Ok(Created::Yes)
            }
            Err(kube::Error::Api(status)) if status.is_already_exists() => {
                self.fetch_pod(at).await.map(Created::Found)
            }
            Err(kube::Error::Api(status)) if status.is_invalid() || status.code == 400 => {
                self.metrics.pod_refused("invalid");
                Ok(Created::Found(PodObservation::Rejected(status.message)))
            }
            // Quota, Pod Security or a policy webhook: may pass later, so retried with backoff.
            Err(kube::Error::Api(status)) if status.is_forbidden() => {
                self.metrics
                    .pod_refused(decide::Refusal::of(&status.message).label());
                Ok(Created::Found(PodObservation::Refused(status.message)))
            }
            Err(source) => Err(Error::CreatePod {
                at: key(at),
                pod: pod::name_for(&at.name_any()),
                source,
            }),
        }
    }

    /// `at`'s pod as cnat creates it, signed.
    fn signed_pod(&self, at: &At) -> Pod {
        let mut built = pod::build(at, &self.policy);
        pod::sign(&mut built, &at.uid().unwrap_or_default(), &self.signing.key);
        built
    }

    /// Whether the API server confirms `at` as the cache showed it: without a request if this
    /// leadership's own last status write left this version PENDING and the At has a shard label
    /// value, else by a quorum read (docs/src/operating/security.md, "Never twice").
    async fn confirm(&self, at: &At) -> Result<bool, Error> {
        let version = at.metadata.resource_version.as_deref();
        let fenced = shard::value_of(at.metadata.labels.as_ref()).is_some();
        if fenced && self.ledger.pending_confirmed(&key(at), version) {
            self.metrics.create_confirmed("own_write");
            return Ok(true);
        }
        let fresh = self
            .at_api(at)
            .get_opt(&at.name_any())
            .await
            .map_err(|source| Error::ConfirmAt {
                at: key(at),
                source,
            })?;
        let confirmed = decide::confirms_create(at, fresh.as_ref());
        if confirmed {
            self.metrics.create_confirmed("read");
        } else {
            let fresh = fresh.as_ref();
            let phase = fresh
                .and_then(|f| f.status.as_ref())
                .map(|s| s.phase.as_str());
            info!(at = %key(at), exists = fresh.is_some(), phase, "the API server's copy of this At is not what the cache shows; no pod until the cache catches up");
            self.metrics.create_unconfirmed();
        }
        Ok(confirmed)
    }

    /// The run lateness: the pod exists now, its schedule said when it should have.
    fn record_lateness(&self, at: &At) {
        if let Ok(due) = schedule::parse(&at.spec.schedule, at.spec.time_zone.as_deref()) {
            let late = ((self.clock)() - due).to_std().unwrap_or_default();
            self.metrics.ran_late(late);
        }
    }

    /// The pod of `at` named `name`: the cached copy, else the API server's; `None` when it
    /// does not exist.
    async fn cached_or_read(&self, at: &At, name: &str) -> Result<Option<Pod>, kube::Error> {
        let cached = self
            .caches
            .pods
            .get(&ObjectRef::new(name).within(&namespace(at)));
        match cached {
            Some(found) => Ok(Some(Pod::clone(&found))),
            None => self.pod_api(at).get_opt(name).await,
        }
    }

    /// Deletes the pod of `at` (its deadline passed), conditional on the uid and resourceVersion
    /// seen (re-read once on a conflict): `None` once deleted; a pod that is gone, ended, or not
    /// this At's is returned to be decided on instead.
    pub(super) async fn delete_pod(&self, at: &At) -> Result<Option<PodObservation>, Error> {
        let name = pod::name_for(&at.name_any());
        let fail = |source| Error::DeletePod {
            at: key(at),
            pod: name.clone(),
            source,
        };
        let api = self.pod_api(at);
        let Some(mut found) = self.cached_or_read(at, &name).await.map_err(fail)? else {
            return Ok(Some(PodObservation::Missing));
        };
        for attempt in 0..2 {
            let seen = self.observe(&found, at);
            if !matches!(&seen, PodObservation::Owned(view) if view.end.is_none()) {
                return Ok(Some(seen));
            }
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: found.uid(),
                    resource_version: found.resource_version(),
                }),
                ..DeleteParams::background()
            };
            match api.delete(&name, &params).await {
                Ok(_) => {
                    info!(at = %key(at), pod = %name, "deleted the pod: activeDeadlineSeconds passed");
                    return Ok(None);
                }
                Err(kube::Error::Api(s)) if s.is_not_found() => {
                    return Ok(Some(PodObservation::Missing))
                }
                // Changed since seen (it may have ended): read it again, once.
                Err(kube::Error::Api(s)) if s.is_conflict() && attempt == 0 => {
                    match api.get_opt(&name).await.map_err(fail)? {
                        Some(fresh) => found = fresh,
                        None => return Ok(Some(PodObservation::Missing)),
                    }
                }
                Err(source) => return Err(fail(source)),
            }
        }
        Ok(Some(self.observe(&found, at)))
    }

    /// Deletes a finished At whose `ttlSecondsAfterFinished` passed; its pod goes with it
    /// (owner reference). The uid precondition spares a new At that took the same name.
    pub(super) async fn delete_at(&self, at: &At) -> Result<Action, Error> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: at.uid(),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match self.at_api(at).delete(&at.name_any(), &params).await {
            Ok(_) => {
                info!(at = %key(at), "deleted: ttlSecondsAfterFinished passed");
                Ok(Action::await_change())
            }
            Err(kube::Error::Api(s)) if s.is_not_found() || s.is_conflict() => {
                Ok(Action::await_change())
            }
            Err(source) => Err(Error::Delete {
                at: key(at),
                source,
            }),
        }
    }
}

/// What a pod create came to.
pub(super) enum Created {
    Yes,
    /// Not created: what was found instead (the pod exists, or the API server refused it).
    Found(PodObservation),
    /// Not created: the API server's copy of the At is not the one decided on.
    Unconfirmed,
    /// Not created: the At cache is behind; decided again once it has caught up, or after
    /// `scheduler::RECHECK_BEHIND`.
    Behind,
}
