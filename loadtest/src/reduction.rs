//! `demo --filter`: the demo's agent reduces process-like series (the shapes of
//! [`crate::process`]) with a swinging-door or deadband filter, and the landed rows are checked
//! against the filter's bound: every landed row is a generated reading, landed once; every
//! series keeps its first and last reading; its reconstruction from the landed rows (linear
//! interpolation for swinging door, sample-and-hold for deadband) is within the band at every
//! generated reading; and no two kept readings with a reading between them are further apart
//! than `max_silence_secs`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use anyhow::Context;
use schemas::{ContentHash, StreamDef};
use serde_json::Value;

use crate::fleet::FleetSpec;
use crate::process::{Reconstruction, Shape, fidelity, readings, series};
use crate::verify::{Landed, Verdict};

/// The filter the demo's agent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FilterKind {
    SwingingDoor,
    Deadband,
}

impl FilterKind {
    /// Its `type` in the agent's config.
    pub fn name(self) -> &'static str {
        match self {
            FilterKind::SwingingDoor => "swinging_door",
            FilterKind::Deadband => "deadband",
        }
    }

    fn reconstruction(self) -> Reconstruction {
        match self {
            FilterKind::SwingingDoor => Reconstruction::Linear,
            FilterKind::Deadband => Reconstruction::Hold,
        }
    }
}

/// `demo --filter`: which filter, its band as a percentage of the instrument's range
/// ([`crate::process::RANGE`]) and its longest silence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DemoFilter {
    pub kind: FilterKind,
    pub percent: f64,
    pub max_silence_secs: u64,
}

/// The most readings a `demo --filter` takes: they are fed to the agent at once (not as the
/// sink keeps up), and a deadband on noisy shapes keeps most of them, which the mock cluster
/// must hold.
pub const MAX_FILTER_RECORDS: usize = 200_000;

impl DemoFilter {
    /// The band in the readings' unit.
    pub fn band(&self) -> f64 {
        let [low, high] = crate::process::RANGE;
        (high - low) * self.percent / 100.0
    }

    /// The filter's section of the agent's config.
    pub fn toml(&self) -> String {
        let [low, high] = crate::process::RANGE;
        // Deadband sends the last suppressed reading before a step, so that sample-and-hold
        // stays within the band up to the step.
        let previous = match self.kind {
            FilterKind::Deadband => "send_previous = true\n",
            FilterKind::SwingingDoor => "",
        };
        format!(
            "[[streams.sensor_readings.filters]]\ntype = \"{}\"\nfield = \"value\"\n\
             percent = {}\nrange = [{low:?}, {high:?}]\nmax_silence_secs = {}\n{previous}",
            self.kind.name(),
            self.percent,
            self.max_silence_secs
        )
    }
}

/// The generated readings of a `demo --filter`: device `proc-NNNN` follows shape
/// [`Shape::ALL`]`[N % 8]`, a reading a second, the devices' readings interleaved in time.
pub struct ProcessFleet {
    pub readings: Vec<Value>,
    /// Each device's series, (event time in ms, value), in time order.
    pub series: BTreeMap<String, Vec<(i64, f64)>>,
    /// Which device and reading each content hash is.
    by_hash: HashMap<ContentHash, (String, usize)>,
}

