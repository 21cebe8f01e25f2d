//! The Kafka output: batches produced straight to the stream topics, in the gateway's wire
//! format (cargo feature `kafka`).

use rdkafka::producer::Producer;
use schemas::api::RejectedRecord;
use schemas::wire::topic_name;
use service_kit::kafka::{DeadLetter, DeliveryGroup, GroupProducer, Messages};

use super::*;
use crate::config::KafkaTarget;

/// Produces batches to Kafka as the gateway would.
pub struct KafkaOutput {
    /// Shared with the blocking pool's metadata requests.
    producer: Arc<GroupProducer>,
    topic_prefix: String,
    /// The producer's `message.max.bytes`.
    max_message_bytes: usize,
    /// `kafka.dead_letter_topic`.
    dead_letter_topic: String,
}

impl KafkaOutput {
    pub fn new(target: &KafkaTarget) -> Result<KafkaOutput, SendError> {
        let mut config = service_kit::kafka::producer_config(&target.brokers, 30_000);
        service_kit::kafka::security::apply(&mut config, target.tls.as_ref(), target.sasl.as_ref())
            .map_err(|e| SendError::Config(format!("{e:#}")))?;
        for (k, v) in &target.properties {
            config.set(k, v);
        }
        Ok(KafkaOutput {
            producer: Arc::new(
                service_kit::kafka::group_producer(&config)
                    .map_err(|e| SendError::Config(e.to_string()))?,
            ),
            topic_prefix: target.topic_prefix.clone(),
            max_message_bytes: service_kit::kafka::max_message_bytes(&config),
            dead_letter_topic: target.dead_letter_topic.clone(),
        })
    }

    /// The batch's records as Kafka messages: decompress, decode, validate and encode, on the
    /// blocking pool. A record whose message would pass the producer's `message.max.bytes` is
    /// left out and returned as rejected, with its dead letter, as the gateway rejects it:
    /// librdkafka refuses it at once, and retrying the batch would hold the stream up for ever.
    pub(super) async fn prepare(
        &self,
        def: Arc<StreamDef>,
        batch: Batch,
    ) -> Result<(Messages, Vec<(RejectedRecord, DeadLetter)>), SendError> {
        let max = self.max_message_bytes;
        // What the HTTP output sends as the Idempotency-Key.
        let batch_id = batch.id.to_string();
        let prepared = tokio::task::spawn_blocking(move || {
            batch.records(&def).map(|records| {
                let mut messages = Messages::new(&def, records.len(), batch.raw_bytes as usize);
                let mut too_large = Vec::new();
                for (index, r) in records.iter().enumerate() {
                    messages.push(&def, r);
                    let size = messages.last_message_bytes();
                    if size > max {
                        let reason = service_kit::kafka::too_large_reason(size, max);
                        let value = messages.iter().last().map_or(&[][..], |(_, v)| v);
                        let dead =
                            DeadLetter::new(index, "too_large", &reason, value).in_batch(&batch_id);
                        messages.pop();
                        too_large.push((RejectedRecord { index, reason }, dead));
                    }
                }
                (messages, too_large)
            })
        })
        .await
        .map_err(|e| SendError::Config(format!("batch decoding failed: {e}")))?;
        prepared.map_err(|e| SendError::Rejected {
            status: 0,
            body: e.to_string(),
        })
    }

    /// Produces the dead letters of a delivered batch's records that were too large, once: a
    /// failure (the topic missing, the broker gone) is logged and counted
    /// (`edge_agent_dead_letters_lost_total`), and the batch is not held up for them. A missing
    /// topic is found by asking for its metadata first: librdkafka only gives up on a message
    /// to a missing topic after `topic.metadata.propagation.max.ms` (30 s), which held the
    /// batch and its stream up that long.
    pub(super) async fn keep_dead_letters(
        &self,
        stream: &str,
        batch: &Batch,
        too_large: &[(RejectedRecord, DeadLetter)],
    ) {
        if too_large.is_empty() {
            return;
        }
        if self.dead_letter_topic_missing().await {
            self.dead_letters_lost(stream, batch, too_large.len(), "the topic does not exist");
            return;
        }
        let ingest_ts = service_kit::kafka::ingest_ts_now();
        let mut group = DeliveryGroup::new();
        let sent = too_large.iter().try_for_each(|(_, dead)| {
            let topic = &self.dead_letter_topic;
            dead.send(&self.producer, &mut group, topic, stream, &ingest_ts)
        });
        let settled = group.settled().await;
        match sent.and(settled) {
            Ok(_) => {
                tracing::warn!(stream, batch = %batch.id, records = too_large.len(), topic = %self.dead_letter_topic, "records too large for a Kafka message went to the dead-letter topic")
            }
            Err(e) => self.dead_letters_lost(stream, batch, too_large.len(), &e.to_string()),
        }
    }

    /// Whether the cluster says the dead-letter topic does not exist; false when it exists or
    /// the metadata request failed (producing then tells).
    async fn dead_letter_topic_missing(&self) -> bool {
        let producer = self.producer.clone();
        let topic = self.dead_letter_topic.clone();
        let exists =
            tokio::task::spawn_blocking(move || {
                let metadata = producer
                    .client()
                    .fetch_metadata(Some(&topic), Duration::from_secs(5))
                    .ok()?;
                Some(metadata.topics().iter().any(|t| {
                    t.name() == topic && t.error().is_none() && !t.partitions().is_empty()
                }))
            })
            .await
            .ok()
            .flatten();
        exists == Some(false)
    }

    fn dead_letters_lost(&self, stream: &str, batch: &Batch, records: usize, error: &str) {
        metrics::counter!(m::DEAD_LETTERS_LOST, "stream" => stream.to_owned())
            .increment(records as u64);
        tracing::error!(stream, batch = %batch.id, records, topic = %self.dead_letter_topic, error, "records too large for a Kafka message could not go to the dead-letter topic: they are left out");
    }

    pub(super) async fn attempt(
        &self,
        stream: &str,
        messages: &Messages,
    ) -> Result<IngestResponse, Attempt> {
        let topic = topic_name(&self.topic_prefix, stream);
        let ingest_ts = service_kit::kafka::ingest_ts_now();
        let mut group = DeliveryGroup::new();
        let sent = messages.send(&self.producer, &mut group, &topic, &ingest_ts);
        // What was handed over is awaited even when the rest was refused.
        let settled = group.settled().await;
        match sent.and(settled) {
            Err(e) if service_kit::kafka::refused_as_too_large(&e) => {
                // The broker's (or topic's) limit is below the producer's: a retry would never
                // do better. The batch is kept aside until the limits are fixed.
                return Err(Attempt::Final(SendError::Rejected {
                    status: 0,
                    body: format!(
                        "{e}: the broker's or the topic's message.max.bytes is below the producer's ({})",
                        self.max_message_bytes
                    ),
                }));
            }
            Err(e) => return Err(retry("kafka", e.to_string())),
            Ok(_) => {}
        }
        Ok(IngestResponse {
            accepted: messages.len(),
            ..IngestResponse::default()
        })
    }
}
