use serde_json::json;

use super::*;

fn def() -> std::sync::Arc<StreamDef> {
    schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone()
}

/// A reading of `sensor` on device d1 at second `sec` with `value`.
fn reading(sensor: &str, sec: i64, value: f64) -> Record {
    let json = json!({"device_id": "d1", "sensor": sensor, "ts": sec * 1000, "value": value, "quality": 192});
    schemas::validate(&def(), json).unwrap()
}

/// A reading of sensor `t` on device d1 at second `sec`, value 1.0, with this quality.
fn with_quality(sec: i64, quality: i64) -> Record {
    let json = json!({"device_id": "d1", "sensor": "t", "ts": sec * 1000, "value": 1.0, "quality": quality});
    schemas::validate(&def(), json).unwrap()
}

/// The event times of `out`, in seconds.
fn seconds(out: &[Record]) -> Vec<i64> {
    out.iter()
        .map(|r| r.event_time(&def()) / 1_000_000)
        .collect()
}

/// The chain fed records, giving records, as most tests use it.
trait OnRecords {
    fn apply_record(&mut self, def: &StreamDef, record: Record, out: &mut Vec<Record>);
    fn flush_records(&mut self, def: &StreamDef, all: bool, out: &mut Vec<Record>);
}

fn records(kept: Vec<Kept>) -> impl Iterator<Item = Record> {
    kept.into_iter().map(|k| match k {
        Kept::Record(r) => r,
        Kept::Line(text) => panic!("records in, a line out: {}", String::from_utf8_lossy(&text)),
    })
}

impl OnRecords for FilterChain {
    fn apply_record(&mut self, def: &StreamDef, record: Record, out: &mut Vec<Record>) {
        let mut kept = Vec::new();
        self.apply(def, Reading::record(record), &mut kept);
        out.extend(records(kept));
    }

    fn flush_records(&mut self, def: &StreamDef, all: bool, out: &mut Vec<Record>) {
        let mut kept = Vec::new();
        self.flush(def, all, &mut kept);
        out.extend(records(kept));
    }
}

fn chain(config: serde_json::Value) -> FilterChain {
    let config: FilterConfig = serde_json::from_value(config).unwrap();
    FilterChain::new(&def(), &[config]).unwrap()
}

/// Feeds (sensor, second, value) readings; returns what passed as (second, value).
fn run(chain: &mut FilterChain, input: &[(&str, i64, f64)], flush: bool) -> Vec<(i64, f64)> {
    let d = def();
    let mut out = Vec::new();
    for &(s, sec, v) in input {
        chain.apply_record(&d, reading(s, sec, v), &mut out);
    }
    if flush {
        chain.flush_records(&d, true, &mut out);
    }
    out.iter()
        .map(|r| {
            let Value::Float(v) = r.values[3] else {
                panic!()
            };
            (r.event_time(&d) / 1_000_000, v)
        })
        .collect()
}

fn dropped(chain: &mut FilterChain) -> u64 {
    chain.take_dropped().iter().map(|(_, n)| n).sum()
}

/// The error `edge-agent check` gives for this filter config.
fn bad(config: serde_json::Value) -> String {
    serde_json::from_value::<FilterConfig>(config)
        .unwrap()
        .check(&def())
        .unwrap_err()
}

#[test]
fn deadband_absolute_sends_only_changes_beyond_the_band() {
    let mut c = chain(
        json!({"type": "deadband", "field": "value", "absolute": 0.5, "send_previous": false}),
    );
    let input = [
        ("t", 0, 10.0),
        ("t", 1, 10.2),
        ("t", 2, 10.5),
        ("t", 3, 10.6),
        ("t", 4, 9.9),
        ("t", 5, 9.95),
    ];
    // 10.5 is exactly on the band: not a change. 10.6 breaks it; 9.9 breaks 10.6's band. The
    // last reading is sent when the agent stops.
    assert_eq!(
        run(&mut c, &input, true),
        [(0, 10.0), (3, 10.6), (4, 9.9), (5, 9.95)]
    );
    assert_eq!(dropped(&mut c), 2);
}

#[test]
fn deadband_sends_the_previous_value_when_the_band_breaks() {
    let mut c = chain(json!({"type": "deadband", "field": "value", "absolute": 1.0}));
    let input = [
        ("t", 0, 20.0),
        ("t", 1, 20.3),
        ("t", 2, 20.6),
        ("t", 3, 25.0),
        ("t", 4, 25.1),
    ];
    // The step from 20.6 (held) to 25.0 keeps its corner: 20.6 is sent just before 25.0, and
    // 25.1, held at the end, when the agent stops.
    assert_eq!(
        run(&mut c, &input, true),
        [(0, 20.0), (2, 20.6), (3, 25.0), (4, 25.1)]
    );
    // 20.3 replaced by 20.6.
    assert_eq!(dropped(&mut c), 1);
}

