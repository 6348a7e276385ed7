use super::*;
use proptest::prelude::*;

/// `now` as a wall-clock time in `zone`.
fn at(zone: &str, wall: &str) -> Zoned {
    let civil: jiff::civil::DateTime = wall.parse().unwrap();
    civil.in_tz(zone).unwrap()
}

fn read(time: &str, now: &Zoned) -> String {
    match parse(time, now) {
        Ok(instant) => instant.to_zoned(now.time_zone().clone()).to_string(),
        Err(error) => format!("error: {error}"),
    }
}

#[test]
fn every_form_reads_as_at_1_does() {
    // Sunday 22 November 2026, 13:48:20 in Berlin (CET, +01:00).
    let now = at("Europe/Berlin", "2026-11-22T13:48:20");
    let table = [
        ("now", "2026-11-22T13:48:20+01:00[Europe/Berlin]"),
        ("NOW", "2026-11-22T13:48:20+01:00[Europe/Berlin]"),
        (
            "now + 5 minutes",
            "2026-11-22T13:53:20+01:00[Europe/Berlin]",
        ),
        ("now+5min", "2026-11-22T13:53:20+01:00[Europe/Berlin]"),
        ("now + 1 minute", "2026-11-22T13:49:20+01:00[Europe/Berlin]"),
        (
            "now + 30 seconds",
            "2026-11-22T13:48:50+01:00[Europe/Berlin]",
        ),
        ("now + 30s", "2026-11-22T13:48:50+01:00[Europe/Berlin]"),
        ("now + 2 hours", "2026-11-22T15:48:20+01:00[Europe/Berlin]"),
        ("now +2h", "2026-11-22T15:48:20+01:00[Europe/Berlin]"),
        ("now + 1 day", "2026-11-23T13:48:20+01:00[Europe/Berlin]"),
        ("now + 3 days", "2026-11-25T13:48:20+01:00[Europe/Berlin]"),
        ("now + 1 week", "2026-11-29T13:48:20+01:00[Europe/Berlin]"),
        ("now + 2w", "2026-12-06T13:48:20+01:00[Europe/Berlin]"),
        // A time of day: today while ahead, else tomorrow.
        ("18:00", "2026-11-22T18:00:00+01:00[Europe/Berlin]"),
        ("1800", "2026-11-22T18:00:00+01:00[Europe/Berlin]"),
        ("09:30", "2026-11-23T09:30:00+01:00[Europe/Berlin]"),
        ("13:48", "2026-11-23T13:48:00+01:00[Europe/Berlin]"),
        ("6pm", "2026-11-22T18:00:00+01:00[Europe/Berlin]"),
        ("6 PM", "2026-11-22T18:00:00+01:00[Europe/Berlin]"),
        ("6:30am", "2026-11-23T06:30:00+01:00[Europe/Berlin]"),
        ("12am", "2026-11-23T00:00:00+01:00[Europe/Berlin]"),
        ("12pm", "2026-11-23T12:00:00+01:00[Europe/Berlin]"),
        ("noon", "2026-11-23T12:00:00+01:00[Europe/Berlin]"),
        ("midnight", "2026-11-23T00:00:00+01:00[Europe/Berlin]"),
        ("teatime", "2026-11-22T16:00:00+01:00[Europe/Berlin]"),
        // With a day.
        ("noon tomorrow", "2026-11-23T12:00:00+01:00[Europe/Berlin]"),
        ("tomorrow noon", "2026-11-23T12:00:00+01:00[Europe/Berlin]"),
        ("6pm today", "2026-11-22T18:00:00+01:00[Europe/Berlin]"),
        ("noon today", "2026-11-22T12:00:00+01:00[Europe/Berlin]"),
        (
            "midnight tomorrow",
            "2026-11-23T00:00:00+01:00[Europe/Berlin]",
        ),
        (
            "teatime tomorrow + 1 week",
            "2026-11-30T16:00:00+01:00[Europe/Berlin]",
        ),
        (
            "9:00 2026-12-24",
            "2026-12-24T09:00:00+01:00[Europe/Berlin]",
        ),
        (
            "2026-12-24 9:00",
            "2026-12-24T09:00:00+01:00[Europe/Berlin]",
        ),
        ("9am friday", "2026-11-27T09:00:00+01:00[Europe/Berlin]"),
        ("noon mon", "2026-11-23T12:00:00+01:00[Europe/Berlin]"),
        // Today is Sunday: 6pm Sunday is still ahead, 9am Sunday is next week's.
        ("6pm sunday", "2026-11-22T18:00:00+01:00[Europe/Berlin]"),
        ("9am sunday", "2026-11-29T09:00:00+01:00[Europe/Berlin]"),
        // RFC 3339, with or without an offset.
        (
            "2026-11-22T18:00:00Z",
            "2026-11-22T19:00:00+01:00[Europe/Berlin]",
        ),
        (
            "2026-11-22T18:00:00+05:00",
            "2026-11-22T14:00:00+01:00[Europe/Berlin]",
        ),
        (
            "2026-11-22T18:00:00",
            "2026-11-22T18:00:00+01:00[Europe/Berlin]",
        ),
        (
            "2026-11-22 18:00:00",
            "2026-11-22T18:00:00+01:00[Europe/Berlin]",
        ),
    ];
    for (time, expected) in table {
        assert_eq!(read(time, &now), expected, "{time}");
    }
}

