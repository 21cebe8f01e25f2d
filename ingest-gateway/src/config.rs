//! Gateway configuration: a TOML file plus `INGEST_GATEWAY_` environment overrides.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;
use service_kit::kafka::security::Sasl;
use service_kit::tls::TlsFiles;

/// Environment variables with this prefix override config keys (`__` separates nesting).
pub const ENV_PREFIX: &str = "INGEST_GATEWAY_";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Address the HTTP API listens on.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (plain HTTP): an internal port for
    /// Prometheus and probes, apart from the API, which may face the internet (the metrics name
    /// tokens and streams) or require client certificates. `"api"` (`None`) serves them on
    /// `listen` instead.
    #[serde(default = "default_admin_listen", deserialize_with = "admin_listen")]
    pub admin_listen: Option<SocketAddr>,
    /// Directory of stream definitions (`<stream>.toml`).
    #[serde(default = "default_streams_dir")]
    pub streams_dir: PathBuf,
    #[serde(default)]
    pub kafka: KafkaConfig,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub auth: AuthConfig,
    #[serde(default)]
    pub idempotency: IdempotencyConfig,
    /// The schema registry of the streams, served under `/registry`.
    #[serde(default)]
    pub registry: RegistryConfig,
    /// TLS for the API; plain HTTP when absent.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Added to the nice value of the threads that take and check requests (0–19; 0 keeps
    /// them at the process's priority). librdkafka's threads, which compress and deliver what
    /// was accepted, keep the process's priority, so when the CPU is saturated the gateway
    /// finishes accepted work before it takes more. Within a container this only orders the
    /// gateway's own threads; on a shared host it also yields to other processes.
    /// Applied by [`crate::runtime`], which the binary and `bench-gateway` serve on; a gateway
    /// started with [`crate::start`] on another runtime (the demo, tests) keeps that runtime's.
    #[serde(default = "default_worker_nice")]
    pub worker_nice: u8,
}

pub use service_kit::http::server::TlsConfig;

/// `[registry]`: the schema registry the gateway serves for its streams.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryConfig {
    /// Where schemas that producers register are kept, so that their ids outlive a restart
    /// (a directory; shared by the gateways behind one address, or each gateway's own when
    /// producers register through one). Absent: kept in memory; a definition's own schemas
    /// need no keeping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// Whether a producer registering an Avro schema with fields the stream lacks (each taking
    /// null, of a stream's type) adds them to the stream's definition file in `streams_dir`, its
    /// version raised, as a compatible change. Off: such a schema is refused.
    #[serde(default)]
    pub add_fields: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdempotencyConfig {
    /// How long the answer to an `Idempotency-Key` is remembered, in seconds.
    #[serde(default = "default_idempotency_window")]
    pub window_secs: u64,
    /// Most answers remembered; the oldest is forgotten first.
    #[serde(default = "default_idempotency_entries")]
    pub max_entries: usize,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        IdempotencyConfig {
            window_secs: default_idempotency_window(),
            max_entries: default_idempotency_entries(),
        }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: default_listen(),
            admin_listen: default_admin_listen(),
            streams_dir: default_streams_dir(),
            kafka: KafkaConfig::default(),
            limits: LimitsConfig::default(),
            auth: AuthConfig::default(),
            idempotency: IdempotencyConfig::default(),
            registry: RegistryConfig::default(),
            tls: None,
            worker_nice: default_worker_nice(),
        }
    }
}

fn default_worker_nice() -> u8 {
    10
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap servers, comma separated.
    #[serde(default = "default_brokers")]
    pub brokers: String,
    /// Topic of a stream = prefix + stream name.
    #[serde(default = "default_topic_prefix")]
    pub topic_prefix: String,
    /// Create the topics of all known streams at start-up when they are missing.
    #[serde(default)]
    pub create_topics: bool,
    /// Partitions of topics the gateway creates.
    #[serde(default = "default_partitions")]
    pub topic_partitions: i32,
    /// Replication factor of topics the gateway creates.
    #[serde(default = "default_replication")]
    pub topic_replication: i32,
    /// How long a record may wait for Kafka's acknowledgement (librdkafka
    /// `message.timeout.ms`) before the request fails with 503.
    #[serde(default = "default_produce_timeout_ms")]
    pub produce_timeout_ms: u64,
    /// Topic that receives rejected records with the reason in headers; created with the
    /// stream topics when `create_topics` is on.
    #[serde(default = "default_dead_letter_topic")]
    pub dead_letter_topic: String,
    /// TLS to the brokers: `tls = {}` trusts the platform's roots; `ca_file` a CA of its own;
    /// `client_cert` and `client_key` for brokers that require a client certificate.
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// SASL authentication: `{ mechanism = "SCRAM-SHA-512", username, password_file }`
    /// (or `password`, e.g. from `INGEST_GATEWAY_KAFKA__SASL__PASSWORD`).
    #[serde(default)]
    pub sasl: Option<Sasl>,
    /// Extra librdkafka producer properties, set last (they win over the settings above).
    #[serde(default)]
    pub producer: BTreeMap<String, String>,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: default_brokers(),
            topic_prefix: default_topic_prefix(),
            create_topics: false,
            topic_partitions: default_partitions(),
            topic_replication: default_replication(),
            produce_timeout_ms: default_produce_timeout_ms(),
            dead_letter_topic: default_dead_letter_topic(),
            tls: None,
            sasl: None,
            producer: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest request body as sent (compressed), in bytes.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Largest request body after decompression, in bytes; a bomb is stopped at this size.
    #[serde(default = "default_max_decompressed")]
    pub max_decompressed_bytes: usize,
    /// Most records in one request.
    #[serde(default = "default_max_records")]
    pub max_records: usize,
    /// Longest NDJSON line (or JSON array element), in bytes; a longer one is rejected alone.
    #[serde(default = "default_max_line")]
    pub max_line_bytes: usize,
    /// Requests served at once; more are answered 429 with `Retry-After`.
    #[serde(default = "default_max_concurrent")]
    pub max_concurrent_requests: usize,
    /// Memory held at once across all requests (bodies as sent, decompressed bodies, the
    /// records' lines and Kafka messages), taken before it is allocated: a request that would
    /// pass it is answered 429 with `Retry-After` (413 when it needs more than all of it), so
    /// neither many clients nor a slow Kafka can take the gateway's memory.
    #[serde(default = "default_max_inflight")]
    pub max_inflight_bytes: usize,
    /// Time for a whole request, from the first body byte to the answer, in milliseconds, plus
    /// the time its body (by `Content-Length`) takes at `min_body_bytes_per_sec`. Reading the
    /// body past it answers 408; producing past it answers 503.
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// The slowest client uplink a request's body is given time for (bytes per second): the
    /// request's time grows by its `Content-Length` at this rate, so an agent behind a slow
    /// link is not cut off with 408 for every batch it sends. 0: `request_timeout_ms` alone.
    #[serde(default = "default_min_body_bytes_per_sec")]
    pub min_body_bytes_per_sec: u64,
    /// Time a connection has to send a request head, in milliseconds: a new connection, and a
    /// kept-alive one between requests. A client that sends nothing, trickles its headers or
    /// leaves its connection idle is disconnected after it.
    #[serde(default = "default_header_timeout_ms")]
    pub header_timeout_ms: u64,
    /// Connections open at once (keep it below the process's open-file limit); more are closed
    /// as they come, before any TLS work.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// The largest Kafka message (key, value, headers) the producer takes: its
    /// `message.max.bytes`, set at start from `kafka.producer` (librdkafka's 1,000,000 by
    /// default). A record whose message would be larger is rejected alone, as an over-long line
    /// is: librdkafka would refuse it, and a retry of its request would never do better.
    #[serde(skip, default = "default_max_message")]
    pub max_message_bytes: usize,
}

