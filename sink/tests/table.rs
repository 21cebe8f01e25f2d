//! The landing zone as Iceberg tables in a SQLite catalog: sinks killed at random points while
//! two share the partitions, and pyiceberg reads each record from the table's current snapshot
//! exactly once; a thousand commits keep the table's metadata bounded. The broker is
//! librdkafka's mock cluster in this process, as in `crashes.rs`.

use crate::common;
use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rdkafka::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::FutureProducer;
use serde_json::Value;

pub(crate) const TOPIC: &str = "ingest.sensor_readings";
pub(crate) const GROUP: &str = "table-sinks";

pub(crate) fn start_sink(config: &Path, log: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_sink"))
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "sink=info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("cannot start the sink binary")
}

/// A sink config landing into `dir/zone` with a table per stream in `catalog` (a SQLite file
/// or a PostgreSQL URL) under the name `catalog_name`, the definitions read from `streams`.
fn write_config(
    dir: &Path,
    bootstrap: &str,
    streams: &Path,
    (catalog, catalog_name): (&str, &str),
) -> PathBuf {
    let config = dir.join("sink.toml");
    std::fs::write(
        &config,
        format!(
            r#"
streams_dir = "{streams}"
admin_listen = "127.0.0.1:0"
key_prefix = "landing"
[kafka]
brokers = "{bootstrap}"
group_id = "{GROUP}"
session_timeout_ms = 3000
consumer = {{ "fetch.wait.max.ms" = "50" }}
[store]
type = "local"
path = "{root}"
[rotation]
max_records = 150
idle_ms = 400
[upload]
staging_dir = "{staging}"
[table]
catalog = "{catalog}"
catalog_name = "{catalog_name}"
commit_interval_ms = 700
"#,
            streams = streams.display(),
            root = dir.join("zone").display(),
            staging = dir.join("staging").display(),
        ),
    )
    .unwrap();
    config
}

/// [`write_config`] with the shipped definitions and a SQLite catalog in `dir`: the catalog's
/// path and the config's.
pub(crate) fn sqlite_config(dir: &Path, bootstrap: &str) -> (String, PathBuf) {
    let catalog = dir.join("catalog.db").display().to_string();
    let config = write_config(
        dir,
        bootstrap,
        &common::repo_root().join("streams"),
        (&catalog, "edge_ingest"),
    );
    (catalog, config)
}

/// A mock cluster whose topic has `partitions`, its bootstrap address, a directory for the
/// test and a producer.
pub(crate) fn rig(
    partitions: i32,
) -> (
    MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    String,
    tempfile::TempDir,
    FutureProducer,
) {
    let cluster = MockCluster::new(1).unwrap();
    cluster.create_topic(TOPIC, partitions, 1).unwrap();
    let bootstrap = cluster.bootstrap_servers();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    (cluster, bootstrap, tempfile::tempdir().unwrap(), producer)
}

/// pyiceberg's view of the stream's table (`scripts/read_table.py`) in `catalog` (a SQLite
/// file or a PostgreSQL URL).
pub(crate) fn read_table(catalog: impl AsRef<std::ffi::OsStr>, extra: &[&str]) -> Value {
    read_table_with(catalog, extra, &[])
}

