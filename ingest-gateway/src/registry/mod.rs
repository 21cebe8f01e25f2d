//! The gateway as a schema registry for its streams: the part of the Confluent Schema Registry
//! REST API that producers' serializers use, under `/registry`.
//!
//! Each stream is the subject `<topic>-value`. Its definition is served as a schema of the
//! stream's first registry format (`value_formats`: Avro, else JSON Schema; Avro for a stream of
//! JSON values only), as version 1 and again whenever the definition changes. A producer may
//! register a schema of its own (a serializer's `auto.register.schemas`): it is taken when the
//! definition takes its values ([`schemas::registry::Writer::compile`]), with an id made from
//! its text, so every gateway gives the same schema the same id; refused with the registry
//! API's error shape otherwise. Registered schemas are kept in `registry.dir` when set.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use anyhow::Context as _;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use schemas::registry::export::{avro_schema, json_schema};
use schemas::registry::{SchemaKind, Writer};
use schemas::{StreamDef, ValueFormat};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::api::AppState;

/// The media type of the registry API's answers.
const MEDIA_TYPE: &str = "application/vnd.schemaregistry.v1+json";

/// A schema the registry holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Entry {
    subject: String,
    #[serde(rename = "schemaType")]
    kind: String,
    schema: String,
}

/// The subjects' schemas, by id, and each subject's versions (ids in order).
#[derive(Default)]
struct Held {
    by_id: HashMap<u32, Entry>,
    subjects: BTreeMap<String, Vec<u32>>,
}

/// The registry of a gateway's streams.
pub struct Registry {
    topic_prefix: String,
    dir: Option<PathBuf>,
    held: RwLock<Held>,
}

impl Default for Registry {
    /// A registry of the default topic names, kept in memory.
    fn default() -> Registry {
        Registry {
            topic_prefix: schemas::wire::DEFAULT_TOPIC_PREFIX.to_owned(),
            dir: None,
            held: RwLock::default(),
        }
    }
}

/// An answer of the registry API that is not a success: its status, error code and message.
pub struct RegistryError(StatusCode, u32, String);

impl IntoResponse for RegistryError {
    fn into_response(self) -> Response {
        let RegistryError(status, code, message) = self;
        let mut answer = (
            status,
            Json(json!({"error_code": code, "message": message})),
        )
            .into_response();
        answer.headers_mut().insert(
            header::CONTENT_TYPE,
            MEDIA_TYPE.parse().expect("a media type"),
        );
        answer
    }
}

type Answer = Result<Response, RegistryError>;

fn ok(body: serde_json::Value) -> Answer {
    let mut answer = Json(body).into_response();
    answer.headers_mut().insert(
        header::CONTENT_TYPE,
        MEDIA_TYPE.parse().expect("a media type"),
    );
    Ok(answer)
}

fn subject_not_found(subject: &str) -> RegistryError {
    RegistryError(
        StatusCode::NOT_FOUND,
        40401,
        format!("Subject '{subject}' not found."),
    )
}

/// The id of a schema: 31 bits of the BLAKE3 hash of its kind and its text as compact JSON (so
/// spacing does not matter), never 0.
fn id_of(kind: &str, text: &str) -> u32 {
    let compact = serde_json::from_str::<serde_json::Value>(text)
        .map(|v| v.to_string())
        .unwrap_or_else(|_| text.to_owned());
    let hash = blake3::hash(format!("{kind}\0{compact}").as_bytes());
    let id = u32::from_be_bytes(hash.as_bytes()[..4].try_into().expect("4 bytes")) & 0x7fff_ffff;
    id.max(1)
}

/// The schema a stream's definition is served as: its kind and text.
fn definition_schema(def: &StreamDef) -> (SchemaKind, String) {
    let json_schema_first = def
        .value_formats
        .iter()
        .find(|f| **f != ValueFormat::Json)
        .is_some_and(|f| *f == ValueFormat::JsonSchema);
    if json_schema_first {
        (SchemaKind::Json, json_schema(def))
    } else {
        (SchemaKind::Avro, avro_schema(def))
    }
}

