//! Compaction by the sink (`[table.compaction]`): once a partition of a stream's table (a day
//! or an hour of ingest time) is closed, the small files of each Kafka partition in it are
//! rewritten into files of about the target size, and one `replace` snapshot removes the small
//! files from the table and adds the large ones.
//!
//! Why exactly once still holds:
//! - The snapshot is built on one version of the table and committed by the catalog only onto
//!   that version, like every append. After a conflict it is built again on the new version if
//!   every file it removes is still there; otherwise its files are deleted and nothing changes.
//! - A compacted file holds the rows of the files it replaces, of one Kafka partition, in their
//!   offset order, and nothing else. So its `_kafka_partition` and `_offset` bounds hold the
//!   offsets of each of them, which is how a partition's next owner finds a landed file that the
//!   table holds only in compacted form (`lookup::held`).
//! - The table's offsets property is carried as it is: a compaction moves no offset.
//! - Partitions where another writer deleted rows (position or equality delete files) are left
//!   alone: a rewrite would bring rows that a delete file names by their file back.
//!
//! The landing files stay where they are: readers of the landing folders read them as before,
//! and the compacted files go under `<table location>/.compacted/`, a hidden folder that those
//! readers skip. Only the table lists the compacted ones.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use anyhow::Context;
use arrow::array::{ArrayRef, RecordBatch, new_null_array};
use arrow::datatypes::SchemaRef;
use bytes::Bytes;
use iceberg::spec::{
    DataFile, ManifestContentType, ManifestFile, ManifestStatus, Struct, TableMetadata, Transform,
};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::metadata::{KeyValue, ParquetMetaDataReader};
use schemas::StreamDef;
use schemas::arrow::{COL_CONTENT_HASH, COL_OFFSET, HashColumn, TABLE_COL_PARTITION};

use super::config::CompactionConfig;
use super::{catalog, lookup, metadata, read_uri, stats};
use crate::metrics as m;
use crate::parquet_file::{
    META_FIRST_OFFSET, META_LAST_OFFSET, META_MAX_EVENT_TIME, META_MIN_EVENT_TIME, META_ROW_COUNT,
};
use crate::store::ObjectStore;

/// Closed partitions older than this many days are not looked at: the manifests of older ones
/// are skipped by their partition summaries, so a run reads the manifests of the last week.
pub const LOOKBACK_DAYS: i64 = 7;

/// Compacted files a run writes at most; a later run goes on with the rest.
const MAX_OUTPUTS_PER_RUN: usize = 16;

/// Times a replace is built again on a newer version of the table before the run gives up.
const MAX_ATTEMPTS: usize = 5;

/// What a run did to one table.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Per partition value (days or hours since the epoch) that was compacted: the files it
    /// rewrote and the files it wrote instead.
    pub partitions: BTreeMap<i32, (usize, usize)>,
    /// Files removed from the table and files added.
    pub removed: usize,
    pub added: usize,
}

/// A live data file of the current snapshot.
#[derive(Debug, Clone)]
struct Live {
    file: DataFile,
    /// The table's partition value.
    value: i32,
    /// Its Kafka partition and its lowest offset, by its column bounds.
    kafka_partition: i64,
    first_offset: i64,
}

/// The end (Unix ms) of partition `value` of a `day` or `hour` spec; `None` for other specs.
fn partition_end_ms(transform: Transform, value: i32) -> Option<i64> {
    match transform {
        Transform::Day => Some((i64::from(value) + 1) * 86_400_000),
        Transform::Hour => Some((i64::from(value) + 1) * 3_600_000),
        _ => None,
    }
}

/// The partition value of the day or hour holding `ms`.
fn partition_value_of(transform: Transform, ms: i64) -> i32 {
    let unit = if transform == Transform::Day {
        86_400_000
    } else {
        3_600_000
    };
    ms.div_euclid(unit) as i32
}