/// [`read_table`] with `env` set for the reader.
fn read_table_with(
    catalog: impl AsRef<std::ffi::OsStr>,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Value {
    let python = common::service_env("EDGE_INGEST_PYTHON");
    let out = Command::new(python)
        .arg(common::repo_root().join("scripts/read_table.py"))
        .arg("--catalog")
        .arg(catalog)
        .args(["--table", "sensor_readings"])
        .args(extra)
        .envs(env.iter().copied())
        .output()
        .expect("cannot run the pyiceberg reader");
    assert!(
        out.status.success(),
        "pyiceberg reader failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("pyiceberg reader printed invalid JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sinks_killed_at_random_points_commit_every_record_to_the_table_once() {
    let (cluster, bootstrap, dir, producer) = rig(4);
    let (catalog, config) = sqlite_config(dir.path(), &bootstrap);
    let sent = support::readings(4_000, 23);
    let mut rng = SmallRng::seed_from_u64(9);
    let log = |i: usize| dir.path().join(format!("sink-{i}.log"));
    let mut sinks: Vec<Child> = (0..2).map(|i| start_sink(&config, &log(i))).collect();
    let (mut kills, mut started) = (0, 2);
    let mut garbage = Vec::new();
    for chunk in sent.chunks(400) {
        support::produce(&producer, TOPIC, chunk).await;
        for _ in 0..3 {
            let value = format!("not a reading {}", garbage.len());
            support::produce_raw(&producer, TOPIC, &format!("bad-{}", garbage.len()), &value).await;
            garbage.push(value);
        }
        // Past the commit interval now and then, so that kills fall before, between and after
        // table commits.
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1_600))).await;
        if rng.random_bool(0.5) {
            let mut child = sinks.swap_remove(rng.random_range(0..sinks.len()));
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            kills += 1;
            sinks.push(start_sink(&config, &log(started)));
            started += 1;
        }
    }
    assert!(kills >= 3, "only {kills} kills");
    // Kafka offsets are committed only past files in the table: caught up means in the table.
    support::wait_caught_up(&bootstrap, (GROUP, TOPIC), &mut sinks, dir.path()).await;
    support::stop_gracefully(sinks);
    // The last quarter by event time, for a filtered scan.
    let mut times: Vec<i64> = sent.iter().map(|r| r["ts"].as_i64().unwrap()).collect();
    times.sort_unstable();
    let since = times[times.len() * 3 / 4];
    let since_text = chrono::DateTime::from_timestamp_millis(since)
        .unwrap()
        .to_rfc3339();
    let table = read_table(
        &catalog,
        &["--row-filter", &format!("ts >= '{since_text}'")],
    );
    common::assert_same_records(&sent, &table);
    common::assert_duckdb_reads_the_same(&table);
    assert_partitions_and_bounds(&table, since * 1_000);
    assert_dead_letters_once(
        &read_table(&catalog, &["--table", "_dead_letters"]),
        &garbage,
    );
    let mut offsets: Vec<(i64, i64)> = table["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["_kafka_partition"].as_i64().unwrap(),
                r["_offset"].as_i64().unwrap(),
            )
        })
        .collect();
    let rows = offsets.len();
    offsets.sort_unstable();
    offsets.dedup();
    assert_eq!(offsets.len(), rows, "a Kafka message twice in the table");
    let names: Vec<&str> = table["schema"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "device_id",
            "sensor",
            "ts",
            "value",
            "unit",
            "quality",
            "tags",
            "_ingest_ts",
            "_kafka_partition",
            "_offset"
        ]
    );
    let ts = &table["schema"][2];
    assert_eq!(
        (ts["id"].as_i64(), ts["type"].as_str()),
        (Some(3), Some("timestamptz"))
    );
    assert_eq!(
        table["sort_order"],
        serde_json::json!(["device_id", "sensor", "unit", "ts"])
    );
    // Every file the table lists is one the sinks landed, each once.
    let files = table["files"].as_array().unwrap();
    let mut distinct: Vec<&str> = files.iter().map(|f| f.as_str().unwrap()).collect();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), files.len(), "a file registered twice");
    drop(cluster);
}

