use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use loadtest::demo::{DemoOptions, run};
use loadtest::fleet::{FleetSpec, sensor_readings, to_ndjson};

/// mimalloc: the decode and encode paths allocate per record; glibc malloc was a quarter of
/// the gateway's profile.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Simulated device fleets, end-to-end verification and the one-command demo.

#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs gateway, sink and a simulated agent in one process on the in-process mock Kafka
    /// cluster, lands Parquet files in a local directory and verifies them.
    Demo {
        /// Landing directory; each run writes under its own `demo-<time>` prefix.
        #[arg(long, default_value = "landing")]
        landing: PathBuf,
        #[command(flatten)]
        fleet: FleetArgs,
        /// Seconds to wait for every record to land.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
    },
    /// Benchmarks the gateway against a librdkafka producer on the same broker, in one run.
    /// Prints a table and writes JSON (build with --release).
    BenchGateway {
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
    },
    /// Measures the gateway's request check (decompress, decode, validate, hash, lay out the Kafka
    /// messages) alone on one core, without
    /// a broker (build with --release; also the target for a profiler).
    BenchDecode {
        /// Records per round (about 160 bytes each as NDJSON).
        #[arg(long, default_value_t = 300_000)]
        records: usize,
        /// Times to decode the whole set; the fastest round is reported.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Uncompressed NDJSON bytes per batch.
        #[arg(long, default_value_t = 1 << 20)]
        batch_bytes: usize,
    },
    /// Benchmarks the sink (Kafka → Parquet on local disk, a 64-partition topic) against a
    /// librdkafka consumer that only reads and against pyarrow converting the same records, in
    /// one run. Prints a table and writes JSON (build with --release).
    BenchSink {
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
    },
    /// The sink side of bench-sink (a child process, so that its peak RSS is its own).
    #[command(hide = true)]
    SinkWorker {
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
    },
    /// Benchmarks the agent's pipeline (read, parse, dedupe, batch, compress, spool) against
    /// `zstd -3 -T1` and `gzip -6` of the same generated file, in one run. Prints a table and
    /// writes JSON (build with --release). Needs no services.
    BenchAgent {
        /// Readings to generate (a fifth of them re-sent).
        #[arg(long, default_value_t = 1_500_000)]
        records: usize,
        /// Rounds of every path in turn; the table gives each path's fastest round.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Directory for the input file and the JSON report.
        #[arg(long, default_value = "target/bench")]
        out: PathBuf,
    },
    /// Writes generated sensor readings as NDJSON to stdout or a file.
    Generate {
        #[command(flatten)]
        fleet: FleetArgs,
        /// Output file; stdout when absent.
        #[arg(long, short)]
        out: Option<PathBuf>,
    },
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
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Keep the demo's output to the summary and warnings unless RUST_LOG asks for more.
    plumbing::init_tracing_with_default("warn");
    match args.command {
        Command::Demo {
            landing,
            fleet,
            timeout,
        } => {
            let summary = run(DemoOptions {
                landing,
                fleet: fleet.into(),
                timeout: Duration::from_secs(timeout),
            })
            .await?;
            println!("{summary}");
            if !summary.verdict.exactly_once() {
                anyhow::bail!("the landed records do not match what was sent");
            }
            Ok(())
        }
        Command::BenchGateway {
            brokers,
            records,
            concurrency,
            batch_bytes,
            rounds,
            warmup_rounds,
            out,
        } => {
            let report = loadtest::bench_gateway::run(loadtest::bench_gateway::BenchOptions {
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
        Command::BenchDecode {
            records,
            rounds,
            batch_bytes,
        } => {
            let work = loadtest::bench_gateway::Workload::generate(records, batch_bytes)?;
            for (name, t) in [
                ("decode+validate+hash", work.validate_path(rounds)?),
                (
                    "  the same, building records",
                    work.validate_path_records(rounds)?,
                ),
                ("gateway check (+ messages)", work.gateway_check(rounds)?),
                (
                    "sink path (+ dedupe, Parquet)",
                    loadtest::bench_sink::sink_path(&work, rounds, 1)?,
                ),
                (
                    "  the same, 64 partitions",
                    loadtest::bench_sink::sink_path(&work, rounds, 64)?,
                ),
            ] {
                println!(
                    "{name:<30} {:>9.0} records/cpu-s {:>7.1} MB/cpu-s ({} records, {:.2} s)",
                    t.records_per_cpu_s, t.mb_per_cpu_s, t.records, t.seconds
                );
            }
            Ok(())
        }
        Command::BenchSink {
            brokers,
            records,
            partitions,
            rounds,
            python,
            out,
        } => {
            let report = loadtest::bench_sink::run(loadtest::bench_sink::SinkBenchOptions {
                brokers,
                records,
                partitions,
                rounds,
                python,
                out,
            })
            .await?;
            println!("{report}");
            Ok(())
        }
        Command::BenchAgent {
            records,
            rounds,
            out,
        } => {
            let report = tokio::task::spawn_blocking(move || {
                loadtest::bench_agent::run(loadtest::bench_agent::AgentBenchOptions {
                    records,
                    rounds,
                    out,
                })
            })
            .await??;
            println!("{report}");
            Ok(())
        }
        Command::SinkWorker {
            brokers,
            topic_prefix,
            records,
            raw_bytes,
            landing,
            group_id,
        } => {
            let group_id = group_id.unwrap_or_else(|| format!("{topic_prefix}sink"));
            let run = loadtest::bench_sink::sink_worker(
                &brokers,
                &topic_prefix,
                &group_id,
                records,
                raw_bytes,
                &landing,
            )
            .await?;
            println!("{}", serde_json::to_string(&run)?);
            Ok(())
        }
        Command::Generate { fleet, out } => {
            let data = to_ndjson(&sensor_readings(&fleet.into()));
            match out {
                Some(path) => std::fs::write(path, data)?,
                None => std::io::Write::write_all(&mut std::io::stdout().lock(), &data)?,
            }
            Ok(())
        }
    }
}
