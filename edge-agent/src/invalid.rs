//! Records a stream's pipeline skipped as invalid, kept under `invalid/<stream>.ndjson` (within
//! `spool.invalid_max_mb`) with the reason, and tried again when the stream's definition changes
//! compatibly and when the agent starts ([`crate::pipeline::Pipeline`]). So a record that only a
//! newer definition takes (a device updated before its agent's file) is not lost: before, it
//! was counted and gone.
//!
//! A try takes the file aside (`<stream>.retrying`, by rename), keeps again what still does not
//! pass, and removes the taken file once what passed is durable in the spool. A crash between
//! leaves the taken file, which the next try reads too; records it tries twice are dropped as
//! duplicates by the dedupe window.

use std::fs::File;
use std::io::{BufRead as _, BufReader, BufWriter, Write as _};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One kept record: the line as it came (text, or hex when it is not UTF-8), why it was
/// skipped, and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kept {
    pub at_ms: u64,
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line_hex: Option<String>,
}

impl Kept {
    fn new(line: &[u8], reason: &str, at_ms: u64) -> Kept {
        let (line, line_hex) = match std::str::from_utf8(line) {
            Ok(text) => (Some(text.to_owned()), None),
            Err(_) => (None, Some(hex::encode(line))),
        };
        Kept {
            at_ms,
            reason: reason.to_owned(),
            line,
            line_hex,
        }
    }

    /// The line as it came.
    pub fn bytes(&self) -> Vec<u8> {
        match (&self.line, &self.line_hex) {
            (Some(text), _) => text.as_bytes().to_vec(),
            (None, Some(hex)) => hex::decode(hex).unwrap_or_default(),
            (None, None) => Vec::new(),
        }
    }
}

/// The kept invalid records of one stream.
pub struct KeptInvalid {
    path: PathBuf,
    taken: PathBuf,
    max_bytes: u64,
    /// The file's size, as written through this.
    bytes: u64,
    out: Option<BufWriter<File>>,
    /// Written since the last [`KeptInvalid::sync`].
    dirty: bool,
}