#[test]
fn bad_input_says_what_is_wrong_and_shows_examples() {
    let now = at("UTC", "2026-11-22T13:48:20");
    let table = [
        ("", "no TIME given; write when to run, e.g. now + 5 minutes"),
        ("   ", "no TIME given"),
        ("soon", "TIME \"soon\": it does not start with now, a time of day or a date; write it as at(1) does, e.g. now + 5 minutes, 18:00"),
        ("25:00", "TIME \"25:00\": 25:00 is not a time of day (00:00 to 23:59)"),
        ("12:60", "12:60 is not a time of day (00:00 to 23:59)"),
        ("13pm", "13pm: the hour must be 1 to 12"),
        ("0am", "0am: the hour must be 1 to 12"),
        ("6", "6 alone is not a time: write 6:00, 6am or 6pm"),
        ("18:0", "18:0 is not a time of day like 18:00"),
        ("12345", "12345 is not a time of day like 18:00 or 1800"),
        ("now + 5 fortnights", "\"fortnights\" is not a unit (seconds, minutes, hours, days or weeks)"),
        ("now + minutes", "an increment is `+ N UNIT`"),
        ("now +", "an increment is `+ N UNIT`"),
        ("now - 5 minutes", "\"-\" is not expected there"),
        ("+ 5 minutes", "an increment needs a start: write `now + 5 minutes`"),
        ("tomorrow", "a day needs a time of day too: write `noon tomorrow`"),
        ("2026-12-24", "a day needs a time of day too"),
        ("noon tomorrow today", "\"today\" is not expected there"),
        ("noon 2026-02-30", "2026-02-30 is not a date"),
        ("now + 99999999 weeks", "\"99999999\" is not a number"),
        ("now + 999999 weeks", "out of range"),
        ("ünïcödé", "it does not start with now, a time of day or a date"),
    ];
    for (time, expected) in table {
        let got = read(time, &now);
        assert!(got.starts_with("error: "), "{time:?} read as {got}");
        assert!(got.contains(expected), "{time:?}: {got}");
    }
}

#[test]
fn midnight_and_day_ends() {
    // A minute before midnight, "midnight" is a minute away; at midnight it is now.
    let late = at("UTC", "2026-12-31T23:59:00");
    assert_eq!(read("midnight", &late), "2027-01-01T00:00:00+00:00[UTC]");
    assert_eq!(read("noon", &late), "2027-01-01T12:00:00+00:00[UTC]");
    assert_eq!(
        read("now + 1 minute", &late),
        "2027-01-01T00:00:00+00:00[UTC]"
    );
    let midnight = at("UTC", "2026-12-31T00:00:00");
    assert_eq!(
        read("midnight", &midnight),
        "2026-12-31T00:00:00+00:00[UTC]"
    );
    assert_eq!(read("00:00", &midnight), "2026-12-31T00:00:00+00:00[UTC]");
    // A month end: "+ 1 day" is the calendar's next day.
    let month_end = at("UTC", "2026-02-28T10:00:00");
    assert_eq!(
        read("now + 1 day", &month_end),
        "2026-03-01T10:00:00+00:00[UTC]"
    );
}

