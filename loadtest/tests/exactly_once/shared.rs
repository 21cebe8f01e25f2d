//! Helpers more than one group of tests uses.

use super::*;

/// The offset `group` committed on partition `partition` of the sensor topic, if any.
pub(crate) fn committed(
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

pub(crate) fn now_micros() -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.unwrap().as_micros() as i64
}

/// Sends `readings` (the `first`th on) to partition 0, each fourth followed by an undecodable
/// value whose offset goes into `garbage`.
pub(crate) async fn send_with_garbage(
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

/// Waits for the next hour when less than `margin` of this one is left.
pub(crate) async fn clear_of_an_hour_boundary(margin: Duration) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let left = Duration::from_secs(3600 - now.as_secs() % 3600);
    if left < margin {
        tokio::time::sleep(left + Duration::from_secs(1)).await;
    }
}

pub(crate) fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
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

/// Every stream of the repository's examples.
pub(crate) fn example_defs() -> Vec<std::sync::Arc<schemas::StreamDef>> {
    schemas::example_streams().iter().cloned().collect()
}
