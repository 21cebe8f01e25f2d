//! `bench-table`: what a table commit costs as the table grows. For each size, a process of its
//! own builds a table of that many data files (a SQLite catalog in a temporary directory, files
//! of ten days, with column statistics as the sink's files have them), then times commits of a
//! few files each, and a commit that finds files the table holds already (a partition's next
//! owner adopting them). It reports commit time (p50, p99) and the process's peak RSS during
//! the timed commits (the peak is reset after the build), per size.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use serde::Serialize;
use sink::table::stats::{Bound, ColumnStats, FileStats};
use sink::table::{Landed, TableConfig, TableKind, Tables};

/// What one size measured.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct TableSize {
    pub files: u64,
    /// Seconds the build of the table took.
    pub build_s: f64,
    pub commits: usize,
    pub commit_p50_ms: f64,
    pub commit_p99_ms: f64,
    /// A commit of files the table holds already (found, not appended).
    pub adopt_ms: f64,
    /// Peak RSS of the process over the timed commits.
    pub rss_peak_mib: f64,
    /// Bytes of the manifests of the current snapshot, and how many.
    pub manifests: usize,
}

const TOPIC: &str = "ingest.sensor_readings";
const PARTITIONS: i32 = 16;

/// Statistics of a file of the sensor readings: bounds of ten columns.
fn stats(first: i64) -> FileStats {
    let mut columns = std::collections::HashMap::new();
    let int = |name: &str, low: i64, high: i64| {
        (
            name.to_owned(),
            ColumnStats {
                values: 400,
                nulls: Some(0),
                bytes: 1_000,
                min: Some(Bound::Int(low)),
                max: Some(Bound::Int(high)),
            },
        )
    };
    let text = |name: &str, low: &str, high: &str| {
        (
            name.to_owned(),
            ColumnStats {
                values: 400,
                nulls: Some(0),
                bytes: 800,
                min: Some(Bound::Text(low.into())),
                max: Some(Bound::Text(high.into())),
            },
        )
    };
    columns.extend([
        int("_offset", first, first + 399),
        int("_partition", 0, 0),
        int("_ingest_ts", 1_764_288_000_000_000, 1_764_288_060_000_000),
        int("ts", 1_764_288_000_000_000, 1_764_288_060_000_000),
        text("device_id", "dev-00000", "dev-00999"),
        text("sensor", "humidity", "vibration"),
        text("unit", "%", "mm/s"),
        text("quality", "bad", "good"),
    ]);
    columns.insert(
        "value".into(),
        ColumnStats {
            values: 400,
            nulls: Some(0),
            bytes: 3_200,
            min: Some(Bound::Double(-40.0)),
            max: Some(Bound::Double(120.0)),
        },
    );
    FileStats { columns }
}

