//! Sink configuration: a TOML file plus `SINK_` environment overrides.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use schemas::Streams;
use schemas::arrow::HashColumn;
use serde::Deserialize;
use service_kit::kafka::security::Sasl;
use service_kit::tls::TlsFiles;

/// Environment variables with this prefix override config keys (`__` separates nesting).
pub const ENV_PREFIX: &str = "SINK_";

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    /// Directory of stream definitions (`<stream>.toml`).
    #[serde(default = "default_streams_dir")]
    pub streams_dir: PathBuf,
    /// The streams of `streams_dir` this sink lands: names or glob patterns (`*` any run of
    /// characters, `?` one character). Each entry must select at least one stream. Sinks with
    /// a group id of their own and a selection of their own split the streams between them,
    /// e.g. for rotation settings per stream or to keep a busy stream from delaying the others.
    #[serde(default = "default_streams")]
    pub streams: Vec<String>,
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    #[serde(default = "default_admin_listen")]
    pub admin_listen: SocketAddr,
    #[serde(default)]
    pub kafka: KafkaConfig,
    /// Where landing files go.
    #[serde(default)]
    pub store: StoreConfig,
    /// First component of every object key.
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    #[serde(default)]
    pub rotation: RotationConfig,
    #[serde(default)]
    pub landing: LandingConfig,
    /// Content hashes remembered per partition to drop re-sent records (0: none).
    #[serde(default = "default_dedupe_window")]
    pub dedupe_window: usize,
    /// Memory for the dedupe windows of all assigned partitions (at most 32 bytes per entry):
    /// when `dedupe_window` entries for each would need more, every partition's window is
    /// smaller, so that many partitions never mean running out of memory. 128 MiB holds
    /// 100,000 entries for each of up to 41 partitions, 65,536 for each of 64 and about 4,200
    /// for each of 1,000.
    #[serde(default = "default_dedupe_memory")]
    pub dedupe_memory_bytes: usize,
    /// Memory for open files across all partitions (rows not yet encoded and row groups in
    /// progress); past it the partition holding the most writes its row group to the staged
    /// file early, so many partitions never mean running out of memory (nor small files).
    #[serde(default = "default_memory_budget")]
    pub memory_budget_bytes: usize,
    #[serde(default)]
    pub upload: UploadConfig,
    /// What a partition does when the offset it gets from Kafka is past the one it needs next
    /// (the records between were deleted by retention before they were read, or the broker
    /// did not deliver them): `stop` there, or `skip` them with a note.
    #[serde(default)]
    pub on_offset_gap: OffsetGapPolicy,
    /// Commit the landing files to an Iceberg table per stream (absent: plain files only).
    #[serde(default)]
    pub table: Option<crate::table::config::TableConfig>,
    /// The schema registry of values in the registry wire format (absent: such values are dead
    /// letters).
    #[serde(default)]
    pub registry: Option<crate::registry::RegistryConfig>,
}

/// What a partition does at an offset gap: the records from the offset it needs next up to the
/// one it got are not in Kafka for it. Either way the gap is logged (ERROR, with the range),
/// counted and alerted on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OffsetGapPolicy {
    /// The partition lands and commits what came before the gap, then stops there (paused,
    /// the sink unready) until an operator decides: `skip` by a reload (SIGHUP) or restart
    /// lets it go on. Every sink that takes the partition over stops at the same offset.
    #[default]
    Stop,
    /// The partition notes the range in its dead letters (a line with `skipped_through`) and
    /// goes on with the first offset Kafka still holds.
    Skip,
}

impl OffsetGapPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            OffsetGapPolicy::Stop => "stop",
            OffsetGapPolicy::Skip => "skip",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadConfig {
    /// Open files are staged here before upload to S3 (a local store stages inside its own
    /// directory, in `.staging/`).
    #[serde(default = "default_staging_dir")]
    pub staging_dir: PathBuf,
    /// S3 files of at least this size go up as multipart uploads of parts of exactly this
    /// size (the last part may be shorter); at least 5 MiB, S3's minimum.
    #[serde(default = "default_part_bytes")]
    pub part_bytes: usize,
    /// Multipart uploads (and loose staged files of versions before staging folders) older
    /// than this are abandoned: a sink that crashed mid-upload left them. Swept at start and
    /// every hour.
    #[serde(default = "default_abandoned_after_hours")]
    pub abandoned_after_hours: u64,
    /// Disk for the staged files of all open files together; past it the file with the most on
    /// disk closes early (flush reason `staging_budget`), so many partitions with large file
    /// targets never fill the disk (the memory budget moves row groups to disk; this bounds
    /// the disk). 0: half of the staging file system's free space when the sink starts.
    #[serde(default)]
    pub staging_budget_bytes: u64,
}

