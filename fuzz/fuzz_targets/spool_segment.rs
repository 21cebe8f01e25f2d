//! Hostile spool directories through the agent's spool recovery (`edge_agent::spool::Spool::open`):
//! segments made of entries with valid checksums (any sequence numbers, sizes and encodings, so
//! that the fuzzer reaches past the checksum), garbage, torn tails and bit flips, and any
//! `acked` file.
//!
//! What must hold for every input:
//! - recovery opens the spool (damage is truncated or quarantined, never an error) and counts
//!   what it found consistently: the pending batches it reports are the ones it serves;
//! - a second recovery of what the first left finds no torn tail and the same pending batches;
//! - a batch appended after recovery gets a sequence number past every recovered one and is
//!   served after them, and delivering acknowledges everything.
#![no_main]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use edge_agent::batch::{Batch, BatchId, BodyEncoding};
use edge_agent::spool::{Appended, FsyncPolicy, Overflow, Spool, SpoolOptions, Usage};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

#[path = "scratch.rs"]
mod scratch;
use scratch::scratch;

const MAGIC: &[u8; 4] = b"EAS1";

#[derive(Arbitrary, Debug)]
struct Input {
    acked: Acked,
    segments: Vec<Segment>,
}

#[derive(Arbitrary, Debug)]
enum Acked {
    Absent,
    Number(u64),
    Text(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Segment {
    first_seq: u64,
    pieces: Vec<Piece>,
}

#[derive(Arbitrary, Debug)]
enum Piece {
    /// An entry as the spool writes it: `MAGIC | payload length | CRC-32 | payload`.
    Entry {
        seq: u64,
        created_ms: u64,
        records: u32,
        raw_bytes: u32,
        encoding: u8,
        id: u8,
        body: Vec<u8>,
    },
    Garbage(Vec<u8>),
    /// Cuts this many bytes off what the segment holds so far.
    Torn(u16),
    /// Flips one bit of what the segment holds so far.
    Flip(u32),
}

fn encode(piece: &Piece, out: &mut Vec<u8>) {
    match *piece {
        Piece::Entry {
            seq,
            created_ms,
            records,
            raw_bytes,
            encoding,
            id,
            ref body,
        } => {
            let mut payload = Vec::new();
            payload.extend_from_slice(&seq.to_le_bytes());
            payload.extend_from_slice(&created_ms.to_le_bytes());
            payload.extend_from_slice(&records.to_le_bytes());
            payload.extend_from_slice(&raw_bytes.to_le_bytes());
            payload.push(encoding % 3);
            payload.extend_from_slice(&[id; 32]);
            payload.extend_from_slice(body);
            out.extend_from_slice(MAGIC);
            out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
            out.extend_from_slice(&payload);
        }
        Piece::Garbage(ref bytes) => out.extend_from_slice(bytes),
        Piece::Torn(cut) => out.truncate(out.len().saturating_sub(usize::from(cut))),
        Piece::Flip(bit) => {
            if !out.is_empty() {
                let bit = bit as usize % (out.len() * 8);
                out[bit / 8] ^= 1 << (bit % 8);
            }
        }
    }
}

fn options() -> SpoolOptions {
    SpoolOptions {
        max_bytes: 1 << 30,
        segment_bytes: 1 << 20,
        fsync: FsyncPolicy::Batch,
        fsync_interval: Duration::from_millis(100),
    }
}

fn open(root: &Path) -> (Spool, edge_agent::spool::Recovery) {
    Spool::open(root, "s", options(), Arc::new(Usage::default()))
        .expect("recovery never fails on damage")
}

fuzz_target!(|input: Input| {
    if input.segments.len() > 4 {
        return;
    }
    let scratch = scratch();
    let dir = scratch.path().join("s");
    std::fs::create_dir_all(&dir).unwrap();
    match &input.acked {
        Acked::Absent => {}
        Acked::Number(n) => std::fs::write(dir.join("acked"), format!("{n:020}")).unwrap(),
        Acked::Text(text) => std::fs::write(dir.join("acked"), text).unwrap(),
    }
    for segment in &input.segments {
        let mut bytes = Vec::new();
        for piece in &segment.pieces {
            encode(piece, &mut bytes);
        }
        std::fs::write(dir.join(format!("seg-{}.spool", segment.first_seq)), bytes).unwrap();
    }

    let (spool, recovery) = open(scratch.path());
    assert_eq!(
        spool.pending(),
        (recovery.pending_batches, recovery.pending_records)
    );
    let pending = spool.pending_batches().unwrap();
    assert_eq!(pending.len() as u64, recovery.pending_batches);
    drop(spool);

    let (spool, again) = open(scratch.path());
    assert_eq!(again.torn_bytes, 0, "a torn tail survived recovery");
    assert!(again.quarantined_regions <= recovery.quarantined_regions);
    assert_eq!(again.pending_batches, recovery.pending_batches);
    assert_eq!(again.pending_records, recovery.pending_records);
    assert!(spool.pending_batches().unwrap() == pending);

    let batch = Batch {
        id: BatchId([0xee; 32]),
        encoding: BodyEncoding::Ndjson,
        body: b"after recovery".to_vec(),
        records: 1,
        raw_bytes: 14,
        created_ms: 1,
    };
    let appended = spool
        .append(&batch, Overflow::DropNewest, &AtomicBool::new(false))
        .unwrap();
    let Appended::Stored { seq: new_seq, .. } = appended else {
        panic!("the batch was dropped: {appended:?}");
    };
    let mut served = Vec::new();
    while let Some((seq, got)) = spool.first_pending().unwrap() {
        served.push((seq, got));
        spool.ack(seq).unwrap();
        assert!(
            served.len() <= pending.len() + 1,
            "served more than was pending"
        );
    }
    assert!(
        served.iter().all(|(seq, _)| *seq <= new_seq),
        "a recovered batch has a sequence number past the new one's"
    );
    let last = served.last().expect("the new batch is served");
    assert_eq!(last.0, new_seq);
    assert!(last.1 == batch);
    assert_eq!(spool.pending(), (0, 0));
    drop(spool);
    let (_, after) = open(scratch.path());
    assert_eq!(after.pending_batches, 0, "acknowledged batches came back");
});
