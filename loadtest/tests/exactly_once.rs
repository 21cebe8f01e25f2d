//! Exactly-once in the sink on the embedded mock cluster: a previous sink wrote a landing file
//! but crashed before committing its offsets. The next sink reads those records again, finds the
//! object at the same key, adopts it and lands only the rest; duplicates re-sent into Kafka and
//! an undecodable record are dropped.

mod common;

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use loadtest::fleet::{FleetSpec, sensor_readings};
use loadtest::verify::{Landed, VerifyOptions, compare, read_landing_dir, verify};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use schemas::arrow::RowMeta;
use sink::SinkConfig;
use sink::config::{IngestTime, RotationConfig, StoreConfig};
use sink::parquet_file::{OffsetRange, encode, object_key};
use sink::store::{ObjectStore, PutOutcome};
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "ingest.sensor_readings";
const BASE_TS: i64 = 1_767_225_600_000_000; // 2026-01-01T00:00:00Z in µs

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_adopts_a_file_written_before_a_crash() {
    // The sink's first file ends inside the crashed sink's range: all of it is adopted.
    adoption_case(25).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_adopts_a_shorter_file_and_lands_the_rest() {
    // The sink's first file reaches past the crashed sink's range: the rows after it are
    // re-encoded into the next file.
    adoption_case(60).await;
}

async fn adoption_case(max_records: usize) {
    let streams = schemas::example_streams();
    let def = streams.get("sensor_readings").unwrap().clone();
    let (cluster, producer) = mock_cluster(1);

    // 150 distinct readings; offsets 100..110 re-send earlier ones, offset 120 is garbage.
    let readings = distinct_readings(150);
    let mut values: Vec<Vec<u8>> = readings
        .iter()
        .map(|r| r.to_string().into_bytes())
        .collect();
    for i in 100..110 {
        values.insert(i, values[i - 100].clone());
    }
    values.insert(120, b"{not json".to_vec());
    for (i, v) in values.iter().enumerate() {
        send_with_ingest_ts(&producer, "k", v, &(BASE_TS + i as i64).to_string()).await;
    }

    // The crashed sink's file: offsets 0..=39, never committed.
    let landing = tempfile::tempdir().unwrap();
    let store = ObjectStore::Local(landing.path().to_path_buf());
    let data = file_of_offsets_0_to_39(&def, &readings[..40], BASE_TS);
    let key = object_key("landing", "sensor_readings", BASE_TS, 0, 0);
    assert_eq!(
        store.put_if_absent(&key, data).await.unwrap(),
        PutOutcome::Created
    );

    let (sink, shutdown) = start_local_sink(
        &cluster,
        landing.path(),
        "exactly-once",
        RotationConfig {
            idle_ms: 300,
            max_records,
            ..RotationConfig::default()
        },
    )
    .await;
    wait_written(&sink, 110).await;
    // Let an idle period pass so that any wrongly re-written file would show.
    tokio::time::sleep(Duration::from_millis(800)).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();

    assert!(sink.stats.adopted_files.load(Ordering::Relaxed) >= 1);
    assert_eq!(sink.stats.landing_conflicts.load(Ordering::Relaxed), 0);
    // Offsets 0..=39 are in the crashed sink's file: read again and not written again.
    assert_eq!(sink.stats.adopted_records.load(Ordering::Relaxed), 40);
    assert_eq!(
        sink.stats.records_settled(),
        sink.stats.records_received.load(Ordering::Relaxed),
        "{:?}",
        sink.stats
    );
    assert_eq!(sink.stats.records_received.load(Ordering::Relaxed), 161);
    assert_eq!(sink.stats.duplicates_dropped.load(Ordering::Relaxed), 10);
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), 1);
    // The same counts on /metrics, where this test has the process to itself (nextest's
    // default; under `cargo test` the two adoption tests share the recorder).
    let own_process = std::env::var("NEXTEST_EXECUTION_MODE").as_deref() == Ok("process-per-test");
    let metrics = plumbing::install_metrics().render();
    for (series, value) in [
        (
            r#"sink_discarded_records_total{stream="sensor_readings",reason="duplicate",intentional="true"}"#,
            10,
        ),
        (
            r#"sink_dead_letter_records_total{stream="sensor_readings"}"#,
            1,
        ),
    ] {
        assert!(
            !own_process || metrics.lines().any(|l| l == format!("{series} {value}")),
            "{series} {value} not in:\n{metrics}"
        );
    }
    let expected: HashSet<_> = readings
        .iter()
        .map(|r| schemas::check(&def, r.clone()).unwrap().hash)
        .collect();
    let landed = read_landing_dir(landing.path()).unwrap();
    let verdict = compare(&expected, &landed);
    assert!(verdict.exactly_once(), "{verdict:?}");
    assert_eq!(landed.rows, 150);

    // The undecodable record is in the dead-letter location with its offset and reason.
    let mut dead = Vec::new();
    for entry in walk(&landing.path().join("landing/_dead_letters")) {
        for line in std::fs::read_to_string(entry).unwrap().lines() {
            dead.push(serde_json::from_str::<serde_json::Value>(line).unwrap());
        }
    }
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["offset"], 120);
    assert!(
        dead[0]["reason"]
            .as_str()
            .unwrap()
            .starts_with("malformed JSON")
    );
    assert_eq!(dead[0]["payload_hex"], hex_of(b"{not json"));
    drop(cluster);
}

/// The object at a file's key cannot be read for a while (here: a folder stands where it
/// goes; on S3, a GET failing after the conflicting PUT): the sink retries the read as it
/// retries writes, instead of failing, and adopts the object once it can read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_to_adopt_that_cannot_be_read_yet_is_read_again() {
    let streams = schemas::example_streams();
    let def = streams.get("sensor_readings").unwrap().clone();
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(60);
    for (i, r) in readings.iter().enumerate() {
        let ts = (BASE_TS + i as i64).to_string();
        send_with_ingest_ts(&producer, "k", r.to_string().as_bytes(), &ts).await;
    }
    // The crashed sink's file of offsets 0..=39, not readable at first.
    let data = file_of_offsets_0_to_39(&def, &readings[..40], BASE_TS);
    let key = object_key("landing", "sensor_readings", BASE_TS, 0, 0);
    let landing = tempfile::tempdir().unwrap();
    let path = landing.path().join(&key);
    std::fs::create_dir_all(&path).unwrap();
    let rotation = RotationConfig {
        idle_ms: 300,
        max_records: 25,
        ..RotationConfig::default()
    };
    let (sink, shutdown) = start_local_sink(&cluster, landing.path(), "unreadable", rotation).await;
    wait_for("a failing read", 30, || {
        sink.stats.store_failing.load(Ordering::Relaxed)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(!sink.task.is_finished(), "the sink gave up");
    std::fs::remove_dir(&path).unwrap();
    let store = ObjectStore::Local(landing.path().to_path_buf());
    assert_eq!(
        store.put_if_absent(&key, data).await.unwrap(),
        PutOutcome::Created
    );
    wait_written(&sink, 20).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert_eq!(sink.stats.adopted_files.load(Ordering::Relaxed), 1);
    assert_exactly_once(&readings, landing.path());
    drop(cluster);
}

/// The topic was deleted and created again under the same name while the landing zone kept
/// the old topic's files: the new messages meet an old file at the key of their offsets. Its
/// rows are other messages (other content hashes and ingest times at the same offsets), so the
/// sink does not adopt it, which would skip the new messages as already landed and commit past
/// them; it stops the partition, commits nothing and counts the conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_landing_file_of_a_topic_created_again_is_not_adopted() {
    topic_created_again(false, false).await;
}

/// The same with the old topic's dead letters: adopted, the object would make the sink drop
/// the new topic's dead letters at those offsets as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_of_a_topic_created_again_are_not_adopted() {
    topic_created_again(true, false).await;
}

/// An object at a landing file's key, or at a dead-letter object's, that is not what the sink
/// writes there (a truncated copy, another program's file): its partition stops as at a
/// conflict, and the sink goes on. Before, the sink exited with the parse error, and every
/// restart again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_object_at_a_key_stops_its_partition_not_the_sink() {
    topic_created_again(false, true).await;
    topic_created_again(true, true).await;
}

