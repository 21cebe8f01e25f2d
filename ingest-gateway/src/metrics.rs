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
/// Requests answered 429 because their token was over its `max_bytes_per_sec`, by token name.
pub const RATE_LIMITED: &str = "gateway_rate_limited_requests_total";
pub const OPEN_CONNECTIONS: &str = "gateway_open_connections";
/// Connections closed as they came because `limits.max_connections` were open.
pub const REFUSED_CONNECTIONS: &str = "gateway_refused_connections_total";
/// 1 when the last SIGHUP reload put the config in force (or none was asked for), 0 when it
/// did not load or check and the running settings stayed.
pub const RELOAD_SUCCESSFUL: &str = "gateway_config_last_reload_successful";

/// Creates, at zero, the series that alerts and dashboards watch: Prometheus sees no increase in
/// a counter whose first sample is already 1, so the first rejected record of a stream would
/// go unnoticed.
/// Installs the Prometheus recorder first (once per process), so nothing registered is lost.
pub fn register(streams: &schemas::Streams) {
    use service_kit::telemetry::{set_gauges, zero_counters};
    service_kit::install_metrics();
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
