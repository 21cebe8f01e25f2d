//! The dead-letter table: every record that did not fit its stream (undecodable, invalid
//! against its definition, or an offset range Kafka no longer had), one row each, queryable
//! next to the streams' tables.
//!
//! A partition's dead letters land as JSON-lines objects in a chain of their own (see
//! [`crate::parquet_file::dead_letter_key`]); with `[table]` each object gets a Parquet twin,
//! encoded from the object as it is in the store, at the same name under
//! `<prefix>/_dead_letter_table/data/`. The twins are appended to the table `_dead_letters`
//! exactly as landing files are to their stream's: by offset range, with each partition's next
//! offset in the snapshot summary.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Context;
use arrow::array::{
    ArrayRef, BinaryBuilder, Int32Builder, Int64Builder, RecordBatch, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow::datatypes::{DataType, Field, Schema as ArrowSchema, TimeUnit};
use iceberg::spec::{
    FormatVersion, NestedField, PrimitiveType, Schema, SortOrder, TableMetadata,
    TableMetadataBuilder, Type, UnboundPartitionSpec,
};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use super::metadata;
use super::stats::FileStats;

/// The table's name in the namespace. Stream names start with a letter, so no stream's table
/// takes it.
pub const TABLE: &str = "_dead_letters";

/// The key prefix (under the sink's `key_prefix`) of the table: its metadata and its files.
pub const LOCATION: &str = "_dead_letter_table";

/// The columns, in order: name, type, required.
const COLUMNS: [(&str, PrimitiveType, bool); 9] = [
    ("stream", PrimitiveType::String, true),
    ("topic", PrimitiveType::String, true),
    ("partition", PrimitiveType::Int, true),
    ("offset", PrimitiveType::Long, true),
    ("ingest_ts", PrimitiveType::Timestamptz, true),
    ("reason", PrimitiveType::String, true),
    ("payload", PrimitiveType::Binary, false),
    ("skipped_through", PrimitiveType::Long, false),
    ("skipped_records", PrimitiveType::Long, false),
];

/// The table's schema: the columns with ids 1 to 9.
pub fn schema() -> iceberg::Result<Schema> {
    let fields = COLUMNS.iter().enumerate().map(|(i, (name, ty, required))| {
        let ty = Type::Primitive(ty.clone());
        let id = i as i32 + 1;
        Arc::new(if *required {
            NestedField::required(id, *name, ty)
        } else {
            NestedField::optional(id, *name, ty)
        })
    });
    Schema::builder()
        .with_schema_id(0)
        .with_fields(fields.collect::<Vec<_>>())
        .build()
}

/// The table's first metadata at `location`: unpartitioned (dead letters are few), unsorted.
pub fn create(location: &str) -> iceberg::Result<TableMetadata> {
    let schema = schema()?;
    let properties = HashMap::from([
        (
            "schema.name-mapping.default".to_owned(),
            metadata::name_mapping(&schema),
        ),
        ("write.format.default".to_owned(), "parquet".to_owned()),
    ]);
    Ok(TableMetadataBuilder::new(
        schema,
        UnboundPartitionSpec::builder().build(),
        SortOrder::unsorted_order(),
        location.to_owned(),
        FormatVersion::V2,
        properties,
    )?
    .build()?
    .metadata)
}

/// The key of the Parquet twin of the dead-letter object at `object` (a key under
/// `<prefix>/_dead_letters/`): the same name under `<prefix>/_dead_letter_table/data/`.
pub fn twin_key(prefix: &str, object: &str) -> Option<String> {
    let rest = object.strip_prefix(&format!("{prefix}/_dead_letters/"))?;
    let name = rest.strip_suffix(".ndjson")?;
    Some(format!("{prefix}/{LOCATION}/data/{name}.parquet"))
}

/// A dead-letter object as a Parquet file of the table.
pub struct Encoded {
    pub bytes: bytes::Bytes,
    pub rows: u64,
    /// The offsets of its first and last dead letter.
    pub first: i64,
    pub last: i64,
    pub stats: FileStats,
}

/// One line of a dead-letter object.
#[derive(serde::Deserialize)]
struct Line {
    #[serde(default)]
    topic: Option<String>,
    #[serde(default)]
    partition: Option<i32>,
    offset: i64,
    #[serde(default)]
    ingest_ts: i64,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    payload_hex: Option<String>,
    #[serde(default)]
    skipped_through: Option<i64>,
    #[serde(default)]
    skipped_records: Option<i64>,
}

/// The table's Parquet file for the dead-letter object `text` of `stream`, whose lines are
/// of `topic` and `partition` (when a line does not say).
pub fn encode(stream: &str, topic: &str, partition: i32, text: &[u8]) -> anyhow::Result<Encoded> {
    let mut lines = Vec::new();
    for line in text.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        lines.push(serde_json::from_slice::<Line>(line).context("a dead-letter line")?);
    }
    lines.sort_by_key(|l| l.offset);
    let (Some(first), Some(last)) = (lines.first(), lines.last()) else {
        anyhow::bail!("a dead-letter object without lines");
    };
    let (first, last) = (first.offset, last.offset);
    let mut streams = StringBuilder::new();
    let mut topics = StringBuilder::new();
    let mut partitions = Int32Builder::new();
    let mut offsets = Int64Builder::new();
    let mut times = TimestampMicrosecondBuilder::new().with_timezone("UTC");
    let mut reasons = StringBuilder::new();
    let mut payloads = BinaryBuilder::new();
    let mut through = Int64Builder::new();
    let mut skipped = Int64Builder::new();
    for line in &lines {
        streams.append_value(stream);
        topics.append_value(line.topic.as_deref().unwrap_or(topic));
        partitions.append_value(line.partition.unwrap_or(partition));
        offsets.append_value(line.offset);
        times.append_value(line.ingest_ts);
        reasons.append_value(&line.reason);
        match &line.payload_hex {
            Some(h) => payloads.append_value(hex::decode(h).context("a dead letter's payload")?),
            None => payloads.append_null(),
        }
        through.append_option(line.skipped_through);
        skipped.append_option(line.skipped_records);
    }
    let arrays: [ArrayRef; 9] = [
        Arc::new(streams.finish()),
        Arc::new(topics.finish()),
        Arc::new(partitions.finish()),
        Arc::new(offsets.finish()),
        Arc::new(times.finish()),
        Arc::new(reasons.finish()),
        Arc::new(payloads.finish()),
        Arc::new(through.finish()),
        Arc::new(skipped.finish()),
    ];
    let fields: Vec<Field> = COLUMNS
        .iter()
        .map(|(name, ty, required)| {
            let ty = match ty {
                PrimitiveType::Int => DataType::Int32,
                PrimitiveType::Long => DataType::Int64,
                PrimitiveType::Timestamptz => {
                    DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
                }
                PrimitiveType::Binary => DataType::Binary,
                _ => DataType::Utf8,
            };
            Field::new(*name, ty, !required)
        })
        .collect();
    let batch = RecordBatch::try_new(Arc::new(ArrowSchema::new(fields)), arrays.to_vec())?;
    let properties = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?))
        .build();
    let mut writer = ArrowWriter::try_new(Vec::new(), batch.schema(), Some(properties))?;
    writer.write(&batch)?;
    let footer = writer.finish()?;
    let bytes = bytes::Bytes::from(std::mem::take(writer.inner_mut()));
    Ok(Encoded {
        bytes,
        rows: lines.len() as u64,
        first,
        last,
        stats: FileStats::of(&footer),
    })
}

