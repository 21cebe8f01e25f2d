//! HTTP serving: the server every component's ports run on, bounded decompression of request
//! bodies and the token bucket of rate limits.

pub mod body;
pub mod rate;
pub mod server;
