use super::*;
use k8s_openapi::api::coordination::v1::LeaseSpec;
use std::collections::BTreeMap;

const LEASE: Duration = Duration::from_secs(15);

fn lease(name: &str, holder: Option<&str>) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: holder.map(Into::into),
            ..LeaseSpec::default()
        }),
    }
}

fn member(identity: &str, shards: Option<usize>) -> Lease {
    let mut lease = lease(&lease_name("cnat", identity), Some(identity));
    lease.metadata.labels = Some(BTreeMap::from([(LABEL.into(), "cnat".into())]));
    lease.metadata.annotations =
        shards.map(|n| BTreeMap::from([(SHARDS_ANNOTATION.into(), n.to_string())]));
    lease
}

#[test]
fn a_lease_is_live_while_it_changes_and_forgotten_long_after() {
    let t0 = Instant::now();
    let mut observed = Observed::default();
    observed.observe([("a", "1"), ("b", "7")], t0);
    assert!(observed.live("a", t0, LEASE) && observed.live("b", t0, LEASE));
    // b renews, a does not.
    let t1 = t0 + Duration::from_secs(10);
    observed.observe([("a", "1"), ("b", "8")], t1);
    let t2 = t0 + LEASE;
    observed.observe([("a", "1"), ("b", "8")], t2);
    assert!(!observed.live("a", t2, LEASE));
    assert!(observed.live("b", t2, LEASE));
    assert!(observed.forgotten(["a", "b"], t2, LEASE).is_empty());
    let t3 = t0 + LEASE * FORGET_AFTER;
    assert_eq!(
        observed.forgotten(["a", "b"], t3, LEASE),
        vec![("a".to_owned(), "1".to_owned())]
    );
    // Only the names asked about.
    assert!(observed.forgotten(["b"], t3, LEASE).is_empty());
    // a comes back (a new version): live again, not forgotten.
    observed.observe([("a", "2"), ("b", "9")], t3);
    assert!(observed.live("a", t3, LEASE));
    assert!(observed.forgotten(["a"], t3, LEASE).is_empty());
    // Deleted: gone at once.
    observed.observe([("b", "9")], t3);
    assert!(!observed.live("a", t3, LEASE));
}

#[test]
fn lease_names_are_valid_and_each_lease_has_one_role() {
    for identity in ["cnat-7d9f-abcde", "Host_Name:1234", "", "ü"] {
        let name = lease_name("cnat", identity);
        assert!(name.starts_with("cnat-member-"), "{name}");
        assert_eq!(name.len(), "cnat-member-".len() + 16);
        assert!(name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'));
    }
    assert_ne!(lease_name("cnat", "a"), lease_name("cnat", "b"));
    assert_eq!(shard_lease_name("cnat", 2, 6), "cnat-2-of-6");
    for (name, expected) in [
        ("cnat", Role::Single),
        ("cnat-2-of-6", Role::Shard { index: 2, count: 6 }),
        ("cnat-0-of-1", Role::Shard { index: 0, count: 1 }),
        ("cnat-6-of-6", Role::Other),
        ("cnat-02-of-6", Role::Other),
        ("cnat-2-of-06", Role::Other),
        ("cnat-x-of-6", Role::Other),
        ("cnat-2", Role::Other),
        ("other", Role::Other),
        ("other-2-of-6", Role::Other),
        ("cnatx-2-of-6", Role::Other),
    ] {
        assert_eq!(role("cnat", &lease(name, None)), expected, "{name}");
    }
    assert_eq!(
        role("cnat", &member("a", Some(6))),
        Role::Member { shards: Some(6) }
    );
    assert_eq!(
        role("cnat", &member("a", None)),
        Role::Member { shards: None }
    );
    // A membership Lease of another election is not this one's.
    assert_eq!(role("other", &member("a", Some(6))), Role::Other);
}

#[test]
fn the_view_counts_live_members_of_this_layout_their_shards_and_free_ones() {
    let leases = [
        member("me", Some(6)),
        member("b", Some(6)),
        member("c", Some(6)),
        member("dead", Some(6)),
        member("older", Some(3)),
        lease("cnat-0-of-6", Some("me")),
        lease("cnat-1-of-6", Some("b")),
        lease("cnat-2-of-6", Some("b")),
        lease("cnat-3-of-6", Some("dead")),
        lease("cnat-4-of-6", None),
        lease("someone-else", Some("x")),
    ];
    let dead = lease_name("cnat", "dead");
    let live = |name: &str| name != dead && name != "cnat-3-of-6";
    let seen = view("cnat", 6, "me", &leases, live);
    assert_eq!(
        seen,
        View {
            // me, b, c (dead is still, older is of another layout and leads nothing).
            replicas: 3,
            fewest_of_others: Some(0),
            // b leads most.
            first_to_give: false,
            // 3 (expired), 4 (released), 5 (missing).
            free: 3,
            another_layout_leads: false,
            outranked: false,
        }
    );
}

#[test]
fn a_held_lease_of_another_layout_leads_a_released_or_expired_one_does_not() {
    // (the other Lease, its holder, live, another layout leads, it outranks 6 shards)
    for (other, holder, live, leads, outranks) in [
        ("cnat", Some("old"), true, true, true),
        ("cnat", Some("old"), false, false, false),
        ("cnat", None, true, false, false),
        ("cnat", Some(""), true, false, false),
        ("cnat-1-of-3", Some("old"), true, true, false),
        ("cnat-1-of-12", Some("new"), true, true, true),
        ("cnat-1-of-12", Some("new"), false, false, false),
        ("cnat-1-of-6", Some("me"), true, false, false),
        ("other", Some("old"), true, false, false),
    ] {
        let leases = [member("me", Some(6)), lease(other, holder)];
        let seen = view("cnat", 6, "me", &leases, |_| live);
        assert_eq!(
            (seen.another_layout_leads, seen.outranked),
            (leads, outranks),
            "{other} {holder:?} {live}"
        );
    }
    // Alone and nothing seen: one replica, every shard free.
    assert_eq!(
        view("cnat", 4, "me", &[], |_| true),
        View {
            replicas: 1,
            fewest_of_others: None,
            first_to_give: true,
            free: 4,
            another_layout_leads: false,
            outranked: false,
        }
    );
}

#[test]
fn after_a_gap_every_lease_counts_as_seen_afresh() {
    let t0 = Instant::now();
    let mut observed = Observed::default();
    observed.observe([("a", "1")], t0);
    // An outage: no list for a long while; a's Lease was renewed meanwhile, or not.
    let t1 = t0 + LEASE * 5;
    observed.seen_again(t1);
    observed.observe([("a", "1")], t1);
    assert!(observed.live("a", t1, LEASE));
    assert!(observed.forgotten(["a"], t1, LEASE).is_empty());
}

#[test]
fn of_the_replicas_leading_most_the_first_by_identity_gives_up() {
    let leases = |a: usize, b: usize| {
        let mut leases = vec![member("a", Some(4)), member("b", Some(4))];
        for shard in 0..a {
            leases.push(lease(&shard_lease_name("cnat", shard, 4), Some("a")));
        }
        for shard in a..a + b {
            leases.push(lease(&shard_lease_name("cnat", shard, 4), Some("b")));
        }
        leases
    };
    let first =
        |me: &str, a: usize, b: usize| view("cnat", 4, me, &leases(a, b), |_| true).first_to_give;
    assert!(first("a", 2, 2) && !first("b", 2, 2));
    assert!(!first("a", 1, 3) && first("b", 1, 3));
    assert!(first("a", 3, 1) && !first("b", 3, 1));
}
