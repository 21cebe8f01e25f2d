//! What the gateway's registry holds: each subject's versions and every schema by id, with
//! the registry API's error answers.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::RwLock;

use anyhow::Context as _;
use axum::Json;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use schemas::registry::SchemaKind;
use schemas::registry::export::{avro_schema, json_schema, proto_schema};
use schemas::{StreamDef, Streams, ValueFormat};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The media type of the registry API's answers.
pub(super) const MEDIA_TYPE: &str = "application/vnd.schemaregistry.v1+json";

/// A schema the registry holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Entry {
    pub(super) subject: String,
    #[serde(rename = "schemaType")]
    pub(super) kind: String,
    pub(super) schema: String,
}

/// The subjects' schemas, by id, and each subject's versions (ids in order).
#[derive(Default)]
pub(super) struct Held {
    pub(super) by_id: HashMap<u32, Entry>,
    pub(super) subjects: BTreeMap<String, Vec<u32>>,
}

/// The registry of a gateway's streams.
pub struct Registry {
    topic_prefix: String,
    dir: Option<PathBuf>,
    /// `registry.add_fields`: a registration may add nullable fields to a stream.
    add_fields: bool,
    held: RwLock<Held>,
    /// Held while a registration adds fields to a definition.
    pub(super) evolving: tokio::sync::Mutex<()>,
}

impl Default for Registry {
    /// A registry of the default topic names, kept in memory.
    fn default() -> Registry {
        Registry {
            topic_prefix: schemas::wire::DEFAULT_TOPIC_PREFIX.to_owned(),
            dir: None,
            add_fields: false,
            held: RwLock::default(),
            evolving: tokio::sync::Mutex::default(),
        }
    }
}

/// An answer of the registry API that is not a success: its status, error code and message.
pub struct RegistryError(pub StatusCode, pub u32, pub String);

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

pub(super) type Answer = Result<Response, RegistryError>;

pub(super) fn ok(body: serde_json::Value) -> Answer {
    let mut answer = Json(body).into_response();
    answer.headers_mut().insert(
        header::CONTENT_TYPE,
        MEDIA_TYPE.parse().expect("a media type"),
    );
    Ok(answer)
}

pub(super) fn subject_not_found(subject: &str) -> RegistryError {
    RegistryError(
        StatusCode::NOT_FOUND,
        40401,
        format!("Subject '{subject}' not found."),
    )
}

/// The id of a schema: 31 bits of the BLAKE3 hash of its kind and its text as compact JSON (so
/// spacing does not matter), never 0.
pub(super) fn id_of(kind: &str, text: &str) -> u32 {
    let compact = serde_json::from_str::<serde_json::Value>(text)
        .map(|v| v.to_string())
        .unwrap_or_else(|_| text.to_owned());
    let hash = blake3::hash(format!("{kind}\0{compact}").as_bytes());
    let id = u32::from_be_bytes(hash.as_bytes()[..4].try_into().expect("4 bytes")) & 0x7fff_ffff;
    id.max(1)
}

/// The schema a stream's definition is served as: its kind and text, of its first registry
/// format (Avro for a stream of JSON values only).
fn definition_schema(def: &StreamDef) -> (SchemaKind, String) {
    match def.value_formats.iter().find(|f| **f != ValueFormat::Json) {
        Some(ValueFormat::JsonSchema) => (SchemaKind::Json, json_schema(def)),
        Some(ValueFormat::Protobuf) => (SchemaKind::Protobuf, proto_schema(def)),
        _ => (SchemaKind::Avro, avro_schema(def)),
    }
}

impl Registry {
    /// A registry of the topics named with `topic_prefix`, its registered schemas kept in `dir`
    /// (read back here).
    pub fn new(
        config: &crate::config::RegistryConfig,
        topic_prefix: &str,
    ) -> anyhow::Result<Registry> {
        let dir = config.dir.clone();
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
            add_fields: config.add_fields,
            held: RwLock::new(held),
            evolving: tokio::sync::Mutex::default(),
        })
    }

    /// Whether a registration may add nullable fields to a stream (`registry.add_fields`).
    pub(super) fn add_fields(&self) -> bool {
        self.add_fields
    }

    /// The stream of subject `<topic>-value`.
    pub(super) fn stream_of<'a>(&self, subject: &'a str) -> Option<&'a str> {
        subject
            .strip_suffix("-value")?
            .strip_prefix(self.topic_prefix.as_str())
    }

    fn subject(&self, stream: &str) -> String {
        format!("{}{stream}-value", self.topic_prefix)
    }

    /// Adds the schemas of the definitions in force that the registry does not hold yet (a
    /// stream's first, or one changed since).
    pub(super) fn sync(&self, streams: &Streams) {
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

    pub(super) fn read(&self) -> std::sync::RwLockReadGuard<'_, Held> {
        self.held
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn write(&self) -> std::sync::RwLockWriteGuard<'_, Held> {
        self.held
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps a registered schema in `dir` (written to a temporary file, then renamed), on the
    /// blocking pool.
    pub(super) async fn keep(&self, entry: Entry, id: u32, sequence: usize) -> anyhow::Result<()> {
        let Some(dir) = self.dir.clone() else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || keep_in(&dir, &entry, id, sequence)).await?
    }
}

/// [`Registry::keep`] in `dir`.
fn keep_in(dir: &std::path::Path, entry: &Entry, id: u32, sequence: usize) -> anyhow::Result<()> {
    // Named by sequence for the order, and by id so that gateways sharing the directory never
    // write one name for two schemas.
    let path = dir.join(format!("{sequence:010}-{id}.json"));
    let tmp = dir.join(format!(".{sequence:010}-{id}.json.tmp"));
    std::fs::write(&tmp, serde_json::to_vec(entry)?)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot rename {}", tmp.display()))?;
    Ok(())
}

impl Held {
    /// Adds `entry` under its id (the next free one when another text has it) and its subject;
    /// the id and whether it was new.
    pub(super) fn add(&mut self, entry: Entry) -> (u32, bool) {
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

    pub(super) fn version(
        &self,
        subject: &str,
        version: &str,
    ) -> Result<(u32, usize), RegistryError> {
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
