//! The escalation guard: whoever creates an At (or changes its spec) must be allowed to create
//! pods in its namespace, asked with a SubjectAccessReview; answers are cached and kept warm.
//! See docs/src/operating/security.md, "No privilege escalation through Ats".

use crate::observability::metrics::Metrics;
use crate::sync::lock;
use futures::future::{BoxFuture, FutureExt, Shared};
use k8s_openapi::api::authentication::v1::UserInfo;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::{Api, Client};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::time::{timeout, Instant, MissedTickBehavior};

/// Most cached answers, and most bytes they may hold; past either, expired answers are dropped,
/// then answers used only once (the oldest first), never one used more than once.
const MAX_CACHED: usize = 10_000;
const MAX_CACHED_BYTES: usize = 16 << 20;

/// The largest identity the guard asks about: its `userInfo` counted as its text plus
/// [`STRING_COST`] bytes a string. A review with more is denied without asking.
pub const MAX_USER_INFO_BYTES: usize = 64 << 10;

/// What a string of an identity costs beyond its text: a `String` and its share of the list.
pub const STRING_COST: usize = 48;

/// Most reviews a replica sends per second: for identities it has no answer for, in all and from
/// one client address, [`NEW_RESERVED_PER_SECOND`] of them kept for addresses asking fewer than
/// [`LIGHT_PER_SECOND_PER_CLIENT`] a second; for those it has or had, [`KNOWN_PER_SECOND`]. A
/// request past these is refused as busy, whatever `--access-review-on-error` says.
pub const NEW_PER_SECOND: u32 = 40;
pub const NEW_PER_SECOND_PER_CLIENT: u32 = 20;
pub const NEW_RESERVED_PER_SECOND: u32 = 20;
pub const LIGHT_PER_SECOND_PER_CLIENT: u32 = 4;

/// A resent review (the same identity and namespace from the same address as one refused as
/// busy within this) may use the reserved new budget as an address asking lightly does, up to
/// [`RETRIES_PER_SECOND_PER_CLIENT`] a second per address and [`RETRIES_PER_SECOND`] in all;
/// a refusal whose first cannot be told is to be denied, not resent.
pub const RETRY_WINDOW: Duration = Duration::from_secs(15);
pub const RETRIES_PER_SECOND: u32 = 8;
pub const RETRIES_PER_SECOND_PER_CLIENT: u32 = 2;
const MAX_REFUSALS_PER_CLIENT: usize = 64;
const MAX_REFUSING_CLIENTS: usize = 1024;

/// How long an identity allowed in a namespace counts as known after its answer, and how many
/// such (identity, namespace) pairs a replica remembers (past the bound, the older half goes).
pub const SEEN_FOR: Duration = Duration::from_secs(24 * 3600);
const MAX_SEEN: usize = 100_000;
pub const KNOWN_PER_SECOND: u32 = 100;
pub const KNOWN_PER_SECOND_PER_CLIENT: u32 = 30;

/// Most reviews the background upkeep starts per second, on average (those tried longest ago
/// first, the rest in a later round). They are also taken from the `KNOWN_PER_SECOND` budget.
const MAX_REFRESHES_PER_SECOND: u32 = KNOWN_PER_SECOND;

/// The shortest time between two rounds of the upkeep, whatever the TTL.
const MIN_PERIOD: Duration = Duration::from_millis(100);

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
    /// How long after its last use an answer is kept fresh in the background (zero: only
    /// while requests keep coming).
    pub keep_warm: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            cache_ttl: Duration::from_secs(10),
            timeout: Duration::from_secs(2),
            on_error: OnError::Deny,
            keep_warm: Duration::from_secs(120),
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

/// The denial for an identity over [`MAX_USER_INFO_BYTES`].
pub fn oversized(namespace: &str, bytes: usize, groups: usize) -> String {
    format!(
        "cnat refuses to check an identity of {bytes} bytes ({groups} groups), over its bound of {MAX_USER_INFO_BYTES} bytes and far beyond any real user's, so it cannot tell whether you may create pods in namespace {namespace}, and an At runs a pod there; ask the cluster administrator"
    )
}

