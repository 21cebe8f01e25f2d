//! The canonical content hash: keyed BLAKE3 over a canonical encoding of a record's hashed fields.
//!
//! The encoding works on validated, normalized values, so JSON key order, number formatting
//! (`1`, `1.0`, `1e0` in a float64 field) and timestamp notation (RFC 3339 or epoch ms/us for
//! the same instant) do not change the hash. Encoding (version 2), for each hashed field in name
//! order whose value is not null: the field name (LEB128 length + UTF-8), then the value: a tag
//! byte and a fixed-width little-endian payload; strings carry a LEB128 byte length first,
//! lists and maps a LEB128 count (map entries: key as a string without tag, then the value).
//! Null fields are left out, so adding a nullable field to a stream keeps the hashes of the
//! records that do not set it. The BLAKE3 key is derived from [`KEY_CONTEXT`] (domain
//! separation without spending input bytes: a typical sensor reading is two 64-byte blocks,
//! where version 1, with a text prefix and fixed-width lengths, took three).

use std::fmt;
use std::str::FromStr;

use crate::stream::StreamDef;
use crate::value::{Record, Scalar, Value};

mod lanes;

/// The context string of the hash key: a future change of the encoding gets a new context.
pub const KEY_CONTEXT: &str = "edge-ingest record content hash v2";

fn key() -> &'static [u8; 32] {
    static KEY: std::sync::LazyLock<[u8; 32]> =
        std::sync::LazyLock::new(|| blake3::derive_key(KEY_CONTEXT, b""));
    &KEY
}

/// The 32-byte BLAKE3 content hash of a record.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ContentHash(pub [u8; 32]);

/// Hash tables see 8 of the 32 bytes: they are uniformly distributed already, and the table's
/// keyed hasher ([`HashSetOfHashes`]) mixes them, so an attacker cannot aim at its buckets.
impl std::hash::Hash for ContentHash {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let mut head = [0u8; 8];
        head.copy_from_slice(&self.0[..8]);
        state.write_u64(u64::from_le_bytes(head));
    }
}

/// A set of content hashes with a fast, randomly keyed hasher (foldhash) instead of SipHash.
pub type HashSetOfHashes = std::collections::HashSet<ContentHash, foldhash::fast::RandomState>;

impl ContentHash {
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }
}

impl fmt::Display for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentHash({})", self.to_hex())
    }
}

impl FromStr for ContentHash {
    type Err = hex::FromHexError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out)?;
        Ok(ContentHash(out))
    }
}

/// Computes the content hash of a validated record. The canonical encoding is written to one
/// buffer and hashed in one call (the same bytes as feeding them piecewise, much faster for
/// records of a few hundred bytes).
pub fn content_hash(def: &StreamDef, record: &Record) -> ContentHash {
    content_hash_in(def, record, &mut AtOnce)
}

/// [`content_hash`], made as `hashing` makes hashes.
pub fn content_hash_in<H: Hashing>(def: &StreamDef, record: &Record, hashing: &mut H) -> H::Hash {
    content_hash_with(def, hashing, |out, i| {
        encode_present(out, &record.values[i])
    })
}

/// The content hash of the record whose hashed fields `write` encodes: `write(out, i)` appends
/// the value of field `i` and returns true, or returns false for null (nothing written).
pub(crate) fn content_hash_with<H: Hashing>(
    def: &StreamDef,
    hashing: &mut H,
    mut write: impl FnMut(&mut Vec<u8>, usize) -> bool,
) -> H::Hash {
    hashing.hash_encoding(|buf| {
        for (&i, name) in def.hash_fields.iter().zip(&def.hash_names) {
            let mark = buf.len();
            push_short(buf, name);
            if !write(buf, i) {
                buf.truncate(mark);
            }
        }
    })
}

/// How the checks make a record's content hash: at once ([`AtOnce`]), or by collecting the
/// record's canonical encoding in a [`HashGroup`] that hashes a group of records together.
pub trait Hashing {
    /// What a check returns for the hash: the hash itself, or the record's place in the group.
    type Hash;

