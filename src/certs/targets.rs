//! The objects whose `caBundle` the operator keeps (pure): the webhooks of its two webhook
//! configurations and the CRD's conversion webhook that call this release's Service (or a URL
//! whose host the certificate names), what they trust, and the JSON patch that makes them trust
//! the Secret's bundle. A webhook that calls another server is never written.

use super::material::{self, Parsed};
use super::rotation::{same_set, Fingerprint, Target};
use base64::Engine;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::ByteString;
use kube::ResourceExt;
use serde_json::json;

/// Where this release's webhook server is: its Service and the names its certificate carries.
#[derive(Debug, Clone)]
pub struct Here {
    pub namespace: String,
    pub service: String,
    pub names: Vec<String>,
}

impl Here {
    /// For a client config that calls this release's server, the certificates of its bundle
    /// (none when it is missing or unreadable); `None` when it calls another server.
    fn kept(
        &self,
        service: Option<(&str, &str)>,
        url: Option<&str>,
        bundle: Option<&ByteString>,
    ) -> Option<Vec<Parsed>> {
        let here = match (service, url) {
            (Some((namespace, name)), _) => namespace == self.namespace && name == self.service,
            (None, Some(url)) => url
                .parse::<http::Uri>()
                .ok()
                .and_then(|uri| uri.host().map(|h| h.trim_matches(['[', ']']).to_owned()))
                .is_some_and(|host| self.names.contains(&host)),
            (None, None) => false,
        };
        here.then(|| {
            bundle
                .and_then(|b| material::read(&b.0, "caBundle").ok())
                .unwrap_or_default()
        })
    }
}

/// One `caBundle` the operator keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Holder {
    /// The JSON pointer to its clientConfig.
    client_config: String,
    /// For a webhook in a list: the pointer to its name and the name (the patch tests it).
    name: Option<(String, String)>,
    /// The certificates of its bundle, read once.
    certs: Vec<Parsed>,
}

/// Which kind of object holds the bundles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    MutatingWebhookConfiguration,
    ValidatingWebhookConfiguration,
    CustomResourceDefinition,
}

/// A webhook configuration or the CRD, as far as its bundles go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Live {
    pub kind: Kind,
    pub name: String,
    resource_version: Option<String>,
    holders: Vec<Holder>,
}

fn webhooks<'a>(
    kind: Kind,
    object: &impl ResourceExt,
    hooks: impl Iterator<Item = (&'a str, &'a WebhookClientConfig)>,
    here: &Here,
) -> Live {
    let holders = hooks
        .enumerate()
        .filter_map(|(i, (name, config))| {
            let service = config.service.as_ref();
            let certs = here.kept(
                service.map(|s| (s.namespace.as_str(), s.name.as_str())),
                config.url.as_deref(),
                config.ca_bundle.as_ref(),
            )?;
            Some(Holder {
                client_config: format!("/webhooks/{i}/clientConfig"),
                name: Some((format!("/webhooks/{i}/name"), name.to_owned())),
                certs,
            })
        })
        .collect();
    Live {
        kind,
        name: object.name_any(),
        resource_version: object.resource_version(),
        holders,
    }
}

pub fn mutating(config: &MutatingWebhookConfiguration, here: &Here) -> Live {
    let hooks = config.webhooks.iter().flatten();
    let hooks = hooks.map(|h| (h.name.as_str(), &h.client_config));
    webhooks(Kind::MutatingWebhookConfiguration, config, hooks, here)
}

pub fn validating(config: &ValidatingWebhookConfiguration, here: &Here) -> Live {
    let hooks = config.webhooks.iter().flatten();
    let hooks = hooks.map(|h| (h.name.as_str(), &h.client_config));
    webhooks(Kind::ValidatingWebhookConfiguration, config, hooks, here)
}

