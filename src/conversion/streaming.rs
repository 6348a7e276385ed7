//! A `ConversionReview` answered as it is read: objects are read, converted and written one at
//! a time, within [`OBJECT_BUDGET`] and [`MAX_TOKEN`], however large the body. Pure: bytes in
//! (`Read`), bytes out (`Write`). See docs/src/design/decisions.md, "Conversion, streamed".

use super::{parts, ConversionError, V1, V1ALPHA1};
use crate::serving::bounded::Budget;
use kube::core::conversion::ConversionResponse;
use kube::core::Status;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::cell::RefCell;
use std::fmt;
use std::io::{self, BufRead, Read, Write};
use std::rc::Rc;

/// What one object of a review may take in memory, decoded: many times what any At needs (etcd
/// bounds an At's JSON), and a bound on a made-up one.
pub const OBJECT_BUDGET: usize = 16 << 20;

/// The longest string or number read, in bytes of the body: the parser holds one whole before
/// anything can look at it, and no At holds one longer than etcd's largest object.
pub const MAX_TOKEN: usize = 2 << 20;

/// How an answer ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Answered {
    /// Every object converted (`Success`).
    Converted(usize),
    /// A `Failure` saying why (nothing was converted).
    Refused(String),
}

/// Why an answer could not be completed once begun (the caller cuts the connection).
#[derive(Debug, thiserror::Error)]
pub enum Broken {
    #[error("writing the answer: {0}")]
    Write(#[from] io::Error),
    #[error("the ConversionReview went wrong after {converted} objects were converted: {why}")]
    Midway { converted: usize, why: String },
}

/// Reads a ConversionReview from `body` and writes its answer to `out`.
pub fn answer(body: impl Read, out: impl Write) -> Result<Answered, Broken> {
    // Buffered here: serde_json reads a byte at a time from what it is given.
    let body: Rc<RefCell<dyn BufRead + '_>> = Rc::new(RefCell::new(io::BufReader::new(body)));
    let state = RefCell::new(State {
        out: Output::new(out),
        uid: None,
        desired: None,
        types: (false, false),
        request: false,
        refused: None,
        converted: 0,
        body: body.clone(),
        object: Vec::new(),
    });
    // The parser reads all but the objects, within MAX_TOKEN; the objects are bounded whole.
    let mut deserializer =
        serde_json::Deserializer::from_reader(Tokens::new(Shared(body), MAX_TOKEN));
    let parsed = Review(&state)
        .deserialize(&mut deserializer)
        .and_then(|()| deserializer.end());
    let mut state = state.into_inner();
    let why = match (parsed, state.refused.take()) {
        (_, Some(why)) => Some(why),
        (Err(error), None) if !state.out.begun => {
            Some(format!("the body is not a ConversionReview: {error}"))
        }
        (Err(error), None) => {
            return Err(midway(&state, error.to_string()));
        }
        (Ok(()), None) => match (state.types, state.request) {
            ((false, _), _) => {
                Some("the body is not a ConversionReview: missing field `apiVersion`".into())
            }
            ((_, false), _) => {
                Some("the body is not a ConversionReview: missing field `kind`".into())
            }
            (_, false) => Some("the ConversionReview has no request".into()),
            _ => None,
        },
    };
    match why {
        Some(why) if state.out.begun => Err(midway(&state, why)),
        Some(why) => {
            let mut response = ConversionResponse::invalid(Status::failure(&why, "BadRequest"));
            response.uid = state.uid.unwrap_or_default();
            serde_json::to_writer(&mut state.out.inner, &response.into_review())
                .map_err(io::Error::from)?;
            state.out.inner.flush()?;
            Ok(Answered::Refused(why))
        }
        None => {
            let uid = serde_json::to_string(state.uid.as_deref().unwrap_or_default())
                .map_err(io::Error::from)?;
            state.out.begin()?;
            write!(state.out.inner, r#"],"uid":{uid}}}}}"#)?;
            state.out.inner.flush()?;
            Ok(Answered::Converted(state.converted))
        }
    }
}

/// A reader that fails once a string or a number (or any other run of bytes between JSON's
/// punctuation) in what it passes on grows past `limit` bytes, before the parser has taken it.
struct Tokens<R> {
    inner: R,
    limit: usize,
    in_string: bool,
    escaped: bool,
    run: usize,
}

impl<R> Tokens<R> {
    fn new(inner: R, limit: usize) -> Self {
        Tokens {
            inner,
            limit,
            in_string: false,
            escaped: false,
            run: 0,
        }
    }
}

impl<R: Read> Read for Tokens<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        for &byte in &buf[..n] {
            if self.in_string {
                match byte {
                    _ if self.escaped => self.escaped = false,
                    b'\\' => self.escaped = true,
                    b'"' => {
                        self.in_string = false;
                        self.run = 0;
                        continue;
                    }
                    _ => {}
                }
                self.run += 1;
            } else {
                match byte {
                    b'"' => {
                        self.in_string = true;
                        self.run = 0;
                    }
                    b'{' | b'}' | b'[' | b']' | b',' | b':' | b' ' | b'\t' | b'\n' | b'\r' => {
                        self.run = 0
                    }
                    _ => self.run += 1,
                }
            }
            if self.run > self.limit {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "a string or number over {} MiB, longer than any At holds",
                        self.limit >> 20
                    ),
                ));
            }
        }
        Ok(n)
    }
}

