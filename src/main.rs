//! `cnat`: parses the command line, wires the pieces of `cnat run` together, and shuts them down
//! in order on SIGTERM or SIGINT.

use clap::Parser;
use cnat::admin::{self, Health};
use cnat::cli::{Cli, Command, RunArgs};
use cnat::events::EventSink;
use cnat::leader::{self, Leadership};
use cnat::{api, controller, telemetry};
use kube::runtime::events::{Recorder, Reporter};
use std::future::IntoFuture;
use std::process::ExitCode;
use std::sync::Arc;
use tokio::signal::unix::{signal, SignalKind};
use tokio::time::{sleep_until, timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[tokio::main]
async fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Crd => {
            print!("{}", api::crd_yaml());
            ExitCode::SUCCESS
        }
        Command::Run(args) => match run(*args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("cnat: {error}");
                ExitCode::FAILURE
            }
        },
    }
}

/// Every replica serves the admin endpoints; the Lease holder also reconciles.
async fn run(args: RunArgs) -> Result<(), String> {
    telemetry::init(args.log_format, &args.log)
        .map_err(|e| format!("--log / CNAT_LOG {:?}: {e}", args.log))?;
    let timing = args.timing();
    timing.validate().map_err(|e| e.to_string())?;
    if args.shutdown_delay >= args.shutdown_timeout {
        return Err(format!(
            "--shutdown-delay {:?} must be shorter than --shutdown-timeout {:?}",
            args.shutdown_delay, args.shutdown_timeout
        ));
    }
    let client = cnat::client().await.map_err(|e| e.to_string())?;
    let identity = args.identity.clone().unwrap_or_else(cnat::identity);
    let namespace = args
        .lease_namespace
        .clone()
        .or_else(|| {
            std::env::var("POD_NAMESPACE")
                .ok()
                .filter(|ns| !ns.is_empty())
        })
        .unwrap_or_else(|| client.default_namespace().to_owned());

    let shutdown = CancellationToken::new();
    tokio::spawn(on_signal(shutdown.clone()));
    let leadership = Arc::new(Leadership::default());
    let health = Arc::new(Health::new(leadership.clone(), timing.lease_duration));
    let listener = tokio::net::TcpListener::bind(args.admin_addr)
        .await
        .map_err(|e| format!("--admin-addr {}: {e}", args.admin_addr))?;
    let close_servers = CancellationToken::new();
    let admin = tokio::spawn(
        axum::serve(listener, admin::router(health.clone()))
            .with_graceful_shutdown(close_servers.clone().cancelled_owned())
            .into_future(),
    );

    let reporter = Reporter {
        controller: "cnat".into(),
        instance: Some(identity.clone()),
    };
    let events = EventSink::start(Recorder::new(client.clone(), reporter));
    let election_settings = leader::Settings {
        lease_name: args.lease_name.clone(),
        namespace,
        identity,
        timing,
    };
    let controller_settings = controller::Settings {
        namespace: args.namespace.clone(),
        concurrency: args.concurrency,
    };
    let (work_client, work_events) = (client.clone(), events.clone());
    let election = tokio::spawn(leader::run(
        client,
        election_settings,
        leadership,
        events,
        move |stop| {
            controller::run(
                work_client.clone(),
                controller_settings.clone(),
                work_events.clone(),
                stop,
            )
        },
        shutdown.clone(),
    ));
    info!(admin = %args.admin_addr, "cnat started");

    shutdown.cancelled().await;
    let signalled = Instant::now();
    health.set_not_ready();
    let graceful = async {
        // 1. stop reconciling and release the Lease, so another replica takes over at once;
        let _ = election.await;
        // 2. keep serving until the endpoint is out of Services;
        sleep_until(signalled + args.shutdown_delay).await;
        // 3. finish requests in flight and close keep-alive connections.
        close_servers.cancel();
        let _ = admin.await;
    };
    match timeout(args.shutdown_timeout, graceful).await {
        Ok(()) => info!("shut down cleanly"),
        Err(_) => {
            warn!(timeout = ?args.shutdown_timeout, "graceful shutdown took too long; exiting")
        }
    }
    Ok(())
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
