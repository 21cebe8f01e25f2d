//! `ingest-gateway redrive`: records the gateway rejected, back into their stream's topic once
//! its definition takes them.
//!
//! Every rejected record is in the dead-letter topic (`kafka.dead_letter_topic`) as it came, with
//! its stream and reason in headers. A client was told which of its records were rejected, but
//! most do not send them again (an agent counts them and goes on), so records rejected because
//! a gateway's definition lagged behind its producers (its file not yet updated) were lost for
//! the landing zone. `redrive --stream S` reads the dead-letter topic from its start to its end,
//! checks each record of stream `S` (from `--since` on) against the definition in `streams_dir`
//! as it is now, and produces those that pass to the stream's topic in the gateway's wire format
//! (the `ingest-ts` is the redrive's); the sinks land them like any record. Records still
//! invalid, and those cut at 64 KiB in the dead-letter topic, stay, counted.
//!
//! Dead letters are never changed. Once Kafka acknowledged a group of redriven records, a
//! *redrive note* listing their dead-letter offsets is appended to the dead-letter topic itself
//! (header `redriven` = the stream, no `stream` header, so readers of dead letters pass it by),
//! and a later run reads the notes first and leaves those records out. So runs may overlap
//! (a `--since` too early, or none) without producing a record twice; only a crash between
//! Kafka's acknowledgement and the note does, and the sinks drop such a copy by content hash
//! within their dedupe window.
//!
//! A record may also be in the dead-letter topic twice: a producer that crashed after its dead
//! letters were produced but before it answered (or, for the agent's Kafka output, before the
//! batch left its spool) produces them again when the batch is retried. Such copies carry the
//! same `batch-id` and `record-index` headers; a run takes the first and leaves the others out
//! (`repeated`), remembering the last [`REPEAT_WINDOW`] of them.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use schemas::window::{Digest, DigestWindow};
use schemas::wire::{
    DLQ_HEADER_BATCH, DLQ_HEADER_INDEX, DLQ_HEADER_REDRIVEN, DLQ_HEADER_STREAM,
    DLQ_HEADER_TRUNCATED,
};
use schemas::{Streams, ValidRecord};
use serde::{Deserialize, Serialize};
use service_kit::kafka::redrive::Tally;
use service_kit::kafka::{DeliveryGroup, GroupProducer, Messages};

use crate::GatewayConfig;

/// Records checked and produced together (memory: their values).
const CHUNK: usize = 10_000;
/// How long the dead-letter topic may give nothing before its end is reached.
const QUIET: Duration = Duration::from_secs(30);
/// How often a long read of the dead-letter topic logs its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// Most offsets in one redrive note (its value stays far below Kafka's 1 MB message limit).
const NOTE_OFFSETS: usize = 2_000;
/// Dead letters of a batch id a run remembers, to leave their repeats out: at most 32 bytes
/// each (`schemas::window`), 32 MB. A retry follows its batch within minutes, so a repeat
/// comes long before a million other dead letters.
const REPEAT_WINDOW: usize = 1_000_000;

/// A redrive note's value: dead letters of one partition that a run produced again.
#[derive(Debug, Serialize, Deserialize)]
struct Note {
    partition: i32,
    offsets: Vec<i64>,
}

/// What to redrive.
#[derive(Debug, Clone, Default)]
pub struct RedriveOptions {
    pub stream: String,
    /// Only records that went to the dead-letter topic at or after this time (ms since the
    /// epoch, against their Kafka timestamps; the topic is read from its start all the same,
    /// as brokers differ in finding offsets by time); `None`: all of them.
    pub since_ms: Option<i64>,
    /// Check and count, produce nothing.
    pub dry_run: bool,
}

