//! The delivery loop of one stream: oldest spooled batch first, one at a time, acknowledged in
//! the spool only after the output acknowledged it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::batch::Batch;
use crate::link::{Link, StreamCap};
use crate::live::StreamLive;
use crate::metrics as m;
use crate::output::{Output, SendError};
use crate::pipeline::CurrentDef;
use crate::rejected::{Kept, RejectedDir};
use crate::spool::Spool;
pub use crate::stats::DeliveryStats;

/// How often a refused batch that found no room under `rejected/` looks again.
pub const REJECTED_RECHECK: Duration = Duration::from_secs(2);

pub struct Delivery {
    /// The stream's definition, which its pipeline may replace.
    pub def: CurrentDef,
    pub spool: Arc<Spool>,
    pub output: Arc<Output>,
    pub link: Arc<Link>,
    pub cap: StreamCap,
    pub priority: i32,
    /// Where refused batches are kept aside (shared by the streams).
    pub rejected: Arc<RejectedDir>,
    /// Set once the stream's pipeline has finished: the loop ends when the spool is empty.
    pub inputs_done: Arc<AtomicBool>,
    /// Where the counters, the link's state and the last error are published for `/status`.
    pub live: StreamLive,
}

impl Delivery {
    /// Sends until the inputs are done and the spool is empty, or until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<DeliveryStats> {
        let mut stats = DeliveryStats::default();
        let labels = [("stream", self.def.name())];
        loop {
            let spool = self.spool.clone();
            let next = tokio::task::spawn_blocking(move || spool.first_pending()).await??;
            let Some((seq, batch)) = next else {
                if self.inputs_done.load(Ordering::Acquire) && self.spool.pending().0 == 0 {
                    return Ok(stats);
                }
                tokio::select! {
                    _ = self.spool.appended() => {}
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    _ = shutdown.cancelled() => return Ok(stats),
                }
                continue;
            };
            // The cap is taken for the spooled body; a body recompressed without a dictionary
            // the gateway lacks is counted below at its own size.
            let mut wire = batch.body.len() as u64;
            tokio::select! {
                _ = async {
                    self.cap.acquire(wire).await;
                    self.link.acquire(self.priority, wire).await;
                } => {}
                _ = shutdown.cancelled() => return Ok(stats),
            }
            match self
                .output
                .send(&self.def.get(), &batch, &shutdown, &self.live)
                .await
            {
                Ok((response, sent)) => {
                    wire = sent;
                    for r in response.rejected.iter().take(10) {
                        tracing::warn!(stream = %self.def.name(), batch = %batch.id, index = r.index, reason = %r.reason, "a record of a delivered batch was rejected");
                    }
                    stats.accepted += response.accepted as u64;
                    stats.duplicates += response.duplicates as u64;
                    stats.rejected_records += response.rejected.len() as u64;
                    metrics::counter!(m::RECORDS_REJECTED, &labels)
                        .increment(response.rejected.len() as u64);
                }
                Err(SendError::Rejected { status, body }) => {
                    self.live.batch_refused(status, &body);
                    if !self.put_aside(&batch, status, body, &shutdown).await? {
                        return Ok(stats);
                    }
                    stats.rejected_batches += 1;
                    metrics::counter!(m::BATCHES_REJECTED, &labels).increment(1);
                }
                Err(SendError::Cancelled) => return Ok(stats),
                Err(e @ SendError::Config(_)) => return Err(e.into()),
            }
            let spool = self.spool.clone();
            tokio::task::spawn_blocking(move || spool.ack(seq)).await??;
            stats.batches += 1;
            stats.records += u64::from(batch.records);
            stats.wire_bytes += wire;
            stats.raw_bytes += u64::from(batch.raw_bytes);
            self.live.delivered(&stats);
            metrics::counter!(m::BATCHES_SENT, &labels).increment(1);
            metrics::counter!(m::RECORDS_SENT, &labels).increment(u64::from(batch.records));
            metrics::counter!(m::SENT_BYTES, &labels).increment(wire);
            metrics::counter!(m::SENT_RAW_BYTES, &labels).increment(u64::from(batch.raw_bytes));
        }
    }

    /// Keeps a refused batch under `rejected/`, waiting (the batch still first in the spool)
    /// while there is no room or the files cannot be written. False when shut down first.
    async fn put_aside(
        &self,
        batch: &Batch,
        status: u16,
        answer: String,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<bool> {
        let (batch, answer) = (Arc::new(batch.clone()), Arc::new(answer));
        let labels = [("stream", self.def.name())];
        let mut waiting = false;
        loop {
            let kept = {
                let (dir, stream) = (self.rejected.clone(), self.def.name());
                let (batch, answer) = (batch.clone(), answer.clone());
                tokio::task::spawn_blocking(move || dir.keep(&stream, &batch, status, &answer))
                    .await?
            };
            let why = match kept {
                Ok(Kept::Kept(path)) => {
                    tracing::error!(stream = %self.def.name(), batch = %batch.id, status, answer = %answer, kept = %path.display(), "batch refused for good; kept aside, not retried");
                    if waiting {
                        metrics::gauge!(m::REJECTED_WAITING, &labels).set(0.0);
                    }
                    return Ok(true);
                }
                Ok(Kept::NoRoom {
                    used,
                    needed,
                    limit,
                }) => format!(
                    "{} holds {used} bytes; {needed} more would pass its limit of {limit} (spool.rejected_max_mb)",
                    self.rejected.path().display()
                ),
                Err(e) => format!("cannot write to {}: {e}", self.rejected.path().display()),
            };
            if !waiting {
                // Logged once per batch: the wait can last until an operator makes room.
                tracing::error!(stream = %self.def.name(), batch = %batch.id, status, answer = %answer, reason = %why, "batch refused for good but cannot be kept aside; it stays in the spool, and the stream's later batches wait behind it, until it can");
                metrics::gauge!(m::REJECTED_WAITING, &labels).set(1.0);
                waiting = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(REJECTED_RECHECK) => {}
                _ = shutdown.cancelled() => return Ok(false),
            }
        }
    }
}
