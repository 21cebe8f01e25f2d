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

mod evolve;
pub mod store;

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use schemas::FieldDef;
use schemas::StreamDef;
use schemas::registry::{SchemaKind, Writer, added_fields};
use serde::Deserialize;
use serde_json::json;

use crate::api::AppState;
use store::{Answer, Entry, id_of, ok, subject_not_found};
pub use store::{Registry, RegistryError};

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
    registry.sync(&state.streams());
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
    state.registry.sync(&state.streams());
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
    state.registry.sync(&state.streams());
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
    state.registry.sync(&state.streams());
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
    ok(json!(["AVRO", "JSON", "PROTOBUF"]))
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
) -> Result<(Arc<StreamDef>, SchemaKind, Vec<FieldDef>), RegistryError> {
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
            incompatible(&def, &reason)
        });
    }
    let added = match kind {
        SchemaKind::Avro => added_fields(&body.schema, &def).map_err(|e| incompatible(&def, &e))?,
        _ => Vec::new(),
    };
    if let Some(field) = added.first().filter(|_| !state.registry.add_fields()) {
        return Err(incompatible(
            &def,
            &format!(
                "its field '{}' is not in the stream's definition: add it there as a nullable field, or let the registry add it (registry.add_fields)",
                field.name
            ),
        ));
    }
    Ok((def, kind, added))
}

fn incompatible(def: &StreamDef, reason: &str) -> RegistryError {
    RegistryError(
        StatusCode::CONFLICT,
        409,
        format!(
            "Schema being registered is incompatible with stream '{}': {reason}",
            def.name
        ),
    )
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
    state.registry.sync(&state.streams());
    let (def, kind, added) = check(&state, &subject, &body)?;
    if !added.is_empty() {
        evolve::add_fields(&state, &def, &added, &subject).await?;
    }
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
        registry.keep(entry, id, sequence).await.map_err(|e| {
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
    state.registry.sync(&state.streams());
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
