//! The Kafka wire format shared by the gateway, other producers and the sink.
//!
//! - topic: `<prefix><stream>`, prefix `ingest.` by default;
//! - key: the partition key value (a string, or an int64 in decimal);
//! - value: the record as a JSON object (field order of the schema, nulls omitted, timestamps as
//!   RFC 3339 strings with microseconds and `Z`);
//! - headers (all optional for other producers; the sink computes what is missing):
//!   `content-hash` (64 hex digits), `schema-version` (decimal), `ingest-ts` (epoch microseconds,
//!   decimal).

use serde_json::Number;

use crate::error::RecordError;
use crate::stream::StreamDef;
use crate::value::{Record, Value, write_timestamp};

pub const DEFAULT_TOPIC_PREFIX: &str = "ingest.";
pub const HEADER_CONTENT_HASH: &str = "content-hash";
pub const HEADER_SCHEMA_VERSION: &str = "schema-version";
pub const HEADER_INGEST_TS: &str = "ingest-ts";

/// Dead-letter headers: the stream, the record's index in its request, a reason code and text.
pub const DLQ_HEADER_STREAM: &str = "stream";
pub const DLQ_HEADER_INDEX: &str = "record-index";
pub const DLQ_HEADER_CODE: &str = "reason-code";
pub const DLQ_HEADER_REASON: &str = "reason";
pub const DLQ_HEADER_TRUNCATED: &str = "truncated";
/// The `Idempotency-Key` of the request (the batch id when the edge agent sent it, or when its
/// Kafka output produced the dead letter); absent for a request without one. A dead letter
/// produced again (a request answered after a crash of its producer, retried by the client) has
/// the same batch id and `record-index`: a reader drops repeats by the two.
pub const DLQ_HEADER_BATCH: &str = "batch-id";
/// Header of a redrive note in the dead-letter topic (`ingest-gateway redrive`): the stream whose
/// dead letters it lists as produced again. A note has no `stream` header.
pub const DLQ_HEADER_REDRIVEN: &str = "redriven";

/// The topic of a stream.
pub fn topic_name(prefix: &str, stream: &str) -> String {
    format!("{prefix}{stream}")
}

/// The stream of a topic, if the topic carries the prefix.
pub fn stream_of_topic<'a>(prefix: &str, topic: &'a str) -> Option<&'a str> {
    topic.strip_prefix(prefix)
}

/// Encodes a validated record as the Kafka message value: a JSON object in the schema's field
/// order, nulls omitted. Written directly, without building a JSON tree (a hot path).
pub fn encode_value(def: &StreamDef, record: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    encode_value_into(def, record, &mut out);
    out
}

/// [`encode_value`], appended to `out`.
pub fn encode_value_into(def: &StreamDef, record: &Record, out: &mut Vec<u8>) {
    out.push(b'{');
    let mut first = true;
    for (i, value) in record.values.iter().enumerate() {
        if *value == Value::Null {
            continue;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_slice(def.json_key(i));
        write_value(out, value);
    }
    out.push(b'}');
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    // Serializing a str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Int(i) => out.extend_from_slice(itoa::Buffer::new().format(*i).as_bytes()),
        Value::Float(f) => match Number::from_f64(*f) {
            Some(n) => {
                let _ = serde_json::to_writer(&mut *out, &n);
            }
            None => out.extend_from_slice(b"null"),
        },
        Value::Str(s) => write_str(out, s),
        Value::Timestamp(t) => {
            out.push(b'"');
            write_timestamp(out, *t);
            out.push(b'"');
        }
        Value::List(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(out, item);
            }
            out.push(b']');
        }
        Value::Map(entries) => {
            out.push(b'{');
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_str(out, k);
                out.push(b':');
                write_value(out, v);
            }
            out.push(b'}');
        }
    }
}

/// Decodes and validates a Kafka message value.
pub fn decode_value(def: &StreamDef, bytes: &[u8]) -> Result<Record, RecordError> {
    crate::typed::decode_record(def, bytes)
}

/// Parses a decimal header value.
pub fn parse_decimal_header(bytes: &[u8]) -> Option<i64> {
    // The common case, digits only (every message the gateway writes), without the UTF-8
    // check, trim and generic parse (430 instructions a header before, on the sink's hot path).
    if (1..=18).contains(&bytes.len()) && bytes.iter().all(u8::is_ascii_digit) {
        return Some(bytes.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0')));
    }
    std::str::from_utf8(bytes).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::parse_decimal_header;

    #[test]
    fn decimal_headers_parse_as_str_parse_does() {
        for (text, want) in [
            ("0", Some(0)),
            ("007", Some(7)),
            ("1700000000123456", Some(1_700_000_000_123_456)),
            ("999999999999999999", Some(999_999_999_999_999_999)),
            ("9223372036854775807", Some(i64::MAX)),
            ("9223372036854775808", None),
            (" 42\n", Some(42)),
            ("-5", Some(-5)),
            ("+7", Some(7)),
            ("", None),
            ("12a", None),
            ("1.5", None),
            ("٣", None),
        ] {
            assert_eq!(parse_decimal_header(text.as_bytes()), want, "{text:?}");
            assert_eq!(want, text.trim().parse().ok(), "{text:?}");
        }
        assert_eq!(parse_decimal_header(&[0xff, b'1']), None);
    }
}
