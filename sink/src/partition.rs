//! The state of one assigned partition: buffered rows of the open file, the dedupe window and
//! the position up to which everything is accounted for (durable or intentionally dropped).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use schemas::arrow::{HashColumn, RowMeta};
use schemas::window::{DigestWindow, digest};
use schemas::{AtOnce, ContentHash, Hashing, RecordError, Row, StreamDef};

use crate::open_file::{FileTargets, OpenFile, SizeRatio};
use crate::parquet_file::RowId;
use crate::registry::Schemas;
use schemas::registry::{frame, unframed_taken};

const HOUR_MICROS: i64 = 3_600_000_000;

pub struct PartitionState {
    pub def: Arc<StreamDef>,
    pub topic: String,
    pub partition: i32,
    /// The open landing file: rows of the current range, in offset order.
    pub file: Option<OpenFile>,
    /// How the previous file's final size compared with its estimate.
    pub size_ratio: SizeRatio,
    /// The `_content_hash` column of the partition's files (`landing.content_hash_bytes`).
    pub hash_column: HashColumn,
    /// `sink_records_received_total` of the stream, registered once (not per message).
    pub received: metrics::Counter,
    /// `sink_adopted_records_total` of the stream, registered once: records read again below
    /// an adopted object's last offset are counted one by one.
    pub adopted: metrics::Counter,
    /// `sink_discarded_records_total{reason="duplicate"}` of the stream, registered once: a
    /// lookup by labels for every dropped duplicate cost a string copy and a registry search.
    pub duplicates: metrics::Counter,
    /// The next offset to read: every record before it is in a written file or was dropped.
    pub next_offset: Option<i64>,
    /// First offset of the open file's range: the first offset consumed after the last file or
    /// commit. Files cover contiguous ranges, so keys are the same whoever writes them.
    pub range_start: Option<RangeStart>,
    /// The offset committed to Kafka, if any was in this assignment.
    pub committed: Option<i64>,
    /// Where the partition's first record is expected, before anything was consumed: the
    /// group's committed offset, or where the sink sought it back to. `None` for a partition
    /// the group never committed (it starts at the earliest offset Kafka holds, unchecked).
    pub expect_from: Option<i64>,
    pub last_append: Instant,
    pub window: DigestWindow,
    /// Dead letters of the open range, as JSON lines for the dead-letter object.
    pub dead: DeadLetters,
    /// The last line of a dead-letter object found already written (by this partition's
    /// previous owner, or before a crash). Dead letters up to it are in that object and are not
    /// kept again, and the open range does not close before it: whoever reads on from the
    /// range's end then starts past that object, where the chain's next key is the one it
    /// computes.
    pub dead_through: Option<i64>,
    /// A write was given up at shutdown: the partition takes no more records and writes and
    /// commits nothing more, so that its next owner reads the unwritten range again.
    pub stopped: bool,
    /// A compatible newer definition of the stream, read while a file of the old one was open:
    /// the partition takes it when it opens its next file, or sooner when a record needs it
    /// (the open file then closes first). A file's rows all have one definition's columns.
    pub newer: Option<Arc<StreamDef>>,
}

/// Dead letters not yet in an object: JSON lines, each line's offset and ingest time kept to
/// name the object and to drop the lines an existing object already holds.
#[derive(Debug, Default)]
pub struct DeadLetters {
    text: Vec<u8>,
    /// (offset, ingest time, end of the line in `text`), in offset order.
    lines: Vec<(i64, i64, usize)>,
}

