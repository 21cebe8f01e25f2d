//! The sink's worker: one task that reads the consumer's messages, keeps a [`PartitionState`]
//! per assigned partition (its open file, dedupe window and offsets), and lands, adopts and
//! commits files. Its parts:
//!
//! - this module: the run loop, memory and staging budgets, holding and dropping partitions;
//! - `partitions`: opening a partition (its stream, warming its window from the landing files)
//!   and handling its records;
//! - `flush`: closing a file, its dead letters, adopting a file already landed, committing;
//! - `ready`: taking the messages the consumer holds in groups;
//! - `gaps`: offset gaps;
//! - `reload`: putting a reloaded config's settings in force.

mod flush;
mod gaps;
mod partitions;
mod ready;
mod reload;

pub use ready::GROUP as READY_GROUP;

use super::*;

pub(crate) struct Worker {
    consumer: Arc<StreamConsumer<SinkContext>>,
    store: ObjectStore,
    streams: Streams,
    config: SinkConfig,
    parts: hashbrown::HashMap<PartKey, PartitionState>,
    stats: Arc<SinkStats>,
    shutdown: CancellationToken,
    /// Where open files are staged: a folder of this process, removed at a graceful stop.
    staging: staging::Staging,
    /// Bytes the open files' staged files may take together (`upload.staging_budget_bytes`,
    /// resolved at start).
    staging_budget: u64,
    last_sweep: Option<Instant>,
    /// Hour folders listed for warming dedupe windows, shared by the partitions opened after.
    listings: Listings,
    /// Partitions assigned, as of the rebalance generation it was read at.
    assigned: Option<(u64, usize)>,
    /// Messages received, for spacing the budget checks.
    received: u64,
    /// When the current round of ready messages began: their partitions' idle clock.
    round_start: Instant,
    /// A write was given up at shutdown (the store failing): the other partitions' writes are
    /// not tried, so a stop takes one partition's retries, not every partition's.
    store_given_up: AtomicBool,
    /// A commit failed at shutdown (the broker unreachable): the other partitions' commits are
    /// not tried either, each of which would wait for the coordinator as long.
    commits_given_up: bool,
    /// When `streams_dir` was last read again for a topic of an unknown stream.
    streams_read: Option<Instant>,
    /// Partitions paused (after a staged write failed, or while their stream is not defined),
    /// and when they are read again.
    paused: Vec<(PartKey, Instant)>,
    /// Staged writes that failed in a row, by partition (the backoff before it is read again);
    /// a partition leaves when it writes a file.
    staging_attempts: HashMap<PartKey, u32>,
    /// The definition files as they were when last read for a record that did not fit
    /// ([`Worker::redefine`]), by stream: a file that is not as it was is read again.
    definitions: HashMap<String, DefinitionFile>,
    /// Streams whose definition file holds a change this sink refused: their files are looked
    /// at on every tick, so that the refusal ends when the file is mended.
    refused: Vec<String>,
    /// The content hashes of a group of ready messages, made together (`ready`).
    hashes: HashGroup,
    /// Partitions sought back ([`Worker::hold`]) since the detached messages of a group were
    /// received: those messages are dropped, as librdkafka drops what it fetched before a seek.
    sought: Vec<PartKey>,
    /// Configs reloaded (SIGHUP), taken at the next tick ([`Worker::take_reload`]).
    reloads: tokio::sync::watch::Receiver<Arc<SinkConfig>>,
    /// Where assigned partitions without state are expected to go on: the group's committed
    /// offsets (read once per rebalance, [`Worker::expected_start`]) and the offsets the sink
    /// sought partitions back to ([`Worker::hold`]). What a partition's first record is
    /// checked against for an offset gap.
    resume_at: HashMap<PartKey, i64>,
    /// The rebalance generation whose committed offsets are in `resume_at`.
    committed_read: Option<u64>,
    /// Partitions stopped at an offset gap (`on_offset_gap = "stop"`), paused until the policy
    /// becomes `skip` or they are revoked.
    gap_stopped: HashMap<PartKey, Gap>,
    /// The streams' Iceberg tables (`[table]`): files landed and not yet committed to them.
    tables: Option<table::Tables>,
    /// The registry's schemas of framed values (`[registry]`).
    schemas: crate::registry::Schemas,
}

