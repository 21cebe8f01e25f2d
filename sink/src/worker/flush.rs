//! Closing a partition's file: landing it (or adopting the one already landed), its dead
//! letters, and committing its offsets.

use super::*;
use crate::table::stats::FileStats;

impl Worker {
    /// Closes the partition's open file, makes it an object and commits past it. On a
    /// conflicting create, adopts the existing object and keeps the rows after it in a new open
    /// file. Retries retryable store errors until shutdown.
    pub(super) async fn flush(&mut self, key: &PartKey, reason: FlushReason) -> anyhow::Result<()> {
        loop {
            let Some(part) = self.parts.get_mut(key).filter(|p| !p.stopped) else {
                return Ok(());
            };
            let (Some(start), Some(next)) = (part.range_start, part.next_offset) else {
                // Nothing open: an adopted object that left nothing after it, or a commit that
                // failed, is committed now (else the offset waited for the partition's next
                // records, and its lag showed until then).
                if part.next_offset > part.committed {
                    self.commit(key).await;
                }
                return Ok(());
            };
            if part.dead_through.is_some_and(|through| next <= through) {
                // An adopted dead-letter object reaches past the range: it closes once the
                // object's offsets are read (the records are in Kafka: its writer read them), or
                // at shutdown not at all, and the next owner reads it again.
                return Ok(());
            }
            let range = parquet_file::OffsetRange {
                first: start.offset,
                last: next - 1,
            };
            if let Some((first, ingest_ts)) = part.dead.first() {
                if !self.write_dead_letters(key, first, ingest_ts).await? {
                    // Shutting down while the store fails: nothing is committed.
                    if let Some(part) = self.parts.get_mut(key) {
                        part.stopped = true;
                    }
                    return Ok(());
                }
                continue;
            }
            let Some(file) = part.file.take() else {
                // Only skipped records (duplicates, dead letters) since the last file.
                part.range_start = None;
                if part.next_offset > part.committed {
                    self.commit(key).await;
                }
                return Ok(());
            };
            let (def, topic, partition) = (part.def.clone(), part.topic.clone(), part.partition);
            let object = parquet_file::object_key(
                &self.config.key_prefix,
                &def.name,
                start.ingest_ts,
                partition,
                start.offset,
            );
            let finished =
                tokio::task::spawn_blocking(move || file.finish(&topic, partition, range))
                    .await?
                    .map_err(|e| {
                        let e = anyhow::Error::new(e).context("cannot finish a Parquet file");
                        StagingFailed::of(part, None, e)
                    })?;
            part.size_ratio = finished.ratio;
            let (staged, rows, size) = (finished.staged, finished.rows, finished.size);
            let mut stats = Some(finished.stats);
            let started = Instant::now();
            let part_bytes = self.config.upload.part_bytes;
            let outcome = self
                .with_retry(&object, || {
                    self.store.put_file_if_absent(&object, &staged, part_bytes)
                })
                .await;
            let part = self
                .parts
                .get_mut(key)
                .context("partition state vanished")?;
            let stream = part.def.name.clone();
            match outcome {
                Some(PutOutcome::Created) => {
                    ::metrics::histogram!(m::UPLOAD_DURATION)
                        .record(started.elapsed().as_secs_f64());
                    ::metrics::histogram!(m::FILE_SIZE, "stream" => stream.clone())
                        .record(size as f64);
                    ::metrics::counter!(m::FILES_WRITTEN, "stream" => stream.clone(), "reason" => reason.as_str()).increment(1);
                    ::metrics::counter!(m::RECORDS_WRITTEN, "stream" => stream.clone())
                        .increment(rows as u64);
                    ::metrics::counter!(m::BYTES_WRITTEN, "stream" => stream).increment(size);
                    self.stats
                        .records_written
                        .fetch_add(rows as u64, Ordering::Relaxed);
                    self.stats.files_written.fetch_add(1, Ordering::Relaxed);
                    part.range_start = None;
                    let landed = self.landed_file(
                        key,
                        &object,
                        range,
                        (rows as u64, size),
                        stats.take().unwrap_or_default(),
                    );
                    if let (Some(tables), Some(landed)) = (&mut self.tables, landed) {
                        tables.landed(landed);
                    }
                    self.staging_recovered(key);
                    tracing::debug!(
                        object,
                        rows,
                        size,
                        reason = reason.as_str(),
                        "wrote landing file"
                    );
                }
                Some(PutOutcome::AlreadyExists) => {
                    self.adopt(key, &object, staged).await?;
                    continue;
                }
                None => {
                    // Shutting down while the store fails: the finished file is dropped, and
                    // nothing of the partition is written or committed after it (a later flush
                    // would otherwise take the range for skipped records only and commit past
                    // it); the records are read again by whoever owns the partition next.
                    part.stopped = true;
                    return Ok(());
                }
            }
            self.commit(key).await;
        }
    }

