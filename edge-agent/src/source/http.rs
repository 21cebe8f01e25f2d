//! A local HTTP port with the gateway's ingest API (`POST /v1/streams/{stream}/records`, NDJSON,
//! JSON array or Parquet bodies, zstd/gzip/identity), for devices that cannot reach the core. The
//! answer (accepted, duplicates, rejected by index) comes once the records are durable in the
//! agent's spool; from there the agent delivers them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use schemas::api::{ErrorBody, IngestResponse};
use schemas::decode::{BodyFormat, split_body};
use schemas::{DecodeError, StreamDef, Streams};
use service_kit::DefinitionFile;
use service_kit::http::body::{DecompressError, Encoding, decompress_into};
use service_kit::http::server::TlsConfig;
use tokio_util::sync::CancellationToken;

use super::{Feed, Feeds};
use crate::chunk::{Chunk, ChunkOutcome};

/// Starts the pipeline of a stream defined after the agent started (blocking) and gives its feed.
pub type StartStream = Arc<dyn Fn(Arc<StreamDef>) -> anyhow::Result<Feed> + Send + Sync>;

struct Local {
    streams: Streams,
    /// The feeds of the streams served: those known at the start, and those started since.
    feeds: Mutex<Feeds>,
    start: StartStream,
    token: Option<blake3::Hash>,
    max_body_bytes: usize,
    /// Definitions read again for Parquet bodies with a column the running one lacks
    /// ([`Local::newer`]), and those of streams started since the start, by stream, with their
    /// files.
    definitions: Mutex<HashMap<String, (Arc<StreamDef>, DefinitionFile)>>,
    /// The files of streams asked for that were not running, as last seen
    /// ([`Local::defined_since_start`]); only names with a file are kept.
    asked: Mutex<HashMap<String, DefinitionFile>>,
    streams_dir: PathBuf,
}

impl Local {
    /// The definition Parquet bodies of `stream` are read with.
    fn definition(&self, stream: &str) -> Option<Arc<StreamDef>> {
        let newer = lock(&self.definitions)
            .get(stream)
            .map(|(def, _)| def.clone());
        newer.or_else(|| self.streams.get(stream).cloned())
    }

    /// The definition and feed of `stream` if it runs.
    fn served(&self, stream: &str) -> Option<(Arc<StreamDef>, Feed)> {
        let feed = lock(&self.feeds).get(stream)?.clone();
        Some((self.definition(stream)?, feed))
    }

    /// A request for a stream that does not run (blocking): if `streams_dir` has a file of that
    /// name that is new or changed since last looked at (a `stat`), the stream is loaded from it
    /// and started (spool, pipeline, delivery) and served from now on, as at the next start.
    /// Names without a file cost a `stat` and are not remembered, so a client cannot grow
    /// anything by asking for streams that do not exist; a file that does not load is logged
    /// once and looked at again when it changes. One stream starts at a time. A stream that
    /// cannot be started (its spool cannot be opened, the agent is stopping) is a 503.
    fn defined_since_start(&self, stream: &str) -> Result<Option<(Arc<StreamDef>, Feed)>, Refusal> {
        if schemas::validate_stream_name(stream).is_err() {
            return Ok(None);
        }
        let mut asked = lock(&self.asked);
        if let Some(served) = self.served(stream) {
            return Ok(Some(served));
        }
        if !self.streams_dir.join(format!("{stream}.toml")).is_file() {
            asked.remove(stream);
            return Ok(None);
        }
        let file = asked
            .entry(stream.to_owned())
            .or_insert_with(|| DefinitionFile::new(&self.streams_dir, stream));
        if !file.changed_since_seen() {
            return Ok(None);
        }
        let def = match service_kit::load_stream(&self.streams_dir, stream) {
            Ok(def) => def,
            Err(e) => {
                tracing::warn!(stream, error = %format!("{e:#}"), "a stream asked for at the local port is defined in streams_dir, but its definition does not load");
                return Ok(None);
            }
        };
        let feed = match (self.start)(def.clone()) {
            Ok(feed) => feed,
            Err(e) => {
                tracing::error!(stream, error = %format!("{e:#}"), "a stream defined after the start cannot be started");
                // Looked at again at the next request: the file did not change, the start failed.
                *file = DefinitionFile::new(&self.streams_dir, stream);
                return Err(error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    format!("stream '{stream}' cannot be started: {e:#}"),
                ));
            }
        };
        let file = asked.remove(stream).expect("inserted above");
        lock(&self.definitions).insert(stream.to_owned(), (def.clone(), file));
        lock(&self.feeds).insert(stream.to_owned(), feed.clone());
        tracing::info!(
            stream,
            "a stream defined after the start is served at the local port from now on"
        );
        Ok(Some((def, feed)))
    }

    /// A Parquet body has a column `running` lacks: if the stream's file changed since it was
    /// read (a `stat`), it is read again, and a compatible change is used for this body and
    /// those after it (the pipeline takes it too, at the first record that needs it). Another
    /// body may have found it already: that one is given.
    #[cfg_attr(not(feature = "parquet"), allow(dead_code))]
    fn newer(&self, running: &Arc<StreamDef>) -> Option<Arc<StreamDef>> {
        let mut definitions = lock(&self.definitions);
        let (current, file) = definitions.entry(running.name.clone()).or_insert_with(|| {
            let file = DefinitionFile::new(&self.streams_dir, &running.name);
            (running.clone(), file)
        });
        if !Arc::ptr_eq(current, running) {
            return Some(current.clone());
        }
        *current = Arc::new(file.compatible_change(current)?);
        Some(current.clone())
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A refused request: a 4xx (or 503) with the gateway's JSON error body.
#[derive(Debug)]
pub struct Refusal {
    status: StatusCode,
    code: &'static str,
    message: String,
}

fn error(status: StatusCode, code: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        code,
        message: message.into(),
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            axum::Json(ErrorBody {
                error: self.code.to_owned(),
                message: self.message,
            }),
        )
            .into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        response
    }
}

