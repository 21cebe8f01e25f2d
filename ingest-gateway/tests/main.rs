//! The integration tests of ingest-gateway, one module per file, in one test binary:
//! the suite links a binary per crate, not one per file (each links arrow, parquet, rdkafka
//! and the AWS SDK).

#[path = "../../loadtest/tests/common/mod.rs"]
mod common;

mod check;
mod kafka;