impl Default for UploadConfig {
    fn default() -> Self {
        UploadConfig {
            staging_dir: default_staging_dir(),
            part_bytes: default_part_bytes(),
            abandoned_after_hours: default_abandoned_after_hours(),
            staging_budget_bytes: 0,
        }
    }
}

impl Default for SinkConfig {
    fn default() -> Self {
        SinkConfig {
            streams_dir: default_streams_dir(),
            streams: default_streams(),
            admin_listen: default_admin_listen(),
            kafka: KafkaConfig::default(),
            store: StoreConfig::default(),
            key_prefix: default_key_prefix(),
            rotation: RotationConfig::default(),
            landing: LandingConfig::default(),
            dedupe_window: default_dedupe_window(),
            dedupe_memory_bytes: default_dedupe_memory(),
            memory_budget_bytes: default_memory_budget(),
            upload: UploadConfig::default(),
            on_offset_gap: OffsetGapPolicy::default(),
            table: None,
            registry: None,
        }
    }
}

impl SinkConfig {
    /// The streams of `all` that [`SinkConfig::streams`] selects. Every entry must be a valid
    /// pattern that selects at least one stream: a misspelt name would otherwise land nothing
    /// without a word. All problems are reported together.
    /// The regular expression (librdkafka's, which a subscription starting with `^` is) of the
    /// topics of the selected streams, when the selection has glob patterns: the sink then
    /// subscribes by it and also reads the topics of streams defined after it started. `None`
    /// for a selection of names only, which subscribes by the list.
    pub fn topic_pattern(&self) -> Option<String> {
        let globbed = |entry: &String| entry.contains(['*', '?', '[']);
        if !self.streams.iter().any(globbed) {
            return None;
        }
        let escape = |text: &str| -> String {
            text.chars()
                .map(|c| match c {
                    c if c.is_ascii_alphanumeric() || c == '_' || c == '-' => c.to_string(),
                    c => format!("\\{c}"),
                })
                .collect()
        };
        let alternatives: Vec<String> = self
            .streams
            .iter()
            .map(|entry| {
                let mut regex = String::new();
                let mut class = false;
                for c in entry.chars() {
                    match c {
                        '[' => (class, regex) = (true, regex + "["),
                        ']' => (class, regex) = (false, regex + "]"),
                        '!' if class && regex.ends_with('[') => regex.push('^'),
                        c if class => regex.push(c),
                        '*' => regex.push_str(".*"),
                        '?' => regex.push('.'),
                        c => regex.push_str(&escape(&c.to_string())),
                    }
                }
                regex
            })
            .collect();
        Some(format!(
            "^{}({})$",
            escape(&self.kafka.topic_prefix),
            alternatives.join("|")
        ))
    }

    pub fn select_streams(&self, mut all: Streams) -> anyhow::Result<Streams> {
        let mut patterns = Vec::new();
        let mut problems = Vec::new();
        for entry in &self.streams {
            match glob::Pattern::new(entry) {
                Ok(p) if all.iter().any(|def| p.matches(&def.name)) => patterns.push(p),
                Ok(_) => problems.push(format!(
                    "'{entry}' selects none of the defined streams ({})",
                    all.iter()
                        .map(|def| def.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
                Err(e) => problems.push(format!("'{entry}' is not a glob pattern: {e}")),
            }
        }
        if self.streams.is_empty() {
            problems.push("the list is empty".into());
        }
        if !problems.is_empty() {
            anyhow::bail!("streams: {}", problems.join("; "));
        }
        all.retain(|def| patterns.iter().any(|p| p.matches(&def.name)));
        Ok(all)
    }
}

/// What landing files hold beyond the records' fields, for every stream and per stream.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LandingConfig {
    /// Bytes of each record's content hash kept in a `_content_hash` column: 0 (no column),
    /// 16 or 32. The hash can always be computed again from the row's fields.
    #[serde(default)]
    pub content_hash_bytes: HashBytes,
    /// Settings of single streams, by name, over the ones above.
    #[serde(default)]
    pub streams: BTreeMap<String, StreamLanding>,
}

/// [`LandingConfig`] for one stream.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamLanding {
    #[serde(default)]
    pub content_hash_bytes: Option<HashBytes>,
}

/// `content_hash_bytes`: 0, 16 or 32.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HashBytes(pub HashColumn);

impl<'de> Deserialize<'de> for HashBytes {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let bytes = u64::deserialize(deserializer)?;
        usize::try_from(bytes)
            .ok()
            .and_then(HashColumn::of_bytes)
            .map(HashBytes)
            .ok_or_else(|| {
                serde::de::Error::custom(format!("content_hash_bytes is 0, 16 or 32, not {bytes}"))
            })
    }
}

