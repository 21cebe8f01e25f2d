//! `ingest-gateway redrive`: records the gateway rejected, back into their stream's topic once
//! its definition takes them.
//!
//! Every rejected record is in the dead-letter topic (`kafka.dead_letter_topic`) as it came, with
//! its stream and reason in headers. A client was told which of its records were rejected, but
//! most do not send them again (an agent counts them and goes on), so records rejected because
//! a gateway's definition lagged behind its producers (its file not yet updated) were lost for
//! the landing zone. `redrive --stream S` reads the dead-letter topic from its start to its end,
//! checks each record of stream `S` (from `--since` on) against the definition in `streams_dir`
//! as it is now, and produces those that pass to the stream's topic in the gateway's wire format (the `ingest-ts` is the redrive's); the sinks land them like any
//! record. Records still invalid, and those cut at 64 KiB in the dead-letter topic, stay, counted.
//! The dead-letter topic is only read. The run keeps no state: a window read twice produces its
//! records twice, and the sinks drop the second copy by content hash within their dedupe window,
//! so give `--since` the time of the fix (or of the last run's end, which the report gives).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use plumbing::kafka::{DLQ_HEADER_STREAM, DLQ_HEADER_TRUNCATED, GroupProducer, Messages};
use plumbing::redrive::Tally;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers as _, Message as _};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use schemas::Streams;
use serde::Serialize;

use crate::GatewayConfig;

/// Records checked and produced together (memory: their values).
const CHUNK: usize = 10_000;
/// How long the dead-letter topic may give nothing before its end is reached.
const QUIET: Duration = Duration::from_secs(30);

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
    /// Its messages read, of every stream.
    pub read: u64,
    /// Of those, the ones older than `--since` (by their Kafka timestamp), left out.
    pub before_since: u64,
    /// Of the stream, those cut at 64 KiB in the dead-letter topic: they cannot be redriven.
    pub truncated: u64,
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
    let def = plumbing::redrive::definition(streams, stream, &config.streams_dir)?;
    let dlq = config.kafka.dead_letter_topic.clone();
    let topic = schemas::wire::topic_name(&config.kafka.topic_prefix, stream);
    let (consumer, mut left) = {
        // Metadata and watermarks are blocking calls: on the blocking pool.
        let (config, dlq) = (config.clone(), dlq.clone());
        tokio::task::spawn_blocking(move || reader(&config, &dlq)).await??
    };
    let producer = if options.dry_run {
        None
    } else {
        Some(plumbing::redrive::producer(&config.kafka.brokers, |c| {
            crate::produce::configure(c, &config.kafka)
        })?)
    };
    let mut report = RedriveReport {
        stream: stream.to_owned(),
        dead_letter_topic: dlq.clone(),
        dry_run: options.dry_run,
        ..RedriveReport::default()
    };
    let mut messages = Messages::new(def, CHUNK, 0);
    let mut last = Instant::now();
    while !left.is_empty() {
        let message = match tokio::time::timeout(Duration::from_millis(200), consumer.recv()).await
        {
            Ok(Err(KafkaError::PartitionEOF(partition))) => {
                left.remove(&partition);
                continue;
            }
            Ok(m) => m.with_context(|| format!("cannot read {dlq}"))?,
            Err(_) if last.elapsed() > QUIET => anyhow::bail!(
                "{dlq} gave nothing for {QUIET:?} before its end: partitions {:?} short",
                left.iter().collect::<Vec<_>>()
            ),
            Err(_) => continue,
        };
        last = Instant::now();
        report.read += 1;
        let at = message.timestamp().to_millis();
        report.read_through_ms = report.read_through_ms.max(at);
        if let (Some(since), Some(at)) = (options.since_ms, at)
            && at < since
        {
            report.before_since += 1;
            continue;
        }
        let headers: HashMap<&str, &[u8]> = message
            .headers()
            .map(|h| h.iter().filter_map(|h| Some((h.key, h.value?))).collect())
            .unwrap_or_default();
        if headers.get(DLQ_HEADER_STREAM) != Some(&stream.as_bytes()) {
            continue;
        }
        if headers.get(DLQ_HEADER_TRUNCATED) == Some(&&b"true"[..]) {
            report.truncated += 1;
            continue;
        }
        let payload = message.payload().unwrap_or_default();
        if let Some(valid) = report.tally.check(def, payload) {
            messages.push(def, &valid);
        }
        if messages.len() >= CHUNK {
            send(producer.as_ref(), &topic, &mut messages, def).await?;
        }
    }
    send(producer.as_ref(), &topic, &mut messages, def).await?;
    Ok(report)
}

/// Produces what `messages` holds (nothing with a dry run) and empties it.
async fn send(
    producer: Option<&GroupProducer>,
    topic: &str,
    messages: &mut Messages,
    def: &schemas::StreamDef,
) -> anyhow::Result<()> {
    if let Some(producer) = producer
        && !messages.is_empty()
    {
        plumbing::redrive::produce(producer, [(topic, &*messages)]).await?;
        tracing::info!(records = messages.len(), topic, "redriven");
    }
    *messages = Messages::new(def, CHUNK, 0);
    Ok(())
}

/// A consumer assigned every partition of `dlq` with something in it, from its start, and those
/// partitions: each is read until the consumer reaches its end (an EOF event).
fn reader(config: &GatewayConfig, dlq: &str) -> anyhow::Result<(StreamConsumer, BTreeSet<i32>)> {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &config.kafka.brokers)
        .set("group.id", "ingest-gateway-redrive")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true");
    plumbing::kafka_security::apply(
        &mut client,
        config.kafka.tls.as_ref(),
        config.kafka.sasl.as_ref(),
    )?;
    let consumer: StreamConsumer = client.create()?;
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
    let mut assigned = TopicPartitionList::new();
    let mut assigned_partitions = BTreeSet::new();
    for p in partitions {
        let (low, high) = consumer.fetch_watermarks(dlq, p, timeout)?;
        if low < high {
            assigned.add_partition_offset(dlq, p, Offset::Offset(low))?;
            assigned_partitions.insert(p);
        }
    }
    consumer.assign(&assigned)?;
    Ok((consumer, assigned_partitions))
}
