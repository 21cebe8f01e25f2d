//! Stream definitions and wire formats, shared by every component. No I/O happens here.
//!
//! - [`stream`]: stream definitions parsed from TOML, and the set of known streams;
//! - [`value`]: validation of JSON records into typed, normalized [`Record`]s;
//! - [`decode`]: NDJSON and JSON-array bodies;
//! - [`hash`]: the canonical BLAKE3 content hash;
//! - [`wire`]: the Kafka topic, key, value and header format;
//! - [`arrow`]: the Arrow schema of landing files and the record batch builder;
//! - [`columnar`]: the Parquet request body;
//! - `registry`: the schema registry wire format (Avro and JSON Schema values).

pub mod api;
#[cfg(feature = "parquet")]
pub mod arrow;
pub mod budget;
#[cfg(feature = "parquet")]
pub mod columnar;
pub mod decode;
pub mod dictionary;
pub mod error;
pub mod hash;
#[cfg(feature = "parquet")]
mod order;
#[cfg(feature = "registry")]
pub mod registry;
mod scan;
pub mod stream;
pub mod typed;
pub mod value;
pub mod window;
pub mod wire;

pub use error::{DecodeError, RecordError, SchemaError};
pub use hash::{AtOnce, ContentHash, HashGroup, Hashing, Pending, content_hash, content_hash_in};
pub use scan::Line;
pub use stream::{
    Change, FieldDef, FieldType, StreamDef, Streams, ValueFormat, validate_stream_name,
};
pub use value::{Record, Scalar, Str, Value, validate};

/// A record that passed validation, with its content hash.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRecord<H = ContentHash> {
    pub record: Record,
    /// The hash, or with a [`HashGroup`] the record's place in the group.
    pub hash: H,
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
    check_bytes_verbatim_in(def, raw, &mut AtOnce)
}

/// [`check_bytes_verbatim`], the hash made as `hashing` makes hashes.
pub fn check_bytes_verbatim_in<H: Hashing>(
    def: &StreamDef,
    raw: &[u8],
    hashing: &mut H,
) -> Result<(ValidRecord<H::Hash>, bool), RecordError> {
    let (record, verbatim) = match scan::decode_verbatim(def, raw) {
        Some(scanned) => scanned,
        None => (typed::decode_record_serde(def, raw)?, false),
    };
    let hash = content_hash_in(def, &record, hashing);
    Ok((ValidRecord { record, hash }, verbatim))
}

/// A record checked for forwarding (as a Kafka message, a line of an NDJSON batch).
#[derive(Debug, Clone, PartialEq)]
pub struct Forward<H = ContentHash> {
    /// The hash, or with a [`HashGroup`] the record's place in the group.
    pub hash: H,
    /// The partition key ([`Record::partition_key`]).
    pub key: Str,
    /// `None` when the record's own text may stand as its value (as [`check_bytes_verbatim`]
    /// decides); otherwise the record, to be encoded canonically ([`wire::encode_value`]).
    pub canonical: Option<Record>,
}

/// [`check_bytes_verbatim`] for callers that forward records rather than look into them: a
/// record whose text may stand as its value is hashed straight from that text, without
/// building a [`Record`] (no strings copied, unhashed lists and maps only checked). Same
/// rules, hashes and errors as [`check_bytes`].
pub fn check_bytes_forward(def: &StreamDef, raw: &[u8]) -> Result<Forward, RecordError> {
    check_bytes_forward_in(def, raw, &mut AtOnce)
}

/// [`check_bytes_forward`], the hash made as `hashing` makes hashes. A [`Line`] of a body
/// ([`decode::split_body_in`]) is read without bounds checks, the same line as a slice with them.
pub fn check_bytes_forward_in<'a, H: Hashing>(
    def: &StreamDef,
    line: impl Into<Line<'a>>,
    hashing: &mut H,
) -> Result<Forward<H::Hash>, RecordError> {
    let (hash, key, canonical) = forward_with(def, line.into(), hashing, value::partition_key)?;
    Ok(Forward {
        hash,
        key,
        canonical,
    })
}

/// A record checked for forwarding by a caller that does not partition records (the edge
/// agent): a [`Forward`] without its partition key.
#[derive(Debug, Clone, PartialEq)]
pub struct Hashed<H = ContentHash> {
    /// The hash, or with a [`HashGroup`] the record's place in the group.
    pub hash: H,
    /// As [`Forward::canonical`].
    pub canonical: Option<Record>,
}

/// [`check_bytes_forward_in`] without the partition key: making it (a string copy, and a
/// larger result to move) was wasted where it is not used. Inlined into the caller's loop: as
/// a call, its result is returned through memory and its slots dropped out of line, which cost
/// the edge agent about 3% more instructions.
#[inline]
pub fn check_bytes_hashed_in<H: Hashing>(
    def: &StreamDef,
    raw: &[u8],
    hashing: &mut H,
) -> Result<Hashed<H::Hash>, RecordError> {
    let (hash, (), canonical) = forward_with(def, raw.into(), hashing, |_| ())?;
    Ok(Hashed { hash, canonical })
}

/// The common case of [`check_bytes_hashed_in`] alone: the hash of a record whose text may
/// stand as its value, `None` for any other line, which [`check_bytes_hashed_in`] then checks
/// (and accepts or rejects) in full. Small enough to be returned in a register, so a caller's
/// loop can store it where it keeps it rather than move it from memory. Nothing is hashed for
/// a `None`; the full check tries the common case again first, so a line that fails it only
/// at its end (a repeated key) is scanned twice. A [`Line`] of a body
/// ([`decode::ndjson_lines_in`]) is read without bounds checks, the same line as a slice with them.
#[inline(always)]
pub fn forwardable_hash_in<'a, H: Hashing>(
    def: &StreamDef,
    line: impl Into<Line<'a>>,
    hashing: &mut H,
) -> Option<H::Hash> {
    scan::forwardable(def, line.into(), hashing, |_| ()).map(|(hash, ())| hash)
}