/// The denial when the guard is asking about too many identities at once.
pub fn busy(namespace: &str) -> String {
    format!(
        "cnat could not check whether you may create pods in namespace {namespace}: it is asking the API server about too many identities at once (at most {NEW_PER_SECOND} new and {KNOWN_PER_SECOND} known ones a second, fewer for one caller), and an At runs a pod there; try again in a few seconds"
    )
}

/// The denial for `user` when their identity is over [`MAX_USER_INFO_BYTES`].
fn too_large(user: &UserInfo, namespace: &str) -> Option<String> {
    let bytes = user_info_bytes(user);
    let groups = user.groups.as_ref().map_or(0, Vec::len);
    (bytes > MAX_USER_INFO_BYTES).then(|| oversized(namespace, bytes, groups))
}

/// What `user`'s identity costs: its text, and [`STRING_COST`] a string.
pub fn user_info_bytes(user: &UserInfo) -> usize {
    let text = |s: &Option<String>| s.as_ref().map_or(0, |s| s.len() + STRING_COST);
    let strings = |v: &[String]| v.iter().map(|s| s.len() + STRING_COST).sum::<usize>();
    let groups = user.groups.as_deref().map_or(0, strings);
    let extra: usize = user
        .extra
        .iter()
        .flatten()
        .map(|(key, values)| key.len() + STRING_COST + strings(values))
        .sum();
    text(&user.username) + text(&user.uid) + groups + extra
}