/// An offset gap: the partition of `stream` needed offset `next` and got `got`.
#[derive(Debug, Clone)]
struct Gap {
    stream: String,
    next: i64,
    got: i64,
}

/// A staged file could not be written (the staging disk full, an I/O error). The sink does not
/// stop for it: [`Worker::rewind`] drops the partition's open work and reads it again from
/// Kafka after a backoff, so the other partitions go on and nothing is skipped.
#[derive(Debug, thiserror::Error)]
#[error("cannot write a staged file of {}[{}]: {error:#}", key.0, key.1)]
struct StagingFailed {
    key: PartKey,
    /// The first offset of the partition that no object holds (the start of its open range):
    /// where it is read again. `None` when nothing was consumed.
    resume: Option<i64>,
    error: anyhow::Error,
}

impl StagingFailed {
    fn of(part: &PartitionState, failing: Option<i64>, error: anyhow::Error) -> Self {
        StagingFailed {
            key: part.key(),
            resume: part.unwritten_from().or(failing),
            error,
        }
    }
}

/// Landing files of the hour folders listed since the last rebalance, by folder and then by
/// partition: (start offset, key). Opening a partition warms its dedupe window from the files of
/// the last [`WARM_HOURS`] hours; listing those folders once per partition made a sink assigned
/// 1,000 partitions list 24,000 times (24,000 LIST requests on S3) before it settled. A listing
/// serves every partition opened until the next rebalance: until then, files of a partition this
/// sink was assigned are written only by this sink, after it opened the partition. It is also
/// dropped after [`LISTINGS_TTL`], so that it does not sit in memory.
#[derive(Default)]
struct Listings {
    generation: u64,
    taken: Option<Instant>,
    folders: HashMap<String, HashMap<i32, Vec<(i64, String)>>>,
}

/// How long listings are kept for partitions opened later.
const LISTINGS_TTL: Duration = Duration::from_secs(60);

impl Listings {
    /// Forgets listings taken before rebalance `generation` or longer ago than [`LISTINGS_TTL`].
    fn refresh(&mut self, generation: u64) {
        let expired = self.taken.is_some_and(|t| t.elapsed() > LISTINGS_TTL);
        if generation != self.generation || expired {
            self.folders.clear();
            self.generation = generation;
            self.taken = None;
        }
    }

    /// Keeps the listing of `folder` (keys of `stream`'s landing files, others are ignored).
    fn insert(&mut self, folder: String, stream: &str, keys: Vec<String>) {
        let mut by_partition: HashMap<i32, Vec<(i64, String)>> = HashMap::new();
        for key in keys {
            if let Some((partition, offset)) = parquet_file::partition_and_offset_of(&key, stream) {
                by_partition
                    .entry(partition)
                    .or_default()
                    .push((offset, key));
            }
        }
        self.taken.get_or_insert_with(Instant::now);
        self.folders.insert(folder, by_partition);
    }

    /// `partition`'s files in a listed folder, newest first; `None` if the folder is not listed.
    fn newest_first(&self, folder: &str, partition: i32) -> Option<Vec<(i64, String)>> {
        let listed = self.folders.get(folder)?;
        let mut files = listed.get(&partition).cloned().unwrap_or_default();
        files.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        Some(files)
    }
}

/// Messages between two checks of the memory budget (a check visits every open file; the
/// budget can be passed by at most this many records).
const BUDGET_CHECK_EVERY: u64 = 16;
/// Messages handled per wake-up of the consumer loop at most.
const DRAIN_MAX: usize = 1024;

/// How often the stream definitions are read again while a topic's stream is unknown.
const STREAMS_RELOAD: Duration = Duration::from_secs(10);

/// How often abandoned multipart uploads and staged files are looked for.
const SWEEP_INTERVAL: Duration = Duration::from_secs(3600);

