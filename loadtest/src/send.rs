//! `loadtest send`: a simulated fleet posting its readings to a running gateway, as edge agents
//! do: zstd NDJSON (or Parquet) batches, each with its BLAKE3 id as `Idempotency-Key`, retried
//! through the
//! agent's own HTTP output (backoff with jitter, `Retry-After`) until the gateway acknowledges
//! it. What was sent can be saved as NDJSON for `loadtest verify`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use edge_agent::batch::{Batch, BatchId, BodyEncoding};
use edge_agent::config::{BATCH_INDEPENDENT_REFUSALS, GatewayTarget};
use edge_agent::output::{Output, SendError};
use edge_agent::tls::TlsFiles;
use schemas::StreamDef;
use serde::Serialize;
use tokio::sync::{Mutex, mpsc};
use tokio_util::sync::CancellationToken;

use crate::fleet::{FleetSpec, Readings};

/// The stream the simulated fleet writes.
pub const STREAM: &str = "sensor_readings";
/// zstd level of the batches, the agent's default.
const ZSTD_LEVEL: i32 = 3;
/// How often progress is printed.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

#[derive(Debug, Clone)]
pub struct SendOptions {
    /// Base URL of the gateway.
    pub gateway: String,
    pub token: Option<String>,
    /// For an https:// gateway: PEM certificates to trust instead of the platform's roots, and
    /// a client certificate and key for a gateway that requires one.
    pub tls: TlsFiles,
    pub fleet: FleetSpec,
    /// Readings per batch.
    pub batch_records: usize,
    /// Body encoding of the batches.
    pub encoding: BodyEncoding,
    /// Batches in flight at once.
    pub concurrency: usize,
    /// Readings per second over all senders; 0 for as fast as the gateway takes them.
    pub rate: f64,
    /// Where the readings go as NDJSON, in the order they were generated; the first attempt
    /// of each acknowledged batch goes next to it ([`crate::verify::times_path`]), for `verify`
    /// to measure from send to landing.
    pub save: Option<PathBuf>,
    /// Timeout of one request.
    pub timeout: Duration,
}

/// What a run sent and what the gateway answered.
#[derive(Debug, Default, Serialize)]
pub struct SendSummary {
    /// Readings handed to the senders, re-sent duplicates included: all of them unless the run
    /// was interrupted.
    pub records: u64,
    /// Batches the gateway acknowledged.
    pub batches: u64,
    /// Records the gateway produced to Kafka (a copy re-sent in a later batch counts again:
    /// the sink drops it).
    pub accepted: u64,
    /// Records the gateway dropped as copies of others in the same request.
    pub duplicates: u64,
    /// Records the gateway rejected as invalid.
    pub rejected: u64,
    /// Batches refused for good (an answer that retrying cannot change, such as 401 or 413).
    pub refused_batches: u64,
    /// Whether the run was cut short (Ctrl-C).
    pub interrupted: bool,
    pub seconds: f64,
    pub records_per_s: f64,
    /// From a batch's first attempt to its acknowledgement, retries included.
    pub latency_ms: Latency,
    pub saved: Option<PathBuf>,
    /// The send times of the saved records' batches.
    pub saved_times: Option<PathBuf>,
}

pub use crate::verify::Latency;

/// An acknowledged batch of the save file: its first record (counted over the save file's
/// lines), its records and its first attempt in milliseconds since the Unix epoch.
type SentBatch = (u64, u64, u64);

#[derive(Default)]
struct Counts {
    records: AtomicU64,
    batches: AtomicU64,
    accepted: AtomicU64,
    duplicates: AtomicU64,
    rejected: AtomicU64,
    refused: AtomicU64,
}

