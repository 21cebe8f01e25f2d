//! Sink processes killed with SIGKILL at random points while two of them share the partitions,
//! writing into moto's S3; pyarrow reads the objects back and every distinct record is there
//! exactly once. The broker is librdkafka's mock cluster in this process (tansu 0.6 never hands
//! the partitions of a killed member to the others; the mock cluster's group coordinator does).

#[path = "../../loadtest/tests/common/mod.rs"]
mod common;
mod support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

const TOPIC: &str = "ingest.sensor_readings";
const PARTITIONS: i32 = 4;
const GROUP: &str = "crash-sinks";

fn start_sink(config: &Path, log: &Path) -> Child {
    let log = std::fs::File::create(log).unwrap();
    Command::new(env!("CARGO_BIN_EXE_sink"))
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "sink=info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("cannot start the sink binary")
}

/// Whether the group committed every partition up to its high watermark.
fn caught_up(bootstrap: &str) -> bool {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", GROUP)
        .create()
        .unwrap();
    let mut list = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        list.add_partition(TOPIC, p);
    }
    let Ok(committed) = consumer.committed_offsets(list, Duration::from_secs(5)) else {
        return false;
    };
    (0..PARTITIONS).all(|p| {
        let high = consumer
            .fetch_watermarks(TOPIC, p, Duration::from_secs(5))
            .map_or(i64::MAX, |(_, high)| high);
        matches!(
            committed.find_partition(TOPIC, p).map(|e| e.offset()),
            Some(Offset::Offset(o)) if o >= high
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sinks_killed_at_random_points_land_every_record_exactly_once() {
    let s3 = common::service_env("EDGE_INGEST_S3");
    let id = common::unique_id();
    let bucket = format!("crash-{id}");
    common::pyarrow(&["--s3-endpoint", &s3, "--bucket", &bucket, "--create-bucket"]);

    let cluster = MockCluster::new(1).unwrap();
    cluster.create_topic(TOPIC, PARTITIONS, 1).unwrap();
    let bootstrap = cluster.bootstrap_servers();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sink.toml");
    std::fs::write(
        &config,
        format!(
            r#"
streams_dir = "{streams}"
admin_listen = "127.0.0.1:0"
key_prefix = "landing"
memory_budget_bytes = 200000
[kafka]
brokers = "{bootstrap}"
group_id = "{GROUP}"
session_timeout_ms = 3000
consumer = {{ "fetch.wait.max.ms" = "50" }}
[store]
type = "s3"
bucket = "{bucket}"
endpoint = "{s3}"
region = "us-east-1"
force_path_style = true
[rotation]
max_records = 150
idle_ms = 400
[upload]
staging_dir = "{staging}"
"#,
            streams = common::repo_root().join("streams").display(),
            staging = dir.path().join("staging").display(),
        ),
    )
    .unwrap();

    let sent = support::readings(6_000, 11);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    let mut rng = SmallRng::seed_from_u64(5);
    let mut sinks: Vec<Child> = (0..2)
        .map(|i| start_sink(&config, &dir.path().join(format!("sink-{i}.log"))))
        .collect();
    let mut kills = 0;
    let mut started = 2;
    // Produce in chunks; between chunks, SIGKILL one of the two sinks at a random moment and
    // start a replacement.
    for chunk in sent.chunks(500) {
        support::produce(&producer, TOPIC, chunk).await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1_500))).await;
        if rng.random_bool(0.5) {
            let victim = rng.random_range(0..sinks.len());
            let mut child = sinks.swap_remove(victim);
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            kills += 1;
            sinks.push(start_sink(
                &config,
                &dir.path().join(format!("sink-{started}.log")),
            ));
            started += 1;
        }
    }
    assert!(kills >= 3, "only {kills} kills");

    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done = {
            let bootstrap = bootstrap.clone();
            tokio::task::spawn_blocking(move || caught_up(&bootstrap))
                .await
                .unwrap()
        };
        if done {
            break;
        }
        for (i, s) in sinks.iter_mut().enumerate() {
            assert!(s.try_wait().unwrap().is_none(), "sink {i} exited");
        }
        assert!(
            Instant::now() < deadline,
            "the sinks did not commit everything; logs in {}",
            dir.path().display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for s in &mut sinks {
        // SIGTERM: a graceful stop.
        Command::new("kill")
            .arg(s.id().to_string())
            .status()
            .unwrap();
        assert!(s.wait().unwrap().success());
    }
    let landed = common::pyarrow_s3(&s3, &bucket, "landing/");
    common::assert_landed_exactly(&sent, &landed);
    drop(cluster);
}
