//! File and directory sources, tailed, with read positions that survive restarts, rotation and
//! truncation.
//!
//! A file is identified by (device, inode), not by name, so a file renamed by log rotation keeps
//! its position and is read to its end while the new file under the old name starts at zero. A file
//! that shrinks below its position was truncated and is read again from the start. A file renamed
//! while the agent was down is found again by inode in its directory; rotations of the log that the
//! agent never opened (two rotations while it was down, or between two polls) are found beside it
//! by name and modification time. Positions are saved (write, fsync, rename) to `positions.json` in
//! the state directory, and a position only moves past lines whose records are durable in the
//! spool: after a crash, reading resumes at the first line not yet spooled, and the dedupe window
//! drops whatever was spooled already.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::io::{BufReader, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use schemas::StreamDef;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};
use tokio_util::sync::CancellationToken;

use super::fields::{StaticFields, typed_text};
use super::{Feed, UntilStopped, Verbatim, feed_lines_with};
use crate::chunk::Done;
use crate::config::FileFormat;

/// (device, inode).
pub type FileId = (u64, u64);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Position {
    path: PathBuf,
    offset: u64,
}

/// Durable read positions of every tailed file, shared by the file sources.
#[derive(Debug)]
pub struct Positions {
    path: PathBuf,
    map: Mutex<(BTreeMap<String, Position>, bool)>,
}

fn key(id: FileId) -> String {
    format!("{}:{}", id.0, id.1)
}

/// The file id of a [`key`].
fn parse_key(k: &str) -> Option<FileId> {
    let (dev, ino) = k.split_once(':')?;
    Some((dev.parse().ok()?, ino.parse().ok()?))
}

impl Positions {
    pub fn load(state_dir: &Path) -> anyhow::Result<Positions> {
        let path = state_dir.join("positions.json");
        let map = match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::error!(file = %path.display(), error = %e, "unreadable positions file; files are read from the start (dedupe drops what was sent)");
                BTreeMap::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(anyhow::anyhow!("cannot read {}: {e}", path.display())),
        };
        Ok(Positions {
            path,
            map: Mutex::new((map, false)),
        })
    }

    /// Every saved position: the file's id, the path it was read under, the offset.
    pub(crate) fn entries(&self) -> Vec<(FileId, PathBuf, u64)> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.0
            .iter()
            .filter_map(|(k, p)| Some((parse_key(k)?, p.path.clone(), p.offset)))
            .collect()
    }

    fn get(&self, id: FileId) -> Option<u64> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.0.get(&key(id)).map(|p| p.offset)
    }

    fn set(&self, id: FileId, path: &Path, offset: u64) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.0.insert(
            key(id),
            Position {
                path: path.to_owned(),
                offset,
            },
        );
        map.1 = true;
    }

    /// Writes the positions if they changed, dropping files that no longer exist. A position
    /// whose path now holds another file follows its file to its new name (a rotation): the
    /// position may have been recorded under the old name by lines read just before the
    /// rename was seen, and dropping it then lost the renamed file's position.
    pub fn save(&self) -> std::io::Result<()> {
        let snapshot = {
            let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
            if !map.1 {
                return Ok(());
            }
            map.1 = false;
            map.0.retain(|k, p| {
                if fs::metadata(&p.path).is_ok_and(|m| key((m.dev(), m.ino())) == *k) {
                    return true;
                }
                match parse_key(k).and_then(|id| find_by_inode(&p.path, id)) {
                    Some((renamed, _)) => {
                        p.path = renamed;
                        true
                    }
                    None => false,
                }
            });
            serde_json::to_vec_pretty(&map.0).map_err(std::io::Error::other)?
        };
        let tmp = self.path.with_extension("json.tmp");
        let mut file = File::create(&tmp)?;
        std::io::Write::write_all(&mut file, &snapshot)?;
        file.sync_data()?;
        fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        Ok(())
    }
}

/// What a file source reads.
#[derive(Debug, Clone)]
pub struct FileSpec {
    pub path: PathBuf,
    pub format: FileFormat,
    pub follow: bool,
    pub suffix: Option<String>,
    pub poll: Duration,
    /// Fields filled into every record.
    pub fields: Option<StaticFields>,
}

