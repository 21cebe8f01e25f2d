//! Encoding landing files: Arrow record batch → Parquet bytes with the metadata readers need,
//! and reading that metadata back from an existing object.

use arrow::array::{Array, Int64Array, RecordBatch, TimestampMicrosecondArray};
use bytes::Bytes;
use chrono::{DateTime, Datelike, Timelike, Utc};
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
    RowSelectionPolicy, RowSelector,
};
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::errors::ParquetError;
use parquet::file::metadata::{
    FileMetaData, FooterTail, KeyValue, PageIndexPolicy, ParquetMetaData, RowGroupMetaData,
    SortingColumn,
};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::file::reader::{ChunkReader, Length};
use parquet::schema::types::ColumnPath;
use schemas::ContentHash;
use schemas::arrow::{
    COL_CONTENT_HASH, COL_INGEST_TS, COL_OFFSET, COL_PARTITION, HashColumn, RowMeta, record_batch,
};
use schemas::value::{Record, format_timestamp};
use schemas::{FieldType, StreamDef};

/// Key-value metadata written into every landing file.
pub const META_TOPIC: &str = "topic";
pub const META_PARTITION: &str = "partition";
pub const META_FIRST_OFFSET: &str = "first_offset";
pub const META_LAST_OFFSET: &str = "last_offset";
pub const META_ROW_COUNT: &str = "row_count";
pub const META_MIN_EVENT_TIME: &str = "min_event_time";
pub const META_MAX_EVENT_TIME: &str = "max_event_time";

/// The object key of a landing file:
/// `<prefix>/<stream>/date=YYYY-MM-DD/hour=HH/<stream>-p<partition>-o<start offset, 20 digits>.parquet`,
/// date and hour from the ingest time (µs) of the file's first record.
pub fn object_key(
    prefix: &str,
    stream: &str,
    ingest_ts: i64,
    partition: i32,
    start: i64,
) -> String {
    let t = DateTime::<Utc>::from_timestamp_micros(ingest_ts).unwrap_or_default();
    format!(
        "{prefix}/{stream}/date={:04}-{:02}-{:02}/hour={:02}/{stream}-p{partition}-o{start:020}.parquet",
        t.year(),
        t.month(),
        t.day(),
        t.hour()
    )
}

/// The offsets a file accounts for: its rows plus the records skipped among them (duplicates,
/// dead letters). Consecutive files of a partition cover consecutive ranges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffsetRange {
    pub first: i64,
    pub last: i64,
}

/// The key of a dead-letter object:
/// `<prefix>/_dead_letters/<stream>/date=…/hour=…/<stream>-p<partition>-o<first>.ndjson`, named
/// after its first dead letter's offset (and placed by its ingest time). An object holds every
/// dead letter of its partition from that offset up to its last line's, so whoever reads those
/// records again finds it at the same key, whatever range it was written with, and goes on after
/// its last line: dead letters form a chain of their own, exactly once.
pub fn dead_letter_key(
    prefix: &str,
    stream: &str,
    ingest_ts: i64,
    partition: i32,
    first: i64,
) -> String {
    let file = object_key("", stream, ingest_ts, partition, first);
    let file = file.trim_start_matches('/').trim_end_matches(".parquet");
    format!("{prefix}/_dead_letters/{file}.ndjson")
}

/// Encodes rows (all within `range`) into a Parquet file of one row group, in series order.
pub fn encode(
    def: &StreamDef,
    hash: HashColumn,
    topic: &str,
    partition: i32,
    range: OffsetRange,
    rows: &[(Record, RowMeta)],
) -> Result<Bytes, ParquetError> {
    let batch = schemas::arrow::sort_batch(def, &record_batch(def, hash, rows)?)?;
    let (min_t, max_t) = rows
        .iter()
        .map(|(r, _)| r.event_time(def))
        .fold((i64::MAX, i64::MIN), |(lo, hi), t| (lo.min(t), hi.max(t)));
    let metadata = file_metadata(def, topic, partition, range, rows.len(), (min_t, max_t));
    let mut writer = ArrowWriter::try_new(
        Vec::new(),
        batch.schema(),
        Some(writer_properties(def, hash)?),
    )?;
    writer.write(&batch)?;
    for kv in metadata {
        writer.append_key_value_metadata(kv);
    }
    Ok(Bytes::from(writer.into_inner()?))
}

/// The key-value metadata of a landing file (docs/src/sink.md).
pub fn file_metadata(
    def: &StreamDef,
    topic: &str,
    partition: i32,
    range: OffsetRange,
    rows: usize,
    (min_event_time, max_event_time): (i64, i64),
) -> Vec<KeyValue> {
    let kv = |k: &str, v: String| KeyValue::new(k.to_owned(), v);
    vec![
        kv(schemas::arrow::META_STREAM, def.name.clone()),
        kv(schemas::arrow::META_SCHEMA_VERSION, def.version.to_string()),
        kv(META_TOPIC, topic.to_owned()),
        kv(META_PARTITION, partition.to_string()),
        kv(META_FIRST_OFFSET, range.first.to_string()),
        kv(META_LAST_OFFSET, range.last.to_string()),
        kv(META_ROW_COUNT, rows.to_string()),
        kv(META_MIN_EVENT_TIME, format_timestamp(min_event_time)),
        kv(META_MAX_EVENT_TIME, format_timestamp(max_event_time)),
    ]
}

