//! Kafka Connect's Iceberg sink beside ours in `bench-sink --connect-jars`: Apache Kafka
//! Connect (a standalone worker, one task) with Apache Iceberg's sink connector reads the same
//! topic into a table of its own in an Iceberg REST catalog, committing as often as our sink
//! with a table does. Its records per CPU-second count from the moment its task runs (the
//! JVM's start-up apart, as the sink's is) until the table's current snapshot holds every
//! record; its peak RSS is the worker process's. [`kill_loop`] kills the worker at random
//! while records flow and counts what its table lost and repeated.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;

use crate::bench_gateway::Throughput;

/// What runs Kafka Connect: the jars of `scripts/kafka-connect/pom.xml` and the REST catalog
/// its table goes to.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub jars: PathBuf,
    pub rest_catalog: String,
}

/// One run of Kafka Connect's Iceberg sink over the benchmark topic.
#[derive(Debug, Serialize)]
pub struct ConnectRun {
    /// CPU time from the worker's start until its task runs (not in `throughput`).
    pub startup_cpu_seconds: f64,
    /// From its task running until the table holds every record.
    pub throughput: Throughput,
    pub peak_rss_bytes: u64,
    /// Data files and snapshots of its table at the end.
    pub files: u64,
    pub snapshots: u64,
    /// Rows in the table at the end (more than the records would be duplicates).
    pub rows: u64,
}

/// A process's CPU seconds (user + system) and peak RSS, from `/proc`.
fn usage(pid: u32) -> anyhow::Result<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("/proc stat")?
        .1
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    let hz = rustix::param::clock_ticks_per_second() as f64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024);
    Ok((ticks / hz, rss))
}

/// The worker, killed when dropped.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A connector of its own over a topic: its name (also its table's namespace), the worker's
/// and the connector's properties, its REST port and its log, in a directory of the run's.
struct Setup {
    name: String,
    worker: PathBuf,
    connector: PathBuf,
    port: u16,
    log: PathBuf,
}

impl Setup {
    async fn new(
        opts: &ConnectOptions,
        brokers: &str,
        (name, topic): (String, &str),
        commit_ms: u64,
        dir: &Path,
    ) -> anyhow::Result<Setup> {
        let rest = opts.rest_catalog.trim_end_matches('/');
        let created = reqwest::Client::new()
            .post(format!("{rest}/v1/namespaces"))
            .header("content-type", "application/json")
            .body(serde_json::json!({ "namespace": [name] }).to_string())
            .send()
            .await
            .with_context(|| format!("the REST catalog at {rest}"))?;
        if !created.status().is_success() {
            bail!(
                "the REST catalog refused the namespace {name}: {}",
                created.text().await?
            );
        }
        let control = format!("{name}-control");
        create_topic(brokers, &control).await?;
        let port = free_port()?;
        let worker = dir.join("worker.properties");
        std::fs::write(
            &worker,
            format!(
                "bootstrap.servers={brokers}\nkey.converter=org.apache.kafka.connect.storage.StringConverter\n\
                 value.converter=org.apache.kafka.connect.json.JsonConverter\nvalue.converter.schemas.enable=false\n\
                 offset.storage.file.filename={}\nlisteners=http://127.0.0.1:{port}\nplugin.discovery=only_scan\n",
                dir.join("offsets").display()
            ),
        )?;
        let connector = dir.join("iceberg.properties");
        std::fs::write(
            &connector,
            format!(
                "name={name}\nconnector.class=org.apache.iceberg.connect.IcebergSinkConnector\ntasks.max=1\n\
                 topics={topic}\niceberg.tables={name}.readings\niceberg.tables.auto-create-enabled=true\n\
                 iceberg.catalog.type=rest\niceberg.catalog.uri={rest}\niceberg.control.topic={control}\n\
                 iceberg.control.commit.interval-ms={commit_ms}\n"
            ),
        )?;
        Ok(Setup {
            name,
            worker,
            connector,
            port,
            log: dir.join("connect.log"),
        })
    }