fn midway<W>(state: &State<'_, W>, why: String) -> Broken {
    Broken::Midway {
        converted: state.converted,
        why,
    }
}

/// The answer as it is written: the head (up to the `[` of `convertedObjects`) once, then the
/// objects with commas between them.
struct Output<W> {
    inner: W,
    begun: bool,
}

impl<W: Write> Output<W> {
    fn new(inner: W) -> Self {
        Output {
            inner,
            begun: false,
        }
    }

    fn begin(&mut self) -> io::Result<()> {
        if self.begun {
            return Ok(());
        }
        self.begun = true;
        let success = serde_json::to_string(&Status::success())?;
        write!(
            self.inner,
            r#"{{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","response":{{"result":{success},"convertedObjects":["#
        )
    }

    fn object(&mut self, object: &parts::Members) -> io::Result<()> {
        let first = !self.begun;
        self.begin()?;
        if !first {
            self.inner.write_all(b",")?;
        }
        parts::write(object, &mut self.inner)
    }
}

/// What the parse has seen so far.
struct State<'r, W> {
    out: Output<W>,
    uid: Option<String>,
    desired: Option<String>,
    /// Whether `apiVersion` and `kind` were there.
    types: (bool, bool),
    request: bool,
    /// Why the review is refused; set, the parse stops.
    refused: Option<String>,
    converted: usize,
    /// The body, shared with the parser: the objects are read from it by `next_object`.
    body: Rc<RefCell<dyn BufRead + 'r>>,
    /// The text of the object being converted.
    object: Vec<u8>,
}

/// The error that stops the parse once `refused` is set (its text is never shown).
fn stop<E: de::Error>() -> E {
    E::custom("refused")
}

struct Review<'a, 'r, W>(&'a RefCell<State<'r, W>>);

impl<'de, W: Write> DeserializeSeed<'de> for Review<'_, '_, W> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, W: Write> Visitor<'de> for Review<'_, '_, W> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a ConversionReview object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::ApiVersion => {
                    map.next_value::<String>()?;
                    self.0.borrow_mut().types.0 = true;
                }
                Key::Kind => {
                    map.next_value::<String>()?;
                    self.0.borrow_mut().types.1 = true;
                }
                Key::Request => {
                    self.0.borrow_mut().request = true;
                    map.next_value_seed(Request(self.0))?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// The keys cnat reads, without allocating for the others.
#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum Key {
    ApiVersion,
    Kind,
    Request,
    Uid,
    #[serde(rename = "desiredAPIVersion")]
    Desired,
    Objects,
    #[serde(other)]
    Other,
}