/// New messages (readings, each fourth followed by garbage) meet an object the old topic left
/// at the key of their first offsets: a landing file of offsets 0 to 39, or (`dead_letters`) a
/// dead-letter object of offsets 4 to 44; with `unreadable`, bytes that are neither.
async fn topic_created_again(dead_letters: bool, unreadable: bool) {
    // The old object sits in this hour's folder, where the new messages' files go.
    clear_of_an_hour_boundary(Duration::from_secs(60)).await;
    let streams = schemas::example_streams();
    let def = streams.get("sensor_readings").unwrap().clone();
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(100);
    // The old topic's object: other readings or other garbage, ingested a day before.
    let landing = tempfile::tempdir().unwrap();
    let store = ObjectStore::Local(landing.path().to_path_buf());
    let old_ts = BASE_TS - 86_400_000_000;
    let (key, data) = if dead_letters {
        let mut old = sink::partition::PartitionState::new(def, TOPIC.into(), 0, 10);
        for offset in (4..=44).step_by(5) {
            let payload = format!("old garbage at {offset}");
            old.dead_letter(
                offset,
                old_ts + offset,
                "malformed JSON",
                payload.as_bytes(),
            );
        }
        let key =
            sink::parquet_file::dead_letter_key("landing", "sensor_readings", now_micros(), 0, 4);
        (key, bytes::Bytes::copy_from_slice(old.dead.text()))
    } else {
        let data = file_of_offsets_0_to_39(&def, &readings[50..90], old_ts);
        (
            object_key("landing", "sensor_readings", now_micros(), 0, 0),
            data,
        )
    };
    let data = match unreadable {
        true => bytes::Bytes::from_static(b"PAR1 not a landing file, nor JSON lines\n"),
        false => data,
    };
    assert_eq!(
        store.put_if_absent(&key, data.clone()).await.unwrap(),
        PutOutcome::Created
    );
    // The new topic's messages, ingested now.
    let mut garbage = Vec::new();
    send_with_garbage(&producer, &readings[..40], 0, &mut garbage).await;
    let (sink, shutdown) = start_local_sink(
        &cluster,
        landing.path(),
        "recreated",
        RotationConfig {
            idle_ms: 300,
            max_records: 25,
            ..RotationConfig::default()
        },
    )
    .await;
    wait_for("a conflict", 30, || {
        sink.stats.landing_conflicts.load(Ordering::Relaxed) > 0
    })
    .await;
    // Idle periods pass: nothing more is written or committed for the partition.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert_eq!(sink.stats.adopted_files.load(Ordering::Relaxed), 0);
    assert_eq!(
        sink.stats
            .adopted_dead_letter_objects
            .load(Ordering::Relaxed),
        0
    );
    assert_eq!(sink.stats.files_written.load(Ordering::Relaxed), 0);
    assert_eq!(committed(&cluster, "recreated", 0), None);
    // No landing file but the old one, as it was. (The new dead letters before the conflicting
    // file are written: they are the new topic's, at a key of their own.)
    let objects = walk(&landing.path().join("landing"));
    let files: Vec<_> = objects
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    if dead_letters {
        assert_eq!(objects, [landing.path().join(&key)]);
    } else {
        assert_eq!(files, [&landing.path().join(&key)]);
    }
    assert_eq!(
        std::fs::read(landing.path().join(&key)).unwrap(),
        data.to_vec()
    );
    drop(cluster);
}

/// A landing file of partition 0 as a sink writes it: `readings` (40) at offsets 0 to 39,
/// ingested from `ingest_ts` on, a microsecond apart.
fn file_of_offsets_0_to_39(
    def: &schemas::StreamDef,
    readings: &[serde_json::Value],
    ingest_ts: i64,
) -> bytes::Bytes {
    assert_eq!(readings.len(), 40);
    let rows: Vec<_> = readings
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let v = schemas::check(def, r.clone()).unwrap();
            let meta = RowMeta {
                ingest_ts: ingest_ts + i as i64,
                partition: 0,
                offset: i as i64,
                hash: v.hash,
            };
            (v.record, meta)
        })
        .collect();
    encode(def, TOPIC, 0, OffsetRange { first: 0, last: 39 }, &rows).unwrap()
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Waits for the next hour when less than `margin` of this one is left.
async fn clear_of_an_hour_boundary(margin: Duration) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let left = Duration::from_secs(3600 - now.as_secs() % 3600);
    if left < margin {
        tokio::time::sleep(left + Duration::from_secs(1)).await;
    }
}

/// A commit that the broker refuses after a file is written is retried once the partition is
/// idle, with no new records to carry it: before, the offset waited for the partition's next
/// records, and its lag showed meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_is_retried_when_the_partition_is_idle() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(30);
    for r in &readings {
        send_plain(&producer, "k", &r.to_string()).await;
    }
    // The next two offset commits fail (a partition-level error librdkafka does not retry).
    cluster.request_errors(
        RDKafkaApiKey::OffsetCommit,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OFFSET_METADATA_TOO_LARGE; 2],
    );
    let landing = tempfile::tempdir().unwrap();
    let (sink, shutdown) =
        start_local_sink(&cluster, landing.path(), "commit-retry", quick_rotation()).await;
    wait_written(&sink, 30).await;
    wait_for("the refused commit retried", 20, || {
        committed(&cluster, "commit-retry", 0) == Some(30)
    })
    .await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert_exactly_once(&readings, landing.path());
    drop(cluster);
}

/// A partition that never goes idle still lands its records within `rotation.max_age_ms`: a
/// reading every 100 ms for 6 s, all in one ingest hour, with no idle period, size or record
/// limit in reach. Without the age limit nothing would land before the sink stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steady_trickle_lands_within_the_max_age() {
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(60);
    let landing = tempfile::tempdir().unwrap();
    let (sink, shutdown) = start_local_sink(
        &cluster,
        landing.path(),
        "max-age",
        RotationConfig {
            idle_ms: 600_000,
            max_age_ms: 1_000,
            ..RotationConfig::default()
        },
    )
    .await;
    for (i, r) in readings.iter().enumerate() {
        let ts = (BASE_TS + i as i64).to_string();
        send_with_ingest_ts(&producer, "k", r.to_string().as_bytes(), &ts).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Everything lands while the sink runs, by age alone.
    wait_written(&sink, readings.len() as u64).await;
    let files = sink.stats.files_written.load(Ordering::Relaxed);
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert!(
        files >= 3,
        "{files} files for 6 s of readings at a 1 s age limit"
    );
    let landed = assert_exactly_once(&readings, landing.path());
    assert_eq!(landed.files.len() as u64, files, "{:?}", landed.files.len());
    assert!(landed.files.iter().all(|f| f.rows < readings.len()));
    drop(cluster);
}