    /// Starts the worker (its log appended to).
    fn spawn(&self, opts: &ConnectOptions) -> anyhow::Result<Worker> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(java())
            .args(["-Xmx1g", "-cp"])
            .arg(format!("{}/*", opts.jars.display()))
            .arg("org.apache.kafka.connect.cli.ConnectStandalone")
            .arg(&self.worker)
            .arg(&self.connector)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot run java for Kafka Connect")?;
        Ok(Worker(child))
    }

    /// The table's metadata, once it exists.
    async fn table(&self, opts: &ConnectOptions) -> Option<serde_json::Value> {
        let rest = opts.rest_catalog.trim_end_matches('/');
        let url = format!("{rest}/v1/namespaces/{}/tables/readings", self.name);
        let r = reqwest::Client::new().get(url).send().await.ok()?;
        if !r.status().is_success() {
            return None;
        }
        Some(json(r).await.ok()?["metadata"].clone())
    }

    /// Waits until the worker's task runs (its REST API says so).
    async fn wait_running(&self, worker: &mut Worker, deadline: Instant) -> anyhow::Result<()> {
        let url = format!(
            "http://127.0.0.1:{}/connectors/{}/status",
            self.port, self.name
        );
        let client = reqwest::Client::new();
        loop {
            if let Ok(r) = client.get(&url).send().await
                && let Ok(v) = json(r).await
                && v["tasks"][0]["state"] == "RUNNING"
            {
                return Ok(());
            }
            check_alive(worker, &self.log, deadline)?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Runs Kafka Connect's Iceberg sink over `topic` (which holds `records` records of
/// `raw_bytes`) into a table of a namespace of its own (`round` tells them apart).
pub async fn run(
    opts: &ConnectOptions,
    brokers: &str,
    (prefix, topic, round): (&str, &str, usize),
    (records, raw_bytes): (usize, usize),
    commit_ms: u64,
) -> anyhow::Result<ConnectRun> {
    let dir = tempfile::tempdir()?;
    let name = format!("{}connect{round}", prefix.replace('.', ""));
    let setup = Setup::new(opts, brokers, (name, topic), commit_ms, dir.path()).await?;
    let mut worker = setup.spawn(opts)?;
    let pid = worker.0.id();
    let deadline = Instant::now() + Duration::from_secs(600);
    setup.wait_running(&mut worker, deadline).await?;
    let (startup_cpu, _) = usage(pid)?;
    let started = Instant::now();
    let (files, snapshots, rows) = loop {
        if let Some(meta) = setup.table(opts).await
            && let Some(done) = counts(&meta)
            && done.2 >= records as u64
        {
            break done;
        }
        check_alive(&mut worker, &setup.log, deadline)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let seconds = started.elapsed().as_secs_f64();
    let (cpu, peak_rss_bytes) = usage(pid)?;
    drop(worker);
    Ok(ConnectRun {
        startup_cpu_seconds: startup_cpu,
        throughput: Throughput::new(records, raw_bytes, seconds, cpu - startup_cpu),
        peak_rss_bytes,
        files,
        snapshots,
        rows,
    })
}

/// What a kill loop found in Kafka Connect's table.
#[derive(Debug, Serialize)]
pub struct KillLoopReport {
    pub seconds: u64,
    pub kills: u32,
    pub produced: usize,
    pub rows: usize,
    pub missing: usize,
    pub duplicated: usize,
}

/// Produces `records` distinct readings to a topic of 8 partitions over about `seconds`
/// while Kafka Connect's Iceberg sink reads them, its worker killed with SIGKILL 3 to 8 seconds
/// after its task runs and started again at once; then lets the last worker run until its
/// table holds every reading and has not changed for 10 s (or has not changed for 120 s), and
/// counts the readings it lacks and those it holds more than once.
pub async fn kill_loop(
    opts: &ConnectOptions,
    brokers: &str,
    prefix: &str,
    (records, seconds): (usize, u64),
    commit_ms: u64,
) -> anyhow::Result<KillLoopReport> {
    use rand::Rng;
    let dir = tempfile::tempdir()?;
    let topic = format!("{prefix}kills");
    create_topic_with(brokers, &topic, 8).await?;
    let name = format!("{}kills", prefix.replace('.', ""));
    let setup = Setup::new(opts, brokers, (name.clone(), &topic), commit_ms, dir.path()).await?;
    let base_ts = 1_767_225_600_000i64;
    let producing = {
        let (brokers, topic) = (brokers.to_owned(), topic.clone());
        tokio::spawn(
            async move { produce_paced(&brokers, &topic, records, seconds, base_ts).await },
        )
    };
    let mut kills = 0;
    let deadline = Instant::now() + Duration::from_secs(seconds + 900);
    let mut worker = setup.spawn(opts)?;
    while !producing.is_finished() {
        // Killed 3 to 8 s after its task runs (a JVM takes longer than that to start here).
        setup.wait_running(&mut worker, deadline).await?;
        let wait = rand::rng().random_range(3_000..8_000);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        drop(worker); // SIGKILL, and waited for
        kills += 1;
        eprintln!("bench: killed Kafka Connect's worker ({kills})");
        worker = setup.spawn(opts)?;
    }
    producing.await??;
    // The last worker runs until its table holds every reading and has not changed for 10 s,
    // or has not changed for 120 s.
    setup.wait_running(&mut worker, deadline).await?;
    let (mut last, mut since) = (None, Instant::now());
    loop {
        check_alive(&mut worker, &setup.log, deadline)?;
        let now = setup.table(opts).await.and_then(|m| counts(&m));
        if now != last {
            (last, since) = (now, Instant::now());
        }
        let all = last.is_some_and(|(_, _, rows)| rows >= records as u64);
        if since.elapsed() > Duration::from_secs(if all { 10 } else { 120 }) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(worker);
    let landed = table_readings(&opts.rest_catalog, &name).await?;
    let mut distinct = landed.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let found = distinct
        .iter()
        .filter(|(device, ts)| {
            let i = ts - base_ts;
            (0..records as i64).contains(&i) && *device == device_of(i as usize)
        })
        .count();
    Ok(KillLoopReport {
        seconds,
        kills,
        produced: records,
        rows: landed.len(),
        missing: records - found,
        duplicated: landed.len() - distinct.len(),
    })
}

/// The device of reading `i` of a kill loop.
fn device_of(i: usize) -> String {
    format!("dev-{:03}", i % 50)
}

/// Produces `records` readings (reading `i` of device [`device_of`] at `base_ts + i` ms) over
/// about `seconds`, each acknowledged.
async fn produce_paced(
    brokers: &str,
    topic: &str,
    records: usize,
    seconds: u64,
    base_ts: i64,
) -> anyhow::Result<()> {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .create()?;
    let started = Instant::now();
    let per_record = seconds as f64 / records.max(1) as f64;
    let mut pending = Vec::new();
    for i in 0..records {
        let device = device_of(i);
        let value = serde_json::json!({
            "device_id": device, "sensor": "temperature", "ts": base_ts + i as i64,
            "value": i as f64 * 0.5, "unit": "C",
        })
        .to_string();
        let record = FutureRecord::to(topic).key(&device).payload(&value);
        pending.push(
            producer
                .send_result(record)
                .map_err(|(e, _)| anyhow::anyhow!("produce: {e}"))?,
        );
        let due = Duration::from_secs_f64(per_record * (i + 1) as f64);
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
    for p in pending {
        p.await?.map_err(|(e, _)| anyhow::anyhow!("produce: {e}"))?;
    }
    Ok(())
}

/// `(device_id, ts)` of every row of the current snapshot of `<namespace>.readings`, read from
/// its data files (Connect's appends write no delete files).
async fn table_readings(rest: &str, namespace: &str) -> anyhow::Result<Vec<(String, i64)>> {
    use arrow::array::{Array, AsArray};
    let mut config = sink::table::TableConfig::new(rest.to_owned());
    config.namespace = namespace.to_owned();
    let store = sink::store::ObjectStore::Local(PathBuf::from("/"));
    let files = sink::table::current_files(&config, &store, "readings")
        .await?
        .context("Kafka Connect's table is missing")?;
    let mut out = Vec::new();
    for file in files {
        anyhow::ensure!(
            file.content == sink::table::FileContent::Data,
            "Kafka Connect's table has delete files"
        );
        let bytes = bytes::Bytes::from(std::fs::read(Path::new("/").join(&file.key))?);
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(bytes)?
            .build()?;
        for batch in reader {
            let batch = batch?;
            let devices = batch
                .column_by_name("device_id")
                .context("no device_id column")?
                .as_string::<i32>()
                .clone();
            let ts = batch
                .column_by_name("ts")
                .context("no ts column")?
                .as_primitive::<arrow::datatypes::Int64Type>()
                .clone();
            for i in 0..batch.num_rows() {
                if devices.is_valid(i) && ts.is_valid(i) {
                    out.push((devices.value(i).to_owned(), ts.value(i)));
                }
            }
        }
    }
    Ok(out)
}

async fn json(r: reqwest::Response) -> anyhow::Result<serde_json::Value> {
    Ok(serde_json::from_slice(&r.bytes().await?)?)
}

/// Data files, snapshots and rows of a table's metadata (its current snapshot's summary).
fn counts(metadata: &serde_json::Value) -> Option<(u64, u64, u64)> {
    let current = metadata["current-snapshot-id"].as_i64()?;
    let snapshots = metadata["snapshots"].as_array()?;
    let summary = &snapshots
        .iter()
        .find(|s| s["snapshot-id"].as_i64() == Some(current))?["summary"];
    let number = |key: &str| summary[key].as_str()?.parse::<u64>().ok();
    Some((
        number("total-data-files")?,
        snapshots.len() as u64,
        number("total-records")?,
    ))
}

fn check_alive(worker: &mut Worker, log: &Path, deadline: Instant) -> anyhow::Result<()> {
    if let Some(status) = worker.0.try_wait()? {
        bail!(
            "Kafka Connect exited ({status}): {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }
    if Instant::now() > deadline {
        bail!(
            "Kafka Connect did not finish within 10 minutes: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }
    Ok(())
}

/// Creates the connector's control topic (one partition).
async fn create_topic(brokers: &str, topic: &str) -> anyhow::Result<()> {
    create_topic_with(brokers, topic, 1).await
}

async fn create_topic_with(brokers: &str, topic: &str, partitions: i32) -> anyhow::Result<()> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    for result in admin.create_topics([&new], &AdminOptions::new()).await? {
        result.map_err(|(t, code)| anyhow::anyhow!("cannot create topic {t}: {code}"))?;
    }
    Ok(())
}

/// `$JAVA_HOME/bin/java`, else `java`.
fn java() -> PathBuf {
    std::env::var_os("JAVA_HOME")
        .map(|h| PathBuf::from(h).join("bin/java"))
        .filter(|j| j.exists())
        .unwrap_or_else(|| PathBuf::from("java"))
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
