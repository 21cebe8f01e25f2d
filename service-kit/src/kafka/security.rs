//! TLS and SASL for the Kafka clients: the gateway's producer and admin client, the sink's
//! consumer and the agent's Kafka output. A `[kafka]` section's `tls` and `sasl` tables become
//! librdkafka's `security.protocol`, `ssl.*` and `sasl.*` properties; the password can come
//! from a file or an environment override instead of the config file.

use std::fmt;
use std::path::PathBuf;

use anyhow::Context as _;
use rdkafka::ClientConfig;
use rustls_pki_types::PrivateKeyDer;
use rustls_pki_types::pem::PemObject;
use serde::Deserialize;

use crate::tls::{TlsFiles, pem_certificates};

/// A `sasl` table: the mechanism, the user and where the password comes from.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sasl {
    pub mechanism: SaslMechanism,
    pub username: String,
    /// The password itself; better given by an environment override than in the file.
    #[serde(default)]
    pub password: Option<String>,
    /// A file holding the password (a mounted secret); a trailing newline is not part of it.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
}

impl fmt::Debug for Sasl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sasl")
            .field("mechanism", &self.mechanism)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("password_file", &self.password_file)
            .finish()
    }
}

/// The SASL mechanisms librdkafka supports without extra system libraries (GSSAPI needs
/// Kerberos; OAUTHBEARER a token provider: both can be set through the raw properties).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum SaslMechanism {
    #[serde(rename = "PLAIN")]
    Plain,
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

