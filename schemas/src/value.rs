//! Typed record values and the validation of JSON records against a stream.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Map, Number, Value as Json};

use crate::error::RecordError;
use crate::stream::{FieldType, StreamDef, printable};

/// A validated value, normalized so that equal data has one representation.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    /// Microseconds since the Unix epoch, UTC.
    Timestamp(i64),
    List(Vec<Value>),
    /// Entries sorted by key, keys unique.
    Map(Vec<(String, Value)>),
}

/// A record validated against a stream: one value per field, in the stream's field order.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub values: Vec<Value>,
}

impl Record {
    /// The event time in microseconds.
    pub fn event_time(&self, def: &StreamDef) -> i64 {
        match self.values[def.event_time] {
            Value::Timestamp(t) => t,
            _ => 0,
        }
    }

    /// The partition key as bytes (a string, or an int64 in decimal).
    pub fn partition_key(&self, def: &StreamDef) -> String {
        match &self.values[def.partition_key] {
            Value::Str(s) => s.clone(),
            Value::Int(i) => i.to_string(),
            _ => String::new(),
        }
    }
}

/// Smallest and largest accepted timestamps: years 0001 to 9999, so every value has an
/// RFC 3339 form.
const MIN_TS_MICROS: i64 = -62_135_596_800_000_000;
const MAX_TS_MICROS: i64 = 253_402_300_799_999_999;
/// Integer timestamps below this magnitude are epoch milliseconds (before the year 5138);
/// at or above it they are epoch microseconds (after March 1973).
pub const EPOCH_MS_LIMIT: i64 = 100_000_000_000_000;
/// Integers beyond this cannot pass through an f64 exactly.
const MAX_EXACT_F64_INT: f64 = 9_007_199_254_740_992.0;

/// Validates a decoded JSON record against a stream and normalizes it.
///
/// Rules: the record is an object; unknown fields are rejected; required fields must be present
/// and not null; an int64 accepts integral numbers (`1`, `1.0`, `1e3`) within range; a float64
/// accepts any number; a timestamp accepts an RFC 3339 string or an integer of epoch
/// milliseconds (|n| < 10^14) or microseconds (otherwise), between the years 1 and 9999.
pub fn validate(def: &StreamDef, record: Json) -> Result<Record, RecordError> {
    let obj = match record {
        Json::Object(obj) => obj,
        other => {
            return Err(RecordError::NotAnObject {
                got: describe(&other),
            });
        }
    };
    validate_object(def, obj)
}

fn validate_object(def: &StreamDef, obj: Map<String, Json>) -> Result<Record, RecordError> {
    let mut values = vec![Value::Null; def.fields.len()];
    for (key, json) in obj {
        let Some(i) = def.field_index(&key) else {
            return Err(RecordError::Unknown {
                field: printable(&key),
            });
        };
        values[i] = convert(&def.fields[i].ty, json, &key)?;
    }
    for (field, value) in def.fields.iter().zip(&values) {
        if field.required && *value == Value::Null {
            return Err(RecordError::Missing {
                field: field.name.clone(),
            });
        }
    }
    Ok(Record { values })
}

