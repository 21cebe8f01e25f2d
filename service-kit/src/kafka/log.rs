//! librdkafka's errors and log lines, each kind logged at most once a minute. A broker that is
//! down makes librdkafka report every failed connect (once a second with the producers'
//! reconnect backoff) through both callbacks, with each failed produce on top: 78 lines in 8 s,
//! so an edge box offline for a day would log some 840,000. The first report of a kind is
//! logged as librdkafka gives it; the next ones within [`CLIENT_LOG_EVERY`] are only counted,
//! and the first one after it says how many were left out.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;

/// How often one kind of librdkafka report is logged.
pub const CLIENT_LOG_EVERY: Duration = Duration::from_secs(60);

/// Kinds remembered at most; past this the memory starts over (a report then logs again).
const MAX_KINDS: usize = 1024;

/// The reports of one librdkafka client: each kind (an error code, or a log facility, with the
/// broker it names) with the time it was last logged and the reports left out since.
#[derive(Default)]
pub struct ClientLog {
    kinds: Mutex<HashMap<String, (Instant, u64)>>,
}

impl ClientLog {
    /// For `ClientContext::error`.
    pub fn error(&self, error: KafkaError, reason: &str) {
        let kind = match error.rdkafka_error_code() {
            Some(code) => format!("{code:?} {}", subject(reason)),
            None => format!("{error}"),
        };
        if let Some(left_out) = self.due(kind, Instant::now()) {
            let note = left_out_note(left_out);
            tracing::error!(target: "librdkafka", "librdkafka: {error}: {reason}{note}");
        }
    }

    /// For `ClientContext::log`: warnings and errors are throttled, the rest (which librdkafka
    /// gives only with its `debug` property set) passes as it comes.
    pub fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        // The note on the count left out, or nothing when this one is left out too.
        let due = || {
            self.due(format!("{facility} {}", subject(message)), Instant::now())
                .map(left_out_note)
        };
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                if let Some(note) = due() {
                    tracing::error!(target: "librdkafka", "librdkafka: {facility} {message}{note}")
                }
            }
            RDKafkaLogLevel::Warning => {
                if let Some(note) = due() {
                    tracing::warn!(target: "librdkafka", "librdkafka: {facility} {message}{note}")
                }
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", "librdkafka: {facility} {message}")
            }
            RDKafkaLogLevel::Debug => {
                tracing::debug!(target: "librdkafka", "librdkafka: {facility} {message}")
            }
        }
    }

    /// Whether a report of `kind` is logged at `now`, and if so how many were left out before
    /// it.
    fn due(&self, kind: String, now: Instant) -> Option<u64> {
        let mut kinds = self.kinds.lock().unwrap_or_else(|p| p.into_inner());
        if kinds.len() >= MAX_KINDS && !kinds.contains_key(&kind) {
            kinds.clear();
        }
        match kinds.get_mut(&kind) {
            Some((last, left_out)) if now.duration_since(*last) < CLIENT_LOG_EVERY => {
                *left_out += 1;
                None
            }
            Some((last, left_out)) => {
                *last = now;
                Some(std::mem::take(left_out))
            }
            None => {
                kinds.insert(kind, (now, 0));
                Some(0)
            }
        }
    }
}

/// What a librdkafka report is about: the text before its first ": " (a broker,
/// `host:port/id`), so that one broker's reports do not hide another's.
fn subject(text: &str) -> &str {
    text.split_once(": ").map_or("", |(subject, _)| subject)
}

/// What a report logged after others of its kind were left out says about them.
fn left_out_note(left_out: u64) -> String {
    if left_out == 0 {
        String::new()
    } else {
        format!(" ({left_out} more like it not logged since the last one)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reports of one kind are logged once per interval, the next one with the count left out;
    /// other brokers and other codes are kinds of their own.
    #[test]
    fn each_kind_is_logged_once_per_interval_with_the_count_left_out() {
        let log = ClientLog::default();
        let t0 = Instant::now();
        let down = "10.0.0.1:9092/1: Connect to ipv4#10.0.0.1:9092 failed: Connection refused";
        let kind = |broker: &str| format!("FAIL {}", subject(broker));
        assert_eq!(log.due(kind(down), t0), Some(0));
        for s in 1..60 {
            assert_eq!(log.due(kind(down), t0 + Duration::from_secs(s)), None);
        }
        let other = "10.0.0.2:9092/2: Connect to ipv4#10.0.0.2:9092 failed: Connection refused";
        assert_eq!(log.due(kind(other), t0 + Duration::from_secs(30)), Some(0));
        assert_eq!(log.due("AllBrokersDown".into(), t0), Some(0));
        assert_eq!(subject("1/1 brokers are down"), "");
        assert_eq!(log.due(kind(down), t0 + CLIENT_LOG_EVERY), Some(59));
        assert_eq!(log.due(kind(down), t0 + CLIENT_LOG_EVERY * 2), Some(0));
    }

    /// Past [`MAX_KINDS`] the memory starts over instead of growing.
    #[test]
    fn the_kinds_remembered_are_bounded() {
        let log = ClientLog::default();
        let t0 = Instant::now();
        for i in 0..MAX_KINDS * 3 {
            assert_eq!(log.due(format!("kind {i}"), t0), Some(0));
        }
        assert!(log.kinds.lock().unwrap().len() <= MAX_KINDS);
    }
}