/// Runs the fleet until every reading was acknowledged (or refused for good), or `shutdown`.
pub async fn run(opts: SendOptions, shutdown: CancellationToken) -> anyhow::Result<SendSummary> {
    let def = schemas::example_streams()
        .get(STREAM)
        .cloned()
        .context("the sensor_readings stream is missing")?;
    let output = Arc::new(Output::new(
        Some(&GatewayTarget {
            url: opts.gateway.clone(),
            token: opts.token.clone().map(Into::into),
            token_file: None,
            timeout_ms: opts.timeout.as_millis() as u64,
            // `--timeout` is the whole request's, as given.
            min_upload_bytes_per_sec: 0,
            max_backoff_ms: 10_000,
            // The run stops at the first of these instead (BATCH_INDEPENDENT_REFUSALS).
            retry_statuses: Vec::new(),
            tls: opts.tls.clone(),
            proxy: None,
        }),
        None,
    )?);
    let counts = Arc::new(Counts::default());
    let started = Instant::now();
    let (tx, rx) = mpsc::channel::<(Batch, u64)>(opts.concurrency.max(1) * 2);
    let rx = Arc::new(Mutex::new(rx));
    let mut senders = Vec::new();
    for _ in 0..opts.concurrency.max(1) {
        let (rx, output, def) = (rx.clone(), output.clone(), def.clone());
        let (counts, shutdown) = (counts.clone(), shutdown.clone());
        senders.push(tokio::spawn(async move {
            sender(rx, &output, &def, &counts, &shutdown).await
        }));
    }
    let progress = tokio::spawn(report_progress(
        counts.clone(),
        opts.fleet.records as u64,
        started,
    ));
    let generated = {
        let (opts, shutdown, def) = (opts.clone(), shutdown.clone(), def.clone());
        tokio::task::spawn_blocking(move || generate(&opts, &def, tx, started, &shutdown))
    };
    let generated = generated.await?;
    let (mut latencies, mut sent) = (Vec::new(), Vec::new());
    for s in senders {
        let (l, b) = s.await??;
        latencies.extend(l);
        sent.extend(b);
    }
    progress.abort();
    generated?;
    let saved_times = match &opts.save {
        Some(path) => {
            let times = crate::verify::times_path(path);
            crate::verify::SendTimes::write(&times, sent)?;
            Some(times)
        }
        None => None,
    };
    let seconds = started.elapsed().as_secs_f64();
    let records = counts.records.load(Ordering::Relaxed);
    Ok(SendSummary {
        records,
        batches: counts.batches.load(Ordering::Relaxed),
        accepted: counts.accepted.load(Ordering::Relaxed),
        duplicates: counts.duplicates.load(Ordering::Relaxed),
        rejected: counts.rejected.load(Ordering::Relaxed),
        refused_batches: counts.refused.load(Ordering::Relaxed),
        interrupted: shutdown.is_cancelled(),
        seconds,
        records_per_s: records as f64 / seconds.max(1e-9),
        latency_ms: Latency::of_ms(&mut latencies).unwrap_or_default(),
        saved: opts.save,
        saved_times,
    })
}

/// Generates the fleet's readings into batches (and the save file), paced to `opts.rate`.
fn generate(
    opts: &SendOptions,
    def: &StreamDef,
    tx: mpsc::Sender<(Batch, u64)>,
    started: Instant,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let mut save = match &opts.save {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?,
        )),
        None => None,
    };
    let mut readings = Readings::new(&opts.fleet).peekable();
    let mut queued = 0usize;
    let mut first_line = 0u64;
    while readings.peek().is_some() && !shutdown.is_cancelled() {
        let mut ndjson = Vec::new();
        let mut parsed = Vec::new();
        let mut records = 0u32;
        for reading in readings.by_ref().take(opts.batch_records.max(1)) {
            serde_json::to_writer(&mut ndjson, &reading)?;
            ndjson.push(b'\n');
            records += 1;
            if opts.encoding == BodyEncoding::Parquet {
                parsed.push(schemas::check(def, reading)?.record);
            }
        }
        if let Some(save) = &mut save {
            save.write_all(&ndjson)?;
        }
        if opts.rate > 0.0 {
            let due = started + Duration::from_secs_f64(queued as f64 / opts.rate);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        queued += records as usize;
        let body = match opts.encoding {
            BodyEncoding::Ndjson => zstd::bulk::compress(&ndjson, ZSTD_LEVEL)?,
            BodyEncoding::Parquet => schemas::columnar::encode_parquet(def, &parsed, ZSTD_LEVEL)?,
        };
        let batch = Batch {
            id: BatchId(*blake3::hash(&ndjson).as_bytes()),
            encoding: opts.encoding,
            body,
            records,
            raw_bytes: ndjson.len() as u32,
            created_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        };
        let first = first_line;
        first_line += u64::from(records);
        if tx.blocking_send((batch, first)).is_err() {
            // Every sender stopped (cancelled, or one failed and says why).
            break;
        }
    }
    if let Some(mut save) = save {
        save.flush()?;
    }
    Ok(())
}