struct Tailed {
    file: File,
    path: PathBuf,
    /// Bytes read and handed over (not necessarily durable yet).
    offset: u64,
    /// CSV: the header line's field names.
    header: Option<Vec<String>>,
    /// Renamed away by rotation (or deleted): done once read to its end.
    rotated: bool,
}

impl Tailed {
    /// A file renamed away by rotation, read from `offset` to its end.
    fn rotated(file: File, path: PathBuf, offset: u64) -> Tailed {
        Tailed {
            file,
            path,
            offset,
            header: None,
            rotated: true,
        }
    }
}

/// The file with `id` in `path`'s directory, whatever its name now (a rotated file).
fn find_by_inode(path: &Path, id: FileId) -> Option<(PathBuf, fs::Metadata)> {
    fs::read_dir(path.parent()?)
        .ok()?
        .flatten()
        .find_map(|entry| {
            let meta = entry.metadata().ok()?;
            (meta.is_file() && file_id(&meta) == id).then(|| (entry.path(), meta))
        })
}

/// Files of `spec` that were renamed away while the agent was down, with unread lines: a saved
/// position whose path now holds another file is looked up by (device, inode) in that path's
/// directory, whatever the new name (`.1`, a date suffix). Rotations made and renamed away again
/// before the agent came back are found beside them ([`missed_rotations`]).
fn rotated_while_down(spec: &FileSpec, positions: &Positions) -> HashMap<FileId, Tailed> {
    let mut found = HashMap::new();
    let mut anchors = Vec::new();
    for (id, path, offset) in positions.entries() {
        let ours = path == spec.path || path.parent() == Some(spec.path.as_path());
        if !ours || fs::metadata(&path).is_ok_and(|m| file_id(&m) == id) {
            continue;
        }
        let Some((renamed, meta)) = find_by_inode(&path, id) else {
            continue;
        };
        if let Ok(modified) = meta.modified() {
            anchors.push((path.clone(), modified));
        }
        if meta.len() > offset
            && let Ok(file) = File::open(&renamed)
        {
            tracing::info!(file = %renamed.display(), was = %path.display(), offset, "reading the rest of a file rotated while the agent was down");
            found.insert(id, Tailed::rotated(file, renamed, offset));
        }
    }
    for (path, modified) in anchors {
        let missed = missed_rotations(&path, modified, |id| {
            found.contains_key(&id) || positions.get(id).is_some()
        });
        found.extend(missed);
    }
    found
}

/// Names of compressed rotations, which are not read (logrotate's `delaycompress` keeps the
/// newest rotation plain).
const COMPRESSED: &[&str] = &[".gz", ".zst", ".xz", ".bz2", ".lz4", ".zip"];

/// Files that the log's rotation created under `original`'s name and renamed away again before
/// the agent looked (two rotations while it was down, or between two polls): in `original`'s
/// directory, named like a rotation of it (the name, then `.` or `-` and a digit:
/// `readings.ndjson.1`, `readings.ndjson-20261123`; not `readings.ndjson-errors`, which may be
/// another live log), not compressed, not `known`, and last written no earlier than
/// the agent's own rotated file (`after`), so they hold lines written after the agent's file
/// was rotated. Older rotations, from before the agent read the log, are left alone. Read from
/// the start; lines the dedupe window has seen are dropped.
fn missed_rotations(
    original: &Path,
    after: SystemTime,
    known: impl Fn(FileId) -> bool,
) -> Vec<(FileId, Tailed)> {
    let (Some(dir), Some(name)) = (original.parent(), original.file_name()) else {
        return Vec::new();
    };
    let name = name.to_string_lossy();
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let other = entry.file_name();
        let other = other.to_string_lossy();
        let rotation = other.strip_prefix(&*name).is_some_and(|rest| {
            let mut chars = rest.chars();
            matches!(chars.next(), Some('.' | '-'))
                && chars.next().is_some_and(|c| c.is_ascii_digit())
        }) && !COMPRESSED.iter().any(|c| other.ends_with(c));
        // The name first: only a rotation's name is worth a stat.
        if !rotation {
            continue;
        }
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        let id = file_id(&meta);
        if !meta.is_file()
            || meta.len() == 0
            || known(id)
            || meta.modified().map_or(true, |m| m < after)
        {
            continue;
        }
        if let Ok(file) = File::open(entry.path()) {
            tracing::warn!(file = %entry.path().display(), log = %original.display(), "reading a rotation of the log that the agent never saw (rotated twice while the agent was down or between two polls)");
            found.push((id, Tailed::rotated(file, entry.path(), 0)));
        }
    }
    found
}

