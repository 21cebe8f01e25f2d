//! Metric names of the agent, declared in one place. Labels: `stream` (configured), `source`
//! (source kind), `filter` (filter kind), `reason`, `policy`, `intentional`.

service_kit::metrics! {
    #[counter]
    /// Records read by sources, before validation.
    pub const RECORDS_RECEIVED: &str = "edge_agent_records_received_total";
    #[counter]
    /// Bytes read by sources, by `stream` and `source`.
    pub const RECEIVED_BYTES: &str = "edge_agent_received_bytes_total";
    #[counter]
    /// Records discarded, with `reason` (invalid, duplicate, filter kinds, spool_full) and
    /// `intentional` (true for dedupe and filters).
    pub const DISCARDED: &str = "edge_agent_discarded_records_total";
    #[counter]
    /// Batches written to the spool, by `stream`.
    pub const BATCHES_SPOOLED: &str = "edge_agent_batches_spooled_total";
    #[counter]
    /// Records written to the spool, by `stream`.
    pub const RECORDS_SPOOLED: &str = "edge_agent_records_spooled_total";
    #[counter]
    /// Bytes written to the spool's segments.
    pub const SPOOL_WRITTEN_BYTES: &str = "edge_agent_spool_written_bytes_total";
    #[gauge]
    /// Bytes of batches in the spool not yet delivered.
    pub const SPOOL_BYTES: &str = "edge_agent_spool_bytes";
    #[gauge]
    /// Bytes the spool's segment files take on disk, delivered batches not yet reclaimed included.
    pub const SPOOL_TOTAL_BYTES: &str = "edge_agent_spool_total_bytes";
    #[gauge]
    /// Batches in the spool not yet delivered.
    pub const SPOOL_PENDING_BATCHES: &str = "edge_agent_spool_pending_batches";
    #[counter]
    /// Records dropped because the spool was full (by an overflow policy that drops, or a batch
    /// larger than the whole spool), by `stream`.
    pub const SPOOL_DROPPED_RECORDS: &str = "edge_agent_spool_dropped_records_total";
    #[counter]
    /// Times a stream waited for room in a full spool (the overflow policy that blocks), by
    /// `stream`.
    pub const SPOOL_BLOCKED: &str = "edge_agent_spool_blocked_waits_total";
    #[counter]
    /// Torn ends of spool segments (a write cut by a crash) cut off at start.
    pub const SPOOL_TORN_TAILS: &str = "edge_agent_spool_torn_tails_total";
    #[counter]
    /// Unreadable regions of spool segments moved aside at start.
    pub const SPOOL_QUARANTINED: &str = "edge_agent_spool_quarantined_regions_total";
    #[gauge]
    /// Content hashes in the dedupe window, by `stream`.
    pub const DEDUPE_ENTRIES: &str = "edge_agent_dedupe_entries";
    #[counter]
    /// Batches delivered, and their bytes on the wire and uncompressed.
    /// Batches delivered, by `stream`.
    pub const BATCHES_SENT: &str = "edge_agent_batches_sent_total";
    #[counter]
    /// Records delivered, by `stream`.
    pub const RECORDS_SENT: &str = "edge_agent_records_sent_total";
    #[counter]
    /// Bytes of delivered batches on the wire (compressed), by `stream`.
    pub const SENT_BYTES: &str = "edge_agent_sent_bytes_total";
    #[counter]
    /// Bytes of delivered batches before compression, by `stream`.
    pub const SENT_RAW_BYTES: &str = "edge_agent_sent_raw_bytes_total";
    #[histogram]
    /// Seconds a delivery attempt took.
    pub const SEND_DURATION: &str = "edge_agent_send_duration_seconds";
    #[counter]
    /// Failed attempts, by `reason` (connect, timeout, status code class).
    pub const SEND_ERRORS: &str = "edge_agent_send_errors_total";
    #[counter]
    /// Batches the gateway refused for good (kept under `rejected/` in the state directory).
    pub const BATCHES_REJECTED: &str = "edge_agent_batches_rejected_total";
    #[gauge]
    /// Bytes of the refused batches kept under `rejected/` (limit `spool.rejected_max_mb`).
    pub const REJECTED_BYTES: &str = "edge_agent_rejected_bytes";
    #[gauge]
    /// 1 while a stream's refused batch waits in the spool for room under `rejected/` (the
    /// directory is at its limit or cannot be written), else 0.
    pub const REJECTED_WAITING: &str = "edge_agent_rejected_waiting_batches";
    #[counter]
    /// Records the gateway rejected individually inside accepted batches.
    pub const RECORDS_REJECTED: &str = "edge_agent_records_rejected_total";
    #[counter]
    /// Records too large for a Kafka message that the Kafka output could not produce to the
    /// dead-letter topic either (missing, or the broker gone): left out, and logged.
    pub const DEAD_LETTERS_LOST: &str = "edge_agent_dead_letters_lost_total";
    #[counter]
    /// Series whose state a deadband or downsample filter forgot, by `filter` (kind): the filter
    /// held `max_series` series, and these were seen longest ago.
    pub const FILTER_EVICTED_SERIES: &str = "edge_agent_filter_evicted_series_total";
    #[counter]
    /// Per stream and filter (`filter`: its type): readings that reached the filter and those it
    /// passed on.
    /// Readings that reached a filter, by `stream` and `filter` (its type).
    pub const FILTER_READINGS_IN: &str = "edge_agent_filter_readings_in_total";
    #[counter]
    /// Readings a filter passed on, by `stream` and `filter`.
    pub const FILTER_READINGS_KEPT: &str = "edge_agent_filter_readings_kept_total";
    #[gauge]
    /// Deadband and swinging door: the band, and the largest distance of a dropped reading from
    /// its reconstruction since the agent started (at most the band).
    /// Deadband and swinging door: the band, by `stream` and `filter`.
    pub const FILTER_BAND: &str = "edge_agent_filter_band";
    #[gauge]
    /// Deadband and swinging door: the largest distance of a dropped reading from its
    /// reconstruction since the agent started (at most the band), by `stream` and `filter`.
    pub const FILTER_MAX_DEVIATION: &str = "edge_agent_filter_max_deviation";
    #[counter]
    /// Swinging door: readings that came out of order and were passed on as they are.
    pub const FILTER_OUT_OF_ORDER: &str = "edge_agent_filter_out_of_order_total";
    #[gauge]
    /// 1 while a stream's definition file holds an incompatible change that the agent refused (it
    /// runs with the definition it had; records that need the new one are skipped as invalid).
    pub const DEFINITION_REFUSED: &str = "edge_agent_definition_refused";
    #[gauge]
    /// Bytes of invalid records kept under `invalid/<stream>.ndjson` to be tried again when the
    /// stream's definition changes (`spool.invalid_max_mb`).
    pub const INVALID_KEPT_BYTES: &str = "edge_agent_invalid_kept_bytes";
    #[counter]
    /// Invalid records that could not be kept (`spool.invalid_max_mb` reached, or a write failed):
    /// only counted, as before keeping.
    pub const INVALID_NOT_KEPT: &str = "edge_agent_invalid_not_kept_total";
    #[counter]
    /// Kept invalid records that passed when tried again under a changed definition.
    pub const INVALID_RETRIED: &str = "edge_agent_invalid_retried_total";
    #[gauge]
    /// 0 after a SIGHUP found a config that does not load or check (the agent runs on with the one
    /// it has), else 1 ([`crate::reload`]).
    pub const RELOAD_SUCCESSFUL: &str = "edge_agent_config_last_reload_successful";
    #[gauge]
    /// The spool's size limit over all streams (`spool.max_mb`), for "spool filling up" alerts.
    pub const SPOOL_LIMIT_BYTES: &str = "edge_agent_spool_limit_bytes";
}