impl Registry {
    /// A registry of the topics named with `topic_prefix`, its registered schemas kept in `dir`
    /// (read back here).
    pub fn new(topic_prefix: &str, dir: Option<PathBuf>) -> anyhow::Result<Registry> {
        let mut held = Held::default();
        if let Some(dir) = &dir {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("registry.dir: cannot create {}", dir.display()))?;
            let mut files: Vec<_> = std::fs::read_dir(dir)
                .with_context(|| format!("registry.dir: cannot read {}", dir.display()))?
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
                .collect();
            // Registration order: the files are named by a sequence number.
            files.sort();
            for path in files {
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("registry.dir: cannot read {}", path.display()))?;
                let entry: Entry = serde_json::from_str(&text)
                    .with_context(|| format!("registry.dir: {} is not a schema", path.display()))?;
                held.add(entry);
            }
        }
        Ok(Registry {
            topic_prefix: topic_prefix.to_owned(),
            dir,
            held: RwLock::new(held),
        })
    }

    /// The stream of subject `<topic>-value`.
    fn stream_of<'a>(&self, subject: &'a str) -> Option<&'a str> {
        subject
            .strip_suffix("-value")?
            .strip_prefix(self.topic_prefix.as_str())
    }

    fn subject(&self, stream: &str) -> String {
        format!("{}{stream}-value", self.topic_prefix)
    }

    /// Adds the schemas of the definitions in force that the registry does not hold yet (a
    /// stream's first, or one changed since).
    fn sync(&self, state: &AppState) {
        let streams = state.streams();
        let missing: Vec<Entry> = {
            let held = self.read();
            streams
                .iter()
                .filter_map(|def| {
                    let (kind, text) = definition_schema(def);
                    let id = id_of(kind.name(), &text);
                    (!held.by_id.contains_key(&id)).then(|| Entry {
                        subject: self.subject(&def.name),
                        kind: kind.name().to_owned(),
                        schema: text,
                    })
                })
                .collect()
        };
        if !missing.is_empty() {
            let mut held = self.write();
            for entry in missing {
                held.add(entry);
            }
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Held> {
        self.held
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Held> {
        self.held
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps a registered schema in `dir` (write to a temporary file, then rename).
    fn keep(&self, entry: &Entry, sequence: usize) -> anyhow::Result<()> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        let path = dir.join(format!("{sequence:010}.json"));
        let tmp = dir.join(format!(".{sequence:010}.json.tmp"));
        std::fs::write(&tmp, serde_json::to_vec(entry)?)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("cannot rename {}", tmp.display()))?;
        Ok(())
    }
}

impl Held {
    /// Adds `entry` under its id (the next free one when another text has it) and its subject;
    /// the id and whether it was new.
    fn add(&mut self, entry: Entry) -> (u32, bool) {
        let mut id = id_of(&entry.kind, &entry.schema);
        loop {
            match self.by_id.get(&id) {
                Some(e) if e.kind == entry.kind && e.schema == entry.schema => break,
                Some(_) => id = (id % 0x7fff_ffff) + 1,
                None => break,
            }
        }
        let versions = self.subjects.entry(entry.subject.clone()).or_default();
        let new = !versions.contains(&id);
        if new {
            versions.push(id);
        }
        self.by_id.entry(id).or_insert(entry);
        (id, new)
    }

    fn version(&self, subject: &str, version: &str) -> Result<(u32, usize), RegistryError> {
        let versions = self
            .subjects
            .get(subject)
            .ok_or_else(|| subject_not_found(subject))?;
        let index = match version {
            "latest" | "-1" => versions.len().checked_sub(1),
            v => v
                .parse::<usize>()
                .ok()
                .filter(|v| *v >= 1)
                .map(|v| v - 1)
                .filter(|i| *i < versions.len()),
        }
        .ok_or_else(|| {
            RegistryError(
                StatusCode::NOT_FOUND,
                40402,
                format!("Version {version} not found."),
            )
        })?;
        Ok((versions[index], index + 1))
    }
}

/// A registration's body.
#[derive(Deserialize)]
pub struct Registration {
    schema: String,
    #[serde(rename = "schemaType")]
    schema_type: Option<String>,
    #[serde(default)]
    references: Vec<serde_json::Value>,
}

fn schema_body(entry: &Entry) -> serde_json::Value {
    let mut body = json!({"schema": entry.schema});
    if entry.kind != SchemaKind::Avro.name() {
        body["schemaType"] = json!(entry.kind);
    }
    body
}

fn version_body(subject: &str, id: u32, version: usize, entry: &Entry) -> serde_json::Value {
    let mut body = schema_body(entry);
    body["subject"] = json!(subject);
    body["id"] = json!(id);
    body["version"] = json!(version);
    body
}

/// Authenticates a registry request: the gateway's tokens, as a bearer token or as the
/// password of HTTP basic authentication (what serializers' `basic.auth.user.info` sends).
/// `Some(stream)`: the caller must also be allowed to write that stream.
fn admit(state: &AppState, headers: &HeaderMap, stream: Option<&str>) -> Result<(), RegistryError> {
    let auth = state.auth();
    let mut bearer = headers.clone();
    if let Some(token) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Basic ")
                .or_else(|| v.strip_prefix("basic "))
        })
        .and_then(|b| {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD
                .decode(b.trim())
                .ok()
        })
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|up| up.split_once(':').map(|(_, p)| p.to_owned()))
    {
        let value = format!("Bearer {token}").parse().map_err(|_| {
            RegistryError(StatusCode::UNAUTHORIZED, 40101, "bad credentials".into())
        })?;
        bearer.insert(header::AUTHORIZATION, value);
    }
    let who = auth
        .authenticate(&bearer)
        .map_err(|e| RegistryError(StatusCode::UNAUTHORIZED, 40101, e.message))?;
    if let Some(stream) = stream {
        auth.authorize(who, stream)
            .map_err(|e| RegistryError(StatusCode::FORBIDDEN, 40301, e.message))?;
    }
    Ok(())
}

