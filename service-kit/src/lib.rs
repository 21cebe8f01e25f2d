//! What the three service binaries (gateway, sink, agent) share to run: config files and
//! secrets (`config`), the Kafka clients (`kafka`: producer, client log, TLS/SASL, redrive),
//! HTTP serving (`http`: server, bounded body decompression, rate buckets), certificate files
//! (`tls`), tracing and metrics (`telemetry`) and the process itself (`process`: signals,
//! limits, thread priority, the start-up and shutdown of a service).

pub mod config;
pub mod http;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod process;
pub mod telemetry;
pub mod tls;

#[doc(hidden)]
pub use metrics as __metrics;

pub use config::{ConfigError, DefinitionFile, Reread, load_config, load_stream, load_streams_dir};
pub use telemetry::{
    Health, admin_router, init_tracing, init_tracing_with_default, install_metrics, serve_admin,
    serve_admin_with, spawn_readiness_probe,
};
