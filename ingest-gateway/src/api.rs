//! The HTTP API: `POST /v1/streams/{stream}/records`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt as _;
use schemas::DecodeError;
use schemas::api::{IngestResponse, RejectedRecord};
use schemas::budget::Charge;
use schemas::columnar::parquet_to_ndjson_charged;
use schemas::decode::{BodyFormat, split_body_charged};
use schemas::hash::HashSetOfHashes;
use schemas::registry::avro_file_to_ndjson;
use schemas::{Forward, HashGroup, RecordError, StreamDef, Streams, validate_stream_name};
use service_kit::http::body::DecompressError;
use service_kit::kafka::Messages;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::auth::Auth;
use crate::config::{IdempotencyConfig, LimitsConfig};
pub use crate::error::ApiError;
use crate::idempotency::{self, Begin, IdempotencyCache};
use crate::metrics as m;
use crate::produce::Producer;
use service_kit::DefinitionFile;
use service_kit::kafka::DeadLetter;

/// Shared state of the handlers.
pub struct AppState {
    /// Replaced whole when the definitions are reloaded (SIGHUP); a request keeps the
    /// definition it began with.
    streams: std::sync::RwLock<Streams>,
    /// Replaced whole when the tokens are reloaded (SIGHUP); a request keeps the one it began
    /// with.
    auth: std::sync::RwLock<Arc<Auth>>,
    pub limits: LimitsConfig,
    pub producer: Producer,
    pub idempotency: IdempotencyCache,
    /// One permit per request served at once.
    pub concurrency: Semaphore,
    /// One permit per KiB of request bytes held at once.
    pub inflight: Arc<Semaphore>,
    /// The definition files of `streams_dir`, looked at when a request's records do not fit
    /// their stream's definition ([`AppState::newer_definition`]); empty: definitions change
    /// only at SIGHUP.
    definitions: std::sync::Mutex<Option<DefinitionFiles>>,
    /// Held while a stream defined after the start is looked for and added.
    adding: tokio::sync::Mutex<()>,
    /// The schema registry of the streams (`/registry`).
    pub registry: crate::registry::store::Registry,
}

/// The definition files of the streams, by stream, as they were when last read.
struct DefinitionFiles {
    dir: std::path::PathBuf,
    /// For the topics of streams defined after the start.
    kafka: crate::config::KafkaConfig,
    files: std::collections::HashMap<String, DefinitionFile>,
}

impl AppState {
    pub fn new(
        streams: Streams,
        auth: Auth,
        limits: LimitsConfig,
        producer: Producer,
        idempotency: &IdempotencyConfig,
    ) -> AppState {
        AppState {
            concurrency: Semaphore::new(limits.max_concurrent_requests.max(1)),
            inflight: Arc::new(Semaphore::new(
                (limits.max_inflight_bytes / 1024).clamp(1, Semaphore::MAX_PERMITS),
            )),
            streams: std::sync::RwLock::new(streams),
            auth: std::sync::RwLock::new(Arc::new(auth)),
            limits,
            producer,
            idempotency: IdempotencyCache::new(idempotency),
            definitions: std::sync::Mutex::new(None),
            adding: tokio::sync::Mutex::new(()),
            registry: crate::registry::store::Registry::default(),
        }
    }

    /// The state with `registry` as its schema registry.
    pub fn with_registry(self, registry: crate::registry::store::Registry) -> AppState {
        AppState { registry, ..self }
    }

    /// Takes compatible changes of the definitions in `dir` from now on, when a request needs
    /// one ([`AppState::newer_definition`]).
    pub fn follow_definitions(&self, dir: std::path::PathBuf, kafka: crate::config::KafkaConfig) {
        *self
            .definitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(DefinitionFiles {
            dir,
            kafka,
            files: Default::default(),
        });
    }

