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
    /// First offset of the open file's range: the first offset consumed after the last file or
    /// commit. Files cover contiguous ranges, so keys are the same whoever writes them.
    pub range_start: Option<RangeStart>,
    /// The offset committed to Kafka, if any was in this assignment.
    pub committed: Option<i64>,
    pub last_append: Instant,
    pub window: HashWindow,
    /// Dead letters of the open range, as JSON lines for the dead-letter object.
    pub dead: Vec<u8>,
}

/// Where the open file's range begins. Its ingest time places the file in a date/hour folder,
/// so a file's key is the same whichever records of the range end up as rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangeStart {
    pub offset: i64,
    pub ingest_ts: i64,
}

/// Why a file was closed (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushReason {
    Records,
    Bytes,
    Hour,
    Idle,
    Memory,
    Shutdown,
}

impl FlushReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FlushReason::Records => "records",
            FlushReason::Bytes => "bytes",
            FlushReason::Hour => "hour",
            FlushReason::Idle => "idle",
            FlushReason::Memory => "memory",
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
            range_start: None,
            committed: None,
            last_append: Instant::now(),
            window: HashWindow::new(window),
            dead: Vec::new(),
        }
    }

    /// Whether a record with this ingest time belongs to another hour than the open file.
    pub fn crosses_hour(&self, ingest_ts: i64) -> bool {
        self.range_start.is_some_and(|r| {
            r.ingest_ts.div_euclid(HOUR_MICROS) != ingest_ts.div_euclid(HOUR_MICROS)
        })
    }

    pub fn push(&mut self, record: Record, meta: RowMeta, bytes: usize) {
        self.range_start.get_or_insert(RangeStart {
            offset: meta.offset,
            ingest_ts: meta.ingest_ts,
        });
        self.next_offset = Some(meta.offset + 1);
        self.bytes += bytes;
        self.last_append = Instant::now();
        self.rows.push((record, meta));
    }

    /// Marks an offset as consumed without a row (a duplicate or a dead letter).
    pub fn skip(&mut self, offset: i64, ingest_ts: i64) {
        self.range_start
            .get_or_insert(RangeStart { offset, ingest_ts });
        self.next_offset = Some(offset + 1);
        self.last_append = Instant::now();
    }

    /// Keeps an undecodable or invalid record for the dead-letter object, with its reason.
    pub fn dead_letter(&mut self, offset: i64, ingest_ts: i64, reason: &str, payload: &[u8]) {
        let line = serde_json::json!({
            "topic": self.topic,
            "partition": self.partition,
            "offset": offset,
            "ingest_ts": ingest_ts,
            "reason": reason,
            "payload_hex": hex::encode(payload),
        });
        self.dead.extend_from_slice(line.to_string().as_bytes());
        self.dead.push(b'\n');
        self.skip(offset, ingest_ts);
    }

    /// Whether there is something to write or commit.
    pub fn has_pending(&self) -> bool {
        !self.rows.is_empty() || self.next_offset > self.committed
    }

    /// Adopts an existing object that accounts for offsets up to and including `last`: drops
    /// the rows it holds and continues the range chain after it. The next range starts at
    /// `last + 1`, with the ingest time of the first row after it when one is buffered.
    pub fn adopt_through(&mut self, last: i64) {
        let before = self.rows.len();
        self.rows.retain(|(_, m)| m.offset > last);
        self.bytes = self.bytes * self.rows.len() / before.max(1);
        if self.next_offset.is_some_and(|n| n > last + 1) {
            let ingest_ts = self.rows.first().map_or_else(
                || self.range_start.map_or(0, |r| r.ingest_ts),
                |(_, m)| m.ingest_ts,
            );
            self.range_start = Some(RangeStart {
                offset: last + 1,
                ingest_ts,
            });
        } else {
            self.next_offset = Some(last + 1);
            self.range_start = None;
        }
    }
}
