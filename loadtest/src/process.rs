//! Process-like series, the shapes plant signals take, for the agent's filters: the benchmark
//! of swinging door against deadband and the end-to-end check of their error bounds. Values lie
//! in [`RANGE`]; the noise on each shape (±[`NOISE`]) stays below a band of 0.5% of it.
//!
//! | shape | what it is |
//! |---|---|
//! | `ramp` | up and down between 20 and 80, 600 s each way |
//! | `drift` | 50 ± 10, one slow swing over about five hours |
//! | `oscillation` | 50 ± 20, a period of 300 s |
//! | `step` | a level held for 100 to 400 s, then a jump to another |
//! | `random_walk` | steps of up to ±0.15 a reading, no noise on top |
//! | `spike` | a drift with a one-reading spike of +30 about every 250 readings |
//! | `stuck` | 42, always |
//! | `gappy` | the oscillation, with 600 s of silence after every 1,000 readings |

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// The instrument's range: a band of 0.5% of it is 0.5.
pub const RANGE: [f64; 2] = [0.0, 100.0];

/// The noise on every shape but the random walk: uniform in ±NOISE.
pub const NOISE: f64 = 0.1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Ramp,
    Drift,
    Oscillation,
    Step,
    RandomWalk,
    Spike,
    Stuck,
    Gappy,
}

impl Shape {
    /// The shapes the benchmark compares swinging door and deadband on.
    pub const BENCHMARK: [Shape; 5] = [
        Shape::Ramp,
        Shape::Drift,
        Shape::Oscillation,
        Shape::Step,
        Shape::RandomWalk,
    ];

    /// Every shape, for the end-to-end check.
    pub const ALL: [Shape; 8] = [
        Shape::Ramp,
        Shape::Drift,
        Shape::Oscillation,
        Shape::Step,
        Shape::RandomWalk,
        Shape::Spike,
        Shape::Stuck,
        Shape::Gappy,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Shape::Ramp => "ramp",
            Shape::Drift => "drift",
            Shape::Oscillation => "oscillation",
            Shape::Step => "step",
            Shape::RandomWalk => "random_walk",
            Shape::Spike => "spike",
            Shape::Stuck => "stuck",
            Shape::Gappy => "gappy",
        }
    }
}

/// `n` readings of `shape` as (event time in ms, value), one a second from `start_ms` (with
/// silences for `gappy`).
pub fn series(shape: Shape, n: usize, start_ms: i64, seed: u64) -> Vec<(i64, f64)> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(n);
    let (mut t, mut level, mut walk, mut next_step) = (start_ms, 50.0f64, 50.0f64, 0usize);
    let tau = std::f64::consts::TAU;
    for i in 0..n {
        let x = i as f64;
        let noise = rng.random_range(-NOISE..=NOISE);
        let value = match shape {
            Shape::Ramp => {
                let phase = (x / 600.0) % 2.0;
                20.0 + 60.0 * if phase < 1.0 { phase } else { 2.0 - phase } + noise
            }
            Shape::Drift => 50.0 + 10.0 * (x / 3_000.0).sin() + noise,
            Shape::Oscillation | Shape::Gappy => 50.0 + 20.0 * (tau * x / 300.0).sin() + noise,
            Shape::Step => {
                if i == next_step {
                    level = rng.random_range(10.0..90.0);
                    next_step = i + rng.random_range(100..400);
                }
                level + noise
            }
            Shape::RandomWalk => {
                walk = (walk + rng.random_range(-0.15..=0.15)).clamp(RANGE[0], RANGE[1]);
                walk
            }
            Shape::Spike => {
                let base = 40.0 + 5.0 * (x / 2_000.0).sin() + noise;
                if rng.random_range(0..250) == 0 {
                    base + 30.0
                } else {
                    base
                }
            }
            Shape::Stuck => 42.0,
        };
        out.push((t, (value * 1000.0).round() / 1000.0));
        t += 1_000;
        if shape == Shape::Gappy && i % 1_000 == 999 {
            t += 600_000;
        }
    }
    out
}

