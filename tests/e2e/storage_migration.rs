//! `cnat migrate-storage` on a real API server, for a CRD of its own (so that changing its
//! storage version disturbs no other test): objects stored in the old version are written again
//! in the new one, page by page; a dry run writes nothing; `status.storedVersions` ends as the
//! new version alone; a second run finds nothing to rewrite.

use cnat::storage_migration::{migrate, rewrite, MigrateError, Options, Report, Written};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams,
};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use std::collections::BTreeMap;

/// The group of the first test's CRD; the second has one of its own, as the tests run at once
/// and a storage version in `storedVersions` cannot be taken away again.
const GROUP: &str = "migrate.e2e.example";
const CRD: &str = "widgets.migrate.e2e.example";
const OTHER_GROUP: &str = "conflict.e2e.example";
const OBJECTS: usize = 1203; // three pages of 500

/// The test CRD of `group` with `versions` (name, storage), each with the same open schema.
fn crd(group: &str, versions: &[(&str, bool)]) -> String {
    let versions: Vec<_> = versions
        .iter()
        .map(|(name, storage)| {
            json!({"name": name, "served": true, "storage": storage, "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {"spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}
            }}})
        })
        .collect();
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("widgets.{group}")},
        "spec": {"group": group, "scope": "Namespaced",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
            "versions": versions}
    })
    .to_string()
}

fn resource(group: &str, version: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, "Widget"), "widgets")
}

fn widgets(client: &Client, ns: &str, version: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &resource(GROUP, version))
}

/// Every object's resourceVersion, by name.
async fn versions(api: &Api<DynamicObject>) -> BTreeMap<String, String> {
    let list = api.list(&ListParams::default()).await.unwrap();
    list.items
        .iter()
        .map(|o| (o.name_any(), o.resource_version().unwrap()))
        .collect()
}

async fn stored_versions(client: &Client) -> Vec<String> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crds.get(CRD).await.unwrap();
    crd.status.unwrap().stored_versions.unwrap()
}

async fn run(client: &Client, dry_run: bool) -> (Report, usize) {
    let options = Options {
        crd: CRD.into(),
        dry_run,
        ..Options::default()
    };
    let mut pages = 0;
    let report = migrate(client.clone(), &options, |_| pages += 1)
        .await
        .unwrap();
    (report, pages)
}

#[tokio::test]
async fn every_object_is_rewritten_in_the_storage_version_once_and_stored_versions_follow() {
    let plane = crate::real_control_plane!();
    let admin = plane.admin().await;
    crate::support::envtest::install_crd(&admin, &crd(GROUP, &[("v1alpha1", true)])).await;
    let ns = plane.namespace("migrate-storage", &[]).await;
    let old = widgets(&admin, &ns, "v1alpha1");
    futures::stream::iter(0..OBJECTS)
        .map(|i| {
            let old = old.clone();
            async move {
                let mut widget =
                    DynamicObject::new(&format!("w-{i:04}"), &resource(GROUP, "v1alpha1"));
                widget.data = json!({"spec": {"size": i}});
                old.create(&PostParams::default(), &widget).await
            }
        })
        .buffer_unordered(8)
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    let before = versions(&old).await;
    assert_eq!(before.len(), OBJECTS);

    // A new storage version: what is stored stays as it was until written again.
    crate::support::envtest::install_crd(&admin, &crd(GROUP, &[("v1alpha1", false), ("v1", true)]))
        .await;
    assert_eq!(stored_versions(&admin).await, ["v1alpha1", "v1"]);

    let (dry, pages) = run(&admin, true).await;
    assert_eq!((dry.read, dry.gone), (OBJECTS, 0));
    assert_eq!(pages, 3);
    assert_eq!(versions(&old).await, before, "a dry run writes nothing");
    assert_eq!(stored_versions(&admin).await, ["v1alpha1", "v1"]);

    let (done, _) = run(&admin, false).await;
    assert_eq!(done.storage_version, "v1");
    assert_eq!(done.stored_before, ["v1alpha1", "v1"]);
    assert_eq!(
        (done.read, done.rewritten, done.unchanged, done.gone),
        (OBJECTS, OBJECTS, 0, 0)
    );
    assert_eq!(stored_versions(&admin).await, ["v1"]);
    let after = versions(&old).await;
    assert!(
        before
            .iter()
            .all(|(name, rv)| after.get(name).is_some_and(|new| new != rv)),
        "every object written again"
    );
    let written = widgets(&admin, &ns, "v1")
        .list(&ListParams::default())
        .await
        .unwrap();
    for widget in written.items {
        let i: usize = widget.name_any()[2..].parse().unwrap();
        assert_eq!(widget.data["spec"], json!({"size": i}), "written unchanged");
    }

    // Again: everything is stored as v1 already, so every write is a no-op.
    let (again, _) = run(&admin, false).await;
    assert_eq!(
        (again.read, again.rewritten, again.unchanged),
        (OBJECTS, 0, OBJECTS)
    );
    assert_eq!(versions(&old).await, after);
}

