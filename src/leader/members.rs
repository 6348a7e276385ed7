//! Who competes for the Lease shards: each replica renews a membership Lease and lists the
//! namespace's Leases every retry period; a Lease is live while its resourceVersion changes
//! within a lease duration, on our own clock.
//! See docs/src/operating/high-availability.md, "Lease shards".

use super::balance::{Balance, View};
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
use tracing::{info, warn};

/// The label that names the election a membership Lease is of (its value: `--lease-name`).
pub const LABEL: &str = "cnat.programming-kubernetes.info/member-of";

/// The annotation of a membership Lease that says how many shards its replica splits the Ats
/// into.
pub const SHARDS_ANNOTATION: &str = "cnat.programming-kubernetes.info/shards";

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

/// The Lease of shard `index` of `count` in the election `election`: `ELECTION-INDEX-of-COUNT`,
/// so replicas of different `--shards` never compete for the same Lease.
pub fn shard_lease_name(election: &str, index: usize, count: usize) -> String {
    format!("{election}-{index}-of-{count}")
}

/// What a Lease of the namespace is to the election `election`. Pure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// The one Lease (`--shards 1`).
    Single,
    /// Shard `index` of `count`.
    Shard { index: usize, count: usize },
    /// A replica's membership Lease, of a replica splitting the Ats into `shards`.
    Member { shards: Option<usize> },
    /// Not the election's.
    Other,
}

/// What `lease` is to the election `election`.
pub fn role(election: &str, lease: &Lease) -> Role {
    let name = lease.metadata.name.as_deref().unwrap_or_default();
    let labels = lease.metadata.labels.as_ref();
    if labels.and_then(|l| l.get(LABEL)).map(String::as_str) == Some(election) {
        let shards = lease
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(SHARDS_ANNOTATION))
            .and_then(|n| n.parse().ok());
        return Role::Member { shards };
    }
    if name == election {
        return Role::Single;
    }
    let shard = name
        .strip_prefix(election)
        .and_then(|rest| rest.strip_prefix('-'))
        .and_then(|rest| rest.split_once("-of-"))
        .and_then(|(index, count)| {
            let (index, count): (usize, usize) = (index.parse().ok()?, count.parse().ok()?);
            // Only names this module writes ("3", not "03").
            (name == shard_lease_name(election, index, count) && index < count)
                .then_some(Role::Shard { index, count })
        });
    shard.unwrap_or(Role::Other)
}

/// The election's Leases as this replica saw them: each one's version, and since when it has
/// had it. Pure.
#[derive(Debug, Default)]
pub struct Observed {
    seen: HashMap<String, (String, Instant)>,
}

impl Observed {
    /// Takes in a list of the Leases (name and resourceVersion) at `now`; those not in it are
    /// gone.
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

    /// Counts every Lease as changed at `now`: after a gap in the lists (an API server outage),
    /// a Lease still since before the gap may have been renewed unseen.
    pub fn seen_again(&mut self, now: Instant) {
        for (_, since) in self.seen.values_mut() {
            *since = now;
        }
    }

    /// Whether the Lease `name` changed within `lease_duration` of `now`.
    pub fn live(&self, name: &str, now: Instant, lease_duration: Duration) -> bool {
        self.seen
            .get(name)
            .is_some_and(|(_, since)| now.saturating_duration_since(*since) < lease_duration)
    }

    /// The Leases among `names` still for `FORGET_AFTER` lease durations: name and the version
    /// to delete.
    pub fn forgotten<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
        now: Instant,
        lease_duration: Duration,
    ) -> Vec<(String, String)> {
        names
            .into_iter()
            .filter_map(|name| {
                let (version, since) = self.seen.get(name)?;
                let still = now.saturating_duration_since(*since) >= lease_duration * FORGET_AFTER;
                still.then(|| (name.to_owned(), version.clone()))
            })
            .collect()
    }
}

/// What the Leases of the namespace say to replica `me` of the election `election` splitting
/// the Ats into `shards`, its Leases observed live or not in `observed`. Pure.
pub fn view(
    election: &str,
    shards: usize,
    me: &str,
    leases: &[Lease],
    live: impl Fn(&str) -> bool,
) -> View {
    let held_by = |lease: &Lease| {
        let name = lease.metadata.name.as_deref().unwrap_or_default();
        let holder = lease.spec.as_ref()?.holder_identity.as_deref()?;
        (!holder.is_empty() && live(name)).then_some(holder.to_owned())
    };
    let mut members: HashMap<String, usize> = HashMap::from([(me.to_owned(), 0)]);
    let mut held: Vec<String> = Vec::new();
    let (mut another_layout_leads, mut outranked) = (false, false);
    for lease in leases {
        let name = lease.metadata.name.as_deref().unwrap_or_default();
        match role(election, lease) {
            Role::Member { shards: Some(n) } if n == shards && live(name) => {
                let holder = lease.spec.as_ref().and_then(|s| s.holder_identity.clone());
                members.entry(holder.unwrap_or_default()).or_default();
            }
            Role::Shard { count, .. } if count == shards => held.extend(held_by(lease)),
            // The one Lease outranks shards; more shards outrank fewer.
            Role::Single | Role::Shard { .. } if held_by(lease).is_some() => {
                another_layout_leads = true;
                outranked |= match role(election, lease) {
                    Role::Shard { count, .. } => count > shards,
                    _ => true,
                };
            }
            Role::Single | Role::Shard { .. } | Role::Member { .. } | Role::Other => {}
        }
    }
    for holder in &held {
        if let Some(count) = members.get_mut(holder) {
            *count += 1;
        }
    }
    let others: Vec<usize> = members
        .iter()
        .filter(|(id, _)| id.as_str() != me)
        .map(|(_, n)| *n)
        .collect();
    // Of the replicas leading most, the first by identity (`me` included).
    let first_to_give = members
        .iter()
        .max_by(|(a, n), (b, m)| n.cmp(m).then_with(|| b.cmp(a)))
        .is_none_or(|(id, _)| id.as_str() == me);
    View {
        replicas: members.len(),
        fewest_of_others: others.iter().min().copied(),
        first_to_give,
        free: shards.saturating_sub(held.len()),
        another_layout_leads,
        outranked,
    }
}

