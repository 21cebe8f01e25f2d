//! Metric names of the gateway, declared in one place.

pub const HTTP_REQUESTS: &str = "gateway_http_requests_total";
pub const HTTP_DURATION: &str = "gateway_http_request_duration_seconds";
pub const RECEIVED_BYTES: &str = "gateway_received_bytes_total";
pub const DECOMPRESSED_BYTES: &str = "gateway_decompressed_bytes_total";
pub const RECORDS: &str = "gateway_records_total";
pub const PRODUCE_DURATION: &str = "gateway_produce_duration_seconds";
pub const REJECTED: &str = "gateway_rejected_records_total";
pub const INFLIGHT_BYTES: &str = "gateway_inflight_bytes";
pub const PRODUCER_REPLACED: &str = "gateway_producer_replaced_total";
pub const PRODUCED_BYTES: &str = "gateway_produced_bytes_total";
