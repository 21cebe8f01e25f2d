//! The whole path against real services: the agent reads an NDJSON file and posts zstd batches
//! to the gateway, which produces to Apache Kafka; the sink consumes as a
//! consumer group and writes Parquet into moto's S3; pyarrow reads the objects back. And the same
//! stack driven by `loadtest send` and checked by `loadtest verify`.

use crate::common;

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

/// A gateway (token `e2e-secret`) producing to Kafka and a sink landing in a fresh moto bucket,
/// both in this process, on topics of their own.
struct Stack {
    gateway: ingest_gateway::Gateway,
    sink: sink::Sink,
    shutdown: CancellationToken,
    streams: schemas::Streams,
    s3: String,
    bucket: String,
}

impl Stack {
    async fn start() -> Stack {
        Stack::start_with(schemas::example_streams(), None).await
    }

    /// The stack on `streams`; the gateway and the sink read their definitions again from
    /// `streams_dir` when records need it.
    async fn start_with(streams: schemas::Streams, streams_dir: Option<&std::path::Path>) -> Stack {
        let kafka = common::service_env("EDGE_INGEST_KAFKA");
        let s3 = common::service_env("EDGE_INGEST_S3");
        let id = common::unique_id();
        let topic_prefix = format!("e2e{id}.");
        let bucket = format!("landing-{id}");
        common::pyarrow(&["--s3-endpoint", &s3, "--bucket", &bucket, "--create-bucket"]);

        let shutdown = CancellationToken::new();
        let mut gateway = GatewayConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            admin_listen: None,
            auth: AuthConfig {
                allow_anonymous: false,
                tokens: vec![TokenConfig {
                    name: "e2e".into(),
                    blake3: blake3_hex("e2e-secret"),
                    streams: vec!["sensor_readings".into()],
                    max_bytes_per_sec: None,
                }],
            },
            ..GatewayConfig::default()
        };
        gateway.kafka.brokers = kafka.clone();
        gateway.kafka.topic_prefix = topic_prefix.clone();
        gateway.kafka.create_topics = true;
        gateway.kafka.produce_timeout_ms = 20_000;
        if let Some(dir) = streams_dir {
            gateway.streams_dir = dir.to_path_buf();
        }
        let gateway = ingest_gateway::start(gateway, streams.clone(), shutdown.clone())
            .await
            .unwrap();