#[tokio::test]
async fn a_stale_copy_is_read_again_and_never_overwrites_a_newer_one() {
    let plane = crate::real_control_plane!();
    let admin = plane.admin().await;
    crate::support::envtest::install_crd(&admin, &crd(OTHER_GROUP, &[("v1alpha1", true)])).await;
    let ns = plane.namespace("migrate-conflict", &[]).await;
    let widget = resource(OTHER_GROUP, "v1alpha1");
    let api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), &ns, &widget);
    let post = PostParams::default();
    for name in ["changed", "deleted"] {
        let mut object = DynamicObject::new(name, &widget);
        object.data = json!({"spec": {"size": 1}});
        api.create(&post, &object).await.unwrap();
    }
    let stale = api.get("changed").await.unwrap();
    let newer = api
        .patch(
            "changed",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 2}})),
        )
        .await
        .unwrap();
    let written = rewrite(&admin, &widget, stale, &post).await;
    // The stale write conflicted (409), the At was read again, and that copy written: a no-op,
    // since it is stored in this version already.
    assert_eq!(written, (Written::Unchanged, 1));
    let now = api.get("changed").await.unwrap();
    assert_eq!(
        now.data["spec"],
        json!({"size": 2}),
        "the newer content stays"
    );
    assert_eq!(now.resource_version(), newer.resource_version());

    let gone = api.get("deleted").await.unwrap();
    api.delete("deleted", &DeleteParams::default())
        .await
        .unwrap();
    let written = rewrite(&admin, &widget, gone, &post).await;
    assert_eq!(written.0, Written::Gone);
}

/// The group of the third test's CRD.
const LEFT_GROUP: &str = "leftover.e2e.example";

/// `crd` for `LEFT_GROUP` with `spec.size` an integer, at most `maximum` when given.
fn bounded_crd(versions: &[(&str, bool)], maximum: Option<i64>) -> String {
    let mut crd: serde_json::Value = serde_json::from_str(&crd(LEFT_GROUP, versions)).unwrap();
    let mut size = json!({"type": "integer"});
    if let Some(maximum) = maximum {
        size["maximum"] = json!(maximum);
    }
    for version in crd["spec"]["versions"].as_array_mut().unwrap() {
        version["schema"]["openAPIV3Schema"]["properties"]["spec"] =
            json!({"type": "object", "properties": {"size": size}});
    }
    crd.to_string()
}

