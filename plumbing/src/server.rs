//! Serving an axum router on a listener, over plain HTTP or TLS (rustls), until shutdown: the
//! gateway's API and the edge agent's local ingest port.

use std::path::PathBuf;

use anyhow::Context as _;
use axum::Router;
use axum_server::tls_rustls::RustlsConfig;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

/// A server certificate: `[tls]` of the gateway, `tls` of the agent's HTTP source.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
}

impl TlsConfig {
    /// Reads the certificate and key (at start, so that a bad file stops the start).
    pub async fn load(&self) -> anyhow::Result<RustlsConfig> {
        RustlsConfig::from_pem_file(&self.cert, &self.key)
            .await
            .with_context(|| {
                format!(
                    "cannot load TLS certificate {} and key {}",
                    self.cert.display(),
                    self.key.display()
                )
            })
    }
}

/// Serves `app` on `listener` (non-blocking), with TLS when `tls` is given, until `shutdown`;
/// requests in progress are finished.
pub async fn serve(
    listener: std::net::TcpListener,
    app: Router,
    tls: Option<RustlsConfig>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    match tls {
        None => {
            axum::serve(tokio::net::TcpListener::from_std(listener)?, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await?;
        }
        Some(tls) => {
            let handle = axum_server::Handle::new();
            let stopper = handle.clone();
            tokio::spawn(async move {
                shutdown.cancelled().await;
                stopper.graceful_shutdown(None);
            });
            axum_server::from_tcp_rustls(listener, tls)?
                .handle(handle)
                .serve(app.into_make_service())
                .await?;
        }
    }
    Ok(())
}
