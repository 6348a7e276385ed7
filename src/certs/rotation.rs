//! The one step the webhook certificates need now (pure): from what the Secret holds, what the
//! webhook configurations and the CRD trust, the policy and the time. Never a leaf whose CA a
//! target may not trust yet, never a CA dropped while a replica may still serve a leaf it signed.
//! See docs/src/operating/admission-webhooks.md, "Certificates the operator keeps".

use jiff::{SignedDuration, Timestamp};

/// A certificate's SHA-256 (of its DER): what tells two certificates apart.
pub type Fingerprint = [u8; 32];

/// A certificate, as the decisions see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    pub fingerprint: Fingerprint,
    pub not_after: Timestamp,
}

/// How long certificates live and when they are replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub ca_validity: SignedDuration,
    /// A CA is replaced this long before it expires.
    pub ca_renew_before: SignedDuration,
    pub leaf_validity: SignedDuration,
    /// A leaf is replaced this long before it expires.
    pub leaf_renew_before: SignedDuration,
    /// How long a new CA is trusted before a leaf it signed is served, and how long a replica
    /// waits to serve a leaf whose CA it saw trusted; the CA a switch replaced stays trusted for
    /// twice as long. Longer than any API server or replica takes to see a write.
    pub overlap: SignedDuration,
}

impl Default for Policy {
    /// CA 10 years renewed 1 year before its end; leaf 1 year renewed 60 days before; 10 minutes
    /// of overlap.
    fn default() -> Self {
        Policy {
            ca_validity: SignedDuration::from_hours(24 * 3650),
            ca_renew_before: SignedDuration::from_hours(24 * 365),
            leaf_validity: SignedDuration::from_hours(24 * 365),
            leaf_renew_before: SignedDuration::from_hours(24 * 60),
            overlap: SignedDuration::from_mins(10),
        }
    }
}

/// A rotation asked for by hand (the Secret's `rotate` annotation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// A new CA (and then a new leaf), through the whole overlap.
    Ca,
    /// A new leaf from the current CA.
    Leaf,
}

/// What the certificates' Secret holds, read and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The CA that signs leaves.
    pub ca: Facts,
    /// A CA published into the bundle, not signing yet.
    pub next: Option<Facts>,
    /// The CAs the targets are to trust.
    pub bundle: Vec<Facts>,
    pub leaf: Facts,
    /// Whether the leaf is signed by `ca` and names every name the Service needs.
    pub leaf_fits: bool,
    /// When `next` entered the bundle.
    pub published_at: Option<Timestamp>,
    /// When `ca` started signing (the CAs before it stay in the bundle for two overlaps).
    pub switched_at: Option<Timestamp>,
    pub request: Option<Request>,
}

/// The Secret as found (one per look: its size does not matter).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Missing,
    /// Not labelled as cnat's: never written.
    Foreign,
    /// cnat's, but without a usable CA, leaf or bundle: made anew.
    Broken,
    Stored(Stored),
}

/// What one target (a webhook configuration, the CRD's conversion) trusts now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Missing, or calling another server: nothing to wait for.
    Ignored,
    /// The certificates of its `caBundle` (for a configuration, those every webhook has).
    Trusts(Vec<Facts>),
}

impl Target {
    fn trusts(&self, fingerprint: &Fingerprint) -> bool {
        match self {
            Target::Ignored => true,
            Target::Trusts(certs) => certs.iter().any(|c| &c.fingerprint == fingerprint),
        }
    }
}

/// The one write to make now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A new CA and leaf; the bundle keeps `adopt` too, CAs the targets trust today (a Secret
    /// deleted by hand, certificates from the chart): leaves served now stay trusted.
    Bootstrap { adopt: Vec<Fingerprint> },
    /// A new leaf from the current CA.
    RenewLeaf,
    /// A new CA into the bundle; it signs nothing yet.
    Publish,
    /// The published CA signs a new leaf; the CA before it stays in the bundle.
    Switch,
    /// The bundle becomes `keep` (CAs past their overlap or expired dropped; the current CA
    /// added if a hand edit removed it).
    Rebundle { keep: Vec<Fingerprint> },
    /// A time a later step counts from is missing (a hand edit): it is written as now.
    Stamp,
    /// Nothing to write; look again at `until` (`None`: when something changes).
    Wait { until: Option<Timestamp> },
    /// The Secret is someone else's: nothing is written (said where users look).
    Refuse,
}

/// Whether every target trusts `fingerprint`.
pub fn trusted_everywhere(targets: &[Target], fingerprint: &Fingerprint) -> bool {
    targets.iter().all(|t| t.trusts(fingerprint))
}

