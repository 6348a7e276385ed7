//! An At of a ConversionReview read in one pass as the parts the conversion moves, every other
//! value kept as the JSON text it came as; converted as the model in `conversion/tests.rs`,
//! the definition, does. See docs/src/design/decisions.md, "Conversion, streamed".

use super::rules::{envelope, respelled, ConversionError, Envelope, CARRIED_ANNOTATION};
use super::rules::{ANNOTATION, NO_IMAGE, POD_FIELDS, V1, V1ALPHA1, V1ALPHA1_IMAGE, V1_ONLY};
use crate::serving::bounded::Budget;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;
use std::io::{self, Write};

/// A member's value: an object split into its members, or JSON text, as it came in the
/// object's text or written anew.
#[derive(Debug, PartialEq)]
pub enum Part<'a> {
    Object(Members<'a>),
    Raw(Cow<'a, str>),
}

/// An object's members in the order they came; a key may come twice (the last one counts).
pub type Members<'a> = Vec<(Cow<'a, str>, Part<'a>)>;

/// One element of a review's `objects`: an object's parts, or what else it is.
#[derive(Debug, PartialEq)]
pub enum Element<'a> {
    Object(Members<'a>),
    /// Not an object, but `null`, a boolean, a number, a string or an array.
    Not(&'static str),
}

/// What the conversion holds of a member: which of its members are split in turn.
#[derive(Clone, Copy)]
enum Plan {
    Top,
    Metadata,
    Spec,
    /// Split into members, each kept as text (`annotations`, `template`, `status`).
    Flat,
    Text,
}

impl Plan {
    fn of(self, key: &str) -> Plan {
        match (self, key) {
            (Plan::Top, "metadata") => Plan::Metadata,
            (Plan::Top, "spec") => Plan::Spec,
            (Plan::Top, "status") | (Plan::Metadata, "annotations") | (Plan::Spec, "template") => {
                Plan::Flat
            }
            _ => Plan::Text,
        }
    }
}

/// What one member costs beside its text: its entry (56 bytes) with the spare room of a vector
/// that doubles, and the key's and the text's allocations.
const ENTRY: usize = 128;

/// One element of `objects` from its text, what it keeps charged to `budget`: the parts borrow
/// the text.
pub fn read<'a>(text: &'a [u8], budget: &Budget) -> serde_json::Result<Element<'a>> {
    let mut deserializer = serde_json::Deserializer::from_slice(text);
    let element = de::Deserializer::deserialize_any(&mut deserializer, TopVisitor(budget))?;
    deserializer.end()?;
    Ok(element)
}

struct TopVisitor<'b>(&'b Budget);

impl<'de> Visitor<'de> for TopVisitor<'_> {
    type Value = Element<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Element<'de>, A::Error> {
        members(map, Plan::Top, self.0).map(Element::Object)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Element<'de>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Element::Not("an array"))
    }
    fn visit_unit<E>(self) -> Result<Element<'de>, E> {
        Ok(Element::Not("null"))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Element<'de>, E> {
        Ok(Element::Not("a boolean"))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Element<'de>, E> {
        Ok(Element::Not("a number"))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Element<'de>, E> {
        Ok(Element::Not("a number"))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Element<'de>, E> {
        Ok(Element::Not("a number"))
    }
    fn visit_str<E>(self, _: &str) -> Result<Element<'de>, E> {
        Ok(Element::Not("a string"))
    }
}

fn members<'de, A: MapAccess<'de>>(
    mut map: A,
    plan: Plan,
    budget: &Budget,
) -> Result<Members<'de>, A::Error> {
    let mut members = Vec::new();
    while let Some(key) = map.next_key_seed(Key)? {
        let part = map.next_value_seed(PartSeed(plan.of(&key), budget))?;
        let text = match &part {
            Part::Raw(text) => text.len(),
            Part::Object(_) => 0,
        };
        budget.charge(ENTRY + key.len() + text)?;
        members.push((key, part));
    }
    Ok(members)
}

/// A key, borrowed from the text unless it has escapes.
struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Cow<'de, str>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Cow<'de, str>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key {
    type Value = Cow<'de, str>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Borrowed(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v.to_owned()))
    }
}

struct PartSeed<'b>(Plan, &'b Budget);

impl<'de> DeserializeSeed<'de> for PartSeed<'_> {
    type Value = Part<'de>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Part<'de>, D::Error> {
        match self.0 {
            Plan::Text => {
                let raw: &'de RawValue = serde::Deserialize::deserialize(d)?;
                Ok(Part::Raw(Cow::Borrowed(raw.get())))
            }
            plan => d.deserialize_any(PartVisitor(plan, self.1)),
        }
    }
}

/// A member to split when it is an object; anything else is kept as JSON text.
struct PartVisitor<'b>(Plan, &'b Budget);

