//! The `loadtest` command line: one function per subcommand.

use std::path::PathBuf;
use std::time::Duration;

use crate::demo::{DemoOptions, run};
use crate::fleet::{FleetSpec, sensor_readings, to_ndjson};
use crate::send::SendOptions;
use crate::verify::{VerifyOptions, verify};
use anyhow::Context;
use clap::{Parser, Subcommand};
use edge_agent::batch::BodyEncoding;
use sink::config::{IngestTime, StoreConfig};
use tokio_util::sync::CancellationToken;

/// Simulated device fleets, a load driver for a running gateway, end-to-end verification of a
/// landing zone and the one-command demo.

#[derive(Debug, Parser)]
#[command(name = "loadtest", version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs gateway, sink and a simulated agent in one process on the in-process mock Kafka
    /// cluster, lands Parquet files in a local directory and verifies them. The agent follows a
    /// file that gets the readings as the sink keeps up (at most 40,000 on their way at once,
    /// which the mock cluster keeps); up to 10,000,000 readings.
    Demo(DemoArgs),
    /// Benchmarks the gateway against a librdkafka producer on the same broker, in one run.
    /// Prints a table and writes JSON (build with --release).
    BenchGateway(BenchGatewayArgs),
    /// Measures the gateway's request check (decompress, decode, validate, hash, lay out the Kafka
    /// messages) alone on one core, without
    /// a broker (build with --release; also the target for a profiler).
    BenchDecode(BenchDecodeArgs),
    /// Benchmarks the sink (Kafka → Parquet on local disk, a 64-partition topic) against a
    /// librdkafka consumer that only reads and against pyarrow converting the same records, in
    /// one run. Prints a table and writes JSON (build with --release).
    BenchSink(BenchSinkArgs),
    /// Times table commits into tables of growing size (1,000 to 100,000 files by default)
    /// and the memory they take. Prints a table and writes JSON (build with --release).
    BenchTable(BenchTableArgs),
    /// The sink side of bench-sink (a child process, so that its peak RSS is its own).
    #[command(hide = true)]
    SinkWorker(SinkWorkerArgs),
    /// Benchmarks the agent's pipeline (read, parse, dedupe, batch, compress, spool) against
    /// `zstd -3 -T1` and `gzip -6` of the same generated file, in one run, in MB per CPU-second
    /// on both sides (zstd's wall-clock speed is printed too). Prints a table and writes JSON
    /// (build with --release). Needs no services.
    BenchAgent(BenchAgentArgs),
    /// Drives a running gateway with a simulated fleet: sensor readings (a share of them
    /// re-sent, as flaky uplinks do) in zstd NDJSON or Parquet batches, each retried with the same
    /// Idempotency-Key until the gateway acknowledges it, as the edge agent sends. Prints
    /// progress to stderr and a JSON summary to stdout; exits non-zero when the gateway refused
    /// a batch or rejected a record. `--save` keeps what was sent for `verify`.
    Send(SendArgs),
    /// Checks a landing zone against what was sent: every distinct valid record of the `--sent`
    /// NDJSON files must be in the stream's Parquet files exactly once. Reads a local directory
    /// (`--landing`) or S3 (`--s3-bucket`; credentials from the usual AWS chain). Prints a JSON
    /// report, with the time from send to landing where `send --save` noted the send times
    /// (`<file>.times`); exits non-zero unless the check passed.
    Verify(VerifyArgs),
    /// Runs librdkafka's mock cluster, a Kafka-protocol broker in memory in this process, with
    /// the example streams' topics, until interrupted; prints its bootstrap address. For soaks
    /// of a whole deployment on one machine, in a process that starts at once (no JVM). It
    /// keeps at most 5 MiB (or 100,000 record batches) of each partition and drops the oldest
    /// past that, about 80,000 of the gateway's readings: a consumer further behind finds an
    /// offset gap (more partitions keep more).
    MockBroker(MockBrokerArgs),
    /// Writes generated sensor readings as NDJSON to stdout or a file.
    Generate(GenerateArgs),
}