    /// A request for `stream`, which no definition in force names. If `<stream>.toml` in
    /// `streams_dir` appeared or changed since it was last looked at (a `stat`), that file alone
    /// is put in force ([`crate::put_stream_in_force`]: the new stream's topic created first
    /// when `kafka.create_topics`; other files of the directory wait for SIGHUP or a restart),
    /// and the stream's definition is given if it is there now. Requests for a stream that is
    /// being added wait for it.
    pub async fn defined_since_start(self: &Arc<Self>, stream: &str) -> Option<Arc<StreamDef>> {
        // A name no stream can have (`../x`) is not looked for on disk at all.
        schemas::validate_stream_name(stream).ok()?;
        let _one_at_a_time = self.adding.lock().await;
        if let Some(def) = self.stream(stream) {
            return Some(def);
        }
        let (state, name) = (self.clone(), stream.to_owned());
        let (dir, kafka) = tokio::task::spawn_blocking(move || {
            let mut guard = state
                .definitions
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let definitions = guard.as_mut()?;
            // Names without a file are not remembered: a client cannot grow this by asking
            // for streams that do not exist.
            if !definitions.dir.join(format!("{name}.toml")).is_file() {
                return None;
            }
            let file = definitions
                .files
                .entry(name.clone())
                .or_insert_with(|| DefinitionFile::new(&definitions.dir, &name));
            file.changed_since_seen()
                .then(|| (definitions.dir.clone(), definitions.kafka.clone()))
        })
        .await
        .ok()
        .flatten()?;
        match crate::put_stream_in_force(self, &dir, stream, &kafka).await {
            Ok(()) => {
                tracing::info!(
                    stream,
                    "a stream defined after the start is served from now on"
                );
            }
            Err(e) => {
                tracing::error!(stream, error = %format!("{e:#}"), "a stream defined after the start cannot be served: its definition does not load, or its topic cannot be created");
            }
        }
        self.stream(stream)
    }

    /// A request's records did not fit `running` in a way a newer definition may take (a field
    /// or Parquet column it lacks, a required field missing). If the stream's file changed since
    /// it was read (a `stat`), it is read again, and a compatible change is put in force for
    /// this request and those after it; the request is then checked again. An incompatible
    /// change is refused (logged) until SIGHUP or a restart takes the directory whole. Another
    /// request (or SIGHUP) may have put a newer definition in force already: that one is given.
    pub async fn newer_definition(
        self: &Arc<Self>,
        running: &Arc<StreamDef>,
    ) -> Option<Arc<StreamDef>> {
        let state = self.clone();
        let running = running.clone();
        tokio::task::spawn_blocking(move || {
            let mut guard = state
                .definitions
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let definitions = guard.as_mut()?;
            let current = state.stream(&running.name)?;
            if !Arc::ptr_eq(&current, &running) {
                return Some(current);
            }
            let def = definitions
                .files
                .entry(running.name.clone())
                .or_insert_with(|| DefinitionFile::new(&definitions.dir, &running.name))
                .compatible_change(&current)?;
            let def = Arc::new(def);
            state
                .streams
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .replace(def.clone());
            Some(def)
        })
        .await
        .ok()
        .flatten()
    }

