//! The whole path on the embedded default: agent → gateway → in-process mock Kafka → sink →
//! Parquet in a local directory, read back by pyarrow.

use crate::common;

use std::time::Duration;

use loadtest::demo::{DemoOptions, run};
use loadtest::fleet::{FleetSpec, sensor_readings};
use schemas::arrow::HashColumn;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_default_lands_every_record_exactly_once() {
    let landing = tempfile::tempdir().unwrap();
    let fleet = FleetSpec {
        records: 4_000,
        devices: 20,
        ..FleetSpec::default()
    };
    let summary = run(DemoOptions {
        landing: landing.path().to_path_buf(),
        fleet: fleet.clone(),
        timeout: Duration::from_secs(90),
        hash_column: HashColumn::None,
        table: true,
        filter: None,
    })
    .await
    .unwrap();
    assert!(summary.verdict.exactly_once(), "{summary}");
    assert_eq!(summary.landed_rows, summary.distinct);
    assert!(
        summary.agent.total().pipeline.duplicates > 0,
        "the fleet re-sends records"
    );
    assert!(
        summary.agent.total().delivery.wire_bytes < summary.agent.total().delivery.raw_bytes / 3,
        "{summary}"
    );

    let landed = common::pyarrow(&["--dir", summary.run_dir.to_str().unwrap()]);
    common::assert_landed_exactly(&sensor_readings(&fleet), &landed);
    // The demo's table holds the same records, as pyiceberg and DuckDB read it.
    let (catalog, table) = summary.table.clone().expect("the demo lands in a table");
    let (namespace, name) = table.split_once('.').unwrap();
    let python = common::service_env("EDGE_INGEST_PYTHON");
    let out = std::process::Command::new(python)
        .arg(common::repo_root().join("scripts/read_table.py"))
        .arg("--catalog")
        .arg(&catalog)
        .args(["--namespace", namespace, "--table", name])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    common::assert_same_records(&sensor_readings(&fleet), &table);
    common::assert_duckdb_reads_the_same(&table);
    assert!(
        summary.to_string().contains("query it (pyiceberg)"),
        "{summary}"
    );
    // `loadtest verify --table` finds the same from the agent's input file, without listing.
    let run = summary
        .run_dir
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let readings = landing.path().join(format!("{run}-agent/readings.ndjson"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(["verify", "--sent"])
        .arg(&readings)
        .arg("--landing")
        .arg(landing.path())
        .arg("--table")
        .arg(&catalog)
        .args(["--namespace", namespace])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["rows"], summary.distinct, "{report}");
    assert_eq!(report["passed"], true, "{report}");
}

/// With `landing.content_hash_bytes = 16` every row keeps the first 16 bytes of its record's
/// content hash (read back by pyarrow), and the files are otherwise the default ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn landing_files_keep_16_bytes_of_the_content_hash_when_asked() {
    let landing = tempfile::tempdir().unwrap();
    let fleet = FleetSpec {
        records: 2_000,
        devices: 10,
        ..FleetSpec::default()
    };
    let summary = run(DemoOptions {
        landing: landing.path().to_path_buf(),
        fleet: fleet.clone(),
        timeout: Duration::from_secs(90),
        hash_column: HashColumn::Short,
        table: false,
        filter: None,
    })
    .await
    .unwrap();
    assert!(summary.verdict.exactly_once(), "{summary}");
    let landed = common::pyarrow(&["--dir", summary.run_dir.to_str().unwrap()]);
    for file in landed["files"].as_array().unwrap() {
        assert_eq!(file["schema"]["_content_hash"], "fixed_size_binary[16]");
        let hash = &file["columns"]["_content_hash"];
        assert_eq!(hash["compression"], "UNCOMPRESSED", "{hash}");
        assert_eq!(hash["statistics"], false, "{hash}");
    }
    let streams = schemas::example_streams();
    let def = streams.get("sensor_readings").unwrap();
    let mut expected: Vec<String> = sensor_readings(&fleet)
        .into_iter()
        .map(|r| schemas::check(def, r).unwrap().hash.to_hex()[..32].to_owned())
        .collect();
    expected.sort();
    expected.dedup();
    let mut got: Vec<String> = landed["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["_content_hash"].as_str().unwrap().to_owned())
        .collect();
    got.sort();
    assert_eq!(got, expected);
    common::assert_duckdb_reads_the_same(&landed);
}

/// One device, so every reading goes to one partition: more of them than the mock cluster keeps
/// of a partition (5 MiB of record batches, about 87,500 of the gateway's readings; past that
/// it drops the oldest). The demo feeds the agent only as the sink keeps up, so none is dropped
/// before the sink read it: every distinct reading lands once, and the sink found no gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_gets_more_readings_than_the_mock_cluster_keeps_of_it_and_all_land() {
    let landing = tempfile::tempdir().unwrap();
    let fleet = FleetSpec {
        records: 120_000,
        devices: 1,
        duplicate_ratio: 0.05,
        ..FleetSpec::default()
    };
    let summary = run(DemoOptions {
        landing: landing.path().to_path_buf(),
        fleet,
        timeout: Duration::from_secs(120),
        hash_column: HashColumn::None,
        table: true,
        filter: None,
    })
    .await
    .unwrap();
    assert!(summary.distinct > 100_000, "{summary}");
    assert!(summary.verdict.exactly_once(), "{summary}");
    assert_eq!(summary.landed_rows, summary.distinct);
}

