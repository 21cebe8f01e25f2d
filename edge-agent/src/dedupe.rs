//! The agent's dedupe window: the last N content hashes (and at most T seconds of them), kept in a
//! compact table ([`schemas::window::DigestWindow`], at most 36 bytes per entry: 36 MB for a
//! window of one million records) and persisted, so that a restart does not re-send what was
//! already sent.
//!
//! Persistence: every accepted digest is appended to `<stream>.digests` (20 bytes each) right after
//! its batch is spooled, with the spool's fsync policy, and before the spool offers the batch for
//! delivery. On start the tail of that log is loaded, then the digests of every batch still in the
//! spool are added, and logged if the log lacked them (a crash between spooling a batch and
//! logging its digests): delivering that batch takes it out of the spool, and the next start must
//! still know its records. The log is rewritten to its last N entries when it reaches twice that.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

pub use schemas::window::{Digest, DigestWindow, digest};

const ENTRY: usize = 20;

/// The append-only log of accepted digests of one stream.
#[derive(Debug)]
pub struct DigestLog {
    path: PathBuf,
    file: File,
    entries: u64,
    keep: usize,
    buf: Vec<u8>,
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
            file,
            entries: whole / ENTRY as u64,
            keep,
            buf: Vec::new(),
        })
    }

    /// Queues a digest; [`DigestLog::flush`] writes the queue.
    pub fn push(&mut self, d: Digest, time: u32) {
        self.buf.extend_from_slice(&d.to_le_bytes());
        self.buf.extend_from_slice(&time.to_le_bytes());
    }

    /// Writes queued digests, fsyncs if `sync`, and compacts the log when it has grown to twice the
    /// window.
    pub fn flush(&mut self, sync: bool) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            if let Err(e) = self.file.write_all(&self.buf) {
                // Keep whole entries only; keep the queue for the next try, within reason.
                let _ = self.file.set_len(self.entries * ENTRY as u64);
                if self.buf.len() > (1 << 20) {
                    self.buf.clear();
                }
                return Err(e);
            }
            self.entries += (self.buf.len() / ENTRY) as u64;
            self.buf.clear();
        }
        if sync {
            self.file.sync_data()?;
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
        let mut from = File::open(&self.path)?;
        from.seek(SeekFrom::Start(start))?;
        std::io::copy(&mut from.take(whole - start), &mut out)?;
        out.sync_data()?;
        fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        self.file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(&self.path)?;
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
            log.flush(true).unwrap();
        }
        // Compacted at 8 entries? Not yet: 7 < 2 * 4.
        assert_eq!(fs::metadata(&path).unwrap().len(), 7 * ENTRY as u64);
        log.push(8, 5);
        log.flush(true).unwrap();
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
        log.flush(true).unwrap();
        drop(log);
        // Seven entries on disk, a window of four: the last four come back.
        let mut again = DigestWindow::new(4, 0);
        let mut log = DigestLog::open(&path, &mut again, 0).unwrap();
        assert_eq!(again.len(), 4);
        assert!((4..=7).all(|d| again.contains(d, 0)));
        assert!((1..=3).all(|d| !again.contains(d, 0)));
        // The reopened log counts its seven entries: the eighth compacts it to the window.
        log.push(8, 5);
        log.flush(true).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), 4 * ENTRY as u64);
        drop(log);
        let mut third = DigestWindow::new(4, 0);
        DigestLog::open(&path, &mut third, 0).unwrap();
        assert!((5..=8).all(|d| third.contains(d, 0)));
    }
}