/// How landing files are encoded: zstd, page statistics, and per column type the encoding that
/// makes sensor data smallest (docs/src/formats.md has the measured figures):
/// - timestamps (the stream's and `_ingest_ts`) and `_offset`: `DELTA_BINARY_PACKED`. Rising
///   within a series, they take a few bits a row; dictionaries of them are as large as the
///   column.
/// - strings, int64, float64 and bool: dictionaries, run-length encoded. Device and sensor
///   names, units and quality codes take a few values each; sensor values are mostly readings of
///   a fixed resolution (a decimal rounded to a few places, an ADC's steps), which repeat:
///   on the demo's readings (a random walk to three decimals) a dictionary takes 3.0 bytes a
///   value where `BYTE_STREAM_SPLIT` takes 5.9. Past the dictionary page limit (1 MiB) a
///   column chunk goes on in plain encoding.
/// - `_partition`, one value a file: dictionary and run length, without zstd (whose frame
///   would make those few bytes larger).
/// - `_content_hash`, where kept: random bytes that no encoding or compression makes smaller
///   and whose minimum and maximum select nothing: plain, uncompressed, without statistics.
///
/// Each row group is sorted by the stream's series and event time, and says so in its
/// `sorting_columns` ([`sorting_columns`]).
pub fn writer_properties(
    def: &StreamDef,
    hash: HashColumn,
) -> Result<WriterProperties, ParquetError> {
    let mut builder = WriterProperties::builder();
    let fields = def.fields.iter().map(|f| (f.name.as_str(), &f.ty));
    let meta = [
        (COL_INGEST_TS, &FieldType::Timestamp),
        (COL_OFFSET, &FieldType::Int64),
    ];
    for (name, ty) in fields.chain(meta) {
        let encoding = match ty {
            FieldType::Timestamp => Encoding::DELTA_BINARY_PACKED,
            FieldType::Int64 if name == COL_OFFSET => Encoding::DELTA_BINARY_PACKED,
            _ => continue,
        };
        let path = ColumnPath::from(name);
        builder = builder
            .set_column_dictionary_enabled(path.clone(), false)
            .set_column_encoding(path, encoding);
    }
    if hash != HashColumn::None {
        let path = || ColumnPath::from(COL_CONTENT_HASH);
        builder = builder
            .set_column_dictionary_enabled(path(), false)
            .set_column_compression(path(), Compression::UNCOMPRESSED)
            .set_column_statistics_enabled(path(), EnabledStatistics::None);
    }
    Ok(builder
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?))
        .set_statistics_enabled(EnabledStatistics::Page)
        .set_dictionary_enabled(true)
        .set_column_compression(ColumnPath::from(COL_PARTITION), Compression::UNCOMPRESSED)
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .set_sorting_columns(Some(sorting_columns(def)))
        .build())
}

/// The columns a landing file's row groups are sorted by, as `schemas::arrow::sort_batch`
/// sorts them: the partition key and the other string fields (those that order: strings and
/// integers, nulls first), then the event time. Indexes are of leaf columns: a list takes one,
/// a map two.
pub fn sorting_columns(def: &StreamDef) -> Vec<SortingColumn> {
    let leaves = |ty: &FieldType| match ty {
        FieldType::Map(_) => 2,
        _ => 1,
    };
    let leaf_of = |field: usize| -> i32 { def.fields[..field].iter().map(|f| leaves(&f.ty)).sum() };
    let orders =
        |field: usize| matches!(def.fields[field].ty, FieldType::String | FieldType::Int64);
    let series = std::iter::once(def.partition_key).chain(
        (0..def.fields.len())
            .filter(|&i| i != def.partition_key && def.fields[i].ty == FieldType::String),
    );
    series
        .filter(|&field| orders(field))
        .chain([def.event_time])
        .map(|field| SortingColumn {
            column_idx: leaf_of(field),
            descending: false,
            nulls_first: true,
        })
        .collect()
}

/// The hour folders of the last `hours` hours before `now_micros`, newest first:
/// `<prefix>/<stream>/date=…/hour=…/`.
pub fn recent_hour_prefixes(
    prefix: &str,
    stream: &str,
    now_micros: i64,
    hours: i64,
) -> Vec<String> {
    (0..hours)
        .map(|h| {
            let key = object_key(prefix, stream, now_micros - h * 3_600_000_000, 0, 0);
            let cut = key.rfind('/').map_or(key.len(), |i| i + 1);
            key[..cut].to_owned()
        })
        .collect()
}

