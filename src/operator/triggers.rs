//! What brings an At to a reconcile besides the runtime's own requeues: the At cache's changes
//! filtered to Ats with work now, first looks, looks after a pod list, sweeps after a relist,
//! and the look-ahead.
//! See docs/src/design/decisions.md, "The wake-up index".

use crate::api::Phase;
use crate::operator::cache::{self, CachedAt, Change};
use crate::operator::reconcile::wakeups::{HORIZON, LOOK_AHEAD_EVERY};
use crate::operator::reconcile::Context;
use crate::operator::{finalizer, pod, quarantine};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::ResourceExt;
use std::sync::Arc;
use tokio::sync::{broadcast, broadcast::error::RecvError, mpsc};
use tracing::warn;

/// The cached Ats with work now, as the cache's changes bring them (settled ones wait in the
/// wake-up index); deletions are forgotten (their held pods released), a relist or a lag looks
/// at every At again.
pub fn at_events(
    changes: broadcast::Receiver<Change>,
    ctx: Arc<Context>,
    store: Store<CachedAt>,
    orphans: mpsc::UnboundedSender<ObjectRef<Pod>>,
) -> impl futures::Stream<Item = Arc<CachedAt>> + Send {
    let filter = ctx.clone();
    futures::stream::unfold(
        (changes, ctx, store, orphans),
        |(mut changes, ctx, store, orphans)| async move {
            loop {
                match changes.recv().await {
                    Ok(Change::At(at)) if at.unreadable().is_some() => report(&ctx, &at),
                    Ok(Change::At(at)) => return Some((at, (changes, ctx, store, orphans))),
                    Ok(Change::Deleted(at)) => {
                        ctx.forget(&at);
                        if let Some(held) = ctx.calls().pod_awaiting_release(&at) {
                            let _ = orphans.send(held);
                        }
                    }
                    // Relisted, or fell behind: whatever was missed is in the cache.
                    seen @ (Ok(Change::Relisted) | Err(RecvError::Lagged(_))) => {
                        if let Err(RecvError::Lagged(missed)) = seen {
                            warn!(
                                missed,
                                "reconcile loop fell behind the At watch; looking at every At"
                            );
                        }
                        sweep(&ctx, &store, &orphans);
                        look_at_all(&ctx, &store).await;
                    }
                    Err(RecvError::Closed) => return None,
                }
            }
        },
    )
    .filter(move |cached: &Arc<CachedAt>| std::future::ready(needs_reconcile(&filter, cached)))
}

/// After a relist or a lagging feed, deletions were not seen one by one: drops what is kept
/// for Ats no longer cached, and releases the pods of those Ats.
fn sweep(ctx: &Context, store: &Store<CachedAt>, orphans: &mpsc::UnboundedSender<ObjectRef<Pod>>) {
    ctx.forget_all_but(|at| store.get(&CachedAt::key_of(at)).is_some());
    for found in ctx
        .calls()
        .pods_awaiting_release(|found| owner_gone(found, store))
    {
        let _ = orphans.send(found);
    }
}

/// Whether the owner At of `found` is gone from `store` (or is another At by that name now).
pub fn owner_gone(found: &Pod, store: &Store<CachedAt>) -> bool {
    let Some((owner, key)) = owner_of(found) else {
        return true;
    };
    match store.get(&key).as_deref().and_then(cache::read) {
        Some(at) => at.uid().as_deref() != Some(owner.uid.as_str()),
        None => true,
    }
}

/// The controlling owner of `found` and the cache key of the At by its name.
fn owner_of(found: &Pod) -> Option<(&OwnerReference, ObjectRef<CachedAt>)> {
    let owner = crate::operator::key::controller(found)?;
    let key = ObjectRef::new(&owner.name).within(&found.namespace().unwrap_or_default());
    Some((owner, key))
}

/// Looks at the cached Ats whose pods hold cnat's finalizer though they ended or are being
/// deleted, once a list of the pod watch is in the pod cache: kube-runtime's reflector puts a
/// list's pods in only when the list ends, so the reconciles the listed pods brought before that
/// found none, and such a pod changes no more. Runs in the pod watch's stream: a pass over the
/// cached pods, one At read back per such pod.
pub fn look_at_holders(ctx: &Arc<Context>, store: &Store<CachedAt>) {
    let holders = ctx.calls().cached_pods(|found| {
        finalizer::is_present(found)
            && (found.metadata.deletion_timestamp.is_some() || pod::has_ended(found))
    });
    for found in &holders {
        // Whether the At by that name owns the pod, its reconcile tells. An At that does not
        // decode was reported when it came.
        let owner = owner_of(found).and_then(|(_, key)| store.get(&key));
        if let Some(cached) = owner.filter(|cached| needs_reconcile(ctx, cached)) {
            ctx.scheduler().wake_up(CachedAt::key(&cached));
        }
    }
}

