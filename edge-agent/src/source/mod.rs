//! Sources: files and directories (tailed, with persisted positions), stdin, MQTT and a local
//! HTTP port. Each hands NDJSON chunks to the pipeline of its stream through a [`Feed`].

pub mod fields;
pub mod file;
pub mod http;
pub mod mqtt;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::mpsc::{SyncSender, TrySendError};

use rustix::event::{PollFd, PollFlags};
use tokio_util::sync::CancellationToken;

use crate::metrics as m;
use crate::pipeline::{Chunk, Done};

/// Largest chunk a line-reading source hands over at once.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// The input of one stream's pipeline.
#[derive(Clone)]
pub struct Feed {
    tx: SyncSender<Chunk>,
    stream: Arc<str>,
    /// Longest line a line-reading source takes (`batch.max_line_bytes`).
    max_line: usize,
}

/// The pipeline is gone (the agent is stopping).
#[derive(Debug, thiserror::Error)]
#[error("pipeline of the stream has stopped")]
pub struct Closed;

/// Whether `e` is [`Closed`], as such or wrapped in an I/O error (what line readers return),
/// under any context.
pub fn pipeline_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause.is::<Closed>()
            || cause
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .is_some_and(|inner| inner.is::<Closed>())
    })
}

impl Feed {
    pub fn new(tx: SyncSender<Chunk>, stream: &str, max_line: usize) -> Feed {
        Feed {
            tx,
            stream: stream.into(),
            max_line: max_line.max(1),
        }
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

/// How long a read of a line source waits for input before it looks at the shutdown token.
const READ_TICK: rustix::event::Timespec = rustix::event::Timespec {
    tv_sec: 0,
    tv_nsec: 200_000_000,
};

/// A line source's input (a file, stdin), read only while the agent runs: once `shutdown` is
/// cancelled a read fails with [`Closed`] instead of waiting for input that may never come (a
/// pipe whose writer runs on). [`feed_lines`] hands over what it read before it reads again, so
/// nothing read is held back; only a line that the input ended in the middle of is not taken.
pub struct UntilStopped<'a, R> {
    input: R,
    shutdown: &'a CancellationToken,
}

impl<'a, R: Read + AsFd> UntilStopped<'a, R> {
    pub fn new(input: R, shutdown: &'a CancellationToken) -> Self {
        UntilStopped { input, shutdown }
    }
}

impl<R: Read + AsFd> Read for UntilStopped<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if self.shutdown.is_cancelled() {
                return Err(std::io::Error::other(Closed));
            }
            // A regular file is always readable; a pipe or terminal is waited for a tick at a
            // time. A closed pipe is readable too (the read then returns its end).
            let mut fds = [PollFd::new(&self.input, PollFlags::IN)];
            match rustix::event::poll(&mut fds, Some(&READ_TICK)) {
                Ok(0) | Err(rustix::io::Errno::INTR) => {}
                Ok(_) => return self.input.read(buf),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Reads lines from `reader` and hands them over in chunks: a chunk closes at [`CHUNK_BYTES`] or
/// when no more input is buffered (so a slow producer's lines are not held back). `done` makes
/// the callback of a chunk from the number of bytes consumed so far. Returns the bytes consumed.
/// A last line without a newline is taken only if `take_partial_tail`.
///
/// A line longer than the feed's `max_line` is skipped as it is read (never held whole: a file
/// without line breaks must not take the agent's memory), counted as discarded
/// (`line_too_long`) and consumed. One that the input ends in the middle of is consumed so far,
/// so the rest of it, once written, is read as a line of its own (and is then most likely
/// invalid JSON, counted as such).
pub fn feed_lines<R: Read>(
    reader: &mut BufReader<R>,
    feed: &Feed,
    mut consumed: u64,
    take_partial_tail: bool,
    mut done: impl FnMut(u64) -> Option<Done>,
    mut transform: impl Transform,
) -> std::io::Result<u64> {
    // Sized for a full chunk and the line that closes it, so that a chunk does not double its
    // buffer to 512 KiB just past the limit (queued chunks are most of the agent's memory).
    let capacity = CHUNK_BYTES + CHUNK_BYTES / 8;
    let mut chunk = Vec::with_capacity(capacity);
    // The start of a line that the reader's buffer ended in the middle of.
    let mut partial = Vec::new();
    // Bytes of an over-long line skipped so far (0: none is being skipped).
    let mut skipped = 0usize;
    let mut pending = 0u64;
    loop {
        // Lines are taken straight from the reader's buffer (only one split across two fills
        // is copied first), found with `memchr`'s vectorized search.
        let (taken, complete) = {
            let buf = match reader.fill_buf() {
                Ok(buf) => buf,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            // Lines that go in as they are: every whole line the buffer holds, copied at once
            // (as far as the chunk has room, and when none of them can be over-long).
            let room = CHUNK_BYTES.saturating_sub(chunk.len()).min(feed.max_line);
            let run = (transform.verbatim() && partial.is_empty() && skipped == 0)
                .then(|| memchr::memrchr(b'\n', &buf[..buf.len().min(room)]))
                .flatten();
            let end = run.or_else(|| memchr::memchr(b'\n', buf));
            let taken = end.map_or(buf.len(), |end| end + 1);
            if run.is_some() {
                chunk.extend_from_slice(&buf[..taken]);
            } else if skipped > 0 || partial.len() + taken > feed.max_line {
                // Dropped as it is read: only its length is kept.
                skipped += std::mem::take(&mut partial).len() + taken;
            } else if end.is_some() && partial.is_empty() {
                transform.line(&buf[..taken], &mut chunk);
            } else {
                partial.extend_from_slice(&buf[..taken]);
                if end.is_some() {
                    transform.line(&partial, &mut chunk);
                }
            }
            (taken, end.is_some())
        };
        reader.consume(taken);
        let eof = taken == 0;
        let line = if skipped > 0 {
            // An over-long line: consumed once it ends, or as far as it goes at the end of
            // the input; nothing of it goes into the chunk.
            if complete || eof {
                skipped_line(feed, skipped, complete);
                pending += std::mem::take(&mut skipped) as u64;
            }
            None
        } else if complete {
            // Its bytes: all in `partial` if it began in an earlier fill.
            Some(if partial.is_empty() {
                taken
            } else {
                partial.len()
            })
        } else if eof && !partial.is_empty() && take_partial_tail {
            transform.line(&partial, &mut chunk);
            Some(partial.len())
        } else {
            // At the end of the input, a partial line not taken is read again once it is
            // complete: `consumed` does not count it.
            None
        };
        if let Some(n) = line {
            partial.clear();
            pending += n as u64;
            if chunk.last() != Some(&b'\n') {
                chunk.push(b'\n');
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

/// Counts and reports a line longer than the feed's limit (`bytes` of it read; `ended`: its
/// line break was seen).
fn skipped_line(feed: &Feed, bytes: usize, ended: bool) {
    tracing::warn!(stream = %feed.stream, bytes, limit = feed.max_line, ended, "line longer than batch.max_line_bytes skipped");
    metrics::counter!(m::DISCARDED, "stream" => feed.stream.to_string(), "reason" => "line_too_long", "intentional" => "false")
        .increment(1);
}

/// [`feed_lines`] with `transform`, and with `fields` filled into each record it makes when
/// given.
pub fn feed_lines_with<R: Read>(
    reader: &mut BufReader<R>,
    feed: &Feed,
    consumed: u64,
    take_partial_tail: bool,
    done: impl FnMut(u64) -> Option<Done>,
    fields: Option<&fields::StaticFields>,
    mut transform: impl Transform,
) -> std::io::Result<u64> {
    match fields {
        None => feed_lines(reader, feed, consumed, take_partial_tail, done, transform),
        Some(fields) => feed_lines(
            reader,
            feed,
            consumed,
            take_partial_tail,
            done,
            |line: &[u8], out: &mut Vec<u8>| {
                fields.fill_line(line, out, |line, out| transform.line(line, out))
            },
        ),
    }
}

/// What a line source puts into the chunk for each line it reads: a closure of the line and the
/// chunk, or [`Verbatim`].
pub trait Transform {
    /// Appends what `line` (with its line break) becomes to `out`.
    fn line(&mut self, line: &[u8], out: &mut Vec<u8>);

    /// Whether every line goes in as it is, so that a run of whole lines may be copied at once.
    fn verbatim(&self) -> bool {
        false
    }
}

impl<F: FnMut(&[u8], &mut Vec<u8>)> Transform for F {
    fn line(&mut self, line: &[u8], out: &mut Vec<u8>) {
        self(line, out)
    }
}

/// Lines as they are (NDJSON). [`feed_lines`] copies the whole lines of each read at once
/// instead of one by one, which saves the per-line search, copy and bookkeeping (about 110
/// instructions a sensor reading, callgrind).
#[derive(Debug, Clone, Copy)]
pub struct Verbatim;

impl Transform for Verbatim {
    fn line(&mut self, line: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(line);
    }

    fn verbatim(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use std::io::BufReader;

    use super::{CHUNK_BYTES, Feed, Transform, Verbatim, feed_lines};

    /// Feeds `input` through a reader buffer of `capacity` bytes: the chunks' bytes and the
    /// bytes counted as consumed.
    fn feed(input: &[u8], capacity: usize, take_partial_tail: bool) -> (Vec<u8>, u64) {
        feed_limited(input, capacity, take_partial_tail, 1 << 20)
    }

    /// [`feed`] with lines of at most `max_line` bytes. The lines go through both ways of
    /// taking them, which must agree: [`Verbatim`]'s runs of whole lines, and a closure's one
    /// line at a time.
    fn feed_limited(
        input: &[u8],
        capacity: usize,
        take_partial_tail: bool,
        max_line: usize,
    ) -> (Vec<u8>, u64) {
        let runs = chunks(input, capacity, take_partial_tail, max_line, Verbatim);
        let one_by_one = chunks(
            input,
            capacity,
            take_partial_tail,
            max_line,
            |line: &[u8], out: &mut Vec<u8>| out.extend_from_slice(line),
        );
        let bytes = |(chunks, consumed): &(Vec<Vec<u8>>, u64)| (chunks.concat(), *consumed);
        assert_eq!(bytes(&runs), bytes(&one_by_one), "buffer of {capacity}");
        bytes(&runs)
    }

    /// The chunks `feed_lines` hands over, and the bytes it counts as consumed.
    fn chunks(
        input: &[u8],
        capacity: usize,
        take_partial_tail: bool,
        max_line: usize,
        transform: impl Transform,
    ) -> (Vec<Vec<u8>>, u64) {
        let (tx, rx) = std::sync::mpsc::sync_channel(1024);
        let mut reader = BufReader::with_capacity(capacity, input);
        let consumed = feed_lines(
            &mut reader,
            &Feed::new(tx, "s", max_line),
            0,
            take_partial_tail,
            |_| None,
            transform,
        )
        .unwrap();
        (rx.try_iter().map(|chunk| chunk.data).collect(), consumed)
    }

    /// Whole lines copied a read at once still make chunks of whole lines that close at
    /// [`CHUNK_BYTES`], never past it by more than the line that closes one.
    #[test]
    fn runs_of_lines_make_chunks_of_whole_lines_up_to_the_limit() {
        let lines: Vec<String> = (0..40_000)
            .map(|i| format!("{{\"n\":{i},\"pad\":\"{}\"}}\n", "x".repeat(i % 97)))
            .collect();
        let input = lines.concat();
        let longest = lines.iter().map(String::len).max().unwrap();
        // (A chunk also closes when a read is used up: small buffers make many chunks.)
        for capacity in [8192, 64 * 1024, 256 * 1024, 1 << 20] {
            let (chunks, consumed) = chunks(input.as_bytes(), capacity, false, 1 << 20, Verbatim);
            assert_eq!(consumed, input.len() as u64);
            assert_eq!(chunks.concat(), input.as_bytes(), "buffer of {capacity}");
            assert!(chunks.len() > input.len() / (CHUNK_BYTES + longest));
            for chunk in &chunks {
                assert!(chunk.ends_with(b"\n"), "buffer of {capacity}");
                assert!(chunk.len() < CHUNK_BYTES + longest, "{} bytes", chunk.len());
            }
        }
    }

    /// Lines longer and shorter than the reader's buffer, split across its fills anywhere, come
    /// out whole; a last line without a newline is taken (with one added) only when asked for,
    /// and is otherwise not counted as consumed, so that it is read again.
    #[test]
    fn lines_split_across_reads_come_out_whole() {
        let complete = b"{\"a\":1}\n\n{\"b\":\"a longer line than the buffer\"}\nx\n".to_vec();
        let mut torn = complete.clone();
        torn.extend_from_slice(b"{\"tail\":");
        let mut taken = torn.clone();
        taken.push(b'\n');
        // (input, take a partial last line, bytes handed over, bytes counted as consumed)
        let cases = [
            (&complete, false, &complete, complete.len()),
            (&torn, false, &complete, complete.len()),
            (&torn, true, &taken, torn.len()),
        ];
        for capacity in [1, 2, 3, 7, 16, 64, 8192] {
            for (i, (input, take, bytes, consumed)) in cases.iter().enumerate() {
                assert_eq!(
                    feed(input, capacity, *take),
                    (bytes.to_vec(), *consumed as u64),
                    "case {i}, buffer of {capacity}"
                );
            }
        }
    }

    /// A line of more than `max_line` bytes (with its line break) is skipped wherever the
    /// reader's fills cut it, and consumed: the lines around it go on. One the input ends in
    /// is consumed as far as it goes, whether or not a partial tail is taken.
    #[test]
    fn over_long_lines_are_skipped_and_consumed() {
        let long = "x".repeat(25);
        let input = format!("123456789\n{long}\nok\n{long}{long}\n\nend\n");
        let kept = "123456789\nok\n\nend\n";
        let torn = format!("ok\n{long}");
        for capacity in [1, 2, 3, 7, 10, 11, 16, 64, 8192] {
            for take in [false, true] {
                assert_eq!(
                    feed_limited(input.as_bytes(), capacity, take, 10),
                    (kept.as_bytes().to_vec(), input.len() as u64),
                    "buffer of {capacity}, take {take}"
                );
                assert_eq!(
                    feed_limited(torn.as_bytes(), capacity, take, 10),
                    (b"ok\n".to_vec(), torn.len() as u64),
                    "buffer of {capacity}, take {take}"
                );
            }
        }
    }
}