/// The start offset of a landing file of `partition`, from its key; `None` for other files.
pub fn start_offset_of(key: &str, stream: &str, partition: i32) -> Option<i64> {
    partition_and_offset_of(key, stream)
        .filter(|&(p, _)| p == partition)
        .map(|(_, offset)| offset)
}

/// The partition and start offset of a landing file of `stream`, from its key (the file name
/// `<stream>-p<partition>-o<offset>.parquet`); `None` for other files.
pub fn partition_and_offset_of(key: &str, stream: &str) -> Option<(i32, i64)> {
    let name = key.rsplit('/').next()?;
    let rest = name.strip_prefix(stream)?.strip_prefix("-p")?;
    let (digits, offset) = rest.strip_suffix(".parquet")?.split_once("-o")?;
    let partition: i32 = digits.parse().ok()?;
    // As written: no sign, no leading zeros.
    (partition >= 0 && partition.to_string() == digits).then_some(())?;
    Some((partition, offset.parse().ok()?))
}

/// Most rows in one row group, whatever their size.
pub const ROW_GROUP_ROWS: usize = 1024 * 1024;

/// Bytes read from the end of a landing file first: its footer (the metadata and the last 8
/// bytes) fits in them unless the file has thousands of row groups.
pub const TAIL_BYTES: u64 = 64 * 1024;

/// Bytes at the end of a Parquet file that its footer takes, from its last 8 bytes (`tail`
/// ends with them).
pub fn footer_bytes(tail: &[u8]) -> Result<u64, ParquetError> {
    let last = tail
        .get(tail.len().saturating_sub(8)..)
        .filter(|last| last.len() == 8)
        .ok_or_else(|| ParquetError::General("shorter than a Parquet footer".into()))?;
    Ok(FooterTail::try_from(last)?.metadata_length() as u64 + 8)
}

/// Which rows of a landing file a [`PagePlan`] reads. Rows lie in series order within each
/// row group, and row groups in offset order: the newest records are somewhere in the last row
/// groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// The first rows of the file (a sample of its first row group's records).
    First(usize),
    /// The last row groups, whole, that hold at least this many rows together.
    LastGroups(usize),
}

/// What to read of a landing file for some of its rows and columns, found from its footer and
/// offset index: the pages of those columns that hold those rows (whole column chunks in a file
/// without an offset index). Warming a dedupe window needs the newest rows' hashes (computed
/// from the hashed fields), and adopting an object its offsets and a sample of its rows:
/// reading the whole object for either would take up to 128 MiB (the default file target) per
/// partition.
#[derive(Debug, Clone)]
pub struct PagePlan {
    metadata: ArrowReaderMetadata,
    columns: Vec<String>,
    /// Indexes of the row groups read, in file order.
    pub row_groups: Vec<usize>,
    /// The rows read of those row groups (their rows one after the other).
    selection: Vec<RowSelector>,
    /// Byte ranges (start, end) to read, in file order (adjacent pages as one range).
    pub ranges: Vec<(u64, u64)>,
}