#[derive(Debug, clap::Args)]
struct DemoArgs {
    /// Landing directory; each run writes under its own `demo-<time>` prefix.
    #[arg(long, default_value = "landing")]
    landing: PathBuf,
    #[command(flatten)]
    fleet: FleetArgs,
    /// Seconds the demo waits while nothing moves (no reading taken from Kafka, none
    /// landed) before it gives up.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// Bytes of each record's content hash the landing files keep (the sink's
    /// landing.content_hash_bytes): 0, 16 or 32.
    #[arg(long, default_value = "0", value_parser = parse_hash_bytes)]
    content_hash_bytes: schemas::arrow::HashColumn,
    /// Land plain files only: no Iceberg table (by default the files are committed to a table
    /// per stream in `<landing>/catalog.db`, a namespace per run, and checked from it).
    #[arg(long)]
    no_table: bool,
    /// Reduce on the agent: the devices send process-like series (ramps, drifts,
    /// oscillations, steps, a random walk, spikes, a stuck value, gaps; no re-sent
    /// duplicates), the agent runs this filter on them, and the demo shows its reduction and
    /// checks its error bound from the landed rows.
    #[arg(long, value_enum)]
    filter: Option<crate::reduction::FilterKind>,
    /// The filter's band, in percent of the series' range (0 to 100).
    #[arg(long, default_value_t = 0.5, requires = "filter")]
    band_percent: f64,
    /// The filter's longest silence: a series keeps a reading at least this often.
    #[arg(long, default_value_t = 300, requires = "filter")]
    max_silence_secs: u64,
}

/// `--content-hash-bytes`: 0, 16 or 32.
fn parse_hash_bytes(text: &str) -> Result<schemas::arrow::HashColumn, String> {
    text.parse::<usize>()
        .ok()
        .and_then(schemas::arrow::HashColumn::of_bytes)
        .ok_or_else(|| format!("{text:?} is not 0, 16 or 32"))
}

#[derive(Debug, clap::Args)]
struct BenchGatewayArgs {
    /// Kafka bootstrap servers.
    #[arg(long)]
    brokers: String,
    /// Records to send (about 160 bytes each as NDJSON).
    #[arg(long, default_value_t = 300_000)]
    records: usize,
    /// Concurrent HTTP clients.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Uncompressed NDJSON bytes per batch.
    #[arg(long, default_value_t = 1 << 20)]
    batch_bytes: usize,
    /// Rounds of (direct, gateway), alternated; the report gives the median of each.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Rounds of both run first and not counted (a fresh broker warms up).
    #[arg(long, default_value_t = 1)]
    warmup_rounds: usize,
    /// Where the JSON report goes.
    #[arg(long, default_value = "target/bench/gateway.json")]
    out: PathBuf,
}

#[derive(Debug, clap::Args)]
struct BenchDecodeArgs {
    /// Records per round (about 160 bytes each as NDJSON).
    #[arg(long, default_value_t = 300_000)]
    records: usize,
    /// Times to decode the whole set; the fastest round is reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Uncompressed NDJSON bytes per batch.
    #[arg(long, default_value_t = 1 << 20)]
    batch_bytes: usize,
}

