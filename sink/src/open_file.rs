//! The open landing file of a partition. Rows are encoded into Parquet as they arrive and row
//! groups are written to a staged file, so memory holds only the row group in progress: many
//! partitions with large target files fit a small memory budget, and a file closes at its
//! target Parquet size (not at a guess from the JSON size).

use std::path::Path;
use std::sync::{Mutex, PoisonError};

use arrow::array::{Array, Int64Array, RecordBatch, TimestampMicrosecondArray};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::errors::ParquetError;
use schemas::arrow::{BatchBuilder, COL_INGEST_TS, COL_OFFSET, RowMeta};
use schemas::{Row, StreamDef};

use crate::parquet_file::{OffsetRange, RowId, file_metadata, row_ids_of, writer_properties};
use crate::store::Staged;

/// Rows collected before they are encoded as one Arrow batch: small enough that the size
/// check after each batch stays close to the target.
const BATCH_ROWS: usize = 1024;

/// Size targets of a landing file.
#[derive(Debug, Clone, Copy)]
pub struct FileTargets {
    /// Close the file when its Parquet size reaches this.
    pub file_bytes: usize,
    /// Write a row group out when its encoded size reaches this.
    pub row_group_bytes: usize,
}

/// Final size / estimated size of the partition's previous file: the writer's estimate of a
/// row group in progress counts pages not yet compressed, so it runs high; the next file's
/// estimate is scaled by what the last one showed.
#[derive(Debug, Clone, Copy)]
pub struct SizeRatio(pub f64);

impl Default for SizeRatio {
    fn default() -> Self {
        SizeRatio(1.0)
    }
}

pub struct OpenFile {
    /// In a mutex only to make the sink's state `Sync` (the writer is `Send` but not `Sync`);
    /// it is reached through `&mut self` and never contended.
    writer: Mutex<ArrowWriter<Staged>>,
    event_time_column: String,
    /// Rows not yet encoded, in Arrow builders.
    pending: BatchBuilder,
    /// Kafka value bytes of the pending rows (their memory is of that order).
    pending_bytes: usize,
    rows: usize,
    min_event_time: i64,
    max_event_time: i64,
    targets: FileTargets,
    ratio: SizeRatio,
    /// The writer's size estimate (row groups written plus the one in progress) after the last
    /// batch: it changes only when a batch is written, and reading it from the writer takes a
    /// lock per column.
    encoded_estimate: usize,
    /// The writer's memory (the row group in progress) after the last batch, for the same
    /// reason: the budget is checked every few records, summing over every open file.
    writer_memory: usize,
    /// Bytes written to the staged file (row groups and the header), for the staging budget.
    staged: usize,
}

impl OpenFile {
    pub fn create(
        def: &StreamDef,
        staging: &Path,
        targets: FileTargets,
        ratio: SizeRatio,
    ) -> Result<OpenFile, ParquetError> {
        let staged = tempfile::Builder::new()
            .prefix(".tmp-")
            .suffix(".parquet")
            .tempfile_in(staging)
            .map_err(|e| ParquetError::External(Box::new(e)))?;
        let schema = schemas::arrow::arrow_schema(def);
        let writer = ArrowWriter::try_new(staged, schema, Some(writer_properties(def)?))?;
        Ok(OpenFile {
            writer: Mutex::new(writer),
            event_time_column: def.event_time_field().name.clone(),
            pending: BatchBuilder::new(def, BATCH_ROWS),
            pending_bytes: 0,
            rows: 0,
            min_event_time: i64::MAX,
            max_event_time: i64::MIN,
            targets,
            ratio,
            encoded_estimate: 0,
            writer_memory: 0,
            staged: 0,
        })
    }

    /// Adds a row; encodes the pending rows once there are enough for a batch.
    pub fn push<H>(
        &mut self,
        row: &Row<'_, H>,
        meta: RowMeta,
        bytes: usize,
    ) -> Result<(), ParquetError> {
        self.pending.push(row, meta);
        self.pending_bytes += bytes;
        if self.pending.len() >= BATCH_ROWS {
            self.encode_pending()?;
        }
        Ok(())
    }