/// A table commit moves the Kafka offset of a partition whose file went in, and no further
/// than the records it has read since into its open file: a sink killed then reads those again
/// (here the open file waits for `max_records`, and its records would otherwise be lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_commit_does_not_commit_past_the_open_file() {
    let (cluster, bootstrap, dir, producer) = rig(1);
    let (catalog, config) = sqlite_config(dir.path(), &bootstrap);
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("idle_ms = 400", "idle_ms = 600000");
    std::fs::write(&config, text).unwrap();
    let sent = support::readings(400, 5);
    let mut sinks = vec![start_sink(&config, &dir.path().join("sink-0.log"))];
    support::produce(&producer, TOPIC, &sent).await;
    // The first files (150 records each) go into the table; the rest wait in the open file.
    let deadline = Instant::now() + Duration::from_secs(60);
    let committed = loop {
        let offsets = {
            let bootstrap = bootstrap.clone();
            tokio::task::spawn_blocking(move || {
                support::committed_offsets(&bootstrap, GROUP, TOPIC)
            })
            .await
            .unwrap()
        };
        if let Some(&(Some(committed), high)) = offsets.first() {
            assert_eq!(high, 400);
            break committed;
        }
        assert!(Instant::now() < deadline, "no offset committed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // A commit lands at the end of a file: past one of the landed files, short of the end.
    let files = read_table(&catalog, &["--files-only"])["files"]
        .as_array()
        .unwrap()
        .len();
    assert!(
        files >= 1,
        "an offset committed before any file was in the table"
    );
    assert!(committed < 400, "committed {committed}, past the open file");
    let mut killed = sinks.remove(0);
    killed.kill().unwrap(); // SIGKILL
    killed.wait().unwrap();
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("idle_ms = 600000", "idle_ms = 400");
    std::fs::write(&config, text).unwrap();
    let mut sinks = vec![start_sink(&config, &dir.path().join("sink-1.log"))];
    support::wait_caught_up(&bootstrap, (GROUP, TOPIC), &mut sinks, dir.path()).await;
    support::stop_gracefully(sinks);
    common::assert_same_records(&sent, &read_table(&catalog, &[]));
    drop(cluster);
}

/// A sink lands a file and is killed before its table commit; the next owner reads the same
/// records again and nothing else. Its dedupe window, warmed from the landing files, must not
/// take those records for duplicates of themselves: it writes them, meets the landed file at
/// the same key, adopts it and commits it to the table, rather than commit the Kafka offset
/// past a file the table never got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_landed_by_a_killed_sink_reaches_the_table_through_its_next_owner() {
    let (cluster, bootstrap, dir, producer) = rig(1);
    let (catalog, config) = sqlite_config(dir.path(), &bootstrap);
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("commit_interval_ms = 700", "commit_interval_ms = 600000"),
    )
    .unwrap();
    // 150 distinct readings: one file at max_records.
    let sent: Vec<serde_json::Value> =
        support::readings(400, 3)
            .into_iter()
            .fold(Vec::new(), |mut distinct, r| {
                if distinct.len() < 150 && !distinct.contains(&r) {
                    distinct.push(r);
                }
                distinct
            });
    assert_eq!(sent.len(), 150);
    let mut first = start_sink(&config, &dir.path().join("sink-0.log"));
    support::produce(&producer, TOPIC, &sent).await;
    let landed = || {
        walk(&dir.path().join("zone/landing/sensor_readings"))
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while landed() == 0 {
        assert!(Instant::now() < deadline, "no file landed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    first.kill().unwrap(); // SIGKILL, long before its table commit
    first.wait().unwrap();
    std::fs::write(&config, text).unwrap();
    let mut sinks = vec![start_sink(&config, &dir.path().join("sink-1.log"))];
    support::wait_caught_up(&bootstrap, (GROUP, TOPIC), &mut sinks, dir.path()).await;
    support::stop_gracefully(sinks);
    assert_eq!(landed(), 1, "the file was adopted, not written again");
    common::assert_same_records(&sent, &read_table(&catalog, &[]));
    drop(cluster);
}

/// Every file under `dir`, recursively.
pub(crate) fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// The table's files and metadata in S3 (moto), written through the sink's store: pyiceberg
/// reads every record once from the table there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_in_s3_holds_every_record_once() {
    let s3 = common::service_env("EDGE_INGEST_S3");
    let bucket = format!("table-{}", common::unique_id());
    common::pyarrow(&["--s3-endpoint", &s3, "--bucket", &bucket, "--create-bucket"]);
    let (cluster, bootstrap, dir, producer) = rig(2);
    let (catalog, config) = sqlite_config(dir.path(), &bootstrap);
    let text = std::fs::read_to_string(&config).unwrap().replace(
        &format!("type = \"local\"\npath = \"{}\"", dir.path().join("zone").display()),
        &format!(
            "type = \"s3\"\nbucket = \"{bucket}\"\nendpoint = \"{s3}\"\nregion = \"us-east-1\"\nforce_path_style = true"
        ),
    );
    assert!(text.contains("type = \"s3\""));
    std::fs::write(&config, text).unwrap();
    let sent = support::readings(800, 31);
    let mut sinks = vec![start_sink(&config, &dir.path().join("sink.log"))];
    support::produce(&producer, TOPIC, &sent).await;
    support::wait_caught_up(&bootstrap, (GROUP, TOPIC), &mut sinks, dir.path()).await;
    support::stop_gracefully(sinks);
    let table = read_table(&catalog, &["--s3-endpoint", &s3]);
    common::assert_same_records(&sent, &table);
    let location = table["metadata_location"].as_str().unwrap();
    assert!(
        location.starts_with(&format!("s3://{bucket}/landing/sensor_readings/metadata/")),
        "{location}"
    );
    drop(cluster);
}

/// A definition that gains a field: the table gains a column with a new id, without rewriting
/// a file; rows landed before read it as null, in pyiceberg and DuckDB alike. The catalog is
/// PostgreSQL's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_added_to_the_definition_becomes_a_column_of_the_table() {
    let (cluster, bootstrap, dir, producer) = rig(2);
    let postgres = common::service_env("EDGE_INGEST_POSTGRES");
    let catalog_name = format!("evolve-{}", common::unique_id());
    let config =
        |streams: &Path| write_config(dir.path(), &bootstrap, streams, (&postgres, &catalog_name));
    let table = || read_table(&postgres, &["--catalog-name", &catalog_name]);
    add_a_field_while_landing(dir.path(), (&bootstrap, &producer), 1, config, table).await;
    drop(cluster);
}

