//! The whole path on the embedded default: agent → gateway → in-process mock Kafka → sink →
//! Parquet in a local directory, read back by pyarrow.

mod common;

use std::time::Duration;

use loadtest::demo::{DemoOptions, run};
use loadtest::fleet::{FleetSpec, sensor_readings};

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
}
