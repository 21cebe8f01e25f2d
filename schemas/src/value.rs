//! Typed record values and the validation of JSON records against a stream.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Map, Number, Value as Json};

use crate::error::RecordError;
use crate::stream::{FieldType, StreamDef, printable};

/// The string type of values and map keys.
pub type Str = compact_str::CompactString;

/// A validated value, normalized so that equal data has one representation.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// Strings of up to 24 bytes are stored inline, without an allocation.
    Str(Str),
    /// Microseconds since the Unix epoch, UTC.
    Timestamp(i64),
    List(Vec<Value>),
    /// Entries sorted by key, keys unique.
    Map(Vec<(Str, Value)>),
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
    pub fn partition_key(&self, def: &StreamDef) -> Str {
        partition_key(self.values[def.partition_key].as_scalar())
    }
}

/// A partition key from the key field's value: a string, or an int64 in decimal.
pub(crate) fn partition_key(value: Option<Scalar<'_>>) -> Str {
    match value {
        Some(Scalar::Str(s)) => Str::from(s),
        Some(Scalar::Int(i)) => Str::from(itoa::Buffer::new().format(i)),
        _ => Str::default(),
    }
}

/// A scalar value borrowed from where it was read (a record's text) or stored (a [`Value`]):
/// what the scanner produces before, or instead of, building a [`Record`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar<'a> {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'a str),
    /// Microseconds since the Unix epoch, UTC.
    Timestamp(i64),
}

impl Value {
    /// The value as a scalar; `None` for null, lists and maps.
    #[inline(always)]
    pub fn as_scalar(&self) -> Option<Scalar<'_>> {
        Some(match self {
            Value::Bool(b) => Scalar::Bool(*b),
            Value::Int(i) => Scalar::Int(*i),
            Value::Float(f) => Scalar::Float(*f),
            Value::Str(s) => Scalar::Str(s),
            Value::Timestamp(t) => Scalar::Timestamp(*t),
            Value::Null | Value::List(_) | Value::Map(_) => return None,
        })
    }
}

impl From<Scalar<'_>> for Value {
    #[inline(always)]
    fn from(s: Scalar<'_>) -> Value {
        match s {
            Scalar::Bool(b) => Value::Bool(b),
            Scalar::Int(i) => Value::Int(i),
            Scalar::Float(f) => Value::Float(f),
            Scalar::Str(s) => Value::Str(s.into()),
            Scalar::Timestamp(t) => Value::Timestamp(t),
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
        (FieldType::String, Json::String(s)) => Ok(Value::Str(s.into())),
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
            let mut entries: Vec<(Str, Value)> = Vec::with_capacity(obj.len());
            for (k, v) in obj {
                let value = convert(inner, v, &format!("{path}.{}", printable(&k)))?;
                entries.push((k.into(), value));
            }
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(Value::Map(entries))
        }
        (_, json) => Err(mismatch(&json)),
    }
}

/// A timestamp (epoch microseconds) from JSON as a record's timestamp field takes it: an RFC 3339
/// string or an integer of epoch milliseconds (|n| < 10^14) or microseconds.
pub fn parse_timestamp(json: &Json) -> Option<i64> {
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
        None => int_from_f64(n.as_f64()?),
    }
}

/// An int64 from a number written as a float: integral and within ±2^53.
pub(crate) fn int_from_f64(f: f64) -> Option<i64> {
    (f.fract() == 0.0 && f.abs() <= MAX_EXACT_F64_INT).then_some(f as i64)
}

/// A float64 from a JSON number; -0.0 becomes 0.0 so that equal values hash equally.
pub(crate) fn float_from_number(n: &Number) -> Option<f64> {
    float_from_f64(n.as_f64()?)
}

/// A finite float64, -0.0 made 0.0.
pub(crate) fn float_from_f64(f: f64) -> Option<f64> {
    f.is_finite().then_some(if f == 0.0 { 0.0 } else { f })
}

/// A timestamp from an RFC 3339 string.
pub(crate) fn timestamp_from_str(s: &str) -> Option<i64> {
    if let Some(micros) = parse_canonical_timestamp(s.as_bytes()) {
        return in_range(micros);
    }
    chrono_timestamp_from_str(s)
}

