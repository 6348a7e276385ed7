//! Pure decisions about the Lease record: what a candidate does next, when a leader must stop,
//! and the compare-and-swap writes. No clock is read here: `now` is a parameter.
//! See docs/src/operating/high-availability.md, "How the election works".

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use serde_json::{json, Value};
use std::time::Duration;
use tokio::time::Instant;

/// What a replica last saw of the Lease, and when it saw it change, on its own clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// `None` when nobody holds it (`holderIdentity` empty or absent, as after a release).
    pub holder: Option<String>,
    /// The record's `leaseDurationSeconds` (ours when absent).
    pub lease_duration: Duration,
    pub transitions: i32,
    pub resource_version: String,
    /// When this replica first saw this `resourceVersion`.
    pub changed_at: Instant,
    /// The holder asked for a successor to hand the Lease over to (`HANDING_OVER`, naming the
    /// holder: one left by an earlier holder asks nothing).
    pub handing_over: bool,
    /// The replica ready to be handed the Lease (`PREFERRED_HOLDER`).
    pub preferred_holder: Option<String>,
    /// The Lease's spec as written (holder, duration, times, transitions): only a change of it
    /// shows its holder alive, as client-go judges (a candidate's annotation does not).
    record: String,
}

/// Set by a holder about to give the Lease up (shutdown, or a shard given up for the balance):
/// it asks for a successor that readies itself (lists the shard's Ats) while it still leads.
pub const HANDING_OVER: &str = "cnat.programming-kubernetes.info/handing-over";

/// Set by the candidate that is ready to lead (its identity): the holder stops reconciling and
/// writes it as the holder.
pub const PREFERRED_HOLDER: &str = "cnat.programming-kubernetes.info/preferred-holder";

/// What a candidate makes of a handover on the Lease (`offer`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Offer {
    /// No handover asked for (or the Lease is free, or ours).
    None,
    /// The holder asks for a successor and nobody is ready yet: ready yourself.
    Open,
    /// This replica said it is ready: wait to be made the holder.
    Ours,
    /// Another replica said it is ready first.
    Taken,
}

/// What the handover on `seen` means for candidate `me`.
pub fn offer(seen: &Seen, me: &str) -> Offer {
    let held_by_another = seen.holder.as_deref().is_some_and(|h| h != me);
    match (&seen.preferred_holder, held_by_another && seen.handing_over) {
        (_, false) => Offer::None,
        (None, true) => Offer::Open,
        (Some(ready), true) if ready == me => Offer::Ours,
        (Some(_), true) => Offer::Taken,
    }
}

impl Seen {
    /// The Lease as read or watched at `now`; `previous` keeps `changed_at` unless the spec
    /// changed, so neither a re-read nor a change of annotations alone postpones its expiry.
    pub fn observe(lease: &Lease, previous: Option<&Seen>, ours: Duration, now: Instant) -> Seen {
        let spec = lease.spec.clone().unwrap_or_default();
        let resource_version = lease.metadata.resource_version.clone().unwrap_or_default();
        let record = serde_json::to_string(&spec).unwrap_or_default();
        let changed_at = match previous {
            Some(p) if p.resource_version == resource_version || p.record == record => p.changed_at,
            _ => now,
        };
        let lease_duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(ours, Duration::from_secs);
        let annotation = |key: &str| {
            lease
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(key))
                .filter(|value| !value.is_empty())
                .cloned()
        };
        let holder = spec.holder_identity.filter(|h| !h.is_empty());
        Seen {
            handing_over: holder.is_some() && annotation(HANDING_OVER) == holder,
            holder,
            lease_duration,
            transitions: spec.lease_transitions.unwrap_or(0),
            resource_version,
            changed_at,
            preferred_holder: annotation(PREFERRED_HOLDER),
            record,
        }
    }

    /// When the Lease expires for this replica if nothing changes (its own clock).
    pub fn expires_at(&self) -> Instant {
        self.changed_at + self.lease_duration
    }

    /// Since when the Lease could be taken: its release, or its expiry.
    pub fn free_since(&self) -> Instant {
        match self.holder {
            None => self.changed_at,
            Some(_) => self.expires_at(),
        }
    }
}

