//! HTTP serving: the server every component's ports run on, bounded decompression of request
//! bodies, the draining of bodies an error answer leaves unread and the token bucket of rate
//! limits.

pub mod body;
pub mod drain;
pub mod rate;
pub mod server;
