use std::sync::atomic::AtomicBool;

use proptest::prelude::*;

use super::*;

fn options(max_bytes: u64, segment_bytes: u64) -> SpoolOptions {
    SpoolOptions {
        max_bytes,
        segment_bytes,
        fsync: FsyncPolicy::Batch,
        fsync_interval: Duration::from_millis(1000),
    }
}

fn batch(i: u32, len: usize) -> Batch {
    Batch {
        id: BatchId([i as u8; 32]),
        encoding: BodyEncoding::Ndjson,
        body: (0..len)
            .map(|j| (j as u32 ^ i.wrapping_mul(31)) as u8)
            .collect(),
        records: i + 1,
        raw_bytes: len as u32 * 3,
        created_ms: 1_700_000_000_000 + u64::from(i),
    }
}

fn open(dir: &Path, opts: SpoolOptions) -> (Spool, Recovery) {
    Spool::open(dir, "s", opts, Arc::new(Usage::default())).unwrap()
}

fn never() -> AtomicBool {
    AtomicBool::new(false)
}

/// Every pending batch, in order, by acknowledging as it goes (on a copy of the spool).
fn drain(spool: &Spool) -> Vec<Batch> {
    let mut out = Vec::new();
    while let Some((seq, b)) = spool.first_pending().unwrap() {
        out.push(b);
        spool.ack(seq).unwrap();
    }
    out
}

fn stored(a: Appended) -> u64 {
    match a {
        Appended::Stored { seq, durable } => {
            assert!(durable);
            seq
        }
        Appended::Dropped => panic!("dropped"),
    }
}

/// Appends `batch(i, len)` for every `i` of `ids`, each stored and durable.
fn append_all(spool: &Spool, ids: std::ops::Range<u32>, len: usize) {
    for i in ids {
        stored(
            spool
                .append(&batch(i, len), Overflow::Block, &never())
                .unwrap(),
        );
    }
}

#[test]
fn batches_survive_a_restart_until_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let (spool, _) = open(dir.path(), options(1 << 20, 300));
    for i in 0..5 {
        assert_eq!(
            stored(
                spool
                    .append(&batch(i, 100), Overflow::Block, &never())
                    .unwrap()
            ),
            u64::from(i)
        );
    }
    let (seq, first) = spool.first_pending().unwrap().unwrap();
    assert_eq!((seq, &first), (0, &batch(0, 100)));
    spool.ack(1).unwrap();
    drop(spool);
    let (spool, recovery) = open(dir.path(), options(1 << 20, 300));
    assert_eq!(recovery.pending_batches, 3);
    assert_eq!(recovery.pending_records, 3 + 4 + 5);
    assert_eq!(
        drain(&spool),
        vec![batch(2, 100), batch(3, 100), batch(4, 100)]
    );
    // Sequence numbers continue; acknowledged segments are gone from disk.
    assert_eq!(
        stored(
            spool
                .append(&batch(9, 10), Overflow::Block, &never())
                .unwrap()
        ),
        5
    );
    let segments = fs::read_dir(dir.path().join("s"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".spool")
        })
        .count();
    assert_eq!(segments, 1);
}

#[test]
fn overflow_policies() {
    let dir = tempfile::tempdir().unwrap();
    // Room for about three 1000-byte batches; one per segment.
    let opts = options(3 * 1070, 1000);
    let (spool, _) = open(dir.path(), opts.clone());
    append_all(&spool, 0..3, 1000);
    assert_eq!(
        spool
            .append(&batch(3, 1000), Overflow::DropNewest, &never())
            .unwrap(),
        Appended::Dropped
    );
    let stopping = AtomicBool::new(true);
    assert!(matches!(
        spool.append(&batch(3, 1000), Overflow::Block, &stopping),
        Err(SpoolError::Cancelled)
    ));
    assert_eq!(
        stored(
            spool
                .append(&batch(3, 1000), Overflow::DropOldest, &never())
                .unwrap()
        ),
        3
    );
    assert_eq!(spool.pending(), (3, 2 + 3 + 4));
    assert_eq!(
        drain(&spool),
        vec![batch(1, 1000), batch(2, 1000), batch(3, 1000)]
    );
    // A batch bigger than the whole spool is dropped whatever the policy.
    assert_eq!(
        spool
            .append(&batch(4, 4000), Overflow::Block, &never())
            .unwrap(),
        Appended::Dropped
    );
    // Blocked appends go through once an acknowledgement frees space.
    let spool = Arc::new(spool);
    append_all(&spool, 5..8, 1000);
    let acker = {
        let spool = spool.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let (seq, _) = spool.first_pending().unwrap().unwrap();
            spool.ack(seq).unwrap();
        })
    };
    stored(
        spool
            .append(&batch(8, 1000), Overflow::Block, &never())
            .unwrap(),
    );
    acker.join().unwrap();
}