/// Apache Iceberg's REST catalog server (the suite's, `EDGE_INGEST_ICEBERG_REST`: its test
/// fixture over a JdbcCatalog), two sinks of one group committing to it at once with OAuth2
/// client credentials (the loser of a race gets 409 and builds again) and a field added on the
/// way: pyiceberg reads the table through the same server, every record once, and the new
/// column from the files landed after the change; then Trino (its Iceberg connector on the same
/// catalog) counts the same rows and offsets. The tables go in a namespace of the test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sinks_commit_to_apache_icebergs_rest_catalog_every_record_once() {
    let (cluster, bootstrap, dir, producer) = rig(4);
    let url = common::service_env("EDGE_INGEST_ICEBERG_REST");
    let namespace = format!("rest{}", common::unique_id());
    std::fs::write(dir.path().join("credential"), "sink-client:s3cret\n").unwrap();
    let config = |streams: &Path| {
        let config = write_config(dir.path(), &bootstrap, streams, (&url, "rest"));
        append(
            &config,
            &format!(
                "namespace = \"{namespace}\"\ncredential_file = \"{}\"\n",
                dir.path().join("credential").display()
            ),
        );
        config
    };
    let table = || {
        read_table_with(
            &url,
            &["--catalog-name", "rest", "--namespace", &namespace],
            &[("SINK_TABLE__CREDENTIAL", "sink-client:s3cret")],
        )
    };
    let after =
        add_a_field_while_landing(dir.path(), (&bootstrap, &producer), 2, config, table).await;
    let location = after["metadata_location"].as_str().unwrap();
    assert!(
        location.contains("/landing/sensor_readings/metadata/"),
        "{location}"
    );
    // Trino reads the same snapshot through the same catalog: as many rows, the new column's
    // values, and the same offsets.
    let trino = common::trino::Trino::start(
        &dir.path().join("trino"),
        &format!(
            "iceberg.catalog.type=rest\niceberg.rest-catalog.uri={url}\nfs.native-local.enabled=true\nlocal.location=/\n"
        ),
    );
    let rows = after["rows"].as_array().unwrap();
    let offsets: i64 = rows.iter().map(|r| r["_offset"].as_i64().unwrap()).sum();
    let got = trino
        .query(&format!(
            "SELECT count(*), count(humidity), sum(_offset), count(DISTINCT (_kafka_partition, _offset)) FROM iceberg.\"{namespace}\".sensor_readings"
        ))
        .await;
    assert_eq!(
        got,
        [[
            serde_json::json!(rows.len()),
            serde_json::json!(30),
            serde_json::json!(offsets),
            serde_json::json!(rows.len())
        ]]
    );
    drop(cluster);
}

