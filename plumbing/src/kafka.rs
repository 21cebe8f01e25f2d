//! The producer side of the Kafka wire format (DESIGN.md), shared by the gateway and the agent's
//! Kafka output.

use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use schemas::ContentHash;
use schemas::wire::{HEADER_CONTENT_HASH, HEADER_INGEST_TS, HEADER_SCHEMA_VERSION};

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
        .set("message.timeout.ms", message_timeout_ms.to_string());
    c
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
