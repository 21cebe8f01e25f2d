//! The durable spool: batches wait here, on disk, until the gateway (or Kafka) acknowledged them.
//!
//! One directory per stream holds segment files `seg-<first seq>.spool` and an `acked` file.
//! A segment is a sequence of entries, each `MAGIC | payload length | CRC-32 of payload | payload`,
//! where the payload is `seq | created_ms | records | raw_bytes | encoding | batch id | body`.
//! `acked` holds the first sequence number not yet acknowledged; it is replaced atomically
//! (write, fsync, rename), and segments whose entries are all acknowledged are then deleted.
//!
//! Recovery scans every segment. A damaged region whose entry would run past the end of the last
//! segment is a torn write (power lost mid-append): the segment is truncated there. Any other
//! damaged region (a bit flip, a bad length) is copied to `quarantine/`, counted, and skipped; the
//! scan resynchronizes on the next entry whose checksum holds. The agent keeps running either way.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Deserialize;
use thiserror::Error;

use crate::batch::{Batch, BatchId, BodyEncoding};
use crate::dedupe::LogSync;
use crate::metrics as m;

const MAGIC: [u8; 4] = *b"EAS1";
const HEADER: usize = 12;
/// seq, created_ms, records, raw_bytes, encoding, id.
const META: usize = 8 + 8 + 4 + 4 + 1 + 32;
/// A bigger declared payload is damage, not a batch.
const MAX_PAYLOAD: usize = 1 << 30;
/// The largest sequence number: a billion batches a second would take 146 years to reach it.
/// Anything above is damage, so that `seq + 1` never overflows.
const MAX_SEQ: u64 = 1 << 62;
const ACKED_FILE: &str = "acked";
const QUARANTINE_DIR: &str = "quarantine";
/// Most bytes a stream's `quarantine/` keeps; damaged regions past it are counted and dropped
/// without a copy.
pub const QUARANTINE_MAX_BYTES: u64 = 64 << 20;

#[derive(Debug, Error)]
pub enum SpoolError {
    #[error("spool i/o on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The spool was full under the `block` policy when the agent was told to stop.
    #[error("spool full while shutting down")]
    Cancelled,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SpoolError + '_ {
    move |source| SpoolError::Io {
        path: path.to_owned(),
        source,
    }
}

/// When appended entries are forced to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FsyncPolicy {
    /// After every batch: nothing acknowledged upstream is ever lost.
    #[default]
    Batch,
    /// At most every `fsync_interval_ms`; sources are acknowledged only after the fsync.
    Interval,
}

/// What to do with a new batch when the spool is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Overflow {
    /// Wait for space; sources stop reading (files) or acknowledging (MQTT, HTTP).
    #[default]
    Block,
    /// Discard the new batch, counted.
    DropNewest,
    /// Discard the oldest segment of the stream, counted.
    DropOldest,
}

impl Overflow {
    pub fn label(self) -> &'static str {
        match self {
            Overflow::Block => "block",
            Overflow::DropNewest => "drop_newest",
            Overflow::DropOldest => "drop_oldest",
        }
    }
}

#[derive(Debug, Clone)]
pub struct SpoolOptions {
    /// Largest total size of all streams' segment files.
    pub max_bytes: u64,
    /// A segment is closed when an append would take it past this size.
    pub segment_bytes: u64,
    pub fsync: FsyncPolicy,
    pub fsync_interval: Duration,
}

/// Bytes on disk across the spools of all streams, shared by them for the size limit.
#[derive(Debug, Default)]
pub struct Usage {
    bytes: AtomicU64,
}

impl Usage {
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
    fn add(&self, n: u64) {
        self.bytes.fetch_add(n, Ordering::Relaxed);
    }
    fn sub(&self, n: u64) {
        self.bytes.fetch_sub(n, Ordering::Relaxed);
    }
}