/// What a candidate knows about the Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Known {
    /// Nothing yet, or a write failed with a conflict: read it.
    Unknown,
    /// The API server said 404.
    Missing,
    Seen(Seen),
}

/// A candidate's next step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Read the Lease.
    Read,
    /// Create the Lease, holding it.
    Create,
    /// Write ourselves in as holder, on this version of the record.
    Take {
        resource_version: String,
        transitions: i32,
    },
    /// Someone holds it: wait for news, or until then, when it expires for us.
    Wait { until: Instant },
    /// Its holder hands it over and we are ready to lead: say so, on this version of the record
    /// (`handover`).
    Offer { resource_version: String },
}

/// What a candidate `me` does at `now` given what it knows.
pub fn next(known: &Known, me: &str, now: Instant) -> Next {
    let seen = match known {
        Known::Unknown => return Next::Read,
        Known::Missing => return Next::Create,
        Known::Seen(seen) => seen,
    };
    let ours = seen.holder.as_deref() == Some(me);
    if seen.holder.is_none() || ours || now >= seen.expires_at() {
        Next::Take {
            resource_version: seen.resource_version.clone(),
            // client-go counts a transition whenever the holder changes.
            transitions: seen.transitions + i32::from(!ours),
        }
    } else {
        Next::Wait {
            until: seen.expires_at(),
        }
    }
}

/// The leader's view of its own tenure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The version of the record our last successful write produced.
    pub resource_version: String,
    /// When that write was sent. Others cannot have seen the record change before this, so
    /// they cannot take the Lease before `sent + lease duration`: stopping at
    /// `sent + renew deadline` stops first, whatever their clocks say.
    pub sent: Instant,
}

impl Held {
    /// When this replica must have stopped reconciling unless a renewal lands.
    pub fn deadline(&self, renew_deadline: Duration) -> Instant {
        self.sent + renew_deadline
    }
}

/// The outcome of a renewal or release that met a conflict, once the Lease was read again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reread {
    /// Still ours (someone else touched the object): retry on this version.
    StillOurs { resource_version: String },
    /// Someone else holds it, or nobody does: we no longer lead.
    Gone { holder: Option<String> },
}

/// Reading the Lease again after a conflict.
pub fn reread(lease: Option<&Lease>, me: &str) -> Reread {
    let holder = lease
        .and_then(|l| l.spec.as_ref())
        .and_then(|s| s.holder_identity.clone())
        .filter(|h| !h.is_empty());
    match (lease, holder) {
        (Some(lease), Some(h)) if h == me => Reread::StillOurs {
            resource_version: lease.metadata.resource_version.clone().unwrap_or_default(),
        },
        (_, holder) => Reread::Gone { holder },
    }
}

fn micro(t: jiff::Timestamp) -> Value {
    serde_json::to_value(MicroTime(t)).unwrap_or(Value::Null)
}

/// Takes the Lease: a merge patch that fails with 409 unless the record is still at
/// `resource_version`.
pub fn take_patch(
    me: &str,
    resource_version: &str,
    transitions: i32,
    lease_seconds: i32,
    wall: jiff::Timestamp,
) -> Value {
    json!({
        "metadata": { "resourceVersion": resource_version, "annotations": no_handover() },
        "spec": {
            "holderIdentity": me,
            "leaseDurationSeconds": lease_seconds,
            "acquireTime": micro(wall),
            "renewTime": micro(wall),
            "leaseTransitions": transitions,
        },
    })
}

/// Removes what a handover left on the Lease (a holder that died while handing it over).
fn no_handover() -> Value {
    json!({ HANDING_OVER: null, PREFERRED_HOLDER: null })
}

