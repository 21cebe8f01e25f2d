//! The sink: a Kafka consumer group that writes Parquet landing files exactly once.
//!
//! Invariant: an offset is committed only after every record before it is in a durable object
//! (or was intentionally dropped as a duplicate or dead letter). Object keys are a function of
//! (stream, partition, start offset) and are created only if absent; when a create finds the
//! object there, the sink adopts it: it reads the object's last offset, drops the rows the
//! object already holds and commits past them.

pub mod config;
mod gaps;
pub mod metrics;
pub mod open_file;
pub mod parquet_file;
pub mod partition;
mod ready;
pub mod redrive;
pub mod reload;
pub mod staging;
pub mod store;

pub use ready::GROUP as READY_GROUP;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use futures::StreamExt as _;
use plumbing::{DefinitionFile, Reread};
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use schemas::window::{DigestWindow, MAX_UNTIMED_ENTRY_BYTES, digest};
use schemas::wire::{HEADER_INGEST_TS, parse_decimal_header, stream_of_topic, topic_name};
use schemas::{ContentHash, HashGroup, Pending, RecordError, Row, Streams};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::SinkConfig;
pub use reload::{Reload, Reloaded};

use crate::config::IngestTime;
use crate::metrics as m;
use crate::open_file::{FileTargets, OpenFile};
use crate::parquet_file::{PagePlan, Rows};
use crate::partition::{Appended, FlushReason, PartitionState};
use crate::store::{ByteRange, ObjectStore, PutOutcome, Staged, StoreError};

/// Counters a caller (the demo, tests) can watch.
#[derive(Debug, Default)]
pub struct SinkStats {
    pub records_written: AtomicU64,
    pub files_written: AtomicU64,
    pub duplicates_dropped: AtomicU64,
    pub dead_letters: AtomicU64,
    pub adopted_files: AtomicU64,
    /// Dead-letter objects found already written when this sink went to write them.
    pub adopted_dead_letter_objects: AtomicU64,
    /// Landing objects found at a file's key that hold other messages at the same offsets
    /// ([`m::LANDING_CONFLICTS`]); each stopped its partition.
    pub landing_conflicts: AtomicU64,
    /// Records taken from Kafka that an adopted object already holds, so they were not written
    /// again ([`m::ADOPTED_RECORDS`]). Once everything is written, received = written +
    /// adopted + duplicates + dead letters.
    pub adopted_records: AtomicU64,
    /// Records taken from Kafka (rows, duplicates and dead letters).
    pub records_received: AtomicU64,
    /// Row groups written early because open files held more than the memory budget.
    pub spilled_row_groups: AtomicU64,
    /// Message sets decompressed again into a bigger buffer, as of librdkafka's last statistics
    /// ([`m::DECOMPRESSION_REGROWTHS`]).
    pub decompression_regrowths: AtomicU64,
    /// Hour folders listed to warm dedupe windows ([`m::LANDING_LISTINGS`]).
    pub landing_listings: AtomicU64,
    /// The last write to the object store failed and is being retried.
    pub store_failing: AtomicBool,
    /// Staged files that could not be written ([`m::STAGING_ERRORS`]).
    pub staging_errors: AtomicU64,
    /// A partition's last staged write failed, and it has not written a file since.
    pub staging_failing: AtomicBool,
    /// Streams whose definition file holds an incompatible change this sink refused
    /// ([`m::DEFINITION_REFUSED`]).
    pub definitions_refused: AtomicU64,
    /// Offset gaps found: a partition got a later offset from Kafka than the one it needed
    /// next ([`m::OFFSETS_SKIPPED`], [`m::GAP_STOPPED`]).
    pub offset_gaps: AtomicU64,
    /// Records skipped at offset gaps (`on_offset_gap = "skip"`).
    pub offsets_skipped: AtomicU64,
    /// Partitions this sink holds stopped at an offset gap (`on_offset_gap = "stop"`): the sink
    /// is not ready while there are any.
    pub gap_stopped: AtomicU64,
    /// Partitions assigned to this sink, as of the last rebalance.
    pub assigned_partitions: AtomicU64,
}

impl SinkStats {
    /// Records received whose fate is settled: written, found in an adopted object, dropped as
    /// duplicates or sent to the dead-letter location. Equal to `records_received` once
    /// everything received is written (records in open files are not settled yet).
    pub fn records_settled(&self) -> u64 {
        [
            &self.records_written,
            &self.adopted_records,
            &self.duplicates_dropped,
            &self.dead_letters,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
    }

    /// Counts records of `part` found already durable in an adopted object.
    fn count_adopted(&self, part: &PartitionState, records: u64) {
        part.adopted.increment(records);
        self.adopted_records.fetch_add(records, Ordering::Relaxed);
    }
}

/// A started sink.
pub struct Sink {
    pub task: JoinHandle<anyhow::Result<()>>,
    pub stats: Arc<SinkStats>,
    pub readiness: Readiness,
    /// Puts a reloaded config in force (SIGHUP).
    pub reload: Reload,
}

/// Whether the sink's dependencies are reachable, for `/readyz`.
#[derive(Clone)]
pub struct Readiness {
    /// Weak: the consumer closes when the worker ends, not when the last probe goes.
    consumer: std::sync::Weak<StreamConsumer<SinkContext>>,
    stats: Arc<SinkStats>,
}

impl Readiness {
    /// The sink runs, Kafka answers a metadata request within 3 s, the object store's last
    /// write did not fail (a failing write is retried until it succeeds, which makes the sink
    /// ready again), no partition stands still after a staged write failed, and none is
    /// stopped at an offset gap.
    pub async fn check(&self) -> bool {
        if self.stats.store_failing.load(Ordering::Relaxed)
            || self.stats.staging_failing.load(Ordering::Relaxed)
            || self.stats.gap_stopped.load(Ordering::Relaxed) > 0
        {
            return false;
        }
        let Some(consumer) = self.consumer.upgrade() else {
            return false;
        };
        tokio::task::spawn_blocking(move || {
            consumer
                .fetch_metadata(None, Duration::from_secs(3))
                .is_ok()
        })
        .await
        .unwrap_or(false)
    }
}

type PartKey = (String, i32);

/// A borrowed [`PartKey`] for lookups: hashes like the owned key, so finding a message's
/// partition allocates nothing (it ran for every message).
#[derive(Hash)]
struct PartRef<'a>(&'a str, i32);