    /// The directory of the definitions the gateway follows ([`AppState::follow_definitions`]).
    pub fn streams_dir(&self) -> Option<std::path::PathBuf> {
        self.definitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|d| d.dir.clone())
    }

    /// The tokens in force.
    pub fn auth(&self) -> Arc<Auth> {
        self.auth
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The definition of `stream` in force.
    pub fn stream(&self, stream: &str) -> Option<Arc<StreamDef>> {
        self.streams
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(stream)
            .cloned()
    }

    /// The definitions in force.
    pub fn streams(&self) -> Streams {
        self.streams
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Puts `streams` in force for the requests that begin from now on.
    pub fn set_streams(&self, streams: Streams) {
        *self
            .streams
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = streams;
    }

    /// Puts `auth` in force for the requests that begin from now on.
    pub fn set_auth(&self, auth: Auth) {
        *self
            .auth
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(auth);
    }
}

pub use service_kit::http::body::Encoding;

fn content_encoding(headers: &HeaderMap) -> Result<Encoding, ApiError> {
    Encoding::from_header(headers.get(header::CONTENT_ENCODING))
        .ok_or_else(|| ApiError::unsupported("Content-Encoding must be zstd, gzip or identity"))
}

fn body_format(headers: &HeaderMap) -> Result<BodyFormat, ApiError> {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(BodyFormat::from_content_type)
        .ok_or_else(|| {
            ApiError::unsupported(
                "Content-Type must be application/x-ndjson, application/json, application/vnd.apache.parquet or avro/binary",
            )
        })
}

/// Decompression state of a request: a zstd context, kept by each blocking-pool thread between
/// requests, and an output buffer, taken from the few kept ([`KEPT_BUFFERS`]; fresh megabyte
/// buffers per request cost more in page faults than the decoding itself).
struct Scratch {
    zstd: Option<zstd::bulk::Decompressor<'static>>,
    plain: Vec<u8>,
}

/// Larger buffers are not kept between requests.
const SCRATCH_KEEP_BYTES: usize = 8 << 20;

/// Output buffers kept between requests, at most: the memory they hold between requests
/// (`KEPT_BUFFERS` × [`SCRATCH_KEEP_BYTES`]) is the only memory of the checks outside the
/// in-flight budget, so it is bounded whatever the number of blocking threads.
const KEPT_BUFFERS: usize = 4;

static KEPT: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

thread_local! {
    static ZSTD: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// A kept output buffer, or a new one.
fn take_buffer() -> Vec<u8> {
    KEPT.lock()
        .ok()
        .and_then(|mut kept| kept.pop())
        .unwrap_or_default()
}

/// Keeps `buffer` for a later request if it is small enough and there is room.
fn keep_buffer(mut buffer: Vec<u8>) {
    if buffer.capacity() > SCRATCH_KEEP_BYTES {
        return;
    }
    buffer.clear();
    if let Ok(mut kept) = KEPT.lock()
        && kept.len() < KEPT_BUFFERS
    {
        kept.push(buffer);
    }
}

/// Decompresses `body` into the scratch buffer, stopping as soon as the output passes `limit` (a
/// bomb never grows past it).
fn decompress_into(
    def: &StreamDef,
    encoding: Encoding,
    body: &[u8],
    limit: usize,
    scratch: &mut Scratch,
    charge: Charge<'_>,
) -> Result<(), ApiError> {
    service_kit::http::body::decompress_into(
        encoding,
        body,
        limit,
        &mut scratch.zstd,
        &def.dictionaries,
        &mut scratch.plain,
        charge,
    )
    .map_err(|e| match e {
        DecompressError::TooLarge(limit) => decompressed_too_large(limit),
        DecompressError::OverBudget => overloaded("in-flight bytes"),
        DecompressError::Invalid(message) => ApiError::bad_request(message),
        e @ DecompressError::UnknownDictionary(_) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            UNKNOWN_DICTIONARY,
            format!(
                "{e}; this gateway has {:?}: send the batch without a dictionary",
                def.dictionaries.ids()
            ),
        ),
    })
}

/// The error code of a body compressed with a zstd dictionary the gateway does not have.
pub const UNKNOWN_DICTIONARY: &str = "unknown_dictionary";

fn decompressed_too_large(limit: usize) -> ApiError {
    ApiError::too_large(format!("decompressed body is larger than {limit} bytes"))
}

/// What decoding and validating one request produced.
pub struct Checked {
    pub prepared: Messages,
    pub dead_letters: Vec<DeadLetter>,
    pub response: IngestResponse,
    pub decompressed_bytes: usize,
    /// The request's records, for `Idempotency-Key`.
    pub fingerprint: idempotency::Fingerprint,
    /// Some record set a field the definition lacks, or lacked a required one: a newer
    /// definition may take it ([`AppState::newer_definition`]).
    pub newer_definition_may_take: bool,
}

/// Decompresses, decodes, validates and hashes a body; CPU work, run on the blocking pool. The
/// memory it takes besides the body (the decompressed bytes as the decoder produces them, the
/// records' lines, the Kafka messages) is taken from `charge` before it is allocated: a body
/// the budget does not take is answered 429 (`overloaded`) before it fills memory.
pub fn check_body(
    def: &StreamDef,
    format: BodyFormat,
    encoding: Encoding,
    body: Bytes,
    limits: &LimitsConfig,
    charge: Charge<'_>,
) -> Result<Checked, ApiError> {
    if encoding == Encoding::Identity {
        if body.len() > limits.max_decompressed_bytes {
            return Err(decompressed_too_large(limits.max_decompressed_bytes));
        }
        return check_plain(def, format, &body, limits, charge);
    }
    ZSTD.with(|zstd| {
        let mut scratch = Scratch {
            zstd: zstd.borrow_mut().take(),
            plain: take_buffer(),
        };
        // A buffer kept from earlier bodies is this body's while it is checked.
        if !charge(scratch.plain.capacity()) {
            keep_buffer(scratch.plain);
            *zstd.borrow_mut() = scratch.zstd;
            return Err(overloaded("in-flight bytes"));
        }
        let checked = decompress_into(
            def,
            encoding,
            &body,
            limits.max_decompressed_bytes,
            &mut scratch,
            &mut *charge,
        )
        .and_then(|()| check_plain(def, format, &scratch.plain, limits, &mut *charge));
        keep_buffer(scratch.plain);
        *zstd.borrow_mut() = scratch.zstd;
        checked
    })
}

/// Decodes, validates and hashes an uncompressed body.
fn check_plain(
    def: &StreamDef,
    format: BodyFormat,
    plain: &[u8],
    limits: &LimitsConfig,
    charge: Charge<'_>,
) -> Result<Checked, ApiError> {
    let converted;
    let (format, plain) = match format {
        BodyFormat::Parquet | BodyFormat::Avro => {
            if !charge(plain.len()) {
                return Err(overloaded("in-flight bytes"));
            }
            let max = limits.max_decompressed_bytes;
            converted = if format == BodyFormat::Parquet {
                parquet_to_ndjson_charged(def, Bytes::copy_from_slice(plain), max, &mut *charge)
            } else {
                avro_file_to_ndjson(def, plain, max).and_then(|ndjson| {
                    charge(ndjson.len())
                        .then_some(ndjson)
                        .ok_or(DecodeError::OverBudget)
                })
            }
            .map_err(|e| match e {
                DecodeError::TooLarge(limit) => decompressed_too_large(limit),
                DecodeError::OverBudget => overloaded("in-flight bytes"),
                e => ApiError {
                    newer_definition_may_take: e.newer_definition_may_take(),
                    ..ApiError::bad_request(e.to_string())
                },
            })?;
            (BodyFormat::Ndjson, &converted[..])
        }
        other => (other, plain),
    };
    let records = split_body_charged(format, plain, limits.max_records, &mut *charge)
        .map_err(|e| match e {
            DecodeError::OverBudget => overloaded("in-flight bytes"),
            e => ApiError::bad_request(e.to_string()),
        })?
        .ok_or_else(|| {
            ApiError::too_large(format!(
                "more than {} records in one request",
                limits.max_records
            ))
        })?;
    // The Kafka messages (values about as large as the records), the in-request dedupe set and
    // the fingerprint.
    if !charge(plain.len() + records.len() * CHECK_BYTES_PER_RECORD) {
        return Err(overloaded("in-flight bytes"));
    }
    let mut response = IngestResponse::default();
    let mut seen = HashSetOfHashes::with_capacity_and_hasher(records.len(), Default::default());
    let mut prepared = Messages::new(def, records.len(), plain.len());
    let mut dead_letters = Vec::new();
    // Hashed once at the end: BLAKE3 takes a long input several chunks at a time, where 32
    // bytes per update would go one block at a time.
    let mut fingerprint = Vec::with_capacity(records.len() * 32);
    let mut newer_definition_may_take = false;
    // Records are checked a group at a time and the group's content hashes made together
    // ([`HashGroup`]), then taken in order.
    let mut hashes = HashGroup::new();
    let mut group = Vec::with_capacity(HASH_GROUP.min(records.len()));
    let mut records = records.into_iter().enumerate().peekable();
    while records.peek().is_some() {
        group.extend(records.by_ref().take(HASH_GROUP).map(|(index, line)| {
            let raw = line.bytes();
            let checked = if raw.len() > limits.max_line_bytes {
                Err(RecordError::Malformed(format!(
                    "record is {} bytes; the limit is {}",
                    raw.len(),
                    limits.max_line_bytes
                )))
            } else {
                schemas::check_bytes_forward_in(def, line, &mut hashes)
            };
            (index, raw, checked)
        }));
        hashes.finish();
        for (index, raw, checked) in group.drain(..) {
            let checked = checked.map(|f| Forward {
                hash: hashes.get(f.hash),
                key: f.key,
                canonical: f.canonical,
            });
            match &checked {
                Ok(record) => fingerprint.extend_from_slice(&record.hash.0),
                Err(_) => fingerprint.extend_from_slice(blake3::hash(raw).as_bytes()),
            }
            match checked {
                Ok(record) => {
                    if seen.insert(record.hash) {
                        // The client's own text is the value when it is a plain object of the
                        // stream's keys; re-encoding it would only cost time.
                        prepared.push_forward(def, &record, raw);
                        let size = prepared.last_message_bytes();
                        if size > limits.max_message_bytes {
                            prepared.pop();
                            seen.remove(&record.hash);
                            let reason = service_kit::kafka::too_large_reason(
                                size,
                                limits.max_message_bytes,
                            );
                            dead_letters.push(DeadLetter::new(index, "too_large", &reason, raw));
                            response.rejected.push(RejectedRecord { index, reason });
                        }
                    } else {
                        response.duplicates += 1;
                    }
                }
                Err(e) => {
                    newer_definition_may_take |= e.newer_definition_may_take();
                    let reason = e.to_string();
                    dead_letters.push(DeadLetter::new(index, e.code(), &reason, raw));
                    response.rejected.push(RejectedRecord { index, reason });
                }
            }
        }
        hashes.clear();
    }
    Ok(Checked {
        prepared,
        dead_letters,
        response,
        decompressed_bytes: plain.len(),
        fingerprint: *blake3::hash(&fingerprint).as_bytes(),
        newer_definition_may_take,
    })
}

/// Records of a request whose content hashes are made together.
const HASH_GROUP: usize = 32;

/// Memory `check_plain` takes per record besides its value: its Kafka message's entry, its
/// content hash in the in-request dedupe set and in the fingerprint.
const CHECK_BYTES_PER_RECORD: usize = service_kit::kafka::Messages::ENTRY_BYTES
    + 2 * std::mem::size_of::<schemas::ContentHash>()
    + 2 * std::mem::size_of::<usize>();

const IDEMPOTENCY_KEY: &str = "idempotency-key";
const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Memory held by a request, taken from the in-flight budget (KiB permits) before it is
/// allocated and given back when the request ends; reported as a gauge.
pub(crate) struct Inflight {
    budget: Arc<Semaphore>,
    /// The whole budget (`limits.max_inflight_bytes`).
    capacity: usize,
    permit: Option<OwnedSemaphorePermit>,
    bytes: usize,
    /// A take failed that the whole budget could not have given either.
    never_fits: bool,
}

impl Inflight {
    pub(crate) fn new(budget: &Arc<Semaphore>, capacity: usize) -> Inflight {
        Inflight {
            budget: budget.clone(),
            capacity,
            permit: None,
            bytes: 0,
            never_fits: false,
        }
    }

    /// Takes `bytes` more from the budget; `false` when it does not have them now.
    fn take(&mut self, bytes: usize) -> bool {
        let total = self.bytes.saturating_add(bytes);
        let kib = total.div_ceil(1024) - self.bytes.div_ceil(1024);
        if kib > 0 {
            let acquired = u32::try_from(kib)
                .ok()
                .and_then(|kib| self.budget.clone().try_acquire_many_owned(kib).ok());
            match acquired {
                Some(more) => match &mut self.permit {
                    Some(held) => held.merge(more),
                    None => self.permit = Some(more),
                },
                None => {
                    self.never_fits = total > self.capacity;
                    return false;
                }
            }
        }
        self.bytes = total;
        metrics::gauge!(m::INFLIGHT_BYTES).increment(bytes as f64);
        true
    }

    /// Gives back what was taken past the first `bytes` (memory freed).
    fn give_back_to(&mut self, bytes: usize) {
        if let Some(held) = &mut self.permit {
            let keep = bytes.div_ceil(1024);
            drop(held.split(held.num_permits().saturating_sub(keep)));
        }
        let given = self.bytes.saturating_sub(bytes);
        self.bytes -= given;
        metrics::gauge!(m::INFLIGHT_BYTES).decrement(given as f64);
    }

    /// [`Inflight::take`], answered 429 with `Retry-After` when the budget does not have them.
    fn acquire(&mut self, bytes: usize) -> Result<(), ApiError> {
        if self.take(bytes) {
            Ok(())
        } else {
            Err(self.refusal(overloaded("in-flight bytes")))
        }
    }

    /// `error`, or 413 when the request needs more than the whole budget: no retry would do
    /// better than the 429 `error` promises.
    fn refusal(&self, error: ApiError) -> ApiError {
        if self.never_fits {
            ApiError::too_large(format!(
                "the request needs more memory than the gateway's whole max_inflight_bytes ({} bytes)",
                self.capacity
            ))
        } else {
            error
        }
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        metrics::gauge!(m::INFLIGHT_BYTES).decrement(self.bytes as f64);
    }
}

/// Reads a request body, its bytes taken from the in-flight budget before they are held: a
/// declared `Content-Length` at once, before anything is read (413 past `max_body_bytes`, 429
/// past the budget), a body without one as its buffer grows.
async fn read_body(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
    deadline: Instant,
    inflight: &mut Inflight,
) -> Result<Bytes, ApiError> {
    let too_large = || ApiError::too_large(format!("request body is larger than {limit} bytes"));
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let mut buffer = Vec::new();
    if let Some(declared) = declared {
        if declared > limit {
            return Err(too_large());
        }
        inflight.acquire(declared)?;
        buffer.reserve_exact(declared);
    }
    let read = async {
        let mut body = body;
        while let Some(frame) = body.frame().await {
            let frame = frame
                .map_err(|e| ApiError::bad_request(format!("cannot read the request body: {e}")))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if buffer.len() + data.len() > limit {
                return Err(too_large());
            }
            if !schemas::budget::reserve(&mut buffer, data.len(), &mut |bytes| inflight.take(bytes))
            {
                return Err(inflight.refusal(overloaded("in-flight bytes")));
            }
            buffer.extend_from_slice(&data);
        }
        Ok(())
    };
    match tokio::time::timeout_at(deadline.into(), read).await {
        Ok(read) => read.map(|()| Bytes::from(buffer)),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "the request body did not arrive in time",
        )),
    }
}

