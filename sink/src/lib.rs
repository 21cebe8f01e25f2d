//! The sink: a Kafka consumer group that writes Parquet landing files exactly once.
//!
//! Invariant: an offset is committed only after every record before it is in a durable object
//! (or was intentionally dropped as a duplicate or dead letter). Object keys are a function of
//! (stream, partition, start offset) and are created only if absent; when a create finds the
//! object there, the sink adopts it: it reads the object's last offset, drops the rows the
//! object already holds and commits past them.

pub mod config;
pub mod metrics;
pub mod parquet_file;
pub mod partition;
pub mod store;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use schemas::arrow::RowMeta;
use schemas::window::HashWindow;
use schemas::wire::{
    HEADER_INGEST_TS, decode_value, parse_decimal_header, stream_of_topic, topic_name,
};
use schemas::{ContentHash, Streams};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::SinkConfig;

use crate::metrics as m;
use crate::partition::{FlushReason, PartitionState};
use crate::store::{ObjectStore, PutOutcome};

/// Counters a caller (the demo, tests) can watch.
#[derive(Debug, Default)]
pub struct SinkStats {
    pub records_written: AtomicU64,
    pub files_written: AtomicU64,
    pub duplicates_dropped: AtomicU64,
    pub dead_letters: AtomicU64,
    pub adopted_files: AtomicU64,
}

/// A started sink.
pub struct Sink {
    pub task: JoinHandle<anyhow::Result<()>>,
    pub stats: Arc<SinkStats>,
}

type PartKey = (String, i32);

/// Hour folders searched for recent landing files when a partition's dedupe window is warmed.
pub const WARM_HOURS: i64 = 24;

/// Collects partitions revoked by a rebalance, so the worker drops their uncommitted rows.
#[derive(Default)]
struct SinkContext {
    revoked: Mutex<Vec<PartKey>>,
}

impl ClientContext for SinkContext {
    /// librdkafka's statistics (every `statistics.interval.ms`) carry the lag per partition.
    fn stats(&self, statistics: rdkafka::Statistics) {
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
        if let Rebalance::Revoke(list) = rebalance
            && let Ok(mut revoked) = self.revoked.lock()
        {
            revoked.extend(
                list.elements()
                    .iter()
                    .map(|e| (e.topic().to_owned(), e.partition())),
            );
        }
    }
}

/// Starts the sink: connects the store, joins the consumer group and runs until `shutdown`,
/// then writes and commits what is buffered.
pub async fn start(
    config: SinkConfig,
    streams: Streams,
    shutdown: CancellationToken,
) -> anyhow::Result<Sink> {
    let store = ObjectStore::from_config(&config.store).await?;
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &config.kafka.brokers)
        .set("group.id", &config.kafka.group_id)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "false")
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
    for (k, v) in &config.kafka.consumer {
        client.set(k, v);
    }
    let consumer: StreamConsumer<SinkContext> =
        client.create_with_context(SinkContext::default())?;
    let topics: Vec<String> = streams
        .iter()
        .map(|s| topic_name(&config.kafka.topic_prefix, &s.name))
        .collect();
    let topic_refs: Vec<&str> = topics.iter().map(String::as_str).collect();
    consumer
        .subscribe(&topic_refs)
        .context("cannot subscribe to the stream topics")?;
    tracing::info!(topics = ?topics, store = %store.describe(), group = %config.kafka.group_id, "sink started");
    let stats = Arc::new(SinkStats::default());
    let worker = Worker {
        consumer: Arc::new(consumer),
        store,
        streams,
        config,
        parts: HashMap::new(),
        stats: stats.clone(),
        shutdown,
    };
    Ok(Sink {
        task: tokio::spawn(worker.run()),
        stats,
    })
}

struct Worker {
    consumer: Arc<StreamConsumer<SinkContext>>,
    store: ObjectStore,
    streams: Streams,
    config: SinkConfig,
    parts: HashMap<PartKey, PartitionState>,
    stats: Arc<SinkStats>,
    shutdown: CancellationToken,
}

