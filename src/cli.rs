//! Command-line interface. Every flag of `cnat run` can also be set by a `CNAT_*` variable.

use crate::admission::access_review::{self, OnError};
use crate::admission::validation::image_problem;
use crate::api::ImagePullPolicy;
use crate::leader::Timing;
use crate::limits;
use crate::operator::policy::{self, RunPolicy};
use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "cnat",
    version,
    about = "Kubernetes operator for At: run a shell command once, at a given time, in a pod"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the operator against the cluster of the in-cluster config, else KUBECONFIG or ~/.kube/config.
    Run(Box<RunArgs>),
    /// Print the At CustomResourceDefinition as YAML (pipe to `kubectl apply -f -`).
    Crd(CrdArgs),
    /// Check At manifests with the validating webhook's rules; exits 1 if any is invalid.
    Check(CheckArgs),
    /// Write a development CA and webhook serving certificate (ca.crt, tls.crt, tls.key).
    Certs(CertsArgs),
    /// Create an At due now and wait until it is Done (what `helm test` runs).
    SmokeTest(SmokeTestArgs),
    /// Rewrite every At in the CRD's storage version, then set status.storedVersions to it alone
    /// (for an admin, after an upgrade that changed the storage version; safe to run again).
    MigrateStorage(MigrateStorageArgs),
    /// Remove cnat's finalizer from every pod whose outcome no longer needs it (its At's status
    /// names it, or its At is gone), for when no replica will run again (helm uninstall's
    /// pre-delete hook, with --stop-deployment); exits 1 if any had to be kept or could not be
    /// released (without --stop-deployment).
    Release(ReleaseArgs),
}

#[derive(Debug, Args)]
pub struct ReleaseArgs {
    /// Only this namespace's pods (default: every namespace).
    #[arg(long)]
    pub namespace: Option<String>,
    /// First stop the operator: scale this Deployment (NAMESPACE/NAME) to 0 and wait until its
    /// pods are gone, so that no pod is created or recorded after the release (helm uninstall's
    /// hook). Pods that must keep the finalizer are then listed, and the exit status is 0.
    #[arg(long, value_parser = service_ref, value_name = "NAMESPACE/NAME")]
    pub stop_deployment: Option<(String, String)>,
    /// How long to wait for the Deployment's pods to go before releasing anyway.
    #[arg(long, default_value = "60s", value_parser = duration)]
    pub stop_timeout: Duration,
}

#[derive(Debug, Args)]
pub struct CrdArgs {
    /// The webhook Service the API server sends ConversionReviews to, as NAMESPACE/NAME
    /// (port 443, path /convert).
    #[arg(long, default_value = "cnat-system/cnat-webhook", value_parser = service_ref)]
    pub conversion_service: (String, String),
    /// PEM file of the CA that signed the webhook's serving certificate (e.g. certs/dev/ca.crt
    /// from `cnat certs`), written into the CRD as the conversion webhook's caBundle.
    #[arg(long)]
    pub ca_bundle: Option<PathBuf>,
}

fn service_ref(value: &str) -> Result<(String, String), String> {
    match value.split_once('/') {
        Some((namespace, name))
            if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
        {
            Ok((namespace.to_owned(), name.to_owned()))
        }
        _ => Err(format!(
            "{value:?} is not NAMESPACE/NAME; for example cnat-system/cnat-webhook"
        )),
    }
}

#[derive(Debug, Args)]
pub struct MigrateStorageArgs {
    /// Have the API server check every write (admission included) without writing anything,
    /// and leave status.storedVersions as it is.
    #[arg(long)]
    pub dry_run: bool,
    /// Ats per list page.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=10000))]
    pub page_size: u32,
    /// Writes in flight at once.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub concurrency: u16,
}

#[derive(Debug, Args)]
pub struct SmokeTestArgs {
    /// Namespace to create the At in [default: $POD_NAMESPACE, else the context's namespace].
    #[arg(long, env = "CNAT_SMOKE_NAMESPACE")]
    pub namespace: Option<String>,
    /// How long to wait for Done (image pulls included).
    #[arg(long, default_value = "180s", value_parser = duration)]
    pub timeout: Duration,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Manifest files or directories (searched for .yaml, .yml, .json), or - for standard input.
    #[arg(short = 'f', long = "filename", required = true)]
    pub files: Vec<PathBuf>,
}