/// The files to rewrite together: per closed partition and Kafka partition, its small files
/// in offset order, cut into runs of at most `target` bytes; runs of one file are left.
fn plan(live: Vec<Live>, target: u64) -> Vec<Vec<Live>> {
    let mut groups: BTreeMap<(i32, i64), Vec<Live>> = BTreeMap::new();
    for file in live {
        groups
            .entry((file.value, file.kafka_partition))
            .or_default()
            .push(file);
    }
    let mut runs = Vec::new();
    for (_, mut files) in groups {
        files.sort_by_key(|f| f.first_offset);
        let mut run: Vec<Live> = Vec::new();
        let mut bytes = 0;
        for file in files {
            let size = file.file.file_size_in_bytes();
            if !run.is_empty() && bytes + size > target {
                runs.push(std::mem::take(&mut run));
                bytes = 0;
            }
            bytes += size;
            run.push(file);
        }
        runs.push(run);
    }
    runs.retain(|r| r.len() >= 2);
    runs
}

/// Compacts the closed partitions of `namespace.table` (see the module). `now_ms` decides
/// which partitions are closed.
pub async fn compact_table(
    catalog: &catalog::Catalog,
    store: &ObjectStore,
    (namespace, table): (&str, &str),
    def: &StreamDef,
    config: &CompactionConfig,
    now_ms: i64,
) -> anyhow::Result<Report> {
    let mut report = Report::default();
    let Some(base) = catalog.load(store, namespace, table).await? else {
        return Ok(report);
    };
    let meta = &base.metadata;
    let spec = meta.default_partition_spec();
    let [field] = spec.fields() else {
        return Ok(report);
    };
    let transform = field.transform;
    if partition_end_ms(transform, 0).is_none() || meta.current_snapshot().is_none() {
        return Ok(report);
    }
    let oldest = partition_value_of(transform, now_ms - LOOKBACK_DAYS * 86_400_000);
    let closed_before = partition_value_of(transform, now_ms - config.delay_ms as i64);
    let live = candidates(
        store,
        meta,
        (oldest, closed_before),
        config.target_bytes / 2,
    )
    .await?;
    let mut runs = plan(live, config.target_bytes);
    runs.truncate(MAX_OUTPUTS_PER_RUN);
    if runs.is_empty() {
        return Ok(report);
    }
    let location = meta.location().trim_end_matches('/').to_owned();
    let mut added: Vec<(DataFile, String)> = Vec::new();
    let mut removed = HashSet::new();
    for run in &runs {
        match rewrite(store, meta, def, &location, run).await {
            Ok(file) => {
                added.push(file);
                removed.extend(run.iter().map(|f| f.file.file_path().to_owned()));
                let counts = report.partitions.entry(run[0].value).or_default();
                counts.0 += run.len();
                counts.1 += 1;
            }
            Err(e) => tracing::warn!(
                table,
                partition = run[0].value,
                kafka_partition = run[0].kafka_partition,
                error = %format!("{e:#}"),
                "cannot compact these files; they stay as they are"
            ),
        }
    }
    if added.is_empty() {
        return Ok(report);
    }
    let values: Vec<Option<i32>> = report.partitions.keys().map(|&v| Some(v)).collect();
    let committed = commit(
        catalog,
        store,
        (namespace, table),
        &added,
        (&removed, &values),
    )
    .await;
    if !matches!(committed, Ok(true)) {
        for (_, key) in &added {
            let _ = store.delete(key).await;
        }
    }
    if !committed? {
        ::metrics::counter!(m::TABLE_COMPACTIONS, "stream" => table.to_owned(), "result" => "abandoned").increment(1);
        return Ok(Report::default());
    }
    ::metrics::counter!(m::TABLE_COMPACTIONS, "stream" => table.to_owned(), "result" => "committed").increment(1);
    ::metrics::counter!(m::TABLE_COMPACTED_FILES, "stream" => table.to_owned())
        .increment(removed.len() as u64);
    report.removed = removed.len();
    report.added = added.len();
    Ok(report)
}