/// Creates, at zero, the series that alerts and dashboards watch: Prometheus sees no increase in
/// a counter whose first sample is already 1, so the first dropped record would go unnoticed.
pub fn register(spool_limit_bytes: u64) {
    describe();
    metrics::gauge!(SPOOL_LIMIT_BYTES).set(spool_limit_bytes as f64);
    service_kit::telemetry::zero_counters(&[SPOOL_TORN_TAILS, SPOOL_QUARANTINED], &[]);
}

/// [`register`] for one stream, whose spool overflows by `policy`.
pub fn register_stream(stream: &str, policy: &'static str) {
    use service_kit::telemetry::{set_gauges, zero_counters};
    let labels = [("stream", stream.to_owned())];
    let counters = [
        BATCHES_REJECTED,
        RECORDS_REJECTED,
        SPOOL_BLOCKED,
        DEAD_LETTERS_LOST,
        INVALID_NOT_KEPT,
        INVALID_RETRIED,
    ];
    zero_counters(&counters, &labels);
    let dropped = [("stream", stream.to_owned()), ("policy", policy.to_owned())];
    zero_counters(&[SPOOL_DROPPED_RECORDS], &dropped);
    set_gauges(&[REJECTED_WAITING, DEFINITION_REFUSED], 0.0, &labels);
    for (reason, intentional) in [("invalid", "false"), ("duplicate", "true")] {
        let labels = [
            ("stream", stream.to_owned()),
            ("reason", reason.to_owned()),
            ("intentional", intentional.to_owned()),
        ];
        zero_counters(&[DISCARDED], &labels);
    }
}
