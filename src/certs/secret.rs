//! The certificates' Secret: its keys and annotations read into what the decisions need, and
//! what it holds after each step (pure but for the keys a step makes).

use super::material::{self, MaterialError, Pair, Parsed};
use super::rotation::{Fingerprint, Found, Policy, Request, Step, Stored};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use std::collections::BTreeMap;

/// The label that marks the Secret as cnat's (any other Secret by that name is left alone).
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "cnat");
/// The annotation that asks for a rotation by hand: `ca` or `leaf`.
pub const ROTATE: &str = "cnat.programming-kubernetes.info/rotate";
const PUBLISHED_AT: &str = "cnat.programming-kubernetes.info/ca-published-at";
const SWITCHED_AT: &str = "cnat.programming-kubernetes.info/ca-switched-at";
/// The CA bundle the webhook configurations and the CRD are to trust.
pub const BUNDLE: &str = "ca-bundle.crt";

/// What the Secret holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contents {
    pub ca: Pair,
    pub next: Option<Pair>,
    pub bundle: Vec<Parsed>,
    pub leaf: Pair,
    pub published_at: Option<Timestamp>,
    pub switched_at: Option<Timestamp>,
    pub request: Option<Request>,
}

impl Contents {
    /// The bundle as one PEM text, in its order.
    pub fn bundle_pem(&self) -> String {
        self.bundle.iter().map(|c| c.pem.as_str()).collect()
    }

    /// What the decisions see of it: `names` are the names the leaf must carry.
    pub fn stored(&self, names: &[String]) -> Result<Stored, MaterialError> {
        let ca = first(&self.ca.cert, "ca.crt")?;
        let leaf = first(&self.leaf.cert, "tls.crt")?;
        let next = match &self.next {
            Some(next) => Some(first(&next.cert, "next-ca.crt")?.facts),
            None => None,
        };
        Ok(Stored {
            leaf_fits: material::fits(&leaf.der, &ca.der, names),
            ca: ca.facts,
            next,
            bundle: self.bundle.iter().map(|c| c.facts.clone()).collect(),
            leaf: leaf.facts,
            published_at: self.published_at,
            switched_at: self.switched_at,
            request: self.request,
        })
    }

    /// The fingerprint of the CA that signed the leaf.
    pub fn signer(&self) -> Result<Fingerprint, MaterialError> {
        Ok(first(&self.ca.cert, "ca.crt")?.facts.fingerprint)
    }
}

fn first(pem: &str, what: &'static str) -> Result<Parsed, MaterialError> {
    let mut all = material::read(pem.as_bytes(), what)?;
    Ok(all.swap_remove(0))
}

/// The Secret as the decisions see it, and its contents when it has usable ones.
pub fn found(secret: Option<&Secret>, names: &[String]) -> (Found, Option<Contents>) {
    let Some(secret) = secret else {
        return (Found::Missing, None);
    };
    let labels = secret.metadata.labels.as_ref();
    if labels.and_then(|l| l.get(MANAGED_BY.0)).map(String::as_str) != Some(MANAGED_BY.1) {
        return (Found::Foreign, None);
    }
    match decode(secret).and_then(|c| Ok((c.stored(names)?, c))) {
        Ok((stored, contents)) => (Found::Stored(stored), Some(contents)),
        Err(_) => (Found::Broken, None),
    }
}

/// The Secret's contents, or why they are not usable.
pub fn decode(secret: &Secret) -> Result<Contents, MaterialError> {
    let empty = BTreeMap::new();
    let data = secret.data.as_ref().unwrap_or(&empty);
    let text = |key: &'static str| -> Result<String, MaterialError> {
        let bytes = data.get(key).ok_or(MaterialError::NoCertificate(key))?;
        String::from_utf8(bytes.0.clone()).map_err(|e| MaterialError::Unreadable {
            what: key,
            why: e.to_string(),
        })
    };
    let pair = |cert, key| -> Result<Pair, MaterialError> {
        Ok(Pair {
            cert: text(cert)?,
            key: text(key)?,
        })
    };
    let next = if data.contains_key("next-ca.crt") {
        Some(pair("next-ca.crt", "next-ca.key")?)
    } else {
        None
    };
    let empty = BTreeMap::new();
    let annotations = secret.metadata.annotations.as_ref().unwrap_or(&empty);
    let at = |key: &str| {
        annotations
            .get(key)
            .and_then(|v| v.parse::<Timestamp>().ok())
    };
    let request = match annotations.get(ROTATE).map(String::as_str) {
        Some("ca") => Some(Request::Ca),
        Some("leaf") => Some(Request::Leaf),
        _ => None,
    };
    Ok(Contents {
        ca: pair("ca.crt", "ca.key")?,
        next,
        bundle: material::read(text(BUNDLE)?.as_bytes(), BUNDLE)?,
        leaf: pair("tls.crt", "tls.key")?,
        published_at: at(PUBLISHED_AT),
        switched_at: at(SWITCHED_AT),
        request,
    })
}

