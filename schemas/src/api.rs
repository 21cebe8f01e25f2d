//! Bodies of the gateway's HTTP API, shared by the gateway and its clients.

use serde::{Deserialize, Serialize};

/// The answer to `POST /v1/streams/{stream}/records` (status 200).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IngestResponse {
    /// Records acknowledged by Kafka.
    pub accepted: usize,
    /// Records dropped because the same content was already in the request.
    pub duplicates: usize,
    /// Records that failed decoding or validation, by index in the request.
    pub rejected: Vec<RejectedRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectedRecord {
    /// Zero-based index of the record in the request (NDJSON: among non-blank lines).
    pub index: usize,
    /// Why it was rejected, naming the field, what was expected and what came.
    pub reason: String,
}

/// The body of every 4xx and 5xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// A stable, machine-readable code, e.g. `payload_too_large`.
    pub error: String,
    /// A human-readable explanation.
    pub message: String,
}