/// A REST catalog that refuses the sink's client credentials stops the sink at start with the
/// catalog's refusal. Apache Iceberg's REST fixture hands a token to any credentials, so this
/// runs against `scripts/rest_catalog.py` (the REST protocol over pyiceberg's SqlCatalog, with
/// `--credential`), which refuses a wrong secret as an OAuth2 server does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rest_catalog_refusing_the_credentials_stops_the_sink_at_start() {
    let (cluster, bootstrap, dir, _producer) = rig(1);
    let server = RestServer::start(dir.path(), "sink-client:s3cret");
    std::fs::write(dir.path().join("wrong"), "sink-client:guess").unwrap();
    let bad = write_config(
        dir.path(),
        &bootstrap,
        &common::repo_root().join("streams"),
        (&server.url, "rest"),
    );
    append(
        &bad,
        &format!(
            "credential_file = \"{}\"\n",
            dir.path().join("wrong").display()
        ),
    );
    let mut refused = start_sink(&bad, &dir.path().join("refused.log"));
    let status = wait_exit(&mut refused, Duration::from_secs(30));
    let log = std::fs::read_to_string(dir.path().join("refused.log")).unwrap();
    assert!(
        !status.success() && log.contains("refused the client credentials of sink-client"),
        "{status:?}: {log}"
    );
    drop(cluster);
}

/// Lands 300 readings with `sinks` sinks, adds a float field to the stream's definition and
/// lands 30 readings that have it; `table` then reads a table whose new column has a new id,
/// null in the rows landed before. Returns the last read.
async fn add_a_field_while_landing(
    dir: &Path,
    (bootstrap, producer): (&str, &FutureProducer),
    sinks: usize,
    config: impl Fn(&Path) -> PathBuf,
    table: impl Fn() -> Value,
) -> Value {
    let streams = dir.join("streams");
    std::fs::create_dir(&streams).unwrap();
    let file = streams.join("sensor_readings.toml");
    let shipped = include_str!("../../streams/sensor_readings.toml");
    std::fs::write(&file, shipped).unwrap();
    let config = config(&streams);
    let mut sinks: Vec<Child> = (0..sinks)
        .map(|i| start_sink(&config, &dir.join(format!("sink-{i}.log"))))
        .collect();
    let plain = support::readings(300, 3);
    support::produce(producer, TOPIC, &plain).await;
    support::wait_caught_up(bootstrap, (GROUP, TOPIC), &mut sinks, dir).await;
    let before = table();
    assert!(
        before["schema"]
            .as_array()
            .unwrap()
            .iter()
            .all(|f| f["name"] != "humidity")
    );

    std::fs::write(
        &file,
        format!(
            "{}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n",
            shipped.replace("version = 1", "version = 2")
        ),
    )
    .unwrap();
    let humid: Vec<Value> = (0..30)
        .map(|i| {
            serde_json::json!({
                "device_id": format!("dev-{:03}", i % 7),
                "sensor": "humidity",
                "ts": 1_767_230_000_000i64 + i,
                "value": 1.0,
                "humidity": 50.0 + i as f64,
            })
        })
        .collect();
    support::produce(producer, TOPIC, &humid).await;
    support::wait_caught_up(bootstrap, (GROUP, TOPIC), &mut sinks, dir).await;
    support::stop_gracefully(sinks);
    let after = table();
    let humidity = after["schema"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == "humidity")
        .expect("a humidity column");
    // After the 10 columns and the map's key and value of the first schema.
    assert_eq!(humidity["id"], 13, "{humidity}");
    assert_eq!(humidity["required"], false);
    let rows = after["rows"].as_array().unwrap();
    assert_eq!(rows.len(), plain.len() - duplicates(&plain) + humid.len());
    let mut values: Vec<f64> = rows.iter().filter_map(|r| r["humidity"].as_f64()).collect();
    values.sort_by(f64::total_cmp);
    let expected: Vec<f64> = (0..30).map(|i| 50.0 + i as f64).collect();
    assert_eq!(
        values, expected,
        "old rows read as null, new ones with their value"
    );
    common::assert_duckdb_reads_the_same(&after);
    after
}

/// `scripts/rest_catalog.py` serving a catalog in `dir`, stopped when dropped.
struct RestServer {
    child: Child,
    url: String,
}