/// What a run did.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct RedriveReport {
    pub stream: String,
    /// The dead-letter topic read.
    pub dead_letter_topic: String,
    /// Its dead letters read, of every stream (redrive notes are not counted).
    pub read: u64,
    /// Of those, the ones older than `--since` (by their Kafka timestamp), left out.
    pub before_since: u64,
    /// Of the stream, those cut at 64 KiB in the dead-letter topic: they cannot be redriven.
    pub truncated: u64,
    /// Of the stream, those an earlier run redrove (its redrive notes list them): left out.
    pub redriven_before: u64,
    /// Of the stream, copies of a dead letter read before (the same `batch-id` and
    /// `record-index`: its batch was produced again after a crash): left out.
    pub repeated: u64,
    /// Of the stream, checked against the definition as it is now.
    #[serde(flatten)]
    pub tally: Tally,
    /// The latest time (ms since the epoch) of a message read: `--since` for the next run.
    pub read_through_ms: Option<i64>,
    pub dry_run: bool,
}

/// Redrives the records of `options.stream` in the dead-letter topic.
pub async fn redrive(
    config: &GatewayConfig,
    streams: &Streams,
    options: &RedriveOptions,
) -> anyhow::Result<RedriveReport> {
    let stream = options.stream.as_str();
    let def = service_kit::kafka::redrive::definition(streams, stream, &config.streams_dir)?;
    let dlq = config.kafka.dead_letter_topic.clone();
    let topic = schemas::wire::topic_name(&config.kafka.topic_prefix, stream);
    let starts = {
        // Metadata and watermarks are blocking calls: on the blocking pool.
        let (config, dlq) = (config.clone(), dlq.clone());
        tokio::task::spawn_blocking(move || starts(&config, &dlq)).await??
    };
    let producer = if options.dry_run {
        None
    } else {
        Some(service_kit::kafka::redrive::producer(
            &config.kafka.brokers,
            |c| crate::produce::configure(c, &config.kafka),
        )?)
    };
    let mut report = RedriveReport {
        stream: stream.to_owned(),
        dead_letter_topic: dlq.clone(),
        dry_run: options.dry_run,
        ..RedriveReport::default()
    };
    // First the notes of earlier runs: one may come after (or in another partition than) the
    // dead letters it lists.
    let mut done = HashSet::new();
    let mut reader = Reader::new(config, &dlq, &starts, "notes of earlier runs").await?;
    while let Some(message) = reader.next().await? {
        if header(&message, DLQ_HEADER_REDRIVEN) == Some(stream.as_bytes()) {
            let note: Note = match serde_json::from_slice(message.payload().unwrap_or_default()) {
                Ok(note) => note,
                Err(e) => {
                    tracing::warn!(partition = message.partition(), offset = message.offset(), error = %e, "a redrive note that cannot be read: left alone");
                    continue;
                }
            };
            done.extend(note.offsets.into_iter().map(|o| (note.partition, o)));
        }
    }
    drop(reader);

    let mut pending = Pending {
        def,
        stream,
        topic: &topic,
        dlq: &dlq,
        producer: producer.as_ref(),
        messages: Messages::new(def, CHUNK, 0),
        offsets: BTreeMap::new(),
    };
    let mut seen = DigestWindow::new(REPEAT_WINDOW, 0);
    let mut reader = Reader::new(config, &dlq, &starts, "dead letters").await?;
    while let Some(message) = reader.next().await? {
        if header(&message, DLQ_HEADER_REDRIVEN).is_some() {
            continue;
        }
        report.read += 1;
        let at = message.timestamp().to_millis();
        report.read_through_ms = report.read_through_ms.max(at);
        if let (Some(since), Some(at)) = (options.since_ms, at)
            && at < since
        {
            report.before_since += 1;
            continue;
        }
        if header(&message, DLQ_HEADER_STREAM) != Some(stream.as_bytes()) {
            continue;
        }
        if let Some(id) = copy_id(&message)
            && !seen.insert(id, 0)
        {
            report.repeated += 1;
            continue;
        }
        if done.contains(&(message.partition(), message.offset())) {
            report.redriven_before += 1;
            continue;
        }
        if header(&message, DLQ_HEADER_TRUNCATED) == Some(b"true") {
            report.truncated += 1;
            continue;
        }
        let payload = message.payload().unwrap_or_default();
        if let Some(valid) = report.tally.check(def, payload) {
            pending
                .push(&valid, message.partition(), message.offset())
                .await?;
        }
    }
    pending.send().await?;
    Ok(report)
}