/// A token bucket: `rate` a second, at most `burst` saved up. Pure: the caller says when it is.
#[derive(Debug, Clone, Copy)]
pub struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// `rate` a second, at most `seconds` of them saved up; full at `now`.
    pub fn new(rate: u32, seconds: u32, now: Instant) -> Self {
        let burst = f64::from(rate) * f64::from(seconds.max(1));
        Bucket {
            rate: f64::from(rate),
            burst,
            tokens: burst,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.at = now;
    }

    /// Whether a token is there at `now` (and takes it).
    pub fn take(&mut self, now: Instant) -> bool {
        self.take_above(0.0, now)
    }

    /// Whether a token is there at `now` beyond `reserve` ones kept for others (and takes it).
    pub fn take_above(&mut self, reserve: f64, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 + reserve {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Whole tokens there at `now`.
    pub fn available(&mut self, now: Instant) -> usize {
        self.refill(now);
        self.tokens as usize
    }

    /// Whether it is full at `now` (it can be forgotten: a new one is the same).
    fn full(&mut self, now: Instant) -> bool {
        self.refill(now);
        self.tokens >= self.burst
    }
}

/// The bucket of `client` in `by_client` (made full; full ones are forgotten when there are
/// many).
fn bucket_of(
    by_client: &mut HashMap<std::net::IpAddr, Bucket>,
    client: std::net::IpAddr,
    rate: u32,
    now: Instant,
) -> &mut Bucket {
    if by_client.len() >= 1024 {
        by_client.retain(|_, bucket| !bucket.full(now));
    }
    by_client
        .entry(client)
        .or_insert_with(|| Bucket::new(rate, 1, now))
}

/// The review budgets (see [`NEW_PER_SECOND`]).
struct Budgets {
    new: Bucket,
    new_by_client: HashMap<std::net::IpAddr, Bucket>,
    /// Per client address: whether it asks lightly (it may use the reserved new budget).
    light_by_client: HashMap<std::net::IpAddr, Bucket>,
    known: Bucket,
    known_by_client: HashMap<std::net::IpAddr, Bucket>,
    /// Resent reviews' share of the reserved new budget, in all and per client address.
    retries: Bucket,
    retries_by_client: HashMap<std::net::IpAddr, Bucket>,
}

impl Budgets {
    fn new(now: Instant) -> Self {
        Budgets {
            new: Bucket::new(NEW_PER_SECOND, 1, now),
            new_by_client: HashMap::new(),
            light_by_client: HashMap::new(),
            // Four seconds' worth: a round of the upkeep may start its budget at once, and a
            // second's worth is left to requests.
            known: Bucket::new(KNOWN_PER_SECOND, 4, now),
            known_by_client: HashMap::new(),
            retries: Bucket::new(RETRIES_PER_SECOND, 1, now),
            retries_by_client: HashMap::new(),
        }
    }

    /// A review asked for by `client`, of an identity with an answer (`known`) or without;
    /// `resent` when it is one refused as busy before (see [`RETRY_WINDOW`]). Nothing is
    /// spent when it is refused.
    fn take(&mut self, client: std::net::IpAddr, known: bool, resent: bool, now: Instant) -> bool {
        let client = crate::serving::guard::canonical(client);
        if known {
            let rate = KNOWN_PER_SECOND_PER_CLIENT;
            let mut mine = *bucket_of(&mut self.known_by_client, client, rate, now);
            if !mine.take(now) || !self.known.take(now) {
                return false;
            }
            *bucket_of(&mut self.known_by_client, client, rate, now) = mine;
            return true;
        }
        let (rate, light_rate) = (NEW_PER_SECOND_PER_CLIENT, LIGHT_PER_SECOND_PER_CLIENT);
        let mut mine = *bucket_of(&mut self.new_by_client, client, rate, now);
        if !mine.take(now) {
            return false;
        }
        let mut light = *bucket_of(&mut self.light_by_client, client, light_rate, now);
        let reserve = match light.take(now) {
            true => 0.0,
            false => f64::from(NEW_RESERVED_PER_SECOND),
        };
        let taken = self.new.take_above(reserve, now)
            || (resent && reserve > 0.0 && self.take_resent(client, now));
        if taken {
            *bucket_of(&mut self.new_by_client, client, rate, now) = mine;
            *bucket_of(&mut self.light_by_client, client, light_rate, now) = light;
        }
        taken
    }

    /// A resent review from `client` that found only the reserve left: taken from it within
    /// the shares of resent reviews, in all and `client`'s.
    fn take_resent(&mut self, client: std::net::IpAddr, now: Instant) -> bool {
        let retries = &mut self.retries_by_client;
        let mut mine = *bucket_of(retries, client, RETRIES_PER_SECOND_PER_CLIENT, now);
        let (mut all, mut new) = (self.retries, self.new);
        if !(mine.take(now) && all.take(now) && new.take(now)) {
            return false;
        }
        *bucket_of(retries, client, RETRIES_PER_SECOND_PER_CLIENT, now) = mine;
        (self.retries, self.new) = (all, new);
        true
    }

    /// How many refreshes the upkeep may start now: what the known budget holds beyond one
    /// second's worth, kept for requests.
    fn for_upkeep(&mut self, now: Instant) -> usize {
        let reserve = KNOWN_PER_SECOND as usize;
        self.known.available(now).saturating_sub(reserve)
    }
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
    /// What this key and its question hold, in bytes, for the cache's bound.
    fn bytes(&self) -> usize {
        let strings = |v: &[String]| v.iter().map(|s| s.len() + STRING_COST).sum::<usize>();
        let identity = self.user.len()
            + self.uid.len()
            + strings(&self.groups)
            + self
                .extra
                .iter()
                .map(|(k, v)| k.len() + STRING_COST + strings(v))
                .sum::<usize>();
        2 * (identity + self.namespace.len()) + 512
    }

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

/// A cached answer: when its question was sent, when a review for it was last started (a
/// refresh may fail), when a request last used it, and the question, to ask it again.
struct Answer {
    asked: Instant,
    tried: Instant,
    used: Instant,
    /// How many requests used it (at most 2 counted: once, or more).
    uses: u8,
    /// The address of the client that used it last.
    client: std::net::IpAddr,
    reviewed: Reviewed,
    question: SubjectAccessReview,
    bytes: usize,
}

/// Why a review was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trigger {
    /// A request from this client address found no answer and waits for this one.
    Request(std::net::IpAddr),
    /// A refresh of a cached answer, ahead of its expiry or as a retry; a request that finds
    /// the answer expired waits for it too.
    Refresh,
}

/// One address's refusals as busy within [`RETRY_WINDOW`] (by hash, each with its first), and
/// when it last had to forget one still within it.
#[derive(Default)]
struct Refusals {
    recent: std::collections::VecDeque<(u64, Instant)>,
    overflowed: Option<Instant>,
}

/// Answers, the reviews in flight, the bytes the answers hold, the review budgets, and the
/// (identity, namespace) pairs allowed lately (by hash, see [`SEEN_FOR`]).
struct Reviews {
    answers: HashMap<Key, Answer>,
    asking: HashMap<Key, Asking>,
    bytes: usize,
    budgets: Budgets,
    seen: HashMap<u64, Instant>,
    /// Per client address, its last reviews refused as busy (by hash; see [`RETRY_WINDOW`]).
    refused: HashMap<std::net::IpAddr, Refusals>,
    /// When `refused` was last pruned.
    refused_pruned: Instant,
    hasher: std::hash::RandomState,
}

impl Reviews {
    fn new(now: Instant) -> Self {
        Reviews {
            answers: HashMap::new(),
            asking: HashMap::new(),
            bytes: 0,
            budgets: Budgets::new(now),
            seen: HashMap::new(),
            refused: HashMap::new(),
            refused_pruned: now,
            hasher: std::hash::RandomState::new(),
        }
    }

    /// Remembers that `key` from `client` was refused as busy at `now` (a request that arrived
    /// at `received`), unless it already was within [`RETRY_WINDOW`]; returns when the first
    /// request refused so arrived, or `None` when that cannot be told (not remembered, or the
    /// address had to forget a refusal within the window lately: else a resend could pass for a
    /// first refusal again and again).
    fn refused(
        &mut self,
        client: std::net::IpAddr,
        key: &Key,
        now: Instant,
        received: Instant,
    ) -> Option<Instant> {
        let client = crate::serving::guard::canonical(client);
        let recent = |at: &Instant| now.duration_since(*at) < RETRY_WINDOW;
        let first = self.first_refused(client, key, now);
        if first.is_some() {
            return first;
        }
        if self.refused.len() >= MAX_REFUSING_CLIENTS
            && !self.refused.contains_key(&client)
            && now.duration_since(self.refused_pruned) >= Duration::from_secs(1)
        {
            self.refused_pruned = now;
            self.refused.retain(|_, refusals| {
                refusals.recent.back().is_some_and(|(_, at)| recent(at))
                    || refusals.overflowed.is_some_and(|at| recent(&at))
            });
        }
        if self.refused.len() >= MAX_REFUSING_CLIENTS && !self.refused.contains_key(&client) {
            return None;
        }
        let hash = self.hasher.hash_one(key);
        let refusals = self.refused.entry(client).or_default();
        while refusals.recent.front().is_some_and(|(_, at)| !recent(at)) {
            refusals.recent.pop_front();
        }
        if refusals.recent.len() >= MAX_REFUSALS_PER_CLIENT {
            refusals.recent.pop_front();
            refusals.overflowed = Some(now);
        }
        refusals.recent.push_back((hash, received));
        match refusals.overflowed {
            Some(at) if recent(&at) => None,
            _ => Some(received),
        }
    }

    /// When `key` from `client` was first refused as busy, if within [`RETRY_WINDOW`] of `now`
    /// (then it is being resent).
    fn first_refused(&self, client: std::net::IpAddr, key: &Key, now: Instant) -> Option<Instant> {
        let client = crate::serving::guard::canonical(client);
        let hash = self.hasher.hash_one(key);
        let refusals = self.refused.get(&client)?;
        (refusals.recent.iter())
            .find(|(h, at)| *h == hash && now.duration_since(*at) < RETRY_WINDOW)
            .map(|(_, at)| *at)
    }

    /// Whether `key` was allowed within [`SEEN_FOR`] of `now`.
    fn seen(&self, key: &Key, now: Instant) -> bool {
        self.seen
            .get(&self.hasher.hash_one(key))
            .is_some_and(|at| now.duration_since(*at) < SEEN_FOR)
    }

    /// Remembers that `key` was allowed at `now`; past [`MAX_SEEN`], pairs older than
    /// [`SEEN_FOR`] go, then (if that left more than 9/10 of the bound) the older half.
    fn allowed(&mut self, key: &Key, now: Instant) {
        if self.seen.len() >= MAX_SEEN {
            self.seen.retain(|_, at| now.duration_since(*at) < SEEN_FOR);
            if self.seen.len() >= MAX_SEEN * 9 / 10 {
                let mut times: Vec<Instant> = self.seen.values().copied().collect();
                let half = times.len() / 2;
                let (_, middle, _) = times.select_nth_unstable(half);
                let middle = *middle;
                self.seen.retain(|_, at| *at > middle);
            }
        }
        self.seen.insert(self.hasher.hash_one(key), now);
    }

    fn remove(&mut self, key: &Key) {
        if let Some(answer) = self.answers.remove(key) {
            self.bytes = self.bytes.saturating_sub(answer.bytes);
        }
    }

    /// Makes room for an answer of `bytes`: expired answers go, then answers used once (the
    /// oldest first); `false` when it still does not fit.
    fn make_room(&mut self, bytes: usize, ttl: Duration, now: Instant) -> bool {
        let fits = |r: &Self| r.answers.len() < MAX_CACHED && r.bytes + bytes <= MAX_CACHED_BYTES;
        if fits(self) {
            return true;
        }
        let expired: Vec<Key> = (self.answers.iter())
            .filter(|(_, a)| now.duration_since(a.asked) >= ttl)
            .map(|(k, _)| k.clone())
            .collect();
        expired.iter().for_each(|key| self.remove(key));
        let mut once: Vec<(Instant, Key)> = (self.answers.iter())
            .filter(|(k, a)| a.uses < 2 && !self.asking.contains_key(*k))
            .map(|(k, a)| (a.used, k.clone()))
            .collect();
        once.sort_by_key(|(used, _)| *used);
        for (_, key) in once {
            if fits(self) {
                break;
            }
            self.remove(&key);
        }
        fits(self)
    }
}

/// How often the background upkeep runs (a quarter TTL, at least [`MIN_PERIOD`]) and how many
/// reviews one round may start (at most [`MAX_REFRESHES_PER_SECOND`] over a second).
pub fn cadence(settings: &Settings) -> (Duration, usize) {
    let period = (settings.cache_ttl / 4).max(MIN_PERIOD);
    let budget = (period.as_secs_f64() * f64::from(MAX_REFRESHES_PER_SECOND)).ceil() as usize;
    (period, budget.max(1))
}

/// Whether a background refresh that takes the whole timeout still arrives before the answer
/// it replaces expires: it is started before the answer is `cache_ttl / 2 + period / 2` old, so
/// the timeout must be under [`timeout_limit`].
pub fn refreshes_in_time(settings: &Settings) -> bool {
    settings.timeout < timeout_limit(settings)
}

/// The longest timeout under which background refreshes arrive in time: `cache_ttl / 2 -
/// period / 2`, 3/8 of the TTL when a round is a quarter of it.
pub fn timeout_limit(settings: &Settings) -> Duration {
    let (period, _) = cadence(settings);
    (settings.cache_ttl / 2).saturating_sub(period / 2)
}

/// How long ago an answer's question was sent, a review for it was last started, and a request
/// last used it.
#[derive(Debug, Clone, Copy)]
pub struct Since {
    pub asked: Duration,
    pub tried: Duration,
    pub used: Duration,
}

/// What a round of the background upkeep does with a cached answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upkeep {
    /// Leave it: not due for a refresh, or not used lately but still valid.
    Keep,
    /// Ask again: used within `keep_warm`, and its last review started about half a TTL ago
    /// (to the nearest round, so a refresh comes every half TTL; a failed one is retried then).
    Refresh,
    /// Forget it: expired and not used within `keep_warm`.
    Drop,
}

/// The upkeep of an answer at one round (see [`Upkeep`]).
pub fn upkeep(since: Since, settings: &Settings) -> Upkeep {
    let used_lately = since.used <= settings.keep_warm;
    if since.asked >= settings.cache_ttl && !used_lately {
        Upkeep::Drop
    } else if keeps_warm(settings) && used_lately && retry_due(since.tried, settings) {
        Upkeep::Refresh
    } else {
        Upkeep::Keep
    }
}

/// Whether the upkeep refreshes answers at all: not when keep-warm is off, nor when its rounds
/// are too far apart to refresh before expiry (a TTL under 200 ms).
fn keeps_warm(settings: &Settings) -> bool {
    let (period, _) = cadence(settings);
    !settings.keep_warm.is_zero() && period <= settings.cache_ttl / 2
}

/// Whether a review for an answer may start again, its last one started `tried` ago: about
/// half a TTL later (to the nearest round of the upkeep), also when that one failed.
fn retry_due(tried: Duration, settings: &Settings) -> bool {
    let (period, _) = cadence(settings);
    tried + period / 2 >= settings.cache_ttl / 2
}

/// Asks the API server, with a short-lived cache: concurrent requests with the same key share
/// one review, and answers used within `keep_warm` are refreshed in the background (see
/// [`refreshes_in_time`]). No answer is ever served older than `cache_ttl`.
pub struct AccessReviewer {
    inner: Arc<Inner>,
}

struct Inner {
    api: Api<SubjectAccessReview>,
    settings: Settings,
    metrics: Arc<Metrics>,
    reviews: Mutex<Reviews>,
}

/// Why a review is denied (the AdmissionReview's message), or that the guard is busy (the
/// request is to be answered 429, for the API server to resend it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Denial {
    message: String,
    /// Refused as busy: since when this identity has been, from this address.
    busy: Option<Duration>,
}