/// Two sinks, each with a group of its own and a stream selection of its own (a pattern and a
/// name), land the two streams' topics between them: each only its own stream, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sinks_split_the_streams_by_selection() {
    let streams = schemas::example_streams();
    let (cluster, producer) = mock_cluster(1);
    let vehicle_topic = "ingest.vehicle_telemetry";
    cluster.create_topic(vehicle_topic, 2, 1).unwrap();
    let readings = distinct_readings(50);
    let reports: Vec<serde_json::Value> = (0..30)
        .map(|i| {
            serde_json::json!({
                "vehicle_id": format!("truck-{}", i % 3),
                "recorded_at": BASE_TS / 1_000 + i * 1_000,
                "lat": 52.0 + i as f64 / 100.0,
                "lon": 13.0,
            })
        })
        .collect();
    for (topic, records) in [(TOPIC, &readings), (vehicle_topic, &reports)] {
        for r in records.iter() {
            let value = r.to_string();
            producer
                .send(
                    FutureRecord::to(topic).key("k").payload(&value),
                    Duration::from_secs(5),
                )
                .await
                .unwrap();
        }
    }

    let shutdown = CancellationToken::new();
    let mut sinks = Vec::new();
    let mut landings = Vec::new();
    for (group, selection, records) in [
        ("sensors", "sensor_*", readings.len()),
        ("vehicles", "vehicle_telemetry", reports.len()),
    ] {
        let landing = tempfile::tempdir().unwrap();
        let mut config = local_sink(&cluster, landing.path(), group, quick_rotation());
        config.streams = vec![selection.into()];
        let sink = sink::start(config, streams.clone(), shutdown.clone())
            .await
            .unwrap();
        wait_written(&sink, records as u64).await;
        sinks.push(sink);
        landings.push(landing);
    }
    // Time for a sink that wrongly read the other stream's topic too to have done so.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    shutdown.cancel();
    for sink in &mut sinks {
        (&mut sink.task).await.unwrap().unwrap();
    }
    assert_eq!(
        sinks[0].stats.records_received.load(Ordering::Relaxed),
        readings.len() as u64
    );
    assert_eq!(
        sinks[1].stats.records_received.load(Ordering::Relaxed),
        reports.len() as u64
    );

    let sensor = assert_exactly_once(&readings, landings[0].path());
    assert!(
        sensor
            .files
            .iter()
            .all(|f| f.key.starts_with("landing/sensor_readings/")),
        "{:?}",
        sensor.files.iter().map(|f| &f.key).collect::<Vec<_>>()
    );
    let def = streams.get("vehicle_telemetry").unwrap();
    let expected: HashSet<_> = reports
        .iter()
        .map(|r| schemas::check(def, r.clone()).unwrap().hash)
        .collect();
    let vehicles = read_landing_dir(landings[1].path()).unwrap();
    assert!(compare(&expected, &vehicles).exactly_once());
    assert!(
        vehicles
            .files
            .iter()
            .all(|f| f.key.starts_with("landing/vehicle_telemetry/"))
    );

    // A selection that names no defined stream stops the start.
    let mut config = local_sink(
        &cluster,
        landings[0].path(),
        "typo",
        RotationConfig::default(),
    );
    config.streams = vec!["sensor_reading".into()];
    let err = sink::start(config, streams.clone(), shutdown.clone())
        .await
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("'sensor_reading' selects none"),
        "{err}"
    );
    drop(cluster);
}

/// The sink's readiness (`/readyz`) follows the broker: ready while it answers, not ready while
/// it is down, ready again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_readiness_follows_the_broker() {
    let (cluster, _producer) = mock_cluster(1);
    let landing = tempfile::tempdir().unwrap();
    let shutdown = CancellationToken::new();
    let config = local_sink(
        &cluster,
        landing.path(),
        "readiness",
        RotationConfig::default(),
    );
    let sink = sink::start(config, schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    assert!(sink.readiness.check().await);
    cluster.broker_down(1).unwrap();
    assert!(!sink.readiness.check().await, "ready with the broker down");
    cluster.broker_up(1).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !sink.readiness.check().await {
        assert!(Instant::now() < deadline, "not ready with the broker back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    // A stopped sink is not ready, and its consumer is closed with it: a probe does not keep it
    // (the demo's mock cluster, dropped after the sink stopped, logged a consumer's failing
    // reconnects when it did).
    assert!(!sink.readiness.check().await, "ready after the stop");
    drop(cluster);
}

/// Stopped while the broker is down, with records in open files of 8 partitions: the sink writes
/// the files, its first commit fails, and it stops without trying the other seven (each waited
/// 10 s for the coordinator, so the stop took 90 s). The next sink, with the broker back, reads
/// the records again, lands nothing twice and commits past them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_the_broker_is_down_writes_the_open_files_and_lands_them_once() {
    clear_of_an_hour_boundary(Duration::from_secs(60)).await;
    let (cluster, producer) = mock_cluster(8);
    let readings = distinct_readings(200);
    for r in &readings {
        send_plain(&producer, r["device_id"].as_str().unwrap(), &r.to_string()).await;
    }
    let landing = tempfile::tempdir().unwrap();
    // Nothing closes a file before the stop.
    let rotation = || RotationConfig {
        idle_ms: 600_000,
        ..RotationConfig::default()
    };
    let (first, shutdown) =
        start_local_sink(&cluster, landing.path(), "broker-down", rotation()).await;
    wait_received(&first, 200).await;
    cluster.broker_down(1).unwrap();
    shutdown.cancel();
    // One commit's wait for the coordinator and the consumer's close (10 s each), not eight.
    tokio::time::timeout(Duration::from_secs(45), first.task)
        .await
        .expect("the sink did not stop in time with the broker down")
        .unwrap()
        .unwrap();
    let files = first.stats.files_written.load(Ordering::Relaxed);
    assert!(files >= 2, "{files} files");
    cluster.broker_up(1).unwrap();
    for p in 0..8 {
        assert_eq!(committed(&cluster, "broker-down", p), None);
    }

    let (second, shutdown) =
        start_local_sink(&cluster, landing.path(), "broker-down", quick_rotation()).await;
    wait_received(&second, 200).await;
    wait_for("every record committed", 30, || {
        (0..8)
            .filter_map(|p| committed(&cluster, "broker-down", p))
            .sum::<i64>()
            == 200
    })
    .await;
    shutdown.cancel();
    second.task.await.unwrap().unwrap();
    // The window, warmed from the file, drops its records as duplicates before they would
    // meet the file's key.
    assert_eq!(second.stats.files_written.load(Ordering::Relaxed), 0);
    assert_eq!(
        second.stats.duplicates_dropped.load(Ordering::Relaxed)
            + second.stats.adopted_records.load(Ordering::Relaxed),
        200
    );
    assert_exactly_once(&readings, landing.path());
    drop(cluster);
}

/// 400 records over 4 partitions with a memory budget of 8 kB: open files write their row
/// groups early instead of holding them, and files still close only by rotation (here: at
/// shutdown, one per partition).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_budget_spills_row_groups_not_small_files() {
    let run = land_with_budgets(400, "budget", |c| c.memory_budget_bytes = 8_000).await;
    assert_eq!(run.early_files, 0);
    assert_eq!(run.landed.files.len(), 4, "one file per partition");
    let spilled = run.stats.spilled_row_groups.load(Ordering::Relaxed);
    assert!(spilled >= 5, "row groups written early: {spilled}");
    let row_groups: usize = run.landed.files.iter().map(|f| f.row_groups).sum();
    assert!(row_groups > 4, "{row_groups} row groups in 4 files");
}

/// 2,000 records over 4 partitions with a memory budget of 8 kB (open files write their row
/// groups to disk early) and a staging budget of 20 kB: whenever the staged files together pass
/// it, the file with the most on disk closes early. With the memory budget alone, the files
/// grow on disk until rotation: the disk was not bounded. Every record lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_budget_closes_the_file_with_the_most_on_disk() {
    let run = land_with_budgets(2_000, "staging-budget", |c| {
        c.memory_budget_bytes = 8_000;
        c.upload.staging_budget_bytes = 20_000;
    })
    .await;
    let sizes: Vec<u64> = run.landed.files.iter().map(|f| f.size).collect();
    let early = run.early_files;
    eprintln!("{early} files before the stop; sizes {sizes:?}");
    assert!(
        early >= 4,
        "only {early} files closed by the staging budget"
    );
    assert!(
        sizes.iter().all(|&s| s < 40_000),
        "a file of twice the budget: {sizes:?}"
    );
}

/// What [`land_with_budgets`] saw.
struct BudgetRun {
    /// Files written before the stop.
    early_files: u64,
    stats: std::sync::Arc<sink::SinkStats>,
    landed: Landed,
}

/// Sends `n` distinct readings over 4 partitions and lands them (each exactly once, checked)
/// with a local sink whose budgets `budgets` sets; records, bytes and idle time close no file
/// within the test, which does not cross an ingest-hour boundary either.
async fn land_with_budgets(
    n: usize,
    group: &str,
    budgets: impl FnOnce(&mut SinkConfig),
) -> BudgetRun {
    clear_of_an_hour_boundary(Duration::from_secs(60)).await;
    let streams = schemas::example_streams();
    let (cluster, producer) = mock_cluster(4);
    let readings = distinct_readings(n);
    for r in &readings {
        send_plain(&producer, r["device_id"].as_str().unwrap(), &r.to_string()).await;
    }
    let landing = tempfile::tempdir().unwrap();
    let shutdown = CancellationToken::new();
    let mut config = local_sink(
        &cluster,
        landing.path(),
        group,
        RotationConfig {
            idle_ms: 600_000,
            ..RotationConfig::default()
        },
    );
    budgets(&mut config);
    let sink = sink::start(config, streams, shutdown.clone())
        .await
        .unwrap();
    wait_received(&sink, n as u64).await;
    let early_files = sink.stats.files_written.load(Ordering::Relaxed);
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    let landed = assert_exactly_once(&readings, landing.path());
    drop(cluster);
    BudgetRun {
        early_files,
        stats: sink.stats,
        landed,
    }
}

