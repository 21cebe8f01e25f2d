//! Opening a partition (its stream's definition, its dedupe window warmed from the landing
//! files) and handling its records.

use super::*;
use schemas::StreamDef;

impl Worker {
    /// Sets up the state of a partition the first time one of its messages arrives, with the
    /// dedupe window warmed from the partition's recent landing files, so that duplicates that
    /// straddle a restart or a rebalance are dropped too.
    pub(super) async fn open_partition(&mut self, msg: &OwnedMessage) -> anyhow::Result<()> {
        if self.parts.contains_key(&part_ref(msg)) {
            return Ok(());
        }
        let key = (msg.topic().to_owned(), msg.partition());
        let expected = self.expected_start(&key).await;
        let Some(def) = self.stream_of(msg.topic()).await else {
            // Read again from this message once the definition may have come: skipped, its
            // records would wait for the next rebalance. From where the partition was expected
            // to start if that is before, so that a gap in front of it is still found then.
            let until = Instant::now() + STREAMS_RELOAD;
            let from = expected.map_or(msg.offset(), |e| e.min(msg.offset()));
            return self.hold(key, Some(from), until).await;
        };
        // More partitions than before share the dedupe memory: the open ones give up their
        // oldest entries first.
        let capacity = self.window_capacity(1);
        for part in self.parts.values_mut() {
            part.window.shrink_to(capacity);
        }
        tracing::debug!(topic = %key.0, partition = key.1, offset = msg.offset(), "opening partition");
        let mut state = PartitionState::new(def.clone(), key.0.clone(), key.1, capacity);
        state.hash_column = self.config.landing.hash_column(&def.name);
        state.expect_from = expected;
        // The store failing, the window is warmed once it answers, before the partition is
        // read: read with a cold window, records re-sent since the files were written would
        // land again once the store is back. Nothing lands meanwhile anyway.
        let mut attempt = 0;
        loop {
            match self
                .warm(&def, key.1, msg.offset(), &mut state.window)
                .await
            {
                Ok(n) => {
                    if n > 0 {
                        tracing::info!(topic = %key.0, partition = key.1, hashes = n, "warmed dedupe window");
                    }
                    if attempt > 0 {
                        self.stats.store_failing.store(false, Ordering::Relaxed);
                    }
                    break;
                }
                Err(e) => {
                    self.stats.store_failing.store(true, Ordering::Relaxed);
                    ::metrics::counter!(m::STORE_ERRORS, "retryable" => "true").increment(1);
                    tracing::warn!(topic = %key.0, partition = key.1, error = %e, attempt, "cannot warm the dedupe window from the landing zone; retrying before the partition is read");
                    tokio::select! {
                        _ = tokio::time::sleep(store::backoff(attempt)) => {}
                        _ = self.shutdown.cancelled() => {
                            // Nothing of the partition is taken without its window.
                            state.stopped = true;
                            break;
                        }
                    }
                    attempt += 1;
                }
            }
        }
        self.parts.insert(key, state);
        self.report_dedupe_memory();
        Ok(())
    }