#[derive(Debug, Args)]
pub struct CertsArgs {
    /// Directory to write ca.crt, tls.crt and tls.key into.
    #[arg(long, default_value = "certs/dev")]
    pub out_dir: PathBuf,
    /// Name of the webhook Service; the certificate is for <service>.<namespace>.svc.
    #[arg(long, default_value = "cnat-webhook")]
    pub service: String,
    /// Namespace of the webhook Service.
    #[arg(long, default_value = "cnat-system")]
    pub namespace: String,
    /// How long the certificates are valid, in days (at most 3650).
    #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..=3650))]
    pub days: u32,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Watch Ats in this namespace only [default: all namespaces].
    #[arg(long, env = "CNAT_NAMESPACE")]
    pub namespace: Option<String>,

    /// Most Ats reconciled at the same time; 0 means no limit. Each in-flight reconcile holds one
    /// HTTP/1.1 connection to the API server, so this also bounds memory.
    #[arg(long, env = "CNAT_CONCURRENCY", default_value_t = 32)]
    pub concurrency: u16,

    /// Image that runs the command of an At that names none (`spec.template.image`); pin it
    /// (a tag other than `latest`, or a digest). In a cluster without Docker Hub, a copy of
    /// busybox (or any image with `/bin/sh`) in a registry the nodes reach.
    #[arg(long, env = "CNAT_DEFAULT_IMAGE", default_value = crate::api::DEFAULT_IMAGE, value_parser = image)]
    pub default_image: String,

    /// `imagePullPolicy` of run pods whose At sets none: `Always`, `IfNotPresent` or `Never`
    /// [default: Kubernetes' own: `Always` for `latest` or no tag, else `IfNotPresent`].
    #[arg(long, env = "CNAT_DEFAULT_IMAGE_PULL_POLICY")]
    pub default_image_pull_policy: Option<ImagePullPolicy>,

    /// Requests for run pods that do not set them, per resource, like a LimitRange's
    /// defaultRequest: `cpu=100m,memory=64Mi`.
    #[arg(long, env = "CNAT_DEFAULT_REQUESTS", value_parser = policy::parse_quantities)]
    pub default_requests: Option<BTreeMap<String, Quantity>>,

    /// Limits for run pods that do not set them, per resource, like a LimitRange's default:
    /// `cpu=1,memory=256Mi`.
    #[arg(long, env = "CNAT_DEFAULT_LIMITS", value_parser = policy::parse_quantities)]
    pub default_limits: Option<BTreeMap<String, Quantity>>,

    /// `activeDeadlineSeconds` for Ats that do not set it.
    #[arg(long, env = "CNAT_DEFAULT_ACTIVE_DEADLINE_SECONDS", value_parser = clap::value_parser!(i64).range(1..=limits::MAX_SECONDS))]
    pub default_active_deadline_seconds: Option<i64>,

    /// `startingDeadlineSeconds` for Ats that do not set it (without it they run however late).
    #[arg(long, env = "CNAT_DEFAULT_STARTING_DEADLINE_SECONDS", value_parser = clap::value_parser!(i64).range(0..=limits::MAX_SECONDS))]
    pub default_starting_deadline_seconds: Option<i64>,

    /// `ttlSecondsAfterFinished` for Ats that do not set it (without it Done Ats stay).
    #[arg(long, env = "CNAT_DEFAULT_TTL_SECONDS_AFTER_FINISHED", value_parser = clap::value_parser!(i32).range(0..))]
    pub default_ttl_seconds_after_finished: Option<i32>,

    /// How often a Running At checks its pod without being told (the pod watch can miss a
    /// deletion while it re-lists); more than 1h counts as 1h.
    #[arg(long, env = "CNAT_RUNNING_RECHECK", default_value = "60s", value_parser = duration)]
    pub running_recheck: Duration,

    /// Log format: `json` lines, human-readable `text`, or `auto` (json inside a cluster).
    #[arg(long, env = "CNAT_LOG_FORMAT", value_enum, default_value_t = LogFormat::Auto)]
    pub log_format: LogFormat,