/// The router of the local ingest port.
pub fn router(
    streams: Streams,
    streams_dir: &std::path::Path,
    feeds: Feeds,
    start: StartStream,
    token: Option<&str>,
    max_body_bytes: usize,
) -> Router {
    let local = Arc::new(Local {
        streams,
        feeds: Mutex::new(feeds),
        start,
        asked: Mutex::default(),
        token: token.map(|t| blake3::hash(t.as_bytes())),
        max_body_bytes,
        definitions: Mutex::default(),
        streams_dir: streams_dir.to_path_buf(),
    });
    Router::new()
        .route("/v1/streams/{stream}/records", post(ingest))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(local)
        // A refused body is read to its end (to a bound) so that the client sees the answer.
        .layer(axum::middleware::from_fn_with_state(
            service_kit::http::drain::Drain {
                max_bytes: max_body_bytes,
                max_time: std::time::Duration::from_secs(10),
            },
            service_kit::http::drain::drain_unread,
        ))
}

/// Serves the local ingest port until `shutdown`, over TLS when `tls` is given.
pub async fn serve(
    listen: SocketAddr,
    router: Router,
    tls: Option<TlsConfig>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let tls = match tls {
        Some(tls) => Some(tls.load().await?),
        None => None,
    };
    let listener = std::net::TcpListener::bind(listen)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| anyhow::anyhow!("cannot listen on {listen}: {e}"))?;
    tracing::info!(%listen, tls = tls.is_some(), "local ingest port listening");
    let options = service_kit::http::server::ServeOptions::default();
    service_kit::http::server::serve(listener, router, tls, options, shutdown).await
}

fn authorized(local: &Local, headers: &HeaderMap) -> bool {
    let Some(expected) = local.token else {
        return true;
    };
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        // blake3::Hash compares in constant time.
        .is_some_and(|t| blake3::hash(t.trim().as_bytes()) == expected)
}

