//! The escalation guard: an At runs a pod with the image and command it names, so whoever
//! creates an At (or changes its spec) must be allowed to create pods in its namespace. The
//! validating webhook asks the API server with a SubjectAccessReview built from the request's
//! `userInfo`, caches answers briefly per (user, groups, namespace), bounds the review's time, and
//! denies, with a message naming the missing permission, when the answer is no or (by default)
//! when no answer comes.

use k8s_openapi::api::authentication::v1::UserInfo;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::{Api, Client};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::{timeout, Instant};

/// Most cached answers; past this, the oldest half is dropped.
const MAX_CACHED: usize = 10_000;

/// What to do when the API server gives no answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnError {
    /// Deny the At (safe: nobody gets a pod they may not create).
    Deny,
    /// Allow the At (available: applies never wait for the review).
    Allow,
}

/// How the guard behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub cache_ttl: Duration,
    pub timeout: Duration,
    pub on_error: OnError,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            cache_ttl: Duration::from_secs(10),
            timeout: Duration::from_secs(2),
            on_error: OnError::Deny,
        }
    }
}

/// The question asked: may this user create pods in this namespace?
pub fn review(user: &UserInfo, namespace: &str) -> SubjectAccessReview {
    SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: user.username.clone(),
            uid: user.uid.clone(),
            groups: user.groups.clone(),
            extra: user.extra.clone(),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(namespace.to_owned()),
                verb: Some("create".into()),
                group: Some(String::new()),
                resource: Some("pods".into()),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    }
}

/// The denial for a `no`, naming the user, the missing permission, the namespace and the fix.
pub fn denial(user: &UserInfo, namespace: &str, reason: Option<&str>) -> String {
    let who = user.username.as_deref().unwrap_or("this user");
    let why = reason
        .filter(|r| !r.is_empty())
        .map(|r| format!(" ({r})"))
        .unwrap_or_default();
    format!(
        "{who} may not create pods in namespace {namespace}{why}, and an At runs a pod there with the image and command it names; ask for create on pods in {namespace} (e.g. a RoleBinding to the edit ClusterRole), or have someone who has it create the At"
    )
}

/// The message when no answer came and the guard denies.
pub fn unanswered(namespace: &str, error: &str) -> String {
    format!(
        "cnat could not check whether you may create pods in namespace {namespace} (SubjectAccessReview: {error}), and an At runs a pod there; try again, or ask the cluster administrator (the chart value webhook.accessReview.onError=allow lets Ats through when the review fails)"
    )
}

/// Everything the review sends, so two requests share an answer only if the API server would
/// be asked the same question: user, uid, groups and extra (each sorted), namespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    user: String,
    uid: String,
    groups: Vec<String>,
    extra: Vec<(String, Vec<String>)>,
    namespace: String,
}

impl Key {
    fn new(user: &UserInfo, namespace: &str) -> Self {
        let mut groups = user.groups.clone().unwrap_or_default();
        groups.sort();
        let mut extra: Vec<(String, Vec<String>)> = user
            .extra
            .iter()
            .flatten()
            .map(|(key, values)| {
                let mut values = values.clone();
                values.sort();
                (key.clone(), values)
            })
            .collect();
        extra.sort();
        Key {
            user: user.username.clone().unwrap_or_default(),
            uid: user.uid.clone().unwrap_or_default(),
            groups,
            extra,
            namespace: namespace.to_owned(),
        }
    }
}

/// Cached answers: when each was given, and `Err(denial)` or `Ok`.
type Cache = HashMap<Key, (Instant, Result<(), String>)>;

/// Asks the API server, with a short-lived cache.
pub struct AccessReviewer {
    reviews: Api<SubjectAccessReview>,
    settings: Settings,
    /// Per (user, groups, namespace).
    cache: Mutex<Cache>,
}

impl AccessReviewer {
    pub fn new(client: Client, settings: Settings) -> Self {
        AccessReviewer {
            reviews: Api::all(client),
            settings,
            cache: Mutex::default(),
        }
    }

    /// `Ok` when `user` may create pods in `namespace`, else the denial message.
    pub async fn check(&self, user: &UserInfo, namespace: &str) -> Result<(), String> {
        let key = Key::new(user, namespace);
        let now = Instant::now();
        if let Some((at, answer)) = self.lock().get(&key) {
            if now.duration_since(*at) < self.settings.cache_ttl {
                return answer.clone();
            }
        }
        let (params, question) = (PostParams::default(), review(user, namespace));
        let asked = self.reviews.create(&params, &question);
        let answer = match timeout(self.settings.timeout, asked).await {
            Ok(Ok(reviewed)) => {
                let status = reviewed.status.unwrap_or_default();
                if status.allowed {
                    Ok(())
                } else if let Some(error) = status.evaluation_error.filter(|e| !e.is_empty()) {
                    // The authorizer could not decide (e.g. a webhook authorizer failed): no
                    // answer, so not cached.
                    return self.unanswered(namespace, &format!("evaluation error: {error}"));
                } else {
                    Err(denial(user, namespace, status.reason.as_deref()))
                }
            }
            // No answer: not cached, so the next request asks again.
            Ok(Err(error)) => return self.unanswered(namespace, &error.to_string()),
            Err(_) => {
                let waited = format!("no answer within {:?}", self.settings.timeout);
                return self.unanswered(namespace, &waited);
            }
        };
        let mut cache = self.lock();
        if cache.len() >= MAX_CACHED {
            let ttl = self.settings.cache_ttl;
            cache.retain(|_, (at, _)| now.duration_since(*at) < ttl);
        }
        if cache.len() < MAX_CACHED {
            cache.insert(key, (now, answer.clone()));
        }
        answer
    }

    fn unanswered(&self, namespace: &str, error: &str) -> Result<(), String> {
        tracing::warn!(namespace, error, on_error = ?self.settings.on_error, "SubjectAccessReview failed");
        match self.settings.on_error {
            OnError::Allow => Ok(()),
            OnError::Deny => Err(unanswered(namespace, error)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests;
