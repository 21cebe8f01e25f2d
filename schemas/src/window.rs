//! A bounded window of recently seen content hashes, for dropping duplicates: the edge agent keeps
//! one per stream, the sink one per partition.
//!
//! Memory per entry: a 16-byte digest (the first half of the record's BLAKE3 content hash) in a
//! ring, a 4-byte timestamp when the window also has an age limit, and two 8-byte buckets in an
//! open-addressing table that is at most half full: **at most 32 bytes per entry without an age
//! limit, 36 with one** ([`MAX_ENTRY_BYTES`]; a table at most 70% full would take 28 and 32, at
//! the cost of longer runs, see [`BUCKETS_PER_ENTRY`]). A set of whole 32-byte hashes plus a queue of them for the order, which
//! this replaced in the sink, took 70–100.
//!
//! A bucket holds 32 bits of the entry's keyed hash, from which its home bucket is computed,
//! and the low 32 bits of its insert number, from which its age in inserts and so its ring
//! position follow. Looking a record up and adding it touch one run of adjacent buckets, and
//! the ring only where the hash bits match. Evicting the oldest entry touches no bucket at all:
//! its bucket stays where it is until a lookup passes it, which sees from the insert number
//! alone that the entry is gone and takes the bucket out of the run then, while the run is in
//! the cache anyway. So a new record costs one random memory access, where evicting the oldest
//! entry's bucket at once would make two, and a general hash table (control bytes,
//! positions and the ring apart) four or five. Buckets left behind that way fill the table to
//! about 89% in the long run, with twice as many buckets as entries (a simulation); should they
//! come to fill more than 15/16 of it, the ring's entries are placed anew. With a million
//! entries (about 32 MB) the table does not fit in the cache: in a full million-entry window
//! an insert took 130 ns with the eviction's access and 78 ns without (1.5 M inserts in groups,
//! a fifth of them duplicates). With a group's buckets loaded together
//! ([`DigestWindow::prefetch`]) the window was about 12% of the agent's samples before that
//! change, much of it waiting for those loads, and 8% after it.
//!
//! An insert number is kept in 32 bits: a bucket that no lookup passes for 2^32 inserts would
//! look young again. Such a bucket names a ring slot that holds a remembered entry, and a
//! lookup matches only the whole digest in that slot, so it can only find a record that is in
//! the window anyway; it is taken out once it looks old again.
//!
//! The table is reserved whole but written only as far as it is used: a small prefix that
//! grows fourfold as entries arrive; the ring grows as entries are added. So a window touches
//! memory in proportion to what it holds, not to its capacity. (Allocating the table zeroed is
//! not enough: mimalloc, the sink's allocator, zeroes such a block itself when it comes from
//! memory it recycles, which wrote every page of a partition's table when the partition
//! opened.) A sink with many partitions reserves a window for each, and one that has seen a few
//! thousand records would otherwise have touched every page of its table by then (inserts land
//! at random).
//!
//! Sixteen bytes are plenty to tell records apart: a window of N entries mistakes a new record
//! for a duplicate with a probability of about N / 2^128 per record, and a record cannot be made
//! to hit a chosen digest (a preimage of BLAKE3's output). The table's buckets are chosen by a
//! hash keyed at random per window, so records cannot be aimed at one bucket either.

use std::hash::BuildHasher;

use crate::hash::ContentHash;

/// Table buckets a window starts with (8 KiB, two pages); it grows [`GROWTH`]-fold from there.
const FIRST_BUCKETS: usize = 1024;

/// How many times the buckets in use grow when they fill; when that would make half of all the
/// buckets or more, they grow to all of them at once. Each growth places every entry anew, at
/// random places in a table larger than the cache: doubling (and doubling again from 1,048,576
/// to the 1,428,572 buckets of a million-entry window) placed 1.47 entries anew for each one the
/// edge agent's window came to hold, about a quarter of the window's time in bench-agent's run
/// (perf). Growing fourfold and skipping the last small step place 0.24.
const GROWTH: usize = 4;