#[test]
fn deadband_percent_of_range_per_series() {
    // 2 % of 0..200 = 4.
    let mut c = chain(
        json!({"type": "deadband", "field": "value", "percent": 2.0, "range": [0.0, 200.0], "send_previous": false}),
    );
    let input = [
        ("a", 0, 100.0),
        ("b", 0, 100.0),
        ("a", 1, 103.9),
        ("b", 1, 104.1),
        ("a", 2, 95.9),
    ];
    assert_eq!(
        run(&mut c, &input, false),
        [(0, 100.0), (0, 100.0), (1, 104.1), (2, 95.9)]
    );
}

#[test]
fn deadband_percent_of_a_range_that_does_not_start_at_zero() {
    // 1 % of 100..300 = 2.
    let mut c = chain(
        json!({"type": "deadband", "field": "value", "percent": 1.0, "range": [100.0, 300.0], "send_previous": false}),
    );
    let input = [("t", 0, 200.0), ("t", 1, 201.9), ("t", 2, 202.1)];
    assert_eq!(run(&mut c, &input, false), [(0, 200.0), (2, 202.1)]);
}

#[test]
fn deadband_series_are_device_and_sensor_by_default() {
    // Readings of one sensor with another quality or unit are the same series: only the
    // partition key and the other required string fields (`sensor`) tell series apart.
    let d = def();
    let mut c = chain(
        json!({"type": "deadband", "field": "value", "absolute": 1.0, "send_previous": false}),
    );
    let mut out = Vec::new();
    for (sec, quality, unit) in [(0, 192, "degC"), (1, 0, "degF"), (2, 64, "degC")] {
        let json = json!({"device_id": "d1", "sensor": "t", "ts": sec * 1000, "value": 20.0, "quality": quality, "unit": unit});
        c.apply_record(&d, schemas::validate(&d, json).unwrap(), &mut out);
    }
    assert_eq!(out.len(), 1);
    // Another device is another series.
    let json = json!({"device_id": "d2", "sensor": "t", "ts": 3000, "value": 20.0});
    c.apply_record(&d, schemas::validate(&d, json).unwrap(), &mut out);
    assert_eq!(out.len(), 2);
}

#[test]
fn deadband_keeps_the_held_reading_across_periodic_flushes() {
    // The pipeline flushes the filters without `all` as batches close; a held reading must
    // survive that to be sent as the corner of a later step.
    let d = def();
    let mut c = chain(json!({"type": "deadband", "field": "value", "absolute": 1.0}));
    let mut out = Vec::new();
    c.apply_record(&d, reading("t", 0, 20.0), &mut out);
    c.apply_record(&d, reading("t", 1, 20.5), &mut out);
    c.flush_records(&d, false, &mut out);
    c.apply_record(&d, reading("t", 2, 25.0), &mut out);
    assert_eq!(seconds(&out), [0, 1, 2]);
    assert_eq!(dropped(&mut c), 0);
}

#[test]
fn deadband_heartbeat_after_max_silence() {
    let mut c = chain(
        json!({"type": "deadband", "field": "value", "absolute": 5.0, "max_silence_secs": 60}),
    );
    let input: Vec<(&str, i64, f64)> = (0..=130).step_by(10).map(|s| ("t", s, 1.0)).collect();
    // A constant signal: one reading at 0, then one every 60 s of silence. Heartbeats do not
    // send the held reading (nothing changed); the last one is sent when the agent stops.
    assert_eq!(
        run(&mut c, &input, true),
        [(0, 1.0), (60, 1.0), (120, 1.0), (130, 1.0)]
    );
    assert_eq!(dropped(&mut c), 10);
}

#[test]
fn deadband_config_errors() {
    assert!(bad(json!({"type": "deadband", "field": "value"})).contains("exactly one"));
    assert!(bad(json!({"type": "deadband", "field": "value", "percent": 1.0})).contains("range"));
    assert!(
        bad(json!({"type": "deadband", "field": "unit", "absolute": 1.0}))
            .contains("not int64 or float64")
    );
    assert!(
        bad(json!({"type": "deadband", "field": "nope", "absolute": 1.0}))
            .contains("no field 'nope'")
    );
    // Negative bands and empty ranges.
    assert!(bad(json!({"type": "deadband", "field": "value", "absolute": -1.0})).contains("≥ 0"));
    for range in [[10.0, 10.0], [10.0, 0.0]] {
        assert!(
            bad(json!({"type": "deadband", "field": "value", "percent": 1.0, "range": range}))
                .contains("low < high")
        );
    }
    assert!(
        bad(json!({"type": "deadband", "field": "value", "percent": -1.0, "range": [0.0, 1.0]}))
            .contains("low < high")
    );
    for filter in [
        json!({"type": "deadband", "field": "value", "absolute": 1.0, "max_series": 0}),
        json!({"type": "downsample", "every": 2, "max_series": 0}),
    ] {
        assert!(bad(filter).contains("max_series must be at least 1"));
    }
    // Downsampling by nothing.
    assert!(bad(json!({"type": "downsample", "every": 0})).contains("downsample"));
    assert!(
        bad(json!({"type": "downsample", "window_secs": 0, "aggregate": "max", "field": "value"}))
            .contains("downsample")
    );
}

