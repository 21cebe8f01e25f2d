//! Runtime plumbing shared by the binaries: config loading, the stream directory, metrics and
//! health endpoints, tracing and shutdown. Kept small on purpose.

pub mod body;
pub mod config;
pub mod kafka;
pub mod kafka_log;
pub mod kafka_security;
pub mod pem;
pub mod priority;
pub mod rate;
pub mod redrive;
pub mod secret;
pub mod server;
pub mod telemetry;

pub use config::{DefinitionFile, Reread, load_config, load_stream, load_streams_dir};
pub use telemetry::{
    Health, admin_router, init_tracing, init_tracing_with_default, install_metrics, serve_admin,
    serve_admin_with, spawn_readiness_probe,
};

use tokio_util::sync::CancellationToken;

/// Raises this process's soft limit on open files to its hard limit, and logs the limit in
/// force. systemd starts services with a soft limit of 1,024 (and a hard one of 524,288) and
/// leaves it to programs that need more to raise it: a sink holds a staged file per partition
/// it writes, a gateway a socket per connection (`limits.max_connections`, 1,024 by default), and
/// past the soft limit both failed with "Too many open files". Returns the soft limit in force
/// (`None`: unlimited).
pub fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let (Some(soft), Some(hard)) = (limit.current, limit.maximum) else {
        return limit.current;
    };
    if soft >= hard {
        return Some(soft);
    }
    let raised = Rlimit {
        current: Some(hard),
        maximum: Some(hard),
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => {
            tracing::info!(from = soft, to = hard, "raised the open files limit");
            Some(hard)
        }
        Err(e) => {
            tracing::warn!(limit = soft, error = %e, "cannot raise the open files limit");
            Some(soft)
        }
    }
}

/// Calls `each` on every SIGHUP, instead of its default action, which ends the process at once
/// without a graceful stop. For the sink and the agent, which have nothing to reload on it: a
/// tool sends it out of habit (a `logrotate` postrotate script, a reload meant for the
/// gateway). `each` logs under its caller's target, which `RUST_LOG` filters name.
#[cfg(unix)]
pub fn on_sighup(mut each: impl FnMut() + Send + 'static) -> std::io::Result<()> {
    let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            each();
        }
    });
    Ok(())
}

/// Cancels `token` on Ctrl-C or SIGTERM.
///
/// On Unix the handlers are in place when this returns, so that a caller may then unblock the
/// signals (the agent's reload keeps them blocked across its exec).
pub fn cancel_on_signal(token: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let listeners = signal(SignalKind::terminate()).and_then(|term| {
            let interrupt = signal(SignalKind::interrupt())?;
            Ok((term, interrupt))
        });
        tokio::spawn(async move {
            match listeners {
                Ok((mut term, mut interrupt)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = interrupt.recv() => {}
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM");
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
            tracing::info!("shutdown requested");
            token.cancel();
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutdown requested");
        token.cancel();
    });
}
