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

use rdkafka::producer::Producer;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_ENCODING, CONTENT_TYPE, RETRY_AFTER};
use schemas::StreamDef;

use crate::live::StreamLive;
use schemas::api::{IngestResponse, RejectedRecord};
use schemas::wire::topic_name;
use service_kit::config::secret::Secret;
use service_kit::kafka::{DeadLetter, DeliveryGroup, GroupProducer, Messages};
use thiserror::Error;
use tokio_util::sync::CancellationToken;

use crate::batch::Batch;
use crate::config::{GatewayTarget, KafkaTarget, ProxyConfig};
use crate::metrics as m;

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
    Kafka(KafkaOutput),
}

impl Output {
    pub fn new(
        gateway: Option<&GatewayTarget>,
        kafka: Option<&KafkaTarget>,
    ) -> Result<Output, SendError> {
        match (gateway, kafka) {
            (Some(g), None) => Ok(Output::Http(HttpOutput::new(g)?)),
            (None, Some(k)) => Ok(Output::Kafka(KafkaOutput::new(k)?)),
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

pub struct KafkaOutput {
    /// Shared with the blocking pool's metadata requests.
    producer: Arc<GroupProducer>,
    topic_prefix: String,
    /// The producer's `message.max.bytes`.
    max_message_bytes: usize,
    /// `kafka.dead_letter_topic`.
    dead_letter_topic: String,
}

impl KafkaOutput {
    pub fn new(target: &KafkaTarget) -> Result<KafkaOutput, SendError> {
        let mut config = service_kit::kafka::producer_config(&target.brokers, 30_000);
        service_kit::kafka::security::apply(&mut config, target.tls.as_ref(), target.sasl.as_ref())
            .map_err(|e| SendError::Config(format!("{e:#}")))?;
        for (k, v) in &target.properties {
            config.set(k, v);
        }
        Ok(KafkaOutput {
            producer: Arc::new(
                service_kit::kafka::group_producer(&config)
                    .map_err(|e| SendError::Config(e.to_string()))?,
            ),
            topic_prefix: target.topic_prefix.clone(),
            max_message_bytes: service_kit::kafka::max_message_bytes(&config),
            dead_letter_topic: target.dead_letter_topic.clone(),
        })
    }

    /// The batch's records as Kafka messages: decompress, decode, validate and encode, on the
    /// blocking pool. A record whose message would pass the producer's `message.max.bytes` is
    /// left out and returned as rejected, with its dead letter, as the gateway rejects it:
    /// librdkafka refuses it at once, and retrying the batch would hold the stream up for ever.
    async fn prepare(
        &self,
        def: Arc<StreamDef>,
        batch: Batch,
    ) -> Result<(Messages, Vec<(RejectedRecord, DeadLetter)>), SendError> {
        let max = self.max_message_bytes;
        // What the HTTP output sends as the Idempotency-Key.
        let batch_id = batch.id.to_string();
        let prepared = tokio::task::spawn_blocking(move || {
            batch.records(&def).map(|records| {
                let mut messages = Messages::new(&def, records.len(), batch.raw_bytes as usize);
                let mut too_large = Vec::new();
                for (index, r) in records.iter().enumerate() {
                    messages.push(&def, r);
                    let size = messages.last_message_bytes();
                    if size > max {
                        let reason = service_kit::kafka::too_large_reason(size, max);
                        let value = messages.iter().last().map_or(&[][..], |(_, v)| v);
                        let dead =
                            DeadLetter::new(index, "too_large", &reason, value).in_batch(&batch_id);
                        messages.pop();
                        too_large.push((RejectedRecord { index, reason }, dead));
                    }
                }
                (messages, too_large)
            })
        })
        .await
        .map_err(|e| SendError::Config(format!("batch decoding failed: {e}")))?;
        prepared.map_err(|e| SendError::Rejected {
            status: 0,
            body: e.to_string(),
        })
    }

    /// Produces the dead letters of a delivered batch's records that were too large, once: a
    /// failure (the topic missing, the broker gone) is logged and counted
    /// (`edge_agent_dead_letters_lost_total`), and the batch is not held up for them. A missing
    /// topic is found by asking for its metadata first: librdkafka only gives up on a message
    /// to a missing topic after `topic.metadata.propagation.max.ms` (30 s), which held the
    /// batch and its stream up that long.
    async fn keep_dead_letters(
        &self,
        stream: &str,
        batch: &Batch,
        too_large: &[(RejectedRecord, DeadLetter)],
    ) {
        if too_large.is_empty() {
            return;
        }
        if self.dead_letter_topic_missing().await {
            self.dead_letters_lost(stream, batch, too_large.len(), "the topic does not exist");
            return;
        }
        let ingest_ts = service_kit::kafka::ingest_ts_now();
        let mut group = DeliveryGroup::new();
        let sent = too_large.iter().try_for_each(|(_, dead)| {
            let topic = &self.dead_letter_topic;
            dead.send(&self.producer, &mut group, topic, stream, &ingest_ts)
        });
        let settled = group.settled().await;
        match sent.and(settled) {
            Ok(_) => {
                tracing::warn!(stream, batch = %batch.id, records = too_large.len(), topic = %self.dead_letter_topic, "records too large for a Kafka message went to the dead-letter topic")
            }
            Err(e) => self.dead_letters_lost(stream, batch, too_large.len(), &e.to_string()),
        }
    }

    /// Whether the cluster says the dead-letter topic does not exist; false when it exists or
    /// the metadata request failed (producing then tells).
    async fn dead_letter_topic_missing(&self) -> bool {
        let producer = self.producer.clone();
        let topic = self.dead_letter_topic.clone();
        let exists =
            tokio::task::spawn_blocking(move || {
                let metadata = producer
                    .client()
                    .fetch_metadata(Some(&topic), Duration::from_secs(5))
                    .ok()?;
                Some(metadata.topics().iter().any(|t| {
                    t.name() == topic && t.error().is_none() && !t.partitions().is_empty()
                }))
            })
            .await
            .ok()
            .flatten();
        exists == Some(false)
    }

    fn dead_letters_lost(&self, stream: &str, batch: &Batch, records: usize, error: &str) {
        metrics::counter!(m::DEAD_LETTERS_LOST, "stream" => stream.to_owned())
            .increment(records as u64);
        tracing::error!(stream, batch = %batch.id, records, topic = %self.dead_letter_topic, error, "records too large for a Kafka message could not go to the dead-letter topic: they are left out");
    }

    async fn attempt(&self, stream: &str, messages: &Messages) -> Result<IngestResponse, Attempt> {
        let topic = topic_name(&self.topic_prefix, stream);
        let ingest_ts = service_kit::kafka::ingest_ts_now();
        let mut group = DeliveryGroup::new();
        let sent = messages.send(&self.producer, &mut group, &topic, &ingest_ts);
        // What was handed over is awaited even when the rest was refused.
        let settled = group.settled().await;
        match sent.and(settled) {
            Err(e) if service_kit::kafka::refused_as_too_large(&e) => {
                // The broker's (or topic's) limit is below the producer's: a retry would never
                // do better. The batch is kept aside until the limits are fixed.
                return Err(Attempt::Final(SendError::Rejected {
                    status: 0,
                    body: format!(
                        "{e}: the broker's or the topic's message.max.bytes is below the producer's ({})",
                        self.max_message_bytes
                    ),
                }));
            }
            Err(e) => return Err(retry("kafka", e.to_string())),
            Ok(_) => {}
        }
        Ok(IngestResponse {
            accepted: messages.len(),
            ..IngestResponse::default()
        })
    }
}

/// 250 ms doubling up to `max`, with ±50 % jitter.
fn backoff(attempt: u32, max: Duration) -> Duration {
    service_kit::process::backoff(attempt, Duration::from_millis(250), max)
}
