//! End-to-end verification: read the landing files back (a local directory or S3) and compare
//! their content hashes with those of what was sent.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::reader::ChunkReader;
use schemas::arrow::META_STREAM;
use schemas::{ContentHash, StreamDef};
use serde::Serialize;
use sink::config::StoreConfig;
use sink::store::ObjectStore;

/// Percentiles of a latency, in milliseconds, over `count` values.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize)]
pub struct Latency {
    pub count: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Latency {
    /// The percentiles of `all` (milliseconds); `None` when it is empty.
    pub fn of_ms(all: &mut [f64]) -> Option<Latency> {
        if all.is_empty() {
            return None;
        }
        all.sort_unstable_by(f64::total_cmp);
        let at = |q: f64| all[((all.len() - 1) as f64 * q).round() as usize];
        Some(Latency {
            count: all.len(),
            p50: at(0.5),
            p99: at(0.99),
            max: at(1.0),
        })
    }
}

/// One landing file.
#[derive(Debug, Clone)]
pub struct LandedFile {
    pub path: PathBuf,
    /// The path below the directory that was read, with `/` separators: the object key.
    pub key: String,
    pub size: u64,
    pub rows: usize,
    pub row_groups: usize,
    /// When the file appeared under its key, where the store tells ([`ObjectStore::list_with_times`]).
    pub landed_at: Option<SystemTime>,
}

/// What the landing files hold.
#[derive(Debug, Default)]
pub struct Landed {
    pub files: Vec<LandedFile>,
    pub rows: usize,
    /// How often each content hash landed, and when first.
    pub hashes: BTreeMap<ContentHash, Copies>,
}

/// The landed copies of one record.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Copies {
    pub count: usize,
    /// When the earliest file holding it landed, in milliseconds since the Unix epoch, where
    /// the store tells.
    pub landed_ms: Option<u64>,
}

/// Reads every `.parquet` file under `dir`, leaving out hidden names (a sink's staged files are
/// in `.staging/`). Each file's rows are hashed as their stream (the file's `stream` metadata)
/// is defined in `defs`.
pub fn read_landing_dir(dir: &Path, defs: &[Arc<StreamDef>]) -> anyhow::Result<Landed> {
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
                let meta = std::fs::metadata(&path)?;
                let landed_at = sink::store::changed_at(&meta);
                let name = path.display().to_string();
                let to_read = FileToRead {
                    name: &name,
                    landed_at,
                    deleted: None,
                };
                let row_groups = read_file(file, to_read, defs, &mut landed)
                    .with_context(|| format!("cannot read {name}"))?;
                let key = path
                    .strip_prefix(dir)
                    .unwrap_or(&path)
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy())
                    .collect::<Vec<_>>()
                    .join("/");
                landed.files.push(LandedFile {
                    size: meta.len(),
                    rows: landed.rows - rows_before,
                    row_groups,
                    key,
                    path,
                    landed_at,
                });
            }
        }
    }
    landed.files.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(landed)
}

/// Reads every landing file of stream `def` in `store` (a local directory or S3), under the
/// sink's key prefix `prefix`: the keys `<prefix>/<stream>/…/<stream>-p<partition>-o<offset>.parquet`.
pub async fn read_landing_store(
    store: &ObjectStore,
    prefix: &str,
    def: &Arc<StreamDef>,
) -> anyhow::Result<Landed> {
    let stream = def.name.as_str();
    let under = format!("{}/{stream}/", prefix.trim_end_matches('/'));
    let mut keys: Vec<(String, Option<SystemTime>)> = store
        .list_with_times(&under)
        .await
        .with_context(|| format!("cannot list {under} in {}", store.describe()))?
        .into_iter()
        .filter(|(k, _)| sink::parquet_file::partition_and_offset_of(k, stream).is_some())
        .collect();
    keys.sort();
    read_keys(store, keys, def, &HashMap::new()).await
}

/// Reads the data files of the current snapshot of stream `def`'s table: the files its
/// metadata lists, without listing a folder. Fails when the catalog has no such table.
pub async fn read_table(
    store: &ObjectStore,
    table: &sink::table::TableConfig,
    def: &Arc<StreamDef>,
) -> anyhow::Result<Landed> {
    let files = sink::table::current_files(table, store, &def.name)
        .await?
        .with_context(|| {
            format!(
                "the catalog {} has no table {}.{}",
                sink::table::catalog::redact(&table.catalog),
                table.namespace,
                def.name
            )
        })?;
    // A table lists a file once per registration: a file registered twice counts its rows
    // twice, as a reader of the table would. A file's rows are visible from the commit that
    // added it: the latency is taken to then. Rows that delete files remove are not counted.
    let mut deleted: HashMap<String, HashSet<i64>> = HashMap::new();
    let mut keys = Vec::new();
    for f in files {
        match f.content {
            sink::table::FileContent::Data => {
                let visible = f
                    .committed_ms
                    .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64));
                keys.push((f.key, visible));
            }
            sink::table::FileContent::PositionDeletes => {
                read_position_deletes(store, &f.key, &mut deleted).await?;
            }
            sink::table::FileContent::EqualityDeletes => anyhow::bail!(
                "the table holds equality deletes ({}), which this check does not apply",
                f.key
            ),
        }
    }
    read_keys(store, keys, def, &deleted).await
}

