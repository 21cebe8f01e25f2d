//! A certificate authority made for a test, and certificates it signs.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A CA and, signed by it, a server certificate for 127.0.0.1 and a client certificate, as PEM
/// files in `dir`.
pub struct Pki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

pub fn pki(dir: &Path) -> Pki {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
        .distinguished_name
        .push(DnType::CommonName, "edge-ingest test CA");
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    let write = |name: &str, pem: String| {
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path
    };
    let leaf = |name: &str, names: &[&str], usage: ExtendedKeyUsagePurpose| {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &ca).unwrap();
        (
            write(&format!("{name}.pem"), cert.pem()),
            write(&format!("{name}-key.pem"), key.serialize_pem()),
        )
    };
    let (server_cert, server_key) = leaf(
        "server",
        &["127.0.0.1", "localhost"],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert, client_key) = leaf("edge-box-7", &[], ExtendedKeyUsagePurpose::ClientAuth);
    Pki {
        ca: write("ca.pem", ca.pem()),
        server_cert,
        server_key,
        client_cert,
        client_key,
    }
}
