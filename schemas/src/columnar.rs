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

use arrow::array::ArrayRef;
use arrow::datatypes::{Field, Schema, SchemaRef};
use bytes::Bytes;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::arrow_writer::{ArrowRowGroupWriterFactory, compute_leaves};
use parquet::arrow::{ArrowSchemaConverter, add_encoded_arrow_schema_to_metadata};
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::errors::ParquetError;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::ColumnPath;

use crate::arrow::{Column, arrow_type};
use crate::error::DecodeError;
use crate::order::{sort_order, take_rows, value_at};
use crate::stream::{FieldType, StreamDef};
use crate::value::{Record, Value};
use crate::wire::encode_value;

pub use crate::decode::PARQUET_CONTENT_TYPE;

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
) -> Result<Vec<u8>, ParquetError> {
    let mut body = BodyBuilder::new(def, records.len());
    for record in records {
        body.push(record);
    }
    body.finish(def, zstd_level)
}

/// A Parquet body built a record at a time: each value goes into its Arrow column as the record
/// arrives, so an open batch is held as columns (about the size of its values) rather than as
/// records (a few hundred bytes and two allocations each).
pub struct BodyBuilder {
    columns: Vec<Column>,
}

impl BodyBuilder {
    /// A builder for `def`'s records with room for `capacity` of them.
    pub fn new(def: &StreamDef, capacity: usize) -> BodyBuilder {
        BodyBuilder {
            columns: Column::for_fields(def, capacity),
        }
    }

    /// Appends a validated record of the builder's stream.
    pub fn push(&mut self, record: &Record) {
        Column::push_record(&mut self.columns, record);
    }

    /// Appends a checked row ([`crate::verbatim_row_in`], [`crate::check_bytes_row`]) of the
    /// builder's stream: a record of the common shape goes into the columns from its text,
    /// without being built.
    pub fn push_row<H>(&mut self, row: &crate::Row<'_, H>) {
        Column::push_row(&mut self.columns, row);
    }

    /// The body: rows sorted by series (the partition key, then the other string fields, e.g.
    /// the sensor), then event time, keeping arrival order among equals. Consecutive rows of
    /// one series make timestamps and values delta-friendly. The columns are encoded one after
    /// the other, each closed before the next starts, so one column's pages and zstd workspace
    /// are held at a time (`ArrowWriter` keeps every column's until the row group closes).
    pub fn finish(self, def: &StreamDef, zstd_level: i32) -> Result<Vec<u8>, ParquetError> {
        let arrays = self.sorted_arrays(def)?;
        write_columns(def, &arrays, zstd_level)
    }

    /// The columns, rows in body order.
    fn sorted_arrays(self, def: &StreamDef) -> Result<Vec<ArrayRef>, ParquetError> {
        let mut columns = self.columns;
        let arrays = columns
            .iter_mut()
            .map(Column::finish)
            .collect::<Result<Vec<ArrayRef>, _>>()?;
        drop(columns);
        let order = sort_order(def, &arrays);
        Ok(arrays
            .iter()
            .map(|a| take_rows(a, &order))
            .collect::<Result<Vec<ArrayRef>, _>>()?)
    }
}

/// Writes `arrays` (the body schema's columns) as one row group, a column at a time.
fn write_columns(
    def: &StreamDef,
    arrays: &[ArrayRef],
    zstd_level: i32,
) -> Result<Vec<u8>, ParquetError> {
    let schema = body_schema(def);
    let mut props = writer_properties(def, zstd_level);
    add_encoded_arrow_schema_to_metadata(&schema, &mut props);
    let parquet_schema = ArrowSchemaConverter::new()
        .with_coerce_types(props.coerce_types())
        .convert(&schema)?;
    let mut out = Vec::new();
    let mut file =
        SerializedFileWriter::new(&mut out, parquet_schema.root_schema_ptr(), Arc::new(props))?;
    let mut writers = ArrowRowGroupWriterFactory::new(&file, schema.clone())
        .create_column_writers(0)?
        .into_iter();
    let mut row_group = file.next_row_group()?;
    for (field, array) in schema.fields().iter().zip(arrays) {
        for leaf in compute_leaves(field, array)? {
            let mut writer = writers
                .next()
                .ok_or_else(|| ParquetError::General("more leaves than columns".into()))?;
            writer.write(&leaf)?;
            writer.close()?.append_to_row_group(&mut row_group)?;
        }
    }
    row_group.close()?;
    file.close()?;
    Ok(out)
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
    parquet_to_ndjson_charged(def, body, max_bytes, &mut crate::budget::unlimited)
}