impl hashbrown::Equivalent<PartKey> for PartRef<'_> {
    fn equivalent(&self, key: &PartKey) -> bool {
        key.0 == self.0 && key.1 == self.1
    }
}

fn part_ref<M: Message>(msg: &M) -> PartRef<'_> {
    PartRef(msg.topic(), msg.partition())
}

/// What the worker reads of a message, read once: each accessor of a librdkafka message is a
/// call into it (the topic name is checked as UTF-8 each time, the headers are searched), and
/// they ran several times per message.
struct Fields<'a> {
    part: PartRef<'a>,
    offset: i64,
    ingest_ts: i64,
    payload: &'a [u8],
}

impl<'a> Fields<'a> {
    fn of<M: Message>(msg: &'a M, ingest_time: IngestTime) -> Fields<'a> {
        Fields {
            part: part_ref(msg),
            offset: msg.offset(),
            ingest_ts: ingest_ts(msg, ingest_time),
            payload: msg.payload().unwrap_or_default(),
        }
    }
}

/// Hour folders searched for recent landing files when a partition's dedupe window is warmed.
pub const WARM_HOURS: i64 = 24;

/// Collects partitions revoked by a rebalance, so the worker drops their uncommitted rows, and
/// takes librdkafka's statistics.
#[derive(Default)]
struct SinkContext {
    stats: Arc<SinkStats>,
    revoked: Mutex<Vec<PartKey>>,
    /// Set after `revoked` got partitions: the worker looks at this flag for every message and
    /// takes the lock only when it is set (the lock per message was 1.4% of the sink's CPU).
    any_revoked: AtomicBool,
    /// Rebalance events so far (assignments, revocations, errors; each counted before and after
    /// it is applied): landing-folder listings taken before the latest one may miss files of
    /// partitions it handed over, and the assignment's size may have changed.
    rebalances: AtomicU64,
    /// librdkafka's reports, each kind logged at most once a minute (a broker outage).
    log: plumbing::kafka_log::ClientLog,
}

impl ClientContext for SinkContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.log.log(level, fac, log_message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        self.log.error(error, reason);
    }

    /// librdkafka's statistics (every `statistics.interval.ms`) carry the lag per partition and
    /// the count of decompressions that started over.
    fn stats(&self, statistics: rdkafka::Statistics) {
        let regrowths = statistics.brokers.values().map(|b| b.zbuf_grow).sum();
        self.stats
            .decompression_regrowths
            .store(regrowths, Ordering::Relaxed);
        ::metrics::counter!(m::DECOMPRESSION_REGROWTHS).absolute(regrowths);
        for (topic, t) in &statistics.topics {
            for (partition, p) in &t.partitions {
                if *partition >= 0 && p.consumer_lag >= 0 {
                    ::metrics::gauge!(m::CONSUMER_LAG, "topic" => topic.clone(), "partition" => partition.to_string())
                        .set(p.consumer_lag as f64);
                }
            }
        }
    }
}

impl ConsumerContext for SinkContext {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        self.rebalances.fetch_add(1, Ordering::AcqRel);
        // Counted from the events: asking librdkafka for the assignment inside its rebalance
        // callback waits on its main thread, which waits on this callback while the consumer
        // closes.
        match rebalance {
            Rebalance::Assign(list) => {
                self.stats
                    .assigned_partitions
                    .fetch_add(list.count() as u64, Ordering::Relaxed);
            }
            Rebalance::Revoke(list) => {
                let revoked = list.count() as u64;
                let _ = self.stats.assigned_partitions.fetch_update(
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                    |n| Some(n.saturating_sub(revoked)),
                );
            }
            Rebalance::Error(_) => {}
        }
        if let Rebalance::Assign(list) = rebalance {
            for e in list.elements() {
                tracing::info!(
                    topic = e.topic(),
                    partition = e.partition(),
                    "partition assigned"
                );
            }
        }
        if let Rebalance::Revoke(list) = rebalance
            && let Ok(mut revoked) = self.revoked.lock()
        {
            revoked.extend(
                list.elements()
                    .iter()
                    .map(|e| (e.topic().to_owned(), e.partition())),
            );
            self.any_revoked.store(true, Ordering::Release);
        }
    }

    /// Counted again once the assignment changed, so that what was read in between is not
    /// taken for the new one.
    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, _rebalance: &Rebalance<'_>) {
        self.rebalances.fetch_add(1, Ordering::AcqRel);
    }
}

/// Checks what `start` would refuse, without connecting to Kafka or the object store: the
/// stream selection, the Kafka client settings (TLS and SASL files included) and the store's
/// settings. Returns the names of the streams the sink would consume.
pub fn check(config: &SinkConfig, streams: Streams) -> anyhow::Result<Vec<String>> {
    let streams = config.select_streams(streams)?;
    let mut client = ClientConfig::new();
    plumbing::kafka_security::apply(
        &mut client,
        config.kafka.tls.as_ref(),
        config.kafka.sasl.as_ref(),
    )?;
    store::check_config(&config.store)?;
    Ok(streams.iter().map(|s| s.name.clone()).collect())
}

