//! Simulated devices: deterministic sensor readings, with re-sent duplicates like a flaky
//! uplink produces.

use std::collections::VecDeque;

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
    Readings::new(spec).collect()
}

/// How far back a re-sent reading reaches.
const RESEND_REACH: usize = 500;

/// [`sensor_readings`] one at a time, holding only the last few hundred (a fleet of millions of
/// readings is never in memory at once).
pub struct Readings {
    spec: FleetSpec,
    rng: SmallRng,
    values: Vec<f64>,
    recent: VecDeque<Value>,
    step: i64,
    emitted: usize,
}

impl Readings {
    pub fn new(spec: &FleetSpec) -> Readings {
        Readings {
            spec: spec.clone(),
            rng: SmallRng::seed_from_u64(spec.seed),
            values: (0..spec.devices.max(1) * SENSORS.len())
                .map(|i| SENSORS[i % SENSORS.len()].2)
                .collect(),
            recent: VecDeque::with_capacity(RESEND_REACH),
            step: 0,
            emitted: 0,
        }
    }

    fn next_reading(&mut self) -> Value {
        let ratio = self.spec.duplicate_ratio.clamp(0.0, 1.0);
        if !self.recent.is_empty() && self.rng.random_bool(ratio) {
            let back = self.rng.random_range(1..=self.recent.len());
            return self.recent[self.recent.len() - back].clone();
        }
        let slot = (self.step as usize) % self.values.len();
        let device = slot / SENSORS.len();
        let (sensor, unit, _, noise) = SENSORS[slot % SENSORS.len()];
        self.values[slot] += self.rng.random_range(-noise..=noise);
        let value = (self.values[slot] * 1000.0).round() / 1000.0;
        let ts = self.spec.start_ms + self.step * 10;
        self.step += 1;
        json!({
            "device_id": format!("dev-{device:05}"),
            "sensor": sensor,
            "ts": ts,
            "value": value,
            "unit": unit,
            "quality": if self.rng.random_bool(0.99) { 192 } else { 64 },
            "tags": {"site": format!("site-{}", device % 4), "line": format!("{}", device % 7)},
        })
    }
}

impl Iterator for Readings {
    type Item = Value;

    fn next(&mut self) -> Option<Value> {
        if self.emitted == self.spec.records {
            return None;
        }
        let reading = self.next_reading();
        if self.recent.len() == RESEND_REACH {
            self.recent.pop_front();
        }
        self.recent.push_back(reading.clone());
        self.emitted += 1;
        Some(reading)
    }
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