/// Tells in an event that `cached` does not decode as an At.
fn report(ctx: &Arc<Context>, cached: &CachedAt) {
    let why = cached.unreadable().unwrap_or_default();
    let regarding = kube::Resource::object_ref(cached, &());
    ctx.writer()
        .report_unreadable(&CachedAt::key(cached), regarding, why);
}

/// `Context::needs_reconcile` on a cached At read back; a panic is caught and ends the loop.
fn needs_reconcile(ctx: &Context, cached: &CachedAt) -> bool {
    let Some(at) = cache::read(cached) else {
        return false;
    };
    match quarantine::catch(|| ctx.needs_reconcile(&at)) {
        Ok(true) => {
            // Its reconcile follows: it takes the At as decoded here.
            ctx.ledger().keep_decoded(Arc::new(at));
            true
        }
        Ok(false) => false,
        Err(panic) => {
            ctx.panicked(&at, "look", &panic);
            false
        }
    }
}

/// Reconciles every cached At that needs it now; the others go into `wakeups`. Ats due within
/// `DUE_SOON` come first, then those that run.
pub async fn look_at_all(ctx: &Arc<Context>, store: &Store<CachedAt>) {
    let now = ctx.now();
    let mut ats = store.state();
    let soon = now + DUE_SOON;
    ats.sort_by_key(|at| first_look_order(at, soon));
    for (i, cached) in ats.iter().enumerate() {
        if i % 1000 == 999 {
            tokio::task::yield_now().await;
        }
        if cached.unreadable().is_some() {
            report(ctx, cached);
            continue;
        }
        if needs_reconcile(ctx, cached) {
            ctx.scheduler().wake_up(CachedAt::key(cached));
        }
    }
}

