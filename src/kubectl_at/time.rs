//! The TIME of `kubectl at TIME`, read as at(1) users write it. Pure: the current time and the
//! user's time zone come in as a `Zoned`. See docs/src/guide/kubectl-at.md, "TIME".

use jiff::civil::{Date, Time, Weekday};
use jiff::tz::{Disambiguation, TimeZone};
use jiff::{Span, Timestamp, Zoned};
use thiserror::Error;

/// What an unreadable TIME is answered with.
pub const EXAMPLES: &str = "now + 5 minutes, 18:00, 6pm tomorrow, noon friday, midnight, \
                            teatime, 2026-11-22 09:30, 2026-11-22T18:00:00Z (or --in 10m)";

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TimeError {
    #[error("no TIME given; write when to run, e.g. {EXAMPLES}")]
    Empty,
    #[error("TIME {time:?}: {why}; write it as at(1) does, e.g. {EXAMPLES}")]
    Unreadable { time: String, why: String },
    #[error("TIME {time:?} is out of range")]
    OutOfRange { time: String },
}

/// The instant `words` name, seen at `now` (which carries the user's time zone).
pub fn parse(words: &str, now: &Zoned) -> Result<Timestamp, TimeError> {
    let text = words.trim();
    if text.is_empty() {
        return Err(TimeError::Empty);
    }
    let unreadable = |why: String| TimeError::Unreadable {
        time: text.to_owned(),
        why,
    };
    if let Ok(instant) = text.parse::<Timestamp>() {
        return Ok(instant);
    }
    // With a time of day only: a date alone means no time, not midnight.
    if let Some(civil) = text
        .contains(':')
        .then(|| text.parse::<jiff::civil::DateTime>().ok())
        .flatten()
    {
        let time = civil.time();
        return wall_clock(civil.date(), time, now.time_zone())
            .map(|zoned| zoned.timestamp())
            .map_err(unreadable);
    }
    let tokens = tokenize(&text.to_ascii_lowercase());
    let (base, rest) = base(&tokens, now).map_err(unreadable)?;
    let increment = increment(rest).map_err(unreadable)?;
    base.checked_add(increment)
        .map(|zoned| zoned.timestamp())
        .map_err(|_| TimeError::OutOfRange {
            time: text.to_owned(),
        })
}

/// Splits on whitespace and around `+`, and between a number and a unit (`5min`, `6pm`).
fn tokenize(text: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    for word in text.split_whitespace() {
        for (i, part) in word.split('+').enumerate() {
            if i > 0 {
                tokens.push("+".to_owned());
            }
            if part.is_empty() {
                continue;
            }
            let digits = part
                .find(|c: char| !c.is_ascii_digit() && c != ':')
                .unwrap_or(part.len());
            let (number, unit) = part.split_at(digits);
            // `2026-11-22` and `2026-11-22t10:00` stay whole.
            if digits > 0 && !unit.is_empty() && !unit.starts_with('-') && !unit.starts_with('t') {
                tokens.push(number.to_owned());
                tokens.push(unit.to_owned());
            } else {
                tokens.push(part.to_owned());
            }
        }
    }
    tokens
}

/// The moment before any increment, and the tokens after it.
fn base<'t>(tokens: &'t [String], now: &Zoned) -> Result<(Zoned, &'t [String]), String> {
    let zone = now.time_zone();
    let first = tokens.first().map(String::as_str).unwrap_or_default();
    if first == "now" {
        return Ok((now.clone(), &tokens[1..]));
    }
    if first == "+" {
        return Err("an increment needs a start: write `now + 5 minutes`".into());
    }
    let mut rest = tokens;
    let mut day = None;
    if let Some((found, after)) = day_of(rest, now)? {
        day = Some(found);
        rest = after;
    }
    let (time, after) = time_of_day(rest)?;
    rest = after;
    if day.is_none() {
        if let Some((found, after)) = day_of(rest, now)? {
            day = Some(found);
            rest = after;
        }
    }
    let Some(time) = time else {
        return Err(match day {
            Some(_) => "a day needs a time of day too: write `noon tomorrow` or `9:00 2026-11-22`",
            None => "it does not start with now, a time of day or a date",
        }
        .into());
    };
    let at = |date: Date| wall_clock(date, time, zone);
    let zoned = match day {
        Some(Day::Date(date)) => at(date)?,
        Some(Day::Weekday(weekday)) => {
            let today = now.date();
            let mut date = today;
            while date.weekday() != weekday || (date == today && at(date)? < *now) {
                date = date.tomorrow().map_err(|e| e.to_string())?;
            }
            at(date)?
        }
        None => {
            let today = at(now.date())?;
            if today < *now {
                at(now.date().tomorrow().map_err(|e| e.to_string())?)?
            } else {
                today
            }
        }
    };
    Ok((zoned, rest))
}

fn wall_clock(date: Date, time: Time, zone: &TimeZone) -> Result<Zoned, String> {
    zone.to_ambiguous_zoned(date.to_datetime(time))
        .disambiguate(Disambiguation::Compatible)
        .map_err(|e| e.to_string())
}