    /// Which log lines to keep, as `RUST_LOG`-style directives, e.g. `info,cnat=debug`.
    #[arg(long, env = "CNAT_LOG", default_value = "info")]
    pub log: String,

    /// Address of the plain-HTTP admin server (/healthz, /readyz, /metrics).
    #[arg(long, env = "CNAT_ADMIN_ADDR", default_value = "[::]:8080")]
    pub admin_addr: SocketAddr,

    /// List the Ats by a streaming watch (`sendInitialEvents`, the WatchList feature of
    /// kube-apiserver 1.32 and 1.34+) where the API server offers one; `false`: by paged lists,
    /// as on servers that do not (a refusal switches to those by itself).
    #[arg(long, env = "CNAT_WATCH_LIST", default_value_t = true, action = ArgAction::Set)]
    pub watch_list: bool,

    /// Serve the admission webhooks (every replica does, leader or not).
    #[arg(long, env = "CNAT_WEBHOOKS", default_value_t = true, action = ArgAction::Set)]
    pub webhooks: bool,

    /// The escalation guard: allow creating an At (or changing its spec) only to users who may
    /// create pods in its namespace, asked with a SubjectAccessReview.
    #[arg(long, env = "CNAT_ACCESS_REVIEW", default_value_t = true, action = ArgAction::Set)]
    pub access_review: bool,

    /// What the guard does when the review cannot be made in time: `deny` (safe) or `allow`.
    #[arg(long, env = "CNAT_ACCESS_REVIEW_ON_ERROR", value_enum, default_value_t = OnError::Deny)]
    pub access_review_on_error: OnError,

    /// How long an answer is reused for the same user, groups and namespace.
    #[arg(long, env = "CNAT_ACCESS_REVIEW_CACHE_TTL", default_value = "10s", value_parser = duration)]
    pub access_review_cache_ttl: Duration,

    /// How long after its last use an answer is kept fresh in the background, so the user's
    /// next apply within that time does not wait for a review (0s: only while applies keep
    /// coming within the cache TTL).
    #[arg(long, env = "CNAT_ACCESS_REVIEW_KEEP_WARM", default_value = "2m", value_parser = duration)]
    pub access_review_keep_warm: Duration,

    /// The longest the guard waits for the API server's answer.
    #[arg(long, env = "CNAT_ACCESS_REVIEW_TIMEOUT", default_value = "2s", value_parser = duration)]
    pub access_review_timeout: Duration,

    /// Address of the HTTPS webhook server.
    #[arg(long, env = "CNAT_WEBHOOK_ADDR", default_value = "[::]:8443")]
    pub webhook_addr: SocketAddr,

    /// PEM certificate chain the webhook server presents (a mounted Secret's tls.crt).
    #[arg(long, env = "CNAT_TLS_CERT", default_value = "/etc/cnat/tls/tls.crt")]
    pub tls_cert: PathBuf,

    /// PEM private key of that certificate (the Secret's tls.key).
    #[arg(long, env = "CNAT_TLS_KEY", default_value = "/etc/cnat/tls/tls.key")]
    pub tls_key: PathBuf,

    /// PEM bundle of a CA that signs only the client certificate kube-apiserver presents to
    /// webhooks (an AdmissionConfiguration with a kubeconfig for cnat's webhooks): the admission
    /// webhooks then answer only clients with a certificate it signed (403 for none; a
    /// certificate another CA signed fails the handshake). Conversions are answered for anyone:
    /// kube-apiserver's conversion calls carry no client certificate. Unset: anyone.
    #[arg(long, env = "CNAT_WEBHOOK_CLIENT_CA")]
    pub webhook_client_ca: Option<PathBuf>,

    /// How often to look for a renewed certificate; new connections get it without a restart.
    #[arg(long, env = "CNAT_TLS_RELOAD_INTERVAL", default_value = "10s", value_parser = duration)]
    pub tls_reload_interval: Duration,

    /// Keep the webhook's CA and serving certificate in this Secret of the Lease's namespace,
    /// instead of reading --tls-cert and --tls-key: the first replica makes it, every replica
    /// serves it, keeps the webhook configurations' and the CRD's caBundle trusting it, and
    /// rotates it before it expires. Unset: the files.
    #[arg(long, env = "CNAT_WEBHOOK_CERTS_SECRET")]
    pub webhook_certs_secret: Option<String>,