fn convert(ty: &FieldType, json: Json, path: &str) -> Result<Value, RecordError> {
    let mismatch = |json: &Json| RecordError::Type {
        field: path.to_owned(),
        expected: expected(ty),
        got: describe(json),
    };
    match (ty, json) {
        (_, Json::Null) => Ok(Value::Null),
        (FieldType::String, Json::String(s)) => Ok(Value::Str(s)),
        (FieldType::Bool, Json::Bool(b)) => Ok(Value::Bool(b)),
        (FieldType::Int64, Json::Number(n)) => int_from_number(&n)
            .map(Value::Int)
            .ok_or_else(|| mismatch(&Json::Number(n))),
        (FieldType::Float64, Json::Number(n)) => float_from_number(&n)
            .map(Value::Float)
            .ok_or_else(|| mismatch(&Json::Number(n))),
        (FieldType::Timestamp, json) => parse_timestamp(&json)
            .map(Value::Timestamp)
            .ok_or_else(|| mismatch(&json)),
        (FieldType::List(inner), Json::Array(items)) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match item {
                Json::Null => Ok(Value::Null),
                item => convert(inner, item, &format!("{path}[{i}]")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Value::List),
        (FieldType::Map(inner), Json::Object(obj)) => {
            // Keys of a JSON object are unique after parsing; sort them so that key order
            // never matters (serde_json may be built with `preserve_order`).
            let mut entries = Vec::with_capacity(obj.len());
            for (k, v) in obj {
                let value = convert(inner, v, &format!("{path}.{}", printable(&k)))?;
                entries.push((k, value));
            }
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(Value::Map(entries))
        }
        (_, json) => Err(mismatch(&json)),
    }
}

fn parse_timestamp(json: &Json) -> Option<i64> {
    match json {
        Json::String(s) => timestamp_from_str(s),
        Json::Number(n) => timestamp_from_int(n),
        _ => None,
    }
}

/// An int64 from a JSON number: any i64, or an integral float up to ±2^53.
pub(crate) fn int_from_number(n: &Number) -> Option<i64> {
    match n.as_i64() {
        Some(i) => Some(i),
        None => {
            let f = n.as_f64()?;
            (f.fract() == 0.0 && f.abs() <= MAX_EXACT_F64_INT).then_some(f as i64)
        }
    }
}

/// A float64 from a JSON number; -0.0 becomes 0.0 so that equal values hash equally.
pub(crate) fn float_from_number(n: &Number) -> Option<f64> {
    let f = n.as_f64()?;
    f.is_finite().then_some(if f == 0.0 { 0.0 } else { f })
}

/// A timestamp from an RFC 3339 string.
pub(crate) fn timestamp_from_str(s: &str) -> Option<i64> {
    let t = DateTime::parse_from_rfc3339(s).ok()?;
    in_range(t.timestamp().checked_mul(1_000_000)? + i64::from(t.timestamp_subsec_micros()))
}

/// A timestamp from an integral number of epoch milliseconds or microseconds.
pub(crate) fn timestamp_from_int(n: &Number) -> Option<i64> {
    let i = int_from_number(n)?;
    in_range(if i.abs() < EPOCH_MS_LIMIT {
        i * 1000
    } else {
        i
    })
}

fn in_range(micros: i64) -> Option<i64> {
    (MIN_TS_MICROS..=MAX_TS_MICROS)
        .contains(&micros)
        .then_some(micros)
}

/// Formats epoch microseconds as RFC 3339 with microsecond precision, `Z` suffix.
pub fn format_timestamp(micros: i64) -> String {
    DateTime::<Utc>::from_timestamp_micros(micros)
        .map(|t| t.to_rfc3339_opts(SecondsFormat::Micros, true))
        .unwrap_or_default()
}

pub(crate) fn expected(ty: &FieldType) -> String {
    match ty {
        FieldType::Timestamp => {
            "timestamp (RFC 3339 string or integer epoch ms/us, years 1-9999)".into()
        }
        FieldType::Int64 => "int64 (an integral number within ±2^63)".into(),
        FieldType::List(t) => format!("list<{t}> (a JSON array)"),
        FieldType::Map(t) => format!("map<{t}> (a JSON object)"),
        other => other.to_string(),
    }
}

/// A short description of a JSON value: its kind and a bounded excerpt.
pub(crate) fn describe(json: &Json) -> String {
    match json {
        Json::Null => "null".into(),
        Json::Bool(b) => format!("bool {b}"),
        Json::Number(n) => format!("number {}", printable(&n.to_string())),
        Json::String(s) => format!("string \"{}\"", printable(s)),
        Json::Array(a) => format!("array of {} items", a.len()),
        Json::Object(o) => format!("object with {} keys", o.len()),
    }
}
