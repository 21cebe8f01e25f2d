//! Agent configuration: a TOML file plus `EDGE_AGENT_` environment overrides.

use std::path::PathBuf;

use serde::Deserialize;

/// Environment variables with this prefix override config keys (`__` separates nesting).
pub const ENV_PREFIX: &str = "EDGE_AGENT_";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// Directory of stream definitions (`<stream>.toml`).
    #[serde(default = "default_streams_dir")]
    pub streams_dir: PathBuf,
    pub gateway: GatewayTarget,
    #[serde(default)]
    pub batch: BatchConfig,
    /// Content hashes remembered to drop re-sent records (32 bytes + overhead each).
    #[serde(default = "default_dedupe_window")]
    pub dedupe_window: usize,
    /// Where records come from.
    pub sources: Vec<SourceConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayTarget {
    /// Base URL of the gateway, e.g. `http://gateway:8080`.
    pub url: String,
    /// Bearer token; none for a gateway that allows anonymous ingest.
    #[serde(default)]
    pub token: Option<String>,
    /// Timeout of one request, in milliseconds.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Attempts per batch before the agent gives up on the batch and stops.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
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
    /// zstd level of batch bodies (1-22).
    #[serde(default = "default_zstd_level")]
    pub zstd_level: i32,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_records: default_max_records(),
            max_bytes: default_max_bytes(),
            zstd_level: default_zstd_level(),
        }
    }
}

/// A source of records.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum SourceConfig {
    /// An NDJSON file, read once from the start.
    File { path: PathBuf, stream: String },
    /// NDJSON on standard input, until end of input.
    Stdin { stream: String },
}

fn default_streams_dir() -> PathBuf {
    PathBuf::from("streams")
}
fn default_dedupe_window() -> usize {
    1_000_000
}
fn default_timeout_ms() -> u64 {
    30_000
}
fn default_max_attempts() -> u32 {
    10
}
fn default_max_records() -> usize {
    50_000
}
fn default_max_bytes() -> usize {
    1 << 20
}
fn default_zstd_level() -> i32 {
    3
}

#[cfg(test)]
mod tests {
    #[test]
    fn shipped_config_file_is_valid() {
        let file =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/edge-agent.toml");
        let c: super::AgentConfig = plumbing::load_config(Some(&file), "NO_SUCH_PREFIX_").unwrap();
        assert_eq!(c.batch.max_bytes, super::BatchConfig::default().max_bytes);
        assert_eq!(c.sources.len(), 1);
    }
}