impl SaslMechanism {
    pub fn name(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// Sets `security.protocol` and the TLS and SASL properties of `config`: `ssl` with `tls`,
/// `sasl_plaintext` with `sasl`, `sasl_ssl` with both, nothing with neither. Every file is read
/// here, so that a missing or empty one is a clear error at start rather than a client that
/// cannot connect.
pub fn apply(
    config: &mut ClientConfig,
    tls: Option<&TlsFiles>,
    sasl: Option<&Sasl>,
) -> anyhow::Result<()> {
    let protocol = match (tls.is_some(), sasl.is_some()) {
        (false, false) => return Ok(()),
        (true, false) => "ssl",
        (false, true) => "sasl_plaintext",
        (true, true) => "sasl_ssl",
    };
    config.set("security.protocol", protocol);
    if let Some(tls) = tls {
        match &tls.ca_file {
            Some(ca) => {
                pem_certificates(ca).context("kafka.tls.ca_file")?;
                config.set("ssl.ca.location", ca.to_string_lossy());
            }
            // librdkafka's OpenSSL is built in, and its default location of the platform's
            // roots is that build's (which does not exist): "probe" looks in the usual places
            // (Debian's /etc/ssl/certs/ca-certificates.crt among them).
            None => {
                config.set("ssl.ca.location", "probe");
            }
        }
        match (&tls.client_cert, &tls.client_key) {
            (Some(cert), Some(key)) => {
                pem_certificates(cert).context("kafka.tls.client_cert")?;
                PrivateKeyDer::from_pem_file(key).with_context(|| {
                    format!(
                        "kafka.tls.client_key: cannot read a private key from {}",
                        key.display()
                    )
                })?;
                config
                    .set("ssl.certificate.location", cert.to_string_lossy())
                    .set("ssl.key.location", key.to_string_lossy());
            }
            (None, None) => {}
            _ => anyhow::bail!(
                "give both kafka.tls.client_cert and kafka.tls.client_key, or neither"
            ),
        }
    }
    if let Some(sasl) = sasl {
        let password = crate::config::secret::password(
            sasl.password.as_deref(),
            sasl.password_file.as_deref(),
            "kafka.sasl",
        )?;
        config
            .set("sasl.mechanisms", sasl.mechanism.name())
            .set("sasl.username", &sasl.username)
            .set("sasl.password", password);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sasl(password: Option<&str>, password_file: Option<PathBuf>) -> Sasl {
        Sasl {
            mechanism: SaslMechanism::ScramSha512,
            username: "ingest".into(),
            password: password.map(Into::into),
            password_file,
        }
    }

    fn applied(tls: Option<&TlsFiles>, sasl: Option<&Sasl>) -> anyhow::Result<ClientConfig> {
        let mut config = ClientConfig::new();
        apply(&mut config, tls, sasl).map(|()| config)
    }

    fn cert_and_key(dir: &std::path::Path) -> (PathBuf, PathBuf) {
        let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&cert, made.cert.pem()).unwrap();
        std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
        (cert, key)
    }

    #[test]
    fn the_protocol_follows_the_tables() {
        let none = applied(None, None).unwrap();
        assert_eq!(none.get("security.protocol"), None);
        let tls = TlsFiles::default();
        let secret = sasl(Some("pw"), None);
        for (tls, sasl, protocol) in [
            (Some(&tls), None, "ssl"),
            (None, Some(&secret), "sasl_plaintext"),
            (Some(&tls), Some(&secret), "sasl_ssl"),
        ] {
            let c = applied(tls, sasl).unwrap();
            assert_eq!(c.get("security.protocol"), Some(protocol));
            // Without ca_file, the platform's roots, wherever they are.
            let ca = tls.map(|_| "probe");
            assert_eq!(c.get("ssl.ca.location"), ca);
        }
        let c = applied(None, Some(&secret)).unwrap();
        assert_eq!(c.get("sasl.mechanisms"), Some("SCRAM-SHA-512"));
        assert_eq!(c.get("sasl.username"), Some("ingest"));
        assert_eq!(c.get("sasl.password"), Some("pw"));
    }

    #[test]
    fn certificate_files_are_read_and_named() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = cert_and_key(dir.path());
        let full = TlsFiles {
            ca_file: Some(cert.clone()),
            client_cert: Some(cert.clone()),
            client_key: Some(key.clone()),
        };
        let c = applied(Some(&full), None).unwrap();
        assert_eq!(c.get("ssl.ca.location"), Some(&*cert.to_string_lossy()));
        assert_eq!(
            c.get("ssl.certificate.location"),
            Some(&*cert.to_string_lossy())
        );
        assert_eq!(c.get("ssl.key.location"), Some(&*key.to_string_lossy()));

        let missing = dir.path().join("missing.pem");
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let cases = [
            (
                TlsFiles {
                    ca_file: Some(missing.clone()),
                    ..TlsFiles::default()
                },
                "kafka.tls.ca_file",
            ),
            (
                TlsFiles {
                    ca_file: Some(junk.clone()),
                    ..TlsFiles::default()
                },
                "holds no PEM certificate",
            ),
            (
                TlsFiles {
                    client_cert: Some(cert.clone()),
                    ..TlsFiles::default()
                },
                "give both kafka.tls.client_cert and kafka.tls.client_key",
            ),
            (
                TlsFiles {
                    client_cert: Some(cert.clone()),
                    client_key: Some(junk.clone()),
                    ..TlsFiles::default()
                },
                "kafka.tls.client_key",
            ),
        ];
        for (tls, expected) in cases {
            let e = format!("{:#}", applied(Some(&tls), None).unwrap_err());
            assert!(e.contains(expected), "{tls:?}: {e}");
        }
    }

    #[test]
    fn the_password_comes_from_one_place() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("password");
        std::fs::write(&file, "from-file\n").unwrap();
        let c = applied(None, Some(&sasl(None, Some(file.clone())))).unwrap();
        assert_eq!(c.get("sasl.password"), Some("from-file"));

        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        for (s, expected) in [
            (sasl(None, None), "give one of"),
            (sasl(Some("pw"), Some(file)), "give one of"),
            (sasl(None, Some(dir.path().join("missing"))), "cannot read"),
            (sasl(None, Some(empty)), "is empty"),
            (sasl(Some(""), None), "is empty"),
        ] {
            let e = format!("{:#}", applied(None, Some(&s)).unwrap_err());
            assert!(e.contains(expected), "{s:?}: {e}");
        }
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API
    fn the_password_can_come_from_the_environment() {
        #[derive(Deserialize)]
        struct Kafka {
            sasl: Option<Sasl>,
        }
        #[derive(Deserialize)]
        struct Config {
            kafka: Kafka,
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            "[kafka]\nsasl = { mechanism = \"PLAIN\", username = \"ingest\" }\n",
        )
        .unwrap();
        figment::Jail::expect_with(|jail| {
            jail.set_env("SECTEST_KAFKA__SASL__PASSWORD", "from-env");
            let c: Config = crate::load_config(Some(&file), "SECTEST_").unwrap();
            let applied = applied(None, c.kafka.sasl.as_ref()).unwrap();
            assert_eq!(applied.get("sasl.password"), Some("from-env"));
            Ok(())
        });
    }

    #[test]
    fn the_password_is_not_in_debug_output() {
        let shown = format!("{:?}", sasl(Some("hunter2"), None));
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }

    #[test]
    fn mechanisms_are_named_as_kafka_names_them() {
        #[derive(Deserialize)]
        struct T {
            sasl: Sasl,
        }
        for name in ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] {
            let t: T = toml::from_str(&format!(
                "sasl = {{ mechanism = \"{name}\", username = \"u\", password = \"p\" }}"
            ))
            .unwrap();
            assert_eq!(t.sasl.mechanism.name(), name);
        }
        assert!(
            toml::from_str::<T>("sasl = { mechanism = \"GSSAPI\", username = \"u\" }").is_err()
        );
    }
}
