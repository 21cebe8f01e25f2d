//! The `ingest-gateway` command line: serve, `--check`, `redrive`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use service_kit::process::{Service, ServiceArgs};

use crate::GatewayConfig;
use crate::config::ENV_PREFIX;

/// HTTP ingest gateway: authenticates, decodes and validates records and produces them to Kafka.
///
/// Configuration comes from the TOML file given with --config, overridden by environment
/// variables prefixed INGEST_GATEWAY_ (nested keys joined with "__", e.g.
/// INGEST_GATEWAY_KAFKA__BROKERS). See config/ingest-gateway.toml for every option. SIGHUP
/// reads the file again and puts the tokens, the TLS files and the stream definitions in force.
#[derive(Debug, Parser)]
#[command(name = "ingest-gateway", version)]
struct Args {
    #[command(flatten)]
    service: ServiceArgs,
    /// With --check: also check that the definitions of streams_dir may replace those in this
    /// directory (the ones in force) while gateways, sinks and agents run: only compatible
    /// changes (nullable fields added, required fields made optional; see
    /// streams/README.md, "Evolution"). Exits 1 naming the stream and field otherwise.
    #[arg(long, value_name = "DIR", requires = "check")]
    compatible_with: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Produces the records of a stream that the gateway rejected (kafka.dead_letter_topic) and
    /// that its definition in streams_dir takes now (after a fix) to the stream's topic, for the
    /// sinks to land; the rest stay, counted by reason. Reads the dead-letter topic to its end
    /// and prints a JSON report. What a run produced is noted in the dead-letter topic, and
    /// later runs leave it out.
    Redrive {
        /// The stream whose rejected records to redrive.
        #[arg(long)]
        stream: String,
        /// Only records rejected at or after this time: RFC 3339 (2026-11-25T08:00:00Z) or
        /// milliseconds since the epoch. Default: the topic's start (what earlier runs
        /// produced is left out all the same; --since only spares reading older records).
        #[arg(long, value_parser = parse_since)]
        since: Option<i64>,
        /// Check and count only: produce nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// `--since`: RFC 3339 or milliseconds since the epoch.
fn parse_since(text: &str) -> Result<i64, String> {
    text.parse::<i64>().or_else(|_| {
        chrono::DateTime::parse_from_rfc3339(text)
            .map(|t| t.timestamp_millis())
            .map_err(|e| format!("{text:?} is neither RFC 3339 nor epoch milliseconds: {e}"))
    })
}

/// mimalloc's delay before it returns freed memory to the OS, unless the environment sets one.
/// Requests free large buffers all the time (bodies, decompressed bodies, Kafka messages); with
/// mimalloc's default of 10 ms (100 ms for its arenas) the freed ones stayed resident while new
/// ones were taken, and the gateway's memory rose 50–70 MiB past `max_inflight_bytes` under a
/// load of bodies that decompress to the limit. At 0 it follows the budget.
const PURGE_DELAY: (&str, &str) = ("MIMALLOC_PURGE_DELAY", "0");

pub fn main() -> anyhow::Result<()> {
    // mimalloc reads its options from the environment when the process starts, before `main`:
    // the process is started again with the option set (same PID, arguments and descriptors).
    let (name, value) = PURGE_DELAY;
    if std::env::var_os(name).is_none() {
        use std::os::unix::process::CommandExt as _;
        let mut args = std::env::args_os();
        let mut again = std::process::Command::new("/proc/self/exe");
        if let Some(arg0) = args.next() {
            again.arg0(arg0);
        }
        let error = again.args(args).env(name, value).exec();
        return Err(
            anyhow::Error::new(error).context("cannot start again with the allocator's settings")
        );
    }
    let args = Args::parse();
    service_kit::init_tracing(ENV_PREFIX);
    let config: GatewayConfig =
        service_kit::load_config(args.service.config.as_deref(), ENV_PREFIX)?;
    if args.service.check {
        let streams = service_kit::load_streams_dir(&config.streams_dir)?;
        let served = crate::check(&config, &streams).map_err(service_kit::config::invalid)?;
        println!("configuration is valid: {served} streams");
        if let Some(dir) = &args.compatible_with {
            let update = service_kit::load_streams_dir(dir)?
                .updated_by(streams)
                .map_err(|e| {
                    anyhow::anyhow!(
                        "{e}: running components refuse this change; a new version of a stream needs a new stream"
                    )
                })?;
            println!(
                "compatible with {}: streams added {:?}, changed {:?}",
                dir.display(),
                update.added,
                update.changed
            );
        }
        return Ok(());
    }
    if let Some(Command::Redrive {
        stream,
        since,
        dry_run,
    }) = args.command
    {
        let streams = service_kit::load_streams_dir(&config.streams_dir)?;
        let options = crate::redrive::RedriveOptions {
            stream,
            since_ms: since,
            dry_run,
        };
        let runtime = tokio::runtime::Runtime::new()?;
        let report = runtime.block_on(crate::redrive::redrive(&config, &streams, &options))?;
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    // Built here, on the main thread: `serve` runs on this thread (block_on), so the Kafka
    // clients it creates keep the process's priority while the runtime's workers run lower.
    let runtime = crate::runtime(config.worker_nice).context("cannot start the Tokio runtime")?;
    runtime.block_on(serve(args, config))
}

async fn serve(args: Args, config: GatewayConfig) -> anyhow::Result<()> {
    let service = Service::start();
    let streams = service_kit::load_streams_dir(&config.streams_dir)?;
    let gateway = crate::start(config, streams, service.shutdown.clone()).await?;
    reload_on_sighup(gateway.reload.clone(), args.service.config.clone())?;
    let grace = args.service.grace(30);
    service
        .run_until_stopped(
            gateway.task,
            grace,
            "gateway",
            "requests in flight were cut off",
        )
        .await
}

/// On SIGHUP, reads the config file (and the environment) again and puts its tokens, TLS files
/// and stream definitions in force ([`crate::Reload`]); a config that does not load or
/// check keeps the running ones. Without this, SIGHUP ended the process.
fn reload_on_sighup(reload: crate::Reload, path: Option<PathBuf>) -> anyhow::Result<()> {
    service_kit::process::on_sighup(move || {
        let (reload, path) = (reload.clone(), path.clone());
        tokio::spawn(async move {
            let reloaded = match service_kit::load_config::<GatewayConfig>(path.as_deref(), ENV_PREFIX)
            {
                Ok(config) => reload.apply(&config).await,
                Err(e) => Err(e),
            };
            ::metrics::gauge!(crate::metrics::RELOAD_SUCCESSFUL)
                .set(if reloaded.is_ok() { 1.0 } else { 0.0 });
            match reloaded {
                Ok(done) => tracing::info!(
                    tokens = done.tokens,
                    added_streams = ?done.added,
                    changed_streams = ?done.changed,
                    "SIGHUP: reloaded the tokens, the TLS files and the stream definitions (other settings take effect at a restart)"
                ),
                Err(e) => tracing::error!(
                    error = %format!("{e:#}"),
                    "SIGHUP: the config does not load; the running tokens, certificate and stream definitions stay"
                ),
            }
        });
    })
    .context("cannot handle SIGHUP")
}
