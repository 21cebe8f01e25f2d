//! Producers that write in transactions (as Kafka Streams, Flink and Kafka Connect do in
//! exactly-once mode), on Apache Kafka: committed transactions interleaved with aborted ones and
//! with a plain producer on the same partitions. Every committed and every plain record lands
//! once, no aborted one lands, and the offsets that the transaction markers and the aborted
//! records take are gone past without a gap, also by a sink that takes over in the middle of an
//! open transaction. Records deleted before a sink read them (`kafka-delete-records`) are still
//! a gap that stops the partition. pyarrow reads what landed, and Kafka's `kafka-consumer-groups`
//! the group's committed offsets.

use crate::common;
use crate::support;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use serde_json::{Value, json};
use sink::config::OffsetGapPolicy;
use sink::{Sink, SinkConfig, SinkStats};
use tokio_util::sync::CancellationToken;

const PARTITIONS: i32 = 2;
const TIMEOUT: Duration = Duration::from_secs(30);

/// Readings that are all distinct, `first` to `first + n - 1`.
fn readings(first: usize, n: usize) -> Vec<Value> {
    (first..first + n)
        .map(|i| {
            json!({
                "device_id": format!("dev-{:03}", i % 16),
                "sensor": "pressure",
                "ts": 1_767_225_600_000i64 + i as i64,
                "value": i as f64 / 4.0,
                "unit": "bar",
                "quality": 192,
            })
        })
        .collect()
}

/// A producer; transactional (with its transactions initialised) when given an id.
fn producer(bootstrap: &str, transactional_id: Option<&str>) -> FutureProducer {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "5");
    if let Some(id) = transactional_id {
        config.set("transactional.id", id);
    }
    let producer: FutureProducer = config.create().unwrap();
    if transactional_id.is_some() {
        producer.init_transactions(TIMEOUT).unwrap();
    }
    producer
}

/// Sends `records` keyed by device (so both partitions get some) and waits for every
/// acknowledgement (inside a transaction: for the records to be sent).
async fn send(producer: &FutureProducer, topic: &str, records: &[Value]) {
    let sends = records.iter().map(|r| {
        let (key, value) = (r["device_id"].as_str().unwrap(), r.to_string());
        async move {
            producer
                .send(FutureRecord::to(topic).key(key).payload(&value), TIMEOUT)
                .await
                .map(drop)
                .map_err(|(e, _)| e)
        }
    });
    for sent in futures::future::join_all(sends).await {
        sent.unwrap();
    }
}

/// A transactional and a plain producer on one topic, and what they sent: what is to land and
/// what was aborted.
struct Feed {
    plain: FutureProducer,
    txn: FutureProducer,
    topic: String,
    next: usize,
    expected: Vec<Value>,
    aborted: Vec<Value>,
}

/// A transaction left open: its records, and how many plain ones were sent beside it.
struct Open {
    records: Vec<Value>,
    plain: usize,
}

impl Feed {
    /// Opens a transaction and sends 20 readings in it, and 20 with the plain producer beside it.
    async fn open(&mut self) -> Open {
        let (t, p) = (readings(self.next, 20), readings(self.next + 20, 20));
        self.next += 40;
        self.txn.begin_transaction().unwrap();
        send(&self.txn, &self.topic, &t).await;
        send(&self.plain, &self.topic, &p).await;
        let plain = p.len();
        self.expected.extend(p);
        Open { records: t, plain }
    }

    /// Commits or aborts the open transaction of `records`.
    fn end(&mut self, records: Vec<Value>, abort: bool) {
        if abort {
            self.txn.abort_transaction(TIMEOUT).unwrap();
            self.aborted.extend(records);
        } else {
            self.txn.commit_transaction(TIMEOUT).unwrap();
            self.expected.extend(records);
        }
    }

    /// Round `n`: a transaction beside plain records, every third one aborted.
    async fn round(&mut self, n: usize) {
        let open = self.open().await;
        self.end(open.records, n % 3 == 1);
    }
}

fn config(bootstrap: &str, prefix: &str, landing: &Path) -> SinkConfig {
    let mut config = support::local_config(bootstrap, landing, &format!("{prefix}sink"));
    config.kafka.topic_prefix = prefix.to_owned();
    config
}

async fn start(config: SinkConfig) -> (Sink, CancellationToken) {
    let streams = service_kit::load_streams_dir(&config.streams_dir).unwrap();
    let shutdown = CancellationToken::new();
    let sink = sink::start(config, streams, shutdown.clone())
        .await
        .unwrap();
    (sink, shutdown)
}

async fn stop(sink: Sink, shutdown: CancellationToken) {
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
}

