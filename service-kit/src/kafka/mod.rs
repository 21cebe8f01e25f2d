//! The Kafka clients' shared parts: the producer side of the wire format (the rest of it is
//! `schemas::wire`), shared by the gateway and the agent's Kafka output; librdkafka's reports
//! (`log`); TLS and SASL (`security`); and the redrive of dead letters (`redrive`).

pub mod log;
pub mod redrive;
pub mod security;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{DeliveryResult, Header, OwnedHeaders, ToBytes};
use rdkafka::producer::{BaseRecord, ProducerContext, ThreadedProducer};
use rdkafka::{ClientConfig, ClientContext};
use schemas::wire::{
    DLQ_HEADER_BATCH, DLQ_HEADER_CODE, DLQ_HEADER_INDEX, DLQ_HEADER_REASON, DLQ_HEADER_STREAM,
    DLQ_HEADER_TRUNCATED, HEADER_CONTENT_HASH, HEADER_INGEST_TS, HEADER_SCHEMA_VERSION,
    encode_value_into,
};
use schemas::{ContentHash, Forward, Str, StreamDef, ValidRecord};
use tokio::sync::Notify;

use crate::kafka::log::ClientLog;

/// An idempotent producer: acks=all, zstd, a short linger, `message_timeout_ms` to give up.
pub fn producer_config(brokers: &str, message_timeout_ms: u64) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("compression.type", "zstd")
        .set("linger.ms", "5")
        // Callers bound what they queue by bytes (the gateway's in-flight budget, the agent's
        // one batch per stream); librdkafka's default cap of 100,000 messages would refuse a
        // burst of small records long before that.
        .set("queue.buffering.max.messages", "10000000")
        .set("message.timeout.ms", message_timeout_ms.to_string())
        // A broker thread waiting to reconnect does not time out its messages until it wakes:
        // with librdkafka's default backoff of up to 10 s, a record failed that much later than
        // `message.timeout.ms` during a broker outage (and the gateway answered that late).
        .set("reconnect.backoff.max.ms", "1000");
    c
}

/// librdkafka's default `message.max.bytes`: a message (key, value, headers) larger than this is
/// refused by the producer itself, and retrying never helps.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1_000_000;

/// A bound on the serialized size of [`record_headers`] (about 140 bytes: three keys, a
/// 64-digit hash, a version and a timestamp, with their varint lengths).
pub const RECORD_HEADERS_BYTES: usize = 256;

/// Whether Kafka refused a message as too large: the producer's messages are checked against
/// its `message.max.bytes` first, so this is the broker's (or the topic's) smaller limit, which
/// no retry gets past.
pub fn refused_as_too_large(e: &KafkaError) -> bool {
    e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::MessageSizeTooLarge)
}

/// Why a record was rejected whose message is `size` bytes against `message.max.bytes` `max`.
pub fn too_large_reason(size: usize, max: usize) -> String {
    format!("record is {size} bytes as a Kafka message; the producer's message.max.bytes is {max}")
}

/// The `message.max.bytes` that librdkafka applies with `config` (its default when unset).
pub fn max_message_bytes(config: &ClientConfig) -> usize {
    config
        .get("message.max.bytes")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_MAX_MESSAGE_BYTES)
}

/// The headers of a record message: `content-hash`, `schema-version`, `ingest-ts` (epoch µs).
pub fn record_headers(hash: &ContentHash, schema_version: u32, ingest_ts: &str) -> OwnedHeaders {
    let hash_hex = blake3::Hash::from_bytes(hash.0).to_hex();
    let mut version = itoa::Buffer::new();
    OwnedHeaders::new_with_capacity(3)
        .insert(Header {
            key: HEADER_CONTENT_HASH,
            value: Some(hash_hex.as_str()),
        })
        .insert(Header {
            key: HEADER_SCHEMA_VERSION,
            value: Some(version.format(schema_version)),
        })
        .insert(Header {
            key: HEADER_INGEST_TS,
            value: Some(ingest_ts),
        })
}

/// Now, as the `ingest-ts` header value.
pub fn ingest_ts_now() -> String {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or_default()
        .to_string()
}

/// Records encoded as Kafka messages of one stream (key, value, content hash), the values
/// packed in one buffer: two allocations per request instead of two per record.
pub struct Messages {
    entries: Vec<Entry>,
    values: Vec<u8>,
    schema_version: u32,
}

struct Entry {
    key: Str,
    hash: ContentHash,
    /// Where the value ends in `values`; it starts where the previous one ended.
    end: usize,
}

impl Messages {
    /// Memory of one message besides its value (its key, content hash and end).
    pub const ENTRY_BYTES: usize = std::mem::size_of::<Entry>();

