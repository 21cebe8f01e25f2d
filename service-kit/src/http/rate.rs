//! A token bucket of one second's worth of bytes: the agent's bandwidth caps and the gateway's
//! per-token rate limits.
//!
//! One transfer may take the bucket below zero (a batch is often larger than a second's budget
//! on a slow link); the next one then waits until the debt is paid. So the long-run rate is the
//! configured one, and no single transfer is refused for its size.

use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Bucket {
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    /// A full bucket for `bytes_per_sec` (more than 0).
    pub fn new(bytes_per_sec: u64) -> Bucket {
        Bucket {
            rate: bytes_per_sec as f64,
            tokens: bytes_per_sec as f64,
            last: Instant::now(),
        }
    }

    fn refill(&mut self) {
        let now = Instant::now();
        self.tokens = (self.tokens + self.rate * (now - self.last).as_secs_f64()).min(self.rate);
        self.last = now;
    }

    /// Time until the bucket is out of debt (zero when it is not in debt).
    pub fn debt_wait(&mut self) -> Duration {
        self.refill();
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }

    /// Takes `bytes`, into debt if need be.
    pub fn take(&mut self, bytes: u64) {
        self.tokens -= bytes as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_transfer_overdraws_and_the_next_waits_for_the_debt() {
        let mut b = Bucket::new(1_000);
        assert_eq!(b.debt_wait(), Duration::ZERO);
        b.take(5_000);
        let wait = b.debt_wait();
        // 4,000 bytes of debt at 1,000 a second (less the microseconds since the take).
        assert!(
            wait > Duration::from_millis(3_900) && wait <= Duration::from_secs(4),
            "{wait:?}"
        );
    }

    #[test]
    fn an_idle_bucket_holds_at_most_one_second() {
        let mut b = Bucket::new(1_000);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(b.debt_wait(), Duration::ZERO);
        // A full bucket holds 1,000 bytes however long it stood, not the 1,200 of its 1.2 s;
        // 100 bytes of debt take 100 ms to pay (less what a slow machine spends in between).
        b.take(1_100);
        let wait = b.debt_wait();
        assert!(wait > Duration::from_millis(50), "{wait:?}");
        // Time pays the debt.
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(b.debt_wait(), Duration::ZERO);
    }
}
