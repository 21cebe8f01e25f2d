//! Batches the receiver refused for good, kept aside under `rejected/` in the state directory
//! (the body and a JSON note with the answer), within a size limit shared by all streams.
//!
//! A refused batch leaves the spool only once it is kept here durably (both files and the
//! directory fsynced). When the directory is at its limit, or the files cannot be written (a
//! full disk), the batch stays first in its stream's spool and is put aside once there is room:
//! the spool's own limit and overflow policy then apply, so the agent's disk use stays bounded
//! by `spool.max_mb` plus `spool.rejected_max_mb`, and nothing is deleted to make room.

use std::fs::{self, File};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context as _;

use crate::batch::{Batch, BatchId, BodyEncoding};
use crate::metrics as m;

/// The `rejected/` directory and its size limit.
#[derive(Debug)]
pub struct RejectedDir {
    dir: PathBuf,
    max_bytes: u64,
    /// Held from the size check to the last write, so that two streams' deliveries do not both
    /// take the last room.
    lock: Mutex<()>,
}

/// What [`RejectedDir::keep`] did with a batch.
#[derive(Debug, PartialEq, Eq)]
pub enum Kept {
    /// Kept durably; the path of its body.
    Kept(PathBuf),
    /// Not kept: the directory already holds `used` bytes, and `needed` more would pass
    /// `limit`.
    NoRoom { used: u64, needed: u64, limit: u64 },
}

impl RejectedDir {
    pub fn new(dir: PathBuf, max_bytes: u64) -> Self {
        RejectedDir {
            dir,
            max_bytes,
            lock: Mutex::new(()),
        }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Keeps a refused batch with the receiver's answer (`status`, `answer`), unless that would
    /// take the directory past its limit. A batch larger than the limit is kept when the
    /// directory is empty, so that no batch waits for ever. Fails when the files cannot be
    /// written; what was written of them is removed again.
    pub fn keep(&self, stream: &str, batch: &Batch, status: u16, answer: &str) -> io::Result<Kept> {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let note = serde_json::json!({
            "stream": stream,
            "batch": batch.id.to_string(),
            "records": batch.records,
            "raw_bytes": batch.raw_bytes,
            "created_ms": batch.created_ms,
            "content_type": batch.encoding.content_type(),
            "content_encoding": batch.encoding.content_encoding(),
            "status": status,
            "answer": answer,
        })
        .to_string();
        let base = self.dir.join(format!("{stream}-{}", batch.id));
        let (body_path, note_path) = (base.with_extension("body"), base.with_extension("json"));
        // A batch kept before a crash that came back from the spool replaces its own files.
        let used = self
            .used()?
            .saturating_sub(file_len(&body_path) + file_len(&note_path));
        let needed = (batch.body.len() + note.len()) as u64;
        if used > 0 && used + needed > self.max_bytes {
            metrics::gauge!(m::REJECTED_BYTES).set(used as f64);
            return Ok(Kept::NoRoom {
                used,
                needed,
                limit: self.max_bytes,
            });
        }
        fs::create_dir_all(&self.dir)?;
        let written = write_synced(&body_path, &batch.body)
            .and_then(|()| write_synced(&note_path, note.as_bytes()))
            .and_then(|()| File::open(&self.dir)?.sync_all());
        if let Err(e) = written {
            let _ = fs::remove_file(&body_path);
            let _ = fs::remove_file(&note_path);
            return Err(e);
        }
        metrics::gauge!(m::REJECTED_BYTES).set((used + needed) as f64);
        Ok(Kept::Kept(body_path))
    }

    /// Bytes held by the files in the directory (0 when it does not exist yet).
    pub fn used(&self) -> io::Result<u64> {
        dir_bytes(&self.dir)
    }

    /// The batches kept here (of `stream`, or of all streams), oldest first. A note without its
    /// body, or one that does not parse, is an error naming the file.
    pub fn list(&self, stream: Option<&str>) -> anyhow::Result<Vec<KeptBatch>> {
        self.list_with(stream, true)
    }

    /// [`RejectedDir::list`] of every stream without reading the bodies (each batch's `body`
    /// is left empty): what `edge-agent status` counts.
    pub fn list_notes(&self) -> anyhow::Result<Vec<KeptBatch>> {
        self.list_with(None, false)
    }

    fn list_with(&self, stream: Option<&str>, bodies: bool) -> anyhow::Result<Vec<KeptBatch>> {
        let mut kept = Vec::new();
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(kept),
            Err(e) => return Err(e.into()),
        };
        for entry in entries {
            let note = entry?.path();
            if note.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let batch = KeptBatch::read(&note, bodies)
                .with_context(|| format!("cannot read the kept batch {}", note.display()))?;
            if stream.is_none_or(|s| s == batch.stream) {
                kept.push(batch);
            }
        }
        kept.sort_by_key(|k| (k.batch.created_ms, k.note.clone()));
        Ok(kept)
    }
}

/// A batch kept under `rejected/`, read back from its note and body.
#[derive(Debug)]
pub struct KeptBatch {
    pub stream: String,
    pub batch: Batch,
    /// The receiver's answer when it refused the batch.
    pub status: u16,
    pub note: PathBuf,
    pub body: PathBuf,
}