impl PartVisitor<'_> {
    fn text<'a, T: serde::Serialize, E: de::Error>(value: T) -> Result<Part<'a>, E> {
        serde_json::to_string(&value)
            .map(|text| Part::Raw(text.into()))
            .map_err(E::custom)
    }
}

impl<'de> Visitor<'de> for PartVisitor<'_> {
    type Value = Part<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Part<'de>, A::Error> {
        let plan = match self.0 {
            Plan::Flat => Plan::Text,
            plan => plan,
        };
        members(map, plan, self.1).map(Part::Object)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Part<'de>, A::Error> {
        let mut text = String::from("[");
        while let Some(element) = seq.next_element::<&RawValue>()? {
            self.1.charge(element.get().len() + 1)?;
            if text.len() > 1 {
                text.push(',');
            }
            text.push_str(element.get());
        }
        text.push(']');
        Ok(Part::Raw(text.into()))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Part<'de>, E> {
        Ok(Part::Raw("null".into()))
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Part<'de>, E> {
        Self::text(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Part<'de>, E> {
        Self::text(v)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Part<'de>, E> {
        Self::text(v)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Part<'de>, E> {
        Self::text(v)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Part<'de>, E> {
        Self::text(v)
    }
}

/// The last member named `key`.
fn get<'m, 'a>(members: &'m Members<'a>, key: &str) -> Option<&'m Part<'a>> {
    members
        .iter()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(_, part)| part)
}

fn get_mut<'m, 'a>(members: &'m mut Members<'a>, key: &str) -> Option<&'m mut Part<'a>> {
    members
        .iter_mut()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(_, part)| part)
}

/// Removes every member named `key`, giving the last one's value. Linear in the members
/// however often the key comes (a made-up object may give one key a hundred thousand times).
fn remove<'a>(members: &mut Members<'a>, key: &str) -> Option<Part<'a>> {
    let at = members.iter().rposition(|(k, _)| k == key)?;
    let (_, last) = members.remove(at);
    members.retain(|(k, _)| k != key);
    Some(last)
}

/// Sets `key` to `part`, in place of every member of that name.
fn insert<'a>(members: &mut Members<'a>, key: &'static str, part: Part<'a>) {
    remove(members, key);
    members.push((Cow::Borrowed(key), part));
}

fn string(text: &str) -> Part<'static> {
    Part::Raw(serde_json::to_string(text).unwrap_or_default().into())
}

/// The string `part` holds, if it is one.
fn as_string(part: &Part) -> Option<String> {
    match part {
        Part::Raw(text) if text.starts_with('"') => serde_json::from_str(text).ok(),
        _ => None,
    }
}

/// `element` (the `index`th of a request) as `desired` (`V1ALPHA1` or `V1`); what it decodes
/// (pod metadata moved into the carried annotation) is charged to `budget`.
pub fn convert<'a>(
    index: usize,
    element: Element<'a>,
    desired: &str,
    budget: &Budget,
) -> Result<Members<'a>, ConversionError> {
    if desired != V1 && desired != V1ALPHA1 {
        return Err(ConversionError::UnknownTarget(desired.to_owned()));
    }
    let mut object = match element {
        Element::Object(object) => object,
        Element::Not(found) => return Err(ConversionError::NotAnObject { index, found }),
    };
    let version = get(&object, "apiVersion").and_then(as_string);
    match version.as_deref().unwrap_or_default() {
        v if v == desired => {}
        V1ALPHA1 => up(&mut object),
        V1 => down(&mut object, budget).map_err(|why| ConversionError::TooLarge { index, why })?,
        other => {
            return Err(ConversionError::UnknownSource {
                index,
                name: name_of(&object),
                version: other.to_owned(),
            })
        }
    }
    insert(&mut object, "apiVersion", string(desired));
    Ok(object)
}

/// `v1alpha1` to `v1`, as the model's `up`.
fn up(object: &mut Members) {
    let Some(Part::Object(spec)) = get_mut(object, "spec") else {
        return phase(object, true);
    };
    let mut template = Members::new();
    for field in POD_FIELDS {
        if let Some(value) = remove(spec, field) {
            template.push((Cow::Borrowed(field), value));
        }
    }
    let envelope = carried(object).as_deref().and_then(envelope);
    if let Some(Envelope {
        fields,
        no_image,
        annotation,
    }) = envelope
    {
        for (field, value) in fields {
            let text = serde_json::to_string(&value).unwrap_or_default();
            template.push((Cow::Borrowed(field), Part::Raw(text.into())));
        }
        let image = get(&template, "image");
        if no_image && image.is_none_or(|i| as_string(i).is_some_and(|i| i == V1ALPHA1_IMAGE)) {
            remove(&mut template, "image");
        }
        set_annotation(object, annotation);
    }
    if let Some(Part::Object(spec)) = get_mut(object, "spec") {
        insert(spec, "template", Part::Object(template));
    }
    phase(object, true);
}