/// Starts the sink: connects the store, joins the consumer group and runs until `shutdown`,
/// then writes and commits what is buffered.
pub async fn start(
    config: SinkConfig,
    streams: Streams,
    shutdown: CancellationToken,
) -> anyhow::Result<Sink> {
    let streams = config.select_streams(streams)?;
    m::register(&streams);
    let store = ObjectStore::from_config(&config.store).await?;
    let staging_root = store.staging_dir(&config.upload.staging_dir);
    let staging = staging::Staging::create(&staging_root).with_context(|| {
        format!(
            "cannot create a staging folder in {}",
            staging_root.display()
        )
    })?;
    let staging_budget = staging
        .budget(config.upload.staging_budget_bytes)
        .with_context(|| {
            format!(
                "cannot read the free space of the staging directory {}",
                staging_root.display()
            )
        })?;
    tracing::info!(dir = %staging.path().display(), budget_bytes = staging_budget, "staging");
    if staging_budget < config.rotation.max_bytes as u64 {
        tracing::warn!(
            budget_bytes = staging_budget,
            max_bytes = config.rotation.max_bytes,
            "the staging budget is below the file target: files close smaller (upload.staging_budget_bytes, or the staging directory's free space)"
        );
    }
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &config.kafka.brokers)
        .set("group.id", &config.kafka.group_id)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "false")
        // Only the partitions that move change hands in a rebalance; an eager one (librdkafka's
        // default) revokes every partition of every member, and each sink dropped its open
        // files whenever one joined or left the group.
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("statistics.interval.ms", "5000")
        .set(
            "session.timeout.ms",
            config.kafka.session_timeout_ms.to_string(),
        )
        .set(
            "heartbeat.interval.ms",
            (config.kafka.session_timeout_ms / 3).max(100).to_string(),
        );
    if let Some(id) = &config.kafka.instance_id {
        client.set("group.instance.id", id);
    }
    let pattern = config.topic_pattern();
    if pattern.is_some() {
        // A topic created later (a stream defined after the start) is found at the next
        // metadata refresh: every 30 s rather than librdkafka's 5 minutes.
        client.set("topic.metadata.refresh.interval.ms", "30000");
    }
    plumbing::kafka_security::apply(
        &mut client,
        config.kafka.tls.as_ref(),
        config.kafka.sasl.as_ref(),
    )?;
    for (k, v) in &config.kafka.consumer {
        client.set(k, v);
    }
    let stats = Arc::new(SinkStats::default());
    let consumer: StreamConsumer<SinkContext> = client.create_with_context(SinkContext {
        stats: stats.clone(),
        ..SinkContext::default()
    })?;
    let topics: Vec<String> = streams
        .iter()
        .map(|s| topic_name(&config.kafka.topic_prefix, &s.name))
        .collect();
    let topic_refs: Vec<&str> = match &pattern {
        Some(pattern) => vec![pattern.as_str()],
        None => topics.iter().map(String::as_str).collect(),
    };
    consumer
        .subscribe(&topic_refs)
        .context("cannot subscribe to the stream topics")?;
    tracing::info!(topics = ?topics, pattern = pattern.as_deref().unwrap_or("-"), store = %store.describe(), group = %config.kafka.group_id, "sink started");
    let consumer = Arc::new(consumer);
    let readiness = Readiness {
        consumer: Arc::downgrade(&consumer),
        stats: stats.clone(),
    };
    let (reload, reloads) = Reload::new(&config);
    let worker = Worker {
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
    };
    Ok(Sink {
        task: tokio::spawn(worker.run()),
        stats,
        readiness,
        reload,
    })
}

struct Worker {
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

/// Ingest time of a message: the gateway's `ingest-ts` header (unless `from` says not to look),
/// else the Kafka timestamp, else now.
fn ingest_ts<M: Message>(msg: &M, from: IngestTime) -> i64 {
    let header = || {
        msg.headers()
            .and_then(|h| h.iter().find(|h| h.key == HEADER_INGEST_TS))
            .and_then(|h| h.value.and_then(parse_decimal_header))
    };
    match from {
        IngestTime::Header => header(),
        IngestTime::Timestamp => None,
    }
    .or_else(|| msg.timestamp().to_millis().map(|ms| ms * 1000))
    .unwrap_or_else(now_micros)
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
}

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or_default()
}

