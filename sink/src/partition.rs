//! The state of one assigned partition: buffered rows of the open file, the dedupe window and
//! the position up to which everything is accounted for (durable or intentionally dropped).

use std::sync::Arc;
use std::time::Instant;

use schemas::StreamDef;
use schemas::arrow::RowMeta;
use schemas::value::Record;
use schemas::window::HashWindow;

const HOUR_MICROS: i64 = 3_600_000_000;

pub struct PartitionState {
    pub def: Arc<StreamDef>,
    pub topic: String,
    pub partition: i32,
    /// Rows of the open file, in offset order.
    pub rows: Vec<(Record, RowMeta)>,
    /// Approximate size of the buffered rows (their Kafka value bytes).
    pub bytes: usize,
    /// The next offset to read: every record before it is in a written file or was dropped.
    pub next_offset: Option<i64>,
    /// The offset committed to Kafka, if any was in this assignment.
    pub committed: Option<i64>,
    pub last_append: Instant,
    pub window: HashWindow,
}

/// Why a file was closed (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushReason {
    Records,
    Bytes,
    Hour,
    Idle,
    Shutdown,
}

impl FlushReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FlushReason::Records => "records",
            FlushReason::Bytes => "bytes",
            FlushReason::Hour => "hour",
            FlushReason::Idle => "idle",
            FlushReason::Shutdown => "shutdown",
        }
    }
}

impl PartitionState {
    pub fn new(def: Arc<StreamDef>, topic: String, partition: i32, window: usize) -> Self {
        PartitionState {
            def,
            topic,
            partition,
            rows: Vec::new(),
            bytes: 0,
            next_offset: None,
            committed: None,
            last_append: Instant::now(),
            window: HashWindow::new(window),
        }
    }

    /// Whether a record with this ingest time belongs to another hour than the open file.
    pub fn crosses_hour(&self, ingest_ts: i64) -> bool {
        self.rows.first().is_some_and(|(_, m)| {
            m.ingest_ts.div_euclid(HOUR_MICROS) != ingest_ts.div_euclid(HOUR_MICROS)
        })
    }

    pub fn push(&mut self, record: Record, meta: RowMeta, bytes: usize) {
        self.next_offset = Some(meta.offset + 1);
        self.bytes += bytes;
        self.last_append = Instant::now();
        self.rows.push((record, meta));
    }

    /// Marks an offset as consumed without a row (a duplicate or a dead letter).
    pub fn skip(&mut self, offset: i64) {
        self.next_offset = Some(offset + 1);
        self.last_append = Instant::now();
    }

    /// Whether there is something to write or commit.
    pub fn has_pending(&self) -> bool {
        !self.rows.is_empty() || self.next_offset > self.committed
    }

    /// Drops rows up to and including `last` (they are durable in an existing object).
    pub fn drop_through(&mut self, last: i64) {
        let before = self.rows.len();
        self.rows.retain(|(_, m)| m.offset > last);
        self.bytes = self.bytes * self.rows.len() / before.max(1);
    }
}
