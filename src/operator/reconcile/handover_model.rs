//! A model of two replicas, their caches and the API server, explored exhaustively with the real
//! `decide` and `confirms_create`: no At's command runs twice (without the quorum read
//! the search finds issue 39's double run).
//! See docs/src/design/decisions.md, "Never twice" (what it explores and what it abstracts).

use super::decide::{confirms_create, decide, Call, PodObservation};
use crate::api::{At, AtPodTemplate, AtSpec, AtStatus, Phase};
use crate::operator::pod::{PodEnd, PodView};
use crate::operator::policy::RunPolicy;
use chrono::{DateTime, Utc};
use std::collections::{HashSet, VecDeque};

/// The time before and after the At falls due (it is due at 11:00).
const BEFORE: &str = "2026-11-25T10:00:00Z";
const NOW: &str = "2026-11-25T12:00:00Z";

/// How the leader makes sure of the At before creating its pod.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Confirm {
    /// It does not: it trusts its cache.
    Never,
    /// A quorum read before every create.
    Read,
    /// A quorum read, unless the cached version is one its own PENDING write made in this
    /// leadership (what cnat does).
    ReadUnlessOwnWrite,
    /// The same with a ledger kept across leaderships (a defect: what it wrote before another
    /// leader acted proves nothing).
    ReadUnlessOwnWriteEver,
}

/// The At as the API server holds it: its version, whether it has `ttlSecondsAfterFinished:
/// 0`, and its status (as JSON, to be hashed).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct AtState {
    rv: u8,
    ttl: bool,
    status: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct PodState {
    ended: bool,
    held: bool,
    deleting: bool,
}

/// The cluster as the server holds it, or as a cache last saw it.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Default)]
struct World {
    at: Option<AtState>,
    pod: Option<PodState>,
}

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct State {
    server: World,
    caches: [World; 2],
    leader: usize,
    /// Whether the At's time has come.
    due: bool,
    /// Per replica, the version its own PENDING write made in its current leadership, if it is
    /// still the last one it decided on (its ledger; a new leadership starts a new one).
    own: [Option<u8>; 2],
    /// Pods created for the At (each runs its command once).
    runs: u8,
    /// Whether a pod was created without a read, on the leader's own write.
    trusted_own_write: bool,
}

fn now() -> DateTime<Utc> {
    NOW.parse().unwrap()
}

fn time(due: bool) -> DateTime<Utc> {
    if due { NOW } else { BEFORE }.parse().unwrap()
}

fn at_of(state: &AtState) -> At {
    let mut at = At::new(
        "x",
        AtSpec {
            schedule: "2026-11-25T11:00:00Z".into(),
            command: "true".into(),
            template: AtPodTemplate {
                image: Some("busybox".into()),
                ..Default::default()
            },
            ttl_seconds_after_finished: state.ttl.then_some(0),
            ..AtSpec::default()
        },
    );
    at.metadata.namespace = Some("default".into());
    at.metadata.uid = Some("uid-1".into());
    at.metadata.resource_version = Some(state.rv.to_string());
    at.status = state
        .status
        .as_deref()
        .map(|json| serde_json::from_str(json).unwrap());
    at
}

fn observe(pod: Option<PodState>, missing: PodObservation) -> PodObservation {
    match pod {
        None => missing,
        Some(pod) => PodObservation::Owned(PodView {
            name: "x-pod".into(),
            created_at: Some(now()),
            end: pod.ended.then(|| PodEnd {
                succeeded: true,
                exit_code: Some(0),
                detail: None,
                pod_reason: None,
                finished_at: Some(now()),
            }),
            deleting: pod.deleting,
            finalizer: pod.held,
            waiting: None,
            running: !pod.ended,
            active_deadline_seconds: None,
        }),
    }
}

