//! JSON from callers nobody vouches for, decoded within a memory bound: every value is charged
//! what it costs in memory as it is built, and decoding fails the moment the budget is spent,
//! before the memory is taken. Pure. See docs/src/operating/security.md, "Hostile callers".

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::cell::Cell;
use std::fmt;

/// What one node is charged: a `Value` (32 bytes) and its share of the vector or map holding
/// it (a `BTreeMap` entry has more around it than a vector's slot).
const NODE: usize = 64;

/// How many bytes a value decoded under this budget may still take.
#[derive(Debug)]
pub struct Budget {
    left: Cell<usize>,
    limit: usize,
}

impl Budget {
    /// A budget of `limit` bytes of decoded memory.
    pub fn new(limit: usize) -> Self {
        Budget {
            left: Cell::new(limit),
            limit,
        }
    }

    /// Charges `bytes` decoded within this budget (by a [`Bounded`] seed, or by something else).
    pub fn charge<E: de::Error>(&self, bytes: usize) -> Result<(), E> {
        match self.left.get().checked_sub(bytes) {
            Some(left) => {
                self.left.set(left);
                Ok(())
            }
            None => Err(E::custom(format_args!(
                "the value takes more than {} KiB to decode, more than any At needs",
                self.limit >> 10
            ))),
        }
    }

    /// A seed that decodes one value within what is left of this budget.
    pub fn value(&self) -> Bounded<'_> {
        Bounded(self)
    }
}

/// Decodes one `Value`, charging its budget as it goes.
#[derive(Clone, Copy)]
pub struct Bounded<'a>(&'a Budget);

impl<'de> DeserializeSeed<'de> for Bounded<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Bounded<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        self.0.charge(NODE)?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        self.0.charge(NODE)?;
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        self.0.charge(NODE)?;
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        self.0.charge(NODE)?;
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.0.charge(NODE + v.len())?;
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        self.0.charge(NODE + v.len())?;
        Ok(Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        self.0.charge(NODE)?;
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        self.visit_unit()
    }

    fn visit_some<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.0.charge(NODE)?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.0.charge(NODE)?;
        let mut fields = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            self.0.charge(key.len())?;
            let value = map.next_value_seed(self)?;
            fields.insert(key, value);
        }
        Ok(Value::Object(fields))
    }
}

/// A JSON object decoded within `budget`: anything else is refused at its first byte, before
/// it is decoded.
pub struct Object<'a>(pub &'a Budget);

impl<'de> DeserializeSeed<'de> for Object<'_> {
    type Value = Map<String, Value>;

    fn deserialize<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Object<'_> {
    type Value = Map<String, Value>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        match Bounded(self.0).visit_map(map)? {
            Value::Object(fields) => Ok(fields),
            _ => unreachable!("visit_map builds an object"),
        }
    }
}

/// A JSON object decoded within `budget`, or `None` for `null`: what an AdmissionReview's
/// `object`, `oldObject`, or an object's `spec` and `status` may be. Anything else is refused at
/// its first byte.
pub fn object_or_null<'de, D: de::Deserializer<'de>>(
    deserializer: D,
    budget: &Budget,
) -> Result<Option<Map<String, Value>>, D::Error> {
    struct ObjectOrNull<'a>(&'a Budget);
    impl<'de> Visitor<'de> for ObjectOrNull<'_> {
        type Value = Option<Map<String, Value>>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an object or null")
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            Object(self.0).deserialize(d).map(Some)
        }
    }
    deserializer.deserialize_option(ObjectOrNull(budget))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(text: &str, limit: usize) -> Result<Value, String> {
        let budget = Budget::new(limit);
        let mut deserializer = serde_json::Deserializer::from_str(text);
        budget
            .value()
            .deserialize(&mut deserializer)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn what_fits_decodes_as_serde_json_does() {
        let text = r#"{"a": [1, -2, 3.5, "x", null, true, {"b": {}}], "c": "d"}"#;
        let expected: Value = serde_json::from_str(text).unwrap();
        assert_eq!(decode(text, 1 << 20).unwrap(), expected);
    }

    #[test]
    fn a_long_array_of_small_values_is_refused_once_past_the_budget() {
        // 2 bytes of text an element, 64 charged: a 1 MiB budget holds about 16,000.
        let text = format!("[{}0]", "0,".repeat(100_000));
        let refused = decode(&text, 1 << 20).unwrap_err();
        assert!(
            refused.contains("more than 1024 KiB to decode, more than any At needs"),
            "{refused}"
        );
        let fits = format!("[{}0]", "0,".repeat(10_000));
        assert_eq!(
            decode(&fits, 1 << 20).unwrap().as_array().unwrap().len(),
            10_001
        );
    }

    #[test]
    fn strings_and_keys_are_charged_their_length() {
        let long = format!(r#"{{"{}": "{}"}}"#, "k".repeat(600), "v".repeat(600));
        assert!(decode(&long, 1000).is_err());
        assert!(decode(&long, 1400).is_ok());
    }

    #[test]
    fn an_object_seed_refuses_anything_else_at_once() {
        let budget = Budget::new(1 << 20);
        for text in ["[1]", "0", "\"spec\"", "null"] {
            let mut deserializer = serde_json::Deserializer::from_str(text);
            assert!(
                Object(&budget).deserialize(&mut deserializer).is_err(),
                "{text}"
            );
        }
        let mut deserializer = serde_json::Deserializer::from_str(r#"{"a": 1}"#);
        let object = Object(&budget).deserialize(&mut deserializer).unwrap();
        assert_eq!(object["a"], 1);
    }
}