/// A producer writing garbage to a busy partition: the dead letters a range holds in memory
/// close it (file and dead-letter object) at `rotation.max_dead_letter_bytes`, or when they are
/// most of what the partition over the memory budget holds, instead of growing until the
/// partition goes idle or the hour ends. Every reading lands once and every dead letter is
/// written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_close_their_range_by_size_and_budget() {
    clear_of_an_hour_boundary(Duration::from_secs(60)).await;
    for by_budget in [false, true] {
        dead_letter_flood(by_budget).await;
    }
}

async fn dead_letter_flood(by_budget: bool) {
    let streams = schemas::example_streams();
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(200);
    for (i, r) in readings.iter().enumerate() {
        let garbage = format!("garbage {i}: not the JSON of a reading at all");
        for value in [r.to_string(), garbage] {
            send_plain(&producer, "k", &value).await;
        }
    }
    let landing = tempfile::tempdir().unwrap();
    let shutdown = CancellationToken::new();
    // No idle period, age or size target closes a range within this test.
    let mut config = local_sink(
        &cluster,
        landing.path(),
        "dead-letters",
        RotationConfig {
            idle_ms: 600_000,
            max_dead_letter_bytes: if by_budget { 1 << 30 } else { 8_000 },
            ..RotationConfig::default()
        },
    );
    if by_budget {
        config.memory_budget_bytes = 8_000;
    }
    let sink = sink::start(config, streams.clone(), shutdown.clone())
        .await
        .unwrap();
    wait_received(&sink, 400).await;
    let dead_dir = landing.path().join("landing/_dead_letters");
    let objects = || {
        if dead_dir.exists() {
            walk(&dead_dir)
        } else {
            Vec::new()
        }
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while objects().len() < 3 {
        assert!(
            Instant::now() < deadline,
            "budget {by_budget}: {} dead-letter objects while the sink runs",
            objects().len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert!(sink.stats.files_written.load(Ordering::Relaxed) >= 3);
    let mut offsets = Vec::new();
    for object in objects() {
        let text = std::fs::read_to_string(&object).unwrap();
        if !by_budget {
            assert!(text.len() < 8_000 + 400, "{} bytes", text.len());
        }
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            offsets.push(v["offset"].as_i64().unwrap());
        }
    }
    offsets.sort_unstable();
    let garbage: Vec<i64> = (0..200).map(|i| 2 * i + 1).collect();
    assert_eq!(offsets, garbage, "every dead letter once");
    assert_exactly_once(&readings, landing.path());
    drop(cluster);
}

/// A sink stopped while its upload fails, after it wrote the range's dead letters (the landing
/// folder cannot be written, so the upload is retried until the stop; a crash there leaves the
/// same). It commits nothing: before, the stop's own flush took the range whose file it had
/// given up for one of skipped records only and committed past it, and its readings were lost.
/// The next sink reads the range again with other rotation settings, so its range ends
/// elsewhere (here: later). It finds the dead-letter object at the key of the first dead
/// letter, drops the dead letters that object holds and writes only the rest. Every dead letter
/// is written once and every reading lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_uploads_fail_loses_nothing_and_writes_dead_letters_once() {
    stop_while_uploads_fail(1_000).await;
}

/// As above, with the next sink's first range ending inside the dead-letter object it finds:
/// the dead letters after that range's end that the object holds are not written again when
/// they arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_a_found_object_holds_are_skipped_past_the_range() {
    stop_while_uploads_fail(20).await;
}

/// Records and dead letters through a sink stopped while its uploads fail (ranges of 40 rows),
/// then a sink with ranges of `second_records` rows.
async fn stop_while_uploads_fail(second_records: usize) {
    clear_of_an_hour_boundary(Duration::from_secs(60)).await;
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(120);
    let mut garbage = Vec::new();
    send_with_garbage(&producer, &readings, 0, &mut garbage).await;
    let landing = tempfile::tempdir().unwrap();
    // A file where the stream's landing folder goes: landing files cannot be written there,
    // dead letters (under `_dead_letters/`) can.
    let blocker = landing.path().join("landing/sensor_readings");
    std::fs::create_dir_all(blocker.parent().unwrap()).unwrap();
    std::fs::write(&blocker, b"not a folder").unwrap();
    let rotation = |max_records| RotationConfig {
        idle_ms: 300,
        max_records,
        ..RotationConfig::default()
    };

    let (first, shutdown) =
        start_local_sink(&cluster, landing.path(), "dead-crash", rotation(40)).await;
    wait_for("dead letters, then a failing upload", 30, || {
        first.stats.store_failing.load(Ordering::Relaxed)
            && !dead_letter_offsets(landing.path()).is_empty()
    })
    .await;
    shutdown.cancel();
    first.task.await.unwrap().unwrap();
    assert_eq!(first.stats.files_written.load(Ordering::Relaxed), 0);
    assert_eq!(
        committed(&cluster, "dead-crash", 0),
        None,
        "committed while nothing landed"
    );
    let before = dead_letter_offsets(landing.path());
    assert!(before.len() < garbage.len(), "{before:?}");

    std::fs::remove_file(&blocker).unwrap();
    let (second, shutdown) = start_local_sink(
        &cluster,
        landing.path(),
        "dead-crash",
        rotation(second_records),
    )
    .await;
    wait_written(&second, readings.len() as u64).await;
    shutdown.cancel();
    second.task.await.unwrap().unwrap();
    assert_eq!(
        dead_letter_offsets(landing.path()),
        garbage,
        "every dead letter once"
    );
    assert_eq!(
        second
            .stats
            .adopted_dead_letter_objects
            .load(Ordering::Relaxed),
        1
    );
    assert_exactly_once(&readings, landing.path());
    drop(cluster);
}

/// Sends `readings` (the `first`th on) to partition 0, each fourth followed by an undecodable
/// value whose offset goes into `garbage`.
async fn send_with_garbage(
    producer: &FutureProducer,
    readings: &[serde_json::Value],
    first: usize,
    garbage: &mut Vec<i64>,
) {
    let mut offset = (first + first / 4) as i64;
    for (i, r) in readings.iter().enumerate().skip(first) {
        send_plain(producer, "k", &r.to_string()).await;
        offset += 1;
        if i % 4 == 3 {
            send_plain(producer, "k", &format!("garbage after reading {i}")).await;
            garbage.push(offset);
            offset += 1;
        }
    }
}

/// A sink stopped (or crashed) after it wrote dead letters through offset 44 but before their
/// range's file; the partition holds only 30 records when the next sink reads it, so that
/// sink's range ends inside the object it finds. The range does not close before the object's
/// last offset: closing it there, its commit would start the next reader of the partition
/// inside the object, where the key of the next dead letter names no object, and those dead
/// letters would be written twice. Here the second sink stops before the rest is produced and
/// commits nothing; a third reads everything and lands it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_ending_inside_a_found_dead_letter_object_waits_past_it() {
    clear_of_an_hour_boundary(Duration::from_secs(60)).await;
    let streams = schemas::example_streams();
    let def = streams.get("sensor_readings").unwrap().clone();
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(120);
    let mut garbage = Vec::new();
    send_with_garbage(&producer, &readings[..24], 0, &mut garbage).await;
    assert_eq!(garbage, [4, 9, 14, 19, 24, 29]);

    // The crashed sink's dead letters: offsets 4 to 44, the object named after the first.
    let mut crashed = sink::partition::PartitionState::new(def, TOPIC.into(), 0, 10);
    for (i, offset) in (4..=44).step_by(5).enumerate() {
        let payload = format!("garbage after reading {}", 4 * i + 3);
        crashed.dead_letter(offset, now_micros(), "malformed JSON", payload.as_bytes());
    }
    let landing = tempfile::tempdir().unwrap();
    let store = ObjectStore::Local(landing.path().to_path_buf());
    let key = sink::parquet_file::dead_letter_key("landing", "sensor_readings", now_micros(), 0, 4);
    let text = bytes::Bytes::copy_from_slice(crashed.dead.text());
    assert_eq!(
        store.put_if_absent(&key, text).await.unwrap(),
        PutOutcome::Created
    );

    let run = |until: u64| {
        let config = local_sink(
            &cluster,
            landing.path(),
            "inside",
            RotationConfig {
                idle_ms: 300,
                max_records: 20,
                ..RotationConfig::default()
            },
        );
        let streams = streams.clone();
        async move {
            let shutdown = CancellationToken::new();
            let sink = sink::start(config, streams, shutdown.clone())
                .await
                .unwrap();
            wait_received(&sink, until).await;
            // Idle periods pass: a range that may close would.
            tokio::time::sleep(Duration::from_millis(1_200)).await;
            shutdown.cancel();
            sink.task.await.unwrap().unwrap();
            sink.stats
        }
    };
    let second = run(30).await;
    assert_eq!(
        second.adopted_dead_letter_objects.load(Ordering::Relaxed),
        1
    );
    assert_eq!(second.files_written.load(Ordering::Relaxed), 0);
    assert_eq!(committed(&cluster, "inside", 0), None);

    send_with_garbage(&producer, &readings, 24, &mut garbage).await;
    run(150).await;
    assert_eq!(
        dead_letter_offsets(landing.path()),
        garbage,
        "every dead letter once"
    );
    assert_exactly_once(&readings, landing.path());
    drop(cluster);
}