/// `secret` (its metadata kept: name, resourceVersion, other labels and annotations) holding
/// `contents`; the `rotate` annotation goes once no rotation is asked for any more.
pub fn encode(mut secret: Secret, contents: &Contents) -> Secret {
    let mut data = BTreeMap::new();
    let mut put = |key: &str, value: &str| {
        data.insert(key.to_owned(), ByteString(value.as_bytes().to_vec()));
    };
    put("ca.crt", &contents.ca.cert);
    put("ca.key", &contents.ca.key);
    put("tls.crt", &contents.leaf.cert);
    put("tls.key", &contents.leaf.key);
    put(BUNDLE, &contents.bundle_pem());
    if let Some(next) = &contents.next {
        put("next-ca.crt", &next.cert);
        put("next-ca.key", &next.key);
    }
    secret.data = Some(data);
    secret.string_data = None;
    secret.type_ = Some("kubernetes.io/tls".into());
    secret
        .metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(MANAGED_BY.0.into(), MANAGED_BY.1.into());
    let annotations = secret
        .metadata
        .annotations
        .get_or_insert_with(BTreeMap::new);
    let mut set = |key: &str, at: Option<Timestamp>| match at {
        Some(at) => {
            annotations.insert(key.into(), at.to_string());
        }
        None => {
            annotations.remove(key);
        }
    };
    set(PUBLISHED_AT, contents.published_at);
    set(SWITCHED_AT, contents.switched_at);
    if contents.request.is_none() {
        annotations.remove(ROTATE);
    }
    secret
}

