//! The escalation guard: an At runs a pod with the image and command it names, so whoever
//! creates an At (or changes its spec) must be allowed to create pods in its namespace. The
//! validating webhook asks the API server with a SubjectAccessReview built from the request's
//! `userInfo`, caches answers briefly per (user, groups, namespace), bounds the review's time, and
//! denies, with a message naming the missing permission, when the answer is no or (by default)
//! when no answer comes.

use futures::future::{BoxFuture, FutureExt, Shared};
use k8s_openapi::api::authentication::v1::UserInfo;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::{Api, Client};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::{timeout, Instant};

/// Most cached answers; past this, expired ones are dropped, and new ones not cached while it
/// stays full.
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

/// What one review came to.
#[derive(Debug, Clone)]
enum Reviewed {
    Allowed,
    /// No, with the authorizer's reason.
    Denied(Option<String>),
    /// No answer (an error, a timeout, an evaluation error): never cached.
    Unanswered(String),
}

/// A review in flight, shared by every request that needs its answer.
type Asking = Shared<BoxFuture<'static, Reviewed>>;

/// Answers, each with when its question was sent, and the reviews in flight.
#[derive(Default)]
struct Reviews {
    answers: HashMap<Key, (Instant, Reviewed)>,
    asking: HashMap<Key, Asking>,
}

/// Asks the API server, with a short-lived cache. Concurrent requests with the same key share
/// one review (single flight); an answer past half its life is refreshed in the background
/// while it is still served, so after the first request per key, admissions that keep coming
/// never wait on the API server. No answer is ever served older than `cache_ttl`.
pub struct AccessReviewer {
    inner: Arc<Inner>,
}

struct Inner {
    api: Api<SubjectAccessReview>,
    settings: Settings,
    reviews: Mutex<Reviews>,
}

impl AccessReviewer {
    pub fn new(client: Client, settings: Settings) -> Self {
        AccessReviewer {
            inner: Arc::new(Inner {
                api: Api::all(client),
                settings,
                reviews: Mutex::default(),
            }),
        }
    }

    /// The verdict from a cached answer, without waiting: `None` when there is none (then
    /// `check`). An answer past half its life is refreshed in the background.
    pub fn cached(&self, user: &UserInfo, namespace: &str) -> Option<Result<(), String>> {
        let key = Key::new(user, namespace);
        let answer = self.fresh(&mut self.inner.lock(), key, user, namespace)?;
        Some(self.verdict(user, namespace, answer))
    }

    /// `Ok` when `user` may create pods in `namespace`, else the denial message.
    pub async fn check(&self, user: &UserInfo, namespace: &str) -> Result<(), String> {
        let key = Key::new(user, namespace);
        let asking = {
            let mut reviews = self.inner.lock();
            if let Some(answer) = self.fresh(&mut reviews, key.clone(), user, namespace) {
                return self.verdict(user, namespace, answer);
            }
            match reviews.asking.get(&key) {
                Some(asking) => asking.clone(),
                None => {
                    let asking = Inner::ask(&self.inner, key.clone(), user, namespace);
                    reviews.asking.insert(key, asking.clone());
                    // Driven to its end (at most the timeout) even if every request waiting
                    // for it goes away, so it never lingers with an answer from long ago.
                    tokio::spawn(asking.clone());
                    asking
                }
            }
        };
        let answer = asking.await;
        self.verdict(user, namespace, answer)
    }

    /// The cached answer for `key` if younger than the TTL; past half its life, a refresh is
    /// started (one at a time).
    fn fresh(
        &self,
        reviews: &mut Reviews,
        key: Key,
        user: &UserInfo,
        namespace: &str,
    ) -> Option<Reviewed> {
        let ttl = self.inner.settings.cache_ttl;
        let (asked, answer) = reviews.answers.get(&key)?;
        let age = Instant::now().duration_since(*asked);
        if age >= ttl {
            return None;
        }
        let answer = answer.clone();
        if age >= ttl / 2 && !reviews.asking.contains_key(&key) {
            let refresh = Inner::ask(&self.inner, key.clone(), user, namespace);
            reviews.asking.insert(key, refresh.clone());
            tokio::spawn(refresh);
        }
        Some(answer)
    }

    fn verdict(&self, user: &UserInfo, namespace: &str, answer: Reviewed) -> Result<(), String> {
        match answer {
            Reviewed::Allowed => Ok(()),
            Reviewed::Denied(reason) => Err(denial(user, namespace, reason.as_deref())),
            Reviewed::Unanswered(error) => match self.inner.settings.on_error {
                OnError::Allow => Ok(()),
                OnError::Deny => Err(unanswered(namespace, &error)),
            },
        }
    }
}

impl Inner {
    /// The review for `key`, bounded in time; its answer goes into the cache (unless there was
    /// none) and it leaves the reviews in flight, whoever polls it to the end.
    fn ask(inner: &Arc<Inner>, key: Key, user: &UserInfo, namespace: &str) -> Asking {
        let (inner, question) = (inner.clone(), review(user, namespace));
        let namespace = namespace.to_owned();
        async move {
            let asked = Instant::now();
            let reviewed = match timeout(
                inner.settings.timeout,
                inner.api.create(&PostParams::default(), &question),
            )
            .await
            {
                Ok(Ok(reviewed)) => {
                    let status = reviewed.status.unwrap_or_default();
                    match status.evaluation_error.filter(|e| !e.is_empty()) {
                        _ if status.allowed => Reviewed::Allowed,
                        // The authorizer could not decide (e.g. a webhook authorizer failed).
                        Some(error) => Reviewed::Unanswered(format!("evaluation error: {error}")),
                        None => Reviewed::Denied(status.reason),
                    }
                }
                Ok(Err(error)) => Reviewed::Unanswered(error.to_string()),
                Err(_) => Reviewed::Unanswered(format!(
                    "no answer within {:?}",
                    inner.settings.timeout
                )),
            };
            let mut reviews = inner.lock();
            reviews.asking.remove(&key);
            match &reviewed {
                Reviewed::Unanswered(error) => {
                    tracing::warn!(namespace, error, on_error = ?inner.settings.on_error, "SubjectAccessReview failed");
                }
                answer => {
                    let (ttl, now) = (inner.settings.cache_ttl, Instant::now());
                    if reviews.answers.len() >= MAX_CACHED {
                        reviews.answers.retain(|_, (at, _)| now.duration_since(*at) < ttl);
                    }
                    if reviews.answers.len() < MAX_CACHED {
                        reviews.answers.insert(key, (asked, answer.clone()));
                    }
                }
            }
            reviewed
        }
        .boxed()
        .shared()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Reviews> {
        self.reviews.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests;