/// The most of the buckets in use that may be taken (numerator, denominator) before the ring's
/// entries are placed anew: buckets of evicted entries are taken out only when a lookup passes
/// them, and a full window on twice as many buckets as entries settles at about 89% of its
/// buckets taken that way (a simulation of the table: 50,000 entries, 400,000 inserts). Entries
/// that leave by age keep their buckets until they are `capacity` inserts old, so a window that
/// holds few entries for its inserts is placed anew now and then.
const CROWDED: (usize, usize) = (15, 16);

/// Entries placed together when the table grows.
const REPLACE_GROUP: usize = 32;

/// Buckets per entry of capacity: the remembered entries take at most half of them, those left
/// behind by evicted entries some more. With 10/7 (and evicting that took its bucket out at
/// once) they settled at about 92% taken, with lookups passing about 9 buckets
/// where they pass about 4 with 2 (the simulation above).
const BUCKETS_PER_ENTRY: usize = 2;

/// The 128-bit digest kept per record.
pub type Digest = u128;

/// What a forgotten entry's ring slot holds. A record whose digest is this value (a chance of
/// 2^-128, and no record can be made to have it) is forgotten when the table next grows: a
/// duplicate of it could pass once.
const FORGOTTEN: Digest = Digest::MAX;

/// Bytes one entry takes at most in a window of a thousand entries or more, with an age limit
/// ([`MAX_UNTIMED_ENTRY_BYTES`] without one): see the module doc.
pub const MAX_ENTRY_BYTES: usize = 36;
/// The same without an age limit (no timestamp is kept).
pub const MAX_UNTIMED_ENTRY_BYTES: usize = MAX_ENTRY_BYTES - size_of::<u32>();

pub fn digest(hash: &ContentHash) -> Digest {
    u128::from_le_bytes(hash.0[..16].try_into().expect("16 bytes"))
}

/// A table bucket: 0 when empty, else the entry's keyed hash bits (high half, never 0) and the
/// low 32 bits of its insert number (low half), from which its age in inserts follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bucket(u64);

impl Bucket {
    const EMPTY: Bucket = Bucket(0);

    fn new(bits: u32, seq: u32) -> Bucket {
        debug_assert!(bits != 0);
        Bucket((u64::from(bits) << 32) | u64::from(seq))
    }

    fn is_empty(self) -> bool {
        self.0 == 0
    }

    fn bits(self) -> u32 {
        (self.0 >> 32) as u32
    }

    fn seq(self) -> u32 {
        self.0 as u32
    }
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
    /// The low 32 bits of the number of inserts so far: the next entry's insert number. The
    /// entry `a` inserts back (1 to `capacity`) is in the ring's slot `a` before its tail.
    seq: u32,
    /// Buckets in use, those of entries gone from the ring among them until a lookup passes
    /// them.
    occupied: usize,
    /// [`Bucket`]s, linear probing from an entry's home bucket; deletions shift the run back (no
    /// tombstones), so a lookup stops at the first empty bucket. The `active` ones in use (the
    /// vector's length; its capacity is the most there can be), at most half full
    /// ([`BUCKETS_PER_ENTRY`]), so there is one.
    table: Vec<u64>,
    active: usize,
    /// The most buckets the table grows to.
    buckets: usize,
    hasher: foldhash::fast::RandomState,
}