/// Runs until dropped: every `LOOK_AHEAD_EVERY`, `look_ahead_once`, or a look at every At should
/// the wall clock have passed the end of the horizon the last look covered.
pub async fn look_ahead(ctx: &Arc<Context>, store: &Store<CachedAt>) {
    let start = tokio::time::Instant::now() + LOOK_AHEAD_EVERY;
    let mut every = tokio::time::interval_at(start, LOOK_AHEAD_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first look at every At, beside this task, covers the first horizon.
    let mut covered = horizon_end(ctx.now());
    loop {
        every.tick().await;
        let now = ctx.now();
        if now > covered {
            warn!(
                covered_until = %covered,
                "the wall clock passed the wake-up index's horizon between two looks ahead; looking at every At"
            );
            look_at_all(ctx, store).await;
        } else {
            look_ahead_once(ctx, store, horizon_end(now)).await;
        }
        covered = horizon_end(now);
    }
}

/// The end of the wake-up index's horizon at wall-clock `now`.
fn horizon_end(now: DateTime<Utc>) -> DateTime<Utc> {
    now + chrono::TimeDelta::from_std(HORIZON).unwrap_or(chrono::TimeDelta::MAX)
}

/// Puts into the wake-up index every cached At whose next reconcile comes by `until`, of those it
/// does not hold yet that may have one (`may_come_within`); an At changed since this look began
/// is left to its change. A panic deciding an At is caught: the At is quarantined, the loop ends.
pub async fn look_ahead_once(ctx: &Arc<Context>, store: &Store<CachedAt>, until: DateTime<Utc>) {
    let ttl_by_default = ctx.ttl_by_default();
    for (i, cached) in store.state().iter().enumerate() {
        if i % 1000 == 999 {
            tokio::task::yield_now().await;
        }
        // An At that does not decode was reported when it came.
        if !may_come_within(cached, until, ttl_by_default) || cached.unreadable().is_some() {
            continue;
        }
        let key = CachedAt::key(cached);
        if ctx.scheduler().wakeups().when(&key).is_some() {
            continue;
        }
        let now_cached = store.get(&CachedAt::key_of(&key));
        if !now_cached.is_some_and(|now| Arc::ptr_eq(&now, cached)) {
            continue;
        }
        let Some(at) = cache::read(cached) else {
            continue;
        };
        if let Err(panic) = quarantine::catch(|| ctx.look_ahead(&at)) {
            ctx.panicked(&at, "look", &panic);
        }
    }
}

/// Whether `at` may have a reconcile due by `until` that no index holds, by what the cache keeps
/// apart (no At read back): a PENDING At due by then, or a DONE At with a TTL (its spec's, or
/// `ttl_by_default`). Not RUNNING: its next look is never further off than the horizon.
fn may_come_within(at: &CachedAt, until: DateTime<Utc>, ttl_by_default: bool) -> bool {
    match at.phase() {
        Phase::Pending => at.due().is_some_and(|due| due <= until),
        Phase::Done => at.sets_ttl() || ttl_by_default,
        Phase::Running => false,
    }
}

/// Where `at` comes in a first look at every At: PENDING and due by `soon` (the look's start
/// plus `DUE_SOON`), earliest first; then RUNNING (its pod may have ended); then the rest.
fn first_look_order(at: &CachedAt, soon: DateTime<Utc>) -> (u8, Option<DateTime<Utc>>) {
    match at.phase() {
        Phase::Pending if at.due().is_some_and(|due| due <= soon) => (0, at.due()),
        Phase::Running => (1, None),
        _ => (2, None),
    }
}

/// How far ahead a first look counts an At as due: longer than reading 100,000 cached Ats back.
const DUE_SOON: chrono::TimeDelta = chrono::TimeDelta::seconds(1);

#[cfg(test)]
mod tests {
    use super::*;

    fn cached(name: &str, schedule: &str, phase: Phase) -> CachedAt {
        CachedAt::example(name, "default", schedule, Some(phase))
    }

    #[test]
    fn a_first_look_takes_due_ats_first_earliest_first_then_running_ones() {
        let now: DateTime<Utc> = "2026-11-23T12:00:00Z".parse().unwrap();
        let mut ats = [
            cached("later", "2026-11-23T13:00:00Z", Phase::Pending),
            cached("done", "2026-11-23T11:00:00Z", Phase::Done),
            cached("running", "2026-11-23T11:00:00Z", Phase::Running),
            cached("bad", "soon", Phase::Pending),
            cached("in-a-second", "2026-11-23T12:00:01Z", Phase::Pending),
            cached("past-the-look", "2026-11-23T12:00:01.001Z", Phase::Pending),
            cached("due-soon", "2026-11-23T12:00:00.040Z", Phase::Pending),
            cached("due-now", "2026-11-23T12:00:00Z", Phase::Pending),
            cached("overdue", "2026-11-23T11:00:00Z", Phase::Pending),
        ];
        ats.sort_by_key(|at| first_look_order(at, now + DUE_SOON));
        let names: Vec<String> = ats.iter().map(|at| at.name_any()).collect();
        assert_eq!(
            names[..5],
            ["overdue", "due-now", "due-soon", "in-a-second", "running"]
        );
        let mut rest = names[5..].to_vec();
        rest.sort();
        assert_eq!(rest, ["bad", "done", "later", "past-the-look"]);
    }

    #[test]
    fn a_look_ahead_reads_back_only_pending_ats_due_within_the_horizon_and_done_ones_with_a_ttl() {
        let until: DateTime<Utc> = "2026-11-23T13:00:00Z".parse().unwrap();
        let mut with_ttl = cached("ttl", "2026-11-23T11:00:00Z", Phase::Done)
            .at()
            .unwrap();
        with_ttl.spec.ttl_seconds_after_finished = Some(7200);
        let with_ttl = CachedAt::from(with_ttl);
        for at in [
            &cached("at-the-end", "2026-11-23T13:00:00Z", Phase::Pending),
            &cached("overdue", "2026-11-23T11:00:00Z", Phase::Pending),
            &with_ttl,
        ] {
            assert!(may_come_within(at, until, false), "{}", at.name_any());
        }
        let done = cached("done", "2026-11-23T11:00:00Z", Phase::Done);
        for at in [
            &cached("later", "2026-11-23T13:00:00.001Z", Phase::Pending),
            &cached("bad", "soon", Phase::Pending),
            &cached("running", "2026-11-23T11:00:00Z", Phase::Running),
            &done,
        ] {
            assert!(!may_come_within(at, until, false), "{}", at.name_any());
        }
        // With a TTL for every At, every DONE one.
        assert!(may_come_within(&done, until, true));
    }
}
