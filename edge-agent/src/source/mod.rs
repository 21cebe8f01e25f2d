//! Sources: files and directories (tailed, with persisted positions), stdin, MQTT and a local
//! HTTP port. Each hands NDJSON chunks to the pipeline of its stream through a [`Feed`].

pub mod file;
pub mod http;
pub mod mqtt;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::sync::mpsc::{SyncSender, TrySendError};

use crate::pipeline::{Chunk, Done};

/// Largest chunk a line-reading source hands over at once.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// The input of one stream's pipeline.
#[derive(Clone)]
pub struct Feed {
    tx: SyncSender<Chunk>,
}

/// The pipeline is gone (the agent is stopping).
#[derive(Debug, thiserror::Error)]
#[error("pipeline of the stream has stopped")]
pub struct Closed;

impl Feed {
    pub fn new(tx: SyncSender<Chunk>) -> Feed {
        Feed { tx }
    }

    /// Blocking send, for source threads.
    pub fn send_blocking(&self, chunk: Chunk) -> Result<(), Closed> {
        self.tx.send(chunk).map_err(|_| Closed)
    }

    /// Send from async code: waits on the blocking pool only when the queue is full.
    pub async fn send(&self, chunk: Chunk) -> Result<(), Closed> {
        match self.tx.try_send(chunk) {
            Ok(()) => Ok(()),
            Err(TrySendError::Disconnected(_)) => Err(Closed),
            Err(TrySendError::Full(chunk)) => {
                let tx = self.tx.clone();
                tokio::task::spawn_blocking(move || tx.send(chunk).map_err(|_| Closed))
                    .await
                    .map_err(|_| Closed)?
            }
        }
    }
}

/// Feeds of every stream, by name.
pub type Feeds = BTreeMap<String, Feed>;

/// Reads lines from `reader` and hands them over in chunks: a chunk closes at [`CHUNK_BYTES`] or
/// when no more input is buffered (so a slow producer's lines are not held back). `done` makes
/// the callback of a chunk from the number of bytes consumed so far. Returns the bytes consumed.
/// A last line without a newline is taken only if `take_partial_tail`.
pub fn feed_lines<R: Read>(
    reader: &mut BufReader<R>,
    feed: &Feed,
    mut consumed: u64,
    take_partial_tail: bool,
    mut done: impl FnMut(u64) -> Option<Done>,
    mut transform: impl FnMut(&[u8], &mut Vec<u8>),
) -> std::io::Result<u64> {
    // Sized for a full chunk and the line that closes it, so that a chunk does not double its
    // buffer to 512 KiB just past the limit (queued chunks are most of the agent's memory).
    let capacity = CHUNK_BYTES + CHUNK_BYTES / 8;
    let mut chunk = Vec::with_capacity(capacity);
    let mut line = Vec::new();
    let mut pending = 0u64;
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line)?;
        let eof = n == 0;
        if n > 0 {
            if line.last() == Some(&b'\n') || take_partial_tail {
                pending += n as u64;
                transform(&line, &mut chunk);
                if chunk.last() != Some(&b'\n') {
                    chunk.push(b'\n');
                }
            } else {
                // A partial line: read it again once it is complete.
                break;
            }
        }
        let drained = eof || reader.buffer().is_empty();
        if pending > 0 && (chunk.len() >= CHUNK_BYTES || drained) {
            consumed += pending;
            pending = 0;
            let data = std::mem::replace(&mut chunk, Vec::with_capacity(capacity));
            if feed
                .send_blocking(Chunk::new(data, done(consumed)))
                .is_err()
            {
                return Err(std::io::Error::other(Closed));
            }
        }
        if eof {
            break;
        }
    }
    Ok(consumed)
}

/// Copies a line as it is (NDJSON).
pub fn verbatim(line: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(line);
}