async fn wait_for(what: &str, stats: &SinkStats, done: impl Fn(&SinkStats) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !done(stats) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn written(stats: &SinkStats) -> u64 {
    stats.records_written.load(Ordering::Relaxed)
}

/// The earliest and the end offset of `topic`'s partition.
fn watermarks(bootstrap: &str, topic: &str, partition: i32) -> (i64, i64) {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    consumer
        .fetch_watermarks(topic, partition, Duration::from_secs(10))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_land_once_when_committed_never_when_aborted_and_leave_no_gap() {
    let bootstrap = common::service_env("EDGE_INGEST_KAFKA");
    let prefix = format!("txn{}.", common::unique_id());
    let topic = format!("{prefix}sensor_readings");
    let admin: AdminClient<_> = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    for made in admin
        .create_topics(
            &[NewTopic::new(
                &topic,
                PARTITIONS,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await
        .unwrap()
    {
        made.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let landing = dir.path().join("landing");
    let mut feed = Feed {
        plain: producer(&bootstrap, None),
        txn: producer(&bootstrap, Some(&format!("{prefix}producer"))),
        topic: topic.clone(),
        next: 0,
        expected: Vec::new(),
        aborted: Vec::new(),
    };

    let (first, shutdown) = start(config(&bootstrap, &prefix, &landing)).await;
    for n in 0..6 {
        feed.round(n).await;
    }
    wait_for("the first rounds", &first.stats, |s| {
        written(s) == feed.expected.len() as u64
    })
    .await;

    // A transaction is open when the sink stops: its records and the plain ones after them wait
    // behind it (read_committed), and the next sink takes them once it commits.
    let open = feed.open().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let first_written = written(&first.stats);
    assert_eq!(first_written as usize, feed.expected.len() - open.plain);
    let first_passed = first.stats.offsets_passed.load(Ordering::Relaxed);
    let first_gaps = first.stats.offset_gaps.load(Ordering::Relaxed);
    stop(first, shutdown).await;
    let (second, shutdown) = start(config(&bootstrap, &prefix, &landing)).await;
    feed.end(open.records, false);
    for n in 7..10 {
        feed.round(n).await;
    }
    let (expected, aborted, next) = (&feed.expected, &feed.aborted, feed.next);
    wait_for("every committed and plain record", &second.stats, |s| {
        first_written + written(s) == expected.len() as u64
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        first_written + written(&second.stats),
        expected.len() as u64
    );
    for (gaps, sink) in [
        (first_gaps, "first"),
        (second.stats.offset_gaps.load(Ordering::Relaxed), "second"),
    ] {
        assert_eq!(gaps, 0, "the {sink} sink found gaps");
    }
    assert_eq!(second.stats.gap_stopped.load(Ordering::Relaxed), 0);
    assert!(second.readiness.check().await, "not ready");
    // Every transaction left a marker, and the aborted ones their records: the sinks went
    // past all of those offsets of the partitions.
    let ends: i64 = (0..PARTITIONS)
        .map(|p| watermarks(&bootstrap, &topic, p).1)
        .sum();
    let passed = first_passed + second.stats.offsets_passed.load(Ordering::Relaxed);
    let held = expected.len() as i64 + aborted.len() as i64;
    assert!(passed >= aborted.len() as u64, "{passed} offsets passed");
    assert!(
        passed as i64 <= ends - expected.len() as i64,
        "{passed} offsets passed, of {} not landed",
        ends - expected.len() as i64
    );
    assert!(
        ends > held,
        "the markers take offsets: {ends} against {held}"
    );
    stop(second, shutdown).await;
    let landed = common::pyarrow(&["--dir", landing.join("landing").to_str().unwrap()]);
    common::assert_landed_exactly(expected, &landed);
    // Kafka's own `kafka-consumer-groups` agrees with the landing files: the group committed
    // each partition just past its last landed record (the markers after it are gone past
    // by the next sink that reads on).
    let (ok, out) = common::kafka::kafka_tool(
        "consumer-groups",
        &[
            "--bootstrap-server",
            &bootstrap,
            "--describe",
            "--group",
            &format!("{prefix}sink"),
            "--offsets",
        ],
    );
    assert!(ok, "kafka-consumer-groups failed: {out}");
    for partition in 0..PARTITIONS {
        // GROUP  TOPIC  PARTITION  CURRENT-OFFSET  LOG-END-OFFSET  LAG ...
        let committed: i64 = out
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.len() > 3 && f[1] == topic && f[2] == partition.to_string())
            .unwrap_or_else(|| panic!("partition {partition} not described: {out}"))[3]
            .parse()
            .unwrap();
        let last = landed["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["_partition"] == partition)
            .map(|r| r["_offset"].as_i64().unwrap())
            .max()
            .unwrap();
        assert_eq!(committed, last + 1, "partition {partition}: {out}");
    }

    // Records deleted before a sink read them are a gap still: the partition stops there.
    send(&feed.plain, &topic, &readings(next, 40)).await;
    let (_, end) = watermarks(&bootstrap, &topic, 0);
    let offsets = dir.path().join("delete.json");
    std::fs::write(
        &offsets,
        json!({"version": 1, "partitions": [{"topic": topic, "partition": 0, "offset": end}]})
            .to_string(),
    )
    .unwrap();
    let (ok, out) = common::kafka::kafka_tool(
        "delete-records",
        &[
            "--bootstrap-server",
            &bootstrap,
            "--offset-json-file",
            offsets.to_str().unwrap(),
        ],
    );
    assert!(ok, "kafka-delete-records failed: {out}");
    assert_eq!(watermarks(&bootstrap, &topic, 0).0, end);
    send(&feed.plain, &topic, &readings(next + 40, 40)).await;
    let (third, shutdown) = start(config(&bootstrap, &prefix, &landing)).await;
    wait_for("the partition to stop at the gap", &third.stats, |s| {
        s.gap_stopped.load(Ordering::Relaxed) == 1
    })
    .await;
    assert_eq!(third.stats.offset_gaps.load(Ordering::Relaxed), 1);
    assert!(
        !third.readiness.check().await,
        "ready while stopped at a gap"
    );
    let mut skipping = config(&bootstrap, &prefix, &landing);
    skipping.on_offset_gap = OffsetGapPolicy::Skip;
    third.reload.apply(skipping).unwrap();
    wait_for("the gap skipped", &third.stats, |s| {
        s.gap_stopped.load(Ordering::Relaxed) == 0 && s.offsets_skipped.load(Ordering::Relaxed) > 0
    })
    .await;
    stop(third, shutdown).await;
}