impl Denial {
    pub fn new(message: String) -> Self {
        Denial {
            message,
            busy: None,
        }
    }

    /// Refused as busy: how long ago the first request of this identity refused so from this
    /// address arrived (for the first, how long it waited to be refused; [`Duration::MAX`] when
    /// that cannot be told; see [`RETRY_WINDOW`]).
    pub fn busy_for(&self) -> Option<Duration> {
        self.busy
    }
}

impl std::ops::Deref for Denial {
    type Target = str;

    fn deref(&self) -> &str {
        &self.message
    }
}

impl AccessReviewer {
    /// The reviewer and its background upkeep, which ends at its first round after the reviewer
    /// and its reviews in flight are gone. Must be called within a Tokio runtime.
    pub fn new(client: Client, settings: Settings, metrics: Arc<Metrics>) -> Self {
        if keeps_warm(&settings) && !refreshes_in_time(&settings) {
            tracing::warn!(
                cache_ttl = ?settings.cache_ttl,
                timeout = ?settings.timeout,
                limit = ?timeout_limit(&settings),
                "the access review timeout is not under its limit (3/8 of the cache TTL): a background refresh that takes the whole timeout arrives after the answer expired, and an apply then waits for it"
            );
        }
        let inner = Arc::new(Inner {
            api: Api::all(client),
            settings,
            metrics,
            reviews: Mutex::new(Reviews::new(Instant::now())),
        });
        tokio::spawn(keep_warm(Arc::downgrade(&inner)));
        AccessReviewer { inner }
    }