#[derive(Debug, clap::Args)]
struct BenchSinkArgs {
    /// Kafka bootstrap servers.
    #[arg(long)]
    brokers: String,
    /// Records to produce and land (about 160 bytes each as NDJSON).
    #[arg(long, default_value_t = 300_000)]
    records: usize,
    /// Partitions of the benchmark topic, all assigned to the one sink.
    #[arg(long, default_value_t = 64)]
    partitions: i32,
    /// Rounds of every path in turn; each path's fastest round is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Python with pyarrow (the test venv's).
    #[arg(long, env = "EDGE_INGEST_PYTHON", default_value = "python3")]
    python: PathBuf,
    /// Where the JSON report goes.
    #[arg(long, default_value = "target/bench/sink.json")]
    out: PathBuf,
    /// Produce the records with the gateway's headers (content-hash, schema-version,
    /// ingest-ts), as the gateway writes them; without, as a plain producer does.
    #[arg(long)]
    gateway_headers: bool,
    /// Where the sink takes the ingest time from (its `kafka.ingest_time`).
    #[arg(long, value_enum, default_value_t = IngestTimeArg::Header)]
    ingest_time: IngestTimeArg,
    /// Also run Kafka Connect's Iceberg sink on the same records each round: the folder of
    /// the jars of scripts/kafka-connect/pom.xml (scripts/bench.sh sink passes it).
    #[arg(long, env = "EDGE_INGEST_CONNECT_JARS", requires = "rest_catalog")]
    connect_jars: Option<PathBuf>,
    /// The Iceberg REST catalog Kafka Connect's table goes to (scripts/bench.sh sink starts
    /// Apache Iceberg's).
    #[arg(long, env = "EDGE_INGEST_ICEBERG_REST")]
    rest_catalog: Option<String>,
    /// With Kafka Connect: then kill its worker with SIGKILL 3 to 8 s after its task runs, for
    /// this many seconds while 1,000 readings a second flow, and count what its table lost and
    /// repeated (0: no kill loop).
    #[arg(long, default_value_t = 60)]
    kill_loop_seconds: u64,
}

#[derive(Debug, clap::Args)]
struct BenchTableArgs {
    /// Sizes of the tables, in data files.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000,100000")]
    files: Vec<u64>,
    /// Timed commits at each size.
    #[arg(long, default_value_t = 200)]
    commits: usize,
    /// Files a timed commit appends.
    #[arg(long, default_value_t = 4)]
    files_per_commit: u64,
    /// Where the JSON report goes.
    #[arg(long, default_value = "target/bench/table.json")]
    out: PathBuf,
    /// Run one size in this process and print its JSON (what each size's process runs).
    #[arg(long, hide = true)]
    one: Option<u64>,
}

#[derive(Debug, clap::Args)]
struct SinkWorkerArgs {
    #[arg(long)]
    brokers: String,
    #[arg(long)]
    topic_prefix: String,
    #[arg(long)]
    records: usize,
    #[arg(long)]
    raw_bytes: usize,
    #[arg(long)]
    landing: PathBuf,
    /// Consumer group (default `<topic-prefix>sink`); another group reads the topic again,
    /// for a profiler.
    #[arg(long)]
    group_id: Option<String>,
    #[arg(long, value_enum, default_value_t = IngestTimeArg::Header)]
    ingest_time: IngestTimeArg,
    /// An extra librdkafka consumer property, KEY=VALUE (repeatable), as the sink's
    /// `kafka.consumer` sets it: for trying a setting without a rebuild.
    #[arg(long = "consumer", value_parser = key_value)]
    consumer: Vec<(String, String)>,
    /// Commit the landed files to an Iceberg table (a SQLite catalog in the landing
    /// directory) this often, in milliseconds.
    #[arg(long)]
    table_commit_ms: Option<u64>,
    /// The schema registry of values in the registry wire format (the sink's `registry.url`).
    #[arg(long)]
    registry: Option<String>,
}

#[derive(Debug, clap::Args)]
struct BenchAgentArgs {
    /// Readings to generate (a fifth of them re-sent).
    #[arg(long, default_value_t = 1_500_000)]
    records: usize,
    /// Rounds of every path in turn; the table gives each path's fastest round.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Directory for the input file and the JSON report.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
}

