//! What `sink redrive` and `ingest-gateway redrive` share: dead letters checked again under
//! their stream's definition as it is now, and those that pass produced back to the stream's
//! topic in the gateway's wire format, waiting for Kafka's acknowledgement.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use schemas::{StreamDef, ValidRecord};
use serde::Serialize;

use crate::kafka::{DeliveryGroup, GroupProducer, Messages};

/// How long Kafka has to acknowledge what one call of [`produce`] hands over.
const PRODUCE_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest reason kept as a key of [`Tally::reasons`].
const REASON_CHARS: usize = 200;

/// Dead letters checked again, by outcome.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct Tally {
    /// Dead letters of the stream checked.
    pub records: u64,
    /// Those that pass now: produced and acknowledged (with a dry run, those that would be).
    pub redriven: u64,
    /// Those still invalid under the definition as it is now, and why (the reason's first 200
    /// characters, with a count).
    pub still_invalid: u64,
    pub reasons: BTreeMap<String, u64>,
}

impl Tally {
    /// Checks a dead letter's payload against `def`: the record if it passes now.
    pub fn check(&mut self, def: &StreamDef, payload: &[u8]) -> Option<ValidRecord> {
        self.records += 1;
        match schemas::check_bytes(def, payload) {
            Ok(valid) => {
                self.redriven += 1;
                Some(valid)
            }
            Err(e) => {
                self.still_invalid += 1;
                let reason: String = e.to_string().chars().take(REASON_CHARS).collect();
                *self.reasons.entry(reason).or_default() += 1;
                None
            }
        }
    }
}

/// Hands every message of `batches` (topic, messages) to librdkafka with the record headers
/// (`ingest-ts` now) and waits until Kafka acknowledged all of them ([`PRODUCE_TIMEOUT`]).
pub async fn produce<'a>(
    producer: &GroupProducer,
    batches: impl IntoIterator<Item = (&'a str, &'a Messages)>,
) -> anyhow::Result<()> {
    let mut group = DeliveryGroup::new();
    let ingest_ts = crate::kafka::ingest_ts_now();
    for (topic, messages) in batches {
        messages
            .send(producer, &mut group, topic, &ingest_ts)
            .with_context(|| format!("cannot produce to {topic}"))?;
    }
    settle(group).await
}

/// Waits until Kafka acknowledged every message of `group` ([`PRODUCE_TIMEOUT`]).
pub async fn settle(group: DeliveryGroup) -> anyhow::Result<()> {
    tokio::time::timeout(PRODUCE_TIMEOUT, group.settled())
        .await
        .context("Kafka did not acknowledge the records in time")?
        .context("Kafka refused records")?;
    Ok(())
}

/// The definition of `stream` that dead letters are checked against (`streams` were loaded
/// from `streams_dir`).
pub fn definition<'a>(
    streams: &'a schemas::Streams,
    stream: &str,
    streams_dir: &std::path::Path,
) -> anyhow::Result<&'a std::sync::Arc<StreamDef>> {
    schemas::validate_stream_name(stream)?;
    streams.get(stream).with_context(|| {
        format!(
            "no stream '{stream}' in {} (redrive checks records against its definition)",
            streams_dir.display()
        )
    })
}

/// An idempotent producer to `brokers` ([`crate::kafka::producer_config`]), with what
/// `configure` adds (TLS, SASL, extra properties).
pub fn producer(
    brokers: &str,
    configure: impl FnOnce(&mut rdkafka::ClientConfig) -> anyhow::Result<()>,
) -> anyhow::Result<GroupProducer> {
    let mut client = crate::kafka::producer_config(brokers, PRODUCE_TIMEOUT.as_millis() as u64);
    configure(&mut client)?;
    Ok(crate::kafka::group_producer(&client)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tally_counts_by_outcome_and_reason() {
        let def = schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone();
        let mut tally = Tally::default();
        let good = br#"{"device_id":"d","sensor":"s","ts":1767225600000,"value":1.5}"#;
        assert!(tally.check(&def, good).is_some());
        assert!(tally.check(&def, b"{oops").is_none());
        assert!(tally.check(&def, b"{oops").is_none());
        let long = format!(r#"{{"device_id":"{}","sensor":1}}"#, "x".repeat(500));
        assert!(tally.check(&def, long.as_bytes()).is_none());
        assert_eq!(
            (tally.records, tally.redriven, tally.still_invalid),
            (4, 1, 3)
        );
        assert_eq!(tally.reasons.values().sum::<u64>(), 3);
        assert!(tally.reasons.values().any(|&n| n == 2));
        assert!(
            tally
                .reasons
                .keys()
                .all(|r| r.chars().count() <= REASON_CHARS)
        );
    }
}