/// What recovery found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recovery {
    pub pending_batches: u64,
    pub pending_records: u64,
    pub torn_bytes: u64,
    pub quarantined_regions: u64,
    pub quarantined_bytes: u64,
}

/// The result of an append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    /// Stored with this sequence number; `durable` when already fsynced.
    Stored { seq: u64, durable: bool },
    /// Discarded: the spool was full under `drop_newest`, or the batch alone exceeds the limit.
    Dropped,
}

#[derive(Debug)]
struct Segment {
    first_seq: u64,
    path: PathBuf,
    bytes: u64,
    /// Sequence number of the segment's last entry; none while it is empty.
    last_seq: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
struct Loc {
    seq: u64,
    segment: u64,
    offset: u64,
    len: u32,
    records: u32,
    /// How far the dedupe log must be durable before this entry leaves ([`LogSync::position`]
    /// when it was released; 0: no log, or not released yet).
    log_position: u64,
}

#[derive(Debug)]
struct Inner {
    segments: VecDeque<Segment>,
    /// Appends go to the last segment through this handle while it is open.
    active: Option<File>,
    /// Entries not yet acknowledged, in order.
    pending: VecDeque<Loc>,
    /// First sequence number not acknowledged.
    acked: u64,
    next_seq: u64,
    /// First sequence number not yet fsynced.
    durable: u64,
    /// First sequence number held back from delivery ([`Spool::append_held`]).
    released: u64,
    last_sync: Instant,
}

/// The spool of one stream.
#[derive(Debug)]
pub struct Spool {
    stream: String,
    dir: PathBuf,
    /// Holds the first sequence number not acknowledged, overwritten in place.
    acked_file: File,
    acked_path: PathBuf,
    options: SpoolOptions,
    usage: Arc<Usage>,
    inner: Mutex<Inner>,
    space: Condvar,
    appended: tokio::sync::Notify,
    /// The dedupe log that holds the digests of this spool's batches: made durable before an
    /// acknowledged batch leaves ([`Spool::sync_log_before_ack`]).
    digest_log: Mutex<Option<Arc<LogSync>>>,
}

impl Spool {
    /// Opens (or creates) the spool of `stream` under `root`, recovering what is there.
    pub fn open(
        root: &Path,
        stream: &str,
        options: SpoolOptions,
        usage: Arc<Usage>,
    ) -> Result<(Spool, Recovery), SpoolError> {
        let dir = root.join(stream);
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        let acked = read_acked(&dir)?;
        // Created now, while there is space: later acknowledgements only overwrite it.
        let acked_path = dir.join(ACKED_FILE);
        let acked_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&acked_path)
            .map_err(io(&acked_path))?;
        // Exactly the 20 digits that later acknowledgements overwrite in place: a longer file
        // (damage) would otherwise keep its tail after them and read as another number.
        acked_file.set_len(20).map_err(io(&acked_path))?;
        write_acked(&acked_file, &acked_path, acked)?;
        let names = segment_names(&dir)?;
        let mut recovery = Recovery::default();
        let mut segments = VecDeque::new();
        let mut pending = VecDeque::new();
        let mut next_seq = acked;
        let count = names.len();
        for (i, (first_seq, path)) in names.into_iter().enumerate() {
            let last = i + 1 == count;
            let scanned = scan_segment(&dir, &path, last, &mut recovery)?;
            let last_seq = scanned.iter().map(|l| l.seq).max();
            if let Some(s) = last_seq {
                next_seq = next_seq.max(s + 1);
            }
            if last_seq.is_none_or(|s| s < acked) {
                fs::remove_file(&path).map_err(io(&path))?;
                continue;
            }
            let bytes = fs::metadata(&path).map_err(io(&path))?.len();
            usage.add(bytes);
            for mut loc in scanned.into_iter().filter(|l| l.seq >= acked) {
                loc.segment = first_seq;
                recovery.pending_batches += 1;
                recovery.pending_records += u64::from(loc.records);
                pending.push_back(loc);
            }
            segments.push_back(Segment {
                first_seq,
                path,
                bytes,
                last_seq,
            });
        }
        let spool = Spool {
            stream: stream.to_owned(),
            dir,
            acked_file,
            acked_path,
            options,
            usage,
            inner: Mutex::new(Inner {
                segments,
                active: None,
                pending,
                acked,
                next_seq,
                durable: next_seq,
                released: next_seq,
                last_sync: Instant::now(),
            }),
            space: Condvar::new(),
            appended: tokio::sync::Notify::new(),
            digest_log: Mutex::new(None),
        };
        spool.report(&spool.lock());
        Ok((spool, recovery))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// Stores a batch. Under the `block` policy this waits for space until `cancel` is set.
    pub fn append(
        &self,
        batch: &Batch,
        overflow: Overflow,
        cancel: &AtomicBool,
    ) -> Result<Appended, SpoolError> {
        let appended = self.append_held(batch, overflow, cancel)?;
        if let Appended::Stored { seq, .. } = appended {
            self.release(seq);
        }
        Ok(appended)
    }

