//! Mapping of a stream to an Arrow schema, and of validated records to a `RecordBatch`.
//!
//! Schema fields map as: string → Utf8, bool → Boolean, int64 → Int64, float64 → Float64,
//! timestamp → Timestamp(Microsecond, "UTC"), list<T> → List(T), map<T> → Map(Utf8, T).
//! Required fields are non-nullable. Three metadata columns follow the stream's fields, and a
//! fourth, `_content_hash`, where the sink is set to keep it ([`HashColumn`]).

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::builder::NullBufferBuilder;
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
/// The name of the [`COL_PARTITION`] column in a stream's Iceberg table: Iceberg reserves
/// `_partition` for its metadata column (a file's partition value), and its Java library (Spark,
/// Trino, Flink) refuses to write to a table with a column of that name. The table's name
/// mapping finds the column by either name in files written without field ids.
pub const TABLE_COL_PARTITION: &str = "_kafka_partition";
/// Kafka offset of the record.
pub const COL_OFFSET: &str = "_offset";
/// BLAKE3 content hash: all 32 bytes, or the first 16 ([`HashColumn`]).
pub const COL_CONTENT_HASH: &str = "_content_hash";

/// How much of each row's content hash a landing file keeps in its `_content_hash` column.
/// The hash is 32 random bytes a row that no encoding makes smaller, several times the size of
/// a sensor reading's other columns together, and anyone can compute it again from the row's
/// fields ([`row_hashes`]), so by default it is left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HashColumn {
    /// No `_content_hash` column.
    #[default]
    None,
    /// The hash's first 16 bytes: enough to tell records apart in any table.
    Short,
    /// All 32 bytes.
    Full,
}

impl HashColumn {
    /// The column's width in bytes (0: no column).
    pub fn bytes(self) -> usize {
        match self {
            HashColumn::None => 0,
            HashColumn::Short => 16,
            HashColumn::Full => 32,
        }
    }

    /// The setting of `bytes` (0, 16 or 32).
    pub fn of_bytes(bytes: usize) -> Option<HashColumn> {
        match bytes {
            0 => Some(HashColumn::None),
            16 => Some(HashColumn::Short),
            32 => Some(HashColumn::Full),
            _ => None,
        }
    }
}

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

/// Lists and maps take the names the Parquet format gives their parts (`element`,
/// `key_value`), not Arrow's (`item`, `entries`): readers that find columns by name through an
/// Iceberg name mapping (DuckDB) look for those.
fn list_item_field(inner: &FieldType) -> FieldRef {
    Arc::new(Field::new("element", scalar_type(inner), true))
}

