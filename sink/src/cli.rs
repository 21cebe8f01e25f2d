//! The `sink` command line: run, `--check`, `redrive`.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use anyhow::Context;
use clap::Parser;
use service_kit::process::{Service, ServiceArgs};

use crate::SinkConfig;
use crate::config::ENV_PREFIX;

/// Landing-zone sink: consumes the stream topics as a consumer group and writes Parquet files
/// to S3 or a local directory exactly once.
///
/// Configuration comes from the TOML file given with --config, overridden by environment
/// variables prefixed SINK_ (nested keys joined with "__", e.g. SINK_KAFKA__BROKERS).
/// See config/sink.toml for every option. SIGHUP reads the file again: the rotation settings,
/// the memory and staging budgets, the upload settings and the dedupe window sizes take effect
/// at once, the others at the next start.
#[derive(Debug, Parser)]
#[command(name = "sink", version)]
struct Args {
    #[command(flatten)]
    service: ServiceArgs,
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
pub async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    service_kit::init_tracing(ENV_PREFIX);
    let config: SinkConfig = service_kit::load_config(args.service.config.as_deref(), ENV_PREFIX)?;
    let streams = service_kit::load_streams_dir(&config.streams_dir)?;
    if let Some(Command::Redrive {
        stream,
        date,
        hour,
        dry_run,
    }) = args.command
    {
        let options = crate::redrive::RedriveOptions {
            stream,
            date,
            hour,
            dry_run,
        };
        let report = crate::redrive::redrive(&config, &streams, &options).await?;
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    if args.service.check {
        let selected = crate::check(&config, streams).map_err(service_kit::config::invalid)?;
        println!("configuration is valid: streams {}", selected.join(", "));
        return Ok(());
    }
    let service = Service::start();
    let health = service_kit::Health::default();
    let admin = service_kit::serve_admin(
        config.admin_listen,
        health.clone(),
        service.shutdown.clone(),
    )
    .await?;
    tracing::info!(%admin, "admin endpoints listening");
    // Before the start, which may take a while (the store's first answer): a SIGHUP then would
    // end the process (its default action).
    let reload = Arc::new(OnceLock::new());
    reload_on_sighup(reload.clone(), args.service.config.clone())?;
    let sink = crate::start(config, streams, service.shutdown.clone()).await?;
    let _ = reload.set(sink.reload.clone());
    let readiness = sink.readiness.clone();
    service_kit::spawn_readiness_probe(health, service.shutdown.clone(), move || {
        let readiness = readiness.clone();
        async move { readiness.check().await }
    });
    let grace = args.service.grace(60);
    service
        .run_until_stopped(
            sink.task,
            grace,
            "sink",
            "unwritten records will be read again",
        )
        .await
}

/// On SIGHUP, reads the config file (and the environment) again and hands it to the running
/// sink ([`crate::Reload`]): the rotation settings, the memory and staging budgets, the upload
/// settings and the dedupe window sizes are put in force; the others take effect at the next
/// start. A config that does not load or check keeps the running settings. Stream definitions
/// need no SIGHUP: they are read again as records need them.
/// Until the sink has started (`reload` set), a SIGHUP is logged and ignored. The files are
/// read and checked on the blocking pool, not on the runtime's threads.
fn reload_on_sighup(
    reload: Arc<OnceLock<crate::Reload>>,
    path: Option<PathBuf>,
) -> anyhow::Result<()> {
    service_kit::process::on_sighup(move || {
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
fn reload_now(reload: &crate::Reload, path: Option<&std::path::Path>) {
    let reloaded = service_kit::load_config::<SinkConfig>(path, ENV_PREFIX)
        .and_then(|config| reload.apply(config));
    ::metrics::gauge!(crate::metrics::RELOAD_SUCCESSFUL).set(if reloaded.is_ok() {
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