fn default_max_message() -> usize {
    service_kit::kafka::DEFAULT_MAX_MESSAGE_BYTES
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: default_max_body(),
            max_decompressed_bytes: default_max_decompressed(),
            max_records: default_max_records(),
            max_line_bytes: default_max_line(),
            max_concurrent_requests: default_max_concurrent(),
            max_inflight_bytes: default_max_inflight(),
            request_timeout_ms: default_request_timeout_ms(),
            min_body_bytes_per_sec: default_min_body_bytes_per_sec(),
            header_timeout_ms: default_header_timeout_ms(),
            max_connections: default_max_connections(),
            max_message_bytes: default_max_message(),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Accept requests without a token. Off by default: a gateway without tokens refuses to
    /// start unless this is set.
    #[serde(default)]
    pub allow_anonymous: bool,
    /// Bearer tokens, stored as BLAKE3 hashes (`edge-agent hash-token` or `b3sum` prints one).
    #[serde(default)]
    pub tokens: Vec<TokenConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// A name for logs and metrics, never the token.
    pub name: String,
    /// BLAKE3 hash of the token, 64 hex digits.
    pub blake3: String,
    /// Streams this token may write; `"*"` for all.
    pub streams: Vec<String>,
    /// Rate limit of this token's requests in body bytes as sent, per second (a token bucket
    /// of one second's bytes; one request may overdraw it). A request while the token is in
    /// debt answers 429 with `Retry-After`. No limit when absent.
    #[serde(default)]
    pub max_bytes_per_sec: Option<u64>,
}

fn default_admin_listen() -> Option<SocketAddr> {
    Some(SocketAddr::from(([0, 0, 0, 0], 9101)))
}
/// `admin_listen`: an address, or `"api"` for the API's own port.
fn admin_listen<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    let text = String::deserialize(d)?;
    if text == "api" {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|e| {
        serde::de::Error::custom(format!(
            "{text:?} is neither an address (host:port) nor \"api\": {e}"
        ))
    })
}
fn default_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8080))
}
fn default_streams_dir() -> PathBuf {
    PathBuf::from("streams")
}
fn default_brokers() -> String {
    "127.0.0.1:9092".into()
}
fn default_topic_prefix() -> String {
    schemas::wire::DEFAULT_TOPIC_PREFIX.into()
}
fn default_partitions() -> i32 {
    3
}
fn default_replication() -> i32 {
    1
}
fn default_produce_timeout_ms() -> u64 {
    30_000
}
fn default_max_body() -> usize {
    16 << 20
}
fn default_max_decompressed() -> usize {
    128 << 20
}
fn default_max_records() -> usize {
    500_000
}
fn default_max_line() -> usize {
    1 << 20
}
fn default_max_concurrent() -> usize {
    256
}
fn default_max_inflight() -> usize {
    1 << 30
}
fn default_max_connections() -> usize {
    4096
}
fn default_header_timeout_ms() -> u64 {
    service_kit::http::server::DEFAULT_HEADER_TIMEOUT.as_millis() as u64
}
fn default_request_timeout_ms() -> u64 {
    60_000
}
fn default_min_body_bytes_per_sec() -> u64 {
    // 16 kbit/s, as the agent's gateway.min_upload_bytes_per_sec.
    2_000
}
fn default_dead_letter_topic() -> String {
    "ingest-dead-letters".into()
}
fn default_idempotency_window() -> u64 {
    600
}
fn default_idempotency_entries() -> usize {
    100_000
}
