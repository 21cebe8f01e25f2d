//! The landing zone as Apache Iceberg tables: every file a sink lands is appended to its
//! stream's table, exactly once, in commits of many files.
//!
//! A table's current snapshot carries each Kafka partition's next offset
//! ([`metadata::OFFSETS_PROPERTY`]): the offset after the last one its files account for. A
//! partition's files form a chain of consecutive offset ranges, each at a key named after its
//! first offset, and whoever reads the partition again arrives at the same files (it adopts
//! them). So a file is in the table exactly when its range ends before that next offset: an
//! append takes, of the files landed since the last, those whose range starts at or past it,
//! in chain order, and moves it past them. The append is built on one version of the table's
//! metadata and committed by the catalog only onto that version ([`catalog::Catalog::commit`]);
//! a writer that loses the race reads the new version and filters again. Kafka offsets are
//! committed only up to the first file not yet in the table, so a sink that dies between
//! landing and appending leaves its files to the partition's next owner, who adopts and
//! appends them, and a sink that dies between appending and committing the offset leaves the
//! next owner files that the table already has.

pub mod catalog;
pub mod compact;
pub mod config;
pub mod dead_letters;
mod lookup;
pub mod metadata;
pub mod rest;
pub mod stats;

pub use config::{CompactionConfig, Partitioning, TableConfig};

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use schemas::StreamDef;
use schemas::arrow::HashColumn;

use crate::metrics as m;
use crate::store::ObjectStore;

/// Which table a landed file goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableKind {
    /// Its stream's: a landing file.
    Stream,
    /// [`dead_letters::TABLE`]: the Parquet twin of a dead-letter object.
    DeadLetters,
}

/// A file landed (written, or adopted from an earlier writer) and not yet known to be in its
/// table.
#[derive(Debug, Clone)]
pub struct Landed {
    pub kind: TableKind,
    pub def: Arc<StreamDef>,
    pub hash: HashColumn,
    pub topic: String,
    pub partition: i32,
    /// The offsets the file accounts for.
    pub first: i64,
    pub last: i64,
    pub key: String,
    pub rows: u64,
    pub size: u64,
    /// Its columns' statistics, from its footer.
    pub stats: stats::FileStats,
    pub landed_at: Instant,
}

impl Landed {
    /// The name of its table in the namespace.
    pub fn table(&self) -> &str {
        match self.kind {
            TableKind::Stream => &self.def.name,
            TableKind::DeadLetters => dead_letters::TABLE,
        }
    }
}

/// The sink's side of its tables: the files landed since the last commit, and the commit.
pub struct Tables {
    catalog: catalog::Catalog,
    store: ObjectStore,
    config: TableConfig,
    key_prefix: String,
    pending: Vec<Landed>,
    last_commit: Instant,
}

/// What a commit of one stream's files found.
#[derive(Debug, Default)]
struct Outcome {
    /// Pending files now known to be in the table (appended, or found there).
    done: Vec<usize>,
    /// Files whose range straddles the table's next offset of their partition.
    straddling: Vec<usize>,
    /// Files whose range ends before it, which the table does not list.
    unlisted: Vec<usize>,
}

impl Tables {
    pub async fn open(
        config: &TableConfig,
        store: ObjectStore,
        key_prefix: &str,
    ) -> anyhow::Result<Tables> {
        let catalog = catalog::Catalog::open(config).await?;
        catalog.create_namespace(&config.namespace).await?;
        Ok(Tables {
            catalog,
            store,
            config: config.clone(),
            key_prefix: key_prefix.to_owned(),
            pending: Vec::new(),
            last_commit: Instant::now(),
        })
    }

    /// A file landed: it goes into the next commit. A file already waiting (a partition that
    /// came back to this sink before the commit, whose file was adopted again) waits once.
    pub fn landed(&mut self, file: Landed) {
        if !self.pending.iter().any(|f| f.key == file.key) {
            self.pending.push(file);
        }
    }

    /// The first offset of the partition's oldest file not yet in its table: Kafka offsets of
    /// the partition are committed no further.
    pub fn held_from(&self, topic: &str, partition: i32) -> Option<i64> {
        self.pending
            .iter()
            .filter(|f| f.partition == partition && f.topic == topic)
            .map(|f| f.first)
            .min()
    }

