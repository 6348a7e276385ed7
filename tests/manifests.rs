//! The webhook configurations in webhooks/ are what the server serves and what the apiserver needs.

use cnat::webhook::{MUTATING_PATH, VALIDATING_PATH};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, RuleWithOperations, ValidatingWebhookConfiguration,
    WebhookClientConfig,
};

fn load<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = format!("{}/webhooks/{name}", env!("CARGO_MANIFEST_DIR"));
    // As the README's sed step does: CA_BUNDLE becomes the base64 of the CA.
    let text = std::fs::read_to_string(path)
        .unwrap()
        .replace("CA_BUNDLE", "Q0E=");
    serde_saphyr::from_str(&text).unwrap()
}

fn assert_safe(
    side_effects: &str,
    versions: &[String],
    failure: Option<&str>,
    timeout: Option<i32>,
    client: &WebhookClientConfig,
    rules: &[RuleWithOperations],
    path: &str,
) {
    assert_eq!(side_effects, "None");
    assert_eq!(versions, ["v1"]);
    assert_eq!(failure, Some("Fail"));
    assert!(timeout.is_some_and(|t| (1..=10).contains(&t)));
    let service = client.service.as_ref().unwrap();
    assert_eq!(service.path.as_deref(), Some(path));
    assert_eq!(
        (service.name.as_str(), service.namespace.as_str()),
        ("cnat-webhook", "cnat-system")
    );
    let [rule] = rules else { panic!("one rule") };
    assert_eq!(
        rule.api_groups.as_deref(),
        Some(&["cnat.programming-kubernetes.info".to_owned()][..])
    );
    assert_eq!(
        rule.resources.as_deref(),
        Some(&["ats".to_owned(), "ats/status".to_owned()][..])
    );
    assert_eq!(
        rule.operations.as_deref(),
        Some(&["CREATE".to_owned(), "UPDATE".to_owned()][..])
    );
}

#[test]
fn the_validating_webhook_only_sees_ats_and_fails_closed() {
    let config: ValidatingWebhookConfiguration = load("validating.yaml");
    let [hook] = config.webhooks.as_deref().unwrap() else {
        panic!("one webhook")
    };
    let rules = hook.rules.clone().unwrap();
    assert_safe(
        &hook.side_effects,
        &hook.admission_review_versions,
        hook.failure_policy.as_deref(),
        hook.timeout_seconds,
        &hook.client_config,
        &rules,
        VALIDATING_PATH,
    );
}

#[test]
fn the_mutating_webhook_only_sees_ats_and_fails_closed() {
    let config: MutatingWebhookConfiguration = load("mutating.yaml");
    let [hook] = config.webhooks.as_deref().unwrap() else {
        panic!("one webhook")
    };
    let rules = hook.rules.clone().unwrap();
    assert_safe(
        &hook.side_effects,
        &hook.admission_review_versions,
        hook.failure_policy.as_deref(),
        hook.timeout_seconds,
        &hook.client_config,
        &rules,
        MUTATING_PATH,
    );
    assert_eq!(hook.reinvocation_policy.as_deref(), Some("IfNeeded"));
}
