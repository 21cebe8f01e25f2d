//! A bounded window of recently seen content hashes, for dropping duplicates: the edge agent keeps
//! one per stream, the sink one per partition.
//!
//! Memory per entry: a 16-byte digest (the first half of the record's BLAKE3 content hash) in a
//! ring, a 4-byte timestamp when the window also has an age limit, and a 4-byte ring position in
//! a hash table kept at most 7/8 full (5 bytes per bucket with its control byte; the buckets are
//! a power of two, 1.15–2.3 per entry): **at most 28 bytes per entry without an age limit, 32
//! with one** ([`MAX_ENTRY_BYTES`]). A set of whole 32-byte hashes plus a queue of them for the order, which
//! this replaced in the sink, took 70–100.
//!
//! Sixteen bytes are plenty to tell records apart: a window of N entries mistakes a new record
//! for a duplicate with a probability of about N / 2^128 per record, and a record cannot be made
//! to hit a chosen digest (a preimage of BLAKE3's output). The table's buckets are chosen by a
//! hash keyed at random per window, so records cannot be aimed at one bucket either.

use std::hash::BuildHasher;

use hashbrown::HashTable;

use crate::hash::ContentHash;

/// The 128-bit digest kept per record.
pub type Digest = u128;

/// Bytes one entry takes at most in a window of a thousand entries or more, with an age limit
/// ([`MAX_UNTIMED_ENTRY_BYTES`] without one): see the module doc.
pub const MAX_ENTRY_BYTES: usize = 32;
/// The same without an age limit (no timestamp is kept).
pub const MAX_UNTIMED_ENTRY_BYTES: usize = MAX_ENTRY_BYTES - size_of::<u32>();

pub fn digest(hash: &ContentHash) -> Digest {
    u128::from_le_bytes(hash.0[..16].try_into().expect("16 bytes"))
}

/// Fixed-capacity window of digests, oldest evicted first, with an optional age limit.
#[derive(Debug, Clone)]
pub struct DigestWindow {
    capacity: usize,
    /// 0: no age limit, and no times are kept.
    max_age_secs: u32,
    digests: Vec<Digest>,
    times: Vec<u32>,
    /// Ring positions: `head` is the oldest entry, `len` entries follow it.
    head: usize,
    len: usize,
    index: HashTable<u32>,
    hasher: foldhash::fast::RandomState,
}

