//! The counters of a stream's pipeline and of its delivery: what a run returns, and what
//! `/status` publishes while it runs ([`crate::live`]).

use crate::filter::Reduction;

/// Counters of one stream's pipeline.
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize)]
pub struct PipelineStats {
    pub read: u64,
    pub invalid: u64,
    pub duplicates: u64,
    pub filtered: u64,
    pub batched: u64,
    pub batches: u64,
    pub spool_dropped: u64,
    pub raw_bytes: u64,
    pub encoded_bytes: u64,
    /// Invalid records kept earlier that passed when tried again (also counted in `read` again).
    pub retried: u64,
    /// What each filter did since the pipeline started, in order.
    #[serde(skip)]
    pub reductions: Vec<Reduction>,
}

/// What one stream's delivery did.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeliveryStats {
    pub batches: u64,
    pub records: u64,
    pub accepted: u64,
    pub duplicates: u64,
    pub rejected_records: u64,
    pub rejected_batches: u64,
    pub wire_bytes: u64,
    pub raw_bytes: u64,
}