impl PagePlan {
    /// The plan for `rows` of `columns` (all rows when the file has fewer), from `tail`, the
    /// end of the file (`size` bytes long) holding its whole footer, and its offset index when
    /// that is in `tail` too (as the sink writes it).
    pub fn new(
        tail: Bytes,
        size: u64,
        columns: &[String],
        rows: Rows,
    ) -> Result<PagePlan, ParquetError> {
        let at = size
            .checked_sub(tail.len() as u64)
            .ok_or_else(|| ParquetError::General("the tail is longer than the file".into()))?;
        let read = Pieces {
            size,
            pieces: vec![(at, tail)],
        };
        let indexed = ArrowReaderOptions::new().with_offset_index_policy(PageIndexPolicy::Optional);
        let metadata = ArrowReaderMetadata::load(&read, indexed)
            .or_else(|_| ArrowReaderMetadata::load(&read, ArrowReaderOptions::new()))?;
        let file = metadata.metadata();
        let leaves = file.file_metadata().schema_descr().columns();
        let indexes = columns
            .iter()
            .map(|name| {
                leaves
                    .iter()
                    .position(|c| c.path().parts() == [name.as_str()])
                    .ok_or_else(|| ParquetError::General(format!("no column {name}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let group_rows = |g: &RowGroupMetaData| g.num_rows().max(0) as usize;
        let total: usize = file.row_groups().iter().map(group_rows).sum();
        let (from, to) = match rows {
            Rows::First(n) => (0, n.min(total)),
            Rows::LastGroups(n) => {
                // From the start of the last row group that, with those after it, holds n rows.
                let mut from = total;
                for group in file.row_groups().iter().rev() {
                    if total - from >= n {
                        break;
                    }
                    from -= group_rows(group);
                }
                (from, total)
            }
        };
        let (mut row_groups, mut selection, mut ranges) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        for (index, group) in file.row_groups().iter().enumerate() {
            let len = group_rows(group);
            let end = start + len;
            // The rows of the group to read, from its first.
            let (lo, hi) = (from.max(start) - start, to.min(end).saturating_sub(start));
            start = end;
            if lo >= hi {
                continue;
            }
            row_groups.push(index);
            let selectors = [
                RowSelector::skip(lo),
                RowSelector::select(hi - lo),
                RowSelector::skip(len - hi),
            ];
            selection.extend(selectors.into_iter().filter(|s| s.row_count > 0));
            for &column in &indexes {
                let chunk = group.column(column);
                let pages = file
                    .offset_index()
                    .and_then(|i| i.get(index)?.get(column))
                    .map(|i| i.page_locations().as_slice())
                    .filter(|pages| !pages.is_empty() && chunk.dictionary_page_offset().is_none());
                let Some(pages) = pages else {
                    let (offset, bytes) = chunk.byte_range();
                    ranges.push((offset, offset + bytes));
                    continue;
                };
                for (i, page) in pages.iter().enumerate() {
                    let first = page.first_row_index.max(0) as usize;
                    let last = pages
                        .get(i + 1)
                        .map_or(len, |next| next.first_row_index.max(0) as usize);
                    if last > lo && first < hi {
                        let offset = page.offset.max(0) as u64;
                        ranges.push((offset, offset + page.compressed_page_size.max(0) as u64));
                    }
                }
            }
        }
        ranges.sort_unstable();
        // A column chunk's pages follow each other: one read for them all.
        ranges.dedup_by(|next, last| {
            let adjacent = next.0 == last.1;
            if adjacent {
                last.1 = next.1;
            }
            adjacent
        });
        Ok(PagePlan {
            metadata,
            columns: columns.to_vec(),
            row_groups,
            selection,
            ranges,
        })
    }

    /// The file's rows.
    pub fn rows(&self) -> u64 {
        self.metadata.metadata().file_metadata().num_rows().max(0) as u64
    }

    /// The file's footer.
    pub fn footer(&self) -> &ParquetMetaData {
        self.metadata.metadata()
    }

    /// The offset range the file's metadata gives.
    pub fn offsets(&self) -> Result<OffsetRange, ParquetError> {
        offsets_of(self.metadata.metadata().file_metadata())
    }

    /// The chosen rows of the chosen columns, in row order, from `pieces`, the bytes of
    /// [`PagePlan::ranges`]; the file is `size` bytes long.
    pub fn read(&self, size: u64, pieces: Vec<Bytes>) -> Result<Vec<RecordBatch>, ParquetError> {
        if self.row_groups.is_empty() {
            return Ok(Vec::new());
        }
        let pieces = self.ranges.iter().map(|r| r.0).zip(pieces).collect();
        let builder = ParquetRecordBatchReaderBuilder::new_with_metadata(
            Pieces { size, pieces },
            self.metadata.clone(),
        );
        let columns = self.columns.iter().map(String::as_str);
        let mask = ProjectionMask::columns(builder.parquet_schema(), columns);
        builder
            .with_projection(mask)
            .with_row_groups(self.row_groups.clone())
            .with_row_selection(RowSelection::from(self.selection.clone()))
            .with_row_selection_policy(RowSelectionPolicy::Selectors)
            .build()?
            .map(|batch| batch.map_err(ParquetError::from))
            .collect()
    }
}

/// The columns that warming a dedupe window reads ([`newest_hashes`]): the offsets and the
/// fields the content hash covers.
pub fn hash_columns(def: &StreamDef) -> Vec<String> {
    std::iter::once(COL_OFFSET.to_owned())
        .chain(def.hash_fields.iter().map(|&f| def.fields[f].name.clone()))
        .collect()
}

/// The content hashes of the `want` rows with the highest offsets below `before` among
/// `batches` (read with [`hash_columns`]), oldest first, computed from their fields (`schemas::arrow::row_hashes`).
pub fn newest_hashes(
    def: &StreamDef,
    batches: &[RecordBatch],
    want: usize,
    before: i64,
) -> Result<Vec<ContentHash>, ParquetError> {
    // (offset, batch, row)
    let mut rows: Vec<(i64, usize, usize)> = Vec::new();
    for (b, batch) in batches.iter().enumerate() {
        let offsets = offset_column(batch)?;
        rows.extend(
            offsets
                .values()
                .iter()
                .enumerate()
                .filter(|&(_, &o)| o < before)
                .map(|(r, &o)| (o, b, r)),
        );
    }
    rows.sort_unstable();
    let mut newest = rows.split_off(rows.len().saturating_sub(want));
    // By batch and row, so that each batch's rows are computed in one call.
    newest.sort_unstable_by_key(|&(_, b, r)| (b, r));
    let mut hashes = Vec::with_capacity(newest.len());
    for of_batch in newest.chunk_by(|x, y| x.1 == y.1) {
        let batch = &batches[of_batch[0].1];
        let computed = schemas::arrow::row_hashes(def, batch, of_batch.iter().map(|x| x.2))?;
        hashes.extend(of_batch.iter().map(|x| x.0).zip(computed));
    }
    hashes.sort_unstable_by_key(|&(offset, _)| offset);
    Ok(hashes.into_iter().map(|(_, hash)| hash).collect())
}

/// A landing batch's `_offset` column.
pub(crate) fn offset_column(batch: &RecordBatch) -> Result<&Int64Array, ParquetError> {
    batch
        .column_by_name(COL_OFFSET)
        .and_then(|c| c.as_any().downcast_ref::<Int64Array>())
        .ok_or_else(|| ParquetError::General("no offset column".into()))
}

/// Pieces of a file read by range (its footer, some column chunks), read as the file: a read
/// outside them is an error.
struct Pieces {
    size: u64,
    /// (offset in the file, bytes).
    pieces: Vec<(u64, Bytes)>,
}

impl Pieces {
    /// The bytes from `start`, `len` of them or to the end of the piece holding `start`.
    fn from(&self, start: u64, len: Option<usize>) -> Result<Bytes, ParquetError> {
        for (at, data) in &self.pieces {
            let Some(from) = start.checked_sub(*at).map(|from| from as usize) else {
                continue;
            };
            let to = len.map_or(data.len(), |len| from + len);
            if from <= data.len() && to <= data.len() {
                return Ok(data.slice(from..to));
            }
        }
        Err(ParquetError::General(format!(
            "bytes {start}.. of the file were not read"
        )))
    }
}

impl Length for Pieces {
    fn len(&self) -> u64 {
        self.size
    }
}

impl ChunkReader for Pieces {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> Result<Self::T, ParquetError> {
        Ok(bytes::Buf::reader(self.from(start, None)?))
    }

    fn get_bytes(&self, start: u64, length: usize) -> Result<Bytes, ParquetError> {
        self.from(start, Some(length))
    }
}

/// What identifies a row of a landing file as the record of a Kafka message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowId {
    pub offset: i64,
    pub hash: ContentHash,
    pub ingest_ts: i64,
}

/// The columns of a landing file that identify its rows ([`row_ids_of`]): the offsets, the
/// ingest times and the fields the content hash covers.
pub fn row_id_columns(def: &StreamDef) -> Vec<String> {
    let mut columns = hash_columns(def);
    columns.push(COL_INGEST_TS.to_owned());
    columns
}

/// The offset, content hash (computed from the row's fields) and ingest time of rows `rows` of
/// a batch read with [`row_id_columns`] (or all columns).
pub fn row_ids_of(
    def: &StreamDef,
    batch: &RecordBatch,
    rows: impl IntoIterator<Item = usize>,
) -> Result<Vec<RowId>, ParquetError> {
    let rows: Vec<usize> = rows.into_iter().collect();
    let hashes = schemas::arrow::row_hashes(def, batch, rows.iter().copied())?;
    let offsets = offset_column(batch)?;
    let ingest = batch
        .column_by_name(COL_INGEST_TS)
        .and_then(|c| c.as_any().downcast_ref::<TimestampMicrosecondArray>())
        .ok_or_else(|| ParquetError::General("no ingest time column".into()))?;
    Ok(rows
        .into_iter()
        .zip(hashes)
        .map(|(row, hash)| RowId {
            offset: offsets.value(row),
            hash,
            ingest_ts: ingest.value(row),
        })
        .collect())
}

/// Offsets whose rows in `ours` and `theirs` (both in offset order; rows of landing files or
/// dead letters) are different messages: both their content hash (or payload) and their ingest
/// time differ. A topic deleted and created again
/// under the same name starts at offset 0 again, and its messages meet the landing files of
/// the old one at the same keys. A changed stream definition can change a record's hash, and a
/// changed `kafka.ingest_time` its ingest time, but not both.
pub fn other_messages(ours: &[RowId], theirs: &[RowId]) -> Vec<i64> {
    let mut differ = Vec::new();
    let (mut i, mut j) = (0, 0);
    while let (Some(a), Some(b)) = (ours.get(i), theirs.get(j)) {
        match a.offset.cmp(&b.offset) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                if a.hash != b.hash && a.ingest_ts != b.ingest_ts {
                    differ.push(a.offset);
                }
                i += 1;
                j += 1;
            }
        }
    }
    differ
}

/// The offset range of a landing file, from its footer metadata.
pub fn offsets_of(meta: &FileMetaData) -> Result<OffsetRange, ParquetError> {
    let get = |key: &str| -> Result<i64, ParquetError> {
        meta.key_value_metadata()
            .and_then(|kvs| kvs.iter().find(|kv| kv.key == key))
            .and_then(|kv| kv.value.as_deref())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| ParquetError::General(format!("landing file has no '{key}' metadata")))
    };
    Ok(OffsetRange {
        first: get(META_FIRST_OFFSET)?,
        last: get(META_LAST_OFFSET)?,
    })
}

#[cfg(test)]
mod tests {
    use parquet::file::reader::{FileReader, SerializedFileReader};

