use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use sink::SinkConfig;
use sink::config::ENV_PREFIX;
use tokio_util::sync::CancellationToken;

/// mimalloc: the decode and encode paths allocate per record; glibc malloc was a quarter of
/// the gateway's profile.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Landing-zone sink: consumes the stream topics as a consumer group and writes Parquet files
/// to S3 or a local directory exactly once.
///
/// Configuration comes from the TOML file given with --config, overridden by environment
/// variables prefixed SINK_ (nested keys joined with "__", e.g. SINK_KAFKA__BROKERS).
/// See config/sink.toml for every option. SIGHUP reads the file again: the rotation settings,
/// the memory and staging budgets, the upload settings and the dedupe window sizes take effect
/// at once, the others at the next start.

#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Config file (TOML).
    #[arg(long, short, global = true)]
    config: Option<PathBuf>,
    /// Seconds to wait for buffered files to be written and committed on shutdown.
    #[arg(long, default_value_t = 60)]
    graceful_shutdown_timeout: u64,
    /// Check the config, the stream definitions and selection and the certificate files, then
    /// exit (0 when valid) without connecting to Kafka or the object store.
    #[arg(long)]
    check: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Produces a stream's dead letters that its definition takes now (after a fix) back to the
    /// topics they came from, for the sinks to land; the rest stay, counted by reason. Prints
    /// a JSON report. Offsets redriven are noted under <key_prefix>/_redriven/ and left out
    /// by later runs.
    Redrive {
        /// The stream whose dead letters to redrive.
        #[arg(long)]
        stream: String,
        /// Only the dead letters of this day (YYYY-MM-DD, their ingest time's).
        #[arg(long)]
        date: Option<String>,
        /// With --date: only this hour (0-23).
        #[arg(long)]
        hour: Option<u8>,
        /// Check and count only: produce nothing, note nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    plumbing::init_tracing();
    let config: SinkConfig = plumbing::load_config(args.config.as_deref(), ENV_PREFIX)?;
    let streams = plumbing::load_streams_dir(&config.streams_dir)?;
    if let Some(Command::Redrive {
        stream,
        date,
        hour,
        dry_run,
    }) = args.command
    {
        let options = sink::redrive::RedriveOptions {
            stream,
            date,
            hour,
            dry_run,
        };
        let report = sink::redrive::redrive(&config, &streams, &options).await?;
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    if args.check {
        let selected = sink::check(&config, streams)?;
        println!("configuration is valid: streams {}", selected.join(", "));
        return Ok(());
    }
    plumbing::install_metrics();
    plumbing::raise_open_files_limit();
    let shutdown = CancellationToken::new();
    plumbing::cancel_on_signal(shutdown.clone());
    let health = plumbing::Health::default();
    let admin =
        plumbing::serve_admin(config.admin_listen, health.clone(), shutdown.clone()).await?;
    tracing::info!(%admin, "admin endpoints listening");
    // Before the start, which may take a while (the store's first answer): a SIGHUP then would
    // end the process (its default action).
    let reload = Arc::new(OnceLock::new());
    reload_on_sighup(reload.clone(), args.config.clone())?;
    let sink = sink::start(config, streams, shutdown.clone()).await?;
    let _ = reload.set(sink.reload.clone());
    let readiness = sink.readiness.clone();
    plumbing::spawn_readiness_probe(health, shutdown.clone(), move || {
        let readiness = readiness.clone();
        async move { readiness.check().await }
    });
    let mut task = sink.task;
    tokio::select! {
        result = &mut task => return result.context("sink task failed")?,
        _ = shutdown.cancelled() => {}
    }
    match tokio::time::timeout(Duration::from_secs(args.graceful_shutdown_timeout), task).await {
        Ok(result) => result.context("sink task failed")?,
        Err(_) => {
            anyhow::bail!("graceful shutdown timed out; unwritten records will be read again")
        }
    }
}

/// On SIGHUP, reads the config file (and the environment) again and hands it to the running
/// sink ([`sink::Reload`]): the rotation settings, the memory and staging budgets, the upload
/// settings and the dedupe window sizes are put in force; the others take effect at the next
/// start. A config that does not load or check keeps the running settings. Stream definitions
/// need no SIGHUP: they are read again as records need them.
/// Until the sink has started (`reload` set), a SIGHUP is logged and ignored. The files are
/// read and checked on the blocking pool, not on the runtime's threads.
fn reload_on_sighup(
    reload: Arc<OnceLock<sink::Reload>>,
    path: Option<PathBuf>,
) -> anyhow::Result<()> {
    plumbing::on_sighup(move || {
        let Some(reload) = reload.get().cloned() else {
            tracing::info!("SIGHUP: the sink is starting; nothing to reload yet");
            return;
        };
        let path = path.clone();
        tokio::task::spawn_blocking(move || reload_now(&reload, path.as_deref()));
    })
    .context("cannot handle SIGHUP")
}

/// Loads the config at `path` and hands it to the sink; logs and counts the outcome.
fn reload_now(reload: &sink::Reload, path: Option<&std::path::Path>) {
    let reloaded = plumbing::load_config::<SinkConfig>(path, ENV_PREFIX)
        .and_then(|config| reload.apply(config));
    ::metrics::gauge!(sink::metrics::RELOAD_SUCCESSFUL).set(if reloaded.is_ok() {
        1.0
    } else {
        0.0
    });
    match reloaded {
        Ok(done) if done.at_restart.is_empty() => tracing::info!(
            in_force = ?done.in_force,
            "SIGHUP: reloaded the config"
        ),
        Ok(done) => tracing::warn!(
            in_force = ?done.in_force,
            at_restart = ?done.at_restart,
            "SIGHUP: reloaded the config; the settings named at_restart changed and take effect at the next start"
        ),
        Err(e) => tracing::error!(
            error = %format!("{e:#}"),
            "SIGHUP: the config does not load or check; the running settings stay"
        ),
    }
}
