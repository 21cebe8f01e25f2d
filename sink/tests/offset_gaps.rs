//! Offset gaps on librdkafka's mock cluster, which keeps at most 5 MiB of each partition and
//! drops the oldest record batches past that: a group's committed offset that falls out of
//! what the partition holds is reported with the exact range lost, stops the partition by
//! default (the sink unready, nothing landed or committed past it), and is skipped with a
//! dead-letter note once the policy says so; a new group starts at the earliest offset held
//! without a report. pyarrow reads the landed rows back.

use crate::common;
use crate::support;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::{Value, json};
use sink::config::OffsetGapPolicy;
use sink::{Sink, SinkConfig, SinkStats};
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "ingest.sensor_readings";
const GROUP: &str = "gap-sink";

/// Readings that are all distinct, `first` to `first + n - 1`.
fn readings(first: usize, n: usize) -> Vec<Value> {
    (first..first + n)
        .map(|i| {
            json!({
                "device_id": format!("dev-{:03}", i % 40),
                "sensor": "temperature",
                "ts": 1_767_225_600_000i64 + i as i64,
                "value": i as f64 / 8.0,
                "unit": "degC",
                "quality": 192,
                "tags": {"site": "s1", "pad": "x".repeat(64)},
            })
        })
        .collect()
}

/// Produces `records` in record batches of many messages (uncompressed, so that they take room
/// in the mock cluster), all acknowledged.
async fn produce(bootstrap: &str, records: &[Value]) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "20")
        .set("compression.type", "none")
        .create()
        .unwrap();
    let sends: Vec<_> = records
        .iter()
        .map(|r| {
            let (key, value) = (r["device_id"].as_str().unwrap(), r.to_string());
            let producer = producer.clone();
            async move {
                producer
                    .send(
                        FutureRecord::to(TOPIC).key(key).payload(&value),
                        Duration::from_secs(30),
                    )
                    .await
                    .map(|_| ())
            }
        })
        .collect();
    for result in futures::future::join_all(sends).await {
        result.unwrap();
    }
}

fn client(bootstrap: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", GROUP)
        .create()
        .unwrap()
}

/// The earliest and the end offset the partition holds.
fn watermarks(bootstrap: &str) -> (i64, i64) {
    client(bootstrap)
        .fetch_watermarks(TOPIC, 0, Duration::from_secs(5))
        .unwrap()
}

/// The group's committed offset of the partition.
fn committed(bootstrap: &str) -> Option<i64> {
    let mut list = TopicPartitionList::new();
    list.add_partition(TOPIC, 0);
    let committed = client(bootstrap)
        .committed_offsets(list, Duration::from_secs(5))
        .unwrap();
    match committed.find_partition(TOPIC, 0).map(|e| e.offset()) {
        Some(Offset::Offset(o)) => Some(o),
        _ => None,
    }
}

fn config(bootstrap: &str, landing: &Path, group: &str) -> SinkConfig {
    support::local_config(bootstrap, landing, group)
}