    fn encode_pending(&mut self) -> Result<(), ParquetError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let batch = self.pending.finish()?;
        self.pending_bytes = 0;
        self.write_batch(&batch)
    }

    /// Appends an Arrow batch of this stream's landing schema.
    pub fn write_batch(&mut self, batch: &RecordBatch) -> Result<(), ParquetError> {
        if let Some(times) = batch
            .column_by_name(&self.event_time_column)
            .and_then(|c| c.as_any().downcast_ref::<TimestampMicrosecondArray>())
        {
            for t in times.iter().flatten() {
                self.min_event_time = self.min_event_time.min(t);
                self.max_event_time = self.max_event_time.max(t);
            }
        }
        self.rows += batch.num_rows();
        let row_group_bytes = self.targets.row_group_bytes;
        let writer = self.writer_mut();
        writer.write(batch)?;
        if writer.in_progress_size() >= row_group_bytes {
            writer.flush()?;
        }
        (self.encoded_estimate, self.writer_memory, self.staged) = (
            writer.bytes_written() + writer.in_progress_size(),
            writer.memory_size(),
            writer.bytes_written(),
        );
        Ok(())
    }

    fn writer_mut(&mut self) -> &mut ArrowWriter<Staged> {
        self.writer
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes the row group in progress to the staged file (to free memory).
    pub fn spill(&mut self) -> Result<(), ParquetError> {
        self.encode_pending()?;
        let writer = self.writer_mut();
        writer.flush()?;
        (self.encoded_estimate, self.writer_memory, self.staged) = (
            writer.bytes_written(),
            writer.memory_size(),
            writer.bytes_written(),
        );
        Ok(())
    }

    /// Rows in the file, pending ones included.
    pub fn rows(&self) -> usize {
        self.rows + self.pending.len()
    }

    /// Memory the file holds: pending rows and the row group in progress.
    pub fn memory(&self) -> usize {
        self.pending_bytes + self.writer_memory
    }

    /// Bytes written to the staged file so far.
    pub fn staged(&self) -> usize {
        self.staged
    }

    /// The writer's estimate of the file size: row groups written, the one in progress, and
    /// the pending rows at the encoded size per row so far.
    fn raw_estimate(&self) -> f64 {
        let encoded = self.encoded_estimate as f64;
        let per_row = if self.rows > 0 {
            encoded / self.rows as f64
        } else {
            0.0
        };
        encoded + per_row * self.pending.len() as f64
    }

    /// New size targets (a reload): the next row group and the next size check follow them.
    pub fn set_targets(&mut self, targets: FileTargets) {
        self.targets = targets;
    }

    /// Whether the file reached its target size (the estimate, corrected by the ratio the
    /// partition's previous file showed).
    pub fn is_full(&self) -> bool {
        self.raw_estimate() * self.ratio.0 >= self.targets.file_bytes as f64
    }

    /// Finishes the file with a landing file's key-value metadata ([`crate::parquet_file`]) and returns the staged file.
    pub fn finish(
        mut self,
        def: &StreamDef,
        topic: &str,
        partition: i32,
        range: OffsetRange,
    ) -> Result<Finished, ParquetError> {
        let estimate = self.raw_estimate();
        self.encode_pending()?;
        let metadata = file_metadata(
            def,
            topic,
            partition,
            range,
            self.rows,
            (self.min_event_time, self.max_event_time),
        );
        for item in metadata {
            self.writer_mut().append_key_value_metadata(item);
        }
        let rows = self.rows;
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
        let ratio = if estimate > 0.0 {
            SizeRatio((size as f64 / estimate).clamp(0.1, 10.0))
        } else {
            self.ratio
        };
        Ok(Finished {
            staged,
            rows,
            size,
            ratio,
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
}

/// What is left of a finished staged file after another sink's object was adopted.
pub struct RowsAfter {
    /// The rows with offsets after the adopted object's last, as Arrow batches.
    pub batches: Vec<RecordBatch>,
    /// The ingest time of the first of them.
    pub first_ingest_ts: Option<i64>,
    /// Rows the adopted object accounts for (offsets up to its last).
    pub covered: u64,
    /// What identifies those rows, to compare with the adopted object's.
    pub covered_ids: Vec<RowId>,
}

/// The rows of a finished staged file with offsets after `last`: what is left to land after
/// another sink's object was adopted.
pub fn rows_after(staged: &Staged, last: i64) -> Result<RowsAfter, ParquetError> {
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
    for batch in reader {
        let batch = batch?;
        let ids = row_ids_of(&batch)?;
        out.covered_ids
            .extend(ids.into_iter().take_while(|id| id.offset <= last));
        let offsets = batch
            .column_by_name(COL_OFFSET)
            .and_then(|c| c.as_any().downcast_ref::<Int64Array>())
            .ok_or_else(|| ParquetError::General("no offset column".into()))?;
        let keep: arrow::array::BooleanArray =
            offsets.iter().map(|o| o.map(|o| o > last)).collect();
        let kept = arrow::compute::filter_record_batch(&batch, &keep)?;
        out.covered += (batch.num_rows() - kept.num_rows()) as u64;
        if kept.num_rows() == 0 {
            continue;
        }
        if out.first_ingest_ts.is_none() {
            out.first_ingest_ts = kept
                .column_by_name(COL_INGEST_TS)
                .and_then(|c| c.as_any().downcast_ref::<TimestampMicrosecondArray>())
                .and_then(|c| c.iter().flatten().next());
        }
        out.batches.push(kept);
    }
    Ok(out)
}