fn now_micros() -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.unwrap().as_micros() as i64
}

/// The offset `group` committed on partition `partition` of the sensor topic, if any.
fn committed(
    cluster: &MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    group: &str,
    partition: i32,
) -> Option<i64> {
    let consumer: rdkafka::consumer::BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", cluster.bootstrap_servers())
        .set("group.id", group)
        .create()
        .unwrap();
    let mut list = rdkafka::TopicPartitionList::new();
    list.add_partition(TOPIC, partition);
    let committed = tokio::task::block_in_place(|| {
        rdkafka::consumer::Consumer::committed_offsets(&consumer, list, Duration::from_secs(10))
    })
    .unwrap();
    match committed.find_partition(TOPIC, partition)?.offset() {
        rdkafka::Offset::Offset(o) => Some(o),
        _ => None,
    }
}

/// The offsets of the dead letters in a local landing zone, in order (repeats kept).
fn dead_letter_offsets(landing: &std::path::Path) -> Vec<i64> {
    let dir = landing.join("landing/_dead_letters");
    let mut offsets = Vec::new();
    if !dir.exists() {
        return offsets;
    }
    // Not the temporary files of objects being written.
    let objects = walk(&dir).into_iter().filter(|p| {
        !p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
    });
    for object in objects {
        for line in std::fs::read_to_string(&object).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            offsets.push(v["offset"].as_i64().unwrap());
        }
    }
    offsets.sort_unstable();
    offsets
}

/// Duplicates that straddle a restart: the second sink's dedupe windows are warmed from the
/// landing files of the first, so records re-sent after the restart do not land twice. The
/// partitions share one listing of each hour folder (24 listings, not 24 per partition).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedupe_window_is_warmed_after_a_restart() {
    let streams = schemas::example_streams();
    let (cluster, producer) = mock_cluster(4);
    let readings = distinct_readings(120);
    // No ingest-ts header: the sink uses the Kafka timestamp (now), like for any producer.
    let send = |r: &serde_json::Value| {
        let value = r.to_string();
        let key = r["device_id"].as_str().unwrap().to_owned();
        let producer = producer.clone();
        async move { send_plain(&producer, &key, &value).await }
    };
    let landing = tempfile::tempdir().unwrap();
    let config = || {
        local_sink(
            &cluster,
            landing.path(),
            "warm",
            RotationConfig {
                idle_ms: 300,
                max_records: 40,
                ..RotationConfig::default()
            },
        )
    };
    let run_until = |want: u64| {
        let config = config();
        let streams = streams.clone();
        async move {
            let shutdown = CancellationToken::new();
            let sink = sink::start(config, streams, shutdown.clone())
                .await
                .unwrap();
            let deadline = Instant::now() + Duration::from_secs(60);
            while sink.stats.records_written.load(Ordering::Relaxed)
                + sink.stats.duplicates_dropped.load(Ordering::Relaxed)
                < want
            {
                assert!(Instant::now() < deadline, "sink made no progress");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            tokio::time::sleep(Duration::from_millis(700)).await;
            shutdown.cancel();
            sink.task.await.unwrap().unwrap();
            sink.stats
        }
    };
    for r in &readings[..100] {
        send(r).await;
    }
    let first = run_until(100).await;
    assert_eq!(first.records_written.load(Ordering::Relaxed), 100);
    // After the restart: the first 100 again (a client retry), then 20 new ones.
    for r in readings[..100].iter().chain(&readings[100..]) {
        send(r).await;
    }
    let second = run_until(120).await;
    assert_eq!(
        second.duplicates_dropped.load(Ordering::Relaxed),
        100,
        "re-sent records were dropped"
    );
    assert_eq!(second.records_written.load(Ordering::Relaxed), 20);
    let landed = assert_exactly_once(&readings, landing.path());
    let partitions: HashSet<i32> = landed
        .files
        .iter()
        .filter_map(|f| sink::parquet_file::partition_and_offset_of(&f.key, "sensor_readings"))
        .map(|(partition, _)| partition)
        .collect();
    assert!(partitions.len() >= 2, "files of {partitions:?}");
    // One listing per hour folder of the warm horizon (one more if the hour turned meanwhile).
    for stats in [&first, &second] {
        let listings = stats.landing_listings.load(Ordering::Relaxed);
        let hours = sink::WARM_HOURS as u64;
        assert!(
            (hours..=hours + 1).contains(&listings),
            "{listings} listings for {} partitions",
            partitions.len()
        );
    }
    drop(cluster);
}

/// Steady load into one partition with a small target file size: the files but the last
/// (closed at shutdown) average within 10% of the target, and each after the first is within
/// 15% (the first has no earlier file to correct the writer's size estimate by).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_close_at_the_target_parquet_size() {
    // The mock cluster keeps about 5 MB per partition: 24,000 readings fit.
    const TARGET: usize = 96 << 10;
    // A file closed at an ingest-hour boundary would be short of the target.
    clear_of_an_hour_boundary(Duration::from_secs(180)).await;
    let (cluster, producer) = mock_cluster(1);
    let readings = sensor_readings(&FleetSpec {
        records: 24_000,
        devices: 200,
        duplicate_ratio: 0.0,
        ..FleetSpec::default()
    });
    let mut pending = Vec::new();
    for r in &readings {
        let value = r.to_string();
        let sent = producer.send_result(FutureRecord::<str, str>::to(TOPIC).payload(&value));
        pending.push(sent.map_err(|(e, _)| e));
        if pending.len() >= 5_000 {
            for p in pending.drain(..) {
                p.unwrap().await.unwrap().unwrap();
            }
        }
    }
    for p in pending {
        p.unwrap().await.unwrap().unwrap();
    }
    let landing = tempfile::tempdir().unwrap();
    let (sink, shutdown) = start_local_sink(
        &cluster,
        landing.path(),
        "size",
        RotationConfig {
            idle_ms: 600_000,
            max_bytes: TARGET,
            ..RotationConfig::default()
        },
    )
    .await;
    wait_received(&sink, readings.len() as u64).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    let landed = assert_exactly_once(&readings, landing.path());
    let mut sizes: Vec<(String, u64)> = landed
        .files
        .iter()
        .map(|f| (f.key.clone(), f.size))
        .collect();
    sizes.sort();
    sizes.pop(); // the last file closed at shutdown, before its target
    assert!(sizes.len() >= 5, "{sizes:?}");
    let off = |size: f64| (size - TARGET as f64).abs() / TARGET as f64;
    eprintln!("file sizes: {sizes:?}");
    for (key, size) in &sizes[1..] {
        assert!(
            off(*size as f64) <= 0.15,
            "{key}: {size} bytes, target {TARGET}"
        );
    }
    let average = sizes.iter().map(|(_, s)| *s as f64).sum::<f64>() / sizes.len() as f64;
    assert!(
        off(average) <= 0.10,
        "average {average:.0}, target {TARGET}: {sizes:?}"
    );
    drop(cluster);
}