    /// With --webhook-certs-secret: the name of the mutating and of the validating webhook
    /// configuration whose webhooks calling this Service get the caBundle.
    #[arg(long, env = "CNAT_WEBHOOK_CONFIGURATION", default_value = "cnat")]
    pub webhook_configuration: String,

    /// With --webhook-certs-secret: the webhook Service (in the Lease's namespace) the
    /// certificate is for, and that webhooks and the CRD's conversion must call to get the
    /// caBundle.
    #[arg(long, env = "CNAT_WEBHOOK_SERVICE", default_value = "cnat-webhook")]
    pub webhook_service: String,

    /// With --webhook-certs-secret: more DNS names or IP addresses for the certificate (comma
    /// separated); a webhook calling a URL with one of them as its host gets the caBundle too.
    #[arg(long, env = "CNAT_WEBHOOK_CERT_NAMES", value_delimiter = ',')]
    pub webhook_cert_names: Vec<String>,

    /// With --webhook-certs-secret: how long a new CA is trusted before it signs the served
    /// certificate, and a replica waits before it serves a certificate of another CA; the CA a
    /// rotation replaced stays trusted for two overlaps. From 1s to 168h.
    #[arg(long, env = "CNAT_WEBHOOK_CA_OVERLAP", default_value = "10m", value_parser = duration)]
    pub webhook_ca_overlap: Duration,

    /// Name of the coordination.k8s.io/v1 Lease the replicas compete for.
    #[arg(long, env = "CNAT_LEASE_NAME", default_value = "cnat")]
    pub lease_name: String,

    /// Split the Ats among this many Leases (1-60): each replica leads some of them, caching and
    /// reconciling only their Ats, so memory and work spread over the replicas. With 1 (the
    /// default) one replica leads every At. Shard I's Lease is LEASE_NAME-I-of-N; each replica
    /// also renews a membership Lease, LEASE_NAME-member-HASH, to count the replicas.
    #[arg(long, env = "CNAT_SHARDS", default_value = "1", value_parser = shards)]
    pub shards: crate::shard::Shards,

    /// Namespace of the Lease [default: $POD_NAMESPACE, else the namespace of the in-cluster or
    /// kubeconfig context].
    #[arg(long, env = "CNAT_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,

    /// Secret, in the Lease's namespace, holding the key cnat signs its pods with (a pod by an
    /// At's pod name that lacks the signature was not made by cnat and is never run as the
    /// At's). The first replica that needs it creates it.
    #[arg(
        long,
        env = "CNAT_POD_SIGNING_SECRET",
        default_value = "cnat-pod-signing"
    )]
    pub pod_signing_secret: String,

    /// This replica's identity in the Lease [default: $POD_NAME, else host name plus a random suffix].
    #[arg(long, env = "CNAT_IDENTITY")]
    pub identity: Option<String>,

    /// How long the Lease stays valid after its last renewal (whole seconds).
    #[arg(long, env = "CNAT_LEASE_DURATION", default_value = "15s", value_parser = duration)]
    pub lease_duration: Duration,

    /// How long the leader keeps reconciling without a successful renewal; must be shorter than
    /// the lease duration.
    #[arg(long, env = "CNAT_RENEW_DEADLINE", default_value = "10s", value_parser = duration)]
    pub renew_deadline: Duration,

    /// How often candidates try to acquire and the leader renews; 1.2 x this must be shorter than
    /// the renew deadline.
    #[arg(long, env = "CNAT_RETRY_PERIOD", default_value = "2s", value_parser = duration)]
    pub retry_period: Duration,

    /// On shutdown, how long reconciles in flight may finish before the reconcile loop is
    /// aborted and the Lease released; a new leader takes over right after.
    #[arg(long, env = "CNAT_STEP_DOWN_GRACE", default_value = "200ms", value_parser = duration)]
    pub step_down_grace: Duration,

    /// After SIGTERM, how long to keep serving before closing the servers, so the endpoint is
    /// removed from Services first.
    #[arg(long, env = "CNAT_SHUTDOWN_DELAY", default_value = "5s", value_parser = duration)]
    pub shutdown_delay: Duration,

    /// The longest a graceful shutdown may take; keep it below the pod's
    /// terminationGracePeriodSeconds (30s by default).
    #[arg(long, env = "CNAT_SHUTDOWN_TIMEOUT", default_value = "25s", value_parser = duration)]
    pub shutdown_timeout: Duration,
}

