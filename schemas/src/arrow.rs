//! Mapping of a stream to an Arrow schema, and of validated records to a `RecordBatch`.
//!
//! Schema fields map as: string → Utf8, bool → Boolean, int64 → Int64, float64 → Float64,
//! timestamp → Timestamp(Microsecond, "UTC"), list<T> → List(T), map<T> → Map(Utf8, T).
//! Required fields are non-nullable. Four metadata columns follow the stream's fields.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanBuilder, FixedSizeBinaryArray, Float64Builder, Int32Builder, Int64Builder,
    ListArray, MapArray, StringBuilder, StructArray, TimestampMicrosecondBuilder,
};
use arrow::buffer::{Buffer, NullBuffer, OffsetBuffer};
use arrow::datatypes::{DataType, Field, FieldRef, Fields, Schema, SchemaRef, TimeUnit};
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatch;

use crate::hash::ContentHash;
use crate::scan::Slot;
use crate::stream::{FieldType, StreamDef};
use crate::value::{Record, Scalar, Value};
use crate::{Row, RowFields};

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
    let mut batch = BatchBuilder::new(def, rows.len());
    for (record, meta) in rows {
        batch.push_record(record.clone(), *meta);
    }
    batch.finish()
}

/// Builds `RecordBatch`es of a stream's landing schema a row at a time: each value goes
/// straight into its column, so a scanned [`Row`] is never built as a [`Record`].
pub struct BatchBuilder {
    schema: SchemaRef,
    columns: Vec<Column>,
    ingest: TimestampMicrosecondBuilder,
    partition: Int32Builder,
    offset: Int64Builder,
    /// The content hashes, 32 bytes each.
    hashes: Vec<u8>,
    rows: usize,
}

impl BatchBuilder {
    /// A builder with room for `capacity` rows.
    pub fn new(def: &StreamDef, capacity: usize) -> BatchBuilder {
        BatchBuilder {
            schema: arrow_schema(def),
            columns: def
                .fields
                .iter()
                .map(|f| Column::new(&f.ty, capacity))
                .collect(),
            ingest: TimestampMicrosecondBuilder::with_capacity(capacity).with_timezone("UTC"),
            partition: Int32Builder::with_capacity(capacity),
            offset: Int64Builder::with_capacity(capacity),
            hashes: Vec::with_capacity(capacity * 32),
            rows: 0,
        }
    }

    /// Rows appended since the last batch.
    pub fn len(&self) -> usize {
        self.rows
    }

    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Appends a checked row ([`crate::check_bytes_row`]) of this builder's stream.
    #[inline]
    pub fn push(&mut self, row: Row<'_>, meta: RowMeta) {
        match row.fields {
            RowFields::Scanned(slots) => {
                for (column, slot) in self.columns.iter_mut().zip(slots) {
                    match slot {
                        Slot::Null => column.push_null(),
                        Slot::Scalar(value) => column.push_scalar(Some(value)),
                        Slot::Nested(value) => column.push_value(value.unwrap_or(Value::Null)),
                    }
                }
                self.push_meta(meta);
            }
            RowFields::Record(record) => self.push_record(record, meta),
        }
    }

    /// Appends a validated record of this builder's stream.
    pub fn push_record(&mut self, record: Record, meta: RowMeta) {
        for (column, value) in self.columns.iter_mut().zip(record.values) {
            column.push_value(value);
        }
        self.push_meta(meta);
    }

    fn push_meta(&mut self, meta: RowMeta) {
        self.ingest.append_value(meta.ingest_ts);
        self.partition.append_value(meta.partition);
        self.offset.append_value(meta.offset);
        self.hashes.extend_from_slice(meta.hash.as_bytes());
        self.rows += 1;
    }