/// The small live data files of closed partitions `oldest..closed_before` of the current
/// snapshot, each of one Kafka partition, in partitions without delete files.
async fn candidates(
    store: &ObjectStore,
    meta: &TableMetadata,
    (oldest, closed_before): (i32, i32),
    small: u64,
) -> anyhow::Result<Vec<Live>> {
    let Some(snapshot) = meta.current_snapshot() else {
        return Ok(Vec::new());
    };
    let schema = meta.current_schema();
    let Some(ids) = schema
        .field_by_name(TABLE_COL_PARTITION)
        .zip(schema.field_by_name(COL_OFFSET))
        .map(|(p, o)| (p.id, o.id))
    else {
        return Ok(Vec::new());
    };
    let default_spec = meta.default_partition_spec_id();
    let wanted: Vec<Option<i32>> = (oldest..closed_before).map(Some).collect();
    let mut live = Vec::new();
    let mut with_deletes = HashSet::new();
    for manifest in metadata::manifests_of(&read_uri(store, snapshot.manifest_list()).await?)? {
        let range = lookup::summary_range(&manifest, default_spec);
        if manifest.content == ManifestContentType::Data
            && (manifest.partition_spec_id != default_spec || !lookup::may_hold(range, &wanted))
        {
            continue;
        }
        let bytes = read_uri(store, &manifest.manifest_path).await?;
        let parsed = iceberg::spec::Manifest::parse_avro(&bytes)?;
        for entry in parsed.entries().iter().filter(|e| e.is_alive()) {
            let data = entry.data_file();
            let value = lookup::partition_int(data.partition());
            if manifest.content == ManifestContentType::Deletes {
                // A delete file of another spec, or without a value, may hold any partition.
                with_deletes.insert(value.filter(|_| manifest.partition_spec_id == default_spec));
                continue;
            }
            let Some(value) = value.filter(|v| (oldest..closed_before).contains(v)) else {
                continue;
            };
            if data.file_size_in_bytes() >= small {
                continue;
            }
            if let Some(((p_low, p_high), (o_low, _))) = lookup::ranges(data, ids)
                && p_low == p_high
            {
                live.push(Live {
                    file: data.clone(),
                    value,
                    kafka_partition: p_low,
                    first_offset: o_low,
                });
            }
        }
    }
    if with_deletes.contains(&None) {
        return Ok(Vec::new());
    }
    live.retain(|f| !with_deletes.contains(&Some(f.value)));
    Ok(live)
}

/// Writes the rows of `run` into one file under `<location>/.compacted/`: its data file and
/// its key.
async fn rewrite(
    store: &ObjectStore,
    meta: &TableMetadata,
    def: &StreamDef,
    location: &str,
    run: &[Live],
) -> anyhow::Result<(DataFile, String)> {
    let mut inputs = Vec::new();
    for live in run {
        let bytes = read_uri(store, live.file.file_path()).await?;
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes.clone())?;
        let kv: HashMap<String, String> = reader
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .into_iter()
            .flatten()
            .filter_map(|kv| Some((kv.key.clone(), kv.value.clone()?)))
            .collect();
        inputs.push((reader.schema().clone(), kv, bytes));
    }
    // Decoding and encoding up to the target size is CPU work: the blocking pool does it, not
    // the runtime's workers that the sink's consumer and commits run on.
    let properties = crate::parquet_file::writer_properties;
    let def = def.clone();
    let (bytes, footer, rows) =
        tokio::task::spawn_blocking(move || encode(&inputs, |hash| properties(&def, hash)))
            .await??;
    let first = &run[0];
    let partition: Struct = first.file.partition().clone();
    let key_uri = format!(
        "{location}/.compacted/{}/p{}-o{:020}-{}.parquet",
        first.value,
        first.kafka_partition,
        first.first_offset,
        uuid::Uuid::new_v4()
    );
    let key = store
        .key_of(&key_uri)
        .context("the table's location is not in the sink's store")?;
    let size = bytes.len() as u64;
    store.put_if_absent(&key, bytes).await?;
    let file = metadata::data_file_at(
        meta,
        key_uri,
        partition,
        (rows, size),
        &stats::FileStats::of(&footer),
    )?;
    Ok((file, key))
}

