//! Decoding a JSON record straight into a typed [`Record`], without building a `serde_json::Value`
//! tree first: the hot path of the gateway, the agent and the sink. It follows the rules of
//! [`crate::value::validate`] exactly, error messages included (a property test holds the two
//! paths equal).

use std::cell::RefCell;
use std::fmt;

use serde::Deserialize;
use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value as Json;

use crate::error::RecordError;
use crate::stream::{FieldType, StreamDef, printable};
use crate::value::{
    Record, Str, Value, describe, expected, timestamp_from_int, timestamp_from_str,
};

/// Parses and validates one JSON record (an NDJSON line or an array element): by the scanner
/// ([`crate::scan`]) when the record has its common shape, otherwise by serde_json.
pub fn decode_record(def: &StreamDef, bytes: &[u8]) -> Result<Record, RecordError> {
    match crate::scan::decode(def, bytes) {
        Some(record) => Ok(record),
        None => decode_record_serde(def, bytes),
    }
}

/// The serde path of [`decode_record`]: any input, with the precise error.
pub(crate) fn decode_record_serde(def: &StreamDef, bytes: &[u8]) -> Result<Record, RecordError> {
    let failure = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let result = RecordSeed {
        def,
        failure: &failure,
    }
    .deserialize(&mut de)
    .and_then(|record| de.end().map(|()| record));
    match result {
        Ok(record) => Ok(record),
        Err(e) => Err(match failure.into_inner() {
            // A validation error counts only if the whole input is well-formed JSON; otherwise
            // the record is malformed, as the tree-building path would say.
            Some(invalid) => match serde_json::from_slice::<de::IgnoredAny>(bytes) {
                Ok(_) => invalid,
                Err(syntax) => RecordError::Malformed(syntax.to_string()),
            },
            None => RecordError::Malformed(e.to_string()),
        }),
    }
}

/// Where a visitor leaves the precise error before aborting the parse with a generic one.
type Failure<'a> = &'a RefCell<Option<RecordError>>;

fn fail<E: de::Error>(failure: Failure<'_>, e: RecordError) -> E {
    let text = e.to_string();
    failure.replace(Some(e));
    E::custom(text)
}

struct RecordSeed<'a> {
    def: &'a StreamDef,
    failure: Failure<'a>,
}

