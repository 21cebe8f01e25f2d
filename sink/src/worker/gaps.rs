//! Offset gaps: a partition that gets a later offset from Kafka than the one it needs next.
//!
//! Kafka gives a `read_committed` consumer no record for some offsets it holds: the markers that
//! end transactions (a commit or an abort), the records of aborted transactions, and records
//! removed by compaction. A partition that needs offset `next` and gets a later one first asks
//! Kafka for the partition's earliest offset. When that is at or before `next`, every offset
//! between is still in the partition, so none of them held a record for the sink: the partition
//! goes past them (counted, not reported). Records are lost only when the partition's earliest
//! offset is past `next`: deleted by retention or by `DeleteRecords` before a sink read them (a
//! sink down for longer than the topic keeps its records, a topic with a small
//! `retention.bytes`). That is a gap of the records from `next` to the earliest offset, found
//! whether it opens while the partition is read or lies between the group's committed offset
//! and the first record a newly assigned partition gets (a partition the group never committed
//! starts at the earliest offset Kafka holds, unchecked); an earliest offset that cannot be read
//! counts as a gap up to the record got. A gap is logged (ERROR, with the range and the
//! partition's earliest offset), counted and alerted on, and then, by `on_offset_gap`:
//! - `stop`: the partition lands and commits what came before the gap and stops there,
//!   paused, with the sink unready; every sink that takes it over stops at the same offset,
//!   until an operator sets `skip` (a reload is enough) or moves the group's offset;
//! - `skip`: the range is noted as one line in the partition's dead letters and the partition
//!   goes on; its open range starts at the gap, so the keys are those of a sink that read it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rdkafka::consumer::Consumer as _;
use rdkafka::{Offset, TopicPartitionList};

use super::{Gap, Worker};
use crate::config::OffsetGapPolicy;
use crate::metrics as m;
use crate::partition::FlushReason;
use crate::{Fields, PartKey};

impl Worker {
    /// Where partition `key`, which has no state, is expected to go on: where the sink sought
    /// it back to, else the group's committed offset (the committed offsets of the whole
    /// assignment are read once per rebalance). `None` when the group never committed it, or
    /// its committed offsets cannot be read (logged: its first record is then not checked).
    pub(crate) async fn expected_start(&mut self, key: &PartKey) -> Option<i64> {
        if let Some(&at) = self.resume_at.get(key) {
            return Some(at);
        }
        let generation = self.consumer.context().rebalances.load(Ordering::Acquire);
        if self.committed_read == Some(generation) {
            return None;
        }
        self.committed_read = Some(generation);
        let consumer = self.consumer.clone();
        let read = tokio::task::spawn_blocking(move || {
            let assignment = consumer.assignment()?;
            consumer.committed_offsets(assignment, Duration::from_secs(10))
        })
        .await;
        match read {
            Ok(Ok(list)) => {
                for e in list.elements() {
                    if let Offset::Offset(offset) = e.offset() {
                        self.resume_at
                            .entry((e.topic().to_owned(), e.partition()))
                            .or_insert(offset);
                    }
                }
            }
            Ok(Err(e)) => tracing::warn!(
                error = %e,
                "cannot read the group's committed offsets: the first records of the partitions opened now are not checked for an offset gap"
            ),
            Err(e) => tracing::warn!(error = %e, "committed offsets task failed"),
        }
        self.resume_at.get(key).copied()
    }

