//! The schemas of values in the registry wire format (`[registry]`): fetched by id from a
//! Confluent-compatible schema registry (the gateway's, Confluent's, Apicurio's, Karapace,
//! Redpanda's), kept for the sink's life, and compiled once per definition of each stream
//! ([`schemas::registry::Writer`]).
//!
//! The worker checks a framed value with [`Schemas::writer`]; an id not loaded yet is fetched by
//! [`Schemas::load`] and the value checked again. An id the registry does not know is a dead
//! letter's reason, asked again after [`UNKNOWN_FOR`]; a registry that does not answer is waited
//! for (with a growing backoff), as the object store is, so nothing is taken past it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use schemas::StreamDef;
use schemas::registry::{SchemaKind, Writer};
use serde::Deserialize;
use service_kit::config::secret::{self, Secret};
use tokio_util::sync::CancellationToken;

use crate::metrics as m;

/// `[registry]`: where the schemas of registry-framed values are fetched.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryConfig {
    /// The registry's base URL, e.g. `http://gateway:8080/registry` or
    /// `http://schema-registry:8081`.
    pub url: String,
    /// HTTP basic authentication (Confluent's `basic.auth.user.info`): the user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Its password, better given by the environment (`SINK_REGISTRY__PASSWORD`) or
    /// `password_file` than in the file.
    #[serde(default, skip_serializing)]
    pub password: Option<Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<String>,
    /// A bearer token (the gateway's registry takes the gateway's tokens); or `token_file`.
    #[serde(default, skip_serializing)]
    pub token: Option<Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<String>,
    /// PEM file of the CA certificates to trust for an `https` URL instead of the platform's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
    /// Time for one request, in milliseconds.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_timeout_ms() -> u64 {
    10_000
}

/// How long an id the registry said it does not know stays a dead letter's reason before it is
/// asked for again.
pub const UNKNOWN_FOR: Duration = Duration::from_secs(60);

/// The registry's client, with its credentials.
struct Client {
    http: reqwest::Client,
    base: String,
    auth: Auth,
}

enum Auth {
    None,
    Basic(String, String),
    Bearer(String),
}

/// A schema as the registry gave it, or why it gave none.
enum Fetched {
    Schema(SchemaKind, String),
    Refused(String),
}

/// A schema compiled for one definition of a stream.
struct Compiled {
    def: Arc<StreamDef>,
    writer: Writer,
    /// For an id the registry did not know: when to ask again.
    until: Option<Instant>,
}

/// The schemas the sink has read values with.
#[derive(Default)]
pub struct Schemas {
    client: Option<Client>,
    fetched: HashMap<u32, Arc<Fetched>>,
    compiled: HashMap<u32, Vec<Compiled>>,
}

