//! End-to-end verification: read the landing files back (a local directory or S3) and compare
//! their content hashes with those of what was sent.

use std::collections::{BTreeMap, HashSet};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use arrow::array::{Array, FixedSizeBinaryArray};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::reader::ChunkReader;
use schemas::arrow::COL_CONTENT_HASH;
use schemas::{ContentHash, StreamDef};
use serde::Serialize;
use sink::config::StoreConfig;
use sink::store::ObjectStore;

/// One landing file.
#[derive(Debug, Clone)]
pub struct LandedFile {
    pub path: PathBuf,
    /// The path below the directory that was read, with `/` separators: the object key.
    pub key: String,
    pub size: u64,
    pub rows: usize,
    pub row_groups: usize,
}

/// What the landing files hold.
#[derive(Debug, Default)]
pub struct Landed {
    pub files: Vec<LandedFile>,
    pub rows: usize,
    /// How often each content hash landed.
    pub hashes: BTreeMap<ContentHash, usize>,
}

/// Reads every `.parquet` file under `dir`, leaving out hidden names (a sink's staged files are
/// in `.staging/`).
pub fn read_landing_dir(dir: &Path) -> anyhow::Result<Landed> {
    let mut landed = Landed::default();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in
            std::fs::read_dir(&d).with_context(|| format!("cannot list {}", d.display()))?
        {
            let path = entry?.path();
            if path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "parquet") {
                let rows_before = landed.rows;
                let file = std::fs::File::open(&path)
                    .with_context(|| format!("cannot open {}", path.display()))?;
                let row_groups = read_file(file, &path.display().to_string(), &mut landed)?;
                let key = path
                    .strip_prefix(dir)
                    .unwrap_or(&path)
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy())
                    .collect::<Vec<_>>()
                    .join("/");
                landed.files.push(LandedFile {
                    size: std::fs::metadata(&path)?.len(),
                    rows: landed.rows - rows_before,
                    row_groups,
                    key,
                    path,
                });
            }
        }
    }
    landed.files.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(landed)
}

/// Reads every landing file of `stream` in `store` (a local directory or S3), under the sink's
/// key prefix `prefix`: the keys `<prefix>/<stream>/…/<stream>-p<partition>-o<offset>.parquet`.
pub async fn read_landing_store(
    store: &ObjectStore,
    prefix: &str,
    stream: &str,
) -> anyhow::Result<Landed> {
    let under = format!("{}/{stream}/", prefix.trim_end_matches('/'));
    let mut keys: Vec<String> = store
        .list(&under)
        .await
        .with_context(|| format!("cannot list {under} in {}", store.describe()))?
        .into_iter()
        .filter(|k| sink::parquet_file::partition_and_offset_of(k, stream).is_some())
        .collect();
    keys.sort();
    let mut landed = Landed::default();
    for key in keys {
        let Some(data) = store
            .get(&key)
            .await
            .with_context(|| format!("cannot read {key} in {}", store.describe()))?
        else {
            // Gone since the listing: a file that is not there holds nothing.
            continue;
        };
        let rows_before = landed.rows;
        let size = data.len() as u64;
        let row_groups =
            read_file(data, &key, &mut landed).with_context(|| format!("cannot read {key}"))?;
        landed.files.push(LandedFile {
            path: PathBuf::from(&key),
            key,
            size,
            rows: landed.rows - rows_before,
            row_groups,
        });
    }
    Ok(landed)
}

/// Adds a file's content hashes to `landed`; returns its number of row groups.
fn read_file<R: ChunkReader + 'static>(
    file: R,
    name: &str,
    landed: &mut Landed,
) -> anyhow::Result<usize> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)?;
    let row_groups = builder.metadata().num_row_groups();
    // Only the hash column is decoded.
    let only_hashes = ProjectionMask::columns(builder.parquet_schema(), [COL_CONTENT_HASH]);
    let reader = builder.with_projection(only_hashes).build()?;
    for batch in reader {
        let batch = batch?;
        let col = batch
            .column_by_name(COL_CONTENT_HASH)
            .with_context(|| format!("{name} has no {COL_CONTENT_HASH} column"))?;
        let hashes = col
            .as_any()
            .downcast_ref::<FixedSizeBinaryArray>()
            .context("content hash column is not fixed-size binary")?;
        for i in 0..hashes.len() {
            let bytes: [u8; 32] = hashes.value(i).try_into()?;
            *landed.hashes.entry(ContentHash(bytes)).or_default() += 1;
        }
        landed.rows += batch.num_rows();
    }
    Ok(row_groups)
}

/// The outcome of comparing landed hashes with the expected set.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub missing: usize,
    pub duplicated: usize,
    pub unexpected: usize,
}

impl Verdict {
    pub fn exactly_once(&self) -> bool {
        *self == Verdict::default()
    }
}

/// Compares what landed with the distinct hashes that were sent.
pub fn compare(expected: &HashSet<ContentHash>, landed: &Landed) -> Verdict {
    Verdict {
        missing: expected
            .iter()
            .filter(|h| !landed.hashes.contains_key(h))
            .count(),
        duplicated: landed.hashes.values().filter(|n| **n > 1).count(),
        unexpected: landed
            .hashes
            .keys()
            .filter(|h| !expected.contains(h))
            .count(),
    }
}