#[derive(Debug, clap::Args)]
struct SendArgs {
    /// Base URL of the gateway.
    #[arg(
        long,
        env = "LOADTEST_GATEWAY",
        default_value = "http://127.0.0.1:8080"
    )]
    gateway: String,
    /// Bearer token (none for a gateway that allows anonymous ingest).
    #[arg(long, env = "LOADTEST_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// PEM certificates to trust for an https:// gateway instead of the platform's roots
    /// (a site's own CA).
    #[arg(long, env = "LOADTEST_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// PEM client certificate (chain) to present to a gateway that requires one (its
    /// `[tls] client_ca_file`), with --client-key.
    #[arg(long, env = "LOADTEST_CLIENT_CERT", requires = "client_key")]
    client_cert: Option<PathBuf>,
    /// PEM private key of --client-cert.
    #[arg(long, env = "LOADTEST_CLIENT_KEY", requires = "client_cert")]
    client_key: Option<PathBuf>,
    #[command(flatten)]
    fleet: FleetArgs,
    /// Event time of the first reading, epoch milliseconds; now when absent, so that runs
    /// with the same seed send different readings (the same ones would be dropped as
    /// duplicates).
    #[arg(long)]
    start_ms: Option<i64>,
    /// Readings per batch.
    #[arg(long, default_value_t = 1_000)]
    batch_records: usize,
    /// Batch bodies: zstd NDJSON, or Parquet as the agent's columnar encoding writes it.
    #[arg(long, value_enum, default_value_t = Encoding::Ndjson)]
    encoding: Encoding,
    /// Batches in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Readings per second over all senders; 0 sends as fast as the gateway takes them.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Writes every reading sent (duplicates included) to this NDJSON file.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Timeout of one request, in seconds.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
}

#[derive(Debug, clap::Args)]
struct VerifyArgs {
    /// NDJSON files of the sent records (`send --save`, or an agent's input files).
    #[arg(long, required = true, num_args = 1..)]
    sent: Vec<PathBuf>,
    /// The stream the records were sent to.
    #[arg(long, default_value = "sensor_readings")]
    stream: String,
    /// Directory of the stream definitions (`*.toml`); the shipped examples when absent.
    #[arg(long)]
    streams_dir: Option<PathBuf>,
    /// A local landing directory (the sink's `store.path`).
    #[arg(
        long,
        conflicts_with = "s3_bucket",
        required_unless_present = "s3_bucket"
    )]
    landing: Option<PathBuf>,
    /// An S3 bucket (the sink's `store.bucket`).
    #[arg(long)]
    s3_bucket: Option<String>,
    /// S3 endpoint URL for S3-compatible servers (MinIO, moto).
    #[arg(long, requires = "s3_bucket")]
    s3_endpoint: Option<String>,
    /// S3 region; from the AWS chain when absent.
    #[arg(long, requires = "s3_bucket")]
    s3_region: Option<String>,
    /// Path-style S3 addressing, which most S3-compatible servers need.
    #[arg(long, requires = "s3_bucket")]
    s3_path_style: bool,
    /// PEM certificates to trust for an https:// S3 endpoint instead of the platform's roots.
    #[arg(long, requires = "s3_bucket")]
    s3_ca_file: Option<PathBuf>,
    /// The sink's `key_prefix`.
    #[arg(long, default_value = "landing")]
    prefix: String,
    /// Seconds to keep looking while records are missing (the sink closes idle files after
    /// `rotation.idle_ms`).
    #[arg(long, default_value_t = 0)]
    wait: u64,
    /// Landed records that were not sent (another producer's) do not fail the check.
    #[arg(long)]
    allow_unexpected: bool,
    /// Check the stream's Iceberg table in this catalog (the sink's `table.catalog`: a SQLite
    /// file or a postgres:// URL) from its current snapshot, without listing folders.
    #[arg(long)]
    table: Option<String>,
    /// The catalog's name (the sink's `table.catalog_name`).
    #[arg(long, default_value = "edge_ingest", requires = "table")]
    catalog_name: String,
    /// The tables' namespace (the sink's `table.namespace`).
    #[arg(long, default_value = "landing", requires = "table")]
    namespace: String,
}

#[derive(Debug, clap::Args)]
struct MockBrokerArgs {
    /// Partitions of each topic.
    #[arg(long, default_value_t = 3)]
    partitions: i32,
    /// Topic prefix (the gateway's and the sink's `kafka.topic_prefix`).
    #[arg(long, default_value = "ingest.")]
    topic_prefix: String,
}

#[derive(Debug, clap::Args)]
struct GenerateArgs {
    #[command(flatten)]
    fleet: FleetArgs,
    /// Output file; stdout when absent.
    #[arg(long, short)]
    out: Option<PathBuf>,
}

