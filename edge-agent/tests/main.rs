//! The integration tests of edge-agent, one module per file, in one test binary:
//! the suite links a binary per crate, not one per file (each links arrow, parquet, rdkafka
//! and the AWS SDK).

mod support;

mod crash;
mod logs;
mod outputs;
mod proxy;
mod sources;
mod status;
mod systemd;
mod tls;