    /// Writes the partition's dead letters from offset `first` (ingested at `ingest_ts`) as an
    /// object named after that offset. When the object exists (written before a crash, or by
    /// the partition's previous owner, with a range that may end elsewhere than ours), it holds
    /// every dead letter up to its last line: those are dropped (also when they arrive later,
    /// and the range closes only past that line) and the rest go on to the next object of the
    /// chain. Store errors are retried. `false` when shutdown interrupted the retries (the dead
    /// letters stay), or when the object holds other messages at the same offsets (the
    /// partition stops, see [`Worker::landing_conflict`]).
    pub(super) async fn write_dead_letters(
        &mut self,
        key: &PartKey,
        first: i64,
        ingest_ts: i64,
    ) -> anyhow::Result<bool> {
        let Some(part) = self.parts.get(key) else {
            return Ok(false);
        };
        let stream = part.def.name.clone();
        let object = parquet_file::dead_letter_key(
            &self.config.key_prefix,
            &stream,
            ingest_ts,
            part.partition,
            first,
        );
        let data = bytes::Bytes::copy_from_slice(part.dead.text());
        let put = self
            .with_retry(&object, || self.store.put_if_absent(&object, data.clone()))
            .await;
        let adopted = match put {
            None => return Ok(false),
            Some(PutOutcome::Created) => {
                tracing::info!(object, "wrote dead letters");
                (None, data)
            }
            Some(PutOutcome::AlreadyExists) => {
                let Some(existing) = self.with_retry(&object, || self.store.get(&object)).await
                else {
                    return Ok(false);
                };
                let existing =
                    existing.context("dead-letter object vanished after a conflicting create")?;
                let theirs = partition::dead_letter_ids(&existing)
                    .and_then(|ids| Ok((partition::last_dead_letter(&ids)?, ids)));
                let (last, theirs) = match theirs {
                    Ok(theirs) => theirs,
                    Err(e) => {
                        self.landing_conflict(key, &object, Conflict::Unreadable(e));
                        return Ok(false);
                    }
                };
                let ours = partition::dead_letter_ids(&data)?;
                let differ = parquet_file::other_messages(&ours, &theirs);
                if let Some(&first) = differ.first() {
                    self.landing_conflict(key, &object, Conflict::OtherMessages(first));
                    return Ok(false);
                }
                tracing::info!(object, last_offset = last, "adopted existing dead letters");
                ::metrics::counter!(m::ADOPTED_DEAD_LETTERS, "stream" => stream).increment(1);
                self.stats
                    .adopted_dead_letter_objects
                    .fetch_add(1, Ordering::Relaxed);
                (Some(last), existing)
            }
        };
        let (adopted, content) = adopted;
        if self.tables.is_some() && !self.land_dead_letter_twin(key, &object, &content).await? {
            return Ok(false);
        }
        if let Some(part) = self.parts.get_mut(key) {
            match adopted {
                // All of them are in the new object.
                None => part.dead = partition::DeadLetters::default(),
                Some(last) => part.adopt_dead_letters_through(last),
            }
        }
        Ok(true)
    }

