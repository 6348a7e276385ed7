//! The committed CRD is exactly what `cnat crd` prints, and it is what users need from it.

use cnat::api::{crd_yaml, Phase};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps,
};

const COMMITTED: &str = include_str!("../../crds/at.yaml");

fn crd() -> CustomResourceDefinition {
    serde_saphyr::from_str(COMMITTED.split_once("---\n").unwrap().1).unwrap()
}

/// The schema of `version` (`v1` unless said otherwise).
fn schema_of(version: &str) -> JSONSchemaProps {
    let crd = crd();
    let version = crd
        .spec
        .versions
        .iter()
        .find(|v| v.name == version)
        .unwrap();
    *version
        .schema
        .clone()
        .unwrap()
        .open_api_v3_schema
        .map(Box::new)
        .unwrap()
}

fn schema() -> JSONSchemaProps {
    schema_of("v1")
}

fn property(schema: &JSONSchemaProps, path: &[&str]) -> JSONSchemaProps {
    path.iter().fold(schema.clone(), |s, name| {
        s.properties.unwrap()[*name].clone()
    })
}

#[test]
fn committed_crd_matches_cnat_crd() {
    assert!(
        COMMITTED == crd_yaml(),
        "crds/at.yaml is out of date: run `cargo run -- crd > crds/at.yaml` and commit it"
    );
}

#[test]
fn crd_names_scope_and_status_subresource() {
    let crd = crd();
    assert_eq!(
        crd.metadata.name.as_deref(),
        Some("ats.cnat.programming-kubernetes.info")
    );
    assert_eq!(crd.spec.group, "cnat.programming-kubernetes.info");
    assert_eq!(crd.spec.scope, "Namespaced");
    assert_eq!(crd.spec.names.kind, "At");
    assert_eq!(crd.spec.names.plural, "ats");
    assert_eq!(crd.spec.names.singular.as_deref(), Some("at"));
    let [v1, v1alpha1] = crd.spec.versions.as_slice() else {
        panic!("two versions: {:?}", crd.spec.versions)
    };
    assert_eq!(v1.name, "v1");
    assert!(v1.served && v1.storage);
    assert_eq!(v1alpha1.name, "v1alpha1");
    assert!(v1alpha1.served && !v1alpha1.storage && v1alpha1.deprecated == Some(true));
    assert!(v1alpha1
        .deprecation_warning
        .as_deref()
        .is_some_and(|w| w.contains("cnat.programming-kubernetes.info/v1")));
    for version in [v1, v1alpha1] {
        same_columns_and_status(version);
    }
}

/// Both versions show the same columns, from the same paths, and have the status subresource.
fn same_columns_and_status(
    version: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinitionVersion,
) {
    assert!(version.subresources.as_ref().unwrap().status.is_some());
    let columns: Vec<_> = version
        .additional_printer_columns
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(
        columns,
        [
            "Schedule",
            "Phase",
            "Outcome",
            "Reason",
            "Exit Code",
            "Pod",
            "Message",
            "Age"
        ]
    );
}

/// Every field is documented (for `kubectl explain`) and typed (a structural schema: a type, or
/// `x-kubernetes-int-or-string` as for quantities).
fn assert_documented_and_typed(schema: &JSONSchemaProps, path: &str) {
    assert!(
        schema.type_.is_some() || schema.x_kubernetes_int_or_string == Some(true),
        "{path} has no type"
    );
    assert!(
        schema.description.as_deref().is_some_and(|d| !d.is_empty()),
        "{path} has no description"
    );
    for (name, child) in schema.properties.iter().flatten() {
        assert_documented_and_typed(child, &format!("{path}.{name}"));
    }
    if let Some(items) = &schema.items {
        let items: JSONSchemaProps =
            serde_json::from_value(serde_json::to_value(items).unwrap()).unwrap();
        assert_documented_and_typed(&items, &format!("{path}[]"));
    }
}

#[test]
fn every_field_is_documented_and_typed() {
    let schema = schema();
    for top in ["spec", "status"] {
        assert_documented_and_typed(&property(&schema, &[top]), top);
    }
    let schedule = property(&schema, &["spec", "schedule"]);
    assert!(schedule.description.unwrap().contains("RFC 3339"));
}

#[test]
fn spec_requires_schedule_and_command_and_leaves_the_image_to_the_operator() {
    let spec = property(&schema(), &["spec"]);
    assert_eq!(spec.required.clone().unwrap(), ["command", "schedule"]);
    // No default in v1: an At without an image runs the operator's default image.
    let image = property(&spec, &["template", "image"]);
    assert_eq!(image.default, None);
    // v1alpha1's schema is frozen as 0.1.0 served it, default and all.
    let old = property(&schema_of("v1alpha1"), &["spec", "image"]);
    assert_eq!(old.default.unwrap().0, serde_json::json!("busybox"));
}

#[test]
fn phases_are_camel_case_in_v1_and_as_in_the_book_in_v1alpha1() {
    let phase = property(&schema(), &["status", "phase"]);
    let allowed: Vec<_> = phase.enum_.unwrap().into_iter().map(|v| v.0).collect();
    assert_eq!(allowed, ["Pending", "Running", "Done"]);
    let old = property(&schema_of("v1alpha1"), &["status", "phase"]);
    let allowed: Vec<_> = old.enum_.unwrap().into_iter().map(|v| v.0).collect();
    assert_eq!(allowed, ["PENDING", "RUNNING", "DONE"]);
    for p in [Phase::Pending, Phase::Running, Phase::Done] {
        assert_eq!(serde_json::to_value(p).unwrap(), p.as_str());
    }
}

/// The phase guard moved from the webhook into the CRD, as a CEL transition rule (enforced by
/// API servers from 1.25 on, where it can never block the operator's own writes, which only
/// move forward). Evaluated here with a CEL interpreter for every old -> new phase.
#[test]
fn the_crd_refuses_a_phase_going_back() {
    let status = property(&schema(), &["status"]);
    let rules = status.x_kubernetes_validations.expect("a transition rule");
    let [rule] = rules.as_slice() else {
        panic!("one rule: {rules:?}")
    };
    assert!(rule.message.as_deref().unwrap().contains("cannot go back"));
    let program = cel_interpreter::Program::compile(&rule.rule).expect("valid CEL");
    let allowed = |old: Option<&str>, new: &str| {
        let mut context = cel_interpreter::Context::default();
        let old = match old {
            Some(phase) => serde_json::json!({"phase": phase}),
            None => serde_json::json!({}),
        };
        context.add_variable("oldSelf", old).unwrap();
        context
            .add_variable("self", serde_json::json!({"phase": new}))
            .unwrap();
        program.execute(&context).unwrap() == cel_interpreter::Value::Bool(true)
    };
    let phases = ["Pending", "Running", "Done"];
    for (i, old) in phases.iter().enumerate() {
        for (j, new) in phases.iter().enumerate() {
            assert_eq!(allowed(Some(old), new), j >= i, "{old} -> {new}");
        }
    }
    assert!(allowed(None, "Done"), "no phase before: anything goes");
}
