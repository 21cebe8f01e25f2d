//! Compaction by the sink (`[table.compaction]`) in a SQLite catalog on librdkafka's mock
//! cluster, read by pyiceberg and DuckDB.

use crate::common;
use crate::support;
use crate::table::{
    GROUP, TOPIC, append, assert_bounds_hold, duplicates, read_table, rig, sqlite_config,
    start_sink, walk,
};

use std::time::{Duration, Instant};

use serde_json::Value;

/// A sink with `[table.compaction]` on hourly partitions: the small files of an hour that
/// closed (records whose Kafka timestamps, their ingest time, are three hours old) become one
/// file per Kafka partition in one `replace` snapshot; the open hour's files stay. pyiceberg
/// and DuckDB read every record once, with bounds that hold. A sink of another group then
/// reads the whole topic again, lands the same files at the same keys and finds them in the
/// table only through the compacted files' offset bounds: nothing twice, no partition stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_compacts_closed_hours_and_a_rereading_sink_appends_nothing_twice() {
    let (cluster, bootstrap, dir, producer) = rig(2);
    let (catalog, config) = sqlite_config(dir.path(), &bootstrap);
    append(
        &config,
        "partition = \"hour\"\n[table.compaction]\nenabled = true\ndelay_ms = 0\ninterval_ms = 1000\ntarget_bytes = 1048576\n",
    );
    let sent = support::readings(1_500, 41);
    let (old, new) = sent.split_at(1_200);
    let three_hours_ago = chrono::Utc::now().timestamp_millis() - 3 * 3_600_000;
    for r in old {
        let key = r["device_id"].as_str().unwrap();
        let value = r.to_string();
        let record = rdkafka::producer::FutureRecord::to(TOPIC)
            .key(key)
            .payload(&value)
            .timestamp(three_hours_ago);
        producer.send(record, Duration::from_secs(5)).await.unwrap();
    }
    support::produce(&producer, TOPIC, new).await;
    let mut sinks = vec![start_sink(&config, &dir.path().join("sink-0.log"))];
    support::wait_caught_up(&bootstrap, (GROUP, TOPIC), &mut sinks, dir.path()).await;
    let compacted = |table: &Value| -> Vec<String> {
        table["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap().to_owned())
            .filter(|f| f.contains("/.compacted/"))
            .collect()
    };
    // The closed hour's landing files: none of them stays listed once it is compacted.
    let hour = chrono::DateTime::from_timestamp_millis(three_hours_ago)
        .unwrap()
        .format("/date=%Y-%m-%d/hour=%H/")
        .to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    let table = loop {
        let table = read_table(&catalog, &["--files-only"]);
        let files = table["files"].as_array().unwrap();
        if compacted(&table).len() == 2
            && !files.iter().any(|f| f.as_str().unwrap().contains(&hour))
        {
            break table;
        }
        assert!(Instant::now() < deadline, "no compaction: {table}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let landed = walk(&dir.path().join("zone"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .filter(|p| !p.to_string_lossy().contains("/.compacted/"))
        .count();
    let listed = table["files"].as_array().unwrap().len();
    eprintln!("{landed} landing files; the table lists {listed}, 2 of them compacted");
    assert!(landed >= listed + 6, "{landed} landed, {listed} listed");
    // A sink of another group reads everything again.
    let again = dir.path().join("again.toml");
    std::fs::write(
        &again,
        std::fs::read_to_string(&config)
            .unwrap()
            .replace(&format!("group_id = \"{GROUP}\""), "group_id = \"again\""),
    )
    .unwrap();
    sinks.push(start_sink(&again, &dir.path().join("sink-1.log")));
    support::wait_caught_up(&bootstrap, ("again", TOPIC), &mut sinks[1..], dir.path()).await;
    support::stop_gracefully(sinks);
    let log = std::fs::read_to_string(dir.path().join("sink-1.log")).unwrap();
    assert!(!log.contains("ERROR"), "{log}");
    let table = read_table(&catalog, &[]);
    common::assert_same_records(&sent, &table);
    common::assert_duckdb_reads_the_same(&table);
    let rows = table["rows"].as_array().unwrap();
    assert_eq!(duplicates(rows), 0);
    // The replace's summary carries the totals forward: files out, the same rows in.
    assert_eq!(
        table["summary"]["total-records"],
        rows.len().to_string(),
        "{}",
        table["summary"]
    );
    assert_eq!(compacted(&table).len(), 2, "{}", table["files"]);
    for file in table["file_stats"].as_array().unwrap() {
        assert_bounds_hold(file);
    }
    drop(cluster);
}