/// Adds the rows a position-delete file removes (`file_path`, `pos`) to `deleted`, by the key
/// of their data file.
async fn read_position_deletes(
    store: &ObjectStore,
    key: &str,
    deleted: &mut HashMap<String, HashSet<i64>>,
) -> anyhow::Result<()> {
    use arrow::array::AsArray;
    let data = store
        .get(key)
        .await?
        .with_context(|| format!("delete file {key} does not exist"))?;
    for batch in ParquetRecordBatchReaderBuilder::try_new(data)?.build()? {
        let batch = batch?;
        let column = |name: &str| {
            batch
                .column_by_name(name)
                .with_context(|| format!("delete file {key} has no column {name}"))
        };
        let paths = arrow::compute::cast(column("file_path")?, &arrow::datatypes::DataType::Utf8)?;
        let positions = column("pos")?
            .as_primitive_opt::<arrow::datatypes::Int64Type>()
            .with_context(|| format!("delete file {key}: pos is not a long"))?
            .clone();
        for (path, pos) in paths.as_string::<i32>().iter().zip(positions.iter()) {
            let (Some(path), Some(pos)) = (path, pos) else {
                continue;
            };
            let data_key = store
                .key_of(path)
                .with_context(|| format!("delete file {key} names {path}, outside the store"))?;
            deleted.entry(data_key).or_default().insert(pos);
        }
    }
    Ok(())
}

/// Reads the landing files at `keys` (with the times they landed, where known), leaving out
/// the rows `deleted` names by key and position.
async fn read_keys(
    store: &ObjectStore,
    keys: Vec<(String, Option<SystemTime>)>,
    def: &Arc<StreamDef>,
    deleted: &HashMap<String, HashSet<i64>>,
) -> anyhow::Result<Landed> {
    let mut landed = Landed::default();
    for (key, landed_at) in keys {
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
        let file = FileToRead {
            name: &key,
            landed_at,
            deleted: deleted.get(&key),
        };
        let row_groups = read_file(data, file, std::slice::from_ref(def), &mut landed)
            .with_context(|| format!("cannot read {key}"))?;
        landed.files.push(LandedFile {
            path: PathBuf::from(&key),
            key,
            size,
            rows: landed.rows - rows_before,
            row_groups,
            landed_at,
        });
    }
    Ok(landed)
}

/// A file [`read_file`] reads: its name, when it landed (where known) and the positions of its
/// rows that a table deleted.
struct FileToRead<'a> {
    name: &'a str,
    landed_at: Option<SystemTime>,
    deleted: Option<&'a HashSet<i64>>,
}

/// Adds a file's content hashes to `landed`, computed from its rows' fields as its stream in
/// `defs` defines them (the file need not keep a `_content_hash` column); returns its number
/// of row groups. A file that names no stream in its metadata (written by another writer of a
/// table, such as Spark's compaction) is of the one stream in `defs`.
fn read_file<R: ChunkReader + 'static>(
    file: R,
    to_read: FileToRead,
    defs: &[Arc<StreamDef>],
    landed: &mut Landed,
) -> anyhow::Result<usize> {
    let FileToRead {
        name,
        landed_at,
        deleted,
    } = to_read;
    let landed_ms = landed_at.map(unix_ms);
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)?;
    let row_groups = builder.metadata().num_row_groups();
    let stream = builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .and_then(|kvs| kvs.iter().find(|kv| kv.key == META_STREAM))
        .and_then(|kv| kv.value.clone());
    let def = match (stream, defs) {
        (None, [only]) => only,
        (None, _) => anyhow::bail!("{name} names no stream in its metadata"),
        (Some(stream), defs) => defs
            .iter()
            .find(|def| def.name == stream)
            .with_context(|| {
                format!("{name} is of stream {stream:?}, which is not defined here")
            })?,
    };
    // Only the columns the hash covers are decoded.
    let schema = builder.parquet_schema();
    let hashed: Vec<&str> = def
        .hash_fields
        .iter()
        .map(|&f| def.fields[f].name.as_str())
        .filter(|name| {
            schema
                .columns()
                .iter()
                .any(|c| c.path().parts()[0] == *name)
        })
        .collect();
    let projection = ProjectionMask::columns(schema, hashed);
    let reader = builder.with_projection(projection).build()?;
    let mut position = 0i64;
    for batch in reader {
        let batch = batch?;
        let hashes = schemas::arrow::row_hashes(def, &batch, 0..batch.num_rows())?;
        let first = position;
        position += batch.num_rows() as i64;
        for (at, hash) in (first..).zip(hashes) {
            if deleted.is_some_and(|d| d.contains(&at)) {
                continue;
            }
            let copies = landed.hashes.entry(hash).or_default();
            copies.count += 1;
            copies.landed_ms = match (copies.landed_ms, landed_ms) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            landed.rows += 1;
        }
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
    verdict(expected.iter(), |h| expected.contains(h), landed)
}

