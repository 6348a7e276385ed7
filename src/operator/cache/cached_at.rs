//! `CachedAt`: an At in the compact form the cache keeps (name, namespace, resourceVersion and
//! what the metrics read kept apart, the rest as packed JSON), read back with `at()`.
//! See docs/src/design/decisions.md, "The At cache".

use super::meta;
use super::pack::{self, Rest};
use crate::api::{At, AtSpec, AtStatus, Phase};
use crate::operator::key::AtKey;
use crate::operator::pod::Stuck;
use crate::schedule;
use crate::shard;
use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::NamespaceResourceScope;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde::Deserialize;
use std::borrow::Cow;
use tracing::error;

/// An At as the cache keeps it, trimmed and compacted. An At that does not decode (e.g. an
/// `exitCode` past int32, which kube-apiserver does not check) is kept as unreadable, with the
/// reason: one such At must not fail the list of every At.
#[derive(Clone, Debug)]
pub struct CachedAt {
    /// Name, namespace and resourceVersion (which the watch resumes from) only: the rest is in
    /// `packed`.
    metadata: ObjectMeta,
    phase: Phase,
    /// Its shard label's value (`shard::value_of`), `NO_VALUE` when it has none: which shard list
    /// holds it, and the label itself, which is not kept twice.
    label: u8,
    /// The instant the schedule names; `None` when it does not parse.
    due: Option<DateTime<Utc>>,
    /// Its spec sets `ttlSecondsAfterFinished` (a DONE At is then deleted some time after).
    ttl: bool,
    /// What keeps its pod from starting the command, as its status shows it (`cnat_ats_stuck`).
    stuck: Option<Stuck>,
    /// The rest of the trimmed At (`Rest`), as JSON compressed with LZ4 against a dictionary of
    /// what every At repeats (`pack`).
    pub(super) packed: Box<[u8]>,
    /// Why the At did not decode; `packed` is then empty.
    unreadable: Option<Box<str>>,
}

/// Through a JSON value, which any deserializer can give (a watch event's object comes through
/// serde's buffered content, which cannot give raw JSON text).
impl<'de> Deserialize<'de> for CachedAt {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        Ok(CachedAt::decode(&value))
    }
}

/// What the cache decodes of an At: its metadata without managedFields and annotations
/// (`meta::KeptMeta`), its spec and its status.
#[derive(Deserialize)]
struct Incoming {
    metadata: meta::KeptMeta,
    spec: AtSpec,
    #[serde(default)]
    status: Option<AtStatus>,
}

impl From<Incoming> for At {
    fn from(incoming: Incoming) -> At {
        let Incoming {
            metadata: m,
            spec,
            status,
        } = incoming;
        let mut at = At::new(m.0.name.as_deref().unwrap_or_default(), spec);
        at.metadata = m.0;
        at.status = status;
        at
    }
}

impl CachedAt {
    /// Decodes an At from its JSON text (an item of a list); what does not decode is kept as
    /// unreadable.
    pub fn decode_text(json: &str) -> CachedAt {
        match serde_json::from_str::<Incoming>(json) {
            Ok(incoming) => At::from(incoming).into(),
            // The slow way, which says why and keeps what it can.
            Err(_) => match serde_json::from_str::<serde_json::Value>(json) {
                Ok(value) => CachedAt::decode(&value),
                Err(error) => CachedAt::undecodable(ObjectMeta::default(), error.to_string()),
            },
        }
    }

    /// Decodes an At from its JSON; what does not decode is kept as unreadable.
    pub fn decode(json: &serde_json::Value) -> CachedAt {
        match Incoming::deserialize(json) {
            Ok(incoming) => At::from(incoming).into(),
            Err(error) => {
                let meta = json
                    .get("metadata")
                    .and_then(|m| ObjectMeta::deserialize(m).ok())
                    .unwrap_or_default();
                CachedAt::undecodable(meta, error.to_string())
            }
        }
    }

    fn undecodable(meta: ObjectMeta, why: String) -> CachedAt {
        CachedAt {
            label: label_of(&meta),
            metadata: ObjectMeta {
                name: meta.name,
                namespace: meta.namespace,
                resource_version: meta.resource_version,
                uid: meta.uid,
                ..ObjectMeta::default()
            },
            phase: Phase::Pending,
            due: None,
            ttl: false,
            stuck: None,
            packed: Box::default(),
            unreadable: Some(why.into()),
        }
    }

    /// Why this At could not be read, if it could not.
    pub fn unreadable(&self) -> Option<&str> {
        self.unreadable.as_deref()
    }

    /// Which of the shard lists (`shard::selectors()`) holds this At.
    pub fn list(&self) -> usize {
        shard::list_of_value(self.value())
    }

    /// Its shard label's value, when it is one the webhook gives.
    fn value(&self) -> Option<u8> {
        (self.label != NO_VALUE).then_some(self.label)
    }
}

/// `CachedAt::label` of an At without a shard label value.
const NO_VALUE: u8 = u8::MAX;

/// `CachedAt::label` of an At with this metadata.
fn label_of(meta: &ObjectMeta) -> u8 {
    shard::value_of(meta.labels.as_ref()).unwrap_or(NO_VALUE)
}