async fn ingest(
    State(local): State<Arc<Local>>,
    Path(stream): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<axum::Json<IngestResponse>, Refusal> {
    if !authorized(&local, &headers) {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer token",
        ));
    }
    let served = match local.served(&stream) {
        Some(served) => Some(served),
        None => {
            let (local, stream) = (local.clone(), stream.clone());
            tokio::task::spawn_blocking(move || local.defined_since_start(&stream))
                .await
                .map_err(|e| error(StatusCode::SERVICE_UNAVAILABLE, "internal", e.to_string()))??
        }
    };
    let Some((def, feed)) = served else {
        return Err(error(
            StatusCode::NOT_FOUND,
            "unknown_stream",
            "no such stream",
        ));
    };
    let format = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(BodyFormat::from_content_type)
        .ok_or_else(|| {
            error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "Content-Type must be application/x-ndjson, application/json or application/vnd.apache.parquet",
            )
        })?;
    let encoding =
        Encoding::from_header(headers.get(header::CONTENT_ENCODING)).ok_or_else(|| {
            error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_encoding",
                "Content-Encoding must be zstd, gzip or identity",
            )
        })?;
    let (limit, reader) = (local.max_body_bytes, local.clone());
    let ndjson = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, Refusal> {
        let mut plain = Vec::new();
        decompress_into(
            encoding,
            &body,
            limit,
            &mut None,
            &def.dictionaries,
            &mut plain,
            &mut schemas::budget::unlimited,
        )
        .map_err(|e| match e {
            DecompressError::TooLarge(_) => {
                error(StatusCode::PAYLOAD_TOO_LARGE, "too_large", e.to_string())
            }
            DecompressError::Invalid(m) => error(StatusCode::BAD_REQUEST, "bad_encoding", m),
            DecompressError::OverBudget => {
                error(StatusCode::TOO_MANY_REQUESTS, "overloaded", e.to_string())
            }
            DecompressError::UnknownDictionary(_) => error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unknown_dictionary",
                e.to_string(),
            ),
        })?;
        match format {
            BodyFormat::Ndjson => Ok(plain),
            BodyFormat::JsonArray => array_to_ndjson(&plain),
            BodyFormat::Parquet => parquet_to_ndjson(&reader, def, plain, limit),
            BodyFormat::Avro => Err(error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "the agent's local port takes NDJSON, JSON or Parquet; the gateway takes Avro files",
            )),
        }
    })
    .await
    .map_err(|e| error(StatusCode::SERVICE_UNAVAILABLE, "internal", e.to_string()))??;
    let (tx, rx) = tokio::sync::oneshot::channel::<ChunkOutcome>();
    let done: crate::chunk::Done = Box::new(move |outcome| {
        let _ = tx.send(outcome);
    });
    let stopping = || {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "stopping",
            "the agent stopped before the records were stored",
        )
    };
    feed.send(Chunk::new(ndjson, Some(done)))
        .await
        .map_err(|_| stopping())?;
    // No answer: the agent stopped before the records were durable; nothing was acknowledged.
    let outcome = rx.await.map_err(|_| stopping())?;
    if outcome.spool_dropped {
        // The stream's `drop_newest` policy dropped (some of) these records. Their digests left
        // the dedupe window, so the client's retry stores them; records that were stored count
        // as duplicates then.
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "spool_full",
            "the spool is full and this stream drops new records; retry later",
        ));
    }
    Ok(axum::Json(IngestResponse {
        accepted: outcome.accepted,
        duplicates: outcome.duplicates,
        rejected: outcome.rejected,
    }))
}

/// A body that cannot be read as records.
fn bad_body(e: DecodeError) -> Refusal {
    match e {
        DecodeError::TooLarge(_) => {
            error(StatusCode::PAYLOAD_TOO_LARGE, "too_large", e.to_string())
        }
        e => error(StatusCode::BAD_REQUEST, "malformed", e.to_string()),
    }
}

/// A JSON array body as NDJSON lines.
fn array_to_ndjson(plain: &[u8]) -> Result<Vec<u8>, Refusal> {
    let items = split_body(BodyFormat::JsonArray, plain).map_err(bad_body)?;
    let mut out = Vec::with_capacity(plain.len());
    for item in items {
        // JSON strings cannot hold raw line breaks, so any in an element are whitespace.
        out.extend(
            item.iter()
                .map(|&b| if b == b'\n' || b == b'\r' { b' ' } else { b }),
        );
        out.push(b'\n');
    }
    Ok(out)
}

/// A Parquet body as NDJSON, read with the stream's definition or a newer one it needs.
#[cfg(feature = "parquet")]
fn parquet_to_ndjson(
    reader: &Local,
    mut def: Arc<StreamDef>,
    plain: Vec<u8>,
    limit: usize,
) -> Result<Vec<u8>, Refusal> {
    let plain = Bytes::from(plain);
    loop {
        match schemas::columnar::parquet_to_ndjson(&def, plain.clone(), limit) {
            Err(e) if e.newer_definition_may_take() => match reader.newer(&def) {
                Some(newer) => def = newer,
                None => return Err(bad_body(e)),
            },
            converted => return converted.map_err(bad_body),
        }
    }
}

/// An agent built without Parquet (cargo feature `parquet`) takes no Parquet bodies.
#[cfg(not(feature = "parquet"))]
fn parquet_to_ndjson(
    _: &Local,
    _: Arc<StreamDef>,
    _: Vec<u8>,
    _: usize,
) -> Result<Vec<u8>, Refusal> {
    Err(error(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
        "this edge-agent is built without Parquet (cargo feature `parquet`): send NDJSON",
    ))
}
