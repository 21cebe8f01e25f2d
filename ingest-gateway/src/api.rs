//! The HTTP API: `POST /v1/streams/{stream}/records`.

use std::collections::HashSet;
use std::io::Read;
use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use schemas::api::{ErrorBody, IngestResponse, RejectedRecord};
use schemas::decode::{BodyFormat, decode_body};
use schemas::{StreamDef, Streams, validate_stream_name};

use crate::auth::Auth;
use crate::config::LimitsConfig;
use crate::metrics as m;
use crate::produce::{Prepared, Producer};

/// Shared state of the handlers.
pub struct AppState {
    pub streams: Streams,
    pub auth: Auth,
    pub limits: LimitsConfig,
    pub producer: Producer,
}

/// A client or server error, answered as JSON with a stable code.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub retry_after_secs: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }
    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
    }
    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
    fn too_large(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }
    fn unsupported(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            message,
        )
    }
    pub fn unavailable(message: impl Into<String>, retry_after_secs: u64) -> ApiError {
        ApiError {
            retry_after_secs: Some(retry_after_secs),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: self.code.to_owned(),
            message: self.message,
        };
        let mut response = (self.status, Json(body)).into_response();
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// How the body is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Identity,
    Zstd,
    Gzip,
}

fn content_encoding(headers: &HeaderMap) -> Result<Encoding, ApiError> {
    let Some(value) = headers.get(header::CONTENT_ENCODING) else {
        return Ok(Encoding::Identity);
    };
    match value.to_str().map(|v| v.trim().to_ascii_lowercase()) {
        Ok(v) if v.is_empty() || v == "identity" => Ok(Encoding::Identity),
        Ok(v) if v == "zstd" => Ok(Encoding::Zstd),
        Ok(v) if v == "gzip" || v == "x-gzip" => Ok(Encoding::Gzip),
        _ => Err(ApiError::unsupported(
            "Content-Encoding must be zstd, gzip or identity",
        )),
    }
}

fn body_format(headers: &HeaderMap) -> Result<BodyFormat, ApiError> {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(BodyFormat::from_content_type)
        .ok_or_else(|| {
            ApiError::unsupported("Content-Type must be application/x-ndjson or application/json")
        })
}

/// Decompresses `body`, stopping as soon as the output passes `limit` (a bomb never grows
/// past it).
fn decompress(encoding: Encoding, body: Bytes, limit: usize) -> Result<Bytes, ApiError> {
    let too_large =
        || ApiError::too_large(format!("decompressed body is larger than {limit} bytes"));
    let reader: Box<dyn Read + '_> = match encoding {
        Encoding::Identity => {
            return if body.len() > limit {
                Err(too_large())
            } else {
                Ok(body)
            };
        }
        Encoding::Zstd => Box::new(
            zstd::stream::read::Decoder::with_buffer(&body[..])
                .map_err(|e| ApiError::bad_request(format!("invalid zstd body: {e}")))?,
        ),
        Encoding::Gzip => Box::new(flate2::read::MultiGzDecoder::new(&body[..])),
    };
    let mut out = Vec::with_capacity(body.len().saturating_mul(4).min(limit));
    reader
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| ApiError::bad_request(format!("cannot decompress body: {e}")))?;
    if out.len() > limit {
        return Err(too_large());
    }
    Ok(Bytes::from(out))
}

/// What decoding and validating one request produced.
struct Checked {
    prepared: Vec<Prepared>,
    response: IngestResponse,
    decompressed_bytes: usize,
}

/// Decompresses, decodes, validates and hashes a body; CPU work, run on the blocking pool.
fn check_body(
    def: &StreamDef,
    format: BodyFormat,
    encoding: Encoding,
    body: Bytes,
    limits: &LimitsConfig,
) -> Result<Checked, ApiError> {
    let plain = decompress(encoding, body, limits.max_decompressed_bytes)?;
    let records = decode_body(format, &plain).map_err(|e| ApiError::bad_request(e.to_string()))?;
    if records.len() > limits.max_records {
        return Err(ApiError::too_large(format!(
            "{} records in one request; the limit is {}",
            records.len(),
            limits.max_records
        )));
    }
    let mut response = IngestResponse::default();
    let mut seen = HashSet::with_capacity(records.len());
    let mut prepared = Vec::with_capacity(records.len());
    for (index, json) in records.into_iter().enumerate() {
        match json.and_then(|j| schemas::check(def, j)) {
            Ok(valid) => {
                if seen.insert(valid.hash) {
                    prepared.push(Prepared::new(def, &valid));
                } else {
                    response.duplicates += 1;
                }
            }
            Err(e) => response.rejected.push(RejectedRecord {
                index,
                reason: e.to_string(),
            }),
        }
    }
    Ok(Checked {
        prepared,
        response,
        decompressed_bytes: plain.len(),
    })
}

pub async fn ingest(
    State(state): State<Arc<AppState>>,
    Path(stream): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<IngestResponse>, ApiError> {
    let who = state.auth.authenticate(&headers)?;
    validate_stream_name(&stream).map_err(|e| ApiError::bad_request(e.to_string()))?;
    state.auth.authorize(who, &stream)?;
    let def = state.streams.get(&stream).cloned().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_stream",
            format!("no stream named '{stream}'"),
        )
    })?;
    let format = body_format(&headers)?;
    let encoding = content_encoding(&headers)?;
    let limit = state.limits.max_body_bytes;
    let body = axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| ApiError::too_large(format!("request body is larger than {limit} bytes")))?;
    let labels = [("stream", stream.clone())];
    metrics::counter!(m::RECEIVED_BYTES, &labels).increment(body.len() as u64);

    let st = state.clone();
    let def2 = def.clone();
    let checked =
        tokio::task::spawn_blocking(move || check_body(&def2, format, encoding, body, &st.limits))
            .await
            .map_err(|e| ApiError::unavailable(format!("internal error: {e}"), 1))??;
    metrics::counter!(m::DECOMPRESSED_BYTES, &labels).increment(checked.decompressed_bytes as u64);

    let Checked {
        prepared,
        mut response,
        ..
    } = checked;
    let started = Instant::now();
    let accepted = prepared.len();
    state.producer.produce(&def.name, prepared).await?;
    metrics::histogram!(m::PRODUCE_DURATION).record(started.elapsed().as_secs_f64());
    response.accepted = accepted;
    for (outcome, n) in [
        ("accepted", response.accepted),
        ("duplicate", response.duplicates),
        ("rejected", response.rejected.len()),
    ] {
        metrics::counter!(m::RECORDS, "stream" => stream.clone(), "outcome" => outcome)
            .increment(n as u64);
    }
    Ok(Json(response))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bombs_stop_at_the_limit() {
        let plain = vec![b'a'; 10 << 20];
        let bomb = zstd::encode_all(&plain[..], 19).unwrap();
        assert!(bomb.len() < 4096);
        let e = decompress(Encoding::Zstd, Bytes::from(bomb.clone()), 1 << 20).unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        let ok = decompress(Encoding::Zstd, Bytes::from(bomb), 10 << 20).unwrap();
        assert_eq!(ok.len(), 10 << 20);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut gz, &plain).unwrap();
        let gz = gz.finish().unwrap();
        let e = decompress(Encoding::Gzip, Bytes::from(gz), 1 << 20).unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        let e = decompress(Encoding::Zstd, Bytes::from_static(b"not zstd"), 1 << 20).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }
}
