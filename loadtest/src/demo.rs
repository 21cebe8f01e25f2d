//! The one-command demo on the embedded default: gateway, sink and a simulated agent in one
//! process, on librdkafka's in-process mock cluster and a local landing directory.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ingest_gateway::GatewayConfig;
use ingest_gateway::config::{AuthConfig, TokenConfig};
use rdkafka::mocking::MockCluster;
use schemas::wire::topic_name;
use schemas::{ContentHash, Streams};
use sink::SinkConfig;
use sink::config::{RotationConfig, StoreConfig};
use tokio_util::sync::CancellationToken;

use crate::fleet::{FleetSpec, sensor_readings, to_ndjson};
use crate::verify::{Verdict, compare, read_landing_dir};

const STREAM: &str = "sensor_readings";
const DEMO_TOKEN: &str = "demo-token";

#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Root of the landing directory; each run writes under its own prefix.
    pub landing: PathBuf,
    pub fleet: FleetSpec,
    /// How long to wait for every record to land.
    pub timeout: Duration,
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
    pub verdict: Verdict,
    pub elapsed: Duration,
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
        let v = &self.verdict;
        if v.exactly_once() {
            writeln!(
                f,
                "  verified             every distinct record landed exactly once"
            )?;
        } else {
            writeln!(
                f,
                "  VERIFICATION FAILED  {} missing, {} duplicated, {} unexpected",
                v.missing, v.duplicated, v.unexpected
            )?;
        }
        writeln!(f, "  files under          {}", self.run_dir.display())?;
        write!(
            f,
            "  took                 {:.1} s",
            self.elapsed.as_secs_f64()
        )
    }
}

/// Runs the demo. The mock cluster is memory-only: nothing but the landing files survives.
pub async fn run(options: DemoOptions) -> anyhow::Result<DemoSummary> {
    let started = Instant::now();
    tracing::warn!(
        "embedded mode: Kafka is librdkafka's in-process mock cluster; it is memory-only and not for production"
    );
    let streams = schemas::example_streams();
    let cluster = MockCluster::new(1).context("cannot start the mock Kafka cluster")?;
    let brokers = cluster.bootstrap_servers();
    for def in streams.iter() {
        cluster.create_topic(
            &topic_name(schemas::wire::DEFAULT_TOPIC_PREFIX, &def.name),
            3,
            1,
        )?;
    }
    let run_prefix = format!("demo-{}", chrono::Utc::now().format("%Y%m%dT%H%M%S%.3fZ"));
    let shutdown = CancellationToken::new();

    let gateway =
        ingest_gateway::start(gateway_config(&brokers), streams.clone(), shutdown.clone()).await?;
    let sink = sink::start(
        sink_config(&brokers, &options.landing, &run_prefix),
        streams.clone(),
        shutdown.clone(),
    )
    .await?;

    let records = sensor_readings(&options.fleet);
    let expected = distinct_hashes(&streams, &records)?;
    // The agent reads the fleet's readings from a file, as it would on an edge box.
    let agent_dir = options.landing.join(format!("{run_prefix}-agent"));
    std::fs::create_dir_all(&agent_dir)?;
    let agent_config = file_agent(&FileAgent {
        dir: &agent_dir,
        ndjson: &to_ndjson(&records),
        gateway: gateway.addr,
        token: Some(DEMO_TOKEN),
        max_records: 2000,
        admin_listen: None,
    })?;
    let agent = edge_agent::run(agent_config, streams.clone(), shutdown.clone()).await?;
    let deadline = Instant::now() + options.timeout;
    while sink.stats.records_written.load(Ordering::Relaxed) < expected.len() as u64 {
        if Instant::now() > deadline {
            shutdown.cancel();
            bail!(
                "only {} of {} records landed within {:?}",
                sink.stats.records_written.load(Ordering::Relaxed),
                expected.len(),
                options.timeout
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    gateway.task.await??;
    sink.task.await??;
    // The gateway's reload handle holds its producer: the cluster goes after every client, or
    // the clients left log that all brokers are down.
    drop(gateway.reload);
    drop(cluster);

    let run_dir = options.landing.join(&run_prefix);
    let landed = read_landing_dir(&run_dir)?;
    Ok(DemoSummary {
        generated: records.len(),
        distinct: expected.len(),
        agent,
        sink_duplicates: sink.stats.duplicates_dropped.load(Ordering::Relaxed),
        landed_rows: landed.rows,
        verdict: compare(&expected, &landed),
        files: landed.files,
        run_dir,
        elapsed: started.elapsed(),
    })
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
}

/// Writes the readings file of `agent` and returns the agent's config.
pub fn file_agent(agent: &FileAgent<'_>) -> anyhow::Result<edge_agent::AgentConfig> {
    let file = agent.dir.join("readings.ndjson");
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
        "#,
        state = agent.dir.join("state"),
        admin = optional("admin_listen", agent.admin_listen),
        gateway = agent.gateway,
        token = optional("token", agent.token),
        max_records = agent.max_records,
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

fn sink_config(brokers: &str, landing: &std::path::Path, prefix: &str) -> SinkConfig {
    let mut config = SinkConfig {
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