    /// [`Spool::append`], but the batch is not offered for delivery until [`Spool::release`]:
    /// the pipeline first logs the batch's digests, so that no batch is delivered (and its
    /// entry removed) whose records a restart would not know. A process that dies before the
    /// release finds the batch pending in the spool.
    pub fn append_held(
        &self,
        batch: &Batch,
        overflow: Overflow,
        cancel: &AtomicBool,
    ) -> Result<Appended, SpoolError> {
        let entry_len = (HEADER + META + batch.body.len()) as u64;
        let labels = [
            ("stream", self.stream.clone()),
            ("policy", overflow.label().to_owned()),
        ];
        if entry_len > self.options.max_bytes {
            tracing::error!(stream = %self.stream, bytes = entry_len, limit = self.options.max_bytes, "batch larger than the whole spool; dropped");
            metrics::counter!(m::SPOOL_DROPPED_RECORDS, &labels)
                .increment(u64::from(batch.records));
            return Ok(Appended::Dropped);
        }
        let mut inner = self.lock();
        loop {
            let full = self.usage.bytes() + entry_len > self.options.max_bytes;
            if !full {
                match self.write_entry(&mut inner, batch, entry_len) {
                    Ok(appended) => return Ok(appended),
                    Err(SpoolError::Io { source, path })
                        if source.kind() == std::io::ErrorKind::StorageFull =>
                    {
                        // The disk filled up before the spool's own limit: the same policy.
                        tracing::warn!(stream = %self.stream, file = %path.display(), policy = overflow.label(), "disk full");
                    }
                    Err(e) => return Err(e),
                }
            }
            let dropped;
            (inner, dropped) = self.overflow_step(inner, overflow, &labels, cancel)?;
            if dropped {
                metrics::counter!(m::SPOOL_DROPPED_RECORDS, &labels)
                    .increment(u64::from(batch.records));
                return Ok(Appended::Dropped);
            }
        }
    }

