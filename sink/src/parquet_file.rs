//! Encoding landing files: Arrow record batch → Parquet bytes with the metadata readers need,
//! and reading that metadata back from an existing object.

use arrow::array::{
    Array, FixedSizeBinaryArray, Int64Array, RecordBatch, TimestampMicrosecondArray,
};
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
    FileMetaData, FooterTail, KeyValue, PageIndexPolicy, RowGroupMetaData,
};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::file::reader::{ChunkReader, Length};
use parquet::schema::types::ColumnPath;
use schemas::ContentHash;
use schemas::arrow::{
    COL_CONTENT_HASH, COL_INGEST_TS, COL_OFFSET, COL_PARTITION, RowMeta, record_batch,
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

/// Most rows in one Parquet row group (row groups also close at a byte size, see
/// [`crate::open_file::FileTargets`]).
const ROW_GROUP_ROWS: usize = 1024 * 1024;

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

/// Encodes rows (in offset order, all within `range`) into a Parquet file.
pub fn encode(
    def: &StreamDef,
    topic: &str,
    partition: i32,
    range: OffsetRange,
    rows: &[(Record, RowMeta)],
) -> Result<Bytes, ParquetError> {
    let batch = record_batch(def, rows)?;
    let (min_t, max_t) = rows
        .iter()
        .map(|(r, _)| r.event_time(def))
        .fold((i64::MAX, i64::MIN), |(lo, hi), t| (lo.min(t), hi.max(t)));
    let metadata = file_metadata(def, topic, partition, range, rows.len(), (min_t, max_t));
    let mut writer =
        ArrowWriter::try_new(Vec::new(), batch.schema(), Some(writer_properties(def)?))?;
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

/// How landing files are encoded: zstd, page statistics, dictionary strings (not for the
/// content hash and offset columns, which never repeat). Offsets, consecutive within a file
/// but for duplicates and dead letters, are delta-encoded: smaller than plain values under
/// zstd, and cheaper to write. So are timestamps (the stream's timestamp fields and
/// `_ingest_ts`): close together and rising within a partition, they took dictionaries as large
/// as the column with a dictionary index per row; delta-encoded, bench-sink's `ts` column came
/// to 17 KB instead of 1.2 MB and its files to 11.1 MB instead of 12.4 MB, and the sink process
/// took 4.2% fewer instructions. Content hashes are random bytes: zstd cannot make them smaller (it
/// only spends time trying) and their minimum and maximum select nothing, so that column is
/// stored uncompressed and without statistics. `_partition` holds one value a file, a few bytes
/// of dictionary and run length that zstd's frame makes larger (3,648 bytes against 2,496 over
/// bench-sink's 64 files), so it is stored uncompressed too, and no zstd context is made for it.
pub fn writer_properties(def: &StreamDef) -> Result<WriterProperties, ParquetError> {
    let hash = || ColumnPath::from(COL_CONTENT_HASH);
    let delta_encoded = def
        .fields
        .iter()
        .filter(|f| f.ty == FieldType::Timestamp)
        .map(|f| f.name.as_str())
        .chain([COL_INGEST_TS, COL_OFFSET]);
    let mut builder = WriterProperties::builder();
    for column in delta_encoded {
        let path = ColumnPath::from(column);
        builder = builder
            .set_column_dictionary_enabled(path.clone(), false)
            .set_column_encoding(path, Encoding::DELTA_BINARY_PACKED);
    }
    Ok(builder
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?))
        .set_statistics_enabled(EnabledStatistics::Page)
        .set_dictionary_enabled(true)
        .set_column_dictionary_enabled(hash(), false)
        .set_column_compression(hash(), Compression::UNCOMPRESSED)
        .set_column_statistics_enabled(hash(), EnabledStatistics::None)
        .set_column_compression(ColumnPath::from(COL_PARTITION), Compression::UNCOMPRESSED)
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .build())
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

/// Which rows of a landing file a [`PagePlan`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    First(usize),
    Last(usize),
}

