//! The CPU side of one stream, on a thread of its own: parse and validate, dedupe, filter, batch,
//! encode, spool. Sources hand it chunks of NDJSON; each chunk's `done` callback runs once every
//! record of the chunk is durable in the spool (or intentionally dropped), in chunk order. File
//! sources persist their read position there, MQTT sends its PUBACKs, HTTP answers.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[cfg(not(feature = "parquet"))]
use no_parquet::BodyBuilder;
use schemas::api::RejectedRecord;
#[cfg(feature = "parquet")]
use schemas::columnar::BodyBuilder;
use schemas::decode::ndjson_lines_in;
use schemas::wire::encode_value_into;
use schemas::{HashGroup, Hashed, Line, Pending, Record, Row, Scalars, StreamDef, ValidRecord};
use service_kit::{DefinitionFile, Reread};

use crate::batch::{Batch, BatchId, BodyEncoding, now_ms};
use crate::config::{BatchConfig, DedupeConfig, StreamSettings};
use crate::dedupe::{Digest, DigestLog, DigestWindow, digest};
use crate::filter::{FilterChain, FilterConfig, Kept, Reading};
use crate::invalid::KeptInvalid;
use crate::metrics as m;
use crate::spool::{Appended, Overflow, Spool, SpoolError};

/// A line as the pipeline checked it; its hash is the line's place in the group's
/// [`HashGroup`].
enum Checked {
    /// Without filters, into NDJSON batches: no record is built when the line may stand for it.
    Forward(Hashed<Pending>),
    /// Without filters, into Parquet batches: a line that stands for its record, whose values
    /// go into the columns from its text; the row's index among the group's rows. Kept apart
    /// and read in place: a row is about 530 bytes, and moved into the group and out again it
    /// took `memmove` from 6% to 15% of the Parquet worker's samples (9% kept apart).
    Row(usize),
    /// With filters: a line that stands for its record, whose scalar values the filters read
    /// and whose text they keep; its index among the group's scalars.
    Scalars(usize),
    /// The record, and whether the line may stand for it.
    Record(ValidRecord<Pending>, bool),
}

/// Lines checked before their digests are looked up in the window together (see
/// [`Pipeline::push_chunk`]).
const DEDUPE_GROUP: usize = 32;

/// Kept invalid records that pass when tried again go into the pipeline in chunks of this size
/// (a line source's), not all at once.
const RETRY_CHUNK_BYTES: usize = 256 * 1024;

/// How long a stopping pipeline still takes what its sources queued, waiting for them to stop
/// (they do within a poll interval; a source that does not is not waited for longer).
pub const STOP_GRACE: Duration = Duration::from_secs(2);

pub use crate::chunk::{Chunk, ChunkOutcome, Done};
use crate::live::StreamLive;
pub use crate::stats::PipelineStats;
pub use report::{ReductionReport, reduction_path};
use report::{Reporter, add_reductions};

#[derive(Default)]
struct Open {
    ndjson: Vec<u8>,
    /// The batch's records as Arrow columns, for a Parquet body.
    columns: Option<BodyBuilder>,
    count: u32,
    started: Option<Instant>,
    digests: Vec<Digest>,
    done: Vec<(Done, ChunkOutcome)>,
}

/// Allocates and frees a block of [`MMAP_THRESHOLD_BYTES`], once per pipeline. glibc's malloc
/// serves blocks from 128 KiB up with an `mmap` of their own until it frees such a block; then
/// that block's size becomes the threshold (mallopt(3), `M_MMAP_THRESHOLD`), and `unsafe` (which
/// `mallopt` needs) is forbidden here. Left to chance, the threshold stayed low or rose depending
/// on the heap's layout at start, and then every batch's buffer and every zstd context that the
/// parquet crate makes for a page were mapped and faulted in anew: bench-agent's worker took
/// 64,000 page faults on 1.5 M readings when started by its absolute path and 18,000 when
/// started by a relative one, 9,000 with this (most of them the dedupe window's first touch).
/// Other allocators ignore it.
fn raise_mmap_threshold() {
    drop(std::hint::black_box(Vec::<u8>::with_capacity(
        MMAP_THRESHOLD_BYTES,
    )));
}

/// See [`raise_mmap_threshold`]: above a batch's buffers and a page's zstd context.
const MMAP_THRESHOLD_BYTES: usize = 4 << 20;

/// Callbacks waiting for a sequence number to become durable (`None`: nothing to wait for).
type Waiting = VecDeque<(Option<u64>, Vec<(Done, ChunkOutcome)>)>;

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Spool(#[from] SpoolError),
    #[error("cannot encode a batch: {0}")]
    Encode(String),
}