/// [`parquet_to_ndjson`], the NDJSON's memory taken from `charge` before it is allocated
/// ([`DecodeError::OverBudget`] when the budget does not take it).
pub fn parquet_to_ndjson_charged(
    def: &StreamDef,
    body: Bytes,
    max_bytes: usize,
    charge: crate::budget::Charge<'_>,
) -> Result<Vec<u8>, DecodeError> {
    // The parquet crate panics on some malformed files instead of returning an error (found
    // by fuzzing, `fuzz/`: an assertion that a column chunk's start is not negative, a
    // division by zero in its byte-array reader, and arithmetic overflows where overflow checks
    // are on). A hostile body must get a 400 like any other malformed one, not take down the
    // thread decoding it (the gateway answered 503, which clients retry for ever).
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        decode_parquet(def, body, max_bytes, charge)
    }))
    .unwrap_or_else(|_| Err(malformed("the Parquet reader failed on it")))
}

fn decode_parquet(
    def: &StreamDef,
    body: Bytes,
    max_bytes: usize,
    charge: crate::budget::Charge<'_>,
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
        let index = def
            .field_index(field.name())
            .ok_or_else(|| DecodeError::UnknownColumn(crate::stream::printable(field.name())))?;
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
            let line = encode_value(def, &record);
            if !crate::budget::reserve(&mut out, line.len() + 1, charge) {
                return Err(DecodeError::OverBudget);
            }
            out.extend_from_slice(&line);
            out.push(b'\n');
            if out.len() > max_bytes {
                return Err(DecodeError::TooLarge(max_bytes));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use arrow::array::{RecordBatch, UInt32Array};
    use arrow::compute::take;
    use arrow::datatypes::DataType;
    use parquet::arrow::ArrowWriter;

    use super::*;
    use crate::example_streams;

    /// Lists and maps taken through their offsets come out as Arrow's `take` gives them, nulls
    /// included, for an order that moves every row and repeats some.
    #[test]
    fn lists_and_maps_are_taken_as_arrow_takes_them() {
        for name in ["sensor_readings", "vehicle_telemetry"] {
            let def = example_streams().get(name).unwrap().clone();
            let lines = crate::tests::sample_lines(&def, 500);
            let mut columns = Column::for_fields(&def, 0);
            for line in &lines {
                let record = crate::check_bytes(&def, line).unwrap().record;
                Column::push_record(&mut columns, &record);
            }
            let arrays: Vec<ArrayRef> = columns
                .iter_mut()
                .map(Column::finish)
                .collect::<Result<_, _>>()
                .unwrap();
            let nested = arrays
                .iter()
                .filter(|a| matches!(a.data_type(), DataType::List(_) | DataType::Map(..)))
                .count();
            assert!(nested > 0, "{name} has no list or map column");
            let order = UInt32Array::from_iter_values((0..500).rev().chain((0..500).step_by(3)));
            for (array, field) in arrays.iter().zip(&def.fields) {
                let ours = take_rows(array, &order).unwrap();
                let theirs = take(array.as_ref(), &order, None).unwrap();
                assert_eq!(&ours, &theirs, "{name}.{}", field.name);
            }
        }
    }

    /// Writing a column at a time (one zstd context alive at a time) gives the very bytes that
    /// `ArrowWriter` gives for the same columns, so gateways read the bodies as before.
    #[test]
    fn column_at_a_time_writes_what_arrow_writer_writes() {
        for name in ["sensor_readings", "vehicle_telemetry"] {
            let def = example_streams().get(name).unwrap().clone();
            let lines = crate::tests::sample_lines(&def, 3_000);
            let mut body = BodyBuilder::new(&def, 0);
            for line in &lines {
                body.push(&crate::check_bytes(&def, line).unwrap().record);
            }
            let arrays = body.sorted_arrays(&def).unwrap();
            let ours = write_columns(&def, &arrays, 3).unwrap();
            let mut theirs = Vec::new();
            let mut writer = ArrowWriter::try_new(
                &mut theirs,
                body_schema(&def),
                Some(writer_properties(&def, 3)),
            )
            .unwrap();
            let batch = RecordBatch::try_new(body_schema(&def), arrays).unwrap();
            writer.write(&batch).unwrap();
            writer.close().unwrap();
            assert_eq!(ours.len(), theirs.len(), "{name}");
            assert!(ours == theirs, "{name}: the files differ");
        }
    }
}
