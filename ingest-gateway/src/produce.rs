//! The Kafka producer: idempotent, acks=all, zstd; a request is answered only after every
//! accepted record was acknowledged.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use schemas::wire::{
    HEADER_CONTENT_HASH, HEADER_INGEST_TS, HEADER_SCHEMA_VERSION, encode_value, topic_name,
};
use schemas::{StreamDef, Streams, ValidRecord};

use crate::api::ApiError;
use crate::config::KafkaConfig;

/// A record encoded for Kafka, ready to send.
pub struct Prepared {
    key: String,
    value: Vec<u8>,
    hash_hex: String,
    schema_version: String,
}

impl Prepared {
    pub fn new(def: &StreamDef, valid: &ValidRecord) -> Prepared {
        Prepared {
            key: valid.record.partition_key(def),
            value: encode_value(def, &valid.record),
            hash_hex: valid.hash.to_hex(),
            schema_version: def.version.to_string(),
        }
    }
}

pub struct Producer {
    inner: FutureProducer,
    topic_prefix: String,
}

/// The base client config for a cluster.
pub fn client_config(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers);
    c
}

impl Producer {
    pub fn new(config: &KafkaConfig) -> Result<Producer, KafkaError> {
        let mut c = client_config(&config.brokers);
        c.set("enable.idempotence", "true")
            .set("acks", "all")
            .set("compression.type", "zstd")
            .set("linger.ms", "5")
            .set("message.timeout.ms", config.produce_timeout_ms.to_string());
        for (k, v) in &config.producer {
            c.set(k, v);
        }
        Ok(Producer {
            inner: c.create()?,
            topic_prefix: config.topic_prefix.clone(),
        })
    }

    /// Sends every record and waits for all acknowledgements. Any failure answers 503 with
    /// `Retry-After`: a retry of the same batch is safe, the sink drops re-sent content.
    pub async fn produce(&self, stream: &str, records: Vec<Prepared>) -> Result<(), ApiError> {
        let topic = topic_name(&self.topic_prefix, stream);
        let ingest_ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as i64)
            .unwrap_or_default()
            .to_string();
        let mut pending = Vec::with_capacity(records.len());
        for r in &records {
            let headers = OwnedHeaders::new_with_capacity(3)
                .insert(Header {
                    key: HEADER_CONTENT_HASH,
                    value: Some(&r.hash_hex),
                })
                .insert(Header {
                    key: HEADER_SCHEMA_VERSION,
                    value: Some(&r.schema_version),
                })
                .insert(Header {
                    key: HEADER_INGEST_TS,
                    value: Some(&ingest_ts),
                });
            let record = FutureRecord::to(&topic)
                .key(&r.key)
                .payload(&r.value)
                .headers(headers);
            match self.inner.send_result(record) {
                Ok(delivery) => pending.push(delivery),
                Err((e, _)) => return Err(kafka_unavailable(&e)),
            }
        }
        for delivery in pending {
            match delivery.await {
                Ok(Ok(_)) => {}
                Ok(Err((e, _))) => return Err(kafka_unavailable(&e)),
                Err(_) => return Err(ApiError::unavailable("producer shut down", 1)),
            }
        }
        Ok(())
    }

    /// Whether the cluster answers a metadata request.
    pub async fn is_reachable(&self) -> bool {
        let client = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            client
                .client()
                .fetch_metadata(None, Duration::from_secs(3))
                .is_ok()
        })
        .await
        .unwrap_or(false)
    }

    /// Waits for queued records to be delivered, at most `timeout`.
    pub async fn flush(&self, timeout: Duration) {
        let p = self.inner.clone();
        let _ = tokio::task::spawn_blocking(move || p.flush(timeout)).await;
    }
}

fn kafka_unavailable(e: &KafkaError) -> ApiError {
    let retry = match e.rdkafka_error_code() {
        Some(RDKafkaErrorCode::QueueFull) => 1,
        _ => 5,
    };
    tracing::warn!(error = %e, "produce failed");
    ApiError::unavailable(format!("Kafka did not acknowledge the records: {e}"), retry)
}

/// Creates the topic of every stream that does not exist yet.
pub async fn ensure_topics(config: &KafkaConfig, streams: &Streams) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = client_config(&config.brokers).create()?;
    let names: Vec<String> = streams
        .iter()
        .map(|s| topic_name(&config.topic_prefix, &s.name))
        .collect();
    let topics: Vec<NewTopic<'_>> = names
        .iter()
        .map(|n| {
            NewTopic::new(
                n,
                config.topic_partitions,
                TopicReplication::Fixed(config.topic_replication),
            )
        })
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for result in admin.create_topics(&topics, &opts).await? {
        match result {
            Ok(topic) => tracing::info!(topic, "created topic"),
            Err((topic, RDKafkaErrorCode::TopicAlreadyExists)) => {
                tracing::debug!(topic, "topic exists")
            }
            Err((topic, code)) => anyhow::bail!("cannot create topic {topic}: {code}"),
        }
    }
    Ok(())
}
