//! The webhook configurations in webhooks/ are what the server serves and what the apiserver needs.

use cnat::admission::webhook::{MUTATING_PATH, VALIDATING_PATH};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};

fn load<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = format!("{}/webhooks/{name}", env!("CARGO_MANIFEST_DIR"));
    // As the sed step of webhooks/README.md does: CA_BUNDLE becomes the base64 of the CA.
    let text = std::fs::read_to_string(path)
        .unwrap()
        .replace("CA_BUNDLE", "Q0E=");
    serde_saphyr::from_str(&text).unwrap()
}

/// The `sed` lines of webhooks/README.md (and the book's install page), run as written with a
/// CA whose base64 has the characters that would end a `s/.../.../` expression early.
#[test]
fn the_documented_sed_step_fills_in_any_ca() {
    let root = env!("CARGO_MANIFEST_DIR");
    let ca = "LS0t+/ab/cd==";
    for doc in ["webhooks/README.md", "docs/src/operating/install.md"] {
        let text = std::fs::read_to_string(format!("{root}/{doc}")).unwrap();
        let lines: Vec<&str> = text
            .lines()
            .map(str::trim_start)
            .filter(|l| l.starts_with("sed ") && l.contains("CA_BUNDLE"))
            .collect();
        assert_eq!(lines.len(), 2, "{doc}: the two sed lines");
        for line in lines {
            let command = line.split(" | kubectl").next().unwrap();
            let output = std::process::Command::new("bash")
                .args(["-c", command])
                .env("CA", ca)
                .current_dir(root)
                .output()
                .unwrap();
            assert!(
                output.status.success(),
                "{doc}: {command}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            let filled = String::from_utf8_lossy(&output.stdout);
            assert!(
                filled.contains(&format!("caBundle: {ca}")) && !filled.contains("CA_BUNDLE"),
                "{doc}: {command}:\n{filled}"
            );
        }
    }
}

/// What both webhooks must be, read from the typed object (which proved the file parses).
fn assert_safe(hook: impl serde::Serialize, path: &str) {
    let hook = serde_json::to_value(hook).unwrap();
    assert_eq!(hook["sideEffects"], "None");
    assert_eq!(hook["admissionReviewVersions"], serde_json::json!(["v1"]));
    assert_eq!(hook["failurePolicy"], "Fail");
    assert!(hook["timeoutSeconds"]
        .as_i64()
        .is_some_and(|t| (1..=10).contains(&t)));
    let service = &hook["clientConfig"]["service"];
    assert_eq!(service["path"], path);
    assert_eq!(
        (service["name"].as_str(), service["namespace"].as_str()),
        (Some("cnat-webhook"), Some("cnat-system"))
    );
    assert_eq!(
        hook["rules"],
        serde_json::json!([{
            "apiGroups": ["cnat.programming-kubernetes.info"],
            "apiVersions": ["v1", "v1alpha1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["ats"],
            "scope": "Namespaced",
        }])
    );
}

#[test]
fn the_validating_webhook_only_sees_ats_and_fails_closed() {
    let config: ValidatingWebhookConfiguration = load("validating.yaml");
    let [hook] = config.webhooks.as_deref().unwrap() else {
        panic!("one webhook")
    };
    assert_safe(hook, VALIDATING_PATH);
}

#[test]
fn the_mutating_webhook_only_sees_ats_and_fails_closed() {
    let config: MutatingWebhookConfiguration = load("mutating.yaml");
    let [hook] = config.webhooks.as_deref().unwrap() else {
        panic!("one webhook")
    };
    assert_safe(hook, MUTATING_PATH);
    assert_eq!(hook.reinvocation_policy.as_deref(), Some("IfNeeded"));
}