    /// The record `msg` of partition `key` is past offset `next`, which the partition needs:
    /// reports the gap and skips it or stops the partition ([`OffsetGapPolicy`]). `true` when
    /// skipped (the record is to be handled again), `false` when the partition stopped (the
    /// record is not taken).
    pub(crate) async fn offset_gap(
        &mut self,
        key: &PartKey,
        next: i64,
        msg: &Fields<'_>,
    ) -> anyhow::Result<bool> {
        let Some(part) = self.parts.get(key) else {
            return Ok(false);
        };
        let stream = part.def.name.clone();
        let earliest = self.earliest_offset(key).await;
        if let Some(low) = earliest
            && low <= next
        {
            let passed = msg.offset - next;
            tracing::debug!(
                topic = %key.0,
                partition = key.1,
                first_offset = next,
                last_offset = msg.offset - 1,
                "offsets without records for the sink (transaction markers, aborted or compacted records)"
            );
            ::metrics::counter!(m::OFFSETS_PASSED, "stream" => stream).increment(passed as u64);
            self.stats
                .offsets_passed
                .fetch_add(passed as u64, Ordering::Relaxed);
            if let Some(part) = self.parts.get_mut(key) {
                part.pass_over(next, msg.offset, msg.ingest_ts);
            }
            return Ok(true);
        }
        // What follows the lost records, up to the record got, is passed over once they are
        // skipped (the record is handled again and finds the partition's earliest offset).
        let got = earliest.map_or(msg.offset, |low| low.min(msg.offset));
        let records = got - next;
        let cause = match earliest {
            Some(low) => format!(
                "deleted before they were read (retention or DeleteRecords): the partition's earliest offset is {low}"
            ),
            None => "the partition's earliest offset cannot be read".to_owned(),
        };
        self.stats.offset_gaps.fetch_add(1, Ordering::Relaxed);
        let (topic, partition) = (key.0.as_str(), key.1);
        let policy = self.config.on_offset_gap;
        let action = match policy {
            OffsetGapPolicy::Skip => {
                "skipped, and noted in the partition's dead letters".to_owned()
            }
            OffsetGapPolicy::Stop => format!(
                "the partition stops at offset {next} (what came before is landed and committed) and the sink is not ready: set on_offset_gap = \"skip\" and reload the sink (SIGHUP) to skip them"
            ),
        };
        tracing::error!(
            topic,
            partition,
            first_offset = next,
            last_offset = got - 1,
            records,
            policy = policy.as_str(),
            "offset gap: {records} records ({next} to {}) are not in Kafka for the sink, {cause}; {action}",
            got - 1
        );
        if policy == OffsetGapPolicy::Skip {
            ::metrics::counter!(m::OFFSETS_SKIPPED, "stream" => stream).increment(records as u64);
            self.stats
                .offsets_skipped
                .fetch_add(records as u64, Ordering::Relaxed);
            if let Some(part) = self.parts.get_mut(key) {
                part.skip_gap(next, got, msg.ingest_ts);
            }
            return Ok(true);
        }
        self.flush(key, FlushReason::OffsetGap).await?;
        let Some(part) = self.parts.get_mut(key) else {
            return Ok(false);
        };
        part.stopped = true;
        let mut list = TopicPartitionList::new();
        list.add_partition(topic, partition);
        if let Err(e) = self.consumer.pause(&list) {
            tracing::warn!(topic, partition, error = %e, "cannot pause the partition stopped at the gap; its records are read and left");
        }
        self.gap_stopped
            .insert(key.clone(), Gap { stream, next, got });
        self.report_gap_stopped(&self.gap_stopped[key].stream);
        Ok(false)
    }

    /// Once `on_offset_gap` is `skip` (a reload), the partitions stopped at a gap go on: each is
    /// read again from the offset it stopped at, and skips the gap there.
    pub(crate) async fn resume_gaps(&mut self) -> anyhow::Result<()> {
        if self.config.on_offset_gap != OffsetGapPolicy::Skip || self.gap_stopped.is_empty() {
            return Ok(());
        }
        for (key, gap) in std::mem::take(&mut self.gap_stopped) {
            tracing::warn!(
                topic = %key.0,
                partition = key.1,
                first_offset = gap.next,
                next_offset_held = gap.got,
                "on_offset_gap is \"skip\" now: the partition stopped at the gap goes on past it"
            );
            self.drop_partition(&key);
            self.report_gap_stopped(&gap.stream);
            self.hold(key, Some(gap.next), Instant::now()).await?;
        }
        Ok(())
    }

    /// Sets the gauge of `stream`'s partitions stopped at a gap, and the sink's count.
    pub(crate) fn report_gap_stopped(&self, stream: &str) {
        let of_stream = self
            .gap_stopped
            .values()
            .filter(|g| g.stream == stream)
            .count();
        ::metrics::gauge!(m::GAP_STOPPED, "stream" => stream.to_owned()).set(of_stream as f64);
        self.stats
            .gap_stopped
            .store(self.gap_stopped.len() as u64, Ordering::Relaxed);
    }

    /// The earliest offset Kafka holds of partition `key`, for the report of a gap.
    async fn earliest_offset(&self, key: &PartKey) -> Option<i64> {
        let consumer = self.consumer.clone();
        let (topic, partition) = key.clone();
        let read = tokio::task::spawn_blocking(move || {
            consumer
                .fetch_watermarks(&topic, partition, Duration::from_secs(5))
                .context("cannot read the partition's watermarks")
        })
        .await;
        match read {
            Ok(Ok((low, _))) => Some(low),
            Ok(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), "offset gap");
                None
            }
            Err(_) => None,
        }
    }
}
