//! The integration tests of sink, one module per file, in one test binary:
//! the suite links a binary per crate, not one per file (each links arrow, parquet, rdkafka
//! and the AWS SDK).

#[path = "../../loadtest/tests/common/mod.rs"]
mod common;
mod support;

mod check;
mod compaction;
mod crashes;
mod foreign_producer;
mod offset_gaps;
mod redrive;
mod s3;
mod table;
mod transactions;
