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

use crate::chunk::{Chunk, Done};
use crate::metrics as m;

/// Largest chunk a line-reading source hands over at once.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// A chunk buffer's size: a full chunk and the line that closes it, so that a chunk does not
/// double its buffer to 512 KiB just past the limit (queued chunks are most of the agent's
/// memory).
const CHUNK_CAPACITY: usize = CHUNK_BYTES + CHUNK_BYTES / 8;

/// The input of one stream's pipeline.
#[derive(Clone)]
pub struct Feed {
    tx: SyncSender<Chunk>,
    stream: Arc<str>,
    /// Longest line a line-reading source takes (`batch.max_line_bytes`).
    max_line: usize,
    spares: Spares,
}

pub use crate::chunk::Spares;

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
            spares: Spares::default(),
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
    if transform.verbatim() {
        return feed_verbatim(reader, feed, consumed, take_partial_tail, done);
    }
    let mut chunk = Vec::with_capacity(CHUNK_CAPACITY);
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
            let end = memchr::memchr(b'\n', buf);
            let taken = end.map_or(buf.len(), |end| end + 1);
            if skipped > 0 || partial.len() + taken > feed.max_line {
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
            let data = std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK_CAPACITY));
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

/// [`feed_lines`] for lines taken as they are ([`Verbatim`]): the input is read straight into
/// the chunk's buffer (from the reader's inner reader, once what the reader holds is taken),
/// where the reader's buffer took it before and every line was copied from there, a copy of
/// every byte (2% of the agent's CPU on bench-agent's file, perf). Only a line that a read
/// ends in the middle of is copied, to the next chunk's start. Buffers the pipeline is done
/// with come back through the feed's [`Spares`].
fn feed_verbatim<R: Read>(
    reader: &mut BufReader<R>,
    feed: &Feed,
    mut consumed: u64,
    take_partial_tail: bool,
    mut done: impl FnMut(u64) -> Option<Done>,
) -> std::io::Result<u64> {
    let mut buf = feed.spares.take(CHUNK_CAPACITY);
    // `buf[..lines]` holds whole lines, `buf[lines..fill]` the start of the next.
    let (mut lines, mut fill) = (0usize, 0usize);
    // Bytes of an over-long line skipped so far (0: none is being skipped).
    let mut skipped = 0usize;
    let mut pending = 0u64;
    loop {
        if fill == buf.len() {
            // A line that fills the buffer and is not over-long yet.
            buf.resize(2 * buf.len(), 0);
        }
        // Reads fill the buffer up to a chunk's size (past it only with the start of a line
        // that is longer), and at most `max_line` bytes each: a line that lies whole in one
        // read is never over-long, so only the first line of each read is measured.
        let end = if fill < CHUNK_BYTES {
            CHUNK_BYTES
        } else {
            buf.len()
        };
        let want = (end - fill).min(feed.max_line);
        let n = match read_some(reader, &mut buf[fill..fill + want]) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        // Where the bytes of this read start that have not been looked at for a line break.
        let mut from = fill;
        fill += n;
        loop {
            let Some(first) = memchr::memchr(b'\n', &buf[from..fill]).map(|i| from + i) else {
                if skipped > 0 || fill - lines > feed.max_line {
                    // Dropped as it is read: only its length is kept.
                    skipped += fill - lines;
                    fill = lines;
                }
                break;
            };
            let len = skipped + (first + 1 - lines);
            if skipped > 0 || len > feed.max_line {
                // An over-long line that ends here: consumed, and the bytes after it move up.
                skipped = 0;
                skipped_line(feed, len, true);
                pending += len as u64;
                buf.copy_within(first + 1..fill, lines);
                fill -= first + 1 - lines;
                from = lines;
                continue;
            }
            let last = memchr::memrchr(b'\n', &buf[first..fill]).map_or(first, |i| first + i);
            pending += (last + 1 - lines) as u64;
            lines = last + 1;
            break;
        }
        let eof = n == 0;
        if eof {
            if skipped > 0 {
                // Consumed as far as it goes (see `feed_lines`).
                skipped_line(feed, skipped, false);
                pending += std::mem::take(&mut skipped) as u64;
            } else if fill > lines && take_partial_tail {
                pending += (fill - lines) as u64;
                if fill == buf.len() {
                    buf.push(b'\n');
                } else {
                    buf[fill] = b'\n';
                }
                fill += 1;
                lines = fill;
            }
        }
        // A short read: no more input for now, and the lines read so far go without waiting.
        let drained = eof || n < want;
        if pending > 0 && (fill >= CHUNK_BYTES || drained) {
            consumed += pending;
            pending = 0;
            let mut next = feed.spares.take(CHUNK_CAPACITY.max(fill - lines));
            next[..fill - lines].copy_from_slice(&buf[lines..fill]);
            let mut data = std::mem::replace(&mut buf, next);
            data.truncate(lines);
            (fill, lines) = (fill - lines, 0);
            let chunk = Chunk::recycled(data, done(consumed), feed.spares.clone());
            if feed.send_blocking(chunk).is_err() {
                return Err(std::io::Error::other(Closed));
            }
        }
        if eof {
            break;
        }
    }
    Ok(consumed)
}

