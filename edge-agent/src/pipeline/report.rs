//! The reduction report of a stream's filters: in the pipeline's stats, as metrics, and in the
//! state directory, where `edge-agent status` reads it.

use std::path::Path;
use std::time::{Duration, Instant};

use super::Pipeline;
use crate::filter::Reduction;
use crate::metrics as m;

/// The reduction report of a stream's filters since the agent started, as `edge-agent status`
/// reads it from `<state_dir>/reduction/<stream>.json`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReductionReport {
    /// When the agent started (ms since the epoch).
    pub since_ms: u64,
    pub filters: Vec<Reduction>,
}

/// The file of a stream's reduction report.
pub fn reduction_path(state_dir: &Path, stream: &str) -> std::path::PathBuf {
    state_dir.join("reduction").join(format!("{stream}.json"))
}

/// The pipeline's side of the reduction report: what the filters replaced on a definition
/// change had done, what was last exported as metrics, and when it was last written.
pub(super) struct Reporter {
    /// Where the report is written ([`Pipeline::report_reductions_in`]); nowhere without.
    pub(super) path: Option<std::path::PathBuf>,
    pub(super) since_ms: u64,
    pub(super) base: Vec<Reduction>,
    pub(super) exported: Vec<Reduction>,
    pub(super) written: Option<Instant>,
}

/// `a` and `b` added, filter by filter (`b` alone where the filters differ).
pub(super) fn add_reductions(a: &[Reduction], b: Vec<Reduction>) -> Vec<Reduction> {
    if a.len() != b.len() || a.iter().zip(&b).any(|(a, b)| a.filter != b.filter) {
        return b;
    }
    a.iter()
        .zip(b)
        .map(|(a, b)| Reduction {
            readings_in: a.readings_in + b.readings_in,
            kept: a.kept + b.kept,
            max_deviation: match (a.max_deviation, b.max_deviation) {
                (Some(x), Some(y)) => Some(x.max(y)),
                (x, y) => x.or(y),
            },
            out_of_order: a.out_of_order + b.out_of_order,
            ..b
        })
        .collect()
}

impl Pipeline {
    /// Brings the reduction report up to date: in the stats, as metrics, and (at most once a
    /// second, and with `now`) in the state directory for `edge-agent status`.
    pub(super) fn report_reductions(&mut self, now: bool) {
        if self.filters.is_empty() && self.reporter.base.is_empty() {
            return;
        }
        let current = add_reductions(&self.reporter.base, self.filters.reductions());
        let before = std::mem::take(&mut self.reporter.exported);
        for (i, r) in current.iter().enumerate() {
            let was = before.get(i).filter(|b| b.filter == r.filter);
            let (was_in, was_kept, was_late) =
                was.map_or((0, 0, 0), |b| (b.readings_in, b.kept, b.out_of_order));
            let labels = [
                ("stream", self.def.name.clone()),
                ("filter", r.filter.clone()),
            ];
            metrics::counter!(m::FILTER_READINGS_IN, &labels)
                .increment(r.readings_in.saturating_sub(was_in));
            metrics::counter!(m::FILTER_READINGS_KEPT, &labels)
                .increment(r.kept.saturating_sub(was_kept));
            if let (Some(band), Some(deviation)) = (r.band, r.max_deviation) {
                metrics::gauge!(m::FILTER_BAND, &labels).set(band);
                metrics::gauge!(m::FILTER_MAX_DEVIATION, &labels).set(deviation);
                metrics::counter!(m::FILTER_OUT_OF_ORDER, &labels)
                    .increment(r.out_of_order.saturating_sub(was_late));
            }
        }
        self.reporter.exported = current.clone();
        self.stats.reductions = current;
        if !now
            && self
                .reporter
                .written
                .is_some_and(|at| at.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        self.reporter.written = Some(Instant::now());
        let report = ReductionReport {
            since_ms: self.reporter.since_ms,
            filters: self.stats.reductions.clone(),
        };
        if let Some(path) = &self.reporter.path
            && let Err(e) = write_atomically(path, &report)
        {
            tracing::debug!(path = %path.display(), error = %e, "cannot write the reduction report");
        }
    }
}

/// Writes `value` as JSON to `path` through a temporary file and a rename, so that a reader
/// never sees half of it.
fn write_atomically(path: &Path, value: &impl serde::Serialize) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(value)?)?;
    std::fs::rename(&tmp, path)
}