    /// The definition of the stream of `topic`. A topic of no stream known (subscribed by a
    /// pattern, the topic of a stream defined after the start) makes the sink read
    /// `streams_dir` again, at most every [`STREAMS_RELOAD`], and take the streams the selection
    /// adds; definitions it has are kept as they were (a changed one is read again when a
    /// record needs it, [`Worker::redefine`]). Records of a topic without a definition are
    /// read but not written or committed, until the definition comes.
    pub(super) async fn stream_of(&mut self, topic: &str) -> Option<Arc<schemas::StreamDef>> {
        let name = stream_of_topic(&self.config.kafka.topic_prefix, topic)?;
        if let Some(def) = self.streams.get(name) {
            return Some(def.clone());
        }
        if self
            .streams_read
            .is_some_and(|t| t.elapsed() < STREAMS_RELOAD)
        {
            return None;
        }
        self.streams_read = Some(Instant::now());
        // Files are read on the blocking pool, not on the reactor.
        let config = self.config.clone();
        let read = tokio::task::spawn_blocking(move || {
            service_kit::load_streams_dir(&config.streams_dir)
                .and_then(|all| config.select_streams(all))
        })
        .await
        .map_err(anyhow::Error::from)
        .and_then(|read| read);
        match read {
            Ok(selected) => {
                for def in selected.iter() {
                    if self.streams.insert(def.clone()) {
                        m::register_stream(def);
                        tracing::info!(stream = %def.name, "a stream defined after the start is landed from now on");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "cannot read the stream definitions again")
            }
        }
        let def = self.streams.get(name).cloned();
        if def.is_none() {
            tracing::warn!(
                topic,
                "no stream definition for this topic: its records wait, uncommitted, until one is added to streams_dir"
            );
        }
        def
    }

    /// Loads the content hashes of the newest records of a partition's landing files (from the
    /// last [`WARM_HOURS`] hour folders) into `window`, oldest first: those at offsets before
    /// `before`, where the partition is read from. Records from there on are read again, so
    /// they enter the window as they are read, in order; taken from the files, they would make
    /// records read again look like duplicates of themselves, and a range of nothing else would
    /// be committed past without its landing file being adopted (which an Iceberg table needs:
    /// its previous owner may have died before committing the file to the table).
    pub(super) async fn warm(
        &mut self,
        def: &Arc<StreamDef>,
        partition: i32,
        before: i64,
        window: &mut DigestWindow,
    ) -> anyhow::Result<usize> {
        let stream = def.name.as_str();
        let mut newest_first: Vec<Vec<ContentHash>> = Vec::new();
        let mut total = 0;
        tracing::debug!(stream, partition, "warming dedupe window");
        let generation = self.consumer.context().rebalances.load(Ordering::Acquire);
        self.listings.refresh(generation);
        'hours: for prefix in parquet_file::recent_hour_prefixes(
            &self.config.key_prefix,
            stream,
            now_micros(),
            WARM_HOURS,
        ) {
            let files = match self.listings.newest_first(&prefix, partition) {
                Some(files) => files,
                None => {
                    let keys = self.store.list(&prefix).await?;
                    ::metrics::counter!(m::LANDING_LISTINGS).increment(1);
                    self.stats.landing_listings.fetch_add(1, Ordering::Relaxed);
                    self.listings.insert(prefix.clone(), stream, keys);
                    self.listings
                        .newest_first(&prefix, partition)
                        .unwrap_or_default()
                }
            };
            for (start, key) in files {
                if total >= window.capacity() {
                    break 'hours;
                }
                if start >= before {
                    continue;
                }
                tracing::debug!(key, "reading content hashes");
                let want = window.capacity() - total;
                let hashes = match self.newest_hashes(def, &key, want, before).await? {
                    Ranged::Read(hashes) => hashes,
                    Ranged::Gone => continue,
                    Ranged::Unreadable(e) => {
                        // Not the store failing: retrying would not help.
                        tracing::warn!(key, error = %e, "cannot read a landing file's content hashes; its records are not in the dedupe window");
                        continue;
                    }
                };
                total += hashes.len();
                newest_first.push(hashes);
            }
        }
        for hashes in newest_first.into_iter().rev() {
            for h in hashes {
                window.insert(digest(&h), 0);
            }
        }
        Ok(total.min(window.capacity()))
    }

    /// The content hashes of the `want` newest records of the landing file at `key` (all of
    /// them when it has fewer), computed from their fields, oldest first: the last row groups
    /// that hold them are read by range ([`Worker::read_pages`]), their offsets and hashed
    /// fields. Fails when the store does (the caller retries).
    pub(super) async fn newest_hashes(
        &self,
        def: &Arc<StreamDef>,
        key: &str,
        want: usize,
        before: i64,
    ) -> anyhow::Result<Ranged<Vec<ContentHash>>> {
        let columns = parquet_file::hash_columns(def);
        let rows = Rows::LastGroups(want);
        let (plan, pieces, size) = match self.read_pages(key, &columns, rows).await? {
            Ranged::Read(pages) => pages,
            Ranged::Gone => return Ok(Ranged::Gone),
            Ranged::Unreadable(e) => return Ok(Ranged::Unreadable(e)),
        };
        let def = def.clone();
        let read = tokio::task::spawn_blocking(move || {
            parquet_file::newest_hashes(&def, &plan.read(size, pieces)?, want, before)
        })
        .await?;
        Ok(read.map_or_else(Ranged::Unreadable, Ranged::Read))
    }