    /// With `[table]`: writes the Parquet twin of the dead-letter object at `object` (holding
    /// `content`) for the dead-letter table, unless it exists, and has it appended with the
    /// next commit. `false` as [`Worker::write_dead_letters`].
    async fn land_dead_letter_twin(
        &mut self,
        key: &PartKey,
        object: &str,
        content: &bytes::Bytes,
    ) -> anyhow::Result<bool> {
        let Some(part) = self.parts.get(key) else {
            return Ok(false);
        };
        let prefix = &self.config.key_prefix;
        let twin = table::dead_letters::twin_key(prefix, object)
            .with_context(|| format!("{object} is not a dead-letter key"))?;
        // Parquet and zstd: off the reactor.
        let (stream, topic, partition) =
            (part.def.name.clone(), part.topic.clone(), part.partition);
        let content = content.clone();
        let encoded = tokio::task::spawn_blocking(move || {
            table::dead_letters::encode(&stream, &topic, partition, &content)
        })
        .await?
        .with_context(|| format!("cannot encode {object} for the dead-letter table"));
        let encoded = match encoded {
            Ok(encoded) => encoded,
            Err(e) => {
                self.landing_conflict(key, object, Conflict::Unreadable(e));
                return Ok(false);
            }
        };
        let put = self
            .with_retry(&twin, || {
                self.store.put_if_absent(&twin, encoded.bytes.clone())
            })
            .await;
        let (size, stats) = match put {
            None => return Ok(false),
            Some(PutOutcome::Created) => (encoded.bytes.len() as u64, encoded.stats),
            // Written before a crash or by another sink, from the same object: its size is
            // what the table records, and its statistics are not known here.
            Some(PutOutcome::AlreadyExists) => {
                match self.with_retry(&twin, || self.store.get(&twin)).await {
                    None => return Ok(false),
                    Some(existing) => (
                        existing
                            .with_context(|| format!("{twin} vanished after a conflicting create"))?
                            .len() as u64,
                        FileStats::default(),
                    ),
                }
            }
        };
        if let (Some(tables), Some(part)) = (&mut self.tables, self.parts.get(key)) {
            tables.landed(table::Landed {
                kind: table::TableKind::DeadLetters,
                def: part.def.clone(),
                hash: part.hash_column,
                topic: part.topic.clone(),
                partition: part.partition,
                first: encoded.first,
                last: encoded.last,
                key: twin,
                rows: encoded.rows,
                size,
                stats,
                landed_at: Instant::now(),
            });
        }
        Ok(true)
    }