/// What the copies of one dead letter share: its batch id and index in the batch, hashed;
/// `None` for a dead letter without a batch id (a request without an Idempotency-Key).
fn copy_id(message: &BorrowedMessage<'_>) -> Option<Digest> {
    let batch = header(message, DLQ_HEADER_BATCH)?;
    let index = header(message, DLQ_HEADER_INDEX).unwrap_or_default();
    let mut hasher = blake3::Hasher::new();
    hasher.update(&(batch.len() as u64).to_le_bytes());
    hasher.update(batch);
    hasher.update(index);
    let hash = hasher.finalize();
    Some(Digest::from_le_bytes(
        hash.as_bytes()[..16].try_into().expect("16 bytes"),
    ))
}

/// The value of a message's header `key`.
fn header<'a>(message: &'a BorrowedMessage<'_>, key: &str) -> Option<&'a [u8]> {
    message
        .headers()?
        .iter()
        .find(|h| h.key == key)
        .and_then(|h| h.value)
}

/// Records that pass now, not produced yet, and their dead-letter offsets.
struct Pending<'a> {
    def: &'a schemas::StreamDef,
    stream: &'a str,
    /// The stream's topic.
    topic: &'a str,
    dlq: &'a str,
    /// `None` with a dry run.
    producer: Option<&'a GroupProducer>,
    messages: Messages,
    offsets: BTreeMap<i32, Vec<i64>>,
}

impl Pending<'_> {
    /// Adds a record that passes, from `offset` of the dead-letter topic's `partition`; sends
    /// what is pending once it holds [`CHUNK`] records.
    async fn push(
        &mut self,
        valid: &ValidRecord,
        partition: i32,
        offset: i64,
    ) -> anyhow::Result<()> {
        self.messages.push(self.def, valid);
        self.offsets.entry(partition).or_default().push(offset);
        if self.messages.len() >= CHUNK {
            self.send().await?;
        }
        Ok(())
    }

    /// Produces the pending records to the stream's topic, then, once Kafka acknowledged them,
    /// the redrive notes of their dead-letter offsets (nothing with a dry run), and empties.
    async fn send(&mut self) -> anyhow::Result<()> {
        let (topic, dlq, stream) = (self.topic, self.dlq, self.stream);
        if let Some(producer) = self.producer
            && !self.messages.is_empty()
        {
            service_kit::kafka::redrive::produce(producer, [(topic, &self.messages)]).await?;
            tracing::info!(records = self.messages.len(), topic, "redriven");
            let mut group = DeliveryGroup::new();
            for (&partition, offsets) in &self.offsets {
                for offsets in offsets.chunks(NOTE_OFFSETS) {
                    let note = serde_json::to_vec(&Note {
                        partition,
                        offsets: offsets.to_vec(),
                    })?;
                    let headers = OwnedHeaders::new().insert(Header {
                        key: DLQ_HEADER_REDRIVEN,
                        value: Some(stream),
                    });
                    group
                        .send(producer, dlq, stream, &note, headers)
                        .with_context(|| format!("cannot produce a redrive note to {dlq}"))?;
                }
            }
            service_kit::kafka::redrive::settle(group).await.with_context(|| {
                format!("redrive notes to {dlq}: the records were produced, and a later run produces them again")
            })?;
        }
        self.messages = Messages::new(self.def, CHUNK, 0);
        self.offsets.clear();
        Ok(())
    }
}