#[tokio::test]
async fn objects_it_cannot_rewrite_are_reported_with_the_fix_and_stored_versions_waits_for_them() {
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    let plane = crate::real_control_plane!();
    let admin = plane.admin().await;
    let crd_name = format!("widgets.{LEFT_GROUP}");
    crate::support::envtest::install_crd(&admin, &bounded_crd(&[("v1alpha1", true)], None)).await;
    let ns = plane.namespace("migrate-leftover", &[]).await;
    let old = resource(LEFT_GROUP, "v1alpha1");
    let api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), &ns, &old);
    let post = PostParams::default();
    for (name, size, refuse) in [
        ("ok-0", 1, false),
        ("ok-1", 2, false),
        ("ok-2", 3, false),
        ("big", 1000, false),
        ("refused", 4, true),
    ] {
        let mut object = DynamicObject::new(name, &old);
        object.data = json!({"spec": {"size": size}});
        if refuse {
            object.metadata.labels = Some([("refuse".to_owned(), "yes".to_owned())].into());
        }
        api.create(&post, &object).await.unwrap();
    }
    // A new storage version whose schema is tighter than what `big` holds (kube-apiserver
    // v1.30+ ratchets an unchanged value; v1.24 refuses it), and a webhook that cannot be
    // called for `refused`'s updates (failurePolicy Fail).
    crate::support::envtest::install_crd(
        &admin,
        &bounded_crd(&[("v1alpha1", false), ("v1", true)], Some(100)),
    )
    .await;
    let webhook: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": "leftover-refuse"},
        "webhooks": [{
            "name": "refuse.leftover.e2e.example",
            "clientConfig": {"url": "https://127.0.0.1:1/refuse"},
            "rules": [{"apiGroups": [LEFT_GROUP], "apiVersions": ["*"], "operations": ["UPDATE"],
                       "resources": ["widgets"]}],
            "objectSelector": {"matchLabels": {"refuse": "yes"}},
            "failurePolicy": "Fail", "sideEffects": "None",
            "admissionReviewVersions": ["v1"], "timeoutSeconds": 2,
        }],
    }))
    .unwrap();
    let webhooks: Api<ValidatingWebhookConfiguration> = Api::all(admin.clone());
    webhooks.create(&post, &webhook).await.unwrap();
    let ratchets = admin
        .apiserver_version()
        .await
        .unwrap()
        .minor
        .trim_end_matches('+')
        .parse::<u32>()
        .unwrap()
        >= 30;

    let options = Options {
        crd: crd_name.clone(),
        ..Options::default()
    };
    // The webhook configuration takes a moment to reach the server's admission chain.
    let mut outcome = migrate(admin.clone(), &options, |_| {}).await;
    for _ in 0..50 {
        match &outcome {
            Err(MigrateError::LeftBehind(report))
                if report.left.iter().any(|l| l.object.ends_with("/refused")) =>
            {
                break
            }
            _ => {}
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        outcome = migrate(admin.clone(), &options, |_| {}).await;
    }
    let error = outcome.expect_err("objects left behind");
    let message = error.to_string();
    let MigrateError::LeftBehind(report) = error else {
        panic!("{message}");
    };
    let left: Vec<&str> = report.left.iter().map(|l| l.object.as_str()).collect();
    let expected_left = if ratchets {
        vec![format!("Widget {ns}/refused")]
    } else {
        vec![format!("Widget {ns}/big"), format!("Widget {ns}/refused")]
    };
    assert_eq!(left, expected_left, "{message}");
    assert_eq!(report.read, 5, "every object was tried");
    let refused = report
        .left
        .iter()
        .find(|l| l.object.ends_with("/refused"))
        .unwrap();
    assert!(
        refused.why.contains("refuse.leftover.e2e.example"),
        "{refused}"
    );
    assert!(refused.fix.contains("webhook"), "{refused}");
    if !ratchets {
        let big = &report.left[0];
        assert!(big.why.contains("spec.size"), "{big}");
        assert!(big.fix.contains("schema"), "{big}");
    }
    assert!(
        message.contains("status.storedVersions stays") && message.contains("/refused: "),
        "{message}"
    );
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    assert_eq!(
        stored_versions_of(&crds, &crd_name).await,
        ["v1alpha1", "v1"],
        "untouched while any is left"
    );

    // Fixed (the webhook gone, the big one brought within bounds): the next run finishes.
    webhooks
        .delete("leftover-refuse", &DeleteParams::default())
        .await
        .unwrap();
    api.patch(
        "big",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"size": 100}})),
    )
    .await
    .unwrap();
    let mut done = migrate(admin.clone(), &options, |_| {}).await;
    for _ in 0..50 {
        if done.is_ok() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        done = migrate(admin.clone(), &options, |_| {}).await;
    }
    let done = done.unwrap();
    assert!(done.left.is_empty());
    assert_eq!(stored_versions_of(&crds, &crd_name).await, ["v1"]);
}

async fn stored_versions_of(crds: &Api<CustomResourceDefinition>, name: &str) -> Vec<String> {
    let crd = crds.get(name).await.unwrap();
    crd.status.unwrap().stored_versions.unwrap()
}