/// Renews our Lease, on the version our last write produced; `handing_over` (our identity):
/// asks for a successor as well (`HANDING_OVER`; it stays until the Lease changes hands).
pub fn renew_patch(
    resource_version: &str,
    wall: jiff::Timestamp,
    handing_over: Option<&str>,
) -> Value {
    let mut patch = json!({
        "metadata": { "resourceVersion": resource_version },
        "spec": { "renewTime": micro(wall) },
    });
    if let Some(me) = handing_over {
        patch["metadata"]["annotations"] = json!({ HANDING_OVER: me });
    }
    patch
}

/// Says that candidate `me` is ready to lead (`PREFERRED_HOLDER`), on the version it saw
/// asking for a successor, so that of two ready candidates one is chosen.
pub fn prefer_patch(resource_version: &str, me: &str) -> Value {
    json!({
        "metadata": {
            "resourceVersion": resource_version,
            "annotations": { PREFERRED_HOLDER: me },
        },
    })
}

/// Takes back a candidate's name (`PREFERRED_HOLDER`): it stops, and will not lead.
pub fn unprefer_patch(resource_version: &str) -> Value {
    json!({
        "metadata": {
            "resourceVersion": resource_version,
            "annotations": { PREFERRED_HOLDER: null },
        },
    })
}

/// Hands our Lease over to `to` (its preferred holder): it holds the Lease from now, as if it
/// had taken it, on the version that named it.
pub fn hand_over_patch(
    resource_version: &str,
    to: &str,
    transitions: i32,
    lease_seconds: i32,
    wall: jiff::Timestamp,
) -> Value {
    take_patch(to, resource_version, transitions, lease_seconds, wall)
}

/// Gives the Lease up (as client-go does: no holder, a 1 s duration), on the version our last
/// write produced, so it can never blank a successor's record.
pub fn release_patch(resource_version: &str, wall: jiff::Timestamp) -> Value {
    json!({
        "metadata": { "resourceVersion": resource_version, "annotations": no_handover() },
        "spec": {
            "holderIdentity": "",
            "leaseDurationSeconds": 1,
            "renewTime": micro(wall),
        },
    })
}