    /// One step of the overflow policy: wait a little for space (`block`), or delete the oldest
    /// segment (`drop_oldest`). True when the new batch is to be dropped instead.
    fn overflow_step<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner>,
        overflow: Overflow,
        labels: &[(&'static str, String); 2],
        cancel: &AtomicBool,
    ) -> Result<(MutexGuard<'a, Inner>, bool), SpoolError> {
        match overflow {
            Overflow::Block => {
                if cancel.load(Ordering::Relaxed) {
                    return Err(SpoolError::Cancelled);
                }
                metrics::counter!(m::SPOOL_BLOCKED, "stream" => self.stream.clone()).increment(1);
                // Another stream's acknowledgement frees space without notifying this one.
                inner = self
                    .space
                    .wait_timeout(inner, Duration::from_millis(50))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                Ok((inner, false))
            }
            Overflow::DropNewest => Ok((inner, true)),
            Overflow::DropOldest => {
                let dropped = !self.drop_oldest_segment(&mut inner, labels)?;
                Ok((inner, dropped))
            }
        }
    }

    fn write_entry(
        &self,
        inner: &mut Inner,
        batch: &Batch,
        entry_len: u64,
    ) -> Result<Appended, SpoolError> {
        let seq = inner.next_seq;
        let rolls = inner
            .segments
            .back()
            .is_none_or(|s| s.bytes > 0 && s.bytes + entry_len > self.options.segment_bytes)
            || inner.active.is_none();
        if rolls {
            self.roll(inner, seq)?;
        }
        let encoded = encode_entry(seq, batch);
        let segment = inner.segments.back_mut().expect("rolled above");
        let offset = segment.bytes;
        let path = segment.path.clone();
        let first = segment.first_seq;
        let file = inner.active.as_mut().expect("rolled above");
        if let Err(e) = file.write_all(&encoded) {
            // Leave no partial entry behind: cut the file back to where the entry started.
            let _ = file.set_len(offset);
            let _ = file.seek(SeekFrom::Start(offset));
            return Err(io(&path)(e));
        }
        let segment = inner.segments.back_mut().expect("rolled above");
        segment.bytes += entry_len;
        segment.last_seq = Some(seq);
        self.usage.add(entry_len);
        inner.next_seq = seq + 1;
        inner.pending.push_back(Loc {
            seq,
            segment: first,
            offset,
            len: (entry_len as usize - HEADER) as u32,
            records: batch.records,
            log_position: 0,
        });
        metrics::counter!(m::SPOOL_WRITTEN_BYTES, "stream" => self.stream.clone())
            .increment(entry_len);
        let durable = match self.options.fsync {
            FsyncPolicy::Batch => {
                self.sync_locked(inner)?;
                true
            }
            FsyncPolicy::Interval => {
                if inner.last_sync.elapsed() >= self.options.fsync_interval {
                    self.sync_locked(inner)?;
                }
                inner.durable > seq
            }
        };
        self.report(inner);
        if durable {
            self.appended.notify_one();
        }
        Ok(Appended::Stored { seq, durable })
    }

    /// Offers the entries up to and including `seq` for delivery (once durable). The dedupe
    /// log's position now ([`Spool::sync_log_before_ack`]) is where it must be durable before
    /// they leave: the pipeline wrote their digests before it released them.
    pub fn release(&self, seq: u64) {
        let position = self.log().map_or(0, |log| log.position());
        let mut inner = self.lock();
        let from = inner.released;
        for loc in inner.pending.iter_mut().rev() {
            if loc.seq < from {
                break;
            }
            if loc.seq <= seq {
                loc.log_position = position;
            }
        }
        inner.released = inner.released.max(seq + 1);
        drop(inner);
        self.appended.notify_one();
    }

    /// Forces appended entries to disk if the fsync interval has passed (or `force`). Returns the
    /// first sequence number that is not durable.
    pub fn sync(&self, force: bool) -> Result<u64, SpoolError> {
        let mut inner = self.lock();
        let due = force || inner.last_sync.elapsed() >= self.options.fsync_interval;
        if due && inner.durable < inner.next_seq {
            self.sync_locked(&mut inner)?;
            drop(inner);
            self.appended.notify_one();
            return Ok(self.lock().durable);
        }
        Ok(inner.durable)
    }

    fn sync_locked(&self, inner: &mut Inner) -> Result<(), SpoolError> {
        if let (Some(file), Some(segment)) = (&inner.active, inner.segments.back()) {
            file.sync_data().map_err(io(&segment.path))?;
        }
        inner.durable = inner.next_seq;
        inner.last_sync = Instant::now();
        Ok(())
    }

    fn roll(&self, inner: &mut Inner, first_seq: u64) -> Result<(), SpoolError> {
        if let (Some(file), Some(segment)) = (inner.active.take(), inner.segments.back()) {
            file.sync_data().map_err(io(&segment.path))?;
        }
        let path = self.dir.join(format!("seg-{first_seq:020}.spool"));
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&path)
            .map_err(io(&path))?;
        sync_dir(&self.dir)?;
        inner.segments.push_back(Segment {
            first_seq,
            path,
            bytes: 0,
            last_seq: None,
        });
        inner.active = Some(file);
        Ok(())
    }