/// The one step the certificates need at `now`.
pub fn next_step(found: &Found, targets: &[Target], policy: &Policy, now: Timestamp) -> Step {
    let stored = match found {
        Found::Foreign => return Step::Refuse,
        Found::Missing | Found::Broken => {
            let mut adopt: Vec<Fingerprint> = Vec::new();
            for target in targets {
                if let Target::Trusts(certs) = target {
                    for cert in certs.iter().filter(|c| c.not_after > now) {
                        if !adopt.contains(&cert.fingerprint) {
                            adopt.push(cert.fingerprint);
                        }
                    }
                }
            }
            return Step::Bootstrap { adopt };
        }
        Found::Stored(stored) => stored,
    };
    let next_fingerprint = stored.next.as_ref().map(|n| n.fingerprint);
    let others = stored
        .bundle
        .iter()
        .any(|c| c.fingerprint != stored.ca.fingerprint && Some(c.fingerprint) != next_fingerprint);
    if (stored.next.is_some() && stored.published_at.is_none())
        || (others && stored.switched_at.is_none())
    {
        return Step::Stamp;
    }
    let leaf_due = renewal(&stored.leaf, policy.leaf_renew_before);
    let leaf_needed = stored.request == Some(Request::Leaf) || !stored.leaf_fits || now >= leaf_due;
    if let (Some(next), Some(published)) = (&stored.next, stored.published_at) {
        // A leaf that must change now is renewed from the current CA, whatever the rotation
        // waits for; one merely due waits for the switch (a leaf is never valid past its CA,
        // so near the CA's end a renewed one would be due again at once).
        let broken = stored.request == Some(Request::Leaf)
            || !stored.leaf_fits
            || (now >= stored.leaf.not_after && now < stored.ca.not_after);
        if broken {
            return Step::RenewLeaf;
        }
        let dwell_ends = published
            .saturating_add(policy.overlap)
            .unwrap_or(published);
        let expiry = (stored.leaf.not_after > now).then_some(stored.leaf.not_after);
        return if now < dwell_ends {
            Step::Wait {
                until: Some(expiry.map_or(dwell_ends, |e| e.min(dwell_ends))),
            }
        } else if trusted_everywhere(targets, &next.fingerprint) {
            Step::Switch
        } else {
            // The injection makes every target trust it; its write wakes this up.
            Step::Wait { until: expiry }
        };
    }
    let ca_due = renewal(&stored.ca, policy.ca_renew_before);
    if stored.request == Some(Request::Ca) || now >= ca_due {
        return Step::Publish;
    }
    if leaf_needed {
        return Step::RenewLeaf;
    }
    // Replicas serve the new leaf up to an overlap after they saw its CA trusted (which may be
    // the switch itself): the CAs before it stay for two.
    let retire_at = stored
        .switched_at
        .map(|at| at.saturating_add(policy.overlap * 2).unwrap_or(at));
    let keep: Vec<Fingerprint> = std::iter::once(stored.ca.fingerprint)
        .chain(
            stored
                .bundle
                .iter()
                .filter(|c| c.fingerprint != stored.ca.fingerprint)
                .filter(|c| c.not_after > now && retire_at.is_some_and(|at| now < at))
                .map(|c| c.fingerprint),
        )
        .collect();
    let bundle: Vec<Fingerprint> = stored.bundle.iter().map(|c| c.fingerprint).collect();
    if !same_set(&keep, &bundle) {
        return Step::Rebundle { keep };
    }
    let mut until = ca_due.min(leaf_due);
    for cert in stored
        .bundle
        .iter()
        .filter(|c| c.fingerprint != stored.ca.fingerprint)
    {
        until = until.min(cert.not_after);
        if let Some(at) = retire_at {
            until = until.min(at);
        }
    }
    Step::Wait { until: Some(until) }
}

/// When `cert` is due for renewal.
fn renewal(cert: &Facts, before: SignedDuration) -> Timestamp {
    cert.not_after
        .saturating_sub(before)
        .unwrap_or(cert.not_after)
}

/// Whether `a` and `b` hold the same fingerprints, in any order.
pub fn same_set(a: &[Fingerprint], b: &[Fingerprint]) -> bool {
    a.iter().all(|x| b.contains(x)) && b.iter().all(|x| a.contains(x))
}

/// Whether a replica that serves a leaf of the CA `serving` (none yet: `None`) may serve one
/// signed by `signer`: at once when it serves nothing or a leaf of the same CA; else only once
/// every target has trusted `signer` for an overlap (`trusted_for`: how long this replica has
/// seen them so), so that a Secret written ahead of the injection is never served early, and
/// API servers that see the targets late trust it too.
pub fn may_serve(
    serving: Option<&Fingerprint>,
    signer: &Fingerprint,
    trusted_for: Option<SignedDuration>,
    overlap: SignedDuration,
) -> bool {
    match serving {
        None => true,
        Some(ca) if ca == signer => true,
        Some(_) => trusted_for.is_some_and(|d| d >= overlap),
    }
}

#[cfg(test)]
mod tests;