    /// Adopts the object another sink wrote at `object`: continues after its last offset, and
    /// the rows of `staged` past that offset go into a new open file. An object that holds
    /// other messages at the same offsets (a topic created again) is not adopted: the partition
    /// stops, and nothing is skipped.
    pub(super) async fn adopt(
        &mut self,
        key: &PartKey,
        object: &str,
        staged: Staged,
    ) -> anyhow::Result<()> {
        // Its offsets, and its first rows to compare with ours: a conflict (a topic created
        // again) differs from the first row on.
        let def = match self.parts.get(key) {
            Some(part) => part.def.clone(),
            None => anyhow::bail!("partition state vanished"),
        };
        let columns = parquet_file::row_id_columns(&def);
        let read = || self.read_pages(object, &columns, ADOPT_SAMPLE);
        let Some(existing) = self.with_retry(object, read).await else {
            // Shutting down while the store fails: the staged file is given up, and nothing of
            // the partition is committed after it (as when its upload is given up).
            if let Some(part) = self.parts.get_mut(key) {
                part.stopped = true;
            }
            return Ok(());
        };
        let (plan, pieces, size) = match existing {
            Ranged::Read(pages) => pages,
            Ranged::Gone => anyhow::bail!("{object} vanished after a conflicting create"),
            Ranged::Unreadable(e) => {
                self.landing_conflict(key, object, Conflict::Unreadable(e.into()));
                return Ok(());
            }
        };
        let targets = self.targets();
        let part = self
            .parts
            .get_mut(key)
            .context("partition state vanished")?;
        // The staged file is read once, off the reactor: the rows the object accounts for are
        // compared with its rows, and those past it go into a new open file.
        let (staging, ratio, hash) = (
            self.staging.path().to_path_buf(),
            part.size_ratio,
            part.hash_column,
        );
        let (part_key, resume) = (part.key(), part.unwritten_from());
        let failed = move |e: parquet::errors::ParquetError, what: &str| StagingFailed {
            key: part_key.clone(),
            resume,
            error: anyhow::Error::new(e).context(what.to_owned()),
        };
        let read = tokio::task::spawn_blocking(move || {
            let adopted = (plan.offsets()?, plan.rows(), FileStats::of(plan.footer()));
            let mut theirs = Vec::new();
            for batch in plan.read(size, pieces)? {
                theirs.extend(parquet_file::row_ids_of(&def, &batch, 0..batch.num_rows())?);
            }
            theirs.sort_unstable_by_key(|id| id.offset);
            let compared = theirs.iter().map(|id| id.offset).collect();
            let after = open_file::rows_after(&def, &staged, adopted.0.last, &compared)
                .map_err(|e| failed(e, "cannot read the staged file"))?;
            let differ = parquet_file::other_messages(&after.covered_ids, &theirs);
            if !differ.is_empty() || after.batches.is_empty() {
                return Ok::<_, anyhow::Error>((adopted, differ, None, after));
            }
            let rest =
                OpenFile::create(def, hash, &staging, targets, ratio).and_then(|mut file| {
                    file.write_batches(&after.batches)?;
                    Ok(file)
                });
            let rest =
                rest.map_err(|e| failed(e, "cannot stage the rows after an adopted file"))?;
            Ok((adopted, differ, Some(rest), after))
        })
        .await?;
        let ((adopted, adopted_rows, stats), differ, rest, after) = match read {
            Ok(read) => read,
            Err(e) => match e.downcast::<StagingFailed>() {
                Ok(failed) => return Err(failed.into()),
                Err(e) => {
                    self.landing_conflict(key, object, Conflict::Unreadable(e));
                    return Ok(());
                }
            },
        };
        if let Some(&first) = differ.first() {
            self.landing_conflict(key, object, Conflict::OtherMessages(first));
            return Ok(());
        }
        tracing::info!(
            object,
            last_offset = adopted.last,
            "adopted existing landing file"
        );
        let part = self
            .parts
            .get_mut(key)
            .context("partition state vanished")?;
        ::metrics::counter!(m::ADOPTED_FILES, "stream" => part.def.name.clone()).increment(1);
        self.stats.adopted_files.fetch_add(1, Ordering::Relaxed);
        self.stats.count_adopted(part, after.covered);
        // The object reaches past what the partition has read: the records up to its end are
        // skipped as they come, so its rows there go into the dedupe window now (the window was
        // warmed only with rows before where the partition is read from).
        let unread = part.next_offset.filter(|&next| next <= adopted.last);
        part.adopt_through(adopted.last, after.first_ingest_ts);
        part.file = rest;
        if let Some(next) = unread {
            let want = (adopted.last + 1 - next) as usize;
            let def = self.parts.get(key).map(|p| p.def.clone());
            let read = match def {
                Some(def) => {
                    self.newest_hashes(&def, object, want, adopted.last + 1)
                        .await
                }
                None => anyhow::Ok(Ranged::Gone),
            };
            match read {
                Ok(Ranged::Read(hashes)) => {
                    if let Some(part) = self.parts.get_mut(key) {
                        for h in hashes {
                            part.window.insert(digest(&h), 0);
                        }
                    }
                }
                Ok(_) | Err(_) => tracing::warn!(
                    object,
                    "cannot read the content hashes of an adopted file's rows past what the partition has read; a re-sent copy of one of them may land again"
                ),
            }
        }
        let landed = self.landed_file(key, object, adopted, (adopted_rows, size), stats);
        if let (Some(tables), Some(landed)) = (&mut self.tables, landed) {
            tables.landed(landed);
        }
        Ok(())
    }

    /// An object at a key of the partition holds other messages at the same offsets (a topic
    /// deleted and created again while the landing zone kept its files), or cannot be read as
    /// what the sink writes there: the partition stops rather than skip its messages as written
    /// (or, before, stop the whole sink, and every restart with it).
    pub(super) fn landing_conflict(&mut self, key: &PartKey, object: &str, conflict: Conflict) {
        match conflict {
            Conflict::OtherMessages(first_offset) => tracing::error!(
                object,
                first_offset,
                "the object at this key holds other messages than the partition has at the same offsets (was the topic deleted and created again?): the partition stops here and nothing of it is committed; move the old objects away and restart the sink"
            ),
            Conflict::Unreadable(e) => tracing::error!(
                object,
                error = %format!("{e:#}"),
                "the object at this key cannot be read as a landing file or dead letters: the partition stops here and nothing of it is committed; move the object away and restart the sink"
            ),
        }
        self.stats.landing_conflicts.fetch_add(1, Ordering::Relaxed);
        if let Some(part) = self.parts.get_mut(key) {
            ::metrics::counter!(m::LANDING_CONFLICTS, "stream" => part.def.name.clone())
                .increment(1);
            part.stopped = true;
        }
    }

