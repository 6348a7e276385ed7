//! How leadership is kept: client-go's durations and invariants, plus the bounded step-down.

use std::time::Duration;
use thiserror::Error;

/// How leadership is kept; the defaults and invariants are client-go's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How long a Lease stays valid after it last changed; candidates wait this long, on their
    /// own clock, before they take a Lease that nobody renews.
    pub lease_duration: Duration,
    /// How long a leader keeps leading without a successful renewal before it stops.
    pub renew_deadline: Duration,
    /// How often the leader renews; also how long a candidate waits for news from its watch
    /// before it reads the Lease again.
    pub retry_period: Duration,
    /// On shutdown or a loop that ended, how long reconciles in flight may take before the loop
    /// is aborted and the Lease released.
    pub step_down_grace: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            step_down_grace: Duration::from_millis(200),
        }
    }
}

/// A timing that cannot keep a single leader. Messages name the flags and the fix.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TimingError {
    #[error("--lease-duration {0:?} must be a whole number of seconds, at least 1s (Lease.spec.leaseDurationSeconds is an integer)")]
    LeaseNotWholeSeconds(Duration),
    #[error("--lease-duration {lease:?} must be longer than --renew-deadline {renew:?}, or a new leader can start before the old one stops")]
    RenewNotBelowLease { lease: Duration, renew: Duration },
    #[error("--renew-deadline {renew:?} must be longer than 1.2 x --retry-period {retry:?}, so a leader gets at least one retry before it gives up")]
    RetryTooLong { renew: Duration, retry: Duration },
    #[error("--retry-period must be longer than zero")]
    ZeroRetry,
    #[error("--step-down-grace {grace:?} must be shorter than half the --renew-deadline {renew:?}: a stopping leader does not renew while reconciles in flight finish")]
    GraceTooLong { grace: Duration, renew: Duration },
}

impl Timing {
    /// Checks lease duration > renew deadline > 1.2 x retry period > 0, and a step-down grace
    /// under half the renew deadline.
    pub fn validate(&self) -> Result<(), TimingError> {
        let lease = self.lease_duration;
        if lease.subsec_nanos() != 0 || lease.is_zero() {
            return Err(TimingError::LeaseNotWholeSeconds(lease));
        }
        if self.retry_period.is_zero() {
            return Err(TimingError::ZeroRetry);
        }
        if lease <= self.renew_deadline {
            return Err(TimingError::RenewNotBelowLease {
                lease,
                renew: self.renew_deadline,
            });
        }
        if self.renew_deadline.as_secs_f64() <= 1.2 * self.retry_period.as_secs_f64() {
            return Err(TimingError::RetryTooLong {
                renew: self.renew_deadline,
                retry: self.retry_period,
            });
        }
        if self.step_down_grace * 2 >= self.renew_deadline {
            return Err(TimingError::GraceTooLong {
                grace: self.step_down_grace,
                renew: self.renew_deadline,
            });
        }
        Ok(())
    }

    /// `leaseDurationSeconds` as written into the Lease.
    pub fn lease_seconds(&self) -> i32 {
        i32::try_from(self.lease_duration.as_secs()).unwrap_or(i32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(lease: u64, renew_ms: u64, retry_ms: u64) -> Timing {
        Timing {
            lease_duration: Duration::from_secs(lease),
            renew_deadline: Duration::from_millis(renew_ms),
            retry_period: Duration::from_millis(retry_ms),
            step_down_grace: Duration::from_millis(200),
        }
    }

    #[test]
    fn client_go_defaults_are_valid() {
        assert_eq!(Timing::default(), timing(15, 10_000, 2_000));
        assert_eq!(Timing::default().validate(), Ok(()));
        assert_eq!(timing(3, 2_000, 500).validate(), Ok(()));
        assert_eq!(Timing::default().lease_seconds(), 15);
    }

    #[test]
    fn invalid_timings_are_refused_with_the_rule_they_break() {
        let err = timing(10, 10_000, 2_000).validate().unwrap_err();
        assert!(matches!(err, TimingError::RenewNotBelowLease { .. }));
        assert!(
            err.to_string()
                .contains("--lease-duration 10s must be longer than --renew-deadline 10s"),
            "{err}"
        );

        // 1.2 x 2s = 2.4s: a 2.4s renew deadline is not longer.
        let err = timing(15, 2_400, 2_000).validate().unwrap_err();
        assert!(matches!(err, TimingError::RetryTooLong { .. }), "{err}");
        assert!(err.to_string().contains("1.2 x --retry-period"), "{err}");
        assert_eq!(timing(15, 2_401, 2_000).validate(), Ok(()));

        let fractional = Timing {
            lease_duration: Duration::from_millis(15_500),
            ..Timing::default()
        };
        assert!(matches!(
            fractional.validate(),
            Err(TimingError::LeaseNotWholeSeconds(_))
        ));
        assert!(matches!(
            timing(0, 0, 0).validate(),
            Err(TimingError::LeaseNotWholeSeconds(_))
        ));
        assert_eq!(
            timing(15, 10_000, 0).validate(),
            Err(TimingError::ZeroRetry)
        );

        let slow = Timing {
            step_down_grace: Duration::from_secs(5),
            ..Timing::default()
        };
        let err = slow.validate().unwrap_err();
        assert!(matches!(err, TimingError::GraceTooLong { .. }), "{err}");
        assert!(err.to_string().contains("--step-down-grace 5s"), "{err}");
        let just_under = Timing {
            step_down_grace: Duration::from_millis(4_999),
            ..Timing::default()
        };
        assert_eq!(just_under.validate(), Ok(()));
    }
}
