//! The webhook's serving certificate, kept by the operator in a Secret (`--webhook-certs-secret`).
//! Every replica follows the Secret, its two webhook configurations and the CRD; takes the one
//! step `rotation` asks for, written with a precondition (of two replicas, one write wins and the
//! other finds nothing left to do); makes every target trust the Secret's bundle; and serves the
//! Secret's leaf once every target trusts its CA. No Helm `lookup`, no certificate in the chart.
//! See docs/src/operating/admission-webhooks.md, "Certificates the operator keeps".

pub mod material;
pub mod rotation;
pub mod secret;
pub mod targets;

use crate::leader::WallClock;
use backon::BackoffBuilder;
use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use material::{Pair, Parsed};
use rotation::{Fingerprint, Policy, Step, Target};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use targets::{Here, Kind, Live};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The field manager of the `caBundle` writes.
pub const FIELD_MANAGER: &str = "cnat-ca-injector";

/// Where the certificates are kept and what they are for.
#[derive(Clone)]
pub struct Settings {
    /// The Secret's namespace and name.
    pub namespace: String,
    pub secret: String,
    /// The name of the mutating and of the validating webhook configuration.
    pub configuration: String,
    /// The CRD whose conversion webhook is kept too (when it calls here).
    pub crd: String,
    pub here: Here,
    pub policy: Policy,
    pub clock: WallClock,
}

impl Settings {
    /// The names a leaf for the Service `service` in `namespace` carries (the four a Service
    /// is reached by, then `extra`).
    pub fn names(namespace: &str, service: &str, extra: &[String]) -> Vec<String> {
        let mut names = vec![
            format!("{service}.{namespace}.svc"),
            format!("{service}.{namespace}.svc.cluster.local"),
            format!("{service}.{namespace}"),
            service.to_owned(),
        ];
        names.extend(extra.iter().filter(|n| !n.trim().is_empty()).cloned());
        names
    }

    /// The Secret as `namespace/name`.
    fn secret_ref(&self) -> String {
        format!("{}/{}", self.namespace, self.secret)
    }
}

/// This replica's certificate state, for its readiness: ready once it serves a leaf every target
/// trusts, and from then on (a target edited by hand is repaired, not a reason to drop every
/// endpoint).
#[derive(Debug)]
pub struct Status(Mutex<Result<(), String>>);

impl Status {
    pub fn new(settings: &Settings) -> Self {
        let secret = settings.secret_ref();
        Status(Mutex::new(Err(format!(
            "waiting for the webhook certificate in Secret {secret}"
        ))))
    }

    pub fn readiness(&self) -> Result<(), String> {
        crate::sync::lock(&self.0).clone()
    }

    fn set(&self, to: Result<(), String>) {
        let mut status = crate::sync::lock(&self.0);
        if status.is_err() {
            *status = to;
        }
    }
}

/// The objects followed, as their reflectors have them.
struct Stores {
    secret: Store<Secret>,
    mutating: Store<MutatingWebhookConfiguration>,
    validating: Store<ValidatingWebhookConfiguration>,
    crd: Store<CustomResourceDefinition>,
}

/// Keeps the certificates until `stop`, sending each leaf this replica is to serve to `serve`.
pub async fn run(
    client: kube::Client,
    settings: Settings,
    serve: watch::Sender<Option<Pair>>,
    status: Arc<Status>,
    stop: CancellationToken,
) {
    let (wake, mut woken) = mpsc::channel(1);
    let by_name = |name: &str| watcher::Config::default().fields(&format!("metadata.name={name}"));
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &settings.namespace);
    let mutating = Api::all(client.clone());
    let validating = Api::all(client.clone());
    let crds = Api::all(client.clone());
    let stores = Stores {
        secret: follow(secrets.clone(), by_name(&settings.secret), &wake, &stop),
        mutating: follow(
            mutating.clone(),
            by_name(&settings.configuration),
            &wake,
            &stop,
        ),
        validating: follow(
            validating.clone(),
            by_name(&settings.configuration),
            &wake,
            &stop,
        ),
        crd: follow(crds.clone(), by_name(&settings.crd), &wake, &stop),
    };
    let synced = async {
        let _ = stores.secret.wait_until_ready().await;
        let _ = stores.mutating.wait_until_ready().await;
        let _ = stores.validating.wait_until_ready().await;
        let _ = stores.crd.wait_until_ready().await;
    };
    tokio::select! {
        _ = stop.cancelled() => return,
        _ = synced => {}
    }
    let keeper = Keeper {
        settings,
        secrets,
        mutating,
        validating,
        crds,
        serve,
        status,
        served_signer: None,
        trusted_since: Vec::new(),
        refused: false,
    };
    keeper.keep(stores, &mut woken, stop).await;
}

