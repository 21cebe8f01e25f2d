//! Whether a table holds landed files that its offsets place in it (after a crash or a
//! rebalance, a partition's next owner lands or adopts them again): a file is held when the
//! table lists it at its key, or when a data file of the table holds its whole offset range of
//! its Kafka partition by its `_kafka_partition` and `_offset` bounds, as the output of a compaction
//! (Spark's `rewrite_data_files`, or the sink's own) does for the files it replaced.
//!
//! Only the data manifests whose partition summaries may hold one of the files' partition
//! values are read, so the lookup costs the manifests of the hours (or days) of the files
//! looked up, not the whole table.

use std::collections::HashSet;

use iceberg::spec::{
    DataFile, Literal, ManifestContentType, ManifestFile, PrimitiveLiteral, Struct, TableMetadata,
};
use schemas::arrow::{COL_OFFSET, TABLE_COL_PARTITION};

use super::{Landed, metadata, read_uri, stats};
use crate::store::ObjectStore;

/// The single integer of a partition value of a one-field spec (a day or an hour), if it has
/// that shape.
pub(super) fn partition_int(value: &Struct) -> Option<i32> {
    match value.fields() {
        [Some(Literal::Primitive(PrimitiveLiteral::Int(v)))] => Some(*v),
        _ => None,
    }
}

/// The range of partition values a data manifest of the default spec lists, from its
/// partition summary (a one-field spec of integers); `None` when the summary cannot say.
pub(super) fn summary_range(manifest: &ManifestFile, default_spec: i32) -> Option<(i32, i32)> {
    let summary = match manifest.partitions.as_deref() {
        Some([summary]) if manifest.partition_spec_id == default_spec => summary,
        _ => return None,
    };
    let bound = |b: Option<&Vec<u8>>| {
        <[u8; 4]>::try_from(b?.as_slice())
            .ok()
            .map(i32::from_le_bytes)
    };
    Some((
        bound(summary.lower_bound.as_deref())?,
        bound(summary.upper_bound.as_deref())?,
    ))
}

/// Whether a manifest listing partition values in `range` (unknown: `None`) may list a data
/// file of a partition in `wanted` (the files' values; `None` for one without an integer
/// value).
pub(super) fn may_hold(range: Option<(i32, i32)>, wanted: &[Option<i32>]) -> bool {
    let Some((low, high)) = range else {
        return true;
    };
    wanted
        .iter()
        .any(|w| w.is_none_or(|v| (low..=high).contains(&v)))
}

/// An integer bound of a data file's column.
fn int_bound(
    bounds: &std::collections::HashMap<i32, iceberg::spec::Datum>,
    id: i32,
) -> Option<i64> {
    match bounds.get(&id)?.literal() {
        PrimitiveLiteral::Int(v) => Some(i64::from(*v)),
        PrimitiveLiteral::Long(v) => Some(*v),
        _ => None,
    }
}

/// The offsets a data file holds of one Kafka partition, by its bounds: `(partition range,
/// offset range)`.
pub(super) fn ranges(file: &DataFile, ids: (i32, i32)) -> Option<((i64, i64), (i64, i64))> {
    let (partition, offset) = ids;
    Some((
        (
            int_bound(file.lower_bounds(), partition)?,
            int_bound(file.upper_bounds(), partition)?,
        ),
        (
            int_bound(file.lower_bounds(), offset)?,
            int_bound(file.upper_bounds(), offset)?,
        ),
    ))
}

/// The offsets of a landed file's first and last row, from its `_offset` statistics: inside
/// its range, which also counts the records skipped at its edges (duplicates, dead letters),
/// whose offsets a compacted file's bounds need not hold.
fn rows_offsets(file: &Landed) -> (i64, i64) {
    let column = file.stats.columns.get(COL_OFFSET);
    let bound = |b: Option<&stats::Bound>| match b {
        Some(stats::Bound::Int(v)) => Some(*v),
        _ => None,
    };
    (
        column
            .and_then(|c| bound(c.min.as_ref()))
            .unwrap_or(file.first),
        column
            .and_then(|c| bound(c.max.as_ref()))
            .unwrap_or(file.last),
    )
}

/// For each of `files`, whether the current snapshot of `table` holds it (see the module).
pub async fn held(
    store: &ObjectStore,
    table: &TableMetadata,
    files: &[&Landed],
) -> anyhow::Result<Vec<bool>> {
    let mut held = vec![false; files.len()];
    let Some(snapshot) = table.current_snapshot() else {
        return Ok(held);
    };
    let schema = table.current_schema();
    let ids = schema
        .field_by_name(TABLE_COL_PARTITION)
        .zip(schema.field_by_name(COL_OFFSET))
        .map(|(p, o)| (p.id, o.id));
    let wanted: Vec<Option<i32>> = files
        .iter()
        .map(|f| {
            metadata::data_file(table, String::new(), f)
                .ok()
                .and_then(|d| partition_int(d.partition()))
        })
        .collect();
    let uris: Vec<String> = files.iter().map(|f| store.uri(&f.key)).collect();
    let by_uri: HashSet<&str> = uris.iter().map(String::as_str).collect();
    let default_spec = table.default_partition_spec_id();
    let list = read_uri(store, snapshot.manifest_list()).await?;
    for manifest in metadata::manifests_of(&list)? {
        if manifest.content != ManifestContentType::Data
            || !may_hold(summary_range(&manifest, default_spec), &wanted)
        {
            continue;
        }
        let bytes = read_uri(store, &manifest.manifest_path).await?;
        let manifest = iceberg::spec::Manifest::parse_avro(&bytes)?;
        for entry in manifest.entries().iter().filter(|e| e.is_alive()) {
            let data = entry.data_file();
            if by_uri.contains(data.file_path()) {
                for (i, uri) in uris.iter().enumerate() {
                    held[i] |= uri == data.file_path();
                }
                continue;
            }
            let Some(((p_low, p_high), (o_low, o_high))) = ids.and_then(|ids| ranges(data, ids))
            else {
                continue;
            };
            for (i, f) in files.iter().enumerate() {
                let (first, last) = rows_offsets(f);
                held[i] |= (p_low..=p_high).contains(&i64::from(f.partition))
                    && o_low <= first
                    && last <= o_high;
            }
        }
        if held.iter().all(|&h| h) {
            break;
        }
    }
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_are_skipped_only_when_their_summary_rules_the_partitions_out() {
        let hours = [Some(100), Some(205)];
        assert!(may_hold(Some((90, 110)), &hours));
        assert!(may_hold(Some((205, 205)), &hours));
        assert!(!may_hold(Some((101, 204)), &hours));
        // No summary (or another spec's), a file without a partition value: read.
        assert!(may_hold(None, &hours));
        assert!(may_hold(Some((101, 204)), &[None]));
    }
}