pub fn crd(crd: &CustomResourceDefinition, here: &Here) -> Live {
    let config = crd
        .spec
        .conversion
        .as_ref()
        .and_then(|c| c.webhook.as_ref())
        .and_then(|w| w.client_config.as_ref());
    let holder = config.and_then(|config| {
        let service = config.service.as_ref();
        let certs = here.kept(
            service.map(|s| (s.namespace.as_str(), s.name.as_str())),
            config.url.as_deref(),
            config.ca_bundle.as_ref(),
        )?;
        Some(Holder {
            client_config: "/spec/conversion/webhook/clientConfig".into(),
            name: None,
            certs,
        })
    });
    Live {
        kind: Kind::CustomResourceDefinition,
        name: crd.name_any(),
        resource_version: crd.resource_version(),
        holders: holder.into_iter().collect(),
    }
}

impl Live {
    /// `KIND NAME`, for logs.
    pub fn what(&self) -> String {
        format!("{:?} {}", self.kind, self.name)
    }

    /// What it trusts (the CAs every one of its webhooks trusts), and every certificate found
    /// in its bundles.
    pub fn trust(&self) -> (Target, Vec<Parsed>) {
        if self.holders.is_empty() {
            return (Target::Ignored, Vec::new());
        }
        let all = &self.holders;
        let common = all[0]
            .certs
            .iter()
            .filter(|c| {
                all.iter()
                    .all(|h| h.certs.iter().any(|o| o.facts == c.facts))
            })
            .map(|c| c.facts.clone())
            .collect();
        let found = all.iter().flat_map(|h| h.certs.iter().cloned()).collect();
        (Target::Trusts(common), found)
    }