#[test]
fn predicates() {
    let d = def();
    let keep = |v: serde_json::Value, r: Record| {
        let mut c = chain(v);
        let mut out = Vec::new();
        c.apply_record(&d, r, &mut out);
        out.len() == 1
    };
    let r = reading("temp", 0, 21.5);
    assert!(keep(
        json!({"type": "predicate", "field": "value", "op": "gt", "value": 20}),
        r.clone()
    ));
    assert!(!keep(
        json!({"type": "predicate", "field": "value", "op": "lt", "value": 20}),
        r.clone()
    ));
    assert!(keep(
        json!({"type": "predicate", "field": "quality", "op": "eq", "value": 192}),
        r.clone()
    ));
    assert!(keep(
        json!({"type": "predicate", "field": "sensor", "op": "in", "value": ["temp", "rpm"]}),
        r.clone()
    ));
    assert!(!keep(
        json!({"type": "predicate", "field": "sensor", "op": "not_in", "value": ["temp"]}),
        r.clone()
    ));
    // `unit` is missing: only ne and not_in hold.
    assert!(!keep(
        json!({"type": "predicate", "field": "unit", "op": "eq", "value": "degC"}),
        r.clone()
    ));
    assert!(keep(
        json!({"type": "predicate", "field": "unit", "op": "ne", "value": "degC"}),
        r.clone()
    ));
    // An int64 field against any number.
    assert!(keep(
        json!({"type": "predicate", "field": "quality", "op": "gt", "value": 191.5}),
        r.clone()
    ));
    // A timestamp literal is read as the records' timestamps are: epoch milliseconds (as the
    // reading's `ts` is written), microseconds or RFC 3339. This reading is at 1970-01-01T00:00:01.
    let r = reading("temp", 1, 21.5);
    for (op, value, kept) in [
        ("eq", json!(1000), true),
        ("lt", json!(1001), true),
        ("gt", json!(999), true),
        ("ge", json!(1001), false),
        // 10^14 and more are microseconds: 100,000,000 s after the epoch.
        ("lt", json!(100_000_000_000_000i64), true),
        ("eq", json!("1970-01-01T00:00:01Z"), true),
        ("gt", json!("1970-01-01T00:00:00.999999Z"), true),
        ("in", json!(["1970-01-01T00:00:02Z", 1000]), true),
        ("not_in", json!(["1970-01-01T00:00:01Z"]), false),
    ] {
        assert_eq!(
            keep(
                json!({"type": "predicate", "field": "ts", "op": op, "value": value}),
                r.clone()
            ),
            kept,
            "ts {op} {value}"
        );
    }
}

#[test]
fn predicate_on_a_bool_field() {
    let d = schemas::example_streams()
        .get("vehicle_telemetry")
        .unwrap()
        .clone();
    let record = |ignition: bool| {
        let json = json!({"vehicle_id": "v1", "recorded_at": 0, "lat": 0.0, "lon": 0.0, "ignition": ignition});
        schemas::validate(&d, json).unwrap()
    };
    let config: FilterConfig = serde_json::from_value(
        json!({"type": "predicate", "field": "ignition", "op": "eq", "value": true}),
    )
    .unwrap();
    let mut c = FilterChain::new(&d, &[config]).unwrap();
    let mut out = Vec::new();
    for ignition in [true, false, true] {
        c.apply_record(&d, record(ignition), &mut out);
    }
    assert_eq!(out.len(), 2);
    assert_eq!(c.take_dropped(), [("predicate", 1)]);
    // A list field cannot be compared.
    let config: FilterConfig = serde_json::from_value(
        json!({"type": "predicate", "field": "fault_codes", "op": "eq", "value": "P0001"}),
    )
    .unwrap();
    assert!(config.check(&d).unwrap_err().contains("is not a value of"));
}

#[test]
fn predicate_literals_the_field_cannot_hold_are_config_errors() {
    // Before, these compared unequal to every record: `sensor eq 1` dropped everything and
    // `sensor ne 1` nothing, silently.
    for v in [
        json!({"type": "predicate", "field": "sensor", "op": "eq", "value": 1}),
        json!({"type": "predicate", "field": "value", "op": "gt", "value": "20"}),
        json!({"type": "predicate", "field": "ts", "op": "gt", "value": "yesterday"}),
        json!({"type": "predicate", "field": "sensor", "op": "in", "value": ["temp", 2]}),
    ] {
        assert!(bad(v.clone()).contains("is not a value of"), "{v}");
    }
    assert!(
        bad(json!({"type": "predicate", "field": "sensor", "op": "not_in", "value": "temp"}))
            .contains("'sensor' not_in: value must be a list")
    );
    assert_eq!(
        bad(json!({"type": "predicate", "field": "sensor", "op": "eq", "value": 1})),
        "'sensor' eq: 1 is not a value of string"
    );
    assert!(
        bad(json!({"type": "predicate", "field": "nope", "op": "eq", "value": 1}))
            .contains("no field 'nope'")
    );
}

#[test]
fn downsample_every_nth_per_series() {
    let mut c = chain(json!({"type": "downsample", "every": 3}));
    let input: Vec<(&str, i64, f64)> = (0..7)
        .flat_map(|i| [("a", i, i as f64), ("b", i, -(i as f64))])
        .collect();
    let out = run(&mut c, &input, true);
    assert_eq!(
        out,
        [
            (0, 0.0),
            (0, -0.0),
            (3, 3.0),
            (3, -3.0),
            (6, 6.0),
            (6, -6.0)
        ]
    );
    assert_eq!(dropped(&mut c), 8);
}