/// The `n`th file of the table: 400 rows of one partition, ten days of files in all.
fn file(def: &Arc<schemas::StreamDef>, n: u64, of: u64) -> Landed {
    let partition = (n % PARTITIONS as u64) as i32;
    let first = (n / PARTITIONS as u64) as i64 * 400;
    let day = n * 10 / of.max(1);
    let date = chrono::NaiveDate::from_ymd_opt(2026, 11, 1).unwrap() + chrono::Days::new(day);
    let hour = n * 240 / of.max(1) % 24;
    Landed {
        kind: TableKind::Stream,
        def: def.clone(),
        hash: schemas::arrow::HashColumn::None,
        topic: TOPIC.into(),
        partition,
        first,
        last: first + 399,
        key: format!(
            "landing/sensor_readings/date={date}/hour={hour:02}/{TOPIC}-{partition}-{first:020}.parquet"
        ),
        rows: 400,
        size: 40_000,
        stats: stats(first),
        landed_at: Instant::now(),
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// The peak RSS of this process (VmHWM), in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))?
                .split_whitespace()
                .nth(1)?
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Builds a table of `files` files in `dir`, then times `commits` commits of `per_commit`
/// files each.
pub async fn one_size(
    dir: &Path,
    files: u64,
    commits: usize,
    per_commit: u64,
) -> anyhow::Result<TableSize> {
    let root = dir.join("zone");
    std::fs::create_dir_all(&root)?;
    let store = sink::store::ObjectStore::Local(root);
    let mut config = TableConfig::new(dir.join("catalog.db").display().to_string());
    config.commit_interval_ms = 0;
    let mut tables = Tables::open(&config, store.clone(), "landing").await?;
    let def = schemas::example_streams()
        .get("sensor_readings")
        .cloned()
        .context("no sensor_readings")?;
    let total = files + commits as u64 * per_commit;
    let started = Instant::now();
    let mut n = 0;
    while n < files {
        for _ in 0..(files - n).min(2_000) {
            tables.landed(file(&def, n, total));
            n += 1;
        }
        anyhow::ensure!(!tables.commit().await.is_empty(), "a build commit failed");
    }
    let build_s = started.elapsed().as_secs_f64();
    // The peak so far is the build's: the timed commits start from here.
    std::fs::write("/proc/self/clear_refs", "5").context("cannot reset the peak RSS")?;
    let mut times = Vec::new();
    for _ in 0..commits {
        for _ in 0..per_commit {
            tables.landed(file(&def, n, total));
            n += 1;
        }
        let at = Instant::now();
        anyhow::ensure!(!tables.commit().await.is_empty(), "a timed commit failed");
        times.push(at.elapsed().as_secs_f64() * 1e3);
    }
    // Files of the first hour, landed again by a partition's next owner: found, not appended.
    for again in 0..per_commit {
        tables.landed(file(&def, again, total));
    }
    let at = Instant::now();
    anyhow::ensure!(
        !tables.commit().await.is_empty(),
        "the adopting commit failed"
    );
    let adopt_ms = at.elapsed().as_secs_f64() * 1e3;
    let rss_peak_mib = peak_rss_mib();
    times.sort_unstable_by(f64::total_cmp);
    let listed = sink::table::current_files(&config, &store, "sensor_readings")
        .await?
        .context("no table")?;
    anyhow::ensure!(
        listed.len() as u64 == n,
        "the table lists {} files, {n} were committed",
        listed.len()
    );
    Ok(TableSize {
        files,
        build_s,
        commits,
        commit_p50_ms: percentile(&times, 0.5),
        commit_p99_ms: percentile(&times, 0.99),
        adopt_ms,
        rss_peak_mib,
        manifests: manifests_of_current(dir)?,
    })
}

/// The manifests in the table's metadata folder that the newest manifest list names.
fn manifests_of_current(dir: &Path) -> anyhow::Result<usize> {
    let metadata = dir.join("zone/landing/sensor_readings/metadata");
    let newest = std::fs::read_dir(&metadata)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("snap-"))
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .context("no manifest list")?;
    let bytes = std::fs::read(newest.path())?;
    Ok(bytes
        .windows(b"-m0.avro".len())
        .filter(|w| w == b"-m0.avro")
        .count())
}

/// Options of `bench-table`.
#[derive(Debug, Clone)]
pub struct TableBenchOptions {
    pub sizes: Vec<u64>,
    pub commits: usize,
    pub per_commit: u64,
    pub out: PathBuf,
}

/// Runs each size in a process of its own (`loadtest bench-table --one N`) and writes the
/// report.
pub async fn run(options: TableBenchOptions) -> anyhow::Result<String> {
    let exe = std::env::current_exe()?;
    let mut sizes = Vec::new();
    for &files in &options.sizes {
        eprintln!("bench-table: a table of {files} files…");
        let out = tokio::process::Command::new(&exe)
            .args(["bench-table", "--one", &files.to_string()])
            .args(["--commits", &options.commits.to_string()])
            .args(["--files-per-commit", &options.per_commit.to_string()])
            .stderr(std::process::Stdio::inherit())
            .output()
            .await?;
        anyhow::ensure!(out.status.success(), "the run of {files} files failed");
        let size: TableSize = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("the run of {files} files printed no report"))?;
        sizes.push(size);
    }
    let mut table = format!(
        "{:>9} {:>9} {:>11} {:>11} {:>10} {:>10} {:>9}\n",
        "files", "build s", "commit p50", "commit p99", "adopt ms", "peak MiB", "manifests"
    );
    for s in &sizes {
        table.push_str(&format!(
            "{:>9} {:>9.1} {:>8.1} ms {:>8.1} ms {:>10.1} {:>10.1} {:>9}\n",
            s.files,
            s.build_s,
            s.commit_p50_ms,
            s.commit_p99_ms,
            s.adopt_ms,
            s.rss_peak_mib,
            s.manifests
        ));
    }
    if let Some(parent) = options.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&options.out, serde_json::to_vec_pretty(&sizes)?)?;
    Ok(table)
}
