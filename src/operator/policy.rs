//! Operator-wide policy for runs (`cnat run --default-*`): what applies when an At does not say,
//! like a LimitRange for the pods cnat creates, and how often a running At is checked again.

use crate::api::{ImagePullPolicy, DEFAULT_IMAGE};
use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use std::collections::BTreeMap;
use std::time::Duration;

/// How often a RUNNING At looks at its pod again without being told: kube-runtime's watcher
/// sends no delete for a pod that vanished while its watch was re-listing.
pub const RUNNING_RECHECK: Duration = Duration::from_secs(60);

/// Defaults for the fields an At may leave out, and the re-check interval.
#[derive(Debug, Clone, PartialEq)]
pub struct RunPolicy {
    /// Image for an At that names none.
    pub image: String,
    /// `imagePullPolicy` for an At that sets none; without either, Kubernetes' default.
    pub image_pull_policy: Option<ImagePullPolicy>,
    /// Requests per resource (`cpu`, `memory`, ...) for a container that does not request it.
    pub requests: BTreeMap<String, Quantity>,
    /// Limits per resource for a container that does not limit it.
    pub limits: BTreeMap<String, Quantity>,
    pub active_deadline_seconds: Option<i64>,
    pub starting_deadline_seconds: Option<i64>,
    pub ttl_seconds_after_finished: Option<i32>,
    pub running_recheck: Duration,
}

impl Default for RunPolicy {
    fn default() -> Self {
        RunPolicy {
            image: DEFAULT_IMAGE.to_owned(),
            image_pull_policy: None,
            requests: BTreeMap::new(),
            limits: BTreeMap::new(),
            active_deadline_seconds: None,
            starting_deadline_seconds: None,
            ttl_seconds_after_finished: None,
            running_recheck: RUNNING_RECHECK,
        }
    }
}

impl RunPolicy {
    /// The image that runs `at`'s command: its own, else this policy's (a blank image, which
    /// admission drops, counts as none).
    pub fn image(&self, at: Option<&str>) -> String {
        at.filter(|image| !image.trim().is_empty())
            .unwrap_or(&self.image)
            .to_owned()
    }

    /// The pull policy of `at`'s container: its own, else this policy's, else none (Kubernetes'
    /// default applies).
    pub fn image_pull_policy(&self, at: Option<ImagePullPolicy>) -> Option<String> {
        at.or(self.image_pull_policy)
            .map(|policy| policy.as_str().to_owned())
    }

    /// The At's resources with the defaults filled in per resource name, as a LimitRange does:
    /// a value the At sets always wins.
    pub fn resources(&self, at: Option<&ResourceRequirements>) -> Option<ResourceRequirements> {
        let mut merged = at.cloned().unwrap_or_default();
        fill(&mut merged.requests, &self.requests);
        fill(&mut merged.limits, &self.limits);
        (merged != ResourceRequirements::default()).then_some(merged)
    }
}

fn fill(into: &mut Option<BTreeMap<String, Quantity>>, defaults: &BTreeMap<String, Quantity>) {
    if defaults.is_empty() {
        return;
    }
    let map = into.get_or_insert_with(BTreeMap::new);
    for (name, quantity) in defaults {
        map.entry(name.clone()).or_insert_with(|| quantity.clone());
    }
}

/// Whether `raw` is a Kubernetes quantity (`100m`, `1.5`, `64Mi`, `1e3`), so a typo is refused
/// where it is written instead of when the pod is created.
pub fn is_quantity(raw: &str) -> bool {
    let body = raw.strip_prefix(['+', '-']).unwrap_or(raw);
    let split = body
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(body.len());
    let (number, suffix) = body.split_at(split);
    let digits = number.chars().filter(char::is_ascii_digit).count();
    let number_ok = digits > 0 && number.matches('.').count() <= 1;
    let suffix_ok = match suffix {
        "" | "n" | "u" | "m" | "k" | "M" | "G" | "T" | "P" | "E" => true,
        "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" => true,
        exp => exp
            .strip_prefix(['e', 'E'])
            .map(|e| e.strip_prefix(['+', '-']).unwrap_or(e))
            .is_some_and(|e| !e.is_empty() && e.chars().all(|c| c.is_ascii_digit())),
    };
    number_ok && suffix_ok
}

/// Parses `cpu=100m,memory=64Mi` (a `--default-requests`/`--default-limits` value).
pub fn parse_quantities(raw: &str) -> Result<BTreeMap<String, Quantity>, String> {
    let mut map = BTreeMap::new();
    for pair in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((name, value)) = pair.split_once('=') else {
            return Err(format!(
                "{pair:?} is not NAME=QUANTITY (expected e.g. cpu=100m,memory=64Mi)"
            ));
        };
        let (name, value) = (name.trim(), value.trim());
        if name.is_empty() || !is_quantity(value) {
            return Err(format!(
                "{pair:?}: {value:?} is not a resource quantity (expected e.g. cpu=100m,memory=64Mi)"
            ));
        }
        map.insert(name.to_owned(), Quantity(value.to_owned()));
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
            .collect()
    }

    #[test]
    fn quantities_are_recognised() {
        for good in [
            "1", "100m", "0.5", ".5", "1.", "64Mi", "1Gi", "2k", "1e3", "1E-2", "+1", "-1", "12345",
        ] {
            assert!(is_quantity(good), "{good}");
        }
        for bad in [
            "", "m", "1.2.3", "64MB", "1 Gi", "one", "1e", "1ee3", "Mi", "1Mi ", "0x10",
        ] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }

    #[test]
    fn default_flags_parse_and_refuse_typos() {
        assert_eq!(
            parse_quantities("cpu=100m, memory=64Mi"),
            Ok(q(&[("cpu", "100m"), ("memory", "64Mi")]))
        );
        assert_eq!(parse_quantities(""), Ok(BTreeMap::new()));
        for bad in ["cpu", "cpu=lots", "=1", "memory=64MB"] {
            let err = parse_quantities(bad).unwrap_err();
            assert!(err.contains("expected e.g. cpu=100m,memory=64Mi"), "{err}");
        }
    }

    #[test]
    fn defaults_fill_what_the_at_leaves_out_as_a_limit_range_does() {
        let policy = RunPolicy {
            requests: q(&[("cpu", "100m"), ("memory", "64Mi")]),
            limits: q(&[("cpu", "1"), ("memory", "256Mi")]),
            ..RunPolicy::default()
        };
        let all = policy.resources(None).unwrap();
        assert_eq!(
            all.requests,
            Some(q(&[("cpu", "100m"), ("memory", "64Mi")]))
        );
        assert_eq!(all.limits, Some(q(&[("cpu", "1"), ("memory", "256Mi")])));
        let own = ResourceRequirements {
            limits: Some(q(&[("memory", "1Gi")])),
            ..ResourceRequirements::default()
        };
        let merged = policy.resources(Some(&own)).unwrap();
        assert_eq!(merged.limits, Some(q(&[("cpu", "1"), ("memory", "1Gi")])));
        assert_eq!(
            merged.requests,
            Some(q(&[("cpu", "100m"), ("memory", "64Mi")]))
        );
        // No defaults, nothing set: no resources at all.
        assert_eq!(RunPolicy::default().resources(None), None);
        assert_eq!(
            RunPolicy::default().resources(Some(&own)),
            Some(own.clone())
        );
    }
}