/// This replica's membership Lease, holding `identity`, renewed at `wall`.
fn membership(settings: &Settings, name: &str, shards: usize, wall: jiff::Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(settings.namespace.clone()),
            labels: Some([(LABEL.to_owned(), settings.lease_name.clone())].into()),
            annotations: Some([(SHARDS_ANNOTATION.to_owned(), shards.to_string())].into()),
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

/// Renews this replica's membership Lease and tells `balance` what the election's Leases say,
/// every retry period until `shutdown`; then deletes it and only looks on until `over`.
/// `settings` names the election (`lease_name`), not a shard.
pub async fn run(
    client: Client,
    settings: Settings,
    shards: usize,
    balance: Arc<Balance>,
    shutdown: CancellationToken,
    over: CancellationToken,
) {
    let api: Api<Lease> = Api::namespaced(client, &settings.namespace);
    let timing = settings.timing;
    let election = settings.lease_name.as_str();
    let name = lease_name(election, &settings.identity);
    let apply = PatchParams::apply("cnat").force();
    let mut observed = Observed::default();
    let mut failing = false;
    let mut listed_at: Option<Instant> = None;
    let mut looked_at: Option<Instant> = None;
    let mut tick = interval(timing.retry_period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut left = false;
    let every = ListParams::default();
    info!(lease = %name, shards, "a member of the shards' election");
    loop {
        tokio::select! {
            _ = over.cancelled() => break,
            _ = shutdown.cancelled(), if !left => {
                leave(&api, &name, timing.retry_period).await;
                left = true;
            }
            _ = tick.tick() => {}
            // An election refused a free shard: look again now, not a retry period on, at most
            // four times a retry period.
            _ = async {
                balance.look_asked().await;
                if let Some(at) = looked_at {
                    tokio::time::sleep_until(at + timing.retry_period / 4).await;
                }
            } => {}
        }
        let sent = Instant::now();
        looked_at = Some(sent);
        // Gone from the election: only looking.
        let renewed = match left {
            true => Ok(()),
            false => {
                let lease = membership(&settings, &name, shards, settings.clock.now());
                within(
                    timing.retry_period,
                    api.patch(&name, &apply, &Patch::Apply(&lease)),
                )
                .await
                .map(drop)
            }
        };
        let listed = match renewed {
            // Once gone from the election, a list in flight does not hold up the shutdown.
            Ok(_) => tokio::select! {
                listed = within(timing.retry_period, api.list(&every)) => listed,
                _ = over.cancelled(), if left => break,
            },
            Err(error) => Err(error),
        };
        let leases = match listed {
            Ok(list) => list.items,
            Err(error) => {
                if !failing {
                    warn!(lease = %name, %error, "cannot renew the membership Lease or list the Leases; the share of shards stays as last counted");
                    failing = true;
                }
                continue;
            }
        };
        if failing {
            info!(lease = %name, "renewing the membership Lease and listing the Leases again");
            failing = false;
        }
        let now = Instant::now();
        // After a gap (an outage), unseen is not still: judge afresh, or a replica back first
        // would find every other one dead.
        if listed_at.is_some_and(|at| now.saturating_duration_since(at) > timing.retry_period * 2) {
            observed.seen_again(now);
        }
        listed_at = Some(now);
        let mine = |lease: &&Lease| role(election, lease) != Role::Other;
        observed.observe(
            leases.iter().filter(mine).map(|lease| {
                let meta = &lease.metadata;
                let name = meta.name.as_deref().unwrap_or_default();
                (name, meta.resource_version.as_deref().unwrap_or_default())
            }),
            now,
        );
        let live = |name: &str| observed.live(name, now, timing.lease_duration);
        let seen = view(election, shards, &settings.identity, &leases, live);
        let last = balance.view();
        if seen.replicas != last.replicas || seen.another_layout_leads != last.another_layout_leads
        {
            info!(
                replicas = seen.replicas,
                another_layout_leads = seen.another_layout_leads,
                outranked = seen.outranked,
                "the shards' election changed"
            );
        }
        balance.set_view(seen, sent);
        let members = leases.iter().filter_map(|lease| {
            let is_member = matches!(role(election, lease), Role::Member { .. });
            is_member.then_some(lease.metadata.name.as_deref()?)
        });
        if left {
            continue;
        }
        for (gone, version) in observed.forgotten(members, now, timing.lease_duration) {
            forget(&api, &gone, version, timing.retry_period).await;
        }
    }
    if !left {
        leave(&api, &name, timing.retry_period).await;
    }
}

/// Deletes this replica's membership Lease: the others count it gone at once.
async fn leave(api: &Api<Lease>, name: &str, limit: Duration) {
    match within(limit, api.delete(name, &DeleteParams::default())).await {
        Ok(_) => info!(lease = %name, "left the shards' election"),
        Err(error) => {
            warn!(lease = %name, %error, "could not delete the membership Lease; the others forget it")
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
        Err(error) => warn!(lease = %name, %error, "could not delete a dead member's Lease"),
    }
}

#[cfg(test)]
mod tests;
