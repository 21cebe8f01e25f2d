//! Metric names of the sink, declared in one place.

service_kit::metrics! {
    #[counter]
    /// Schemas asked of the registry (`[registry]`), by `result`: `fetched`, `unknown` (the
    /// registry does not know the id: its values are dead letters) or `error` (no answer; the
    /// values wait and it is asked again).
    pub const SCHEMA_FETCHES: &str = "sink_schema_fetches_total";
    #[counter]
    /// Records read from Kafka, by `stream`.
    pub const RECORDS_RECEIVED: &str = "sink_records_received_total";
    #[counter]
    /// Records written in landed files, by `stream`.
    pub const RECORDS_WRITTEN: &str = "sink_records_written_total";
    #[counter]
    /// Bytes of landed files, by `stream`.
    pub const BYTES_WRITTEN: &str = "sink_written_bytes_total";
    #[counter]
    /// Landed files, by `stream` and `reason`: why the file was closed (a size or age limit, the
    /// hour's end, idleness, a memory or staging budget, a rebalance, a stop).
    pub const FILES_WRITTEN: &str = "sink_files_written_total";
    #[histogram]
    /// Sizes of landed files in bytes, by `stream`.
    pub const FILE_SIZE: &str = "sink_file_size_bytes";
    #[histogram]
    /// Seconds to put a landed file in the object store.
    pub const UPLOAD_DURATION: &str = "sink_upload_duration_seconds";
    #[counter]
    /// Records not landed, by `stream`, `reason` and `intentional` (true for duplicates).
    pub const DISCARDED: &str = "sink_discarded_records_total";
    #[counter]
    /// Failed object store requests, by `retryable` (true: tried again after a backoff).
    pub const STORE_ERRORS: &str = "sink_store_errors_total";
    #[counter]
    /// Landing objects found already written at a file's key and taken as this file (written before
    /// a crash or by another sink), by `stream`.
    pub const ADOPTED_FILES: &str = "sink_adopted_files_total";
    #[counter]
    /// Records received that an adopted object already holds (written by another sink, or by this
    /// one before a lost answer or a crash), so they were not written again.
    pub const ADOPTED_RECORDS: &str = "sink_adopted_records_total";
    #[counter]
    /// Dead-letter objects found already written (before a crash, or by the partition's previous
    /// owner) when the sink went to write them: their dead letters were not written again.
    pub const ADOPTED_DEAD_LETTERS: &str = "sink_adopted_dead_letter_objects_total";
    #[counter]
    /// Landing objects found at a file's key holding other messages at the same offsets (a topic
    /// deleted and created again under the same name, its old files still in the landing zone), or
    /// that cannot be read as what the sink writes there: each stops its partition, which then
    /// commits nothing.
    pub const LANDING_CONFLICTS: &str = "sink_landing_conflicts_total";
    #[counter]
    /// Records of a stream's partitions that were not in Kafka when the sink needed them (deleted
    /// by retention or `DeleteRecords` before they were read) and that it skipped
    /// (`on_offset_gap = "skip"`), each range noted in the dead letters.
    pub const OFFSETS_SKIPPED: &str = "sink_offsets_skipped_total";
    #[counter]
    /// Offsets of a stream's partitions that Kafka holds but gives the sink no record for, which it
    /// went past: the markers that end transactions, the records of aborted transactions (the sink
    /// reads `read_committed`) and records removed by compaction. Not a loss, so not a gap.
    pub const OFFSETS_PASSED: &str = "sink_offsets_without_records_total";
    #[counter]
    /// Errors the Kafka consumer reported in place of a message, by librdkafka's error code
    /// (`error`): e.g. `TopicAuthorizationFailed` when an ACL keeps the sink from a stream topic.
    pub const CONSUMER_ERRORS: &str = "sink_kafka_consumer_errors_total";
    #[gauge]
    /// Partitions of a stream that this sink holds stopped at an offset gap
    /// (`on_offset_gap = "stop"`): they land nothing until an operator decides.
    pub const GAP_STOPPED: &str = "sink_partitions_stopped_at_gap";
    #[counter]
    /// Appends to a stream's Iceberg table (`[table]`), by result: `committed`, `conflict` (another
    /// writer committed first; built again on its version) or `failed` (retried at the next tick).
    pub const TABLE_COMMITS: &str = "sink_table_commits_total";
    #[counter]
    /// Landed files registered in a stream's table, by `stream`.
    pub const TABLE_FILES: &str = "sink_table_files_committed_total";
    #[counter]
    /// Records of the landed files registered in a stream's table, by `stream`.
    pub const TABLE_RECORDS: &str = "sink_table_records_committed_total";
    #[counter]
    /// Compactions of a stream's table (`[table.compaction]`), by result: `committed`,
    /// `conflict` (another writer committed first; built again on its version), `abandoned`
    /// (another writer removed files it rewrote; its files are deleted) or `failed`.
    pub const TABLE_COMPACTIONS: &str = "sink_table_compactions_total";
    #[counter]
    /// Small files of a stream's table that compactions replaced, by `stream`.
    pub const TABLE_COMPACTED_FILES: &str = "sink_table_files_compacted_total";
    #[gauge]
    /// Seconds since the oldest file this sink landed and has not yet committed to its table was
    /// landed (0 when none waits): the table's staleness on top of the files'.
    pub const TABLE_COMMIT_LAG: &str = "sink_table_commit_lag_seconds";
    #[histogram]
    /// Seconds a table commit took, retries included.
    pub const TABLE_COMMIT_DURATION: &str = "sink_table_commit_duration_seconds";
    #[gauge]
    /// Records of a partition not yet read, by `topic` and `partition` (high watermark minus
    /// position).
    pub const CONSUMER_LAG: &str = "sink_consumer_lag_records";
    #[gauge]
    /// Bytes of records held in memory for open files, over all partitions (at most about
    /// `memory_budget_bytes`).
    pub const BUFFERED_BYTES: &str = "sink_buffered_bytes";
    #[gauge]
    /// Bytes of open files written to their staged files so far, over all partitions (at most about
    /// `upload.staging_budget_bytes`).
    pub const STAGED_BYTES: &str = "sink_staged_bytes";
    #[gauge]
    /// Bytes reserved for the dedupe windows of the partitions this sink holds (at most
    /// `dedupe_memory_bytes`).
    pub const DEDUPE_MEMORY: &str = "sink_dedupe_window_bytes";
    #[counter]
    /// Row groups written early to their staged file to keep memory under the budget.
    pub const SPILLED_ROW_GROUPS: &str = "sink_spilled_row_groups_total";
    #[counter]
    /// Unfinished multipart uploads of earlier runs that the sink removed.
    pub const ABANDONED_UPLOADS: &str = "sink_abandoned_uploads_removed_total";
    #[counter]
    /// Records that went to the dead-letter location (also counted in `DISCARDED` by reason).
    pub const DEAD_LETTERS: &str = "sink_dead_letter_records_total";
    #[counter]
    /// Compressed message sets that librdkafka decompressed again into a bigger buffer (its
    /// statistic `zbuf_grow`, summed over brokers). A zstd frame without its uncompressed size
    /// (written by a producer whose librdkafka lacks `WITH_ZSTD_STATIC`) is decompressed into a
    /// guessed buffer, and from the start again on every miss; ours carry the size, so this stays 0
    /// unless other producers write to the topics.
    pub const DECOMPRESSION_REGROWTHS: &str = "sink_kafka_decompression_regrowths_total";
    #[counter]
    /// Hour folders of the landing zone listed to warm the dedupe windows of newly opened
    /// partitions (one listing serves every partition opened until the next rebalance).
    pub const LANDING_LISTINGS: &str = "sink_landing_listings_total";
    #[counter]
    /// Staged files that could not be written (the staging disk full, an I/O error): each time, the
    /// partition's open file was dropped and its range read again from Kafka after a backoff.
    pub const STAGING_ERRORS: &str = "sink_staging_errors_total";

    #[counter]
    /// Definitions of a stream read again because a record did not fit the running one, by
    /// `result`: `taken` (a compatible change, in force from then on) or `refused` (incompatible,
    /// kept out until a restart; records that need it go to the dead letters).
    pub const DEFINITION_CHANGES: &str = "sink_definition_changes_total";
    #[gauge]
    /// 1 while the definition file of a stream holds an incompatible change that this sink refused
    /// (it runs with the definition it had), else 0.
    pub const DEFINITION_REFUSED: &str = "sink_definition_refused";

    #[gauge]
    /// 1 when the last SIGHUP reload put the config in force (or none was asked for), 0 when it
    /// did not load or check and the running settings stayed.
    pub const RELOAD_SUCCESSFUL: &str = "sink_config_last_reload_successful";
}