impl DeadLetters {
    /// Bytes of the JSON lines.
    pub fn len(&self) -> usize {
        self.text.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// Memory held, lines and their index.
    pub fn memory(&self) -> usize {
        self.text.len() + self.lines.len() * std::mem::size_of::<(i64, i64, usize)>()
    }

    /// Offset and ingest time of the first dead letter, which name its object.
    pub fn first(&self) -> Option<(i64, i64)> {
        self.lines
            .first()
            .map(|&(offset, ingest_ts, _)| (offset, ingest_ts))
    }

    /// The JSON lines, for the object.
    pub fn text(&self) -> &[u8] {
        &self.text
    }

    fn push(&mut self, offset: i64, ingest_ts: i64, line: &serde_json::Value) {
        // Writing into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut self.text, line);
        self.text.push(b'\n');
        self.lines.push((offset, ingest_ts, self.text.len()));
    }

    /// Forgets the dead letters at offsets up to and including `last` (an object holds them).
    pub fn drop_through(&mut self, last: i64) {
        let kept = self.lines.partition_point(|&(offset, ..)| offset <= last);
        let Some(&(.., cut)) = kept.checked_sub(1).map(|i| &self.lines[i]) else {
            return;
        };
        self.text.drain(..cut);
        self.lines.drain(..kept);
        for line in &mut self.lines {
            line.2 -= cut;
        }
    }
}

/// The offset, payload (as a hash) and ingest time of the dead letters in JSON lines, in
/// offset order: what [`crate::parquet_file::other_messages`] compares.
pub fn dead_letter_ids(text: &[u8]) -> anyhow::Result<Vec<RowId>> {
    #[derive(serde::Deserialize)]
    struct Line<'a> {
        offset: i64,
        #[serde(default)]
        ingest_ts: i64,
        #[serde(default, borrow)]
        payload_hex: &'a str,
    }
    let mut ids = Vec::new();
    for line in text.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let line: Line =
            serde_json::from_slice(line).context("a dead-letter line without its offset")?;
        ids.push(RowId {
            offset: line.offset,
            hash: ContentHash(*blake3::hash(line.payload_hex.as_bytes()).as_bytes()),
            ingest_ts: line.ingest_ts,
        });
    }
    ids.sort_by_key(|id| id.offset);
    Ok(ids)
}

/// The offset of the last dead letter in an object's JSON lines.
pub fn last_dead_letter(ids: &[RowId]) -> anyhow::Result<i64> {
    ids.last()
        .map(|id| id.offset)
        .context("a dead-letter object without dead letters")
}

/// Where the open file's range begins. Its ingest time places the file in a date/hour folder,
/// so a file's key is the same whichever records of the range end up as rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangeStart {
    pub offset: i64,
    pub ingest_ts: i64,
    /// When this sink consumed the range's first record: the file's age for
    /// `rotation.max_age_ms`.
    pub opened: Instant,
}

/// Why a file was closed (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushReason {
    Records,
    Bytes,
    Hour,
    Idle,
    Age,
    /// The range's dead letters reached `rotation.max_dead_letter_bytes`, or took the most of
    /// the memory budget.
    DeadLetters,
    /// The staged files of all open files together reached `upload.staging_budget_bytes`: the
    /// one with the most on disk closes early.
    StagingBudget,
    /// The stream's definition changed (compatibly) and a record needs the new one: the file of
    /// the old columns closes.
    Definition,
    /// The next record is past an offset gap and the partition stops there: what came before
    /// is landed and committed.
    OffsetGap,
    Shutdown,
}

impl FlushReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FlushReason::Records => "records",
            FlushReason::Bytes => "bytes",
            FlushReason::Hour => "hour",
            FlushReason::Idle => "idle",
            FlushReason::Age => "age",
            FlushReason::DeadLetters => "dead_letters",
            FlushReason::StagingBudget => "staging_budget",
            FlushReason::Definition => "definition",
            FlushReason::OffsetGap => "offset_gap",
            FlushReason::Shutdown => "shutdown",
        }
    }
}

/// What became of a record taken from the partition.
#[derive(Debug)]
pub enum Appended {
    /// A row of the open file; `full` when the file reached its target size.
    Row { full: bool },
    /// Its content hash is in the window: dropped.
    Duplicate,
    /// Undecodable or invalid: kept for the dead-letter object.
    DeadLetter(RecordError),
    /// Not taken, and not consumed: framed with a schema id that is not loaded yet
    /// ([`Schemas::load`]).
    SchemaNotLoaded(u32),
    /// Not taken, and not consumed: the stream's definition lacks a field the record sets, or
    /// requires one it lacks, which a newer definition may not. The worker looks for one
    /// ([`PartitionState::newer`]) before it makes the record a dead letter.
    Unfit(RecordError),
}

