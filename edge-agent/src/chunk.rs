//! What a source hands a stream's pipeline: chunks of NDJSON lines, each with a callback that
//! says what became of its records once they are durable (a file source saves its position,
//! MQTT sends its PUBACK, the local HTTP port answers), and the buffers coming back for a line
//! source to read into again. Sources and the pipeline both depend on this contract, not on each
//! other.

use std::sync::{Arc, Mutex};

use schemas::api::RejectedRecord;

/// Called once the chunk's records are durable or dropped on purpose.
pub type Done = Box<dyn FnOnce(ChunkOutcome) + Send>;

/// NDJSON lines from a source.
pub struct Chunk {
    pub data: Vec<u8>,
    pub done: Option<Done>,
    /// Close the open batch after this chunk (a source holding many unacknowledged messages).
    pub flush: bool,
    /// Where `data`'s buffer goes back to once the pipeline is done with it.
    pub(crate) spares: Option<Spares>,
}

impl Chunk {
    pub fn new(data: Vec<u8>, done: Option<Done>) -> Chunk {
        Chunk {
            data,
            done,
            flush: false,
            spares: None,
        }
    }

    /// A chunk whose buffer goes back to `spares` once the pipeline is done with it.
    pub fn recycled(data: Vec<u8>, done: Option<Done>, spares: Spares) -> Chunk {
        Chunk {
            spares: Some(spares),
            ..Chunk::new(data, done)
        }
    }
}

/// What became of one chunk's records.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ChunkOutcome {
    /// Valid records that were not duplicates (spooled, or dropped by a filter).
    pub accepted: usize,
    pub duplicates: usize,
    pub rejected: Vec<RejectedRecord>,
    /// The spool was full and the stream's policy dropped records of this chunk.
    pub spool_dropped: bool,
}

/// Chunk buffers that the pipeline is done with, for a line source to read into again
/// ([`feed_lines`]): reading into a buffer takes it written once already (safe Rust has no
/// read into uninitialized memory), and for a fresh buffer that first write costs about what
/// the copy it saves does.
#[derive(Clone, Default)]
pub struct Spares(Arc<Mutex<Vec<Vec<u8>>>>);

impl Spares {
    /// Buffers kept. A source waits on a full queue while the pipeline reads, and one faster
    /// than its input finds its last buffer back before it needs the next: either way a buffer
    /// comes back about when one is taken, and more than two kept would only hold memory (a
    /// chunk's worth each, for every stream, idle ones too).
    const KEEP: usize = 2;

    /// A buffer of `len` bytes: a spare one when there is one (only the part of it past its
    /// last contents is written), else a new one.
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let spare = self.0.lock().ok().and_then(|mut spares| spares.pop());
        let mut buf = spare.unwrap_or_default();
        buf.resize(len, 0);
        buf
    }

    /// Keeps `buf` for [`Spares::take`] (or frees it, when enough are kept).
    pub fn give(&self, buf: Vec<u8>) {
        if let Ok(mut spares) = self.0.lock()
            && spares.len() < Self::KEEP
        {
            spares.push(buf);
        }
    }
}