impl ProcessFleet {
    /// `spec.records` readings over `spec.devices` devices (re-sent duplicates are not made:
    /// the filter's bound is about the series as measured).
    pub fn generate(spec: &FleetSpec, def: &StreamDef) -> anyhow::Result<ProcessFleet> {
        let devices = spec.devices.max(1);
        let per_device = spec.records.div_ceil(devices);
        let mut all = BTreeMap::new();
        for d in 0..devices {
            let shape = Shape::ALL[d % Shape::ALL.len()];
            let n = spec.records / devices + usize::from(d < spec.records % devices);
            all.insert(
                format!("proc-{d:04}"),
                series(shape, n, spec.start_ms, spec.seed.wrapping_add(d as u64)),
            );
        }
        let mut readings_out = Vec::with_capacity(spec.records);
        let mut by_hash = HashMap::with_capacity(spec.records);
        // The devices' readings interleaved: each device's i-th, then their (i + 1)-th.
        let mut queues: Vec<(&String, std::vec::IntoIter<Value>)> = all
            .iter()
            .map(|(device, s)| (device, readings(device, s).into_iter()))
            .collect();
        for i in 0..per_device {
            for (device, queue) in &mut queues {
                if let Some(reading) = queue.next() {
                    let hash = schemas::check(def, reading.clone())
                        .context("a generated reading does not fit the stream")?
                        .hash;
                    by_hash.insert(hash, ((*device).clone(), i));
                    readings_out.push(reading);
                }
            }
        }
        Ok(ProcessFleet {
            readings: readings_out,
            series: all,
            by_hash,
        })
    }

    /// The distinct content hashes of the readings.
    pub fn distinct(&self) -> HashSet<ContentHash> {
        self.by_hash.keys().copied().collect()
    }

    /// The readings as NDJSON.
    pub fn ndjson(&self) -> Vec<u8> {
        crate::fleet::to_ndjson(&self.readings)
    }
}

/// What a `demo --filter` found in the landing zone.
#[derive(Debug, Clone)]
pub struct FilterReport {
    pub filter: DemoFilter,
    pub generated: usize,
    pub series: usize,
    /// What the agent reported: readings in, kept, and its largest deviation.
    pub agent_in: u64,
    pub agent_kept: u64,
    pub agent_max_deviation: Option<f64>,
    /// Distinct landed rows, and the largest reconstruction error and gap between kept
    /// readings measured from them.
    pub landed: usize,
    pub max_error: f64,
    pub max_gap_ms: i64,
    /// Series that break the bound, with why.
    pub failures: Vec<String>,
}

impl FilterReport {
    pub fn holds(&self) -> bool {
        self.failures.is_empty()
    }
}

/// Checks `landed` against `fleet` and the filter's bound; the verdict counts rows landed more
/// than once, rows that are no generated reading, and readings the agent delivered that did
/// not land (`missing`).
pub fn check(
    fleet: &ProcessFleet,
    landed: &Landed,
    filter: DemoFilter,
    agent: &edge_agent::StreamStats,
) -> (Verdict, FilterReport) {
    let mut kept: BTreeMap<&str, Vec<(i64, f64)>> = BTreeMap::new();
    let mut unexpected = 0;
    for hash in landed.hashes.keys() {
        match fleet.by_hash.get(hash) {
            Some((device, i)) => kept
                .entry(device.as_str())
                .or_default()
                .push(fleet.series[device][*i]),
            None => unexpected += 1,
        }
    }
    let band = filter.band();
    let mut report = FilterReport {
        filter,
        generated: fleet.readings.len(),
        series: fleet.series.values().filter(|s| !s.is_empty()).count(),
        agent_in: 0,
        agent_kept: 0,
        agent_max_deviation: None,
        landed: landed.hashes.len(),
        max_error: 0.0,
        max_gap_ms: 0,
        failures: Vec::new(),
    };
    if let Some(r) = agent.pipeline.reductions.first() {
        report.agent_in = r.readings_in;
        report.agent_kept = r.kept;
        report.agent_max_deviation = r.max_deviation;
    }
    for (device, input) in fleet.series.iter().filter(|(_, s)| !s.is_empty()) {
        let mut rows = kept.remove(device.as_str()).unwrap_or_default();
        rows.sort_by_key(|r| r.0);
        match fidelity(input, &rows, filter.kind.reconstruction()) {
            Ok(f) => {
                report.max_error = report.max_error.max(f.max_error);
                report.max_gap_ms = report.max_gap_ms.max(f.max_gap_ms);
                if f.max_error > band + 1e-9 {
                    report.failures.push(format!(
                        "{device}: a reading {} from its reconstruction, past the band {band}",
                        f.max_error
                    ));
                }
                if f.max_gap_ms > filter.max_silence_secs as i64 * 1_000 {
                    report.failures.push(format!(
                        "{device}: {} s between kept readings, past max_silence_secs {}",
                        f.max_gap_ms / 1_000,
                        filter.max_silence_secs
                    ));
                }
            }
            Err(e) => report.failures.push(format!("{device}: {e}")),
        }
    }
    let verdict = Verdict {
        missing: (agent.delivery.accepted as usize).saturating_sub(landed.hashes.len()),
        duplicated: landed.hashes.values().filter(|c| c.count > 1).count(),
        unexpected,
    };
    (verdict, report)
}

