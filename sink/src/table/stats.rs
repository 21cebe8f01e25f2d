//! What a table's manifest says of each data file beyond its path and row count: its
//! partition value and its columns' statistics (sizes, value and null counts, lower and upper
//! bounds), so that a reader skips the files a filter rules out without opening them.
//!
//! The statistics come from the file's own Parquet footer, which the sink reads from the staged
//! file when it finishes one and from the object when it adopts one. They are kept by column
//! name and bound to field ids only at commit, from the table's current schema (a newer
//! definition may have added columns).

use std::collections::HashMap;

use chrono::{DateTime, NaiveDate, Utc};
use iceberg::spec::{DataFileBuilder, Datum, Literal, PrimitiveType, Schema, Struct, Type};
use parquet::file::metadata::ParquetMetaData;
use parquet::file::statistics::Statistics;
use schemas::arrow::{COL_INGEST_TS, COL_PARTITION, TABLE_COL_PARTITION};

/// One bound of a column's values, as the Parquet statistics give it.
#[derive(Debug, Clone, PartialEq)]
pub enum Bound {
    Bool(bool),
    Int(i64),
    Double(f64),
    Text(String),
}

/// The statistics of one top-level column of a file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ColumnStats {
    /// Values, nulls included.
    pub values: u64,
    pub nulls: Option<u64>,
    /// Compressed bytes of the column's chunks.
    pub bytes: u64,
    pub min: Option<Bound>,
    pub max: Option<Bound>,
}

/// The statistics of a file's top-level columns, by name. Nested columns (lists and maps)
/// have none: their values do not line up with the rows.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FileStats {
    pub columns: HashMap<String, ColumnStats>,
}

fn bounds(stats: &Statistics) -> (Option<Bound>, Option<Bound>) {
    match stats {
        Statistics::Boolean(s) => (
            s.min_opt().map(|&v| Bound::Bool(v)),
            s.max_opt().map(|&v| Bound::Bool(v)),
        ),
        Statistics::Int32(s) => (
            s.min_opt().map(|&v| Bound::Int(v.into())),
            s.max_opt().map(|&v| Bound::Int(v.into())),
        ),
        Statistics::Int64(s) => (
            s.min_opt().map(|&v| Bound::Int(v)),
            s.max_opt().map(|&v| Bound::Int(v)),
        ),
        // NaN is no bound: Iceberg keeps NaN out of a column's bounds.
        Statistics::Double(s) => (
            s.min_opt()
                .filter(|v| !v.is_nan())
                .map(|&v| Bound::Double(v)),
            s.max_opt()
                .filter(|v| !v.is_nan())
                .map(|&v| Bound::Double(v)),
        ),
        // A truncated minimum is a prefix of the real one and still a lower bound; the writer
        // truncates a maximum only by incrementing it, so it is still an upper bound.
        Statistics::ByteArray(s) => (
            s.min_opt()
                .and_then(|v| std::str::from_utf8(v.data()).ok())
                .map(|v| Bound::Text(v.to_owned())),
            s.max_opt()
                .and_then(|v| std::str::from_utf8(v.data()).ok())
                .map(|v| Bound::Text(v.to_owned())),
        ),
        _ => (None, None),
    }
}

fn merge(a: Option<Bound>, b: Option<Bound>, keep_min: bool) -> Option<Bound> {
    let (a, b) = (a?, b?);
    let a_first = match (&a, &b) {
        (Bound::Bool(x), Bound::Bool(y)) => x <= y,
        (Bound::Int(x), Bound::Int(y)) => x <= y,
        (Bound::Double(x), Bound::Double(y)) => x <= y,
        (Bound::Text(x), Bound::Text(y)) => x <= y,
        _ => return None,
    };
    Some(if a_first == keep_min { a } else { b })
}

impl FileStats {
    /// The statistics of a file from its footer. A bound missing from any row group leaves the
    /// column without that bound.
    pub fn of(meta: &ParquetMetaData) -> FileStats {
        let mut columns: HashMap<String, ColumnStats> = HashMap::new();
        for (group_index, group) in meta.row_groups().iter().enumerate() {
            for chunk in group.columns() {
                let path = chunk.column_path().parts();
                let [name] = path else { continue };
                let (min, max) = chunk.statistics().map(bounds).unwrap_or((None, None));
                let nulls = chunk.statistics().and_then(|s| s.null_count_opt());
                let values = chunk.num_values().max(0) as u64;
                let bytes = chunk.compressed_size().max(0) as u64;
                match columns.get_mut(name) {
                    Some(c) if group_index > 0 => {
                        c.values += values;
                        c.nulls = c.nulls.zip(nulls).map(|(a, b)| a + b);
                        c.bytes += bytes;
                        c.min = merge(c.min.take(), min, true);
                        c.max = merge(c.max.take(), max, false);
                    }
                    _ => {
                        columns.insert(
                            name.clone(),
                            ColumnStats {
                                values,
                                nulls,
                                bytes,
                                min,
                                max,
                            },
                        );
                    }
                }
            }
        }
        FileStats { columns }
    }