    /// The verdict from a cached answer, without waiting: `None` when there is none (then
    /// `check_received`); an identity over the bound is denied at once. An answer past half its
    /// life is refreshed in the background.
    pub fn cached_for(
        &self,
        client: std::net::IpAddr,
        user: &UserInfo,
        namespace: &str,
    ) -> Option<Result<(), Denial>> {
        if let Some(denial) = too_large(user, namespace) {
            return Some(Err(Denial::new(denial)));
        }
        let key = Key::new(user, namespace);
        let answer = self.fresh(&mut self.inner.lock(), key, client)?;
        Some(self.verdict(user, namespace, answer).map_err(Denial::new))
    }

    /// `Ok` when `user` may create pods in `namespace`, else the denial. Its review counts against
    /// the budgets of new or known identities, in all and for `client` ([`NEW_PER_SECOND`]); a
    /// refusal as busy counts from the arrival of the first request refused so ([`Denial::busy_for`]).
    pub async fn check_received(
        &self,
        client: std::net::IpAddr,
        user: &UserInfo,
        namespace: &str,
        received: Instant,
    ) -> Result<(), Denial> {
        if let Some(denial) = too_large(user, namespace) {
            return Err(Denial::new(denial));
        }
        let key = Key::new(user, namespace);
        let asking = {
            let mut reviews = self.inner.lock();
            if let Some(answer) = self.fresh(&mut reviews, key.clone(), client) {
                return self.verdict(user, namespace, answer).map_err(Denial::new);
            }
            match reviews.asking.get(&key) {
                Some(asking) => asking.clone(),
                None => {
                    let now = Instant::now();
                    let known = reviews.answers.contains_key(&key) || reviews.seen(&key, now);
                    let resent = !known && reviews.first_refused(client, &key, now).is_some();
                    let budgeted = reviews.budgets.take(client, known, resent, now);
                    if !budgeted {
                        let first = reviews.refused(client, &key, now, received.min(now));
                        self.inner
                            .metrics
                            .access_reviewed("request", "refused", Duration::ZERO);
                        // Not known since when: as if since ever (denied, not to be resent).
                        let since = first.map_or(Duration::MAX, |first| now.duration_since(first));
                        return Err(Denial {
                            message: busy(namespace),
                            busy: Some(since),
                        });
                    }
                    let question = review(user, namespace);
                    self.inner
                        .start(&mut reviews, key, question, Trigger::Request(client))
                }
            }
        };
        let answer = asking.await;
        self.verdict(user, namespace, answer).map_err(Denial::new)
    }