/// What the Secret holds after `step`, from `before` (`None` for a bootstrap). `adopted` are
/// the PEM certificates a bootstrap keeps in the bundle.
pub fn after(
    step: &Step,
    before: Option<&Contents>,
    adopted: &[Parsed],
    names: &[String],
    policy: &Policy,
    now: Timestamp,
) -> Result<Option<Contents>, MaterialError> {
    let leaf_of = |ca: &Pair| -> Result<Pair, MaterialError> {
        let ca_end = first(&ca.cert, "ca.crt")?.facts.not_after;
        material::new_leaf(ca, names, now, policy.leaf_validity, ca_end)
    };
    let Some(before) = before else {
        if !matches!(step, Step::Bootstrap { .. }) {
            return Ok(None);
        }
        let ca = material::new_ca(now, policy.ca_validity)?;
        let mut bundle = material::read(ca.cert.as_bytes(), "ca.crt")?;
        bundle.extend(adopted.iter().cloned());
        return Ok(Some(Contents {
            leaf: leaf_of(&ca)?,
            ca,
            next: None,
            bundle,
            published_at: None,
            switched_at: Some(now),
            request: None,
        }));
    };
    let mut after = before.clone();
    match step {
        Step::Bootstrap { .. } | Step::Wait { .. } | Step::Refuse => return Ok(None),
        Step::RenewLeaf => {
            after.leaf = leaf_of(&after.ca)?;
            after.request = None;
        }
        Step::Publish => {
            let next = material::new_ca(now, policy.ca_validity)?;
            after
                .bundle
                .extend(material::read(next.cert.as_bytes(), "next-ca.crt")?);
            after.next = Some(next);
            after.published_at = Some(now);
            after.request = None;
        }
        Step::Switch => {
            let Some(next) = after.next.take() else {
                return Ok(None);
            };
            after.leaf = leaf_of(&next)?;
            after.ca = next;
            after.published_at = None;
            after.switched_at = Some(now);
            // A rotation asked for while this one ran is this one.
            after.request = None;
        }
        Step::Stamp => {
            if after.next.is_some() {
                after.published_at.get_or_insert(now);
            }
            after.switched_at.get_or_insert(now);
        }
        Step::Rebundle { keep } => {
            let mut bundle: Vec<Parsed> = keep
                .iter()
                .filter_map(|fp| {
                    before
                        .bundle
                        .iter()
                        .find(|c| &c.facts.fingerprint == fp)
                        .cloned()
                })
                .collect();
            let signer = before.signer()?;
            if !bundle.iter().any(|c| c.facts.fingerprint == signer) {
                bundle.insert(0, first(&before.ca.cert, "ca.crt")?);
            }
            after.bundle = bundle;
        }
    }
    Ok(Some(after))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::rotation::next_step;

    fn names() -> Vec<String> {
        vec!["cnat.cnat-system.svc".into()]
    }

    fn cnat_secret() -> Secret {
        let mut secret = Secret::default();
        secret.metadata.name = Some("cnat-webhook-certs".into());
        secret.metadata.labels = Some([(MANAGED_BY.0.into(), MANAGED_BY.1.into())].into());
        secret
    }

    #[test]
    fn every_step_round_trips_through_the_secret_and_settles() {
        let policy = Policy::default();
        let now = Timestamp::from_second(1_800_000_000).unwrap();
        let (found0, none) = found(None, &names());
        assert_eq!((found0, none), (Found::Missing, None));
        let step = next_step(&Found::Missing, &[], &policy, now);
        let first = after(&step, None, &[], &names(), &policy, now)
            .unwrap()
            .unwrap();
        let secret = encode(cnat_secret(), &first);
        let (found1, contents) = found(Some(&secret), &names());
        assert_eq!(contents.as_ref(), Some(&first));
        let Found::Stored(stored) = &found1 else {
            panic!("{found1:?}")
        };
        assert!(stored.leaf_fits);
        assert_eq!(stored.bundle.len(), 1);
        // Settled until the overlap after the bootstrap ends, then the same.
        assert!(matches!(
            next_step(&found1, &[], &policy, now),
            Step::Wait { until: Some(_) }
        ));
        // A CA rotation asked for by hand: published, then switched, then the old one retired.
        let mut asked = secret.clone();
        asked
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(ROTATE.into(), "ca".into());
        let (found2, contents) = found(Some(&asked), &names());
        assert_eq!(next_step(&found2, &[], &policy, now), Step::Publish);
        let published = after(
            &Step::Publish,
            contents.as_ref(),
            &[],
            &names(),
            &policy,
            now,
        )
        .unwrap()
        .unwrap();
        let secret = encode(asked, &published);
        assert!(!secret
            .metadata
            .annotations
            .as_ref()
            .unwrap()
            .contains_key(ROTATE));
        let later = now + policy.overlap;
        let (found3, contents) = found(Some(&secret), &names());
        assert_eq!(next_step(&found3, &[], &policy, later), Step::Switch);
        let switched = after(
            &Step::Switch,
            contents.as_ref(),
            &[],
            &names(),
            &policy,
            later,
        )
        .unwrap()
        .unwrap();
        assert_eq!(switched.ca, published.next.clone().unwrap());
        assert_eq!(switched.bundle.len(), 2, "the old CA stays for the overlap");
        let secret = encode(secret, &switched);
        let (found4, contents) = found(Some(&secret), &names());
        let Found::Stored(stored) = &found4 else {
            panic!()
        };
        assert!(stored.leaf_fits, "the new leaf is the new CA's");
        let retired = later + policy.overlap * 2;
        let step = next_step(&found4, &[], &policy, retired);
        assert!(matches!(&step, Step::Rebundle { keep } if keep.len() == 1));
        let done = after(&step, contents.as_ref(), &[], &names(), &policy, retired)
            .unwrap()
            .unwrap();
        assert_eq!(done.bundle.len(), 1);
        assert_eq!(done.bundle[0].facts.fingerprint, done.signer().unwrap());
    }

    #[test]
    fn a_foreign_or_broken_secret() {
        let mut foreign = cnat_secret();
        foreign.metadata.labels = None;
        assert_eq!(found(Some(&foreign), &names()).0, Found::Foreign);
        let mut broken = cnat_secret();
        broken.data = Some([("ca.crt".into(), ByteString(b"junk".to_vec()))].into());
        assert_eq!(found(Some(&broken), &names()).0, Found::Broken);
    }
}
