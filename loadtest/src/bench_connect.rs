//! Kafka Connect's Iceberg sink beside ours in `bench-sink --connect-jars`: Apache Kafka
//! Connect (a standalone worker, one task) with Apache Iceberg's sink connector reads the same
//! topic into a table of its own in an Iceberg REST catalog, committing as often as our sink
//! with a table does. Its records per CPU-second count from the moment its task runs (the
//! JVM's start-up apart, as the sink's is) until the table's current snapshot holds every
//! record; its peak RSS is the worker process's.

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
    let control = format!("{prefix}connect-control{round}");
    let client = reqwest::Client::new();
    let rest = opts.rest_catalog.trim_end_matches('/');
    let created = client
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
    create_topic(brokers, &control).await?;
    let port = free_port()?;
    let worker = dir.path().join("worker.properties");
    std::fs::write(
        &worker,
        format!(
            "bootstrap.servers={brokers}\nkey.converter=org.apache.kafka.connect.storage.StringConverter\n\
             value.converter=org.apache.kafka.connect.json.JsonConverter\nvalue.converter.schemas.enable=false\n\
             offset.storage.file.filename={}\nlisteners=http://127.0.0.1:{port}\nplugin.discovery=only_scan\n",
            dir.path().join("offsets").display()
        ),
    )?;
    let connector = dir.path().join("iceberg.properties");
    std::fs::write(
        &connector,
        format!(
            "name={name}\nconnector.class=org.apache.iceberg.connect.IcebergSinkConnector\ntasks.max=1\n\
             topics={topic}\niceberg.tables={name}.readings\niceberg.tables.auto-create-enabled=true\n\
             iceberg.catalog.type=rest\niceberg.catalog.uri={rest}\niceberg.control.topic={control}\n\
             iceberg.control.commit.interval-ms={commit_ms}\n"
        ),
    )?;
    let log = dir.path().join("connect.log");
    let child = Command::new(java())
        .args(["-Xmx1g", "-cp"])
        .arg(format!("{}/*", opts.jars.display()))
        .arg("org.apache.kafka.connect.cli.ConnectStandalone")
        .arg(&worker)
        .arg(&connector)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log)?)
        .stderr(Stdio::inherit())
        .spawn()
        .context("cannot run java for Kafka Connect")?;
    let mut worker = Worker(child);
    let pid = worker.0.id();
    let deadline = Instant::now() + Duration::from_secs(600);
    // Its task runs: the start-up is over.
    let status_url = format!("http://127.0.0.1:{port}/connectors/{name}/status");
    loop {
        if let Ok(r) = client.get(&status_url).send().await
            && let Ok(v) = json(r).await
            && v["tasks"][0]["state"] == "RUNNING"
        {
            break;
        }
        check_alive(&mut worker, &log, deadline)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (startup_cpu, _) = usage(pid)?;
    let started = Instant::now();
    let table_url = format!("{rest}/v1/namespaces/{name}/tables/readings");
    let (files, snapshots, rows) = loop {
        if let Ok(r) = client.get(&table_url).send().await
            && r.status().is_success()
            && let Ok(v) = json(r).await
            && let Some(done) = counts(&v["metadata"])
            && done.2 >= records as u64
        {
            break done;
        }
        check_alive(&mut worker, &log, deadline)?;
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
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let new = NewTopic::new(topic, 1, TopicReplication::Fixed(1));
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