/// A reflector of the objects `config` selects, waking `wake` on each change; its watch errors
/// are retried with kube-runtime's backoff and logged.
fn follow<K>(
    api: Api<K>,
    config: watcher::Config,
    wake: &mpsc::Sender<()>,
    stop: &CancellationToken,
) -> Store<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let events = watcher(api, config).default_backoff().reflect(writer);
    let wake = wake.clone();
    let events = events.take_until(stop.clone().cancelled_owned());
    tokio::spawn(events.for_each(move |event| {
        match event {
            Err(error) => warn!(%error, "watching the webhook certificate's objects; retrying"),
            Ok(_) => _ = wake.try_send(()),
        }
        std::future::ready(())
    }));
    store
}

struct Keeper {
    settings: Settings,
    secrets: Api<Secret>,
    mutating: Api<MutatingWebhookConfiguration>,
    validating: Api<ValidatingWebhookConfiguration>,
    crds: Api<CustomResourceDefinition>,
    serve: watch::Sender<Option<Pair>>,
    status: Arc<Status>,
    /// The CA of the leaf this replica serves.
    served_signer: Option<Fingerprint>,
    /// The CAs of the bundle every target trusts, and since when (this replica's clock).
    trusted_since: Vec<(Fingerprint, Instant)>,
    /// Whether the foreign Secret was reported.
    refused: bool,
}

/// The longest wait between two looks without a change (a clock that jumped is seen then).
const LONGEST_WAIT: Duration = Duration::from_secs(600);