    /// Whether a commit is due: files wait and the interval has passed.
    pub fn due(&self) -> bool {
        !self.pending.is_empty()
            && self.last_commit.elapsed() >= Duration::from_millis(self.config.commit_interval_ms)
    }

    /// Reports the age of the oldest file waiting, per stream.
    pub fn report_lag(&self) {
        let mut oldest: BTreeMap<&str, Instant> = BTreeMap::new();
        for f in &self.pending {
            let at = oldest.entry(f.table()).or_insert(f.landed_at);
            *at = (*at).min(f.landed_at);
        }
        for (stream, at) in oldest {
            ::metrics::gauge!(m::TABLE_COMMIT_LAG, "stream" => stream.to_owned())
                .set(at.elapsed().as_secs_f64());
        }
    }

    /// Appends every waiting file to its stream's table. The partitions `(topic, partition)`
    /// whose waiting files changed (their Kafka offsets may move on) are returned, also when
    /// some stream's commit failed (it is retried at the next one).
    pub async fn commit(&mut self) -> Vec<(String, i32)> {
        self.last_commit = Instant::now();
        let mut streams: Vec<String> = self.pending.iter().map(|f| f.table().to_owned()).collect();
        streams.sort_unstable();
        streams.dedup();
        let mut finished = Vec::new();
        for stream in streams {
            let started = Instant::now();
            let result = self.commit_stream(&stream).await;
            ::metrics::histogram!(m::TABLE_COMMIT_DURATION).record(started.elapsed().as_secs_f64());
            match result {
                Ok(outcome) => {
                    let held = [
                        (
                            &outcome.unlisted,
                            "the table's offsets say it holds this file's range, but neither lists the file nor holds a file whose offset bounds cover its range (was the topic deleted and created again while the table kept the old one, or were the file's rows deleted from the table?): the file is not appended and the partition's offsets are not committed past it; give the stream a new table or namespace and restart the sink",
                        ),
                        (
                            &outcome.straddling,
                            "a landed file starts before the table's next offset of its partition and ends past it: it is not appended (its rows before that offset are in the table already), and the partition's offsets are not committed past it; move the file away and restart the sink",
                        ),
                    ];
                    for (files, why) in held {
                        for &i in files {
                            let f = &self.pending[i];
                            tracing::error!(
                                stream,
                                partition = f.partition,
                                first_offset = f.first,
                                last_offset = f.last,
                                object = f.key,
                                "{why}"
                            );
                        }
                    }
                    let mut index = 0;
                    self.pending.retain(|f| {
                        let done = outcome.done.contains(&index);
                        index += 1;
                        if done {
                            finished.push((f.topic.clone(), f.partition));
                        }
                        !done
                    });
                    ::metrics::gauge!(m::TABLE_COMMIT_LAG, "stream" => stream.clone()).set(0.0);
                }
                Err(e) => {
                    ::metrics::counter!(m::TABLE_COMMITS, "stream" => stream.clone(), "result" => "failed").increment(1);
                    tracing::warn!(stream, error = %format!("{e:#}"), "table commit failed; retried at the next commit");
                }
            }
        }
        self.report_lag();
        finished.sort_unstable();
        finished.dedup();
        finished
    }

    /// The table's current version, the table created first when the catalog has none of
    /// that name.
    async fn load_or_create(&self, file: &Landed) -> anyhow::Result<catalog::Version> {
        let ns = &self.config.namespace;
        let name = file.table();
        loop {
            if let Some(version) = self.catalog.load(&self.store, ns, name).await? {
                return Ok(version);
            }
            let (location, metadata) = match file.kind {
                TableKind::Stream => {
                    let location = self.store.uri(&format!("{}/{name}", self.key_prefix));
                    let metadata =
                        metadata::create(&file.def, file.hash, &location, self.config.partition)?;
                    (location, metadata)
                }
                TableKind::DeadLetters => {
                    let location =
                        self.store
                            .uri(&format!("{}/{}", self.key_prefix, dead_letters::LOCATION));
                    let metadata = dead_letters::create(&location)?;
                    (location, metadata)
                }
            };
            let path = format!(
                "{location}/metadata/00000-{}.metadata.json",
                uuid::Uuid::new_v4()
            );
            let key = self.store.key_of(&path).context("table location")?;
            self.store
                .put_if_absent(&key, bytes::Bytes::from(serde_json::to_vec(&metadata)?))
                .await?;
            if self.catalog.register(ns, name, &path).await? {
                tracing::info!(table = %format!("{ns}.{name}"), location, "created table");
            }
        }
    }

