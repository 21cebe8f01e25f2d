//! Records produced straight into Apache Kafka by another client, Python's confluent-kafka,
//! keyed by the partition key as the wire format says but without the gateway's headers, with re-sent duplicates and malformed and schema-invalid
//! values among them: the sink lands every distinct valid record exactly once in moto's S3
//! (read back by pyarrow) and puts each bad value in the dead-letter location. The producer
//! compresses with zstd as the gateway does, but its librdkafka (the confluent-kafka wheel's)
//! leaves the uncompressed size out of the frames, which the sink's regrowth metric shows.

use crate::common;
use crate::support;

use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use sink::SinkConfig;
use sink::config::RotationConfig;
use sink::store::ObjectStore;
use tokio_util::sync::CancellationToken;

const PRODUCE: &str = r#"
import json, sys
from confluent_kafka import Producer
brokers, topic, path = sys.argv[1:4]
p = Producer({"bootstrap.servers": brokers, "enable.idempotence": True,
              "compression.type": "zstd"})
with open(path, "rb") as f:
    for line in f:
        value = line.rstrip(b"\n")
        try:
            key = json.loads(value)["device_id"]  # the wire format's key: the partition key
        except Exception:
            key = None
        p.produce(topic, key=key if isinstance(key, str) else None, value=value)
        p.poll(0)
left = p.flush(30)
sys.exit(1 if left else 0)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confluent_kafka_records_with_duplicates_and_bad_values() {
    let kafka = common::service_env("EDGE_INGEST_KAFKA");
    let s3 = common::service_env("EDGE_INGEST_S3");
    let python = common::service_env("EDGE_INGEST_PYTHON");
    let id = common::unique_id();
    let prefix = format!("foreign{id}.");
    let topic = format!("{prefix}sensor_readings");
    let bucket = format!("foreign-{id}");
    common::pyarrow(&["--s3-endpoint", &s3, "--bucket", &bucket, "--create-bucket"]);
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &kafka)
        .create()
        .unwrap();
    admin
        .create_topics(
            &[NewTopic::new(&topic, 2, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap()
        .into_iter()
        .for_each(|r| {
            r.unwrap();
        });

    // 1,200 readings (a fifth re-sent), with 6 malformed and 6 schema-invalid values spread
    // among them.
    let sent = support::readings(1_200, 21);
    let bad: [&[u8]; 4] = [
        b"{not json",
        br#"{"device_id": 1, "sensor": "s", "ts": 0, "value": 1}"#,
        br#"{"device_id": "d", "sensor": "s", "ts": "yesterday", "value": 1}"#,
        b"\xff\xfe",
    ];
    let mut lines = Vec::new();
    let mut bad_count = 0;
    for (i, r) in sent.iter().enumerate() {
        lines.extend_from_slice(r.to_string().as_bytes());
        lines.push(b'\n');
        if i % 100 == 50 {
            lines.extend_from_slice(bad[bad_count % bad.len()]);
            lines.push(b'\n');
            bad_count += 1;
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.ndjson");
    std::fs::write(&file, &lines).unwrap();
    let status = Command::new(&python)
        .args(["-c", PRODUCE, &kafka, &topic])
        .arg(&file)
        .status()
        .unwrap();
    assert!(status.success(), "confluent-kafka producer failed");

    let mut config = SinkConfig {
        store: support::s3_store(&s3, &bucket),
        rotation: RotationConfig {
            max_records: 400,
            idle_ms: 500,
            ..RotationConfig::default()
        },
        ..SinkConfig::default()
    };
    config.kafka.brokers = kafka;
    config.kafka.topic_prefix = prefix;
    config.kafka.group_id = format!("foreign-{id}");
    let store = ObjectStore::from_config(&config.store).await.unwrap();
    let shutdown = CancellationToken::new();
    let sink = sink::start(config, schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    let total = (sent.len() + bad_count) as u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    while sink.stats.records_received.load(Ordering::Relaxed) < total {
        assert!(
            Instant::now() < deadline,
            "the sink read {} of {total} records",
            sink.stats.records_received.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Idle rotation writes what is buffered. librdkafka's statistics (every 5 s) count the
    // message sets it had to decompress again: the wheel's frames do not say how big they are
    // uncompressed, and sensor readings compress more than the first guess of twice the size.
    let deadline = Instant::now() + Duration::from_secs(20);
    while sink.stats.decompression_regrowths.load(Ordering::Relaxed) == 0 {
        assert!(
            Instant::now() < deadline,
            "no decompression regrowth reported for frames without their size"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert_eq!(
        sink.stats.dead_letters.load(Ordering::Relaxed),
        bad_count as u64
    );

    let landed = common::pyarrow_s3(&s3, &bucket, "landing/sensor_readings/");
    common::assert_landed_exactly(&sent, &landed);

    let mut dead = Vec::new();
    for key in store.list("landing/_dead_letters/").await.unwrap() {
        let data = store.get(&key).await.unwrap().unwrap();
        for line in String::from_utf8(data.to_vec()).unwrap().lines() {
            dead.push(serde_json::from_str::<serde_json::Value>(line).unwrap());
        }
    }
    assert_eq!(dead.len(), bad_count, "{dead:?}");
    for d in &dead {
        let payload = hex::decode(d["payload_hex"].as_str().unwrap()).unwrap();
        assert!(bad.contains(&payload.as_slice()), "{d}");
        assert!(!d["reason"].as_str().unwrap().is_empty());
        assert!(d["offset"].as_i64().is_some());
    }
}
