//! Parsing `spec.schedule` and working out how long until it is due. Pure: the clock is a parameter.

use chrono::{DateTime, NaiveDateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use std::time::Duration;
use thiserror::Error;

/// The example every schedule error shows, so users see the accepted form.
pub const EXAMPLE: &str = "2019-04-12T10:12:00Z";

/// Longest part of a bad value quoted back in a message; huge inputs must not make huge messages.
const MAX_QUOTED: usize = 64;

/// Why `spec.schedule` (with `spec.timeZone`) was rejected. Messages name the field, the value
/// and the fix.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ScheduleError {
    #[error("spec.schedule is empty (expected an RFC 3339 time, e.g. {EXAMPLE})")]
    Empty,
    #[error(
        "spec.schedule: {0} has no UTC offset; add `Z` for UTC or an offset such as `+02:00`, or set spec.timeZone (e.g. Europe/Berlin) to read it as wall-clock time there (expected e.g. {EXAMPLE})"
    )]
    NoOffset(String),
    #[error("spec.schedule: {0} is not an RFC 3339 time (expected e.g. {EXAMPLE})")]
    Malformed(String),
    #[error("spec.schedule: {0} names an instant outside the years 0000 to 9999 (UTC), which is all an RFC 3339 time can hold; write a time within them (expected e.g. {EXAMPLE})")]
    OutOfRange(String),
    #[error("spec.timeZone: {0} is not an IANA time zone name (expected e.g. Europe/Berlin, America/New_York or UTC)")]
    UnknownZone(String),
    #[error("spec.schedule: {schedule} has a UTC offset, but spec.timeZone is set to {zone}; drop the offset to mean wall-clock time in {zone}, or drop spec.timeZone")]
    OffsetWithZone { schedule: String, zone: String },
    #[error("spec.schedule: {schedule} does not exist in {zone}: the clocks skip it (daylight saving time begins); it could mean {earlier} or {later}: write one of them as the schedule and drop spec.timeZone")]
    Gap {
        schedule: String,
        zone: String,
        earlier: String,
        later: String,
    },
    #[error("spec.schedule: {schedule} happens twice in {zone} (daylight saving time ends): at {first} and at {second}; write one of them as the schedule and drop spec.timeZone")]
    Fold {
        schedule: String,
        zone: String,
        first: String,
        second: String,
    },
}

/// Parses `schedule` into the instant it names: an RFC 3339 time with `Z` or an offset, or,
/// when `zone` (an IANA name) is given, a wall-clock time without offset in that zone.
pub fn parse(raw: &str, zone: Option<&str>) -> Result<DateTime<Utc>, ScheduleError> {
    let instant = parse_any(raw, zone)?;
    if !(earliest()..=latest()).contains(&instant) {
        return Err(ScheduleError::OutOfRange(quote(raw)));
    }
    Ok(instant)
}