#[test]
fn downsample_window_aggregates() {
    for (agg, expected) in [
        ("mean", [2.0, 11.0]),
        ("min", [1.0, 10.0]),
        ("max", [3.0, 12.0]),
    ] {
        let mut c = chain(
            json!({"type": "downsample", "window_secs": 60, "aggregate": agg, "field": "value"}),
        );
        let input = [
            ("t", 61, 1.0),
            ("t", 90, 2.0),
            ("t", 119, 3.0),
            ("t", 120, 10.0),
            ("t", 170, 12.0),
            ("t", 171, 11.0),
        ];
        let out = run(&mut c, &input, true);
        assert_eq!(out, [(60, expected[0]), (120, expected[1])], "{agg}");
        assert_eq!(dropped(&mut c), 4);
    }
}

#[test]
fn old_windows_are_emitted_without_waiting_for_the_end() {
    let d = def();
    let mut c = chain(
        json!({"type": "downsample", "window_secs": 10, "aggregate": "max", "field": "value"}),
    );
    let mut out = Vec::new();
    c.apply_record(&d, reading("a", 0, 1.0), &mut out);
    c.apply_record(&d, reading("b", 35, 2.0), &mut out);
    c.flush_records(&d, false, &mut out);
    assert_eq!(
        out.len(),
        1,
        "a's window [0, 10) is two windows behind the latest reading"
    );
    // With the latest reading at 35 s, a window that ended by 25 s is over; [20, 30) is not.
    let mut c = chain(
        json!({"type": "downsample", "window_secs": 10, "aggregate": "max", "field": "value"}),
    );
    let mut out = Vec::new();
    for (sensor, sec) in [("a", 10), ("b", 20), ("c", 35)] {
        c.apply_record(&d, reading(sensor, sec, 1.0), &mut out);
    }
    c.flush_records(&d, false, &mut out);
    assert_eq!(seconds(&out), [10]);
}

#[test]
fn downsample_an_int_field_keeps_it_an_int() {
    let d = def();
    let mut c = chain(
        json!({"type": "downsample", "window_secs": 60, "aggregate": "mean", "field": "quality"}),
    );
    let mut out = Vec::new();
    for (sec, quality) in [(0, 192), (10, 0), (20, 0)] {
        c.apply_record(&d, with_quality(sec, quality), &mut out);
    }
    c.flush_records(&d, true, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].values[5], Value::Int(64));
}

#[test]
fn series_by_an_int_key_field() {
    let mut c = chain(json!({"type": "downsample", "every": 2, "key_fields": ["quality"]}));
    let d = def();
    let mut out = Vec::new();
    for (sec, quality) in [(0, 192), (1, 0), (2, 192), (3, 0), (4, 192)] {
        c.apply_record(&d, with_quality(sec, quality), &mut out);
    }
    // Every 2nd per quality: 192 at 0 and 4, 0 at 1.
    assert_eq!(seconds(&out), [0, 1, 4]);
}

/// The series a chain's only filter holds state for.
fn series_held(c: &FilterChain) -> usize {
    match &c.filters[0].1 {
        Filter::Deadband { state, .. } => state.map.len(),
        Filter::SwingingDoor { state, .. } => state.map.len(),
        Filter::Every { seen, .. } => seen.map.len(),
        Filter::Window { open, .. } => open.map.len(),
        Filter::Predicate { .. } => 0,
    }
}

fn evicted(c: &mut FilterChain) -> u64 {
    c.take_evicted().iter().map(|(_, n)| n).sum()
}

#[test]
fn deadband_forgets_the_series_seen_longest_ago_past_max_series() {
    let mut c =
        chain(json!({"type": "deadband", "field": "value", "absolute": 5.0, "max_series": 4}));
    // a..d sent; a seen again (held), so b is the one seen longest ago when e comes.
    let input = [
        ("a", 0, 1.0),
        ("b", 1, 1.0),
        ("c", 2, 1.0),
        ("d", 3, 1.0),
        ("a", 4, 1.1),
    ];
    assert_eq!(run(&mut c, &input, false).len(), 4);
    assert_eq!(run(&mut c, &[("e", 5, 1.0)], false), [(5, 1.0)]);
    assert_eq!(evicted(&mut c), 1);
    assert_eq!(series_held(&c), 4);
    // b starts anew: its reading within the band is sent; a still has its state.
    assert_eq!(run(&mut c, &[("b", 6, 1.2)], false), [(6, 1.2)]);
    assert_eq!(run(&mut c, &[("a", 7, 1.3)], false), []);
    // c was forgotten for b, holding nothing; a's held reading is dropped as before.
    assert_eq!(evicted(&mut c), 1);
    assert_eq!(dropped(&mut c), 1);

    // Series without end stay within the limit: an eighth is forgotten at a time.
    let mut c =
        chain(json!({"type": "deadband", "field": "value", "absolute": 5.0, "max_series": 1000}));
    let names: Vec<String> = (0..100_000).map(|i| format!("s{i}")).collect();
    let input: Vec<(&str, i64, f64)> = names.iter().map(|n| (n.as_str(), 0, 1.0)).collect();
    assert_eq!(
        run(&mut c, &input, false).len(),
        100_000,
        "each is new: sent"
    );
    assert!(
        (875..=1000).contains(&series_held(&c)),
        "{}",
        series_held(&c)
    );
    assert_eq!(evicted(&mut c), 100_000 - series_held(&c) as u64);
}