#[test]
fn interval_fsync_hides_entries_until_synced() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(1 << 20, 1 << 16);
    opts.fsync = FsyncPolicy::Interval;
    opts.fsync_interval = Duration::from_secs(3600);
    let (spool, _) = open(dir.path(), opts);
    // An hour-long interval: the append is written but not yet synced.
    let a = spool
        .append(&batch(0, 10), Overflow::Block, &never())
        .unwrap();
    assert_eq!(
        a,
        Appended::Stored {
            seq: 0,
            durable: false
        }
    );
    assert!(
        spool.first_pending().unwrap().is_none(),
        "not durable, not sent"
    );
    assert_eq!(spool.sync(false).unwrap(), 0);
    assert_eq!(spool.sync(true).unwrap(), 1);
    assert_eq!(spool.first_pending().unwrap().unwrap().1, batch(0, 10));
}

#[test]
fn a_held_entry_is_not_offered_until_released_or_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let (spool, _) = open(dir.path(), options(1 << 20, 1 << 16));
    let seq = stored(
        spool
            .append_held(&batch(0, 10), Overflow::Block, &never())
            .unwrap(),
    );
    let held = stored(
        spool
            .append_held(&batch(1, 10), Overflow::Block, &never())
            .unwrap(),
    );
    assert!(
        spool.first_pending().unwrap().is_none(),
        "durable but held: not offered"
    );
    spool.release(seq);
    assert_eq!(spool.first_pending().unwrap().unwrap(), (seq, batch(0, 10)));
    spool.ack(seq).unwrap();
    assert!(
        spool.first_pending().unwrap().is_none(),
        "the second is still held"
    );
    drop(spool);
    // A process that died before releasing: the entry is pending after a restart.
    let (spool, recovery) = open(dir.path(), options(1 << 20, 1 << 16));
    assert_eq!(recovery.pending_batches, 1);
    assert_eq!(
        spool.first_pending().unwrap().unwrap(),
        (held, batch(1, 10))
    );
}

fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir.join("s"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "spool"))
        .collect();
    files.sort();
    files
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Power lost in the middle of an append: every batch written before it is recovered, the
    /// torn one is cut off, and the spool keeps working.
    #[test]
    fn torn_tail_is_truncated(sizes in prop::collection::vec(1usize..400, 1..12), cut in 1usize..10_000) {
        let dir = tempfile::tempdir().unwrap();
        let opts = options(1 << 20, 1024);
        let (spool, _) = open(dir.path(), opts.clone());
        for (i, &len) in sizes.iter().enumerate() {
            stored(spool.append(&batch(i as u32, len), Overflow::Block, &never()).unwrap());
        }
        drop(spool);
        let last = segment_files(dir.path()).pop().unwrap();
        let bytes = fs::read(&last).unwrap();
        let last_len = HEADER + META + sizes[sizes.len() - 1];
        // Cut somewhere inside the last entry: at least its first byte stays and its last byte
        // goes (a cut at its very start would be a clean end, with nothing torn).
        let keep = bytes.len() - 1 - (cut % (last_len - 1));
        fs::write(&last, &bytes[..keep]).unwrap();
        let (spool, recovery) = open(dir.path(), opts);
        prop_assert!(recovery.torn_bytes > 0);
        prop_assert_eq!(recovery.quarantined_regions, 0);
        let expected: Vec<Batch> = (0..sizes.len() - 1).map(|i| batch(i as u32, sizes[i])).collect();
        let next = stored(spool.append(&batch(99, 5), Overflow::Block, &never()).unwrap());
        prop_assert_eq!(next, sizes.len() as u64 - 1);
        let mut got = drain(&spool);
        prop_assert_eq!(got.pop(), Some(batch(99, 5)));
        prop_assert_eq!(got, expected);
    }

    /// A flipped bit anywhere: at most the batch it hit is lost (quarantined or cut as a torn
    /// tail), every other batch comes back intact, and the agent keeps going.
    #[test]
    fn bit_flips_lose_at_most_the_batch_they_hit(
        sizes in prop::collection::vec(1usize..300, 1..10),
        segment in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let opts = options(1 << 20, 700);
        let (spool, _) = open(dir.path(), opts.clone());
        for (i, &len) in sizes.iter().enumerate() {
            stored(spool.append(&batch(i as u32, len), Overflow::Block, &never()).unwrap());
        }
        drop(spool);
        let files = segment_files(dir.path());
        let file = segment.get(&files);
        let mut bytes = fs::read(file).unwrap();
        let pos = at.index(bytes.len());
        bytes[pos] ^= 1 << bit;
        fs::write(file, &bytes).unwrap();
        let (spool, recovery) = open(dir.path(), opts);
        let got = drain(&spool);
        let all: Vec<Batch> = sizes.iter().enumerate().map(|(i, &len)| batch(i as u32, len)).collect();
        prop_assert!(got.len() + 1 >= all.len(), "lost more than one batch: {} of {}", got.len(), all.len());
        for b in &got {
            prop_assert!(all.contains(b), "a damaged batch came back");
        }
        if got.len() < all.len() {
            prop_assert!(recovery.quarantined_regions + u64::from(recovery.torn_bytes > 0) >= 1);
        }
        stored(spool.append(&batch(99, 5), Overflow::Block, &never()).unwrap());
    }
}