    /// The hash of the canonical encoding that `encode` appends to the buffer it is given.
    fn hash_encoding(&mut self, encode: impl FnOnce(&mut Vec<u8>)) -> Self::Hash;

    /// The hash of the canonical encoding that `write` writes at the start of the room it is
    /// given, `bound` bytes or more (their contents unspecified), returning its length.
    fn hash_written(&mut self, bound: usize, write: impl FnOnce(&mut [u8]) -> usize) -> Self::Hash {
        self.hash_encoding(|buf| {
            let start = buf.len();
            buf.resize(start + bound, 0);
            let n = write(&mut buf[start..]);
            buf.truncate(start + n);
        })
    }
}

/// Hashes each record as it is checked.
#[derive(Debug, Clone, Copy, Default)]
pub struct AtOnce;

impl Hashing for AtOnce {
    type Hash = ContentHash;

    fn hash_encoding(&mut self, encode: impl FnOnce(&mut Vec<u8>)) -> ContentHash {
        AT_ONCE_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            buf.clear();
            encode(&mut buf);
            ContentHash(*blake3::keyed_hash(key(), &buf).as_bytes())
        })
    }

    /// In room left from earlier records, which is not zeroed again for each.
    fn hash_written(
        &mut self,
        bound: usize,
        write: impl FnOnce(&mut [u8]) -> usize,
    ) -> ContentHash {
        AT_ONCE_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < bound {
                buf.resize(bound, 0);
            }
            let n = write(&mut buf[..]);
            ContentHash(*blake3::keyed_hash(key(), &buf[..n]).as_bytes())
        })
    }
}

thread_local! {
    /// [`AtOnce`]'s encodings.
    static AT_ONCE_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The canonical encodings of a group of records, hashed together by [`HashGroup::finish`]:
/// eight records side by side in the lanes of one vector (see `hash/lanes.rs`), about four
/// times as fast per record as hashing them one at a time. The same hashes as
/// [`content_hash`]. Use: check the group's records with it (each check returns the record's
/// [`Pending`] place), `finish`, read each record's hash with [`HashGroup::get`], `clear`.
#[derive(Debug, Default)]
pub struct HashGroup {
    /// The encodings, in `buf[..used]`; the bytes after them are left from earlier groups, so
    /// that [`Hashing::hash_written`] finds room there without zeroing it (a `memset` of some
    /// 240 bytes a sensor reading, 1.5% of the edge agent's instructions).
    buf: Vec<u8>,
    used: usize,
    /// Where each record's encoding ends in `buf`.
    ends: Vec<usize>,
    hashes: Vec<[u8; 32]>,
    /// Scratch space of the lanes.
    order: Vec<u32>,
}

/// A record's place in a [`HashGroup`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending(u32);

impl Hashing for HashGroup {
    type Hash = Pending;

    fn hash_encoding(&mut self, encode: impl FnOnce(&mut Vec<u8>)) -> Pending {
        self.buf.truncate(self.used);
        encode(&mut self.buf);
        self.used = self.buf.len();
        self.pending()
    }

    fn hash_written(&mut self, bound: usize, write: impl FnOnce(&mut [u8]) -> usize) -> Pending {
        let end = self.used + bound;
        if self.buf.len() < end {
            self.buf.resize(end, 0);
        }
        self.used += write(&mut self.buf[self.used..end]);
        self.pending()
    }
}

impl HashGroup {
    pub fn new() -> HashGroup {
        HashGroup::default()
    }

    /// Ends the record whose encoding was just added at `used`.
    fn pending(&mut self) -> Pending {
        self.ends.push(self.used);
        Pending((self.ends.len() - 1) as u32)
    }

    /// The number of records collected since the last [`HashGroup::clear`].
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Hashes every record collected since the last [`HashGroup::clear`].
    pub fn finish(&mut self) {
        self.hashes.resize(self.ends.len(), [0; 32]);
        lanes::keyed_hash_many(
            key(),
            &self.buf[..self.used],
            &self.ends,
            &mut self.order,
            &mut self.hashes,
        );
    }

    /// The hash of the record at `pending`, once [`HashGroup::finish`] has run.
    ///
    /// # Panics
    /// When the group was not finished since the record was added.
    pub fn get(&self, pending: Pending) -> ContentHash {
        ContentHash(self.hashes[pending.0 as usize])
    }

    /// Empties the group for the next one (keeping its buffers).
    pub fn clear(&mut self) {
        self.used = 0;
        self.ends.clear();
        self.hashes.clear();
    }
}

/// Encodes a value unless it is null; returns whether it wrote anything.
pub(crate) fn encode_present(out: &mut Vec<u8>, value: &Value) -> bool {
    let present = !matches!(value, Value::Null);
    if present {
        encode(out, value);
    }
    present
}

fn encode(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Null => out.push(0),
        Value::List(items) => {
            out.push(6);
            leb128(out, items.len());
            for item in items {
                encode(out, item);
            }
        }
        Value::Map(entries) => {
            out.push(7);
            leb128(out, entries.len());
            for (k, v) in entries {
                encode_bytes(out, k.as_bytes());
                encode(out, v);
            }
        }
        scalar => {
            if let Some(s) = scalar.as_scalar() {
                encode_scalar(out, s);
            }
        }
    }
}