/// The ingest time comes from the gateway's `ingest-ts` header by default and from the Kafka
/// timestamp with `kafka.ingest_time = "timestamp"`: records whose header says 2020 land in the
/// 2020 hour folder in the one case and in the current hour's in the other, exactly once both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_time_from_the_header_or_the_kafka_timestamp() {
    let (cluster, producer) = mock_cluster(2);
    let readings = distinct_readings(20);
    // 2020-01-01T05:06:07Z.
    let header_ts = "1577855167000000";
    // Before the records get their Kafka timestamps.
    let before = chrono::Utc::now();
    for r in &readings {
        let key = r["device_id"].as_str().unwrap();
        send_with_ingest_ts(&producer, key, r.to_string().as_bytes(), header_ts).await;
    }
    for (from, group) in [
        (IngestTime::Header, "from-header"),
        (IngestTime::Timestamp, "from-timestamp"),
    ] {
        let landing = tempfile::tempdir().unwrap();
        let mut config = local_sink(&cluster, landing.path(), group, quick_rotation());
        config.kafka.ingest_time = from;
        let shutdown = CancellationToken::new();
        let sink = sink::start(config, schemas::example_streams(), shutdown.clone())
            .await
            .unwrap();
        wait_written(&sink, readings.len() as u64).await;
        shutdown.cancel();
        sink.task.await.unwrap().unwrap();
        let landed = assert_exactly_once(&readings, landing.path());
        let after = chrono::Utc::now();
        for file in &landed.files {
            let in_hour = |t: chrono::DateTime<chrono::Utc>| {
                file.key
                    .contains(&t.format("date=%Y-%m-%d/hour=%H/").to_string())
            };
            match from {
                IngestTime::Header => {
                    assert!(
                        file.key.contains("date=2020-01-01/hour=05/"),
                        "{}",
                        file.key
                    )
                }
                IngestTime::Timestamp => {
                    assert!(in_hour(before) || in_hour(after), "{}", file.key)
                }
            }
        }
    }
    drop(cluster);
}

/// `loadtest verify` on a local landing directory: every sent reading once passes (a line that
/// is not a valid record is counted apart, not expected); the time from the send times next to
/// the sent file to the landing of each file is measured; a landed file copied under another
/// start offset fails it with its rows duplicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_checks_a_local_landing_directory() {
    let (cluster, producer) = mock_cluster(2);
    let sent_ms = unix_ms(std::time::SystemTime::now());
    let readings = sensor_readings(&FleetSpec {
        records: 300,
        ..FleetSpec::default()
    });
    for r in &readings {
        let (value, key) = (r.to_string(), r["device_id"].as_str().unwrap().to_owned());
        let record = FutureRecord::to(TOPIC).key(&key).payload(&value);
        producer.send(record, Duration::from_secs(5)).await.unwrap();
    }
    let landing = tempfile::tempdir().unwrap();
    let config = local_sink(&cluster, landing.path(), "verify", quick_rotation());
    let shutdown = CancellationToken::new();
    let sink = sink::start(config, schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    let def = schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone();
    let distinct = readings
        .iter()
        .map(|r| schemas::check(&def, r.clone()).unwrap().hash)
        .collect::<HashSet<_>>()
        .len();
    wait_written(&sink, distinct as u64).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    let landed = assert_exactly_once(&readings, landing.path());

    let sent = landing.path().join("sent.ndjson");
    let mut text = loadtest::fleet::to_ndjson(&readings);
    text.extend_from_slice(b"{\"device_id\": 7}\n");
    std::fs::write(&sent, text).unwrap();
    // All of them sent in one batch before the sink started, as `send --save` notes it.
    loadtest::verify::SendTimes::write(
        &loadtest::verify::times_path(&sent),
        vec![(0, readings.len() as u64, sent_ms)],
    )
    .unwrap();
    let options = VerifyOptions {
        sent: vec![sent],
        def,
        store: StoreConfig::Local {
            path: landing.path().to_path_buf(),
        },
        prefix: "landing".into(),
        wait: Duration::ZERO,
        allow_unexpected: false,
    };
    let report = verify(&options).await.unwrap();
    assert!(report.passed, "{report:?}");
    assert_eq!(
        (
            report.sent_lines,
            report.invalid_lines,
            report.expected,
            report.rows
        ),
        (readings.len() + 1, 1, distinct, distinct),
        "{report:?}"
    );
    // Each record from its send to the moment its file was linked into place (the inode's
    // change time), read here from the files themselves; a file closes once its partition was
    // idle for 300 ms.
    let latency = report.send_to_landing_ms.expect("send times were given");
    assert_eq!((latency.count, report.timed_records), (distinct, distinct));
    let landed_ms = |f: &loadtest::verify::LandedFile| {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&f.path).unwrap();
        meta.ctime() as u64 * 1000 + meta.ctime_nsec() as u64 / 1_000_000
    };
    let latest = landed.files.iter().map(landed_ms).max().unwrap();
    assert_eq!(latency.max, (latest - sent_ms) as f64, "{latency:?}");
    assert!(
        latency.p50 >= 300.0 && latency.p50 <= latency.p99 && latency.p99 <= latency.max,
        "{latency:?}"
    );

    let file = &landed.files[0];
    let copy = file.path.with_file_name(format!(
        "{}-o99999999999.parquet",
        file.key
            .rsplit_once("-o")
            .unwrap()
            .0
            .rsplit('/')
            .next()
            .unwrap()
    ));
    std::fs::copy(&file.path, &copy).unwrap();
    let report = verify(&options).await.unwrap();
    assert!(!report.passed, "{report:?}");
    assert_eq!(report.duplicated, file.rows, "{report:?}");
    drop(cluster);
}

/// A sink config for the mock cluster writing to a local directory.
fn local_sink(
    cluster: &MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    landing: &std::path::Path,
    group: &str,
    rotation: RotationConfig,
) -> SinkConfig {
    let mut config = SinkConfig {
        store: StoreConfig::Local {
            path: landing.to_path_buf(),
        },
        rotation,
        ..SinkConfig::default()
    };
    config.kafka.brokers = cluster.bootstrap_servers();
    config.kafka.group_id = group.into();
    config
}