    /// The cached answer for `key` if younger than the TTL, marked used; past half its life, a
    /// refresh is started (one at a time, half a TTL after the last one started). An expired
    /// answer is marked used too: it stays warm (and is not forgotten) while `check_received` asks.
    fn fresh(&self, reviews: &mut Reviews, key: Key, client: std::net::IpAddr) -> Option<Reviewed> {
        let ttl = self.inner.settings.cache_ttl;
        let now = Instant::now();
        let answer = reviews.answers.get_mut(&key)?;
        answer.used = now;
        answer.uses = answer.uses.saturating_add(1).min(2);
        answer.client = client;
        let age = now.duration_since(answer.asked);
        if age >= ttl {
            return None;
        }
        let reviewed = answer.reviewed.clone();
        let retry = retry_due(now.duration_since(answer.tried), &self.inner.settings);
        if age >= ttl / 2
            && retry
            && !reviews.asking.contains_key(&key)
            && reviews.budgets.take(client, true, false, now)
        {
            let Some(answer) = reviews.answers.get(&key) else {
                return Some(reviewed);
            };
            let question = answer.question.clone();
            let _refresh = self.inner.start(reviews, key, question, Trigger::Refresh);
        }
        Some(reviewed)
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

/// The first `budget` of `due` answers (once used, last tried, last client, key) to refresh:
/// each client address's in turn, and within one address's, those used more than once first,
/// then those tried longest ago.
fn fair(mut due: Vec<(bool, Instant, std::net::IpAddr, Key)>, budget: usize) -> Vec<Key> {
    due.sort_by_key(|(once, tried, ..)| (*once, *tried));
    let mut queues: Vec<std::collections::VecDeque<Key>> = Vec::new();
    let mut index: HashMap<std::net::IpAddr, usize> = HashMap::new();
    for (_, _, client, key) in due {
        let at = *index.entry(client).or_insert_with(|| {
            queues.push(std::collections::VecDeque::new());
            queues.len() - 1
        });
        queues[at].push_back(key);
    }
    let mut chosen = Vec::new();
    while chosen.len() < budget && queues.iter().any(|q| !q.is_empty()) {
        for queue in &mut queues {
            if chosen.len() == budget {
                break;
            }
            chosen.extend(queue.pop_front());
        }
    }
    chosen
}

/// The background upkeep: a round every [`cadence`] period (see [`Inner::upkeep`]). Ends when
/// the reviewer is gone.
async fn keep_warm(inner: Weak<Inner>) {
    let Some((period, _)) = inner.upgrade().map(|inner| cadence(&inner.settings)) else {
        return;
    };
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        inner.upkeep(Instant::now());
    }
}

impl Inner {
    /// One round of upkeep at `now` (see [`upkeep`]): answers without a review in flight are
    /// refreshed or forgotten; at most the [`cadence`] budget of refreshes, the answers tried
    /// longest ago first.
    fn upkeep(self: &Arc<Self>, now: Instant) {
        let mut reviews = self.lock();
        let Reviews {
            answers,
            asking,
            bytes,
            budgets,
            ..
        } = &mut *reviews;
        let mut due = Vec::new();
        answers.retain(|key, answer| {
            if asking.contains_key(key) {
                return true;
            }
            let since = Since {
                asked: now.duration_since(answer.asked),
                tried: now.duration_since(answer.tried),
                used: now.duration_since(answer.used),
            };
            let keep = match upkeep(since, &self.settings) {
                Upkeep::Drop => false,
                Upkeep::Refresh => {
                    // Identities used more than once first: a flood of made-up ones, each used
                    // once, cannot keep the answers of real users from being refreshed.
                    due.push((answer.uses < 2, answer.tried, answer.client, key.clone()));
                    true
                }
                Upkeep::Keep => true,
            };
            if !keep {
                *bytes = bytes.saturating_sub(answer.bytes);
            }
            keep
        });
        let (_, budget) = cadence(&self.settings);
        let budget = budget.min(budgets.for_upkeep(now));
        for key in fair(due, budget) {
            let Some(answer) = reviews.answers.get(&key) else {
                continue;
            };
            let question = answer.question.clone();
            reviews.budgets.known.take(now);
            let _refresh = self.start(&mut reviews, key, question, Trigger::Refresh);
        }
    }