#[cfg(test)]
mod tests {
    use arrow::array::Array;

    use super::*;

    #[test]
    fn twins_sit_under_the_table_with_the_objects_names() {
        assert_eq!(
            twin_key(
                "landing",
                "landing/_dead_letters/s/date=2026-11-28/hour=07/s-p2-o00000000000000000005.ndjson"
            )
            .as_deref(),
            Some(
                "landing/_dead_letter_table/data/s/date=2026-11-28/hour=07/s-p2-o00000000000000000005.parquet"
            )
        );
        assert_eq!(twin_key("landing", "other/_dead_letters/s/x.ndjson"), None);
    }

    #[test]
    fn an_object_becomes_one_row_per_line_in_offset_order() {
        let text = concat!(
            r#"{"topic":"t","partition":2,"offset":9,"ingest_ts":5,"reason":"bad","payload_hex":"6869"}"#,
            "\n",
            r#"{"topic":"t","partition":2,"offset":7,"ingest_ts":4,"reason":"offsets 7 to 8 were not in Kafka","skipped_through":8,"skipped_records":2}"#,
            "\n"
        );
        let encoded = encode("s", "t", 2, text.as_bytes()).unwrap();
        assert_eq!((encoded.rows, encoded.first, encoded.last), (2, 7, 9));
        let batch = parquet::arrow::arrow_reader::ParquetRecordBatchReader::try_new(
            encoded.bytes.clone(),
            1024,
        )
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
        let payload = batch
            .column_by_name("payload")
            .unwrap()
            .as_any()
            .downcast_ref::<arrow::array::BinaryArray>()
            .unwrap();
        assert!(payload.is_null(0));
        assert_eq!(payload.value(1), b"hi");
        assert_eq!(
            encoded.stats.columns["offset"].min,
            Some(super::super::stats::Bound::Int(7))
        );
        assert!(encode("s", "t", 2, b"not json\n").is_err());
    }
}