impl RunArgs {
    /// The escalation guard's settings, `None` when it is off.
    pub fn access_review(&self) -> Option<access_review::Settings> {
        self.access_review.then_some(access_review::Settings {
            cache_ttl: self.access_review_cache_ttl,
            timeout: self.access_review_timeout,
            on_error: self.access_review_on_error,
            keep_warm: self.access_review_keep_warm,
        })
    }

    /// What applies to runs whose At leaves it out.
    pub fn policy(&self) -> RunPolicy {
        RunPolicy {
            image: self.default_image.clone(),
            image_pull_policy: self.default_image_pull_policy,
            requests: self.default_requests.clone().unwrap_or_default(),
            limits: self.default_limits.clone().unwrap_or_default(),
            active_deadline_seconds: self.default_active_deadline_seconds,
            starting_deadline_seconds: self.default_starting_deadline_seconds,
            ttl_seconds_after_finished: self.default_ttl_seconds_after_finished,
            running_recheck: self.running_recheck,
        }
    }

    pub fn timing(&self) -> Timing {
        Timing {
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
            step_down_grace: self.step_down_grace,
        }
    }
}

/// `--shards`: a whole number from 1 to `shard::VALUES`.
fn shards(raw: &str) -> Result<crate::shard::Shards, String> {
    let count: usize = raw.parse().map_err(|_| {
        format!(
            "{raw:?} is not a whole number of shards; give 1 to {}",
            crate::shard::VALUES
        )
    })?;
    crate::shard::Shards::new(count).map_err(|error| error.to_string())
}

/// `--default-image`: an image reference the kubelet takes, as for `spec.template.image`.
fn image(raw: &str) -> Result<String, String> {
    match image_problem(raw) {
        None => Ok(raw.to_owned()),
        Some(problem) => Err(problem.trim_start_matches("spec.template.image: ").replace(
            "remove the field to use the operator's default image",
            "name an image",
        )),
    }
}

