//! Delivery of spooled batches: to the gateway over HTTP, or straight to Kafka.
//!
//! HTTP: every attempt of a batch carries the same `Idempotency-Key` (the batch id), so a retry
//! after a lost answer, or after a restart, never lands twice. Retryable failures (connection
//! errors, timeouts, 407 from a proxy, 408, 409 in-progress, 429, 5xx) are retried with
//! exponential backoff and jitter, honouring `Retry-After`, until they succeed or the agent
//! stops; so are the 4xx answers that every batch would get (`retry_statuses`: 401, 403, 404 by
//! default), which a fix of the token or the gateway's streams ends. Other 4xx answers are
//! final: the batch is kept aside under `rejected/` and not retried.
//!
//! Kafka: the records of the batch are produced like the gateway does (topic, key, value,
//! headers) by an idempotent producer; the batch is acknowledged once Kafka acknowledged all of
//! them. A batch retried after a failure may put some records into Kafka twice; they carry the
//! same content hash and the sink drops them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use reqwest::header::{CONTENT_ENCODING, CONTENT_TYPE, RETRY_AFTER};
use schemas::StreamDef;

use crate::live::StreamLive;
use schemas::api::IngestResponse;
use service_kit::config::secret::Secret;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

use crate::batch::Batch;
use crate::config::{GatewayTarget, KafkaTarget, ProxyConfig};

#[cfg(feature = "kafka")]
mod kafka;
use crate::metrics as m;
#[cfg(feature = "kafka")]
pub use kafka::KafkaOutput;

#[derive(Debug, Error)]
pub enum SendError {
    /// The receiver refused the batch for good; retrying cannot help.
    #[error("batch refused with {status}: {body}")]
    Rejected { status: u16, body: String },
    #[error("shutting down")]
    Cancelled,
    #[error("invalid output configuration: {0}")]
    Config(String),
}

/// Where batches go.
pub enum Output {
    Http(HttpOutput),
    #[cfg(feature = "kafka")]
    Kafka(KafkaOutput),
}

impl Output {
    pub fn new(
        gateway: Option<&GatewayTarget>,
        kafka: Option<&KafkaTarget>,
    ) -> Result<Output, SendError> {
        match (gateway, kafka) {
            (Some(g), None) => Ok(Output::Http(HttpOutput::new(g)?)),
            #[cfg(feature = "kafka")]
            (None, Some(k)) => Ok(Output::Kafka(KafkaOutput::new(k)?)),
            #[cfg(not(feature = "kafka"))]
            (None, Some(_)) => Err(SendError::Config(NO_KAFKA.into())),
            _ => Err(SendError::Config(
                "set exactly one of [gateway] and [kafka]".into(),
            )),
        }
    }

    /// Delivers one batch, retrying until it is acknowledged, refused for good, or cancelled.
    /// Returns the answer and the size of the body that was delivered (the spooled body, or
    /// the one recompressed without a dictionary the gateway lacks).
    pub async fn send(
        &self,
        def: &Arc<StreamDef>,
        batch: &Batch,
        shutdown: &CancellationToken,
        live: &StreamLive,
    ) -> Result<(IngestResponse, u64), SendError> {
        match self {
            Output::Http(h) => {
                // Set when the gateway does not have the stream's dictionary.
                let plain_body = std::sync::Mutex::new(None);
                let response = retrying((&def.name, live), batch, shutdown, h.max_backoff, || {
                    h.attempt(def, batch, &plain_body)
                })
                .await?;
                let sent = lock(&plain_body)
                    .as_ref()
                    .map_or(batch.body.len(), Vec::len);
                Ok((response, sent as u64))
            }
            #[cfg(feature = "kafka")]
            Output::Kafka(k) => {
                // Decoded once per batch, on the blocking pool, not once per attempt.
                let (messages, too_large) = k.prepare(def.clone(), batch.clone()).await?;
                let mut response = retrying(
                    (&def.name, live),
                    batch,
                    shutdown,
                    KAFKA_MAX_BACKOFF,
                    || k.attempt(&def.name, &messages),
                )
                .await?;
                k.keep_dead_letters(&def.name, batch, &too_large).await;
                response.rejected = too_large.into_iter().map(|(r, _)| r).collect();
                Ok((response, batch.body.len() as u64))
            }
        }
    }
}