impl RestServer {
    /// Starts it wanting `credential` (`client_id:secret`) and handing out a prefix.
    fn start(dir: &Path, credential: &str) -> RestServer {
        use std::io::BufRead;
        let mut child = Command::new(common::service_env("EDGE_INGEST_PYTHON"))
            .arg(common::repo_root().join("scripts/rest_catalog.py"))
            .arg("--catalog")
            .arg(dir.join("rest.db"))
            .arg("--warehouse")
            .arg(dir.join("warehouse"))
            .args(["--prefix", "wh", "--credential", credential])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("rest.log")).unwrap())
            .spawn()
            .expect("cannot start the REST catalog");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("the REST catalog did not start: {line:?}"));
        RestServer {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for RestServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn append(file: &Path, text: &str) {
    let mut all = std::fs::read_to_string(file).unwrap();
    all.push_str(text);
    std::fs::write(file, all).unwrap();
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "the sink did not exit");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The table is partitioned by day of ingest time, each file in the partition of the date its
/// key names; every file's manifest entry bounds its event time, ingest time, offsets, device
/// and value, and the bounds hold every value in the file (read by pyarrow); a scan filtered on
/// event time from `since` (µs) skips files by those bounds and returns exactly the rows from
/// `since` on.
fn assert_partitions_and_bounds(table: &Value, since: i64) {
    assert_eq!(
        table["partition_spec"],
        serde_json::json!([{"name": "_ingest_ts_day", "source": "_ingest_ts", "transform": "day"}])
    );
    let files = table["file_stats"].as_array().unwrap();
    assert_eq!(files.len(), table["files"].as_array().unwrap().len());
    for file in files {
        let path = file["path"].as_str().unwrap();
        let date = path.split("/date=").nth(1).unwrap().get(..10).unwrap();
        let days = chrono::NaiveDate::parse_from_str(date, "%Y-%m-%d")
            .unwrap()
            .signed_duration_since(chrono::NaiveDate::default())
            .num_days();
        assert_eq!(file["partition"]["_ingest_ts_day"], days, "{path}");
        assert_bounds_hold(file);
    }
    let expected = table["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["ts"].as_i64().unwrap() >= since)
        .count();
    let filtered = &table["filtered"];
    assert_eq!(filtered["rows"], expected as u64);
    assert!(
        filtered["files"].as_u64().unwrap() < files.len() as u64,
        "a filter on the last quarter of event times skipped no file: {filtered}"
    );
}

/// The manifest's bounds of a file of pyiceberg's `file_stats` hold the true minimum and
/// maximum of its columns, and it has rows.
pub(crate) fn assert_bounds_hold(file: &Value) {
    let path = file["path"].as_str().unwrap();
    let columns = file["columns"].as_object().unwrap();
    for name in [
        "ts",
        "_ingest_ts",
        "_offset",
        "_kafka_partition",
        "device_id",
        "value",
    ] {
        let c = &columns
            .get(name)
            .unwrap_or_else(|| panic!("{path}: no bounds of {name}"));
        let (lower, upper, min, max) = (&c["lower"], &c["upper"], &c["min"], &c["max"]);
        let holds = match (lower.as_str(), upper.as_str()) {
            (Some(l), Some(u)) => l <= min.as_str().unwrap() && u >= max.as_str().unwrap(),
            _ => {
                lower.as_f64().unwrap() <= min.as_f64().unwrap()
                    && upper.as_f64().unwrap() >= max.as_f64().unwrap()
            }
        };
        assert!(holds, "{path}: bounds of {name} {c} do not hold its values");
    }
    let rows = file["value_counts"]["ts"].as_u64().unwrap();
    assert!(
        rows > 0 && file["null_counts"]["unit"] == 0,
        "{path}: {file}"
    );
}

/// The dead-letter table holds each of `garbage` once, at an offset of its own, with the
/// stream it was sent to and a reason; DuckDB reads as many rows.
fn assert_dead_letters_once(table: &Value, garbage: &[String]) {
    let rows = table["rows"].as_array().unwrap();
    let mut payloads: Vec<String> = rows
        .iter()
        .map(|r| String::from_utf8(hex::decode(r["payload"].as_str().unwrap()).unwrap()).unwrap())
        .collect();
    payloads.sort();
    let mut expected = garbage.to_vec();
    expected.sort();
    assert_eq!(payloads, expected, "the dead-letter table: {rows:?}");
    let mut at: Vec<(i64, i64)> = rows
        .iter()
        .map(|r| {
            (
                r["partition"].as_i64().unwrap(),
                r["offset"].as_i64().unwrap(),
            )
        })
        .collect();
    at.sort_unstable();
    at.dedup();
    assert_eq!(at.len(), garbage.len(), "two dead letters at one offset");
    assert!(rows.iter().all(|r| r["stream"] == "sensor_readings"
        && r["topic"] == TOPIC
        && !r["reason"].as_str().unwrap().is_empty()));
    assert_eq!(table["duckdb"]["rows"], garbage.len() as u64);
}

/// How many of `records` repeat an earlier one.
pub(crate) fn duplicates(records: &[Value]) -> usize {
    let mut seen: Vec<String> = records.iter().map(Value::to_string).collect();
    seen.sort();
    let all = seen.len();
    seen.dedup();
    all - seen.len()
}

/// A thousand commits of one file each: the current snapshot's manifests are merged past 32,
/// snapshots past 64 expire and the metadata log keeps 100 entries, so the table's metadata
/// stays bounded while every file stays listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_commits_keep_the_metadata_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("zone");
    std::fs::create_dir_all(&root).unwrap();
    let store = sink::store::ObjectStore::Local(root.clone());
    let catalog = dir.path().join("catalog.db");
    let config: sink::table::TableConfig =
        serde_json::from_value(serde_json::json!({ "catalog": catalog })).unwrap();
    let mut tables = sink::table::Tables::open(&config, store, "landing")
        .await
        .unwrap();
    let def: Arc<schemas::StreamDef> =
        service_kit::load_stream(&common::repo_root().join("streams"), "sensor_readings").unwrap();
    let started = Instant::now();
    commit_one_file_each(&mut tables, &def, 1_000).await;
    // Files committed again (a sink that adopted them) are found in the table, not added.
    tables.landed(ten_rows(&def, 3, 9_990, "hour=05/f999"));
    assert_eq!(tables.commit().await, [(TOPIC.to_owned(), 3)]);
    // A file the offsets place in the table but that it does not list (a topic created again
    // while the table kept the old one's): not appended, and held back with its partition.
    let stray = |first: i64| ten_rows(&def, 2, first, &format!("hour=06/again-{first}"));
    tables.landed(stray(0));
    tables.landed(stray(10_000));
    assert!(tables.commit().await.is_empty());
    assert_eq!(tables.held_from(TOPIC, 2), Some(0));
    eprintln!("1,001 commits in {:?}", started.elapsed());
    let table = read_table(&catalog, &["--files-only"]);
    assert_eq!(table["files"].as_array().unwrap().len(), 1_000);
    assert_eq!(table["summary"]["total-data-files"], "1000");
    assert!(
        table["manifests"].as_u64().unwrap() <= 33,
        "{}",
        table["manifests"]
    );
    assert!(
        table["snapshots"].as_u64().unwrap() <= 64,
        "{}",
        table["snapshots"]
    );
    assert!(
        table["metadata_log"].as_u64().unwrap() <= 100,
        "{}",
        table["metadata_log"]
    );
    // What stays in the store: the metadata files of the log, the manifest lists of the kept
    // snapshots and the manifests (those only expired snapshots listed too).
    let sizes = |suffix: &str| -> (usize, u64) {
        std::fs::read_dir(root.join("landing/sensor_readings/metadata"))
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.file_name().to_string_lossy().ends_with(suffix))
            .fold((0, 0), |(n, b), e| (n + 1, b + e.metadata().unwrap().len()))
    };
    let (metadata_files, metadata_bytes) = sizes(".metadata.json");
    assert!(metadata_files <= 101, "{metadata_files} metadata files");
    let (lists, _) = sizes(".avro");
    eprintln!("metadata: {metadata_files} files, {metadata_bytes} bytes; {lists} Avro files");
    let current = table["metadata_location"].as_str().unwrap();
    let current = std::fs::metadata(current.strip_prefix("file://").unwrap())
        .unwrap()
        .len();
    assert!(
        current < 256 << 10,
        "the current metadata file is {current} bytes"
    );
}

