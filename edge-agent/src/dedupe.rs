//! The agent's dedupe window: the last N content hashes (and at most T seconds of them), kept in a
//! compact table and persisted, so that a restart does not re-send what was already sent.
//!
//! Memory per entry: a 16-byte digest (the first half of the record's BLAKE3 content hash) and a
//! 4-byte timestamp in a ring, plus a 4-byte slot index in a hash table kept at most 7/8 full
//! (about 5 bytes per bucket, 1-2 buckets per entry): **about 30 bytes per entry**, 30 MB for a
//! window of one million records.
//!
//! Persistence: every accepted digest is appended to `<stream>.digests` (20 bytes each) right after
//! its batch is spooled, with the spool's fsync policy. On start the tail of that log is loaded,
//! then the digests of every batch still in the spool are added (so a crash between spooling a
//! batch and logging its digests loses nothing). The log is rewritten to its last N entries when
//! it reaches twice that.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use hashbrown::HashTable;
use schemas::ContentHash;

const ENTRY: usize = 20;

/// The 128-bit digest kept per record.
pub type Digest = u128;

pub fn digest(hash: &ContentHash) -> Digest {
    u128::from_le_bytes(hash.0[..16].try_into().expect("16 bytes"))
}

/// Fixed-capacity window of digests, oldest evicted first, with an age limit.
#[derive(Debug)]
pub struct DigestWindow {
    capacity: usize,
    max_age_secs: u32,
    digests: Vec<Digest>,
    times: Vec<u32>,
    /// Ring positions: `head` is the oldest entry, `len` entries follow it.
    head: usize,
    len: usize,
    index: HashTable<u32>,
}

fn hash_of(d: Digest) -> u64 {
    // The digest is already uniformly distributed.
    d as u64
}

impl DigestWindow {
    pub fn new(capacity: usize, max_age_secs: u32) -> DigestWindow {
        // Reserved once: growing by doubling would hold the old and the new copy at once (the
        // peak), and over-allocate up to twice the window. Untouched pages cost no memory.
        DigestWindow {
            capacity,
            max_age_secs,
            digests: Vec::with_capacity(capacity),
            times: Vec::with_capacity(capacity),
            head: 0,
            len: 0,
            index: HashTable::with_capacity(capacity),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, d: Digest, now_secs: u32) -> bool {
        self.index
            .find(hash_of(d), |&slot| self.digests[slot as usize] == d)
            .is_some_and(|&slot| !self.expired(self.times[slot as usize], now_secs))
    }

    fn expired(&self, time: u32, now_secs: u32) -> bool {
        self.max_age_secs > 0 && now_secs.saturating_sub(time) > self.max_age_secs
    }

    /// Records `d` seen at `now_secs`; false if it is already in the window (a duplicate).
    pub fn insert(&mut self, d: Digest, now_secs: u32) -> bool {
        if self.capacity == 0 {
            return true;
        }
        while self.len > 0 && self.expired(self.times[self.head], now_secs) {
            self.evict_oldest();
        }
        if self.contains(d, now_secs) {
            return false;
        }
        if self.len == self.capacity {
            self.evict_oldest();
        }
        let slot = if self.digests.len() < self.capacity {
            // Grow the ring lazily, so a big window costs memory only once it is used.
            debug_assert_eq!(self.head + self.len, self.digests.len());
            self.digests.push(d);
            self.times.push(now_secs);
            self.digests.len() - 1
        } else {
            let slot = (self.head + self.len) % self.capacity;
            self.digests[slot] = d;
            self.times[slot] = now_secs;
            slot
        };
        let digests = &self.digests;
        self.index
            .insert_unique(hash_of(d), slot as u32, |&s| hash_of(digests[s as usize]));
        self.len += 1;
        true
    }

    /// Takes `d` out of the window (its records were not stored after all, so a re-send must
    /// not count as a duplicate). Its ring slot stays until evicted, matching no table entry.
    pub fn forget(&mut self, d: Digest) {
        let digests = &self.digests;
        if let Ok(entry) = self
            .index
            .find_entry(hash_of(d), |&s| digests[s as usize] == d)
        {
            entry.remove();
        }
    }

    fn evict_oldest(&mut self) {
        let slot = self.head;
        let d = self.digests[slot];
        if let Ok(entry) = self.index.find_entry(hash_of(d), |&s| s as usize == slot) {
            entry.remove();
        }
        self.head = (self.head + 1) % self.capacity;
        self.len -= 1;
        if self.len == 0 && self.digests.len() < self.capacity {
            self.head = 0;
            self.digests.clear();
            self.times.clear();
        }
    }

    /// Bytes held by the table and the ring.
    pub fn memory_bytes(&self) -> usize {
        self.digests.capacity() * 16 + self.times.capacity() * 4 + self.index.capacity() * 5
    }
}

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
        let keep = window.capacity;
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
    fn window_evicts_by_count_and_age() {
        let mut w = DigestWindow::new(3, 10);
        assert!(w.insert(1, 100));
        assert!(!w.insert(1, 100));
        assert!(w.insert(2, 100) && w.insert(3, 101));
        assert!(w.insert(4, 102), "evicts 1");
        assert!(!w.contains(1, 102) && w.contains(2, 102) && w.contains(4, 102));
        assert!(w.insert(1, 102));
        assert_eq!(w.len(), 3);
        // 3, 4 and 1 are older than 10 s at 113; all expire.
        assert!(w.insert(3, 113));
        assert_eq!(w.len(), 1);
        assert!(!w.contains(4, 113));
    }

    #[test]
    fn window_matches_a_model_over_random_operations() {
        use std::collections::VecDeque;
        let mut w = DigestWindow::new(64, 0);
        let mut model: VecDeque<u128> = VecDeque::new();
        let mut x: u64 = 1;
        for _ in 0..20_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let d = u128::from((x >> 33) % 200);
            let fresh = !model.contains(&d);
            assert_eq!(w.insert(d, 0), fresh, "digest {d}");
            if fresh {
                model.push_back(d);
                if model.len() > 64 {
                    model.pop_front();
                }
            }
        }
        assert_eq!(w.len(), model.len());
    }

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
}
