//! cnat's signature on the pods it creates (an HMAC-SHA256 of the At's uid and the pod's name
//! under a key kept in a Secret), which tells them from a pod someone else made by that name.
//! See docs/src/operating/security.md, "Pods cnat did not create".

use base64::Engine;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{Api, PostParams};
use ring::hmac;
use ring::rand::SecureRandom;
use std::sync::Arc;

/// The Secret's key that holds the signing key.
pub const SECRET_KEY: &str = "key";

/// How many bytes the signing key has (SHA-256's block is 64; its output 32).
const KEY_BYTES: usize = 32;

/// How long a signature is, as written (unpadded URL-safe base64 of the 32-byte tag).
pub const SIGNATURE_LEN: usize = 43;

/// The key pods are signed with.
#[derive(Clone)]
pub struct Key(Arc<hmac::Key>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    /// A key from its bytes (at least 32 of them).
    pub fn from_bytes(bytes: &[u8]) -> Result<Key, SigningError> {
        if bytes.len() < KEY_BYTES {
            return Err(SigningError::Short(bytes.len()));
        }
        Ok(Key(Arc::new(hmac::Key::new(hmac::HMAC_SHA256, bytes))))
    }

    /// A new random key, and its bytes (to store).
    pub fn generate() -> (Key, Vec<u8>) {
        let mut bytes = vec![0; KEY_BYTES];
        ring::rand::SystemRandom::new()
            .fill(&mut bytes)
            .expect("the operating system's random source");
        let key = Key::from_bytes(&bytes).expect("KEY_BYTES long");
        (key, bytes)
    }

    /// The signature of the pod `pod_name` of the At whose uid is `at_uid`.
    pub fn sign(&self, at_uid: &str, pod_name: &str) -> String {
        let tag = hmac::sign(&self.0, &message(at_uid, pod_name));
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(tag.as_ref())
    }

    /// Whether `signature` is this key's for that pod of that At (compared in constant time).
    pub fn verifies(&self, at_uid: &str, pod_name: &str, signature: &str) -> bool {
        if signature.len() != SIGNATURE_LEN {
            return false;
        }
        let Ok(tag) = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(signature) else {
            return false;
        };
        hmac::verify(&self.0, &message(at_uid, pod_name), &tag).is_ok()
    }
}

/// What is signed: the uid and the name, which neither contains a `/`.
fn message(at_uid: &str, pod_name: &str) -> Vec<u8> {
    format!("{at_uid}/{pod_name}").into_bytes()
}

/// Why the signing key could not be had.
#[derive(Debug, thiserror::Error)]
pub enum SigningError {
    #[error("the signing key has {0} bytes; it needs at least 32")]
    Short(usize),
    #[error("Secret {namespace}/{name} has no {SECRET_KEY:?} of at least 32 bytes; put 32 random bytes there, keeping the Secret (security.md: \"Pods cnat did not create\"; pods started but not yet recorded as RUNNING are then refused as not cnat's)")]
    Unusable { namespace: String, name: String },
    #[error("could not read or create Secret {namespace}/{name} (the operator's role needs get and create on it): {source}")]
    Api {
        namespace: String,
        name: String,
        source: kube::Error,
    },
}

/// The key pods are signed with, and since when cnat signs: a pod the API server created before
/// `since` (the Secret's creation) counts as cnat's without a signature.
#[derive(Debug, Clone)]
pub struct Signing {
    pub key: Key,
    pub since: Option<chrono::DateTime<chrono::Utc>>,
}

impl Signing {
    /// `key`, with no pod older than it taken without a signature.
    pub fn new(key: Key) -> Signing {
        Signing { key, since: None }
    }
}

/// Where the key comes from: a Secret (read, or created by the first replica that needs it), or
/// a key given (tests).
#[derive(Debug, Clone)]
pub enum Source {
    Secret { namespace: String, name: String },
    Given(Signing),
}

impl Source {
    /// The key in Secret `namespace/name`.
    pub fn secret(namespace: impl Into<String>, name: impl Into<String>) -> Source {
        Source::Secret {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// This key.
    pub fn given(key: Key) -> Source {
        Source::Given(Signing::new(key))
    }

    /// The key, read (or made) anew for each leadership: a Secret replaced since the last one
    /// takes effect at the next.
    pub async fn signing(&self, client: &kube::Client) -> Result<Signing, SigningError> {
        match self {
            Source::Given(signing) => Ok(signing.clone()),
            Source::Secret { namespace, name } => obtain(client, namespace, name).await,
        }
    }
}

/// The key in Secret `namespace/name`; a new one, stored there, when the Secret does not exist
/// (the replica whose create comes second reads the first one's).
async fn obtain(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<Signing, SigningError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let fail = |source| SigningError::Api {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        source,
    };
    let since = |secret: &Secret| {
        let created = secret.metadata.creation_timestamp.as_ref();
        created.map(crate::schedule::to_chrono)
    };
    let read = |secret: Secret| {
        let since = since(&secret);
        let bytes = secret.data.and_then(|mut data| data.remove(SECRET_KEY));
        let key = bytes
            .and_then(|ByteString(bytes)| Key::from_bytes(&bytes).ok())
            .ok_or_else(|| SigningError::Unusable {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            })?;
        Ok(Signing { key, since })
    };
    if let Some(secret) = api.get_opt(name).await.map_err(fail)? {
        return read(secret);
    }
    let (key, bytes) = Key::generate();
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some([("app.kubernetes.io/managed-by".to_owned(), "cnat".to_owned())].into()),
            ..Default::default()
        },
        data: Some([(SECRET_KEY.to_owned(), ByteString(bytes))].into()),
        type_: Some("Opaque".to_owned()),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(created) => Ok(Signing {
            key,
            since: since(&created),
        }),
        Err(kube::Error::Api(status)) if status.is_already_exists() => {
            read(api.get(name).await.map_err(fail)?)
        }
        Err(source) => Err(fail(source)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_holds_for_its_at_and_pod_only_and_under_its_key_only() {
        let (key, bytes) = Key::generate();
        assert_eq!(bytes.len(), KEY_BYTES);
        let signature = key.sign("uid-1", "x-pod");
        assert_eq!(signature.len(), SIGNATURE_LEN);
        assert!(key.verifies("uid-1", "x-pod", &signature));
        assert_eq!(
            Key::from_bytes(&bytes).unwrap().sign("uid-1", "x-pod"),
            signature
        );
        assert!(!key.verifies("uid-2", "x-pod", &signature));
        assert!(!key.verifies("uid-1", "y-pod", &signature));
        assert!(!key.verifies("uid-1/x", "pod", &signature));
        let (other, _) = Key::generate();
        assert!(!other.verifies("uid-1", "x-pod", &signature));
        for forged in [
            "",
            "x",
            &"A".repeat(SIGNATURE_LEN),
            &format!("{signature}="),
        ] {
            assert!(!key.verifies("uid-1", "x-pod", forged), "{forged}");
        }
        assert!(matches!(
            Key::from_bytes(&[0; 31]),
            Err(SigningError::Short(31))
        ));
    }
}
