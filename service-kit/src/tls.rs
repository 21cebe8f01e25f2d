//! PEM certificate files: the `tls` tables of the configs (what a client trusts and presents)
//! and reading the CA files and certificates they name.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

/// A `tls` table: what a client trusts and what it presents. Used for the agent's MQTT brokers
/// and gateway, and for the Kafka clients of the gateway, the sink and the agent's Kafka output.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// PEM certificates to trust instead of the platform's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM certificate chain and private key the client presents (mutual TLS).
    #[serde(default)]
    pub client_cert: Option<PathBuf>,
    #[serde(default)]
    pub client_key: Option<PathBuf>,
}

impl TlsFiles {
    pub fn is_empty(&self) -> bool {
        *self == TlsFiles::default()
    }
}

/// The certificates of the PEM file at `path`; an error when it cannot be read or holds none.
pub fn pem_certificates(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let pem = std::fs::read(path)
        .with_context(|| format!("cannot read certificates from {}", path.display()))?;
    certificates_in(&pem, path)
}

/// The certificates of `pem`, the text of the file at `path`; an error when it holds none.
pub fn certificates_in(pem: &[u8], path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("cannot read certificates from {}", path.display()))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "{} holds no PEM certificate",
        path.display()
    );
    Ok(certs)
}