/// Creates, at zero, the series that alerts and dashboards watch: Prometheus sees no increase in
/// a counter whose first sample is already 1, so the first dead letter of a stream would go
/// unnoticed.
/// Installs the Prometheus recorder first (once per process), so nothing registered is lost.
pub fn register(streams: &schemas::Streams) {
    use service_kit::telemetry::{set_gauges, zero_counters};
    service_kit::install_metrics();
    describe();
    for retryable in ["true", "false"] {
        zero_counters(&[STORE_ERRORS], &[("retryable", retryable.to_owned())]);
    }
    let counters = [
        SPILLED_ROW_GROUPS,
        ABANDONED_UPLOADS,
        DECOMPRESSION_REGROWTHS,
        LANDING_LISTINGS,
        STAGING_ERRORS,
    ];
    zero_counters(&counters, &[]);
    set_gauges(&[RELOAD_SUCCESSFUL], 1.0, &[]);
    for def in streams.iter() {
        register_stream(def);
    }
}

/// [`register`]'s series of one stream (also for a stream that appears while the sink runs).
pub fn register_stream(def: &schemas::StreamDef) {
    use service_kit::telemetry::{set_gauges, zero_counters};
    let labels = [("stream", def.name.clone())];
    let counters = [
        DEAD_LETTERS,
        ADOPTED_RECORDS,
        LANDING_CONFLICTS,
        OFFSETS_SKIPPED,
        OFFSETS_PASSED,
    ];
    zero_counters(&counters, &labels);
    set_gauges(
        &[GAP_STOPPED, DEFINITION_REFUSED, TABLE_COMMIT_LAG],
        0.0,
        &labels,
    );
    zero_counters(&[TABLE_FILES, TABLE_RECORDS], &labels);
    for result in ["committed", "conflict", "failed"] {
        let labels = [("stream", def.name.clone()), ("result", result.to_owned())];
        zero_counters(&[TABLE_COMMITS], &labels);
    }
    for result in ["taken", "refused"] {
        let labels = [("stream", def.name.clone()), ("result", result.to_owned())];
        zero_counters(&[DEFINITION_CHANGES], &labels);
    }
    duplicates(&def.name).increment(0);
}

/// `DISCARDED` for the duplicates of `stream`.
pub fn duplicates(stream: &str) -> ::metrics::Counter {
    ::metrics::counter!(DISCARDED, "stream" => stream.to_owned(), "reason" => "duplicate", "intentional" => "true")
}