    pub fn new(def: &StreamDef, records: usize, value_bytes: usize) -> Messages {
        Messages {
            entries: Vec::with_capacity(records),
            values: Vec::with_capacity(value_bytes),
            schema_version: def.version,
        }
    }

    /// Adds a record, encoded canonically.
    pub fn push(&mut self, def: &StreamDef, valid: &ValidRecord) {
        encode_value_into(def, &valid.record, &mut self.values);
        self.entry(valid.record.partition_key(def), valid.hash);
    }

    /// Adds a checked record ([`schemas::check_bytes_forward`]) whose JSON text is `text`: the
    /// text is the value when it may stand as one, otherwise the record is encoded canonically.
    pub fn push_forward(&mut self, def: &StreamDef, record: &Forward, text: &[u8]) {
        match &record.canonical {
            None => self.values.extend_from_slice(text.trim_ascii()),
            Some(canonical) => encode_value_into(def, canonical, &mut self.values),
        }
        self.entry(record.key.clone(), record.hash);
    }

    fn entry(&mut self, key: Str, hash: ContentHash) {
        self.entries.push(Entry {
            key,
            hash,
            end: self.values.len(),
        });
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Size of the last message as librdkafka counts it against `message.max.bytes`: key,
    /// value and (at most [`RECORD_HEADERS_BYTES`]) headers.
    pub fn last_message_bytes(&self) -> usize {
        let Some(last) = self.entries.last() else {
            return 0;
        };
        let start = self
            .entries
            .len()
            .checked_sub(2)
            .map_or(0, |i| self.entries[i].end);
        last.key.as_str().len() + (last.end - start) + RECORD_HEADERS_BYTES
    }

    /// Takes the last message out again.
    pub fn pop(&mut self) {
        if self.entries.pop().is_some() {
            let end = self.entries.last().map_or(0, |e| e.end);
            self.values.truncate(end);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of all message values.
    pub fn value_bytes(&self) -> usize {
        self.values.len()
    }

    /// Each message's key and value.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.entries_with_values()
            .map(|(e, value)| (e.key.as_str(), value))
    }

    fn entries_with_values(&self) -> impl Iterator<Item = (&Entry, &[u8])> {
        let starts = std::iter::once(0).chain(self.entries.iter().map(|e| e.end));
        self.entries
            .iter()
            .zip(starts)
            .map(|(e, start)| (e, &self.values[start..e.end]))
    }

    /// Hands every message to librdkafka in `group`, with the record headers
    /// ([`record_headers`]); stops at the first refusal.
    pub fn send(
        &self,
        producer: &GroupProducer,
        group: &mut DeliveryGroup,
        topic: &str,
        ingest_ts: &str,
    ) -> KafkaResult<()> {
        for (entry, value) in self.entries_with_values() {
            let headers = record_headers(&entry.hash, self.schema_version, ingest_ts);
            group.send(producer, topic, entry.key.as_str(), value, headers)?;
        }
        Ok(())
    }
}

/// A rejected record bound for the dead-letter topic: the gateway's records that are invalid or
/// too large for a Kafka message, and the agent Kafka output's that are too large.
pub struct DeadLetter {
    index: String,
    code: &'static str,
    reason: String,
    /// The record as received, cut at [`MAX_DEAD_LETTER_BYTES`].
    raw: Vec<u8>,
    truncated: bool,
    /// The request's `Idempotency-Key` or the agent's batch id, when there is one.
    batch: Option<String>,
}

/// Longest record kept in the dead-letter topic (Kafka's default message limit is 1 MB).
pub const MAX_DEAD_LETTER_BYTES: usize = 64 * 1024;

impl DeadLetter {
    /// The record at `index` of its request or batch, `raw` as it came, refused for `reason`
    /// (`code`, a metric label).
    pub fn new(index: usize, code: &'static str, reason: &str, raw: &[u8]) -> DeadLetter {
        let cut = raw.len().min(MAX_DEAD_LETTER_BYTES);
        DeadLetter {
            index: index.to_string(),
            code,
            reason: reason.to_owned(),
            raw: raw[..cut].to_vec(),
            truncated: cut < raw.len(),
            batch: None,
        }
    }

    /// Names the batch (request) the record came in: the [`DLQ_HEADER_BATCH`] header.
    pub fn in_batch(mut self, id: &str) -> DeadLetter {
        self.batch = Some(id.to_owned());
        self
    }

    /// The reason code (a metric label).
    pub fn code(&self) -> &'static str {
        self.code
    }

    /// Hands it to librdkafka in `group`, for `topic`, keyed by its stream, with the
    /// dead-letter headers and the ingest time.
    pub fn send(
        &self,
        producer: &GroupProducer,
        group: &mut DeliveryGroup,
        topic: &str,
        stream: &str,
        ingest_ts: &str,
    ) -> KafkaResult<()> {
        let truncated = if self.truncated { "true" } else { "false" };
        let headers = [
            (DLQ_HEADER_STREAM, stream),
            (DLQ_HEADER_INDEX, self.index.as_str()),
            (DLQ_HEADER_CODE, self.code),
            (DLQ_HEADER_REASON, self.reason.as_str()),
            (DLQ_HEADER_TRUNCATED, truncated),
            (HEADER_INGEST_TS, ingest_ts),
        ]
        .into_iter()
        .chain(self.batch.as_deref().map(|id| (DLQ_HEADER_BATCH, id)))
        .fold(
            OwnedHeaders::new_with_capacity(7),
            |headers, (key, value)| {
                headers.insert(Header {
                    key,
                    value: Some(value),
                })
            },
        );
        group.send(producer, topic, stream, &self.raw, headers)
    }
}

/// A producer whose deliveries are counted per group of messages (a request, a batch): the
/// waiter wakes once when the whole group is settled, instead of a oneshot channel and a future
/// per message as with rdkafka's `FutureProducer`.
pub type GroupProducer = ThreadedProducer<GroupContext>;

/// Creates a [`GroupProducer`] from a client config.
pub fn group_producer(config: &ClientConfig) -> KafkaResult<GroupProducer> {
    config.create_with_context(GroupContext::default())
}

/// The producer context of a [`GroupProducer`]: settles each message in its group.
#[derive(Default)]
pub struct GroupContext {
    log: ClientLog,
}

impl ClientContext for GroupContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.log.log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.log.error(error, reason);
    }
}

