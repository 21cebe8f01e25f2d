//! Landing rows: content hashes computed again from a landed row equal the hash of the record
//! as produced, whatever the field types and values, after the rows are sorted into series
//! order and written to Parquet and read back.

use std::sync::Arc;

use ::arrow::array::{AsArray, RecordBatch};
use ::arrow::datatypes::Int64Type;
use bytes::Bytes;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use proptest::prelude::*;
use serde_json::{Value as Json, json};

use crate::arrow::{BatchBuilder, COL_CONTENT_HASH, COL_OFFSET, HashColumn, RowMeta, row_hashes};
use crate::*;

/// A stream with a field of every type, every field hashed.
fn every_type() -> Arc<StreamDef> {
    let text = r#"
name = "every_type"
version = 1
event_time_field = "at"
partition_key_field = "site"
[[fields]]
name = "site"
type = "string"
required = true
[[fields]]
name = "at"
type = "timestamp"
required = true
[[fields]]
name = "label"
type = "string"
[[fields]]
name = "on"
type = "bool"
[[fields]]
name = "count"
type = "int64"
[[fields]]
name = "reading"
type = "float64"
[[fields]]
name = "seen"
type = "timestamp"
[[fields]]
name = "codes"
type = "list<string>"
[[fields]]
name = "levels"
type = "list<float64>"
[[fields]]
name = "attrs"
type = "map<string>"
[[fields]]
name = "limits"
type = "map<int64>"
"#;
    Arc::new(StreamDef::from_toml(text).unwrap())
}

fn arb_text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z]{0,6}",
        Just("Grüße, 東京 🌡".to_owned()),
        Just("quote \" backslash \\ tab \t".to_owned()),
        "\\PC{0,8}",
    ]
}

fn arb_float() -> impl Strategy<Value = Json> {
    prop_oneof![
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        Just(json!(-0.0)),
        Just(json!(1e308)),
        Just(json!(-1e308)),
        Just(json!(5e-324)),
        (-1000i64..1000).prop_map(|i| json!(i)),
    ]
}

fn arb_timestamp() -> impl Strategy<Value = Json> {
    prop_oneof![
        (0i64..4_000_000_000_000).prop_map(|ms| json!(ms)),
        (0i64..4_000_000_000, 0u32..1_000_000, -14i32..=14, 0u32..60).prop_map(
            |(s, micros, hours, minutes)| {
                let t = chrono::DateTime::from_timestamp(s, micros * 1000).unwrap();
                let sign = if hours < 0 { '-' } else { '+' };
                let text = format!(
                    "{}{sign}{:02}:{minutes:02}",
                    t.format("%Y-%m-%dT%H:%M:%S%.6f"),
                    hours.unsigned_abs()
                );
                json!(text)
            }
        ),
        Just(json!("2026-11-28T02:00:00Z")),
    ]
}

fn maybe(value: impl Strategy<Value = Json>) -> impl Strategy<Value = Json> {
    prop_oneof![1 => Just(Json::Null), 3 => value]
}

fn arb_record() -> impl Strategy<Value = Json> {
    let map = |value: BoxedStrategy<Json>| {
        prop::collection::btree_map(arb_text(), value, 0..4)
            .prop_map(|m| Json::Object(m.into_iter().collect()))
    };
    (
        prop::sample::select(vec!["a", "b", "c", "ü"]),
        arb_timestamp(),
        maybe(arb_text().prop_map(Json::String)),
        maybe(any::<bool>().prop_map(Json::Bool)),
        maybe(any::<i64>().prop_map(|i| json!(i))),
        maybe(arb_float()),
        maybe(arb_timestamp()),
        maybe(
            prop::collection::vec(maybe(arb_text().prop_map(Json::String)), 0..4)
                .prop_map(Json::Array),
        ),
        maybe(prop::collection::vec(maybe(arb_float()), 0..4).prop_map(Json::Array)),
        maybe(map(maybe(arb_text().prop_map(Json::String)).boxed())),
        maybe(map(maybe(any::<i64>().prop_map(|i| json!(i))).boxed())),
    )
        .prop_map(
            |(site, at, label, on, count, reading, seen, codes, levels, attrs, limits)| {
                json!({
                    "site": site, "at": at, "label": label, "on": on, "count": count,
                    "reading": reading, "seen": seen, "codes": codes, "levels": levels,
                    "attrs": attrs, "limits": limits,
                })
            },
        )
}

/// Writes `batch` to Parquet and reads it back whole.
fn through_parquet(batch: &RecordBatch) -> RecordBatch {
    let mut file = Vec::new();
    let mut writer = ArrowWriter::try_new(&mut file, batch.schema(), None).unwrap();
    writer.write(batch).unwrap();
    writer.close().unwrap();
    let reader = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(file))
        .unwrap()
        .build()
        .unwrap();
    let batches: Vec<RecordBatch> = reader.map(Result::unwrap).collect();
    ::arrow::compute::concat_batches(&batch.schema(), &batches).unwrap()
}

