//! The agent's dedupe window: the last N content hashes (and at most T seconds of them), kept in a
//! compact table ([`schemas::window::DigestWindow`], at most 36 bytes per entry: 36 MB for a
//! window of one million records) and persisted, so that a restart does not re-send what was
//! already sent.
//!
//! Persistence: every accepted digest is appended to `<stream>.digests` (20 bytes each) right after
//! its batch is spooled, and before the spool offers the batch for delivery. On start the tail of
//! that log is loaded, then the digests of every batch still in the spool are added, and logged if
//! the log lacked them (a crash between spooling a batch and logging its digests): delivering that
//! batch takes it out of the spool, and the next start must still know its records. The log is
//! rewritten to its last N entries when it reaches twice that.
//!
//! The log is made durable (fsynced) on the delivery side, by [`LogSync`], before an acknowledged
//! batch leaves the spool ([`crate::spool::Spool::ack`]): until then the spool holds the batch, and
//! a restart takes its digests from there. So the pipeline fsyncs only the spool a batch; one
//! fsync of the log covers every batch spooled before it, and an acknowledgement of batches
//! that an earlier fsync covered makes none (while a backlog is delivered, say).

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

pub use schemas::window::{Digest, DigestWindow, digest};

const ENTRY: usize = 20;

/// The append-only log of accepted digests of one stream.
#[derive(Debug)]
pub struct DigestLog {
    path: PathBuf,
    entries: u64,
    keep: usize,
    buf: Vec<u8>,
    sync: Arc<LogSync>,
}

/// Makes what a [`DigestLog`] wrote durable from another thread: the delivery side's, before an
/// acknowledged batch leaves the spool.
#[derive(Debug)]
pub struct LogSync {
    state: Mutex<SyncState>,
    /// Failed syncs, for the warnings' rate.
    errors: AtomicU64,
}

#[derive(Debug)]
struct SyncState {
    /// The log's file (the pipeline appends to it), replaced when compaction writes a new one.
    file: Arc<File>,
    /// Entries written since the log was opened (compaction does not lower it).
    written: u64,
    /// Of those, how many are known to be durable.
    durable: u64,
}