        let mut sink = SinkConfig {
            store: StoreConfig::S3 {
                bucket: bucket.clone(),
                endpoint: Some(s3.clone()),
                region: Some("us-east-1".into()),
                force_path_style: true,
                ca_file: None,
                server_side_encryption: None,
                kms_key_id: None,
                storage_class: None,
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
        if let Some(dir) = streams_dir {
            sink.streams_dir = dir.to_path_buf();
        }
        let sink = sink::start(sink, streams.clone(), shutdown.clone())
            .await
            .unwrap();
        Stack {
            gateway,
            sink,
            shutdown,
            streams,
            s3,
            bucket,
        }
    }

    /// Waits until the sink wrote `records` records (or fails the test after two minutes).
    async fn wait_written(&self, records: usize) {
        let written = || self.sink.stats.records_written.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(120);
        while written() < records as u64 {
            assert!(
                Instant::now() < deadline,
                "only {} of {records} records landed",
                written()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.gateway.task.await.unwrap().unwrap();
        self.sink.task.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_gateway_kafka_sink_s3_pyarrow() {
    let stack = Stack::start().await;
    let streams = stack.streams.clone();
    let shutdown = stack.shutdown.clone();
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
        addr = stack.gateway.addr,
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

    stack.wait_written(expected.len()).await;
    let (s3, bucket) = (stack.s3.clone(), stack.bucket.clone());
    stack.stop().await;

    let landed = common::pyarrow_s3(&s3, &bucket, "landing/");
    common::assert_landed_exactly(&records, &landed);
}

/// The filters' error bounds, end to end: process-like series of every shape (drift, noise,
/// steps, spikes, stuck values, gaps) go through an agent with a swinging-door filter and, under
/// other device names, one with deadband, both at 0.5% of the range; the gateway, Kafka and the
/// sink land them in S3, and from the rows pyarrow reads each series is rebuilt (linear
/// interpolation, sample-and-hold) and checked at every input reading against the band, the
/// first and last reading kept, and no gap between kept readings over `max_silence_secs` where
/// the input had readings. Each agent's own report of its largest deviation matches. Readings
/// that come 30 s late or a second time at one time are among them: each lands as it is, told
/// apart by its order (`_offset`), and the rest keep the band.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_keep_every_reading_within_the_band_end_to_end() {
    use loadtest::process::{Reconstruction, Shape, fidelity, readings, series};
    let stack = Stack::start().await;
    let dir = tempfile::tempdir().unwrap();
    let band = 0.5;
    let silence_secs = 120;
    let mut inputs = std::collections::BTreeMap::new();
    let mut came_late = std::collections::BTreeMap::new();
    let mut kept_total = 0;
    for (kind, prefix) in [("swinging_door", "sd"), ("deadband", "db")] {
        let mut lines = Vec::new();
        for (i, shape) in Shape::ALL.into_iter().enumerate() {
            let device = format!("{prefix}-{}", shape.name());
            let s = series(shape, 1_500, 1_767_225_600_000, i as u64);
            // After every 97th reading one 30 s late, after every 131st a second one at its
            // time, both far from the series' values.
            let mut late = Vec::new();
            for (j, &(t, v)) in s.iter().enumerate() {
                lines.extend(readings(&device, &[(t, v)]));
                let first = s[0].0;
                for (every, at) in [(97, (t - 30_000).max(first)), (131, t)] {
                    if j > 0 && j % every == 0 {
                        lines.extend(readings(&device, &[(at, v + 40.0)]));
                        late.push((at, v + 40.0));
                    }
                }
            }
            came_late.insert(device.clone(), late);
            inputs.insert(device, s);
        }
        let file = dir.path().join(format!("{kind}.ndjson"));
        std::fs::write(&file, to_ndjson(&lines)).unwrap();
        let extra = if kind == "deadband" {
            "send_previous = true\n"
        } else {
            ""
        };
        let agent = AgentConfig::parse(&format!(
            r#"
            state_dir = {state:?}
            [gateway]
            url = "http://{addr}"
            token = "e2e-secret"
            [batch]
            max_records = 500
            [[sources]]
            type = "file"
            path = {file:?}
            stream = "sensor_readings"
            [[streams.sensor_readings.filters]]
            type = "{kind}"
            field = "value"
            percent = 0.5
            range = [0.0, 100.0]
            max_silence_secs = {silence_secs}
            {extra}
            "#,
            state = dir.path().join(format!("state-{kind}")),
            addr = stack.gateway.addr,
        ))
        .unwrap();
        let stats = edge_agent::run(agent, stack.streams.clone(), stack.shutdown.clone())
            .await
            .unwrap();
        let stats = &stats.streams["sensor_readings"];
        let report = &stats.pipeline.reductions[0];
        assert_eq!(report.readings_in as usize, lines.len());
        assert_eq!(stats.delivery.accepted, report.kept);
        assert!(report.max_deviation.unwrap() <= band, "{report:?}");
        kept_total += report.kept as usize;
    }
    stack.wait_written(kept_total).await;
    let (s3, bucket) = (stack.s3.clone(), stack.bucket.clone());
    stack.stop().await;

    let landed = common::pyarrow_s3(&s3, &bucket, "landing/");
    // Each series' rows in the order they left the agent: one series is in one partition.
    type Rows = Vec<(i64, (i64, f64))>;
    let mut by_offset: std::collections::BTreeMap<String, Rows> = Default::default();
    for row in landed["rows"].as_array().unwrap() {
        by_offset
            .entry(row["device_id"].as_str().unwrap().to_owned())
            .or_default()
            .push((
                row["_offset"].as_i64().unwrap(),
                (
                    row["ts"].as_i64().unwrap() / 1_000,
                    row["value"].as_f64().unwrap(),
                ),
            ));
    }
    let mut kept: std::collections::BTreeMap<String, Vec<(i64, f64)>> = Default::default();
    for (device, mut rows) in by_offset {
        rows.sort_by_key(|r| r.0);
        let rows: Vec<(i64, f64)> = rows.into_iter().map(|r| r.1).collect();
        let (in_order, mut late) = edge_agent::filter::late::split(&rows);
        let mut expected = came_late[&device].clone();
        late.sort_by(|a, b| a.partial_cmp(b).unwrap());
        expected.sort_by(|a, b| a.partial_cmp(b).unwrap());
        assert_eq!(
            late, expected,
            "{device}: the late readings landed as they came"
        );
        kept.insert(device, in_order);
    }
    assert_eq!(kept.len(), inputs.len(), "every series landed");
    let count = |prefix: &str| -> usize {
        kept.iter()
            .filter(|(device, _)| device.starts_with(prefix))
            .map(|(_, rows)| rows.len())
            .sum()
    };
    assert!(
        count("sd-") < count("db-"),
        "swinging door kept {}, deadband {}",
        count("sd-"),
        count("db-")
    );
    for (device, input) in &inputs {
        let mut rows = kept[device].clone();
        rows.sort_by_key(|r| r.0);
        let how = match device.starts_with("sd-") {
            true => Reconstruction::Linear,
            false => Reconstruction::Hold,
        };
        let f = fidelity(input, &rows, how).unwrap_or_else(|e| panic!("{device}: {e}"));
        assert!(
            f.max_error <= band * (1.0 + 1e-9),
            "{device}: error {} over the band",
            f.max_error
        );
        assert!(
            f.max_gap_ms <= silence_secs * 1_000,
            "{device}: {} ms between kept readings",
            f.max_gap_ms
        );
    }
}

/// A stream gains a field while the whole path runs, and the definition's file is replaced in
/// the one directory that the agent, the gateway and the sink read: nothing is restarted or
/// signalled. The agent (Parquet batches) takes the new definition at the first line that sets
/// the field, the gateway at the first body with its column, the sink at the first record that
/// sets it. Every reading lands once, each new one with its value, in files of version 2 with
/// the column (pyarrow, from S3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_added_while_the_path_runs_lands_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let streams_dir = dir.path().join("streams");
    std::fs::create_dir(&streams_dir).unwrap();
    let definition = streams_dir.join("sensor_readings.toml");
    let shipped = include_str!("../../streams/sensor_readings.toml");
    std::fs::write(&definition, shipped).unwrap();
    let streams = service_kit::load_streams_dir(&streams_dir).unwrap();
    let stack = Stack::start_with(streams.clone(), Some(&streams_dir)).await;
    let fleet = FleetSpec {
        records: 600,
        devices: 6,
        duplicate_ratio: 0.0,
        seed: 11,
        ..FleetSpec::default()
    };
    let mut records = sensor_readings(&fleet);
    for (i, r) in records[300..].iter_mut().enumerate() {
        r["humidity"] = serde_json::json!(i as f64 / 2.0);
    }
    let file = dir.path().join("readings.ndjson");
    std::fs::write(&file, to_ndjson(&records[..300])).unwrap();
    let agent = AgentConfig::parse(&format!(
        r#"
        streams_dir = {streams_dir:?}
        state_dir = {state:?}
        [gateway]
        url = "http://{addr}"
        token = "e2e-secret"
        [batch]
        max_records = 100
        max_age_ms = 200
        encoding = "parquet"
        [[sources]]
        type = "file"
        path = {file:?}
        stream = "sensor_readings"
        follow = true
        poll_ms = 50
        "#,
        state = dir.path().join("state"),
        addr = stack.gateway.addr,
    ))
    .unwrap();
    let agent = tokio::spawn(edge_agent::run(agent, streams, stack.shutdown.clone()));
    stack.wait_written(300).await;

    let extended = format!(
        "{}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n",
        shipped.replace("version = 1", "version = 2")
    );
    std::fs::write(&definition, extended).unwrap();
    let mut appended = std::fs::OpenOptions::new()
        .append(true)
        .open(&file)
        .unwrap();
    std::io::Write::write_all(&mut appended, &to_ndjson(&records[300..])).unwrap();
    stack.wait_written(600).await;
    let dead = stack.sink.stats.dead_letters.load(Ordering::Relaxed);
    let (s3, bucket) = (stack.s3.clone(), stack.bucket.clone());
    stack.stop().await;
    let stats = agent.await.unwrap().unwrap().total();
    assert_eq!(
        (
            stats.pipeline.invalid,
            stats.delivery.rejected_records,
            dead
        ),
        (0, 0, 0)
    );

    let landed = common::pyarrow_s3(&s3, &bucket, "landing/");
    common::assert_landed_exactly(&records, &landed);
    let (_, humid) = common::column_added_in(&landed, "humidity", "2");
    assert_eq!(humid.len(), 300);
    assert_eq!(
        humid.iter().sum::<f64>(),
        (0..300).map(|i| i as f64 / 2.0).sum::<f64>()
    );
}

/// Runs the `loadtest` binary with `args`.
async fn loadtest_output(args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .await
        .expect("cannot run loadtest")
}

/// Runs the `loadtest` binary with `args`; returns whether it succeeded and its stdout as JSON.
async fn loadtest(args: &[&str]) -> (bool, serde_json::Value) {
    let out = loadtest_output(args).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("loadtest {args:?} printed no JSON ({e}); stderr: {stderr}"));
    (out.status.success(), report)
}

/// Runs a boto3 call on the test bucket: `copy SRC DST` or `delete KEY`.
fn s3_object(s3: &str, bucket: &str, op: &[&str]) {
    let script = r#"
import sys, boto3
s3 = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1")
bucket, op = sys.argv[2], sys.argv[3]
if op == "copy":
    s3.copy_object(Bucket=bucket, Key=sys.argv[5], CopySource={"Bucket": bucket, "Key": sys.argv[4]})
else:
    s3.delete_object(Bucket=bucket, Key=sys.argv[4])
"#;
    let status = std::process::Command::new(common::service_env("EDGE_INGEST_PYTHON"))
        .args(["-c", script, s3, bucket])
        .args(op)
        .status()
        .expect("cannot run python");
    assert!(status.success(), "boto3 {op:?} failed");
}

/// `loadtest send` drives a running gateway (Kafka behind it, a sink landing in moto's S3) with
/// NDJSON and then Parquet batches and saves what it sent; `loadtest verify` then finds every
/// distinct sent reading of both files in the landing
/// files once, as pyarrow does. With a landed file copied, its rows count as duplicated; with it
/// deleted, as missing; either way verify fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_and_verify_a_running_stack() {
    let stack = Stack::start().await;
    let started = std::time::Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let sent = dir.path().join("sent.ndjson");
    let sent_arg = sent.to_str().unwrap();
    let gateway = format!("http://{}", stack.gateway.addr);
    // A wrong token stops the run at the first refusal, with the gateway's answer.
    let refused = loadtest_output(&["send", "--gateway", &gateway, "--token", "wrong"]).await;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("401"),
        "{stderr}"
    );
    // `loadtest send` to the stack with the right token, and `args`.
    let send = |args: &[&str]| {
        let mut all = vec!["send", "--gateway", &gateway, "--token", "e2e-secret"];
        all.extend_from_slice(args);
        let all: Vec<String> = all.into_iter().map(str::to_owned).collect();
        async move { loadtest(&all.iter().map(String::as_str).collect::<Vec<_>>()).await }
    };
    let (ok, summary) = send(&[
        "--records",
        "3000",
        "--devices",
        "10",
        "--batch-records",
        "400",
        "--concurrency",
        "3",
        "--save",
        sent_arg,
    ])
    .await;
    assert!(ok, "send failed: {summary}");
    assert_eq!(summary["records"], 3000, "{summary}");
    assert_eq!(summary["batches"], 8, "{summary}");
    assert_eq!(summary["refused_batches"], 0, "{summary}");
    let accepted = summary["accepted"].as_u64().unwrap();
    assert_eq!(
        accepted + summary["duplicates"].as_u64().unwrap(),
        3000,
        "{summary}"
    );