#[test]
fn a_held_reading_of_a_forgotten_series_is_counted_as_dropped() {
    let mut c = chain(
        json!({"type": "deadband", "field": "value", "absolute": 5.0, "max_series": 1, "send_previous": true}),
    );
    assert_eq!(
        run(&mut c, &[("a", 0, 1.0), ("a", 1, 1.5)], false),
        [(0, 1.0)]
    );
    assert_eq!(dropped(&mut c), 0, "held, not dropped yet");
    assert_eq!(run(&mut c, &[("b", 2, 1.0)], false), [(2, 1.0)]);
    assert_eq!(dropped(&mut c), 1, "a's held reading went with a");
    assert_eq!(evicted(&mut c), 1);
}

#[test]
fn downsampling_past_max_series_restarts_counts_and_closes_windows_early() {
    // every = 3: a forgotten series keeps its next reading, as a new one does.
    let mut c = chain(json!({"type": "downsample", "every": 3, "max_series": 1}));
    let kept = run(
        &mut c,
        &[("a", 0, 1.0), ("a", 1, 1.0), ("b", 2, 1.0), ("a", 3, 1.0)],
        false,
    );
    assert_eq!(kept, [(0, 1.0), (2, 1.0), (3, 1.0)]);
    assert_eq!(evicted(&mut c), 2);
    assert_eq!(series_held(&c), 1);

    // A window of a forgotten series is emitted then, with what it aggregated so far.
    let mut c = chain(
        json!({"type": "downsample", "window_secs": 60, "aggregate": "max", "field": "value", "max_series": 1}),
    );
    let out = run(
        &mut c,
        &[("a", 0, 1.0), ("a", 10, 3.0), ("b", 20, 2.0)],
        false,
    );
    assert_eq!(out, [(0, 3.0)]);
    assert_eq!(dropped(&mut c), 1, "two readings of a became one");
    assert_eq!(run(&mut c, &[], true), [(0, 2.0)]);
    assert_eq!(evicted(&mut c), 1);
}

/// The largest distance of an input reading from the line between the kept readings around
/// it (0 for a kept one), checking that the first and last readings are kept and that no two
/// consecutive kept readings are more than `silence` seconds apart (0: unbounded) unless no
/// reading came between them.
fn linear_error(input: &[(i64, f64)], kept: &[(i64, f64)], silence: i64) -> f64 {
    assert_eq!(kept.first(), input.first(), "the first reading is kept");
    assert_eq!(kept.last(), input.last(), "the last reading is kept");
    for pair in kept.windows(2) {
        let gap = pair[1].0 - pair[0].0;
        let between = input
            .iter()
            .filter(|r| r.0 > pair[0].0 && r.0 < pair[1].0)
            .count();
        assert!(
            silence == 0 || gap <= silence || between == 0,
            "{gap} s between kept readings {pair:?}"
        );
    }
    let mut worst: f64 = 0.0;
    for &(t, v) in input {
        let after = kept.partition_point(|k| k.0 < t);
        if kept.get(after).is_some_and(|k| k.0 == t) {
            assert_eq!(kept[after].1, v);
            continue;
        }
        let (a, b) = (kept[after - 1], kept[after]);
        let line = a.1 + (b.1 - a.1) * (t - a.0) as f64 / (b.0 - a.0) as f64;
        worst = worst.max((v - line).abs());
    }
    worst
}

/// The largest distance of an input reading from the last kept reading at or before it.
fn hold_error(input: &[(i64, f64)], kept: &[(i64, f64)]) -> f64 {
    assert_eq!(kept.first(), input.first(), "the first reading is kept");
    assert_eq!(kept.last(), input.last(), "the last reading is kept");
    input
        .iter()
        .map(|&(t, v)| {
            let at = kept.partition_point(|k| k.0 <= t) - 1;
            (v - kept[at].1).abs()
        })
        .fold(0.0, f64::max)
}

#[test]
fn swinging_door_keeps_the_corners_of_a_ramp_and_a_step() {
    let mut c = chain(json!({"type": "swinging_door", "field": "value", "absolute": 0.1}));
    // Flat, a ramp of 1 a second (to 15 at second 20), flat again, then a step.
    let input: Vec<(&str, i64, f64)> = (0..40)
        .map(|s| {
            let v = match s {
                0..10 => 5.0,
                10..20 => 5.0 + (s - 10) as f64,
                20..30 => 15.0,
                _ => 30.0,
            };
            ("t", s, v)
        })
        .collect();
    let out = run(&mut c, &input, true);
    assert_eq!(
        out,
        [
            (0, 5.0),
            (10, 5.0),
            (20, 15.0),
            (29, 15.0),
            (30, 30.0),
            (39, 30.0)
        ]
    );
    let r = &c.reductions()[0];
    assert_eq!((r.readings_in, r.kept), (40, 6));
    assert_eq!(r.max_deviation, Some(0.0));
}