impl LandingConfig {
    /// The `_content_hash` column of `stream`'s landing files.
    pub fn hash_column(&self, stream: &str) -> HashColumn {
        self.streams
            .get(stream)
            .and_then(|s| s.content_hash_bytes)
            .unwrap_or(self.content_hash_bytes)
            .0
    }

    /// Fails when a stream setting names a stream this sink does not land (`selected`).
    pub fn check(&self, selected: &Streams) -> anyhow::Result<()> {
        let unknown: Vec<&str> = self
            .streams
            .keys()
            .filter(|name| selected.get(name).is_none())
            .map(String::as_str)
            .collect();
        anyhow::ensure!(
            unknown.is_empty(),
            "landing.streams names {} that this sink does not land",
            unknown.join(", ")
        );
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap servers, comma separated.
    #[serde(default = "default_brokers")]
    pub brokers: String,
    /// Consumer group; every sink process of one landing zone uses the same group.
    #[serde(default = "default_group_id")]
    pub group_id: String,
    /// Topic of a stream = prefix + stream name. The sink reads the topics of the streams it
    /// selects (`streams`).
    #[serde(default = "default_topic_prefix")]
    pub topic_prefix: String,
    /// The consumer group protocol: `classic` (JoinGroup and SyncGroup, every Kafka since 0.9;
    /// the default) or `consumer` (KIP-848: the brokers assign the partitions, Apache Kafka 4.0
    /// or later; its session timeout is the brokers' `group.consumer.session.timeout.ms`, so
    /// `session_timeout_ms` does not apply).
    #[serde(default)]
    pub group_protocol: GroupProtocol,
    /// How long a sink may be silent before the group gives its partitions to the others
    /// (librdkafka `session.timeout.ms`, classic protocol): the time a crashed sink's
    /// partitions stand still.
    #[serde(default = "default_session_timeout_ms")]
    pub session_timeout_ms: u64,
    /// Static group membership (librdkafka `group.instance.id`): a stable name per sink process
    /// (e.g. the pod name) lets a restarted sink take its partitions back without a rebalance.
    #[serde(default)]
    pub instance_id: Option<String>,
    /// Where a record's ingest time (`_ingest_ts`, and the hour folder of its file) comes from.
    #[serde(default)]
    pub ingest_time: IngestTime,
    /// TLS to the brokers: `tls = {}` trusts the platform's roots; `ca_file` a CA of its own;
    /// `client_cert` and `client_key` for brokers that require a client certificate.
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// SASL authentication: `{ mechanism = "SCRAM-SHA-512", username, password_file }`
    /// (or `password`, e.g. from `SINK_KAFKA__SASL__PASSWORD`).
    #[serde(default)]
    pub sasl: Option<Sasl>,
    /// Extra librdkafka consumer properties, set last (they win over the settings above).
    #[serde(default)]
    pub consumer: BTreeMap<String, String>,
}

/// The consumer group protocol of the sinks' group (librdkafka `group.protocol`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupProtocol {
    /// The classic protocol, which every Kafka-protocol broker serves. The sinks assign the
    /// partitions among themselves (cooperative sticky: only partitions that move change hands).
    #[default]
    Classic,
    /// KIP-848's protocol: the group coordinator assigns the partitions and members heartbeat
    /// their way to them, with no stop of the whole group. Needs Apache Kafka 4.0 or later (or
    /// a broker that serves `ConsumerGroupHeartbeat`).
    Consumer,
}

impl GroupProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            GroupProtocol::Classic => "classic",
            GroupProtocol::Consumer => "consumer",
        }
    }
}