    async fn commit_stream(&self, stream: &str) -> anyhow::Result<Outcome> {
        let mine: Vec<usize> = (0..self.pending.len())
            .filter(|&i| self.pending[i].table() == stream)
            .collect();
        let Some(&first) = mine.first() else {
            return Ok(Outcome::default());
        };
        let first = &self.pending[first];
        // The newest definition among a stream's files: the table takes its columns.
        let newest = mine
            .iter()
            .map(|&i| &self.pending[i])
            .filter(|f| f.kind == TableKind::Stream)
            .max_by_key(|f| f.def.version)
            .map(|f| (f.def.clone(), f.hash));
        loop {
            let base = self.load_or_create(first).await?;
            let mut table = base.metadata.clone();
            if let Some(newest) = &newest
                && let Some(evolved) = metadata::evolved(&table, &newest.0, newest.1)?
            {
                tracing::info!(
                    stream,
                    version = newest.0.version,
                    "the table takes the columns of a newer definition"
                );
                table = evolved;
            }
            let mut offsets = metadata::offsets(&table)?;
            let mut outcome = Outcome::default();
            let mut added = Vec::new();
            // Files the offsets say the table has (rare: after a crash or a rebalance) are
            // looked up in it: one it does not hold means the table's offsets are not this
            // topic's (a topic created again) or the files of the partition do not line up.
            let below: Vec<usize> = mine
                .iter()
                .copied()
                .filter(|&i| {
                    let f = &self.pending[i];
                    offsets
                        .get(&metadata::partition_key(&f.topic, f.partition))
                        .is_some_and(|&next| f.last < next)
                })
                .collect();
            let held = if below.is_empty() {
                Vec::new()
            } else {
                let files: Vec<&Landed> = below.iter().map(|&i| &self.pending[i]).collect();
                lookup::held(&self.store, &table, &files).await?
            };
            let mut blocked: Vec<String> = Vec::new();
            for &i in &mine {
                let f = &self.pending[i];
                let pk = metadata::partition_key(&f.topic, f.partition);
                if blocked.contains(&pk) {
                    continue;
                }
                match offsets.get(&pk).copied() {
                    Some(next) if f.last < next => {
                        let at = below.iter().position(|&b| b == i);
                        if at.is_some_and(|at| held[at]) {
                            outcome.done.push(i);
                        } else {
                            outcome.unlisted.push(i);
                            blocked.push(pk);
                        }
                    }
                    Some(next) if f.first < next => {
                        outcome.straddling.push(i);
                        blocked.push(pk);
                    }
                    _ => {
                        added.push(metadata::data_file(&table, self.store.uri(&f.key), f)?);
                        offsets.insert(pk, f.last + 1);
                        outcome.done.push(i);
                    }
                }
            }
            if added.is_empty() {
                return Ok(outcome);
            }
            let (files, records) = (
                added.len(),
                added.iter().map(|f| f.record_count()).sum::<u64>(),
            );
            let mut kept = match table.current_snapshot() {
                Some(snapshot) => {
                    metadata::manifests_of(&read_uri(&self.store, snapshot.manifest_list()).await?)?
                }
                None => Vec::new(),
            };
            let mut merged = Vec::new();
            for i in metadata::to_merge(&kept, table.default_partition_spec_id())
                .into_iter()
                .rev()
            {
                let manifest = kept.remove(i);
                let bytes = read_uri(&self.store, &manifest.manifest_path).await?;
                merged.push((manifest, bytes));
            }
            let append = metadata::append(
                &table,
                &base.location,
                (kept, merged),
                added,
                &offsets,
                &HashSet::new(),
            )
            .await?;
            for (path, bytes) in &append.files {
                let key = self.store.key_of(path).context("metadata location")?;
                self.store.put_if_absent(&key, bytes.clone()).await?;
            }
            let ns = &self.config.namespace;
            if let Some(unreferenced) = self
                .catalog
                .commit(&self.store, (ns, stream), &base, append)
                .await?
            {
                ::metrics::counter!(m::TABLE_COMMITS, "stream" => stream.to_owned(), "result" => "committed").increment(1);
                ::metrics::counter!(m::TABLE_FILES, "stream" => stream.to_owned())
                    .increment(files as u64);
                ::metrics::counter!(m::TABLE_RECORDS, "stream" => stream.to_owned())
                    .increment(records);
                tracing::debug!(stream, files, records, "committed to table");
                for path in unreferenced {
                    if let Some(key) = self.store.key_of(&path)
                        && let Err(e) = self.store.delete(&key).await
                    {
                        tracing::debug!(path, error = %e, "cannot remove a file the table no longer refers to");
                    }
                }
                return Ok(outcome);
            }
            ::metrics::counter!(m::TABLE_COMMITS, "stream" => stream.to_owned(), "result" => "conflict").increment(1);
            tracing::debug!(stream, "table changed meanwhile; building the commit again");
        }
    }
}

