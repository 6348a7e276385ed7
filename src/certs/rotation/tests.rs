use super::*;
use proptest::prelude::*;

fn t(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

fn cert(id: u8, not_after: Timestamp) -> Facts {
    Facts {
        fingerprint: [id; 32],
        not_after,
    }
}

const DAY: i64 = 86_400;

fn policy() -> Policy {
    Policy {
        ca_validity: SignedDuration::from_secs(1000 * DAY),
        ca_renew_before: SignedDuration::from_secs(100 * DAY),
        leaf_validity: SignedDuration::from_secs(90 * DAY),
        leaf_renew_before: SignedDuration::from_secs(30 * DAY),
        overlap: SignedDuration::from_secs(600),
    }
}

/// A settled Secret: CA 1 (ends at day 1000), leaf 9 (ends at day 90), bundle {1}.
fn settled() -> Stored {
    let ca = cert(1, t(1000 * DAY));
    Stored {
        ca: ca.clone(),
        next: None,
        bundle: vec![ca],
        leaf: cert(9, t(90 * DAY)),
        leaf_fits: true,
        published_at: None,
        switched_at: None,
        request: None,
    }
}

fn trusting(ids: &[u8]) -> Target {
    Target::Trusts(ids.iter().map(|&id| cert(id, t(1000 * DAY))).collect())
}

#[test]
fn a_missing_or_broken_secret_is_made_anew_keeping_what_targets_trust_today() {
    let targets = [
        Target::Trusts(vec![cert(3, t(10)), cert(4, t(-1))]),
        Target::Trusts(vec![cert(3, t(10)), cert(5, t(20))]),
        Target::Ignored,
    ];
    for found in [Found::Missing, Found::Broken] {
        assert_eq!(
            next_step(&found, &targets, &policy(), t(0)),
            Step::Bootstrap {
                adopt: vec![[3; 32], [5; 32]]
            },
            "expired CA 4 is not adopted, CA 3 once"
        );
    }
    assert_eq!(
        next_step(&Found::Missing, &[], &policy(), t(0)),
        Step::Bootstrap { adopt: vec![] }
    );
}

#[test]
fn a_secret_that_is_not_cnats_is_never_written() {
    assert_eq!(
        next_step(&Found::Foreign, &[trusting(&[1])], &policy(), t(0)),
        Step::Refuse
    );
}

#[test]
fn a_settled_secret_waits_until_its_leaf_is_due_and_renews_it_then() {
    let found = Found::Stored(settled());
    let targets = [trusting(&[1])];
    let due = t(60 * DAY);
    assert_eq!(
        next_step(&found, &targets, &policy(), t(0)),
        Step::Wait { until: Some(due) }
    );
    assert_eq!(
        next_step(&found, &targets, &policy(), t(60 * DAY - 1)),
        Step::Wait { until: Some(due) }
    );
    assert_eq!(next_step(&found, &targets, &policy(), due), Step::RenewLeaf);
}

#[test]
fn a_leaf_that_does_not_fit_or_is_asked_for_is_renewed_at_once() {
    let mut stored = settled();
    stored.leaf_fits = false;
    assert_eq!(
        next_step(&Found::Stored(stored), &[], &policy(), t(0)),
        Step::RenewLeaf
    );
    let mut stored = settled();
    stored.request = Some(Request::Leaf);
    assert_eq!(
        next_step(&Found::Stored(stored), &[], &policy(), t(0)),
        Step::RenewLeaf
    );
}

#[test]
fn a_ca_due_or_asked_for_is_published_before_anything_else() {
    let mut stored = settled();
    stored.leaf_fits = false;
    assert_eq!(
        next_step(&Found::Stored(stored.clone()), &[], &policy(), t(900 * DAY)),
        Step::Publish,
        "day 900 is 100 days before the CA's end"
    );
    assert_eq!(
        next_step(
            &Found::Stored(stored.clone()),
            &[],
            &policy(),
            t(900 * DAY - 1)
        ),
        Step::RenewLeaf
    );
    stored.request = Some(Request::Ca);
    assert_eq!(
        next_step(&Found::Stored(stored), &[], &policy(), t(0)),
        Step::Publish
    );
}

#[test]
fn a_published_ca_signs_only_after_the_overlap_and_once_every_target_trusts_it() {
    let mut stored = settled();
    stored.next = Some(cert(2, t(2000 * DAY)));
    stored.bundle.push(cert(2, t(2000 * DAY)));
    stored.published_at = Some(t(100));
    stored.request = Some(Request::Ca);
    let found = Found::Stored(stored);
    let all = [trusting(&[1, 2]), trusting(&[2, 1]), Target::Ignored];
    let one_lags = [trusting(&[1, 2]), trusting(&[1]), Target::Ignored];
    assert_eq!(
        next_step(&found, &all, &policy(), t(699)),
        Step::Wait {
            until: Some(t(700))
        }
    );
    assert_eq!(next_step(&found, &all, &policy(), t(700)), Step::Switch);
    assert_eq!(
        next_step(&found, &one_lags, &policy(), t(5000)),
        Step::Wait {
            until: Some(t(90 * DAY))
        },
        "until a target trusts it (its write wakes the keeper), or the leaf expires"
    );
}

#[test]
fn the_ca_before_stays_trusted_for_the_overlap_then_goes() {
    let mut stored = settled();
    stored.ca = cert(2, t(2000 * DAY));
    stored.bundle = vec![cert(2, t(2000 * DAY)), cert(1, t(1000 * DAY))];
    stored.switched_at = Some(t(100));
    let found = Found::Stored(stored.clone());
    assert_eq!(
        next_step(&found, &[], &policy(), t(1299)),
        Step::Wait {
            until: Some(t(1300))
        },
        "two overlaps: replicas serve the new leaf up to one overlap after they see it trusted"
    );
    assert_eq!(
        next_step(&found, &[], &policy(), t(1300)),
        Step::Rebundle {
            keep: vec![[2; 32]]
        }
    );
    // Expired before its overlap ends: dropped at once.
    stored.bundle[1].not_after = t(50);
    assert_eq!(
        next_step(&Found::Stored(stored), &[], &policy(), t(60)),
        Step::Rebundle {
            keep: vec![[2; 32]]
        }
    );
}

#[test]
fn a_leaf_due_during_a_rotation_is_renewed_from_the_current_ca() {
    let mut stored = settled();
    stored.next = Some(cert(2, t(2000 * DAY)));
    stored.bundle.push(cert(2, t(2000 * DAY)));
    stored.published_at = Some(t(100));
    stored.leaf_fits = false;
    let lagging = [trusting(&[1])];
    assert_eq!(
        next_step(&Found::Stored(stored), &lagging, &policy(), t(200)),
        Step::RenewLeaf,
        "a target that never trusts the new CA does not hold the leaf back"
    );
}

#[test]
fn a_leaf_merely_due_during_a_rotation_waits_for_the_switch() {
    // Near the CA's end a leaf renewed from it would be due again at once: no renewal loop.
    let mut stored = settled();
    stored.ca.not_after = t(20 * DAY);
    stored.leaf.not_after = t(20 * DAY);
    stored.next = Some(cert(2, t(2000 * DAY)));
    stored.bundle.push(cert(2, t(2000 * DAY)));
    stored.published_at = Some(t(0));
    let lagging = [trusting(&[1])];
    let found = Found::Stored(stored.clone());
    assert_eq!(
        next_step(&found, &lagging, &policy(), t(100)),
        Step::Wait {
            until: Some(t(600))
        }
    );
    assert_eq!(
        next_step(&found, &lagging, &policy(), t(700)),
        Step::Wait {
            until: Some(t(20 * DAY))
        }
    );
    // Both expired: nothing a renewal could mend, and no wait that ends at once.
    assert_eq!(
        next_step(&found, &lagging, &policy(), t(30 * DAY)),
        Step::Wait { until: None }
    );
}

#[test]
fn a_time_a_step_counts_from_that_is_missing_is_written_first() {
    let mut stored = settled();
    stored.next = Some(cert(2, t(2000 * DAY)));
    stored.bundle.push(cert(2, t(2000 * DAY)));
    assert_eq!(
        next_step(&Found::Stored(stored.clone()), &[], &policy(), t(0)),
        Step::Stamp,
        "a published CA without its time would wait for ever"
    );
    stored.next = None;
    assert_eq!(
        next_step(&Found::Stored(stored.clone()), &[], &policy(), t(0)),
        Step::Stamp,
        "an old CA without the switch's time would be dropped at once"
    );
    stored.switched_at = Some(t(0));
    assert!(matches!(
        next_step(&Found::Stored(stored), &[], &policy(), t(0)),
        Step::Wait { .. }
    ));
}

#[test]
fn a_bundle_without_the_signing_ca_gets_it_back() {
    let mut stored = settled();
    stored.bundle = vec![];
    assert_eq!(
        next_step(&Found::Stored(stored), &[], &policy(), t(0)),
        Step::Rebundle {
            keep: vec![[1; 32]]
        }
    );
}

#[test]
fn a_new_ca_s_leaf_is_served_only_once_every_target_trusted_it_for_an_overlap() {
    let targets = [trusting(&[1]), Target::Ignored];
    assert!(trusted_everywhere(&targets, &[1; 32]));
    assert!(!trusted_everywhere(&targets, &[2; 32]));
    let overlap = SignedDuration::from_secs(600);
    let long = Some(overlap);
    let short = Some(SignedDuration::from_secs(599));
    assert!(
        may_serve(None, &[2; 32], None, overlap),
        "a first leaf at once"
    );
    assert!(
        may_serve(Some(&[2; 32]), &[2; 32], None, overlap),
        "a renewal at once"
    );
    assert!(!may_serve(Some(&[1; 32]), &[2; 32], None, overlap));
    assert!(!may_serve(Some(&[1; 32]), &[2; 32], short, overlap));
    assert!(may_serve(Some(&[1; 32]), &[2; 32], long, overlap));
}

// The model: one Secret written with optimistic concurrency, targets that trust what the
// injection last wrote to each (one at a time, in any order), replicas that load a leaf only
// through `may_serve`, whenever they get to it, and time that moves on only once every target
// and replica has caught up (what the overlap assumes). Invariant: every target trusts the CA
// of every leaf any replica serves, at every moment (no admission fails).

/// The model's Secret: its version and what it holds, with the signer of each leaf.
#[derive(Debug, Clone)]
struct World {
    version: u32,
    stored: Option<Stored>,
    leaf_signer: Fingerprint,
    targets: Vec<Vec<Facts>>,
    /// Per replica: the Secret version it loaded last and the signer of the leaf it serves.
    replicas: Vec<(u32, Option<Fingerprint>)>,
    now: Timestamp,
    next_id: u8,
}

#[derive(Debug, Clone)]
enum Move {
    /// A replica decides and writes.
    Decide,
    /// A replica loads the Secret's leaf (through the gate).
    Load { replica: usize },
    /// One target gets the Secret's bundle.
    Inject { target: usize },
    /// Time moves on by this many seconds.
    Tick(i64),
    /// A rotation by hand.
    Ask(Request),
}

fn moves() -> impl Strategy<Value = Move> {
    prop_oneof![
        4 => Just(Move::Decide),
        4 => (0..3usize).prop_map(|replica| Move::Load { replica }),
        4 => (0..3usize).prop_map(|target| Move::Inject { target }),
        3 => prop_oneof![Just(1i64), Just(300), Just(900), Just(20 * DAY)].prop_map(Move::Tick),
        1 => prop_oneof![Just(Request::Ca), Just(Request::Leaf)].prop_map(Move::Ask),
    ]
}

impl World {
    fn new() -> Self {
        World {
            version: 0,
            stored: None,
            leaf_signer: [0; 32],
            targets: vec![vec![]; 3],
            replicas: vec![(0, None); 3],
            now: t(0),
            next_id: 1,
        }
    }

    fn fresh(&mut self, valid: SignedDuration) -> Facts {
        self.next_id = self.next_id.wrapping_add(1).max(1);
        cert(self.next_id, self.now.saturating_add(valid).unwrap())
    }

    fn views(&self) -> Vec<Target> {
        self.targets
            .iter()
            .map(|c| Target::Trusts(c.clone()))
            .collect()
    }

    fn apply(&mut self, step: Step, policy: &Policy) {
        let now = self.now;
        let leaf = |world: &mut World, ca: &Facts| {
            let mut leaf = world.fresh(policy.leaf_validity);
            leaf.not_after = leaf.not_after.min(ca.not_after);
            leaf
        };
        match step {
            Step::Bootstrap { adopt } => {
                let ca = self.fresh(policy.ca_validity);
                let mut bundle = vec![ca.clone()];
                for fp in adopt {
                    let known = self.targets.iter().flatten().find(|c| c.fingerprint == fp);
                    bundle.push(known.unwrap().clone());
                }
                let leaf = leaf(self, &ca);
                self.leaf_signer = ca.fingerprint;
                self.stored = Some(Stored {
                    ca,
                    next: None,
                    bundle,
                    leaf,
                    leaf_fits: true,
                    published_at: None,
                    switched_at: Some(now),
                    request: None,
                });
            }
            Step::RenewLeaf => {
                let mut s = self.stored.clone().unwrap();
                s.leaf = leaf(self, &s.ca);
                s.request = None;
                self.leaf_signer = s.ca.fingerprint;
                self.stored = Some(s);
            }
            Step::Publish => {
                let next = self.fresh(policy.ca_validity);
                let s = self.stored.as_mut().unwrap();
                s.bundle.push(next.clone());
                s.next = Some(next);
                s.published_at = Some(now);
                s.request = None;
            }
            Step::Switch => {
                let mut s = self.stored.clone().unwrap();
                s.ca = s.next.take().unwrap();
                s.leaf = leaf(self, &s.ca);
                s.switched_at = Some(now);
                s.published_at = None;
                s.request = None;
                self.leaf_signer = s.ca.fingerprint;
                self.stored = Some(s);
            }
            Step::Rebundle { keep } => {
                let s = self.stored.as_mut().unwrap();
                let mut bundle: Vec<Facts> = keep
                    .iter()
                    .filter_map(|fp| s.bundle.iter().find(|c| &c.fingerprint == fp).cloned())
                    .collect();
                if !bundle.iter().any(|c| c.fingerprint == s.ca.fingerprint) {
                    bundle.push(s.ca.clone());
                }
                s.bundle = bundle;
            }
            Step::Stamp => {
                let s = self.stored.as_mut().unwrap();
                if s.next.is_some() {
                    s.published_at.get_or_insert(now);
                }
                s.switched_at.get_or_insert(now);
            }
            Step::Wait { .. } | Step::Refuse => return,
        }
        self.version += 1;
    }

    fn check(&self) -> Result<(), TestCaseError> {
        for (i, (_, serving)) in self.replicas.iter().enumerate() {
            if let Some(signer) = serving {
                for (j, target) in self.targets.iter().enumerate() {
                    // A target that was never injected calls no one yet (a fresh install).
                    if target.is_empty() {
                        continue;
                    }
                    prop_assert!(
                        target.iter().any(|c| &c.fingerprint == signer),
                        "replica {i} serves a leaf of {:?} that target {j} does not trust: {self:?}",
                        signer[0]
                    );
                }
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn no_replica_ever_serves_a_leaf_a_target_does_not_trust(
        moves in prop::collection::vec(moves(), 1..200)
    ) {
        let policy = policy();
        let mut world = World::new();
        for m in moves {
            match m {
                Move::Decide => {
                    // Writes are serialised by the Secret's resourceVersion: a replica that read
                    // an older one loses, reads again and decides on the latest.
                    let found = match &world.stored {
                        None => Found::Missing,
                        Some(s) => Found::Stored(s.clone()),
                    };
                    let step = next_step(&found, &world.views(), &policy, world.now);
                    world.apply(step, &policy);
                }
                Move::Load { replica } => {
                    if world.stored.is_some() {
                        let serving = world.replicas[replica].1;
                        let signer = world.leaf_signer;
                        // Trusted for an overlap: the model's views do not lag.
                        let trusted = trusted_everywhere(&world.views(), &signer)
                            .then_some(policy.overlap);
                        if may_serve(serving.as_ref(), &signer, trusted, policy.overlap) {
                            world.replicas[replica] = (world.version, Some(signer));
                        }
                    }
                }
                Move::Inject { target } => {
                    if let Some(s) = &world.stored {
                        world.targets[target] = s.bundle.clone();
                    }
                }
                Move::Tick(secs) => {
                    // Within an overlap every replica has loaded what it may, and every
                    // target has its bundle: time moves on only once they have.
                    if let Some(s) = world.stored.clone() {
                        for target in world.targets.iter_mut() {
                            *target = s.bundle.clone();
                        }
                        let signer = world.leaf_signer;
                        let trusted = trusted_everywhere(&world.views(), &signer)
                            .then_some(policy.overlap);
                        for r in world.replicas.iter_mut() {
                            if may_serve(r.1.as_ref(), &signer, trusted, policy.overlap) {
                                *r = (world.version, Some(signer));
                            }
                        }
                    }
                    world.check()?;
                    world.now = world.now.saturating_add(SignedDuration::from_secs(secs)).unwrap();
                }
                Move::Ask(request) => {
                    if let Some(s) = world.stored.as_mut() {
                        s.request = Some(request);
                        world.version += 1;
                    }
                }
            }
            world.check()?;
        }
    }
}
