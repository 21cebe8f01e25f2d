//! Metric names of the gateway, declared in one place.

service_kit::metrics! {
    #[counter]
    /// HTTP requests answered, by `route` and `status` code.
    pub const HTTP_REQUESTS: &str = "gateway_http_requests_total";
    #[histogram]
    /// Seconds from a request's arrival to its answer, by `route`.
    pub const HTTP_DURATION: &str = "gateway_http_request_duration_seconds";
    #[counter]
    /// Request body bytes received as sent (compressed or not), by `stream`.
    pub const RECEIVED_BYTES: &str = "gateway_received_bytes_total";
    #[counter]
    /// Request body bytes after decompression, by `stream`.
    pub const DECOMPRESSED_BYTES: &str = "gateway_decompressed_bytes_total";
    #[counter]
    /// Records of requests by `stream` and `outcome`: `accepted` (produced and acknowledged by
    /// Kafka), `duplicate` (dropped as a repeat) or `rejected` (invalid, with a per-record status).
    pub const RECORDS: &str = "gateway_records_total";
    #[histogram]
    /// Seconds from a request's first produced message to Kafka's acknowledgement of its last.
    pub const PRODUCE_DURATION: &str = "gateway_produce_duration_seconds";
    #[counter]
    /// Records rejected, by `stream` and `reason` (the per-record status code).
    pub const REJECTED: &str = "gateway_rejected_records_total";
    #[gauge]
    /// Bytes of requests being checked or produced (at most `limits.max_inflight_bytes`).
    pub const INFLIGHT_BYTES: &str = "gateway_inflight_bytes";
    #[counter]
    /// Kafka producers replaced after a fatal producer error.
    pub const PRODUCER_REPLACED: &str = "gateway_producer_replaced_total";
    #[counter]
    /// Message value bytes produced to Kafka, by `stream`.
    pub const PRODUCED_BYTES: &str = "gateway_produced_bytes_total";
    #[counter]
    /// Requests answered 429 because their token was over its `max_bytes_per_sec`, by token name.
    pub const RATE_LIMITED: &str = "gateway_rate_limited_requests_total";
    #[gauge]
    /// Client connections open on the API port.
    pub const OPEN_CONNECTIONS: &str = "gateway_open_connections";
    #[counter]
    /// Connections closed as they came because `limits.max_connections` were open.
    pub const REFUSED_CONNECTIONS: &str = "gateway_refused_connections_total";
    #[gauge]
    /// 1 when the last SIGHUP reload put the config in force (or none was asked for), 0 when it
    /// did not load or check and the running settings stayed.
    pub const RELOAD_SUCCESSFUL: &str = "gateway_config_last_reload_successful";
}

/// Creates, at zero, the series that alerts and dashboards watch: Prometheus sees no increase in
/// a counter whose first sample is already 1, so the first rejected record of a stream would
/// go unnoticed.
/// Installs the Prometheus recorder first (once per process), so nothing registered is lost.
pub fn register(streams: &schemas::Streams) {
    use service_kit::telemetry::{set_gauges, zero_counters};
    service_kit::install_metrics();
    describe();
    zero_counters(&[PRODUCER_REPLACED, REFUSED_CONNECTIONS], &[]);
    set_gauges(&[OPEN_CONNECTIONS], 0.0, &[]);
    set_gauges(&[RELOAD_SUCCESSFUL], 1.0, &[]);
    for def in streams.iter() {
        for outcome in ["accepted", "duplicate", "rejected"] {
            let labels = [
                ("stream", def.name.clone()),
                ("outcome", outcome.to_owned()),
            ];
            zero_counters(&[RECORDS], &labels);
        }
    }
}