/// The definition a stream runs with, shared by its pipeline, which replaces it when the
/// definition's file changes compatibly ([`Pipeline::follow_definition`]), and its delivery,
/// which decodes batches (the Kafka output) and names the stream with it.
#[derive(Clone)]
pub struct CurrentDef(Arc<std::sync::RwLock<Arc<StreamDef>>>);

impl CurrentDef {
    pub fn new(def: Arc<StreamDef>) -> CurrentDef {
        CurrentDef(Arc::new(std::sync::RwLock::new(def)))
    }

    pub fn get(&self) -> Arc<StreamDef> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The stream's name (it never changes).
    pub fn name(&self) -> String {
        self.get().name.clone()
    }

    fn set(&self, def: Arc<StreamDef>) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = def;
    }
}

pub struct Pipeline {
    def: Arc<StreamDef>,
    /// `def`, for the stream's delivery.
    current: CurrentDef,
    /// The file `def` was read from, looked at again when a record does not fit `def` in a way
    /// a newer definition may take ([`Pipeline::redefine`]); `None`: `def` is kept.
    definition: Option<DefinitionFile>,
    /// The filters' settings, to set them up again for a new definition whose fields moved.
    filter_configs: Vec<FilterConfig>,
    /// The definition's file holds a change that was refused: it is looked at again as chunks
    /// and ticks come, so that the refusal ends when the file is mended.
    refused: bool,
    /// Where invalid records are kept to be tried again ([`Pipeline::retry_kept`]); `None`:
    /// they are only counted.
    kept: Option<KeptInvalid>,
    batch: BatchConfig,
    encoding: BodyEncoding,
    overflow: Overflow,
    filters: FilterChain,
    window: DigestWindow,
    log: DigestLog,
    spool: Arc<Spool>,
    open: Open,
    waiting: Waiting,
    durable: u64,
    filtered_out: Vec<Kept>,
    /// The content hashes of a group of lines, made together.
    hashes: HashGroup,
    /// The spool dropped a batch while the current chunk was read.
    dropped_in_chunk: bool,
    invalid_logged: u64,
    /// Series the filters forgot so far (logged at the first and once per million).
    evicted_logged: u64,
    reporter: Reporter,
    /// Where the counters are published for `/status` ([`Pipeline::report_live`]).
    live: StreamLive,
    log_errors: u64,
    /// Compresses NDJSON batches, with the stream's dictionary when it has one.
    zstd: zstd::bulk::Compressor<'static>,
    /// Records in the last batch closed: the room a Parquet batch's columns start with.
    last_batch_records: usize,
    pub stats: PipelineStats,
}

pub fn now_secs() -> u32 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as u32)
        .unwrap_or(0)
}

impl Pipeline {
    /// Builds the pipeline of a stream. The dedupe window is loaded from the digest log in
    /// `state_dir` and from every batch still in the spool.
    pub fn new(
        def: Arc<StreamDef>,
        settings: &StreamSettings,
        batch: BatchConfig,
        dedupe: &DedupeConfig,
        spool: Arc<Spool>,
        state_dir: &Path,
    ) -> anyhow::Result<Pipeline> {
        raise_mmap_threshold();
        let filters = FilterChain::new(&def, &settings.filters).map_err(anyhow::Error::msg)?;
        let stateful = filters.stateful();
        if !stateful.is_empty() {
            tracing::info!(stream = %def.name, filters = ?stateful, "filter state starts afresh: the first reading of each series is kept");
        }
        let mut window = DigestWindow::new(dedupe.window_records, dedupe.window_secs);
        let now = now_secs();
        let path = state_dir.join(format!("{}.digests", def.name));
        let mut log = DigestLog::open(&path, &mut window, now)
            .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
        // The digests of spooled batches that the log lacks (the last run died between spooling
        // a batch and logging it) are logged now: once this run delivers such a batch, the
        // spool no longer holds it, and the next start would not know its records.
        for batch in spool.pending_batches()? {
            match batch.records(&def) {
                Ok(records) => records.iter().for_each(|r| {
                    let d = digest(&r.hash);
                    if window.insert(d, now) {
                        log.push(d, now);
                    }
                }),
                Err(e) => {
                    tracing::error!(stream = %def.name, batch = %batch.id, error = %e, "cannot rebuild the dedupe window from a spooled batch")
                }
            }
        }
        metrics::gauge!(m::DEDUPE_ENTRIES, "stream" => def.name.clone()).set(window.len() as f64);
        let zstd = match def.dictionaries.current().filter(|_| batch.zstd_dictionary) {
            Some(dictionary) => {
                tracing::info!(stream = %def.name, dictionary = dictionary.id(), "compressing NDJSON batches with the stream's zstd dictionary");
                zstd::bulk::Compressor::with_dictionary(batch.zstd_level, dictionary.bytes())
            }
            None => zstd::bulk::Compressor::new(batch.zstd_level),
        }?;
        let mut pipeline = Pipeline {
            encoding: settings.encoding.unwrap_or(batch.encoding),
            overflow: settings.overflow,
            current: CurrentDef::new(def.clone()),
            definition: None,
            filter_configs: settings.filters.clone(),
            refused: false,
            kept: None,
            def,
            batch,
            filters,
            window,
            log,
            spool,
            open: Open::default(),
            waiting: VecDeque::new(),
            durable: 0,
            filtered_out: Vec::new(),
            hashes: HashGroup::new(),
            dropped_in_chunk: false,
            invalid_logged: 0,
            evicted_logged: 0,
            reporter: Reporter {
                path: None,
                since_ms: now_ms(),
                base: Vec::new(),
                exported: Vec::new(),
                written: None,
            },
            live: StreamLive::none(),
            log_errors: 0,
            zstd,
            last_batch_records: 0,
            stats: PipelineStats::default(),
        };
        // Writes the digests queued above; a failure (a full disk) is not fatal, as in the run.
        // The spool makes them durable before it lets a batch go.
        pipeline.flush_log();
        pipeline.spool.sync_log_before_ack(pipeline.log.syncer());
        Ok(pipeline)
    }