/// A demo of more readings than it can check in memory is refused before anything starts.
#[test]
fn the_demo_refuses_more_readings_than_it_takes() {
    let landing = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(["demo", "--records", "10000001", "--landing"])
        .arg(landing.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("takes at most 10000000 readings"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_dir(landing.path()).unwrap().count(), 0);
}

/// The README's first command, as a user runs it: it succeeds, prints the verdict, and logs no
/// error. Its last line used to be a librdkafka error that all brokers were down: the mock
/// cluster went while the gateway's reload handle still held a producer.
#[test]
fn the_demo_command_verifies_and_logs_no_error() {
    let (stdout, stderr) = demo_command(&["--records", "2000"]);
    assert!(
        stdout.contains("every distinct record landed exactly once"),
        "{stdout}"
    );
    assert!(!stderr.contains("ERROR"), "{stderr}");
}

/// `demo --filter swinging-door`: the agent reduces process-like series, the summary shows the
/// reduction, and the bound is checked from the table's rows: every series within the band of
/// every generated reading.
#[test]
fn the_demo_with_a_filter_shows_the_reduction_and_checks_the_bound() {
    let (stdout, stderr) = demo_command(&[
        "--records",
        "16000",
        "--devices",
        "8",
        "--filter",
        "swinging-door",
    ]);
    let line = |prefix: &str| {
        stdout
            .lines()
            .find(|l| l.trim_start().starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} line: {stdout}"))
            .to_owned()
    };
    assert!(
        line("filter").contains("swinging_door with a band of 0.5"),
        "{stdout}"
    );
    let reduction = line("reduction");
    let numbers: Vec<u64> = reduction
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(numbers[0], 16_000, "{reduction}");
    assert!(
        numbers[1] < 16_000 / 5,
        "kept {} of 16,000: {reduction}",
        numbers[1]
    );
    assert!(
        line("bound checked").contains("of all 16000 readings"),
        "{stdout}"
    );
    assert!(
        stdout.contains("every record the agent kept landed exactly once"),
        "{stdout}"
    );
    assert!(!stderr.contains("ERROR"), "{stderr}");
}

/// `loadtest demo ARGS` into a landing directory of its own: its stdout and stderr, once it
/// succeeded.
fn demo_command(args: &[&str]) -> (String, String) {
    let landing = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .arg("demo")
        .args(args)
        .arg("--landing")
        .arg(landing.path())
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    (stdout, stderr)
}