/// Entries of each partition's dedupe window when `assigned` partitions share
/// `dedupe_memory_bytes`: at most `dedupe_window` (0 turns dedupe off), and at least one.
pub fn window_capacity(config: &SinkConfig, assigned: usize) -> usize {
    if config.dedupe_window == 0 {
        return 0;
    }
    let share = config.dedupe_memory_bytes / assigned.max(1);
    (share / MAX_UNTIMED_ENTRY_BYTES).clamp(1, config.dedupe_window)
}

/// Why an object found at a key of a partition is not adopted.
enum Conflict {
    /// It holds other messages, the first at this offset.
    OtherMessages(i64),
    /// It cannot be read as what the sink writes there.
    Unreadable(anyhow::Error),
}

/// What reading a landing file by range came to ([`Worker::read_pages`]).
enum Ranged<T> {
    Read(T),
    /// The object is not there (any more).
    Gone,
    /// Not a landing file that can be read.
    Unreadable(parquet::errors::ParquetError),
}

/// The pages of a landing file read for a plan: the plan, the bytes of its ranges and the
/// object's size.
type Pages = (PagePlan, Vec<bytes::Bytes>, u64);

/// Rows of an object to adopt that are compared with the partition's own.
const ADOPT_SAMPLE: Rows = Rows::First(4096);

/// What [`Worker::handle`] did with a message.
enum Handled {
    /// Taken (a row, a duplicate, a dead letter): the partition to flush, if one must be.
    Taken(Option<(PartKey, FlushReason)>),
    /// Not taken: its stream's definition may have a newer version that takes it
    /// ([`Worker::redefine`]).
    Redefine,
    /// Not taken: its offset is past the one the partition needs next, which it carries
    /// ([`Worker::offset_gap`]).
    Gap(i64),
    /// Not taken: framed with a schema id that is not loaded yet ([`Worker::load_schema`]).
    Schema(u32),
}

impl Worker {
    /// The worker of a consumer that subscribed to its topics, nothing assigned yet.
    pub(crate) fn new(
        consumer: Arc<StreamConsumer<SinkContext>>,
        (store, tables, schemas): (ObjectStore, Option<table::Tables>, crate::registry::Schemas),
        streams: Streams,
        (config, reloads): (SinkConfig, tokio::sync::watch::Receiver<Arc<SinkConfig>>),
        stats: Arc<SinkStats>,
        shutdown: CancellationToken,
        (staging, staging_budget): (staging::Staging, u64),
    ) -> Worker {
        Worker {
            consumer,
            store,
            streams,
            config,
            parts: hashbrown::HashMap::new(),
            stats: stats.clone(),
            shutdown,
            staging,
            staging_budget,
            last_sweep: None,
            listings: Listings::default(),
            assigned: None,
            received: 0,
            round_start: Instant::now(),
            store_given_up: AtomicBool::new(false),
            commits_given_up: false,
            streams_read: None,
            paused: Vec::new(),
            staging_attempts: HashMap::new(),
            definitions: HashMap::new(),
            refused: Vec::new(),
            hashes: HashGroup::new(),
            sought: Vec::new(),
            reloads,
            resume_at: HashMap::new(),
            committed_read: None,
            gap_stopped: HashMap::new(),
            tables,
            schemas,
        }
    }

