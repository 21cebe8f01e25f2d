//! The order of rows in Parquet bodies and landing files, and reading cells back as values.
//!
//! Rows are laid out by series (the partition key, then the stream's other string fields, e.g.
//! the sensor), then event time, keeping arrival order among equals: consecutive rows of one
//! series make timestamps and values delta-friendly and strings run-length friendly.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, Int64Array, ListArray, MapArray, StringArray, UInt32Array,
};
use arrow::buffer::{BooleanBuffer, NullBuffer, OffsetBuffer};
use arrow::compute::take;
use arrow::datatypes::{DataType, Float64Type, Int64Type, TimestampMicrosecondType};
use arrow::error::ArrowError;
use smallvec::SmallVec;

use crate::stream::{FieldType, StreamDef};
use crate::value::Value;

/// Arrow's `take` of `order`'s rows, except that a list or map column is taken through its
/// offsets and its items' arrays: `take` copies a list or map through `MutableArrayData`, a row
/// at a time (550 instructions a row for bench-agent's maps of two entries, against 180).
pub(crate) fn take_rows(array: &ArrayRef, order: &UInt32Array) -> Result<ArrayRef, ArrowError> {
    let positions = |offsets: &OffsetBuffer<i32>, nulls: Option<&NullBuffer>| {
        let mut items = Vec::with_capacity((offsets[offsets.len() - 1] - offsets[0]) as usize);
        let mut taken = Vec::with_capacity(order.len() + 1);
        taken.push(0i32);
        for &row in order.values() {
            let (start, end) = (offsets[row as usize], offsets[row as usize + 1]);
            items.extend(start as u32..end as u32);
            taken.push(items.len() as i32);
        }
        let nulls = nulls.map(|n| {
            NullBuffer::new(BooleanBuffer::from_iter(
                order.values().iter().map(|&row| n.is_valid(row as usize)),
            ))
        });
        (
            OffsetBuffer::new(taken.into()),
            UInt32Array::from(items),
            nulls,
        )
    };
    Ok(match array.data_type() {
        DataType::List(field) => {
            let list = array.as_list::<i32>();
            let (offsets, items, nulls) = positions(list.offsets(), list.nulls());
            let values = take(list.values().as_ref(), &items, None)?;
            Arc::new(ListArray::try_new(field.clone(), offsets, values, nulls)?)
        }
        DataType::Map(field, ordered) => {
            let map = array.as_map();
            let (offsets, items, nulls) = positions(map.offsets(), map.nulls());
            let entries = take(map.entries(), &items, None)?;
            Arc::new(MapArray::try_new(
                field.clone(),
                offsets,
                entries.as_struct().clone(),
                nulls,
                *ordered,
            )?)
        }
        _ => take(array.as_ref(), order, None)?,
    })
}

/// Row indices in series order (the module's). Rows are numbered by series first
/// (a batch holds few: its devices' sensors), the series ranked by their key values, and rows
/// sorted by (series rank, event time, arrival). Comparing the strings for every pair of rows
/// cost more than twice as much (1,950 against 830 instructions per row on bench-agent's data).
pub(crate) fn sort_order(def: &StreamDef, arrays: &[ArrayRef]) -> UInt32Array {
    let columns: Vec<SeriesColumn<'_>> = std::iter::once(def.partition_key)
        .chain(
            (0..def.fields.len())
                .filter(|&i| i != def.partition_key && def.fields[i].ty == FieldType::String),
        )
        .map(|i| SeriesColumn::of(arrays[i].as_ref()))
        .collect();
    let time = arrays[def.event_time].as_primitive_opt::<TimestampMicrosecondType>();
    let rows = arrays.first().map_or(0, |a| a.len());
    let mut ids: foldhash::HashMap<SeriesKey<'_>, u32> = foldhash::HashMap::default();
    let series: Vec<u32> = (0..rows)
        .map(|row| {
            let key = columns.iter().map(|c| c.at(row)).collect();
            let next = ids.len() as u32;
            *ids.entry(key).or_insert(next)
        })
        .collect();
    let mut ranked: Vec<(SeriesKey<'_>, u32)> = ids.into_iter().collect();
    ranked.sort_unstable();
    let mut rank = vec![0u32; ranked.len()];
    for (r, (_, id)) in ranked.iter().enumerate() {
        rank[*id as usize] = r as u32;
    }
    let time_at = |row: u32| match time {
        Some(t) if t.is_valid(row as usize) => t.value(row as usize),
        _ => 0,
    };
    // Rows by series rank, counted out (stable: arrival order within a series)...
    let mut starts = vec![0usize; ranked.len() + 1];
    for &id in &series {
        starts[rank[id as usize] as usize + 1] += 1;
    }
    for r in 1..starts.len() {
        starts[r] += starts[r - 1];
    }
    let mut next = starts.clone();
    let mut order = vec![0u32; rows];
    for (row, &id) in series.iter().enumerate() {
        let slot = &mut next[rank[id as usize] as usize];
        order[*slot] = row as u32;
        *slot += 1;
    }
    // ...then each series by event time where its rows did not arrive in time order (stable:
    // arrival order among equal times). Sensors mostly report in order, so this is mostly a
    // check. A sort of (rank, time, arrival) triples cost 540 instructions a row.
    for range in starts.windows(2) {
        let run = &mut order[range[0]..range[1]];
        if !run.is_sorted_by_key(|&row| time_at(row)) {
            run.sort_by_key(|&row| time_at(row));
        }
    }
    UInt32Array::from(order)
}

/// The values of a row's series columns.
type SeriesKey<'a> = SmallVec<[KeyValue<'a>; 4]>;

/// A row's value in a series column: strings and integers order rows, nulls first; a column of
/// another type orders nothing. (Nulls must order too: a null that tied with every string made
/// the order intransitive, and Rust's sort may panic on that.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum KeyValue<'a> {
    Null,
    Str(&'a str),
    Int(i64),
    Unordered,
}

/// A series column, its type looked up once.
enum SeriesColumn<'a> {
    Str(&'a StringArray),
    Int(&'a Int64Array),
    Other,
}

impl SeriesColumn<'_> {
    fn of(array: &dyn Array) -> SeriesColumn<'_> {
        if let Some(s) = array.as_string_opt::<i32>() {
            SeriesColumn::Str(s)
        } else if let Some(i) = array.as_primitive_opt::<Int64Type>() {
            SeriesColumn::Int(i)
        } else {
            SeriesColumn::Other
        }
    }

    fn at(&self, row: usize) -> KeyValue<'_> {
        match self {
            SeriesColumn::Str(s) if s.is_valid(row) => KeyValue::Str(s.value(row)),
            SeriesColumn::Int(i) if i.is_valid(row) => KeyValue::Int(i.value(row)),
            SeriesColumn::Str(_) | SeriesColumn::Int(_) => KeyValue::Null,
            SeriesColumn::Other => KeyValue::Unordered,
        }
    }
}

/// The value of one cell. The column's type was checked against `ty` before.
pub(crate) fn value_at(array: &dyn Array, ty: &FieldType, row: usize) -> Value {
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
