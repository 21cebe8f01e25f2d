//! Delivery of batches to the gateway, with retries that never create duplicates: every attempt
//! of a batch carries the same `Idempotency-Key`, and the sink drops re-sent content.

use std::time::Duration;

use rand::Rng;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_ENCODING, CONTENT_TYPE, RETRY_AFTER};
use schemas::api::IngestResponse;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

use crate::config::GatewayTarget;
use crate::pipeline::Batch;

#[derive(Debug, Error)]
pub enum SendError {
    /// The gateway refused the batch for good (4xx other than 408/429); retrying cannot help.
    #[error("gateway rejected the batch with {status}: {body}")]
    Rejected { status: u16, body: String },
    /// Every attempt failed with a retryable error.
    #[error("batch not delivered after {attempts} attempts: {last}")]
    GaveUp { attempts: u32, last: String },
    #[error("shutting down")]
    Cancelled,
    #[error("invalid gateway configuration: {0}")]
    Config(String),
}

pub struct Sender {
    client: reqwest::Client,
    base: String,
    token: Option<String>,
    max_attempts: u32,
}

impl Sender {
    pub fn new(target: &GatewayTarget) -> Result<Sender, SendError> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(target.timeout_ms))
            .build()
            .map_err(|e| SendError::Config(e.to_string()))?;
        Ok(Sender {
            client,
            base: target.url.trim_end_matches('/').to_owned(),
            token: target.token.clone(),
            max_attempts: target.max_attempts.max(1),
        })
    }

    /// Sends a batch, retrying with exponential backoff and jitter, honouring `Retry-After`.
    pub async fn send(
        &self,
        batch: &Batch,
        shutdown: &CancellationToken,
    ) -> Result<IngestResponse, SendError> {
        let url = format!("{}/v1/streams/{}/records", self.base, batch.stream);
        let mut last = String::new();
        for attempt in 0..self.max_attempts {
            let mut request = self
                .client
                .post(&url)
                .header(CONTENT_TYPE, "application/x-ndjson")
                .header(CONTENT_ENCODING, "zstd")
                .header("Idempotency-Key", &batch.id)
                .body(batch.body.clone());
            if let Some(token) = &self.token {
                request = request.bearer_auth(token);
            }
            let mut wait = backoff(attempt);
            match request.send().await {
                Ok(response) => {
                    let status = response.status();
                    if status.is_success() {
                        let body = response.bytes().await.unwrap_or_default();
                        return serde_json::from_slice::<IngestResponse>(&body).map_err(|e| {
                            SendError::Rejected {
                                status: status.as_u16(),
                                body: format!("unreadable answer: {e}"),
                            }
                        });
                    }
                    if let Some(secs) = response
                        .headers()
                        .get(RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok())
                    {
                        wait = Duration::from_secs(secs.min(300));
                    }
                    let body = response.text().await.unwrap_or_default();
                    if status.is_client_error()
                        && status != StatusCode::TOO_MANY_REQUESTS
                        && status != StatusCode::REQUEST_TIMEOUT
                    {
                        return Err(SendError::Rejected {
                            status: status.as_u16(),
                            body,
                        });
                    }
                    last = format!("{status}: {body}");
                }
                Err(e) => last = e.to_string(),
            }
            tracing::warn!(stream = %batch.stream, attempt, error = %last, ?wait, "batch not delivered, retrying");
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => return Err(SendError::Cancelled),
            }
        }
        Err(SendError::GaveUp {
            attempts: self.max_attempts,
            last,
        })
    }
}

/// 250 ms doubling up to 60 s, with ±50 % jitter.
fn backoff(attempt: u32) -> Duration {
    let base = 250u64.saturating_mul(1 << attempt.min(8)).min(60_000);
    let jitter = rand::rng().random_range(base / 2..=base + base / 2);
    Duration::from_millis(jitter)
}
