//! Agent configuration: a TOML file plus `EDGE_AGENT_` environment overrides. Every option has a
//! default except the output (`[gateway]` or `[kafka]`) and the sources.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use service_kit::config::secret::{self, Secret};

use crate::batch::BodyEncoding;
use crate::filter::FilterConfig;
use crate::spool::{FsyncPolicy, Overflow, SpoolOptions};
use crate::tls::TlsFiles;

#[cfg(feature = "kafka")]
use service_kit::kafka::security::Sasl;
/// An agent built without the Kafka output reads `[kafka]` only to refuse it
/// ([`AgentConfig::validate`]).
#[cfg(not(feature = "kafka"))]
type Sasl = serde::de::IgnoredAny;

/// Environment variables with this prefix override config keys (`__` separates nesting).
pub const ENV_PREFIX: &str = "EDGE_AGENT_";

/// The gateway's refusals that every batch would get, whatever it holds: 401 a missing or
/// unknown token, 403 a token without the stream, 404 a gateway without the stream (or a wrong
/// URL). The default of [`GatewayTarget::retry_statuses`].
pub const BATCH_INDEPENDENT_REFUSALS: [u16; 3] = [401, 403, 404];

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// Directory of stream definitions (`<stream>.toml`).
    #[serde(default = "default_streams_dir")]
    pub streams_dir: PathBuf,
    /// Where the agent keeps its spool, dedupe logs and file read positions.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// `/metrics`, `/healthz` and `/readyz`; none to serve nothing.
    #[serde(default)]
    pub admin_listen: Option<SocketAddr>,
    /// HTTP output: the ingest gateway. Exactly one of `gateway` and `kafka` is set.
    #[serde(default)]
    pub gateway: Option<GatewayTarget>,
    /// Kafka output, for boxes that reach the brokers.
    #[serde(default)]
    pub kafka: Option<KafkaTarget>,
    #[serde(default)]
    pub batch: BatchConfig,
    #[serde(default)]
    pub dedupe: DedupeConfig,
    #[serde(default)]
    pub spool: SpoolConfig,
    /// Bandwidth cap over all streams, bytes per second on the wire; 0 is no cap.
    #[serde(default)]
    pub max_bytes_per_sec: u64,
    /// Per-stream settings, by stream name.
    #[serde(default)]
    pub streams: BTreeMap<String, StreamSettings>,
    /// Where records come from.
    pub sources: Vec<SourceConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayTarget {
    /// Base URL of the gateway, e.g. `http://gateway:8080`.
    pub url: String,
    /// Bearer token; none for a gateway that allows anonymous ingest. Best from `token_file`
    /// (a mounted secret) or `EDGE_AGENT_GATEWAY__TOKEN`; never printed.
    #[serde(default)]
    pub token: Option<Secret>,
    /// A file holding the bearer token (its first line), instead of `token`.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Timeout of one request, in milliseconds, plus the time its body takes at
    /// `min_upload_bytes_per_sec`.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// The slowest uplink a request is given time for: each request's timeout grows by its
    /// body's size at this rate, so a batch that takes longer than `timeout_ms` to upload over
    /// a slow link is not cut off and sent again for ever. 0: `timeout_ms` alone.
    #[serde(default = "default_min_upload_bytes_per_sec")]
    pub min_upload_bytes_per_sec: u64,
    /// Longest wait between retries, in milliseconds (backoff doubles from 250 ms).
    #[serde(default = "default_max_backoff_ms")]
    pub max_backoff_ms: u64,
    /// 4xx answers retried like 5xx (default [`BATCH_INDEPENDENT_REFUSALS`]): the batch stays
    /// first in the spool and is retried with backoff until the cause is fixed, where other
    /// 4xx answers put the batch aside for good.
    #[serde(default = "default_retry_statuses")]
    pub retry_statuses: Vec<u16>,
    /// For an `https://` url: a CA file to trust instead of the platform's roots, and a client
    /// certificate and key for gateways (or proxies) that require one.
    #[serde(default)]
    pub tls: TlsFiles,
    /// A forward proxy between the agent and the gateway. Without this table the agent uses
    /// the proxy that `HTTPS_PROXY`, `HTTP_PROXY` or `ALL_PROXY` in its environment names,
    /// except for the hosts of `NO_PROXY`.
    #[serde(default)]
    pub proxy: Option<ProxyConfig>,
}