async fn wait_for(what: &str, stats: &SinkStats, done: impl Fn(&SinkStats) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done(stats) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn start(config: SinkConfig, streams: &schemas::Streams) -> (Sink, CancellationToken) {
    let shutdown = CancellationToken::new();
    let sink = sink::start(config, streams.clone(), shutdown.clone())
        .await
        .unwrap();
    (sink, shutdown)
}

async fn stop(sink: Sink, shutdown: CancellationToken) {
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
}

/// The dead-letter lines under `landing`.
fn dead_letter_lines(landing: &Path) -> Vec<Value> {
    let mut lines = Vec::new();
    let mut dirs = vec![landing.join("landing/_dead_letters")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "ndjson") {
                let text = std::fs::read_to_string(&path).unwrap();
                lines.extend(text.lines().map(|l| serde_json::from_str(l).unwrap()));
            }
        }
    }
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_offset_out_of_retention_stops_the_partition_then_is_skipped_with_a_note() {
    let cluster = MockCluster::new(1).unwrap();
    cluster.create_topic(TOPIC, 1, 1).unwrap();
    let bootstrap = cluster.bootstrap_servers();
    let streams =
        service_kit::load_streams_dir(&config(&bootstrap, Path::new("."), GROUP).streams_dir)
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let landing = dir.path().join("a");

    // The group lands and commits the first 100 readings.
    let first = readings(0, 100);
    produce(&bootstrap, &first).await;
    let (sink, shutdown) = start(config(&bootstrap, &landing, GROUP), &streams).await;
    wait_for("the first readings", &sink.stats, |s| {
        s.records_written.load(Ordering::Relaxed) == 100
    })
    .await;
    stop(sink, shutdown).await;
    assert_eq!(committed(&bootstrap), Some(100));

    // While no sink runs, so much is produced that the cluster drops the oldest batches,
    // offset 100 among them.
    let later = readings(100, 40_000);
    produce(&bootstrap, &later).await;
    let (earliest, end) = watermarks(&bootstrap);
    assert_eq!(end, 40_100);
    assert!(
        earliest > 100 && earliest < end,
        "the cluster keeps offsets {earliest} to {end}"
    );

    // Stop (the default): nothing past the gap is landed or committed, and the sink is not
    // ready.
    let (sink, shutdown) = start(config(&bootstrap, &landing, GROUP), &streams).await;
    wait_for("the partition to stop at the gap", &sink.stats, |s| {
        s.gap_stopped.load(Ordering::Relaxed) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sink.stats.offset_gaps.load(Ordering::Relaxed), 1);
    assert_eq!(sink.stats.offsets_skipped.load(Ordering::Relaxed), 0);
    assert_eq!(sink.stats.records_received.load(Ordering::Relaxed), 0);
    assert_eq!(sink.stats.records_written.load(Ordering::Relaxed), 0);
    assert!(
        !sink.readiness.check().await,
        "ready while stopped at a gap"
    );
    assert_eq!(committed(&bootstrap), Some(100));
    assert!(dead_letter_lines(&landing).is_empty());

    // A reload to skip lets it go on: the range is noted once, exactly, and every reading the
    // cluster still holds lands.
    let mut skipping = config(&bootstrap, &landing, GROUP);
    skipping.on_offset_gap = OffsetGapPolicy::Skip;
    let reloaded = sink.reload.apply(skipping).unwrap();
    assert_eq!(reloaded.in_force, ["on_offset_gap"]);
    let held = (end - earliest) as u64;
    wait_for("the readings after the gap", &sink.stats, |s| {
        s.records_written.load(Ordering::Relaxed) == held
    })
    .await;
    wait_for("the commit past them", &sink.stats, |_| {
        committed(&bootstrap) == Some(end)
    })
    .await;
    assert_eq!(sink.stats.gap_stopped.load(Ordering::Relaxed), 0);
    assert_eq!(
        sink.stats.offsets_skipped.load(Ordering::Relaxed),
        (earliest - 100) as u64
    );
    assert!(sink.readiness.check().await, "not ready after the skip");
    stop(sink, shutdown).await;

    let notes = dead_letter_lines(&landing);
    assert_eq!(notes.len(), 1, "{notes:?}");
    let note = &notes[0];
    assert_eq!(note["offset"], 100);
    assert_eq!(note["skipped_through"], earliest - 1);
    assert_eq!(note["skipped_records"], earliest - 100);
    assert_eq!(note["partition"], 0);
    assert!(note.get("payload_hex").is_none(), "{note}");
    let landed = common::pyarrow(&["--dir", landing.join("landing").to_str().unwrap()]);
    let mut expected = first.clone();
    expected.extend_from_slice(&later[(earliest - 100) as usize..]);
    common::assert_landed_exactly(&expected, &landed);
    // The range after the gap starts at the gap: its file's key is the one a sink that read
    // offsets 100 on would have written.
    let files: Vec<&str> = landed["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["key"].as_str().unwrap())
        .collect();
    assert!(
        files
            .iter()
            .any(|f| f.ends_with("-o00000000000000000100.parquet")),
        "{files:?}"
    );

    // A new group starts at the earliest offset held, without a report.
    let fresh = dir.path().join("b");
    let (sink, shutdown) = start(config(&bootstrap, &fresh, "gap-sink-new"), &streams).await;
    wait_for("a new group's landing", &sink.stats, |s| {
        s.records_written.load(Ordering::Relaxed) == held
    })
    .await;
    assert_eq!(sink.stats.offset_gaps.load(Ordering::Relaxed), 0);
    assert!(sink.readiness.check().await);
    stop(sink, shutdown).await;
    assert!(dead_letter_lines(&fresh).is_empty());
}