/// Why an agent built without the Kafka output refuses `[kafka]`.
#[cfg(not(feature = "kafka"))]
pub const NO_KAFKA: &str = "[kafka]: this edge-agent is built without the Kafka output (cargo feature `kafka`); send to a gateway ([gateway]) or use a full build";

#[cfg(feature = "kafka")]
const KAFKA_MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Runs `attempt` until it succeeds or fails for good, backing off between attempts.
async fn retrying<F, Fut>(
    (stream, live): (&str, &StreamLive),
    batch: &Batch,
    shutdown: &CancellationToken,
    max_backoff: Duration,
    mut attempt: F,
) -> Result<IngestResponse, SendError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<IngestResponse, Attempt>>,
{
    let started = Instant::now();
    let mut attempts = 0u32;
    loop {
        // An attempt is given up at shutdown, not waited out (up to `gateway.timeout_ms`, or
        // the Kafka message timeout): the batch stays in the spool and is sent again after the
        // restart with the same id, which the gateway replays and the sink deduplicates.
        let result = tokio::select! {
            result = attempt() => result,
            _ = shutdown.cancelled() => return Err(SendError::Cancelled),
        };
        let (reason, retry_after) = match result {
            Ok(response) => {
                metrics::histogram!(m::SEND_DURATION, "stream" => stream.to_owned())
                    .record(started.elapsed().as_secs_f64());
                live.attempt_answered();
                return Ok(response);
            }
            Err(Attempt::Final(e)) => return Err(e),
            Err(Attempt::Retry {
                reason,
                retry_after,
            }) => (reason, retry_after),
        };
        metrics::counter!(m::SEND_ERRORS, "stream" => stream.to_owned(), "reason" => reason.kind)
            .increment(1);
        live.attempt_failed(reason.kind, &reason.text);
        let wait = retry_after.unwrap_or_else(|| backoff(attempts, max_backoff));
        tracing::warn!(stream, batch = %batch.id, attempt = attempts, error = %reason.text, ?wait, "batch not delivered, retrying");
        attempts = attempts.saturating_add(1);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.cancelled() => return Err(SendError::Cancelled),
        }
    }
}

struct Reason {
    kind: &'static str,
    text: String,
}

enum Attempt {
    Retry {
        reason: Reason,
        retry_after: Option<Duration>,
    },
    Final(SendError),
}

fn retry(kind: &'static str, text: impl Into<String>) -> Attempt {
    Attempt::Retry {
        reason: Reason {
            kind,
            text: text.into(),
        },
        retry_after: None,
    }
}

/// The gateway's error code for a body compressed with a dictionary it does not have.
const UNKNOWN_DICTIONARY: &str = "unknown_dictionary";
/// zstd level of a batch resent without the dictionary (the gateway's answer is per batch, so
/// this stays rare: deploy the dictionary to the gateways first).
const DICTIONARY_FALLBACK_LEVEL: i32 = 3;

pub struct HttpOutput {
    client: reqwest::Client,
    base: String,
    token: Option<Secret>,
    max_backoff: Duration,
    /// 4xx answers retried like 5xx ([`GatewayTarget::retry_statuses`]).
    retry_statuses: Vec<u16>,
    /// Dictionaries the gateway said it does not have: batches compressed with them are sent
    /// recompressed without, so each does not pay a refused upload first.
    refused_dictionaries: std::sync::Mutex<std::collections::HashSet<u32>>,
    /// `gateway.timeout_ms`.
    timeout: Duration,
    /// `gateway.min_upload_bytes_per_sec`.
    min_upload_rate: u64,
}

