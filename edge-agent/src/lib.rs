//! The edge agent: reads records from sources, validates and dedupes them by content hash,
//! batches and zstd-compresses them and delivers them to the gateway.
//!
//! Each source runs its CPU work (parse, validate, hash, compress) on a blocking thread and
//! hands closed batches over a bounded channel to the async sender.

pub mod config;
pub mod pipeline;
pub mod sender;

use std::io::BufRead;
use std::sync::Arc;

use anyhow::Context;
use schemas::{StreamDef, Streams};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use config::AgentConfig;

use crate::config::{BatchConfig, SourceConfig};
use crate::pipeline::{Batch, Pipeline, PipelineStats};
use crate::sender::Sender;

/// Batches in flight between a source and the sender (each at most `batch.max_bytes`).
const QUEUED_BATCHES: usize = 4;

/// What a run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AgentStats {
    pub pipeline: PipelineStats,
    pub batches: u64,
    pub accepted: u64,
    pub gateway_duplicates: u64,
    pub gateway_rejected: u64,
    pub raw_bytes: u64,
    pub wire_bytes: u64,
}

impl AgentStats {
    pub fn merge(&mut self, other: &AgentStats) {
        let p = &other.pipeline;
        self.pipeline.read += p.read;
        self.pipeline.invalid += p.invalid;
        self.pipeline.duplicates += p.duplicates;
        self.pipeline.batched += p.batched;
        self.batches += other.batches;
        self.accepted += other.accepted;
        self.gateway_duplicates += other.gateway_duplicates;
        self.gateway_rejected += other.gateway_rejected;
        self.raw_bytes += other.raw_bytes;
        self.wire_bytes += other.wire_bytes;
    }

    fn add_batch(&mut self, batch: &Batch, response: &schemas::api::IngestResponse) {
        self.batches += 1;
        self.accepted += response.accepted as u64;
        self.gateway_duplicates += response.duplicates as u64;
        self.gateway_rejected += response.rejected.len() as u64;
        self.raw_bytes += batch.raw_bytes as u64;
        self.wire_bytes += batch.body.len() as u64;
    }
}

/// Runs every configured source to its end and delivers what it read.
pub async fn run(
    config: AgentConfig,
    streams: Streams,
    shutdown: CancellationToken,
) -> anyhow::Result<AgentStats> {
    let sender = Arc::new(Sender::new(&config.gateway)?);
    let mut total = AgentStats::default();
    for source in &config.sources {
        let (stream, reader): (&str, Box<dyn BufRead + Send>) = match source {
            SourceConfig::File { path, stream } => (
                stream,
                Box::new(std::io::BufReader::new(
                    std::fs::File::open(path)
                        .with_context(|| format!("cannot open {}", path.display()))?,
                )),
            ),
            SourceConfig::Stdin { stream } => {
                (stream, Box::new(std::io::BufReader::new(std::io::stdin())))
            }
        };
        let def = streams
            .get(stream)
            .with_context(|| format!("source refers to unknown stream '{stream}'"))?
            .clone();
        let stats = deliver_lines(
            reader,
            def,
            config.batch.clone(),
            config.dedupe_window,
            &sender,
            &shutdown,
        )
        .await?;
        total.merge(&stats);
    }
    Ok(total)
}

/// Reads NDJSON lines on a blocking thread, batches them and sends every batch.
pub async fn deliver_lines(
    reader: Box<dyn BufRead + Send>,
    def: Arc<StreamDef>,
    batch: BatchConfig,
    dedupe_window: usize,
    sender: &Sender,
    shutdown: &CancellationToken,
) -> anyhow::Result<AgentStats> {
    let (tx, rx) = mpsc::channel(QUEUED_BATCHES);
    let stream = def.name.clone();
    let reading = tokio::task::spawn_blocking(move || -> anyhow::Result<PipelineStats> {
        let mut pipeline = Pipeline::new(def, batch, dedupe_window);
        for (n, line) in reader.split(b'\n').enumerate() {
            let line = line?;
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match pipeline.push_line(&line) {
                Ok(Some(batch)) => {
                    if tx.blocking_send(batch).is_err() {
                        break;
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(stream = %stream, line = n + 1, error = %e, "invalid record skipped")
                }
            }
        }
        if let Some(batch) = pipeline.take_batch() {
            let _ = tx.blocking_send(batch);
        }
        Ok(pipeline.stats)
    });
    let mut stats = send_all(rx, sender, shutdown).await?;
    stats.pipeline = reading.await??;
    Ok(stats)
}

/// Sends batches from `rx` in order until the channel closes.
pub async fn send_all(
    mut rx: mpsc::Receiver<Batch>,
    sender: &Sender,
    shutdown: &CancellationToken,
) -> anyhow::Result<AgentStats> {
    let mut stats = AgentStats::default();
    while let Some(batch) = rx.recv().await {
        let response = sender.send(&batch, shutdown).await?;
        for r in &response.rejected {
            tracing::warn!(stream = %batch.stream, batch = %batch.id, index = r.index, reason = %r.reason, "gateway rejected a record");
        }
        stats.add_batch(&batch, &response);
    }
    Ok(stats)
}