/// The sink's `kafka.ingest_time` values.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum IngestTimeArg {
    Header,
    Timestamp,
}

impl From<IngestTimeArg> for IngestTime {
    fn from(a: IngestTimeArg) -> IngestTime {
        match a {
            IngestTimeArg::Header => IngestTime::Header,
            IngestTimeArg::Timestamp => IngestTime::Timestamp,
        }
    }
}

/// Batch body encodings of `send`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Encoding {
    Ndjson,
    Parquet,
}

#[derive(Debug, clap::Args)]
struct FleetArgs {
    /// Readings to generate, re-sent duplicates included.
    #[arg(long, default_value_t = 5_000)]
    records: usize,
    /// Simulated devices (four sensors each).
    #[arg(long, default_value_t = 50)]
    devices: usize,
    /// Fraction of readings that re-send an earlier one.
    #[arg(long, default_value_t = 0.2)]
    duplicate_ratio: f64,
    /// Random seed; the same seed gives the same readings.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

impl From<FleetArgs> for FleetSpec {
    fn from(a: FleetArgs) -> FleetSpec {
        FleetSpec {
            devices: a.devices.max(1),
            records: a.records,
            duplicate_ratio: a.duplicate_ratio,
            seed: a.seed,
            ..FleetSpec::default()
        }
    }
}

#[tokio::main]
pub async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Keep the demo's output to the summary and warnings unless RUST_LOG asks for more.
    service_kit::init_tracing_with_default("LOADTEST_", "warn");
    match args.command {
        Command::Demo(args) => demo(args).await,
        Command::BenchGateway(args) => bench_gateway(args).await,
        Command::BenchDecode(args) => bench_decode(args).await,
        Command::BenchSink(args) => bench_sink(args).await,
        Command::BenchTable(args) => bench_table(args).await,
        Command::BenchAgent(args) => bench_agent(args).await,
        Command::SinkWorker(args) => sink_worker(args).await,
        Command::Send(args) => send_command(args).await,
        Command::Verify(args) => verify_command(args).await,
        Command::MockBroker(args) => mock_broker(args).await,
        Command::Generate(args) => generate(args).await,
    }
}

async fn demo(
    DemoArgs {
        landing,
        fleet,
        timeout,
        content_hash_bytes,
        no_table,
        filter,
        band_percent,
        max_silence_secs,
    }: DemoArgs,
) -> anyhow::Result<()> {
    let summary = run(DemoOptions {
        landing,
        fleet: fleet.into(),
        timeout: Duration::from_secs(timeout),
        hash_column: content_hash_bytes,
        table: !no_table,
        filter: filter.map(|kind| crate::reduction::DemoFilter {
            kind,
            percent: band_percent,
            max_silence_secs,
        }),
    })
    .await?;
    println!("{summary}");
    if !summary.passed() {
        anyhow::bail!("the landed records do not match what was sent");
    }
    Ok(())
}

async fn bench_gateway(
    BenchGatewayArgs {
        brokers,
        records,
        concurrency,
        batch_bytes,
        rounds,
        warmup_rounds,
        out,
    }: BenchGatewayArgs,
) -> anyhow::Result<()> {
    let report = crate::bench_gateway::run(crate::bench_gateway::BenchOptions {
        brokers,
        records,
        concurrency: concurrency.max(1),
        batch_bytes,
        rounds,
        warmup_rounds,
        out,
    })
    .await?;
    println!("{report}");
    Ok(())
}

async fn bench_decode(
    BenchDecodeArgs {
        records,
        rounds,
        batch_bytes,
    }: BenchDecodeArgs,
) -> anyhow::Result<()> {
    let work = crate::bench_gateway::Workload::generate(records, batch_bytes)?;
    for (name, t) in [
        ("decode+validate+hash", work.validate_path(rounds)?),
        (
            "  the same, building records",
            work.validate_path_records(rounds)?,
        ),
        ("gateway check (+ messages)", work.gateway_check(rounds)?),
        (
            "sink path (+ dedupe, Parquet)",
            crate::bench_sink::sink_path(&work, rounds, 1)?,
        ),
        (
            "  the same, 64 partitions",
            crate::bench_sink::sink_path(&work, rounds, 64)?,
        ),
    ] {
        println!(
            "{name:<30} {:>9.0} records/cpu-s {:>7.1} MB/cpu-s ({} records, {:.2} s)",
            t.records_per_cpu_s, t.mb_per_cpu_s, t.records, t.seconds
        );
    }
    Ok(())
}