/// `v1` to `v1alpha1`, as the model's `down`.
fn down(object: &mut Members, budget: &Budget) -> Result<(), String> {
    let mut moved = Vec::new();
    if let Some(Part::Object(spec)) = get_mut(object, "spec") {
        if let Some(Part::Object(mut template)) = remove(spec, "template") {
            for (field, key) in V1_ONLY {
                if let Some(value) = remove(&mut template, field) {
                    moved.push((key, value));
                }
            }
            let null = |part: &Part| matches!(part, Part::Raw(text) if text.trim() == "null");
            if get(&template, "image").is_none_or(null) {
                moved.push((NO_IMAGE, Part::Raw("true".into())));
            }
            // Appended: a field the spec has too is read from the template, as `extend` has it.
            spec.extend(template);
        }
    }
    let annotation = carried(object);
    let wrap = !moved.is_empty() || annotation.as_deref().and_then(envelope).is_some();
    if wrap {
        let mut carried = serde_json::Map::new();
        for (key, value) in moved {
            // Read as JSON, within the object's budget, to be written as the model's `down`
            // writes it (canonical, as `envelope` wants it back).
            let text = match value {
                Part::Raw(text) => text,
                Part::Object(members) => Cow::Owned(text_of(&members)),
            };
            let mut deserializer = serde_json::Deserializer::from_str(&text);
            let value = budget
                .value()
                .deserialize(&mut deserializer)
                .map_err(|e| e.to_string())?;
            carried.insert(key.into(), value);
        }
        if let Some(annotation) = annotation {
            carried.insert(ANNOTATION.into(), serde_json::Value::String(annotation));
        }
        let text = serde_json::to_string(&serde_json::Value::Object(carried)).unwrap_or_default();
        set_annotation(object, Some(text));
    }
    phase(object, false);
    Ok(())
}

/// Respells `status.phase` as the model's `phase` does.
fn phase(object: &mut Members, to_v1: bool) {
    let Some(Part::Object(status)) = get_mut(object, "status") else {
        return;
    };
    let Some(phase) = get_mut(status, "phase") else {
        return;
    };
    let Some(spelled) = as_string(phase) else {
        return;
    };
    if let Some(to) = respelled(&spelled, to_v1) {
        *phase = string(to);
    }
}

/// The value of the carried annotation, if the object has one.
fn carried(object: &Members) -> Option<String> {
    let Some(Part::Object(metadata)) = get(object, "metadata") else {
        return None;
    };
    let Some(Part::Object(annotations)) = get(metadata, "annotations") else {
        return None;
    };
    get(annotations, CARRIED_ANNOTATION).and_then(as_string)
}

/// Sets the carried annotation to `value`, or removes it, as the model's `set_annotation`.
fn set_annotation(object: &mut Members, value: Option<String>) {
    if get(object, "metadata").is_none() {
        object.push((Cow::Borrowed("metadata"), Part::Object(Members::new())));
    }
    let Some(Part::Object(metadata)) = get_mut(object, "metadata") else {
        return;
    };
    match value {
        Some(value) => {
            if !matches!(get(metadata, "annotations"), Some(Part::Object(_))) {
                insert(metadata, "annotations", Part::Object(Members::new()));
            }
            if let Some(Part::Object(annotations)) = get_mut(metadata, "annotations") {
                insert(annotations, CARRIED_ANNOTATION, string(&value));
            }
        }
        None => {
            if let Some(Part::Object(annotations)) = get_mut(metadata, "annotations") {
                remove(annotations, CARRIED_ANNOTATION);
                if annotations.is_empty() {
                    remove(metadata, "annotations");
                }
            }
        }
    }
}

fn name_of(object: &Members) -> String {
    let field = |f: &str| match get(object, "metadata") {
        Some(Part::Object(metadata)) => get(metadata, f).and_then(as_string),
        _ => None,
    };
    match (field("namespace"), field("name")) {
        (Some(ns), Some(name)) => format!("{ns}/{name}"),
        (None, Some(name)) => name,
        _ => "no name".to_owned(),
    }
}

/// Writes an object's members as JSON.
pub fn write(members: &Members, out: &mut impl Write) -> io::Result<()> {
    out.write_all(b"{")?;
    for (i, (key, part)) in members.iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        serde_json::to_writer(&mut *out, key.as_ref()).map_err(io::Error::from)?;
        out.write_all(b":")?;
        match part {
            Part::Raw(text) => out.write_all(text.as_bytes())?,
            Part::Object(members) => write(members, out)?,
        }
    }
    out.write_all(b"}")
}

/// An object's members as JSON text.
pub(super) fn text_of(members: &Members) -> String {
    let mut out = Vec::new();
    let _ = write(members, &mut out);
    String::from_utf8(out).unwrap_or_default()
}