impl LogSync {
    fn new(file: Arc<File>) -> LogSync {
        LogSync {
            state: Mutex::new(SyncState {
                file,
                written: 0,
                durable: 0,
            }),
            errors: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SyncState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Entries written so far: a position [`LogSync::sync_through`] takes.
    pub fn position(&self) -> u64 {
        self.lock().written
    }

    /// Makes every entry written so far durable: one fsync for all that were written since the
    /// last, none when there are none.
    #[cfg(test)]
    pub(crate) fn sync(&self) -> std::io::Result<()> {
        self.sync_through(u64::MAX)
    }

    /// Makes the entries before `position` durable, and with them every entry written so far:
    /// no fsync when an earlier one covered them. The pipeline keeps appending meanwhile (the
    /// lock is not held during the fsync).
    pub fn sync_through(&self, position: u64) -> std::io::Result<()> {
        let (file, written) = {
            let state = self.lock();
            if state.durable >= state.written.min(position) {
                return Ok(());
            }
            (state.file.clone(), state.written)
        };
        // A compaction meanwhile made them durable in a new file; syncing the old one is
        // harmless.
        again_if_interrupted(|| file.sync_data())?;
        let mut state = self.lock();
        state.durable = state.durable.max(written);
        Ok(())
    }

    /// [`LogSync::sync_through`], a failure (a full or failing disk) only logged, the first
    /// three and then every thousandth: the log only saves re-sending after a restart, and the
    /// receiver drops re-sent records too.
    pub fn sync_through_or_warn(&self, position: u64, stream: &str) {
        if let Err(e) = self.sync_through(position) {
            let n = self.errors.fetch_add(1, Ordering::Relaxed) + 1;
            if n <= 3 || n.is_multiple_of(1000) {
                tracing::warn!(stream, error = %e, failures = n, "cannot make the dedupe log durable");
            }
        }
    }

    /// Whether entries were written that are not known to be durable.
    #[cfg(test)]
    pub(crate) fn behind(&self) -> bool {
        let state = self.lock();
        state.durable < state.written
    }
}

/// Runs `op` again while a signal interrupts it (`EINTR`): the standard library retries
/// reads, writes and opens, not `fsync`, `rename` or a kernel copy, and any signal the process
/// takes (a reload, a profiler's timer) can interrupt those. Each use is safe to repeat.
fn again_if_interrupted<T>(mut op: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    loop {
        match op() {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            done => return done,
        }
    }
}

impl DigestLog {
    /// Opens the log and loads its valid tail into `window`, reading in small chunks (the log of
    /// a million-entry window is 20 MB, twice that before compaction).
    pub fn open(
        path: &Path,
        window: &mut DigestWindow,
        now_secs: u32,
    ) -> std::io::Result<DigestLog> {
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)?;
        let len = file.metadata()?.len();
        let whole = len / ENTRY as u64 * ENTRY as u64;
        if whole < len {
            // A torn last entry.
            file.set_len(whole)?;
        }
        let keep = window.capacity();
        let start = whole.saturating_sub((keep * ENTRY) as u64);
        let mut reader = std::io::BufReader::with_capacity(ENTRY * 3276, &file);
        reader.seek(SeekFrom::Start(start))?;
        let mut entry = [0u8; ENTRY];
        for _ in 0..(whole - start) / ENTRY as u64 {
            reader.read_exact(&mut entry)?;
            let d = u128::from_le_bytes(entry[..16].try_into().expect("16 bytes"));
            let t = u32::from_le_bytes(entry[16..].try_into().expect("4 bytes"));
            if !window.expired(t, now_secs) {
                window.insert(d, t);
            }
        }
        Ok(DigestLog {
            path: path.to_owned(),
            sync: Arc::new(LogSync::new(Arc::new(file))),
            entries: whole / ENTRY as u64,
            keep,
            buf: Vec::new(),
        })
    }

    /// What makes the log's entries durable from another thread.
    pub fn syncer(&self) -> Arc<LogSync> {
        self.sync.clone()
    }

    /// Queues a digest; [`DigestLog::flush`] writes the queue.
    pub fn push(&mut self, d: Digest, time: u32) {
        self.buf.extend_from_slice(&d.to_le_bytes());
        self.buf.extend_from_slice(&time.to_le_bytes());
    }

    /// Writes queued digests (without an fsync: [`LogSync::sync_through`] makes them durable),
    /// and compacts the log when it has grown to twice the window.
    pub fn flush(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            let file = self.sync.lock().file.clone();
            if let Err(e) = (&*file).write_all(&self.buf) {
                // Keep whole entries only; keep the queue for the next try, within reason.
                let _ = file.set_len(self.entries * ENTRY as u64);
                if self.buf.len() > (1 << 20) {
                    self.buf.clear();
                }
                return Err(e);
            }
            let n = (self.buf.len() / ENTRY) as u64;
            self.entries += n;
            self.sync.lock().written += n;
            self.buf.clear();
        }
        if self.keep > 0 && self.entries >= 2 * self.keep as u64 {
            self.compact()?;
        }
        Ok(())
    }

