//! The columnar request body: a Parquet file holding one batch of a stream's records.
//!
//! The body's columns are the stream's fields, by name and with the Arrow types of
//! [`crate::arrow::arrow_type`]; nullable columns may be missing. The agent sorts rows by the
//! partition key and the event time and writes timestamps and integers with
//! `DELTA_BINARY_PACKED`, floats with `BYTE_STREAM_SPLIT`, strings with dictionaries, all pages
//! zstd: on sensor data that is about half the size of the same records as zstd NDJSON.
//!
//! A body decodes to the same records as the NDJSON body of the same data: every row is turned
//! back into the canonical JSON record and goes through the same validation, so no rule can differ
//! between the two body types.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::{
    Field, Float64Type, Int64Type, Schema, SchemaRef, TimestampMicrosecondType,
};
use bytes::Bytes;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use crate::arrow::{arrow_type, build_array};
use crate::error::DecodeError;
use crate::stream::{FieldType, StreamDef};
use crate::value::{Record, Value};
use crate::wire::encode_value;

/// The media type of a columnar body.
pub const PARQUET_CONTENT_TYPE: &str = "application/vnd.apache.parquet";

/// Rows decoded per Arrow batch.
const READ_BATCH_ROWS: usize = 8192;

/// The Arrow schema of a columnar body: the stream's fields only.
pub fn body_schema(def: &StreamDef) -> SchemaRef {
    Arc::new(Schema::new(
        def.fields
            .iter()
            .map(|f| Field::new(&f.name, arrow_type(&f.ty), !f.required))
            .collect::<Vec<_>>(),
    ))
}

fn writer_properties(def: &StreamDef, zstd_level: i32) -> WriterProperties {
    let level = ZstdLevel::try_new(zstd_level).unwrap_or_default();
    let mut props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(level))
        .set_statistics_enabled(EnabledStatistics::None)
        .set_max_row_group_row_count(None);
    for field in &def.fields {
        let path = ColumnPath::from(field.name.as_str());
        let encoding = match field.ty {
            FieldType::Int64 | FieldType::Timestamp => Encoding::DELTA_BINARY_PACKED,
            FieldType::Float64 => Encoding::BYTE_STREAM_SPLIT,
            _ => continue,
        };
        props = props
            .set_column_dictionary_enabled(path.clone(), false)
            .set_column_encoding(path, encoding);
    }
    props.build()
}

/// Encodes records as a Parquet body, rows sorted by partition key, then event time (stable).
pub fn encode_parquet(
    def: &StreamDef,
    records: &[Record],
    zstd_level: i32,
) -> Result<Vec<u8>, parquet::errors::ParquetError> {
    // Series first (the partition key, then the other string fields, e.g. the sensor), then
    // time: consecutive rows of one series make timestamps and values delta-friendly.
    let mut series = vec![def.partition_key];
    series.extend(
        (0..def.fields.len())
            .filter(|&i| i != def.partition_key && def.fields[i].ty == FieldType::String),
    );
    let mut order: Vec<&Record> = records.iter().collect();
    order.sort_by(|a, b| {
        series
            .iter()
            .map(|&i| compare_values(&a.values[i], &b.values[i]))
            .find(|o| o.is_ne())
            .unwrap_or(std::cmp::Ordering::Equal)
            .then_with(|| a.event_time(def).cmp(&b.event_time(def)))
    });
    let columns: Vec<ArrayRef> = def
        .fields
        .iter()
        .enumerate()
        .map(|(i, f)| build_array(&f.ty, order.iter().map(|r| &r.values[i])))
        .collect::<Result<_, _>>()?;
    let batch = RecordBatch::try_new(body_schema(def), columns)?;
    let mut out = Vec::with_capacity(records.len() * 16);
    let mut writer = ArrowWriter::try_new(
        &mut out,
        batch.schema(),
        Some(writer_properties(def, zstd_level)),
    )?;
    writer.write(&batch)?;
    writer.close()?;
    Ok(out)
}

