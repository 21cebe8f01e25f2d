//! The open landing file of a partition. Rows are collected in Arrow builders until they make
//! a row group (`rotation.row_group_bytes` of record data); the row group is then sorted into
//! series order (`schemas::arrow::sort_batch`: partition key, the other string fields, event
//! time), encoded and written to a staged file. So memory holds only the row group in progress,
//! many partitions with large target files fit a small memory budget, a file closes at its
//! target Parquet size, and each row group's rows lie in the order that compresses best.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use arrow::array::{Array, RecordBatch, TimestampMicrosecondArray};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::errors::ParquetError;
use parquet::file::metadata::ParquetMetaDataReader;
use schemas::arrow::{BatchBuilder, COL_INGEST_TS, HashColumn, RowMeta};
use schemas::{Row, StreamDef};

use crate::parquet_file::{
    OffsetRange, ROW_GROUP_ROWS, RowId, file_metadata, offset_column, row_ids_of, writer_properties,
};
use crate::store::Staged;
use crate::table::stats::FileStats;

/// Size targets of a landing file.
#[derive(Debug, Clone, Copy)]
pub struct FileTargets {
    /// Close the file when its Parquet size reaches this.
    pub file_bytes: usize,
    /// Sort and write a row group when its rows' record data (the Kafka values) reaches this.
    pub row_group_bytes: usize,
}

/// Parquet bytes per byte of record data (Kafka values), as the partition's last file showed:
/// what the rows of an open file not yet encoded are estimated at until its first row group is
/// written.
#[derive(Debug, Clone, Copy)]
pub struct SizeRatio(pub f64);

impl Default for SizeRatio {
    /// A guess for a partition's first file: sensor readings come to about 5% of their JSON in
    /// Parquet.
    fn default() -> Self {
        SizeRatio(0.05)
    }
}

pub struct OpenFile {
    /// In a mutex only to make the sink's state `Sync` (the writer is `Send` but not `Sync`);
    /// it is reached through `&mut self` and never contended.
    writer: Mutex<ArrowWriter<Staged>>,
    def: Arc<StreamDef>,
    /// Rows of the row group in progress, in Arrow builders.
    pending: BatchBuilder,
    /// Record data (Kafka value bytes) of the pending rows (their memory is of that order).
    pending_bytes: usize,
    /// Rows in the row groups written.
    rows: usize,
    /// Record data of the rows in the row groups written.
    written_data: usize,
    min_event_time: i64,
    max_event_time: i64,
    targets: FileTargets,
    ratio: SizeRatio,
    /// Bytes written to the staged file (row groups and the header).
    staged: usize,
}

impl OpenFile {
    pub fn create(
        def: Arc<StreamDef>,
        hash: HashColumn,
        staging: &Path,
        targets: FileTargets,
        ratio: SizeRatio,
    ) -> Result<OpenFile, ParquetError> {
        let staged = tempfile::Builder::new()
            .prefix(".tmp-")
            .suffix(".parquet")
            .tempfile_in(staging)
            .map_err(|e| ParquetError::External(Box::new(e)))?;
        let schema = schemas::arrow::arrow_schema(&def, hash);
        let writer = ArrowWriter::try_new(staged, schema, Some(writer_properties(&def, hash)?))?;
        Ok(OpenFile {
            writer: Mutex::new(writer),
            pending: BatchBuilder::new(&def, hash, 1024),
            def,
            pending_bytes: 0,
            rows: 0,
            written_data: 0,
            min_event_time: i64::MAX,
            max_event_time: i64::MIN,
            targets,
            ratio,
            staged: 0,
        })
    }

    /// Adds a row of `bytes` of record data; writes the row group once it is complete.
    pub fn push<H>(
        &mut self,
        row: &Row<'_, H>,
        meta: RowMeta,
        bytes: usize,
    ) -> Result<(), ParquetError> {
        self.pending.push(row, meta);
        self.pending_bytes += bytes;
        if self.pending_bytes >= self.targets.row_group_bytes
            || self.pending.len() >= ROW_GROUP_ROWS
        {
            self.write_row_group()?;
        }
        Ok(())
    }