/// What `loadtest verify` checks, and where.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// NDJSON files of the records that were sent (`loadtest send --save`, or an agent's input).
    pub sent: Vec<PathBuf>,
    pub def: Arc<StreamDef>,
    pub store: StoreConfig,
    /// The sink's `key_prefix`.
    pub prefix: String,
    /// How long to keep looking while records are missing (the sink may not have closed its
    /// files yet).
    pub wait: Duration,
    /// Records in the landing zone that were not sent (another producer's) do not fail the
    /// check; they are still counted.
    pub allow_unexpected: bool,
}

/// The outcome of `loadtest verify`.
#[derive(Debug, Default, Serialize)]
pub struct VerifyReport {
    /// Non-blank lines of the sent files.
    pub sent_lines: usize,
    /// Lines that are not valid records of the stream: the gateway rejects them, so they are
    /// not expected to land.
    pub invalid_lines: usize,
    /// Distinct valid records sent: each must land once.
    pub expected: usize,
    pub files: usize,
    pub rows: usize,
    /// Expected records found in no landing file.
    pub missing: usize,
    /// Records found in more than one row.
    pub duplicated: usize,
    /// Records in the landing files that were not sent.
    pub unexpected: usize,
    /// Offsets the sinks noted in the stream's dead letters as skipped at an offset gap: records
    /// Kafka no longer held when a sink read the partition (`on_offset_gap = "skip"`), which
    /// explains that many missing ones.
    pub skipped_offsets: u64,
    /// Every expected record landed once and nothing else failed the check.
    pub passed: bool,
}

/// Compares the stream's landing files with the sent records, looking again every few seconds
/// while records are missing, until `opts.wait` has passed.
pub async fn verify(opts: &VerifyOptions) -> anyhow::Result<VerifyReport> {
    let (expected, sent_lines, invalid_lines) = sent_hashes(&opts.sent, &opts.def)?;
    if let StoreConfig::Local { path } = &opts.store {
        // The store would create a missing directory; a typo should not pass as "all missing".
        anyhow::ensure!(path.is_dir(), "no landing directory at {}", path.display());
    }
    let store = ObjectStore::from_config(&opts.store).await?;
    let deadline = Instant::now() + opts.wait;
    loop {
        let landed = read_landing_store(&store, &opts.prefix, &opts.def.name).await?;
        let verdict = compare(&expected, &landed);
        if verdict.missing == 0 || Instant::now() >= deadline {
            let skipped_offsets = skipped_offsets(&store, &opts.prefix, &opts.def.name).await?;
            return Ok(VerifyReport {
                skipped_offsets,
                sent_lines,
                invalid_lines,
                expected: expected.len(),
                files: landed.files.len(),
                rows: landed.rows,
                missing: verdict.missing,
                duplicated: verdict.duplicated,
                unexpected: verdict.unexpected,
                passed: verdict.missing == 0
                    && verdict.duplicated == 0
                    && (opts.allow_unexpected || verdict.unexpected == 0),
            });
        }
        eprintln!(
            "verify: {} of {} records not landed yet ({} files), looking again",
            verdict.missing,
            expected.len(),
            landed.files.len()
        );
        tokio::time::sleep(VERIFY_POLL.min(deadline.saturating_duration_since(Instant::now())))
            .await;
    }
}

/// The offsets noted as skipped at offset gaps in the dead letters of `stream` under `prefix`.
pub async fn skipped_offsets(
    store: &ObjectStore,
    prefix: &str,
    stream: &str,
) -> anyhow::Result<u64> {
    #[derive(serde::Deserialize)]
    struct Line {
        offset: i64,
        #[serde(default)]
        skipped_through: Option<i64>,
    }
    let under = format!("{}/_dead_letters/{stream}/", prefix.trim_end_matches('/'));
    let mut skipped = 0;
    for key in store.list(&under).await? {
        let Some(data) = store.get(&key).await? else {
            continue;
        };
        for line in data.split(|&b| b == b'\n') {
            if let Ok(Line {
                offset,
                skipped_through: Some(last),
            }) = serde_json::from_slice(line)
            {
                skipped += (last - offset + 1).max(0) as u64;
            }
        }
    }
    Ok(skipped)
}

/// How often `verify` looks again while records are missing.
const VERIFY_POLL: Duration = Duration::from_secs(2);

/// The distinct content hashes of the valid records in `files`, the non-blank lines read and
/// how many of them were not valid records.
fn sent_hashes(
    files: &[PathBuf],
    def: &StreamDef,
) -> anyhow::Result<(HashSet<ContentHash>, usize, usize)> {
    let (mut hashes, mut lines, mut invalid) = (HashSet::new(), 0, 0);
    for path in files {
        let file =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        for line in std::io::BufReader::new(file).split(b'\n') {
            let line = line.with_context(|| format!("cannot read {}", path.display()))?;
            if line.trim_ascii().is_empty() {
                continue;
            }
            lines += 1;
            match schemas::check_bytes(def, &line) {
                Ok(valid) => {
                    hashes.insert(valid.hash);
                }
                Err(_) => invalid += 1,
            }
        }
    }
    Ok((hashes, lines, invalid))
}