impl HttpOutput {
    pub fn new(target: &GatewayTarget) -> Result<HttpOutput, SendError> {
        // The timeout is set per request (`HttpOutput::timeout`), by its body's size.
        let builder =
            reqwest::Client::builder().connect_timeout(Duration::from_millis(target.timeout_ms));
        let client = crate::tls::http_client(builder, &target.tls)
            .and_then(|builder| with_proxy(builder, target.proxy.as_ref()))
            .map_err(|e| SendError::Config(format!("{e:#}")))?
            .build()
            .map_err(|e| SendError::Config(e.to_string()))?;
        Ok(HttpOutput {
            client,
            base: target.url.trim_end_matches('/').to_owned(),
            token: service_kit::config::secret::resolve(
                target.token.as_ref(),
                target.token_file.as_deref(),
                "gateway.token",
            )
            .map_err(|e| SendError::Config(format!("{e:#}")))?,
            max_backoff: Duration::from_millis(target.max_backoff_ms.max(1)),
            retry_statuses: target.retry_statuses.clone(),
            refused_dictionaries: Default::default(),
            timeout: Duration::from_millis(target.timeout_ms),
            min_upload_rate: target.min_upload_bytes_per_sec,
        })
    }

    /// The timeout of a request with a body of `bytes`: `gateway.timeout_ms`, plus the time the
    /// body takes at `gateway.min_upload_bytes_per_sec`. With the timeout alone, a batch that
    /// an uplink cannot carry within it was cut off, sent again and cut off again for ever,
    /// each time spending the link's bytes.
    fn timeout(&self, bytes: usize) -> Duration {
        if self.min_upload_rate == 0 {
            return self.timeout;
        }
        self.timeout + Duration::from_secs_f64(bytes as f64 / self.min_upload_rate as f64)
    }

    /// One attempt. `plain_body` replaces a body compressed with a zstd dictionary once the
    /// gateway said it does not have that dictionary.
    async fn attempt(
        &self,
        def: &Arc<StreamDef>,
        batch: &Batch,
        plain_body: &std::sync::Mutex<Option<Vec<u8>>>,
    ) -> Result<IngestResponse, Attempt> {
        let url = format!("{}/v1/streams/{}/records", self.base, def.name);
        // Parquet bodies are not zstd frames: only NDJSON batches name a dictionary.
        let dictionary = schemas::dictionary::frame_dictionary_id(&batch.body);
        let refused = dictionary.is_some_and(|id| lock(&self.refused_dictionaries).contains(&id));
        if refused && lock(plain_body).is_none() {
            let plain = without_dictionary(def, batch, None).await?;
            *lock(plain_body) = Some(plain);
        }
        let body = lock(plain_body)
            .clone()
            .unwrap_or_else(|| batch.body.clone());
        let mut request = self
            .client
            .post(&url)
            .timeout(self.timeout(body.len()))
            .header(CONTENT_TYPE, batch.encoding.content_type())
            .header(CONTENT_ENCODING, batch.encoding.content_encoding())
            .header("Idempotency-Key", batch.id.to_string())
            // The gateway logs a failed request with it: every attempt of a batch is found by
            // the batch id that the agent's own logs name.
            .header("X-Request-Id", batch.id.to_string())
            .body(body);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token.expose());
        }
        let response = request.send().await.map_err(|e| {
            let kind = if e.is_timeout() { "timeout" } else { "connect" };
            retry(kind, e.to_string())
        })?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|secs| Duration::from_secs(secs.min(300)));
        let body = response
            .bytes()
            .await
            .map_err(|e| retry("timeout", e.to_string()))?;
        if status.is_success() {
            return serde_json::from_slice::<IngestResponse>(&body).map_err(|e| {
                // A 200 whose body is not ours (a proxy?): retrying is safe with the same key.
                retry("bad_answer", format!("unreadable answer: {e}"))
            });
        }
        let text = String::from_utf8_lossy(&body).into_owned();
        if let Some(id) = dictionary.filter(|_| {
            status == StatusCode::UNPROCESSABLE_ENTITY && text.contains(UNKNOWN_DICTIONARY)
        }) {
            tracing::warn!(stream = %def.name, dictionary = id, "the gateway does not have the stream's zstd dictionary; sending batches without it until the agent restarts");
            lock(&self.refused_dictionaries).insert(id);
            let plain = without_dictionary(def, batch, Some(&text)).await?;
            *lock(plain_body) = Some(plain);
            return Err(Attempt::Retry {
                reason: Reason {
                    kind: UNKNOWN_DICTIONARY,
                    text: format!("{status}: {text}; sending it without the dictionary"),
                },
                retry_after: Some(Duration::ZERO),
            });
        }
        // 407 comes from a proxy on the way that wants (other) credentials: it says nothing of
        // the batch, and every batch would get it.
        let retryable = status.is_server_error()
            || matches!(
                status,
                StatusCode::PROXY_AUTHENTICATION_REQUIRED
                    | StatusCode::REQUEST_TIMEOUT
                    | StatusCode::CONFLICT
                    | StatusCode::TOO_MANY_REQUESTS
            )
            || self.retry_statuses.contains(&status.as_u16());
        if !retryable {
            return Err(Attempt::Final(SendError::Rejected {
                status: status.as_u16(),
                body: text,
            }));
        }
        let kind = match status {
            _ if status.is_server_error() => "5xx",
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => "auth",
            StatusCode::PROXY_AUTHENTICATION_REQUIRED => "proxy_auth",
            StatusCode::NOT_FOUND => "not_found",
            _ => "4xx",
        };
        Err(Attempt::Retry {
            reason: Reason {
                kind,
                text: format!("{status}: {text}"),
            },
            retry_after,
        })
    }
}