impl PartitionState {
    /// Takes the record at `offset` (its Kafka value `payload`): a row of the open file (created
    /// in `staging` when there is none), a dropped duplicate or a dead letter. Either way the
    /// offset is consumed.
    pub fn append(
        &mut self,
        payload: &[u8],
        offset: i64,
        ingest_ts: i64,
        staging: &Path,
        (targets, registry): (FileTargets, &Schemas),
    ) -> anyhow::Result<Appended> {
        let checked = self.check(payload, &mut AtOnce, registry);
        let checked = checked.as_ref().map(|row| (row, row.hash));
        self.append_checked(checked, payload, offset, ingest_ts, staging, targets)
    }

    /// Checks a record for [`PartitionState::append_checked`], its content hash made as
    /// `hashing` makes hashes: the worker checks a group of records, makes their hashes
    /// together ([`schemas::HashGroup`]), then appends them. A partition without an open file
    /// takes its newer definition first, so the record is checked against the definition it
    /// is appended with.
    pub fn check<'a, H: Hashing>(
        &mut self,
        payload: &'a [u8],
        hashing: &mut H,
        registry: &Schemas,
    ) -> Result<Row<'a, H::Hash>, RecordError> {
        if self.file.is_none()
            && let Some(newer) = self.newer.take()
        {
            self.def = newer;
        }
        match frame(payload) {
            None => {
                unframed_taken(&self.def, payload)?;
                schemas::check_bytes_row_in(&self.def, payload, hashing)
            }
            Some(framed) => {
                let (id, body) = framed?;
                match registry.writer(id, &self.def) {
                    Some(writer) => writer.check_row_in(&self.def, id, body, hashing),
                    None => Err(RecordError::SchemaNotLoaded(id)),
                }
            }
        }
    }

    /// Loads the dedupe window's buckets that appending a record of content hash `hash` will
    /// probe first ([`DigestWindow::prefetch`]): called for a group of checked records before
    /// they are appended, so their cache misses overlap instead of coming one after another.
    pub fn prefetch(&self, hash: &ContentHash) {
        self.window.prefetch(&[digest(hash)]);
    }

    /// [`PartitionState::append`] of a record checked by [`PartitionState::check`]: the row
    /// (borrowed: a move copies its slots) and its content hash, or the check's error (cloned
    /// into the answer: an invalid record becomes a dead letter, a rare path).
    pub fn append_checked<H>(
        &mut self,
        checked: Result<(&Row<'_, H>, ContentHash), &RecordError>,
        payload: &[u8],
        offset: i64,
        ingest_ts: i64,
        staging: &Path,
        targets: FileTargets,
    ) -> anyhow::Result<Appended> {
        let def = &self.def;
        let (row, hash) = match checked {
            Ok(checked) => checked,
            Err(e) if e.newer_definition_may_take() => return Ok(Appended::Unfit(e.clone())),
            Err(RecordError::SchemaNotLoaded(id)) => return Ok(Appended::SchemaNotLoaded(*id)),
            Err(e) => {
                self.dead_letter(offset, ingest_ts, &e.to_string(), payload);
                return Ok(Appended::DeadLetter(e.clone()));
            }
        };
        if !self.window.insert(digest(&hash), 0) {
            self.consumed(offset, ingest_ts);
            return Ok(Appended::Duplicate);
        }
        let meta = RowMeta {
            ingest_ts,
            partition: self.partition,
            offset,
            hash,
        };
        let file = match &mut self.file {
            Some(file) => file,
            None => self.file.insert(
                OpenFile::create(
                    def.clone(),
                    self.hash_column,
                    staging,
                    targets,
                    self.size_ratio,
                )
                .context("cannot create a staged file")?,
            ),
        };
        file.push(row, meta, payload.len())
            .context("cannot write to the staged file")?;
        let full = file.is_full();
        self.consumed(offset, ingest_ts);
        Ok(Appended::Row { full })
    }

    /// The key of this partition in the worker's map.
    pub fn key(&self) -> (String, i32) {
        (self.topic.clone(), self.partition)
    }

    /// A partition's state with a dedupe window of `window` entries.
    pub fn new(def: Arc<StreamDef>, topic: String, partition: i32, window: usize) -> Self {
        let received =
            metrics::counter!(crate::metrics::RECORDS_RECEIVED, "stream" => def.name.clone());
        let adopted =
            metrics::counter!(crate::metrics::ADOPTED_RECORDS, "stream" => def.name.clone());
        let duplicates = crate::metrics::duplicates(&def.name);
        PartitionState {
            def,
            topic,
            partition,
            file: None,
            size_ratio: SizeRatio::default(),
            hash_column: HashColumn::default(),
            received,
            adopted,
            duplicates,
            next_offset: None,
            range_start: None,
            committed: None,
            expect_from: None,
            last_append: Instant::now(),
            window: DigestWindow::new(window, 0),
            dead: DeadLetters::default(),
            dead_through: None,
            stopped: false,
            newer: None,
        }
    }

    /// Whether a record with this ingest time belongs to another hour than the open file.
    pub fn crosses_hour(&self, ingest_ts: i64) -> bool {
        self.range_start.is_some_and(|r| {
            r.ingest_ts.div_euclid(HOUR_MICROS) != ingest_ts.div_euclid(HOUR_MICROS)
        })
    }

    /// Marks `offset` as consumed: its record is a row of the open file, a duplicate or a dead
    /// letter.
    pub fn consumed(&mut self, offset: i64, ingest_ts: i64) {
        // The clock is read once per range, not per record.
        self.range_start.get_or_insert_with(|| RangeStart {
            offset,
            ingest_ts,
            opened: Instant::now(),
        });
        self.next_offset = Some(offset + 1);
    }

    /// The first offset that no object holds and that is not dropped: the start of the open
    /// range, else the next offset to read (`None` before anything was consumed).
    pub fn unwritten_from(&self) -> Option<i64> {
        self.range_start.map(|r| r.offset).or(self.next_offset)
    }

    /// Rows in the open file.
    pub fn rows(&self) -> usize {
        self.file.as_ref().map_or(0, OpenFile::rows)
    }

    /// Memory held by the open file and the range's dead letters.
    pub fn memory(&self) -> usize {
        self.file.as_ref().map_or(0, OpenFile::memory) + self.dead.memory()
    }

    /// Bytes of the open file in its staged file so far.
    pub fn staged(&self) -> usize {
        self.file.as_ref().map_or(0, OpenFile::staged)
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
        self.keep_dead_line(offset, ingest_ts, &line);
        self.consumed(offset, ingest_ts);
    }

    /// Adds a line at `offset` to the dead letters, unless a dead-letter object found written
    /// already holds it.
    fn keep_dead_line(&mut self, offset: i64, ingest_ts: i64, line: &serde_json::Value) {
        if self.dead_through.is_none_or(|through| offset > through) {
            self.dead.push(offset, ingest_ts, line);
        }
    }

    /// The offset this partition needs next when `offset` is past it: the records between are
    /// not in Kafka for it (an offset gap). `None` when `offset` follows on.
    pub fn gap_before(&self, offset: i64) -> Option<i64> {
        self.next_offset
            .or(self.expect_from)
            .filter(|&next| offset > next)
    }

    /// Skips the offsets from `next` up to the record at `offset` (ingested at `ingest_ts`),
    /// which comes next: they are noted in the dead letters as one line (no payload,
    /// `skipped_through` its last offset), and the range goes on past them ([`Self::pass_over`]).
    pub fn skip_gap(&mut self, next: i64, offset: i64, ingest_ts: i64) {
        let last = offset - 1;
        let line = serde_json::json!({
            "topic": self.topic,
            "partition": self.partition,
            "offset": next,
            "ingest_ts": ingest_ts,
            "reason": format!("offsets {next} to {last} were not in Kafka when the sink read the partition"),
            "skipped_through": last,
            "skipped_records": offset - next,
        });
        self.keep_dead_line(next, ingest_ts, &line);
        self.pass_over(next, offset, ingest_ts);
    }

    /// Goes on from `next` to the record at `offset` (ingested at `ingest_ts`) as if it had read
    /// the offsets between, which hold no records for the sink: the open range takes them in, so
    /// it starts at `next` as it would have for a sink that read them (its key is the same).
    pub fn pass_over(&mut self, next: i64, offset: i64, ingest_ts: i64) {
        self.range_start.get_or_insert_with(|| RangeStart {
            offset: next,
            ingest_ts,
            opened: Instant::now(),
        });
        self.next_offset = Some(offset);
    }

    /// Takes a dead-letter object found written whose last line is at `last`: the dead letters
    /// up to it are not kept again, and the range closes only past it.
    pub fn adopt_dead_letters_through(&mut self, last: i64) {
        self.dead.drop_through(last);
        self.dead_through = self.dead_through.max(Some(last));
    }

    /// Whether there is something to write or commit.
    pub fn has_pending(&self) -> bool {
        !self.stopped && (self.rows() > 0 || self.next_offset > self.committed)
    }

    /// Why the open range is due to be written by the clock alone, as of `now`: nothing
    /// arrived for `idle`, or its first record was read `max_age` ago or longer (`None`: no
    /// age limit).
    pub fn due(
        &self,
        now: Instant,
        idle: Duration,
        max_age: Option<Duration>,
    ) -> Option<FlushReason> {
        if !self.has_pending() {
            return None;
        }
        if now.saturating_duration_since(self.last_append) >= idle {
            return Some(FlushReason::Idle);
        }
        let opened = self.range_start?.opened;
        max_age
            .is_some_and(|age| now.saturating_duration_since(opened) >= age)
            .then_some(FlushReason::Age)
    }

    /// Adopts an existing object that accounts for offsets up to and including `last`, after
    /// the open file was taken out: continues the range chain after it. When offsets past
    /// `last` were consumed, the next range starts at `last + 1` with the ingest time of the
    /// first row after it (`first_ingest_ts`, if a row is left).
    pub fn adopt_through(&mut self, last: i64, first_ingest_ts: Option<i64>) {
        if self.next_offset.is_some_and(|n| n > last + 1) {
            let ingest_ts =
                first_ingest_ts.unwrap_or_else(|| self.range_start.map_or(0, |r| r.ingest_ts));
            // The rows left were read when the range opened: its age stays.
            let opened = self.range_start.map_or_else(Instant::now, |r| r.opened);
            self.range_start = Some(RangeStart {
                offset: last + 1,
                ingest_ts,
                opened,
            });
        } else {
            self.next_offset = Some(last + 1);
            self.range_start = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letters_drop_what_an_object_holds() {
        let def = schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone();
        let mut part = PartitionState::new(def, "ingest.sensor_readings".into(), 3, 10);
        for (offset, payload) in [(4, "a"), (9, "b"), (15, "c")] {
            part.dead_letter(offset, 100 + offset, "malformed JSON", payload.as_bytes());
        }
        assert_eq!(part.dead.first(), Some((4, 104)));
        let ids = dead_letter_ids(part.dead.text()).unwrap();
        assert_eq!(last_dead_letter(&ids).unwrap(), 15);
        assert_eq!(ids[1].ingest_ts, 109);
        // An object that holds the dead letters up to offset 9 (its range may have ended
        // anywhere from 9 to 14).
        part.dead.drop_through(12);
        assert_eq!(part.dead.first(), Some((15, 115)));
        let line: serde_json::Value = serde_json::from_slice(part.dead.text()).unwrap();
        assert_eq!(line["offset"], 15);
        assert_eq!(line["partition"], 3);
        assert_eq!(line["payload_hex"], hex::encode("c"));
        // Nothing held up to an offset before the first.
        part.dead.drop_through(14);
        assert_eq!(part.dead.first(), Some((15, 115)));
        part.dead.drop_through(15);
        assert!(part.dead.is_empty() && part.dead.text().is_empty());

        // An object found written reaches past what the range has read: the dead letters up
        // to its last line are not kept again when they arrive, those after it are.
        part.dead_letter(18, 118, "malformed JSON", b"d");
        part.adopt_dead_letters_through(30);
        assert!(part.dead.is_empty());
        part.dead_letter(30, 130, "malformed JSON", b"e");
        assert!(part.dead.is_empty());
        assert_eq!(part.next_offset, Some(31), "consumed all the same");
        part.dead_letter(31, 131, "malformed JSON", b"f");
        assert_eq!(part.dead.first(), Some((31, 131)));
        // An earlier object does not lower the mark.
        part.adopt_dead_letters_through(20);
        assert_eq!(part.dead_through, Some(30));

        assert!(last_dead_letter(&dead_letter_ids(b"").unwrap()).is_err());
        assert!(dead_letter_ids(b"{\"reason\":\"x\"}\n").is_err());
        let ids = dead_letter_ids(b"{\"offset\":7}\n{\"offset\":3}\n").unwrap();
        assert_eq!(last_dead_letter(&ids).unwrap(), 7);
    }

    #[test]
    fn a_gap_is_found_against_the_next_offset_or_the_expected_start_and_skipped_in_the_range() {
        let def = schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone();
        let mut part = PartitionState::new(def, "ingest.sensor_readings".into(), 2, 10);
        // A partition the group never committed: whatever comes first is where it starts.
        assert_eq!(part.gap_before(5_000), None);
        // One whose committed offset is 40: a later first record is a gap, from 40.
        part.expect_from = Some(40);
        assert_eq!(part.gap_before(40), None);
        assert_eq!(part.gap_before(39), None, "before it: no records lost");
        assert_eq!(part.gap_before(41), Some(40));
        part.consumed(40, 7);
        part.consumed(41, 7);
        // While it is read, against the next offset (the expected start no longer counts).
        assert_eq!(part.gap_before(42), None);
        assert_eq!(part.gap_before(50), Some(42));
        part.skip_gap(42, 50, 9);
        assert_eq!(part.gap_before(50), None);
        assert_eq!(part.next_offset, Some(50));
        assert_eq!(
            part.range_start.unwrap().offset,
            40,
            "the open range goes on"
        );
        let note: serde_json::Value = serde_json::from_slice(part.dead.text()).unwrap();
        assert_eq!(note["offset"], 42);
        assert_eq!(note["skipped_through"], 49);
        assert_eq!(note["skipped_records"], 8);
        assert_eq!(note["partition"], 2);
        assert_eq!(part.dead.first(), Some((42, 9)));

        // A gap before anything was consumed opens the range at the gap, so its key is the one
        // of a sink that read from there.
        let def = part.def.clone();
        let mut part = PartitionState::new(def, "ingest.sensor_readings".into(), 2, 10);
        part.expect_from = Some(100);
        part.skip_gap(100, 180, 11);
        assert_eq!(
            part.range_start.map(|r| (r.offset, r.ingest_ts)),
            Some((100, 11))
        );
        // A dead-letter object found written through the gap holds its note already.
        let def = part.def.clone();
        let mut part = PartitionState::new(def, "ingest.sensor_readings".into(), 2, 10);
        part.adopt_dead_letters_through(120);
        part.skip_gap(100, 180, 11);
        assert!(part.dead.is_empty());

        // Offsets that held no records (a transaction's marker) are gone past without a note,
        // and a range that opens there starts at them, as for a sink that read them.
        let def = part.def.clone();
        let mut part = PartitionState::new(def, "ingest.sensor_readings".into(), 2, 10);
        part.expect_from = Some(60);
        assert_eq!(part.gap_before(61), Some(60));
        part.pass_over(60, 61, 12);
        assert_eq!(part.gap_before(61), None);
        assert_eq!(part.next_offset, Some(61));
        assert_eq!(
            part.range_start.map(|r| (r.offset, r.ingest_ts)),
            Some((60, 12))
        );
        assert!(part.dead.is_empty());
        part.consumed(61, 12);
        part.pass_over(62, 64, 13);
        assert_eq!(
            part.range_start.unwrap().offset,
            60,
            "the open range goes on"
        );
        assert_eq!(part.gap_before(64), None);
    }

    #[test]
    fn the_clock_makes_a_range_due_when_idle_or_old() {
        let def = schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone();
        let mut part = PartitionState::new(def, "ingest.sensor_readings".into(), 0, 10);
        let (idle, age) = (Duration::from_secs(60), Some(Duration::from_secs(300)));
        let t0 = Instant::now();
        // Nothing consumed: nothing to write or commit, however long it stood.
        assert_eq!(part.due(t0 + Duration::from_secs(3_600), idle, age), None);

        part.consumed(7, 0);
        part.last_append = part.range_start.unwrap().opened;
        let opened = part.last_append;
        let at = |secs| opened + Duration::from_secs(secs);
        assert_eq!(part.due(at(59), idle, age), None);
        assert_eq!(part.due(at(60), idle, age), Some(FlushReason::Idle));
        // Records keep coming: never idle, due by age once the first is 300 s old.
        part.last_append = at(299);
        assert_eq!(part.due(at(299), idle, age), None);
        assert_eq!(part.due(at(300), idle, age), Some(FlushReason::Age));
        assert_eq!(part.due(at(300), idle, None), None, "no age limit");
        // Later records do not make the range younger.
        part.consumed(8, 0);
        assert_eq!(part.range_start.unwrap().opened, opened);
    }
}
