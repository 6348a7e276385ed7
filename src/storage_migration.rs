//! `cnat migrate-storage`: rewrites every At in the CRD's storage version, then sets the CRD's
//! `status.storedVersions` to it alone. Safe to run again, and while the operator runs.
//! See docs/src/operating/upgrading.md, "Storage migration".

use futures::StreamExt;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{GroupVersionKind, TypeMeta};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use thiserror::Error;

/// The At CRD.
pub const CRD_NAME: &str = "ats.cnat.programming-kubernetes.info";
const MANAGER: &str = "cnat-migrate-storage";
/// Writes of one object that may conflict in a row before giving up on it.
const MAX_CONFLICTS: usize = 10;
/// Times the paged list may expire (410) and start again before giving up.
const MAX_RESTARTS: usize = 5;

/// What to migrate and how.
#[derive(Debug, Clone)]
pub struct Options {
    /// The CustomResourceDefinition whose objects are rewritten (`CRD_NAME` for cnat).
    pub crd: String,
    /// Check every write with the API server (dry run: admission included) without writing, and
    /// leave `storedVersions` as it is.
    pub dry_run: bool,
    /// Objects per list page.
    pub page_size: u32,
    /// Writes in flight at once.
    pub concurrency: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            crd: CRD_NAME.to_owned(),
            dry_run: false,
            page_size: 500,
            concurrency: 8,
        }
    }
}

/// What a migration did (or, in a dry run, checked).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    pub crd: String,
    /// The version every object is stored in now.
    pub storage_version: String,
    /// `status.storedVersions` before (after: `storage_version` alone).
    pub stored_before: Vec<String>,
    /// Objects read.
    pub read: usize,
    /// Objects the API server wrote again (their resourceVersion changed).
    pub rewritten: usize,
    /// Objects already stored as `storage_version` (the write was a no-op), or, in a dry run,
    /// every object the API server accepted.
    pub unchanged: usize,
    /// Objects deleted before they could be written.
    pub gone: usize,
    /// Writes that conflicted with another and were retried.
    pub conflicts: usize,
    /// Times the paged list expired and started again (what was done before is not counted or
    /// written again).
    pub restarts: usize,
    pub dry_run: bool,
    /// Objects the API server would not take back (or, in a dry run, would not): each with why
    /// and the fix. While any is left, `storedVersions` stays as it was.
    pub left: Vec<Left>,
}

/// An object the migration could not rewrite.
#[derive(Debug, Clone, PartialEq)]
pub struct Left {
    /// Kind, namespace and name, as kubectl names it.
    pub object: String,
    /// The API server's answer.
    pub why: String,
    /// What to do about it.
    pub fix: &'static str,
}

impl Left {
    /// `object` could not be written back: why (`error`), and what to do about it.
    fn new(object: String, error: &kube::Error) -> Self {
        let fix = match error {
            kube::Error::Api(status) if status.message.contains("conversion webhook") => {
                "the API server could not convert it: is a cnat replica of this release running (it serves /convert)?"
            }
            kube::Error::Api(status) if status.message.contains("webhook") => {
                "an admission webhook refused the unchanged object, or could not be called: fix what it names (or the webhook)"
            }
            kube::Error::Api(status) if status.code == 422 => {
                "its stored value breaks today's schema (a value outside the bounds): fix the field named (kubectl edit) or delete the object"
            }
            kube::Error::Api(status) if status.code == 403 => {
                "grant the migration's user update on this resource (or run it as one who has it)"
            }
            kube::Error::Api(_) => "fix what the API server names",
            _ => "check that the API server answers",
        };
        let why = match error {
            kube::Error::Api(status) => status.message.clone(),
            other => other.to_string(),
        };
        Left { object, why, fix }
    }
}