/// The checks of [`check_bytes_forward_in`], with what `key` makes of the partition key
/// field's value.
#[inline(always)]
fn forward_with<H: Hashing, K>(
    def: &StreamDef,
    line: Line<'_>,
    hashing: &mut H,
    key: impl Fn(Option<value::Scalar<'_>>) -> K,
) -> Result<(H::Hash, K, Option<Record>), RecordError> {
    if let Some((hash, key)) = scan::forwardable(def, line, hashing, &key) {
        return Ok((hash, key, None));
    }
    let (valid, verbatim) = check_bytes_verbatim_in(def, line.bytes(), hashing)?;
    let key = key(valid.record.values[def.partition_key].as_scalar());
    Ok((valid.hash, key, (!verbatim).then_some(valid.record)))
}

/// A record checked for landing: its content hash and its field values, which
/// [`arrow::BatchBuilder::push`] appends to Arrow columns.
#[derive(Debug, Clone)]
pub struct Row<'a, H = ContentHash> {
    /// The hash, or with a [`HashGroup`] the record's place in the group.
    pub hash: H,
    // Read by the Arrow builders only.
    #[cfg_attr(not(feature = "parquet"), allow(dead_code))]
    pub(crate) fields: RowFields<'a>,
}

// The scanned variant is the common case: boxing it would add an allocation per record, which
// is what this type avoids.
#[allow(clippy::large_enum_variant)]
#[cfg_attr(not(feature = "parquet"), allow(dead_code))]
#[derive(Debug, Clone)]
pub(crate) enum RowFields<'a> {
    /// A record of the common shape, not built: its strings are slices of its text.
    Scanned(scan::Slots<'a>),
    Record(Record),
}

/// [`check_bytes`] for callers that only append records to Arrow columns (the sink): a record
/// of the common shape is not built into a [`Record`] (no `Vec` of values, no string copied).
/// Same rules, hashes and errors as [`check_bytes`].
#[inline]
pub fn check_bytes_row<'a>(def: &StreamDef, raw: &'a [u8]) -> Result<Row<'a>, RecordError> {
    check_bytes_row_in(def, raw, &mut AtOnce)
}

/// [`check_bytes_row`], the hash made as `hashing` makes hashes.
#[inline]
pub fn check_bytes_row_in<'a, H: Hashing>(
    def: &StreamDef,
    raw: &'a [u8],
    hashing: &mut H,
) -> Result<Row<'a, H::Hash>, RecordError> {
    if let Some((slots, hash)) = scan::scanned(def, raw, hashing) {
        return Ok(Row {
            hash,
            fields: RowFields::Scanned(slots),
        });
    }
    let record = typed::decode_record_serde(def, raw)?;
    Ok(Row {
        hash: content_hash_in(def, &record, hashing),
        fields: RowFields::Record(record),
    })
}

/// The common case of [`check_bytes_row_in`] for callers that keep the record's text too (the
/// edge agent's Parquet batches, whose NDJSON text makes the batch id): the row of a record
/// whose text may stand for it (as [`check_bytes_verbatim`] decides), `None` for any other
/// line, which the caller then checks in full. Nothing is hashed for a `None`. A [`Line`] of a
/// body is read without bounds checks, as by [`forwardable_hash_in`].
#[inline]
pub fn verbatim_row_in<'a, H: Hashing>(
    def: &StreamDef,
    line: impl Into<Line<'a>>,
    hashing: &mut H,
) -> Option<Row<'a, H::Hash>> {
    scan::scanned_if(def, line.into(), hashing, |once| once).map(|(slots, hash)| Row {
        hash,
        fields: RowFields::Scanned(slots),
    })
}

/// The scalar values and content hash of a line whose text stands for its record, for callers
/// that read its scalar fields and keep its text (the edge agent's filters): lists and maps are
/// checked (and built for the hash where they are hashed) but not kept, so a map of tags costs
/// no allocation.
#[derive(Debug, Clone)]
pub struct Scalars<'a, H = ContentHash> {
    /// The hash, or with a [`HashGroup`] the record's place in the group.
    pub hash: H,
    slots: scan::Slots<'a>,
}

impl<H> Scalars<'_, H> {
    /// The value of field `i` (in the stream's field order) when it is a scalar; `None` for a
    /// null, a list or a map.
    #[inline]
    pub fn get(&self, i: usize) -> Option<value::Scalar<'_>> {
        match self.slots.get(i)? {
            scan::Slot::Scalar(s) => Some(*s),
            scan::Slot::Null | scan::Slot::Nested(_) => None,
        }
    }
}

/// [`verbatim_row_in`] for a reader of the scalar fields: the [`Scalars`] of a line whose text
/// may stand for its record, `None` for any other line (nothing is hashed then).
#[inline]
pub fn verbatim_scalars_in<'a, H: Hashing>(
    def: &StreamDef,
    line: impl Into<Line<'a>>,
    hashing: &mut H,
) -> Option<Scalars<'a, H::Hash>> {
    scan::scanned_hashed_if(def, line.into(), hashing, |once| once)
        .map(|(slots, hash)| Scalars { hash, slots })
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
