//! Hostile dedupe logs through the agent's digest log (`edge_agent::dedupe::DigestLog`): any
//! bytes as `<stream>.digests` (torn entries, any digests and times), a window of any small
//! capacity and age limit, then new digests written and compacted.
//!
//! What must hold for every input:
//! - opening never fails and cuts a torn last entry, leaving whole 20-byte entries;
//! - the window holds every entry of the log's last `capacity` that is not past the age limit,
//!   and no more than its capacity;
//! - digests written after opening are found again by the next open (the last `capacity` of
//!   them), through compaction, which keeps the file under twice the window.
#![no_main]

use edge_agent::dedupe::{DigestLog, DigestWindow};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

#[path = "scratch.rs"]
mod scratch;
use scratch::scratch;

const ENTRY: usize = 20;

#[derive(Arbitrary, Debug)]
struct Input {
    capacity: u8,
    max_age_secs: u8,
    now_secs: u32,
    log: Vec<u8>,
    pushes: Vec<u128>,
}

fn entries(bytes: &[u8]) -> Vec<(u128, u32)> {
    bytes
        .chunks_exact(ENTRY)
        .map(|e| {
            (
                u128::from_le_bytes(e[..16].try_into().unwrap()),
                u32::from_le_bytes(e[16..].try_into().unwrap()),
            )
        })
        .collect()
}

/// Checks that `window` holds the unexpired entries among the last `capacity` of `log`.
fn check_loaded(window: &DigestWindow, log: &[(u128, u32)], now: u32) {
    let capacity = window.capacity();
    assert!(window.len() <= capacity);
    for &(d, t) in &log[log.len().saturating_sub(capacity)..] {
        if !window.expired(t, now) {
            assert!(window.contains(d, now), "entry {d:x} at {t} not loaded");
        }
    }
}

fuzz_target!(|input: Input| {
    let capacity = usize::from(input.capacity % 64);
    let max_age = u32::from(input.max_age_secs);
    let now = input.now_secs;
    let scratch = scratch();
    let path = scratch.path().join("s.digests");
    std::fs::write(&path, &input.log).unwrap();

    let mut window = DigestWindow::new(capacity, max_age);
    let mut log = DigestLog::open(&path, &mut window, now).expect("opening never fails");
    let on_disk = std::fs::read(&path).unwrap();
    let whole = input.log.len() / ENTRY * ENTRY;
    assert!(
        on_disk == input.log[..whole],
        "more than a torn entry was cut"
    );
    let mut expected = entries(&on_disk);
    check_loaded(&window, &expected, now);

    for &d in input.pushes.iter().take(200) {
        if window.insert(d, now) {
            log.push(d, now);
            expected.push((d, now));
        }
        log.flush().unwrap();
        let len = std::fs::metadata(&path).unwrap().len() as usize;
        assert_eq!(len % ENTRY, 0);
        if capacity > 0 {
            assert!(len < 2 * capacity * ENTRY, "not compacted: {len} bytes");
        }
    }
    drop(log);
    let mut again = DigestWindow::new(capacity, max_age);
    let _log = DigestLog::open(&path, &mut again, now).unwrap();
    check_loaded(&again, &expected, now);
});