impl fmt::Display for FilterReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let band = self.filter.band();
        let share = |n: u64| 100.0 * n as f64 / self.agent_in.max(1) as f64;
        writeln!(
            f,
            "  filter               {} with a band of {band} ({}% of the range), max_silence_secs {}",
            self.filter.kind.name(),
            self.filter.percent,
            self.filter.max_silence_secs
        )?;
        writeln!(
            f,
            "  reduction            {} readings in, {} kept ({:.1}%) over {} series; largest deviation {} (agent's report)",
            self.agent_in,
            self.agent_kept,
            share(self.agent_kept),
            self.series,
            self.agent_max_deviation
                .map_or("-".to_owned(), |d| format!("{d:.4}"))
        )?;
        if self.holds() {
            write!(
                f,
                "  bound checked        from the {} landed rows: every series within {:.4} of all {} readings (band {band}), first and last kept, at most {} s between kept readings",
                self.landed,
                self.max_error,
                self.generated,
                self.max_gap_ms / 1_000
            )
        } else {
            write!(
                f,
                "  BOUND BROKEN         {} series:\n    {}",
                self.failures.len(),
                self.failures.join("\n    ")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::Copies;

    fn landed_of(fleet: &ProcessFleet, keep: impl Fn(&str, usize) -> bool) -> Landed {
        let mut landed = Landed::default();
        for (hash, (device, i)) in &fleet.by_hash {
            if keep(device, *i) {
                landed.hashes.insert(
                    *hash,
                    Copies {
                        count: 1,
                        landed_ms: None,
                    },
                );
            }
        }
        landed.rows = landed.hashes.len();
        landed
    }

    /// The check passes on every reading landed, and fails when a series lands only its
    /// first and last reading (far past the band in between) or twice.
    #[test]
    fn the_bound_is_checked_on_what_landed() {
        let streams = schemas::example_streams();
        let def = streams.get("sensor_readings").unwrap();
        let spec = FleetSpec {
            devices: 8,
            records: 4_000,
            ..FleetSpec::default()
        };
        let fleet = ProcessFleet::generate(&spec, def).unwrap();
        assert_eq!(fleet.readings.len(), 4_000);
        assert_eq!(fleet.series.len(), 8);
        let filter = DemoFilter {
            kind: FilterKind::SwingingDoor,
            percent: 0.5,
            max_silence_secs: 300,
        };
        let mut stats = edge_agent::StreamStats::default();
        stats.delivery.accepted = 4_000;
        let (verdict, report) = check(&fleet, &landed_of(&fleet, |_, _| true), filter, &stats);
        assert!(verdict.exactly_once() && report.holds(), "{report}");
        assert_eq!(report.max_error, 0.0);

        let ends = |device: &str, i: usize| {
            device != "proc-0002" || i == 0 || i == fleet.series[device].len() - 1
        };
        let (_, report) = check(&fleet, &landed_of(&fleet, ends), filter, &stats);
        assert!(!report.holds());
        assert!(report.failures[0].starts_with("proc-0002:"), "{report}");

        let mut twice = landed_of(&fleet, |_, _| true);
        twice.hashes.values_mut().next().unwrap().count = 2;
        let (verdict, _) = check(&fleet, &twice, filter, &stats);
        assert_eq!(verdict.duplicated, 1);
    }
}