/// The rows of `inputs` (schema, key-value metadata and bytes of each file, in offset order)
/// in one Parquet file with the widest of their schemas (the newest definition's: older files'
/// rows get nulls in the columns they lack), encoded with `properties`: its bytes, footer and
/// rows.
#[allow(clippy::type_complexity)]
fn encode(
    inputs: &[(SchemaRef, HashMap<String, String>, Bytes)],
    properties: impl FnOnce(
        HashColumn,
    ) -> Result<
        parquet::file::properties::WriterProperties,
        parquet::errors::ParquetError,
    >,
) -> anyhow::Result<(Bytes, parquet::file::metadata::ParquetMetaData, u64)> {
    let schema: SchemaRef = inputs
        .iter()
        .map(|(s, _, _)| s.clone())
        .max_by_key(|s| s.fields().len())
        .context("no files")?;
    let hash = if schema.column_with_name(COL_CONTENT_HASH).is_some() {
        HashColumn::Full
    } else {
        HashColumn::None
    };
    let mut writer = ArrowWriter::try_new(Vec::new(), schema.clone(), Some(properties(hash)?))?;
    let mut rows = 0u64;
    for (_, _, bytes) in inputs {
        for batch in ParquetRecordBatchReaderBuilder::try_new(bytes.clone())?.build()? {
            let batch = batch?;
            rows += batch.num_rows() as u64;
            writer.write(&widened(&batch, &schema)?)?;
        }
        // Each input's rows are one sorted run: they stay row groups of their own, so the
        // file's `sorting_columns` hold for every row group.
        writer.flush()?;
    }
    for kv in compacted_metadata(
        &inputs.iter().map(|(_, kv, _)| kv).collect::<Vec<_>>(),
        rows,
    ) {
        writer.append_key_value_metadata(kv);
    }
    let bytes = Bytes::from(writer.into_inner()?);
    let footer = ParquetMetaDataReader::new().parse_and_finish(&bytes)?;
    Ok((bytes, footer, rows))
}

/// `batch` with the columns of `schema`, those it lacks null.
fn widened(batch: &RecordBatch, schema: &SchemaRef) -> anyhow::Result<RecordBatch> {
    let columns: Vec<ArrayRef> = schema
        .fields()
        .iter()
        .map(|f| {
            batch
                .column_by_name(f.name())
                .cloned()
                .unwrap_or_else(|| new_null_array(f.data_type(), batch.num_rows()))
        })
        .collect();
    RecordBatch::try_new(schema.clone(), columns).context("the files' columns do not fit together")
}

/// The key-value metadata of a compacted file: the landing files' (stream, version, topic,
/// partition: the widest file's), its offsets from the first file's first to the last file's
/// last, its rows and event times over all.
fn compacted_metadata(inputs: &[&HashMap<String, String>], rows: u64) -> Vec<KeyValue> {
    let widest = inputs.iter().max_by_key(|kv| kv.len()).copied();
    let mut out: BTreeMap<String, String> =
        widest.cloned().unwrap_or_default().into_iter().collect();
    let pick = |key: &str, min: bool| {
        let values = inputs.iter().filter_map(|kv| kv.get(key));
        if min { values.min() } else { values.max() }.cloned()
    };
    let edges = [
        (
            META_FIRST_OFFSET,
            inputs
                .first()
                .and_then(|kv| kv.get(META_FIRST_OFFSET))
                .cloned(),
        ),
        (
            META_LAST_OFFSET,
            inputs
                .last()
                .and_then(|kv| kv.get(META_LAST_OFFSET))
                .cloned(),
        ),
        (META_MIN_EVENT_TIME, pick(META_MIN_EVENT_TIME, true)),
        (META_MAX_EVENT_TIME, pick(META_MAX_EVENT_TIME, false)),
        (META_ROW_COUNT, Some(rows.to_string())),
    ];
    for (key, value) in edges {
        if let Some(value) = value {
            out.insert(key.to_owned(), value);
        }
    }
    out.retain(|k, _| !k.starts_with("ARROW:"));
    out.into_iter().map(|(k, v)| KeyValue::new(k, v)).collect()
}