#[test]
fn swinging_door_drops_noise_within_the_band_of_a_drift() {
    let mut c = chain(json!({"type": "swinging_door", "field": "value", "absolute": 0.5}));
    // A drift of 0.05 a second with ±0.2 of alternating noise: one line covers it all.
    let input: Vec<(&str, i64, f64)> = (0..200)
        .map(|s| {
            (
                "t",
                s,
                0.05 * s as f64 + if s % 2 == 0 { 0.2 } else { -0.2 },
            )
        })
        .collect();
    let out = run(&mut c, &input, true);
    assert!(out.len() <= 4, "{out:?}");
    let points: Vec<(i64, f64)> = input.iter().map(|&(_, s, v)| (s, v)).collect();
    let error = linear_error(&points, &out, 0);
    assert!(error <= 0.5, "{error}");
    let reported = c.reductions()[0].max_deviation.unwrap();
    assert!(
        (reported - error).abs() < 1e-9,
        "{reported} against {error}"
    );
}

#[test]
fn swinging_door_keeps_a_reading_every_max_silence() {
    let mut c = chain(
        json!({"type": "swinging_door", "field": "value", "absolute": 1.0, "max_silence_secs": 60}),
    );
    let input: Vec<(&str, i64, f64)> = (0..=300).step_by(10).map(|s| ("t", s, 1.0)).collect();
    let out = run(&mut c, &input, true);
    assert_eq!(seconds_of(&out), [0, 60, 120, 180, 240, 300]);
    // A gap in the input longer than max_silence: both readings around it are kept.
    let out = run(&mut c, &[("t", 1000, 1.0), ("t", 1010, 1.0)], true);
    assert_eq!(seconds_of(&out), [1000, 1010]);
}

fn seconds_of(out: &[(i64, f64)]) -> Vec<i64> {
    out.iter().map(|(s, _)| *s).collect()
}

#[test]
fn swinging_door_passes_out_of_order_readings_and_counts_them() {
    let mut c = chain(json!({"type": "swinging_door", "field": "value", "absolute": 1.0}));
    let out = run(
        &mut c,
        &[
            ("t", 0, 1.0),
            ("t", 10, 1.0),
            ("t", 5, 50.0),
            ("t", 20, 1.0),
        ],
        true,
    );
    // The late reading goes through as it is, after the held one (10 s), which is kept; the
    // door from 10 to 20 is not bent by it.
    assert_eq!(out, [(0, 1.0), (10, 1.0), (5, 50.0), (20, 1.0)]);
    assert_eq!(c.reductions()[0].out_of_order, 1);
    let (in_order, late) = late::split(&out);
    assert_eq!((in_order.len(), late), (3, vec![(5, 50.0)]));
}

/// Deadband as swinging door: a late reading and a second one at the same time are passed on
/// and counted; the reference stays with the in-order readings, and the held reading goes out
/// before them.
#[test]
fn deadband_passes_late_and_repeated_readings_and_counts_them() {
    let mut c = chain(
        json!({"type": "deadband", "field": "value", "absolute": 1.0, "send_previous": false}),
    );
    let out = run(
        &mut c,
        &[
            ("t", 0, 1.0),
            ("t", 10, 1.5),
            ("t", 5, 50.0),
            ("t", 10, 40.0),
            ("t", 20, 2.2),
            ("t", 30, 3.0),
        ],
        true,
    );
    // 10 s is held and goes out before the late 5 s; the reference moves to it (1.5), so 20 s
    // (2.2) is within the band and 30 s (3.0) breaks it.
    assert_eq!(out, [(0, 1.0), (10, 1.5), (5, 50.0), (10, 40.0), (30, 3.0)]);
    let r = &c.reductions()[0];
    assert_eq!((r.out_of_order, r.readings_in, r.kept), (2, 6, 5));
    let (in_order, late) = late::split(&out);
    assert_eq!(late, [(5, 50.0), (10, 40.0)]);
    assert!(hold_error(&[(0, 1.0), (10, 1.5), (20, 2.2), (30, 3.0)], &in_order) <= 1.0);
}

#[test]
fn swinging_door_keeps_a_silent_series_held_reading_once_others_move_on() {
    let d = def();
    let mut c = chain(
        json!({"type": "swinging_door", "field": "value", "absolute": 1.0, "max_silence_secs": 60}),
    );
    let mut out = Vec::new();
    c.apply_record(&d, reading("a", 0, 1.0), &mut out);
    c.apply_record(&d, reading("a", 10, 1.0), &mut out);
    c.apply_record(&d, reading("b", 30, 1.0), &mut out);
    c.flush_records(&d, false, &mut out);
    assert_eq!(seconds(&out), [0, 30], "a's held reading is 20 s old");
    c.apply_record(&d, reading("b", 75, 1.0), &mut out);
    c.flush_records(&d, false, &mut out);
    assert_eq!(seconds(&out), [0, 30, 10], "a silent for 65 s of b's time");
}

