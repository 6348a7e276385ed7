//! `cnat smoke-test`: the check `helm test` runs in the cluster. It creates an At due now, waits
//! until it is DONE, deletes it, and succeeds only if the command succeeded.

use crate::api::{At, AtSpec, Outcome, Phase};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use std::time::Duration;
use thiserror::Error;
use tokio::time::{sleep, Instant};

/// How often the At is looked at while waiting.
const POLL: Duration = Duration::from_millis(500);

/// Why the smoke test failed; each message says what to look at.
#[derive(Debug, Error)]
pub enum SmokeError {
    #[error("creating At {namespace}/{name}: {source}")]
    Create {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("At {0} was not DONE within {1:?}: is a cnat replica leading (kubectl get lease), and can its pod start?")]
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
        image: crate::api::DEFAULT_IMAGE.into(),
        ..AtSpec::default()
    };
    ats.create(&PostParams::default(), &At::new(&name, spec))
        .await
        .map_err(|source| SmokeError::Create {
            namespace: namespace.into(),
            name: name.clone(),
            source,
        })?;
    let result = wait_done(&ats, &name, timeout).await;
    // Deleting the At also deletes its pod (it owns it).
    let _ = ats.delete(&name, &DeleteParams::default()).await;
    result
}

async fn wait_done(ats: &Api<At>, name: &str, timeout: Duration) -> Result<String, SmokeError> {
    let deadline = Instant::now() + timeout;
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
