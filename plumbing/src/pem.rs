//! Reading PEM certificate files: the CA files and certificates the agent and the sink are
//! configured with.

use std::path::Path;

use anyhow::Context as _;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

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
