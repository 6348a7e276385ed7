//! An At's name: its namespace and name as one shared string, `namespace/name` (neither can
//! contain a `/`), cheap to clone (one `Arc`) and to hash, and looked up by `&str` too
//! (`Borrow<str>`), so `map["ns/name"]` works.

use crate::api::At;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;

/// The owner reference of `object`'s controller: for a pod cnat created, the At it runs for.
pub fn controller(object: &impl Resource) -> Option<&OwnerReference> {
    object
        .meta()
        .owner_references
        .iter()
        .flatten()
        .find(|owner| owner.controller == Some(true))
}

/// `namespace/name` of an At.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AtKey(Arc<str>);

impl AtKey {
    /// The key of `name` in `namespace` (`""` for none).
    pub fn new(namespace: &str, name: &str) -> Self {
        AtKey(format!("{namespace}/{name}").into())
    }

    /// The key of an object's namespace and name (an At, or its cached form).
    pub fn of(object: &impl Resource) -> Self {
        let meta = object.meta();
        AtKey::new(
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default(),
        )
    }

    /// The At's namespace (`""` for none).
    pub fn namespace(&self) -> &str {
        self.0
            .split_once('/')
            .map_or("", |(namespace, _)| namespace)
    }

    /// The At's name.
    pub fn name(&self) -> &str {
        self.0.split_once('/').map_or(&self.0, |(_, name)| name)
    }

    /// A reference to the At for kube's runtime (its queues and stores).
    pub fn to_ref<K: Resource<DynamicType = ()>>(&self) -> ObjectRef<K> {
        let namespace = Some(self.namespace()).filter(|ns| !ns.is_empty());
        let reference = ObjectRef::new(self.name());
        match namespace {
            Some(namespace) => reference.within(namespace),
            None => reference,
        }
    }
}

#[cfg(test)]
impl From<&ObjectRef<At>> for AtKey {
    fn from(at: &ObjectRef<At>) -> Self {
        AtKey::new(at.namespace.as_deref().unwrap_or_default(), &at.name)
    }
}

impl From<&At> for AtKey {
    fn from(at: &At) -> Self {
        AtKey::new(&at.namespace().unwrap_or_default(), &at.name_any())
    }
}

/// The same At as a reference to it (for tests and logs that hold one).
#[cfg(test)]
impl PartialEq<ObjectRef<At>> for AtKey {
    fn eq(&self, other: &ObjectRef<At>) -> bool {
        other.namespace.as_deref().unwrap_or_default() == self.namespace()
            && other.name == self.name()
    }
}

impl Borrow<str> for AtKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for AtKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for AtKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn a_key_names_the_at_as_logs_do_and_gives_its_parts_and_references_back() {
        let key = AtKey::new("team-a", "backup");
        assert_eq!(key.to_string(), "team-a/backup");
        assert_eq!((key.namespace(), key.name()), ("team-a", "backup"));
        let reference: ObjectRef<At> = key.to_ref();
        assert_eq!(reference, ObjectRef::new("backup").within("team-a"));
        assert_eq!(AtKey::from(&reference), key);
        let clusterwide = AtKey::new("", "x");
        assert_eq!(clusterwide.to_ref::<At>(), ObjectRef::new("x"));
        // Found by its text.
        let map = HashMap::from([(key.clone(), 3)]);
        assert_eq!(map["team-a/backup"], 3);
    }
}