    /// The JSON patch that makes every one of its webhooks trust exactly `bundle` (PEM, whose
    /// certificates are `wanted`), tested against its resourceVersion and the webhooks' names;
    /// `None` when they already do.
    pub fn patch(&self, bundle: &str, wanted: &[Fingerprint]) -> Option<json_patch::Patch> {
        let differs = |h: &&Holder| {
            let have: Vec<Fingerprint> = h.certs.iter().map(|c| c.facts.fingerprint).collect();
            !same_set(&have, wanted)
        };
        let stale: Vec<&Holder> = self.holders.iter().filter(differs).collect();
        if stale.is_empty() {
            return None;
        }
        let encoded = base64::engine::general_purpose::STANDARD.encode(bundle);
        let mut ops = vec![json!({
            "op": "test", "path": "/metadata/resourceVersion", "value": self.resource_version
        })];
        for holder in stale {
            if let Some((path, name)) = &holder.name {
                ops.push(json!({"op": "test", "path": path, "value": name}));
            }
            let path = format!("{}/caBundle", holder.client_config);
            ops.push(json!({"op": "add", "path": path, "value": encoded}));
        }
        serde_json::from_value(json!(ops)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::material::{new_ca, read};
    use jiff::{SignedDuration, Timestamp};

    fn here() -> Here {
        Here {
            namespace: "cnat-system".into(),
            service: "cnat-webhook".into(),
            names: vec!["cnat-webhook.cnat-system.svc".into(), "127.0.0.1".into()],
        }
    }

    fn ca() -> String {
        let now = Timestamp::from_second(1_800_000_000).unwrap();
        new_ca(now, SignedDuration::from_hours(24)).unwrap().cert
    }

    fn config(bundles: &[Option<&str>], urls: &[&str]) -> MutatingWebhookConfiguration {
        serde_json::from_value(json!({
            "metadata": {"name": "cnat", "resourceVersion": "7"},
            "webhooks": bundles.iter().zip(urls).enumerate().map(|(i, (b, url))| {
                let mut client = if url.is_empty() {
                    json!({"service": {"namespace": "cnat-system", "name": "cnat-webhook"}})
                } else {
                    json!({"url": url})
                };
                if let Some(b) = b {
                    client["caBundle"] = json!(base64::engine::general_purpose::STANDARD.encode(b));
                }
                json!({"name": format!("w{i}.cnat"), "clientConfig": client,
                       "sideEffects": "None", "admissionReviewVersions": ["v1"]})
            }).collect::<Vec<_>>()
        }))
        .unwrap()
    }

    #[test]
    fn only_webhooks_that_call_here_are_kept_and_trust_is_what_all_share() {
        let (a, b) = (ca(), ca());
        let both = format!("{a}{b}");
        let live = mutating(
            &config(
                &[Some(both.as_str()), Some(a.as_str()), Some(b.as_str())],
                &[
                    "",
                    "https://127.0.0.1:8443/mutating",
                    "https://elsewhere:443/",
                ],
            ),
            &here(),
        );
        let (target, found) = live.trust();
        let a_facts = read(a.as_bytes(), "a").unwrap()[0].facts.clone();
        assert_eq!(target, Target::Trusts(vec![a_facts.clone()]));
        assert_eq!(
            found.len(),
            3,
            "both of the first webhook's, one of the second's"
        );
        // Already trusting exactly {a}: the third webhook calls elsewhere and is never written,
        // the first gets {a}.
        let patch = live.patch(&a, &[a_facts.fingerprint]).unwrap();
        let ops = serde_json::to_value(&patch).unwrap();
        assert_eq!(ops.as_array().unwrap().len(), 3, "{ops}");
        assert_eq!(ops[0]["path"], "/metadata/resourceVersion");
        assert_eq!(ops[0]["value"], "7");
        assert_eq!(
            ops[1],
            json!({"op": "test", "path": "/webhooks/0/name", "value": "w0.cnat"})
        );
        assert_eq!(ops[2]["path"], "/webhooks/0/clientConfig/caBundle");
        // Applied to the object, the patch leaves nothing to do.
        let mut object = serde_json::to_value(config(
            &[Some(both.as_str()), Some(a.as_str()), Some(b.as_str())],
            &[
                "",
                "https://127.0.0.1:8443/mutating",
                "https://elsewhere:443/",
            ],
        ))
        .unwrap();
        json_patch::patch(&mut object, &patch).unwrap();
        let patched: MutatingWebhookConfiguration = serde_json::from_value(object).unwrap();
        assert_eq!(
            mutating(&patched, &here()).patch(&a, &[a_facts.fingerprint]),
            None
        );
    }

    #[test]
    fn a_missing_bundle_trusts_nothing_and_a_configuration_calling_elsewhere_is_ignored() {
        let live = mutating(&config(&[None], &[""]), &here());
        assert_eq!(live.trust().0, Target::Trusts(vec![]));
        let elsewhere = mutating(&config(&[None], &["https://other.svc/"]), &here());
        assert_eq!(elsewhere.trust().0, Target::Ignored);
        assert_eq!(elsewhere.patch("", &[]), None);
    }

    #[test]
    fn the_crds_conversion_is_kept_only_when_it_calls_this_service() {
        let object = |namespace: &str| -> CustomResourceDefinition {
            serde_json::from_value(json!({
                "metadata": {"name": "ats.cnat.programming-kubernetes.info", "resourceVersion": "3"},
                "spec": {"group": "g", "names": {"kind": "At", "plural": "ats"}, "scope": "Namespaced",
                  "versions": [],
                  "conversion": {"strategy": "Webhook", "webhook": {"conversionReviewVersions": ["v1"],
                    "clientConfig": {"service": {"namespace": namespace, "name": "cnat-webhook"}}}}}
            }))
            .unwrap()
        };
        let a = ca();
        let fp = read(a.as_bytes(), "a").unwrap()[0].facts.fingerprint;
        let patch = crd(&object("cnat-system"), &here())
            .patch(&a, &[fp])
            .unwrap();
        let ops = serde_json::to_value(&patch).unwrap();
        assert_eq!(
            ops[1]["path"],
            "/spec/conversion/webhook/clientConfig/caBundle"
        );
        assert_eq!(crd(&object("other"), &here()).trust().0, Target::Ignored);
    }
}
