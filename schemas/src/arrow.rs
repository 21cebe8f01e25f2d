//! Mapping of a stream to an Arrow schema, and of validated records to a `RecordBatch`.
//!
//! Schema fields map as: string → Utf8, bool → Boolean, int64 → Int64, float64 → Float64,
//! timestamp → Timestamp(Microsecond, "UTC"), list<T> → List(T), map<T> → Map(Utf8, T).
//! Required fields are non-nullable. Four metadata columns follow the stream's fields.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanBuilder, FixedSizeBinaryBuilder, Float64Builder, Int32Builder, Int64Builder,
    ListArray, MapArray, StringBuilder, StructArray, TimestampMicrosecondBuilder,
};
use arrow::buffer::{NullBuffer, OffsetBuffer};
use arrow::datatypes::{DataType, Field, FieldRef, Fields, Schema, SchemaRef, TimeUnit};
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatch;

use crate::hash::ContentHash;
use crate::stream::{FieldType, StreamDef};
use crate::value::{Record, Value};

/// Ingest time of the record (the gateway's `ingest-ts`, else the Kafka timestamp).
pub const COL_INGEST_TS: &str = "_ingest_ts";
/// Kafka partition the record was read from.
pub const COL_PARTITION: &str = "_partition";
/// Kafka offset of the record.
pub const COL_OFFSET: &str = "_offset";
/// BLAKE3 content hash, 32 bytes.
pub const COL_CONTENT_HASH: &str = "_content_hash";

/// Schema-level metadata keys.
pub const META_STREAM: &str = "stream";
pub const META_SCHEMA_VERSION: &str = "schema_version";

fn utc_micros() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
}

fn scalar_type(ty: &FieldType) -> DataType {
    match ty {
        FieldType::String => DataType::Utf8,
        FieldType::Bool => DataType::Boolean,
        FieldType::Int64 => DataType::Int64,
        FieldType::Float64 => DataType::Float64,
        FieldType::Timestamp => utc_micros(),
        FieldType::List(_) | FieldType::Map(_) => DataType::Null,
    }
}

fn list_item_field(inner: &FieldType) -> FieldRef {
    Arc::new(Field::new("item", scalar_type(inner), true))
}

fn map_entries_field(inner: &FieldType) -> FieldRef {
    Arc::new(Field::new(
        "entries",
        DataType::Struct(map_entry_fields(inner)),
        false,
    ))
}

fn map_entry_fields(inner: &FieldType) -> Fields {
    Fields::from(vec![
        Field::new("key", DataType::Utf8, false),
        Field::new("value", scalar_type(inner), true),
    ])
}

/// The Arrow type of a field.
pub fn arrow_type(ty: &FieldType) -> DataType {
    match ty {
        FieldType::List(inner) => DataType::List(list_item_field(inner)),
        FieldType::Map(inner) => DataType::Map(map_entries_field(inner), false),
        scalar => scalar_type(scalar),
    }
}

/// The Arrow schema of a stream's landing files: its fields, then the metadata columns.
pub fn arrow_schema(def: &StreamDef) -> SchemaRef {
    let mut fields: Vec<Field> = def
        .fields
        .iter()
        .map(|f| Field::new(&f.name, arrow_type(&f.ty), !f.required))
        .collect();
    fields.push(Field::new(COL_INGEST_TS, utc_micros(), false));
    fields.push(Field::new(COL_PARTITION, DataType::Int32, false));
    fields.push(Field::new(COL_OFFSET, DataType::Int64, false));
    fields.push(Field::new(
        COL_CONTENT_HASH,
        DataType::FixedSizeBinary(32),
        false,
    ));
    let metadata = HashMap::from([
        (META_STREAM.to_owned(), def.name.clone()),
        (META_SCHEMA_VERSION.to_owned(), def.version.to_string()),
    ]);
    Arc::new(Schema::new_with_metadata(fields, metadata))
}

/// Where a record came from, stored in the metadata columns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowMeta {
    pub ingest_ts: i64,
    pub partition: i32,
    pub offset: i64,
    pub hash: ContentHash,
}

