//! End-to-end verification: read the landing files back and compare the content hashes with
//! what was sent.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use arrow::array::{Array, FixedSizeBinaryArray};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use schemas::ContentHash;
use schemas::arrow::COL_CONTENT_HASH;

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
                let row_groups = read_file(&path, &mut landed)?;
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

/// Adds a file's content hashes to `landed`; returns its number of row groups.
fn read_file(path: &Path, landed: &mut Landed) -> anyhow::Result<usize> {
    let file = std::fs::File::open(path)?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)?;
    let row_groups = builder.metadata().num_row_groups();
    let reader = builder.build()?;
    for batch in reader {
        let batch = batch?;
        let col = batch
            .column_by_name(COL_CONTENT_HASH)
            .with_context(|| format!("{} has no {COL_CONTENT_HASH} column", path.display()))?;
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
pub fn compare(expected: &std::collections::HashSet<ContentHash>, landed: &Landed) -> Verdict {
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