/// Waits until `done`, checking every 100 ms, for `secs` seconds at most.
async fn wait_for(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts a sink on the example streams, landing in `landing`; stopped by the token.
async fn start_local_sink(
    cluster: &MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    landing: &std::path::Path,
    group: &str,
    rotation: RotationConfig,
) -> (sink::Sink, CancellationToken) {
    let shutdown = CancellationToken::new();
    let config = local_sink(cluster, landing, group, rotation);
    let sink = sink::start(config, schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    (sink, shutdown)
}

/// A one-broker mock cluster with the sensor topic, and a producer for it.
fn mock_cluster(
    partitions: i32,
) -> (
    MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    FutureProducer,
) {
    let cluster = MockCluster::new(1).unwrap();
    cluster.create_topic(TOPIC, partitions, 1).unwrap();
    let producer = ClientConfig::new()
        .set("bootstrap.servers", cluster.bootstrap_servers())
        .create()
        .unwrap();
    (cluster, producer)
}

/// Reads the landing directory and checks it holds each distinct reading exactly once.
fn assert_exactly_once(readings: &[serde_json::Value], landing: &std::path::Path) -> Landed {
    let streams = schemas::example_streams();
    let def = streams.get("sensor_readings").unwrap();
    let expected: HashSet<_> = readings
        .iter()
        .map(|r| schemas::check(def, r.clone()).unwrap().hash)
        .collect();
    let landed = read_landing_dir(landing).unwrap();
    let verdict = compare(&expected, &landed);
    assert!(verdict.exactly_once(), "{verdict:?}");
    landed
}

/// Waits until the sink read at least `n` records, at most two minutes.
async fn wait_received(sink: &sink::Sink, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while sink.stats.records_received.load(Ordering::Relaxed) < n {
        assert!(
            Instant::now() < deadline && !sink.task.is_finished(),
            "the sink read {} of {n} records",
            sink.stats.records_received.load(Ordering::Relaxed),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the sink wrote at least `n` records, at most a minute.
async fn wait_written(sink: &sink::Sink, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while sink.stats.records_written.load(Ordering::Relaxed) < n {
        let written = sink.stats.records_written.load(Ordering::Relaxed);
        assert!(
            Instant::now() < deadline,
            "only {written} of {n} records landed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `records` generated readings, none of them re-sent.
fn distinct_readings(records: usize) -> Vec<serde_json::Value> {
    sensor_readings(&FleetSpec {
        records,
        duplicate_ratio: 0.0,
        ..FleetSpec::default()
    })
}

/// Files close 300 ms after their partition's last record.
fn quick_rotation() -> RotationConfig {
    RotationConfig {
        idle_ms: 300,
        ..RotationConfig::default()
    }
}

/// Produces `value` with `key` and no headers, as any producer may.
async fn send_plain(producer: &FutureProducer, key: &str, value: &str) {
    producer
        .send(
            FutureRecord::to(TOPIC).key(key).payload(value),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
}

/// Produces `value` with `key` and the gateway's `ingest-ts` header.
async fn send_with_ingest_ts(producer: &FutureProducer, key: &str, value: &[u8], ingest_ts: &str) {
    let headers = OwnedHeaders::new().insert(Header {
        key: "ingest-ts",
        value: Some(ingest_ts),
    });
    producer
        .send(
            FutureRecord::to(TOPIC)
                .key(key)
                .payload(value)
                .headers(headers),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
}

/// A stream defined after the sink started: a sink whose selection has a glob subscribes by a
/// pattern, finds the new stream's topic at a metadata refresh, reads `streams_dir` again and
/// lands the stream. Its records that came before the definition wait for it (the partition is
/// held and read again from them), none skipped. Before, a new stream took a restart of every
/// sink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_defined_after_the_start_is_landed_without_a_restart() {
    let (cluster, producer) = mock_cluster(2);
    let (landing, streams) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../streams");
    std::fs::copy(
        shipped.join("sensor_readings.toml"),
        streams.path().join("sensor_readings.toml"),
    )
    .unwrap();
    let mut config = local_sink(&cluster, landing.path(), "later", quick_rotation());
    config.streams_dir = streams.path().to_path_buf();
    config
        .kafka
        .consumer
        .insert("topic.metadata.refresh.interval.ms".into(), "500".into());
    let shutdown = CancellationToken::new();
    let defined = plumbing::load_streams_dir(streams.path()).unwrap();
    let sink = sink::start(config, defined, shutdown.clone())
        .await
        .unwrap();
    let readings = distinct_readings(200);
    for r in &readings {
        let (key, value) = (r["device_id"].as_str().unwrap(), r.to_string());
        let record = FutureRecord::to(TOPIC).key(key).payload(&value);
        producer.send(record, Duration::from_secs(5)).await.unwrap();
    }
    // The vehicle stream's topic and records, then (a few seconds later) its definition.
    cluster
        .create_topic("ingest.vehicle_telemetry", 1, 1)
        .unwrap();
    for i in 0..30 {
        let value = serde_json::json!({"vehicle_id": format!("v{}", i % 3), "recorded_at": 1_767_225_600_000i64 + i, "lat": 1.0, "lon": 2.0}).to_string();
        let record = FutureRecord::to("ingest.vehicle_telemetry")
            .key("v")
            .payload(&value);
        producer.send(record, Duration::from_secs(5)).await.unwrap();
    }
    wait_for("the readings", 60, || {
        sink.stats.records_written.load(Ordering::Relaxed) >= 200
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(sink.stats.records_written.load(Ordering::Relaxed), 200);
    std::fs::copy(
        shipped.join("vehicle_telemetry.toml"),
        streams.path().join("vehicle_telemetry.toml"),
    )
    .unwrap();
    wait_for("the vehicle records", 60, || {
        sink.stats.records_written.load(Ordering::Relaxed) >= 230
    })
    .await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert_eq!(sink.stats.records_written.load(Ordering::Relaxed), 230);
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), 0);
    let vehicles = read_landing_dir(&landing.path().join("landing/vehicle_telemetry")).unwrap();
    assert_eq!(vehicles.rows, 30);
    assert_exactly_once(&readings, &landing.path().join("landing/sensor_readings"));
    drop(cluster);
}

/// A stream's definition changed while the sink runs. A nullable field added (`humidity`,
/// version 2) is taken when the first record that sets it arrives: the partition's open file of
/// the old columns closes, and the record lands in a file with the new column, none of them a
/// dead letter. Before, such records went to the dead letters until every sink restarted. An
/// incompatible edit after it (`quality` retyped, `site` added) is refused at the first record
/// that sets `site`: the running definition stays, so records of the old shape still land and
/// those of the new shape are dead letters; the refusal ends once the file is mended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compatible_definition_change_is_taken_without_a_restart() {
    let (cluster, producer) = mock_cluster(2);
    let (landing, streams) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let file = streams.path().join("sensor_readings.toml");
    let shipped = include_str!("../../streams/sensor_readings.toml");
    std::fs::write(&file, shipped).unwrap();
    // Files stay open 2 s after their last record, so that the change meets open files.
    let rotation = RotationConfig {
        idle_ms: 2000,
        ..RotationConfig::default()
    };
    let mut config = local_sink(&cluster, landing.path(), "redefined", rotation);
    config.streams_dir = streams.path().to_path_buf();
    let shutdown = CancellationToken::new();
    let defined = plumbing::load_streams_dir(streams.path()).unwrap();
    let sink = sink::start(config, defined, shutdown.clone())
        .await
        .unwrap();
    let readings = distinct_readings(300);
    let (old, new) = readings.split_at(150);
    let send = |r: &serde_json::Value| {
        let (key, value) = (r["device_id"].as_str().unwrap().to_owned(), r.to_string());
        let producer = producer.clone();
        async move { send_plain(&producer, &key, &value).await }
    };
    for r in old {
        send(r).await;
    }
    wait_received(&sink, 150).await;
    let extended = format!(
        "{}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\ndoc = \"Relative humidity, %\"\n",
        shipped.replace("version = 1", "version = 2")
    );
    std::fs::write(&file, &extended).unwrap();
    let mut with_humidity = Vec::new();
    for (i, r) in new.iter().enumerate() {
        let mut r = r.clone();
        r["humidity"] = serde_json::json!(40.0 + i as f64);
        send(&r).await;
        with_humidity.push(r);
    }
    wait_for("the records with the new field", 60, || {
        sink.stats.records_written.load(Ordering::Relaxed) >= 300
    })
    .await;
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), 0);

    // An incompatible edit (`quality` retyped, `site` added): refused when records with `site`
    // come, and the definition with `humidity` stays.
    std::fs::write(
        &file,
        format!("{extended}\n[[fields]]\nname = \"site\"\ntype = \"string\"\n").replace(
            "name = \"quality\"\ntype = \"int64\"",
            "name = \"quality\"\ntype = \"string\"",
        ),
    )
    .unwrap();
    let more = distinct_readings(320);
    let mut sited = more[300..310].to_vec();
    for r in &mut sited {
        r["site"] = serde_json::json!("plant-7");
        send(r).await;
    }
    let kept: Vec<serde_json::Value> = more[310..]
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r["humidity"] = serde_json::json!(1.5);
            r
        })
        .collect();
    for r in &kept {
        send(r).await;
    }
    wait_for("the records after the refused edit", 60, || {
        sink.stats.records_written.load(Ordering::Relaxed) >= 310
            && sink.stats.dead_letters.load(Ordering::Relaxed) >= 10
    })
    .await;
    assert_eq!(sink.stats.definitions_refused.load(Ordering::Relaxed), 1);
    // The file mended: the refusal ends without another record.
    std::fs::write(&file, &extended).unwrap();
    wait_for("the refusal to end", 10, || {
        sink.stats.definitions_refused.load(Ordering::Relaxed) == 0
    })
    .await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert_eq!(sink.stats.records_written.load(Ordering::Relaxed), 310);
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), 10);

    // Every record once, by the new definition's hashes (`humidity` is not hashed).
    let def = schemas::StreamDef::from_toml(&extended).unwrap();
    let expected: HashSet<_> = old
        .iter()
        .chain(&with_humidity)
        .chain(&kept)
        .map(|r| schemas::check(&def, r.clone()).unwrap().hash)
        .collect();
    let dir = landing.path().join("landing/sensor_readings");
    let verdict = compare(&expected, &read_landing_dir(&dir).unwrap());
    assert!(verdict.exactly_once(), "{verdict:?}");
    // pyarrow: files of version 1 without the column, files of version 2 with it, and every
    // reading that set it has its value there.
    let read = common::pyarrow(&["--dir", dir.to_str().unwrap()]);
    let (versions, humid) = common::column_added_in(&read, "humidity", "2");
    assert_eq!(versions.len(), 2, "{versions:?}");
    assert_eq!(humid.len(), 160);
    let sum: f64 = humid.iter().sum();
    let want: f64 = (0..150).map(|i| 40.0 + i as f64).sum::<f64>() + 10.0 * 1.5;
    assert_eq!(sum, want);
    drop(cluster);
}

/// The worker takes ready messages a group at a time (their content hashes made together) and
/// ends a group wherever a message needs an await: a file full after 7 records, a record of
/// the next ingest hour (every 50 messages), a partition's first record. Everything is
/// produced before the sink starts, so groups are full and those ends fall anywhere in them.
/// Every valid reading lands once, each duplicate and each undecodable record (every 40th
/// message) is counted once, no file mixes two hours and no two files of a partition overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_groups_end_at_flushes_hours_and_new_partitions_and_land_once() {
    let (cluster, producer) = mock_cluster(3);
    let readings = sensor_readings(&FleetSpec {
        records: 1_500,
        ..FleetSpec::default()
    });
    let mut garbage = 0;
    let mut sends = Vec::new();
    for (i, r) in readings.iter().enumerate() {
        let key = r["device_id"].as_str().unwrap().to_owned();
        let value = if i % 40 == 39 {
            garbage += 1;
            format!("{{\"device_id\": \"{key}\", not json")
        } else {
            r.to_string()
        };
        let hour = BASE_TS + (i as i64 / 50) * 3_600_000_000;
        let headers = OwnedHeaders::new().insert(Header {
            key: "ingest-ts",
            value: Some(&hour.to_string()),
        });
        sends.push((key, value, headers));
    }
    produce_at_once(&producer, sends).await;
    let landing = tempfile::tempdir().unwrap();
    let rotation = RotationConfig {
        max_records: 7,
        ..quick_rotation()
    };
    let (sink, shutdown) = start_local_sink(&cluster, landing.path(), "groups", rotation).await;
    wait_received(&sink, readings.len() as u64).await;
    wait_for("every record written", 30, || {
        sink.stats.records_settled() == readings.len() as u64
    })
    .await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    let kept: Vec<serde_json::Value> = readings
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 40 != 39)
        .map(|(_, r)| r.clone())
        .collect();
    let landed = assert_exactly_once(&kept, landing.path());
    let stats = &sink.stats;
    assert_eq!(stats.dead_letters.load(Ordering::Relaxed), garbage);
    let streams = schemas::example_streams();
    let def = streams.get("sensor_readings").unwrap();
    let kept_distinct: HashSet<_> = kept
        .iter()
        .map(|r| schemas::check(def, r.clone()).unwrap().hash)
        .collect();
    // Some readings are re-sent: the duplicates below are not nothing.
    assert!(kept_distinct.len() < kept.len());
    assert_eq!(
        stats.duplicates_dropped.load(Ordering::Relaxed),
        (kept.len() - kept_distinct.len()) as u64
    );
    let mut ranges: Vec<(i32, i64, i64)> = Vec::new();
    for file in &landed.files {
        let (partition, first, last, hours) = file_offsets_and_hours(&file.path);
        assert_eq!(hours.len(), 1, "{} holds rows of hours {hours:?}", file.key);
        let hour = chrono::DateTime::from_timestamp_micros(hours[0] * 3_600_000_000).unwrap();
        assert!(
            file.key
                .contains(&hour.format("date=%Y-%m-%d/hour=%H/").to_string()),
            "{}",
            file.key
        );
        ranges.push((partition, first, last));
    }
    ranges.sort();
    for pair in ranges.windows(2) {
        let ((p, _, last), (q, first, _)) = (pair[0], pair[1]);
        assert!(p != q || first > last, "overlapping files: {ranges:?}");
    }
    assert!(landed.files.len() > 3 * 8, "{} files", landed.files.len());
    drop(cluster);
}