    use super::*;

    #[test]
    fn keys_are_deterministic_and_sortable() {
        let ts = 1_714_564_800_000_000; // 2024-05-01T12:00:00Z
        assert_eq!(
            object_key("landing", "sensor_readings", ts, 3, 42),
            "landing/sensor_readings/date=2024-05-01/hour=12/sensor_readings-p3-o00000000000000000042.parquet"
        );
    }

    #[test]
    fn recent_hours_and_start_offsets() {
        let ts = 1_714_564_800_000_000; // 2024-05-01T12:00:00Z
        assert_eq!(
            recent_hour_prefixes("landing", "s", ts, 2),
            [
                "landing/s/date=2024-05-01/hour=12/",
                "landing/s/date=2024-05-01/hour=11/"
            ]
        );
        let key = object_key("landing", "s", ts, 3, 42);
        assert_eq!(start_offset_of(&key, "s", 3), Some(42));
        assert_eq!(start_offset_of(&key, "s", 4), None);
        assert_eq!(start_offset_of("landing/s/x.ndjson", "s", 3), None);
        assert_eq!(partition_and_offset_of(&key, "s"), Some((3, 42)));
        assert_eq!(partition_and_offset_of(&key, "t"), None);
        for other in [
            "landing/s/s-p03-o00000000000000000042.parquet",
            "landing/s/s-p+3-o00000000000000000042.parquet",
            "landing/s/s-p3-o42.ndjson",
            "landing/s/s_x-p3-o42.parquet",
            "landing/s/s-px-o42.parquet",
        ] {
            assert_eq!(partition_and_offset_of(other, "s"), None, "{other}");
        }
    }