/// Posts batches until the generator is done; returns each acknowledged batch's latency (ms)
/// and when it was first sent.
async fn sender(
    rx: Arc<Mutex<mpsc::Receiver<(Batch, u64)>>>,
    output: &Output,
    def: &Arc<StreamDef>,
    counts: &Counts,
    shutdown: &CancellationToken,
) -> anyhow::Result<(Vec<f64>, Vec<SentBatch>)> {
    let (mut latencies, mut sent) = (Vec::new(), Vec::new());
    let nobody = edge_agent::live::StreamLive::none();
    loop {
        let next = tokio::select! {
            batch = async { rx.lock().await.recv().await } => batch,
            _ = shutdown.cancelled() => None,
        };
        let Some((batch, first_line)) = next else {
            break;
        };
        let started = Instant::now();
        let sent_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        counts
            .records
            .fetch_add(u64::from(batch.records), Ordering::Relaxed);
        match output.send(def, &batch, shutdown, &nobody).await {
            Ok((answer, _)) => {
                latencies.push(started.elapsed().as_secs_f64() * 1e3);
                sent.push((first_line, u64::from(batch.records), sent_ms));
                counts.batches.fetch_add(1, Ordering::Relaxed);
                counts
                    .accepted
                    .fetch_add(answer.accepted as u64, Ordering::Relaxed);
                counts
                    .duplicates
                    .fetch_add(answer.duplicates as u64, Ordering::Relaxed);
                counts
                    .rejected
                    .fetch_add(answer.rejected.len() as u64, Ordering::Relaxed);
                if let Some(first) = answer.rejected.first() {
                    eprintln!(
                        "send: the gateway rejected {} records of batch {}, the first: {}",
                        answer.rejected.len(),
                        batch.id,
                        first.reason
                    );
                }
            }
            Err(SendError::Rejected { status, body }) => {
                counts.refused.fetch_add(1, Ordering::Relaxed);
                // A bad token or an unknown stream refuses every batch alike: stop.
                anyhow::ensure!(
                    !BATCH_INDEPENDENT_REFUSALS.contains(&status),
                    "the gateway refused a batch with {status}: {body}"
                );
                eprintln!(
                    "send: batch {} of {} records refused with {status}: {body}",
                    batch.id, batch.records
                );
            }
            Err(SendError::Cancelled) => break,
            Err(e) => return Err(e.into()),
        }
    }
    Ok((latencies, sent))
}

/// Prints a line of progress every few seconds until aborted.
async fn report_progress(counts: Arc<Counts>, total: u64, started: Instant) {
    let mut tick = tokio::time::interval(PROGRESS_EVERY);
    tick.tick().await;
    loop {
        tick.tick().await;
        let acked = counts.batches.load(Ordering::Relaxed);
        let records = counts.records.load(Ordering::Relaxed);
        let secs = started.elapsed().as_secs_f64();
        eprintln!(
            "send: {records} of {total} readings handed to senders, {acked} batches acknowledged, {:.0} readings/s",
            records as f64 / secs
        );
    }
}