fn map_entries_field(inner: &FieldType) -> FieldRef {
    Arc::new(Field::new(
        "key_value",
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
pub fn arrow_schema(def: &StreamDef, hash: HashColumn) -> SchemaRef {
    let mut fields: Vec<Field> = def
        .fields
        .iter()
        .map(|f| Field::new(&f.name, arrow_type(&f.ty), !f.required))
        .collect();
    fields.push(Field::new(COL_INGEST_TS, utc_micros(), false));
    fields.push(Field::new(COL_PARTITION, DataType::Int32, false));
    fields.push(Field::new(COL_OFFSET, DataType::Int64, false));
    if hash != HashColumn::None {
        let width = DataType::FixedSizeBinary(hash.bytes() as i32);
        fields.push(Field::new(COL_CONTENT_HASH, width, false));
    }
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

/// Builds one `RecordBatch` from validated records of one stream, rows in their order.
pub fn record_batch(
    def: &StreamDef,
    hash: HashColumn,
    rows: &[(Record, RowMeta)],
) -> Result<RecordBatch, ArrowError> {
    let mut batch = BatchBuilder::new(def, hash, rows.len());
    for (record, meta) in rows {
        batch.push_record(record, *meta);
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
    /// The bytes of the content hashes that the file keeps ([`HashColumn`]).
    hash_bytes: usize,
    hashes: Vec<u8>,
    rows: usize,
}

impl BatchBuilder {
    /// A builder with room for `capacity` rows.
    pub fn new(def: &StreamDef, hash: HashColumn, capacity: usize) -> BatchBuilder {
        BatchBuilder {
            schema: arrow_schema(def, hash),
            columns: Column::for_fields(def, capacity),
            ingest: TimestampMicrosecondBuilder::with_capacity(capacity).with_timezone("UTC"),
            partition: Int32Builder::with_capacity(capacity),
            offset: Int64Builder::with_capacity(capacity),
            hash_bytes: hash.bytes(),
            hashes: Vec::with_capacity(capacity * hash.bytes()),
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

    /// Appends a checked row ([`crate::check_bytes_row`]) of this builder's stream. The row is
    /// borrowed: moving its slots (an array of 16) here cost a copy of them per record.
    #[inline]
    pub fn push<H>(&mut self, row: &Row<'_, H>, meta: RowMeta) {
        Column::push_row(&mut self.columns, row);
        self.push_meta(meta);
    }

    /// Appends a validated record of this builder's stream.
    pub fn push_record(&mut self, record: &Record, meta: RowMeta) {
        Column::push_record(&mut self.columns, record);
        self.push_meta(meta);
    }

    fn push_meta(&mut self, meta: RowMeta) {
        self.ingest.append_value(meta.ingest_ts);
        self.partition.append_value(meta.partition);
        self.offset.append_value(meta.offset);
        self.hashes
            .extend_from_slice(&meta.hash.as_bytes()[..self.hash_bytes]);
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
        if self.hash_bytes > 0 {
            let hashes = Buffer::from_vec(std::mem::take(&mut self.hashes));
            let width = self.hash_bytes as i32;
            columns.push(Arc::new(FixedSizeBinaryArray::try_new(
                width, hashes, None,
            )?));
        }
        self.rows = 0;
        RecordBatch::try_new(self.schema.clone(), columns)
    }

    /// [`BatchBuilder::finish`], the rows in series order ([`crate::order`]): by the partition
    /// key and the other string fields, then event time, arrival order among equals.
    pub fn finish_sorted(&mut self, def: &StreamDef) -> Result<RecordBatch, ArrowError> {
        let batch = self.finish()?;
        sort_batch(def, &batch)
    }
}

/// A batch of a stream's landing schema with its rows in series order ([`crate::order`]).
pub fn sort_batch(def: &StreamDef, batch: &RecordBatch) -> Result<RecordBatch, ArrowError> {
    let order = crate::order::sort_order(def, batch.columns());
    let columns = batch
        .columns()
        .iter()
        .map(|column| crate::order::take_rows(column, &order))
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new(batch.schema(), columns)
}

/// The content hashes of rows `rows` of a landing batch, computed again from their fields as
/// the gateway and the agent compute them ([`crate::content_hash`]): the fields the hash covers
/// must be columns of the batch (a nullable one may be missing: its values are null). The
/// batch may hold only those columns.
pub fn row_hashes(
    def: &StreamDef,
    batch: &RecordBatch,
    rows: impl IntoIterator<Item = usize>,
) -> Result<Vec<ContentHash>, ArrowError> {
    let mut columns = Vec::with_capacity(def.hash_fields.len());
    for &field in &def.hash_fields {
        let f = &def.fields[field];
        match batch.column_by_name(&f.name) {
            Some(column) if column.data_type().equals_datatype(&arrow_type(&f.ty)) => {
                columns.push((field, column.clone()));
            }
            Some(column) => {
                return Err(ArrowError::SchemaError(format!(
                    "column '{}' is {}, the stream's field is {}",
                    f.name,
                    column.data_type(),
                    arrow_type(&f.ty)
                )));
            }
            None if f.required => {
                return Err(ArrowError::SchemaError(format!(
                    "no column '{}', which the content hash covers",
                    f.name
                )));
            }
            None => {}
        }
    }
    let mut record = Record {
        values: vec![Value::Null; def.fields.len()],
    };
    rows.into_iter()
        .map(|row| {
            if row >= batch.num_rows() {
                return Err(ArrowError::InvalidArgumentError(format!(
                    "row {row} of a batch of {}",
                    batch.num_rows()
                )));
            }
            for (field, column) in &columns {
                record.values[*field] =
                    crate::order::value_at(column.as_ref(), &def.fields[*field].ty, row);
            }
            Ok(crate::content_hash(def, &record))
        })
        .collect()
}

/// One Arrow column of a stream's field, built a value at a time.
pub(crate) enum Column {
    Str(StringBuilder),
    Bool(BooleanBuilder),
    Int(Int64Builder),
    Float(Float64Builder),
    Timestamp(TimestampMicrosecondBuilder),
    List(Nested),
    /// A map column: its entries' keys, and their values in the [`Nested`] items.
    Map(Nested, StringBuilder),
}

/// What a list or map column is made of: where each row's items start, which rows are null,
/// and the items (scalars) in a column of their own.
pub(crate) struct Nested {
    inner: FieldType,
    offsets: Vec<i32>,
    valid: NullBufferBuilder,
    items: Box<Column>,
}

impl Nested {
    fn new(inner: &FieldType, capacity: usize) -> Nested {
        let mut offsets = Vec::with_capacity(capacity + 1);
        offsets.push(0);
        Nested {
            inner: inner.clone(),
            offsets,
            valid: NullBufferBuilder::new(capacity),
            items: Box::new(Column::new(inner, capacity)),
        }
    }

    /// Ends a row: `items` were just appended to it, or it is null (`valid` false, no items).
    fn end_row(&mut self, items: usize, valid: bool) {
        let start = self.offsets.last().copied().unwrap_or(0);
        self.offsets.push(start + items as i32);
        self.valid.append(valid);
    }

    /// The row offsets and validity since the last call, and the items' array.
    fn finish(&mut self) -> Result<(OffsetBuffer<i32>, Option<NullBuffer>, ArrayRef), ArrowError> {
        let offsets = std::mem::replace(&mut self.offsets, vec![0]);
        Ok((
            OffsetBuffer::new(offsets.into()),
            self.valid.finish(),
            self.items.finish()?,
        ))
    }
}

impl Column {
    /// One column per field of `def`, with room for `capacity` rows.
    pub(crate) fn for_fields(def: &StreamDef, capacity: usize) -> Vec<Column> {
        def.fields
            .iter()
            .map(|f| Column::new(&f.ty, capacity))
            .collect()
    }

    /// Appends a checked row's values to `columns` (those of its stream's fields).
    #[inline]
    pub(crate) fn push_row<H>(columns: &mut [Column], row: &Row<'_, H>) {
        match &row.fields {
            RowFields::Scanned(slots) => {
                for (column, slot) in columns.iter_mut().zip(slots) {
                    match slot {
                        Slot::Null => column.push_null(),
                        Slot::Scalar(value) => column.push_scalar(Some(*value)),
                        Slot::Nested(value) => {
                            column.push_value(value.as_ref().unwrap_or(&Value::Null))
                        }
                    }
                }
            }
            RowFields::Record(record) => Column::push_record(columns, record),
        }
    }

    /// Appends a record's values to `columns` (those of its stream's fields).
    pub(crate) fn push_record(columns: &mut [Column], record: &Record) {
        for (column, value) in columns.iter_mut().zip(&record.values) {
            column.push_value(value);
        }
    }

    fn new(ty: &FieldType, capacity: usize) -> Column {
        match ty {
            FieldType::String => Column::Str(StringBuilder::with_capacity(capacity, capacity * 16)),
            FieldType::Bool => Column::Bool(BooleanBuilder::with_capacity(capacity)),
            FieldType::Int64 => Column::Int(Int64Builder::with_capacity(capacity)),
            FieldType::Float64 => Column::Float(Float64Builder::with_capacity(capacity)),
            FieldType::Timestamp => Column::Timestamp(
                TimestampMicrosecondBuilder::with_capacity(capacity).with_timezone("UTC"),
            ),
            FieldType::List(inner) => Column::List(Nested::new(inner, capacity)),
            FieldType::Map(inner) => Column::Map(
                Nested::new(inner, capacity),
                StringBuilder::with_capacity(capacity, capacity * 8),
            ),
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
            Column::List(n) | Column::Map(n, _) => n.end_row(0, false),
        }
    }

    /// Appends a value; one of another type (validation rules that out) is appended as a null.
    fn push_value(&mut self, value: &Value) {
        match (self, value) {
            (Column::List(n), Value::List(items)) => {
                for item in items {
                    n.items.push_scalar(item.as_scalar());
                }
                n.end_row(items.len(), true);
            }
            (Column::Map(n, keys), Value::Map(entries)) => {
                for (key, value) in entries {
                    keys.append_value(key);
                    n.items.push_scalar(value.as_scalar());
                }
                n.end_row(entries.len(), true);
            }
            (column, value) => column.push_scalar(value.as_scalar()),
        }
    }

    /// The values appended since the last call, as an array.
    pub(crate) fn finish(&mut self) -> Result<ArrayRef, ArrowError> {
        Ok(match self {
            Column::Str(b) => Arc::new(b.finish()),
            Column::Bool(b) => Arc::new(b.finish()),
            Column::Int(b) => Arc::new(b.finish()),
            Column::Float(b) => Arc::new(b.finish()),
            Column::Timestamp(b) => Arc::new(b.finish()),
            Column::List(n) => {
                let (offsets, nulls, items) = n.finish()?;
                Arc::new(ListArray::try_new(
                    list_item_field(&n.inner),
                    offsets,
                    items,
                    nulls,
                )?)
            }
            Column::Map(n, keys) => {
                let (offsets, nulls, values) = n.finish()?;
                let entries = StructArray::try_new(
                    map_entry_fields(&n.inner),
                    vec![Arc::new(keys.finish()) as ArrayRef, values],
                    None,
                )?;
                Arc::new(MapArray::try_new(
                    map_entries_field(&n.inner),
                    offsets,
                    entries,
                    nulls,
                    false,
                )?)
            }
        })
    }
}
