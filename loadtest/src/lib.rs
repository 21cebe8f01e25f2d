//! Simulated device fleets, the end-to-end verifier and the one-command demo.

pub mod bench_gateway;
pub mod demo;
pub mod fleet;
pub mod verify;