    // More readings as Parquet bodies, saved to a second file.
    let sent_parquet = dir.path().join("sent-parquet.ndjson");
    let sent_parquet_arg = sent_parquet.to_str().unwrap();
    let (ok, summary) = send(&[
        "--records",
        "1000",
        "--encoding",
        "parquet",
        "--save",
        sent_parquet_arg,
    ])
    .await;
    assert!(ok, "send failed: {summary}");
    assert_eq!(summary["batches"], 1, "{summary}");

    let records: Vec<serde_json::Value> = [&sent, &sent_parquet]
        .into_iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(records.len(), 4000);
    let expected = distinct_hashes(&stack.streams, &records).unwrap();
    assert!(
        expected.len() < 3600,
        "a fifth are re-sent: {}",
        expected.len()
    );
    stack.wait_written(expected.len()).await;
    let (s3, bucket) = (stack.s3.clone(), stack.bucket.clone());
    stack.stop().await;

    let verify = |wait: &'static str| {
        let (s3, bucket) = (s3.clone(), bucket.clone());
        let sent = [sent_arg.to_owned(), sent_parquet_arg.to_owned()];
        async move {
            loadtest(&[
                "verify",
                "--sent",
                &sent[0],
                &sent[1],
                "--s3-bucket",
                &bucket,
                "--s3-endpoint",
                &s3,
                "--s3-region",
                "us-east-1",
                "--s3-path-style",
                "--wait",
                wait,
            ])
            .await
        }
    };
    let (ok, report) = verify("60").await;
    assert!(ok, "verify failed: {report}");
    assert_eq!(report["sent_lines"], 4000, "{report}");
    assert_eq!(report["invalid_lines"], 0, "{report}");
    assert_eq!(report["expected"], expected.len(), "{report}");
    assert_eq!(report["rows"], expected.len(), "{report}");
    assert_eq!(report["missing"], 0, "{report}");
    assert_eq!(report["duplicated"], 0, "{report}");
    // Every batch's first attempt is noted next to what was saved, and verify measures each
    // record from it to its object's Last-Modified: at least 0, at most this test's run.
    let times = |f: &std::path::Path| {
        let mut name = f.as_os_str().to_owned();
        name.push(".times");
        std::fs::read_to_string(name).unwrap().lines().count()
    };
    assert_eq!((times(&sent), times(&sent_parquet)), (8, 1));
    let latency = &report["send_to_landing_ms"];
    assert_eq!(latency["count"], expected.len(), "{report}");
    assert_eq!(report["timed_records"], expected.len(), "{report}");
    let ms = |q: &str| latency[q].as_f64().unwrap();
    assert!(
        0.0 <= ms("p50")
            && ms("p50") <= ms("p99")
            && ms("p99") <= ms("max")
            && ms("max") <= started.elapsed().as_secs_f64() * 1e3,
        "{report}"
    );
    // The independent reader agrees.
    let landed = common::pyarrow_s3(&s3, &bucket, "landing/");
    common::assert_landed_exactly(&records, &landed);

    // A landed file copied under another start offset: its rows land twice.
    let file = landed["files"][0]["key"].as_str().unwrap().to_owned();
    let rows = landed["files"][0]["rows"].as_u64().unwrap();
    let copy = format!("{}-o99999999999.parquet", file.rsplit_once("-o").unwrap().0);
    s3_object(&s3, &bucket, &["copy", &file, &copy]);
    let (ok, report) = verify("0").await;
    assert!(!ok, "a copied file passed: {report}");
    assert_eq!(report["duplicated"], rows, "{report}");
    assert_eq!(report["missing"], 0, "{report}");

    // Both gone: its rows are missing.
    s3_object(&s3, &bucket, &["delete", &file]);
    s3_object(&s3, &bucket, &["delete", &copy]);
    let (ok, report) = verify("0").await;
    assert!(!ok, "a deleted file passed: {report}");
    assert_eq!(report["missing"], rows, "{report}");
    assert_eq!(report["duplicated"], 0, "{report}");
}