/// Parses durations such as `15s`, `500ms` or `1m 30s`.
fn duration(raw: &str) -> Result<Duration, String> {
    let parsed: jiff::SignedDuration = raw
        .parse()
        .map_err(|e| format!("{raw:?} is not a duration like 15s, 500ms or 1m30s ({e})"))?;
    Duration::try_from(parsed).map_err(|_| format!("{raw:?} is negative"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Auto,
    Json,
    Text,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_defaults_watch_every_namespace() {
        let cli = Cli::try_parse_from(["cnat", "run"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("run")
        };
        assert_eq!(args.namespace, None);
        assert_eq!(args.concurrency, 32);
        assert_eq!(args.log_format, LogFormat::Auto);
    }

    #[test]
    fn bad_flags_are_refused_with_the_accepted_values() {
        let err = Cli::try_parse_from(["cnat", "run", "--log-format", "xml"]).unwrap_err();
        assert!(
            err.to_string()
                .contains("possible values: auto, json, text"),
            "{err}"
        );
        for bad in [
            "--concurrency=-1",
            "--concurrency=70000",
            "--concurrency=lots",
        ] {
            let err = Cli::try_parse_from(["cnat", "run", bad]).unwrap_err();
            let message = err.to_string();
            assert!(
                message.contains("invalid value") && message.contains("--concurrency"),
                "{message}"
            );
        }
    }

    #[test]
    fn durations_read_like_go_flags() {
        let cli = Cli::try_parse_from([
            "cnat",
            "run",
            "--lease-duration=20s",
            "--renew-deadline=1m",
            "--retry-period=500ms",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("run")
        };
        assert_eq!(args.lease_duration, Duration::from_secs(20));
        assert_eq!(args.renew_deadline, Duration::from_secs(60));
        assert_eq!(args.retry_period, Duration::from_millis(500));
        for bad in [
            "--retry-period=soon",
            "--retry-period=-2s",
            "--retry-period=2",
        ] {
            let err = Cli::try_parse_from(["cnat", "run", bad])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("invalid value") && err.contains("--retry-period"),
                "{err}"
            );
        }
    }

    #[test]
    fn run_defaults_are_read_like_a_limit_range() {
        let Command::Run(args) = Cli::try_parse_from([
            "cnat",
            "run",
            "--default-requests=cpu=100m,memory=64Mi",
            "--default-limits",
            "memory=256Mi",
            "--default-active-deadline-seconds=3600",
            "--default-starting-deadline-seconds=0",
            "--default-ttl-seconds-after-finished=86400",
            "--default-image=registry.example.com/mirror/busybox:1.36",
            "--default-image-pull-policy=IfNotPresent",
        ])
        .unwrap()
        .command
        else {
            panic!("run")
        };
        let policy = args.policy();
        assert_eq!(policy.requests.len(), 2);
        assert_eq!(policy.limits["memory"].0, "256Mi");
        assert_eq!(policy.active_deadline_seconds, Some(3600));
        assert_eq!(policy.starting_deadline_seconds, Some(0));
        assert_eq!(policy.ttl_seconds_after_finished, Some(86400));
        assert_eq!(policy.image, "registry.example.com/mirror/busybox:1.36");
        assert_eq!(
            policy.image_pull_policy,
            Some(ImagePullPolicy::IfNotPresent)
        );
        let Command::Run(plain) = Cli::try_parse_from(["cnat", "run"]).unwrap().command else {
            panic!("run")
        };
        assert_eq!(plain.policy(), RunPolicy::default());
        for bad in [
            "--default-requests=cpu=lots",
            "--default-limits=memory",
            "--default-active-deadline-seconds=0",
            "--default-starting-deadline-seconds=-1",
            "--default-ttl-seconds-after-finished=-1",
            "--default-image=",
            "--default-image=Busybox:1.36",
            "--default-image-pull-policy=ifnotpresent",
        ] {
            let err = Cli::try_parse_from(["cnat", "run", bad])
                .unwrap_err()
                .to_string();
            assert!(err.contains("invalid value"), "{bad}: {err}");
        }
        let err = Cli::try_parse_from(["cnat", "run", "--default-image-pull-policy=Sometimes"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "\"Sometimes\" is not an imagePullPolicy; give Always, IfNotPresent or Never"
            ),
            "{err}"
        );
        let err = Cli::try_parse_from(["cnat", "run", "--default-image=Busybox"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"Busybox\" is not a valid image reference")
                && !err.contains("spec.template"),
            "{err}"
        );
    }

    #[test]
    fn shards_take_1_to_60_and_say_so_otherwise() {
        for (raw, count) in [("1", 1), ("3", 3), ("60", 60)] {
            let Command::Run(args) = Cli::try_parse_from(["cnat", "run", "--shards", raw])
                .unwrap()
                .command
            else {
                panic!("run")
            };
            assert_eq!(args.shards.count(), count);
        }
        for bad in ["0", "61", "-1", "two", ""] {
            let err = Cli::try_parse_from(["cnat", "run", &format!("--shards={bad}")])
                .unwrap_err()
                .to_string();
            assert!(err.contains("give 1") && err.contains("60"), "{bad}: {err}");
        }
    }

    #[test]
    fn ha_defaults_are_client_go_defaults() {
        let Command::Run(args) = Cli::try_parse_from(["cnat", "run"]).unwrap().command else {
            panic!("run")
        };
        assert_eq!(args.timing(), Timing::default());
        assert_eq!(args.lease_name, "cnat");
        assert_eq!(args.shards.count(), 1);
        assert!(args.shutdown_delay < args.shutdown_timeout);
        assert!(args.shutdown_timeout < Duration::from_secs(30));
    }

    #[test]
    fn every_run_flag_reads_a_cnat_variable() {
        let command = Cli::command();
        let run = command.find_subcommand("run").unwrap();
        for arg in run.get_arguments().filter(|a| a.get_long().is_some()) {
            let long = arg.get_long().unwrap();
            if matches!(long, "help" | "version") {
                continue;
            }
            let env = arg
                .get_env()
                .unwrap_or_else(|| panic!("--{long} has no env var"));
            let expected = format!("CNAT_{}", long.to_uppercase().replace('-', "_"));
            assert_eq!(env.to_str(), Some(expected.as_str()));
        }
    }
}