impl KeptBatch {
    fn read(note_path: &Path, with_body: bool) -> anyhow::Result<KeptBatch> {
        let note: serde_json::Value = serde_json::from_slice(&fs::read(note_path)?)?;
        let text = |key: &str| {
            note[key]
                .as_str()
                .with_context(|| format!("the note has no '{key}'"))
        };
        let number = |key: &str| note[key].as_u64();
        let encoding = BodyEncoding::from_content_type(text("content_type")?)
            .context("unknown content_type")?;
        let mut id = [0u8; 32];
        hex::decode_to_slice(text("batch")?, &mut id)
            .context("the batch id is not 64 hex digits")?;
        let body_path = note_path.with_extension("body");
        let body = if with_body {
            fs::read(&body_path).with_context(|| format!("cannot read {}", body_path.display()))?
        } else {
            Vec::new()
        };
        let small = |key: &str| number(key).and_then(|n| u32::try_from(n).ok());
        Ok(KeptBatch {
            stream: text("stream")?.to_owned(),
            batch: Batch {
                id: BatchId(id),
                encoding,
                body,
                records: small("records").context("the note has no 'records'")?,
                // Notes written before these were kept: 0 and now.
                raw_bytes: small("raw_bytes").unwrap_or(0),
                created_ms: number("created_ms").unwrap_or_else(crate::batch::now_ms),
            },
            status: number("status")
                .and_then(|s| u16::try_from(s).ok())
                .unwrap_or(0),
            note: note_path.to_path_buf(),
            body: body_path,
        })
    }

    /// Removes the batch's files (after it went back into the spool).
    pub fn remove(&self) -> io::Result<()> {
        fs::remove_file(&self.body)?;
        fs::remove_file(&self.note)?;
        if let Some(dir) = self.note.parent() {
            File::open(dir)?.sync_all()?;
        }
        Ok(())
    }
}

/// Bytes held by the files in `dir` (0 when it does not exist).
pub fn dir_bytes(dir: &Path) -> io::Result<u64> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut total = 0;
    for entry in entries {
        let meta = entry?.metadata()?;
        if meta.is_file() {
            total += meta.len();
        }
    }
    Ok(total)
}

fn file_len(path: &Path) -> u64 {
    fs::metadata(path).map_or(0, |m| m.len())
}

fn write_synced(path: &Path, data: &[u8]) -> io::Result<()> {
    let mut file = File::create(path)?;
    file.write_all(data)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(id: u8, body_len: usize) -> Batch {
        Batch {
            id: BatchId([id; 32]),
            encoding: BodyEncoding::default(),
            body: vec![id; body_len],
            records: 3,
            raw_bytes: 300,
            created_ms: 0,
        }
    }

    #[test]
    fn keeps_batches_until_the_limit_then_waits_for_room() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = RejectedDir::new(tmp.path().join("rejected"), 10_000);
        assert_eq!(dir.used().unwrap(), 0, "no directory yet");
        let Kept::Kept(first) = dir.keep("s", &batch(1, 4_000), 400, "bad").unwrap() else {
            panic!("an empty directory takes a batch");
        };
        assert_eq!(fs::read(&first).unwrap(), vec![1; 4_000]);
        let note: serde_json::Value =
            serde_json::from_slice(&fs::read(first.with_extension("json")).unwrap()).unwrap();
        assert_eq!(
            (note["status"].as_u64(), note["records"].as_u64()),
            (Some(400), Some(3))
        );
        assert_eq!(note["answer"], "bad");
        let used = dir.used().unwrap();
        assert!(used > 4_000, "body and note: {used}");

        assert!(matches!(
            dir.keep("s", &batch(2, 4_000), 400, "bad").unwrap(),
            Kept::Kept(_)
        ));
        let third = dir.keep("s", &batch(3, 4_000), 400, "bad").unwrap();
        let Kept::NoRoom {
            used,
            needed,
            limit,
        } = third
        else {
            panic!("the third batch passes the limit: {third:?}");
        };
        assert_eq!(limit, 10_000);
        assert!(used + needed > limit && used <= limit);
        assert!(
            !tmp.path()
                .join(format!("rejected/s-{}.body", BatchId([3; 32])))
                .exists()
        );

        // The same batch again (back from the spool after a crash) replaces its own files.
        assert!(matches!(
            dir.keep("s", &batch(2, 4_000), 400, "bad").unwrap(),
            Kept::Kept(_)
        ));

        // Room made (an operator took the first batch away): the third goes aside.
        fs::remove_file(&first).unwrap();
        fs::remove_file(first.with_extension("json")).unwrap();
        assert!(matches!(
            dir.keep("s", &batch(3, 4_000), 400, "bad").unwrap(),
            Kept::Kept(_)
        ));
    }

    #[test]
    fn a_batch_larger_than_the_limit_is_kept_in_an_empty_directory_only() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = RejectedDir::new(tmp.path().join("rejected"), 1_000);
        assert!(matches!(
            dir.keep("s", &batch(1, 5_000), 413, "").unwrap(),
            Kept::Kept(_)
        ));
        assert!(matches!(
            dir.keep("s", &batch(2, 10), 413, "").unwrap(),
            Kept::NoRoom { .. }
        ));
    }

    #[test]
    fn a_failed_write_leaves_nothing_behind() {
        let tmp = tempfile::tempdir().unwrap();
        // A file where the directory should be: nothing can be written under it.
        let path = tmp.path().join("rejected");
        fs::write(&path, b"").unwrap();
        let dir = RejectedDir::new(path, 10_000);
        assert!(dir.keep("s", &batch(1, 10), 400, "").is_err());
    }
}