/// Ingest time of a message: the gateway's `ingest-ts` header, else the Kafka timestamp, else now.
fn ingest_ts(msg: &OwnedMessage) -> i64 {
    msg.headers()
        .and_then(|h| h.iter().find(|h| h.key == HEADER_INGEST_TS))
        .and_then(|h| h.value.and_then(parse_decimal_header))
        .or_else(|| msg.timestamp().to_millis().map(|ms| ms * 1000))
        .unwrap_or_else(now_micros)
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
        let idle = Duration::from_millis(self.config.rotation.idle_ms);
        let consumer = self.consumer.clone();
        loop {
            tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => break,
                _ = tick.tick() => {
                    self.drop_revoked();
                    let idle_parts: Vec<PartKey> = self
                        .parts
                        .iter()
                        .filter(|(_, p)| p.has_pending() && p.last_append.elapsed() >= idle)
                        .map(|(k, _)| k.clone())
                        .collect();
                    for key in idle_parts {
                        self.flush(&key, FlushReason::Idle).await?;
                    }
                }
                msg = consumer.recv() => {
                    // Detached: the message outlives awaits below (a borrowed one is not Send).
                    let msg = match msg {
                        Ok(msg) => msg.detach(),
                        Err(e) => {
                            tracing::warn!(error = %e, "consumer error");
                            continue;
                        }
                    };
                    self.drop_revoked();
                    self.open_partition(&msg).await;
                    if let Some(key) = self.rotates_before(&msg) {
                        self.flush(&key, FlushReason::Hour).await?;
                    }
                    if let Some((key, reason)) = self.handle(&msg) {
                        self.flush(&key, reason).await?;
                    }
                    if let Some(key) = self.over_budget() {
                        self.flush(&key, FlushReason::Memory).await?;
                    }
                }
            }
        }
        let keys: Vec<PartKey> = self.parts.keys().cloned().collect();
        for key in keys {
            self.flush(&key, FlushReason::Shutdown).await?;
        }
        tracing::info!("sink stopped");
        Ok(())
    }

    /// The partition with the most buffered bytes, when all buffers together pass the budget.
    fn over_budget(&self) -> Option<PartKey> {
        let total: usize = self.parts.values().map(|p| p.bytes).sum();
        ::metrics::gauge!(m::BUFFERED_BYTES).set(total as f64);
        if total <= self.config.memory_budget_bytes {
            return None;
        }
        self.parts
            .iter()
            .max_by_key(|(_, p)| p.bytes)
            .map(|(k, _)| k.clone())
    }

    fn drop_revoked(&mut self) {
        let revoked = std::mem::take(
            &mut *self
                .consumer
                .context()
                .revoked
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for key in revoked {
            if let Some(p) = self.parts.remove(&key) {
                tracing::info!(topic = %key.0, partition = key.1, dropped_rows = p.rows.len(), "partition revoked");
            }
        }
    }

    /// Sets up the state of a partition the first time one of its messages arrives, with the
    /// dedupe window warmed from the partition's recent landing files, so that duplicates that
    /// straddle a restart or a rebalance are dropped too.
    async fn open_partition(&mut self, msg: &OwnedMessage) {
        let key = (msg.topic().to_owned(), msg.partition());
        if self.parts.contains_key(&key) {
            return;
        }
        let Some(def) = stream_of_topic(&self.config.kafka.topic_prefix, msg.topic())
            .and_then(|s| self.streams.get(s))
            .cloned()
        else {
            return;
        };
        let mut state =
            PartitionState::new(def.clone(), key.0.clone(), key.1, self.config.dedupe_window);
        match self.warm(&def.name, key.1, &mut state.window).await {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(topic = %key.0, partition = key.1, hashes = n, "warmed dedupe window")
            }
            Err(e) => {
                tracing::warn!(topic = %key.0, partition = key.1, error = %e, "cannot warm dedupe window")
            }
        }
        self.parts.insert(key, state);
    }

    /// Loads the content hashes of the newest landing files of a partition (from the last
    /// [`WARM_HOURS`] hour folders) into `window`, oldest first.
    async fn warm(
        &self,
        stream: &str,
        partition: i32,
        window: &mut HashWindow,
    ) -> anyhow::Result<usize> {
        let mut newest_first: Vec<Vec<ContentHash>> = Vec::new();
        let mut total = 0;
        tracing::debug!(stream, partition, "warming dedupe window");
        'hours: for prefix in parquet_file::recent_hour_prefixes(
            &self.config.key_prefix,
            stream,
            now_micros(),
            WARM_HOURS,
        ) {
            let mut files: Vec<(i64, String)> = self
                .store
                .list(&prefix)
                .await?
                .into_iter()
                .filter_map(|k| {
                    parquet_file::start_offset_of(&k, stream, partition).map(|o| (o, k))
                })
                .collect();
            files.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
            for (_, key) in files {
                if total >= window.capacity() {
                    break 'hours;
                }
                tracing::debug!(key, "reading content hashes");
                let Some(data) = self.store.get(&key).await? else {
                    continue;
                };
                let hashes =
                    tokio::task::spawn_blocking(move || parquet_file::read_hashes(data)).await??;
                total += hashes.len();
                newest_first.push(hashes);
            }
        }
        for hashes in newest_first.into_iter().rev() {
            for h in hashes {
                window.insert(h);
            }
        }
        Ok(total.min(window.capacity()))
    }

    /// The partition whose open file must close before `msg` joins it: its first record was
    /// ingested in another hour.
    fn rotates_before(&self, msg: &OwnedMessage) -> Option<PartKey> {
        let key = (msg.topic().to_owned(), msg.partition());
        let part = self.parts.get(&key)?;
        part.crosses_hour(ingest_ts(msg)).then_some(key)
    }

    /// Adds one message to its partition; returns the partition to flush, if one must be.
    fn handle(&mut self, msg: &OwnedMessage) -> Option<(PartKey, FlushReason)> {
        let topic = msg.topic();
        let def = stream_of_topic(&self.config.kafka.topic_prefix, topic)
            .and_then(|s| self.streams.get(s))?
            .clone();
        let key = (topic.to_owned(), msg.partition());
        // `open_partition` created the state (with its warmed window) before this call.
        let part = self.parts.get_mut(&key)?;
        let offset = msg.offset();
        let payload = msg.payload().unwrap_or_default();
        let labels = [("stream", def.name.clone())];
        ::metrics::counter!(m::RECORDS_RECEIVED, &labels).increment(1);
        if part.next_offset.is_some_and(|next| offset < next) {
            // Already durable in an adopted object.
            return None;
        }
        let ingest_ts = ingest_ts(msg);
        let record = match decode_value(&def, payload) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(topic, partition = msg.partition(), offset, reason = %e, "dead letter: undecodable or invalid record");
                ::metrics::counter!(m::DISCARDED, "stream" => def.name.clone(), "reason" => e.code(), "intentional" => "false").increment(1);
                self.stats.dead_letters.fetch_add(1, Ordering::Relaxed);
                part.dead_letter(offset, ingest_ts, &e.to_string(), payload);
                return None;
            }
        };
        let hash = schemas::content_hash(&def, &record);
        if !part.window.insert(hash) {
            ::metrics::counter!(m::DISCARDED, "stream" => def.name.clone(), "reason" => "duplicate", "intentional" => "true").increment(1);
            self.stats
                .duplicates_dropped
                .fetch_add(1, Ordering::Relaxed);
            part.skip(offset, ingest_ts);
            return None;
        }
        let meta = RowMeta {
            ingest_ts,
            partition: msg.partition(),
            offset,
            hash,
        };
        part.push(record, meta, payload.len());
        let rot = &self.config.rotation;
        if part.rows.len() >= rot.max_records {
            Some((key, FlushReason::Records))
        } else if part.bytes >= rot.max_bytes {
            Some((key, FlushReason::Bytes))
        } else {
            None
        }
    }

    /// Writes the partition's buffered rows as one object and commits past them. On a
    /// conflicting create, adopts the existing object. Retries retryable store errors until
    /// shutdown.
    async fn flush(&mut self, key: &PartKey, reason: FlushReason) -> anyhow::Result<()> {
        loop {
            let Some(part) = self.parts.get_mut(key) else {
                return Ok(());
            };
            let (Some(start), Some(next)) = (part.range_start, part.next_offset) else {
                return Ok(());
            };
            if !part.dead.is_empty() {
                let range = parquet_file::OffsetRange {
                    first: start.offset,
                    last: next - 1,
                };
                let object = parquet_file::dead_letter_key(
                    &self.config.key_prefix,
                    &part.def.name,
                    start.ingest_ts,
                    part.partition,
                    range,
                );
                let data = bytes::Bytes::from(std::mem::take(&mut part.dead));
                if self.put_with_retry(&object, data.clone()).await.is_none() {
                    if let Some(part) = self.parts.get_mut(key) {
                        part.dead = data.to_vec();
                    }
                    return Ok(());
                }
                tracing::info!(object, "wrote dead letters");
                continue;
            }
            if part.rows.is_empty() {
                // Only skipped records (duplicates, dead letters) since the last file.
                part.range_start = None;
                if part.next_offset > part.committed {
                    self.commit(key).await;
                }
                return Ok(());
            }
            let rows = std::mem::take(&mut part.rows);
            let (def, topic, partition) = (part.def.clone(), part.topic.clone(), part.partition);
            let range = parquet_file::OffsetRange {
                first: start.offset,
                last: next - 1,
            };
            let object = parquet_file::object_key(
                &self.config.key_prefix,
                &def.name,
                start.ingest_ts,
                partition,
                start.offset,
            );
            let (rows, encoded) = tokio::task::spawn_blocking(move || {
                let encoded = parquet_file::encode(&def, &topic, partition, range, &rows);
                (rows, encoded)
            })
            .await?;
            let data = encoded.context("cannot encode a Parquet file")?;
            let size = data.len();
            let started = Instant::now();
            let outcome = self.put_with_retry(&object, data).await;
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
                        .increment(rows.len() as u64);
                    ::metrics::counter!(m::BYTES_WRITTEN, "stream" => stream)
                        .increment(size as u64);
                    self.stats
                        .records_written
                        .fetch_add(rows.len() as u64, Ordering::Relaxed);
                    self.stats.files_written.fetch_add(1, Ordering::Relaxed);
                    part.bytes = 0;
                    part.range_start = None;
                    tracing::debug!(
                        object,
                        rows = rows.len(),
                        size,
                        reason = reason.as_str(),
                        "wrote landing file"
                    );
                }
                Some(PutOutcome::AlreadyExists) => {
                    let existing = self
                        .store
                        .get(&object)
                        .await?
                        .context("object vanished after a conflicting create")?;
                    let adopted =
                        tokio::task::spawn_blocking(move || parquet_file::read_offsets(existing))
                            .await??;
                    tracing::info!(
                        object,
                        last_offset = adopted.last,
                        "adopted existing landing file"
                    );
                    ::metrics::counter!(m::ADOPTED_FILES, "stream" => stream).increment(1);
                    self.stats.adopted_files.fetch_add(1, Ordering::Relaxed);
                    let part = self
                        .parts
                        .get_mut(key)
                        .context("partition state vanished")?;
                    part.rows = rows;
                    part.adopt_through(adopted.last);
                    continue;
                }
                None => {
                    // Shutting down while the store fails: nothing is committed, the records
                    // are read again by whoever owns the partition next.
                    return Ok(());
                }
            }
            self.commit(key).await;
        }
    }

    async fn put_with_retry(&self, object: &str, data: bytes::Bytes) -> Option<PutOutcome> {
        let mut attempt = 0;
        loop {
            match self.store.put_if_absent(object, data.clone()).await {
                Ok(outcome) => return Some(outcome),
                Err(e) => {
                    ::metrics::counter!(m::STORE_ERRORS, "retryable" => if e.retryable { "true" } else { "false" }).increment(1);
                    tracing::warn!(object, error = %e, attempt, "store write failed");
                    tokio::select! {
                        _ = tokio::time::sleep(store::backoff(attempt)) => {}
                        _ = self.shutdown.cancelled(), if attempt >= 3 => return None,
                    }
                    attempt += 1;
                }
            }
        }
    }

    /// Commits the partition's next offset. A failed commit is logged: the records are durable,
    /// and whoever reads them again adopts the existing object.
    async fn commit(&mut self, key: &PartKey) {
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
                if let Some(part) = self.parts.get_mut(key) {
                    part.committed = Some(next);
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(topic = %key.0, partition = key.1, error = %e, "offset commit failed")
            }
            Err(e) => tracing::warn!(error = %e, "offset commit task failed"),
        }
    }
}
