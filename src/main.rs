//! `cnat`: parses the command line, wires the pieces of `cnat run` together, and shuts them down
//! in order on SIGTERM or SIGINT.

use axum_server::tls_rustls::RustlsConfig;
use clap::Parser;
use cnat::admission::access_review::AccessReviewer;
use cnat::cli::{
    CertsArgs, CheckArgs, Cli, Command, CrdArgs, MigrateStorageArgs, ReleaseArgs, RunArgs,
    SmokeTestArgs,
};
use cnat::leader::{self, Leadership};
use cnat::leading::Election;
use cnat::observability::metrics::Metrics;
use cnat::serving::admin::{self, Health};
use cnat::serving::tls::{self, CertFiles};
use cnat::{admission::webhook, api, observability::telemetry, operator::controller};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// mimalloc in every build (glibc or the image's musl), so the image allocates as benches measure.
/// See docs/src/design/decisions.md, "The allocator".
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long exiting waits for the collector to take the last spans.
const TRACE_FLUSH_TIMEOUT: Duration = Duration::from_secs(3);

fn main() -> ExitCode {
    no_transparent_huge_pages();
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(command(Cli::parse().command)),
        Err(error) => {
            eprintln!("cnat: could not start the async runtime: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Turns transparent huge pages off for this process, before the runtime's threads allocate
/// (docs/src/design/decisions.md, "The allocator"). Where the kernel refuses, nothing changes.
fn no_transparent_huge_pages() {
    // SAFETY: prctl(PR_SET_THP_DISABLE) takes integer arguments only and changes a flag of this
    // process; it touches no memory of ours.
    #[cfg(target_os = "linux")]
    unsafe {
        libc::prctl(
            libc::PR_SET_THP_DISABLE,
            1 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        );
    }
}

/// A command's failure, printed as `cnat COMMAND: ERROR` (exit code 1).
type Failure = Box<dyn std::error::Error>;

async fn command(command: Command) -> ExitCode {
    let (name, outcome) = match command {
        Command::Crd(args) => ("cnat crd", crd(args)),
        Command::Check(args) => return check(args),
        Command::Certs(args) => ("cnat certs", certs(args)),
        Command::SmokeTest(args) => ("cnat smoke-test", smoke_test(args).await),
        Command::MigrateStorage(args) => ("cnat migrate-storage", migrate_storage(args).await),
        Command::Release(args) => ("cnat release", release(args).await),
        Command::Run(args) => (
            "cnat",
            run(*args)
                .await
                .map(|()| ExitCode::SUCCESS)
                .map_err(Failure::from),
        ),
    };
    outcome.unwrap_or_else(|error| {
        eprintln!("{name}: {error}");
        ExitCode::FAILURE
    })
}

/// `cnat crd`: the CRD on stdout, conversion by the given Service (and CA).
fn crd(args: CrdArgs) -> Result<ExitCode, Failure> {
    let (namespace, name) = &args.conversion_service;
    let mut client = api::conversion_service(namespace, name);
    if let Some(path) = &args.ca_bundle {
        match std::fs::read(path) {
            Ok(pem) if is_pem_certificates(&pem) => {
                client.ca_bundle = Some(k8s_openapi::ByteString(pem));
            }
            Ok(_) => return Err(format!(
                "--ca-bundle {}: no PEM certificate in it; give the CA's PEM file (ca.crt from `cnat certs`)",
                path.display()
            )
            .into()),
            Err(error) => return Err(format!("--ca-bundle {}: {error}", path.display()).into()),
        }
    }
    print!("{}", api::crd_to_yaml(&api::crd_with(client)));
    Ok(ExitCode::SUCCESS)
}

/// Whether `pem` holds one or more certificates and nothing unreadable.
fn is_pem_certificates(pem: &[u8]) -> bool {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let certificates: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    certificates.is_ok_and(|c| !c.is_empty())
}

/// `cnat check`: problems on stdout, a summary on stderr, exit 1 if any At is invalid.
fn check(args: CheckArgs) -> ExitCode {
    let report = cnat::admission::check::check_paths(&args.files, std::io::stdin());
    for problem in &report.problems {
        println!("{problem}");
    }
    eprintln!(
        "checked {} At(s): {} problem(s)",
        report.checked,
        report.problems.len()
    );
    if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `cnat smoke-test`: one At through its whole life; exit 1 unless it succeeded.
async fn smoke_test(args: SmokeTestArgs) -> Result<ExitCode, Failure> {
    let client = cnat::client().await?;
    let namespace = namespace_or_own(args.namespace, &client);
    println!(
        "{}",
        cnat::smoke_test::run(client, &namespace, args.timeout).await?
    );
    Ok(ExitCode::SUCCESS)
}

/// `cnat migrate-storage`: progress per page on stderr, the result on stdout.
async fn migrate_storage(args: MigrateStorageArgs) -> Result<ExitCode, Failure> {
    use cnat::storage_migration::{migrate, Options};
    let client = cnat::client().await?;
    let options = Options {
        dry_run: args.dry_run,
        page_size: args.page_size,
        concurrency: args.concurrency.into(),
        ..Options::default()
    };
    let progress = |report: &cnat::storage_migration::Report| {
        if report.dry_run {
            eprintln!(
                "cnat migrate-storage (dry run): {} read, {} accepted, {} refused, {} gone",
                report.read,
                report.unchanged,
                report.left.len(),
                report.gone
            )
        } else {
            eprintln!(
                "cnat migrate-storage: {} read, {} rewritten, {} already stored as {}, {} left behind, {} gone",
                report.read,
                report.rewritten,
                report.unchanged,
                report.storage_version,
                report.left.len(),
                report.gone
            )
        }
    };
    println!("{}", migrate(client, &options, progress).await?);
    Ok(ExitCode::SUCCESS)
}

/// `cnat release`: every pod let go of cnat's finalizer; the count on stdout, failures on
/// stderr.
async fn release(args: ReleaseArgs) -> Result<ExitCode, Failure> {
    let client = cnat::client().await?;
    let stopping = args.stop_deployment.is_some();
    if stopping {
        // A first pass while the operator still serves the CRD's conversion (an At stored in
        // an older version reads only through it): every pod recorded so far goes now.
        if let Ok(first) =
            cnat::operator::release::release_all(client.clone(), args.namespace.as_deref()).await
        {
            println!("released {} pod(s) before stopping cnat", first.released);
        }
    }
    if let Some((namespace, name)) = &args.stop_deployment {
        use cnat::operator::release::{stop_deployment, Stopped};
        match stop_deployment(&client, namespace, name, args.stop_timeout).await? {
            Stopped::Stopped => println!("stopped Deployment {namespace}/{name}"),
            Stopped::Absent => println!("no Deployment {namespace}/{name}: nothing to stop"),
            Stopped::Scaled => println!(
                "scaled Deployment {namespace}/{name} to 0 (it selects its pods by no label: not waited for)"
            ),
            Stopped::StillRunning(left) => eprintln!(
                "cnat release: {left} pod(s) of Deployment {namespace}/{name} still there after {:?}; releasing anyway (a pod they create from now on keeps cnat's finalizer: run cnat release again once they are gone)",
                args.stop_timeout
            ),
        }
    }
    let released = cnat::operator::release::release_all(client, args.namespace.as_deref()).await?;
    println!(
        "released {} pod(s) from cnat's finalizer",
        released.released
    );
    for (pod, why) in &released.kept {
        eprintln!("cnat release: pod {pod}: {why}");
    }
    if !released.kept.is_empty() && stopping {
        // The operator is gone: nothing will record them; the uninstall goes on.
        eprintln!("cnat release: {} pod(s) keep cnat's finalizer, so that their command never runs twice should cnat be installed again; to let one go (other finalizers stay): kubectl get pod NAME -n NAMESPACE -o json | jq '.metadata.finalizers -= [\"{}\"]' | kubectl replace -f -", released.kept.len(), cnat::operator::finalizer::FINALIZER);
    }
    Ok(if released.kept.is_empty() || stopping {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `cnat certs`: a development CA and serving certificate.
fn certs(args: CertsArgs) -> Result<ExitCode, Failure> {
    let files = tls::generate(&args.service, &args.namespace, args.days)
        .and_then(|c| c.write(&args.out_dir))?;
    let dir = args.out_dir.display();
    println!(
        "wrote {dir}/ca.crt, {} and {}",
        files.cert.display(),
        files.key.display()
    );
    println!(
        "serving certificate for {}.{}.svc (and localhost), valid {} days",
        args.service, args.namespace, args.days
    );
    println!("caBundle for the webhook configurations: base64 -w0 {dir}/ca.crt");
    Ok(ExitCode::SUCCESS)
}

/// Why `cnat run` stopped with an error (printed as `cnat: ...`, exit code 1).
#[derive(Debug, thiserror::Error)]
enum RunError {
    #[error(transparent)]
    Telemetry(#[from] telemetry::Error),
    #[error(transparent)]
    Timing(#[from] leader::TimingError),
    #[error("--shutdown-delay {delay:?} must be shorter than --shutdown-timeout {timeout:?}")]
    ShutdownDelay { delay: Duration, timeout: Duration },
    #[error(transparent)]
    Connect(#[from] cnat::ConnectError),
    #[error("--admin-addr {addr}: {source}")]
    AdminAddr {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("webhook certificate (--tls-cert, --tls-key): {0}")]
    Certificate(#[from] tls::TlsError),
    #[error("--webhook-addr {addr}: {why}")]
    WebhookAddr { addr: SocketAddr, why: String },
    #[error("the At cache stopped following the Ats")]
    CacheStopped,
    #[error("stopped before the webhook certificate was ready (see the warnings before this)")]
    CertificatesStopped,
    #[error("--webhook-ca-overlap {0:?}: must be from 1s to 168h (7 days); 10m is the default")]
    CaOverlap(Duration),
    #[error("--lease-name {0:?} is {len} characters; with --shards it names the membership Leases by the label {label}, whose value may have at most 63: use a shorter name", len = .0.len(), label = leader::members::LABEL)]
    LeaseNameTooLong(String),
}

/// Every replica serves the admin endpoints and the webhooks; the Lease holder also reconciles.
async fn run(args: RunArgs) -> Result<(), RunError> {
    let identity = args.identity.clone().unwrap_or_else(cnat::identity);
    let telemetry = telemetry::init(args.log_format, &args.log, &identity)?;
    // Panic messages go through the log, once each (see `operator::quarantine`).
    cnat::operator::quarantine::install_hook();
    let result = serve(args, identity, telemetry.exporting()).await;
    // Whatever happened, the spans that tell about it reach the collector.
    telemetry.shutdown(TRACE_FLUSH_TIMEOUT).await;
    result
}

/// What `cnat run` serves until it shuts down.
struct Serving {
    health: Arc<Health>,
    draining: cnat::serving::drain::Draining,
    /// Cancelled to close the servers (after the shutdown delay).
    close_servers: CancellationToken,
    admin: JoinHandle<std::io::Result<()>>,
    webhooks: Option<WebhookServer>,
}

type WebhookServer = (
    JoinHandle<std::io::Result<()>>,
    axum_server::Handle<SocketAddr>,
);

/// `cnat run` once telemetry is up: the servers, then the election, then the shutdown.
async fn serve(args: RunArgs, identity: String, exporting: bool) -> Result<(), RunError> {
    let timing = args.timing();
    timing.validate()?;
    if args.shards.count() > 1 && args.lease_name.len() > 63 {
        return Err(RunError::LeaseNameTooLong(args.lease_name.clone()));
    }
    if args.shutdown_delay >= args.shutdown_timeout {
        return Err(RunError::ShutdownDelay {
            delay: args.shutdown_delay,
            timeout: args.shutdown_timeout,
        });
    }
    let client = cnat::client().await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(on_signal(shutdown.clone()));
    let leadership = Arc::new(Leadership::default());
    let metrics = Arc::new(Metrics::new(leadership.clone()));
    let health = Arc::new(Health::new(
        leadership.clone(),
        timing.lease_duration,
        args.webhooks,
    ));
    // With one Lease every replica caches every At, and is ready and a candidate only once it
    // has them all; with Lease shards a replica caches only the shards it leads.
    let cache = (args.shards.count() == 1).then(|| {
        cnat::operator::cache::AtCache::start_listing(
            &client,
            args.namespace.as_deref(),
            args.watch_list,
        )
    });
    if let Some(cache) = &cache {
        let cache = cache.clone();
        health.require(move || cache.readiness().map_err(Into::into));
    }
    let (serving, admin_addr) = start_servers(&args, &client, &metrics, health, &shutdown).await?;
    let cache_stopped = {
        let stopped = cache.as_ref().map(|cache| cache.stopped());
        async move {
            match stopped {
                Some(stopped) => stopped.await,
                None => std::future::pending().await,
            }
        }
    };
    let lease_namespace = namespace_or_own(args.lease_namespace.clone(), &client);
    let signing = cnat::operator::signing::Source::secret(
        lease_namespace.clone(),
        args.pod_signing_secret.clone(),
    );
    let election = Election {
        lease_namespace,
        lease_name: args.lease_name.clone(),
        client,
        identity,
        timing,
        leadership,
        metrics,
        controller: controller::Settings {
            namespace: args.namespace.clone(),
            selector: None,
            concurrency: args.concurrency,
            policy: args.policy(),
            signing,
        },
        streaming: args.watch_list,
        shutdown_timeout: args.shutdown_timeout,
    };
    let election = match cache {
        Some(cache) => election.run(cache, &shutdown),
        None => election.run_shards(args.shards, &shutdown),
    };
    info!(admin = %admin_addr, exporting_traces = exporting, "cnat started");
    let failed = tokio::select! {
        _ = shutdown.cancelled() => None,
        _ = cache_stopped => {
            error!("the At cache stopped following the Ats (its task panicked); stopping, so that the pod restarts");
            shutdown.cancel();
            Some(RunError::CacheStopped)
        }
    };
    shut_down(&args, serving, election).await;
    failed.map_or(Ok(()), Err)
}

/// The admin server and, unless `--webhooks=false`, the webhook server; returns once they
/// listen, with the admin address bound (`--admin-addr=127.0.0.1:0` then logs its port).
async fn start_servers(
    args: &RunArgs,
    client: &kube::Client,
    metrics: &Arc<Metrics>,
    health: Arc<Health>,
    shutdown: &CancellationToken,
) -> Result<(Serving, SocketAddr), RunError> {
    let listener =
        cnat::serving::listen::bind(args.admin_addr).map_err(|source| RunError::AdminAddr {
            addr: args.admin_addr,
            source,
        })?;
    let admin_addr = listener.local_addr().unwrap_or(args.admin_addr);
    let close_servers = CancellationToken::new();
    let admin = tokio::spawn(admin::serve(
        listener,
        admin::router(health.clone(), metrics.clone()),
        close_servers.clone(),
        cnat::serving::guard::Limits::admin(),
    ));
    let draining = cnat::serving::drain::Draining::default();
    let webhooks = if args.webhooks {
        let reviewer = args.access_review().map(|settings| {
            Arc::new(AccessReviewer::new(
                client.clone(),
                settings,
                metrics.clone(),
            ))
        });
        let shared = webhook::Shared {
            metrics: metrics.clone(),
            reviewer,
            draining: draining.clone(),
            certified_only: args.webhook_client_ca.is_some(),
        };
        let stop = close_servers.clone();
        Some(start_webhooks(args, shared, client, &health, (stop, shutdown)).await?)
    } else {
        None
    };
    health.set_webhooks_serving();
    let serving = Serving {
        health,
        draining,
        close_servers,
        admin,
        webhooks,
    };
    Ok((serving, admin_addr))
}

/// `given`, else this pod's namespace (`POD_NAMESPACE`, from the downward API), else the
/// client's default.
fn namespace_or_own(given: Option<String>, client: &kube::Client) -> String {
    given
        .or_else(|| {
            std::env::var("POD_NAMESPACE")
                .ok()
                .filter(|ns| !ns.is_empty())
        })
        .unwrap_or_else(|| client.default_namespace().to_owned())
}

/// Not ready at once; then stops reconciling and releases the Lease, serves until
/// `--shutdown-delay`, and finishes requests in flight, all within `--shutdown-timeout`.
async fn shut_down(args: &RunArgs, serving: Serving, election: JoinHandle<()>) {
    let signalled = Instant::now();
    serving.health.set_not_ready();
    serving.draining.start();
    let graceful = async {
        let _ = election.await;
        sleep_until(signalled + args.shutdown_delay).await;
        serving.close_servers.cancel();
        if let Some((server, handle)) = serving.webhooks {
            handle.graceful_shutdown(None);
            let _ = server.await;
        }
        let _ = serving.admin.await;
    };
    match timeout(args.shutdown_timeout, graceful).await {
        Ok(()) => info!("shut down cleanly"),
        Err(_) => {
            warn!(timeout = ?args.shutdown_timeout, "graceful shutdown took too long; exiting")
        }
    }
}

/// Starts the HTTPS webhook server and its certificate's keeper or reloader; returns once it
/// listens (with --webhook-certs-secret, once the Secret has a certificate).
async fn start_webhooks(
    args: &RunArgs,
    shared: webhook::Shared,
    client: &kube::Client,
    health: &Health,
    (stop_reloading, shutdown): (CancellationToken, &CancellationToken),
) -> Result<WebhookServer, RunError> {
    let config = match &args.webhook_certs_secret {
        None => {
            let files = CertFiles {
                cert: args.tls_cert.clone(),
                key: args.tls_key.clone(),
                client_ca: args.webhook_client_ca.clone(),
            };
            let config = RustlsConfig::from_config(tls::server_config(&files)?);
            let (interval, stop) = (args.tls_reload_interval, stop_reloading);
            tokio::spawn(tls::reload_on_change(files, config.clone(), interval, stop));
            config
        }
        Some(secret) => {
            let stop = stop_reloading;
            keep_certificates(args, secret, client, health, (stop, shutdown)).await?
        }
    };
    let handle = axum_server::Handle::new();
    let addr = args.webhook_addr;
    let listener = cnat::serving::listen::bind(addr).map_err(|e| RunError::WebhookAddr {
        addr,
        why: e.to_string(),
    })?;
    let server = tokio::spawn(webhook::serve(
        listener,
        config,
        handle.clone(),
        shared,
        cnat::serving::guard::Limits::default(),
    ));
    let Some(bound) = handle.listening().await else {
        let why = match server.await {
            Ok(Err(error)) => error.to_string(),
            other => format!("{other:?}"),
        };
        return Err(RunError::WebhookAddr { addr, why });
    };
    info!(addr = %bound, "serving admission webhooks");
    Ok((server, handle))
}

/// The webhook server's TLS config from the Secret `secret`, kept by `certs::run` until `stop`.
async fn keep_certificates(
    args: &RunArgs,
    secret: &str,
    client: &kube::Client,
    health: &Health,
    (stop, shutdown): (CancellationToken, &CancellationToken),
) -> Result<RustlsConfig, RunError> {
    use cnat::certs;
    let namespace = namespace_or_own(args.lease_namespace.clone(), client);
    let service = &args.webhook_service;
    let overlap = args.webhook_ca_overlap;
    if !(Duration::from_secs(1)..=Duration::from_secs(7 * 86_400)).contains(&overlap) {
        return Err(RunError::CaOverlap(overlap));
    }
    let policy = certs::rotation::Policy {
        overlap: jiff::SignedDuration::try_from(overlap).unwrap_or(jiff::SignedDuration::MAX),
        ..Default::default()
    };
    let settings = certs::Settings {
        here: certs::targets::Here {
            names: certs::Settings::names(&namespace, service, &args.webhook_cert_names),
            namespace: namespace.clone(),
            service: service.clone(),
        },
        secret: secret.to_owned(),
        namespace,
        configuration: args.webhook_configuration.clone(),
        crd: <cnat::api::At as kube::CustomResourceExt>::crd_name().to_owned(),
        policy,
        clock: cnat::leader::WallClock::system(),
    };
    let source = format!("Secret {}/{}", settings.namespace, settings.secret);
    let status = Arc::new(certs::Status::new(&settings));
    let readiness = status.clone();
    health.require(move || readiness.readiness().map_err(Into::into));
    let (serve, mut identities) = tokio::sync::watch::channel(None);
    tokio::spawn(certs::run(
        client.clone(),
        settings,
        serve,
        status,
        stop.clone(),
    ));
    info!("waiting for the webhook certificate in {source}");
    // A SIGTERM before the first certificate stops the wait (and the keeper) at once.
    let first = tokio::select! {
        first = identities.wait_for(Option::is_some) => first.ok().and_then(|f| f.clone()),
        _ = shutdown.cancelled() => None,
    };
    let Some(first) = first else {
        stop.cancel();
        return Err(RunError::CertificatesStopped);
    };
    let client_ca = args.webhook_client_ca.clone();
    let config = tls::identity_config(&first, &source, client_ca.clone())?;
    let config = RustlsConfig::from_config(config);
    let (interval, reloading) = (args.tls_reload_interval, config.clone());
    tokio::spawn(async move {
        tls::follow_identities(identities, &source, client_ca, reloading, interval, stop).await
    });
    Ok(config)
}

/// Cancels `shutdown` on the first SIGTERM or SIGINT.
async fn on_signal(shutdown: CancellationToken) {
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        warn!("cannot listen for signals; stop with SIGKILL");
        return;
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: shutting down"),
        _ = int.recv() => info!("SIGINT: shutting down"),
    }
    shutdown.cancel();
}