    /// Sorts the pending rows and writes them as a row group.
    fn write_row_group(&mut self) -> Result<(), ParquetError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let batch = self.pending.finish_sorted(&self.def)?;
        let data = std::mem::take(&mut self.pending_bytes);
        self.write_sorted(&batch, data)
    }

    /// Writes a batch of this stream's landing schema, in series order, as a row group.
    fn write_sorted(&mut self, batch: &RecordBatch, data: usize) -> Result<(), ParquetError> {
        if let Some(times) = batch
            .column_by_name(&self.def.event_time_field().name)
            .and_then(|c| c.as_any().downcast_ref::<TimestampMicrosecondArray>())
        {
            for t in times.iter().flatten() {
                self.min_event_time = self.min_event_time.min(t);
                self.max_event_time = self.max_event_time.max(t);
            }
        }
        self.rows += batch.num_rows();
        self.written_data += data;
        let writer = self.writer_mut();
        writer.write(batch)?;
        writer.flush()?;
        self.staged = writer.bytes_written();
        Ok(())
    }

    /// Writes rows of this stream's landing schema taken from another file (those past an
    /// adopted object), sorted into series order as one row group. Their record data is
    /// counted as their Arrow memory.
    pub fn write_batches(&mut self, batches: &[RecordBatch]) -> Result<(), ParquetError> {
        self.write_row_group()?;
        let Some(first) = batches.first() else {
            return Ok(());
        };
        let batch = arrow::compute::concat_batches(&first.schema(), batches)?;
        let sorted = schemas::arrow::sort_batch(&self.def, &batch)?;
        self.write_sorted(&sorted, batch.get_array_memory_size())
    }

    fn writer_mut(&mut self) -> &mut ArrowWriter<Staged> {
        self.writer
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes the row group in progress to the staged file (to free memory).
    pub fn spill(&mut self) -> Result<(), ParquetError> {
        self.write_row_group()
    }

    /// Rows in the file, pending ones included.
    pub fn rows(&self) -> usize {
        self.rows + self.pending.len()
    }

    /// Memory the file holds: the rows of the row group in progress.
    pub fn memory(&self) -> usize {
        self.pending_bytes
    }

    /// Bytes written to the staged file so far.
    pub fn staged(&self) -> usize {
        self.staged
    }

    /// Parquet bytes per byte of record data: this file's so far, or the partition's last one's.
    fn bytes_per_data_byte(&self) -> f64 {
        if self.written_data > 0 {
            self.staged as f64 / self.written_data as f64
        } else {
            self.ratio.0
        }
    }

    /// The file size estimate: row groups written, and the pending rows at the rate so far.
    fn estimate(&self) -> f64 {
        self.staged as f64 + self.pending_bytes as f64 * self.bytes_per_data_byte()
    }

    /// New size targets (a reload): the next row group and the next size check follow them.
    pub fn set_targets(&mut self, targets: FileTargets) {
        self.targets = targets;
    }

    /// Whether the file reached its target size (by [`OpenFile::estimate`]).
    pub fn is_full(&self) -> bool {
        self.estimate() >= self.targets.file_bytes as f64
    }

    /// Finishes the file with a landing file's key-value metadata ([`crate::parquet_file`]) and returns the staged file.
    pub fn finish(
        mut self,
        topic: &str,
        partition: i32,
        range: OffsetRange,
    ) -> Result<Finished, ParquetError> {
        self.write_row_group()?;
        let metadata = file_metadata(
            &self.def,
            topic,
            partition,
            range,
            self.rows,
            (self.min_event_time, self.max_event_time),
        );
        for item in metadata {
            self.writer_mut().append_key_value_metadata(item);
        }
        let (rows, data) = (self.rows, self.written_data);
        let staged = self
            .writer
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .into_inner()?;
        let file = staged.as_file();
        file.sync_all()
            .map_err(|e| ParquetError::External(Box::new(e)))?;
        let size = file
            .metadata()
            .map_err(|e| ParquetError::External(Box::new(e)))?
            .len();
        let ratio = if data > 0 {
            SizeRatio((size as f64 / data as f64).clamp(1e-4, 10.0))
        } else {
            self.ratio
        };
        let footer = ParquetMetaDataReader::new().parse_and_finish(
            &file
                .try_clone()
                .map_err(|e| ParquetError::External(Box::new(e)))?,
        )?;
        Ok(Finished {
            staged,
            rows,
            size,
            ratio,
            stats: FileStats::of(&footer),
        })
    }
}