/// The leader's reconcile on what its cache shows, carried out against the server.
fn reconcile(state: &State, confirm: Confirm) -> State {
    let mut next = state.clone();
    let cache = &state.caches[state.leader];
    let Some(cached) = &cache.at else {
        return next;
    };
    let at = at_of(cached);
    let mut observation = observe(cache.pod, PodObservation::NotCached);
    for _ in 0..3 {
        let decision = decide(&at, &observation, time(state.due), &RunPolicy::default());
        let server = &mut next.server;
        match decision.call {
            Call::LookUpPod => {
                observation = observe(server.pod, PodObservation::Missing);
                continue;
            }
            Call::CreatePod => {
                let fresh = server.at.as_ref().map(at_of);
                let trusts_own = matches!(
                    confirm,
                    Confirm::ReadUnlessOwnWrite | Confirm::ReadUnlessOwnWriteEver
                );
                let own = trusts_own && state.own[state.leader] == Some(cached.rv);
                let read = confirm != Confirm::Never && !own;
                if read && !confirms_create(&at, fresh.as_ref()) {
                    return next;
                }
                // No later create relies on this version.
                if state.own[state.leader] == Some(cached.rv) {
                    next.own[state.leader] = None;
                }
                if server.pod.is_some() {
                    // Already exists: looked up and decided again.
                    observation = observe(server.pod, PodObservation::Missing);
                    continue;
                }
                server.pod = Some(PodState {
                    ended: false,
                    held: true,
                    deleting: false,
                });
                next.runs += 1;
                next.trusted_own_write |= own;
            }
            Call::ReleasePod => {
                if let Some(pod) = &mut server.pod {
                    pod.held = false;
                    if pod.deleting {
                        server.pod = None;
                    }
                }
                return next;
            }
            Call::DeleteAt => {
                server.at = None;
                return next;
            }
            Call::DeletePod => {
                if let Some(pod) = &mut server.pod {
                    pod.deleting = true;
                }
            }
            Call::Nothing => {}
        }
        // The status write, guarded by the version decided on.
        if let (Some(status), Some(stored)) = (&decision.status, &mut server.at) {
            if next.own[state.leader] == Some(cached.rv) {
                next.own[state.leader] = None;
            }
            if stored.rv == cached.rv {
                *stored = AtState {
                    rv: stored.rv + 1,
                    ttl: stored.ttl,
                    status: Some(serde_json::to_string::<AtStatus>(status).unwrap()),
                };
                if status.phase == Phase::Pending {
                    next.own[state.leader] = Some(stored.rv);
                }
            }
        }
        return next;
    }
    next
}

/// Every state one step from `state`.
fn successors(state: &State, confirm: Confirm) -> Vec<State> {
    let mut next = vec![reconcile(state, confirm)];
    let mut change = |apply: &dyn Fn(&mut State)| {
        let mut changed = state.clone();
        apply(&mut changed);
        next.push(changed);
    };
    // The kubelet ends the pod.
    change(&|s| {
        if let Some(pod) = &mut s.server.pod {
            pod.ended = true;
        }
    });
    // Someone deletes the ended pod by hand; or the garbage collector, once the At is gone.
    change(&|s| {
        let gone = s.server.at.is_none();
        if let Some(pod) = &mut s.server.pod {
            if pod.ended || gone {
                if pod.held {
                    pod.deleting = true;
                } else {
                    s.server.pod = None;
                }
            }
        }
    });
    // The leader releases the held pod of a gone At (it asks the server first).
    change(&|s| {
        if s.server.at.is_none() && s.server.pod.is_some_and(|p| p.held && p.deleting) {
            s.server.pod = None;
        }
    });
    // A cache catches up; the Lease changes hands.
    for replica in 0..2 {
        change(&|s| s.caches[replica] = s.server.clone());
    }
    change(&|s| {
        s.leader = 1 - s.leader;
        // A new leadership, a new ledger.
        if confirm != Confirm::ReadUnlessOwnWriteEver {
            s.own[s.leader] = None;
        }
    });
    change(&|s| s.due = true);
    next.retain(|n| n != state);
    next
}

