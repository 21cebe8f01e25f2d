//! Answers remembered by `Idempotency-Key`: a repeated key within the window gets the first
//! answer without producing again. Only successful answers are remembered, so a retry after a
//! failure produces for real. Each answer is remembered with its request's records (a
//! fingerprint of them): a key repeated with other records is refused, not answered with the
//! first request's answer, which would have told the client that records nobody produced were
//! accepted (a client whose keys repeat, e.g. a counter that starts over after a reboot).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use schemas::api::IngestResponse;

use crate::config::IdempotencyConfig;

/// What identifies a request's records: BLAKE3 over each record's content hash (the BLAKE3 of
/// the text of one that is not valid), in order. The same records compressed otherwise (the agent resends a
/// batch without the dictionary a gateway lacks) have the same fingerprint.
pub type Fingerprint = [u8; 32];

enum Slot {
    InFlight,
    Done {
        response: IngestResponse,
        at: Instant,
        fingerprint: Fingerprint,
    },
}

#[derive(Default)]
struct Inner {
    slots: HashMap<String, Slot>,
    /// Completed keys in completion order, for expiry and the entry cap.
    order: VecDeque<(Instant, String)>,
}

pub struct IdempotencyCache {
    window: Duration,
    max_entries: usize,
    inner: Mutex<Inner>,
}

/// What to do with a request that carries a key.
pub enum Begin<'a> {
    /// First time: go on, then `complete` the guard with the answer.
    Fresh(Guard<'a>),
    /// Seen before with the same records: answer this.
    Replay(IngestResponse),
    /// Seen before with other records: refuse the request.
    Reused,
    /// A request with this key is being served right now.
    InFlight,
}

/// Marks a key in flight; forgets it on drop unless completed.
pub struct Guard<'a> {
    cache: &'a IdempotencyCache,
    key: String,
    fingerprint: Fingerprint,
    completed: bool,
}

impl Guard<'_> {
    pub fn complete(mut self, response: &IngestResponse) {
        self.completed = true;
        let now = Instant::now();
        let mut inner = self.cache.lock();
        inner.slots.insert(
            self.key.clone(),
            Slot::Done {
                response: response.clone(),
                at: now,
                fingerprint: self.fingerprint,
            },
        );
        inner.order.push_back((now, std::mem::take(&mut self.key)));
        while inner.order.len() > self.cache.max_entries {
            self.cache.evict_front(&mut inner);
        }
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if !self.completed {
            self.cache.lock().slots.remove(&self.key);
        }
    }
}

impl IdempotencyCache {
    pub fn new(config: &IdempotencyConfig) -> IdempotencyCache {
        IdempotencyCache {
            window: Duration::from_secs(config.window_secs),
            max_entries: config.max_entries.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn evict_front(&self, inner: &mut Inner) {
        if let Some((at, key)) = inner.order.pop_front()
            && matches!(inner.slots.get(&key), Some(Slot::Done { at: a, .. }) if *a == at)
        {
            inner.slots.remove(&key);
        }
    }

    pub fn begin(&self, stream: &str, key: &str, fingerprint: Fingerprint) -> Begin<'_> {
        let full = format!("{stream}\0{key}");
        let now = Instant::now();
        let mut inner = self.lock();
        while inner
            .order
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > self.window)
        {
            self.evict_front(&mut inner);
        }
        match inner.slots.get(&full) {
            Some(Slot::InFlight) => Begin::InFlight,
            Some(Slot::Done {
                response,
                at,
                fingerprint: first,
            }) if now.duration_since(*at) <= self.window => {
                if *first == fingerprint {
                    Begin::Replay(response.clone())
                } else {
                    Begin::Reused
                }
            }
            _ => {
                inner.slots.insert(full.clone(), Slot::InFlight);
                Begin::Fresh(Guard {
                    cache: self,
                    key: full,
                    fingerprint,
                    completed: false,
                })
            }
        }
    }
}

/// Checks an `Idempotency-Key` value: 1 to 255 visible ASCII characters.
pub fn valid_key(key: &str) -> bool {
    (1..=255).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_graphic())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(window_secs: u64, max_entries: usize) -> IdempotencyCache {
        IdempotencyCache::new(&IdempotencyConfig {
            window_secs,
            max_entries,
        })
    }

    const F: Fingerprint = [1; 32];

    fn answer(n: usize) -> IngestResponse {
        IngestResponse {
            accepted: n,
            ..IngestResponse::default()
        }
    }

    #[test]
    fn replays_completed_and_forgets_failed() {
        let c = cache(60, 10);
        let Begin::Fresh(g) = c.begin("s", "k", F) else {
            panic!()
        };
        assert!(matches!(c.begin("s", "k", F), Begin::InFlight));
        assert!(
            matches!(c.begin("other", "k", F), Begin::Fresh(_)),
            "keys are per stream"
        );
        g.complete(&answer(3));
        assert!(matches!(c.begin("s", "k", F), Begin::Replay(r) if r.accepted == 3));
        let Begin::Fresh(g) = c.begin("s", "failed", F) else {
            panic!()
        };
        drop(g);
        assert!(matches!(c.begin("s", "failed", F), Begin::Fresh(_)));
    }

    /// A key repeated with other records is refused, not replayed; with the same records it
    /// is replayed, also after a refusal.
    #[test]
    fn a_key_reused_for_other_records_is_refused() {
        let c = cache(60, 10);
        let Begin::Fresh(g) = c.begin("s", "k", F) else {
            panic!()
        };
        g.complete(&answer(3));
        assert!(matches!(c.begin("s", "k", [2; 32]), Begin::Reused));
        assert!(matches!(c.begin("s", "k", F), Begin::Replay(r) if r.accepted == 3));
    }

    #[test]
    fn window_and_cap() {
        let c = cache(0, 10);
        let Begin::Fresh(g) = c.begin("s", "k", F) else {
            panic!()
        };
        g.complete(&answer(1));
        std::thread::sleep(Duration::from_millis(5));
        assert!(matches!(c.begin("s", "k", F), Begin::Fresh(_)), "expired");
        let c = cache(60, 2);
        for k in ["a", "b", "c"] {
            let Begin::Fresh(g) = c.begin("s", k, F) else {
                panic!()
            };
            g.complete(&answer(1));
        }
        assert!(
            matches!(c.begin("s", "b", F), Begin::Replay(_)),
            "two remembered"
        );
        assert!(
            matches!(c.begin("s", "a", F), Begin::Fresh(_)),
            "oldest evicted"
        );
        assert!(matches!(c.begin("s", "c", F), Begin::Replay(_)));
    }

    #[test]
    fn key_syntax() {
        assert!(valid_key(&"a".repeat(64)));
        assert!(!valid_key(""));
        assert!(!valid_key("has space"));
        assert!(!valid_key(&"a".repeat(256)));
        assert!(!valid_key("ключ"));
    }
}
