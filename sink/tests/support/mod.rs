//! Test data shared by the sink's tests.

#![allow(dead_code)]

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};

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
        let key = r["device_id"].as_str().unwrap().to_owned();
        let value = r.to_string();
        producer
            .send(
                FutureRecord::to(topic).key(&key).payload(&value),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
    }
}