impl std::fmt::Display for Left {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}; {}", self.object, self.why, self.fix)
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Report {
            crd,
            storage_version,
            stored_before,
            read,
            rewritten,
            unchanged,
            gone,
            conflicts,
            restarts,
            dry_run,
            left,
        } = self;
        if *dry_run {
            write!(
                f,
                "dry run: {read} object(s) of {crd} read as {storage_version}, every write accepted by the API server, nothing written; storedVersions stays {stored_before:?} (would become [{storage_version:?}])"
            )?;
        } else {
            write!(
                f,
                "{crd}: {read} object(s) read as {storage_version}: {rewritten} rewritten, {unchanged} already stored as {storage_version}, {gone} deleted meanwhile; storedVersions {stored_before:?} -> [{storage_version:?}]"
            )?;
        }
        if !left.is_empty() {
            write!(
                f,
                "; {} object(s) left behind (storedVersions unchanged)",
                left.len()
            )?;
        }
        if conflicts + restarts > 0 {
            write!(
                f,
                " ({conflicts} conflicting write(s) retried, list restarted {restarts} time(s))"
            )?;
        }
        Ok(())
    }
}

/// Why the migration stopped; each says what to do. Running it again is always safe.
#[derive(Debug, Error)]
pub enum MigrateError {
    #[error("reading CustomResourceDefinition {crd}: {source}. Is the CRD installed (cnat crd | kubectl apply -f -), and may you get customresourcedefinitions?")]
    Crd { crd: String, source: kube::Error },
    #[error("CustomResourceDefinition {0} has no version with storage: true; apply the CRD from `cnat crd`")]
    NoStorageVersion(String),
    #[error("listing {crd} objects as {version}: {source}. If reading them needs a conversion webhook, is a cnat replica of this release running (it serves /convert)?")]
    List {
        crd: String,
        version: String,
        source: kube::Error,
    },
    #[error("the list of {crd} objects expired {MAX_RESTARTS} times (410 Gone) before it was read to the end; run cnat migrate-storage again (it skips nothing it has not checked, and what is done is a no-op), with a higher --concurrency")]
    Expired { crd: String },
    #[error("the storage version of {crd} changed from {was} to {now} while the objects were rewritten; run cnat migrate-storage again")]
    StorageChanged {
        crd: String,
        was: String,
        now: String,
    },
    #[error("{} object(s) of {} could not be rewritten, so status.storedVersions stays {:?}; fix each and run cnat migrate-storage again (what was rewritten stays rewritten):{}", .0.left.len(), .0.crd, .0.stored_before, list_left(&.0.left))]
    LeftBehind(Box<Report>),
    #[error("setting status.storedVersions of {crd} to [{version}]: {source}. Every object is stored as {version} now: running cnat migrate-storage again finishes this")]
    StoredVersions {
        crd: String,
        version: String,
        source: kube::Error,
    },
}

/// Objects listed in the error at most; the count says how many more.
const LISTED: usize = 50;

/// One line each, the first `LISTED`.
fn list_left(left: &[Left]) -> String {
    let mut lines: String = left
        .iter()
        .take(LISTED)
        .map(|l| format!("\n  {l}"))
        .collect();
    if left.len() > LISTED {
        lines += &format!("\n  ... and {} more", left.len() - LISTED);
    }
    lines
}

/// The version objects of `crd` are stored in (the one with `storage: true`).
pub fn storage_version(crd: &CustomResourceDefinition) -> Option<&str> {
    crd.spec
        .versions
        .iter()
        .find(|v| v.storage)
        .map(|v| v.name.as_str())
}

