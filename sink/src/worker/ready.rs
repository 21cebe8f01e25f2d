//! The consumer loop's common case, a group of ready messages at a time: the messages of open
//! partitions that stay in their hour are checked first, their content hashes made side by side
//! ([`schemas::HashGroup`], eight records in the lanes of one vector instead of one block at a
//! time), then taken in order while librdkafka still owns them. What needs an await (a flush, a new
//! partition, an hour boundary, a definition read again, a failed staged write) ends the group:
//! the messages after it are detached and handled one at a time the slow way, so every message
//! is handled in its order, as it was one by one.

use std::sync::atomic::Ordering;

use futures::{FutureExt as _, StreamExt as _};
use hashbrown::Equivalent as _;
use rdkafka::consumer::{Consumer as _, MessageStream};
use rdkafka::error::KafkaResult;
use rdkafka::message::{BorrowedMessage, OwnedMessage};

use super::{DRAIN_MAX, Handled, Worker};
use crate::metrics as m;
use crate::partition::FlushReason;
use crate::{Fields, PartKey, SinkContext, part_ref};

/// Messages checked together. The lanes take eight records of a block count; 32 fill them for
/// the one or two blocks that a sensor reading's encoding takes.
pub const GROUP: usize = 32;

/// What is left of a group of ready messages once it was taken as far as it could be without
/// an await: all owned, so it may be held across the awaits.
#[derive(Default)]
pub(crate) struct Left {
    /// The last message taken failed (a staged write): recovered from first.
    failed: Option<anyhow::Error>,
    /// A partition to flush after the last message taken.
    flush: Option<(PartKey, FlushReason)>,
    /// The messages after the last one taken, handled one at a time (`Worker::on_message`).
    slow: Vec<OwnedMessage>,
}

