//! Gateway configuration: a TOML file plus `INGEST_GATEWAY_` environment overrides.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

/// Environment variables with this prefix override config keys (`__` separates nesting).
pub const ENV_PREFIX: &str = "INGEST_GATEWAY_";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Address the HTTP API, `/metrics`, `/healthz` and `/readyz` listen on.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Directory of stream definitions (`<stream>.toml`).
    #[serde(default = "default_streams_dir")]
    pub streams_dir: PathBuf,
    #[serde(default)]
    pub kafka: KafkaConfig,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub auth: AuthConfig,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: default_listen(),
            streams_dir: default_streams_dir(),
            kafka: KafkaConfig::default(),
            limits: LimitsConfig::default(),
            auth: AuthConfig::default(),
        }
    }
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
    /// Extra librdkafka producer properties, e.g. `"security.protocol" = "ssl"`.
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
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: default_max_body(),
            max_decompressed_bytes: default_max_decompressed(),
            max_records: default_max_records(),
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
