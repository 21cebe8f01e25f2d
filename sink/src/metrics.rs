//! Metric names of the sink, declared in one place.

pub const RECORDS_RECEIVED: &str = "sink_records_received_total";
pub const RECORDS_WRITTEN: &str = "sink_records_written_total";
pub const BYTES_WRITTEN: &str = "sink_written_bytes_total";
pub const FILES_WRITTEN: &str = "sink_files_written_total";
pub const FILE_SIZE: &str = "sink_file_size_bytes";
pub const UPLOAD_DURATION: &str = "sink_upload_duration_seconds";
pub const DISCARDED: &str = "sink_discarded_records_total";
pub const STORE_ERRORS: &str = "sink_store_errors_total";
pub const ADOPTED_FILES: &str = "sink_adopted_files_total";
pub const CONSUMER_LAG: &str = "sink_consumer_lag_records";
pub const BUFFERED_BYTES: &str = "sink_buffered_bytes";
pub const SPILLED_ROW_GROUPS: &str = "sink_spilled_row_groups_total";
pub const ABANDONED_UPLOADS: &str = "sink_abandoned_uploads_removed_total";