/// Commits the replace of `removed` (files of the partitions `values`) by `added`, built again
/// on newer versions after conflicts while every removed file is still live: whether it went
/// in. Only the data manifests whose partition summaries may hold those partitions are read.
async fn commit(
    catalog: &catalog::Catalog,
    store: &ObjectStore,
    (namespace, table): (&str, &str),
    added: &[(DataFile, String)],
    (removed, values): (&HashSet<String>, &[Option<i32>]),
) -> anyhow::Result<bool> {
    for _ in 0..MAX_ATTEMPTS {
        let base = catalog
            .load(store, namespace, table)
            .await?
            .context("the table is gone")?;
        let meta = &base.metadata;
        let Some(snapshot) = meta.current_snapshot() else {
            return Ok(false);
        };
        let mut kept: Vec<ManifestFile> = Vec::new();
        let mut merged = Vec::new();
        let mut found = 0;
        for manifest in metadata::manifests_of(&read_uri(store, snapshot.manifest_list()).await?)? {
            let range = lookup::summary_range(&manifest, meta.default_partition_spec_id());
            if manifest.content != ManifestContentType::Data || !lookup::may_hold(range, values) {
                kept.push(manifest);
                continue;
            }
            let bytes = read_uri(store, &manifest.manifest_path).await?;
            let holds = iceberg::spec::Manifest::parse_avro(&bytes)?
                .entries()
                .iter()
                .filter(|e| e.status() != ManifestStatus::Deleted)
                .filter(|e| removed.contains(e.data_file().file_path()))
                .count();
            if holds == 0 {
                kept.push(manifest);
            } else {
                found += holds;
                merged.push((manifest, bytes));
            }
        }
        if found != removed.len() {
            tracing::info!(
                table,
                "files to compact were removed by another writer meanwhile; the compaction is dropped"
            );
            return Ok(false);
        }
        let offsets = metadata::offsets(meta)?;
        let files = added.iter().map(|(f, _)| f.clone()).collect();
        let replace = metadata::append(
            meta,
            &base.location,
            (kept, merged),
            files,
            &offsets,
            removed,
        )
        .await?;
        for (path, bytes) in &replace.files {
            let key = store.key_of(path).context("metadata location")?;
            store.put_if_absent(&key, bytes.clone()).await?;
        }
        if let Some(unreferenced) = catalog
            .commit(store, (namespace, table), &base, replace)
            .await?
        {
            for path in unreferenced {
                if let Some(key) = store.key_of(&path) {
                    let _ = store.delete(&key).await;
                }
            }
            return Ok(true);
        }
        ::metrics::counter!(m::TABLE_COMPACTIONS, "stream" => table.to_owned(), "result" => "conflict").increment(1);
    }
    Ok(false)
}

/// Runs compaction of every stream's table every `interval_ms` until `shutdown`.
pub async fn run(
    config: super::TableConfig,
    store: ObjectStore,
    streams: Vec<Arc<StreamDef>>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let compaction = config.compaction.clone();
    let catalog = match catalog::Catalog::open(&config).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "compaction cannot open the catalog; the tables are not compacted");
            return;
        }
    };
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(compaction.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        for def in &streams {
            let now = chrono::Utc::now().timestamp_millis();
            let ran = tokio::select! {
                r = compact_table(&catalog, &store, (&config.namespace, &def.name), def, &compaction, now) => r,
                _ = shutdown.cancelled() => return,
            };
            match ran {
                Ok(report) if report.added > 0 => {
                    for (value, (before, after)) in &report.partitions {
                        tracing::info!(
                            stream = def.name,
                            partition = value,
                            files_before = before,
                            files_after = after,
                            "compacted a closed partition's small files"
                        );
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    ::metrics::counter!(m::TABLE_COMPACTIONS, "stream" => def.name.clone(), "result" => "failed").increment(1);
                    tracing::warn!(stream = def.name, error = %format!("{e:#}"), "compaction failed; tried again at the next interval");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_partitions_end_with_their_day_or_hour() {
        let hour = partition_value_of(Transform::Hour, 7_200_000 + 5);
        assert_eq!(hour, 2);
        assert_eq!(partition_end_ms(Transform::Hour, hour), Some(10_800_000));
        assert_eq!(partition_value_of(Transform::Day, 86_400_000 * 3 - 1), 2);
        assert_eq!(partition_end_ms(Transform::Day, 2), Some(86_400_000 * 3));
        assert_eq!(partition_end_ms(Transform::Identity, 2), None);
    }
}