impl From<At> for CachedAt {
    fn from(at: At) -> Self {
        let due = schedule::parse(&at.spec.schedule, at.spec.time_zone.as_deref()).ok();
        let ttl = at.spec.ttl_seconds_after_finished.is_some();
        let phase = at.phase();
        let stuck = at.status.as_ref().and_then(Stuck::shown);
        let At {
            mut metadata,
            spec,
            status,
            ..
        } = at;
        let key = ObjectMeta {
            name: metadata.name.take(),
            namespace: metadata.namespace.take(),
            resource_version: metadata.resource_version.take(),
            ..ObjectMeta::default()
        };
        let label = label_of(&metadata);
        // Of the rest of its metadata only what cnat reads, all of bounded size: not its labels,
        // annotations, finalizers, owner references or managed fields, which may be huge.
        let metadata = ObjectMeta {
            uid: metadata.uid,
            generation: metadata.generation,
            creation_timestamp: metadata.creation_timestamp,
            deletion_timestamp: metadata.deletion_timestamp,
            deletion_grace_period_seconds: metadata.deletion_grace_period_seconds,
            ..ObjectMeta::default()
        };
        let rest = Rest {
            metadata,
            spec,
            status,
        };
        // It serializes: its maps have string keys. Were that ever to fail, reading it back
        // fails too, and says so; this says why.
        let json = serde_json::to_vec(&rest).unwrap_or_else(|error| {
            error!(%error, at = ?key.name, namespace = ?key.namespace, "caching an At");
            Vec::new()
        });
        CachedAt {
            label,
            metadata: key,
            phase,
            due,
            ttl,
            stuck,
            packed: pack::pack(&json),
            unreadable: None,
        }
    }
}

impl CachedAt {
    /// The At, as it was cached. An error means the cache holds what the At type cannot read
    /// back, which is a bug: callers log it and leave the At alone.
    pub fn at(&self) -> Result<At, CacheError> {
        if let Some(why) = &self.unreadable {
            return Err(CacheError {
                at: AtKey::of(self),
                source: Fault::Unreadable(why.to_string()),
            });
        }
        let fault = |source| CacheError {
            at: AtKey::of(self),
            source,
        };
        let json = pack::unpack(&self.packed).map_err(|e| fault(Fault::Lz4(e)))?;
        let rest: Rest = serde_json::from_slice(&json).map_err(|e| fault(Fault::Json(e)))?;
        let mut at = At::new(&self.name_any(), rest.spec);
        at.metadata = ObjectMeta {
            name: self.metadata.name.clone(),
            namespace: self.metadata.namespace.clone(),
            resource_version: self.metadata.resource_version.clone(),
            ..rest.metadata
        };
        if let Some(value) = self.value() {
            let labels = at.metadata.labels.get_or_insert_with(Default::default);
            labels.insert(shard::LABEL.to_owned(), value.to_string());
        }
        at.status = rest.status;
        Ok(at)
    }

    /// The phase, `PENDING` while no status was written.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The instant the schedule names, `None` when it does not parse.
    pub fn due(&self) -> Option<DateTime<Utc>> {
        self.due
    }

    /// Whether its spec sets `ttlSecondsAfterFinished`.
    pub fn sets_ttl(&self) -> bool {
        self.ttl
    }

    /// What keeps its pod from starting the command, as its status shows it.
    pub fn stuck(&self) -> Option<Stuck> {
        self.stuck
    }

    /// The At this cached copy is of, by name and namespace.
    pub fn key(cached: &CachedAt) -> AtKey {
        AtKey::of(cached)
    }

    /// The same At's key in the runtime's queue of Ats to reconcile.
    pub fn key_of(at: &AtKey) -> ObjectRef<CachedAt> {
        at.to_ref()
    }
}

#[cfg(test)]
impl CachedAt {
    /// The bytes its JSON takes packed (`pack`), and what LZ4 alone makes of the same JSON.
    pub(crate) fn packed_sizes(&self) -> (usize, usize) {
        let json = pack::unpack(&self.packed).unwrap_or_default();
        let alone = lz4_flex::block::compress_prepend_size(&json);
        (self.packed.len(), alone.len())
    }

    /// An At running `true` at `schedule`, in `phase` (`None`: no status yet), as cached.
    pub(crate) fn example(
        name: &str,
        namespace: &str,
        schedule: &str,
        phase: Option<Phase>,
    ) -> Self {
        let mut at = At::new(
            name,
            AtSpec {
                schedule: schedule.into(),
                command: "true".into(),
                ..AtSpec::default()
            },
        );
        at.metadata.namespace = Some(namespace.into());
        at.status = phase.map(|phase| AtStatus {
            phase,
            ..AtStatus::default()
        });
        at.into()
    }
}

/// A cached At that does not read back as an At (a bug in cnat).
#[derive(Debug, thiserror::Error)]
#[error("At {at}: the cached copy does not read back ({source}); it is left alone until it changes. Please report this as a bug")]
pub struct CacheError {
    at: AtKey,
    source: Fault,
}

/// What went wrong reading a cached At back.
#[derive(Debug, thiserror::Error)]
pub enum Fault {
    #[error("it does not decode as an At: {0}")]
    Unreadable(String),
    #[error("decompressing: {0}")]
    Lz4(lz4_flex::block::DecompressError),
    #[error("decoding: {0}")]
    Json(serde_json::Error),
}

/// The At's API identity: what the runtime queries, and what pods' owner references name.
impl Resource for CachedAt {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(dt: &()) -> Cow<'_, str> {
        At::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        At::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        At::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        At::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Reads `cached` back as an At; `None` if it does not read: an At the API server holds but
/// the At type cannot (the leader tells it in an event), or else a bug, which is logged.
pub fn read(cached: &CachedAt) -> Option<At> {
    if cached.unreadable.is_some() {
        return None;
    }
    cached
        .at()
        .inspect_err(|bug| error!(error = %bug, "cached At"))
        .ok()
}
