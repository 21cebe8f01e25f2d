//! Test data shared by the sink's tests.

#![allow(dead_code)]

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};

/// A sink of the example streams' `sensor_readings` for Kafka at `bootstrap`, group `group`,
/// landing in the directory `landing` (staging under it), closing files idle for 300 ms.
pub fn local_config(bootstrap: &str, landing: &std::path::Path, group: &str) -> sink::SinkConfig {
    let mut config = sink::SinkConfig {
        streams_dir: std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../streams"),
        streams: vec!["sensor_readings".into()],
        store: sink::config::StoreConfig::Local {
            path: landing.to_path_buf(),
        },
        rotation: sink::config::RotationConfig {
            idle_ms: 300,
            ..sink::config::RotationConfig::default()
        },
        ..sink::SinkConfig::default()
    };
    config.kafka.brokers = bootstrap.to_owned();
    config.kafka.group_id = group.to_owned();
    config.upload.staging_dir = landing.join(".staging");
    config
}

/// Readings of the fleet generator's shape (a fifth re-sent), deterministic per seed.
pub fn readings(n: usize, seed: u64) -> Vec<Value> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut out: Vec<Value> = Vec::with_capacity(n);
    while out.len() < n {
        if !out.is_empty() && rng.random_bool(0.2) {
            let back = rng.random_range(1..=out.len().min(300));
            out.push(out[out.len() - back].clone());
            continue;
        }
        let i = out.len();
        out.push(json!({
            "device_id": format!("dev-{:03}", i % 40),
            "sensor": "temperature",
            "ts": 1_767_225_600_000i64 + i as i64,
            "value": rng.random_range(0.0..100.0f64),
            "unit": "degC",
            "quality": 192,
            "tags": {"site": "s1"},
        }));
    }
    out
}

/// Produces readings keyed by device (the partition key), each acknowledged.
pub async fn produce(producer: &FutureProducer, topic: &str, records: &[Value]) {
    for r in records {
        let key = r["device_id"].as_str().unwrap();
        produce_raw(producer, topic, key, &r.to_string()).await;
    }
}

/// Produces one value as it is (a malformed one, say) with `key`, acknowledged.
pub async fn produce_raw(producer: &FutureProducer, topic: &str, key: &str, value: &str) {
    producer
        .send(
            FutureRecord::to(topic).key(key).payload(value),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
}

/// The (partition, offset) of every dead letter in the bucket's `landing/_dead_letters/`, in
/// order, repeats kept.
pub async fn dead_letters(s3: &str, bucket: &str) -> Vec<(i64, i64)> {
    let store = sink::store::ObjectStore::from_config(&s3_store(s3, bucket))
        .await
        .unwrap();
    let mut dead = Vec::new();
    for key in store.list("landing/_dead_letters/").await.unwrap() {
        let data = store.get(&key).await.unwrap().unwrap();
        for line in String::from_utf8(data.to_vec()).unwrap().lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            dead.push((
                v["partition"].as_i64().unwrap(),
                v["offset"].as_i64().unwrap(),
            ));
        }
    }
    dead.sort_unstable();
    dead
}

/// The store settings of `bucket` on the S3 server at `s3` (moto: path-style, us-east-1).
pub fn s3_store(s3: &str, bucket: &str) -> sink::config::StoreConfig {
    sink::config::StoreConfig::S3 {
        bucket: bucket.to_owned(),
        endpoint: Some(s3.to_owned()),
        region: Some("us-east-1".into()),
        force_path_style: true,
        ca_file: None,
        server_side_encryption: None,
        kms_key_id: None,
        storage_class: None,
    }
}

/// Checks `get_range` of `store` on an object of 100,000 bytes it writes: suffixes (one longer
/// than the object), spans (one past its end), and an object that is not there.
pub async fn check_ranges(store: &sink::store::ObjectStore) {
    use sink::store::ByteRange;
    let key = "landing/s/date=2026-01-01/hour=00/s-p0-o00000000000000000042.parquet";
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
    store
        .put_if_absent(key, bytes::Bytes::from(data.clone()))
        .await
        .unwrap();
    for (range, expected) in [
        (ByteRange::Suffix(10), &data[99_990..]),
        (ByteRange::Suffix(200_000), &data[..]),
        (ByteRange::Span(5, 17), &data[5..17]),
        (ByteRange::Span(99_000, 200_000), &data[99_000..]),
    ] {
        let (read, size) = store.get_range(key, range).await.unwrap().unwrap();
        assert_eq!(size, 100_000, "{range:?}");
        assert!(read == expected, "{range:?}: {} bytes", read.len());
    }
    let missing = "landing/s/date=2026-01-01/hour=00/none.parquet";
    let none = store
        .get_range(missing, ByteRange::Suffix(8))
        .await
        .unwrap();
    assert!(none.is_none());
}

/// Whether `group` committed every partition of `topic` up to its high watermark.
pub fn caught_up(bootstrap: &str, group: &str, topic: &str) -> bool {
    let partitions = committed_offsets(bootstrap, group, topic);
    !partitions.is_empty()
        && partitions
            .iter()
            .all(|&(committed, high)| committed.is_some_and(|c| c >= high))
}

/// Per partition of `topic`: the group's committed offset (`None` when it has none) and the
/// high watermark; empty when the broker does not answer.
pub fn committed_offsets(bootstrap: &str, group: &str, topic: &str) -> Vec<(Option<i64>, i64)> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .create()
        .unwrap();
    let Ok(metadata) = consumer.fetch_metadata(Some(topic), Duration::from_secs(5)) else {
        return Vec::new();
    };
    let partitions = metadata
        .topics()
        .first()
        .map_or(0, |t| t.partitions().len()) as i32;
    let mut list = TopicPartitionList::new();
    for p in 0..partitions {
        list.add_partition(topic, p);
    }
    let Ok(committed) = consumer.committed_offsets(list, Duration::from_secs(5)) else {
        return Vec::new();
    };
    (0..partitions)
        .map(|p| {
            let high = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(5))
                .map_or(i64::MAX, |(_, high)| high);
            let committed = match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => Some(o),
                _ => None,
            };
            (committed, high)
        })
        .collect()
}

/// SIGTERM, a graceful stop, and each sink must exit successfully.
pub fn stop_gracefully(sinks: Vec<std::process::Child>) {
    for mut s in sinks {
        std::process::Command::new("kill")
            .arg(s.id().to_string())
            .status()
            .unwrap();
        assert!(s.wait().unwrap().success());
    }
}

/// Waits until the group committed every partition to its end (two minutes at most), checking
/// that no sink exited meanwhile.
pub async fn wait_caught_up(
    bootstrap: &str,
    (group, topic): (&str, &str),
    sinks: &mut [std::process::Child],
    dir: &std::path::Path,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let done = {
            let (bootstrap, group, topic) =
                (bootstrap.to_owned(), group.to_owned(), topic.to_owned());
            tokio::task::spawn_blocking(move || caught_up(&bootstrap, &group, &topic))
                .await
                .unwrap()
        };
        if done {
            return;
        }
        for (i, s) in sinks.iter_mut().enumerate() {
            assert!(
                s.try_wait().unwrap().is_none(),
                "sink {i} exited; logs:\n{}",
                logs_in(dir)
            );
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the sinks did not commit everything; logs in {}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The last lines of every `.log` file in `dir`.
fn logs_in(dir: &std::path::Path) -> String {
    let mut all = String::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            all.push_str(&format!("== {}\n", path.display()));
            for line in &lines[lines.len().saturating_sub(15)..] {
                all.push_str(line);
                all.push('\n');
            }
        }
    }
    all
}
