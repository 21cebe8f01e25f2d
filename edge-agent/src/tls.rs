//! TLS for the agent's connections: to an MQTT broker (`mqtts://`) and to the gateway
//! (`https://`), trusting the platform's roots or a CA file of the site's own, with an optional
//! client certificate for brokers that require one; and the local ingest port's certificate.

use anyhow::Context as _;
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject;
use service_kit::tls::pem_certificates;

pub use service_kit::tls::TlsFiles;

/// A client config trusting `files.ca_file` (or the platform's roots) and presenting the client
/// certificate when one is given.
pub fn client_config(files: &TlsFiles) -> anyhow::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    match &files.ca_file {
        Some(path) => {
            for cert in pem_certificates(path)? {
                roots
                    .add(cert)
                    .with_context(|| format!("a certificate of {} is invalid", path.display()))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            anyhow::ensure!(
                !roots.is_empty(),
                "no CA certificates found on this system: give ca_file"
            );
        }
    }
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
    match (&files.client_cert, &files.client_key) {
        (Some(cert), Some(key)) => {
            let chain = pem_certificates(cert)?;
            let key = PrivateKeyDer::from_pem_file(key)
                .with_context(|| format!("cannot read a private key from {}", key.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .context("the client certificate and key do not go together")
        }
        (None, None) => Ok(builder.with_no_client_auth()),
        _ => anyhow::bail!(BOTH_OR_NEITHER),
    }
}

const BOTH_OR_NEITHER: &str = "give both tls.client_cert and tls.client_key, or neither";

/// Sets up `builder` (the gateway's client) to trust `files.ca_file` instead of the platform's
/// roots and to present the client certificate when one is given.
pub fn http_client(
    mut builder: reqwest::ClientBuilder,
    files: &TlsFiles,
) -> anyhow::Result<reqwest::ClientBuilder> {
    if let Some(path) = &files.ca_file {
        let certs = pem_certificates(path)?
            .iter()
            .map(|cert| reqwest::Certificate::from_der(cert))
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("a certificate of {} is invalid", path.display()))?;
        builder = builder.tls_certs_only(certs);
    }
    match (&files.client_cert, &files.client_key) {
        (Some(cert), Some(key)) => {
            let mut pem =
                std::fs::read(cert).with_context(|| format!("cannot read {}", cert.display()))?;
            pem.extend(
                std::fs::read(key).with_context(|| format!("cannot read {}", key.display()))?,
            );
            let identity = reqwest::Identity::from_pem(&pem).with_context(|| {
                format!(
                    "cannot read a certificate and key from {} and {}",
                    cert.display(),
                    key.display()
                )
            })?;
            Ok(builder.identity(identity))
        }
        (None, None) => Ok(builder),
        _ => anyhow::bail!(BOTH_OR_NEITHER),
    }
}

/// Checks a server certificate and key (the local ingest port's): both readable, the key the
/// certificate's, and the client CA file when one is given.
pub fn check_server(tls: &service_kit::http::server::TlsConfig) -> anyhow::Result<()> {
    tls.server_config().map(drop)
}