/// A scalar value: a tag byte and a fixed-width payload, or for strings a length and the bytes.
#[inline(always)]
pub(crate) fn encode_scalar(out: &mut Vec<u8>, value: Scalar<'_>) {
    match value {
        Scalar::Bool(b) => out.extend_from_slice(&[1, u8::from(b)]),
        Scalar::Int(i) => tagged(out, 2, i.to_le_bytes()),
        // Validation maps -0.0 to 0.0; JSON has no NaN.
        Scalar::Float(f) => tagged(out, 3, f.to_bits().to_le_bytes()),
        // A tag and a one-byte length for strings under 128 bytes, written at once.
        Scalar::Str(s) if s.len() < 0x80 => {
            out.extend_from_slice(&[4, s.len() as u8]);
            push_short(out, s.as_bytes());
        }
        Scalar::Str(s) => {
            out.push(4);
            encode_bytes(out, s.as_bytes());
        }
        Scalar::Timestamp(t) => tagged(out, 5, t.to_le_bytes()),
    }
}

/// Encodings of at most this many bytes (a power of two) may be written into a [`ShortRoom`].
pub(crate) const SHORT_ENCODING: usize = 256;

/// Bytes of a [`ShortRoom`].
pub(crate) const ROOM: usize = SHORT_ENCODING + 16;

/// Room for an encoding of at most [`SHORT_ENCODING`] bytes: every write of at most 16 bytes
/// there is at an offset masked to below [`SHORT_ENCODING`] (which changes none of them) in an
/// array longer than that by 16 bytes, so the compiler leaves out its bounds check: a sensor
/// reading's encoding took 515 instructions, now 456 (callgrind). (A room of 1,024 bytes, which
/// would take longer records too, had fewer instructions than slices but took more time than
/// either in the forwarding driver, over 9 alternating runs twice.)
pub(crate) type ShortRoom = [u8; ROOM];

/// Where an encoding is written: a slice, or a [`ShortRoom`].
pub(crate) trait Room {
    /// Writes `bytes` (`N` at most 16) at `at`.
    fn put<const N: usize>(&mut self, at: usize, bytes: [u8; N]);
    /// Writes `bytes` at `at`.
    fn put_slice(&mut self, at: usize, bytes: &[u8]);
}

impl Room for [u8] {
    #[inline(always)]
    fn put<const N: usize>(&mut self, at: usize, bytes: [u8; N]) {
        self[at..at + N].copy_from_slice(&bytes);
    }