impl DigestWindow {
    /// A window of `capacity` entries, each forgotten `max_age_secs` after it was seen (0: only
    /// by count).
    pub fn new(capacity: usize, max_age_secs: u32) -> DigestWindow {
        // Reserved once: growing by doubling would hold the old and the new copy at once (the
        // peak), and over-allocate up to twice the window. Untouched pages cost no memory.
        DigestWindow {
            capacity,
            max_age_secs,
            digests: Vec::with_capacity(capacity),
            times: Vec::with_capacity(if max_age_secs > 0 { capacity } else { 0 }),
            head: 0,
            len: 0,
            index: HashTable::with_capacity(capacity),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn bucket(&self, d: Digest) -> u64 {
        self.hasher.hash_one(d as u64)
    }

    fn time(&self, slot: usize) -> u32 {
        self.times.get(slot).copied().unwrap_or_default()
    }

    /// The entry of ring position `slot`, unless it was forgotten.
    fn live(&self, slot: usize) -> bool {
        self.index
            .find(self.bucket(self.digests[slot]), |&s| s as usize == slot)
            .is_some()
    }

    pub fn contains(&self, d: Digest, now_secs: u32) -> bool {
        self.index
            .find(self.bucket(d), |&slot| self.digests[slot as usize] == d)
            .is_some_and(|&slot| !self.expired(self.time(slot as usize), now_secs))
    }

    /// Whether an entry seen at `time` is past the age limit at `now_secs`.
    pub fn expired(&self, time: u32, now_secs: u32) -> bool {
        self.max_age_secs > 0 && now_secs.saturating_sub(time) > self.max_age_secs
    }

    /// Records `d` seen at `now_secs` (any value when there is no age limit); false if it is
    /// already in the window (a duplicate).
    pub fn insert(&mut self, d: Digest, now_secs: u32) -> bool {
        if self.capacity == 0 {
            return true;
        }
        while self.len > 0 && self.expired(self.time(self.head), now_secs) {
            self.evict_oldest();
        }
        if self.contains(d, now_secs) {
            return false;
        }
        if self.len == self.capacity {
            self.evict_oldest();
        }
        let timed = self.max_age_secs > 0;
        let slot = if self.digests.len() < self.capacity {
            // Grow the ring lazily, so a big window costs memory only once it is used.
            debug_assert_eq!(self.head + self.len, self.digests.len());
            self.digests.push(d);
            if timed {
                self.times.push(now_secs);
            }
            self.digests.len() - 1
        } else {
            let slot = (self.head + self.len) % self.capacity;
            self.digests[slot] = d;
            if timed {
                self.times[slot] = now_secs;
            }
            slot
        };
        let (digests, hasher) = (&self.digests, &self.hasher);
        self.index.insert_unique(self.bucket(d), slot as u32, |&s| {
            hasher.hash_one(digests[s as usize] as u64)
        });
        self.len += 1;
        true
    }

    /// Takes `d` out of the window (its records were not stored after all, so a re-send must
    /// not count as a duplicate). Its ring slot stays until evicted, matching no table entry.
    pub fn forget(&mut self, d: Digest) {
        let digests = &self.digests;
        if let Ok(entry) = self
            .index
            .find_entry(self.bucket(d), |&s| digests[s as usize] == d)
        {
            entry.remove();
        }
    }

    fn evict_oldest(&mut self) {
        let slot = self.head;
        if let Ok(entry) = self
            .index
            .find_entry(self.bucket(self.digests[slot]), |&s| s as usize == slot)
        {
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

    /// Lowers the capacity to `capacity` (a no-op if it is not lower), keeping the newest
    /// entries, and gives back the memory of the rest.
    pub fn shrink_to(&mut self, capacity: usize) {
        if capacity >= self.capacity {
            return;
        }
        let mut smaller = DigestWindow::new(capacity, self.max_age_secs);
        smaller.hasher = self.hasher.clone();
        let live: Vec<usize> = (0..self.len)
            .map(|i| (self.head + i) % self.capacity)
            .filter(|&slot| self.live(slot))
            .collect();
        for &slot in &live[live.len().saturating_sub(capacity)..] {
            smaller.insert(self.digests[slot], self.time(slot));
        }
        *self = smaller;
    }

    /// Bytes held by the table and the ring (reserved, touched or not).
    pub fn memory_bytes(&self) -> usize {
        self.digests.capacity() * size_of::<Digest>()
            + self.times.capacity() * size_of::<u32>()
            + self.index.allocation_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_by_count_and_age() {
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
        let mut off = DigestWindow::new(0, 0);
        assert!(off.insert(1, 0) && off.insert(1, 0));
    }

    /// A queue of the window's digests, as the window should hold them.
    fn model_insert(model: &mut std::collections::VecDeque<u128>, cap: usize, d: u128) -> bool {
        let fresh = !model.contains(&d);
        if fresh {
            model.push_back(d);
            if model.len() > cap {
                model.pop_front();
            }
        }
        fresh
    }

    fn lcg(x: &mut u64) -> u64 {
        *x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *x >> 33
    }

    #[test]
    fn matches_a_model_over_random_operations() {
        for max_age in [0, 1_000_000] {
            let mut w = DigestWindow::new(64, max_age);
            let mut model = std::collections::VecDeque::new();
            let mut x: u64 = 1;
            for i in 0..20_000 {
                let d = u128::from(lcg(&mut x) % 200);
                let fresh = model_insert(&mut model, 64, d);
                assert_eq!(w.insert(d, i), fresh, "digest {d}");
            }
            assert_eq!(w.len(), model.len());
            assert!(model.iter().all(|&d| w.contains(d, 20_000)));
        }
    }

    #[test]
    fn shrinking_keeps_the_newest_entries_and_goes_on_like_a_smaller_window() {
        let mut w = DigestWindow::new(100, 0);
        let mut model = std::collections::VecDeque::new();
        let mut x: u64 = 7;
        for _ in 0..1_000 {
            let d = u128::from(lcg(&mut x) % 300);
            assert_eq!(w.insert(d, 0), model_insert(&mut model, 100, d));
        }
        // A forgotten entry is not carried over.
        let forgotten = *model.back().unwrap();
        w.forget(forgotten);
        model.pop_back();
        let before = w.memory_bytes();
        w.shrink_to(10);
        assert!(w.memory_bytes() < before / 4, "memory given back");
        while model.len() > 10 {
            model.pop_front();
        }
        assert_eq!(w.len(), 10);
        assert!(model.iter().all(|&d| w.contains(d, 0)));
        assert!(!w.contains(forgotten, 0));
        for _ in 0..1_000 {
            let d = u128::from(lcg(&mut x) % 30);
            assert_eq!(
                w.insert(d, 0),
                model_insert(&mut model, 10, d),
                "digest {d}"
            );
        }
        w.shrink_to(50);
        assert_eq!(w.capacity(), 10, "never grows");
    }

    #[test]
    fn an_entry_takes_at_most_the_stated_bytes() {
        for (max_age, per_entry) in [(0, MAX_UNTIMED_ENTRY_BYTES), (60, MAX_ENTRY_BYTES)] {
            for capacity in [1_000, 100_000, 1 << 20, 1_000_000] {
                let w = DigestWindow::new(capacity, max_age);
                assert!(
                    w.memory_bytes() <= capacity * per_entry,
                    "{capacity} entries, age limit {max_age}: {} bytes",
                    w.memory_bytes()
                );
            }
        }
    }
}
