//! Who competes for the Lease shards (`cnat run --shards N`): each replica holds a Lease of its
//! own, named for it and labelled with the election's name, and renews it every retry period;
//! every replica lists them to count the live replicas, which sets its share of shards
//! (`balance`).
//!
//! A member is live while its Lease changed (its resourceVersion) within a lease duration of this
//! replica's own clock, as the election judges the shards' Leases: clock skew between nodes
//! does not matter. A replica that shuts down deletes its own; one that died is counted until
//! its Lease stops changing for a lease duration, and the Lease is deleted (with its version as
//! a precondition) once it has been still for `FORGET_AFTER` lease durations.

use super::balance::Balance;
use super::store::{within, LeaseError};
use super::Settings;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::{Api, Client};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{interval, Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// The label that names the election a membership Lease is of (its value: `--lease-name`).
pub const LABEL: &str = "cnat.programming-kubernetes.info/member-of";

/// Lease durations a member's Lease stays still before it is deleted.
const FORGET_AFTER: u32 = 4;

/// The membership Lease of `identity` in the election `election`: `ELECTION-member-HASH`, the
/// hash of the identity (which may hold characters no name can).
pub fn lease_name(election: &str, identity: &str) -> String {
    format!(
        "{election}-member-{:016x}",
        xxhash_rust::xxh3::xxh3_64(identity.as_bytes())
    )
}

/// The label selector of the election's membership Leases.
pub fn selector(election: &str) -> String {
    format!("{LABEL}={election}")
}

/// The membership Leases as this replica saw them: each one's version, and since when it has
/// had it. Pure.
#[derive(Debug, Default)]
pub struct Members {
    seen: HashMap<String, (String, Instant)>,
}

impl Members {
    /// Takes in a list of every membership Lease (name and resourceVersion) at `now`; those not
    /// in it are gone.
    pub fn observe<'a>(
        &mut self,
        leases: impl IntoIterator<Item = (&'a str, &'a str)>,
        now: Instant,
    ) {
        let mut seen = HashMap::new();
        for (name, version) in leases {
            let since = match self.seen.get(name) {
                Some((known, since)) if known == version => *since,
                _ => now,
            };
            seen.insert(name.to_owned(), (version.to_owned(), since));
        }
        self.seen = seen;
    }

    /// The members whose Lease changed within `lease_duration` of `now`.
    pub fn live(&self, now: Instant, lease_duration: Duration) -> usize {
        self.seen
            .values()
            .filter(|(_, since)| now.saturating_duration_since(*since) < lease_duration)
            .count()
    }

    /// The Leases still for `FORGET_AFTER` lease durations: name and the version to delete.
    pub fn forgotten(&self, now: Instant, lease_duration: Duration) -> Vec<(String, String)> {
        self.seen
            .iter()
            .filter(|(_, (_, since))| {
                now.saturating_duration_since(*since) >= lease_duration * FORGET_AFTER
            })
            .map(|(name, (version, _))| (name.clone(), version.clone()))
            .collect()
    }
}

/// This replica's membership Lease, holding `identity`, renewed at `wall`.
fn membership(settings: &Settings, name: &str, wall: jiff::Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(settings.namespace.clone()),
            labels: Some([(LABEL.to_owned(), settings.lease_name.clone())].into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(settings.identity.clone()),
            lease_duration_seconds: Some(settings.timing.lease_seconds()),
            renew_time: Some(MicroTime(wall)),
            ..LeaseSpec::default()
        }),
    }
}