    /// Sets the column statistics of `file` by the field ids of `schema`. A column the schema
    /// does not have, or whose bound does not fit its type, gets no statistics.
    pub fn describe(&self, schema: &Schema, file: &mut DataFileBuilder) {
        let (mut sizes, mut values, mut nulls) = (HashMap::new(), HashMap::new(), HashMap::new());
        let (mut lower, mut upper) = (HashMap::new(), HashMap::new());
        for (name, stats) in &self.columns {
            let name = match name.as_str() {
                COL_PARTITION => TABLE_COL_PARTITION,
                name => name,
            };
            let Some(field) = schema.field_by_name(name) else {
                continue;
            };
            let Type::Primitive(ty) = field.field_type.as_ref() else {
                continue;
            };
            sizes.insert(field.id, stats.bytes);
            values.insert(field.id, stats.values);
            if let Some(n) = stats.nulls {
                nulls.insert(field.id, n);
            }
            if let Some(d) = stats.min.as_ref().and_then(|b| datum(ty, b)) {
                lower.insert(field.id, d);
            }
            if let Some(d) = stats.max.as_ref().and_then(|b| datum(ty, b)) {
                upper.insert(field.id, d);
            }
        }
        file.column_sizes(sizes)
            .value_counts(values)
            .null_value_counts(nulls)
            .lower_bounds(lower)
            .upper_bounds(upper);
    }
}

fn datum(ty: &PrimitiveType, bound: &Bound) -> Option<Datum> {
    Some(match (ty, bound) {
        (PrimitiveType::Boolean, Bound::Bool(v)) => Datum::bool(*v),
        (PrimitiveType::Int, Bound::Int(v)) => Datum::int(i32::try_from(*v).ok()?),
        (PrimitiveType::Long, Bound::Int(v)) => Datum::long(*v),
        (PrimitiveType::Timestamptz, Bound::Int(v)) => Datum::timestamptz_micros(*v),
        (PrimitiveType::Double, Bound::Double(v)) => Datum::double(*v),
        (PrimitiveType::String, Bound::Text(v)) => Datum::string(v),
        _ => return None,
    })
}

/// The hour (µs since the epoch) a landing file's key places it in: every row of the file was
/// ingested within that hour (the sink starts a new file at each hour of ingest time).
pub fn ingest_hour_of_key(key: &str) -> Option<i64> {
    let date = key.split("/date=").nth(1)?.get(..10)?;
    let hour: u32 = key.split("/hour=").nth(1)?.get(..2)?.parse().ok()?;
    let at = NaiveDate::parse_from_str(date, "%Y-%m-%d")
        .ok()?
        .and_hms_opt(hour, 0, 0)?;
    Some(DateTime::<Utc>::from_naive_utc_and_offset(at, Utc).timestamp_micros())
}

/// The partition value of a file whose rows were all ingested in the hour starting at `hour`
/// (µs), under `spec`, whose fields must all be transforms of the ingest time.
pub fn partition_of(
    spec: &iceberg::spec::PartitionSpec,
    schema: &Schema,
    hour: i64,
) -> iceberg::Result<Struct> {
    let mut values = Vec::new();
    for field in spec.fields() {
        let source = schema.field_by_id(field.source_id);
        if source.is_none_or(|f| f.name != COL_INGEST_TS) {
            return Err(iceberg::Error::new(
                iceberg::ErrorKind::FeatureUnsupported,
                format!(
                    "the table's partition field {} is not a transform of {COL_INGEST_TS}, the only column the sink partitions by",
                    field.name
                ),
            ));
        }
        let function = iceberg::transform::create_transform_function(&field.transform)?;
        let value = function.transform_literal_result(&Datum::timestamptz_micros(hour))?;
        values.push(Some(Literal::from(value)));
    }
    Ok(Struct::from_iter(values))
}