struct Request<'a, 'r, W>(&'a RefCell<State<'r, W>>);

impl<'de, W: Write> DeserializeSeed<'de> for Request<'_, '_, W> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, W: Write> Visitor<'de> for Request<'_, '_, W> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a ConversionRequest object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let (mut uid, mut desired, mut objects) = (false, false, false);
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Uid => {
                    self.0.borrow_mut().uid = Some(map.next_value()?);
                    uid = true;
                }
                Key::Desired => {
                    let version: String = map.next_value()?;
                    if version != V1 && version != V1ALPHA1 {
                        // Refused; read on (skipping the objects, which costs no memory) for
                        // the uid the answer must carry.
                        let why = ConversionError::UnknownTarget(version.clone()).to_string();
                        self.0.borrow_mut().refused = Some(why);
                    }
                    self.0.borrow_mut().desired = Some(version);
                    desired = true;
                }
                Key::Objects if self.0.borrow().refused.is_some() => {
                    map.next_value::<IgnoredAny>()?;
                    objects = true;
                }
                Key::Objects => {
                    if !desired {
                        self.0.borrow_mut().refused = Some(
                            "the ConversionReview's request lists its objects before its desiredAPIVersion; cnat converts them as they come, in the order kube-apiserver sends them".into(),
                        );
                        return Err(stop());
                    }
                    map.next_value_seed(Objects(self.0))?;
                    objects = true;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let missing = [
            (uid, "uid"),
            (desired, "desiredAPIVersion"),
            (objects, "objects"),
        ]
        .into_iter()
        .find(|(present, _)| !present);
        if let Some((_, field)) = missing.filter(|_| self.0.borrow().refused.is_none()) {
            self.0.borrow_mut().refused = Some(format!(
                "the body is not a ConversionReview: missing field `{field}`"
            ));
            return Err(stop());
        }
        Ok(())
    }
}

struct Objects<'a, 'r, W>(&'a RefCell<State<'r, W>>);

impl<'de, W: Write> DeserializeSeed<'de> for Objects<'_, '_, W> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, W: Write> Visitor<'de> for Objects<'_, '_, W> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of objects")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        for index in 0.. {
            let budget = Budget::new(OBJECT_BUDGET);
            let mut state = self.0.borrow_mut();
            let state = &mut *state;
            let mut text = std::mem::take(&mut state.object);
            let read = next_object(&mut *state.body.borrow_mut(), index == 0, &mut text);
            let object = read.and_then(|more| match more {
                false => Ok(None),
                true => parts::read(&text, &budget)
                    .map(Some)
                    .map_err(io::Error::from),
            });
            let object = match object {
                Ok(Some(object)) => object,
                Ok(None) => {
                    state.object = text;
                    return Ok(());
                }
                Err(error) => {
                    state.refused = Some(format!("object {index}: {error}"));
                    return Err(stop());
                }
            };
            let desired = state.desired.clone().unwrap_or_default();
            let converted = parts::convert(index, object, &desired, &budget);
            let written = match &converted {
                Ok(object) => Ok(state.out.object(object)),
                Err(error) => Err(error.to_string()),
            };
            drop(converted);
            state.object = text;
            match written {
                Ok(written) => {
                    if let Err(error) = written {
                        state.refused = Some(format!("writing the answer: {error}"));
                        return Err(stop());
                    }
                    state.converted += 1;
                }
                Err(why) => {
                    state.refused = Some(why);
                    return Err(stop());
                }
            }
        }
        Ok(())
    }
}

/// The body as the parser reads it, shared with `next_object`.
struct Shared<'r>(Rc<RefCell<dyn BufRead + 'r>>);