/// Where the sink takes a record's ingest time from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IngestTime {
    /// The `ingest-ts` header that the gateway and the agent's Kafka output set (microseconds),
    /// else the message's Kafka timestamp, else the time the sink reads it.
    #[default]
    Header,
    /// The message's Kafka timestamp (milliseconds; librdkafka sets it when the gateway produces
    /// the record, or the broker when the topic uses `LogAppendTime`), else the time the sink
    /// reads it. The sink then never reads a message's headers: librdkafka parses all of them
    /// on the first look, 16% of the sink's instructions on the gateway's messages.
    Timestamp,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: default_brokers(),
            group_id: default_group_id(),
            topic_prefix: default_topic_prefix(),
            group_protocol: GroupProtocol::default(),
            session_timeout_ms: default_session_timeout_ms(),
            instance_id: None,
            ingest_time: IngestTime::default(),
            tls: None,
            sasl: None,
            consumer: BTreeMap::new(),
        }
    }
}

/// The object store backend.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum StoreConfig {
    /// A local directory: files are written to a temporary name, fsynced and linked into place.
    Local {
        /// Root directory of the landing zone.
        path: PathBuf,
    },
    /// S3 or an S3-compatible server. Credentials come from the usual AWS chain
    /// (environment, profile, instance role).
    S3 {
        bucket: String,
        /// Endpoint URL for S3-compatible servers (MinIO, moto); AWS when absent.
        #[serde(default)]
        endpoint: Option<String>,
        /// Region; from the AWS chain when absent, else `us-east-1`.
        #[serde(default)]
        region: Option<String>,
        /// Path-style addressing (`endpoint/bucket/key`), needed by most S3-compatible servers.
        #[serde(default)]
        force_path_style: bool,
        /// PEM certificates to trust for an `https://` endpoint instead of the platform's
        /// roots: an S3-compatible store with a certificate from the site's own CA.
        #[serde(default)]
        ca_file: Option<PathBuf>,
        /// Server-side encryption of the objects written: `AES256` (keys S3 manages),
        /// `aws:kms` or `aws:kms:dsse` (KMS: `kms_key_id`, else the account's S3 key). Buckets
        /// whose policy demands the header refuse objects without it. The bucket's default
        /// encryption when absent.
        #[serde(default)]
        server_side_encryption: Option<String>,
        /// KMS key (id, alias or ARN) for `aws:kms` / `aws:kms:dsse`.
        #[serde(default)]
        kms_key_id: Option<String>,
        /// Storage class of the objects written (`STANDARD_IA`, `INTELLIGENT_TIERING`, …);
        /// the bucket's default (`STANDARD`) when absent.
        #[serde(default)]
        storage_class: Option<String>,
    },
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig::Local {
            path: PathBuf::from("landing"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RotationConfig {
    /// Close a file after this many records.
    #[serde(default = "default_max_records")]
    pub max_records: usize,
    /// Close a file when its Parquet size reaches this many bytes (the target file size).
    #[serde(default = "default_max_bytes")]
    pub max_bytes: usize,
    /// Write a row group when its encoded size reaches this many bytes.
    #[serde(default = "default_row_group_bytes")]
    pub row_group_bytes: usize,
    /// Close a file when its partition received nothing for this many milliseconds.
    #[serde(default = "default_idle_ms")]
    pub idle_ms: u64,
    /// Close a file this many milliseconds after its first record was read, however steadily
    /// records keep coming: how late a record may land in the landing zone. 0: no limit (a
    /// file of a steady partition then closes at its size targets or the ingest-hour boundary).
    #[serde(default = "default_max_age_ms")]
    pub max_age_ms: u64,
    /// Close the open range (its file and its dead-letter object) when the dead letters it
    /// holds in memory reach this many bytes (each is a JSON line with the payload in hex), so
    /// that a producer writing garbage to a busy topic cannot fill the sink's memory before the
    /// range closes for another reason.
    #[serde(default = "default_max_dead_letter_bytes")]
    pub max_dead_letter_bytes: usize,
}

impl RotationConfig {
    /// `max_age_ms` as a duration, `None` when there is no limit.
    pub fn max_age(&self) -> Option<Duration> {
        (self.max_age_ms > 0).then(|| Duration::from_millis(self.max_age_ms))
    }
}

impl Default for RotationConfig {
    fn default() -> Self {
        RotationConfig {
            max_records: default_max_records(),
            max_bytes: default_max_bytes(),
            row_group_bytes: default_row_group_bytes(),
            idle_ms: default_idle_ms(),
            max_age_ms: default_max_age_ms(),
            max_dead_letter_bytes: default_max_dead_letter_bytes(),
        }
    }
}

fn default_max_dead_letter_bytes() -> usize {
    4 << 20
}

fn default_streams() -> Vec<String> {
    vec!["*".into()]
}
fn default_streams_dir() -> PathBuf {
    PathBuf::from("streams")
}
fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 9102))
}
fn default_brokers() -> String {
    "127.0.0.1:9092".into()
}
fn default_group_id() -> String {
    "landing-sink".into()
}
fn default_topic_prefix() -> String {
    schemas::wire::DEFAULT_TOPIC_PREFIX.into()
}
fn default_session_timeout_ms() -> u64 {
    10_000
}
fn default_key_prefix() -> String {
    "landing".into()
}
fn default_max_records() -> usize {
    1_000_000
}
fn default_max_bytes() -> usize {
    128 << 20
}
fn default_row_group_bytes() -> usize {
    16 << 20
}
fn default_staging_dir() -> PathBuf {
    std::env::temp_dir().join("edge-ingest-sink")
}
fn default_part_bytes() -> usize {
    16 << 20
}
fn default_abandoned_after_hours() -> u64 {
    24
}
fn default_idle_ms() -> u64 {
    60_000
}
fn default_max_age_ms() -> u64 {
    0
}
fn default_memory_budget() -> usize {
    256 << 20
}
fn default_dedupe_memory() -> usize {
    128 << 20
}
fn default_dedupe_window() -> usize {
    100_000
}