/// Every state reached from an At just created (with and without `ttlSecondsAfterFinished: 0`),
/// and the first in which the command ran twice, if any.
fn explore(confirm: Confirm) -> (Option<State>, HashSet<State>) {
    let mut seen = HashSet::new();
    let mut queue = VecDeque::new();
    for (ttl, due) in [(false, false), (false, true), (true, false), (true, true)] {
        let created = World {
            at: Some(AtState {
                rv: 1,
                ttl,
                status: None,
            }),
            pod: None,
        };
        let start = State {
            server: created.clone(),
            caches: [created.clone(), created],
            leader: 0,
            due,
            own: [None, None],
            runs: 0,
            trusted_own_write: false,
        };
        seen.insert(start.clone());
        queue.push_back(start);
    }
    while let Some(state) = queue.pop_front() {
        if state.runs > 1 {
            return (Some(state), seen);
        }
        for next in successors(&state, confirm) {
            if seen.insert(next.clone()) {
                queue.push_back(next);
            }
        }
    }
    (None, seen)
}

/// A replica's cache still shows the At as created (no status) while the server has moved on.
fn stale_cache(state: &State) -> bool {
    state
        .caches
        .iter()
        .any(|c| c.at.as_ref().is_some_and(|at| at.status.is_none()) && c.pod.is_none())
}

fn done(world: &World) -> bool {
    world.at.as_ref().is_some_and(|at| {
        at.status
            .as_deref()
            .is_some_and(|s| s.contains(r#""phase":"Done""#))
    })
}

#[test]
fn with_the_quorum_read_no_interleaving_runs_the_command_twice() {
    let (twice, seen) = explore(Confirm::Read);
    assert_eq!(twice, None);
    dangers_reached(&seen);
}

#[test]
fn skipping_the_read_on_the_leader_s_own_pending_write_runs_nothing_twice_either() {
    let (twice, seen) = explore(Confirm::ReadUnlessOwnWrite);
    assert_eq!(twice, None);
    dangers_reached(&seen);
    assert!(
        seen.iter().any(|s| s.trusted_own_write),
        "never created a pod on its own write"
    );
    // Not vacuous: a pod created on the leader's own write while the other replica's cache is
    // stale, and a handover after it.
    assert!(seen
        .iter()
        .any(|s| s.trusted_own_write && stale_cache(s) && s.runs == 1));
}

#[test]
fn a_ledger_kept_across_leaderships_would_run_it_twice() {
    let (twice, _) = explore(Confirm::ReadUnlessOwnWriteEver);
    let twice = twice.expect("a leader trusting a write from before another leader acted");
    assert!(twice.trusted_own_write, "{twice:?}");
}

/// The dangerous situations were reached, each with a stale cache that could lead.
fn dangers_reached(seen: &HashSet<State>) {
    let reached = |what: &str, holds: &dyn Fn(&State) -> bool| {
        assert!(seen.iter().any(holds), "never reached: {what}");
    };
    reached("deleted after it ran, a stale cache", &|s| {
        s.runs == 1 && s.server.at.is_none() && s.server.pod.is_none() && stale_cache(s)
    });
    reached("DONE, its pod let go and deleted, a stale cache", &|s| {
        s.runs == 1 && done(&s.server) && s.server.pod.is_none() && stale_cache(s)
    });
    reached("DONE, its pod let go but still there", &|s| {
        done(&s.server) && s.server.pod.is_some_and(|p| !p.held && !p.deleting)
    });
    reached("a stale cache leading", &|s| {
        s.runs == 1
            && s.caches[s.leader]
                .at
                .as_ref()
                .is_some_and(|at| at.status.is_none())
    });
}

#[test]
fn without_it_a_new_leader_with_a_stale_cache_runs_it_again() {
    let (twice, _) = explore(Confirm::Never);
    let twice = twice.expect("the issue's interleaving");
    // The leader that ran it again decided on a cache behind the server.
    let cache = &twice.caches[twice.leader];
    assert_ne!(cache.at, twice.server.at, "{twice:?}");
    assert!(
        cache.at.as_ref().is_some_and(|at| at.status.is_none()),
        "{twice:?}"
    );
}