impl Worker {
    /// Takes ready messages, from `first` on, into a group of up to [`GROUP`] (fewer when no
    /// more are ready, when [`DRAIN_MAX`] were taken in this round, or when a rebalance revoked
    /// partitions: the messages received before it are handled first, as they were one by one)
    /// and handles the group as far as it can without an await. Returns what is left, and
    /// whether to go on with the round.
    pub(crate) fn take_ready<'c>(
        &mut self,
        messages: &mut MessageStream<'c, SinkContext>,
        first: KafkaResult<BorrowedMessage<'c>>,
        taken: &mut usize,
    ) -> (Left, bool) {
        let mut group = Vec::with_capacity(GROUP);
        let mut held = None;
        let mut next = Some(first);
        let mut more = false;
        while let Some(msg) = next.take() {
            *taken += 1;
            match msg {
                Ok(msg) if self.revoking() && !group.is_empty() => held = Some(msg),
                Ok(msg) => {
                    // Partitions revoked before this message was received are dropped first.
                    self.drop_revoked();
                    group.push(msg);
                }
                Err(e) => consumer_error(&self.stats, &e),
            }
            if *taken >= DRAIN_MAX {
                break;
            }
            if held.is_some() || group.len() == GROUP {
                more = true;
                break;
            }
            next = next_ready(messages);
        }
        let mut left = self.take_group(group);
        if let Some(msg) = held {
            // `Worker::finish_left` drops the revoked partitions before it.
            left.slow.push(msg.detach());
        }
        (left, more)
    }

    /// Whether a rebalance revoked partitions that [`Worker::drop_revoked`] has not dropped.
    fn revoking(&self) -> bool {
        self.consumer.context().any_revoked.load(Ordering::Acquire)
    }

    /// Checks the group's messages whose partition is open and stays in its hour (up to the
    /// first that is not), makes their hashes together, then takes them in order until one
    /// needs an await. The messages from there on are detached into [`Left::slow`].
    fn take_group(&mut self, group: Vec<BorrowedMessage<'_>>) -> Left {
        let ingest_time = self.config.kafka.ingest_time;
        let fields: Vec<Fields<'_>> = group.iter().map(|m| Fields::of(m, ingest_time)).collect();
        let mut checked = Vec::with_capacity(fields.len());
        for f in &fields {
            let Some(part) = self
                .parts
                .get_mut(&f.part)
                .filter(|p| !p.crosses_hour(f.ingest_ts))
            else {
                break;
            };
            // A record the partition will not append (it stopped, or an adopted object holds
            // it) is not checked.
            let appends = !part.stopped && part.next_offset.is_none_or(|next| f.offset >= next);
            checked.push(appends.then(|| part.check(f.payload, &mut self.hashes, &self.schemas)));
        }
        self.hashes.finish();
        // The dedupe windows' buckets of the checked records, loaded together: with many
        // partitions open, the windows fall out of the cache between two records of one
        // partition, and each insert would wait for memory in turn.
        for (f, checked) in fields.iter().zip(&checked) {
            if let (Some(Ok(row)), Some(part)) = (checked, self.parts.get(&f.part)) {
                part.prefetch(&self.hashes.get(row.hash));
            }
        }
        let mut left = Left::default();
        let mut done = 0;
        for (f, checked) in fields.iter().zip(&checked) {
            // An earlier record of the group may have opened a range in another hour.
            if self
                .parts
                .get(&f.part)
                .is_none_or(|p| p.crosses_hour(f.ingest_ts))
            {
                break;
            }
            // The row stays where it was checked (a move would copy its slots).
            let checked = checked
                .as_ref()
                .map(|c| c.as_ref().map(|row| (row, self.hashes.get(row.hash))));
            let taken = match self.handle(f, checked) {
                Ok(Handled::Redefine | Handled::Gap(_) | Handled::Schema(_)) => break,
                Ok(Handled::Taken(flush)) => self.count_received().map(|budget| flush.or(budget)),
                Err(e) => Err(e),
            };
            done += 1;
            match taken {
                Ok(None) => {}
                Ok(Some(flush)) => {
                    left.flush = Some(flush);
                    break;
                }
                Err(e) => {
                    left.failed = Some(e);
                    break;
                }
            }
        }
        self.hashes.clear();
        drop((checked, fields));
        left.slow = group.into_iter().skip(done).map(|m| m.detach()).collect();
        left
    }

    /// Does what a group left (recovers from its failure, flushes, handles its other messages
    /// one at a time); returns whether it awaited anything.
    pub(crate) async fn finish_left(&mut self, left: Left) -> anyhow::Result<bool> {
        let Left {
            failed,
            flush,
            slow,
        } = left;
        let mut waited = false;
        self.sought.clear();
        if let Some(e) = failed {
            self.recover::<()>(Err(e)).await?;
            waited = true;
        }
        if let Some((key, reason)) = flush {
            let flushed = self.flush(&key, reason).await;
            self.recover(flushed).await?;
            waited = true;
        }
        for msg in slow {
            // Its partition was sought back (a failed staged write, a stream not defined yet, a
            // newer definition): it is read again from there, this message with it.
            let part = part_ref(&msg);
            if self.sought.iter().any(|key| part.equivalent(key)) {
                continue;
            }
            self.drop_revoked();
            let handled = self.on_message(msg).await;
            self.recover(handled).await?;
            waited = true;
        }
        Ok(waited)
    }
}

/// The next message of `messages` if one is ready, without waiting.
pub(crate) fn next_ready<'c>(
    messages: &mut MessageStream<'c, SinkContext>,
) -> Option<KafkaResult<BorrowedMessage<'c>>> {
    messages
        .next()
        .now_or_never()
        .map(|m| m.expect("a Kafka message stream never ends"))
}

/// An error the consumer reported in place of a message: counted by its code
/// ([`m::CONSUMER_ERRORS`]) and logged. A topic or group that the sink's principal may not read
/// says what to grant.
fn consumer_error(stats: &crate::SinkStats, e: &rdkafka::error::KafkaError) {
    use rdkafka::types::RDKafkaErrorCode as Code;
    let code = e.rdkafka_error_code();
    let name = code.map_or_else(|| "other".to_owned(), |c| format!("{c:?}"));
    ::metrics::counter!(m::CONSUMER_ERRORS, "error" => name).increment(1);
    stats.consumer_errors.fetch_add(1, Ordering::Relaxed);
    match code {
        Some(Code::TopicAuthorizationFailed | Code::GroupAuthorizationFailed) => tracing::error!(
            error = %e,
            "Kafka does not let the sink read a stream topic or use its group: grant the sink's principal Read and Describe on the topics and Read on the group (ACLs); what it cannot read stays in Kafka"
        ),
        _ => tracing::warn!(error = %e, "consumer error"),
    }
}
