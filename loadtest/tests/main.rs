//! The integration tests of loadtest, one module per file, in one test binary:
//! the suite links a binary per crate, not one per file (each links arrow, parquet, rdkafka
//! and the AWS SDK).

mod common;

mod dictionary;
mod docs;
mod embedded;
mod exactly_once;
mod kafka_cluster;
mod kafka_security;
mod monitoring;
mod repository;
mod send_tls;
mod services;
mod spark;
mod walkthrough;
