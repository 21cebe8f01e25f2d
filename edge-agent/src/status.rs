//! `edge-agent status`: what waits on this box, read from the state directory without changing
//! anything, also while the agent runs: per stream, the batches of its spool not yet delivered
//! (records, bytes, the oldest one's age) and the refused batches kept under `rejected/`; the
//! spool's and `rejected/`'s use of their limits; how far the file sources have read.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use axum::response::IntoResponse as _;
use serde::Serialize;

use crate::config::AgentConfig;
use crate::live::{Live, LiveStream};
use crate::pipeline::{ReductionReport, reduction_path};
use crate::rejected::RejectedDir;
use crate::source::file::{Positions, file_id};
use crate::spool::{self, Peek};

#[derive(Debug, Serialize)]
pub struct Status {
    pub state_dir: PathBuf,
    /// When it was read (ms since the epoch).
    pub now_ms: u64,
    /// When the agent serving it started (served by a running agent only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_ms: Option<u64>,
    pub spool_bytes: u64,
    pub spool_max_bytes: u64,
    pub rejected_bytes: u64,
    pub rejected_max_bytes: u64,
    pub streams: Vec<StreamStatus>,
    pub files: Vec<FileStatus>,
}

#[derive(Debug, Serialize)]
pub struct StreamStatus {
    pub stream: String,
    /// The spool: batches waiting for delivery.
    pub spool: Peek,
    /// Batches the receiver refused for good, kept under `rejected/`, and their records.
    pub rejected_batches: u64,
    pub rejected_records: u64,
    /// Bytes of records skipped as invalid, kept under `invalid/` to be tried again when the
    /// stream's definition changes.
    pub invalid_kept_bytes: u64,
    /// What the stream's filters did since the agent started (while it runs, as of the last
    /// second; after it stopped, its whole run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reduction: Option<ReductionReport>,
    /// What the running agent did with the stream since it started, its link's state and
    /// last error (served by a running agent only, for the streams it runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live: Option<LiveStream>,
}

#[derive(Debug, Serialize)]
pub struct FileStatus {
    pub path: PathBuf,
    /// How far the agent has read (and spooled) the file.
    pub read_bytes: u64,
    /// The file's size now; none when the path no longer holds the file that was read (rotated
    /// away or deleted: the agent finishes a rotated file it knows of at its next look).
    pub size_bytes: Option<u64>,
}

/// Reads the status of the agent whose config is `config`; with `live`, what the running
/// agent does too.
pub fn status(config: &AgentConfig, live: Option<&Live>) -> anyhow::Result<Status> {
    let mut running = live.map(Live::snapshot).unwrap_or_default();
    let state = &config.state_dir;
    let spool_root = state.join("spool");
    let rejected = RejectedDir::new(state.join("rejected"), config.spool.rejected_max_bytes());
    let kept = rejected.list_notes()?;
    let mut names: BTreeSet<String> = config
        .sources
        .iter()
        .filter_map(|s| s.stream().map(str::to_owned))
        .chain(config.streams.keys().cloned())
        .chain(kept.iter().map(|k| k.stream.clone()))
        .chain(running.keys().cloned())
        .collect();
    if let Ok(dirs) = std::fs::read_dir(&spool_root) {
        for dir in dirs.flatten() {
            if dir.path().is_dir() {
                names.extend(dir.file_name().to_str().map(str::to_owned));
            }
        }
    }
    let mut streams = Vec::new();
    for stream in names {
        let of_stream = kept.iter().filter(|k| k.stream == stream);
        let now = running.remove(&stream);
        // A running agent's reduction as of now, not as of the report's last write.
        let reduction = match (&now, live) {
            (Some(now), Some(live)) if !now.pipeline.reductions.is_empty() => {
                Some(ReductionReport {
                    since_ms: live.started_ms(),
                    filters: now.pipeline.reductions.clone(),
                })
            }
            _ => std::fs::read(reduction_path(state, &stream))
                .ok()
                .and_then(|json| serde_json::from_slice(&json).ok()),
        };
        streams.push(StreamStatus {
            spool: spool::peek(&spool_root, &stream)?,
            rejected_batches: of_stream.clone().count() as u64,
            invalid_kept_bytes: ["ndjson", "retrying"]
                .iter()
                .filter_map(|ext| {
                    std::fs::metadata(state.join("invalid").join(format!("{stream}.{ext}"))).ok()
                })
                .map(|m| m.len())
                .sum(),
            rejected_records: of_stream.map(|k| u64::from(k.batch.records)).sum(),
            reduction,
            live: now,
            stream,
        });
    }
    Ok(Status {
        state_dir: state.clone(),
        now_ms: crate::batch::now_ms(),
        started_ms: live.map(Live::started_ms),
        spool_bytes: streams.iter().map(|s| s.spool.disk_bytes).sum(),
        spool_max_bytes: config.spool.options().max_bytes,
        rejected_bytes: rejected.used()?,
        rejected_max_bytes: config.spool.rejected_max_bytes(),
        streams,
        files: files(state)?,
    })
}