impl KeptInvalid {
    /// The kept records of `stream` under `dir`, at most `max_bytes` of them (0: none kept).
    pub fn open(dir: &Path, stream: &str, max_bytes: u64) -> std::io::Result<KeptInvalid> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!("{stream}.ndjson"));
        let bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
        Ok(KeptInvalid {
            taken: dir.join(format!("{stream}.retrying")),
            path,
            max_bytes,
            bytes,
            out: None,
            dirty: false,
        })
    }

    /// Bytes kept.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Keeps `line`, skipped for `reason`; false when it does not fit under the limit (or
    /// cannot be written: a full disk), and it is not kept.
    pub fn keep(&mut self, line: &[u8], reason: &str, at_ms: u64) -> bool {
        let Ok(mut text) = serde_json::to_vec(&Kept::new(line, reason, at_ms)) else {
            return false;
        };
        text.push(b'\n');
        if self.bytes + text.len() as u64 > self.max_bytes {
            return false;
        }
        let written = self.writer().and_then(|out| out.write_all(&text));
        match written {
            Ok(()) => {
                self.bytes += text.len() as u64;
                self.dirty = true;
                true
            }
            Err(e) => {
                tracing::error!(file = %self.path.display(), error = %e, "cannot keep an invalid record");
                self.out = None;
                false
            }
        }
    }

    fn writer(&mut self) -> std::io::Result<&mut BufWriter<File>> {
        if self.out.is_none() {
            let file = File::options().create(true).append(true).open(&self.path)?;
            self.out = Some(BufWriter::new(file));
        }
        Ok(self.out.as_mut().expect("opened above"))
    }

    /// Makes what was kept durable (before the chunks it came in are acknowledged); whether
    /// there was anything to.
    pub fn sync(&mut self) -> std::io::Result<bool> {
        if !std::mem::take(&mut self.dirty) {
            return Ok(false);
        }
        if let Some(out) = self.out.as_mut() {
            out.flush()?;
            out.get_ref().sync_data()?;
        }
        Ok(true)
    }

    /// Whether anything is kept, or was taken by a try that did not finish.
    pub fn any(&self) -> bool {
        self.bytes > 0 || self.taken.exists()
    }

    /// Takes every kept record for a try: the file is moved aside (what is kept from now on
    /// goes to a new one), and read a record at a time with what an unfinished try left.
    /// Finish the try with [`KeptInvalid::tried`] once what passed is durable.
    pub fn take(&mut self) -> std::io::Result<Taken> {
        self.sync()?;
        self.out = None;
        if self.bytes > 0 || self.path.exists() {
            if self.taken.exists() {
                // An unfinished try: append this file's records to it.
                let mut taken = File::options().append(true).open(&self.taken)?;
                std::io::copy(&mut File::open(&self.path)?, &mut taken)?;
                taken.sync_data()?;
                std::fs::remove_file(&self.path)?;
            } else {
                std::fs::rename(&self.path, &self.taken)?;
            }
            self.bytes = 0;
        }
        let lines = File::open(&self.taken)
            .ok()
            .map(|file| BufReader::new(file).split(b'\n'));
        Ok(Taken {
            path: self.taken.clone(),
            lines,
        })
    }

    /// Ends a try: the taken records are gone (those still invalid were kept again).
    pub fn tried(&mut self) -> std::io::Result<()> {
        self.sync()?;
        match std::fs::remove_file(&self.taken) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// The records a try took, read a record at a time (so a large `invalid/` file is not held in
/// memory whole).
pub struct Taken {
    path: PathBuf,
    lines: Option<std::io::Split<BufReader<File>>>,
}

impl Iterator for Taken {
    type Item = Kept;

    fn next(&mut self) -> Option<Kept> {
        loop {
            let line = match self.lines.as_mut()?.next()? {
                Ok(line) => line,
                Err(e) => {
                    tracing::error!(file = %self.path.display(), error = %e, "cannot read the kept invalid records; the rest are tried next time");
                    self.lines = None;
                    return None;
                }
            };
            if line.trim_ascii().is_empty() {
                continue;
            }
            match serde_json::from_slice(&line) {
                Ok(k) => return Some(k),
                // A torn last line of a crash while keeping: it was not acknowledged.
                Err(e) => {
                    tracing::warn!(file = %self.path.display(), error = %e, "a kept invalid record cannot be read; left out");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_kept_within_the_limit_and_taken_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut kept = KeptInvalid::open(dir.path(), "s", 300).unwrap();
        assert!(!kept.any());
        assert!(kept.keep(b"{\"a\":1}", "field 'a' unknown", 1));
        assert!(kept.keep(b"\xff\xfe", "not UTF-8", 2));
        assert!(!kept.keep(&[b'x'; 300], "too long", 3), "past the limit");
        kept.sync().unwrap();
        assert!(kept.any());
        // A new run reads them; one kept during the try goes to a new file.
        let mut again = KeptInvalid::open(dir.path(), "s", 300).unwrap();
        let taken: Vec<Kept> = again.take().unwrap().collect();
        assert_eq!(taken.len(), 2);
        assert_eq!(taken[0].bytes(), b"{\"a\":1}");
        assert_eq!(taken[1].bytes(), b"\xff\xfe");
        assert_eq!(taken[1].reason, "not UTF-8");
        assert!(again.keep(&taken[0].bytes(), "still unknown", 4));
        // A crash before the try ended: the next take reads both files.
        again.sync().unwrap();
        let mut after_crash = KeptInvalid::open(dir.path(), "s", 300).unwrap();
        let taken: Vec<Kept> = after_crash.take().unwrap().collect();
        assert_eq!(taken.len(), 3, "{taken:?}");
        after_crash.tried().unwrap();
        assert!(!after_crash.any());
        assert_eq!(after_crash.take().unwrap().count(), 0);
    }
}