    pub(crate) async fn run(mut self) -> anyhow::Result<()> {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        let consumer = self.consumer.clone();
        // One stream for the whole run: `StreamConsumer::recv` makes a stream per message,
        // whose waker slot costs two locks of the consumer's waker table.
        let mut messages = consumer.stream();
        loop {
            tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => break,
                _ = tick.tick() => {
                    self.take_reload();
                    self.drop_revoked();
                    self.resume_gaps().await?;
                    self.resume_due();
                    self.sweep_if_due().await;
                    for name in self.refused.clone() {
                        self.reread(&name).await?;
                    }
                    let now = Instant::now();
                    let idle = Duration::from_millis(self.config.rotation.idle_ms);
                    let max_age = self.config.rotation.max_age();
                    let due: Vec<(PartKey, FlushReason)> = self
                        .parts
                        .iter()
                        .filter_map(|(k, p)| Some((k.clone(), p.due(now, idle, max_age)?)))
                        .collect();
                    for (key, reason) in due {
                        let flushed = self.flush(&key, reason).await;
                        self.recover(flushed).await?;
                    }
                    if self.tables.as_ref().is_some_and(table::Tables::due) {
                        self.commit_tables().await;
                    } else if let Some(tables) = &self.tables {
                        tables.report_lag();
                    }
                }
                msg = messages.next() => {
                    let msg = msg.expect("a Kafka message stream never ends");
                    // Then whatever else is ready, a group at a time (`ready`), without a trip
                    // through `select!` (and its waker registrations) per message; the timers
                    // and shutdown are checked between rounds.
                    let mut next = Some(msg);
                    let mut taken = 0;
                    self.round_start = Instant::now();
                    while let Some(first) = next.take() {
                        let (left, more) = self.take_ready(&mut messages, first, &mut taken);
                        if self.finish_left(left).await? {
                            // The clock moved during the await.
                            self.round_start = Instant::now();
                        }
                        if more {
                            next = ready::next_ready(&mut messages);
                        }
                    }
                    if taken >= DRAIN_MAX {
                        // Messages keep coming (a backlog): the runtime's other tasks (the
                        // metrics and health server, on a one-core machine the same thread)
                        // run before the next round, as they do while the worker waits for one.
                        // A ready message is taken without giving the thread up, so without
                        // this a backlog held them off until it was read.
                        tokio::task::yield_now().await;
                    }
                }
            }
        }
        let keys: Vec<PartKey> = self.parts.keys().cloned().collect();
        for key in keys {
            let flushed = self.flush(&key, FlushReason::Shutdown).await;
            self.recover(flushed).await?;
        }
        if self.tables.is_some() {
            self.commit_tables().await;
        }
        tracing::info!("sink stopped");
        Ok(())
    }

    async fn on_message(&mut self, msg: OwnedMessage) -> anyhow::Result<()> {
        self.open_partition(&msg).await?;
        let fields = Fields::of(&msg, self.config.kafka.ingest_time);
        if let Some(key) = self.rotates_before(&fields) {
            self.flush(&key, FlushReason::Hour).await?;
        }
        self.round_start = Instant::now();
        let flush = loop {
            let PartRef(topic, partition) = fields.part;
            match self.handle(&fields, None)? {
                Handled::Taken(flush) => break flush,
                // Handled again with the definition there is now: a redefinition ends in a
                // stamp that matches, so this ends.
                Handled::Redefine => self.redefine(&(topic.to_owned(), partition)).await?,
                // Handled again with the schema loaded (or known to be refused).
                Handled::Schema(id) => {
                    if !self.load_schema(&(topic.to_owned(), partition), id).await {
                        return Ok(());
                    }
                }
                // Handled again once the gap is skipped; not taken if the partition stopped.
                Handled::Gap(next) => {
                    let key = (topic.to_owned(), partition);
                    if !self.offset_gap(&key, next, &fields).await? {
                        return Ok(());
                    }
                }
            }
        };
        if let Some((key, reason)) = flush.or(self.count_received()?) {
            self.flush(&key, reason).await?;
        }
        Ok(())
    }

    /// Loads schema `id` for partition `key`'s definition ([`crate::registry::Schemas::load`]).
    /// A stop while the registry does not answer stops the partition, so that nothing past the
    /// record waiting for it is taken or committed; `false` then.
    async fn load_schema(&mut self, key: &PartKey, id: u32) -> bool {
        let Some(def) = self.parts.get(key).map(|p| p.def.clone()) else {
            return false;
        };
        if self.schemas.load(id, &def, &self.shutdown).await {
            return true;
        }
        if let Some(part) = self.parts.get_mut(key) {
            part.stopped = true;
        }
        false
    }

    /// Counts a message; every [`BUDGET_CHECK_EVERY`] the memory budget is checked, which may
    /// name a partition to flush.
    fn count_received(&mut self) -> anyhow::Result<Option<(PartKey, FlushReason)>> {
        self.received += 1;
        if self.received.is_multiple_of(BUDGET_CHECK_EVERY) {
            return self.enforce_budget();
        }
        Ok(None)
    }

    /// When the open files' staged files together take more disk than the staging budget, the
    /// partition whose file takes the most is to be flushed. When the open files and dead
    /// letters together hold more memory than the memory budget, the partition holding the most
    /// writes its row group in progress to its staged file, or, when dead letters are most of
    /// what it holds, is to be flushed (they are only written with their range).
    fn enforce_budget(&mut self) -> anyhow::Result<Option<(PartKey, FlushReason)>> {
        let (total, staged) = self.parts.values().fold((0, 0), |(memory, staged), p| {
            (memory + p.memory(), staged + p.staged())
        });
        ::metrics::gauge!(m::BUFFERED_BYTES).set(total as f64);
        ::metrics::gauge!(m::STAGED_BYTES).set(staged as f64);
        if staged as u64 > self.staging_budget
            && let Some(part) = self
                .parts
                .values()
                .filter(|p| !p.stopped && p.staged() > 0)
                .max_by_key(|p| p.staged())
        {
            return Ok(Some((part.key(), FlushReason::StagingBudget)));
        }
        if total <= self.config.memory_budget_bytes {
            return Ok(None);
        }
        let Some(part) = self.parts.values_mut().max_by_key(|p| p.memory()) else {
            return Ok(None);
        };
        if part.dead.len() * 2 >= part.memory() {
            return Ok(Some((part.key(), FlushReason::DeadLetters)));
        }
        if let Some(spilled) = part.file.as_mut().map(OpenFile::spill) {
            spilled.map_err(|e| {
                let e =
                    anyhow::Error::new(e).context("cannot write a row group to the staged file");
                StagingFailed::of(part, None, e)
            })?;
            ::metrics::counter!(m::SPILLED_ROW_GROUPS).increment(1);
            self.stats
                .spilled_row_groups
                .fetch_add(1, Ordering::Relaxed);
        }
        Ok(None)
    }

    /// Aborts abandoned multipart uploads and removes abandoned staged files, at start and
    /// then every [`SWEEP_INTERVAL`].
    async fn sweep_if_due(&mut self) {
        if self
            .last_sweep
            .is_some_and(|t| t.elapsed() < SWEEP_INTERVAL)
        {
            return;
        }
        self.last_sweep = Some(Instant::now());
        let age = Duration::from_secs(self.config.upload.abandoned_after_hours * 3600);
        let prefix = format!("{}/", self.config.key_prefix);
        match self.store.sweep_abandoned(&prefix, age).await {
            Ok(0) => {}
            Ok(n) => {
                ::metrics::counter!(m::ABANDONED_UPLOADS).increment(n as u64);
                tracing::info!(removed = n, "removed abandoned uploads");
            }
            Err(e) => tracing::warn!(error = %e, "cannot sweep abandoned uploads"),
        }
        let cutoff = SystemTime::now().checked_sub(age).unwrap_or(UNIX_EPOCH);
        match self.staging.sweep_in_background(cutoff).await {
            Ok(swept) if swept == staging::Swept::default() => {}
            Ok(swept) => {
                ::metrics::counter!(m::ABANDONED_UPLOADS)
                    .increment((swept.folders + swept.files) as u64);
                tracing::info!(
                    folders = swept.folders,
                    files = swept.files,
                    bytes = swept.bytes,
                    "removed staged files of sinks that are gone"
                );
            }
            Err(e) => tracing::warn!(error = %e, "cannot sweep the staging directory"),
        }
    }

    /// Passes `result` on, unless it failed to write a staged file: then the partition is
    /// rewound ([`Worker::rewind`]) and the sink goes on (`None`).
    async fn recover<T>(&mut self, result: anyhow::Result<T>) -> anyhow::Result<Option<T>> {
        match result {
            Ok(value) => Ok(Some(value)),
            Err(e) => match e.downcast::<StagingFailed>() {
                Ok(failed) => self.rewind(failed).await.map(|()| None),
                Err(e) => Err(e),
            },
        }
    }

    /// After a staged write failed: drops the partition's state (its open file and staged
    /// file, its dead letters and its dedupe window), pauses the partition for a backoff and
    /// seeks it back to the first offset no object holds. When it is read again, its state is
    /// opened anew, with a window warmed from its landing files (the dropped records' hashes
    /// are not in it). A disk that stays full costs a retry per backoff, and the other
    /// partitions go on.
    async fn rewind(&mut self, failed: StagingFailed) -> anyhow::Result<()> {
        let StagingFailed { key, resume, error } = failed;
        let dropped_rows = self.drop_partition(&key);
        let attempt = self.staging_attempts.entry(key.clone()).or_default();
        let delay = store::backoff(*attempt);
        *attempt += 1;
        ::metrics::counter!(m::STAGING_ERRORS).increment(1);
        self.stats.staging_errors.fetch_add(1, Ordering::Relaxed);
        self.stats.staging_failing.store(true, Ordering::Relaxed);
        tracing::warn!(
            topic = %key.0,
            partition = key.1,
            error = %format!("{error:#}"),
            resume_offset = resume,
            dropped_rows,
            retry_in_ms = delay.as_millis() as u64,
            "cannot write a staged file (is the staging disk full?): the partition's open file is dropped and read again from Kafka"
        );
        self.hold(key, resume, Instant::now() + delay).await
    }

    /// Forgets the state of a partition that is read again from its first unwritten offset (its
    /// open file, dead letters and dedupe window); returns the rows its open file dropped.
    fn drop_partition(&mut self, key: &PartKey) -> usize {
        let dropped_rows = self.parts.remove(key).map_or(0, |p| p.rows());
        self.report_dedupe_memory();
        // Files of the partition written since the listings were taken are not in them.
        self.listings = Listings::default();
        dropped_rows
    }

    /// Pauses the partition until `until` ([`Worker::resume_due`]) and seeks it back to
    /// `offset`, so that its records from there are read again then. A seek that fails stops
    /// the sink, which then reads the partition again from its committed offset after a
    /// restart.
    async fn hold(
        &mut self,
        key: PartKey,
        offset: Option<i64>,
        until: Instant,
    ) -> anyhow::Result<()> {
        let mut list = TopicPartitionList::new();
        list.add_partition(&key.0, key.1);
        self.consumer
            .pause(&list)
            .with_context(|| format!("cannot pause {}[{}]", key.0, key.1))?;
        self.paused.push((key.clone(), until));
        let Some(offset) = offset else {
            return Ok(());
        };
        self.sought.push(key.clone());
        self.resume_at.insert(key.clone(), offset);
        let consumer = self.consumer.clone();
        let (topic, partition) = key;
        tokio::task::spawn_blocking(move || {
            consumer.seek(
                &topic,
                partition,
                Offset::Offset(offset),
                Duration::from_secs(10),
            )
        })
        .await?
        .with_context(|| format!("cannot seek back to offset {offset}"))
    }

    /// Resumes the partitions held ([`Worker::hold`]) whose time is over.
    fn resume_due(&mut self) {
        if self.paused.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut list = TopicPartitionList::new();
        self.paused.retain(|((topic, partition), at)| {
            let due = *at <= now;
            if due {
                list.add_partition(topic, *partition);
            }
            !due
        });
        if list.count() > 0
            && let Err(e) = self.consumer.resume(&list)
        {
            tracing::warn!(error = %e, "cannot resume held partitions");
        }
    }

    fn drop_revoked(&mut self) {
        let context = self.consumer.context();
        if !context.any_revoked.swap(false, Ordering::Acquire) {
            return;
        }
        let revoked =
            std::mem::take(&mut *context.revoked.lock().unwrap_or_else(|e| e.into_inner()));
        for key in revoked {
            if let Some(p) = self.parts.remove(&key) {
                tracing::info!(topic = %key.0, partition = key.1, dropped_rows = p.rows(), "partition revoked");
            }
            // Its next owner finds the gap, if there is one, where this sink found it.
            self.resume_at.remove(&key);
            if let Some(gap) = self.gap_stopped.remove(&key) {
                self.report_gap_stopped(&gap.stream);
            }
            // Its next owner reads it from the committed offset, with a disk of its own.
            self.staging_recovered(&key);
        }
        self.report_dedupe_memory();
    }

    /// The partition no longer waits after a failed staged write: it wrote a file, or went to
    /// another sink. The sink is ready again once no partition waits.
    fn staging_recovered(&mut self, key: &PartKey) {
        if self.staging_attempts.remove(key).is_some() {
            self.stats
                .staging_failing
                .store(!self.staging_attempts.is_empty(), Ordering::Relaxed);
        }
    }

    /// The dedupe window of each partition: `dedupe_window` entries, fewer when the windows of
    /// all partitions would need more than `dedupe_memory_bytes` (the assigned ones, or the open
    /// ones and `opening` more if there are more of those).
    fn window_capacity(&mut self, opening: usize) -> usize {
        // The assignment is copied out of librdkafka, so it is read once per rebalance: per
        // partition opened, it made opening n partitions cost n² (2.5% of a sink's CPU when it
        // took over 1,000).
        let generation = self.consumer.context().rebalances.load(Ordering::Acquire);
        let assigned = match self.assigned {
            Some((seen, count)) if seen == generation => count,
            _ => {
                let count = self.consumer.assignment().map_or(0, |list| list.count());
                self.assigned = Some((generation, count));
                count
            }
        };
        window_capacity(&self.config, assigned.max(self.parts.len() + opening))
    }

    fn report_dedupe_memory(&self) {
        let bytes: usize = self.parts.values().map(|p| p.window.memory_bytes()).sum();
        ::metrics::gauge!(m::DEDUPE_MEMORY).set(bytes as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ingest_time_from_the_header_or_the_kafka_timestamp() {
        use rdkafka::Timestamp;
        use rdkafka::message::{Header, OwnedHeaders};
        let message = |header: Option<&str>, ms: Option<i64>| {
            let headers = header.map(|v| {
                OwnedHeaders::new().insert(Header {
                    key: HEADER_INGEST_TS,
                    value: Some(v),
                })
            });
            let ts = ms.map_or(Timestamp::NotAvailable, Timestamp::CreateTime);
            OwnedMessage::new(None, None, "t".into(), ts, 0, 0, headers)
        };
        let with_both = message(Some("1700000000123456"), Some(1_700_000_000_999));
        assert_eq!(
            ingest_ts(&with_both, IngestTime::Header),
            1_700_000_000_123_456
        );
        assert_eq!(
            ingest_ts(&with_both, IngestTime::Timestamp),
            1_700_000_000_999_000
        );
        // Without the header, or with one that is not a number: the Kafka timestamp.
        for header in [None, Some("soon")] {
            let msg = message(header, Some(1_700_000_000_999));
            assert_eq!(ingest_ts(&msg, IngestTime::Header), 1_700_000_000_999_000);
        }
        // Neither: the time it is read.
        let before = now_micros();
        let read = ingest_ts(&message(None, None), IngestTime::Timestamp);
        assert!((before..=now_micros()).contains(&read));
    }

    #[test]
    fn listings_serve_until_a_rebalance_or_their_age_limit() {
        let folder = "landing/s/date=2024-05-01/hour=12/";
        let keys = vec![
            format!("{folder}s-p1-o00000000000000000010.parquet"),
            format!("{folder}s-p1-o00000000000000000030.parquet"),
            format!("{folder}s-p2-o00000000000000000000.parquet"),
            format!("{folder}other.txt"),
        ];
        let mut listings = Listings::default();
        listings.refresh(1);
        assert_eq!(listings.newest_first(folder, 1), None, "not listed yet");
        listings.insert(folder.into(), "s", keys.clone());
        let offsets = |l: &Listings, p| -> Option<Vec<i64>> {
            Some(l.newest_first(folder, p)?.iter().map(|f| f.0).collect())
        };
        assert_eq!(offsets(&listings, 1), Some(vec![30, 10]), "newest first");
        assert_eq!(offsets(&listings, 2), Some(vec![0]));
        assert_eq!(offsets(&listings, 3), Some(vec![]), "listed, no files");
        listings.refresh(1);
        assert_eq!(offsets(&listings, 1), Some(vec![30, 10]), "same generation");
        listings.refresh(2);
        assert_eq!(offsets(&listings, 1), None, "a rebalance drops it");
        listings.insert(folder.into(), "s", keys);
        listings.taken = Instant::now().checked_sub(LISTINGS_TTL + Duration::from_secs(1));
        listings.refresh(2);
        assert_eq!(offsets(&listings, 1), None, "too old");
    }
}
