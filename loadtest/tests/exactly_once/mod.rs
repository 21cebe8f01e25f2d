//! Exactly-once in the sink on the embedded mock cluster: a previous sink wrote a landing file
//! but crashed before committing its offsets. The next sink reads those records again, finds the
//! object at the same key, adopts it and lands only the rest; duplicates re-sent into Kafka and
//! an undecodable record are dropped.

use crate::common;

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

mod adoption;
mod budgets;
mod definitions;
mod shared;

use shared::*;

const TOPIC: &str = "ingest.sensor_readings";
const BASE_TS: i64 = 1_767_225_600_000_000; // 2026-01-01T00:00:00Z in µs

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
    let vehicles = read_landing_dir(landings[1].path(), std::slice::from_ref(def)).unwrap();
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
/// 15% (the first has no earlier file to take the bytes per record from).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_close_at_the_target_parquet_size() {
    // The mock cluster keeps about 5 MB per partition: 24,000 readings fit, about 150 KB of
    // Parquet.
    const TARGET: usize = 20 << 10;
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
        table: None,
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
    let landed = read_landing_dir(landing, std::slice::from_ref(def)).unwrap();
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
