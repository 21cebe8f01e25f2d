//! The one-command demo on the embedded default: gateway, sink and a simulated agent in one
//! process, on librdkafka's in-process mock cluster and a local landing directory.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ingest_gateway::GatewayConfig;
use ingest_gateway::config::{AuthConfig, TokenConfig};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::mocking::MockCluster;
use schemas::wire::topic_name;
use schemas::{ContentHash, Streams};
use sink::SinkConfig;
use sink::config::{RotationConfig, StoreConfig};
use tokio_util::sync::CancellationToken;

use crate::fleet::{FleetSpec, Readings};
use crate::reduction::{DemoFilter, FilterReport, MAX_FILTER_RECORDS, ProcessFleet};
use crate::verify::{Verdict, compare, read_landing_dir};

const STREAM: &str = "sensor_readings";
const DEMO_TOKEN: &str = "demo-token";
/// The demo's table catalog name.
const DEMO_CATALOG: &str = "edge_ingest";

#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Root of the landing directory; each run writes under its own prefix.
    pub landing: PathBuf,
    pub fleet: FleetSpec,
    /// How long to wait for every record to land.
    pub timeout: Duration,
    /// The landing files' `_content_hash` column.
    pub hash_column: schemas::arrow::HashColumn,
    /// Commit the files to an Iceberg table per stream (a SQLite catalog in the landing
    /// directory, a namespace per run) and verify from the table; else plain files only.
    pub table: bool,
    /// Reduce process-like series with this filter on the agent, and check the landed rows
    /// against its bound instead of expecting every reading.
    pub filter: Option<DemoFilter>,
}

/// What the demo did, printed at the end.
#[derive(Debug)]
pub struct DemoSummary {
    pub generated: usize,
    pub distinct: usize,
    pub agent: edge_agent::AgentStats,
    pub sink_duplicates: u64,
    pub landed_rows: usize,
    pub files: Vec<crate::verify::LandedFile>,
    pub run_dir: PathBuf,
    /// The run's table of the stream: the catalog's SQLite file and the table's name.
    pub table: Option<(PathBuf, String)>,
    pub verdict: Verdict,
    /// With a filter: its reduction and the check of its bound.
    pub filter: Option<FilterReport>,
    pub elapsed: Duration,
}

impl DemoSummary {
    /// Whether the run verified: every record once (with a filter, every record the agent
    /// kept once, and the filter's bound held).
    pub fn passed(&self) -> bool {
        self.verdict.exactly_once() && self.filter.as_ref().is_none_or(FilterReport::holds)
    }
}

impl fmt::Display for DemoSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = self.agent.total();
        let dups = a.pipeline.duplicates + a.delivery.duplicates + self.sink_duplicates;
        writeln!(
            f,
            "edge-ingest demo: agent -> gateway -> Kafka (in-process mock) -> sink -> Parquet"
        )?;
        writeln!(
            f,
            "  records generated    {} ({} distinct)",
            self.generated, self.distinct
        )?;
        writeln!(
            f,
            "  sent by the agent    {} records in {} zstd batches through its spool, {} accepted by the gateway",
            a.pipeline.batched, a.delivery.batches, a.delivery.accepted
        )?;
        writeln!(
            f,
            "  duplicates dropped   {dups} (agent {}, gateway {}, sink {})",
            a.pipeline.duplicates, a.delivery.duplicates, self.sink_duplicates
        )?;
        writeln!(
            f,
            "  landed               {} rows in {} Parquet files",
            self.landed_rows,
            self.files.len()
        )?;
        let ratio = a.delivery.wire_bytes as f64 / a.delivery.raw_bytes.max(1) as f64;
        writeln!(
            f,
            "  bytes on the wire    {} (NDJSON {} bytes, ratio {ratio:.3})",
            a.delivery.wire_bytes, a.delivery.raw_bytes
        )?;
        if let Some(report) = &self.filter {
            writeln!(f, "{report}")?;
        }
        let v = &self.verdict;
        if v.exactly_once() {
            let from = match &self.table {
                Some((_, table)) => format!(" (read from table {table}'s snapshot)"),
                None => String::new(),
            };
            let what = match self.filter {
                Some(_) => "every record the agent kept",
                None => "every distinct record",
            };
            writeln!(f, "  verified             {what} landed exactly once{from}")?;
        } else {
            writeln!(
                f,
                "  VERIFICATION FAILED  {} missing, {} duplicated, {} unexpected",
                v.missing, v.duplicated, v.unexpected
            )?;
        }
        writeln!(f, "  files under          {}", self.run_dir.display())?;
        if let Some((catalog, table)) = &self.table {
            writeln!(
                f,
                "  query it (pyiceberg) python3 -c \"from pyiceberg.catalog.sql import SqlCatalog; print(SqlCatalog('{DEMO_CATALOG}', uri='sqlite:///{}').load_table('{table}').scan().to_arrow())\"",
                catalog.display()
            )?;
        }
        write!(
            f,
            "  took                 {:.1} s",
            self.elapsed.as_secs_f64()
        )
    }
}

