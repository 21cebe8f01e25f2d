//! `[table]`: which catalog the tables are in, how the sink commits to it and how it signs in.

use serde::Deserialize;
use service_kit::config::secret::Secret;

/// `[table]`: commit the landing files to Iceberg tables, one per stream, in a SQL or REST
/// catalog.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct TableConfig {
    /// The catalog: a SQLite file (created when missing), a `postgres://` URL, or the
    /// `http(s)://` URL of a REST catalog (the part before `/v1/`).
    pub catalog: String,
    /// The catalog's name in the catalog tables: what Spark, Trino or pyiceberg call it.
    #[serde(default = "default_catalog_name")]
    pub catalog_name: String,
    /// The namespace of the streams' tables; each table is named after its stream.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Landed files are committed at most this often (and at shutdown): one snapshot for all
    /// the files of an interval, not one per file.
    #[serde(default = "default_commit_interval")]
    pub commit_interval_ms: u64,
    /// How a table is partitioned when the sink creates it: by the `day` or `hour` of the
    /// ingest time (`_ingest_ts`), or not at all (`none`). An existing table keeps its spec.
    #[serde(default)]
    pub partition: Partitioning,
    /// `[table.compaction]`: the sink rewrites the small files of closed partitions into
    /// larger ones (off unless `enabled`).
    #[serde(default)]
    pub compaction: CompactionConfig,
    /// REST: the warehouse asked for in the catalog's configuration (`/v1/config?warehouse=`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warehouse: Option<String>,
    /// REST: a file holding a bearer token, read for every request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<String>,
    /// REST: a bearer token, better given by the environment (`SINK_TABLE__TOKEN`) than in the
    /// file; or `token_file`.
    #[serde(default, skip_serializing)]
    pub token: Option<Secret>,
    /// REST: a file holding OAuth2 client credentials, `client_id:client_secret`, exchanged for
    /// a token at `oauth2_uri`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_file: Option<String>,
    /// REST: OAuth2 client credentials, `client_id:client_secret`, better given by the
    /// environment (`SINK_TABLE__CREDENTIAL`) than in the file; or `credential_file`.
    #[serde(default, skip_serializing)]
    pub credential: Option<Secret>,
    /// REST: the token endpoint; `<catalog>/v1/oauth/tokens` when not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oauth2_uri: Option<String>,
    /// REST: the scope asked for with client credentials (Polaris wants
    /// `PRINCIPAL_ROLE:ALL`).
    #[serde(default = "default_scope")]
    pub oauth2_scope: String,
}

/// The partition spec of a new table: a transform of the ingest time. Each landing file holds
/// the records of one hour of ingest time, so each is in one partition of either; event time
/// is not a partition (a file holds many event days when data arrives late), but every file's
/// event-time bounds are in the manifests, which prunes as well for data that arrives in order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Partitioning {
    #[default]
    Day,
    Hour,
    None,
}

/// `[table.compaction]`: once a partition of the table (a day or an hour of ingest time) is
/// closed, the small files of each Kafka partition in it are rewritten into files of about
/// `target_bytes`, in one `replace` snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct CompactionConfig {
    /// Compact (default false).
    #[serde(default)]
    pub enabled: bool,
    /// The size a compacted file grows to at most; files of at least half this size are left
    /// as they are. A sink holds about one such file in memory while it writes it.
    #[serde(default = "default_compaction_target")]
    pub target_bytes: u64,
    /// How long after a partition's end (the end of its day or hour of ingest time) it counts
    /// as closed: longer than files take to land and be committed, so that late files of the
    /// partition are few.
    #[serde(default = "default_compaction_delay")]
    pub delay_ms: u64,
    /// How often the sink looks for closed partitions to compact.
    #[serde(default = "default_compaction_interval")]
    pub interval_ms: u64,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        CompactionConfig {
            enabled: false,
            target_bytes: default_compaction_target(),
            delay_ms: default_compaction_delay(),
            interval_ms: default_compaction_interval(),
        }
    }
}

fn default_compaction_target() -> u64 {
    64 << 20
}

fn default_compaction_delay() -> u64 {
    15 * 60_000
}

fn default_compaction_interval() -> u64 {
    5 * 60_000
}

fn default_catalog_name() -> String {
    "edge_ingest".into()
}

fn default_namespace() -> String {
    "landing".into()
}

fn default_scope() -> String {
    "catalog".into()
}

fn default_commit_interval() -> u64 {
    60_000
}

impl TableConfig {
    /// `[table]` with `catalog` and every other key at its default.
    pub fn new(catalog: String) -> TableConfig {
        TableConfig {
            catalog,
            catalog_name: default_catalog_name(),
            namespace: default_namespace(),
            commit_interval_ms: default_commit_interval(),
            partition: Partitioning::default(),
            compaction: CompactionConfig::default(),
            warehouse: None,
            token_file: None,
            token: None,
            credential_file: None,
            credential: None,
            oauth2_uri: None,
            oauth2_scope: default_scope(),
        }
    }

    /// Checks what can be checked without connecting.
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.catalog.is_empty(), "table.catalog is empty");
        for (key, value) in [
            ("catalog_name", &self.catalog_name),
            ("namespace", &self.namespace),
        ] {
            anyhow::ensure!(
                !value.is_empty() && value.len() <= 255 && !value.contains(char::is_control),
                "table.{key} must be 1 to 255 characters without control characters"
            );
        }
        anyhow::ensure!(
            self.commit_interval_ms >= 100,
            "table.commit_interval_ms must be at least 100"
        );
        anyhow::ensure!(
            self.compaction.target_bytes >= 1 << 20,
            "table.compaction.target_bytes must be at least 1 MiB"
        );
        anyhow::ensure!(
            self.compaction.interval_ms >= 100,
            "table.compaction.interval_ms must be at least 100"
        );
        if !is_rest(&self.catalog) {
            for (key, set) in [
                ("warehouse", self.warehouse.is_some()),
                ("token_file", self.token_file.is_some()),
                ("token", self.token.is_some()),
                ("credential_file", self.credential_file.is_some()),
                ("credential", self.credential.is_some()),
                ("oauth2_uri", self.oauth2_uri.is_some()),
            ] {
                anyhow::ensure!(
                    !set,
                    "table.{key} is for a REST catalog (an http:// or https:// table.catalog)"
                );
            }
        }
        Ok(())
    }
}

/// Whether `catalog` names a REST catalog (an `http://` or `https://` URL).
pub fn is_rest(catalog: &str) -> bool {
    catalog.starts_with("http://") || catalog.starts_with("https://")
}