fn verdict<'a>(
    expected: impl Iterator<Item = &'a ContentHash>,
    sent: impl Fn(&ContentHash) -> bool,
    landed: &Landed,
) -> Verdict {
    Verdict {
        missing: expected.filter(|h| !landed.hashes.contains_key(h)).count(),
        duplicated: landed.hashes.values().filter(|c| c.count > 1).count(),
        unexpected: landed.hashes.keys().filter(|h| !sent(h)).count(),
    }
}

/// From each expected record's first send to the landing of the first file holding it, over the
/// records that have both times; `None` when none has.
pub fn send_to_landing(
    expected: &HashMap<ContentHash, Option<u64>>,
    landed: &Landed,
) -> Option<Latency> {
    let mut all: Vec<f64> = expected
        .iter()
        .filter_map(|(h, sent)| {
            let landed = landed.hashes.get(h)?.landed_ms?;
            // Clocks a little apart (the store's and the sender's) must not make it negative.
            Some(landed.saturating_sub((*sent)?) as f64)
        })
        .collect();
    Latency::of_ms(&mut all)
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
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
    /// Check the stream's table in this catalog (its current snapshot) instead of the files
    /// under the prefix.
    pub table: Option<sink::table::TableConfig>,
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
    /// From a record's first send to the landing of the file that holds it (p50, p99 and max,
    /// milliseconds), over the landed records with a send time: `send --save` writes the times
    /// of its batches next to the records (`<file>.times`). Absent when no sent file has them.
    pub send_to_landing_ms: Option<Latency>,
    /// The records that latency is taken over.
    pub timed_records: usize,
    /// Every expected record landed once and nothing else failed the check.
    pub passed: bool,
}