impl Read for Shared<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.borrow_mut().read(buf)
    }
}

fn syntax(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.to_owned())
}

/// Reads the next element of `objects` into `text` (the first when `first`), unchecked as JSON
/// (`parts::read` checks it): `false` at the list's end, whose `]` is left for the parser, which
/// has just read the `[` and holds no byte read ahead. An element past [`OBJECT_BUDGET`] bytes
/// is refused before more of it is read.
fn next_object(body: &mut dyn BufRead, first: bool, text: &mut Vec<u8>) -> io::Result<bool> {
    text.clear();
    let mut next = skip_whitespace(body)?;
    if next == Some(b']') {
        return Ok(false);
    }
    if !first {
        if next != Some(b',') {
            return Err(syntax("expected `,` or `]` after an object"));
        }
        body.consume(1);
        next = skip_whitespace(body)?;
    }
    let Some(start) = next else {
        return Err(io::ErrorKind::UnexpectedEof.into());
    };
    if matches!(start, b']' | b',') {
        return Err(syntax("expected an object"));
    }
    // Where the element ends: at the `}` or `]` that closes it, or, for anything else, before
    // the `,` or `]` or space after it (or at the quote that ends a string).
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    loop {
        let chunk = body.fill_buf()?;
        if chunk.is_empty() {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let mut end = None;
        let mut i = 0;
        while i < chunk.len() {
            let byte = chunk[i];
            i += 1;
            if escaped {
                escaped = false;
                continue;
            }
            if in_string {
                // Most of an At's text is in strings: on to the next quote or backslash.
                match memchr::memchr2(b'"', b'\\', &chunk[i - 1..]) {
                    None => i = chunk.len(),
                    Some(at) => {
                        i += at;
                        match chunk[i - 1] {
                            b'\\' => escaped = true,
                            _ => {
                                in_string = false;
                                if depth == 0 {
                                    end = Some(i);
                                    break;
                                }
                            }
                        }
                    }
                }
                continue;
            }
            let i = i - 1;
            match byte {
                b'"' => in_string = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' if depth > 0 => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(i + 1);
                        break;
                    }
                }
                b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r' if depth == 0 => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let taken = end.unwrap_or(chunk.len());
        if text.len() + taken > OBJECT_BUDGET {
            return Err(syntax(&format!(
                "the object takes more than {} KiB of the body, more than any At needs",
                OBJECT_BUDGET >> 10
            )));
        }
        if text.len() + taken > text.capacity() {
            // Room doubled as a vector does, but never past the bound.
            let room = (text.capacity() * 2).clamp(text.len() + taken, OBJECT_BUDGET);
            text.reserve_exact(room - text.len());
        }
        text.extend_from_slice(&chunk[..taken]);
        body.consume(taken);
        if end.is_some() {
            return Ok(true);
        }
    }
}

/// Skips whitespace; the next byte, not consumed, or `None` at the end of the body.
fn skip_whitespace(body: &mut dyn BufRead) -> io::Result<Option<u8>> {
    loop {
        let chunk = body.fill_buf()?;
        let Some(&first) = chunk.first() else {
            return Ok(None);
        };
        let blank = chunk
            .iter()
            .take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
            .count();
        if blank == 0 {
            return Ok(Some(first));
        }
        body.consume(blank);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::conversion::ConversionReview;
    use serde_json::{json, Value};

    fn run(body: &[u8]) -> (Result<Answered, String>, Vec<u8>) {
        let mut out = Vec::new();
        let answered = answer(body, &mut out).map_err(|e| e.to_string());
        (answered, out)
    }

    fn at(name: &str) -> Value {
        json!({"apiVersion": V1ALPHA1, "kind": "At", "metadata": {"name": name},
               "spec": {"schedule": "s", "command": "c", "image": "busybox"}})
    }

    #[test]
    fn every_object_is_converted_in_order_and_the_answer_is_a_review() {
        let objects: Vec<Value> = (0..300).map(|i| at(&format!("at-{i}"))).collect();
        let body = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
            "request": {"uid": "u-1", "desiredAPIVersion": V1, "objects": objects}});
        let (answered, out) = run(&serde_json::to_vec(&body).unwrap());
        assert_eq!(answered, Ok(Answered::Converted(300)));
        let review: ConversionReview = serde_json::from_slice(&out).unwrap();
        let response = review.response.unwrap();
        assert_eq!(response.uid, "u-1");
        assert_eq!(response.converted_objects.len(), 300);
        assert_eq!(response.converted_objects[7]["metadata"]["name"], "at-7");
        assert_eq!(
            response.converted_objects[7]["spec"]["template"]["image"],
            "busybox"
        );
    }

    #[test]
    fn an_empty_list_is_converted() {
        let body = br#"{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{"uid":"u","desiredAPIVersion":"cnat.programming-kubernetes.info/v1","objects":[]}}"#;
        let (answered, out) = run(body);
        assert_eq!(answered, Ok(Answered::Converted(0)));
        let review: ConversionReview = serde_json::from_slice(&out).unwrap();
        assert!(review.response.unwrap().converted_objects.is_empty());
    }

    #[test]
    fn a_list_of_non_objects_is_refused_at_its_first_element_without_reading_on() {
        // 60 MB of `0,` would follow; the reader is asked for no more than the first buffers.
        struct Zeros {
            given: usize,
        }
        impl Read for Zeros {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let head = br#"{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{"uid":"u-2","desiredAPIVersion":"cnat.programming-kubernetes.info/v1","objects":["#;
                let n = buf.len().min(4096);
                for (i, byte) in buf[..n].iter_mut().enumerate() {
                    let at = self.given + i;
                    *byte = head.get(at).copied().unwrap_or(if at.is_multiple_of(2) {
                        b'0'
                    } else {
                        b','
                    });
                }
                self.given += n;
                assert!(self.given < 1 << 20, "read on past the first object");
                Ok(n)
            }
        }
        let mut out = Vec::new();
        let answered = answer(Zeros { given: 0 }, &mut out).unwrap();
        assert!(
            matches!(&answered, Answered::Refused(why) if why.contains("object 0 is not a JSON object but a number")),
            "{answered:?}"
        );
        let review: ConversionReview = serde_json::from_slice(&out).unwrap();
        let response = review.response.unwrap();
        assert_eq!(response.uid, "u-2");
        assert_eq!(
            response.result.status,
            Some(kube::core::response::StatusSummary::Failure)
        );
    }

    #[test]
    fn an_object_past_its_budget_is_refused_before_it_is_built() {
        // Text: more than OBJECT_BUDGET bytes of one object, refused before the rest is read.
        struct Endless {
            given: usize,
        }
        impl Read for Endless {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let head = format!(
                    r#"{{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{{"uid":"u","desiredAPIVersion":"{V1}","objects":[{{"spec":[0"#
                );
                let n = buf.len().min(4096);
                for (i, byte) in buf[..n].iter_mut().enumerate() {
                    *byte = head.as_bytes().get(self.given + i).copied().unwrap_or(b',');
                    if self.given + i >= head.len() && (self.given + i).is_multiple_of(2) {
                        *byte = b'0';
                    }
                }
                self.given += n;
                assert!(
                    self.given < OBJECT_BUDGET + (1 << 20),
                    "read on past the budget"
                );
                Ok(n)
            }
        }
        let mut out = Vec::new();
        let answered = answer(Endless { given: 0 }, &mut out).unwrap();
        let Answered::Refused(why) = answered else {
            panic!("{answered:?}")
        };
        assert!(
            why.starts_with("object 0: the object takes more than 16384 KiB of the body"),
            "{why}"
        );
        // Members: each costs more in memory than in the text, and is charged.
        let crowd = format!(
            r#"{{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{{"uid":"u","desiredAPIVersion":"{V1}","objects":[{{"spec":{{{}"a":0}}}}]}}}}"#,
            r#""a":0,"#.repeat(300_000)
        );
        let (answered, _) = run(crowd.as_bytes());
        let Ok(Answered::Refused(why)) = answered else {
            panic!("{answered:?}")
        };
        assert!(
            why.starts_with("object 0: the value takes more than 16384 KiB"),
            "{why}"
        );
    }

    #[test]
    fn objects_before_the_version_wanted_are_refused_and_the_uid_may_come_last() {
        let object = serde_json::to_string(&at("a")).unwrap();
        let text = format!(
            r#"{{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{{"objects":[{object}],"uid":"u","desiredAPIVersion":"{V1}"}}}}"#
        );
        let (answered, out) = run(text.as_bytes());
        assert!(
            matches!(&answered, Ok(Answered::Refused(why)) if why.contains("lists its objects before its desiredAPIVersion")),
            "{answered:?}"
        );
        let review: ConversionReview = serde_json::from_slice(&out).unwrap();
        let failure = Some(kube::core::response::StatusSummary::Failure);
        assert_eq!(review.response.unwrap().result.status, failure);
        let text = format!(
            r#"{{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{{"desiredAPIVersion":"{V1}","objects":[{object}],"uid":"u-last"}}}}"#
        );
        let (answered, out) = run(text.as_bytes());
        assert_eq!(answered, Ok(Answered::Converted(1)));
        let review: ConversionReview = serde_json::from_slice(&out).unwrap();
        assert_eq!(review.response.unwrap().uid, "u-last");
    }

    #[test]
    fn a_bad_object_after_good_ones_breaks_the_answer_instead_of_cutting_the_list() {
        let body = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
            "request": {"uid": "u", "desiredAPIVersion": V1, "objects": [at("a"), 7]}});
        let (answered, out) = run(&serde_json::to_vec(&body).unwrap());
        let error = answered.unwrap_err();
        assert!(error.contains("after 1 objects were converted"), "{error}");
        assert!(
            serde_json::from_slice::<Value>(&out).is_err(),
            "no complete review was written"
        );
    }

    #[test]
    fn a_string_or_number_past_the_bound_is_refused_before_the_parser_holds_it() {
        for long in [
            format!(r#""{}""#, "u".repeat(MAX_TOKEN + 1)),
            format!(
                r#""{}\"{}""#,
                "u".repeat(MAX_TOKEN / 2),
                "u".repeat(MAX_TOKEN / 2)
            ),
            "1".repeat(MAX_TOKEN + 1),
        ] {
            let body = format!(
                r#"{{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{{"uid":{long},"desiredAPIVersion":"{V1}","objects":[]}}}}"#
            );
            let (answered, _) = run(body.as_bytes());
            assert!(
                matches!(&answered, Ok(Answered::Refused(why)) if why.contains("a string or number over 2 MiB")),
                "{answered:?}"
            );
        }
        // A key too.
        let body = format!(r#"{{"{}":1}}"#, "k".repeat(MAX_TOKEN + 1));
        assert!(matches!(run(body.as_bytes()).0, Ok(Answered::Refused(_))));
        // Just under the bound passes.
        let fits = format!(
            r#"{{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{{"uid":"{}","desiredAPIVersion":"{V1}","objects":[]}}}}"#,
            "u".repeat(MAX_TOKEN)
        );
        assert_eq!(run(fits.as_bytes()).0, Ok(Answered::Converted(0)));
    }

    #[test]
    fn trailing_bytes_after_the_review_break_it() {
        let body = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
            "request": {"uid": "u", "desiredAPIVersion": V1, "objects": [at("a")]}});
        let mut text = serde_json::to_vec(&body).unwrap();
        text.extend_from_slice(b" {}");
        assert!(run(&text).0.is_err());
    }
}
