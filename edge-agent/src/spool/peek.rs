//! Reading what a stream's spool holds without opening it (`edge-agent status`).

use super::*;

/// What a stream's spool holds, as [`peek`] reads it.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Peek {
    /// Batches not yet acknowledged by the receiver, their records and body bytes.
    pub batches: u64,
    pub records: u64,
    pub body_bytes: u64,
    /// When the oldest of them was closed (ms since the epoch).
    pub oldest_created_ms: Option<u64>,
    /// Bytes of the segment files.
    pub disk_bytes: u64,
    /// Bytes after the last whole entry of a segment: an append in progress, or damage that
    /// the agent's next start truncates or quarantines.
    pub unread_bytes: u64,
}

/// Reads the spool of `stream` under `root` without changing anything, also while an agent
/// appends to it and acknowledges: what waits there for delivery. Only each entry's header and
/// metadata are read (the bodies are skipped, and not checksummed), so a large spool costs a
/// few reads per batch. A segment is read up to its first region that does not start a whole
/// entry; a segment deleted meanwhile counts as empty.
pub fn peek(root: &Path, stream: &str) -> Result<Peek, SpoolError> {
    let dir = root.join(stream);
    let mut peek = Peek::default();
    if !dir.is_dir() {
        return Ok(peek);
    }
    let acked = read_acked(&dir)?;
    for (_, path) in segment_names(&dir)? {
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(&path)(e)),
        };
        let size = file.metadata().map_err(io(&path))?.len();
        peek.disk_bytes += size;
        let mut reader = std::io::BufReader::with_capacity(4096, file);
        let mut pos = 0u64;
        let mut head = [0u8; HEADER + META];
        while pos + (HEADER + META) as u64 <= size {
            reader.read_exact(&mut head).map_err(io(&path))?;
            let len = u32_at(&head, 4) as usize;
            let end = pos + (HEADER + len) as u64;
            let encoding = BodyEncoding::from_code(head[HEADER + 24]);
            if head[..4] != MAGIC
                || !(META..=MAX_PAYLOAD).contains(&len)
                || end > size
                || encoding.is_none()
            {
                break;
            }
            if u64_at(&head, HEADER) >= acked {
                let created = u64_at(&head, HEADER + 8);
                peek.batches += 1;
                peek.records += u64::from(u32_at(&head, HEADER + 16));
                peek.body_bytes += (len - META) as u64;
                peek.oldest_created_ms =
                    Some(peek.oldest_created_ms.map_or(created, |o| o.min(created)));
            }
            reader
                .seek_relative((len - META) as i64)
                .map_err(io(&path))?;
            pos = end;
        }
        peek.unread_bytes += size - pos;
    }
    Ok(peek)
}
