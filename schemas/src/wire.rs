//! The Kafka wire format shared by the gateway, other producers and the sink.
//!
//! - topic: `<prefix><stream>`, prefix `ingest.` by default;
//! - key: the partition key value (a string, or an int64 in decimal);
//! - value: the record as a JSON object (field order of the schema, nulls omitted, timestamps as
//!   RFC 3339 strings with microseconds and `Z`);
//! - headers (all optional for other producers; the sink computes what is missing):
//!   `content-hash` (64 hex digits), `schema-version` (decimal), `ingest-ts` (epoch microseconds,
//!   decimal).

use serde_json::{Map, Number, Value as Json};

use crate::error::RecordError;
use crate::stream::StreamDef;
use crate::value::{Record, Value, format_timestamp, validate};

pub const DEFAULT_TOPIC_PREFIX: &str = "ingest.";
pub const HEADER_CONTENT_HASH: &str = "content-hash";
pub const HEADER_SCHEMA_VERSION: &str = "schema-version";
pub const HEADER_INGEST_TS: &str = "ingest-ts";

/// The topic of a stream.
pub fn topic_name(prefix: &str, stream: &str) -> String {
    format!("{prefix}{stream}")
}

/// The stream of a topic, if the topic carries the prefix.
pub fn stream_of_topic<'a>(prefix: &str, topic: &'a str) -> Option<&'a str> {
    topic.strip_prefix(prefix)
}

/// Encodes a validated record as the Kafka message value.
pub fn encode_value(def: &StreamDef, record: &Record) -> Vec<u8> {
    let mut obj = Map::new();
    for (field, value) in def.fields.iter().zip(&record.values) {
        if *value != Value::Null {
            obj.insert(field.name.clone(), to_json(value));
        }
    }
    serde_json::to_vec(&Json::Object(obj)).unwrap_or_default()
}

/// Decodes and validates a Kafka message value.
pub fn decode_value(def: &StreamDef, bytes: &[u8]) -> Result<Record, RecordError> {
    let json: Json =
        serde_json::from_slice(bytes).map_err(|e| RecordError::Malformed(e.to_string()))?;
    validate(def, json)
}

/// The JSON form of a value, as the gateway writes it to Kafka.
pub fn to_json(value: &Value) -> Json {
    match value {
        Value::Null => Json::Null,
        Value::Bool(b) => Json::Bool(*b),
        Value::Int(i) => Json::Number((*i).into()),
        Value::Float(f) => Number::from_f64(*f).map_or(Json::Null, Json::Number),
        Value::Str(s) => Json::String(s.clone()),
        Value::Timestamp(t) => Json::String(format_timestamp(*t)),
        Value::List(items) => Json::Array(items.iter().map(to_json).collect()),
        Value::Map(entries) => Json::Object(
            entries
                .iter()
                .map(|(k, v)| (k.clone(), to_json(v)))
                .collect(),
        ),
    }
}

/// Parses a decimal header value.
pub fn parse_decimal_header(bytes: &[u8]) -> Option<i64> {
    std::str::from_utf8(bytes).ok()?.trim().parse().ok()
}
