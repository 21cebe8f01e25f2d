//! Simulated devices: deterministic sensor readings, with re-sent duplicates like a flaky
//! uplink produces.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

const SENSORS: &[(&str, &str, f64, f64)] = &[
    ("temperature", "degC", 21.0, 0.2),
    ("pressure", "bar", 4.2, 0.01),
    ("vibration", "mm/s", 1.5, 0.05),
    ("rpm", "rpm", 1450.0, 3.0),
];

/// Parameters of a simulated fleet.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    pub devices: usize,
    /// Readings to produce, duplicates included.
    pub records: usize,
    /// Fraction of the output that re-sends an earlier reading (0.0..1.0).
    pub duplicate_ratio: f64,
    pub seed: u64,
    /// Event time of the first reading, epoch milliseconds.
    pub start_ms: i64,
}

impl Default for FleetSpec {
    fn default() -> Self {
        FleetSpec {
            devices: 50,
            records: 5_000,
            duplicate_ratio: 0.2,
            seed: 42,
            start_ms: 1_767_225_600_000, // 2026-01-01T00:00:00Z
        }
    }
}

/// Generates `spec.records` readings as JSON objects; about `duplicate_ratio` of them repeat an
/// earlier reading exactly.
pub fn sensor_readings(spec: &FleetSpec) -> Vec<Value> {
    let mut rng = SmallRng::seed_from_u64(spec.seed);
    let mut values: Vec<f64> = (0..spec.devices * SENSORS.len())
        .map(|i| SENSORS[i % SENSORS.len()].2)
        .collect();
    let mut out: Vec<Value> = Vec::with_capacity(spec.records);
    let mut step = 0i64;
    while out.len() < spec.records {
        if !out.is_empty() && rng.random_bool(spec.duplicate_ratio.clamp(0.0, 1.0)) {
            let back = rng.random_range(1..=out.len().min(500));
            out.push(out[out.len() - back].clone());
            continue;
        }
        let slot = (step as usize) % values.len();
        let device = slot / SENSORS.len();
        let (sensor, unit, _, noise) = SENSORS[slot % SENSORS.len()];
        values[slot] += rng.random_range(-noise..=noise);
        let value = (values[slot] * 1000.0).round() / 1000.0;
        let ts = spec.start_ms + step * 10;
        out.push(json!({
            "device_id": format!("dev-{device:05}"),
            "sensor": sensor,
            "ts": ts,
            "value": value,
            "unit": unit,
            "quality": if rng.random_bool(0.99) { 192 } else { 64 },
            "tags": {"site": format!("site-{}", device % 4), "line": format!("{}", device % 7)},
        }));
        step += 1;
    }
    out
}

/// The same readings as NDJSON text.
pub fn to_ndjson(records: &[Value]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in records {
        out.extend_from_slice(r.to_string().as_bytes());
        out.push(b'\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_with_the_requested_duplicates() {
        let spec = FleetSpec {
            records: 2_000,
            ..FleetSpec::default()
        };
        let a = sensor_readings(&spec);
        assert_eq!(a, sensor_readings(&spec));
        assert_eq!(a.len(), 2_000);
        let unique: std::collections::HashSet<String> = a.iter().map(|v| v.to_string()).collect();
        let dup = 1.0 - unique.len() as f64 / a.len() as f64;
        assert!((0.15..0.25).contains(&dup), "duplicate ratio {dup}");
        let def = schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone();
        assert!(a.iter().all(|r| schemas::check(&def, r.clone()).is_ok()));
    }
}
