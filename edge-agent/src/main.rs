use std::path::PathBuf;

use clap::{Parser, Subcommand};
use edge_agent::AgentConfig;
use edge_agent::config::ENV_PREFIX;
use tokio_util::sync::CancellationToken;

/// mimalloc: the decode and encode paths allocate per record; glibc malloc was a quarter of
/// the gateway's profile.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Edge agent: reads sensor records, validates and dedupes them by content hash, batches and
/// zstd-compresses them and delivers them to the ingest gateway.
///
/// Configuration comes from the TOML file given with --config, overridden by environment
/// variables prefixed EDGE_AGENT_ (nested keys joined with "__", e.g. EDGE_AGENT_GATEWAY__URL).
/// See config/edge-agent.toml for every option.

#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the configured sources to their end and delivers their records.
    Run {
        /// Config file (TOML).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Prints the BLAKE3 hash of a token, for the gateway's auth.tokens.
    HashToken {
        /// The token.
        token: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    plumbing::init_tracing();
    match args.command {
        Command::HashToken { token } => {
            println!("{}", blake3::hash(token.as_bytes()).to_hex());
            Ok(())
        }
        Command::Run { config } => {
            plumbing::install_metrics();
            let config: AgentConfig = plumbing::load_config(Some(&config), ENV_PREFIX)?;
            let streams = plumbing::load_streams_dir(&config.streams_dir)?;
            let shutdown = CancellationToken::new();
            plumbing::cancel_on_signal(shutdown.clone());
            let stats = edge_agent::run(config, streams, shutdown).await?;
            eprintln!(
                "read {} records: {} invalid, {} duplicates dropped; sent {} batches, {} accepted; {} raw bytes as {} bytes on the wire",
                stats.pipeline.read,
                stats.pipeline.invalid,
                stats.pipeline.duplicates,
                stats.batches,
                stats.accepted,
                stats.raw_bytes,
                stats.wire_bytes
            );
            Ok(())
        }
    }
}