#[test]
fn swinging_door_config_errors() {
    assert!(
        bad(json!({"type": "swinging_door", "field": "value"})).contains("exactly one of"),
        "no band"
    );
    assert!(
        bad(json!({"type": "swinging_door", "field": "value", "percent": 1.0}))
            .contains("needs range")
    );
    assert!(
        bad(json!({"type": "swinging_door", "field": "sensor", "absolute": 1.0}))
            .contains("not int64 or float64")
    );
}

#[test]
fn deadband_sends_each_series_last_reading_when_the_agent_stops() {
    let mut c = chain(json!({"type": "deadband", "field": "value", "absolute": 1.0}));
    let out = run(&mut c, &[("t", 0, 1.0), ("t", 1, 1.2), ("t", 2, 1.4)], true);
    assert_eq!(out, [(0, 1.0), (2, 1.4)]);
    let r = &c.reductions()[0];
    assert_eq!((r.readings_in, r.kept, r.band), (3, 2, Some(1.0)));
    assert!((r.max_deviation.unwrap() - 0.2).abs() < 1e-9);
}

/// A series of the shapes process signals take: drift, noise, steps, spikes, stuck values and
/// gaps, at increasing whole seconds.
fn process_series() -> impl Strategy<Value = Vec<(i64, f64)>> {
    proptest::collection::vec((1i64..30, 0u8..10, -5.0f64..5.0), 2..300).prop_map(|steps| {
        let (mut t, mut v, mut drift) = (0i64, 50.0f64, 0.0f64);
        let mut out = Vec::with_capacity(steps.len());
        for (dt, shape, x) in steps {
            t += if shape == 9 { dt * 20 } else { dt };
            match shape {
                0 => v += x * 5.0,     // a step
                1 => drift = x / 10.0, // a new slope
                2 => {}                // stuck
                3 => {
                    out.push((t, v + x * 20.0)); // a spike
                    t += 1;
                }
                _ => v += drift * dt as f64 + x / 20.0, // drift with noise
            }
            out.push((t, v));
        }
        out
    })
}

use proptest::prelude::*;

/// `series` in the order it arrives with `late` readings among it: each (i, back, value) comes
/// after reading i, `back` seconds before it (0: a second reading at its time).
fn arriving_with_late(
    series: &[(i64, f64)],
    late: &[(usize, i64, f64)],
) -> Vec<(&'static str, i64, f64)> {
    let mut input = Vec::with_capacity(series.len() + late.len());
    for (i, &(t, v)) in series.iter().enumerate() {
        input.push(("t", t, v));
        for &(_, back, value) in late.iter().filter(|l| l.0 % series.len() == i) {
            input.push(("t", t - back, value));
        }
    }
    input
}

/// Checks what a filter passed on for `series` with `late` readings: the late ones, told apart
/// by their order, are exactly those that came late; the others rebuild the series (`error`
/// gives the largest distance) within `band`.
fn check_late(
    series: &[(i64, f64)],
    late: &[(usize, i64, f64)],
    out: &[(i64, f64)],
    band: f64,
    error: impl Fn(&[(i64, f64)], &[(i64, f64)]) -> f64,
) -> Result<(), TestCaseError> {
    let (in_order, passed) = late::split(out);
    let mut came: Vec<(i64, u64)> = late
        .iter()
        .map(|l| (series[l.0 % series.len()].0 - l.1, l.2.to_bits()))
        .collect();
    let mut got: Vec<(i64, u64)> = passed.iter().map(|r| (r.0, r.1.to_bits())).collect();
    came.sort_unstable();
    got.sort_unstable();
    prop_assert_eq!(got, came);
    let e = error(series, &in_order);
    prop_assert!(e <= band * (1.0 + 1e-9), "error {} > band {}", e, band);
    Ok(())
}

