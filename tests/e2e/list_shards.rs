//! List shards on a real API server: the mutating webhook labels each At it admits with its
//! shard, the shard lists' label selectors together select every At exactly once (unlabelled
//! and oddly labelled ones too), and the At cache lists them at once and then follows changes.

use crate::admission::{ready, register};
use crate::lifecycle::at;
use cnat::api::At;
use cnat::shard::{self, LABEL};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Duration;

#[tokio::test]
async fn the_shard_lists_select_every_at_once_and_the_cache_lists_them_all_at_once() {
    let plane = crate::real_control_plane!();
    let admin = plane.admin().await;
    crate::support::envtest::install_crd(&admin, &cnat::api::crd_yaml()).await;
    let ns = plane.namespace("list-shards", &[]).await;
    let ats: Api<At> = Api::namespaced(admin.clone(), &ns);
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    let post = PostParams::default();

    // Before the webhook: no label, or one that is no value (set by hand).
    for i in 0..3 {
        ats.create(&post, &at(&format!("plain-{i}"), later, "true"))
            .await
            .unwrap();
    }
    let mut odd = at("odd", later, "true");
    odd.metadata.labels = Some([(LABEL.to_owned(), "77".to_owned())].into());
    let odd = ats.create(&post, &odd).await.unwrap();
    assert_eq!(odd.labels().get(LABEL).map(String::as_str), Some("77"));
    // Through the webhook (serving only: it reconciles another namespace).
    let replica = plane.replica("shards-0", &ns, &["--namespace=elsewhere"]);
    ready(plane, &replica).await;
    register(&admin, &replica, &ns).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        // The API server loads a new webhook configuration asynchronously.
        let probe = ats
            .create(&post, &at("probe", later, "true"))
            .await
            .unwrap();
        ats.delete("probe", &DeleteParams::default()).await.unwrap();
        if probe.labels().contains_key(LABEL) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never labelled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for i in 0..40 {
        let name = format!("at-{i:02}");
        let created = ats.create(&post, &at(&name, later, "true")).await.unwrap();
        assert_eq!(
            created.labels().get(LABEL),
            Some(&shard::assign(&format!("{ns}/{name}"))),
            "{name}"
        );
    }
    let mut named = at("", later, "true");
    named.metadata.name = None;
    named.metadata.generate_name = Some("gen-".into());
    let generated = ats.create(&post, &named).await.unwrap();
    let value = generated.labels().get(LABEL).cloned().unwrap_or_default();
    assert!(
        shard::list_of(Some(generated.labels())) < shard::SHARDS,
        "{value:?}"
    );
    // The webhook sets the label: a text that is no value is replaced.
    let mut odd = at("odd-later", later, "true");
    odd.metadata.labels = Some([(LABEL.to_owned(), "77".to_owned())].into());
    let odd = ats.create(&post, &odd).await.unwrap();
    assert_eq!(
        odd.labels().get(LABEL),
        Some(&shard::assign(&format!("{ns}/odd-later")))
    );
    // An update that drops the label gets it back.
    let reapplied = ats
        .patch(
            "at-00",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {LABEL: null}}})),
        )
        .await
        .unwrap();
    assert_eq!(
        reapplied.labels().get(LABEL),
        Some(&shard::assign(&format!("{ns}/at-00")))
    );

    // The selectors, on the real server: each At in exactly one list.
    let every: BTreeSet<String> = ats
        .list(&ListParams::default())
        .await
        .unwrap()
        .into_iter()
        .map(|at| at.name_any())
        .collect();
    assert_eq!(every.len(), 4 + 40 + 2);
    let mut seen = BTreeSet::new();
    let mut sizes = Vec::new();
    for selector in shard::selectors() {
        let listed = ats
            .list(&ListParams::default().labels(&selector))
            .await
            .unwrap();
        sizes.push(listed.items.len());
        for at in listed {
            assert!(seen.insert(at.name_any()), "{} twice", at.name_any());
        }
    }
    assert_eq!(seen, every);
    // The last list has the unlabelled Ats and the odd one made before the webhook; the shards
    // have the rest.
    assert_eq!(sizes.last(), Some(&4), "{sizes:?}");
    assert!(
        sizes.iter().take(shard::SHARDS).all(|n| *n > 0),
        "{sizes:?}"
    );

    // The cache lists them all at once, then follows changes made after: by a streaming list
    // where the server offers one (kube-apiserver 1.34 and later; 1.24 refuses it), and by the
    // shard lists (the way on servers that do not, and with `--watch-list=false`).
    let caches: Vec<_> = [true, false]
        .into_iter()
        .map(|streaming| {
            let cache = cnat::operator::cache::AtCache::start_listing(&admin, Some(&ns), streaming);
            (streaming, cache)
        })
        .collect();
    let cached = |cache: &cnat::operator::cache::AtCache| -> BTreeSet<String> {
        cache
            .store()
            .state()
            .iter()
            .map(|at| at.as_ref().name_any())
            .collect()
    };
    for (streaming, cache) in &caches {
        tokio::time::timeout(Duration::from_secs(30), cache.listed())
            .await
            .expect("never listed");
        assert_eq!(
            cache.streams_lists(),
            *streaming && plane.minor() >= 34,
            "streaming asked: {streaming}, on {}",
            plane.version
        );
        assert_eq!(cached(cache), every, "streaming asked: {streaming}");
    }
    ats.create(&post, &at("after", later, "true"))
        .await
        .unwrap();
    ats.delete("plain-0", &DeleteParams::default())
        .await
        .unwrap();
    ats.delete("at-01", &DeleteParams::default()).await.unwrap();
    let mut expected = every.clone();
    expected.insert("after".into());
    expected.remove("plain-0");
    expected.remove("at-01");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    for (streaming, cache) in &caches {
        while cached(cache) != expected {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the cache (streaming asked: {streaming}) never followed: {:?}",
                cached(cache)
                    .symmetric_difference(&expected)
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