#[cfg(test)]
mod tests {
    #[test]
    fn shipped_config_file_is_valid() {
        let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/sink.toml");
        let c: super::SinkConfig =
            service_kit::load_config(Some(&file), "NO_SUCH_PREFIX_").unwrap();
        assert_eq!(
            c.rotation.max_bytes,
            super::RotationConfig::default().max_bytes
        );
        let defaults = super::SinkConfig::default();
        assert_eq!(c.dedupe_window, defaults.dedupe_window);
        assert_eq!(c.dedupe_memory_bytes, defaults.dedupe_memory_bytes);
        assert_eq!(c.memory_budget_bytes, defaults.memory_budget_bytes);
        assert_eq!(
            c.upload.staging_budget_bytes,
            defaults.upload.staging_budget_bytes
        );
    }

    fn select(entries: &[&str]) -> anyhow::Result<Vec<String>> {
        let c = super::SinkConfig {
            streams: entries.iter().map(|e| e.to_string()).collect(),
            ..super::SinkConfig::default()
        };
        let picked = c.select_streams(schemas::example_streams())?;
        Ok(picked.iter().map(|d| d.name.clone()).collect())
    }

    #[test]
    fn streams_are_selected_by_name_or_pattern() {
        assert_eq!(
            select(&["*"]).unwrap(),
            ["sensor_readings", "vehicle_telemetry"]
        );
        assert_eq!(select(&["vehicle_*"]).unwrap(), ["vehicle_telemetry"]);
        assert_eq!(
            select(&["sensor_readings", "vehicle_telemetr?"]).unwrap(),
            ["sensor_readings", "vehicle_telemetry"]
        );
        // Every problem at once: a name defined nowhere, a broken pattern, a pattern that
        // matches nothing.
        let e = select(&["sensor_reading", "[", "truck_*", "sensor_*"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("'sensor_reading' selects none"), "{e}");
        assert!(e.contains("'[' is not a glob pattern"), "{e}");
        assert!(e.contains("'truck_*' selects none"), "{e}");
        assert!(!e.contains("sensor_*"), "{e}");
        assert!(select(&[]).unwrap_err().to_string().contains("empty"));
    }

    #[test]
    fn dedupe_windows_share_their_memory() {
        let c = super::SinkConfig::default();
        let cap = |n| crate::window_capacity(&c, n);
        assert_eq!(cap(1), c.dedupe_window);
        assert_eq!(cap(41), 100_000);
        assert!(cap(42) < 100_000);
        assert_eq!(cap(64), 65_536);
        assert_eq!(cap(1_000), 4_194);
        // What the windows reserve stays within the memory, whatever the partition count.
        for n in [1, 41, 42, 64, 1_000] {
            let one = schemas::window::DigestWindow::new(cap(n), 0).memory_bytes();
            assert!(
                one * n <= c.dedupe_memory_bytes,
                "{n} partitions: {one} bytes each"
            );
        }
        let tiny = super::SinkConfig {
            dedupe_memory_bytes: 0,
            ..super::SinkConfig::default()
        };
        assert_eq!(crate::window_capacity(&tiny, 10), 1, "never none at all");
        let off = super::SinkConfig {
            dedupe_window: 0,
            ..super::SinkConfig::default()
        };
        assert_eq!(crate::window_capacity(&off, 10), 0, "turned off");
    }
}
