//! `sink redrive` against Apache Kafka and moto's S3, read back by pyarrow: dead letters that a mended
//! definition takes go back to their topic and land once; those still invalid stay; a second
//! run redrives nothing again.

use crate::common;
use crate::support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::FutureProducer;
use serde_json::json;
use sink::SinkConfig;
use sink::config::RotationConfig;
use sink::redrive::{RedriveOptions, RedriveReport, redrive};
use tokio_util::sync::CancellationToken;

/// Runs a sink on `config` with the definitions of its `streams_dir` until it has read
/// `records` records and written `written` rows, then stops it; gives its dead-letter count and
/// the records it read.
async fn run_sink(config: &SinkConfig, records: u64, written: u64) -> (u64, u64) {
    let streams = service_kit::load_streams_dir(&config.streams_dir).unwrap();
    let shutdown = CancellationToken::new();
    let sink = sink::start(config.clone(), streams, shutdown.clone())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    while sink.stats.records_received.load(Ordering::Relaxed) < records
        || sink.stats.records_written.load(Ordering::Relaxed) < written
    {
        assert!(
            Instant::now() < deadline,
            "the sink read {} of {records} records and wrote {} of {written}",
            sink.stats.records_received.load(Ordering::Relaxed),
            sink.stats.records_written.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Idle rotation writes the dead letters with the rest.
    tokio::time::sleep(Duration::from_secs(1)).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    (
        sink.stats.dead_letters.load(Ordering::Relaxed),
        sink.stats.records_received.load(Ordering::Relaxed),
    )
}

/// Every object under the dead letters, with its bytes.
async fn snapshot(store: &sink::store::ObjectStore) -> Vec<(String, bytes::Bytes)> {
    let mut out = Vec::new();
    for key in store.list("landing/_dead_letters/").await.unwrap() {
        let data = store.get(&key).await.unwrap().unwrap();
        out.push((key, data));
    }
    out
}

async fn redriven(config: &SinkConfig, dry_run: bool) -> RedriveReport {
    let streams = service_kit::load_streams_dir(&config.streams_dir).unwrap();
    let options = RedriveOptions {
        stream: "sensor_readings".into(),
        dry_run,
        ..RedriveOptions::default()
    };
    redrive(config, &streams, &options).await.unwrap()
}

/// Readings with `humidity` set, which the shipped definition does not have: 30 distinct ones.
fn humid_readings() -> Vec<serde_json::Value> {
    (0..30)
        .map(|i| {
            json!({
                "device_id": format!("dev-{:03}", i % 5),
                "sensor": "humidity",
                "ts": 1_767_300_000_000i64 + i,
                "value": 20.5,
                "unit": "degC",
                "quality": 192,
                "tags": {"site": "s1"},
                "humidity": 50.0 + i as f64,
            })
        })
        .collect()
}

/// A sink whose definition lacks a field its producers already set makes those records dead
/// letters, next to garbage. Once the definition has the field, `redrive` produces the 30 back
/// to their topic (a dry run first changes nothing), the next sink run lands them once with
/// their values, the garbage stays a dead letter, and a second redrive produces nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_redriven_once_a_definition_takes_them() {
    let kafka = common::service_env("EDGE_INGEST_KAFKA");
    let s3 = common::service_env("EDGE_INGEST_S3");
    let id = common::unique_id();
    let prefix = format!("redrive{id}.");
    let topic = format!("{prefix}sensor_readings");
    let bucket = format!("redrive-{id}");
    common::pyarrow(&["--s3-endpoint", &s3, "--bucket", &bucket, "--create-bucket"]);
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &kafka)
        .create()
        .unwrap();
    for r in admin
        .create_topics(
            &[NewTopic::new(&topic, 2, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap()
    {
        r.unwrap();
    }
    let streams = tempfile::tempdir().unwrap();
    let file = streams.path().join("sensor_readings.toml");
    let shipped = include_str!("../../streams/sensor_readings.toml");
    std::fs::write(&file, shipped).unwrap();

    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &kafka)
        .create()
        .unwrap();
    let plain = support::readings(100, 5);
    let humid = humid_readings();
    support::produce(&producer, &topic, &plain).await;
    support::produce(&producer, &topic, &humid).await;
    for garbage in ["{not json", r#"{"device_id": 1}"#, "[]"] {
        support::produce_raw(&producer, &topic, "dev-000", garbage).await;
    }

    let mut config = SinkConfig {
        streams_dir: streams.path().to_path_buf(),
        store: support::s3_store(&s3, &bucket),
        rotation: RotationConfig {
            idle_ms: 500,
            ..RotationConfig::default()
        },
        ..SinkConfig::default()
    };
    config.kafka.brokers = kafka;
    config.kafka.topic_prefix = prefix;
    config.kafka.group_id = format!("redrive-{id}");
    let total = (plain.len() + humid.len() + 3) as u64;
    assert_eq!(run_sink(&config, total, 1).await, (33, total));
    assert_eq!(support::dead_letters(&s3, &bucket).await.len(), 33);
    // Another program's file among the dead letters is left out, not a reason to stop.
    let store = sink::store::ObjectStore::from_config(&config.store)
        .await
        .unwrap();
    let foreign = "landing/_dead_letters/sensor_readings/notes.ndjson";
    store
        .put_if_absent(foreign, bytes::Bytes::from_static(b"not a dead letter\n"))
        .await
        .unwrap();
    let dead_before = snapshot(&store).await;

    // Under the shipped definition nothing passes: a redrive now would produce nothing.
    let before = redriven(&config, true).await;
    assert_eq!(
        (
            before.tally.records,
            before.tally.redriven,
            before.tally.still_invalid
        ),
        (33, 0, 33)
    );

    let extended = format!(
        "{}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n",
        shipped.replace("version = 1", "version = 2")
    );
    std::fs::write(&file, extended).unwrap();
    let dry = redriven(&config, true).await;
    assert_eq!(
        (dry.tally.redriven, dry.tally.still_invalid),
        (30, 3),
        "{dry:?}"
    );
    let report = redriven(&config, false).await;
    assert_eq!(
        (
            report.tally.records,
            report.tally.redriven,
            report.tally.still_invalid
        ),
        (33, 30, 3),
        "{report:?}"
    );
    assert_eq!(report.unreadable_objects, 1);
    assert!(report.objects >= 1);
    assert_eq!(report.tally.reasons.values().sum::<u64>(), 3);
    let again = redriven(&config, false).await;
    assert_eq!(
        (
            again.redriven_before,
            again.tally.records,
            again.tally.redriven,
            again.tally.still_invalid
        ),
        (30, 3, 0, 3),
        "{again:?}"
    );

    // The next sink run reads the 30 (the dry runs and the second run produced none) and lands
    // them.
    assert_eq!(run_sink(&config, 30, 30).await, (0, 30));
    let landed = common::pyarrow_s3(&s3, &bucket, "landing/sensor_readings/");
    let all: Vec<serde_json::Value> = plain.iter().chain(&humid).cloned().collect();
    common::assert_landed_exactly(&all, &landed);
    let (versions, mut values) = common::column_added_in(&landed, "humidity", "2");
    assert!(versions.contains("2"), "{versions:?}");
    values.sort_by(f64::total_cmp);
    let expected: Vec<f64> = (0..30).map(|i| 50.0 + f64::from(i)).collect();
    assert_eq!(values, expected);
    assert!(
        snapshot(&store).await == dead_before,
        "dead-letter objects are neither changed nor deleted"
    );
}

/// The command as an operator runs it, on a landing directory and without brokers: a dry run
/// needs no Kafka, reads the dead letters, and prints the JSON report; wrong options are told.
#[test]
fn the_redrive_command_reports_a_dry_run_on_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let streams = dir.path().join("streams");
    std::fs::create_dir(&streams).unwrap();
    std::fs::write(
        streams.join("sensor_readings.toml"),
        include_str!("../../streams/sensor_readings.toml"),
    )
    .unwrap();
    let dead = dir
        .path()
        .join("landing/landing/_dead_letters/sensor_readings/date=2026-11-25/hour=04");
    std::fs::create_dir_all(&dead).unwrap();
    let valid = r#"{"device_id":"d1","sensor":"s","ts":1767225600000,"value":1.5}"#;
    let line = |offset: i64, payload: &[u8]| {
        json!({"topic": "ingest.sensor_readings", "partition": 0, "offset": offset,
               "ingest_ts": 1_764_043_200_000_000i64, "reason": "r",
               "payload_hex": hex::encode(payload)})
        .to_string()
    };
    std::fs::write(
        dead.join("sensor_readings-p0-o00000000000000000005.ndjson"),
        format!("{}\n{}\n", line(5, valid.as_bytes()), line(9, b"{oops")),
    )
    .unwrap();
    let config = dir.path().join("sink.toml");
    std::fs::write(
        &config,
        format!(
            "streams_dir = {streams:?}\n[kafka]\nbrokers = \"127.0.0.1:1\"\n\
             [store]\ntype = \"local\"\npath = {:?}\n",
            dir.path().join("landing")
        ),
    )
    .unwrap();
    let sink = env!("CARGO_BIN_EXE_sink");
    let run = |args: &[&str]| {
        std::process::Command::new(sink)
            .arg("redrive")
            .arg("--config")
            .arg(&config)
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["--stream", "sensor_readings", "--dry-run"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            &report["objects"],
            &report["records"],
            &report["redriven"],
            &report["still_invalid"],
            &report["dry_run"]
        ),
        (&json!(1), &json!(2), &json!(1), &json!(1), &json!(true)),
        "{report}"
    );
    let out = run(&["--stream", "sensor_readings", "--hour", "4"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--hour needs --date"));
    let out = run(&["--stream", "nosuch"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no stream 'nosuch'"));
}
