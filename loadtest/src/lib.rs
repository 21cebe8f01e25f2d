//! Simulated device fleets, the end-to-end verifier and the one-command demo.

pub mod bench_agent;
pub mod bench_avro;
pub mod bench_connect;
pub mod bench_gateway;
pub mod bench_sink;
pub mod bench_table;
pub mod cli;
pub mod demo;
pub mod fleet;
pub mod process;
pub mod reduction;
pub mod send;
pub mod verify;