/// Partitions of each topic of the embedded cluster.
const PARTITIONS: i32 = 3;

/// Readings that may wait between the readings file and the sink at once: lines of the file the
/// agent has not read, records in its spool and records in Kafka the sink has not taken. The
/// mock cluster keeps at most 5 MiB (or 100,000 record batches) of each partition and drops the
/// oldest past that, which a sink further behind would never read (it reports them as an offset
/// gap). The gateway's readings take about 60 bytes each in its zstd batches, so this many stay
/// under 2.5 MB even when they all wait in one partition.
pub const MAX_WAITING: u64 = 40_000;

/// Readings appended to the agent's file at a time.
const CHUNK: usize = 5_000;

/// The most readings a demo takes: their content hashes, and those of the landed rows, are
/// checked in memory (about 100 bytes per reading).
pub const MAX_RECORDS: usize = 10_000_000;

/// How long the sink may take to be assigned its partitions before the demo gives up.
const ASSIGN_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs the demo. The mock cluster is memory-only: nothing but the landing files survives.
///
/// The sink is assigned its partitions before the agent starts, and the readings are appended
/// to the agent's file (which it follows, as on an edge box) only while fewer than
/// [`MAX_WAITING`] wait on their way to the sink: so the mock cluster never holds more of a
/// partition than it keeps, whatever the number of readings.
pub async fn run(options: DemoOptions) -> anyhow::Result<DemoSummary> {
    let started = Instant::now();
    if options.fleet.records > MAX_RECORDS {
        bail!(
            "the embedded demo takes at most {MAX_RECORDS} readings (it checks their content hashes in memory); for more, run the components against Kafka and drive them with `loadtest send`"
        );
    }
    if options.filter.is_some() && options.fleet.records > MAX_FILTER_RECORDS {
        bail!(
            "demo --filter takes at most {MAX_FILTER_RECORDS} readings (the agent is given them at once, and what it keeps must fit the mock cluster)"
        );
    }
    tracing::warn!(
        "embedded mode: Kafka is librdkafka's in-process mock cluster; it is memory-only and not for production"
    );
    let streams = schemas::example_streams();
    let cluster = MockCluster::new(1).context("cannot start the mock Kafka cluster")?;
    let brokers = cluster.bootstrap_servers();
    for def in streams.iter() {
        cluster.create_topic(
            &topic_name(schemas::wire::DEFAULT_TOPIC_PREFIX, &def.name),
            PARTITIONS,
            1,
        )?;
    }
    let run_prefix = format!("demo-{}", chrono::Utc::now().format("%Y%m%dT%H%M%S%.3fZ"));
    // Each run's tables in a namespace of their own: a new mock cluster starts its offsets
    // again, which a table holding an earlier run's would take for files it has.
    let table = options.table.then(|| {
        let catalog = std::path::absolute(options.landing.join("catalog.db"))
            .unwrap_or_else(|_| options.landing.join("catalog.db"));
        sink::table::TableConfig {
            catalog_name: DEMO_CATALOG.into(),
            namespace: run_prefix.replace(['-', '.'], "_"),
            commit_interval_ms: 1_000,
            ..sink::table::TableConfig::new(catalog.display().to_string())
        }
    });
    let shutdown = CancellationToken::new();

    let gateway =
        ingest_gateway::start(gateway_config(&brokers), streams.clone(), shutdown.clone()).await?;
    let sink = sink::start(
        SinkConfig {
            table: table.clone(),
            ..sink_config(&brokers, &options.landing, &run_prefix, options.hash_column)
        },
        streams.clone(),
        shutdown.clone(),
    )
    .await?;

    let assigned = Instant::now();
    let partitions = PARTITIONS as u64 * streams.iter().count() as u64;
    while sink.stats.assigned_partitions.load(Ordering::Relaxed) < partitions {
        if assigned.elapsed() > ASSIGN_TIMEOUT {
            shutdown.cancel();
            bail!("the sink was not assigned its partitions within {ASSIGN_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The agent follows a file of the fleet's readings, as it would on an edge box.
    let agent_dir = options.landing.join(format!("{run_prefix}-agent"));
    std::fs::create_dir_all(&agent_dir)?;
    // With a filter, the agent reads a file of process-like series to its end (its filters
    // send each series' held last reading there) and stops once it delivered what it kept.
    let process = match options.filter {
        Some(filter) => {
            let def = streams.get(STREAM).context("no sensor_readings stream")?;
            Some((filter, ProcessFleet::generate(&options.fleet, def)?))
        }
        None => None,
    };
    let agent_config = match &process {
        Some((filter, fleet)) => file_agent(&FileAgent {
            dir: &agent_dir,
            ndjson: &fleet.ndjson(),
            gateway: gateway.addr,
            token: Some(DEMO_TOKEN),
            max_records: 2000,
            admin_listen: None,
            follow: false,
            more: &filter.toml(),
        })?,
        None => following_agent(&agent_dir, gateway.addr)?,
    };
    let agent_stop = shutdown.child_token();
    let agent = tokio::spawn(edge_agent::run(
        agent_config.clone(),
        streams.clone(),
        agent_stop.clone(),
    ));
    let watch = Watch {
        stats: sink.stats.clone(),
        lag: Lag::new(&brokers)?,
        timeout: options.timeout,
    };
    let (agent, landed) = match &process {
        None => {
            let fed = feed(&options.fleet, &streams, &agent_config, &agent_dir, &watch).await;
            let landed = match fed {
                Ok(expected) => watch
                    .landing(expected.len() as u64)
                    .await
                    .map(|()| expected),
                Err(e) => Err(e),
            };
            agent_stop.cancel();
            (agent.await.context("the agent's task failed")?, landed)
        }
        Some((_, fleet)) => {
            let agent = agent.await.context("the agent's task failed")?;
            let landed = match &agent {
                Ok(stats) => watch
                    .landing(stats.total().delivery.accepted)
                    .await
                    .map(|()| fleet.distinct()),
                Err(_) => Ok(HashSet::new()),
            };
            (agent, landed)
        }
    };
    shutdown.cancel();
    gateway.task.await??;
    sink.task.await??;
    // The gateway's reload handle holds its producer: the cluster goes after every client, or
    // the clients left log that all brokers are down.
    drop(gateway.reload);
    drop(watch);
    drop(cluster);
    let (agent, expected) = (agent?, landed?);

    let run_dir = options.landing.join(&run_prefix);
    let landed = match &table {
        Some(table) => {
            let store = sink::store::ObjectStore::Local(options.landing.clone());
            let def = streams.get(STREAM).context("no sensor_readings stream")?;
            crate::verify::read_table(&store, table, def).await?
        }
        None => read_landing_dir(&run_dir, &streams.iter().cloned().collect::<Vec<_>>())?,
    };
    let (verdict, filter) = match &process {
        Some((filter, fleet)) => {
            let stats = agent.streams.get(STREAM).cloned().unwrap_or_default();
            let (verdict, report) = crate::reduction::check(fleet, &landed, *filter, &stats);
            (verdict, Some(report))
        }
        None => (compare(&expected, &landed), None),
    };
    Ok(DemoSummary {
        generated: options.fleet.records,
        distinct: expected.len(),
        agent,
        sink_duplicates: sink.stats.duplicates_dropped.load(Ordering::Relaxed),
        landed_rows: landed.rows,
        verdict,
        filter,
        files: landed.files,
        run_dir,
        table: table.map(|t| {
            (
                PathBuf::from(t.catalog),
                format!("{}.{STREAM}", t.namespace),
            )
        }),
        elapsed: started.elapsed(),
    })
}

/// What the demo watches while it runs: the sink's counters and the records in Kafka that the
/// sink has not taken.
struct Watch {
    stats: Arc<sink::SinkStats>,
    lag: Lag,
    /// How long nothing may move before the demo gives up.
    timeout: Duration,
}

impl Watch {
    /// Fails once the sink found an offset gap: the mock cluster dropped records before the
    /// sink read them, and the demo cannot verify.
    fn check_gaps(&self) -> anyhow::Result<()> {
        let gaps = self.stats.offset_gaps.load(Ordering::Relaxed);
        if gaps > 0 {
            bail!(
                "the sink found {gaps} offset gap(s): the mock cluster dropped records before the sink read them (see the sink's ERROR log)"
            );
        }
        Ok(())
    }

    /// Waits until `distinct` rows landed; fails when nothing moved for the timeout.
    async fn landing(&self, distinct: u64) -> anyhow::Result<()> {
        let mut progress = Progress::new(self.timeout);
        loop {
            let written = self.stats.records_written.load(Ordering::Relaxed);
            if written >= distinct {
                return Ok(());
            }
            self.check_gaps()?;
            let taken = self.stats.records_received.load(Ordering::Relaxed);
            progress.check(written + taken, || {
                format!("only {written} of {distinct} records landed")
            })?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Records of the demo's topic that the sink has not taken: the partitions' end offsets, read
/// from the mock cluster, less the records the sink took.
struct Lag {
    consumer: Arc<BaseConsumer>,
    topic: String,
}

impl Lag {
    fn new(brokers: &str) -> anyhow::Result<Lag> {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .context("cannot make a client of the mock cluster")?;
        Ok(Lag {
            consumer: Arc::new(consumer),
            topic: topic_name(schemas::wire::DEFAULT_TOPIC_PREFIX, STREAM),
        })
    }

    async fn records(&self, taken: u64) -> anyhow::Result<u64> {
        let (consumer, topic) = (self.consumer.clone(), self.topic.clone());
        let ends = tokio::task::spawn_blocking(move || {
            (0..PARTITIONS)
                .map(|p| {
                    consumer
                        .fetch_watermarks(&topic, p, Duration::from_secs(5))
                        .map(|(_, end)| end)
                })
                .sum::<Result<i64, _>>()
        })
        .await?
        .context("cannot read the end offsets of the demo's topic")?;
        Ok((ends as u64).saturating_sub(taken))
    }
}

/// Fails when a count has not moved for its timeout.
struct Progress {
    last: u64,
    since: Instant,
    timeout: Duration,
}

impl Progress {
    fn new(timeout: Duration) -> Progress {
        Progress {
            last: 0,
            since: Instant::now(),
            timeout,
        }
    }

    fn check(&mut self, count: u64, what: impl FnOnce() -> String) -> anyhow::Result<()> {
        if count != self.last {
            (self.last, self.since) = (count, Instant::now());
        } else if self.since.elapsed() > self.timeout {
            bail!("{}: nothing moved for {:?}", what(), self.timeout);
        }
        Ok(())
    }
}

/// Appends the fleet's readings to the file the agent follows, [`CHUNK`] at a time, each chunk
/// once it fits under [`MAX_WAITING`] with the readings already on their way to the sink (lines
/// the agent has not read, its spool, Kafka's records the sink has not taken). Returns the
/// distinct content hashes of the readings.
async fn feed(
    fleet: &FleetSpec,
    streams: &Streams,
    agent: &edge_agent::AgentConfig,
    dir: &Path,
    watch: &Watch,
) -> anyhow::Result<HashSet<ContentHash>> {
    let def = streams
        .get(STREAM)
        .context("sensor_readings stream missing")?;
    let path = readings_file(dir);
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .with_context(|| format!("cannot append to {}", path.display()))?;
    let mut readings = Readings::new(fleet);
    let mut expected = HashSet::new();
    // The end in the file and the lines of each chunk appended, until the agent read past it.
    let mut unread: VecDeque<(u64, u64)> = VecDeque::new();
    let (mut chunk, mut lines, mut end) = (Vec::new(), 0u64, 0u64);
    let mut progress = Progress::new(watch.timeout);
    loop {
        if lines == 0 {
            for reading in readings.by_ref().take(CHUNK) {
                serde_json::to_writer(&mut chunk, &reading)?;
                chunk.push(b'\n');
                expected.insert(schemas::check(def, reading)?.hash);
                lines += 1;
            }
            if lines == 0 {
                return Ok(expected);
            }
        }
        watch.check_gaps()?;
        // The state directory's files (positions, spool segments) are read on the blocking pool.
        let status = {
            let agent = agent.clone();
            tokio::task::spawn_blocking(move || edge_agent::status::status(&agent, None)).await??
        };
        let read = status.files.first().map_or(0, |f| f.read_bytes);
        while unread
            .front()
            .is_some_and(|&(chunk_end, _)| chunk_end <= read)
        {
            unread.pop_front();
        }
        let in_file: u64 = unread.iter().map(|&(_, n)| n).sum();
        let spooled: u64 = status.streams.iter().map(|s| s.spool.records).sum();
        let taken = watch.stats.records_received.load(Ordering::Relaxed);
        let waiting = in_file + spooled + watch.lag.records(taken).await?;
        if waiting + lines <= MAX_WAITING {
            std::io::Write::write_all(&mut file, &chunk)
                .with_context(|| format!("cannot append to {}", path.display()))?;
            end += chunk.len() as u64;
            unread.push_back((end, lines));
            (lines, chunk) = (0, Vec::new());
        } else {
            progress.check(taken + read, || {
                format!("{taken} readings taken by the sink, {waiting} waiting")
            })?;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The distinct content hashes of generated records.
/// An agent that reads sensor readings from a file to its end and delivers them to a gateway.
#[derive(Debug, Clone, Copy)]
pub struct FileAgent<'a> {
    /// Holds the readings file and the agent's state directory.
    pub dir: &'a Path,
    /// The readings, as NDJSON.
    pub ndjson: &'a [u8],
    pub gateway: std::net::SocketAddr,
    pub token: Option<&'a str>,
    pub max_records: usize,
    pub admin_listen: Option<&'a str>,
    /// Follow the file for appended readings (until the agent is stopped), rather than read
    /// it to its end and stop.
    pub follow: bool,
    /// TOML appended to the config (a stream's filters, say).
    pub more: &'a str,
}

/// The demo's agent: it follows an empty readings file in `dir`, which [`feed`] fills, and
/// delivers to the demo's gateway at `gateway`.
fn following_agent(
    dir: &Path,
    gateway: std::net::SocketAddr,
) -> anyhow::Result<edge_agent::AgentConfig> {
    file_agent(&FileAgent {
        dir,
        ndjson: b"",
        gateway,
        token: Some(DEMO_TOKEN),
        max_records: 2000,
        admin_listen: None,
        follow: true,
        more: "",
    })
}

/// The file an agent of [`file_agent`] reads.
pub fn readings_file(dir: &Path) -> PathBuf {
    dir.join("readings.ndjson")
}

/// Writes the readings file of `agent` and returns the agent's config.
pub fn file_agent(agent: &FileAgent<'_>) -> anyhow::Result<edge_agent::AgentConfig> {
    let file = readings_file(agent.dir);
    std::fs::write(&file, agent.ndjson)?;
    let optional =
        |key: &str, value: Option<&str>| value.map_or(String::new(), |v| format!("{key} = {v:?}"));
    edge_agent::AgentConfig::parse(&format!(
        r#"
        state_dir = {state:?}
        {admin}
        [gateway]
        url = "http://{gateway}"
        {token}
        [batch]
        max_records = {max_records}
        [[sources]]
        type = "file"
        path = {file:?}
        stream = "{STREAM}"
        follow = {follow}
        poll_ms = 50
        {more}
        "#,
        state = agent.dir.join("state"),
        admin = optional("admin_listen", agent.admin_listen),
        gateway = agent.gateway,
        token = optional("token", agent.token),
        max_records = agent.max_records,
        follow = agent.follow,
        more = agent.more,
    ))
}

pub fn distinct_hashes(
    streams: &Streams,
    records: &[serde_json::Value],
) -> anyhow::Result<HashSet<ContentHash>> {
    let def = streams
        .get(STREAM)
        .context("sensor_readings stream missing")?;
    records
        .iter()
        .map(|r| Ok(schemas::check(def, r.clone())?.hash))
        .collect()
}

fn gateway_config(brokers: &str) -> GatewayConfig {
    let mut config = GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        admin_listen: None,
        auth: AuthConfig {
            allow_anonymous: false,
            tokens: vec![TokenConfig {
                name: "demo".into(),
                blake3: blake3_hex(DEMO_TOKEN),
                streams: vec!["*".into()],
                max_bytes_per_sec: None,
            }],
        },
        ..GatewayConfig::default()
    };
    config.kafka.brokers = brokers.to_owned();
    config.kafka.produce_timeout_ms = 10_000;
    config
}

fn sink_config(
    brokers: &str,
    landing: &std::path::Path,
    prefix: &str,
    hash: schemas::arrow::HashColumn,
) -> SinkConfig {
    let mut config = SinkConfig {
        landing: sink::config::LandingConfig {
            content_hash_bytes: sink::config::HashBytes(hash),
            ..Default::default()
        },
        store: StoreConfig::Local {
            path: landing.to_path_buf(),
        },
        key_prefix: prefix.to_owned(),
        rotation: RotationConfig {
            idle_ms: 500,
            ..RotationConfig::default()
        },
        ..SinkConfig::default()
    };
    config.kafka.brokers = brokers.to_owned();
    config.kafka.group_id = "demo-sink".into();
    config
}

/// The BLAKE3 hex of a token, as `auth.tokens[].blake3` wants it.
pub fn blake3_hex(token: &str) -> String {
    blake3::hash(token.as_bytes()).to_hex().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With no sink reading, the feed stops once [`MAX_WAITING`] readings wait: the agent and
    /// the gateway put no more than that into Kafka, so the mock cluster drops none of them
    /// (one device, so they all go to one partition), and the feed gives up when nothing moves.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_feed_waits_for_the_sink_before_the_cluster_drops_a_reading() {
        let streams = schemas::example_streams();
        let cluster = MockCluster::new(1).unwrap();
        let brokers = cluster.bootstrap_servers();
        let topic = topic_name(schemas::wire::DEFAULT_TOPIC_PREFIX, STREAM);
        cluster.create_topic(&topic, PARTITIONS, 1).unwrap();
        let shutdown = CancellationToken::new();
        let gateway =
            ingest_gateway::start(gateway_config(&brokers), streams.clone(), shutdown.clone())
                .await
                .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let agent_config = following_agent(dir.path(), gateway.addr).unwrap();
        let agent = tokio::spawn(edge_agent::run(
            agent_config.clone(),
            streams.clone(),
            shutdown.clone(),
        ));
        let watch = Watch {
            stats: Arc::new(sink::SinkStats::default()),
            lag: Lag::new(&brokers).unwrap(),
            timeout: Duration::from_secs(3),
        };
        let fleet = FleetSpec {
            records: 150_000,
            devices: 1,
            duplicate_ratio: 0.0,
            ..FleetSpec::default()
        };
        let fed = feed(&fleet, &streams, &agent_config, dir.path(), &watch).await;
        let e = fed.unwrap_err().to_string();
        assert!(e.contains("0 readings taken by the sink"), "{e}");
        assert!(e.contains("nothing moved"), "{e}");
        let produced = watch.lag.records(0).await.unwrap();
        assert!(
            produced <= MAX_WAITING && produced > MAX_WAITING - 2 * CHUNK as u64,
            "{produced} readings in Kafka"
        );
        for p in 0..PARTITIONS {
            let (earliest, _) = watch
                .lag
                .consumer
                .fetch_watermarks(&topic, p, Duration::from_secs(5))
                .unwrap();
            assert_eq!(earliest, 0, "partition {p} dropped readings");
        }
        shutdown.cancel();
        agent.await.unwrap().unwrap();
        gateway.task.await.unwrap().unwrap();
        drop((gateway.reload, watch));
    }
}