    /// The rows appended since the last batch, as a batch; the builder is then empty.
    pub fn finish(&mut self) -> Result<RecordBatch, ArrowError> {
        let mut columns: Vec<ArrayRef> = Vec::with_capacity(self.columns.len() + 4);
        for column in &mut self.columns {
            columns.push(column.finish()?);
        }
        columns.push(Arc::new(self.ingest.finish()));
        columns.push(Arc::new(self.partition.finish()));
        columns.push(Arc::new(self.offset.finish()));
        let hashes = Buffer::from_vec(std::mem::take(&mut self.hashes));
        columns.push(Arc::new(FixedSizeBinaryArray::try_new(32, hashes, None)?));
        self.rows = 0;
        RecordBatch::try_new(self.schema.clone(), columns)
    }
}

/// One Arrow column of a stream's field, built a value at a time.
enum Column {
    Str(StringBuilder),
    Bool(BooleanBuilder),
    Int(Int64Builder),
    Float(Float64Builder),
    Timestamp(TimestampMicrosecondBuilder),
    /// A list or map column: its values are kept and built when the batch is finished.
    Nested(FieldType, Vec<Value>),
}

impl Column {
    fn new(ty: &FieldType, capacity: usize) -> Column {
        match ty {
            FieldType::String => Column::Str(StringBuilder::with_capacity(capacity, capacity * 16)),
            FieldType::Bool => Column::Bool(BooleanBuilder::with_capacity(capacity)),
            FieldType::Int64 => Column::Int(Int64Builder::with_capacity(capacity)),
            FieldType::Float64 => Column::Float(Float64Builder::with_capacity(capacity)),
            FieldType::Timestamp => Column::Timestamp(
                TimestampMicrosecondBuilder::with_capacity(capacity).with_timezone("UTC"),
            ),
            nested => Column::Nested(nested.clone(), Vec::with_capacity(capacity)),
        }
    }

    /// Appends a scalar; a value of another type (validation rules that out) is appended as a
    /// null.
    #[inline]
    fn push_scalar(&mut self, value: Option<Scalar<'_>>) {
        match (self, value) {
            (Column::Str(b), Some(Scalar::Str(s))) => b.append_value(s),
            (Column::Bool(b), Some(Scalar::Bool(v))) => b.append_value(v),
            (Column::Int(b), Some(Scalar::Int(v))) => b.append_value(v),
            (Column::Float(b), Some(Scalar::Float(v))) => b.append_value(v),
            (Column::Timestamp(b), Some(Scalar::Timestamp(v))) => b.append_value(v),
            (column, _) => column.push_null(),
        }
    }

    fn push_null(&mut self) {
        match self {
            Column::Str(b) => b.append_null(),
            Column::Bool(b) => b.append_null(),
            Column::Int(b) => b.append_null(),
            Column::Float(b) => b.append_null(),
            Column::Timestamp(b) => b.append_null(),
            Column::Nested(_, values) => values.push(Value::Null),
        }
    }

    /// Appends a value, moved (a list or map is kept as it is).
    fn push_value(&mut self, value: Value) {
        match self {
            Column::Nested(_, values) => values.push(value),
            column => column.push_scalar(value.as_scalar()),
        }
    }

    /// The values appended since the last call, as an array.
    fn finish(&mut self) -> Result<ArrayRef, ArrowError> {
        Ok(match self {
            Column::Str(b) => Arc::new(b.finish()),
            Column::Bool(b) => Arc::new(b.finish()),
            Column::Int(b) => Arc::new(b.finish()),
            Column::Float(b) => Arc::new(b.finish()),
            Column::Timestamp(b) => Arc::new(b.finish()),
            Column::Nested(ty, values) => build_array(ty, std::mem::take(values).iter())?,
        })
    }
}

pub(crate) fn build_array<'a>(
    ty: &FieldType,
    values: impl ExactSizeIterator<Item = &'a Value>,
) -> Result<ArrayRef, ArrowError> {
    Ok(match ty {
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
        scalar => {
            let mut column = Column::new(scalar, values.len());
            for v in values {
                column.push_scalar(v.as_scalar());
            }
            column.finish()?
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