enum Day {
    Date(Date),
    Weekday(Weekday),
}

/// `today`, `tomorrow`, a weekday or an ISO date at the start of `tokens`.
fn day_of<'t>(tokens: &'t [String], now: &Zoned) -> Result<Option<(Day, &'t [String])>, String> {
    let Some(word) = tokens.first() else {
        return Ok(None);
    };
    let day = match word.as_str() {
        "today" => Day::Date(now.date()),
        "tomorrow" => Day::Date(now.date().tomorrow().map_err(|e| e.to_string())?),
        word => match weekday(word) {
            Some(weekday) => Day::Weekday(weekday),
            None if word.len() == 10 && word.as_bytes()[4] == b'-' => {
                Day::Date(word.parse().map_err(|_| format!("{word} is not a date"))?)
            }
            None => return Ok(None),
        },
    };
    Ok(Some((day, &tokens[1..])))
}

fn weekday(word: &str) -> Option<Weekday> {
    let days = [
        ("monday", Weekday::Monday),
        ("tuesday", Weekday::Tuesday),
        ("wednesday", Weekday::Wednesday),
        ("thursday", Weekday::Thursday),
        ("friday", Weekday::Friday),
        ("saturday", Weekday::Saturday),
        ("sunday", Weekday::Sunday),
    ];
    days.iter()
        .find(|(name, _)| word.len() >= 3 && name.starts_with(word))
        .map(|(_, day)| *day)
}

/// A time of day at the start of `tokens` (`None` when there is none).
fn time_of_day(tokens: &[String]) -> Result<(Option<Time>, &[String]), String> {
    let Some(word) = tokens.first() else {
        return Ok((None, tokens));
    };
    let named = match word.as_str() {
        "noon" => Some(Time::constant(12, 0, 0, 0)),
        "midnight" => Some(Time::midnight()),
        "teatime" => Some(Time::constant(16, 0, 0, 0)),
        _ => None,
    };
    if named.is_some() {
        return Ok((named, &tokens[1..]));
    }
    if !word.starts_with(|c: char| c.is_ascii_digit()) || word.len() == 10 {
        return Ok((None, tokens));
    }
    let (hour, minute) = match word.split_once(':') {
        Some((h, m)) if m.len() == 2 => (number(h)?, number(m)?),
        Some(_) => return Err(format!("{word} is not a time of day like 18:00")),
        None if word.len() == 4 => (number(&word[..2])?, number(&word[2..])?),
        None if word.len() <= 2 => (number(word)?, 0),
        None => return Err(format!("{word} is not a time of day like 18:00 or 1800")),
    };
    let (hour, rest) = match tokens.get(1).map(String::as_str) {
        Some(meridiem @ ("am" | "pm")) => {
            if !(1..=12).contains(&hour) {
                return Err(format!("{word}{meridiem}: the hour must be 1 to 12"));
            }
            (
                hour % 12 + if meridiem == "pm" { 12 } else { 0 },
                &tokens[2..],
            )
        }
        _ if word.len() <= 2 && !word.contains(':') => {
            return Err(format!(
                "{word} alone is not a time: write {word}:00, {word}am or {word}pm"
            ))
        }
        _ => (hour, &tokens[1..]),
    };
    if hour > 23 || minute > 59 {
        return Err(format!("{word} is not a time of day (00:00 to 23:59)"));
    }
    Ok((Some(Time::constant(hour as i8, minute as i8, 0, 0)), rest))
}

fn number(digits: &str) -> Result<i64, String> {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.len() > 6 {
        return Err(format!("{digits:?} is not a number"));
    }
    digits
        .parse()
        .map_err(|_| format!("{digits:?} is not a number"))
}

/// `+ N UNIT` (or nothing) making up the rest of the TIME.
fn increment(tokens: &[String]) -> Result<Span, String> {
    match tokens {
        [] => Ok(Span::new()),
        [plus, count, unit] if plus == "+" => {
            let count = number(count)?;
            let span = match unit.as_str() {
                "s" | "sec" | "secs" | "second" | "seconds" => Span::new().try_seconds(count),
                "m" | "min" | "mins" | "minute" | "minutes" => Span::new().try_minutes(count),
                "h" | "hour" | "hours" => Span::new().try_hours(count),
                "d" | "day" | "days" => Span::new().try_days(count),
                "w" | "week" | "weeks" => Span::new().try_weeks(count),
                other => {
                    return Err(format!(
                        "{other:?} is not a unit (seconds, minutes, hours, days or weeks)"
                    ))
                }
            };
            span.map_err(|_| format!("+ {count} {unit} is too far"))
        }
        [plus, ..] if plus == "+" => {
            Err("an increment is `+ N UNIT`, e.g. + 5 minutes or +2h".into())
        }
        [word, ..] => Err(format!("{word:?} is not expected there")),
    }
}

#[cfg(test)]
mod tests;