/// The landed rows' hashes, computed again, by their `_offset`.
fn recomputed_by_offset(def: &StreamDef, landed: &RecordBatch) -> Vec<(i64, ContentHash)> {
    let offsets = landed.column_by_name(COL_OFFSET).unwrap();
    let offsets = offsets.as_primitive::<Int64Type>();
    let hashes = row_hashes(def, landed, 0..landed.num_rows()).unwrap();
    let mut by_offset: Vec<(i64, ContentHash)> =
        offsets.values().iter().copied().zip(hashes).collect();
    by_offset.sort_by_key(|&(offset, _)| offset);
    by_offset
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Records checked as the gateway checks them (the scanned row, and the record where the
    /// scanner declines), landed in series order through Parquet: every row's hash computed
    /// again from its columns is the hash the record had when it was produced, and the file's
    /// `_content_hash` column, where kept, holds it.
    #[test]
    fn a_landed_rows_hash_computed_again_is_the_records_hash(
        records in prop::collection::vec(arb_record(), 1..40),
        keep in prop::sample::select(vec![HashColumn::None, HashColumn::Short, HashColumn::Full]),
    ) {
        let def = every_type();
        let mut builder = BatchBuilder::new(&def, keep, records.len());
        let mut produced = Vec::new();
        for (offset, json) in records.iter().enumerate() {
            let line = json.to_string().into_bytes();
            let checked = crate::check_bytes(&def, &line).unwrap();
            let meta = RowMeta { ingest_ts: 1, partition: 0, offset: offset as i64, hash: checked.hash };
            builder.push_record(&checked.record, meta);
            produced.push((offset as i64, checked.hash));
        }
        let landed = through_parquet(&builder.finish_sorted(&def).unwrap());
        prop_assert_eq!(recomputed_by_offset(&def, &landed), produced.clone());
        match landed.column_by_name(COL_CONTENT_HASH) {
            None => prop_assert_eq!(keep, HashColumn::None),
            Some(column) => {
                let column = column.as_fixed_size_binary();
                prop_assert_eq!(column.value_length() as usize, keep.bytes());
                let offsets = landed.column_by_name(COL_OFFSET).unwrap();
                let offsets = offsets.as_primitive::<Int64Type>();
                for row in 0..landed.num_rows() {
                    let hash = produced[offsets.value(row) as usize].1;
                    prop_assert_eq!(column.value(row), &hash.as_bytes()[..keep.bytes()]);
                }
            }
        }
    }
}

/// The sample streams' scanned rows (the sink's path: `check_bytes_row`) land with the hashes
/// their records have, in series order.
#[test]
fn scanned_rows_land_with_their_records_hashes() {
    for name in ["sensor_readings", "vehicle_telemetry"] {
        let def = example_streams().get(name).unwrap().clone();
        let lines = super::sample_lines(&def, 2_000);
        let mut builder = BatchBuilder::new(&def, HashColumn::None, lines.len());
        let mut produced = Vec::new();
        for (offset, line) in lines.iter().enumerate() {
            let row = crate::check_bytes_row(&def, line).unwrap();
            let meta = RowMeta {
                ingest_ts: 1,
                partition: 0,
                offset: offset as i64,
                hash: row.hash,
            };
            builder.push(&row, meta);
            produced.push((offset as i64, crate::check_bytes(&def, line).unwrap().hash));
        }
        let landed = through_parquet(&builder.finish_sorted(&def).unwrap());
        assert!(landed.column_by_name(COL_CONTENT_HASH).is_none());
        assert_eq!(recomputed_by_offset(&def, &landed), produced, "{name}");
        let offsets = landed.column_by_name(COL_OFFSET).unwrap();
        let in_order = offsets.as_primitive::<Int64Type>().values().is_sorted();
        assert!(!in_order, "{name}: the rows are not in series order");
    }
}

/// A hash covers only the fields named; a batch of only those columns is enough, and a missing
/// required one is an error naming it.
#[test]
fn hashes_need_only_the_hashed_columns() {
    let def = example_streams().get("sensor_readings").unwrap().clone();
    let line = br#"{"device_id":"d","sensor":"s","ts":5,"value":1.5,"tags":{"a":"b"}}"#;
    let checked = crate::check_bytes(&def, line).unwrap();
    let meta = RowMeta {
        ingest_ts: 1,
        partition: 0,
        offset: 0,
        hash: checked.hash,
    };
    let mut builder = BatchBuilder::new(&def, HashColumn::None, 1);
    builder.push_record(&checked.record, meta);
    let batch = builder.finish().unwrap();
    let hashed: Vec<usize> = def
        .hash_fields
        .iter()
        .map(|&f| batch.schema().index_of(&def.fields[f].name).unwrap())
        .collect();
    let only_hashed = batch.project(&hashed).unwrap();
    assert_eq!(
        row_hashes(&def, &only_hashed, [0]).unwrap(),
        vec![checked.hash]
    );
    let without_ts = batch
        .project(&[batch.schema().index_of("device_id").unwrap()])
        .unwrap();
    let error = row_hashes(&def, &without_ts, [0]).unwrap_err().to_string();
    assert!(error.contains("no column 'sensor'"), "{error}");
    assert!(
        row_hashes(&def, &batch, [1]).is_err(),
        "a row past the batch"
    );
}