    /// Reads `rows` of `columns` of the landing file at `key` by range: its footer and offset
    /// index (the last 64 KiB, more for a longer footer), then only the pages that hold them
    /// ([`PagePlan`]), never the whole object (up to 128 MiB at the default file target).
    pub(super) async fn read_pages(
        &self,
        key: &str,
        columns: &[String],
        rows: Rows,
    ) -> Result<Ranged<Pages>, StoreError> {
        let tail = self
            .store
            .get_range(key, ByteRange::Suffix(parquet_file::TAIL_BYTES))
            .await?;
        let Some((mut tail, size)) = tail else {
            return Ok(Ranged::Gone);
        };
        let footer = match parquet_file::footer_bytes(&tail) {
            Ok(footer) => footer,
            Err(e) => return Ok(Ranged::Unreadable(e)),
        };
        if footer > tail.len() as u64 && footer <= size {
            let Some((whole, _)) = self.store.get_range(key, ByteRange::Suffix(footer)).await?
            else {
                return Ok(Ranged::Gone);
            };
            tail = whole;
        }
        let plan = match PagePlan::new(tail, size, columns, rows) {
            Ok(plan) => plan,
            Err(e) => return Ok(Ranged::Unreadable(e)),
        };
        let mut pieces = Vec::with_capacity(plan.ranges.len());
        for &(start, end) in &plan.ranges {
            let piece = self
                .store
                .get_range(key, ByteRange::Span(start, end))
                .await?;
            let Some((piece, _)) = piece else {
                return Ok(Ranged::Gone);
            };
            pieces.push(piece);
        }
        Ok(Ranged::Read((plan, pieces, size)))
    }

    /// The partition whose open file must close before `msg` joins it: its first record was
    /// ingested in another hour.
    pub(super) fn rotates_before(&self, msg: &Fields<'_>) -> Option<PartKey> {
        let part = self.parts.get(&msg.part)?;
        part.crosses_hour(msg.ingest_ts).then(|| part.key())
    }

    pub(super) fn targets(&self) -> FileTargets {
        FileTargets {
            file_bytes: self.config.rotation.max_bytes,
            row_group_bytes: self.config.rotation.row_group_bytes,
        }
    }

    /// Adds one message to its partition; returns the partition to flush, if one must be.
    /// Fails only when the staged file cannot be written (nothing is committed then).
    pub(super) fn handle<'m>(
        &mut self,
        msg: &Fields<'m>,
        checked: Option<Result<(&Row<'m, Pending>, ContentHash), &RecordError>>,
    ) -> anyhow::Result<Handled> {
        let targets = self.targets();
        // `open_partition` created the state (with its warmed window and its stream) before
        // this call.
        let Some(part) = self.parts.get_mut(&msg.part).filter(|p| !p.stopped) else {
            return Ok(Handled::Taken(None));
        };
        let Fields {
            offset,
            ingest_ts,
            payload,
            ..
        } = *msg;
        if let Some(next) = part.gap_before(offset) {
            return Ok(Handled::Gap(next));
        }
        let adopted = part.next_offset.is_some_and(|next| offset < next);
        let appended = if adopted {
            None
        } else {
            let staging = self.staging.path();
            let appended = match checked {
                Some(checked) => {
                    part.append_checked(checked, payload, offset, ingest_ts, staging, targets)
                }
                None => part.append(
                    payload,
                    offset,
                    ingest_ts,
                    staging,
                    (targets, &self.schemas),
                ),
            }
            .map_err(|e| StagingFailed::of(part, Some(offset), e))?;
            Some(match appended {
                Appended::Unfit(e) => {
                    let changed = self
                        .definitions
                        .get(&part.def.name)
                        .is_none_or(DefinitionFile::changed);
                    if part.newer.is_some() || changed {
                        return Ok(Handled::Redefine);
                    }
                    // No newer definition takes it.
                    part.dead_letter(offset, ingest_ts, &e.to_string(), payload);
                    Appended::Unfit(e)
                }
                Appended::SchemaNotLoaded(id) => return Ok(Handled::Schema(id)),
                appended => appended,
            })
        };
        // The idle timer's clock, read once per round of ready messages.
        part.last_append = self.round_start;
        self.stats.records_received.fetch_add(1, Ordering::Relaxed);
        part.received.increment(1);
        let Some(appended) = appended else {
            // Already durable in an adopted object.
            self.stats.count_adopted(part, 1);
            return Ok(Handled::Taken(None));
        };
        let full = match appended {
            Appended::Row { full } => full,
            Appended::Duplicate => {
                part.duplicates.increment(1);
                self.stats
                    .duplicates_dropped
                    .fetch_add(1, Ordering::Relaxed);
                return Ok(Handled::Taken(None));
            }
            Appended::SchemaNotLoaded(_) => unreachable!("handled above, before it is counted"),
            Appended::DeadLetter(e) | Appended::Unfit(e) => {
                let PartRef(topic, partition) = msg.part;
                tracing::warn!(topic, partition, offset, reason = %e, "dead letter: undecodable or invalid record");
                ::metrics::counter!(m::DISCARDED, "stream" => part.def.name.clone(), "reason" => e.code(), "intentional" => "false").increment(1);
                ::metrics::counter!(m::DEAD_LETTERS, "stream" => part.def.name.clone())
                    .increment(1);
                self.stats.dead_letters.fetch_add(1, Ordering::Relaxed);
                let full = part.dead.len() >= self.config.rotation.max_dead_letter_bytes;
                return Ok(Handled::Taken(
                    full.then(|| (part.key(), FlushReason::DeadLetters)),
                ));
            }
        };
        Ok(Handled::Taken(
            if part.rows() >= self.config.rotation.max_records {
                Some((part.key(), FlushReason::Records))
            } else if full {
                Some((part.key(), FlushReason::Bytes))
            } else {
                None
            },
        ))
    }