/// What a file of a table's snapshot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileContent {
    Data,
    /// Rows deleted from data files, by file path and position (`file_path`, `pos`).
    PositionDeletes,
    /// Rows deleted by the values of some of their columns.
    EqualityDeletes,
}

/// A data or delete file of a table's current snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableFile {
    /// Its key in the store.
    pub key: String,
    pub content: FileContent,
    pub rows: u64,
    /// When the snapshot that added it was committed (Unix milliseconds), while the table
    /// keeps that snapshot: when its rows became visible to readers.
    pub committed_ms: Option<i64>,
}

/// The data and delete files of the current snapshot of `namespace.table` in `catalog`, read
/// from its metadata, manifest list and manifests in `store` (nothing is listed); empty when
/// the table has no snapshot, `None` when the catalog has no such table.
pub async fn current_files(
    config: &TableConfig,
    store: &ObjectStore,
    table: &str,
) -> anyhow::Result<Option<Vec<TableFile>>> {
    let catalog = catalog::Catalog::open(config).await?;
    let Some(catalog::Version { metadata, .. }) =
        catalog.load(store, &config.namespace, table).await?
    else {
        return Ok(None);
    };
    let mut files = Vec::new();
    for (path, rows, added_by, content) in data_files(store, &metadata).await? {
        let key = store
            .key_of(&path)
            .with_context(|| format!("data file {path} is not in the store"))?;
        let committed_ms = metadata.snapshot_by_id(added_by).map(|s| s.timestamp_ms());
        let content = match content {
            iceberg::spec::DataContentType::Data => FileContent::Data,
            iceberg::spec::DataContentType::PositionDeletes => FileContent::PositionDeletes,
            iceberg::spec::DataContentType::EqualityDeletes => FileContent::EqualityDeletes,
        };
        files.push(TableFile {
            key,
            content,
            rows,
            committed_ms,
        });
    }
    Ok(Some(files))
}

/// The object at `uri` in `store`.
async fn read_uri(store: &ObjectStore, uri: &str) -> anyhow::Result<bytes::Bytes> {
    let key = store
        .key_of(uri)
        .with_context(|| format!("{uri} is not in this sink's store"))?;
    store
        .get(&key)
        .await?
        .with_context(|| format!("{uri} does not exist"))
}

/// The live files of the current snapshot of the table `metadata` describes: URI, rows, the
/// id of the snapshot that added each and what it holds (data or deletes).
async fn data_files(
    store: &ObjectStore,
    metadata: &iceberg::spec::TableMetadata,
) -> anyhow::Result<Vec<(String, u64, i64, iceberg::spec::DataContentType)>> {
    let Some(snapshot) = metadata.current_snapshot() else {
        return Ok(Vec::new());
    };
    let mut files = Vec::new();
    for manifest in metadata::manifests_of(&read_uri(store, snapshot.manifest_list()).await?)? {
        let bytes = read_uri(store, &manifest.manifest_path).await?;
        for entry in iceberg::spec::Manifest::parse_avro(&bytes)?
            .entries()
            .iter()
            .filter(|e| e.is_alive())
        {
            let file = entry.data_file();
            // An entry added by the manifest's own snapshot inherits its id.
            let added_by = entry.snapshot_id().unwrap_or(manifest.added_snapshot_id);
            files.push((
                file.file_path().to_owned(),
                file.record_count(),
                added_by,
                file.content_type(),
            ));
        }
    }
    Ok(files)
}