    #[test]
    fn dead_letter_keys_carry_the_first_offset() {
        assert_eq!(
            dead_letter_key("landing", "s", 0, 2, 5),
            "landing/_dead_letters/s/date=1970-01-01/hour=00/s-p2-o00000000000000000005.ndjson"
        );
    }

    #[test]
    fn other_messages_differ_in_both_hash_and_ingest_time() {
        let id = |offset, hash: u8, ingest_ts| RowId {
            offset,
            hash: ContentHash([hash; 32]),
            ingest_ts,
        };
        let ours = [
            id(1, 1, 10),
            id(2, 2, 20),
            id(3, 3, 30),
            id(5, 5, 50),
            id(7, 7, 70),
        ];
        let theirs = [
            // A changed stream definition: another hash, the same message.
            id(1, 9, 10),
            // A changed ingest time source: the same record.
            id(2, 2, 99),
            // Only in one of them (dedupe windows differ): nothing to compare.
            id(4, 4, 40),
            // Another message.
            id(5, 6, 60),
            id(7, 7, 70),
        ];
        assert_eq!(other_messages(&ours, &theirs), [5]);
        assert_eq!(other_messages(&ours, &ours), Vec::<i64>::new());
    }

    /// [`PagePlan`] over `file`, given only its last 64 KiB and the ranges it names.
    fn read_planned(
        file: &Bytes,
        columns: &[String],
        rows: Rows,
    ) -> Result<Vec<RecordBatch>, ParquetError> {
        let plan = planned(file, columns, rows)?;
        let pieces = plan
            .ranges
            .iter()
            .map(|&(start, end)| file.slice(start as usize..end as usize))
            .collect();
        plan.read(file.len() as u64, pieces)
    }

    fn planned(file: &Bytes, columns: &[String], rows: Rows) -> Result<PagePlan, ParquetError> {
        let tail = file.slice(file.len().saturating_sub(TAIL_BYTES as usize)..);
        PagePlan::new(tail, file.len() as u64, columns, rows)
    }

    fn sensor() -> std::sync::Arc<StreamDef> {
        schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone()
    }

    /// The hashes of the `want` newest records of `file`, as warming reads them.
    fn newest(file: &Bytes, want: usize) -> Result<Vec<ContentHash>, ParquetError> {
        let def = sensor();
        let batches = read_planned(file, &hash_columns(&def), Rows::LastGroups(want))?;
        newest_hashes(&def, &batches, want, i64::MAX)
    }

    fn chosen(file: &Bytes, want: usize) -> Result<PagePlan, ParquetError> {
        planned(file, &hash_columns(&sensor()), Rows::LastGroups(want))
    }