    /// Starts the review for `key` and records it as in flight (and, on a cached answer, when
    /// it was tried). It is driven to its end (at most the timeout) even if every request
    /// waiting for it goes away, so it never lingers with an answer from long ago.
    fn start(
        self: &Arc<Self>,
        reviews: &mut Reviews,
        key: Key,
        question: SubjectAccessReview,
        trigger: Trigger,
    ) -> Asking {
        if let Some(answer) = reviews.answers.get_mut(&key) {
            answer.tried = Instant::now();
        }
        let review = Inner::ask(self, key.clone(), question, trigger);
        reviews.asking.insert(key, review.clone());
        tokio::spawn(review.clone());
        review
    }

    /// The review for `key`, bounded in time; it leaves the reviews in flight and its answer
    /// (unless there was none) goes into the cache, whoever polls it to the end. A refresh only
    /// replaces an answer still cached: it never brings back one forgotten meanwhile.
    fn ask(
        inner: &Arc<Inner>,
        key: Key,
        question: SubjectAccessReview,
        trigger: Trigger,
    ) -> Asking {
        let inner = inner.clone();
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
            let outcome = match &reviewed {
                Reviewed::Allowed => "allowed",
                Reviewed::Denied(_) => "denied",
                Reviewed::Unanswered(_) => "unanswered",
            };
            let trigger_label = match trigger {
                Trigger::Request(_) => "request",
                Trigger::Refresh => "refresh",
            };
            inner
                .metrics
                .access_reviewed(trigger_label, outcome, asked.elapsed());
            let mut reviews = inner.lock();
            reviews.asking.remove(&key);
            match &reviewed {
                Reviewed::Unanswered(error) => {
                    let namespace = &key.namespace;
                    tracing::warn!(namespace, error, on_error = ?inner.settings.on_error, "SubjectAccessReview failed");
                }
                answer => {
                    let (ttl, now) = (inner.settings.cache_ttl, Instant::now());
                    if let Reviewed::Allowed = answer {
                        reviews.allowed(&key, now);
                    }
                    if let Some(cached) = reviews.answers.get_mut(&key) {
                        if asked >= cached.asked {
                            (cached.asked, cached.reviewed) = (asked, answer.clone());
                        }
                        return reviewed;
                    }
                    let Trigger::Request(client) = trigger else {
                        return reviewed;
                    };
                    let bytes = key.bytes();
                    if reviews.make_room(bytes, ttl, now) {
                        let cached = Answer {
                            asked,
                            tried: asked,
                            used: asked,
                            uses: 1,
                            client,
                            reviewed: answer.clone(),
                            question,
                            bytes,
                        };
                        reviews.bytes += bytes;
                        reviews.answers.insert(key, cached);
                    }
                }
            }
            reviewed
        }
        .boxed()
        .shared()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Reviews> {
        lock(&self.reviews)
    }
}

#[cfg(test)]
mod tests;