impl<'de> DeserializeSeed<'de> for RecordSeed<'_> {
    type Value = Record;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Record, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for RecordSeed<'_> {
    type Value = Record;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Record, A::Error> {
        let mut values = vec![Value::Null; self.def.fields.len()];
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            let Some(i) = self.def.field_index(&key) else {
                return Err(fail(
                    self.failure,
                    RecordError::Unknown {
                        field: printable(&key),
                    },
                ));
            };
            values[i] = map.next_value_seed(FieldSeed {
                ty: &self.def.fields[i].ty,
                path: FieldPath::Field(&key),
                failure: self.failure,
            })?;
        }
        for (field, value) in self.def.fields.iter().zip(&values) {
            if field.required && *value == Value::Null {
                return Err(fail(
                    self.failure,
                    RecordError::Missing {
                        field: field.name.clone(),
                    },
                ));
            }
        }
        Ok(Record { values })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Record, A::Error> {
        let json = Json::deserialize(SeqAccessDeserializer::new(seq))?;
        Err(self.not_an_object(&json))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Record, E> {
        Err(self.not_an_object(&Json::String(v.to_owned())))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Record, E> {
        Err(self.not_an_object(&Json::Bool(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Record, E> {
        Err(self.not_an_object(&Json::from(v)))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Record, E> {
        Err(self.not_an_object(&Json::from(v)))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Record, E> {
        Err(self.not_an_object(&Json::from(v)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Record, E> {
        Err(self.not_an_object(&Json::Null))
    }
}

impl RecordSeed<'_> {
    fn not_an_object<E: de::Error>(&self, json: &Json) -> E {
        fail(
            self.failure,
            RecordError::NotAnObject {
                got: describe(json),
            },
        )
    }
}

/// Where a value sits in the record, rendered only for an error message (`field`,
/// `field[3]`, `field.key`).
#[derive(Clone, Copy)]
enum FieldPath<'a> {
    Field(&'a str),
    Index(&'a str, usize),
    Key(&'a str, &'a str),
}

impl fmt::Display for FieldPath<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FieldPath::Field(name) => f.write_str(name),
            FieldPath::Index(name, i) => write!(f, "{name}[{i}]"),
            FieldPath::Key(name, key) => write!(f, "{name}.{}", printable(key)),
        }
    }
}

impl<'a> FieldPath<'a> {
    /// The field a nested value belongs to (lists and maps hold scalars only).
    fn field(self) -> &'a str {
        match self {
            FieldPath::Field(name) | FieldPath::Index(name, _) | FieldPath::Key(name, _) => name,
        }
    }
}

/// Decodes one field value of a known type.
struct FieldSeed<'a> {
    ty: &'a FieldType,
    path: FieldPath<'a>,
    failure: Failure<'a>,
}

impl FieldSeed<'_> {
    fn mismatch<E: de::Error>(&self, got: &Json) -> E {
        fail(
            self.failure,
            RecordError::Type {
                field: self.path.to_string(),
                expected: expected(self.ty),
                got: describe(got),
            },
        )
    }

    fn number<E: de::Error>(&self, n: serde_json::Number) -> Result<Value, E> {
        let value = match self.ty {
            FieldType::Int64 => crate::value::int_from_number(&n).map(Value::Int),
            FieldType::Float64 => crate::value::float_from_number(&n).map(Value::Float),
            FieldType::Timestamp => timestamp_from_int(&n).map(Value::Timestamp),
            _ => None,
        };
        value.ok_or_else(|| self.mismatch(&Json::Number(n)))
    }
}

impl<'de> DeserializeSeed<'de> for FieldSeed<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FieldSeed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a value of type {}", self.ty)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        match self.ty {
            FieldType::Bool => Ok(Value::Bool(v)),
            _ => Err(self.mismatch(&Json::Bool(v))),
        }
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        self.number(v.into())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        self.number(v.into())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        match serde_json::Number::from_f64(v) {
            Some(n) => self.number(n),
            None => Err(self.mismatch(&Json::Null)),
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        match self.ty {
            FieldType::String => Ok(Value::Str(v.into())),
            FieldType::Timestamp => timestamp_from_str(v)
                .map(Value::Timestamp)
                .ok_or_else(|| self.mismatch(&Json::String(v.to_owned()))),
            _ => Err(self.mismatch(&Json::String(v.to_owned()))),
        }
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        match self.ty {
            FieldType::String => Ok(Value::Str(v.into())),
            _ => self.visit_str(&v),
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let FieldType::List(inner) = self.ty else {
            let json = Json::deserialize(SeqAccessDeserializer::new(seq))?;
            return Err(self.mismatch(&json));
        };
        let mut items = Vec::new();
        loop {
            let seed = FieldSeed {
                ty: inner,
                path: FieldPath::Index(self.path.field(), items.len()),
                failure: self.failure,
            };
            match seq.next_element_seed(seed)? {
                Some(v) => items.push(v),
                None => break,
            }
        }
        Ok(Value::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let FieldType::Map(inner) = self.ty else {
            let json = Json::deserialize(MapAccessDeserializer::new(map))?;
            return Err(self.mismatch(&json));
        };
        let mut entries: Vec<(Str, Value)> = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(FieldSeed {
                ty: inner,
                path: FieldPath::Key(self.path.field(), &key),
                failure: self.failure,
            })?;
            // A repeated key keeps its last value, as a parsed JSON object would.
            match entries.iter_mut().find(|(k, _)| *k == key) {
                Some(slot) => slot.1 = value,
                None => entries.push((key.into(), value)),
            }
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Value::Map(entries))
    }
}