impl ProducerContext for GroupContext {
    type DeliveryOpaque = Arc<GroupState>;

    fn delivery(&self, result: &DeliveryResult<'_>, group: Arc<GroupState>) {
        if let Err((e, _)) = result {
            let mut failed = group.failed.lock().unwrap_or_else(|p| p.into_inner());
            failed.get_or_insert_with(|| e.clone());
        }
        group.settle_one();
    }
}

/// What a group's messages share: how many are unsettled and the first failure.
pub struct GroupState {
    /// Messages handed to librdkafka and not yet settled, plus one while the group is open
    /// (so that it cannot look settled before the last message was handed over).
    pending: AtomicUsize,
    failed: Mutex<Option<KafkaError>>,
    settled: Notify,
}

impl GroupState {
    fn settle_one(&self) {
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.settled.notify_one();
        }
    }
}

/// Messages sent together and awaited together.
pub struct DeliveryGroup {
    state: Arc<GroupState>,
    sent: usize,
}

impl Default for DeliveryGroup {
    fn default() -> Self {
        DeliveryGroup::new()
    }
}

impl DeliveryGroup {
    pub fn new() -> DeliveryGroup {
        DeliveryGroup {
            state: Arc::new(GroupState {
                pending: AtomicUsize::new(1),
                failed: Mutex::new(None),
                settled: Notify::new(),
            }),
            sent: 0,
        }
    }

    /// Hands one message to librdkafka (never blocks). On an error (a full queue, say) the
    /// message is not part of the group.
    pub fn send<K, P>(
        &mut self,
        producer: &GroupProducer,
        topic: &str,
        key: &K,
        value: &P,
        headers: OwnedHeaders,
    ) -> KafkaResult<()>
    where
        K: ToBytes + ?Sized,
        P: ToBytes + ?Sized,
    {
        // Counted before the send: the delivery may be reported before `send` returns.
        self.state.pending.fetch_add(1, Ordering::AcqRel);
        let record = BaseRecord::with_opaque_to(topic, self.state.clone())
            .key(key)
            .payload(value)
            .headers(headers);
        match producer.send(record) {
            Ok(()) => {
                self.sent += 1;
                Ok(())
            }
            Err((e, record)) => {
                drop(record);
                self.state.settle_one();
                Err(e)
            }
        }
    }

    /// Messages handed over so far.
    pub fn len(&self) -> usize {
        self.sent
    }

    pub fn is_empty(&self) -> bool {
        self.sent == 0
    }