    /// Takes compatible changes of the stream's definition in `file` from now on: a record that
    /// sets a field the definition lacks, or lacks a required one, makes the pipeline look at
    /// the file, and read it again if it changed ([`Pipeline::redefine`]). Before, such records
    /// were skipped as invalid until the agent restarted.
    pub fn follow_definition(mut self, file: DefinitionFile) -> Pipeline {
        self.definition = Some(file);
        self
    }

    /// Writes the filters' reduction report to `<state_dir>/reduction/<stream>.json` (at most
    /// once a second, and when the pipeline stops), for `edge-agent status` and `/status`. A
    /// report of an earlier run is removed first: it is not this run's.
    pub fn report_reductions_in(mut self, state_dir: &Path) -> Pipeline {
        let path = reduction_path(state_dir, &self.def.name);
        let _ = std::fs::remove_file(&path);
        self.reporter.path = Some(path);
        self
    }

    /// Publishes the pipeline's counters to `live` as it runs (after each chunk it takes,
    /// and when it stops).
    pub fn report_live(mut self, live: StreamLive) -> Pipeline {
        self.live = live;
        self
    }

    /// Keeps the records skipped as invalid in `kept`, and tries them again when the run starts
    /// and when the definition changes compatibly ([`Pipeline::retry_kept`]).
    pub fn keep_invalid(mut self, kept: KeptInvalid) -> Pipeline {
        metrics::gauge!(m::INVALID_KEPT_BYTES, "stream" => self.def.name.clone())
            .set(kept.bytes() as f64);
        self.kept = Some(kept);
        self
    }

    /// Tries the invalid records kept so far again under the definition in force: those that
    /// pass now are batched like any record (the dedupe window drops those already sent), those
    /// that still do not are kept again with their new reason. What passed is durable in the
    /// spool before the taken records are let go.
    fn retry_kept(&mut self, cancel: &AtomicBool) -> Result<(), PipelineError> {
        let Some(kept) = self.kept.as_mut().filter(|k| k.any()) else {
            return Ok(());
        };
        let stream = self.def.name.clone();
        let taken = match kept.take() {
            Ok(taken) => taken,
            Err(e) => {
                tracing::error!(stream, error = %e, "cannot take the kept invalid records to try them again");
                return Ok(());
            }
        };
        let (mut data, mut passed, mut still, mut lost) = (Vec::new(), 0u64, 0u64, 0u64);
        for k in taken {
            let line = k.bytes();
            let Some(kept) = self.kept.as_mut() else {
                break;
            };
            match schemas::check_bytes(&self.def, &line) {
                Ok(_) => {
                    data.extend_from_slice(&line);
                    data.push(b'\n');
                    passed += 1;
                }
                Err(e) => {
                    still += 1;
                    if !kept.keep(&line, &e.to_string(), k.at_ms) {
                        lost += 1;
                    }
                }
            }
            // In chunks of a line source's size, so that a large `invalid/` file is not held
            // in memory whole.
            if data.len() >= RETRY_CHUNK_BYTES {
                self.push_chunk(Chunk::new(std::mem::take(&mut data), None), cancel)?;
            }
        }
        self.not_kept(lost);
        tracing::info!(
            stream,
            passed,
            still,
            "invalid records kept earlier tried again"
        );
        self.stats.retried += passed;
        metrics::counter!(m::INVALID_RETRIED, "stream" => stream).increment(passed);
        if !data.is_empty() {
            self.push_chunk(Chunk::new(data, None), cancel)?;
        }
        self.close_batch(cancel)?;
        self.sync(true)?;
        if let Some(kept) = self.kept.as_mut()
            && let Err(e) = kept.tried()
        {
            tracing::error!(stream = %self.def.name, error = %e, "cannot end a try of the kept invalid records; they are tried again");
        }
        Ok(())
    }

