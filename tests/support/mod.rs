//! Test doubles shared by the integration tests and benchmarks.

#![allow(dead_code)] // each test binary uses a different part

pub mod apiserver;
pub mod envtest;
pub mod https;
pub mod otlp;
pub mod ports;
pub mod process;
pub mod proxy;
pub mod service;

use cnat::observability::metrics::Metrics;
use cnat::operator::events::EventSink;
use kube::runtime::events::Reporter;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// An event sink reporting as `instance`.
pub fn events(client: &kube::Client, instance: &str) -> EventSink {
    let reporter = Reporter {
        controller: "cnat".into(),
        instance: Some(instance.into()),
    };
    EventSink::start(client.clone(), reporter)
}

/// The reconcile loop as `cnat run` starts it on the leader; it runs until aborted.
pub fn run_controller(client: kube::Client) -> JoinHandle<()> {
    run_controller_with(client, Default::default())
}

/// The reconcile loop with operator-wide defaults `policy`.
pub fn run_controller_with(
    client: kube::Client,
    policy: cnat::operator::policy::RunPolicy,
) -> JoinHandle<()> {
    let settings = cnat::operator::controller::Settings {
        namespace: None,
        selector: None,
        concurrency: 32,
        policy,
        signing: cnat::operator::signing::Source::secret("default", "cnat-pod-signing"),
    };
    let events = events(&client, "cnat-test");
    tokio::spawn(cnat::operator::controller::run(
        client,
        settings,
        events,
        Arc::new(Metrics::new(Default::default())),
        CancellationToken::new(),
    ))
}

/// Checks `check` every 10 ms until it holds or `timeout` passes (tokio time: also under
/// paused time).
pub async fn until(timeout: Duration, check: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    check()
}

/// Polls `check` every 50 ms for `within`: the first value it gives, or `None`.
pub async fn until_some<T>(
    within: Duration,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> Option<T> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(found) = check().await {
            return Some(found);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
