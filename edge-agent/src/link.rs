//! Bandwidth caps (global and per stream) and stream priority on the uplink.
//!
//! A cap is a token bucket of one second's worth of bytes (`service_kit::http::rate::Bucket`): a batch may
//! take it below zero, and the next sender then waits until the debt is paid. Under the global
//! cap, the waiting stream with the highest priority goes next (ties: the one that waited
//! longest).

use std::cmp::Reverse;
use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use service_kit::http::rate::Bucket;

/// A per-stream cap.
#[derive(Debug)]
pub struct StreamCap(Option<Mutex<Bucket>>);

impl StreamCap {
    pub fn new(bytes_per_sec: u64) -> StreamCap {
        StreamCap((bytes_per_sec > 0).then(|| Mutex::new(Bucket::new(bytes_per_sec))))
    }

    /// Waits until the stream may send `bytes`.
    pub async fn acquire(&self, bytes: u64) {
        let Some(bucket) = &self.0 else { return };
        loop {
            let wait = {
                let mut b = bucket.lock().unwrap_or_else(|e| e.into_inner());
                let wait = b.debt_wait();
                if wait.is_zero() {
                    b.take(bytes);
                    return;
                }
                wait
            };
            tokio::time::sleep(wait).await;
        }
    }
}

#[derive(Debug)]
struct Shared {
    bucket: Bucket,
    /// Streams waiting to send: highest priority first, then oldest ticket.
    waiting: BTreeSet<(Reverse<i32>, u64)>,
}

/// The global cap, shared by every stream.
#[derive(Debug)]
pub struct Link {
    shared: Option<Mutex<Shared>>,
    tickets: AtomicU64,
    turn: tokio::sync::Notify,
}

/// Removes a waiter that gave up (its future was dropped).
struct Waiter<'a> {
    link: &'a Link,
    key: (Reverse<i32>, u64),
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if let Some(shared) = &self.link.shared {
            shared
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .waiting
                .remove(&self.key);
        }
        self.link.turn.notify_waiters();
    }
}

impl Link {
    pub fn new(bytes_per_sec: u64) -> Link {
        Link {
            shared: (bytes_per_sec > 0).then(|| {
                Mutex::new(Shared {
                    bucket: Bucket::new(bytes_per_sec),
                    waiting: BTreeSet::new(),
                })
            }),
            tickets: AtomicU64::new(0),
            turn: tokio::sync::Notify::new(),
        }
    }

    /// Waits until a stream of `priority` may send `bytes` under the global cap.
    pub async fn acquire(&self, priority: i32, bytes: u64) {
        let Some(shared) = &self.shared else { return };
        let key = (
            Reverse(priority),
            self.tickets.fetch_add(1, Ordering::Relaxed),
        );
        shared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .waiting
            .insert(key);
        let _waiter = Waiter { link: self, key };
        loop {
            let turn = self.turn.notified();
            let wait = {
                let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
                if s.waiting.first() == Some(&key) {
                    let wait = s.bucket.debt_wait();
                    if wait.is_zero() {
                        s.bucket.take(bytes);
                        return;
                    }
                    Some(wait)
                } else {
                    None
                }
            };
            match wait {
                // First in line: wait for the debt, or for someone more urgent to arrive.
                Some(wait) => {
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = turn => {}
                    }
                }
                None => turn.await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn global_cap_paces_and_serves_the_higher_priority_first() {
        let link = Arc::new(Link::new(1000));
        // Spend the initial second of budget, going 1 s into debt.
        link.acquire(0, 2000).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, priority) in [("low", 0), ("high", 5)] {
            let (link, order) = (link.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                link.acquire(priority, 1000).await;
                order.lock().unwrap().push((name, Instant::now()));
            }));
            tokio::task::yield_now().await;
        }
        let start = Instant::now();
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap();
        assert_eq!(
            order[0].0, "high",
            "the later but higher-priority stream goes first"
        );
        assert_eq!(order[1].0, "low");
        let first = order[0].1 - start;
        let second = order[1].1 - start;
        assert!(
            first >= Duration::from_millis(990) && first <= Duration::from_millis(1100),
            "{first:?}"
        );
        assert!(
            second >= Duration::from_millis(1990) && second <= Duration::from_millis(2100),
            "{second:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn stream_cap_paces_its_stream() {
        let cap = StreamCap::new(500);
        let start = Instant::now();
        for _ in 0..4 {
            cap.acquire(500).await;
        }
        // 500 bytes of budget to start with; a send may go into debt, the next one waits it off.
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(1990) && took <= Duration::from_millis(2100),
            "{took:?}"
        );
        StreamCap::new(0).acquire(u64::MAX).await;
    }
}