/// Migrates every object of `options.crd` to its storage version, calling `progress` after each
/// page with the counts so far.
pub async fn migrate(
    client: Client,
    options: &Options,
    mut progress: impl FnMut(&Report),
) -> Result<Report, MigrateError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crds
        .get(&options.crd)
        .await
        .map_err(|source| MigrateError::Crd {
            crd: options.crd.clone(),
            source,
        })?;
    let version = storage_version(&crd)
        .ok_or_else(|| MigrateError::NoStorageVersion(options.crd.clone()))?
        .to_owned();
    let mut report = Report {
        crd: options.crd.clone(),
        storage_version: version.clone(),
        stored_before: crd
            .status
            .as_ref()
            .and_then(|s| s.stored_versions.clone())
            .unwrap_or_default(),
        dry_run: options.dry_run,
        ..Report::default()
    };
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(&crd.spec.group, &version, &crd.spec.names.kind),
        &crd.spec.names.plural,
    );
    let all: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    let params = PostParams {
        dry_run: options.dry_run,
        field_manager: Some(MANAGER.to_owned()),
    };
    let mut token: Option<String> = None;
    // Objects written (or checked) so far, by uid: after the list restarts they are skipped.
    let mut done = std::collections::HashSet::new();
    loop {
        let mut list = ListParams::default().limit(options.page_size);
        if let Some(token) = &token {
            list = list.continue_token(token);
        }
        let page = match all.list(&list).await {
            Ok(page) => page,
            Err(kube::Error::Api(e)) if e.code == 410 && report.restarts < MAX_RESTARTS => {
                // The continue token expired: from the start, skipping what is done.
                report.restarts += 1;
                token = None;
                continue;
            }
            Err(kube::Error::Api(e)) if e.code == 410 => {
                return Err(MigrateError::Expired {
                    crd: options.crd.clone(),
                })
            }
            Err(source) => {
                return Err(MigrateError::List {
                    crd: options.crd.clone(),
                    version,
                    source,
                })
            }
        };
        let fresh: Vec<DynamicObject> = page
            .items
            .into_iter()
            .filter(|o| o.uid().is_none_or(|uid| !done.contains(&uid)))
            .collect();
        report.read += fresh.len();
        done.extend(fresh.iter().filter_map(|o| o.uid()));
        // Every object is tried: one the API server will not take back is reported, not the
        // end of the migration.
        let outcomes: Vec<(Written, usize)> = futures::stream::iter(fresh)
            .map(|object| rewrite(&client, &resource, object, &params))
            .buffer_unordered(options.concurrency.max(1))
            .collect()
            .await;
        for (written, conflicts) in outcomes {
            report.conflicts += conflicts;
            match written {
                Written::Rewritten => report.rewritten += 1,
                Written::Unchanged => report.unchanged += 1,
                Written::Gone => report.gone += 1,
                Written::Left(left) => report.left.push(left),
            }
        }
        progress(&report);
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            break;
        }
    }
    if !report.left.is_empty() {
        report.left.sort_by(|a, b| a.object.cmp(&b.object));
        return Err(MigrateError::LeftBehind(Box::new(report)));
    }
    // Only if the storage version and the CRD are unchanged (its resourceVersion is the patch's
    // precondition). A dry run patches as a dry run: a missing right shows now.
    let stored_versions = |source| MigrateError::StoredVersions {
        crd: options.crd.clone(),
        version: version.clone(),
        source,
    };
    let now = crds.get(&options.crd).await.map_err(stored_versions)?;
    match storage_version(&now) {
        Some(v) if v == version => {}
        other => {
            return Err(MigrateError::StorageChanged {
                crd: options.crd.clone(),
                was: version.clone(),
                now: other.unwrap_or("none").to_owned(),
            })
        }
    }
    let patch = json!({
        "metadata": {"resourceVersion": now.resource_version()},
        "status": {"storedVersions": [version]}
    });
    let params = if options.dry_run {
        PatchParams::default().dry_run()
    } else {
        PatchParams::default()
    };
    crds.patch_status(&options.crd, &params, &Patch::Merge(patch))
        .await
        .map_err(stored_versions)?;
    Ok(report)
}

/// What one write did.
#[derive(Debug, Clone, PartialEq)]
pub enum Written {
    Rewritten,
    Unchanged,
    Gone,
    /// The API server would not take it back.
    Left(Left),
}

