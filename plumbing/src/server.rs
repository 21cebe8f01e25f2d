//! Serving an axum router on a listener, over plain HTTP or TLS (rustls), until shutdown: the
//! gateway's API and the edge agent's local ingest port.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use axum::Router;
use axum_server::tls_rustls::RustlsConfig;
use rustls_pki_types::PrivateKeyDer;
use rustls_pki_types::pem::PemObject;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::pem::pem_certificates;

/// A server certificate: `[tls]` of the gateway, `tls` of the agent's HTTP source.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
    /// Mutual TLS: PEM CA certificates; only clients presenting a certificate issued by one of
    /// them get a TLS session (the handshake fails for the others).
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

impl TlsConfig {
    /// The rustls server config: the certificate and key, which must go together, and the
    /// client certificate check when `client_ca_file` is given. HTTP/2 and HTTP/1.1 by ALPN.
    pub fn server_config(&self) -> anyhow::Result<rustls::ServerConfig> {
        let chain = pem_certificates(&self.cert)?;
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .with_context(|| format!("cannot read a private key from {}", self.key.display()))?;
        let builder = rustls::ServerConfig::builder();
        let builder = match &self.client_ca_file {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in pem_certificates(path)? {
                    roots.add(cert).with_context(|| {
                        format!("a certificate of {} is invalid", path.display())
                    })?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
                    .build()
                    .with_context(|| format!("cannot verify clients with {}", path.display()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(chain, key).with_context(|| {
            format!(
                "{} is not the key of {}",
                self.key.display(),
                self.cert.display()
            )
        })?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }

    /// Reads the certificate and key (at start, so that a bad file stops the start).
    pub async fn load(&self) -> anyhow::Result<RustlsConfig> {
        let config = self.server_config().with_context(|| {
            format!(
                "cannot load TLS certificate {} and key {}",
                self.cert.display(),
                self.key.display()
            )
        })?;
        Ok(RustlsConfig::from_config(Arc::new(config)))
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
