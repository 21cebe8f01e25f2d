//! The whole path against real services: the agent reads an NDJSON file and posts zstd batches
//! to the gateway, which produces to tansu (a Kafka-protocol broker); the sink consumes as a
//! consumer group and writes Parquet into moto's S3; pyarrow reads the objects back.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use edge_agent::AgentConfig;
use ingest_gateway::GatewayConfig;
use ingest_gateway::config::{AuthConfig, TokenConfig};
use loadtest::demo::{blake3_hex, distinct_hashes};
use loadtest::fleet::{FleetSpec, sensor_readings, to_ndjson};
use sink::SinkConfig;
use sink::config::{RotationConfig, StoreConfig};
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_gateway_tansu_sink_s3_pyarrow() {
    let kafka = common::service_env("EDGE_INGEST_KAFKA");
    let s3 = common::service_env("EDGE_INGEST_S3");
    let id = common::unique_id();
    let topic_prefix = format!("e2e{id}.");
    let bucket = format!("landing-{id}");
    common::pyarrow(&["--s3-endpoint", &s3, "--bucket", &bucket, "--create-bucket"]);

    let streams = schemas::example_streams();
    let shutdown = CancellationToken::new();
    let mut gateway = GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        auth: AuthConfig {
            allow_anonymous: false,
            tokens: vec![TokenConfig {
                name: "e2e".into(),
                blake3: blake3_hex("e2e-secret"),
                streams: vec!["sensor_readings".into()],
            }],
        },
        ..GatewayConfig::default()
    };
    gateway.kafka.brokers = kafka.clone();
    gateway.kafka.topic_prefix = topic_prefix.clone();
    gateway.kafka.create_topics = true;
    gateway.kafka.produce_timeout_ms = 20_000;
    let gateway = ingest_gateway::start(gateway, streams.clone(), shutdown.clone())
        .await
        .unwrap();

    let mut sink = SinkConfig {
        store: StoreConfig::S3 {
            bucket: bucket.clone(),
            endpoint: Some(s3.clone()),
            region: Some("us-east-1".into()),
            force_path_style: true,
        },
        rotation: RotationConfig {
            idle_ms: 1_000,
            ..RotationConfig::default()
        },
        ..SinkConfig::default()
    };
    sink.kafka.brokers = kafka;
    sink.kafka.topic_prefix = topic_prefix;
    sink.kafka.group_id = format!("e2e-sink-{id}");
    let sink = sink::start(sink, streams.clone(), shutdown.clone())
        .await
        .unwrap();

    let fleet = FleetSpec {
        records: 3_000,
        devices: 10,
        seed: 7,
        ..FleetSpec::default()
    };
    let records = sensor_readings(&fleet);
    let expected = distinct_hashes(&streams, &records).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("readings.ndjson");
    std::fs::write(&file, to_ndjson(&records)).unwrap();
    // The agent sends Parquet batch bodies: the gateway's columnar path, end to end.
    let agent = AgentConfig::parse(&format!(
        r#"
        state_dir = {state:?}
        [gateway]
        url = "http://{addr}"
        token = "e2e-secret"
        [batch]
        max_records = 700
        encoding = "parquet"
        [[sources]]
        type = "file"
        path = {file:?}
        stream = "sensor_readings"
        "#,
        state = dir.path().join("state"),
        addr = gateway.addr,
    ))
    .unwrap();
    let stats = edge_agent::run(agent, streams.clone(), shutdown.clone())
        .await
        .unwrap()
        .total();
    assert_eq!(stats.delivery.accepted as usize, expected.len());
    assert!(stats.delivery.batches >= 4, "several batches: {stats:?}");
    assert!(
        stats.delivery.wire_bytes * 2 < stats.delivery.raw_bytes,
        "Parquet bodies are compressed: {stats:?}"
    );

    let deadline = Instant::now() + Duration::from_secs(120);
    while sink.stats.records_written.load(Ordering::Relaxed) < expected.len() as u64 {
        assert!(
            Instant::now() < deadline,
            "only {} of {} records landed",
            sink.stats.records_written.load(Ordering::Relaxed),
            expected.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shutdown.cancel();
    gateway.task.await.unwrap().unwrap();
    sink.task.await.unwrap().unwrap();

    let landed = common::pyarrow_s3(&s3, &bucket, "landing/");
    common::assert_landed_exactly(&records, &landed);
}