    #[inline(always)]
    fn put_slice(&mut self, at: usize, bytes: &[u8]) {
        self[at..at + bytes.len()].copy_from_slice(bytes);
    }
}

impl Room for ShortRoom {
    #[inline(always)]
    fn put<const N: usize>(&mut self, at: usize, bytes: [u8; N]) {
        debug_assert!(at < SHORT_ENCODING && N <= 16);
        let at = at & (SHORT_ENCODING - 1);
        self[at..at + N].copy_from_slice(&bytes);
    }

    /// As a slice does, with its bounds check: a longer string's length is not known here.
    #[inline(always)]
    fn put_slice(&mut self, at: usize, bytes: &[u8]) {
        self[..].put_slice(at, bytes);
    }
}

/// [`encode_scalar`] into `out` at `n`, which has room for it; returns where it ends.
#[inline(always)]
pub(crate) fn put_scalar<R: Room + ?Sized>(out: &mut R, n: usize, value: Scalar<'_>) -> usize {
    let tagged = |out: &mut R, tag: u8, payload: [u8; 8]| {
        out.put(n, [tag]);
        out.put(n + 1, payload);
        n + 9
    };
    match value {
        Scalar::Bool(b) => {
            out.put(n, [1, u8::from(b)]);
            n + 2
        }
        Scalar::Int(i) => tagged(out, 2, i.to_le_bytes()),
        Scalar::Float(f) => tagged(out, 3, f.to_bits().to_le_bytes()),
        Scalar::Timestamp(t) => tagged(out, 5, t.to_le_bytes()),
        Scalar::Str(s) => {
            out.put(n, [4]);
            let at = put_leb128(out, n + 1, s.len());
            put_bytes(out, at, s.as_bytes())
        }
    }
}

/// Copies `bytes` into `out` at `n` and returns where they end. Up to 16 bytes are copied as
/// two overlapping words (within `out[n..n + bytes.len()]`), without a call to `memcpy`.
#[inline(always)]
pub(crate) fn put_bytes<R: Room + ?Sized>(out: &mut R, n: usize, bytes: &[u8]) -> usize {
    fn word<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
        bytes[at..at + N].try_into().unwrap_or([0; N])
    }
    let len = bytes.len();
    match len {
        8..=16 => {
            out.put(n, word::<8>(bytes, 0));
            out.put(n + len - 8, word::<8>(bytes, len - 8));
        }
        4..=7 => {
            out.put(n, word::<4>(bytes, 0));
            out.put(n + len - 4, word::<4>(bytes, len - 4));
        }
        0..=3 => {
            for (k, &b) in bytes.iter().enumerate() {
                out.put(n + k, [b]);
            }
        }
        _ => out.put_slice(n, bytes),
    }
    n + len
}

/// A tag byte and an 8-byte payload, written at once.
fn tagged(out: &mut Vec<u8>, tag: u8, payload: [u8; 8]) {
    let mut bytes = [tag; 9];
    bytes[1..].copy_from_slice(&payload);
    out.extend_from_slice(&bytes);
}

fn encode_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    leb128(out, bytes.len());
    push_short(out, bytes);
}

/// Appends `bytes`. Up to 16 bytes (a record's field names and most of its strings) are
/// copied by [`put_bytes`] into room made as a constant 16 bytes, rather than by a call to
/// `memcpy`, which for so few bytes costs more than the copy.
#[inline(always)]
fn push_short(out: &mut Vec<u8>, bytes: &[u8]) {
    let (at, n) = (out.len(), bytes.len());
    if n <= 16 {
        out.extend_from_slice(&[0; 16]);
        put_bytes(&mut out[..], at, bytes);
        out.truncate(at + n);
    } else {
        out.extend_from_slice(bytes);
    }
}