pub(crate) fn file_id(m: &fs::Metadata) -> FileId {
    (m.dev(), m.ino())
}

/// The files to read now: the file itself, or the directory's matching files (oldest first).
fn listing(spec: &FileSpec) -> std::io::Result<Vec<PathBuf>> {
    let meta = match fs::metadata(&spec.path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && spec.follow => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    if !meta.is_dir() {
        return Ok(vec![spec.path.clone()]);
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(&spec.path)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.')
            || spec
                .suffix
                .as_ref()
                .is_some_and(|s| !name.ends_with(s.as_str()))
        {
            continue;
        }
        let m = entry.metadata()?;
        if m.is_file() {
            files.push((m.modified().ok(), entry.path()));
        }
    }
    files.sort();
    Ok(files.into_iter().map(|(_, p)| p).collect())
}

/// Reads the files of `spec` into `feed` until they end (or, following, until `shutdown`).
pub fn run(
    spec: &FileSpec,
    def: &Arc<StreamDef>,
    feed: &Feed,
    positions: &Arc<Positions>,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let mut open = rotated_while_down(spec, positions);
    // Rotated files read to their end, whose positions may not be saved yet (their last lines
    // not yet durable): not a missed rotation. Bounded; saved positions cover older ones.
    let mut read_out: HashSet<FileId> = HashSet::new();
    loop {
        for path in listing(spec)? {
            // A stat, not an open, for the files already being read.
            if fs::metadata(&path).is_ok_and(|m| open.contains_key(&file_id(&m))) {
                continue;
            }
            let Ok(file) = File::open(&path) else {
                continue;
            };
            let meta = file.metadata()?;
            let id = file_id(&meta);
            if open.contains_key(&id) {
                continue;
            }
            let mut offset = positions.get(id).unwrap_or(0);
            if offset > meta.len() {
                tracing::warn!(file = %path.display(), offset, size = meta.len(), "file is shorter than its read position (truncated?); reading it from the start");
                offset = 0;
            }
            open.insert(
                id,
                Tailed {
                    file,
                    path,
                    offset,
                    header: None,
                    rotated: false,
                },
            );
        }
        let mut all_done = true;
        let mut finished = Vec::new();
        let mut anchors = Vec::new();
        for (&id, t) in open.iter_mut() {
            if !t.rotated
                && fs::metadata(&t.path)
                    .map(|m| file_id(&m) != id)
                    .unwrap_or(true)
            {
                // Renamed away (rotation) or deleted. A renamed file is followed under its new
                // name, so that its saved position still finds it after a crash; either way it
                // is read to its end through the handle and then done.
                if let Some((renamed, meta)) = find_by_inode(&t.path, id) {
                    if let Ok(modified) = meta.modified() {
                        anchors.push((t.path.clone(), modified));
                    }
                    t.path = renamed;
                }
                t.rotated = true;
            }
            let size = t.file.metadata()?.len();
            if size < t.offset {
                tracing::warn!(file = %t.path.display(), "file truncated; reading it from the start");
                t.offset = 0;
                positions.set(id, &t.path, 0);
            }
            if size > t.offset {
                read_new(t, id, spec, def, feed, positions, shutdown)?;
            }
            // A file that was renamed away or deleted, and is read to its end, is done.
            let at_end = t.file.metadata()?.len() <= t.offset;
            if t.rotated && at_end {
                finished.push(id);
            } else if !at_end {
                all_done = false;
            }
        }
        for (path, modified) in anchors {
            let missed = missed_rotations(&path, modified, |id| {
                open.contains_key(&id) || read_out.contains(&id) || positions.get(id).is_some()
            });
            open.extend(missed);
        }
        if read_out.len() > 4096 {
            read_out.clear();
        }
        for id in finished {
            open.remove(&id);
            read_out.insert(id);
        }
        if !spec.follow && all_done {
            return Ok(());
        }
        if shutdown.is_cancelled() {
            return Ok(());
        }
        std::thread::sleep(spec.poll);
    }
}

fn read_new(
    t: &mut Tailed,
    id: FileId,
    spec: &FileSpec,
    def: &Arc<StreamDef>,
    feed: &Feed,
    positions: &Arc<Positions>,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    if spec.format == FileFormat::Csv && t.header.is_none() {
        let (names, len) = csv_header(&t.file)?;
        t.header = Some(names);
        t.offset = t.offset.max(len);
    }
    t.file.seek(SeekFrom::Start(t.offset))?;
    let mut reader = BufReader::with_capacity(64 * 1024, UntilStopped::new(&t.file, shutdown));
    let path = t.path.clone();
    let positions2 = positions.clone();
    let done = move |offset: u64| -> Option<Done> {
        let positions = positions2.clone();
        let path = path.clone();
        Some(Box::new(move |_| positions.set(id, &path, offset)))
    };
    let header = t.header.clone();
    let (offset, fields) = (t.offset, spec.fields.as_ref());
    let consumed = match (spec.format, header) {
        (FileFormat::Csv, Some(header)) => {
            let csv = |line: &[u8], out: &mut Vec<u8>| csv_to_json(def, &header, line, out);
            feed_lines_with(&mut reader, feed, offset, !spec.follow, done, fields, csv)
        }
        _ => feed_lines_with(
            &mut reader,
            feed,
            offset,
            !spec.follow,
            done,
            fields,
            Verbatim,
        ),
    };
    t.offset = consumed?;
    Ok(())
}

/// The field names of a CSV file's header line, and the line's length.
fn csv_header(file: &File) -> anyhow::Result<(Vec<String>, u64)> {
    // A clone shares the file offset; `read_new` seeks before reading anyway.
    let mut f = file.try_clone()?;
    f.seek(SeekFrom::Start(0))?;
    let mut line = Vec::new();
    std::io::BufRead::read_until(&mut BufReader::new(f), b'\n', &mut line)?;
    let mut record = csv::StringRecord::new();
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .from_reader(&line[..]);
    if !reader.read_record(&mut record)? {
        anyhow::bail!("CSV file has no header line");
    }
    Ok((
        record.iter().map(|s| s.trim().to_owned()).collect(),
        line.len() as u64,
    ))
}

/// Turns one CSV line into a JSON record, typing cells by the stream's fields
/// ([`typed_text`](super::fields::typed_text)). Empty cells are missing values.
pub fn csv_to_json(def: &StreamDef, header: &[String], line: &[u8], out: &mut Vec<u8>) {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .from_reader(line);
    let mut record = csv::StringRecord::new();
    if !matches!(reader.read_record(&mut record), Ok(true)) {
        out.extend_from_slice(b"\"unreadable CSV line\"");
        return;
    }
    let mut object = Map::new();
    for (name, cell) in header.iter().zip(record.iter()) {
        if cell.is_empty() {
            continue;
        }
        object.insert(name.clone(), typed_text(def, name, cell));
    }
    let _ = serde_json::to_writer(&mut *out, &Json::Object(object));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A position recorded under a file's old name follows the file when it was renamed and
    /// another file took the name; a position of a deleted file is dropped.
    #[test]
    fn saved_positions_follow_renamed_files() {
        let dir = tempfile::tempdir().unwrap();
        let live = dir.path().join("readings.ndjson");
        fs::write(&live, b"a\n").unwrap();
        let renamed_id = file_id(&fs::metadata(&live).unwrap());
        let gone = dir.path().join("gone.ndjson");
        fs::write(&gone, b"b\n").unwrap();
        let gone_id = file_id(&fs::metadata(&gone).unwrap());
        let positions = Positions::load(dir.path()).unwrap();
        positions.set(renamed_id, &live, 2);
        positions.set(gone_id, &gone, 2);
        fs::rename(&live, dir.path().join("readings.ndjson.1")).unwrap();
        fs::write(&live, b"c\n").unwrap();
        fs::remove_file(&gone).unwrap();
        positions.save().unwrap();
        let saved = Positions::load(dir.path()).unwrap().entries();
        assert_eq!(
            saved,
            vec![(renamed_id, dir.path().join("readings.ndjson.1"), 2)]
        );
    }
}
