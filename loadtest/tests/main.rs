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
mod registry;
mod repository;
mod send_tls;
mod services;
mod spark;
mod walkthrough;

/// Runs the `loadtest` binary with `args`; returns whether it succeeded and the JSON it printed.
async fn loadtest(args: &[&std::ffi::OsStr]) -> (bool, serde_json::Value) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(args)
        .output()
        .await
        .unwrap();
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "loadtest {args:?} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.success(), report)
}