impl Worker {
    async fn run(mut self) -> anyhow::Result<()> {
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

    /// Sets up the state of a partition the first time one of its messages arrives, with the
    /// dedupe window warmed from the partition's recent landing files, so that duplicates that
    /// straddle a restart or a rebalance are dropped too.
    async fn open_partition(&mut self, msg: &OwnedMessage) -> anyhow::Result<()> {
        if self.parts.contains_key(&part_ref(msg)) {
            return Ok(());
        }
        let key = (msg.topic().to_owned(), msg.partition());
        let expected = self.expected_start(&key).await;
        let Some(def) = self.stream_of(msg.topic()).await else {
            // Read again from this message once the definition may have come: skipped, its
            // records would wait for the next rebalance. From where the partition was expected
            // to start if that is before, so that a gap in front of it is still found then.
            let until = Instant::now() + STREAMS_RELOAD;
            let from = expected.map_or(msg.offset(), |e| e.min(msg.offset()));
            return self.hold(key, Some(from), until).await;
        };
        // More partitions than before share the dedupe memory: the open ones give up their
        // oldest entries first.
        let capacity = self.window_capacity(1);
        for part in self.parts.values_mut() {
            part.window.shrink_to(capacity);
        }
        tracing::debug!(topic = %key.0, partition = key.1, offset = msg.offset(), "opening partition");
        let mut state = PartitionState::new(def.clone(), key.0.clone(), key.1, capacity);
        state.expect_from = expected;
        // The store failing, the window is warmed once it answers, before the partition is
        // read: read with a cold window, records re-sent since the files were written would
        // land again once the store is back. Nothing lands meanwhile anyway.
        let mut attempt = 0;
        loop {
            match self.warm(&def.name, key.1, &mut state.window).await {
                Ok(n) => {
                    if n > 0 {
                        tracing::info!(topic = %key.0, partition = key.1, hashes = n, "warmed dedupe window");
                    }
                    if attempt > 0 {
                        self.stats.store_failing.store(false, Ordering::Relaxed);
                    }
                    break;
                }
                Err(e) => {
                    self.stats.store_failing.store(true, Ordering::Relaxed);
                    ::metrics::counter!(m::STORE_ERRORS, "retryable" => "true").increment(1);
                    tracing::warn!(topic = %key.0, partition = key.1, error = %e, attempt, "cannot warm the dedupe window from the landing zone; retrying before the partition is read");
                    tokio::select! {
                        _ = tokio::time::sleep(store::backoff(attempt)) => {}
                        _ = self.shutdown.cancelled() => {
                            // Nothing of the partition is taken without its window.
                            state.stopped = true;
                            break;
                        }
                    }
                    attempt += 1;
                }
            }
        }
        self.parts.insert(key, state);
        self.report_dedupe_memory();
        Ok(())
    }

    /// The definition of the stream of `topic`. A topic of no stream known (subscribed by a
    /// pattern, the topic of a stream defined after the start) makes the sink read
    /// `streams_dir` again, at most every [`STREAMS_RELOAD`], and take the streams the selection
    /// adds; definitions it has are kept as they were (a changed one is read again when a
    /// record needs it, [`Worker::redefine`]). Records of a topic without a definition are
    /// read but not written or committed, until the definition comes.
    async fn stream_of(&mut self, topic: &str) -> Option<Arc<schemas::StreamDef>> {
        let name = stream_of_topic(&self.config.kafka.topic_prefix, topic)?;
        if let Some(def) = self.streams.get(name) {
            return Some(def.clone());
        }
        if self
            .streams_read
            .is_some_and(|t| t.elapsed() < STREAMS_RELOAD)
        {
            return None;
        }
        self.streams_read = Some(Instant::now());
        // Files are read on the blocking pool, not on the reactor.
        let config = self.config.clone();
        let read = tokio::task::spawn_blocking(move || {
            plumbing::load_streams_dir(&config.streams_dir)
                .and_then(|all| config.select_streams(all))
        })
        .await
        .map_err(anyhow::Error::from)
        .and_then(|read| read);
        match read {
            Ok(selected) => {
                for def in selected.iter() {
                    if self.streams.insert(def.clone()) {
                        m::register_stream(def);
                        tracing::info!(stream = %def.name, "a stream defined after the start is landed from now on");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "cannot read the stream definitions again")
            }
        }
        let def = self.streams.get(name).cloned();
        if def.is_none() {
            tracing::warn!(
                topic,
                "no stream definition for this topic: its records wait, uncommitted, until one is added to streams_dir"
            );
        }
        def
    }

    /// Loads the content hashes of the newest landing files of a partition (from the last
    /// [`WARM_HOURS`] hour folders) into `window`, oldest first.
    async fn warm(
        &mut self,
        stream: &str,
        partition: i32,
        window: &mut DigestWindow,
    ) -> anyhow::Result<usize> {
        let mut newest_first: Vec<Vec<ContentHash>> = Vec::new();
        let mut total = 0;
        tracing::debug!(stream, partition, "warming dedupe window");
        let generation = self.consumer.context().rebalances.load(Ordering::Acquire);
        self.listings.refresh(generation);
        'hours: for prefix in parquet_file::recent_hour_prefixes(
            &self.config.key_prefix,
            stream,
            now_micros(),
            WARM_HOURS,
        ) {
            let files = match self.listings.newest_first(&prefix, partition) {
                Some(files) => files,
                None => {
                    let keys = self.store.list(&prefix).await?;
                    ::metrics::counter!(m::LANDING_LISTINGS).increment(1);
                    self.stats.landing_listings.fetch_add(1, Ordering::Relaxed);
                    self.listings.insert(prefix.clone(), stream, keys);
                    self.listings
                        .newest_first(&prefix, partition)
                        .unwrap_or_default()
                }
            };
            for (_, key) in files {
                if total >= window.capacity() {
                    break 'hours;
                }
                tracing::debug!(key, "reading content hashes");
                let hashes = match self.last_hashes(&key, window.capacity() - total).await? {
                    Ranged::Read(hashes) => hashes,
                    Ranged::Gone => continue,
                    Ranged::Unreadable(e) => {
                        // Not the store failing: retrying would not help.
                        tracing::warn!(key, error = %e, "cannot read a landing file's content hashes; its records are not in the dedupe window");
                        continue;
                    }
                };
                total += hashes.len();
                newest_first.push(hashes);
            }
        }
        for hashes in newest_first.into_iter().rev() {
            for h in hashes {
                window.insert(digest(&h), 0);
            }
        }
        Ok(total.min(window.capacity()))
    }

    /// The content hashes of the last `want` rows of the landing file at `key` (all of them
    /// when it has fewer), read by range ([`Worker::read_pages`]). Fails when the store does
    /// (the caller retries).
    async fn last_hashes(
        &self,
        key: &str,
        want: usize,
    ) -> anyhow::Result<Ranged<Vec<ContentHash>>> {
        let columns = [schemas::arrow::COL_CONTENT_HASH];
        let (plan, pieces, size) = match self.read_pages(key, &columns, Rows::Last(want)).await? {
            Ranged::Read(pages) => pages,
            Ranged::Gone => return Ok(Ranged::Gone),
            Ranged::Unreadable(e) => return Ok(Ranged::Unreadable(e)),
        };
        let read =
            tokio::task::spawn_blocking(move || parquet_file::hashes_of(&plan.read(size, pieces)?))
                .await?;
        Ok(read.map_or_else(Ranged::Unreadable, Ranged::Read))
    }

    /// Reads `rows` of `columns` of the landing file at `key` by range: its footer and offset
    /// index (the last 64 KiB, more for a longer footer), then only the pages that hold them
    /// ([`PagePlan`]). The whole object was read before: 128 MiB at the default file target,
    /// for each partition a sink opened and for each object it adopted.
    async fn read_pages(
        &self,
        key: &str,
        columns: &[&'static str],
        rows: Rows,
    ) -> Result<Ranged<Pages>, StoreError> {
        let tail = self
            .store
            .get_range(key, ByteRange::Suffix(parquet_file::TAIL_BYTES))
            .await?;
        let Some((mut tail, size)) = tail else {
            return Ok(Ranged::Gone);
        };
        let footer = match parquet_file::footer_bytes(&tail) {
            Ok(footer) => footer,
            Err(e) => return Ok(Ranged::Unreadable(e)),
        };
        if footer > tail.len() as u64 && footer <= size {
            let Some((whole, _)) = self.store.get_range(key, ByteRange::Suffix(footer)).await?
            else {
                return Ok(Ranged::Gone);
            };
            tail = whole;
        }
        let plan = match PagePlan::new(tail, size, columns, rows) {
            Ok(plan) => plan,
            Err(e) => return Ok(Ranged::Unreadable(e)),
        };
        let mut pieces = Vec::with_capacity(plan.ranges.len());
        for &(start, end) in &plan.ranges {
            let piece = self
                .store
                .get_range(key, ByteRange::Span(start, end))
                .await?;
            let Some((piece, _)) = piece else {
                return Ok(Ranged::Gone);
            };
            pieces.push(piece);
        }
        Ok(Ranged::Read((plan, pieces, size)))
    }

    /// The partition whose open file must close before `msg` joins it: its first record was
    /// ingested in another hour.
    fn rotates_before(&self, msg: &Fields<'_>) -> Option<PartKey> {
        let part = self.parts.get(&msg.part)?;
        part.crosses_hour(msg.ingest_ts).then(|| part.key())
    }

    fn targets(&self) -> FileTargets {
        FileTargets {
            file_bytes: self.config.rotation.max_bytes,
            row_group_bytes: self.config.rotation.row_group_bytes,
        }
    }

    /// Adds one message to its partition; returns the partition to flush, if one must be.
    /// Fails only when the staged file cannot be written (nothing is committed then).
    fn handle<'m>(
        &mut self,
        msg: &Fields<'m>,
        checked: Option<Result<(&Row<'m, Pending>, ContentHash), &RecordError>>,
    ) -> anyhow::Result<Handled> {
        let targets = self.targets();
        // `open_partition` created the state (with its warmed window and its stream) before
        // this call.
        let Some(part) = self.parts.get_mut(&msg.part).filter(|p| !p.stopped) else {
            return Ok(Handled::Taken(None));
        };
        let Fields {
            offset,
            ingest_ts,
            payload,
            ..
        } = *msg;
        if let Some(next) = part.gap_before(offset) {
            return Ok(Handled::Gap(next));
        }
        let adopted = part.next_offset.is_some_and(|next| offset < next);
        let appended = if adopted {
            None
        } else {
            let staging = self.staging.path();
            let appended = match checked {
                Some(checked) => {
                    part.append_checked(checked, payload, offset, ingest_ts, staging, targets)
                }
                None => part.append(payload, offset, ingest_ts, staging, targets),
            }
            .map_err(|e| StagingFailed::of(part, Some(offset), e))?;
            Some(match appended {
                Appended::Unfit(e) => {
                    let changed = self
                        .definitions
                        .get(&part.def.name)
                        .is_none_or(DefinitionFile::changed);
                    if part.newer.is_some() || changed {
                        return Ok(Handled::Redefine);
                    }
                    // No newer definition takes it.
                    part.dead_letter(offset, ingest_ts, &e.to_string(), payload);
                    Appended::Unfit(e)
                }
                appended => appended,
            })
        };
        // The idle timer's clock, read once per round of ready messages.
        part.last_append = self.round_start;
        self.stats.records_received.fetch_add(1, Ordering::Relaxed);
        part.received.increment(1);
        let Some(appended) = appended else {
            // Already durable in an adopted object.
            self.stats.count_adopted(part, 1);
            return Ok(Handled::Taken(None));
        };
        let full = match appended {
            Appended::Row { full } => full,
            Appended::Duplicate => {
                part.duplicates.increment(1);
                self.stats
                    .duplicates_dropped
                    .fetch_add(1, Ordering::Relaxed);
                return Ok(Handled::Taken(None));
            }
            Appended::DeadLetter(e) | Appended::Unfit(e) => {
                let PartRef(topic, partition) = msg.part;
                tracing::warn!(topic, partition, offset, reason = %e, "dead letter: undecodable or invalid record");
                ::metrics::counter!(m::DISCARDED, "stream" => part.def.name.clone(), "reason" => e.code(), "intentional" => "false").increment(1);
                ::metrics::counter!(m::DEAD_LETTERS, "stream" => part.def.name.clone())
                    .increment(1);
                self.stats.dead_letters.fetch_add(1, Ordering::Relaxed);
                let full = part.dead.len() >= self.config.rotation.max_dead_letter_bytes;
                return Ok(Handled::Taken(
                    full.then(|| (part.key(), FlushReason::DeadLetters)),
                ));
            }
        };
        Ok(Handled::Taken(
            if part.rows() >= self.config.rotation.max_records {
                Some((part.key(), FlushReason::Records))
            } else if full {
                Some((part.key(), FlushReason::Bytes))
            } else {
                None
            },
        ))
    }

    /// A record of partition `key` sets a field its stream's definition lacks, or lacks one it
    /// requires ([`Appended::Unfit`]). If the definition's file changed since it was read, it
    /// is read again ([`Worker::reread`]). If a compatible newer definition is there, the
    /// partition's open file closes and the partition takes it; the record is then handled
    /// again, and becomes a dead letter only if that one does not take it either.
    async fn redefine(&mut self, key: &PartKey) -> anyhow::Result<()> {
        let Some(name) = self.parts.get(key).map(|p| p.def.name.clone()) else {
            return Ok(());
        };
        self.reread(&name).await?;
        if self.parts.get(key).is_some_and(|p| p.newer.is_some()) {
            self.flush(key, FlushReason::Definition).await?;
            let Some(part) = self.parts.get_mut(key).filter(|p| !p.stopped) else {
                return Ok(());
            };
            if part.file.is_none() {
                if let Some(newer) = part.newer.take() {
                    part.def = newer;
                }
            } else {
                // The open range cannot close yet (an adopted dead-letter object reaches past
                // it): it is read again from its start, by a state opened with the new
                // definition.
                let resume = part.unwritten_from();
                self.drop_partition(key);
                self.hold(key.clone(), resume, Instant::now()).await?;
            }
        }
        Ok(())
    }

    /// Reads the definition of stream `name` again (on the blocking pool) if its file changed.
    /// A compatible change (see [`schemas::Change`]) replaces it: partitions opened from now on
    /// take the new one, and open ones at their next file or at their next record that needs
    /// it. An incompatible change is refused until a restart: records the running definition
    /// does not take go to the dead letters, as before.
    async fn reread(&mut self, name: &str) -> anyhow::Result<()> {
        let Some(running) = self.streams.get(name).cloned() else {
            return Ok(());
        };
        let mut file = self
            .definitions
            .remove(name)
            .unwrap_or_else(|| DefinitionFile::new(&self.config.streams_dir, name));
        if !file.changed() {
            self.definitions.insert(name.to_owned(), file);
            return Ok(());
        }
        let (file, reread) = tokio::task::spawn_blocking(move || {
            let reread = file.reread(&running);
            (file, reread)
        })
        .await?;
        self.definitions.insert(name.to_owned(), file);
        let refused = matches!(reread, Reread::Refused);
        self.refused.retain(|r| r != name);
        if refused {
            self.refused.push(name.to_owned());
        }
        self.stats
            .definitions_refused
            .store(self.refused.len() as u64, Ordering::Relaxed);
        ::metrics::gauge!(m::DEFINITION_REFUSED, "stream" => name.to_owned()).set(if refused {
            1.0
        } else {
            0.0
        });
        let result = match reread {
            Reread::Same | Reread::Failed => return Ok(()),
            Reread::Refused => "refused",
            Reread::Compatible(def) => {
                let def = Arc::new(*def);
                self.streams.replace(def.clone());
                for part in self.parts.values_mut().filter(|p| p.def.name == name) {
                    part.newer = Some(def.clone());
                }
                "taken"
            }
        };
        ::metrics::counter!(m::DEFINITION_CHANGES, "stream" => name.to_owned(), "result" => result)
            .increment(1);
        Ok(())
    }

    /// Closes the partition's open file, makes it an object and commits past it. On a
    /// conflicting create, adopts the existing object and keeps the rows after it in a new open
    /// file. Retries retryable store errors until shutdown.
    async fn flush(&mut self, key: &PartKey, reason: FlushReason) -> anyhow::Result<()> {
        loop {
            let Some(part) = self.parts.get_mut(key).filter(|p| !p.stopped) else {
                return Ok(());
            };
            let (Some(start), Some(next)) = (part.range_start, part.next_offset) else {
                // Nothing open: an adopted object that left nothing after it, or a commit that
                // failed, is committed now (else the offset waited for the partition's next
                // records, and its lag showed until then).
                if part.next_offset > part.committed {
                    self.commit(key).await;
                }
                return Ok(());
            };
            if part.dead_through.is_some_and(|through| next <= through) {
                // An adopted dead-letter object reaches past the range: it closes once the
                // object's offsets are read (the records are in Kafka: its writer read them), or
                // at shutdown not at all, and the next owner reads it again.
                return Ok(());
            }
            let range = parquet_file::OffsetRange {
                first: start.offset,
                last: next - 1,
            };
            if let Some((first, ingest_ts)) = part.dead.first() {
                if !self.write_dead_letters(key, first, ingest_ts).await? {
                    // Shutting down while the store fails: nothing is committed.
                    if let Some(part) = self.parts.get_mut(key) {
                        part.stopped = true;
                    }
                    return Ok(());
                }
                continue;
            }
            let Some(file) = part.file.take() else {
                // Only skipped records (duplicates, dead letters) since the last file.
                part.range_start = None;
                if part.next_offset > part.committed {
                    self.commit(key).await;
                }
                return Ok(());
            };
            let (def, topic, partition) = (part.def.clone(), part.topic.clone(), part.partition);
            let object = parquet_file::object_key(
                &self.config.key_prefix,
                &def.name,
                start.ingest_ts,
                partition,
                start.offset,
            );
            let finished =
                tokio::task::spawn_blocking(move || file.finish(&def, &topic, partition, range))
                    .await?
                    .map_err(|e| {
                        let e = anyhow::Error::new(e).context("cannot finish a Parquet file");
                        StagingFailed::of(part, None, e)
                    })?;
            part.size_ratio = finished.ratio;
            let (staged, rows, size) = (finished.staged, finished.rows, finished.size);
            let started = Instant::now();
            let part_bytes = self.config.upload.part_bytes;
            let outcome = self
                .with_retry(&object, || {
                    self.store.put_file_if_absent(&object, &staged, part_bytes)
                })
                .await;
            let part = self
                .parts
                .get_mut(key)
                .context("partition state vanished")?;
            let stream = part.def.name.clone();
            match outcome {
                Some(PutOutcome::Created) => {
                    ::metrics::histogram!(m::UPLOAD_DURATION)
                        .record(started.elapsed().as_secs_f64());
                    ::metrics::histogram!(m::FILE_SIZE, "stream" => stream.clone())
                        .record(size as f64);
                    ::metrics::counter!(m::FILES_WRITTEN, "stream" => stream.clone(), "reason" => reason.as_str()).increment(1);
                    ::metrics::counter!(m::RECORDS_WRITTEN, "stream" => stream.clone())
                        .increment(rows as u64);
                    ::metrics::counter!(m::BYTES_WRITTEN, "stream" => stream).increment(size);
                    self.stats
                        .records_written
                        .fetch_add(rows as u64, Ordering::Relaxed);
                    self.stats.files_written.fetch_add(1, Ordering::Relaxed);
                    part.range_start = None;
                    self.staging_recovered(key);
                    tracing::debug!(
                        object,
                        rows,
                        size,
                        reason = reason.as_str(),
                        "wrote landing file"
                    );
                }
                Some(PutOutcome::AlreadyExists) => {
                    self.adopt(key, &object, staged).await?;
                    continue;
                }
                None => {
                    // Shutting down while the store fails: the finished file is dropped, and
                    // nothing of the partition is written or committed after it (a later flush
                    // would otherwise take the range for skipped records only and commit past
                    // it); the records are read again by whoever owns the partition next.
                    part.stopped = true;
                    return Ok(());
                }
            }
            self.commit(key).await;
        }
    }

    /// Writes the partition's dead letters from offset `first` (ingested at `ingest_ts`) as an
    /// object named after that offset. When the object exists (written before a crash, or by
    /// the partition's previous owner, with a range that may end elsewhere than ours), it holds
    /// every dead letter up to its last line: those are dropped (also when they arrive later,
    /// and the range closes only past that line) and the rest go on to the next object of the
    /// chain. Store errors are retried. `false` when shutdown interrupted the retries (the dead
    /// letters stay), or when the object holds other messages at the same offsets (the
    /// partition stops, see [`Worker::landing_conflict`]).
    async fn write_dead_letters(
        &mut self,
        key: &PartKey,
        first: i64,
        ingest_ts: i64,
    ) -> anyhow::Result<bool> {
        let Some(part) = self.parts.get(key) else {
            return Ok(false);
        };
        let stream = part.def.name.clone();
        let object = parquet_file::dead_letter_key(
            &self.config.key_prefix,
            &stream,
            ingest_ts,
            part.partition,
            first,
        );
        let data = bytes::Bytes::copy_from_slice(part.dead.text());
        let put = self
            .with_retry(&object, || self.store.put_if_absent(&object, data.clone()))
            .await;
        let adopted = match put {
            None => return Ok(false),
            Some(PutOutcome::Created) => {
                tracing::info!(object, "wrote dead letters");
                None
            }
            Some(PutOutcome::AlreadyExists) => {
                let Some(existing) = self.with_retry(&object, || self.store.get(&object)).await
                else {
                    return Ok(false);
                };
                let existing =
                    existing.context("dead-letter object vanished after a conflicting create")?;
                let theirs = partition::dead_letter_ids(&existing)
                    .and_then(|ids| Ok((partition::last_dead_letter(&ids)?, ids)));
                let (last, theirs) = match theirs {
                    Ok(theirs) => theirs,
                    Err(e) => {
                        self.landing_conflict(key, &object, Conflict::Unreadable(e));
                        return Ok(false);
                    }
                };
                let ours = partition::dead_letter_ids(&data)?;
                let differ = parquet_file::other_messages(&ours, &theirs);
                if let Some(&first) = differ.first() {
                    self.landing_conflict(key, &object, Conflict::OtherMessages(first));
                    return Ok(false);
                }
                tracing::info!(object, last_offset = last, "adopted existing dead letters");
                ::metrics::counter!(m::ADOPTED_DEAD_LETTERS, "stream" => stream).increment(1);
                self.stats
                    .adopted_dead_letter_objects
                    .fetch_add(1, Ordering::Relaxed);
                Some(last)
            }
        };
        if let Some(part) = self.parts.get_mut(key) {
            match adopted {
                // All of them are in the new object.
                None => part.dead = partition::DeadLetters::default(),
                Some(last) => part.adopt_dead_letters_through(last),
            }
        }
        Ok(true)
    }

    /// Adopts the object another sink wrote at `object`: continues after its last offset, and
    /// the rows of `staged` past that offset go into a new open file. An object that holds
    /// other messages at the same offsets (a topic created again) is not adopted: the partition
    /// stops, and nothing is skipped.
    async fn adopt(&mut self, key: &PartKey, object: &str, staged: Staged) -> anyhow::Result<()> {
        // Its offsets, and its first rows to compare with ours: a conflict (a topic created
        // again) differs from the first row on.
        let read = || self.read_pages(object, &parquet_file::ROW_ID_COLUMNS, ADOPT_SAMPLE);
        let Some(existing) = self.with_retry(object, read).await else {
            // Shutting down while the store fails: the staged file is given up, and nothing of
            // the partition is committed after it (as when its upload is given up).
            if let Some(part) = self.parts.get_mut(key) {
                part.stopped = true;
            }
            return Ok(());
        };
        let (plan, pieces, size) = match existing {
            Ranged::Read(pages) => pages,
            Ranged::Gone => anyhow::bail!("{object} vanished after a conflicting create"),
            Ranged::Unreadable(e) => {
                self.landing_conflict(key, object, Conflict::Unreadable(e.into()));
                return Ok(());
            }
        };
        let targets = self.targets();
        let part = self
            .parts
            .get_mut(key)
            .context("partition state vanished")?;
        // The staged file is read once, off the reactor: the rows the object accounts for are
        // compared with its rows, and those past it go into a new open file.
        let (def, staging, ratio) = (
            part.def.clone(),
            self.staging.path().to_path_buf(),
            part.size_ratio,
        );
        let (part_key, resume) = (part.key(), part.unwritten_from());
        let failed = move |e: parquet::errors::ParquetError, what: &str| StagingFailed {
            key: part_key.clone(),
            resume,
            error: anyhow::Error::new(e).context(what.to_owned()),
        };
        let read = tokio::task::spawn_blocking(move || {
            let adopted = plan.offsets()?;
            let mut theirs = Vec::new();
            for batch in plan.read(size, pieces)? {
                theirs.extend(parquet_file::row_ids_of(&batch)?);
            }
            let after = open_file::rows_after(&staged, adopted.last)
                .map_err(|e| failed(e, "cannot read the staged file"))?;
            let differ = parquet_file::other_messages(&after.covered_ids, &theirs);
            if !differ.is_empty() || after.batches.is_empty() {
                return Ok::<_, anyhow::Error>((adopted, differ, None, after));
            }
            let rest = OpenFile::create(&def, &staging, targets, ratio).and_then(|mut file| {
                for batch in &after.batches {
                    file.write_batch(batch)?;
                }
                Ok(file)
            });
            let rest =
                rest.map_err(|e| failed(e, "cannot stage the rows after an adopted file"))?;
            Ok((adopted, differ, Some(rest), after))
        })
        .await?;
        let (adopted, differ, rest, after) = match read {
            Ok(read) => read,
            Err(e) => match e.downcast::<StagingFailed>() {
                Ok(failed) => return Err(failed.into()),
                Err(e) => {
                    self.landing_conflict(key, object, Conflict::Unreadable(e));
                    return Ok(());
                }
            },
        };
        if let Some(&first) = differ.first() {
            self.landing_conflict(key, object, Conflict::OtherMessages(first));
            return Ok(());
        }
        tracing::info!(
            object,
            last_offset = adopted.last,
            "adopted existing landing file"
        );
        let part = self
            .parts
            .get_mut(key)
            .context("partition state vanished")?;
        ::metrics::counter!(m::ADOPTED_FILES, "stream" => part.def.name.clone()).increment(1);
        self.stats.adopted_files.fetch_add(1, Ordering::Relaxed);
        self.stats.count_adopted(part, after.covered);
        part.adopt_through(adopted.last, after.first_ingest_ts);
        part.file = rest;
        Ok(())
    }

    /// An object at a key of the partition holds other messages at the same offsets (a topic
    /// deleted and created again while the landing zone kept its files), or cannot be read as
    /// what the sink writes there: the partition stops rather than skip its messages as written
    /// (or, before, stop the whole sink, and every restart with it).
    fn landing_conflict(&mut self, key: &PartKey, object: &str, conflict: Conflict) {
        match conflict {
            Conflict::OtherMessages(first_offset) => tracing::error!(
                object,
                first_offset,
                "the object at this key holds other messages than the partition has at the same offsets (was the topic deleted and created again?): the partition stops here and nothing of it is committed; move the old objects away and restart the sink"
            ),
            Conflict::Unreadable(e) => tracing::error!(
                object,
                error = %format!("{e:#}"),
                "the object at this key cannot be read as a landing file or dead letters: the partition stops here and nothing of it is committed; move the object away and restart the sink"
            ),
        }
        self.stats.landing_conflicts.fetch_add(1, Ordering::Relaxed);
        if let Some(part) = self.parts.get_mut(key) {
            ::metrics::counter!(m::LANDING_CONFLICTS, "stream" => part.def.name.clone())
                .increment(1);
            part.stopped = true;
        }
    }

    /// Runs a store request (a write, or the read of an object to adopt) until it succeeds;
    /// `None` when shutdown interrupted the retries.
    async fn with_retry<T, F, Fut>(&self, object: &str, mut write: F) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        if self.shutdown.is_cancelled() && self.store_given_up.load(Ordering::Relaxed) {
            return None;
        }
        let mut attempt = 0;
        loop {
            let result = write().await;
            self.stats
                .store_failing
                .store(result.is_err(), Ordering::Relaxed);
            match result {
                Ok(outcome) => return Some(outcome),
                Err(e) => {
                    ::metrics::counter!(m::STORE_ERRORS, "retryable" => if e.retryable { "true" } else { "false" }).increment(1);
                    tracing::warn!(object, error = %e, attempt, "store request failed");
                    tokio::select! {
                        _ = tokio::time::sleep(store::backoff(attempt)) => {}
                        _ = self.shutdown.cancelled(), if attempt >= 3 => {
                            tracing::warn!("the store fails at shutdown: what is not written yet is not tried, and is read again by the partitions' next owners");
                            self.store_given_up.store(true, Ordering::Relaxed);
                            return None;
                        }
                    }
                    attempt += 1;
                }
            }
        }
    }

    /// Commits the partition's next offset. A failed commit is logged and retried once the
    /// partition is idle: the records are durable, and whoever reads them meanwhile adopts the
    /// existing object.
    async fn commit(&mut self, key: &PartKey) {
        if self.commits_given_up {
            return;
        }
        let Some(part) = self.parts.get_mut(key) else {
            return;
        };
        let Some(next) = part.next_offset else {
            return;
        };
        let mut list = TopicPartitionList::new();
        if let Err(e) = list.add_partition_offset(&part.topic, part.partition, Offset::Offset(next))
        {
            tracing::warn!(error = %e, "cannot build commit");
            return;
        }
        let consumer = self.consumer.clone();
        let result =
            tokio::task::spawn_blocking(move || consumer.commit(&list, CommitMode::Sync)).await;
        match result {
            Ok(Ok(())) => {
                tracing::debug!(topic = %key.0, partition = key.1, offset = next, "committed");
                if let Some(part) = self.parts.get_mut(key) {
                    part.committed = Some(next);
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(topic = %key.0, partition = key.1, error = %e, "offset commit failed; retried when the partition is idle");
                if self.shutdown.is_cancelled() {
                    tracing::warn!(
                        "offset commits fail at shutdown: the other partitions' are not tried; their records are written, and their next owners adopt them"
                    );
                    self.commits_given_up = true;
                }
                // The idle timer retries it (a broker that refuses at once is not asked every
                // tick).
                if let Some(part) = self.parts.get_mut(key) {
                    part.last_append = Instant::now();
                }
            }
            Err(e) => tracing::warn!(error = %e, "offset commit task failed"),
        }
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