    /// Readings of 7 devices' 3 sensors as landing rows, offsets from 0.
    fn landing_rows(def: &StreamDef, n: i64) -> Vec<(Record, RowMeta)> {
        (0..n)
            .map(|i| {
                let json = serde_json::json!({
                    "device_id": format!("d{}", i % 7), "sensor": format!("s{}", i % 3),
                    "ts": i, "value": i,
                });
                let v = schemas::check(def, json).unwrap();
                let meta = RowMeta {
                    ingest_ts: 0,
                    partition: 0,
                    offset: i,
                    hash: v.hash,
                };
                (v.record, meta)
            })
            .collect()
    }

    /// A landing file of `rows` as the sink writes one: row groups of at most `group_rows`
    /// rows, each in series order, and data pages of at most `page_rows` rows.
    fn file_of(
        def: &StreamDef,
        rows: &[(Record, RowMeta)],
        group_rows: usize,
        page_rows: usize,
    ) -> Bytes {
        let props = writer_properties(def, HashColumn::None)
            .unwrap()
            .into_builder()
            .set_data_page_row_count_limit(page_rows)
            .set_write_batch_size(page_rows)
            .build();
        let schema = schemas::arrow::arrow_schema(def, HashColumn::None);
        let mut writer = ArrowWriter::try_new(Vec::new(), schema, Some(props)).unwrap();
        for group in rows.chunks(group_rows) {
            let batch = record_batch(def, HashColumn::None, group).unwrap();
            writer
                .write(&schemas::arrow::sort_batch(def, &batch).unwrap())
                .unwrap();
            writer.flush().unwrap();
        }
        Bytes::from(writer.into_inner().unwrap())
    }

    /// A landing file of 1,000 readings (offsets 0 to 999) in row groups of 300, 300, 300 and
    /// 100 rows, in pages of 50, and the readings' content hashes.
    fn paged_file() -> (Bytes, Vec<ContentHash>) {
        let def = sensor();
        let rows = landing_rows(&def, 1_000);
        let hashes = rows.iter().map(|(_, m)| m.hash).collect();
        (file_of(&def, &rows, 300, 50), hashes)
    }

    #[test]
    fn the_newest_hashes_are_read_from_the_last_row_groups_only() {
        let (file, hashes) = paged_file();
        let groups = |want| chosen(&file, want).unwrap().row_groups;
        assert_eq!(groups(0), Vec::<usize>::new());
        assert_eq!(groups(1), [3]);
        assert_eq!(groups(100), [3]);
        assert_eq!(groups(101), [2, 3]);
        assert_eq!(groups(5_000), [0, 1, 2, 3]);
        for want in [1, 50, 51, 120, 400] {
            assert_eq!(
                newest(&file, want).unwrap(),
                hashes[1_000 - want..],
                "{want} wanted"
            );
        }
        assert_eq!(newest(&file, 5_000).unwrap(), hashes);
        // Only the last row group is read for 100 rows: a tenth of the columns.
        let bytes = |want| -> u64 {
            let plan = chosen(&file, want).unwrap();
            plan.ranges.iter().map(|(s, e)| e - s).sum()
        };
        assert!(
            bytes(100) * 4 < bytes(1_000),
            "{} of {}",
            bytes(100),
            bytes(1_000)
        );
        // A piece not read is an error, not a wrong answer.
        let chunks = chosen(&file, 120).unwrap();
        let short = chunks.ranges.iter().map(|_| file.slice(0..1)).collect();
        assert!(chunks.read(file.len() as u64, short).is_err());
        assert!(footer_bytes(b"PAR1").is_err());
        assert!(footer_bytes(b"\x10\0\0\0NOPE").is_err());

        // A sample of the first rows, across a row group's end: every row of the first group
        // and 50 of the second, each with its own offset, hash and ingest time.
        let def = sensor();
        let ids: Vec<RowId> = read_planned(&file, &row_id_columns(&def), Rows::First(350))
            .unwrap()
            .iter()
            .flat_map(|b| row_ids_of(&def, b, 0..b.num_rows()).unwrap())
            .collect();
        assert_eq!(ids.len(), 350);
        for id in &ids {
            assert_eq!(id.hash, hashes[id.offset as usize], "offset {}", id.offset);
        }
        let first_group = ids.iter().filter(|id| id.offset < 300).count();
        assert_eq!(first_group, 300);
        let plan = planned(&file, &row_id_columns(&def), Rows::First(350)).unwrap();
        assert_eq!(plan.row_groups, [0, 1]);
        let read: u64 = plan.ranges.iter().map(|(s, e)| e - s).sum();
        assert!(
            read * 2 < file.len() as u64,
            "{read} of {} bytes",
            file.len()
        );
    }