/// Reads into `buf`: what `reader` holds first, then straight from its inner reader.
fn read_some<R: Read>(reader: &mut BufReader<R>, buf: &mut [u8]) -> std::io::Result<usize> {
    if reader.buffer().is_empty() {
        return reader.get_mut().read(buf);
    }
    let held = reader.buffer();
    let n = held.len().min(buf.len());
    buf[..n].copy_from_slice(&held[..n]);
    reader.consume(n);
    Ok(n)
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

    /// Whether every line goes in as it is, so that the input may be read straight into the
    /// chunk.
    fn verbatim(&self) -> bool {
        false
    }
}

impl<F: FnMut(&[u8], &mut Vec<u8>)> Transform for F {
    fn line(&mut self, line: &[u8], out: &mut Vec<u8>) {
        self(line, out)
    }
}

/// Lines as they are (NDJSON). [`feed_lines`] reads them straight into the chunk and looks for
/// line breaks only to find the last whole line of each read (and the first, to measure it),
/// where one line at a time would take a search, a copy and bookkeeping per line (about 110
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
    use std::io::{BufReader, Read};

    use proptest::prelude::*;

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
        input: impl Read,
        capacity: usize,
        take_partial_tail: bool,
        max_line: usize,
        transform: impl Transform,
    ) -> (Vec<Vec<u8>>, u64) {
        let (tx, rx) = std::sync::mpsc::sync_channel(1 << 16);
        let mut reader = BufReader::with_capacity(capacity, input);
        // The reader holds the input's start, as a reader used before may.
        std::io::BufRead::fill_buf(&mut reader).unwrap();
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

    /// A reader that hands its input out in reads of the given sizes, in turn (a pipe, or a
    /// file being written).
    struct Dribble<'a> {
        input: &'a [u8],
        sizes: Vec<usize>,
        reads: usize,
    }

    impl Read for Dribble<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let size = self.sizes[self.reads % self.sizes.len()];
            self.reads += 1;
            let n = size.min(buf.len()).min(self.input.len());
            buf[..n].copy_from_slice(&self.input[..n]);
            self.input = &self.input[n..];
            Ok(n)
        }
    }

    proptest! {
        /// Lines read straight into chunks ([`Verbatim`]) come out as the lines of the input
        /// that are not over-long, whatever sizes the reads come in and whatever the reader
        /// held first, and the same as one line at a time through the reader's buffer; the
        /// bytes consumed are the input's but for a last line without a newline that is not
        /// taken (and not over-long).
        #[test]
        fn lines_read_into_chunks_are_the_inputs_whatever_the_reads(
            lines in prop::collection::vec(
                (prop::collection::vec(any::<u8>().prop_filter("a line", |&b| b != b'\n'), 0..40), any::<bool>()),
                0..60,
            ),
            sizes in prop::collection::vec(1usize..80, 1..8),
            capacity in 1usize..100,
            max_line in 1usize..50,
            take_partial_tail in any::<bool>(),
        ) {
            // Every line but maybe the last ends with a newline.
            let n = lines.len();
            let input: Vec<u8> = lines
                .iter()
                .enumerate()
                .flat_map(|(i, (line, ends))| {
                    let newline = (*ends || i + 1 < n).then_some(b'\n');
                    line.iter().copied().chain(newline)
                })
                .collect();
            let (whole, tail) = match memchr::memrchr(b'\n', &input) {
                Some(end) => input.split_at(end + 1),
                None => input.split_at(0),
            };
            let mut expected: Vec<u8> = whole
                .split_inclusive(|&b| b == b'\n')
                .filter(|line| line.len() <= max_line)
                .flatten()
                .copied()
                .collect();
            let mut consumed = whole.len();
            if !tail.is_empty() && (take_partial_tail || tail.len() > max_line) {
                consumed += tail.len();
                if tail.len() <= max_line {
                    expected.extend_from_slice(tail);
                    expected.push(b'\n');
                }
            }
            let dribble = Dribble { input: &input, sizes: sizes.clone(), reads: 0 };
            let (runs, runs_consumed) =
                chunks(dribble, capacity, take_partial_tail, max_line, Verbatim);
            prop_assert!(runs.iter().all(|c| c.is_empty() || c.ends_with(b"\n")));
            prop_assert_eq!((runs.concat(), runs_consumed), (expected.clone(), consumed as u64));
            let dribble = Dribble { input: &input, sizes, reads: 0 };
            let one_by_one = |line: &[u8], out: &mut Vec<u8>| out.extend_from_slice(line);
            let (lines, lines_consumed) =
                chunks(dribble, capacity, take_partial_tail, max_line, one_by_one);
            prop_assert_eq!((lines.concat(), lines_consumed), (expected, consumed as u64));
        }
    }
}