/// The general RFC 3339 parser (offsets, lower-case `t`/`z`, leap seconds).
pub(crate) fn chrono_timestamp_from_str(s: &str) -> Option<i64> {
    let t = DateTime::parse_from_rfc3339(s).ok()?;
    in_range(t.timestamp().checked_mul(1_000_000)? + i64::from(t.timestamp_subsec_micros()))
}

/// The common form `YYYY-MM-DDTHH:MM:SS[.fraction]Z` (1 to 9 fraction digits, cut to
/// microseconds), parsed without chrono; `None` sends anything else to the general parser. It
/// gives what chrono gives for the inputs it takes (a property test holds them equal).
fn parse_canonical_timestamp(b: &[u8]) -> Option<i64> {
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' {
        return None;
    }
    if b[16] != b':' || *b.last()? != b'Z' {
        return None;
    }
    let num = |range: std::ops::Range<usize>| {
        b[range].iter().try_fold(0u32, |acc, &c| {
            c.is_ascii_digit().then(|| acc * 10 + u32::from(c - b'0'))
        })
    };
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let fraction = &b[19..b.len() - 1];
    let micros = match fraction {
        [] => 0,
        [b'.', digits @ ..] if (1..=9).contains(&digits.len()) => {
            let mut micros = 0u32;
            for i in 0..6 {
                let d = match digits.get(i) {
                    Some(c) if c.is_ascii_digit() => u32::from(c - b'0'),
                    Some(_) => return None,
                    None => 0,
                };
                micros = micros * 10 + d;
            }
            if !digits[6.min(digits.len())..].iter().all(u8::is_ascii_digit) {
                return None;
            }
            micros
        }
        _ => return None,
    };
    if !(1..=12).contains(&month) || day == 0 || day > days_in_month(year, month) {
        return None;
    }
    if hour > 23 || minute > 59 || second > 59 {
        return None; // leap seconds go to chrono
    }
    let days = days_from_civil(i64::from(year), month, day);
    let seconds = days * 86_400 + i64::from(hour * 3600 + minute * 60 + second);
    Some(seconds * 1_000_000 + i64::from(micros))
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        2 if year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400)) => {
            29
        }
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar (H. Hinnant's
/// `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day counted from 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A timestamp from an integral number of epoch milliseconds or microseconds.
pub(crate) fn timestamp_from_int(n: &Number) -> Option<i64> {
    timestamp_from_i64(int_from_number(n)?)
}

/// A timestamp from epoch milliseconds (|i| < 10^14) or microseconds.
pub(crate) fn timestamp_from_i64(i: i64) -> Option<i64> {
    in_range(if i.unsigned_abs() < EPOCH_MS_LIMIT.unsigned_abs() {
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
    let mut out = Vec::with_capacity(27);
    write_timestamp(&mut out, micros);
    String::from_utf8(out).unwrap_or_default()
}

/// Appends [`format_timestamp`]'s text to `out` (the encoders' hot path: no allocation).
pub fn write_timestamp(out: &mut Vec<u8>, micros: i64) {
    let (year, month, day) = civil_from_days(micros.div_euclid(86_400_000_000));
    if !(0..=9999).contains(&year) {
        // Outside what validation accepts; chrono writes the extended-year form.
        let text = DateTime::<Utc>::from_timestamp_micros(micros)
            .map(|t| t.to_rfc3339_opts(SecondsFormat::Micros, true))
            .unwrap_or_default();
        out.extend_from_slice(text.as_bytes());
        return;
    }
    let of_day = micros.rem_euclid(86_400_000_000);
    let (seconds, fraction) = (of_day / 1_000_000, of_day % 1_000_000);
    let mut text = *b"0000-00-00T00:00:00.000000Z";
    let mut put = |end: usize, width: usize, mut value: i64| {
        for slot in text[end - width..end].iter_mut().rev() {
            *slot = b'0' + (value % 10) as u8;
            value /= 10;
        }
    };
    put(4, 4, year);
    put(7, 2, i64::from(month));
    put(10, 2, i64::from(day));
    put(13, 2, seconds / 3600);
    put(16, 2, seconds / 60 % 60);
    put(19, 2, seconds % 60);
    put(26, 6, fraction);
    out.extend_from_slice(&text);
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