proptest! {
    #[test]
    fn late_and_repeated_readings_pass_and_the_rest_keep_the_band(
        series in process_series(),
        late in proptest::collection::vec((0usize..1000, 0i64..60, -100.0f64..100.0), 0..20),
        band in 0.01f64..3.0,
        door in any::<bool>(),
        send_previous in any::<bool>(),
    ) {
        // A late reading is after the first of the series (or a second one at its time).
        let late: Vec<_> = late
            .into_iter()
            .map(|(i, back, v)| {
                let after_first = series[i % series.len()].0 - series[0].0 - 1;
                (i, back.min(after_first).max(0), v)
            })
            .collect();
        let config = if door {
            json!({"type": "swinging_door", "field": "value", "absolute": band})
        } else {
            json!({"type": "deadband", "field": "value", "absolute": band, "send_previous": send_previous})
        };
        let mut c = chain(config);
        let out = run(&mut c, &arriving_with_late(&series, &late), true);
        prop_assert_eq!(c.reductions()[0].out_of_order, late.len() as u64);
        if door {
            check_late(&series, &late, &out, band, |s, k| linear_error(s, k, 0))?;
        } else {
            check_late(&series, &late, &out, band, hold_error)?;
        }
    }

    #[test]
    fn swinging_door_interpolation_is_within_the_band_at_every_reading(
        series in process_series(),
        band in 0.01f64..3.0,
        silence in prop_oneof![Just(0u64), 20u64..200],
    ) {
        let mut c = chain(json!({"type": "swinging_door", "field": "value", "absolute": band, "max_silence_secs": silence}));
        let input: Vec<(&str, i64, f64)> = series.iter().map(|&(t, v)| ("t", t, v)).collect();
        let out = run(&mut c, &input, true);
        let error = linear_error(&series, &out, silence as i64);
        prop_assert!(error <= band * (1.0 + 1e-9), "error {error} > band {band}");
        let r = &c.reductions()[0];
        prop_assert_eq!((r.readings_in, r.kept), (series.len() as u64, out.len() as u64));
        let reported = r.max_deviation.unwrap();
        prop_assert!((reported - error).abs() <= 1e-9 * (1.0 + error), "reported {reported}, measured {error}");
    }

    #[test]
    fn deadband_hold_is_within_the_band_at_every_reading(
        series in process_series(),
        band in 0.01f64..3.0,
        send_previous in any::<bool>(),
    ) {
        let mut c = chain(json!({"type": "deadband", "field": "value", "absolute": band, "send_previous": send_previous}));
        let input: Vec<(&str, i64, f64)> = series.iter().map(|&(t, v)| ("t", t, v)).collect();
        let out = run(&mut c, &input, true);
        let error = hold_error(&series, &out);
        prop_assert!(error <= band, "error {error} > band {band}");
        let reported = c.reductions()[0].max_deviation.unwrap();
        prop_assert!((reported - error).abs() <= 1e-9, "reported {reported}, measured {error}");
    }
}

/// The canonical NDJSON text of what the filters passed on, whichever form it has.
fn canonical(def: &StreamDef, kept: &[Kept]) -> Vec<String> {
    kept.iter()
        .map(|k| {
            let record = match k {
                Kept::Record(r) => r.clone(),
                Kept::Line(text) => schemas::check_bytes(def, text).unwrap().record,
            };
            let mut text = Vec::new();
            schemas::wire::encode_value_into(def, &record, &mut text);
            String::from_utf8(text).unwrap()
        })
        .collect()
}

proptest! {
    /// Lines read in place and records built from them go through a chain alike: the same
    /// readings come out, lines as their own text (nothing built or encoded), and the reports
    /// agree.
    #[test]
    fn lines_and_records_are_filtered_alike(
        series in process_series(),
        band in 0.01f64..3.0,
        chain_of in 0usize..4,
    ) {
        let d = def();
        let configs: Vec<FilterConfig> = [
            vec![json!({"type": "swinging_door", "field": "value", "absolute": band, "max_silence_secs": 100})],
            vec![json!({"type": "predicate", "field": "quality", "op": "ge", "value": 100}),
                 json!({"type": "deadband", "field": "value", "absolute": band})],
            vec![json!({"type": "deadband", "field": "value", "absolute": band}),
                 json!({"type": "swinging_door", "field": "value", "absolute": band})],
            vec![json!({"type": "downsample", "every": 3}),
                 json!({"type": "downsample", "window_secs": 60, "aggregate": "mean", "field": "value"})],
        ][chain_of].iter().map(|c| serde_json::from_value(c.clone()).unwrap()).collect();
        let mut by_record = FilterChain::new(&d, &configs).unwrap();
        let mut by_line = FilterChain::new(&d, &configs).unwrap();
        let (mut from_records, mut from_lines) = (Vec::new(), Vec::new());
        for (i, &(t, v)) in series.iter().enumerate() {
            let sensor = ["a", "b"][i % 2];
            let quality = [192, 0, 192, 64][i % 4];
            let text = format!(r#"{{"device_id":"d1","sensor":"{sensor}","ts":{},"value":{v:?},"quality":{quality},"tags":{{"line":"{i}"}}}}"#, t * 1000);
            let record = schemas::check_bytes(&d, text.as_bytes()).unwrap().record;
            by_record.apply(&d, Reading::record(record), &mut from_records);
            let scalars = schemas::verbatim_scalars_in(&d, text.as_bytes(), &mut AtOnce).unwrap();
            by_line.apply(&d, Reading::Line(&scalars, text.as_bytes()), &mut from_lines);
        }
        prop_assert_eq!(canonical(&d, &from_records), canonical(&d, &from_lines));
        // What is held at the end comes out in the order of the series' map.
        let (mut held_records, mut held_lines) = (Vec::new(), Vec::new());
        by_record.flush(&d, true, &mut held_records);
        by_line.flush(&d, true, &mut held_lines);
        let mut sorted = [canonical(&d, &held_records), canonical(&d, &held_lines)];
        sorted.iter_mut().for_each(|texts| texts.sort());
        prop_assert_eq!(&sorted[0], &sorted[1]);
        from_lines.extend(held_lines);
        let windows = chain_of == 3;
        prop_assert!(from_lines.iter().all(|k| matches!(k, Kept::Line(_)) != windows));
        prop_assert_eq!(by_record.reductions(), by_line.reductions());
    }
}