/// The dead-letter topic's partitions with something in them, and their start offsets.
fn starts(config: &GatewayConfig, dlq: &str) -> anyhow::Result<BTreeMap<i32, i64>> {
    let consumer = consumer(config)?;
    let timeout = Duration::from_secs(10);
    let metadata = consumer
        .fetch_metadata(Some(dlq), timeout)
        .with_context(|| format!("cannot read the metadata of {dlq}"))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    anyhow::ensure!(
        !partitions.is_empty(),
        "the dead-letter topic {dlq} does not exist"
    );
    let mut starts = BTreeMap::new();
    for p in partitions {
        // Only "anything there" is taken from the end: a Kafka-protocol broker has given 1 as
        // the end of a partition holding 23 records in one batch. The reader stops at EOF
        // events instead.
        let (low, high) = consumer.fetch_watermarks(dlq, p, timeout)?;
        if low < high {
            starts.insert(p, low);
        }
    }
    Ok(starts)
}

/// A consumer of the dead-letter topic, in no group's offsets (nothing is committed).
fn consumer(config: &GatewayConfig) -> anyhow::Result<StreamConsumer> {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &config.kafka.brokers)
        .set("group.id", "ingest-gateway-redrive")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true");
    service_kit::kafka::security::apply(
        &mut client,
        config.kafka.tls.as_ref(),
        config.kafka.sasl.as_ref(),
    )?;
    Ok(client.create()?)
}

/// Reads the dead-letter topic's partitions from their starts to their ends (an EOF event each).
/// A run's own notes may come before its end: they are notes, and passed by.
struct Reader {
    consumer: StreamConsumer,
    dlq: String,
    /// The partitions not read through yet.
    left: BTreeSet<i32>,
    last: Instant,
    /// What this pass is for, and its messages so far (progress is logged every 10 s).
    pass: &'static str,
    read: u64,
    logged: Instant,
}

impl Reader {
    async fn new(
        config: &GatewayConfig,
        dlq: &str,
        starts: &BTreeMap<i32, i64>,
        pass: &'static str,
    ) -> anyhow::Result<Reader> {
        let mut assigned = TopicPartitionList::new();
        for (&p, &low) in starts {
            assigned.add_partition_offset(dlq, p, Offset::Offset(low))?;
        }
        let consumer = {
            let config = config.clone();
            tokio::task::spawn_blocking(move || {
                let consumer = consumer(&config)?;
                consumer.assign(&assigned)?;
                anyhow::Ok(consumer)
            })
            .await??
        };
        Ok(Reader {
            consumer,
            dlq: dlq.to_owned(),
            left: starts.keys().copied().collect(),
            last: Instant::now(),
            pass,
            read: 0,
            logged: Instant::now(),
        })
    }

    /// The next message; `None` once every partition is read through.
    async fn next(&mut self) -> anyhow::Result<Option<BorrowedMessage<'_>>> {
        loop {
            if self.left.is_empty() {
                return Ok(None);
            }
            let received =
                tokio::time::timeout(Duration::from_millis(200), self.consumer.recv()).await;
            let message = match received {
                Ok(Err(KafkaError::PartitionEOF(partition))) => {
                    self.left.remove(&partition);
                    continue;
                }
                Ok(m) => m.with_context(|| format!("cannot read {}", self.dlq))?,
                Err(_) if self.last.elapsed() > QUIET => anyhow::bail!(
                    "{} gave nothing for {QUIET:?} before its end: partitions {:?} short",
                    self.dlq,
                    self.left.iter().collect::<Vec<_>>()
                ),
                Err(_) => continue,
            };
            self.last = Instant::now();
            self.read += 1;
            if self.logged.elapsed() >= PROGRESS_EVERY {
                self.logged = self.last;
                tracing::info!(pass = self.pass, messages = self.read, partitions_left = self.left.len(), topic = %self.dlq, "reading the dead-letter topic");
            }
            return Ok(Some(message));
        }
    }
}