    fn not_kept(&self, n: u64) {
        metrics::counter!(m::INVALID_NOT_KEPT, "stream" => self.def.name.clone()).increment(n);
    }

    /// The definition in force, shared with the stream's delivery.
    pub fn current(&self) -> CurrentDef {
        self.current.clone()
    }

    /// Whether a record that does not fit the definition should make the pipeline read the
    /// definition's file again: it changed since it was read (a `stat`).
    fn definition_changed(&self) -> bool {
        self.definition
            .as_ref()
            .is_some_and(DefinitionFile::changed)
    }

    /// Reads the definition's file again; a compatible change (see [`schemas::Change`]) is put
    /// in force. The open batch closes first (a batch's records have one definition's fields),
    /// and the filters keep their state unless fields moved (their positions are read anew then,
    /// and their series start over). An incompatible change is refused and logged, until a
    /// restart.
    fn redefine(&mut self, cancel: &AtomicBool) -> Result<(), PipelineError> {
        let Some(file) = self.definition.as_mut() else {
            return Ok(());
        };
        let reread = file.reread(&self.def);
        self.refused = matches!(reread, Reread::Refused);
        metrics::gauge!(m::DEFINITION_REFUSED, "stream" => self.def.name.clone())
            .set(if self.refused { 1.0 } else { 0.0 });
        let Reread::Compatible(def) = reread else {
            return Ok(());
        };
        let def = Arc::new(*def);
        let moved = self
            .def
            .fields
            .iter()
            .zip(&def.fields)
            .any(|(old, new)| old.name != new.name);
        let filters = match moved
            .then(|| FilterChain::new(&def, &self.filter_configs))
            .transpose()
        {
            Ok(filters) => filters,
            Err(e) => {
                tracing::error!(stream = %self.def.name, error = %e, "the filters do not fit the new definition; it is not taken");
                return Ok(());
            }
        };
        if let Some(filters) = filters {
            // What the old filters hold back goes out under the old definition.
            self.flush_filters(true, cancel)?;
            self.reporter.base = add_reductions(&self.reporter.base, self.filters.reductions());
            self.filters = filters;
            tracing::warn!(stream = %self.def.name, "fields moved in the new definition: the filters start over");
        }
        self.close_batch(cancel)?;
        self.current.set(def.clone());
        self.def = def;
        self.retry_kept(cancel)
    }

    /// Reads a refused definition's file again once it changed, so that the refusal (and its
    /// gauge) ends when the file is mended, not at the next record that needs it.
    fn recheck_refused(&mut self, cancel: &AtomicBool) -> Result<(), PipelineError> {
        if self.refused && self.definition_changed() {
            self.redefine(cancel)?;
        }
        Ok(())
    }

    pub fn dedupe_memory_bytes(&self) -> usize {
        self.window.memory_bytes()
    }

