//! What `kubectl at` prints: the job line, the `-l` table, relative times and how a finished At
//! becomes an exit code. Pure: the clock and the zone are parameters.

use crate::api::{At, Outcome, Phase};
use jiff::tz::TimeZone;
use jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;

/// `Sun Nov 22 18:00:00 2026 CET`, as at(1) and date(1) print times.
pub fn local(instant: Timestamp, zone: &TimeZone) -> String {
    instant
        .to_zoned(zone.clone())
        .strftime("%a %b %e %T %Y %Z")
        .to_string()
}

/// `in 4h12m`, `3m20s ago`, `now`: the two largest units.
pub fn relative(due: Timestamp, now: Timestamp) -> String {
    let ahead = due.duration_since(now);
    let seconds = ahead.as_secs().unsigned_abs();
    if seconds == 0 {
        return "now".into();
    }
    let units = [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)];
    let mut left = seconds;
    let mut parts = String::new();
    for (name, size) in units {
        if left >= size {
            let count = left / size;
            left -= count * size;
            parts.push_str(&format!("{count}{name}"));
            if parts.chars().filter(|c| c.is_ascii_alphabetic()).count() == 2 {
                break;
            }
        } else if !parts.is_empty() {
            break;
        }
    }
    if ahead > SignedDuration::ZERO {
        format!("in {parts}")
    } else {
        format!("{parts} ago")
    }
}

/// The line printed for a created At, like at(1)'s `job 12 at Sun Nov 22 18:00:00 2026`.
pub fn job_line(at: &At, due: Timestamp, now: Timestamp, zone: &TimeZone) -> String {
    let utc = due.strftime("%H:%M:%S UTC");
    format!(
        "at: job {}/{} at {} ({utc}, {})",
        at.namespace().unwrap_or_default(),
        at.name_any(),
        local(due, zone),
        relative(due, now)
    )
}

/// The due instant an At's schedule names, if it is readable.
pub fn due(at: &At) -> Option<Timestamp> {
    let instant = crate::schedule::parse(&at.spec.schedule, at.spec.time_zone.as_deref()).ok()?;
    Timestamp::from_millisecond(instant.timestamp_millis()).ok()
}