/// Builds one `RecordBatch` from validated records of one stream.
pub fn record_batch(
    def: &StreamDef,
    rows: &[(Record, RowMeta)],
) -> Result<RecordBatch, ArrowError> {
    let schema = arrow_schema(def);
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(schema.fields().len());
    for (i, field) in def.fields.iter().enumerate() {
        columns.push(build_array(
            &field.ty,
            rows.iter().map(|(r, _)| &r.values[i]),
        )?);
    }
    let mut ingest = TimestampMicrosecondBuilder::with_capacity(rows.len()).with_timezone("UTC");
    let mut partition = Int32Builder::with_capacity(rows.len());
    let mut offset = Int64Builder::with_capacity(rows.len());
    let mut hash = FixedSizeBinaryBuilder::with_capacity(rows.len(), 32);
    for (_, meta) in rows {
        ingest.append_value(meta.ingest_ts);
        partition.append_value(meta.partition);
        offset.append_value(meta.offset);
        hash.append_value(meta.hash.as_bytes())?;
    }
    columns.push(Arc::new(ingest.finish()));
    columns.push(Arc::new(partition.finish()));
    columns.push(Arc::new(offset.finish()));
    columns.push(Arc::new(hash.finish()));
    RecordBatch::try_new(schema, columns)
}

pub(crate) fn build_array<'a>(
    ty: &FieldType,
    values: impl ExactSizeIterator<Item = &'a Value>,
) -> Result<ArrayRef, ArrowError> {
    let n = values.len();
    Ok(match ty {
        FieldType::String => {
            let mut b = StringBuilder::with_capacity(n, n * 16);
            for v in values {
                match v {
                    Value::Str(s) => b.append_value(s),
                    _ => b.append_null(),
                }
            }
            Arc::new(b.finish())
        }
        FieldType::Bool => {
            let mut b = BooleanBuilder::with_capacity(n);
            values.for_each(|v| {
                b.append_option(matches!(v, Value::Bool(_)).then(|| v == &Value::Bool(true)))
            });
            Arc::new(b.finish())
        }
        FieldType::Int64 => {
            let mut b = Int64Builder::with_capacity(n);
            values.for_each(|v| {
                b.append_option(match v {
                    Value::Int(i) => Some(*i),
                    _ => None,
                })
            });
            Arc::new(b.finish())
        }
        FieldType::Float64 => {
            let mut b = Float64Builder::with_capacity(n);
            values.for_each(|v| {
                b.append_option(match v {
                    Value::Float(f) => Some(*f),
                    _ => None,
                })
            });
            Arc::new(b.finish())
        }
        FieldType::Timestamp => {
            let mut b = TimestampMicrosecondBuilder::with_capacity(n).with_timezone("UTC");
            values.for_each(|v| {
                b.append_option(match v {
                    Value::Timestamp(t) => Some(*t),
                    _ => None,
                })
            });
            Arc::new(b.finish())
        }
        FieldType::List(inner) => {
            let (offsets, nulls, children) = flatten(values, |v| match v {
                Value::List(items) => Some(items.iter().collect::<Vec<_>>()),
                _ => None,
            });
            let child = build_array(inner, children.into_iter())?;
            Arc::new(ListArray::try_new(
                list_item_field(inner),
                offsets,
                child,
                nulls,
            )?)
        }
        FieldType::Map(inner) => {
            let mut keys = StringBuilder::new();
            let (offsets, nulls, children) = flatten(values, |v| match v {
                Value::Map(entries) => Some(
                    entries
                        .iter()
                        .map(|(k, v)| {
                            keys.append_value(k);
                            v
                        })
                        .collect::<Vec<_>>(),
                ),
                _ => None,
            });
            let child = build_array(inner, children.into_iter())?;
            let entries = StructArray::try_new(
                map_entry_fields(inner),
                vec![Arc::new(keys.finish()) as ArrayRef, child],
                None,
            )?;
            Arc::new(MapArray::try_new(
                map_entries_field(inner),
                offsets,
                entries,
                nulls,
                false,
            )?)
        }
    })
}

/// Flattens collection values into offsets, a validity buffer and the child values.
fn flatten<'a>(
    values: impl Iterator<Item = &'a Value>,
    mut items: impl FnMut(&'a Value) -> Option<Vec<&'a Value>>,
) -> (OffsetBuffer<i32>, Option<NullBuffer>, Vec<&'a Value>) {
    let mut lengths = Vec::new();
    let mut valid = Vec::new();
    let mut children = Vec::new();
    for v in values {
        match items(v) {
            Some(list) => {
                lengths.push(list.len());
                valid.push(true);
                children.extend(list);
            }
            None => {
                lengths.push(0);
                valid.push(false);
            }
        }
    }
    let nulls = NullBuffer::from(valid);
    let nulls = (nulls.null_count() > 0).then_some(nulls);
    (OffsetBuffer::from_lengths(lengths), nulls, children)
}