/// `GET /registry/subjects`
pub async fn subjects(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Answer {
    admit(&state, &headers, None)?;
    let registry = &state.registry;
    registry.sync(&state);
    let subjects: Vec<String> = registry.read().subjects.keys().cloned().collect();
    ok(json!(subjects))
}

/// `GET /registry/subjects/{subject}/versions`
pub async fn versions(
    State(state): State<Arc<AppState>>,
    Path(subject): Path<String>,
    headers: HeaderMap,
) -> Answer {
    admit(&state, &headers, None)?;
    state.registry.sync(&state);
    let held = state.registry.read();
    let versions = held
        .subjects
        .get(&subject)
        .ok_or_else(|| subject_not_found(&subject))?;
    ok(json!((1..=versions.len()).collect::<Vec<_>>()))
}

/// `GET /registry/subjects/{subject}/versions/{version}` (a number or `latest`)
pub async fn version(
    State(state): State<Arc<AppState>>,
    Path((subject, version)): Path<(String, String)>,
    headers: HeaderMap,
) -> Answer {
    admit(&state, &headers, None)?;
    state.registry.sync(&state);
    let held = state.registry.read();
    let (id, number) = held.version(&subject, &version)?;
    ok(version_body(&subject, id, number, &held.by_id[&id]))
}

/// `GET /registry/schemas/ids/{id}`
pub async fn schema(
    State(state): State<Arc<AppState>>,
    Path(id): Path<u32>,
    headers: HeaderMap,
) -> Answer {
    admit(&state, &headers, None)?;
    state.registry.sync(&state);
    let held = state.registry.read();
    let entry = held.by_id.get(&id).ok_or_else(|| {
        RegistryError(
            StatusCode::NOT_FOUND,
            40403,
            format!("Schema {id} not found"),
        )
    })?;
    ok(schema_body(entry))
}

/// `GET /registry/schemas/types`
pub async fn types() -> Answer {
    ok(json!(["AVRO", "JSON"]))
}

/// `GET /registry/config` and `GET /registry/config/{subject}`: the compatibility the
/// registry keeps, which is the definition's (only compatible changes are taken).
pub async fn config() -> Answer {
    ok(json!({"compatibilityLevel": "BACKWARD"}))
}

/// The definition of the stream of `subject`, and the writer of a registration's schema for
/// it (refused when the definition does not take its values).
fn check(
    state: &AppState,
    subject: &str,
    body: &Registration,
) -> Result<(Arc<StreamDef>, SchemaKind), RegistryError> {
    let def = state
        .registry
        .stream_of(subject)
        .and_then(|s| state.stream(s))
        .ok_or_else(|| subject_not_found(subject))?;
    let kind = SchemaKind::parse(body.schema_type.as_deref())
        .map_err(|e| RegistryError(StatusCode::UNPROCESSABLE_ENTITY, 42201, e))?;
    if !body.references.is_empty() {
        return Err(RegistryError(
            StatusCode::UNPROCESSABLE_ENTITY,
            42201,
            "schema references are not taken".into(),
        ));
    }
    if let Writer::Refused(reason) = Writer::compile(kind, &body.schema, &def) {
        let invalid = reason.starts_with("it is not");
        return Err(if invalid {
            RegistryError(StatusCode::UNPROCESSABLE_ENTITY, 42201, reason)
        } else {
            RegistryError(
                StatusCode::CONFLICT,
                409,
                format!(
                    "Schema being registered is incompatible with stream '{}': {reason}",
                    def.name
                ),
            )
        });
    }
    Ok((def, kind))
}

/// `POST /registry/subjects/{subject}/versions`: registers a schema the stream's definition
/// takes; `{"id": …}`. The same schema again gets the same id.
pub async fn register(
    State(state): State<Arc<AppState>>,
    Path(subject): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Registration>,
) -> Answer {
    let stream = state.registry.stream_of(&subject).map(str::to_owned);
    admit(
        &state,
        &headers,
        Some(stream.as_deref().unwrap_or(&subject)),
    )?;
    state.registry.sync(&state);
    let (_, kind) = check(&state, &subject, &body)?;
    let entry = Entry {
        subject: subject.clone(),
        kind: kind.name().to_owned(),
        schema: body.schema,
    };
    let registry = &state.registry;
    let (id, new, sequence) = {
        let mut held = registry.write();
        let (id, new) = held.add(entry.clone());
        (id, new, held.by_id.len())
    };
    if new {
        registry.keep(&entry, sequence).map_err(|e| {
            RegistryError(StatusCode::INTERNAL_SERVER_ERROR, 50001, format!("{e:#}"))
        })?;
        tracing::info!(subject, id, "schema registered");
    }
    ok(json!({"id": id}))
}

/// `POST /registry/subjects/{subject}`: the version and id of a schema registered under the
/// subject.
pub async fn lookup(
    State(state): State<Arc<AppState>>,
    Path(subject): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Registration>,
) -> Answer {
    admit(&state, &headers, None)?;
    state.registry.sync(&state);
    let kind = SchemaKind::parse(body.schema_type.as_deref())
        .map_err(|e| RegistryError(StatusCode::UNPROCESSABLE_ENTITY, 42201, e))?;
    let id = id_of(kind.name(), &body.schema);
    let held = state.registry.read();
    let versions = held
        .subjects
        .get(&subject)
        .ok_or_else(|| subject_not_found(&subject))?;
    let position = versions
        .iter()
        .position(|v| *v == id)
        .ok_or_else(|| RegistryError(StatusCode::NOT_FOUND, 40403, "Schema not found".into()))?;
    ok(version_body(&subject, id, position + 1, &held.by_id[&id]))
}

/// `POST /registry/compatibility/subjects/{subject}/versions/{version}`: whether the stream's
/// definition takes values of the schema.
pub async fn compatibility(
    State(state): State<Arc<AppState>>,
    Path((subject, _version)): Path<(String, String)>,
    headers: HeaderMap,
    Json(body): Json<Registration>,
) -> Answer {
    admit(&state, &headers, None)?;
    match check(&state, &subject, &body) {
        Ok(_) => ok(json!({"is_compatible": true})),
        Err(RegistryError(StatusCode::CONFLICT, _, message)) => {
            ok(json!({"is_compatible": false, "messages": [message]}))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests;