    /// Runs until every sender of `rx` is gone, then closes the open batch and waits for it to be
    /// durable. Once `cancel` is set, the sources stop, and what they queued until then is still
    /// taken (stdin cannot be read again) for at most [`STOP_GRACE`]. Stops early (leaving the
    /// open batch to be read again) if the spool is full under `block` while `cancel` is set.
    pub fn run(
        mut self,
        rx: Receiver<Chunk>,
        cancel: &AtomicBool,
    ) -> Result<PipelineStats, PipelineError> {
        let max_age = Duration::from_millis(self.batch.max_age_ms.max(1));
        let tick = max_age.min(Duration::from_millis(200));
        let mut stop_by: Option<Instant> = None;
        // A definition changed while the agent was down: what was kept may pass now.
        self.retry_kept(cancel)?;
        loop {
            if stop_by.is_none() && cancel.load(std::sync::atomic::Ordering::Relaxed) {
                stop_by = Some(Instant::now() + STOP_GRACE);
            }
            if stop_by.is_some_and(|by| Instant::now() >= by) {
                // A source that has not stopped: what it queued will be read again (files),
                // delivered again (MQTT) or answered 503 (HTTP).
                break;
            }
            let wait = match self.open.started {
                Some(t) => (t + max_age)
                    .saturating_duration_since(Instant::now())
                    .min(tick),
                None => tick,
            };
            match rx.recv_timeout(wait) {
                Ok(chunk) => self.push_chunk(chunk, cancel)?,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if self.open.started.is_some_and(|t| t.elapsed() >= max_age) {
                self.close_batch(cancel)?;
            }
            self.flush_filters(false, cancel)?;
            self.sync(false)?;
            self.recheck_refused(cancel)?;
            self.report_reductions(false);
            self.live.pipeline(&self.stats);
        }
        self.flush_filters(true, cancel)?;
        self.close_batch(cancel)?;
        self.sync(true)?;
        self.report_reductions(true);
        self.live.pipeline(&self.stats);
        for r in &self.stats.reductions {
            tracing::info!(
                stream = %self.def.name,
                filter = r.filter,
                readings_in = r.readings_in,
                kept = r.kept,
                band = r.band,
                max_deviation = r.max_deviation,
                out_of_order = r.out_of_order,
                "filter reduction"
            );
        }
        Ok(self.stats)
    }

    /// Parses, dedupes, filters and batches the records of one chunk.
    pub fn push_chunk(&mut self, chunk: Chunk, cancel: &AtomicBool) -> Result<(), PipelineError> {
        let now = now_secs();
        let mut outcome = ChunkOutcome::default();
        self.dropped_in_chunk = false;
        let (mut read, mut invalid, mut duplicates) = (0u64, 0u64, 0u64);
        // Without filters, NDJSON batches need no record of a line that may stand for itself.
        let forward = self.filters.is_empty() && self.encoding == BodyEncoding::Ndjson;
        // Without filters, Parquet batches take a line that stands for its record as a row.
        let rows = self.filters.is_empty() && self.encoding == BodyEncoding::Parquet;
        // With filters, such a line is read for its scalar values and kept as its text.
        let filtered = !self.filters.is_empty();
        // Lines are checked a group at a time, the group's content hashes made together
        // ([`HashGroup`]) and its window buckets loaded together ([`DigestWindow::prefetch`])
        // before the group is deduplicated and batched.
        let mut group: Vec<(&[u8], Checked)> = Vec::with_capacity(DEDUPE_GROUP);
        let mut group_rows: Vec<Row<'_, Pending>> = Vec::new();
        let mut group_scalars: Vec<Scalars<'_, Pending>> = Vec::new();
        let mut digests: Vec<Digest> = Vec::with_capacity(DEDUPE_GROUP);
        let mut lines = ndjson_lines_in(&chunk.data).enumerate().peekable();
        // A line that a newer definition may take: checked again after the group before it is
        // batched and the definition read again.
        let mut again: Option<(usize, Line<'_>)> = None;
        while lines.peek().is_some() || again.is_some() {
            for (index, in_chunk) in again
                .take()
                .into_iter()
                .chain(lines.by_ref())
                .take(DEDUPE_GROUP)
            {
                let line = in_chunk.bytes();
                // The common case reads the line in the chunk ([`Line`]).
                if forward
                    && let Some(place) =
                        schemas::forwardable_hash_in(&self.def, in_chunk, &mut self.hashes)
                {
                    // The common case, stored straight into the group. Taken from the full
                    // check's result, which is returned through memory, the place was read back
                    // within a 16-byte copy of it, a load the CPU cannot forward from the
                    // narrower store: `push_chunk` had 5.3% of the samples, now 3.0% (perf).
                    read += 1;
                    group.push((
                        line,
                        Checked::Forward(Hashed {
                            hash: place,
                            canonical: None,
                        }),
                    ));
                    continue;
                }
                if rows
                    && let Some(row) =
                        schemas::verbatim_row_in(&self.def, in_chunk, &mut self.hashes)
                {
                    // Its values go into the columns without a record being built (an
                    // allocation for its values and one for its map's entries, each string
                    // copied, and the entries sorted).
                    read += 1;
                    group.push((line, Checked::Row(group_rows.len())));
                    group_rows.push(row);
                    continue;
                }
                if filtered
                    && let Some(scalars) =
                        schemas::verbatim_scalars_in(&self.def, in_chunk, &mut self.hashes)
                {
                    read += 1;
                    group.push((line, Checked::Scalars(group_scalars.len())));
                    group_scalars.push(scalars);
                    continue;
                }
                let checked = if forward {
                    schemas::check_bytes_hashed_in(&self.def, line, &mut self.hashes)
                        .map(Checked::Forward)
                } else {
                    schemas::check_bytes_verbatim_in(&self.def, line, &mut self.hashes)
                        .map(|(valid, verbatim)| Checked::Record(valid, verbatim))
                };
                let checked = match checked {
                    Ok(checked) => checked,
                    Err(e) if e.newer_definition_may_take() && self.definition_changed() => {
                        again = Some((index, in_chunk));
                        break;
                    }
                    Err(e) => {
                        read += 1;
                        invalid += 1;
                        if let Some(kept) = self.kept.as_mut()
                            && !kept.keep(line, &e.to_string(), now_ms())
                        {
                            self.not_kept(1);
                        }
                        self.invalid_logged += 1;
                        if self.invalid_logged <= 10 || self.invalid_logged.is_multiple_of(1000) {
                            tracing::warn!(stream = %self.def.name, index, error = %e, total = self.invalid_logged, "invalid record skipped");
                        }
                        outcome.rejected.push(RejectedRecord {
                            index,
                            reason: e.to_string(),
                        });
                        continue;
                    }
                };
                read += 1;
                group.push((line, checked));
            }
            self.hashes.finish();
            digests.extend(group.iter().map(|(_, checked)| {
                digest(&self.hashes.get(match checked {
                    Checked::Forward(f) => f.hash,
                    Checked::Row(k) => group_rows[*k].hash,
                    Checked::Scalars(k) => group_scalars[*k].hash,
                    Checked::Record(valid, _) => valid.hash,
                }))
            }));
            self.hashes.clear();
            self.window.prefetch(&digests);
            for ((line, checked), d) in group.drain(..).zip(digests.drain(..)) {
                if !self.window.insert(d, now) {
                    duplicates += 1;
                    continue;
                }
                self.open.digests.push(d);
                outcome.accepted += 1;
                match checked {
                    Checked::Forward(f) => self.add_forward(f.canonical.as_ref(), line, cancel)?,
                    Checked::Row(k) => self.add_row(&group_rows[k], line, cancel)?,
                    Checked::Scalars(k) => {
                        self.filter(Reading::Line(&group_scalars[k], line), cancel)?;
                    }
                    // The line itself goes into the batch when it is a plain object of the
                    // stream's keys (as the gateway forwards it): re-encoding it would only cost
                    // time.
                    Checked::Record(valid, verbatim) if self.filters.is_empty() => {
                        self.add(valid.record, verbatim.then_some(line), cancel)?;
                    }
                    Checked::Record(valid, _) => {
                        self.filter(Reading::record(valid.record), cancel)?;
                    }
                }
            }
            group_rows.clear();
            group_scalars.clear();
            if again.is_some() {
                self.redefine(cancel)?;
            }
        }
        outcome.duplicates = duplicates as usize;
        self.stats.read += read;
        self.stats.invalid += invalid;
        self.stats.duplicates += duplicates;
        let labels = [("stream", self.def.name.clone())];
        metrics::counter!(m::RECORDS_RECEIVED, &labels).increment(read);
        metrics::counter!(m::RECEIVED_BYTES, &labels).increment(chunk.data.len() as u64);
        self.discarded("invalid", false, invalid);
        self.discarded("duplicate", true, duplicates);
        // A batch that closed while this chunk was read holds some of its records but not its
        // callback (that waits on the batch of the chunk's last record).
        outcome.spool_dropped = self.dropped_in_chunk;
        if let Some(done) = chunk.done {
            self.open.done.push((done, outcome));
        }
        if let Some(spares) = chunk.spares {
            // (The group's lines are slices of the chunk.)
            drop((lines, group, group_rows, group_scalars));
            spares.give(chunk.data);
        }
        if chunk.flush || (self.open.count == 0 && !self.open.done.is_empty()) {
            // Nothing left to spool for these chunks (all filtered or duplicates).
            self.close_batch(cancel)?;
        }
        Ok(())
    }

    fn discarded(&self, reason: &'static str, intentional: bool, n: u64) {
        if n > 0 {
            metrics::counter!(m::DISCARDED, "stream" => self.def.name.clone(), "reason" => reason, "intentional" => if intentional { "true" } else { "false" }).increment(n);
        }
    }

    /// Runs a reading through the filters and adds what they pass on to the open batch.
    fn filter<H>(
        &mut self,
        reading: Reading<'_, '_, H>,
        cancel: &AtomicBool,
    ) -> Result<(), PipelineError> {
        let mut out = std::mem::take(&mut self.filtered_out);
        self.filters.apply(&self.def, reading, &mut out);
        let added = out
            .drain(..)
            .try_for_each(|kept| self.add_kept(kept, cancel));
        self.filtered_out = out;
        added
    }

    /// Adds a reading the filters passed on to the open batch: a record, or a line's text,
    /// which stands for its record in the batch's text (a Parquet batch scans it again for its
    /// columns).
    fn add_kept(&mut self, kept: Kept, cancel: &AtomicBool) -> Result<(), PipelineError> {
        let text = match kept {
            Kept::Record(record) => return self.add(record, None, cancel),
            Kept::Line(text) => text,
        };
        if self.encoding == BodyEncoding::Parquet {
            match schemas::check_bytes_row(&self.def, &text) {
                Ok(row) => self.columns().push_row(&row),
                Err(e) => {
                    // Held across a change of the stream's definition that it does not fit.
                    tracing::error!(stream = %self.def.name, error = %e, "a reading the filters held no longer fits the stream's definition; it is dropped");
                    self.discarded("invalid", false, 1);
                    return Ok(());
                }
            }
        }
        self.add_forward(None, &text, cancel)
    }

    /// Adds a record to the open batch: `verbatim` is its JSON text when that may stand for it
    /// ([`schemas::check_bytes_verbatim`]); otherwise it is encoded canonically.
    fn add(
        &mut self,
        record: Record,
        verbatim: Option<&[u8]>,
        cancel: &AtomicBool,
    ) -> Result<(), PipelineError> {
        match verbatim {
            Some(text) => self.open.ndjson.extend_from_slice(text.trim_ascii()),
            None => encode_value_into(&self.def, &record, &mut self.open.ndjson),
        }
        self.open.ndjson.push(b'\n');
        if self.encoding == BodyEncoding::Parquet {
            self.columns().push(&record);
        }
        self.added(cancel)
    }

    /// Adds a checked row to an open Parquet batch; its text `line` stands for it in the
    /// batch's NDJSON text.
    fn add_row(
        &mut self,
        row: &Row<'_, Pending>,
        line: &[u8],
        cancel: &AtomicBool,
    ) -> Result<(), PipelineError> {
        self.columns().push_row(row);
        self.add_forward(None, line, cancel)
    }

    /// The open batch's columns, made with room for as many records as the last batch had
    /// (batches of a stream are alike).
    fn columns(&mut self) -> &mut BodyBuilder {
        let capacity = self.last_batch_records;
        self.open
            .columns
            .get_or_insert_with(|| BodyBuilder::new(&self.def, capacity))
    }

    /// Adds a record's NDJSON text to the open batch (an NDJSON batch's body, or the text a
    /// Parquet batch's id is made from): its text `line` when that may stand for it
    /// (`canonical` is `None`, see [`schemas::check_bytes_forward`]), otherwise `canonical`
    /// encoded.
    fn add_forward(
        &mut self,
        canonical: Option<&Record>,
        line: &[u8],
        cancel: &AtomicBool,
    ) -> Result<(), PipelineError> {
        match canonical {
            None => self.open.ndjson.extend_from_slice(line.trim_ascii()),
            Some(record) => encode_value_into(&self.def, record, &mut self.open.ndjson),
        }
        self.open.ndjson.push(b'\n');
        self.added(cancel)
    }

    /// Counts the record just added to the open batch, and closes the batch when full.
    fn added(&mut self, cancel: &AtomicBool) -> Result<(), PipelineError> {
        self.open.count += 1;
        self.open.started.get_or_insert_with(Instant::now);
        if self.open.count as usize >= self.batch.max_records
            || self.open.ndjson.len() >= self.batch.max_bytes
        {
            self.close_batch(cancel)?;
        }
        Ok(())
    }

    fn flush_filters(&mut self, all: bool, cancel: &AtomicBool) -> Result<(), PipelineError> {
        if self.filters.is_empty() {
            return Ok(());
        }
        let mut out = Vec::new();
        self.filters.flush(&self.def, all, &mut out);
        out.into_iter()
            .try_for_each(|kept| self.add_kept(kept, cancel))
    }

    /// Encodes and spools the open batch; queues its chunks' callbacks until it is durable.
    fn close_batch(&mut self, cancel: &AtomicBool) -> Result<(), PipelineError> {
        let open = std::mem::take(&mut self.open);
        for (kind, n) in self.filters.take_dropped() {
            self.stats.filtered += n;
            self.discarded(kind, true, n);
        }
        self.report_reductions(false);
        for (kind, n) in self.filters.take_evicted() {
            metrics::counter!(m::FILTER_EVICTED_SERIES, "stream" => self.def.name.clone(), "filter" => kind).increment(n);
            self.evicted_logged += n;
            // At the first, then once per million.
            if self.evicted_logged == n
                || self.evicted_logged / 1_000_000 > (self.evicted_logged - n) / 1_000_000
            {
                tracing::warn!(stream = %self.def.name, filter = kind, evicted = n, total = self.evicted_logged, "the filter holds max_series series: those seen longest ago were forgotten and start anew (is a key field unique per reading?)");
            }
        }
        if open.count == 0 {
            let now = now_secs();
            for d in &open.digests {
                self.log.push(*d, now);
            }
            self.flush_log();
            self.waiting.push_back((None, open.done));
            self.reuse(open.ndjson, open.digests);
            self.fire_ready();
            return Ok(());
        }
        let body = match self.encoding {
            BodyEncoding::Ndjson => self
                .zstd
                .compress(&open.ndjson)
                .map_err(|e| PipelineError::Encode(e.to_string()))?,
            BodyEncoding::Parquet => open
                .columns
                .unwrap_or_else(|| BodyBuilder::new(&self.def, 0))
                .finish(&self.def, self.batch.zstd_level)
                .map_err(|e| PipelineError::Encode(e.to_string()))?,
        };
        let batch = Batch {
            id: BatchId(*blake3::hash(&open.ndjson).as_bytes()),
            encoding: self.encoding,
            body,
            records: open.count,
            raw_bytes: open.ndjson.len() as u32,
            created_ms: now_ms(),
        };
        self.last_batch_records = open.count as usize;
        let mut done = open.done;
        match self.spool.append_held(&batch, self.overflow, cancel)? {
            Appended::Stored { seq, durable } => {
                let now = now_secs();
                for d in &open.digests {
                    self.log.push(*d, now);
                }
                self.flush_log();
                // Logged: the batch may be delivered now; the spool makes the log durable before
                // the batch leaves it (`Spool::ack`).
                self.spool.release(seq);
                if durable {
                    self.durable = seq + 1;
                }
                self.stats.batched += u64::from(batch.records);
                self.stats.batches += 1;
                self.stats.raw_bytes += u64::from(batch.raw_bytes);
                self.stats.encoded_bytes += batch.body.len() as u64;
                let labels = [("stream", self.def.name.clone())];
                metrics::counter!(m::BATCHES_SPOOLED, &labels).increment(1);
                metrics::counter!(m::RECORDS_SPOOLED, &labels).increment(u64::from(batch.records));
                self.waiting.push_back((Some(seq), done));
            }
            Appended::Dropped => {
                // Not stored: a re-send of these records is not a duplicate.
                for d in &open.digests {
                    self.window.forget(*d);
                }
                self.stats.spool_dropped += u64::from(batch.records);
                self.dropped_in_chunk = true;
                for (_, outcome) in &mut done {
                    outcome.spool_dropped = true;
                }
                self.waiting.push_back((None, done));
            }
        }
        metrics::gauge!(m::DEDUPE_ENTRIES, "stream" => self.def.name.clone())
            .set(self.window.len() as f64);
        self.reuse(open.ndjson, open.digests);
        self.fire_ready();
        Ok(())
    }

    /// Gives the closed batch's buffers to the next one, rather than growing a new one by
    /// doubling (and copying) for every batch.
    fn reuse(&mut self, mut ndjson: Vec<u8>, mut digests: Vec<Digest>) {
        ndjson.clear();
        digests.clear();
        self.open.ndjson = ndjson;
        self.open.digests = digests;
    }

    /// Writes the dedupe log, without an fsync (see [`crate::dedupe`]). Failures (a full disk)
    /// are logged, not fatal: the log only saves re-sending after a restart, and the receiver
    /// drops re-sent records anyway.
    fn flush_log(&mut self) {
        if let Err(e) = self.log.flush() {
            self.log_errors += 1;
            if self.log_errors <= 3 || self.log_errors.is_multiple_of(1000) {
                tracing::warn!(stream = %self.def.name, error = %e, "cannot write the dedupe log");
            }
        }
    }

    fn sync(&mut self, force: bool) -> Result<(), PipelineError> {
        if self
            .waiting
            .iter()
            .any(|(seq, _)| seq.is_some_and(|s| s >= self.durable))
        {
            let durable = self.spool.sync(force)?;
            self.durable = self.durable.max(durable);
        }
        self.fire_ready();
        Ok(())
    }

    /// Makes the invalid records kept so far durable: before the chunks they came in are
    /// acknowledged. A failure (a full disk) loses them as before keeping, and is logged.
    fn sync_kept(&mut self) {
        let Some(kept) = self.kept.as_mut() else {
            return;
        };
        match kept.sync() {
            Ok(false) => {}
            Ok(true) => metrics::gauge!(m::INVALID_KEPT_BYTES, "stream" => self.def.name.clone())
                .set(kept.bytes() as f64),
            Err(e) => {
                tracing::error!(stream = %self.def.name, error = %e, "cannot make the kept invalid records durable");
            }
        }
    }

    fn fire_ready(&mut self) {
        self.sync_kept();
        while let Some((seq, _)) = self.waiting.front() {
            if seq.is_some_and(|s| s >= self.durable) {
                break;
            }
            let (_, callbacks) = self.waiting.pop_front().expect("checked");
            for (done, outcome) in callbacks {
                done(outcome);
            }
        }
    }
}

mod report;

/// An agent built without Parquet (cargo feature `parquet`) batches no Parquet: its config
/// check refuses `encoding = "parquet"`. The pipeline's calls to the columns of a Parquet batch
/// stay, on a builder that holds nothing and cannot finish.
#[cfg(not(feature = "parquet"))]
mod no_parquet {
    use schemas::{Record, Row, StreamDef};

    pub struct BodyBuilder;

    impl BodyBuilder {
        pub fn new(_: &StreamDef, _: usize) -> BodyBuilder {
            BodyBuilder
        }
        pub fn push(&mut self, _: &Record) {}
        pub fn push_row<H>(&mut self, _: &Row<'_, H>) {}
        pub fn finish(self, _: &StreamDef, _: i32) -> Result<Vec<u8>, String> {
            Err("this edge-agent is built without Parquet (cargo feature `parquet`)".into())
        }
    }
}
#[cfg(test)]
mod tests;