/// Renews this replica's membership Lease and counts the live members into `balance`, every
/// retry period until `shutdown`; then deletes its Lease.
pub async fn run(
    client: Client,
    settings: Settings,
    balance: Arc<Balance>,
    shutdown: CancellationToken,
) {
    let api: Api<Lease> = Api::namespaced(client, &settings.namespace);
    let timing = settings.timing;
    let name = lease_name(&settings.lease_name, &settings.identity);
    let apply = PatchParams::apply("cnat").force();
    let mut members = Members::default();
    let mut failing = false;
    let mut tick = interval(timing.retry_period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    info!(lease = %name, "a member of the shards' election");
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        let lease = membership(&settings, &name, settings.clock.now());
        let renewed = within(
            timing.retry_period,
            api.patch(&name, &apply, &Patch::Apply(&lease)),
        )
        .await;
        let listed = match renewed {
            Ok(_) => {
                let params = ListParams::default().labels(&selector(&settings.lease_name));
                within(timing.retry_period, api.list(&params)).await
            }
            Err(error) => Err(error),
        };
        match listed {
            Ok(list) => {
                if failing {
                    info!(lease = %name, "counting the members again");
                    failing = false;
                }
                let now = Instant::now();
                members.observe(
                    list.items.iter().map(|lease| {
                        (
                            lease.metadata.name.as_deref().unwrap_or_default(),
                            lease
                                .metadata
                                .resource_version
                                .as_deref()
                                .unwrap_or_default(),
                        )
                    }),
                    now,
                );
                let live = members.live(now, timing.lease_duration).max(1);
                if live != balance.standing().replicas {
                    info!(replicas = live, "live members of the shards' election");
                }
                balance.set_replicas(live);
                for (gone, version) in members.forgotten(now, timing.lease_duration) {
                    forget(&api, &gone, version, timing.retry_period).await;
                }
            }
            Err(error) if !failing => {
                warn!(lease = %name, %error, "cannot renew or list the membership Leases; the share of shards stays as last counted");
                failing = true;
            }
            Err(_) => {}
        }
    }
    let deleted = within(
        timing.retry_period,
        api.delete(&name, &DeleteParams::default()),
    )
    .await;
    match deleted {
        Ok(_) => info!(lease = %name, "left the shards' election"),
        Err(error) => {
            debug!(lease = %name, %error, "could not delete the membership Lease; the others forget it")
        }
    }
}

/// Deletes a dead member's Lease, only at the version seen (a member back since keeps its own).
async fn forget(api: &Api<Lease>, name: &str, version: String, limit: Duration) {
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: Some(version),
            uid: None,
        }),
        ..DeleteParams::default()
    };
    match within(limit, api.delete(name, &params)).await {
        Ok(_) => info!(lease = %name, "deleted the membership Lease of a replica gone"),
        Err(LeaseError::Api(kube::Error::Api(status))) if matches!(status.code, 404 | 409) => {}
        Err(error) => debug!(lease = %name, %error, "could not delete a dead member's Lease"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(15);

    #[test]
    fn a_member_is_live_while_its_lease_changes_and_forgotten_long_after() {
        let t0 = Instant::now();
        let mut members = Members::default();
        members.observe([("a", "1"), ("b", "7")], t0);
        assert_eq!(members.live(t0, LEASE), 2);
        // b renews, a does not.
        let t1 = t0 + Duration::from_secs(10);
        members.observe([("a", "1"), ("b", "8")], t1);
        assert_eq!(members.live(t1, LEASE), 2);
        let t2 = t0 + LEASE;
        members.observe([("a", "1"), ("b", "8")], t2);
        assert_eq!(members.live(t2, LEASE), 1);
        assert!(members.forgotten(t2, LEASE).is_empty());
        let t3 = t0 + LEASE * FORGET_AFTER;
        assert_eq!(
            members.forgotten(t3, LEASE),
            vec![("a".to_owned(), "1".to_owned())]
        );
        // a comes back (a new version): live again, not forgotten.
        members.observe([("a", "2"), ("b", "9")], t3);
        assert_eq!(members.live(t3, LEASE), 2);
        assert!(members.forgotten(t3, LEASE).is_empty());
        // Deleted: gone at once.
        members.observe([("b", "9")], t3);
        assert_eq!(members.live(t3, LEASE), 1);
    }

    #[test]
    fn membership_lease_names_are_valid_whatever_the_identity() {
        for identity in ["cnat-7d9f-abcde", "Host_Name:1234", "", "ü"] {
            let name = lease_name("cnat", identity);
            assert!(name.starts_with("cnat-member-"), "{name}");
            assert_eq!(name.len(), "cnat-member-".len() + 16);
            assert!(name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'));
        }
        assert_ne!(lease_name("cnat", "a"), lease_name("cnat", "b"));
    }
}