/// A new Lease held by `me` (creation is its own precondition: 409 if it exists).
pub fn new_lease(
    name: &str,
    namespace: &str,
    me: &str,
    lease_seconds: i32,
    wall: jiff::Timestamp,
) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(me.into()),
            lease_duration_seconds: Some(lease_seconds),
            acquire_time: Some(MicroTime(wall)),
            renew_time: Some(MicroTime(wall)),
            lease_transitions: Some(0),
            ..LeaseSpec::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OURS: Duration = Duration::from_secs(15);
    const T: &str = "2026-11-22T07:33:01.146870Z";

    fn lease(holder: &str, seconds: i32, rv: &str, renewed: &str) -> Lease {
        serde_json::from_value(json!({
            "metadata": {"name": "cnat", "namespace": "fx", "resourceVersion": rv},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": seconds,
                     "renewTime": renewed, "leaseTransitions": 3},
        }))
        .unwrap()
    }

    fn at(t0: Instant, secs: f64) -> Instant {
        t0 + Duration::from_secs_f64(secs)
    }

    #[test]
    fn expiry_is_measured_on_our_clock_from_when_we_saw_a_change() {
        let t0 = Instant::now();
        let held = lease("cnat-a", 15, "10", "2026-11-22T07:33:01.146870Z");
        let seen = Seen::observe(&held, None, OURS, t0);
        assert_eq!(seen.expires_at(), at(t0, 15.0));
        assert_eq!(seen.holder.as_deref(), Some("cnat-a"));
        // Re-reading the same version later does not postpone the expiry ...
        let again = Seen::observe(&held, Some(&seen), OURS, at(t0, 9.0));
        assert_eq!(again.expires_at(), at(t0, 15.0));
        // ... a renewal (new version) does.
        let renewed = lease("cnat-a", 15, "11", "2026-11-22T07:33:03.146870Z");
        let after = Seen::observe(&renewed, Some(&again), OURS, at(t0, 10.0));
        assert_eq!(after.expires_at(), at(t0, 25.0));
    }

    #[test]
    fn timestamps_in_the_record_are_ignored_whatever_the_skew() {
        let t0 = Instant::now();
        // A holder whose clock is far ahead, far behind, or absurd: the decision is the same.
        for renewed in [
            "2026-11-22T07:33:06.000000Z",
            "2026-11-22T07:32:56.000000Z",
            "1970-01-01T00:00:00.000000Z",
            "2999-01-01T00:00:00.000000Z",
        ] {
            let seen = Seen::observe(&lease("cnat-a", 15, "10", renewed), None, OURS, t0);
            let known = Known::Seen(seen);
            assert_eq!(
                next(&known, "cnat-b", at(t0, 14.999)),
                Next::Wait {
                    until: at(t0, 15.0)
                },
                "{renewed}"
            );
            assert!(
                matches!(next(&known, "cnat-b", at(t0, 15.0)), Next::Take { .. }),
                "{renewed}"
            );
        }
    }

    #[test]
    fn a_released_lease_is_free_at_once() {
        let t0 = Instant::now();
        // As captured: holder "", leaseDurationSeconds 1.
        let released = lease("", 1, "139242", "2026-11-22T07:33:01.398641Z");
        let seen = Seen::observe(&released, None, OURS, t0);
        assert_eq!(seen.holder, None);
        assert_eq!(seen.free_since(), t0);
        assert_eq!(
            next(&Known::Seen(seen), "cnat-b", t0),
            Next::Take {
                resource_version: "139242".into(),
                transitions: 4
            }
        );
        let mut absent: Lease = released.clone();
        absent.spec.as_mut().unwrap().holder_identity = None;
        let seen = Seen::observe(&absent, None, OURS, t0);
        assert!(matches!(
            next(&Known::Seen(seen), "cnat-b", t0),
            Next::Take { .. }
        ));
    }

    #[test]
    fn the_records_duration_wins_over_ours() {
        let t0 = Instant::now();
        let seen = Seen::observe(&lease("cnat-a", 40, "1", T), None, OURS, t0);
        assert_eq!(seen.expires_at(), at(t0, 40.0));
        assert_eq!(seen.free_since(), at(t0, 40.0));
        let mut no_duration = lease("cnat-a", 1, "1", T);
        no_duration.spec.as_mut().unwrap().lease_duration_seconds = None;
        assert_eq!(
            Seen::observe(&no_duration, None, OURS, t0).expires_at(),
            at(t0, 15.0)
        );
        let mut negative = lease("cnat-a", -5, "1", T);
        negative.spec.as_mut().unwrap().lease_duration_seconds = Some(-5);
        assert_eq!(
            Seen::observe(&negative, None, OURS, t0).expires_at(),
            at(t0, 15.0)
        );
    }

    #[test]
    fn what_a_candidate_does_in_every_state() {
        let t0 = Instant::now();
        assert_eq!(next(&Known::Unknown, "me", t0), Next::Read);
        assert_eq!(next(&Known::Missing, "me", t0), Next::Create);
        let other = Known::Seen(Seen::observe(&lease("other", 15, "7", T), None, OURS, t0));
        assert_eq!(
            next(&other, "me", at(t0, 1.0)),
            Next::Wait {
                until: at(t0, 15.0)
            }
        );
        assert_eq!(
            next(&other, "me", at(t0, 20.0)),
            Next::Take {
                resource_version: "7".into(),
                transitions: 4
            }
        );
        // Our own record (a restarted container with the same pod name): take it back at once,
        // without counting a transition.
        let mine = Known::Seen(Seen::observe(&lease("me", 15, "8", T), None, OURS, t0));
        assert_eq!(
            next(&mine, "me", t0),
            Next::Take {
                resource_version: "8".into(),
                transitions: 3
            }
        );
    }

    #[test]
    fn a_leader_stops_before_anyone_can_take_over() {
        let t0 = Instant::now();
        let held = Held {
            resource_version: "5".into(),
            sent: t0,
        };
        let (renew, lease) = (Duration::from_secs(10), Duration::from_secs(15));
        // The earliest a candidate can see the write is when it was sent.
        let candidate = Seen::observe(&lease_v("5"), None, lease, t0);
        assert!(held.deadline(renew) < candidate.expires_at());
    }

    fn lease_v(rv: &str) -> Lease {
        lease("me", 15, rv, T)
    }

    #[test]
    fn rereading_after_a_conflict() {
        assert_eq!(
            reread(Some(&lease("me", 15, "9", T)), "me"),
            Reread::StillOurs {
                resource_version: "9".into()
            }
        );
        assert_eq!(
            reread(Some(&lease("them", 15, "9", T)), "me"),
            Reread::Gone {
                holder: Some("them".into())
            }
        );
        assert_eq!(
            reread(Some(&lease("", 1, "9", T)), "me"),
            Reread::Gone { holder: None }
        );
        assert_eq!(reread(None, "me"), Reread::Gone { holder: None });
    }

    #[test]
    fn every_write_carries_its_precondition() {
        let wall: jiff::Timestamp = "2026-11-22T07:33:01.5Z".parse().unwrap();
        let no_handover = json!({HANDING_OVER: null, PREFERRED_HOLDER: null});
        let take = take_patch("me", "41", 2, 15, wall);
        assert_eq!(
            take,
            json!({
                "metadata": {"resourceVersion": "41", "annotations": no_handover},
                "spec": {"holderIdentity": "me", "leaseDurationSeconds": 15,
                         "acquireTime": "2026-11-22T07:33:01.500000Z",
                         "renewTime": "2026-11-22T07:33:01.500000Z", "leaseTransitions": 2},
            })
        );
        assert_eq!(
            renew_patch("42", wall, None),
            json!({"metadata": {"resourceVersion": "42"},
                   "spec": {"renewTime": "2026-11-22T07:33:01.500000Z"}})
        );
        assert_eq!(
            renew_patch("42", wall, Some("me")),
            json!({"metadata": {"resourceVersion": "42", "annotations": {HANDING_OVER: "me"}},
                   "spec": {"renewTime": "2026-11-22T07:33:01.500000Z"}})
        );
        assert_eq!(
            prefer_patch("44", "cnat-b"),
            json!({"metadata": {"resourceVersion": "44",
                                "annotations": {PREFERRED_HOLDER: "cnat-b"}}})
        );
        // The successor holds it as if it had taken it; what the handover wrote is gone.
        assert_eq!(
            hand_over_patch("45", "cnat-b", 3, 15, wall),
            take_patch("cnat-b", "45", 3, 15, wall)
        );
        // The release matches what the real server showed for one (lease-watch-events.jsonl),
        // and removes what a handover left.
        assert_eq!(
            release_patch("43", wall),
            json!({"metadata": {"resourceVersion": "43", "annotations": no_handover},
                   "spec": {"holderIdentity": "", "leaseDurationSeconds": 1,
                            "renewTime": "2026-11-22T07:33:01.500000Z"}})
        );
        let created = serde_json::to_value(new_lease("cnat", "fx", "me", 15, wall)).unwrap();
        assert_eq!(created["spec"]["holderIdentity"], "me");
        assert_eq!(created["spec"]["leaseTransitions"], 0);
        assert_eq!(created["metadata"]["namespace"], "fx");
    }

    fn handing_over(holder: &str, preferred: Option<&str>) -> Seen {
        let mut lease = lease(holder, 15, "9", T);
        let mut annotations =
            std::collections::BTreeMap::from([(HANDING_OVER.to_owned(), holder.to_owned())]);
        if let Some(preferred) = preferred {
            annotations.insert(PREFERRED_HOLDER.to_owned(), preferred.to_owned());
        }
        lease.metadata.annotations = Some(annotations);
        Seen::observe(&lease, None, OURS, Instant::now())
    }

    #[test]
    fn a_change_of_annotations_alone_does_not_postpone_expiry() {
        let t0 = Instant::now();
        let held = lease("a", 15, "10", T);
        let seen = Seen::observe(&held, None, OURS, t0);
        // A candidate names itself (a new resourceVersion, the same spec): the holder may be dead.
        let mut offered = held.clone();
        offered.metadata.resource_version = Some("11".into());
        offered.metadata.annotations = Some([(PREFERRED_HOLDER.to_owned(), "b".to_owned())].into());
        let again = Seen::observe(&offered, Some(&seen), OURS, at(t0, 10.0));
        assert_eq!(again.expires_at(), at(t0, 15.0));
        // A renewal (a new renewTime) does.
        let renewed = lease("a", 15, "12", "2026-11-22T07:33:03.146870Z");
        let after = Seen::observe(&renewed, Some(&again), OURS, at(t0, 11.0));
        assert_eq!(after.expires_at(), at(t0, 26.0));
    }

    #[test]
    fn what_a_candidate_makes_of_a_handover() {
        // Asked for a successor, nobody named: ready yourself.
        assert_eq!(offer(&handing_over("a", None), "b"), Offer::Open);
        assert_eq!(offer(&handing_over("a", Some("b")), "b"), Offer::Ours);
        assert_eq!(offer(&handing_over("a", Some("c")), "b"), Offer::Taken);
        // The holder itself, a free Lease, and a Lease nobody hands over are no offer.
        assert_eq!(offer(&handing_over("b", None), "b"), Offer::None);
        assert_eq!(offer(&handing_over("", None), "b"), Offer::None);
        let plain = Seen::observe(&lease("a", 15, "9", T), None, OURS, Instant::now());
        assert!(!plain.handing_over);
        assert_eq!(plain.preferred_holder, None);
        assert_eq!(offer(&plain, "b"), Offer::None);
        // A preferred holder without the ask (left by a holder that died) is no offer either.
        let mut stale = plain.clone();
        stale.preferred_holder = Some("b".into());
        assert_eq!(offer(&stale, "b"), Offer::None);
        // An ask left by an earlier holder asks nothing of the present one's candidates.
        let mut left = lease("c", 15, "10", T);
        left.metadata.annotations = Some([(HANDING_OVER.to_owned(), "a".to_owned())].into());
        let earlier = Seen::observe(&left, None, OURS, Instant::now());
        assert!(!earlier.handing_over);
        assert_eq!(offer(&earlier, "b"), Offer::None);
        // Empty annotations count as absent.
        let mut empty = lease("a", 15, "9", T);
        empty.metadata.annotations = Some(
            [(HANDING_OVER.to_owned(), String::new())]
                .into_iter()
                .collect(),
        );
        let seen = Seen::observe(&empty, None, OURS, Instant::now());
        assert_eq!(offer(&seen, "b"), Offer::None);
    }

    #[test]
    fn the_captured_watch_stream_reads_as_renew_release_takeover() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/api-k8s-1.24/lease-watch-events.jsonl"
        );
        let t0 = Instant::now();
        let mut seen: Option<Seen> = None;
        let mut steps = Vec::new();
        for (i, line) in std::fs::read_to_string(path).unwrap().lines().enumerate() {
            let event: Value = serde_json::from_str(line).unwrap();
            let lease: Lease = serde_json::from_value(event["object"].clone()).unwrap();
            let now = at(t0, i as f64);
            let s = Seen::observe(&lease, seen.as_ref(), OURS, now);
            steps.push(next(&Known::Seen(s.clone()), "cnat-c", now));
            seen = Some(s);
        }
        assert_eq!(
            steps,
            [
                Next::Wait {
                    until: at(t0, 15.0)
                },
                Next::Take {
                    resource_version: "139242".into(),
                    transitions: 1
                },
                Next::Wait {
                    until: at(t0, 17.0)
                },
            ]
        );
    }
}