impl Keeper {
    async fn keep(
        mut self,
        stores: Stores,
        woken: &mut mpsc::Receiver<()>,
        stop: CancellationToken,
    ) {
        let retries = || {
            backon::ExponentialBuilder::default()
                .with_min_delay(Duration::from_secs(1))
                .with_max_delay(Duration::from_secs(60))
                .without_max_times()
                .build()
        };
        let mut backoff = retries();
        let mut next = Instant::now();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = woken.recv() => {}
                _ = tokio::time::sleep_until(next) => {}
            }
            next = match self.look(&stores).await {
                Ok(wait) => {
                    backoff = retries();
                    Instant::now() + wait
                }
                Err(()) => Instant::now() + backoff.next().unwrap_or(LONGEST_WAIT),
            };
        }
    }

    /// One look: the step to take, the bundles to write, the leaf to serve; how long until the
    /// next look without a change (`Err` when a write failed: look again after a backoff).
    async fn look(&mut self, stores: &Stores) -> Result<Duration, ()> {
        let s = &self.settings;
        let now = s.clock.now();
        let secret = stores
            .secret
            .get(&ObjectRef::new(&s.secret).within(&s.namespace));
        let lives: Vec<Live> = [
            stores
                .mutating
                .get(&ObjectRef::new(&s.configuration))
                .map(|c| targets::mutating(&c, &s.here)),
            stores
                .validating
                .get(&ObjectRef::new(&s.configuration))
                .map(|c| targets::validating(&c, &s.here)),
            stores
                .crd
                .get(&ObjectRef::new(&s.crd))
                .map(|c| targets::crd(&c, &s.here)),
        ]
        .into_iter()
        .flatten()
        .collect();
        let (trust, seen): (Vec<Target>, Vec<Vec<Parsed>>) = lives.iter().map(Live::trust).unzip();
        let (found, contents) = secret::found(secret.as_deref(), &s.here.names);
        let step = rotation::next_step(&found, &trust, &s.policy, now);
        let mut wait = LONGEST_WAIT;
        let mut step_failed = false;
        match &step {
            Step::Refuse => {
                let secret = s.secret_ref();
                let why = format!(
                    "Secret {secret} is not cnat's (no label app.kubernetes.io/managed-by=cnat)"
                );
                self.status.set(Err(why));
                if !self.refused {
                    warn!(%secret, "the webhook certificate's Secret exists but is not cnat's (no label app.kubernetes.io/managed-by=cnat): nothing is written to it; delete it, or name another with --webhook-certs-secret");
                    self.refused = true;
                }
                return Ok(wait);
            }
            Step::Wait { until } => {
                if let Some(until) = until {
                    let left = until.duration_since(now);
                    wait = wait.min(left.max(jiff::SignedDuration::ZERO).unsigned_abs());
                }
            }
            step => {
                let adopted = adopted(step, seen.iter().flatten());
                let names = &s.here.names;
                let after = secret::after(step, contents.as_ref(), &adopted, names, &s.policy, now);
                match after {
                    // Its watch event wakes the next look.
                    Ok(Some(after)) => match self.write(secret.as_deref(), step, &after).await {
                        Ok(()) => return Ok(LONGEST_WAIT),
                        // Then what the Secret holds is still bundled and served.
                        Err(()) => step_failed = true,
                    },
                    Ok(None) => {}
                    Err(error) => {
                        warn!(%error, ?step, "cannot make the webhook certificate");
                        step_failed = true;
                    }
                }
            }
        }
        let Some(contents) = contents else {
            return Ok(wait);
        };
        let bundle = contents.bundle_pem();
        let wanted: Vec<Fingerprint> = contents
            .bundle
            .iter()
            .map(|c| c.facts.fingerprint)
            .collect();
        let mut failed = false;
        for live in &lives {
            if let Some(patch) = live.patch(&bundle, &wanted) {
                failed |= self.inject(live, patch).await.is_err();
            }
        }
        let Ok(signer) = contents.signer() else {
            return Ok(wait);
        };
        // Since when every target trusts each CA of the bundle (a published CA's count starts
        // before it signs: at the switch, replicas serve its leaf at once).
        self.trusted_since
            .retain(|(ca, _)| wanted.contains(ca) && rotation::trusted_everywhere(&trust, ca));
        for ca in &wanted {
            let known = self.trusted_since.iter().any(|(seen, _)| seen == ca);
            if !known && rotation::trusted_everywhere(&trust, ca) {
                self.trusted_since.push((*ca, Instant::now()));
            }
        }
        let since = self
            .trusted_since
            .iter()
            .find(|(ca, _)| *ca == signer)
            .map(|(_, at)| *at);
        let current = self.serve.borrow().clone();
        if current.as_ref() != Some(&contents.leaf) {
            let trusted_for =
                since.and_then(|at| jiff::SignedDuration::try_from(at.elapsed()).ok());
            let overlap = s.policy.overlap;
            if rotation::may_serve(self.served_signer.as_ref(), &signer, trusted_for, overlap) {
                info!(ca = %material::hex(&signer), "serving the webhook certificate from Secret {}", s.secret_ref());
                self.serve.send_replace(Some(contents.leaf.clone()));
                self.served_signer = Some(signer);
            } else if let Some(left) = trusted_for.and_then(|d| (overlap - d).try_into().ok()) {
                wait = wait.min(left);
            }
        }
        if self
            .served_signer
            .is_some_and(|ca| rotation::trusted_everywhere(&trust, &ca))
        {
            self.status.set(Ok(()));
        }
        if failed || step_failed {
            Err(())
        } else {
            Ok(wait)
        }
    }

    /// Writes the Secret (`before`: as read, its resourceVersion the precondition; none: a
    /// create). A lost race is no error: the winner's write wakes the next look.
    async fn write(
        &self,
        before: Option<&Secret>,
        step: &Step,
        after: &secret::Contents,
    ) -> Result<(), ()> {
        let s = &self.settings;
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PostParams::default()
        };
        let result = match before {
            Some(before) => {
                let new = secret::encode(before.clone(), after);
                self.secrets.replace(&s.secret, &params, &new).await
            }
            None => {
                let mut new = Secret::default();
                new.metadata.name = Some(s.secret.clone());
                new.metadata.namespace = Some(s.namespace.clone());
                new.metadata.labels = Some(
                    [(
                        "app.kubernetes.io/component".to_owned(),
                        "webhook-certs".to_owned(),
                    )]
                    .into(),
                );
                self.secrets
                    .create(&params, &secret::encode(new, after))
                    .await
            }
        };
        match result {
            Ok(_) => {
                let step = format!("{step:?}");
                let step = step.split([' ', '{']).next().unwrap_or_default();
                info!(step, secret = %s.secret_ref(), "webhook certificate step written");
                Ok(())
            }
            Err(kube::Error::Api(status)) if status.is_conflict() || status.is_already_exists() => {
                Ok(())
            }
            Err(error) => {
                warn!(%error, secret = %s.secret_ref(), "cannot write the webhook certificate's Secret; retrying");
                Err(())
            }
        }
    }

    /// Makes `live` trust the Secret's bundle. A changed object (the patch's tests fail) is no
    /// error: its change wakes the next look.
    async fn inject(&self, live: &Live, patch: json_patch::Patch) -> Result<(), ()> {
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        let patch = Patch::<()>::Json(patch);
        let name = &live.name;
        let result = match live.kind {
            Kind::MutatingWebhookConfiguration => {
                self.mutating.patch(name, &params, &patch).await.map(drop)
            }
            Kind::ValidatingWebhookConfiguration => {
                self.validating.patch(name, &params, &patch).await.map(drop)
            }
            Kind::CustomResourceDefinition => {
                self.crds.patch(name, &params, &patch).await.map(drop)
            }
        };
        match result {
            Ok(()) => {
                info!(target = %live.what(), "the webhook CA bundle written");
                Ok(())
            }
            // 422 without causes: a `test` of the patch failed, the object changed (its watch
            // event follows).
            Err(kube::Error::Api(status))
                if status.is_conflict()
                    || status.is_not_found()
                    || (status.code == 422
                        && status.details.as_ref().is_none_or(|d| d.causes.is_empty())) =>
            {
                Ok(())
            }
            Err(error) => {
                warn!(%error, target = %live.what(), "cannot write the webhook CA bundle; retrying");
                Err(())
            }
        }
    }
}

/// The certificates a bootstrap keeps, from those the targets trust.
fn adopted<'a>(step: &Step, seen: impl Iterator<Item = &'a Parsed>) -> Vec<Parsed> {
    let Step::Bootstrap { adopt } = step else {
        return Vec::new();
    };
    let mut kept: Vec<Parsed> = Vec::new();
    for cert in seen {
        if adopt.contains(&cert.facts.fingerprint) && !kept.iter().any(|k| k.facts == cert.facts) {
            kept.push(cert.clone());
        }
    }
    kept
}
