//! Stream definitions and wire formats, shared by every component. No I/O happens here.
//!
//! - [`stream`]: stream definitions parsed from TOML, and the set of known streams;
//! - [`value`]: validation of JSON records into typed, normalized [`Record`]s;
//! - [`decode`]: NDJSON and JSON-array bodies;
//! - [`hash`]: the canonical BLAKE3 content hash;
//! - [`wire`]: the Kafka topic, key, value and header format;
//! - [`arrow`]: the Arrow schema of landing files and the record batch builder;
//! - [`columnar`]: the Parquet request body.

pub mod api;
pub mod arrow;
pub mod columnar;
pub mod decode;
pub mod dictionary;
pub mod error;
pub mod hash;
mod scan;
pub mod stream;
pub mod typed;
pub mod value;
pub mod window;
pub mod wire;

pub use error::{DecodeError, RecordError, SchemaError};
pub use hash::{ContentHash, content_hash};
pub use stream::{FieldDef, FieldType, StreamDef, Streams, validate_stream_name};
pub use value::{Record, Str, Value, validate};

/// A record that passed validation, with its content hash.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRecord {
    pub record: Record,
    pub hash: ContentHash,
}

/// Parses and validates one raw JSON record (an NDJSON line or array element) straight into a
/// typed record, and computes its content hash. The fast path; same rules as [`check`].
pub fn check_bytes(def: &StreamDef, raw: &[u8]) -> Result<ValidRecord, RecordError> {
    let record = typed::decode_record(def, raw)?;
    let hash = content_hash(def, &record);
    Ok(ValidRecord { record, hash })
}

/// [`check_bytes`], and whether `raw` itself (without surrounding whitespace) may stand as the
/// record's Kafka value: it is one JSON object of the stream's keys, each once, without escapes,
/// so any reader decodes it to the same record as the canonical encoding
/// ([`wire::encode_value`]). The gateway then forwards the client's bytes instead of
/// re-encoding them.
pub fn check_bytes_verbatim(
    def: &StreamDef,
    raw: &[u8],
) -> Result<(ValidRecord, bool), RecordError> {
    let (record, verbatim) = match scan::decode_verbatim(def, raw) {
        Some(scanned) => scanned,
        None => (typed::decode_record_serde(def, raw)?, false),
    };
    let hash = content_hash(def, &record);
    Ok((ValidRecord { record, hash }, verbatim))
}

/// Validates a JSON record and computes its content hash.
pub fn check(def: &StreamDef, json: serde_json::Value) -> Result<ValidRecord, RecordError> {
    let record = validate(def, json)?;
    let hash = content_hash(def, &record);
    Ok(ValidRecord { record, hash })
}

/// The example stream definitions shipped in the repository's `streams/` directory, embedded so
/// that the demo and tests run without a checkout.
pub const EXAMPLE_STREAMS: &[(&str, &str)] = &[
    (
        "sensor_readings",
        include_str!("../../streams/sensor_readings.toml"),
    ),
    (
        "vehicle_telemetry",
        include_str!("../../streams/vehicle_telemetry.toml"),
    ),
];

/// The example streams, parsed.
pub fn example_streams() -> Streams {
    Streams::from_sources(EXAMPLE_STREAMS.iter().copied())
        .unwrap_or_else(|errors| panic!("shipped stream definitions are invalid: {errors:?}"))
}

#[cfg(test)]
mod tests;