/// Bytes of a spooled entry holding `batch(_, body)`.
fn entry_len(body: usize) -> u64 {
    (HEADER + META + body) as u64
}

/// The lengths of the quarantined regions of stream `s` in `dir`.
fn quarantined(dir: &Path) -> Vec<u64> {
    fs::read_dir(dir.join("s").join(QUARANTINE_DIR))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .collect()
}

#[test]
fn an_acknowledgement_inside_a_segment_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    // Two entries fill a segment exactly.
    let opts = options(1 << 20, 2 * entry_len(100));
    let (spool, _) = open(dir.path(), opts.clone());
    append_all(&spool, 0..5, 100);
    assert_eq!(segment_files(dir.path()).len(), 3, "[0, 1] [2, 3] [4]");
    // Entry 2 is acknowledged, 3 in its segment is not: the segment stays, 2 must not come back.
    spool.ack(2).unwrap();
    assert_eq!(segment_files(dir.path()).len(), 2);
    drop(spool);
    let (spool, recovery) = open(dir.path(), opts.clone());
    assert_eq!(
        (recovery.pending_batches, recovery.pending_records),
        (2, 4 + 5)
    );
    assert_eq!(drain(&spool), vec![batch(3, 100), batch(4, 100)]);
    drop(spool);
    // An unreadable acknowledgement file neither stops the spool nor loses what it holds (at
    // worst it re-sends acknowledged entries of a kept segment, which the receiver drops by
    // batch id).
    let (spool, _) = open(dir.path(), opts.clone());
    stored(
        spool
            .append(&batch(7, 100), Overflow::Block, &never())
            .unwrap(),
    );
    drop(spool);
    fs::write(dir.path().join("s").join(ACKED_FILE), "garbage").unwrap();
    let (spool, recovery) = open(dir.path(), opts.clone());
    assert_eq!(recovery.pending_batches, 1);
    assert_eq!(drain(&spool), vec![batch(7, 100)]);
    drop(spool);
    // Nor does one that is not even text (found by the `spool_segment` fuzz target: it stopped
    // the agent's start).
    let (spool, _) = open(dir.path(), opts.clone());
    let seq = stored(
        spool
            .append(&batch(8, 100), Overflow::Block, &never())
            .unwrap(),
    );
    drop(spool);
    fs::write(dir.path().join("s").join(ACKED_FILE), b"\xff\xfe0\x00").unwrap();
    let (spool, recovery) = open(dir.path(), opts);
    assert_eq!(recovery.pending_batches, 1);
    assert_eq!(drain(&spool), vec![batch(8, 100)]);
    assert!(seq > 0);
}

