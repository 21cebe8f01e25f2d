//! The `edge-agent` command line: run, check, status, resend-rejected, train-dictionary,
//! hash-token.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::AgentConfig;
use crate::config::ENV_PREFIX;
use crate::reload::Reload;

/// Edge agent: reads sensor records (files, stdin, MQTT, a local HTTP port), validates them,
/// drops duplicates by content hash, filters them, batches and compresses them into a
/// crash-safe disk spool and delivers them to the ingest gateway (or Kafka).
///
/// Configuration comes from the TOML file given with --config, overridden by environment
/// variables prefixed EDGE_AGENT_ (nested keys joined with "__", e.g. EDGE_AGENT_GATEWAY__URL).
/// See config/edge-agent.toml for every option.
#[derive(Debug, Parser)]
#[command(name = "edge-agent", version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the agent: until its sources end and the spool is delivered, or until SIGINT/SIGTERM
    /// (then what is not delivered stays in the spool for the next start). SIGHUP reloads the
    /// config: if it loads and checks, the agent stops as on SIGTERM and starts again on it in
    /// the same process; if not, it runs on with the one it has (an agent reading stdin does
    /// not reload).
    Run {
        /// Config file (TOML).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Checks the config file and the stream definitions, then exits.
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Puts the batches the gateway refused for good (kept under <state_dir>/rejected/) back
    /// into their streams' spools, oldest first, once the cause is fixed; the agent delivers
    /// them at its next start. Run it while the agent is stopped.
    ResendRejected {
        #[arg(long, short)]
        config: PathBuf,
        /// Only this stream's batches (default: every stream's).
        #[arg(long)]
        stream: Option<String>,
    },
    /// Shows what waits on this box, read from the state directory without changing anything
    /// (also while the agent runs): per stream the batches not yet delivered (records, bytes,
    /// the oldest one's age) and the refused ones kept under rejected/, the spool's use of its
    /// limit, and how far the file sources have read.
    Status {
        #[arg(long, short)]
        config: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Trains a zstd dictionary on a stream's own records (an NDJSON file) and installs it as
    /// <streams-dir>/<stream>.zdict, where agents compress small batches with it and gateways
    /// decode them (deploy it to the gateways first). A dictionary already there is kept as
    /// <stream>.<id>.zdict so that batches compressed with it still decode.
    TrainDictionary {
        /// Directory of stream definitions (the dictionary is written there).
        #[arg(long, default_value = "streams")]
        streams_dir: PathBuf,
        /// The stream.
        #[arg(long)]
        stream: String,
        /// NDJSON records of the stream to learn from (invalid lines are skipped).
        #[arg(long)]
        input: PathBuf,
        /// Largest dictionary size in bytes.
        #[arg(long, default_value_t = schemas::dictionary::DEFAULT_DICTIONARY_BYTES)]
        max_bytes: usize,
        /// Records to learn from, at most (the first ones of the input).
        #[arg(long, default_value_t = 100_000)]
        max_samples: usize,
    },
    /// Prints the BLAKE3 hash of a token, for the gateway's auth.tokens. The token is read from
    /// the first line of standard input (so that it shows in no process list or shell history),
    /// or given as the argument.
    HashToken {
        /// The token; read from standard input when absent or `-`.
        token: Option<String>,
    },
}

fn load(config: &std::path::Path) -> anyhow::Result<(AgentConfig, schemas::Streams)> {
    let config: AgentConfig = service_kit::load_config(Some(config), ENV_PREFIX)?;
    let streams = service_kit::load_streams_dir(&config.streams_dir)?;
    config
        .validate(&streams)
        .map_err(service_kit::config::invalid)?;
    Ok((config, streams))
}

#[tokio::main]
pub async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    service_kit::init_tracing(ENV_PREFIX);
    match args.command {
        Command::HashToken { token } => {
            let token = match token.filter(|t| t != "-") {
                Some(token) => token,
                None => {
                    let mut line = String::new();
                    std::io::stdin().read_line(&mut line).map_err(|e| {
                        anyhow::anyhow!("cannot read the token from standard input: {e}")
                    })?;
                    line.trim_end_matches(['\n', '\r']).to_owned()
                }
            };
            anyhow::ensure!(!token.is_empty(), "the token is empty");
            println!("{}", blake3::hash(token.as_bytes()).to_hex());
            Ok(())
        }
        Command::TrainDictionary {
            streams_dir,
            stream,
            input,
            max_bytes,
            max_samples,
        } => {
            let streams = service_kit::load_streams_dir(&streams_dir)?;
            let def = streams.get(&stream).ok_or_else(|| {
                anyhow::anyhow!("no stream {stream:?} in {}", streams_dir.display())
            })?;
            let ndjson = std::fs::read(&input)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", input.display()))?;
            let (dictionary, trained) =
                crate::dictionary::train_dictionary(def, &ndjson, max_bytes, max_samples)?;
            let installed =
                crate::dictionary::install_dictionary(&streams_dir, &stream, &dictionary)?;
            println!(
                "trained dictionary {} ({} bytes) on {} records ({} bytes; {} invalid lines skipped); wrote {}",
                dictionary.id(),
                dictionary.bytes().len(),
                trained.samples,
                trained.sample_bytes,
                trained.invalid,
                installed.path.display()
            );
            if let Some(retired) = installed.retired {
                println!("the previous dictionary is kept as {}", retired.display());
            }
            Ok(())
        }
        Command::Check { config } => {
            let (config, streams) = load(&config)?;
            println!(
                "configuration is valid: {} sources, {} streams known",
                config.sources.len(),
                streams.len()
            );
            Ok(())
        }
        Command::Status { config, json } => {
            let (config, _) = load(&config)?;
            let status = crate::status::status(&config, None)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print!("{status}");
            }
            Ok(())
        }
        Command::ResendRejected { config, stream } => {
            let (config, streams) = load(&config)?;
            let resent = crate::resend_rejected(&config, &streams, stream.as_deref())?;
            println!(
                "put {} batches ({} records) back into the spool; the agent sends them at its next start",
                resent.batches, resent.records
            );
            Ok(())
        }
        Command::Run { config: path } => {
            // SIGINT/SIGTERM stop the process; a reload (SIGHUP) stops only the run.
            let stop = CancellationToken::new();
            let shutdown = stop.child_token();
            // Listening for SIGTERM and SIGINT before `on_sighup` unblocks them (after a reload).
            service_kit::process::cancel_on_signal(stop.clone());
            let reload = Reload::on_sighup(path.clone(), shutdown.clone(), |path| {
                load(path).map(|(config, _)| config)
            })?;
            service_kit::install_metrics();
            service_kit::process::raise_open_files_limit();
            let (config, streams) = load(&path)?;
            reload.running(&config);
            let stats = crate::run(config, streams, shutdown).await?;
            let t = stats.total();
            // A log event, so that it is one JSON object too with EDGE_AGENT_LOG_FORMAT=json.
            tracing::info!(
                read = t.pipeline.read,
                invalid = t.pipeline.invalid,
                duplicates = t.pipeline.duplicates,
                filtered = t.pipeline.filtered,
                dropped_on_full_spool = t.pipeline.spool_dropped,
                spooled = t.pipeline.batched,
                spooled_batches = t.pipeline.batches,
                delivered_batches = t.delivery.batches,
                accepted = t.delivery.accepted,
                refused_batches = t.delivery.rejected_batches,
                raw_bytes = t.delivery.raw_bytes,
                wire_bytes = t.delivery.wire_bytes,
                "run finished"
            );
            if reload.requested() && !stop.is_cancelled() {
                tracing::info!("starting again on the reloaded config");
                let e = crate::reload::exec_self();
                tracing::error!(error = %e, "cannot start again on the reloaded config; exiting, for the service manager to restart the agent");
                std::process::exit(1)
            }
            // A source blocked on stdin must not keep the process alive.
            std::process::exit(0)
        }
    }
}
