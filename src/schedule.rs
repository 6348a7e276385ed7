//! Parsing `spec.schedule` and working out how long until it is due. Pure: the clock is a parameter.

use chrono::{DateTime, NaiveDateTime, Utc};
use std::time::Duration;
use thiserror::Error;

/// The example every schedule error shows, so users see the accepted form.
pub const EXAMPLE: &str = "2019-04-12T10:12:00Z";

/// Longest part of a bad value quoted back in a message; huge inputs must not make huge messages.
const MAX_QUOTED: usize = 64;

/// Why `spec.schedule` was rejected. Messages name the field, the value and the fix.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ScheduleError {
    #[error("spec.schedule is empty (expected an RFC 3339 time, e.g. {EXAMPLE})")]
    Empty,
    #[error(
        "spec.schedule: {0} has no UTC offset; add `Z` for UTC or an offset such as `+02:00` (expected e.g. {EXAMPLE})"
    )]
    NoOffset(String),
    #[error("spec.schedule: {0} is not an RFC 3339 time (expected e.g. {EXAMPLE})")]
    Malformed(String),
}

/// Parses an RFC 3339 time with `Z` or an explicit offset into the instant it names.
pub fn parse(raw: &str) -> Result<DateTime<Utc>, ScheduleError> {
    if raw.trim().is_empty() {
        return Err(ScheduleError::Empty);
    }
    if let Ok(time) = DateTime::parse_from_rfc3339(raw) {
        return Ok(time.with_timezone(&Utc));
    }
    if NaiveDateTime::parse_from_str(raw, "%Y-%m-%dT%H:%M:%S%.f").is_ok() {
        return Err(ScheduleError::NoOffset(quote(raw)));
    }
    Err(ScheduleError::Malformed(quote(raw)))
}

/// Time left until `due`, or `None` when it is due now or overdue.
pub fn until_due(due: DateTime<Utc>, now: DateTime<Utc>) -> Option<Duration> {
    (due - now).to_std().ok().filter(|left| !left.is_zero())
}

/// Quotes a user value for a message, escaped, and shortened to about `MAX_QUOTED` characters
/// of escaped text (escaping can make one character ten).
fn quote(raw: &str) -> String {
    let mut shown = String::new();
    let mut rest = raw.chars();
    while shown.chars().count() < MAX_QUOTED {
        let Some(c) = rest.next() else { break };
        shown.extend(c.escape_debug());
    }
    if rest.as_str().is_empty() {
        format!("\"{shown}\"")
    } else {
        format!("\"{shown}\"… ({} characters)", raw.chars().count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
    }

    #[test]
    fn accepts_rfc3339_forms_and_keeps_the_instant() {
        let book = utc(2019, 4, 12, 10, 12, 0);
        for (raw, want) in [
            ("2019-04-12T10:12:00Z", book),
            ("2019-04-12T12:12:00+02:00", book),
            ("2019-04-12T05:12:00-05:00", book),
            ("2019-04-12t10:12:00z", book),
            ("2019-04-12T10:12:00.000Z", book),
            ("2019-04-12T10:12:00+00:00", book),
            ("2019-04-12T10:12:00-00:00", book),
            ("2019-04-12 10:12:00Z", book),
            ("2019-04-12T10:12:00.000000000999Z", book),
            ("2024-02-29T00:00:00Z", utc(2024, 2, 29, 0, 0, 0)),
        ] {
            assert_eq!(parse(raw), Ok(want), "{raw}");
        }
        let leap = parse("2016-12-31T23:59:60Z").unwrap();
        assert_eq!(
            until_due(leap, utc(2016, 12, 31, 23, 59, 59)),
            Some(Duration::from_secs(1))
        );
        let fractional = parse("2019-04-12T10:12:00.250+00:00").unwrap();
        assert_eq!(fractional - book, chrono::Duration::milliseconds(250));
    }

    #[test]
    fn rejects_garbage_with_a_message_that_says_how_to_fix_it() {
        assert_eq!(
            parse("tomorrow noon").unwrap_err().to_string(),
            r#"spec.schedule: "tomorrow noon" is not an RFC 3339 time (expected e.g. 2019-04-12T10:12:00Z)"#
        );
        for raw in [
            "2019-04-12",
            "10:12:00Z",
            "2019-04-12 10:12:00",
            "2019-04-12T10:12:61Z",
            "2023-02-29T00:00:00Z",
            "2019-13-01T00:00:00Z",
            "2019-04-12T24:00:01Z",
            "2019-04-12T10:12:00+25:00",
            " 2019-04-12T10:12:00Z",
            "1555063920",
            "\u{0}",
        ] {
            assert!(
                matches!(parse(raw), Err(ScheduleError::Malformed(_))),
                "{raw:?}"
            );
        }
    }

    #[test]
    fn a_missing_offset_gets_its_own_hint() {
        let err = parse("2019-04-12T10:12:00").unwrap_err();
        assert_eq!(
            err,
            ScheduleError::NoOffset(r#""2019-04-12T10:12:00""#.into())
        );
        assert!(err.to_string().contains("add `Z` for UTC"));
    }

    #[test]
    fn empty_and_blank_are_empty() {
        assert_eq!(parse(""), Err(ScheduleError::Empty));
        assert_eq!(parse(" \t\n"), Err(ScheduleError::Empty));
    }

    #[test]
    fn huge_values_are_shortened_in_messages() {
        let huge = "x".repeat(100_000);
        let message = parse(&huge).unwrap_err().to_string();
        assert!(message.len() < 200, "{}", message.len());
        assert!(message.contains("(100000 characters)"));
        let multibyte = "é".repeat(70);
        assert!(parse(&multibyte)
            .unwrap_err()
            .to_string()
            .contains("(70 characters)"));
    }

    #[test]
    fn time_until_due() {
        let due = utc(2019, 4, 12, 10, 12, 0);
        let before = due - chrono::Duration::milliseconds(1500);
        assert_eq!(until_due(due, before), Some(Duration::from_millis(1500)));
        assert_eq!(until_due(due, due), None);
        assert_eq!(until_due(due, due + chrono::Duration::days(3000)), None);
    }
}
