//! The sink: a Kafka consumer group that writes Parquet landing files exactly once.
//!
//! Invariant: an offset is committed only after every record before it is in a durable object
//! (or was intentionally dropped as a duplicate or dead letter). Object keys are a function of
//! (stream, partition, start offset) and are created only if absent; when a create finds the
//! object there, the sink adopts it: it reads the object's last offset, drops the rows the
//! object already holds and commits past them.

pub mod cli;
pub mod config;
pub mod metrics;
pub mod open_file;
pub mod parquet_file;
pub mod partition;
pub mod redrive;
pub mod registry;
pub mod reload;
pub mod staging;
pub mod store;
pub mod table;
mod worker;

pub use worker::{READY_GROUP, window_capacity};

use worker::Worker;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use futures::StreamExt as _;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use schemas::window::{DigestWindow, MAX_UNTIMED_ENTRY_BYTES, digest};
use schemas::wire::{HEADER_INGEST_TS, parse_decimal_header, stream_of_topic, topic_name};
use schemas::{ContentHash, HashGroup, Pending, RecordError, Row, Streams};
use service_kit::{DefinitionFile, Reread};
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
    /// Errors the consumer reported in place of messages ([`m::CONSUMER_ERRORS`]).
    pub consumer_errors: AtomicU64,
    /// Offsets gone past that held no record for the sink: transaction markers, aborted
    /// transactions' records ([`m::OFFSETS_PASSED`]).
    pub offsets_passed: AtomicU64,
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
    log: service_kit::kafka::log::ClientLog,
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
    config.landing.check(&streams)?;
    if let Some(table) = &config.table {
        table.check()?;
    }
    let mut client = ClientConfig::new();
    service_kit::kafka::security::apply(
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
    let streams = config
        .select_streams(streams)
        .map_err(service_kit::config::invalid)?;
    config
        .landing
        .check(&streams)
        .map_err(service_kit::config::invalid)?;
    m::register(&streams);
    let store = ObjectStore::from_config(&config.store).await?;
    let tables = match &config.table {
        Some(table) => {
            table.check().map_err(service_kit::config::invalid)?;
            Some(table::Tables::open(table, store.clone(), &config.key_prefix).await?)
        }
        None => None,
    };
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
        // Only what producers committed: records of aborted transactions never land (the
        // offsets they and the transaction markers take are gone past, `worker::gaps`).
        .set("isolation.level", "read_committed")
        .set("statistics.interval.ms", "5000")
        .set("group.protocol", config.kafka.group_protocol.as_str());
    if config.kafka.group_protocol == config::GroupProtocol::Classic {
        // Only the partitions that move change hands in a rebalance; an eager one (librdkafka's
        // default) revokes every partition of every member, and each sink dropped its open
        // files whenever one joined or left the group. (The consumer protocol is incremental
        // of itself, and its timeouts are the brokers'.)
        client
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set(
                "session.timeout.ms",
                config.kafka.session_timeout_ms.to_string(),
            )
            .set(
                "heartbeat.interval.ms",
                (config.kafka.session_timeout_ms / 3).max(100).to_string(),
            );
    }
    if let Some(id) = &config.kafka.instance_id {
        client.set("group.instance.id", id);
    }
    let pattern = config.topic_pattern();
    if pattern.is_some() {
        // A topic created later (a stream defined after the start) is found at the next
        // metadata refresh: every 30 s rather than librdkafka's 5 minutes.
        client.set("topic.metadata.refresh.interval.ms", "30000");
    }
    service_kit::kafka::security::apply(
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
    tracing::info!(topics = ?topics, pattern = pattern.as_deref().unwrap_or("-"), store = %store.describe(), group = %config.kafka.group_id, group_protocol = config.kafka.group_protocol.as_str(), "sink started");
    let consumer = Arc::new(consumer);
    let readiness = Readiness {
        consumer: Arc::downgrade(&consumer),
        stats: stats.clone(),
    };
    if let Some(table) = config.table.as_ref().filter(|t| t.compaction.enabled) {
        tokio::spawn(table::compact::run(
            table.clone(),
            store.clone(),
            streams.iter().cloned().collect(),
            shutdown.child_token(),
        ));
    }
    let (reload, reloads) = Reload::new(&config);
    let worker = Worker::new(
        consumer,
        (
            store,
            tables,
            registry::Schemas::new(config.registry.as_ref())?,
        ),
        streams,
        (config, reloads),
        stats.clone(),
        shutdown,
        (staging, staging_budget),
    );
    Ok(Sink {
        task: tokio::spawn(worker.run()),
        stats,
        readiness,
        reload,
    })
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

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or_default()
}