async fn bench_sink(
    BenchSinkArgs {
        brokers,
        records,
        partitions,
        rounds,
        python,
        out,
        gateway_headers,
        ingest_time,
        connect_jars,
        rest_catalog,
        kill_loop_seconds,
    }: BenchSinkArgs,
) -> anyhow::Result<()> {
    let report = crate::bench_sink::run(crate::bench_sink::SinkBenchOptions {
        brokers,
        records,
        partitions,
        rounds,
        python,
        out,
        gateway_headers,
        ingest_time: ingest_time.into(),
        connect: connect_jars.zip(rest_catalog).map(|(jars, rest_catalog)| {
            crate::bench_connect::ConnectOptions { jars, rest_catalog }
        }),
        kill_loop_seconds,
    })
    .await?;
    println!("{report}");
    Ok(())
}

async fn bench_table(args: BenchTableArgs) -> anyhow::Result<()> {
    if let Some(files) = args.one {
        let dir = tempfile::tempdir()?;
        let size =
            crate::bench_table::one_size(dir.path(), files, args.commits, args.files_per_commit)
                .await?;
        println!("{}", serde_json::to_string(&size)?);
        return Ok(());
    }
    let report = crate::bench_table::run(crate::bench_table::TableBenchOptions {
        sizes: args.files,
        commits: args.commits,
        per_commit: args.files_per_commit,
        out: args.out,
    })
    .await?;
    println!("{report}");
    Ok(())
}

async fn bench_agent(
    BenchAgentArgs {
        records,
        rounds,
        out,
    }: BenchAgentArgs,
) -> anyhow::Result<()> {
    let report = tokio::task::spawn_blocking(move || {
        crate::bench_agent::run(crate::bench_agent::AgentBenchOptions {
            records,
            rounds,
            out,
        })
    })
    .await??;
    println!("{report}");
    Ok(())
}

async fn sink_worker(
    SinkWorkerArgs {
        brokers,
        topic_prefix,
        records,
        raw_bytes,
        landing,
        group_id,
        ingest_time,
        consumer,
        table_commit_ms,
        registry,
    }: SinkWorkerArgs,
) -> anyhow::Result<()> {
    let group_id = group_id.unwrap_or_else(|| format!("{topic_prefix}sink"));
    let run = crate::bench_sink::sink_worker(
        &brokers,
        (&topic_prefix, &group_id),
        (records, raw_bytes),
        &landing,
        ingest_time.into(),
        consumer.into_iter().collect(),
        (table_commit_ms, registry),
    )
    .await?;
    println!("{}", serde_json::to_string(&run)?);
    Ok(())
}

async fn send_command(
    SendArgs {
        gateway,
        token,
        ca_file,
        client_cert,
        client_key,
        fleet,
        start_ms,
        batch_records,
        encoding,
        concurrency,
        rate,
        save,
        timeout,
    }: SendArgs,
) -> anyhow::Result<()> {
    let mut fleet = FleetSpec::from(fleet);
    let records = fleet.records;
    fleet.start_ms = start_ms.unwrap_or_else(|| chrono::Utc::now().timestamp_millis());
    let shutdown = CancellationToken::new();
    let interrupt = shutdown.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("send: interrupted, stopping");
            interrupt.cancel();
        }
    });
    let summary = crate::send::run(
        SendOptions {
            gateway,
            token,
            tls: edge_agent::tls::TlsFiles {
                ca_file,
                client_cert,
                client_key,
            },
            fleet,
            batch_records,
            encoding: match encoding {
                Encoding::Ndjson => BodyEncoding::Ndjson,
                Encoding::Parquet => BodyEncoding::Parquet,
            },
            concurrency,
            rate,
            save,
            timeout: Duration::from_secs(timeout.max(1)),
        },
        shutdown,
    )
    .await?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    anyhow::ensure!(
        !summary.interrupted,
        "interrupted after {} of {} readings",
        summary.records,
        records
    );
    anyhow::ensure!(
        summary.refused_batches == 0 && summary.rejected == 0,
        "the gateway refused {} batches and rejected {} records",
        summary.refused_batches,
        summary.rejected
    );
    Ok(())
}