/// The `-l` table (like atq): Ats by due time, then name.
pub fn table(ats: &[At], now: Timestamp, zone: &TimeZone, namespaces: bool) -> String {
    let mut rows: Vec<(Option<Timestamp>, Vec<String>)> = ats
        .iter()
        .map(|at| {
            let due = due(at);
            let status = at.status.as_ref();
            let mut row = Vec::new();
            if namespaces {
                row.push(at.namespace().unwrap_or_default());
            }
            row.push(at.name_any());
            match due {
                Some(due) => {
                    row.push(local(due, zone));
                    row.push(relative(due, now));
                }
                None => row.extend([format!("{:?} (unreadable)", at.spec.schedule), "".into()]),
            }
            row.push(at.phase().to_string());
            row.push(
                status
                    .and_then(|s| s.outcome)
                    .map(|o| format!("{o:?}"))
                    .unwrap_or_default(),
            );
            row.push(
                status
                    .and_then(|s| s.exit_code)
                    .map(|c| c.to_string())
                    .unwrap_or_default(),
            );
            (due, row)
        })
        .collect();
    rows.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    let mut header: Vec<String> = Vec::new();
    if namespaces {
        header.push("NAMESPACE".into());
    }
    header.extend(["NAME", "DUE", "", "PHASE", "OUTCOME", "EXIT"].map(String::from));
    let all: Vec<Vec<String>> = std::iter::once(header)
        .chain(rows.into_iter().map(|(_, row)| row))
        .collect();
    let widths: Vec<usize> = (0..all[0].len())
        .map(|i| all.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in &all {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(line.join("   ").trim_end());
        out.push('\n');
    }
    out
}

/// How `--wait` ends for a finished At: the command's exit code, or why there is none.
pub fn exit_code(at: &At) -> Result<u8, String> {
    let name = format!("{}/{}", at.namespace().unwrap_or_default(), at.name_any());
    let Some(status) = at.status.as_ref().filter(|s| s.phase == Phase::Done) else {
        return Err(format!("At {name} has not finished"));
    };
    let why = || {
        [status.reason.as_deref(), status.message.as_deref()]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(": ")
    };
    match (status.outcome, status.exit_code) {
        (Some(Outcome::Succeeded), _) => Ok(0),
        // An exit status is a byte; a shell reports a signal as 128 + its number.
        (_, Some(code)) if code != 0 => Ok(u8::try_from(code.rem_euclid(256)).unwrap_or(1).max(1)),
        (Some(Outcome::Missed), _) => Err(format!("At {name} never ran: {}", why())),
        _ => Err(format!("At {name} failed without an exit code: {}", why())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{AtSpec, AtStatus};

    fn t(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn relative_times_use_the_two_largest_units() {
        let now = t("2026-11-22T13:48:00Z");
        let table = [
            ("2026-11-22T13:48:00Z", "now"),
            ("2026-11-22T13:48:30Z", "in 30s"),
            ("2026-11-22T13:53:20Z", "in 5m20s"),
            ("2026-11-22T18:00:00Z", "in 4h12m"),
            ("2026-11-22T18:48:00Z", "in 5h"),
            ("2026-11-22T18:48:59Z", "in 5h"),
            ("2026-11-25T18:00:00Z", "in 3d4h"),
            ("2026-11-22T13:45:00Z", "3m ago"),
            ("2026-11-21T13:47:59Z", "1d ago"),
        ];
        for (due, expected) in table {
            assert_eq!(relative(t(due), now), expected, "{due}");
        }
    }

    fn at(name: &str, schedule: &str, status: Option<AtStatus>) -> At {
        let mut at = At::new(
            name,
            AtSpec {
                schedule: schedule.into(),
                command: "echo hi".into(),
                ..AtSpec::default()
            },
        );
        at.metadata.namespace = Some("team-a".into());
        at.status = status;
        at
    }

    fn done(outcome: Outcome, exit_code: Option<i32>, reason: &str) -> Option<AtStatus> {
        Some(AtStatus {
            phase: Phase::Done,
            outcome: Some(outcome),
            exit_code,
            reason: Some(reason.into()),
            message: Some("details".into()),
            ..AtStatus::default()
        })
    }

    #[test]
    fn the_table_lists_by_due_time_in_local_time() {
        let zone = TimeZone::get("Europe/Berlin").unwrap();
        let now = t("2026-11-22T12:48:00Z");
        let ats = [
            at("later", "2026-11-22T17:00:00Z", None),
            at(
                "done",
                "2026-11-22T10:00:00Z",
                done(Outcome::Failed, Some(3), "Error"),
            ),
            at("bad", "tomorrow", None),
        ];
        assert_eq!(
            table(&ats, now, &zone, false),
            "NAME    DUE                                        PHASE     OUTCOME   EXIT\n\
             bad     \"tomorrow\" (unreadable)                    Pending\n\
             done    Sun Nov 22 11:00:00 2026 CET   2h48m ago   Done      Failed    3\n\
             later   Sun Nov 22 18:00:00 2026 CET   in 4h12m    Pending\n"
        );
        let with_namespaces = table(&ats[..1], now, &zone, true);
        assert!(
            with_namespaces.starts_with("NAMESPACE   NAME"),
            "{with_namespaces}"
        );
        assert!(
            with_namespaces.contains("\nteam-a      later"),
            "{with_namespaces}"
        );
    }

    #[test]
    fn the_job_line_gives_local_time_utc_and_how_far() {
        let zone = TimeZone::get("Europe/Berlin").unwrap();
        let at = at("backup-x7k2", "2026-11-22T17:00:00Z", None);
        assert_eq!(
            job_line(
                &at,
                t("2026-11-22T17:00:00Z"),
                t("2026-11-22T12:48:00Z"),
                &zone
            ),
            "at: job team-a/backup-x7k2 at Sun Nov 22 18:00:00 2026 CET (17:00:00 UTC, in 4h12m)"
        );
    }

    #[test]
    fn a_finished_at_becomes_the_commands_exit_code_or_a_reason() {
        let code = |status| exit_code(&at("x", "2026-11-22T17:00:00Z", status));
        assert_eq!(code(done(Outcome::Succeeded, Some(0), "Completed")), Ok(0));
        assert_eq!(code(done(Outcome::Failed, Some(3), "Error")), Ok(3));
        assert_eq!(code(done(Outcome::Failed, Some(137), "OOMKilled")), Ok(137));
        assert_eq!(code(done(Outcome::Failed, Some(256), "Error")), Ok(1));
        assert_eq!(code(done(Outcome::Failed, Some(-1), "Error")), Ok(255));
        assert_eq!(
            code(done(Outcome::Missed, None, "Missed")),
            Err("At team-a/x never ran: Missed: details".into())
        );
        assert_eq!(
            code(done(Outcome::Failed, None, "DeadlineExceeded")),
            Err("At team-a/x failed without an exit code: DeadlineExceeded: details".into())
        );
        assert_eq!(code(None), Err("At team-a/x has not finished".into()));
    }
}