fn compare_values(a: &Value, b: &Value) -> std::cmp::Ordering {
    match (a, b) {
        (Value::Str(a), Value::Str(b)) => a.cmp(b),
        (Value::Int(a), Value::Int(b)) => a.cmp(b),
        _ => std::cmp::Ordering::Equal,
    }
}

fn malformed(e: impl std::fmt::Display) -> DecodeError {
    DecodeError::Malformed(format!("Parquet body: {e}"))
}

/// Decodes a Parquet body into canonical NDJSON, one line per row, for the same validation as
/// an NDJSON body. Fails when the body is not Parquet, its columns do not match the stream, or
/// the NDJSON would exceed `max_bytes` (checked against the file's stated sizes before decoding
/// and again while decoding).
pub fn parquet_to_ndjson(
    def: &StreamDef,
    body: Bytes,
    max_bytes: usize,
) -> Result<Vec<u8>, DecodeError> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(body).map_err(malformed)?;
    let stated: i64 = builder
        .metadata()
        .row_groups()
        .iter()
        .map(|g| g.total_byte_size())
        .sum();
    if stated < 0 || stated as u64 > max_bytes as u64 {
        return Err(DecodeError::TooLarge(max_bytes));
    }
    let schema = builder.schema().clone();
    let mut columns = Vec::with_capacity(def.fields.len());
    for field in schema.fields() {
        let index = def.field_index(field.name()).ok_or_else(|| {
            malformed(format!(
                "column '{}' is not a field of the stream",
                crate::stream::printable(field.name())
            ))
        })?;
        let expected = arrow_type(&def.fields[index].ty);
        if !field.data_type().equals_datatype(&expected) {
            return Err(malformed(format!(
                "column '{}' is {}, the stream's field is {expected}",
                field.name(),
                field.data_type()
            )));
        }
        columns.push(index);
    }
    let reader = builder
        .with_batch_size(READ_BATCH_ROWS)
        .build()
        .map_err(malformed)?;
    let mut out = Vec::new();
    let mut record = Record {
        values: vec![Value::Null; def.fields.len()],
    };
    for batch in reader {
        let batch = batch.map_err(malformed)?;
        for row in 0..batch.num_rows() {
            for (column, &field) in batch.columns().iter().zip(&columns) {
                record.values[field] = value_at(column.as_ref(), &def.fields[field].ty, row);
            }
            out.extend_from_slice(&encode_value(def, &record));
            out.push(b'\n');
            if out.len() > max_bytes {
                return Err(DecodeError::TooLarge(max_bytes));
            }
        }
    }
    Ok(out)
}

/// The value of one cell. The column's type was checked against `ty` before.
fn value_at(array: &dyn Array, ty: &FieldType, row: usize) -> Value {
    if array.is_null(row) {
        return Value::Null;
    }
    match ty {
        FieldType::String => Value::Str(array.as_string::<i32>().value(row).into()),
        FieldType::Bool => Value::Bool(array.as_boolean().value(row)),
        FieldType::Int64 => Value::Int(array.as_primitive::<Int64Type>().value(row)),
        FieldType::Float64 => Value::Float(array.as_primitive::<Float64Type>().value(row)),
        FieldType::Timestamp => {
            Value::Timestamp(array.as_primitive::<TimestampMicrosecondType>().value(row))
        }
        FieldType::List(inner) => {
            let items = array.as_list::<i32>().value(row);
            Value::List(
                (0..items.len())
                    .map(|i| value_at(items.as_ref(), inner, i))
                    .collect(),
            )
        }
        FieldType::Map(inner) => {
            let entries = array.as_map().value(row);
            let keys = entries.column(0).as_string::<i32>();
            let values = entries.column(1);
            Value::Map(
                (0..entries.len())
                    .map(|i| (keys.value(i).into(), value_at(values.as_ref(), inner, i)))
                    .collect(),
            )
        }
    }
}