/// A finished landing file, staged.
pub struct Finished {
    pub staged: Staged,
    pub rows: usize,
    pub size: u64,
    /// Final size / estimate, for the partition's next file.
    pub ratio: SizeRatio,
    /// Its columns' statistics, for a table's manifest.
    pub stats: FileStats,
}

/// What is left of a finished staged file after another sink's object was adopted.
pub struct RowsAfter {
    /// The rows with offsets after the adopted object's last, as Arrow batches.
    pub batches: Vec<RecordBatch>,
    /// The ingest time of the first of them.
    pub first_ingest_ts: Option<i64>,
    /// Rows the adopted object accounts for (offsets up to its last).
    pub covered: u64,
    /// What identifies those of them whose offsets were asked for, in offset order, to compare
    /// with the adopted object's rows at the same offsets.
    pub covered_ids: Vec<RowId>,
}

/// The rows of a finished staged file with offsets after `last`: what is left to land after
/// another sink's object was adopted. Of the rows up to `last`, only those at `compared`
/// offsets (the rows read of the adopted object) are identified: a row's hash is computed from
/// its fields, and the others would be computed for nothing.
pub fn rows_after(
    def: &StreamDef,
    staged: &Staged,
    last: i64,
    compared: &HashSet<i64>,
) -> Result<RowsAfter, ParquetError> {
    let file = staged
        .reopen()
        .map_err(|e| ParquetError::External(Box::new(e)))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)?.build()?;
    let mut out = RowsAfter {
        batches: Vec::new(),
        first_ingest_ts: None,
        covered: 0,
        covered_ids: Vec::new(),
    };
    // The kept row with the lowest offset: (offset, ingest time).
    let mut first: Option<(i64, i64)> = None;
    for batch in reader {
        let batch = batch?;
        let offsets = offset_column(&batch)?;
        let compare: Vec<usize> = (0..batch.num_rows())
            .filter(|&row| offsets.value(row) <= last && compared.contains(&offsets.value(row)))
            .collect();
        out.covered_ids.extend(row_ids_of(def, &batch, compare)?);
        let ingest = batch
            .column_by_name(COL_INGEST_TS)
            .and_then(|c| c.as_any().downcast_ref::<TimestampMicrosecondArray>())
            .ok_or_else(|| ParquetError::General("no ingest time column".into()))?;
        for row in (0..batch.num_rows()).filter(|&row| offsets.value(row) > last) {
            let offset = offsets.value(row);
            if first.is_none_or(|(lowest, _)| offset < lowest) {
                first = Some((offset, ingest.value(row)));
            }
        }
        let keep: arrow::array::BooleanArray =
            offsets.iter().map(|o| o.map(|o| o > last)).collect();
        let kept = arrow::compute::filter_record_batch(&batch, &keep)?;
        out.covered += (batch.num_rows() - kept.num_rows()) as u64;
        if kept.num_rows() > 0 {
            out.batches.push(kept);
        }
    }
    out.first_ingest_ts = first.map(|(_, ingest_ts)| ingest_ts);
    out.covered_ids.sort_unstable_by_key(|id| id.offset);
    Ok(out)
}