/// Unsigned LEB128: seven bits per byte, low groups first, the high bit set on all but the last.
fn leb128(out: &mut Vec<u8>, n: usize) {
    let mut bytes = [0u8; 10];
    let len = put_leb128(&mut bytes[..], 0, n);
    out.extend_from_slice(&bytes[..len]);
}

/// [`leb128`] into `out` at `at`, which has room for it (at most 10 bytes); returns where it
/// ends.
#[inline(always)]
fn put_leb128<R: Room + ?Sized>(out: &mut R, mut at: usize, mut n: usize) -> usize {
    while n >= 0x80 {
        out.put(at, [(n as u8) | 0x80]);
        n >>= 7;
        at += 1;
    }
    out.put(at, [n as u8]);
    at + 1
}

#[cfg(test)]
mod tests {
    #[test]
    fn short_pushes_and_puts_write_exactly_the_bytes() {
        let source: Vec<u8> = (1..=40).collect();
        for n in 0..=40 {
            let mut out = vec![0xee; 3];
            super::push_short(&mut out, &source[..n]);
            assert_eq!(out[..3], [0xee; 3], "{n}");
            assert_eq!(out[3..], source[..n], "{n}");
            let mut out = vec![0xee; 3 + n + 3];
            assert_eq!(super::put_bytes(&mut out[..], 3, &source[..n]), 3 + n);
            assert_eq!(out[..3], [0xee; 3], "{n}");
            assert_eq!(out[3..3 + n], source[..n], "{n}");
            assert_eq!(out[3 + n..], [0xee; 3], "{n}");
            let mut room: super::ShortRoom = [0xee; super::ROOM];
            assert_eq!(super::put_bytes(&mut room, 3, &source[..n]), 3 + n);
            assert_eq!(room[..3 + n + 3], out[..], "{n}");
            assert!(room[3 + n..].iter().all(|&b| b == 0xee), "{n}");
        }
    }

    /// Each scalar is put as it is pushed, strings of every length of their length's bytes.
    #[test]
    fn scalars_are_put_as_they_are_pushed() {
        use crate::value::Scalar;
        let long = "x".repeat(300);
        let scalars = [
            Scalar::Bool(true),
            Scalar::Int(-7),
            Scalar::Float(2.5),
            Scalar::Timestamp(1_767_225_600_000_000),
            Scalar::Str(""),
            Scalar::Str("degC"),
            Scalar::Str(&long[..127]),
            Scalar::Str(&long[..128]),
            Scalar::Str(&long),
        ];
        for value in scalars {
            let mut pushed = Vec::new();
            super::encode_scalar(&mut pushed, value);
            let mut out = vec![0; 2 + 1 + 2 + 300];
            let end = super::put_scalar(&mut out[..], 2, value);
            assert_eq!(out[2..end], pushed[..], "{value:?}");
            if end <= super::SHORT_ENCODING {
                let mut room: super::ShortRoom = [0; super::ROOM];
                assert_eq!(super::put_scalar(&mut room, 2, value), end, "{value:?}");
                assert_eq!(room[2..end], pushed[..], "{value:?}");
            }
        }
    }

    #[test]
    fn a_stream_encodes_its_field_names_as_the_hash_encodes_bytes() {
        for len in [0usize, 1, 8, 16, 17, 127, 128, 300, 20_000] {
            let name = "n".repeat(len);
            let mut want = Vec::new();
            super::encode_bytes(&mut want, name.as_bytes());
            assert_eq!(&*crate::stream::encoded_name(&name), &want[..], "{len}");
        }
    }

    #[test]
    fn leb128_groups_seven_bits_low_first() {
        for (n, want) in [
            (0usize, vec![0u8]),
            (127, vec![0x7f]),
            (128, vec![0x80, 0x01]),
            (300, vec![0xac, 0x02]),
            (16_384, vec![0x80, 0x80, 0x01]),
        ] {
            let mut out = Vec::new();
            super::leb128(&mut out, n);
            assert_eq!(out, want, "{n}");
        }
    }
}