/// The first instant a schedule may name: 0000-01-01T00:00:00Z.
fn earliest() -> DateTime<Utc> {
    DateTime::from_timestamp(-62_167_219_200, 0).unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// The last instant a schedule may name: 9999-12-31T23:59:59.999999999Z. Status times are
/// written as RFC 3339, whose years have four digits: a later instant could not be stored.
fn latest() -> DateTime<Utc> {
    DateTime::from_timestamp(253_402_300_799, 999_999_999).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

fn parse_any(raw: &str, zone: Option<&str>) -> Result<DateTime<Utc>, ScheduleError> {
    if raw.trim().is_empty() {
        return Err(ScheduleError::Empty);
    }
    let tz = match zone {
        None => None,
        Some(name) => Some(
            jiff::tz::TimeZone::get(name).map_err(|_| ScheduleError::UnknownZone(quote(name)))?,
        ),
    };
    if let Ok(time) = DateTime::parse_from_rfc3339(raw) {
        return match zone {
            Some(zone) => Err(ScheduleError::OffsetWithZone {
                schedule: quote(raw),
                zone: zone.to_owned(),
            }),
            None => Ok(time.with_timezone(&Utc)),
        };
    }
    let Ok(civil) = NaiveDateTime::parse_from_str(raw, "%Y-%m-%dT%H:%M:%S%.f") else {
        return Err(ScheduleError::Malformed(quote(raw)));
    };
    let (Some(tz), Some(zone)) = (tz, zone) else {
        return Err(ScheduleError::NoOffset(quote(raw)));
    };
    in_zone(raw, civil, &tz, zone)
}

/// The instant a wall-clock time names in `tz`, refusing times skipped or repeated there.
fn in_zone(
    raw: &str,
    civil: NaiveDateTime,
    tz: &jiff::tz::TimeZone,
    zone: &str,
) -> Result<DateTime<Utc>, ScheduleError> {
    use chrono::{Datelike, Timelike};
    use jiff::tz::AmbiguousOffset;
    let malformed = || ScheduleError::Malformed(quote(raw));
    let wall = jiff::civil::DateTime::new(
        i16::try_from(civil.year()).map_err(|_| malformed())?,
        i8::try_from(civil.month()).map_err(|_| malformed())?,
        i8::try_from(civil.day()).map_err(|_| malformed())?,
        i8::try_from(civil.hour()).map_err(|_| malformed())?,
        i8::try_from(civil.minute()).map_err(|_| malformed())?,
        i8::try_from(civil.second().min(59)).map_err(|_| malformed())?,
        i32::try_from(civil.nanosecond().min(999_999_999)).map_err(|_| malformed())?,
    )
    .map_err(|_| malformed())?;
    let at = |offset: jiff::tz::Offset| -> Result<DateTime<Utc>, ScheduleError> {
        // jiff's timestamps end in the last days of 9999 (and start in -9999).
        let ts = offset
            .to_timestamp(wall)
            .map_err(|_| ScheduleError::OutOfRange(quote(raw)))?;
        DateTime::from_timestamp(ts.as_second(), ts.subsec_nanosecond().unsigned_abs())
            .ok_or_else(malformed)
    };
    let shown = |offset: jiff::tz::Offset| -> Result<String, ScheduleError> {
        Ok(at(offset)?.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true))
    };
    match tz.to_ambiguous_zoned(wall).offset() {
        AmbiguousOffset::Unambiguous { offset } => at(offset),
        AmbiguousOffset::Gap { before, after } => {
            let (a, b) = (shown(after)?, shown(before)?);
            let (earlier, later) = if a <= b { (a, b) } else { (b, a) };
            Err(ScheduleError::Gap {
                schedule: quote(raw),
                zone: zone.to_owned(),
                earlier,
                later,
            })
        }
        AmbiguousOffset::Fold { before, after } => Err(ScheduleError::Fold {
            schedule: quote(raw),
            zone: zone.to_owned(),
            first: shown(before)?,
            second: shown(after)?,
        }),
    }
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

/// Converts a Kubernetes timestamp (jiff) to the chrono time the rest of cnat uses.
pub fn to_chrono(time: &Time) -> DateTime<Utc> {
    let ts = time.0;
    DateTime::from_timestamp(ts.as_second(), ts.subsec_nanosecond().unsigned_abs())
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
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
            assert_eq!(parse(raw, None), Ok(want), "{raw}");
        }
        let leap = parse("2016-12-31T23:59:60Z", None).unwrap();
        assert_eq!(
            until_due(leap, utc(2016, 12, 31, 23, 59, 59)),
            Some(Duration::from_secs(1))
        );
        let fractional = parse("2019-04-12T10:12:00.250+00:00", None).unwrap();
        assert_eq!(fractional - book, chrono::Duration::milliseconds(250));
    }

    #[test]
    fn rejects_garbage_with_a_message_that_says_how_to_fix_it() {
        assert_eq!(
            parse("tomorrow noon", None).unwrap_err().to_string(),
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
                matches!(parse(raw, None), Err(ScheduleError::Malformed(_))),
                "{raw:?}"
            );
        }
    }

    #[test]
    fn a_missing_offset_gets_its_own_hint() {
        let err = parse("2019-04-12T10:12:00", None).unwrap_err();
        assert_eq!(
            err,
            ScheduleError::NoOffset(r#""2019-04-12T10:12:00""#.into())
        );
        assert!(err.to_string().contains("add `Z` for UTC"));
    }

    #[test]
    fn years_0000_to_9999_with_the_widest_offsets_are_the_range() {
        let first = parse("0000-01-01T00:00:00Z", None).unwrap();
        assert_eq!(first, earliest());
        let last = parse("9999-12-31T23:59:59.999999999Z", None).unwrap();
        assert_eq!(last, latest());
        // Offsets as wide as RFC 3339 allows, inside the range.
        assert!(parse("0000-01-01T23:59:00+23:59", None).is_ok());
        assert!(parse("9999-12-31T00:00:00-23:59", None).is_ok());
        // ... and pushing the instant out of it.
        for raw in ["0000-01-01T00:00:00+00:01", "9999-12-31T23:59:59-23:59"] {
            let err = parse(raw, None).unwrap_err();
            assert!(matches!(err, ScheduleError::OutOfRange(_)), "{raw}: {err}");
            assert!(err.to_string().starts_with("spec.schedule: "), "{err}");
            assert!(err.to_string().contains("years 0000 to 9999"), "{err}");
        }
        // Wall-clock times in a zone, at both ends and past them.
        assert!(parse("9999-12-31T12:00:00", Some("Pacific/Kiritimati")).is_ok());
        assert!(matches!(
            parse("9999-12-31T23:00:00", Some("America/Adak")),
            Err(ScheduleError::OutOfRange(_))
        ));
        assert!(matches!(
            parse("0000-01-01T00:00:00", Some("Asia/Tokyo")),
            Err(ScheduleError::OutOfRange(_))
        ));
        for raw in [
            "+10000-01-01T00:00:00",
            "-0001-01-01T00:00:00",
            "99999-01-01T00:00:00",
        ] {
            assert!(parse(raw, Some("UTC")).is_err(), "{raw}");
        }
    }

    #[test]
    fn empty_and_blank_are_empty() {
        assert_eq!(parse("", None), Err(ScheduleError::Empty));
        assert_eq!(parse(" \t\n", None), Err(ScheduleError::Empty));
    }

    #[test]
    fn huge_values_are_shortened_in_messages() {
        let huge = "x".repeat(100_000);
        let message = parse(&huge, None).unwrap_err().to_string();
        assert!(message.len() < 200, "{}", message.len());
        assert!(message.contains("(100000 characters)"));
        let multibyte = "é".repeat(70);
        assert!(parse(&multibyte, None)
            .unwrap_err()
            .to_string()
            .contains("(70 characters)"));
    }

    #[test]
    fn a_wall_clock_time_is_read_in_its_time_zone() {
        let berlin = Some("Europe/Berlin");
        // Winter (+01:00) and summer (+02:00).
        assert_eq!(
            parse("2026-11-22T18:00:00", berlin),
            Ok(utc(2026, 11, 22, 17, 0, 0))
        );
        assert_eq!(
            parse("2026-07-01T18:00:00.5", berlin).unwrap(),
            utc(2026, 7, 1, 16, 0, 0) + chrono::Duration::milliseconds(500)
        );
        assert_eq!(
            parse("2026-11-22T18:00:00", Some("America/New_York")),
            Ok(utc(2026, 11, 22, 23, 0, 0))
        );
        assert_eq!(
            parse("2026-11-22T18:00:00", Some("UTC")),
            Ok(utc(2026, 11, 22, 18, 0, 0))
        );
        // Midnight and the last second of a day.
        assert_eq!(
            parse("2026-12-31T23:59:59", Some("Asia/Tokyo")),
            Ok(utc(2026, 12, 31, 14, 59, 59))
        );
        assert_eq!(
            parse("2027-01-01T00:00:00", Some("Asia/Kolkata")),
            Ok(utc(2026, 12, 31, 18, 30, 0))
        );
    }

    #[test]
    fn daylight_saving_gaps_and_folds_are_refused_with_both_instants() {
        let berlin = Some("Europe/Berlin");
        // 2026-03-29 02:00 -> 03:00 in Berlin: 02:30 never happens.
        let gap = parse("2026-03-29T02:30:00", berlin).unwrap_err();
        assert_eq!(
            gap.to_string(),
            r#"spec.schedule: "2026-03-29T02:30:00" does not exist in Europe/Berlin: the clocks skip it (daylight saving time begins); it could mean 2026-03-29T00:30:00Z or 2026-03-29T01:30:00Z: write one of them as the schedule and drop spec.timeZone"#
        );
        // 2026-10-25 03:00 -> 02:00: 02:30 happens twice.
        let fold = parse("2026-10-25T02:30:00", berlin).unwrap_err();
        assert_eq!(
            fold.to_string(),
            r#"spec.schedule: "2026-10-25T02:30:00" happens twice in Europe/Berlin (daylight saving time ends): at 2026-10-25T00:30:00Z and at 2026-10-25T01:30:00Z; write one of them as the schedule and drop spec.timeZone"#
        );
        // Just outside both: fine.
        assert_eq!(
            parse("2026-03-29T03:00:00", berlin),
            Ok(utc(2026, 3, 29, 1, 0, 0))
        );
        assert_eq!(
            parse("2026-10-25T03:00:00", berlin),
            Ok(utc(2026, 10, 25, 2, 0, 0))
        );
        // New York's gap is at 02:00 local on 2026-03-08.
        assert!(matches!(
            parse("2026-03-08T02:15:00", Some("America/New_York")),
            Err(ScheduleError::Gap { .. })
        ));
    }

    #[test]
    fn bad_zones_and_mixed_forms_are_refused() {
        assert_eq!(
            parse("2026-11-22T18:00:00", Some("Mars/Olympus_Mons"))
                .unwrap_err()
                .to_string(),
            r#"spec.timeZone: "Mars/Olympus_Mons" is not an IANA time zone name (expected e.g. Europe/Berlin, America/New_York or UTC)"#
        );
        for zone in ["", " ", "Europe/Berlin ", "+02:00", "\u{0}"] {
            assert!(
                matches!(
                    parse("2026-11-22T18:00:00", Some(zone)),
                    Err(ScheduleError::UnknownZone(_))
                ),
                "{zone:?}"
            );
        }
        let mixed = parse("2026-11-22T18:00:00+01:00", Some("Europe/Berlin")).unwrap_err();
        assert!(
            mixed
                .to_string()
                .contains("has a UTC offset, but spec.timeZone is set to Europe/Berlin"),
            "{mixed}"
        );
        assert!(matches!(
            parse("tomorrow", Some("Europe/Berlin")),
            Err(ScheduleError::Malformed(_))
        ));
        let hint = parse("2019-04-12T10:12:00", None).unwrap_err().to_string();
        assert!(hint.contains("or set spec.timeZone"), "{hint}");
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