/// `[gateway.proxy]`: the forward proxy the agent reaches the gateway through (an HTTP
/// `CONNECT` tunnel for an `https://` gateway, so TLS still ends at the gateway).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    /// `http://host:port` (or `https://` for a proxy reached over TLS); `"direct"` connects
    /// straight to the gateway and ignores the environment's proxy variables.
    pub url: String,
    /// Basic credentials for the proxy: the user, and the password inline (best from
    /// `EDGE_AGENT_GATEWAY__PROXY__PASSWORD`) or in `password_file`.
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// Hosts reached without the proxy, comma-separated as in `NO_PROXY`: names (a leading
    /// dot or none matches subdomains too), IP addresses and CIDR ranges.
    #[serde(default)]
    pub no_proxy: Option<String>,
}

/// `url` value of [`ProxyConfig`] for no proxy at all.
pub const DIRECT: &str = "direct";

impl std::fmt::Debug for ProxyConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyConfig")
            .field("url", &redacted_url(&self.url))
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("password_file", &self.password_file)
            .field("no_proxy", &self.no_proxy)
            .finish()
    }
}

/// `url` without the password it may carry (`http://user:secret@host` → `http://user:***@host`),
/// for logs and errors.
pub fn redacted_url(url: &str) -> String {
    match url.parse::<reqwest::Url>() {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        Ok(_) => url.to_owned(),
        Err(_) => "<not a URL>".to_owned(),
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaTarget {
    /// Bootstrap servers.
    pub brokers: String,
    /// Topic prefix (`ingest.` like the gateway).
    #[serde(default = "default_topic_prefix")]
    pub topic_prefix: String,
    /// Where a record too large for a Kafka message goes instead (cut at 64 KiB, with the
    /// reason), as the gateway sends it (the gateway's default `kafka.dead_letter_topic`).
    #[serde(default = "default_dead_letter_topic")]
    pub dead_letter_topic: String,
    /// TLS to the brokers: `tls = {}` trusts the platform's roots; `ca_file` a CA of its own;
    /// `client_cert` and `client_key` for brokers that require a client certificate.
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// SASL authentication: `{ mechanism = "SCRAM-SHA-512", username, password_file }`
    /// (or `password`, e.g. from `EDGE_AGENT_KAFKA__SASL__PASSWORD`).
    #[serde(default)]
    pub sasl: Option<Sasl>,
    /// Extra librdkafka producer properties (timeouts), set last: they win over the above.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchConfig {
    /// Close a batch at this many records.
    #[serde(default = "default_max_records")]
    pub max_records: usize,
    /// Close a batch when its uncompressed NDJSON reaches this many bytes.
    #[serde(default = "default_max_bytes")]
    pub max_bytes: usize,
    /// Close a batch this long after its first record, in milliseconds.
    #[serde(default = "default_max_age_ms")]
    pub max_age_ms: u64,
    /// zstd level of batch bodies (1-22).
    #[serde(default = "default_zstd_level")]
    pub zstd_level: i32,
    /// Body encoding: `ndjson` (zstd NDJSON) or `parquet` (columnar, about half the bytes).
    #[serde(default)]
    pub encoding: BodyEncoding,
    /// Compress NDJSON batches with the stream's zstd dictionary (`<stream>.zdict` next to its
    /// definition) when it has one. A gateway without it makes the agent resend the batch
    /// without.
    #[serde(default = "default_true")]
    pub zstd_dictionary: bool,
    /// Longest line the file and stdin sources take, in bytes with its line break (the
    /// gateway's `limits.max_line_bytes` is the same 1 MiB by default). A longer line is
    /// skipped as it is read, never held whole, and counted as discarded (`line_too_long`).
    #[serde(default = "default_max_line_bytes")]
    pub max_line_bytes: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_records: default_max_records(),
            max_bytes: default_max_bytes(),
            max_age_ms: default_max_age_ms(),
            zstd_level: default_zstd_level(),
            encoding: BodyEncoding::default(),
            zstd_dictionary: true,
            max_line_bytes: default_max_line_bytes(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DedupeConfig {
    /// Content hashes remembered per stream (at most 36 bytes each, 32 with `window_secs` 0); 0
    /// turns dedupe off.
    #[serde(default = "default_dedupe_records")]
    pub window_records: usize,
    /// Hashes older than this many seconds are forgotten; 0 keeps them until evicted by count.
    #[serde(default = "default_dedupe_secs")]
    pub window_secs: u32,
}

impl Default for DedupeConfig {
    fn default() -> Self {
        DedupeConfig {
            window_records: default_dedupe_records(),
            window_secs: default_dedupe_secs(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpoolConfig {
    /// Size limit of the spool over all streams, in MiB (small limits are fine).
    #[serde(default = "default_spool_mb")]
    pub max_mb: u64,
    /// Segment file size in MiB; the effective size is at most a quarter of `max_mb`.
    #[serde(default = "default_segment_mb")]
    pub segment_mb: u64,
    /// `batch` (fsync every batch) or `interval` (every `fsync_interval_ms`).
    #[serde(default)]
    pub fsync: FsyncPolicy,
    #[serde(default = "default_fsync_interval_ms")]
    pub fsync_interval_ms: u64,
    /// Size limit of `rejected/` in the state directory (batches the receiver refused for
    /// good, kept with its answer), in MiB. When it is reached, a refused batch stays first in
    /// its stream's spool until there is room (the spool's limit and overflow policy then
    /// apply); nothing kept is deleted.
    #[serde(default = "default_rejected_mb")]
    pub rejected_max_mb: u64,
    /// Size limit of `invalid/` per stream, in MiB: records skipped as invalid are kept there
    /// with the reason and tried again when the stream's definition changes compatibly and when
    /// the agent starts. Past the limit they are only counted
    /// (`edge_agent_invalid_not_kept_total`). 0: none kept.
    #[serde(default = "default_invalid_mb")]
    pub invalid_max_mb: u64,
}

impl Default for SpoolConfig {
    fn default() -> Self {
        SpoolConfig {
            max_mb: default_spool_mb(),
            segment_mb: default_segment_mb(),
            fsync: FsyncPolicy::default(),
            fsync_interval_ms: default_fsync_interval_ms(),
            rejected_max_mb: default_rejected_mb(),
            invalid_max_mb: default_invalid_mb(),
        }
    }
}

impl SpoolConfig {
    pub fn options(&self) -> SpoolOptions {
        let max_bytes = self.max_mb.max(1) << 20;
        SpoolOptions {
            max_bytes,
            segment_bytes: (self.segment_mb.max(1) << 20).min(max_bytes / 4),
            fsync: self.fsync,
            fsync_interval: Duration::from_millis(self.fsync_interval_ms),
        }
    }

    /// `rejected_max_mb` in bytes.
    pub fn rejected_max_bytes(&self) -> u64 {
        self.rejected_max_mb.saturating_mul(1 << 20)
    }

    /// `invalid_max_mb` in bytes.
    pub fn invalid_max_bytes(&self) -> u64 {
        self.invalid_max_mb.saturating_mul(1 << 20)
    }
}

/// Settings of one stream.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamSettings {
    /// What to do when the spool is full: `block` (default), `drop_newest`, `drop_oldest`.
    #[serde(default)]
    pub overflow: Overflow,
    /// Higher goes first when streams share a bandwidth cap.
    #[serde(default)]
    pub priority: i32,
    /// This stream's own cap, bytes per second on the wire; 0 is no cap.
    #[serde(default)]
    pub max_bytes_per_sec: u64,
    /// Body encoding of this stream, instead of `batch.encoding`.
    #[serde(default)]
    pub encoding: Option<BodyEncoding>,
    /// Filters, applied in order after dedupe.
    #[serde(default)]
    pub filters: Vec<FilterConfig>,
}

/// Record format of a file source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileFormat {
    #[default]
    Ndjson,
    /// Comma-separated with a header line naming the fields; cells are typed by the stream.
    Csv,
}

/// A source of records.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum SourceConfig {
    /// A file, or every file in a directory whose name ends with `suffix`. Read positions are
    /// persisted and survive rotation (by rename), truncation and restarts.
    File {
        path: PathBuf,
        stream: String,
        #[serde(default)]
        format: FileFormat,
        /// Keep watching for appended lines and new files; false reads to the end and stops.
        #[serde(default)]
        follow: bool,
        /// For a directory: only file names ending with this.
        #[serde(default)]
        suffix: Option<String>,
        /// Poll interval when following, in milliseconds.
        #[serde(default = "default_poll_ms")]
        poll_ms: u64,
        /// Fields added to every record that lacks them ([`StaticFieldsConfig`]).
        #[serde(default)]
        fields: StaticFieldsConfig,
    },
    /// NDJSON on standard input, until end of input.
    Stdin {
        stream: String,
        #[serde(default)]
        fields: StaticFieldsConfig,
    },
    /// An MQTT subscription. Messages are NDJSON (one or more records). With QoS 1 the PUBACK
    /// goes out only after the records are in the spool.
    Mqtt {
        /// `mqtt://host:port` (or `host:port`; port 1883 by default), or `mqtts://host:port`
        /// for TLS (8883).
        url: String,
        topics: Vec<String>,
        stream: String,
        #[serde(default = "default_mqtt_client_id")]
        client_id: String,
        #[serde(default = "default_qos")]
        qos: u8,
        #[serde(default)]
        username: Option<String>,
        /// The login's password; best from `password_file` or the environment.
        #[serde(default)]
        password: Option<Secret>,
        /// A file holding the password (its first line), instead of `password`.
        #[serde(default)]
        password_file: Option<PathBuf>,
        /// Messages not yet acknowledged at which the open batch is closed early. Keep it at or
        /// below the broker's in-flight limit (mosquitto: `max_inflight_messages`, 20).
        #[serde(default = "default_max_unacked")]
        max_unacked: usize,
        /// With `mqtts://`: a CA file to trust instead of the platform's roots, and a client
        /// certificate and key for brokers that require one.
        #[serde(default)]
        tls: TlsFiles,
        /// Fields taken from each message's topic, e.g. `plant/+/{device_id}/{sensor}`
        /// ([`crate::source::fields`]).
        #[serde(default)]
        topic_fields: Option<String>,
        #[serde(default)]
        fields: StaticFieldsConfig,
    },
    /// The gateway's ingest API on a local port, for devices on the box or the plant network.
    /// Answers after the records are in the spool.
    Http {
        listen: SocketAddr,
        /// Bearer token clients must present; none accepts anonymous requests. Best from
        /// `token_file` or the environment.
        #[serde(default)]
        token: Option<Secret>,
        /// A file holding the token (its first line), instead of `token`.
        #[serde(default)]
        token_file: Option<PathBuf>,
        /// Largest request body, compressed or not.
        #[serde(default = "default_http_max_body")]
        max_body_bytes: usize,
        /// HTTPS with this certificate and key (PEM); plain HTTP when absent.
        #[serde(default)]
        tls: Option<service_kit::http::server::TlsConfig>,
    },
}

/// A source's `fields` table: field name → value, added to each of its records that lacks the
/// field (a record's own value wins), e.g. `fields = { device_id = "press-07" }` for a file of
/// one machine's readings. Checked against the stream at start.
pub type StaticFieldsConfig = BTreeMap<String, serde_json::Value>;

impl SourceConfig {
    /// The stream the source feeds; none for the HTTP source (the URL names it).
    pub fn stream(&self) -> Option<&str> {
        match self {
            SourceConfig::File { stream, .. }
            | SourceConfig::Stdin { stream, .. }
            | SourceConfig::Mqtt { stream, .. } => Some(stream),
            SourceConfig::Http { .. } => None,
        }
    }

    /// The source's `fields` table (none for the HTTP source).
    pub fn fields(&self) -> Option<&StaticFieldsConfig> {
        match self {
            SourceConfig::File { fields, .. }
            | SourceConfig::Stdin { fields, .. }
            | SourceConfig::Mqtt { fields, .. } => Some(fields),
            SourceConfig::Http { .. } => None,
        }
    }

    /// The source's secret (an MQTT login's password, the local port's token), from the config
    /// or its file.
    pub fn secret(&self) -> anyhow::Result<Option<Secret>> {
        match self {
            SourceConfig::Mqtt {
                password,
                password_file,
                ..
            } => secret::resolve(
                password.as_ref(),
                password_file.as_deref(),
                "sources.password",
            ),
            SourceConfig::Http {
                token, token_file, ..
            } => secret::resolve(token.as_ref(), token_file.as_deref(), "sources.token"),
            SourceConfig::File { .. } | SourceConfig::Stdin { .. } => Ok(None),
        }
    }
}

impl AgentConfig {
    /// Parses a config from TOML text (no environment overrides), for tests and tools.
    pub fn parse(text: &str) -> anyhow::Result<AgentConfig> {
        use figment::providers::{Format, Toml};
        figment::Figment::new()
            .merge(Toml::string(text))
            .extract()
            .map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))
    }

    pub fn settings(&self, stream: &str) -> StreamSettings {
        self.streams.get(stream).cloned().unwrap_or_default()
    }
}

fn default_streams_dir() -> PathBuf {
    PathBuf::from("streams")
}
fn default_state_dir() -> PathBuf {
    PathBuf::from("edge-agent-state")
}
fn default_timeout_ms() -> u64 {
    30_000
}
fn default_min_upload_bytes_per_sec() -> u64 {
    // 16 kbit/s: a slow cellular link.
    2_000
}
fn default_max_backoff_ms() -> u64 {
    60_000
}
fn default_retry_statuses() -> Vec<u16> {
    BATCH_INDEPENDENT_REFUSALS.to_vec()
}
fn default_topic_prefix() -> String {
    schemas::wire::DEFAULT_TOPIC_PREFIX.to_owned()
}
fn default_dead_letter_topic() -> String {
    "ingest-dead-letters".into()
}
fn default_max_records() -> usize {
    50_000
}
fn default_true() -> bool {
    true
}

fn default_max_bytes() -> usize {
    1 << 20
}
fn default_max_line_bytes() -> usize {
    1 << 20
}
fn default_max_age_ms() -> u64 {
    1_000
}
fn default_zstd_level() -> i32 {
    3
}
fn default_dedupe_records() -> usize {
    1_000_000
}
fn default_dedupe_secs() -> u32 {
    86_400
}
fn default_spool_mb() -> u64 {
    256
}
fn default_rejected_mb() -> u64 {
    64
}
fn default_invalid_mb() -> u64 {
    16
}
fn default_segment_mb() -> u64 {
    8
}
fn default_fsync_interval_ms() -> u64 {
    1_000
}
fn default_poll_ms() -> u64 {
    250
}
fn default_mqtt_client_id() -> String {
    "edge-agent".to_owned()
}
fn default_qos() -> u8 {
    1
}
fn default_max_unacked() -> usize {
    20
}
fn default_http_max_body() -> usize {
    16 << 20
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    #[test]
    fn shipped_config_file_is_valid() {
        let file =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/edge-agent.toml");
        let c: super::AgentConfig =
            service_kit::load_config(Some(&file), "NO_SUCH_PREFIX_").unwrap();
        assert_eq!(c.batch.max_bytes, super::BatchConfig::default().max_bytes);
        c.validate(&schemas::example_streams()).unwrap();
        assert_eq!(c.gateway.unwrap().retry_statuses, [401, 403, 404]);
    }

    /// What `validate` says of a config with `output` (its `[gateway]` or `[kafka]` tables) and
    /// a stdin source: nothing when it is valid.
    fn problems(output: &str) -> String {
        super::AgentConfig::parse(&format!(
            "{output}\n[[sources]]\ntype = \"stdin\"\nstream = \"sensor_readings\"\n"
        ))
        .unwrap()
        .validate(&schemas::example_streams())
        .map_or_else(|e| e.to_string(), |()| String::new())
    }

    #[test]
    fn retry_statuses_are_4xx_only() {
        let with = |statuses: &str| {
            problems(&format!(
                "[gateway]\nurl = \"http://gw\"\nretry_statuses = {statuses}"
            ))
        };
        assert_eq!(with("[]"), "");
        assert_eq!(with("[401, 409]"), "");
        let e = with("[401, 503]");
        assert!(e.contains("gateway.retry_statuses holds 503"), "{e}");
    }

    #[test]
    fn kafka_security_is_checked_with_the_config() {
        let with = |security: &str| problems(&format!("[kafka]\nbrokers = \"k:9093\"\n{security}"));
        assert_eq!(with(""), "");
        assert_eq!(
            with("tls = {}\nsasl = { mechanism = \"PLAIN\", username = \"u\", password = \"p\" }"),
            ""
        );
        let e = with("sasl = { mechanism = \"SCRAM-SHA-256\", username = \"u\" }");
        assert!(e.contains("kafka: give one of kafka.sasl.password"), "{e}");
        let e = with("tls = { ca_file = \"/nonexistent/ca.pem\" }");
        assert!(e.contains("kafka: kafka.tls.ca_file"), "{e}");
    }

    #[test]
    fn the_gateway_proxy_is_checked_with_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("proxy-password");
        std::fs::write(&secret, "s3cret\n").unwrap();
        let with = |proxy: &str| {
            problems(&format!(
                "[gateway]\nurl = \"http://gw\"\n[gateway.proxy]\n{proxy}"
            ))
        };
        assert_eq!(
            with("url = \"http://proxy:3128\"\nno_proxy = \"gw.local,10.0.0.0/8\""),
            ""
        );
        assert_eq!(with("url = \"direct\""), "");
        let file = format!("password_file = {secret:?}");
        assert_eq!(
            with(&format!(
                "url = \"https://proxy:3129\"\nusername = \"edge\"\n{file}"
            )),
            ""
        );
        for (proxy, expected) in [
            ("url = \"socks5://proxy:1080\"", "give http://host:port"),
            ("url = \"proxy:3128\"", "give http://host:port"),
            (
                "url = \"http://proxy\"\nusername = \"u\"",
                "give one of gateway.proxy.password",
            ),
            (
                "url = \"http://proxy\"\npassword = \"p\"",
                "a password needs a username",
            ),
            ("url = \"http://u:hunter2@\"", "<not a URL>"),
            ("url = \"ftp://u:hunter2@proxy\"", "ftp://u:***@proxy"),
        ] {
            let e = with(proxy);
            assert!(
                e.contains("gateway: ") && e.contains(expected),
                "{proxy}: {e}"
            );
            assert!(!e.contains("hunter2"), "{proxy}: {e}");
        }
        let config = super::AgentConfig::parse(
            "[gateway]\nurl = \"http://gw\"\n[gateway.proxy]\nurl = \"http://u:hunter2@proxy\"\n\
             username = \"u\"\npassword = \"hunter2\"\n[[sources]]\ntype = \"stdin\"\n\
             stream = \"sensor_readings\"\n",
        )
        .unwrap();
        let shown = format!("{:?}", config.gateway.unwrap().proxy.unwrap());
        assert!(
            !shown.contains("hunter2") && shown.contains("u:***@proxy"),
            "{shown}"
        );
    }

    #[test]
    fn mqtt_topic_fields_are_checked_with_the_config() {
        let with = |pattern: &str| {
            super::AgentConfig::parse(&format!(
                "[gateway]\nurl = \"http://gw\"\n[[sources]]\ntype = \"mqtt\"\n\
                 url = \"mqtt://broker\"\ntopics = [\"plant/#\"]\nstream = \"sensor_readings\"\n\
                 topic_fields = \"{pattern}\"\n"
            ))
            .unwrap()
            .validate(&schemas::example_streams())
            .map_or_else(|e| e.to_string(), |()| String::new())
        };
        assert_eq!(with("plant/+/{device_id}/{sensor}"), "");
        let e = with("plant/{site}/{device_id}");
        assert!(
            e.contains("mqtt source: topic_fields") && e.contains("no field 'site'"),
            "{e}"
        );
    }

    #[test]
    fn a_sources_fields_are_checked_against_its_stream() {
        let with = |fields: &str| {
            problems(&format!(
                "[gateway]\nurl = \"http://gw\"\n[[sources]]\ntype = \"file\"\npath = \"x\"\n\
                 stream = \"sensor_readings\"\nfields = {fields}"
            ))
        };
        assert_eq!(with("{ device_id = \"press-07\", quality = 192 }"), "");
        for (fields, expected) in [
            ("{ site = \"x\" }", "site"),
            ("{ quality = \"good\" }", "quality"),
            ("{ device_id = 7 }", "device_id"),
        ] {
            let e = with(fields);
            assert!(
                e.contains("a source of stream 'sensor_readings': fields:") && e.contains(expected),
                "{fields}: {e}"
            );
        }
    }

    /// The error `validate` gives for an MQTT source with `url` and `tls`, and a gateway with
    /// `gateway_tls` (TOML inline tables).
    fn tls_problems(url: &str, tls: &str, gateway_tls: &str) -> String {
        super::AgentConfig::parse(&format!(
            "[gateway]\nurl = \"https://gw\"\ntls = {gateway_tls}\n\
             [[sources]]\ntype = \"mqtt\"\nurl = \"{url}\"\ntopics = [\"t\"]\n\
             stream = \"sensor_readings\"\ntls = {tls}\n"
        ))
        .unwrap()
        .validate(&schemas::example_streams())
        .map_or_else(|e| e.to_string(), |()| String::new())
    }

    #[test]
    fn tls_settings_are_checked_with_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let ca = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert, key, junk) = (
            dir.path().join("cert.pem"),
            dir.path().join("key.pem"),
            dir.path().join("junk.pem"),
        );
        std::fs::write(&cert, ca.cert.pem()).unwrap();
        std::fs::write(&key, ca.signing_key.serialize_pem()).unwrap();
        std::fs::write(&junk, "not a certificate").unwrap();
        let missing = dir.path().join("missing.pem");
        let good =
            format!("{{ ca_file = {cert:?}, client_cert = {cert:?}, client_key = {key:?} }}");
        assert_eq!(tls_problems("mqtts://broker", &good, &good), "");
        assert_eq!(tls_problems("mqtt://broker", "{}", "{}"), "");
        let cases = [
            (
                "mqtt://broker",
                format!("{{ ca_file = {cert:?} }}"),
                "need an mqtts:// url",
            ),
            (
                "mqtts://broker",
                format!("{{ ca_file = {missing:?} }}"),
                "missing.pem",
            ),
            (
                "mqtts://broker",
                format!("{{ ca_file = {junk:?} }}"),
                "holds no PEM certificate",
            ),
            (
                "mqtts://broker",
                format!("{{ ca_file = {cert:?}, client_cert = {cert:?} }}"),
                "give both tls.client_cert and tls.client_key",
            ),
            (
                "mqtts://broker",
                format!("{{ ca_file = {cert:?}, client_cert = {cert:?}, client_key = {cert:?} }}"),
                "cannot read a private key",
            ),
            ("ws://broker", "{}".to_owned(), "is not mqtt:// or mqtts://"),
        ];
        for (url, tls, expected) in cases {
            let e = tls_problems(url, &tls, "{}");
            assert!(e.contains(expected), "{url} {tls}: {e}");
        }
        let e = tls_problems("mqtt://broker", "{}", &format!("{{ ca_file = {junk:?} }}"));
        assert!(e.contains("gateway: ") && e.contains("junk.pem"), "{e}");
        let e = tls_problems(
            "mqtt://broker",
            "{}",
            &format!("{{ client_key = {key:?} }}"),
        );
        assert!(e.contains("give both"), "{e}");
        // The local port's certificate: readable, and the key is the certificate's.
        let other = rcgen::KeyPair::generate().unwrap();
        let other_key = dir.path().join("other-key.pem");
        std::fs::write(&other_key, other.serialize_pem()).unwrap();
        let local_with = |cert: &Path, key: &Path, more: &str| {
            super::AgentConfig::parse(&format!(
                "[gateway]\nurl = \"http://gw\"\n[[sources]]\ntype = \"http\"\n\
                 listen = \"127.0.0.1:0\"\ntls = {{ cert = {cert:?}, key = {key:?}{more} }}\n"
            ))
            .unwrap()
            .validate(&schemas::example_streams())
            .map_or_else(|e| e.to_string(), |()| String::new())
        };
        let local = |cert: &Path, key: &Path| local_with(cert, key, "");
        assert_eq!(local(&cert, &key), "");
        let e = local(&missing, &key);
        assert!(
            e.contains("http source") && e.contains("missing.pem"),
            "{e}"
        );
        let e = local(&cert, &other_key);
        assert!(e.contains("other-key.pem is not the key of"), "{e}");
        // Client certificates required: the CA file must hold certificates.
        let mtls = |ca: &Path| local_with(&cert, &key, &format!(", client_ca_file = {ca:?}"));
        assert_eq!(mtls(&cert), "");
        let e = mtls(&junk);
        assert!(e.contains("junk.pem holds no PEM certificate"), "{e}");
    }
}