    /// Deletes the stream's oldest segment to make room. False when there is none to delete.
    fn drop_oldest_segment(
        &self,
        inner: &mut Inner,
        labels: &[(&'static str, String); 2],
    ) -> Result<bool, SpoolError> {
        let Some(oldest) = inner.segments.front() else {
            return Ok(false);
        };
        let first = oldest.first_seq;
        if inner.segments.len() == 1 {
            inner.active = None;
        }
        let dropped: u64 = inner
            .pending
            .iter()
            .filter(|l| l.segment == first)
            .map(|l| u64::from(l.records))
            .sum();
        let last = oldest.last_seq.unwrap_or(first);
        tracing::warn!(stream = %self.stream, records = dropped, "spool full: dropped the oldest segment");
        metrics::counter!(m::SPOOL_DROPPED_RECORDS, labels).increment(dropped);
        self.ack_locked(inner, last)?;
        // An empty or partly acknowledged oldest segment that ack did not remove.
        if inner.segments.front().is_some_and(|s| s.first_seq == first) {
            let segment = inner.segments.pop_front().expect("checked");
            fs::remove_file(&segment.path).map_err(io(&segment.path))?;
            self.usage.sub(segment.bytes);
        }
        Ok(true)
    }

    /// Bytes on disk of the spools that share this one's size limit.
    pub fn bytes(&self) -> u64 {
        self.usage.bytes()
    }

    /// The oldest durable and released entry not yet acknowledged, read from disk. A damaged
    /// entry is quarantined and skipped.
    pub fn first_pending(&self) -> Result<Option<(u64, Batch)>, SpoolError> {
        loop {
            let loc = {
                let inner = self.lock();
                match inner.pending.front() {
                    Some(loc) if loc.seq < inner.durable.min(inner.released) => *loc,
                    _ => return Ok(None),
                }
            };
            // Its segment was dropped meanwhile (`drop_oldest`): look at the new front.
            let Some((segment, entry)) = self.read_entry(&loc)? else {
                continue;
            };
            if let Some((_, batch)) = check_entry(&entry).and_then(decode_payload) {
                return Ok(Some((loc.seq, batch)));
            }
            tracing::error!(stream = %self.stream, seq = loc.seq, "spooled batch damaged on disk; quarantined");
            quarantine(
                &self.dir,
                &segment,
                loc.offset,
                &entry,
                &mut Recovery::default(),
            );
            self.ack(loc.seq)?;
        }
    }

    /// The bytes of a pending entry and its segment's path, read without holding the lock (an
    /// append need not wait for a megabyte read). None when the segment is gone by then.
    fn read_entry(&self, loc: &Loc) -> Result<Option<(PathBuf, Vec<u8>)>, SpoolError> {
        let path = self
            .lock()
            .segments
            .iter()
            .find(|s| s.first_seq == loc.segment)
            .map(|s| s.path.clone());
        let Some(path) = path else {
            return Ok(None);
        };
        let mut entry = vec![0u8; HEADER + loc.len as usize];
        let read = File::open(&path).and_then(|mut f| {
            f.seek(SeekFrom::Start(loc.offset))?;
            f.read_exact(&mut entry)
        });
        match read {
            Ok(()) => Ok(Some((path, entry))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io(&path)(e)),
        }
    }

    /// Waits until an entry may be pending (cheap; check with [`Spool::first_pending`]).
    pub async fn appended(&self) {
        self.appended.notified().await;
    }

    /// Makes `log` durable before acknowledged entries leave (replacing the log given before):
    /// the pipeline writes the digests of a spooled batch to it without an fsync, and once the
    /// batch leaves the spool only the log remembers them across a restart. The entries pending
    /// now, those found at start included (whose digests the pipeline logged again if the log
    /// lacked them), need all that the log holds now.
    pub fn sync_log_before_ack(&self, log: Arc<LogSync>) {
        let position = log.position();
        *self.digest_log.lock().unwrap_or_else(|e| e.into_inner()) = Some(log);
        for loc in self.lock().pending.iter_mut() {
            loc.log_position = position;
        }
    }

    fn log(&self) -> Option<Arc<LogSync>> {
        self.digest_log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Acknowledges every entry up to and including `seq`; deletes segments left with none. The
    /// dedupe log is made durable first as far as their digests go (no fsync when an earlier one
    /// covered them, as while a backlog is delivered); if it cannot be (a full or failing disk),
    /// the failure is logged and the entries leave anyway ([`LogSync::sync_through_or_warn`]).
    pub fn ack(&self, seq: u64) -> Result<(), SpoolError> {
        if let Some(log) = self.log() {
            let position = self
                .lock()
                .pending
                .iter()
                .take_while(|l| l.seq <= seq)
                .map(|l| l.log_position)
                .max()
                .unwrap_or(0);
            log.sync_through_or_warn(position, &self.stream);
        }
        let mut inner = self.lock();
        self.ack_locked(&mut inner, seq)?;
        self.report(&inner);
        drop(inner);
        self.space.notify_all();
        Ok(())
    }

    fn ack_locked(&self, inner: &mut Inner, seq: u64) -> Result<(), SpoolError> {
        if seq < inner.acked {
            return Ok(());
        }
        inner.acked = seq + 1;
        write_acked(&self.acked_file, &self.acked_path, inner.acked)?;
        while inner.pending.front().is_some_and(|l| l.seq <= seq) {
            inner.pending.pop_front();
        }
        while let Some(segment) = inner.segments.front() {
            let done = segment.last_seq.is_some_and(|s| s <= seq);
            if !done {
                break;
            }
            if inner.segments.len() == 1 {
                inner.active = None;
            }
            let segment = inner.segments.pop_front().expect("checked");
            fs::remove_file(&segment.path).map_err(io(&segment.path))?;
            self.usage.sub(segment.bytes);
        }
        Ok(())
    }

    /// Batches and records waiting to be acknowledged.
    pub fn pending(&self) -> (u64, u64) {
        let inner = self.lock();
        (
            inner.pending.len() as u64,
            inner.pending.iter().map(|l| u64::from(l.records)).sum(),
        )
    }

    /// Every pending entry, oldest first, durable or not (for rebuilding the dedupe window).
    pub fn pending_batches(&self) -> Result<Vec<Batch>, SpoolError> {
        let locs: Vec<Loc> = self.lock().pending.iter().copied().collect();
        let mut out = Vec::with_capacity(locs.len());
        for loc in locs {
            if let Some((_, entry)) = self.read_entry(&loc)?
                && let Some((_, batch)) = check_entry(&entry).and_then(decode_payload)
            {
                out.push(batch);
            }
        }
        Ok(out)
    }

    fn report(&self, inner: &Inner) {
        let labels = [("stream", self.stream.clone())];
        metrics::gauge!(m::SPOOL_PENDING_BATCHES, &labels).set(inner.pending.len() as f64);
        let bytes: u64 = inner.segments.iter().map(|s| s.bytes).sum();
        metrics::gauge!(m::SPOOL_BYTES, &labels).set(bytes as f64);
        metrics::gauge!(m::SPOOL_TOTAL_BYTES).set(self.usage.bytes() as f64);
    }
}

/// The segment files of a stream's spool directory with their first sequence numbers, in order.
fn segment_names(dir: &Path) -> Result<Vec<(u64, PathBuf)>, SpoolError> {
    let mut names: Vec<(u64, PathBuf)> = Vec::new();
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if let Some(first) = name
            .strip_prefix("seg-")
            .and_then(|n| n.strip_suffix(".spool"))
            .and_then(|n| n.parse::<u64>().ok())
        {
            names.push((first, path));
        }
    }
    names.sort();
    Ok(names)
}

fn encode_entry(seq: u64, batch: &Batch) -> Vec<u8> {
    let mut payload = Vec::with_capacity(META + batch.body.len());
    payload.extend_from_slice(&seq.to_le_bytes());
    payload.extend_from_slice(&batch.created_ms.to_le_bytes());
    payload.extend_from_slice(&batch.records.to_le_bytes());
    payload.extend_from_slice(&batch.raw_bytes.to_le_bytes());
    payload.push(batch.encoding.code());
    payload.extend_from_slice(&batch.id.0);
    payload.extend_from_slice(&batch.body);
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// The payload of a whole entry (header included) whose checksum holds.
fn check_entry(entry: &[u8]) -> Option<&[u8]> {
    if entry.len() < HEADER || entry[..4] != MAGIC {
        return None;
    }
    let len = u32_at(entry, 4) as usize;
    let payload = entry.get(HEADER..HEADER + len)?;
    (crc32fast::hash(payload) == u32_at(entry, 8)).then_some(payload)
}

fn decode_payload(payload: &[u8]) -> Option<(u64, Batch)> {
    if payload.len() < META {
        return None;
    }
    let seq = u64_at(payload, 0);
    let mut id = [0u8; 32];
    id.copy_from_slice(&payload[25..57]);
    Some((
        seq,
        Batch {
            created_ms: u64_at(payload, 8),
            records: u32_at(payload, 16),
            raw_bytes: u32_at(payload, 20),
            encoding: BodyEncoding::from_code(payload[24])?,
            id: BatchId(id),
            body: payload[META..].to_vec(),
        },
    ))
}

/// Reads a segment and returns its intact entries. Damage is truncated (a torn tail of the last
/// segment) or quarantined (anything else).
fn scan_segment(
    dir: &Path,
    path: &Path,
    last: bool,
    recovery: &mut Recovery,
) -> Result<Vec<Loc>, SpoolError> {
    let data = fs::read(path).map_err(io(path))?;
    let mut locs = Vec::new();
    let mut pos = 0usize;
    let mut good_end = 0usize;
    while pos < data.len() {
        if let Some(loc) = entry_at(&data, pos) {
            locs.push(loc);
            pos += HEADER + loc.len as usize;
            good_end = pos;
            continue;
        }
        // Damage at `pos`. A torn tail: the last segment, and the entry claims bytes past the end
        // (or its header is cut off), with no intact entry after it.
        let resync = (pos + 1..data.len()).find(|&p| entry_at(&data, p).is_some());
        let claims_past_end = data.len() - pos < HEADER
            || (data[pos..pos + 4] == MAGIC
                && pos + HEADER + u32_at(&data, pos + 4) as usize > data.len());
        match resync {
            None if last && claims_past_end => {
                recovery.torn_bytes += (data.len() - pos) as u64;
                tracing::warn!(segment = %path.display(), bytes = data.len() - pos, "torn write at the end of the spool; truncated");
                metrics::counter!(m::SPOOL_TORN_TAILS).increment(1);
                break;
            }
            None => {
                quarantine(dir, path, pos as u64, &data[pos..], recovery);
                break;
            }
            Some(next) => {
                quarantine(dir, path, pos as u64, &data[pos..next], recovery);
                pos = next;
            }
        }
    }
    if good_end < data.len() {
        // Cut off what follows the last intact entry: torn, or copied to quarantine above.
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(io(path))?;
        file.set_len(good_end as u64).map_err(io(path))?;
        file.sync_all().map_err(io(path))?;
    }
    Ok(locs)
}

fn entry_at(data: &[u8], pos: usize) -> Option<Loc> {
    let rest = &data[pos..];
    if rest.len() < HEADER || rest[..4] != MAGIC {
        return None;
    }
    let len = u32_at(rest, 4) as usize;
    if !(META..=MAX_PAYLOAD).contains(&len) {
        return None;
    }
    let payload = check_entry(rest)?;
    BodyEncoding::from_code(payload[24])?;
    let seq = u64_at(payload, 0);
    if seq >= MAX_SEQ {
        return None;
    }
    Some(Loc {
        seq,
        segment: 0,
        offset: pos as u64,
        len: len as u32,
        records: u32_at(payload, 16),
        log_position: 0,
    })
}

fn quarantine(dir: &Path, segment: &Path, offset: u64, bytes: &[u8], recovery: &mut Recovery) {
    recovery.quarantined_regions += 1;
    recovery.quarantined_bytes += bytes.len() as u64;
    metrics::counter!(m::SPOOL_QUARANTINED).increment(1);
    let (segment_path, len) = (segment.display(), bytes.len());
    match keep_quarantined(dir, segment, offset, bytes, QUARANTINE_MAX_BYTES) {
        Ok(Some(path)) => {
            tracing::error!(segment = %segment_path, offset, bytes = len, quarantine = %path.display(), "damaged spool region quarantined");
        }
        Ok(None) => {
            tracing::error!(segment = %segment_path, offset, bytes = len, limit = QUARANTINE_MAX_BYTES, "damaged spool region dropped without a copy: quarantine/ is at its limit");
        }
        Err(e) => {
            tracing::error!(segment = %segment_path, offset, bytes = len, error = %e, "damaged spool region dropped without a copy: it could not be written");
        }
    }
}

/// Copies a damaged region to `quarantine/` for a post-mortem, unless that would take the
/// directory past `limit` bytes (None). What the region held is lost either way (it fails its
/// checksum), so the copy is best effort: a full disk or a full quarantine never stops the
/// spool.
fn keep_quarantined(
    dir: &Path,
    segment: &Path,
    offset: u64,
    bytes: &[u8],
    limit: u64,
) -> std::io::Result<Option<PathBuf>> {
    let qdir = dir.join(QUARANTINE_DIR);
    if crate::rejected::dir_bytes(&qdir)? + bytes.len() as u64 > limit {
        return Ok(None);
    }
    fs::create_dir_all(&qdir)?;
    let name = segment
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("segment");
    let path = qdir.join(format!("{name}.at-{offset}"));
    if let Err(e) = fs::write(&path, bytes) {
        let _ = fs::remove_file(&path);
        return Err(e);
    }
    Ok(Some(path))
}

fn read_acked(dir: &Path) -> Result<u64, SpoolError> {
    let path = dir.join(ACKED_FILE);
    // Damage (bytes that are not digits, or not even text) is read as nothing acknowledged.
    match fs::read(&path) {
        Ok(bytes) => Ok(std::str::from_utf8(&bytes)
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .filter(|acked| *acked <= MAX_SEQ)
            .unwrap_or_else(|| {
                tracing::error!(file = %path.display(), "unreadable acknowledgement file; resending the whole spool");
                0
            })),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(io(&path)(e)),
    }
}

/// Overwrites the acknowledgement file in place: 20 digits at offset 0, so that a full disk
/// (which refuses new files and blocks) can never stop acknowledgements. A single 20-byte write
/// within one sector is not torn in practice; an unreadable file only means re-sending (and the
/// receiver dropping) batches.
fn write_acked(file: &File, path: &Path, acked: u64) -> Result<(), SpoolError> {
    use std::os::unix::fs::FileExt;
    file.write_all_at(format!("{acked:020}").as_bytes(), 0)
        .and_then(|()| file.sync_data())
        .map_err(io(path))
}

/// Makes a rename or a new file in `dir` durable.
pub fn sync_dir(dir: &Path) -> Result<(), SpoolError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

mod peek;

pub use peek::{Peek, peek};

#[cfg(test)]
mod tests;