/// A landing file's partition, first and last offset (from its metadata, checked against its
/// `_offset` column) and the ingest hours of its rows.
fn file_offsets_and_hours(path: &std::path::Path) -> (i32, i64, i64, Vec<i64>) {
    use arrow::array::{Array, AsArray};
    use arrow::datatypes::{Int32Type, Int64Type, TimestampMicrosecondType};
    let file = std::fs::File::open(path).unwrap();
    let builder =
        parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
    let meta: std::collections::HashMap<String, String> = builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .unwrap()
        .iter()
        .map(|kv| (kv.key.clone(), kv.value.clone().unwrap_or_default()))
        .collect();
    let first: i64 = meta["first_offset"].parse().unwrap();
    let last: i64 = meta["last_offset"].parse().unwrap();
    let (mut partitions, mut hours) = (Vec::new(), Vec::new());
    for batch in builder.build().unwrap() {
        let batch = batch.unwrap();
        let column = |name: &str| batch.column_by_name(name).unwrap().clone();
        let offsets = column("_offset");
        for offset in offsets.as_primitive::<Int64Type>().values() {
            assert!(
                (first..=last).contains(offset),
                "{offset} in {first}..={last}"
            );
        }
        partitions.extend(column("_partition").as_primitive::<Int32Type>().values());
        let ingest = column("_ingest_ts");
        assert_eq!(ingest.null_count(), 0);
        hours.extend(
            ingest
                .as_primitive::<TimestampMicrosecondType>()
                .values()
                .iter()
                .map(|t| t.div_euclid(3_600_000_000)),
        );
    }
    partitions.dedup();
    hours.sort();
    hours.dedup();
    assert_eq!(partitions.len(), 1, "{partitions:?}");
    (partitions[0], first, last, hours)
}

/// A sink reading a backlog lets the other tasks of its runtime run: its metrics and health
/// server, on a machine of one core, share a single runtime thread with it. On a runtime of one
/// thread, a task checking the sink's progress every 5 ms sees it part-way through the backlog
/// again and again. Before, the worker took message after message without giving the thread
/// up while any was ready, and the task saw nothing until the whole backlog was read (a health
/// check would have timed out for as long).
#[tokio::test(flavor = "current_thread")]
async fn a_sink_reading_a_backlog_lets_the_other_tasks_run() {
    let (cluster, producer) = mock_cluster(3);
    let readings = distinct_readings(30_000);
    let sends = readings.iter().map(|r| {
        let key = r["device_id"].as_str().unwrap().to_owned();
        (key, r.to_string(), OwnedHeaders::new())
    });
    produce_at_once(&producer, sends).await;
    let landing = tempfile::tempdir().unwrap();
    let (sink, shutdown) =
        start_local_sink(&cluster, landing.path(), "backlog", quick_rotation()).await;
    let total = readings.len() as u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen = std::collections::BTreeSet::new();
    loop {
        let received = sink.stats.records_received.load(Ordering::Relaxed);
        if received >= total {
            break;
        }
        // Past the partitions' start, whose awaits give the thread up anyway.
        if received >= total / 10 {
            seen.insert(received);
        }
        assert!(
            Instant::now() < deadline,
            "the sink read {received} of {total}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        seen.len() >= 5,
        "the checking task ran only {} times while the sink read the last 90% of its backlog: {seen:?}",
        seen.len()
    );
    wait_written(&sink, total).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert_exactly_once(&readings, landing.path());
    drop(cluster);
}

/// Produces (key, value, headers) records all at once (not each awaited before the next), so
/// that a sink started after finds them ready together.
async fn produce_at_once(
    producer: &FutureProducer,
    records: impl IntoIterator<Item = (String, String, OwnedHeaders)>,
) {
    let sends = records.into_iter().map(|(key, value, headers)| {
        let producer = producer.clone();
        async move {
            let record = FutureRecord::to(TOPIC)
                .key(&key)
                .payload(&value)
                .headers(headers);
            producer
                .send(record, Duration::from_secs(30))
                .await
                .unwrap();
        }
    });
    futures::future::join_all(sends).await;
}

fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}