impl Schemas {
    /// The schemas of `config`'s registry; without one, every framed value is a dead letter
    /// saying so.
    pub fn new(config: Option<&RegistryConfig>) -> anyhow::Result<Schemas> {
        let Some(config) = config else {
            return Ok(Schemas::default());
        };
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_millis(config.timeout_ms));
        if let Some(path) = &config.ca_file {
            let pem = std::fs::read(path)
                .with_context(|| format!("registry.ca_file: cannot read {path}"))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .with_context(|| format!("registry.ca_file: {path} holds no valid certificate"))?;
            builder = builder.tls_certs_only(certs);
        }
        let password = secret::resolve(
            config.password.as_ref(),
            config.password_file.as_deref().map(std::path::Path::new),
            "registry.password",
        )?;
        let token = secret::resolve(
            config.token.as_ref(),
            config.token_file.as_deref().map(std::path::Path::new),
            "registry.token",
        )?;
        let auth = match (&config.username, password, token) {
            (Some(user), Some(password), None) => {
                Auth::Basic(user.clone(), password.expose().to_owned())
            }
            (None, None, Some(token)) => Auth::Bearer(token.expose().to_owned()),
            (None, None, None) => Auth::None,
            _ => anyhow::bail!(
                "registry: give username with password (or password_file), or a token (or token_file), or none of them"
            ),
        };
        Ok(Schemas {
            client: Some(Client {
                http: builder.build()?,
                base: config.url.trim_end_matches('/').to_owned(),
                auth,
            }),
            ..Schemas::default()
        })
    }

    /// The schema of `id` compiled for `def`, if loaded (and, for an id the registry did not
    /// know, not due to be asked for again).
    pub fn writer(&self, id: u32, def: &Arc<StreamDef>) -> Option<&Writer> {
        let compiled = self.compiled.get(&id)?;
        let c = compiled.iter().find(|c| Arc::ptr_eq(&c.def, def))?;
        match c.until {
            Some(until) if Instant::now() >= until => None,
            _ => Some(&c.writer),
        }
    }

    /// Fetches `id` from the registry (unless it was) and compiles it for `def`. Waits while
    /// the registry does not answer; `false` if `shutdown` came first.
    pub async fn load(
        &mut self,
        id: u32,
        def: &Arc<StreamDef>,
        shutdown: &CancellationToken,
    ) -> bool {
        let expired = self.writer(id, def).is_none() && self.compiled.contains_key(&id);
        if expired {
            self.fetched.remove(&id);
            self.compiled.remove(&id);
        }
        let fetched = match self.fetched.get(&id) {
            Some(f) => f.clone(),
            None => {
                let Some(f) = self.fetch(id, shutdown).await else {
                    return false;
                };
                let f = Arc::new(f);
                self.fetched.insert(id, f.clone());
                f
            }
        };
        let (writer, until) = match &*fetched {
            Fetched::Schema(kind, text) => (Writer::compile(*kind, text, def), None),
            Fetched::Refused(reason) => (
                Writer::Refused(reason.clone()),
                Some(Instant::now() + UNKNOWN_FOR),
            ),
        };
        if let Some(reason) = writer.refused() {
            tracing::warn!(id, stream = %def.name, reason, "values of this schema id are dead letters");
        }
        let compiled = self.compiled.entry(id).or_default();
        compiled.retain(|c| Arc::strong_count(&c.def) > 1);
        compiled.push(Compiled {
            def: def.clone(),
            writer,
            until,
        });
        true
    }

    /// The registry's answer for `id`: its schema, or why there is none (no registry, an
    /// unknown id). Tried again with a backoff while the registry does not answer.
    async fn fetch(&self, id: u32, shutdown: &CancellationToken) -> Option<Fetched> {
        let Some(client) = &self.client else {
            return Some(Fetched::Refused(
                "the value is in the registry wire format and the sink has no [registry]".into(),
            ));
        };
        for attempt in 0.. {
            let failure = match client.get(id).await {
                Ok(fetched) => {
                    let result = match &fetched {
                        Fetched::Schema(..) => "fetched",
                        Fetched::Refused(_) => "unknown",
                    };
                    ::metrics::counter!(m::SCHEMA_FETCHES, "result" => result).increment(1);
                    return Some(fetched);
                }
                Err(e) => e,
            };
            ::metrics::counter!(m::SCHEMA_FETCHES, "result" => "error").increment(1);
            let wait = service_kit::process::backoff(
                attempt,
                Duration::from_millis(500),
                Duration::from_secs(30),
            );
            tracing::warn!(id, registry = %client.base, error = %format!("{failure:#}"), retry_in_ms = wait.as_millis() as u64, "cannot fetch a schema from the registry; its records wait");
            tokio::select! {
                () = shutdown.cancelled() => return None,
                () = tokio::time::sleep(wait) => {}
            }
        }
        None
    }
}

/// `GET /schemas/ids/{id}`'s answer.
#[derive(Deserialize)]
struct SchemaById {
    schema: String,
    #[serde(rename = "schemaType")]
    schema_type: Option<String>,
    #[serde(default)]
    references: Vec<serde_json::Value>,
}

impl Client {
    /// The schema of `id`; an error for an answer that may change (the registry down, a 5xx,
    /// credentials refused).
    async fn get(&self, id: u32) -> anyhow::Result<Fetched> {
        let url = format!("{}/schemas/ids/{id}", self.base);
        let mut request = self.http.get(&url).header(
            reqwest::header::ACCEPT,
            "application/vnd.schemaregistry.v1+json",
        );
        request = match &self.auth {
            Auth::None => request,
            Auth::Basic(user, password) => request.basic_auth(user, Some(password)),
            Auth::Bearer(token) => request.bearer_auth(token),
        };
        let answer = request.send().await.with_context(|| format!("GET {url}"))?;
        let status = answer.status();
        let body = answer.bytes().await.with_context(|| format!("GET {url}"))?;
        if status == reqwest::StatusCode::NOT_FOUND {
            return Ok(Fetched::Refused(format!(
                "the registry does not know it ({})",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            )));
        }
        anyhow::ensure!(
            status.is_success(),
            "GET {url}: {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        );
        let schema: SchemaById = serde_json::from_slice(&body)
            .with_context(|| format!("GET {url}: not a registry's schema"))?;
        if !schema.references.is_empty() {
            return Ok(Fetched::Refused(
                "it refers to other schemas (references), which are not read".into(),
            ));
        }
        Ok(match SchemaKind::parse(schema.schema_type.as_deref()) {
            Ok(kind) => Fetched::Schema(kind, schema.schema),
            Err(reason) => Fetched::Refused(reason),
        })
    }
}