    #[test]
    fn without_an_offset_index_whole_chunks_are_read() {
        let (file, hashes) = paged_file();
        // The footer only, the offset index left out of the tail.
        let footer = footer_bytes(&file).unwrap() as usize;
        let tail = file.slice(file.len() - footer..);
        let def = sensor();
        let columns = hash_columns(&def);
        let plan = PagePlan::new(tail, file.len() as u64, &columns, Rows::LastGroups(120)).unwrap();
        assert_eq!(plan.row_groups, [2, 3]);
        let pieces = plan
            .ranges
            .iter()
            .map(|&(start, end)| file.slice(start as usize..end as usize))
            .collect();
        let batches = plan.read(file.len() as u64, pieces).unwrap();
        assert_eq!(
            newest_hashes(&def, &batches, 120, i64::MAX).unwrap(),
            hashes[880..]
        );
        // Rows from `before` on are left out: the partition reads them again.
        assert_eq!(
            newest_hashes(&def, &batches, 120, 950).unwrap(),
            hashes[830..950]
        );
    }

    #[test]
    fn encode_then_read_offsets() {
        let def = sensor();
        let rows: Vec<_> = landing_rows(&def, 10)
            .into_iter()
            .map(|(record, meta)| {
                let meta = RowMeta {
                    partition: 1,
                    offset: 100 + meta.offset,
                    ..meta
                };
                (record, meta)
            })
            .collect();
        // Offsets 98 and 99 were skipped (duplicates) before the first row.
        let range = OffsetRange {
            first: 98,
            last: 109,
        };
        let topic = "ingest.sensor_readings";
        let data = encode(&def, HashColumn::Full, topic, 1, range, &rows).unwrap();
        let plan = planned(&data, &row_id_columns(&def), Rows::First(4)).unwrap();
        assert_eq!(plan.offsets().unwrap(), range);
        let hashes: Vec<_> = rows.iter().map(|(_, m)| m.hash).collect();
        assert_eq!(newest(&data, usize::MAX).unwrap(), hashes);

        // Timestamps and offsets are delta-encoded without a dictionary; strings, integers and
        // floats use dictionaries.
        let reader = SerializedFileReader::new(data).unwrap();
        let group = reader.metadata().row_group(0);
        let column = |name: &str| {
            group
                .columns()
                .iter()
                .find(|c| c.column_path().string() == name)
                .unwrap_or_else(|| panic!("no column {name}"))
        };
        let encodings = |name: &str| {
            let column = column(name);
            (
                column.encodings().collect::<Vec<_>>(),
                column.dictionary_page_offset(),
            )
        };
        for (name, encoding) in [
            ("ts", Encoding::DELTA_BINARY_PACKED),
            (COL_INGEST_TS, Encoding::DELTA_BINARY_PACKED),
            (COL_OFFSET, Encoding::DELTA_BINARY_PACKED),
        ] {
            let (found, dictionary) = encodings(name);
            assert!(found.contains(&encoding), "{name}: {found:?}");
            assert!(
                !found.contains(&Encoding::RLE_DICTIONARY),
                "{name}: {found:?}"
            );
            assert_eq!(dictionary, None, "{name}");
        }
        for name in ["device_id", "sensor", "value", "quality"] {
            let (found, dictionary) = encodings(name);
            assert!(
                found.contains(&Encoding::RLE_DICTIONARY),
                "{name}: {found:?}"
            );
            assert!(dictionary.is_some());
        }

        // zstd for the data, not for the random content hashes nor the one-value partition.
        let compression = |name: &str| column(name).compression();
        for name in ["device_id", "value", "ts", COL_INGEST_TS, COL_OFFSET] {
            assert!(matches!(compression(name), Compression::ZSTD(_)), "{name}");
        }
        for name in [COL_CONTENT_HASH, COL_PARTITION] {
            assert_eq!(compression(name), Compression::UNCOMPRESSED, "{name}");
        }

        // The row group says how it is sorted: series (device, sensor, unit), then time.
        let sorted: Vec<String> = group
            .sorting_columns()
            .unwrap()
            .iter()
            .map(|c| {
                assert!(!c.descending && c.nulls_first);
                group.column(c.column_idx as usize).column_path().string()
            })
            .collect();
        assert_eq!(sorted, ["device_id", "sensor", "unit", "ts"]);
    }

    #[test]
    fn the_hash_column_is_kept_only_where_asked() {
        let def = sensor();
        let rows = landing_rows(&def, 50);
        let range = OffsetRange { first: 0, last: 49 };
        for (hash, width) in [
            (HashColumn::None, None),
            (HashColumn::Short, Some(16)),
            (HashColumn::Full, Some(32)),
        ] {
            let data = encode(&def, hash, "t", 0, range, &rows).unwrap();
            let reader = SerializedFileReader::new(data.clone()).unwrap();
            let group = reader.metadata().row_group(0);
            let column = group
                .columns()
                .iter()
                .find(|c| c.column_path().string() == COL_CONTENT_HASH);
            assert_eq!(column.is_some(), width.is_some(), "{hash:?}");
            // The hashes come from the fields either way.
            let hashes: Vec<_> = rows.iter().map(|(_, m)| m.hash).collect();
            assert_eq!(newest(&data, 50).unwrap(), hashes, "{hash:?}");
        }
    }
}