fn files(state: &Path) -> anyhow::Result<Vec<FileStatus>> {
    let mut files: Vec<FileStatus> = Positions::load(state)?
        .entries()
        .into_iter()
        .map(|(id, path, read_bytes)| {
            let size_bytes = std::fs::metadata(&path)
                .ok()
                .filter(|m| file_id(m) == id)
                .map(|m| m.len());
            FileStatus {
                path,
                read_bytes,
                size_bytes,
            }
        })
        .collect();
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(files)
}

/// The agent's admin routes: `GET /status`, [`status`] with what the running agent does, as
/// JSON, read on the blocking pool (it reads the spool's segments), for a fleet's tooling where
/// no Prometheus scrapes the box; and `GET /`, the status page, which shows it to an operator
/// on the box and refreshes it live.
pub fn router(config: &AgentConfig, live: Arc<Live>) -> axum::Router {
    let config = Arc::new(config.clone());
    axum::Router::new()
        .route(
            "/status",
            axum::routing::get(move || {
                let (config, live) = (config.clone(), live.clone());
                async move {
                    match tokio::task::spawn_blocking(move || status(&config, Some(&live))).await {
                        Ok(Ok(status)) => axum::Json(status).into_response(),
                        Ok(Err(e)) => failed(format!("{e:#}")),
                        Err(e) => failed(e.to_string()),
                    }
                }
            }),
        )
        .route(
            "/",
            axum::routing::get(|| async {
                (
                    [
                        (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
                        (axum::http::header::CACHE_CONTROL, "no-store"),
                    ],
                    STATUS_PAGE,
                )
            }),
        )
}

/// The status page: one file, its script and style inline, nothing fetched but `/status`.
const STATUS_PAGE: &str = include_str!("status.html");

fn failed(message: String) -> axum::response::Response {
    let body = serde_json::json!({ "error": "status_failed", "message": message });
    (
        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        axum::Json(body),
    )
        .into_response()
}

/// `bytes` for people: B, KiB, MiB, GiB.
fn size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// An age for people: 42 s, 7 min, 3 h, 2 d.
fn age(ms: u64) -> String {
    let secs = ms / 1000;
    match secs {
        0..120 => format!("{secs} s"),
        120..7200 => format!("{} min", secs / 60),
        7200..172_800 => format!("{} h", secs / 3600),
        _ => format!("{} d", secs / 86_400),
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "state directory {}", self.state_dir.display())?;
        writeln!(
            f,
            "spool {} of {}; refused batches kept under rejected/ {} of {}",
            size(self.spool_bytes),
            size(self.spool_max_bytes),
            size(self.rejected_bytes),
            size(self.rejected_max_bytes)
        )?;
        writeln!(
            f,
            "{:<24} {:>9} {:>10} {:>11} {:>12} {:>8}",
            "stream", "waiting", "records", "bytes", "oldest", "refused"
        )?;
        for s in &self.streams {
            let oldest = s.spool.oldest_created_ms.map_or("-".to_owned(), |at| {
                format!("{} ago", age(self.now_ms.saturating_sub(at)))
            });
            writeln!(
                f,
                "{:<24} {:>9} {:>10} {:>11} {:>12} {:>8}",
                s.stream,
                s.spool.batches,
                s.spool.records,
                size(s.spool.body_bytes),
                oldest,
                s.rejected_batches
            )?;
            if s.invalid_kept_bytes > 0 {
                writeln!(
                    f,
                    "  {} of records skipped as invalid kept under invalid/ (tried again when \
                     the definition changes)",
                    size(s.invalid_kept_bytes)
                )?;
            }
            for r in s.reduction.iter().flat_map(|r| &r.filters) {
                let share = match r.readings_in {
                    0 => String::new(),
                    n => format!(" ({:.1}%)", 100.0 * r.kept as f64 / n as f64),
                };
                write!(
                    f,
                    "  filter {}: {} readings in, {} kept{share}",
                    r.filter, r.readings_in, r.kept
                )?;
                if let (Some(band), Some(deviation)) = (r.band, r.max_deviation) {
                    write!(f, "; largest deviation {deviation} of band {band}")?;
                }
                if r.out_of_order > 0 {
                    write!(f, "; {} out of order, passed on", r.out_of_order)?;
                }
                writeln!(f)?;
            }
            if s.spool.unread_bytes > 0 {
                writeln!(
                    f,
                    "  {} after the last whole batch (being written, or damage the next start \
                     quarantines)",
                    size(s.spool.unread_bytes)
                )?;
            }
        }
        if !self.files.is_empty() {
            writeln!(f, "{:<48} {:>11} {:>11}", "file", "read", "size")?;
            for file in &self.files {
                let now = file.size_bytes.map_or("rotated".to_owned(), size);
                let path = file.path.display().to_string();
                writeln!(f, "{path:<48} {:>11} {now:>11}", size(file.read_bytes))?;
            }
        }
        Ok(())
    }
}