fn overloaded(what: &str) -> ApiError {
    ApiError {
        retry_after_secs: Some(1),
        ..ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "overloaded",
            format!("the gateway is at its limit of {what}; retry later"),
        )
    }
}

/// Unknown routes answer JSON too.
pub async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

/// Known routes with another method answer JSON too.
pub async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not take that method",
    )
}

/// The time a request has, from its first body byte to its answer: `request_timeout_ms`, plus
/// its `Content-Length` at `min_body_bytes_per_sec`. Without the second part, an agent whose
/// uplink carried its batch in longer than the timeout was answered 408 for every attempt, for
/// ever. Only an authenticated client gets this far (the token is checked before the body is
/// read), and `max_body_bytes` bounds what it can claim.
fn request_time(limits: &LimitsConfig, headers: &HeaderMap) -> Duration {
    let base = Duration::from_millis(limits.request_timeout_ms);
    let length = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(|n| n.min(limits.max_body_bytes as u64));
    match (length, limits.min_body_bytes_per_sec) {
        (Some(bytes), rate) if rate > 0 => {
            base + Duration::from_secs_f64(bytes as f64 / rate as f64)
        }
        _ => base,
    }
}

pub async fn ingest(
    State(state): State<Arc<AppState>>,
    path: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let Path(stream) = path.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let _slot = state
        .concurrency
        .try_acquire()
        .map_err(|_| overloaded("concurrent requests"))?;
    let auth = state.auth();
    let who = auth.authenticate(&headers)?;
    validate_stream_name(&stream).map_err(|e| ApiError::bad_request(e.to_string()))?;
    auth.authorize(who, &stream)?;
    auth.admit(who)?;
    let def = match state.stream(&stream) {
        Some(def) => Some(def),
        None => state.defined_since_start(&stream).await,
    };
    let def = def.ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_stream",
            format!("no stream named '{stream}'"),
        )
    })?;
    let format = body_format(&headers)?;
    let encoding = content_encoding(&headers)?;
    let key = match headers.get(IDEMPOTENCY_KEY) {
        None => None,
        Some(value) => Some(
            value
                .to_str()
                .ok()
                .filter(|k| idempotency::valid_key(k))
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "Idempotency-Key must be 1 to 255 visible ASCII characters",
                    )
                })?,
        ),
    };
    let deadline = Instant::now() + request_time(&state.limits, &headers);
    // Everything the request holds, from its body to its Kafka messages, is charged here and
    // given back when it ends.
    let mut inflight = Inflight::new(&state.inflight, state.limits.max_inflight_bytes);
    let body = read_body(
        body,
        &headers,
        state.limits.max_body_bytes,
        deadline,
        &mut inflight,
    )
    .await?;
    auth.charge(who, body.len());
    let labels = [("stream", stream.clone())];
    metrics::counter!(m::RECEIVED_BYTES, &labels).increment(body.len() as u64);

    // The memory the check takes is held until the request ends (its Kafka messages are
    // produced from it).
    let check = |def: Arc<StreamDef>, body: Bytes, mut inflight: Inflight| {
        let st = state.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let checked = check_body(&def, format, encoding, body, &st.limits, &mut |bytes| {
                    inflight.take(bytes)
                });
                (checked.map_err(|e| inflight.refusal(e)), inflight)
            })
            .await
            .map_err(|e| ApiError::unavailable(format!("internal error: {e}"), 1))
        }
    };
    let body_bytes = inflight.bytes;
    let (mut checked, mut inflight) = check(def.clone(), body.clone(), inflight).await?;
    let unfit = match &checked {
        Ok(c) => c.newer_definition_may_take,
        Err(e) => e.newer_definition_may_take,
    };
    if unfit && let Some(newer) = state.newer_definition(&def).await {
        // The first check's memory goes back before the second takes its own.
        drop(checked);
        inflight.give_back_to(body_bytes);
        (checked, inflight) = check(newer, body, inflight).await?;
    }
    let checked = checked?;
    // Given back once the answer is made, with the messages produced from it.
    let _held = inflight;
    metrics::counter!(m::DECOMPRESSED_BYTES, &labels).increment(checked.decompressed_bytes as u64);
    // The key is looked up once the records are known: a repeat must carry the same ones.
    let guard = match key {
        None => None,
        Some(key) => match state.idempotency.begin(&stream, key, checked.fingerprint) {
            Begin::Fresh(guard) => Some(guard),
            Begin::Replay(response) => {
                let mut r = Json(response).into_response();
                r.headers_mut()
                    .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
                return Ok(r);
            }
            Begin::Reused => {
                return Err(ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency_key_reused",
                    "this Idempotency-Key was used within the window for a request with other records; use a new key for every batch (nothing was produced)",
                ));
            }
            Begin::InFlight => {
                return Err(ApiError {
                    retry_after_secs: Some(1),
                    ..ApiError::new(
                        StatusCode::CONFLICT,
                        "in_progress",
                        "a request with this Idempotency-Key is in progress",
                    )
                });
            }
        },
    };

    let Checked {
        prepared,
        mut dead_letters,
        mut response,
        ..
    } = checked;
    if let Some(key) = key {
        dead_letters = dead_letters.into_iter().map(|d| d.in_batch(key)).collect();
    }
    for d in &dead_letters {
        metrics::counter!(m::REJECTED, "stream" => stream.clone(), "reason" => d.code())
            .increment(1);
    }
    let produced_bytes = prepared.value_bytes();
    let started = Instant::now();
    response.accepted = prepared.len();
    let produced = state.producer.produce(&def.name, prepared, dead_letters);
    match tokio::time::timeout_at(deadline.into(), produced).await {
        Ok(result) => result?,
        Err(_) => {
            return Err(ApiError::unavailable(
                "Kafka did not acknowledge the records in time",
                5,
            ));
        }
    }
    metrics::histogram!(m::PRODUCE_DURATION).record(started.elapsed().as_secs_f64());
    metrics::counter!(m::PRODUCED_BYTES, &labels).increment(produced_bytes as u64);
    for (outcome, n) in [
        ("accepted", response.accepted),
        ("duplicate", response.duplicates),
        ("rejected", response.rejected.len()),
    ] {
        metrics::counter!(m::RECORDS, "stream" => stream.clone(), "outcome" => outcome)
            .increment(n as u64);
    }
    if let Some(guard) = guard {
        guard.complete(&response);
    }
    Ok(Json(response).into_response())
}

#[cfg(test)]
mod tests;