/// Writes `object` (of `resource`) back unchanged, reading it again after each conflict, so a
/// stale copy never overwrites a newer one; with the number of conflicts.
pub async fn rewrite(
    client: &Client,
    resource: &ApiResource,
    mut object: DynamicObject,
    params: &PostParams,
) -> (Written, usize) {
    let name = object.name_any();
    let (api, label): (Api<DynamicObject>, _) = match object.namespace() {
        Some(namespace) => (
            Api::namespaced_with(client.clone(), &namespace, resource),
            format!("{} {namespace}/{name}", resource.kind),
        ),
        None => (
            Api::all_with(client.clone(), resource),
            format!("{} {name}", resource.kind),
        ),
    };
    for conflicts in 0..MAX_CONFLICTS {
        // A list's items may come without apiVersion and kind; a write needs them.
        object.types = Some(TypeMeta {
            api_version: resource.api_version.clone(),
            kind: resource.kind.clone(),
        });
        let before = object.resource_version();
        match api.replace(&name, params, &object).await {
            // A dry run writes nothing, whatever the answer says.
            Ok(_) if params.dry_run => return (Written::Unchanged, conflicts),
            Ok(written) if written.resource_version() == before => {
                return (Written::Unchanged, conflicts)
            }
            Ok(_) => return (Written::Rewritten, conflicts),
            Err(kube::Error::Api(e)) if e.code == 404 => return (Written::Gone, conflicts),
            Err(kube::Error::Api(e)) if e.code == 409 => match api.get_opt(&name).await {
                Ok(Some(fresh)) => object = fresh,
                Ok(None) => return (Written::Gone, conflicts + 1),
                Err(error) => return (Written::Left(Left::new(label, &error)), conflicts + 1),
            },
            Err(error) => return (Written::Left(Left::new(label, &error)), conflicts),
        }
    }
    let left = Left {
        object: label,
        why: format!("{MAX_CONFLICTS} writes in a row conflicted with other writers"),
        fix: "run cnat migrate-storage again",
    };
    (Written::Left(left), MAX_CONFLICTS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_storage_version_is_the_one_marked_storage() {
        let crd: CustomResourceDefinition = serde_json::from_value(json!({
            "metadata": {"name": "ats.cnat.programming-kubernetes.info"},
            "spec": {"group": "cnat.programming-kubernetes.info", "scope": "Namespaced",
                "names": {"kind": "At", "plural": "ats"},
                "versions": [
                    {"name": "v1alpha1", "served": true, "storage": false},
                    {"name": "v1", "served": true, "storage": true}
                ]}
        }))
        .unwrap();
        assert_eq!(storage_version(&crd), Some("v1"));
        let mut none = crd;
        none.spec.versions[1].storage = false;
        assert_eq!(storage_version(&none), None);
    }

    #[test]
    fn reports_say_what_was_done_and_what_a_dry_run_would_do() {
        let mut report = Report {
            crd: CRD_NAME.into(),
            storage_version: "v1".into(),
            stored_before: vec!["v1alpha1".into(), "v1".into()],
            read: 1200,
            rewritten: 1190,
            unchanged: 9,
            gone: 1,
            conflicts: 2,
            restarts: 0,
            dry_run: false,
            left: Vec::new(),
        };
        assert_eq!(
            report.to_string(),
            "ats.cnat.programming-kubernetes.info: 1200 object(s) read as v1: 1190 rewritten, 9 already stored as v1, 1 deleted meanwhile; storedVersions [\"v1alpha1\", \"v1\"] -> [\"v1\"] (2 conflicting write(s) retried, list restarted 0 time(s))"
        );
        report.dry_run = true;
        assert!(report.to_string().starts_with(
            "dry run: 1200 object(s) of ats.cnat.programming-kubernetes.info read as v1, every write accepted"
        ));
    }
}