    fn compact(&mut self) -> std::io::Result<()> {
        let whole = self.entries * ENTRY as u64;
        let start = whole.saturating_sub((self.keep * ENTRY) as u64);
        let tmp = self.path.with_extension("digests.tmp");
        let mut out = File::create(&tmp)?;
        let from = File::open(&self.path)?;
        again_if_interrupted(|| {
            // From the start again: an interrupted copy may have written part of it.
            out.set_len(0)?;
            out.seek(SeekFrom::Start(0))?;
            (&from).seek(SeekFrom::Start(start))?;
            std::io::copy(&mut (&from).take(whole - start), &mut out)
        })?;
        again_if_interrupted(|| out.sync_data())?;
        again_if_interrupted(|| fs::rename(&tmp, &self.path))?;
        if let Some(dir) = self.path.parent() {
            let dir = File::open(dir)?;
            again_if_interrupted(|| dir.sync_all())?;
        }
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(&self.path)?;
        // Everything written is in the new file, which is durable.
        let mut state = self.sync.lock();
        state.file = Arc::new(file);
        state.durable = state.written;
        drop(state);
        self.entries = (whole - start) / ENTRY as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_survives_reopen_torn_tail_and_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.digests");
        let mut w = DigestWindow::new(4, 0);
        let mut log = DigestLog::open(&path, &mut w, 0).unwrap();
        for d in 1..=7u128 {
            assert!(w.insert(d, 5));
            log.push(d, 5);
            log.flush().unwrap();
        }
        // Compacted at 8 entries? Not yet: 7 < 2 * 4.
        assert_eq!(fs::metadata(&path).unwrap().len(), 7 * ENTRY as u64);
        log.push(8, 5);
        log.flush().unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().len(),
            4 * ENTRY as u64,
            "compacted"
        );
        drop(log);
        // A torn entry at the end.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[1, 2, 3]).unwrap();
        let mut again = DigestWindow::new(4, 0);
        let _log = DigestLog::open(&path, &mut again, 0).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), 4 * ENTRY as u64);
        for d in 5..=8 {
            assert!(again.contains(d, 0), "{d} reloaded");
        }
        assert!(!again.contains(4, 0));
    }

    /// The delivery side's fsync covers what the pipeline wrote before it; a compaction's new
    /// file counts as durable too.
    #[test]
    fn the_log_is_behind_from_a_write_until_a_sync() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.digests");
        let mut w = DigestWindow::new(4, 0);
        let mut log = DigestLog::open(&path, &mut w, 0).unwrap();
        let syncer = log.syncer();
        assert!(!syncer.behind(), "nothing written");
        log.push(1, 5);
        assert!(!syncer.behind(), "queued, not written");
        log.flush().unwrap();
        assert!(syncer.behind());
        syncer.sync().unwrap();
        assert!(!syncer.behind());
        // The compaction at 8 entries writes a new, durable file, which later syncs use.
        for d in 2..=8 {
            log.push(d, 5);
            log.flush().unwrap();
        }
        assert!(!syncer.behind(), "compacted");
        assert_eq!(fs::metadata(&path).unwrap().len(), 4 * ENTRY as u64);
        log.push(9, 5);
        log.flush().unwrap();
        assert!(syncer.behind());
        syncer.sync().unwrap();
        assert!(!syncer.behind());
        drop(log);
        let mut again = DigestWindow::new(4, 0);
        DigestLog::open(&path, &mut again, 0).unwrap();
        assert!((6..=9).all(|d| again.contains(d, 0)));
    }

    /// A log that cannot be made durable stays behind and counts the failures; the caller goes
    /// on (fdatasync on /dev/full fails with EINVAL).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_failed_sync_is_counted_and_not_fatal() {
        let sync = LogSync::new(Arc::new(File::open("/dev/full").unwrap()));
        sync.lock().written = 3;
        assert!(sync.sync().is_err());
        sync.sync_through_or_warn(3, "s");
        sync.sync_through_or_warn(u64::MAX, "s");
        assert_eq!(sync.errors.load(Ordering::Relaxed), 2);
        assert!(sync.behind());
    }

    #[test]
    fn a_log_longer_than_the_window_loads_its_newest_entries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.digests");
        let mut w = DigestWindow::new(4, 0);
        let mut log = DigestLog::open(&path, &mut w, 0).unwrap();
        for d in 1..=7u128 {
            w.insert(d, 5);
            log.push(d, 5);
        }
        log.flush().unwrap();
        drop(log);
        // Seven entries on disk, a window of four: the last four come back.
        let mut again = DigestWindow::new(4, 0);
        let mut log = DigestLog::open(&path, &mut again, 0).unwrap();
        assert_eq!(again.len(), 4);
        assert!((4..=7).all(|d| again.contains(d, 0)));
        assert!((1..=3).all(|d| !again.contains(d, 0)));
        // The reopened log counts its seven entries: the eighth compacts it to the window.
        log.push(8, 5);
        log.flush().unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), 4 * ENTRY as u64);
        drop(log);
        let mut third = DigestWindow::new(4, 0);
        DigestLog::open(&path, &mut third, 0).unwrap();
        assert!((5..=8).all(|d| third.contains(d, 0)));
    }
}
