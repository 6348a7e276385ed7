//! `cnat smoke-test`: the check `helm test` runs in the cluster. It creates an At due now, waits
//! until it is Done, deletes it, and succeeds only if the command succeeded.

use crate::api::{At, AtSpec, Outcome, Phase};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use std::time::Duration;
use thiserror::Error;
use tokio::time::{sleep, Instant};

/// How often the At is looked at while waiting.
const POLL: Duration = Duration::from_millis(500);
/// Pause between attempts to create the At while the API server or the webhook is not ready.
const CREATE_RETRY: Duration = Duration::from_secs(1);

/// Why the smoke test failed; each message says what to look at.
#[derive(Debug, Error)]
pub enum SmokeError {
    #[error("creating At {namespace}/{name}: {source}")]
    Create {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("creating At {namespace}/{name} kept failing for {tried:?}, last with: {source}. Is the cnat admission webhook (validate.ats.cnat.programming-kubernetes.info, default.ats.cnat.programming-kubernetes.info) served? Check that the cnat pods are ready and the webhook Service has endpoints (kubectl get endpoints -A | grep cnat); install with helm install --wait")]
    Unreachable {
        namespace: String,
        name: String,
        tried: Duration,
        source: kube::Error,
    },
    #[error("At {0} was not Done within {1:?}: is a cnat replica leading (kubectl get lease), and can its pod start?")]
    Timeout(String, Duration),
    #[error("At {at} ended {outcome:?}: {message}")]
    Failed {
        at: String,
        outcome: Option<Outcome>,
        message: String,
    },
}

/// Runs one At through its whole life in `namespace`.
pub async fn run(client: Client, namespace: &str, timeout: Duration) -> Result<String, SmokeError> {
    let ats: Api<At> = Api::namespaced(client, namespace);
    let name = format!("cnat-smoke-test-{}", chrono::Utc::now().timestamp_millis());
    let spec = AtSpec {
        schedule: chrono::Utc::now().to_rfc3339(),
        command: "echo cnat smoke test".into(),
        ..AtSpec::default()
    };
    let started = Instant::now();
    let at = At::new(&name, spec);
    // Right after `helm install` without --wait, no replica may serve the webhook yet: the API
    // server then answers 5xx. Retry those (and connection errors) within the timeout.
    loop {
        match ats.create(&PostParams::default(), &at).await {
            Ok(_) => break,
            Err(error) if is_transient(&error) && started.elapsed() + CREATE_RETRY < timeout => {
                sleep(CREATE_RETRY).await;
            }
            Err(source) if is_transient(&source) => {
                return Err(SmokeError::Unreachable {
                    namespace: namespace.into(),
                    name,
                    tried: started.elapsed(),
                    source,
                })
            }
            Err(source) => {
                return Err(SmokeError::Create {
                    namespace: namespace.into(),
                    name,
                    source,
                })
            }
        }
    }
    let result = wait_done(&ats, &name, started + timeout, timeout).await;
    // Deleting the At also deletes its pod (it owns it).
    let _ = ats.delete(&name, &DeleteParams::default()).await;
    result
}

/// 5xx (e.g. `failed calling webhook`) or no answer at all: may pass once the webhook serves.
fn is_transient(error: &kube::Error) -> bool {
    match error {
        kube::Error::Api(status) => status.code >= 500,
        _ => true,
    }
}

async fn wait_done(
    ats: &Api<At>,
    name: &str,
    deadline: Instant,
    timeout: Duration,
) -> Result<String, SmokeError> {
    let at_name = format!("{}/{name}", ats.namespace().unwrap_or_default());
    while Instant::now() < deadline {
        let status = ats
            .get_opt(name)
            .await
            .ok()
            .flatten()
            .and_then(|at| at.status);
        if let Some(status) = status.filter(|s| s.phase == Phase::Done) {
            let message = status.message.unwrap_or_default();
            return match status.outcome {
                Some(Outcome::Succeeded) => {
                    Ok(format!("At {at_name} ran and succeeded: {message}"))
                }
                outcome => Err(SmokeError::Failed {
                    at: at_name,
                    outcome,
                    message,
                }),
            };
        }
        sleep(POLL).await;
    }
    Err(SmokeError::Timeout(at_name, timeout))
}