/// A landed file of ten rows of partition `partition` from offset `first`, named `name` under
/// the stream's folder of one day.
fn ten_rows(
    def: &Arc<schemas::StreamDef>,
    partition: i32,
    first: i64,
    name: &str,
) -> sink::table::Landed {
    sink::table::Landed {
        kind: sink::table::TableKind::Stream,
        def: def.clone(),
        hash: schemas::arrow::HashColumn::None,
        topic: TOPIC.into(),
        partition,
        first,
        last: first + 9,
        key: format!("landing/sensor_readings/date=2026-11-28/{name}.parquet"),
        rows: 10,
        size: 1_000,
        stats: Default::default(),
        landed_at: Instant::now(),
    }
}

/// `n` commits of one file each, spread over four partitions.
async fn commit_one_file_each(
    tables: &mut sink::table::Tables,
    def: &Arc<schemas::StreamDef>,
    n: i64,
) {
    for i in 0..n {
        let partition = (i % 4) as i32;
        tables.landed(ten_rows(def, partition, i * 10, &format!("hour=05/f{i}")));
        let done = tables.commit().await;
        assert_eq!(done, [(TOPIC.to_owned(), partition)], "commit {i}");
    }
}

/// Commits through Apache Iceberg's REST catalog server past the snapshots a table keeps: the
/// old ones are expired by the commits' own updates, and every file stays listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_through_a_rest_catalog_expire_old_snapshots() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("zone");
    std::fs::create_dir_all(&root).unwrap();
    let url = common::service_env("EDGE_INGEST_ICEBERG_REST");
    let namespace = format!("expiry{}", common::unique_id());
    std::fs::write(dir.path().join("credential"), "client:secret").unwrap();
    let config: sink::table::TableConfig = serde_json::from_value(serde_json::json!({
        "catalog": url,
        "namespace": namespace,
        "credential_file": dir.path().join("credential"),
    }))
    .unwrap();
    let store = sink::store::ObjectStore::Local(root);
    let mut tables = sink::table::Tables::open(&config, store.clone(), "landing")
        .await
        .unwrap();
    let def: Arc<schemas::StreamDef> =
        service_kit::load_stream(&common::repo_root().join("streams"), "sensor_readings").unwrap();
    commit_one_file_each(&mut tables, &def, 70).await;
    let table = read_table_with(
        &url,
        &[
            "--catalog-name",
            "rest",
            "--namespace",
            &namespace,
            "--files-only",
        ],
        &[("SINK_TABLE__CREDENTIAL", "client:secret")],
    );
    assert_eq!(table["files"].as_array().unwrap().len(), 70);
    assert_eq!(table["summary"]["total-data-files"], "70");
    assert_eq!(table["snapshots"], 64, "{}", table["snapshots"]);
    // Two commits built on one version: the catalog takes the first and refuses the second.
    use sink::table::{catalog, metadata};
    let catalog = catalog::Catalog::open(&config).await.unwrap();
    let base = catalog
        .load(&store, &namespace, "sensor_readings")
        .await
        .unwrap()
        .unwrap();
    let mut outcomes = Vec::new();
    for i in 0..2 {
        let file = ten_rows(&def, 0, 10_000 + i * 10, &format!("hour=06/raced-{i}"));
        let added = metadata::data_file(&base.metadata, store.uri(&file.key), &file).unwrap();
        let append = metadata::append(
            &base.metadata,
            &base.location,
            (Vec::new(), Vec::new()),
            vec![added],
            &metadata::offsets(&base.metadata).unwrap(),
            &Default::default(),
        )
        .await
        .unwrap();
        for (path, bytes) in &append.files {
            store
                .put_if_absent(&store.key_of(path).unwrap(), bytes.clone())
                .await
                .unwrap();
        }
        let done = catalog
            .commit(&store, (&namespace, "sensor_readings"), &base, append)
            .await
            .unwrap();
        outcomes.push(done.is_some());
    }
    assert_eq!(outcomes, [true, false]);
}