/// Sequence numbers past [`MAX_SEQ`], in an entry whose checksum holds or in `acked`, are damage
/// (found by the `spool_segment` fuzz target: the next append's `seq + 1` overflowed).
#[test]
fn sequence_numbers_at_the_end_of_the_range_are_damage() {
    let dir = tempfile::tempdir().unwrap();
    let sdir = dir.path().join("s");
    fs::create_dir_all(&sdir).unwrap();
    let mut segment = encode_entry(u64::MAX, &batch(1, 10));
    segment.extend_from_slice(&encode_entry(0, &batch(2, 10)));
    fs::write(sdir.join("seg-0.spool"), &segment).unwrap();
    let (spool, recovery) = open(dir.path(), options(1 << 20, 1 << 20));
    assert_eq!(recovery.quarantined_regions, 1);
    assert_eq!(recovery.pending_batches, 1);
    assert_eq!(
        stored(
            spool
                .append(&batch(3, 10), Overflow::Block, &never())
                .unwrap()
        ),
        1
    );
    assert_eq!(drain(&spool), vec![batch(2, 10), batch(3, 10)]);
    drop(spool);

    fs::write(sdir.join(ACKED_FILE), format!("{:020}", u64::MAX)).unwrap();
    let (spool, recovery) = open(dir.path(), options(1 << 20, 1 << 20));
    assert_eq!(recovery.pending_batches, 0);
    let seq = stored(
        spool
            .append(&batch(4, 10), Overflow::Block, &never())
            .unwrap(),
    );
    assert!(seq < MAX_SEQ);
    assert_eq!(drain(&spool), vec![batch(4, 10)]);
    drop(spool);

    // An unreadable `acked` longer than the 20 digits written over it: what follows them must
    // not read as part of the number once they are (found by the fuzz target too: the tail
    // "1111" after 20 zeros read as 1111, and the pending entry 0 was lost).
    let (spool, _) = open(dir.path(), options(1 << 20, 1 << 20));
    let seq = stored(
        spool
            .append(&batch(5, 10), Overflow::Block, &never())
            .unwrap(),
    );
    drop(spool);
    fs::write(
        sdir.join(ACKED_FILE),
        format!("{}{}", "x".repeat(20), seq + 1000),
    )
    .unwrap();
    for _ in 0..2 {
        let (spool, recovery) = open(dir.path(), options(1 << 20, 1 << 20));
        assert_eq!(recovery.pending_batches, 1);
        assert_eq!(spool.pending_batches().unwrap(), vec![batch(5, 10)]);
    }
}

#[test]
fn damage_before_the_end_is_quarantined_not_cut_as_a_torn_tail() {
    // A flipped byte in the body of `entry` (0-based) of four entries, two per segment: a torn
    // write only ever hits the end of the last segment, so this is damage to set aside, whether
    // the entry ends a segment (1) or the whole spool (3, its length still in bounds).
    for entry in [1u64, 3] {
        let dir = tempfile::tempdir().unwrap();
        let opts = options(1 << 20, 2 * entry_len(100));
        let (spool, _) = open(dir.path(), opts.clone());
        append_all(&spool, 0..4, 100);
        drop(spool);
        let file = &segment_files(dir.path())[(entry / 2) as usize];
        let mut bytes = fs::read(file).unwrap();
        let at = (entry % 2 * entry_len(100)) as usize + HEADER + META + 10;
        bytes[at] ^= 0x40;
        fs::write(file, &bytes).unwrap();
        let (spool, recovery) = open(dir.path(), opts);
        assert_eq!(recovery.torn_bytes, 0, "entry {entry}");
        assert_eq!(recovery.quarantined_regions, 1, "entry {entry}");
        assert_eq!(recovery.quarantined_bytes, entry_len(100));
        assert_eq!(quarantined(dir.path()), [entry_len(100)]);
        let expected: Vec<Batch> = (0..4)
            .filter(|&i| u64::from(i) != entry)
            .map(|i| batch(i, 100))
            .collect();
        assert_eq!(drain(&spool), expected, "entry {entry}");
    }
}