/// What to read of a landing file for some of its rows and columns, found from its footer and
/// offset index: the pages of those columns that hold those rows (whole column chunks in a file
/// without an offset index). Warming a dedupe window needs the last rows' content hashes, and
/// adopting an object its offsets and a sample of its first rows: reading the whole object for
/// either took up to 128 MiB (the default file target) per partition.
#[derive(Debug, Clone)]
pub struct PagePlan {
    metadata: ArrowReaderMetadata,
    columns: Vec<&'static str>,
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
        columns: &[&'static str],
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
                    .position(|c| c.path().parts() == [*name])
                    .ok_or_else(|| ParquetError::General(format!("no column {name}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let group_rows = |g: &RowGroupMetaData| g.num_rows().max(0) as usize;
        let total: usize = file.row_groups().iter().map(group_rows).sum();
        let (from, to) = match rows {
            Rows::First(n) => (0, n.min(total)),
            Rows::Last(n) => (total.saturating_sub(n), total),
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
                    .page_index()
                    .and_then(|i| i.page_locations(index, column))
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
        let mask = ProjectionMask::columns(builder.parquet_schema(), self.columns.clone());
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

/// The content hashes of batches of a landing file, in row order.
pub fn hashes_of(batches: &[RecordBatch]) -> Result<Vec<ContentHash>, ParquetError> {
    let mut out = Vec::new();
    for batch in batches {
        let hashes = hash_column(batch)?;
        for i in 0..hashes.len() {
            out.push(hash_at(hashes, i)?);
        }
    }
    Ok(out)
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

/// The columns of a landing file that identify its rows ([`row_ids_of`]).
pub const ROW_ID_COLUMNS: [&str; 3] = [COL_OFFSET, COL_CONTENT_HASH, COL_INGEST_TS];

/// The offset, content hash and ingest time of a batch's rows, in row order.
pub fn row_ids_of(batch: &RecordBatch) -> Result<Vec<RowId>, ParquetError> {
    let hashes = hash_column(batch)?;
    let offsets = batch
        .column_by_name(COL_OFFSET)
        .and_then(|c| c.as_any().downcast_ref::<Int64Array>())
        .ok_or_else(|| ParquetError::General("no offset column".into()))?;
    let ingest = batch
        .column_by_name(COL_INGEST_TS)
        .and_then(|c| c.as_any().downcast_ref::<TimestampMicrosecondArray>())
        .ok_or_else(|| ParquetError::General("no ingest time column".into()))?;
    (0..batch.num_rows())
        .map(|i| {
            Ok(RowId {
                offset: offsets.value(i),
                hash: hash_at(hashes, i)?,
                ingest_ts: ingest.value(i),
            })
        })
        .collect()
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

fn hash_column(
    batch: &arrow::record_batch::RecordBatch,
) -> Result<&FixedSizeBinaryArray, ParquetError> {
    batch
        .column_by_name(COL_CONTENT_HASH)
        .and_then(|c| c.as_any().downcast_ref::<FixedSizeBinaryArray>())
        .ok_or_else(|| ParquetError::General("no content hash column".into()))
}

fn hash_at(hashes: &FixedSizeBinaryArray, i: usize) -> Result<ContentHash, ParquetError> {
    let bytes: [u8; 32] = hashes
        .value(i)
        .try_into()
        .map_err(|_| ParquetError::General("content hash is not 32 bytes".into()))?;
    Ok(ContentHash(bytes))
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
        columns: &[&'static str],
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

    fn planned(
        file: &Bytes,
        columns: &[&'static str],
        rows: Rows,
    ) -> Result<PagePlan, ParquetError> {
        let tail = file.slice(file.len().saturating_sub(TAIL_BYTES as usize)..);
        PagePlan::new(tail, file.len() as u64, columns, rows)
    }

    fn last_hashes(file: &Bytes, want: usize) -> Result<Vec<ContentHash>, ParquetError> {
        hashes_of(&read_planned(file, &[COL_CONTENT_HASH], Rows::Last(want))?)
    }

    fn chosen(file: &Bytes, want: usize) -> Result<PagePlan, ParquetError> {
        planned(file, &[COL_CONTENT_HASH], Rows::Last(want))
    }

    /// Readings as landing rows, offsets from 0.
    fn landing_rows(def: &StreamDef, n: i64) -> Vec<(Record, RowMeta)> {
        (0..n)
            .map(|i| {
                let json =
                    serde_json::json!({"device_id": "d", "sensor": "s", "ts": i, "value": i});
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

    /// A landing file of `rows` with row groups and data pages of at most the given rows.
    fn file_of(
        def: &StreamDef,
        rows: &[(Record, RowMeta)],
        group_rows: usize,
        page_rows: usize,
    ) -> Bytes {
        let props = writer_properties(def)
            .unwrap()
            .into_builder()
            .set_max_row_group_row_count(Some(group_rows))
            .set_data_page_row_count_limit(page_rows)
            .set_write_batch_size(page_rows)
            .build();
        let batch = record_batch(def, rows).unwrap();
        let mut writer = ArrowWriter::try_new(Vec::new(), batch.schema(), Some(props)).unwrap();
        writer.write(&batch).unwrap();
        Bytes::from(writer.into_inner().unwrap())
    }

    /// A landing file of 1,000 readings (offsets 0 to 999) in row groups of 300, 300, 300 and
    /// 100 rows, in pages of 50, and the readings' content hashes.
    fn paged_file() -> (Bytes, Vec<ContentHash>) {
        let def = schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone();
        let rows = landing_rows(&def, 1_000);
        let hashes = rows.iter().map(|(_, m)| m.hash).collect();
        (file_of(&def, &rows, 300, 50), hashes)
    }

    #[test]
    fn the_last_hashes_are_read_from_the_last_pages_only() {
        let (file, hashes) = paged_file();
        let groups = |want| chosen(&file, want).unwrap().row_groups;
        assert_eq!(groups(0), Vec::<usize>::new());
        assert_eq!(groups(1), [3]);
        assert_eq!(groups(100), [3]);
        assert_eq!(groups(101), [2, 3]);
        assert_eq!(groups(5_000), [0, 1, 2, 3]);
        for want in [1, 50, 51, 120, 400] {
            assert_eq!(
                last_hashes(&file, want).unwrap(),
                hashes[1_000 - want..],
                "{want} wanted"
            );
        }
        // Pages of 50 rows: 51 rows take two, one of them partly.
        assert_eq!(chosen(&file, 51).unwrap().ranges.len(), 1, "adjacent pages");
        assert_eq!(last_hashes(&file, 5_000).unwrap(), hashes);
        // Only those pages are read: a fifth of the hash column for 200 rows.
        let column: u64 = chosen(&file, 1_000)
            .unwrap()
            .ranges
            .iter()
            .map(|(s, e)| e - s)
            .sum();
        let some: u64 = chosen(&file, 200)
            .unwrap()
            .ranges
            .iter()
            .map(|(s, e)| e - s)
            .sum();
        assert!(some * 4 < column, "{some} of {column} bytes");
        // A piece not read is an error, not a wrong answer.
        let chunks = chosen(&file, 120).unwrap();
        let short = chunks.ranges.iter().map(|_| file.slice(0..1)).collect();
        assert!(chunks.read(file.len() as u64, short).is_err());
        assert!(footer_bytes(b"PAR1").is_err());
        assert!(footer_bytes(b"\x10\0\0\0NOPE").is_err());

        // The first rows of three columns, across a row group's end: offsets 0 to 349.
        let ids: Vec<RowId> = read_planned(&file, &ROW_ID_COLUMNS, Rows::First(350))
            .unwrap()
            .iter()
            .flat_map(|b| row_ids_of(b).unwrap())
            .collect();
        assert_eq!(ids.len(), 350);
        assert!(ids.iter().enumerate().all(|(i, id)| id.offset == i as i64));
        assert_eq!(ids[349].hash, hashes[349]);
        let plan = planned(&file, &ROW_ID_COLUMNS, Rows::First(350)).unwrap();
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
        let plan = PagePlan::new(
            tail,
            file.len() as u64,
            &[COL_CONTENT_HASH],
            Rows::Last(120),
        )
        .unwrap();
        assert_eq!(plan.row_groups, [2, 3]);
        let pieces = plan
            .ranges
            .iter()
            .map(|&(start, end)| file.slice(start as usize..end as usize))
            .collect();
        let batches = plan.read(file.len() as u64, pieces).unwrap();
        assert_eq!(hashes_of(&batches).unwrap(), hashes[880..]);
    }

    #[test]
    fn encode_then_read_offsets() {
        let def = schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone();
        let rows: Vec<_> = (0..10)
            .map(|i| {
                let json =
                    serde_json::json!({"device_id": "d", "sensor": "s", "ts": i, "value": i});
                let v = schemas::check(&def, json).unwrap();
                (
                    v.record,
                    RowMeta {
                        ingest_ts: 0,
                        partition: 1,
                        offset: 100 + i,
                        hash: v.hash,
                    },
                )
            })
            .collect();
        // Offsets 98 and 99 were skipped (duplicates) before the first row.
        let range = OffsetRange {
            first: 98,
            last: 109,
        };
        let data = encode(&def, "ingest.sensor_readings", 1, range, &rows).unwrap();
        let plan = planned(&data, &ROW_ID_COLUMNS, Rows::First(4)).unwrap();
        assert_eq!(plan.offsets().unwrap(), range);
        let hashes: Vec<_> = rows.iter().map(|(_, m)| m.hash).collect();
        assert_eq!(last_hashes(&data, usize::MAX).unwrap(), hashes);

        // Timestamps and offsets are delta-encoded without a dictionary, strings use one.
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
        for name in ["ts", COL_INGEST_TS, COL_OFFSET] {
            let (found, dictionary) = encodings(name);
            assert!(
                found.contains(&Encoding::DELTA_BINARY_PACKED),
                "{name}: {found:?}"
            );
            assert!(
                !found.contains(&Encoding::RLE_DICTIONARY),
                "{name}: {found:?}"
            );
            assert_eq!(dictionary, None, "{name}");
        }
        let (found, dictionary) = encodings("device_id");
        assert!(
            found.contains(&Encoding::RLE_DICTIONARY),
            "device_id: {found:?}"
        );
        assert!(dictionary.is_some());

        // zstd for the data, not for the random content hashes nor the one-value partition.
        let compression = |name: &str| column(name).compression();
        for name in ["device_id", "value", "ts", COL_INGEST_TS, COL_OFFSET] {
            assert!(matches!(compression(name), Compression::ZSTD(_)), "{name}");
        }
        for name in [COL_CONTENT_HASH, COL_PARTITION] {
            assert_eq!(compression(name), Compression::UNCOMPRESSED, "{name}");
        }
    }
}
