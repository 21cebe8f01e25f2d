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
pub mod secret;
pub mod server;
pub mod telemetry;

pub use config::{load_config, load_streams_dir};
pub use telemetry::{
    Health, admin_router, init_tracing, init_tracing_with_default, install_metrics, serve_admin,
    serve_admin_with, spawn_readiness_probe,
};

use tokio_util::sync::CancellationToken;

/// Cancels `token` on Ctrl-C or SIGTERM.
pub fn cancel_on_signal(token: CancellationToken) {
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot listen for SIGTERM");
                        let _ = ctrl_c.await;
                        token.cancel();
                        return;
                    }
                };
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("shutdown requested");
        token.cancel();
    });
}