/// A series as sensor readings of `device` (sensor `process`, unit `%`).
pub fn readings(device: &str, series: &[(i64, f64)]) -> Vec<Value> {
    series
        .iter()
        .map(|&(ts, value)| {
            json!({"device_id": device, "sensor": "process", "ts": ts, "value": value, "unit": "%"})
        })
        .collect()
}

/// How `kept` (a subsequence of `input`, both in time order) stands for `input`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fidelity {
    /// The largest distance of an input reading from its reconstruction.
    pub max_error: f64,
    /// The longest time between consecutive kept readings with an input reading between them.
    pub max_gap_ms: i64,
}

/// How a series is rebuilt from its kept readings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reconstruction {
    /// The last kept reading at or before (deadband).
    Hold,
    /// The line between the kept readings around (swinging door).
    Linear,
}

/// Checks that `kept` is a subsequence of `input` holding its first and last reading, and
/// measures the reconstruction's error at every input reading.
pub fn fidelity(
    input: &[(i64, f64)],
    kept: &[(i64, f64)],
    how: Reconstruction,
) -> Result<Fidelity, String> {
    if kept.first() != input.first() || kept.last() != input.last() {
        return Err(format!(
            "first or last reading not kept: input {:?}..{:?}, kept {:?}..{:?}",
            input.first(),
            input.last(),
            kept.first(),
            kept.last()
        ));
    }
    let mut max_error: f64 = 0.0;
    let mut max_gap_ms = 0;
    let mut k = 0;
    for &(t, v) in input {
        while k + 1 < kept.len() && kept[k + 1].0 <= t {
            k += 1;
        }
        let (a, b) = (kept[k], kept.get(k + 1).copied());
        if a.0 == t {
            if a.1 != v {
                return Err(format!(
                    "kept reading at {t} is {} where the input had {v}",
                    a.1
                ));
            }
            continue;
        }
        let rebuilt = match (how, b) {
            (Reconstruction::Hold, _) | (Reconstruction::Linear, None) => a.1,
            (Reconstruction::Linear, Some(b)) => {
                a.1 + (b.1 - a.1) * (t - a.0) as f64 / (b.0 - a.0) as f64
            }
        };
        max_error = max_error.max((v - rebuilt).abs());
        if let Some(b) = b {
            max_gap_ms = max_gap_ms.max(b.0 - a.0);
        }
    }
    if kept
        .iter()
        .any(|k| input.binary_search_by_key(&k.0, |r| r.0).is_err())
    {
        return Err("a kept reading that is not in the input".into());
    }
    Ok(Fidelity {
        max_error,
        max_gap_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_stay_in_range_and_a_second_apart() {
        for shape in Shape::ALL {
            let s = series(shape, 3_000, 0, 1);
            assert!(
                s.iter().all(|&(_, v)| (RANGE[0]..=RANGE[1]).contains(&v)),
                "{shape:?}"
            );
            assert!(s.windows(2).all(|w| w[1].0 - w[0].0 >= 1_000), "{shape:?}");
        }
        let gappy = series(Shape::Gappy, 2_000, 0, 1);
        assert_eq!(gappy[1_000].0 - gappy[999].0, 601_000);
    }

    #[test]
    fn fidelity_measures_both_reconstructions() {
        let input = [(0, 0.0), (1_000, 1.0), (2_000, 3.0), (3_000, 3.0)];
        let kept = [(0, 0.0), (2_000, 3.0), (3_000, 3.0)];
        let linear = fidelity(&input, &kept, Reconstruction::Linear).unwrap();
        assert_eq!((linear.max_error, linear.max_gap_ms), (0.5, 2_000));
        let hold = fidelity(&input, &kept, Reconstruction::Hold).unwrap();
        assert_eq!(hold.max_error, 1.0);
        assert!(fidelity(&input, &kept[..2], Reconstruction::Hold).is_err());
    }
}
