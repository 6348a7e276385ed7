//! Failures that are the API server's own bugs rather than a verdict on the At: retried like
//! any failure, but logged at debug while they stay occasional, so that a busy replica's log
//! shows only what someone has to look at.

/// Failures in a row of one At that are logged at debug when each is a glitch; a glitch that
/// keeps coming is a WARN like any other failure.
pub const QUIET_ATTEMPTS: u32 = 3;

/// kube-apiserver v1.24.0-v1.24.9 and v1.25.0-v1.25.5 fail some concurrent writes with 422
/// `internal error: ... evaluating rule:` (cel-go's data race, kubernetes/kubernetes#114661).
/// Only a 422 whose one cause is that failure: a genuine refusal beside a glitch is not one.
pub fn is_cel_race(error: &kube::Error) -> bool {
    let kube::Error::Api(status) = error else {
        return false;
    };
    let causes = status.details.as_ref().map_or(&[][..], |d| &d.causes[..]);
    status.code == 422
        && matches!(causes, [cause]
            if cause.message.contains("internal error: ")
                && cause.message.contains(" evaluating rule: "))
}

/// Whether the `attempt`th failure in a row (1-based) of an At's reconcile or status write,
/// with `error`, is logged at debug instead of WARN.
pub fn quiet(error: &kube::Error, attempt: u32) -> bool {
    is_cel_race(error) && attempt <= QUIET_ATTEMPTS
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An API error as kube-apiserver words a 422: the message joins the causes' messages.
    fn api(code: u16, reason: &str, causes: &[&str]) -> kube::Error {
        let message = match causes {
            [one] => format!("At.cnat.programming-kubernetes.info \"at-1\" is invalid: {one}"),
            many => format!(
                "At.cnat.programming-kubernetes.info \"at-1\" is invalid: [{}]",
                many.join(", ")
            ),
        };
        let mut status = kube::core::Status::failure(&message, reason).with_code(code);
        status.details = Some(kube::core::response::StatusDetails {
            name: "at-1".into(),
            group: "cnat.programming-kubernetes.info".into(),
            kind: "At".into(),
            uid: String::new(),
            retry_after_seconds: 0,
            causes: causes
                .iter()
                .map(|m| kube::core::response::StatusCause {
                    reason: "FieldValueInvalid".into(),
                    message: (*m).into(),
                    field: "status".into(),
                })
                .collect(),
        });
        kube::Error::Api(status.boxed())
    }

    const RULE: &str = "evaluating rule: status.phase cannot go back (Pending -> Running -> Done): an At runs at most once; create a new At to run the command again";

    #[test]
    fn both_faces_of_the_cel_race_are_glitches() {
        for inner in [
            "internal error: runtime error: index out of range [5] with length 4",
            "internal error: value method github.com/google/cel-go/common/types.String.Size called using nil *String pointer",
        ] {
            let cause = format!("Invalid value: \"object\": {inner} {RULE}");
            let error = api(422, "Invalid", &[&cause]);
            assert!(is_cel_race(&error), "{cause}");
            assert!(quiet(&error, 1));
            assert!(quiet(&error, QUIET_ATTEMPTS));
            assert!(!quiet(&error, QUIET_ATTEMPTS + 1), "a glitch that keeps coming");
        }
    }

    #[test]
    fn verdicts_and_other_failures_are_not() {
        let verdict = "Invalid value: \"object\": status.phase cannot go back (Pending -> Running -> Done): an At runs at most once; create a new At to run the command again";
        let schema = "Invalid value: 9999999999: spec.activeDeadlineSeconds in body should be less than or equal to 2147483647";
        let glitch = format!("Invalid value: \"object\": internal error: runtime error: index out of range [5] with length 4 {RULE}");
        let mut message_only = kube::core::Status::failure(&glitch, "Invalid").with_code(422);
        message_only.details = None;
        for error in [
            api(422, "Invalid", &[verdict]),
            api(422, "Invalid", &[schema]),
            // A genuine refusal beside a glitch, in one answer: not a glitch.
            api(422, "Invalid", &[schema, &glitch]),
            // The same words with another code: not this race.
            api(500, "InternalError", &[&glitch]),
            api(
                503,
                "ServiceUnavailable",
                &["etcdserver: request timed out"],
            ),
            // No causes to tell by.
            kube::Error::Api(message_only.boxed()),
            kube::Error::LinesCodecMaxLineLengthExceeded,
        ] {
            assert!(!is_cel_race(&error), "{error}");
            assert!(!quiet(&error, 1), "{error}");
        }
    }
}