#[test]
fn daylight_saving_changes() {
    // (zone, now, TIME, expected): Berlin springs forward on 29 March 2026 (02:00 -> 03:00)
    // and falls back on 25 October 2026 (03:00 CEST -> 02:00 CET); New York on 8 March 2026.
    let table = [
        // 02:30 does not exist that night: the same moment as 03:30 CEST.
        (
            "Europe/Berlin",
            "2026-03-28T20:00:00",
            "2:30am",
            "2026-03-29T03:30:00+02:00[Europe/Berlin]",
        ),
        // A day later is the same wall-clock time, 23 hours later.
        (
            "Europe/Berlin",
            "2026-03-28T20:00:00",
            "now + 1 day",
            "2026-03-29T20:00:00+02:00[Europe/Berlin]",
        ),
        (
            "Europe/Berlin",
            "2026-03-28T20:00:00",
            "now + 24 hours",
            "2026-03-29T21:00:00+02:00[Europe/Berlin]",
        ),
        // 02:30 happens twice: the first.
        (
            "Europe/Berlin",
            "2026-10-24T20:00:00",
            "2:30am",
            "2026-10-25T02:30:00+02:00[Europe/Berlin]",
        ),
        (
            "Europe/Berlin",
            "2026-10-24T20:00:00",
            "now + 1 day",
            "2026-10-25T20:00:00+01:00[Europe/Berlin]",
        ),
        (
            "America/New_York",
            "2026-03-07T23:00:00",
            "2:15am",
            "2026-03-08T03:15:00-04:00[America/New_York]",
        ),
    ];
    for (zone, now, time, expected) in table {
        assert_eq!(
            read(time, &at(zone, now)),
            expected,
            "{time} at {now} in {zone}"
        );
    }
}

fn zones() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "UTC",
        "Europe/Berlin",
        "America/New_York",
        "Asia/Kolkata",
        "Australia/Lord_Howe",
        "Pacific/Chatham",
    ])
}

proptest! {
    /// Any instant written in RFC 3339 reads back as itself, whatever the zone and the clock.
    #[test]
    fn rfc3339_round_trips(seconds in 0i64..4_000_000_000, now in 0i64..4_000_000_000, zone in zones()) {
        let instant = Timestamp::from_second(seconds).unwrap();
        let now = Timestamp::from_second(now).unwrap().in_tz(zone).unwrap();
        prop_assert_eq!(parse(&instant.to_string(), &now), Ok(instant));
        let local = instant.in_tz(zone).unwrap();
        prop_assert_eq!(parse(&local.timestamp().to_string(), &now), Ok(instant));
    }

    /// `now + N UNIT` is N of that unit after now, exactly for seconds to hours.
    #[test]
    fn increments_add_exactly(now in 0i64..4_000_000_000, n in 0i64..10_000, zone in zones(), unit in 0usize..3) {
        let now = Timestamp::from_second(now).unwrap().in_tz(zone).unwrap();
        let (word, seconds) = [("seconds", 1), ("minutes", 60), ("hours", 3600)][unit];
        let got = parse(&format!("now + {n} {word}"), &now).unwrap();
        prop_assert_eq!(got.as_second() - now.timestamp().as_second(), n * seconds);
    }

    /// A time of day alone is never in the past and less than a day (plus a DST shift) away,
    /// and reads as that wall-clock time unless the clocks skip it.
    #[test]
    fn a_time_of_day_is_the_next_one(now in 0i64..4_000_000_000, hour in 0i8..24, minute in 0i8..60, zone in zones()) {
        let now = Timestamp::from_second(now).unwrap().in_tz(zone).unwrap();
        let got = parse(&format!("{hour:02}:{minute:02}"), &now).unwrap();
        let ahead = got.as_second() - now.timestamp().as_second();
        prop_assert!((0..=25 * 3600).contains(&ahead), "{} is {}s ahead of {}", got, ahead, now);
        let wall = got.to_zoned(now.time_zone().clone());
        let exists = wall.hour() == hour && wall.minute() == minute;
        let skipped = wall.time_zone().to_ambiguous_zoned(wall.date().to_datetime(Time::constant(hour, minute, 0, 0))).is_ambiguous();
        prop_assert!(exists || skipped, "{:02}:{:02} read as {}", hour, minute, wall);
    }

    /// Nothing the user types makes the parser panic.
    #[test]
    fn arbitrary_input_never_panics(text in "\\PC{0,40}", now in 0i64..4_000_000_000) {
        let now = Timestamp::from_second(now).unwrap().in_tz("UTC").unwrap();
        let _ = parse(&text, &now);
    }

    /// Nor does anything made of the parser's own words.
    #[test]
    fn word_salad_never_panics(words in prop::collection::vec(prop::sample::select(vec![
        "now", "+", "5", "minutes", "noon", "midnight", "teatime", "tomorrow", "today", "friday",
        "6pm", "18:00", "2026-11-22", "am", "pm", "99", "0", "-", "weeks",
    ]), 0..6)) {
        let now = Timestamp::from_second(1_800_000_000).unwrap().in_tz("Europe/Berlin").unwrap();
        let _ = parse(&words.join(" "), &now);
    }
}