    /// Waits until every message of the group was acknowledged or failed; the first failure
    /// is the error.
    pub async fn settled(self) -> KafkaResult<usize> {
        let state = self.state;
        state.settle_one(); // the group is closed
        // `notify_one` keeps a permit when nobody waits yet, so no wake-up is lost between
        // the check and the await.
        while state.pending.load(Ordering::Acquire) != 0 {
            state.settled.notified().await;
        }
        let failed = state
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match failed {
            Some(e) => Err(e),
            None => Ok(self.sent),
        }
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::mocking::MockCluster;
    use std::time::Duration;

    use rdkafka::producer::Producer as _;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

    use super::*;

    fn headers(i: u32) -> OwnedHeaders {
        record_headers(&schemas::ContentHash([i as u8; 32]), 1, "0")
    }

    #[tokio::test]
    async fn a_group_settles_once_every_message_is_acknowledged() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("t", 4, 1).unwrap();
        let producer =
            group_producer(&producer_config(&cluster.bootstrap_servers(), 10_000)).unwrap();
        let mut group = DeliveryGroup::new();
        for i in 0..500u32 {
            let key = format!("device-{}", i % 7);
            group
                .send(&producer, "t", &key, &format!("{{\"i\":{i}}}"), headers(i))
                .unwrap();
        }
        assert_eq!(group.len(), 500);
        assert_eq!(group.settled().await.unwrap(), 500);
        // Settled means acknowledged: the broker holds all of them now.
        let stored: i64 = (0..4)
            .map(|p| {
                let (low, high) = producer
                    .client()
                    .fetch_watermarks("t", p, Duration::from_secs(5))
                    .unwrap();
                high - low
            })
            .sum();
        assert_eq!(stored, 500);
        // An empty group is settled at once.
        assert_eq!(DeliveryGroup::new().settled().await.unwrap(), 0);
    }

    /// A message that [`Messages::last_message_bytes`] puts at exactly `message.max.bytes`
    /// (the headers at their bound) is taken by librdkafka: the bound is not below what the
    /// headers take. One of a megabyte is refused at once, whatever the retries.
    #[tokio::test]
    async fn the_message_size_bound_matches_librdkafkas_limit() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("t", 1, 1).unwrap();
        let config = producer_config(&cluster.bootstrap_servers(), 10_000);
        assert_eq!(max_message_bytes(&config), DEFAULT_MAX_MESSAGE_BYTES);
        let producer = group_producer(&config).unwrap();
        let key = "device-1";
        let fits = vec![b'x'; DEFAULT_MAX_MESSAGE_BYTES - key.len() - RECORD_HEADERS_BYTES];
        let mut group = DeliveryGroup::new();
        group
            .send(&producer, "t", key, &fits, headers(u32::MAX))
            .unwrap();
        group.settled().await.unwrap();
        let over = vec![b'x'; 1 << 20];
        let refused = DeliveryGroup::new().send(&producer, "t", key, &over, headers(1));
        assert!(refused.is_err_and(|e| e.rdkafka_error_code()
            == Some(rdkafka::types::RDKafkaErrorCode::MessageSizeTooLarge)));
    }

    /// The last message's size counts its key, its value and the headers' bound; taking it out
    /// leaves the others as they were.
    #[test]
    fn the_last_message_is_measured_and_taken_out() {
        let def = schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone();
        let line = |v: u32| {
            format!(r#"{{"device_id":"dev-{v}","sensor":"t","ts":1700000000000,"value":{v}}}"#)
        };
        let mut messages = Messages::new(&def, 2, 0);
        assert_eq!(messages.last_message_bytes(), 0);
        for v in [1, 22] {
            let text = line(v);
            let record = schemas::check_bytes_forward(&def, text.as_bytes()).unwrap();
            messages.push_forward(&def, &record, text.as_bytes());
        }
        let (key, value) = messages
            .iter()
            .last()
            .map(|(k, v)| (k.len(), v.len()))
            .unwrap();
        assert_eq!(value, line(22).len());
        assert_eq!(
            messages.last_message_bytes(),
            key + value + RECORD_HEADERS_BYTES
        );
        messages.pop();
        assert_eq!(messages.len(), 1);
        assert_eq!(messages.value_bytes(), line(1).len());
        assert_eq!(messages.iter().next().unwrap().1, line(1).as_bytes());
    }

    #[tokio::test]
    async fn a_group_reports_the_first_failure() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("t", 1, 1).unwrap();
        let mut config = producer_config(&cluster.bootstrap_servers(), 10_000);
        // A non-retriable error ends the message at once; idempotence would turn it fatal.
        config.set("enable.idempotence", "false");
        let producer = group_producer(&config).unwrap();
        // Settle one good message first, so the metadata is known.
        let mut warm = DeliveryGroup::new();
        warm.send(&producer, "t", "k", "v", headers(0)).unwrap();
        warm.settled().await.unwrap();
        cluster.request_errors(
            RDKafkaApiKey::Produce,
            &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED; 4],
        );
        let mut group = DeliveryGroup::new();
        group.send(&producer, "t", "k", "v", headers(1)).unwrap();
        let e = group.settled().await.unwrap_err();
        assert!(e.to_string().contains("authoriz"), "{e}");
    }
}