    /// A record of partition `key` sets a field its stream's definition lacks, or lacks one it
    /// requires ([`Appended::Unfit`]). If the definition's file changed since it was read, it
    /// is read again ([`Worker::reread`]). If a compatible newer definition is there, the
    /// partition's open file closes and the partition takes it; the record is then handled
    /// again, and becomes a dead letter only if that one does not take it either.
    pub(super) async fn redefine(&mut self, key: &PartKey) -> anyhow::Result<()> {
        let Some(name) = self.parts.get(key).map(|p| p.def.name.clone()) else {
            return Ok(());
        };
        self.reread(&name).await?;
        if self.parts.get(key).is_some_and(|p| p.newer.is_some()) {
            self.flush(key, FlushReason::Definition).await?;
            let Some(part) = self.parts.get_mut(key).filter(|p| !p.stopped) else {
                return Ok(());
            };
            if part.file.is_none() {
                if let Some(newer) = part.newer.take() {
                    part.def = newer;
                }
            } else {
                // The open range cannot close yet (an adopted dead-letter object reaches past
                // it): it is read again from its start, by a state opened with the new
                // definition.
                let resume = part.unwritten_from();
                self.drop_partition(key);
                self.hold(key.clone(), resume, Instant::now()).await?;
            }
        }
        Ok(())
    }

    /// Reads the definition of stream `name` again (on the blocking pool) if its file changed.
    /// A compatible change (see [`schemas::Change`]) replaces it: partitions opened from now on
    /// take the new one, and open ones at their next file or at their next record that needs
    /// it. An incompatible change is refused until a restart: records the running definition
    /// does not take go to the dead letters, as before.
    pub(super) async fn reread(&mut self, name: &str) -> anyhow::Result<()> {
        let Some(running) = self.streams.get(name).cloned() else {
            return Ok(());
        };
        let mut file = self
            .definitions
            .remove(name)
            .unwrap_or_else(|| DefinitionFile::new(&self.config.streams_dir, name));
        if !file.changed() {
            self.definitions.insert(name.to_owned(), file);
            return Ok(());
        }
        let (file, reread) = tokio::task::spawn_blocking(move || {
            let reread = file.reread(&running);
            (file, reread)
        })
        .await?;
        self.definitions.insert(name.to_owned(), file);
        let refused = matches!(reread, Reread::Refused);
        self.refused.retain(|r| r != name);
        if refused {
            self.refused.push(name.to_owned());
        }
        self.stats
            .definitions_refused
            .store(self.refused.len() as u64, Ordering::Relaxed);
        ::metrics::gauge!(m::DEFINITION_REFUSED, "stream" => name.to_owned()).set(if refused {
            1.0
        } else {
            0.0
        });
        let result = match reread {
            Reread::Same | Reread::Failed => return Ok(()),
            Reread::Refused => "refused",
            Reread::Compatible(def) => {
                let def = Arc::new(*def);
                self.streams.replace(def.clone());
                for part in self.parts.values_mut().filter(|p| p.def.name == name) {
                    part.newer = Some(def.clone());
                }
                "taken"
            }
        };
        ::metrics::counter!(m::DEFINITION_CHANGES, "stream" => name.to_owned(), "result" => result)
            .increment(1);
        Ok(())
    }
}