/// Sets up the gateway's client to go through `proxy` ([`ProxyConfig`]), or, without one, to
/// use the proxy of the environment (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`), as
/// reqwest does by default.
fn with_proxy(
    builder: reqwest::ClientBuilder,
    proxy: Option<&ProxyConfig>,
) -> anyhow::Result<reqwest::ClientBuilder> {
    let Some(config) = proxy else {
        return Ok(builder);
    };
    if config.url == crate::config::DIRECT {
        return Ok(builder.no_proxy());
    }
    let shown = crate::config::redacted_url(&config.url);
    let url: reqwest::Url = config
        .url
        .parse()
        .map_err(|e| anyhow::anyhow!("gateway.proxy.url {shown}: {e}"))?;
    anyhow::ensure!(
        matches!(url.scheme(), "http" | "https") && url.host().is_some(),
        "gateway.proxy.url {shown}: give http://host:port or https://host:port, or \"{}\"",
        crate::config::DIRECT
    );
    let mut proxy = reqwest::Proxy::all(url)
        .map_err(|e| anyhow::anyhow!("gateway.proxy.url {shown}: {e}"))?
        .no_proxy(
            config
                .no_proxy
                .as_deref()
                .and_then(reqwest::NoProxy::from_string),
        );
    match &config.username {
        Some(user) => {
            let password = service_kit::config::secret::password(
                config.password.as_deref(),
                config.password_file.as_deref(),
                "gateway.proxy",
            )?;
            proxy = proxy.basic_auth(user, &password);
        }
        None => anyhow::ensure!(
            config.password.is_none() && config.password_file.is_none(),
            "gateway.proxy: a password needs a username"
        ),
    }
    Ok(builder.proxy(proxy))
}

/// The batch recompressed without its dictionary, on the blocking pool (up to a MiB of zstd
/// both ways); a batch that cannot be read back is refused for good (`answer`: the gateway's
/// answer that asked for this).
async fn without_dictionary(
    def: &Arc<StreamDef>,
    batch: &Batch,
    answer: Option<&str>,
) -> Result<Vec<u8>, Attempt> {
    let (def, batch) = (def.clone(), batch.clone());
    let recompressed = tokio::task::spawn_blocking(move || {
        batch
            .without_dictionary(&def, DICTIONARY_FALLBACK_LEVEL)
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|e| Err(e.to_string()));
    recompressed.map_err(|e| {
        Attempt::Final(SendError::Rejected {
            status: StatusCode::UNPROCESSABLE_ENTITY.as_u16(),
            body: format!("{} ({e})", answer.unwrap_or(UNKNOWN_DICTIONARY)),
        })
    })
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// 250 ms doubling up to `max`, with ±50 % jitter.
fn backoff(attempt: u32, max: Duration) -> Duration {
    service_kit::process::backoff(attempt, Duration::from_millis(250), max)
}