    /// Runs a store request (a write, or the read of an object to adopt) until it succeeds;
    /// `None` when shutdown interrupted the retries.
    pub(super) async fn with_retry<T, F, Fut>(&self, object: &str, mut write: F) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        if self.shutdown.is_cancelled() && self.store_given_up.load(Ordering::Relaxed) {
            return None;
        }
        let mut attempt = 0;
        loop {
            let result = write().await;
            self.stats
                .store_failing
                .store(result.is_err(), Ordering::Relaxed);
            match result {
                Ok(outcome) => return Some(outcome),
                Err(e) => {
                    ::metrics::counter!(m::STORE_ERRORS, "retryable" => if e.retryable { "true" } else { "false" }).increment(1);
                    tracing::warn!(object, error = %e, attempt, "store request failed");
                    tokio::select! {
                        _ = tokio::time::sleep(store::backoff(attempt)) => {}
                        _ = self.shutdown.cancelled(), if attempt >= 3 => {
                            tracing::warn!("the store fails at shutdown: what is not written yet is not tried, and is read again by the partitions' next owners");
                            self.store_given_up.store(true, Ordering::Relaxed);
                            return None;
                        }
                    }
                    attempt += 1;
                }
            }
        }
    }

    /// A file of the partition landed at `object` (written or adopted), as its table lists it.
    fn landed_file(
        &self,
        key: &PartKey,
        object: &str,
        range: parquet_file::OffsetRange,
        (rows, size): (u64, u64),
        stats: FileStats,
    ) -> Option<table::Landed> {
        self.tables.as_ref()?;
        let part = self.parts.get(key)?;
        Some(table::Landed {
            kind: table::TableKind::Stream,
            def: part.def.clone(),
            hash: part.hash_column,
            topic: part.topic.clone(),
            partition: part.partition,
            first: range.first,
            last: range.last,
            key: object.to_owned(),
            rows,
            size,
            stats,
            landed_at: Instant::now(),
        })
    }

    /// Appends the landed files to their tables, then commits the offsets of the partitions
    /// whose files went in.
    pub(super) async fn commit_tables(&mut self) {
        let Some(tables) = &mut self.tables else {
            return;
        };
        for (topic, partition) in tables.commit().await {
            let key = (topic, partition);
            if self.parts.contains_key(&key) {
                self.commit(&key).await;
            }
        }
    }

    /// Commits the partition's next offset, no further than the range it has open (records
    /// read but not yet in an object: a table commit calls this between flushes) and, with
    /// `[table]`, no further than its oldest file not yet in its table. A failed commit is
    /// logged and retried once the partition is idle: the records are durable, and whoever
    /// reads them meanwhile adopts the existing object.
    pub(super) async fn commit(&mut self, key: &PartKey) {
        if self.commits_given_up {
            return;
        }
        let Some(part) = self.parts.get_mut(key) else {
            return;
        };
        let Some(mut next) = part.next_offset else {
            return;
        };
        if let Some(open) = &part.range_start {
            next = next.min(open.offset);
        }
        if let Some(held) = self
            .tables
            .as_ref()
            .and_then(|t| t.held_from(&part.topic, part.partition))
        {
            next = next.min(held);
            if part.committed == Some(next) {
                return;
            }
        }
        let mut list = TopicPartitionList::new();
        if let Err(e) = list.add_partition_offset(&part.topic, part.partition, Offset::Offset(next))
        {
            tracing::warn!(error = %e, "cannot build commit");
            return;
        }
        let consumer = self.consumer.clone();
        let result =
            tokio::task::spawn_blocking(move || consumer.commit(&list, CommitMode::Sync)).await;
        match result {
            Ok(Ok(())) => {
                tracing::debug!(topic = %key.0, partition = key.1, offset = next, "committed");
                if let Some(part) = self.parts.get_mut(key) {
                    part.committed = Some(next);
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(topic = %key.0, partition = key.1, error = %e, "offset commit failed; retried when the partition is idle");
                if self.shutdown.is_cancelled() {
                    tracing::warn!(
                        "offset commits fail at shutdown: the other partitions' are not tried; their records are written, and their next owners adopt them"
                    );
                    self.commits_given_up = true;
                }
                // The idle timer retries it (a broker that refuses at once is not asked every
                // tick).
                if let Some(part) = self.parts.get_mut(key) {
                    part.last_append = Instant::now();
                }
            }
            Err(e) => tracing::warn!(error = %e, "offset commit task failed"),
        }
    }
}