impl DigestWindow {
    /// A window of `capacity` entries, each forgotten `max_age_secs` after it was seen (0: only
    /// by count).
    pub fn new(capacity: usize, max_age_secs: u32) -> DigestWindow {
        assert!(
            capacity < u32::MAX as usize / 2,
            "window of {capacity} entries"
        );
        // Reserved once: growing by doubling would hold the old and the new copy at once (the
        // peak), and over-allocate up to twice the window. Untouched pages cost no memory, and
        // only the buckets in use are written.
        let buckets = if capacity == 0 {
            0
        } else {
            capacity * BUCKETS_PER_ENTRY
        };
        DigestWindow {
            capacity,
            max_age_secs,
            digests: Vec::with_capacity(capacity),
            times: Vec::with_capacity(if max_age_secs > 0 { capacity } else { 0 }),
            head: 0,
            len: 0,
            seq: 0,
            occupied: 0,
            table: {
                let mut table = Vec::with_capacity(buckets);
                table.resize(buckets.min(FIRST_BUCKETS), 0);
                table
            },
            active: buckets.min(FIRST_BUCKETS),
            buckets,
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

    /// The ring position `k` entries after the oldest (`k` at most the capacity): a subtraction
    /// where `%` took a division, tens of cycles, on every insert and eviction.
    fn ring(&self, k: usize) -> usize {
        let i = self.head + k;
        if i >= self.capacity {
            i - self.capacity
        } else {
            i
        }
    }

    /// The keyed hash bits of `d` that a bucket keeps (never 0, so no bucket in use is 0).
    fn bits(&self, d: Digest) -> u32 {
        (self.hasher.hash_one(d as u64) >> 32) as u32 | 1
    }

    /// The bucket where an entry with hash bits `bits` is placed if it is free.
    fn home(&self, bits: u32) -> usize {
        ((u64::from(bits) * self.active as u64) >> 32) as usize
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.active { 0 } else { i + 1 }
    }

    fn bucket(&self, i: usize) -> Bucket {
        Bucket(self.table[i])
    }

    /// The ring slot of `b`'s entry, or `None` if it is more than `capacity` inserts old (its
    /// slot has been taken by a newer entry, or is about to be): a bucket's age is read from
    /// the bucket alone, so evicting an entry needs no table access.
    fn slot_of(&self, b: Bucket) -> Option<usize> {
        let age = self.seq.wrapping_sub(b.seq()) as usize;
        if age == 0 || age > self.capacity {
            return None;
        }
        let tail = self.ring(self.len);
        Some(if age <= tail {
            tail - age
        } else {
            tail + self.capacity - age
        })
    }

    /// Puts `b` in the first free bucket from its home.
    fn place(&mut self, b: Bucket) {
        let mut i = self.home(b.bits());
        while !self.bucket(i).is_empty() {
            i = self.next(i);
        }
        self.table[i] = b.0;
        self.occupied += 1;
    }

    /// Makes room for one more bucket: grows the buckets in use ([`GROWTH`]) when one more
    /// entry would fill them past half, and places the ring's entries anew in the same buckets
    /// when those left by evicted entries (which lookups take out only as they pass them) have
    /// filled them past [`CROWDED`]. Either way every entry of the ring is placed anew, and
    /// nothing else (no copy of the old buckets is held).
    fn make_room(&mut self) {
        if !self.grows_for_one_more() && (self.occupied + 1) * CROWDED.1 <= self.active * CROWDED.0
        {
            return;
        }
        self.table.fill(0);
        self.occupied = 0;
        while self.grows_for_one_more() {
            let grown = self.active * GROWTH;
            self.active = if grown * 2 >= self.buckets {
                self.buckets
            } else {
                grown
            };
        }
        // Within the capacity reserved at the start: no reallocation.
        self.table.resize(self.active, 0);
        // In groups whose home buckets are loaded first: a table larger than the cache misses
        // on each, and the loads of a group wait for memory together (placing the entries one
        // by one was a quarter of the inserts' time in a million-entry window).
        let mut homes = [Bucket::EMPTY; REPLACE_GROUP];
        for start in (0..self.len).step_by(REPLACE_GROUP) {
            let group = &mut homes[..REPLACE_GROUP.min(self.len - start)];
            let mut sum = 0u64;
            for (k, home) in (start..).zip(group.iter_mut()) {
                let d = self.digests[self.ring(k)];
                *home = if d == FORGOTTEN {
                    Bucket::EMPTY
                } else {
                    let b = Bucket::new(self.bits(d), self.seq.wrapping_sub((self.len - k) as u32));
                    sum ^= self.table[self.home(b.bits())];
                    b
                };
            }
            std::hint::black_box(sum);
            for &b in group.iter() {
                if !b.is_empty() {
                    self.place(b);
                }
            }
        }
    }

    /// Whether the buckets in use are to grow before one more entry: they can, and it would
    /// fill them past half.
    fn grows_for_one_more(&self) -> bool {
        self.active < self.buckets && (self.len + 1) * BUCKETS_PER_ENTRY > self.active
    }

    /// Whether bucket `b`, whose entry is in ring slot `slot`, holds `d` (hash bits `bits`)
    /// within the age limit at `now_secs`.
    fn holds(&self, b: Bucket, slot: usize, (d, bits): (Digest, u32), now_secs: u32) -> bool {
        b.bits() == bits && self.digests[slot] == d && !self.expired(self.time(slot), now_secs)
    }

    /// The bucket and ring slot of `d`'s entry, unless it is past the age limit at `now_secs`.
    fn find(&self, d: Digest, now_secs: u32) -> Option<(usize, usize)> {
        let bits = self.bits(d);
        let mut i = self.home(bits);
        loop {
            let b = self.bucket(i);
            if b.is_empty() {
                return None;
            }
            if let Some(slot) = self.slot_of(b)
                && self.holds(b, slot, (d, bits), now_secs)
            {
                return Some((i, slot));
            }
            i = self.next(i);
        }
    }

    /// Empties bucket `i`, moving later entries of its run back so that each stays reachable
    /// from its home bucket.
    fn remove_bucket(&mut self, mut i: usize) {
        self.occupied -= 1;
        let mut j = i;
        loop {
            j = self.next(j);
            let b = self.bucket(j);
            if b.is_empty() {
                break;
            }
            let home = self.home(b.bits());
            // The entry at j stays if its home lies cyclically in (i, j].
            let stays = if i <= j {
                i < home && home <= j
            } else {
                i < home || home <= j
            };
            if !stays {
                self.table[i] = b.0;
                i = j;
            }
        }
        self.table[i] = Bucket::EMPTY.0;
    }

    fn time(&self, slot: usize) -> u32 {
        self.times.get(slot).copied().unwrap_or_default()
    }

    pub fn contains(&self, d: Digest, now_secs: u32) -> bool {
        self.capacity > 0 && self.find(d, now_secs).is_some()
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
        // Look `d` up, taking the buckets of entries gone from the ring out of the run on the
        // way: they were left in place when their entries were evicted.
        let bits = self.bits(d);
        let mut i = self.home(bits);
        loop {
            let b = self.bucket(i);
            if b.is_empty() {
                break;
            }
            match self.slot_of(b) {
                // Fills bucket `i` from later in the run, or empties it.
                None => self.remove_bucket(i),
                Some(slot) if self.holds(b, slot, (d, bits), now_secs) => return false,
                Some(_) => i = self.next(i),
            }
        }
        if self.len == self.capacity {
            self.evict_oldest();
        }
        self.make_room();
        let timed = self.max_age_secs > 0;
        let slot = self.ring(self.len);
        if slot == self.digests.len() {
            // Grow the ring lazily, so a big window costs memory only once it is used.
            self.digests.push(d);
            if timed {
                self.times.push(now_secs);
            }
        } else {
            self.digests[slot] = d;
            if timed {
                self.times[slot] = now_secs;
            }
        }
        self.len += 1;
        self.seq = self.seq.wrapping_add(1);
        self.place(Bucket::new(bits, self.seq.wrapping_sub(1)));
        true
    }

    /// Loads the buckets that inserting `ds` in turn will probe first. A window much larger
    /// than the cache misses on each, and these independent loads wait for memory together
    /// where the inserts would wait one after another (a cache miss was 95% of a lookup's time
    /// with a million entries). Only a hint: calling it or not changes no answer.
    pub fn prefetch(&self, ds: &[Digest]) {
        if self.active == 0 {
            return;
        }
        let mut sum = 0u64;
        for &d in ds {
            sum ^= self.table[self.home(self.bits(d))];
        }
        std::hint::black_box(sum);
    }

    /// Takes `d` out of the window (its records were not stored after all, so a re-send must
    /// not count as a duplicate). Its ring slot stays until evicted, matching no table entry,
    /// and holds [`FORGOTTEN`] so that placing the entries anew does not bring it back.
    pub fn forget(&mut self, d: Digest) {
        if self.capacity == 0 {
            return;
        }
        // An entry past the age limit may still have its bucket, beside a newer one: both go
        // (a time of 0 counts every entry as within the limit).
        while let Some((i, slot)) = self.find(d, 0) {
            self.remove_bucket(i);
            self.digests[slot] = FORGOTTEN;
        }
    }

    /// Drops the oldest entry from the ring. Its bucket stays until a lookup passes it or the
    /// entries are placed anew: by then its insert number says it is gone.
    fn evict_oldest(&mut self) {
        self.head = self.ring(1);
        self.len -= 1;
    }

    /// Lowers the capacity to `capacity` (a no-op if it is not lower), keeping the newest
    /// entries, and gives back the memory of the rest.
    pub fn shrink_to(&mut self, capacity: usize) {
        if capacity < self.capacity {
            self.resize_to(capacity);
        }
    }

    /// Sets the capacity to `capacity`, keeping the newest entries that fit (all of them when
    /// it grows): the window then goes on as a window of that capacity would that had seen
    /// them. The memory is reserved anew for the new capacity. Costs an insert per kept entry.
    pub fn resize_to(&mut self, capacity: usize) {
        if capacity == self.capacity {
            return;
        }
        let mut resized = DigestWindow::new(capacity, self.max_age_secs);
        resized.hasher = self.hasher.clone();
        let live: Vec<usize> = (0..self.len)
            .map(|i| self.ring(i))
            .filter(|&slot| self.digests[slot] != FORGOTTEN)
            .collect();
        for &slot in &live[live.len().saturating_sub(capacity)..] {
            resized.insert(self.digests[slot], self.time(slot));
        }
        *self = resized;
    }

    /// Bytes held by the table and the ring (reserved, touched or not: an upper bound of what
    /// the window can come to hold).
    pub fn memory_bytes(&self) -> usize {
        self.digests.capacity() * size_of::<Digest>()
            + self.times.capacity() * size_of::<u32>()
            + self.table.capacity() * size_of::<Bucket>()
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
        // An entry is forgotten once more than the age limit has passed, not at the limit.
        let mut w = DigestWindow::new(3, 10);
        assert!(w.insert(7, 100));
        assert!(w.contains(7, 110) && !w.insert(7, 110));
        assert!(!w.contains(7, 111) && w.insert(7, 111));
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

    /// Inserts `n` digests drawn below `range` at `now`, each answered as `model` (a window of
    /// `cap`) answers it.
    fn insert_as_model(
        w: &mut DigestWindow,
        model: &mut std::collections::VecDeque<u128>,
        cap: usize,
        x: &mut u64,
        (n, range, now): (usize, u64, u32),
    ) {
        for _ in 0..n {
            let d = u128::from(lcg(x) % range);
            assert_eq!(w.insert(d, now), model_insert(model, cap, d), "digest {d}");
        }
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

    /// Every bucket in use lies in an unbroken run from its home bucket, and `occupied` counts
    /// them; the buckets of remembered entries are exactly one per entry.
    fn assert_runs_reachable(w: &DigestWindow, remembered: usize, what: &str) {
        let mut used = 0;
        let mut of_entries = 0;
        for i in 0..w.active {
            let b = w.bucket(i);
            if b.is_empty() {
                continue;
            }
            used += 1;
            if w.slot_of(b).is_some() {
                of_entries += 1;
            }
            let mut j = w.home(b.bits());
            while j != i {
                assert!(
                    !w.bucket(j).is_empty(),
                    "{what}: bucket {i} cut off from its home"
                );
                j = w.next(j);
            }
        }
        assert_eq!(used, w.occupied, "{what}: buckets in use");
        assert_eq!(of_entries, remembered, "{what}: one bucket per entry");
    }

    /// Inserts, forgets and evictions in random order, on windows whose tables wrap around and
    /// hold long runs: the window answers as a model does, and its table holds exactly one
    /// bucket per remembered entry, each reachable from its home bucket.
    #[test]
    fn forgetting_and_evicting_keep_every_run_reachable() {
        // 3,000 entries start on fewer buckets than they need at the end, so its table grows.
        for capacity in [1, 2, 7, 64, 500, 3_000] {
            let mut w = DigestWindow::new(capacity, 0);
            let mut model: std::collections::VecDeque<(u128, bool)> = Default::default();
            let mut x: u64 = capacity as u64;
            let universe = 3 * capacity as u64 + 5;
            for _ in 0..20_000 {
                let d = u128::from(lcg(&mut x) % universe) << 64 | 0xabc;
                if lcg(&mut x).is_multiple_of(4) {
                    w.forget(d);
                    if let Some(e) = model.iter_mut().find(|(m, live)| *m == d && *live) {
                        e.1 = false;
                    }
                    continue;
                }
                let fresh = !model.iter().any(|&(m, live)| m == d && live);
                w.prefetch(&[d, d ^ 1 << 64]);
                assert_eq!(w.insert(d, 0), fresh, "capacity {capacity}, digest {d}");
                if fresh {
                    model.push_back((d, true));
                    if model.len() > capacity {
                        model.pop_front();
                    }
                }
                assert_eq!(w.len(), model.len());
            }
            let live: Vec<u128> = model.iter().filter(|e| e.1).map(|e| e.0).collect();
            assert!(live.iter().all(|&d| w.contains(d, 0)));
            assert_runs_reachable(&w, live.len(), &format!("capacity {capacity}"));
        }
    }

    /// With an age limit short enough that most entries leave by age, the buckets they leave
    /// behind are taken out or the entries placed anew before they crowd the table (small
    /// windows whose buckets in use stay few), and the window answers as a model does.
    #[test]
    fn entries_leaving_by_age_do_not_crowd_the_table() {
        for capacity in [1, 3, 64, 5_000] {
            let max_age = 3;
            let mut w = DigestWindow::new(capacity, max_age);
            // (digest, time, not forgotten) in the order seen: a forgotten entry keeps its
            // place in the ring until it is evicted.
            let mut model: std::collections::VecDeque<(u128, u32, bool)> = Default::default();
            let mut x: u64 = 99 + capacity as u64;
            let universe = 2 * capacity as u64 + 40;
            let mut now = 0u32;
            for n in 0..40_000u32 {
                if n % 50 == 0 {
                    now += 1;
                }
                let d = u128::from(lcg(&mut x) % universe);
                if lcg(&mut x).is_multiple_of(9) {
                    w.forget(d);
                    for e in model.iter_mut().filter(|e| e.0 == d) {
                        e.2 = false;
                    }
                    continue;
                }
                while model.front().is_some_and(|&(_, t, _)| now - t > max_age) {
                    model.pop_front();
                }
                let fresh = !model.iter().any(|&(m, _, live)| m == d && live);
                assert_eq!(w.insert(d, now), fresh, "capacity {capacity}, digest {d}");
                if fresh {
                    model.push_back((d, now, true));
                    if model.len() > capacity {
                        model.pop_front();
                    }
                }
                assert!(
                    w.occupied * CROWDED.1 <= w.active * CROWDED.0,
                    "capacity {capacity}: {} of {} buckets in use",
                    w.occupied,
                    w.active
                );
            }
            for &(d, ..) in &model {
                let live = model.iter().any(|&(m, _, live)| m == d && live);
                assert_eq!(w.contains(d, now), live, "capacity {capacity}, digest {d}");
            }
            assert_eq!(w.len(), model.len());
        }
    }

    #[test]
    fn shrinking_keeps_the_newest_entries_and_goes_on_like_a_smaller_window() {
        let mut w = DigestWindow::new(100, 0);
        let mut model = std::collections::VecDeque::new();
        let mut x: u64 = 7;
        insert_as_model(&mut w, &mut model, 100, &mut x, (1_000, 300, 0));
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
        insert_as_model(&mut w, &mut model, 10, &mut x, (1_000, 30, 0));
        w.shrink_to(50);
        assert_eq!(w.capacity(), 10, "never grows");
    }

    #[test]
    fn growing_keeps_every_entry_and_goes_on_like_a_larger_window() {
        for max_age in [0, 1_000] {
            let mut w = DigestWindow::new(20, max_age);
            let mut model = std::collections::VecDeque::new();
            let mut x: u64 = 3;
            insert_as_model(&mut w, &mut model, 20, &mut x, (500, 60, 5));
            w.resize_to(200);
            assert_eq!((w.capacity(), w.len()), (200, 20));
            assert!(model.iter().all(|&d| w.contains(d, 5)));
            // Entries keep their times: all of them expire together past the age limit.
            if max_age > 0 {
                assert!(w.insert(1_000_000, 5 + max_age + 1));
                assert_eq!(w.len(), 1);
                continue;
            }
            insert_as_model(&mut w, &mut model, 200, &mut x, (2_000, 600, 5));
            // And back down, to none at all (deduplication off: nothing is a duplicate).
            w.resize_to(0);
            assert!(w.insert(7, 5) && w.insert(7, 5));
            w.resize_to(5);
            assert!(w.insert(7, 5) && !w.insert(7, 5));
        }
    }

    /// The buckets in use grow fourfold, and to all of them at once when that would be half of
    /// them or more, so that few entries are placed anew as a large window fills.
    #[test]
    fn grows_fourfold_and_to_all_its_buckets_from_half() {
        for (capacity, steps) in [
            (100_000, vec![1024, 4096, 16_384, 65_536, 200_000]),
            (40_000, vec![1024, 4096, 16_384, 80_000]),
            (500, vec![1000]),
        ] {
            let mut w = DigestWindow::new(capacity, 0);
            let mut seen = vec![w.active];
            let mut x: u64 = 5;
            for n in 0..capacity {
                assert!(w.insert(u128::from(lcg(&mut x)) << 40 | n as u128, 0));
                if seen.last() != Some(&w.active) {
                    seen.push(w.active);
                }
            }
            assert_eq!(seen, steps, "window of {capacity}");
            assert_eq!(w.len(), capacity);
        }
    }

    #[test]
    fn uses_buckets_in_proportion_to_its_entries() {
        let mut w = DigestWindow::new(1_000_000, 0);
        assert_eq!(w.active, FIRST_BUCKETS);
        let mut x: u64 = 11;
        let mut inserted = Vec::new();
        for n in 1..=20_000usize {
            let d = u128::from(lcg(&mut x)) << 40 | n as u128;
            assert!(w.insert(d, 0));
            inserted.push(d);
            assert!(
                n * BUCKETS_PER_ENTRY <= w.active,
                "{n} entries on {} buckets",
                w.active
            );
            assert!(
                w.active <= (n * BUCKETS_PER_ENTRY * GROWTH).max(FIRST_BUCKETS),
                "{n} entries"
            );
        }
        assert_eq!(w.active, 65_536);
        assert_eq!(w.table.len(), w.active, "the rest is not written");
        assert_eq!(
            w.table.capacity(),
            1_000_000 * BUCKETS_PER_ENTRY,
            "reserved once"
        );
        assert!(inserted.iter().all(|&d| w.contains(d, 0)));
        assert!(
            inserted.iter().all(|&d| !w.insert(d, 0)),
            "still duplicates"
        );
    }

    #[test]
    fn an_entry_takes_at_most_the_stated_bytes() {
        for (max_age, per_entry) in [(0, MAX_UNTIMED_ENTRY_BYTES), (60, MAX_ENTRY_BYTES)] {
            for capacity in [1_000, 100_000, 1 << 20, 1_000_000] {
                let w = DigestWindow::new(capacity, max_age);
                // And not much less: the sink sizes its windows by this figure.
                assert!(
                    (capacity * (per_entry - 1)..=capacity * per_entry).contains(&w.memory_bytes()),
                    "{capacity} entries, age limit {max_age}: {} bytes",
                    w.memory_bytes()
                );
            }
        }
    }
}