/// Compares the stream's landing files with the sent records, looking again every few seconds
/// while records are missing, until `opts.wait` has passed.
pub async fn verify(opts: &VerifyOptions) -> anyhow::Result<VerifyReport> {
    let (expected, sent_lines, invalid_lines) = sent_hashes(&opts.sent, &opts.def)?;
    let timed = expected.values().filter(|t| t.is_some()).count();
    if let StoreConfig::Local { path } = &opts.store {
        // The store would create a missing directory; a typo should not pass as "all missing".
        anyhow::ensure!(path.is_dir(), "no landing directory at {}", path.display());
    }
    let store = ObjectStore::from_config(&opts.store).await?;
    let deadline = Instant::now() + opts.wait;
    loop {
        let landed = match &opts.table {
            Some(table) => read_table(&store, table, &opts.def).await?,
            None => read_landing_store(&store, &opts.prefix, &opts.def).await?,
        };
        let verdict = verdict(expected.keys(), |h| expected.contains_key(h), &landed);
        let latency = (timed > 0)
            .then(|| send_to_landing(&expected, &landed))
            .flatten();
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
                timed_records: latency.as_ref().map_or(0, |l| l.count),
                send_to_landing_ms: latency,
                passed: verdict.missing == 0
                    && verdict.duplicated == 0
                    && (opts.allow_unexpected || verdict.unexpected == 0),
            });
        }
        let so_far = latency.map_or(String::new(), |l| {
            format!(
                "; send to landing so far p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
                l.p50, l.p99, l.max
            )
        });
        eprintln!(
            "verify: {} of {} records not landed yet ({} files){so_far}, looking again",
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

/// The distinct content hashes of the valid records in `files`, each with its first send time
/// where the file's `.times` gives one, the non-blank lines read and how many of them were not
/// valid records.
fn sent_hashes(
    files: &[PathBuf],
    def: &StreamDef,
) -> anyhow::Result<(HashMap<ContentHash, Option<u64>>, usize, usize)> {
    let (mut hashes, mut lines, mut invalid) = (HashMap::new(), 0, 0);
    for path in files {
        let times = SendTimes::read(&times_path(path))?;
        let file =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let mut index = 0u64;
        for line in std::io::BufReader::new(file).split(b'\n') {
            let line = line.with_context(|| format!("cannot read {}", path.display()))?;
            if line.trim_ascii().is_empty() {
                continue;
            }
            let sent = times.at(index);
            index += 1;
            lines += 1;
            match schemas::check_bytes(def, &line) {
                Ok(valid) => {
                    let first = hashes.entry(valid.hash).or_insert(sent);
                    *first = match (*first, sent) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
                Err(_) => invalid += 1,
            }
        }
    }
    Ok((hashes, lines, invalid))
}

/// Where `send --save FILE` writes the send times of FILE's records: `FILE.times`.
pub fn times_path(saved: &Path) -> PathBuf {
    let mut name = saved.as_os_str().to_owned();
    name.push(".times");
    PathBuf::from(name)
}

/// The send times of a saved file's records, by batch: each line of a `.times` file is
/// `<first record> <records> <first attempt, ms since the Unix epoch>`, the records counted
/// from 0 over the saved file's non-blank lines.
#[derive(Debug, Default)]
pub struct SendTimes {
    /// (first record, records, sent at), sorted by first record.
    batches: Vec<(u64, u64, u64)>,
}

impl SendTimes {
    /// Reads a `.times` file; none (no file) when there is none.
    pub fn read(path: &Path) -> anyhow::Result<SendTimes> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(SendTimes::default()),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let mut batches = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let fields: Vec<u64> = line
                .split_ascii_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()
                .filter(|f: &Vec<u64>| f.len() == 3)
                .with_context(|| {
                    format!(
                        "{}:{}: expected <first record> <records> <sent ms>, found {line:?}",
                        path.display(),
                        n + 1
                    )
                })?;
            batches.push((fields[0], fields[1], fields[2]));
        }
        batches.sort_unstable();
        Ok(SendTimes { batches })
    }

    /// When the record at `index` was first sent.
    pub fn at(&self, index: u64) -> Option<u64> {
        let i = self.batches.partition_point(|b| b.0 <= index);
        let &(first, records, sent) = self.batches.get(i.checked_sub(1)?)?;
        (index < first + records).then_some(sent)
    }

    /// Writes the times of acknowledged batches, `(first record, records, sent at)`.
    pub fn write(path: &Path, mut batches: Vec<(u64, u64, u64)>) -> anyhow::Result<()> {
        batches.sort_unstable();
        let mut text = String::with_capacity(batches.len() * 32);
        for (first, records, sent) in batches {
            text.push_str(&format!("{first} {records} {sent}\n"));
        }
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_times_map_records_to_their_batch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sent.ndjson.times");
        // Batches acknowledged out of order, as concurrent senders note them.
        SendTimes::write(&path, vec![(5, 3, 2_000), (0, 5, 1_000), (10, 2, 3_000)]).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "0 5 1000\n5 3 2000\n10 2 3000\n"
        );
        let times = SendTimes::read(&path).unwrap();
        let at: Vec<Option<u64>> = (0..13).map(|i| times.at(i)).collect();
        let (a, b, c) = (Some(1_000), Some(2_000), Some(3_000));
        // Records 8 and 9 were in a batch that was refused: no time.
        assert_eq!(at, [a, a, a, a, a, b, b, b, None, None, c, c, None]);
        assert!(
            SendTimes::read(&dir.path().join("none"))
                .unwrap()
                .at(0)
                .is_none()
        );

        std::fs::write(&path, "0 5 1000\n5 x 2000\n").unwrap();
        let e = SendTimes::read(&path).unwrap_err().to_string();
        assert!(e.contains(":2: expected"), "{e}");
    }

    #[test]
    fn send_to_landing_counts_the_records_with_both_times_and_never_below_zero() {
        let h = |b: u8| ContentHash([b; 32]);
        let mut landed = Landed::default();
        let copies = |count, landed_ms| Copies { count, landed_ms };
        landed.hashes.insert(h(1), copies(1, Some(5_000)));
        landed.hashes.insert(h(2), copies(2, Some(7_000)));
        // Landed before it was sent: the clocks disagree.
        landed.hashes.insert(h(3), copies(1, Some(900)));
        landed.hashes.insert(h(4), copies(1, None));
        let expected = HashMap::from([
            (h(1), Some(1_000)),
            (h(2), Some(1_000)),
            (h(3), Some(1_000)),
            (h(4), Some(1_000)),
            (h(5), Some(1_000)),
            (h(6), None),
        ]);
        let latency = send_to_landing(&expected, &landed).unwrap();
        assert_eq!(
            (latency.count, latency.p50, latency.max),
            (3, 4_000.0, 6_000.0)
        );
        assert!(send_to_landing(&HashMap::from([(h(1), None)]), &landed).is_none());
    }
}