/// The copy of a damaged region is best effort: where `quarantine/` cannot be written (here a
/// file stands in its place; a full disk alike), the region is still counted and skipped, and
/// the spool opens and delivers the rest. Before, the spool failed to open.
#[test]
fn an_unwritable_quarantine_does_not_stop_the_spool() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(1 << 20, 2 * entry_len(100));
    let (spool, _) = open(dir.path(), opts.clone());
    append_all(&spool, 0..4, 100);
    drop(spool);
    let file = &segment_files(dir.path())[0];
    let mut bytes = fs::read(file).unwrap();
    bytes[HEADER + META + 10] ^= 0x40;
    fs::write(file, &bytes).unwrap();
    fs::write(dir.path().join("s").join(QUARANTINE_DIR), b"").unwrap();
    let (spool, recovery) = open(dir.path(), opts);
    assert_eq!(recovery.quarantined_regions, 1);
    assert_eq!(
        drain(&spool),
        (1..4).map(|i| batch(i, 100)).collect::<Vec<_>>()
    );
}

/// `quarantine/` keeps copies up to its limit and then no more.
#[test]
fn quarantine_copies_stop_at_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let segment = dir.path().join("00000001.seg");
    let keep = |offset, len| keep_quarantined(dir.path(), &segment, offset, &vec![7; len], 1_000);
    assert!(keep(0, 600).unwrap().is_some());
    assert!(keep(600, 400).unwrap().is_some(), "exactly at the limit");
    assert!(keep(1_000, 1).unwrap().is_none());
    assert_eq!(
        crate::rejected::dir_bytes(&dir.path().join(QUARANTINE_DIR)).unwrap(),
        1_000
    );
}

#[test]
fn the_limit_is_exact_and_drop_oldest_takes_a_partly_acknowledged_segment() {
    let dir = tempfile::tempdir().unwrap();
    // Room for exactly four entries, two per segment.
    let opts = options(4 * entry_len(100), 2 * entry_len(100));
    let (spool, _) = open(dir.path(), opts);
    append_all(&spool, 0..4, 100);
    assert_eq!(
        spool
            .append(&batch(4, 100), Overflow::DropNewest, &never())
            .unwrap(),
        Appended::Dropped,
        "full"
    );
    // The oldest segment holds 0 (acknowledged) and 1: dropping it frees both entries' room.
    spool.ack(0).unwrap();
    stored(
        spool
            .append(&batch(5, 100), Overflow::DropOldest, &never())
            .unwrap(),
    );
    assert_eq!(spool.pending(), (3, 3 + 4 + 6));
    assert_eq!(segment_files(dir.path()).len(), 2);
    assert_eq!(
        drain(&spool),
        vec![batch(2, 100), batch(3, 100), batch(5, 100)]
    );
    // A batch as large as the whole spool fits an empty one.
    let whole = (4 * entry_len(100)) as usize - HEADER - META;
    stored(
        spool
            .append(&batch(6, whole), Overflow::Block, &never())
            .unwrap(),
    );
}

/// `peek` sees the batches not yet acknowledged across segments, stops at a partial entry (an
/// append in progress) and changes nothing on disk.
#[test]
fn peek_reads_what_waits_without_changing_the_spool() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(peek(dir.path(), "s").unwrap(), Peek::default());
    let (spool, _) = open(dir.path(), options(1 << 20, 4096));
    append_all(&spool, 0..6, 1000);
    let (seq, _) = spool.first_pending().unwrap().unwrap();
    spool.ack(seq).unwrap();
    spool.ack(seq + 1).unwrap();
    let segments = segment_files(dir.path());
    assert!(segments.len() > 1, "{segments:?}");
    let last = segments.last().unwrap();
    let mut partial = encode_entry(99, &batch(99, 500));
    partial.truncate(300);
    OpenOptions::new()
        .append(true)
        .open(last)
        .unwrap()
        .write_all(&partial)
        .unwrap();
    let sizes = |segments: &[PathBuf]| -> Vec<u64> {
        segments
            .iter()
            .map(|p| fs::metadata(p).unwrap().len())
            .collect()
    };
    let before = sizes(&segments);
    let seen = peek(dir.path(), "s").unwrap();
    assert_eq!(sizes(&segments), before, "peek changed a segment");
    assert_eq!(seen.batches, 4);
    assert_eq!(
        seen.records,
        (3..=6).sum::<u64>(),
        "records of batches 2 to 5"
    );
    assert_eq!(seen.body_bytes, 4 * 1000);
    assert_eq!(seen.oldest_created_ms, Some(batch(2, 0).created_ms));
    assert_eq!(seen.unread_bytes, 300);
    assert_eq!(seen.disk_bytes, before.iter().sum::<u64>());
}