async fn verify_command(
    VerifyArgs {
        sent,
        stream,
        streams_dir,
        landing,
        s3_bucket,
        s3_endpoint,
        s3_region,
        s3_path_style,
        s3_ca_file,
        prefix,
        wait,
        allow_unexpected,
        table,
        catalog_name,
        namespace,
    }: VerifyArgs,
) -> anyhow::Result<()> {
    let streams = match streams_dir {
        Some(dir) => service_kit::load_streams_dir(&dir)?,
        None => schemas::example_streams(),
    };
    let def = streams
        .get(&stream)
        .cloned()
        .with_context(|| format!("unknown stream {stream:?}"))?;
    let store = match (landing, s3_bucket) {
        (_, Some(bucket)) => StoreConfig::S3 {
            bucket,
            endpoint: s3_endpoint,
            region: s3_region,
            force_path_style: s3_path_style,
            ca_file: s3_ca_file,
            server_side_encryption: None,
            kms_key_id: None,
            storage_class: None,
        },
        (Some(path), None) => StoreConfig::Local { path },
        (None, None) => anyhow::bail!("give --landing or --s3-bucket"),
    };
    let report = verify(&VerifyOptions {
        sent,
        def,
        store,
        prefix,
        wait: Duration::from_secs(wait),
        allow_unexpected,
        table: table.map(|catalog| sink::table::TableConfig {
            catalog_name,
            namespace,
            ..sink::table::TableConfig::new(catalog)
        }),
    })
    .await?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    anyhow::ensure!(
        report.passed,
        "the landing zone does not hold every sent record exactly once"
    );
    Ok(())
}

async fn mock_broker(
    MockBrokerArgs {
        partitions,
        topic_prefix,
    }: MockBrokerArgs,
) -> anyhow::Result<()> {
    let cluster = rdkafka::mocking::MockCluster::new(1)?;
    for def in schemas::example_streams().iter() {
        cluster.create_topic(
            &schemas::wire::topic_name(&topic_prefix, &def.name),
            partitions,
            1,
        )?;
    }
    println!("{}", cluster.bootstrap_servers());
    tracing::warn!(
        partitions,
        "the mock broker keeps at most 5 MiB (or 100,000 record batches) of each partition and drops the oldest past that: a consumer further behind finds an offset gap"
    );
    tokio::signal::ctrl_c().await?;
    Ok(())
}

async fn generate(GenerateArgs { fleet, out }: GenerateArgs) -> anyhow::Result<()> {
    let data = to_ndjson(&sensor_readings(&fleet.into()));
    match out {
        Some(path) => std::fs::write(path, data)?,
        None => std::io::Write::write_all(&mut std::io::stdout().lock(), &data)?,
    }
    Ok(())
}

/// `KEY=VALUE`, split at the first `=`.
fn key_value(arg: &str) -> Result<(String, String), String> {
    arg.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected KEY=VALUE, got {arg:?}"))
}

#[cfg(test)]
mod tests {
    use super::key_value;

    #[test]
    fn consumer_settings_split_at_the_first_equals_sign() {
        let kv = |k: &str, v: &str| Ok((k.to_owned(), v.to_owned()));
        assert_eq!(
            key_value("fetch.max.bytes=1048576"),
            kv("fetch.max.bytes", "1048576")
        );
        assert_eq!(key_value("a=b=c"), kv("a", "b=c"));
        assert_eq!(key_value("debug="), kv("debug", ""));
        assert!(key_value("no-equals-sign").is_err());
        assert!(key_value("=value").is_err());
    }
}
