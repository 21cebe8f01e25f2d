//! A hand-written scanner for the common shape of a record: one JSON object of known keys whose
//! strings carry no escapes. It decodes such a record straight into a typed [`Record`] (with
//! hashing, the decode path went from about 130 to about 200 MB/s per core when it replaced
//! serde_json's visitor path there), and gives up (`None`) on anything else: escapes,
//! unknown keys, wrong types, missing fields, numbers it does not parse itself, malformed JSON.
//! The caller then runs the serde path ([`crate::typed`]), which decides and words the error, so
//! the scanner never has to: it only accepts what that path accepts, with the same result (a
//! property test holds the two equal on valid and invalid input).

use smallvec::SmallVec;

use crate::hash::{
    Hashing, ROOM, Room, SHORT_ENCODING, ShortRoom, content_hash_with, encode_present,
    encode_scalar, put_bytes, put_scalar,
};
use crate::stream::{FieldType, StreamDef};
use crate::value::{
    Record, Scalar, Str, Value, float_from_f64, int_from_f64, timestamp_from_i64,
    timestamp_from_str,
};

/// Decodes `bytes` when it is a record of the common shape; `None` sends it to the serde path.
pub(crate) fn decode(def: &StreamDef, bytes: &[u8]) -> Option<Record> {
    decode_verbatim(def, bytes).map(|(record, _)| record)
}

/// [`decode`], and whether every key appeared once (then `bytes` is a plain JSON object of the
/// record: known keys, each once, no escapes).
pub(crate) fn decode_verbatim(def: &StreamDef, bytes: &[u8]) -> Option<(Record, bool)> {
    let mut values = Vec::with_capacity(def.fields.len());
    values.resize_with(def.fields.len(), || Value::Null);
    let once = scan(def, bytes.into(), Build::All, &mut values)?;
    Some((Record { values }, once))
}

/// The content hash and partition key of a record of the common shape whose keys appear once
/// each, so that its text may stand as its Kafka value; the record itself is never built (its
/// strings stay in the line, its unhashed lists and maps are only checked). `None` for anything
/// else, which the caller decodes into a record instead.
///
/// `key` makes what the caller keeps of the partition key field's value (the gateway its
/// partition key, the edge agent nothing).
#[inline(always)]
pub(crate) fn forwardable<H: Hashing, K>(
    def: &StreamDef,
    line: Line<'_>,
    hashing: &mut H,
    key: impl FnOnce(Option<Scalar<'_>>) -> K,
) -> Option<(H::Hash, K)> {
    with_null_slots(def.fields.len(), |slots| {
        let once = scan(def, line, Build::Hashed, slots)?;
        if !once {
            return None;
        }
        // `Build::Hashed` built every hashed list and map.
        let hash = slots_hash(def, slots, line.bytes.len(), hashing);
        let key = key(match &slots[def.partition_key] {
            Slot::Scalar(value) => Some(*value),
            _ => None,
        });
        Some((hash, key))
    })
}

/// Runs `f` over `n` null slots that stay where they are made: an array on the stack, of 8
/// slots for streams of up to 8 fields (256 bytes to set, which the compiler does with a few
/// stores inline) and of 16 up to 16. [`Slots`], which callers that keep the slots need, were
/// set as a 512-byte array and then copied whole into place: a `memset` and a `memcpy` call a
/// record, about 150 of a sensor reading's instructions (callgrind).
#[inline(always)]
fn with_null_slots<'a, R>(n: usize, f: impl FnOnce(&mut [Slot<'a>]) -> R) -> R {
    if n <= 8 {
        on_stack::<8, _>(n, f)
    } else if n <= 16 {
        on_stack::<16, _>(n, f)
    } else {
        f(&mut vec![Slot::Null; n])
    }
}

/// [`with_null_slots`] in an array of `N` slots, `n` of them used.
#[inline(always)]
fn on_stack<'a, const N: usize, R>(n: usize, f: impl FnOnce(&mut [Slot<'a>]) -> R) -> R {
    let mut slots = [const { Slot::Null }; N];
    let r = f(&mut slots[..n]);
    if !owns_something(&slots) {
        std::mem::forget(slots);
    }
    r
}

/// The fields and content hash of a record of the common shape (keys may repeat: the last
/// value counts), without building the record: strings stay slices of `bytes`. `None` for
/// anything else, which the caller decodes into a record instead.
#[inline(always)]
pub(crate) fn scanned<'a, H: Hashing>(
    def: &StreamDef,
    bytes: &'a [u8],
    hashing: &mut H,
) -> Option<(Slots<'a>, H::Hash)> {
    scanned_if(def, bytes.into(), hashing, |_| true)
}

/// [`scanned`] when `take` accepts whether every key appeared once (nothing is hashed
/// otherwise): `|once| once` takes only records whose text may stand for them.
#[inline(always)]
pub(crate) fn scanned_if<'a, H: Hashing>(
    def: &StreamDef,
    line: Line<'a>,
    hashing: &mut H,
    take: impl FnOnce(bool) -> bool,
) -> Option<(Slots<'a>, H::Hash)> {
    scanned_with(def, line, Build::All, hashing, take)
}

/// [`scanned_if`] with only the hashed lists and maps built: the others are checked and left as
/// `Slot::Nested(None)`, for callers that read scalars only.
#[inline(always)]
pub(crate) fn scanned_hashed_if<'a, H: Hashing>(
    def: &StreamDef,
    line: Line<'a>,
    hashing: &mut H,
    take: impl FnOnce(bool) -> bool,
) -> Option<(Slots<'a>, H::Hash)> {
    scanned_with(def, line, Build::Hashed, hashing, take)
}

#[inline(always)]
fn scanned_with<'a, H: Hashing>(
    def: &StreamDef,
    line: Line<'a>,
    build: Build,
    hashing: &mut H,
    take: impl FnOnce(bool) -> bool,
) -> Option<(Slots<'a>, H::Hash)> {
    let mut slots = null_slots(def.fields.len());
    if !take(scan(def, line, build, &mut slots)?) {
        return None;
    }
    let hash = slots_hash(def, &slots, line.bytes.len(), hashing);
    Some((slots, hash))
}

/// One slot per field: streams of up to 16 fields need no allocation.
pub(crate) type Slots<'a> = SmallVec<[Slot<'a>; 16]>;

/// Whether any of `slots` owns memory (a built list or map). Slots that own nothing are
/// forgotten rather than dropped: dropping a slot is a call that looks at its tag, about 130
/// instructions for the seven of a sensor reading, 56 fewer in all with this check. Forgetting
/// what owns nothing leaks nothing.
#[inline(always)]
fn owns_something(slots: &[Slot<'_>]) -> bool {
    slots
        .iter()
        .any(|slot| matches!(slot, Slot::Nested(Some(_))))
}

/// `n` null slots. Made from a whole array of them rather than pushed one by one: a pushed
/// `Slot::Null` was written to the stack by its tag alone and read back whole, a load the CPU
/// cannot forward from the narrower store, and that stall was 5.8% of the edge agent's time.
#[inline(always)]
fn null_slots<'a>(n: usize) -> Slots<'a> {
    if n <= 16 {
        SmallVec::from_buf_and_len([const { Slot::Null }; 16], n)
    } else {
        std::iter::repeat_n(Slot::Null, n).collect()
    }
}

/// The content hash of scanned fields whose hashed lists and maps were built; `text_len` is
/// the length of the record's text, which bounds its strings' bytes.
///
/// Scalars only (the common case) are written into room made for the whole encoding at once,
/// at offsets kept in a local: pushing each piece onto the `Vec` (a capacity check, a length
/// update and often a `memcpy` call per piece) took about 650 instructions a sensor reading.
fn slots_hash<H: Hashing>(
    def: &StreamDef,
    slots: &[Slot<'_>],
    text_len: usize,
    hashing: &mut H,
) -> H::Hash {
    let nested = def
        .hash_fields
        .iter()
        .any(|&i| matches!(slots[i], Slot::Nested(_)));
    if nested {
        return content_hash_with(def, hashing, |out, i| match &slots[i] {
            Slot::Null => false,
            Slot::Scalar(value) => {
                encode_scalar(out, *value);
                true
            }
            Slot::Nested(value) => value.as_ref().is_some_and(|v| encode_present(out, v)),
        });
    }
    // Names, at most 10 bytes of tag and payload or of tag and length per value, and the
    // strings' bytes (slices of the text).
    let bound = def.hash_names_bytes + 10 * def.hash_fields.len() + text_len;
    if bound <= SHORT_ENCODING {
        hashing.hash_written(ROOM, |out| {
            let room: &mut ShortRoom = out.first_chunk_mut().expect("room asked for");
            put_scalars(def, slots, room)
        })
    } else {
        hashing.hash_written(bound, |out| put_scalars(def, slots, out))
    }
}

/// Writes the encoding of scalar `slots` into `out`; returns its length.
#[inline(always)]
fn put_scalars<R: Room + ?Sized>(def: &StreamDef, slots: &[Slot<'_>], out: &mut R) -> usize {
    let mut n = 0;
    for (&i, name) in def.hash_fields.iter().zip(&def.hash_names) {
        if let Slot::Scalar(value) = slots[i] {
            n = put_bytes(out, n, name);
            n = put_scalar(out, n, value);
        }
    }
    n
}

/// A field's value as the scanner read it.
#[derive(Debug, Clone)]
pub(crate) enum Slot<'a> {
    Null,
    /// Strings are slices of the record's text.
    Scalar(Scalar<'a>),
    /// A list or map; `None` when it was checked but not built.
    Nested(Option<Value>),
}

/// Where the scanner puts a field's value: a [`Value`] of a record, or a [`Slot`].
trait Field<'a> {
    fn null() -> Self;
    fn is_null(&self) -> bool;
    fn scalar(value: Scalar<'a>) -> Self;
    /// A list or map: `None` when it was only checked.
    fn nested(value: Option<Value>) -> Self;
}

impl<'a> Field<'a> for Value {
    fn null() -> Self {
        Value::Null
    }

    fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }

    #[inline(always)]
    fn scalar(value: Scalar<'a>) -> Self {
        value.into()
    }

    fn nested(value: Option<Value>) -> Self {
        value.unwrap_or(Value::Null)
    }
}

impl<'a> Field<'a> for Slot<'a> {
    fn null() -> Self {
        Slot::Null
    }

    fn is_null(&self) -> bool {
        matches!(self, Slot::Null)
    }

    #[inline(always)]
    fn scalar(value: Scalar<'a>) -> Self {
        Slot::Scalar(value)
    }

    fn nested(value: Option<Value>) -> Self {
        Slot::Nested(value)
    }
}

/// Which lists and maps the scanner builds as values (the others it only checks).
#[derive(Clone, Copy)]
enum Build {
    All,
    /// Those of hashed fields.
    Hashed,
}

/// Scans a record of the common shape into `fields` (one per field of the stream, all null);
/// returns whether every key appeared once, or `None` when the record is not of that shape or
/// not valid.
fn scan<'a, F: Field<'a>>(
    def: &StreamDef,
    line: Line<'a>,
    build: Build,
    fields: &mut [F],
) -> Option<bool> {
    // One UTF-8 check of the whole line (JSON text outside strings is ASCII anyway) instead of
    // one per string; strings are then sliced out of `text` at quote positions. simdutf8 checks
    // 32 bytes at a time where the CPU has AVX2 (a reading of 143 bytes: 100 instead of 180
    // instructions).
    let text = simdutf8::basic::from_utf8(line.bytes).ok()?;
    match line.window {
        Some(window) => scan_line(def, text, Window(window), build, fields),
        None => scan_line(def, text, text.as_bytes(), build, fields),
    }
}

/// [`scan`] over the line's bytes as `b` gives them, `text` being the line.
#[inline(always)]
fn scan_line<'a, F: Field<'a>, B: Bytes>(
    def: &StreamDef,
    text: &'a str,
    b: B,
    build: Build,
    fields: &mut [F],
) -> Option<bool> {
    let bytes = text.as_bytes();
    let mut s = Scanner { text, b, i: 0 };
    s.ws();
    s.eat(b'{')?;
    // Keys seen, one bit per field; streams of more than 64 fields never count as verbatim.
    let (mut seen, mut once) = (0u64, def.fields.len() <= 64);
    let mut prev = def.fields.len();
    s.sequence(b'}', |s| {
        let i = match s.likely_key(def, prev) {
            Some(i) => i,
            None => {
                let (start, len) = s.key()?;
                s.field(def, start, len)?
            }
        };
        prev = i;
        let bit = 1u64 << (i % 64);
        once &= seen & bit == 0;
        seen |= bit;
        let build = match build {
            Build::All => true,
            Build::Hashed => def.hashed[i],
        };
        // A repeated key keeps its last value, as on the serde path.
        s.value(&def.fields[i].ty, build, &mut fields[i])
    })?;
    s.ws();
    if s.i != bytes.len() {
        return None;
    }
    let complete = def
        .fields
        .iter()
        .zip(fields.iter())
        .all(|(f, v)| !f.required || !v.is_null());
    complete.then_some(once)
}

/// The bytes a [`Line`]'s window holds: room for any index below 256 and a block of 64 bytes
/// from it.
const WINDOW: usize = 256 + 64;

/// The longest line read through a window.
const WINDOW_LINE: usize = 240;

/// A line to scan, and a window on the buffer it lies in when that buffer goes on past the line
/// with a control character (an NDJSON body's `\n` or `\r`) and for a whole window's length from
/// its start. The scanner reads such a line without bounds checks (see [`Bytes`]).
#[derive(Debug, Clone, Copy)]
pub struct Line<'a> {
    bytes: &'a [u8],
    window: Option<&'a [u8; WINDOW]>,
}

impl<'a> Line<'a> {
    /// The line at `buffer[start..end]`.
    pub fn within(buffer: &'a [u8], start: usize, end: usize) -> Line<'a> {
        let bytes = &buffer[start..end];
        let ends = buffer.get(end).is_some_and(|&c| c < 0x20);
        let window = if ends && bytes.len() <= WINDOW_LINE {
            buffer[start..].first_chunk()
        } else {
            None
        };
        Line { bytes, window }
    }

    pub fn bytes(self) -> &'a [u8] {
        self.bytes
    }

    /// Whether the line is read through a window.
    #[cfg(test)]
    pub(crate) fn windowed(self) -> bool {
        self.window.is_some()
    }
}

impl<'a> From<&'a [u8]> for Line<'a> {
    fn from(bytes: &'a [u8]) -> Line<'a> {
        Line {
            bytes,
            window: None,
        }
    }
}

/// A line's window, from its start.
#[derive(Clone, Copy)]
struct Window<'a>(&'a [u8; WINDOW]);

/// The bytes of a line as the scanner reads them: the line, then a control character (a
/// window's next byte, or zeros past the end of a slice). A control character is never part of a
/// token the scanner accepts (outside strings it is whitespace or not JSON, inside them it must
/// be escaped), so the scanner stops at the end of the line as it stops at any byte it does not
/// expect, and never reads past it by more than a block. Its position never passes the end
/// either: it only moves over bytes it has matched, and over whitespace up to the end.
///
/// Every read of a [`Window`] is at an index below 256 of an array longer than that by a block,
/// so the compiler leaves out the bounds checks: about a fifth of the scanner's instructions
/// (callgrind: 418 of 2,028 a sensor reading, on about 70 reads of a byte and 20 of a block). A
/// line without a window is read in place, with the checks. (A copy of the line into a zeroed
/// buffer, in place of the window, made the scanner slower: its reads of words and blocks then
/// spanned the copy's stores, loads the CPU cannot forward from them.)
trait Bytes: Copy {
    /// The byte at `i`.
    fn at(self, i: usize) -> u8;
    /// The `N` bytes from `i` (`N` at most 64).
    fn block<const N: usize>(self, i: usize) -> [u8; N];
    /// Whether `word` (of no control character) comes at `i`.
    fn has_at(self, i: usize, word: &[u8]) -> bool;
}

impl Bytes for Window<'_> {
    #[inline(always)]
    fn at(self, i: usize) -> u8 {
        debug_assert!(i <= WINDOW_LINE);
        self.0[usize::from(i as u8)]
    }

    #[inline(always)]
    fn block<const N: usize>(self, i: usize) -> [u8; N] {
        debug_assert!(i <= WINDOW_LINE);
        match self.0[usize::from(i as u8)..].first_chunk() {
            Some(block) => *block,
            None => [0; N],
        }
    }

    #[inline(always)]
    fn has_at(self, i: usize, word: &[u8]) -> bool {
        self.0
            .get(i..i + word.len())
            .is_some_and(|text| same_short(text, word))
    }
}

impl Bytes for &[u8] {
    #[inline(always)]
    fn at(self, i: usize) -> u8 {
        self.get(i).copied().unwrap_or(0)
    }

    #[inline(always)]
    fn block<const N: usize>(self, i: usize) -> [u8; N] {
        let rest = self.get(i..).unwrap_or_default();
        match rest.first_chunk() {
            Some(block) => *block,
            None => {
                let mut block = [0; N];
                block[..rest.len()].copy_from_slice(rest);
                block
            }
        }
    }

    #[inline(always)]
    fn has_at(self, i: usize, word: &[u8]) -> bool {
        self.get(i..i + word.len())
            .is_some_and(|text| same_short(text, word))
    }
}

struct Scanner<'a, B> {
    text: &'a str,
    /// `text` as bytes, then a control character ([`Bytes`]).
    b: B,
    i: usize,
}

impl<'a, B: Bytes> Scanner<'a, B> {
    /// The next byte: 0 at the end of the line.
    #[inline(always)]
    fn peek(&self) -> u8 {
        self.b.at(self.i)
    }

    #[inline(always)]
    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek() == c).then(|| self.i += 1)
    }

    /// Skips JSON whitespace (compact JSON has none: the first byte decides), up to the end of
    /// the line.
    fn ws(&mut self) {
        while self.i < self.text.len() && matches!(self.peek(), b' ' | b'\n' | b'\r' | b'\t') {
            self.i += 1;
        }
    }

    /// The next byte after any whitespace, which is skipped; 0 at the end of the line. Every
    /// token but the first is read through this, so compact JSON pays one test per token for the
    /// whitespace it does not have.
    #[inline(always)]
    fn peek_ws(&mut self) -> u8 {
        match self.peek() {
            b' ' | b'\n' | b'\r' | b'\t' => {
                self.ws();
                self.peek()
            }
            c => c,
        }
    }

    /// A string without escapes or control characters: where its text starts in `b` and its
    /// length.
    #[inline(always)]
    fn raw_string(&mut self) -> Option<(usize, usize)> {
        self.eat(b'"')?;
        let start = self.i;
        let end = string_end(self.b, start);
        if self.b.at(end) != b'"' {
            return None;
        }
        self.i = end + 1;
        Some((start, end - start))
    }

    /// A string without escapes or control characters.
    #[inline(always)]
    fn string(&mut self) -> Option<&'a str> {
        let (start, len) = self.raw_string()?;
        // `text` is valid UTF-8 and quotes are ASCII, so this never splits a character.
        self.text.get(start..start + len)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.b.has_at(self.i, word).then(|| self.i += word.len())
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while self.peek().is_ascii_digit() {
            self.i += 1;
        }
        self.i - start
    }

    /// The elements of an array whose `[` was just read, through its `]`: `element` reads each.
    fn elements(&mut self, element: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.sequence(b']', element)
    }

    /// The members of an object whose `{` was just read, through its `}`: `member` reads the
    /// value of each key (given as where its text starts in `b` and its length).
    #[inline(always)]
    fn members(
        &mut self,
        mut member: impl FnMut(&mut Self, usize, usize) -> Option<()>,
    ) -> Option<()> {
        self.sequence(b'}', |s| {
            let (start, len) = s.key()?;
            member(s, start, len)
        })
    }

    /// An object's key and its colon: where the key's text starts in `b` and its length.
    #[inline(always)]
    fn key(&mut self) -> Option<(usize, usize)> {
        if self.peek_ws() != b'"' {
            return None;
        }
        let key = self.raw_string()?;
        if self.peek_ws() != b':' {
            return None;
        }
        self.i += 1;
        Some(key)
    }

    /// The field whose key and colon (`"name":`, no space between) come next, if it is one of
    /// the two [`StreamDef::next_keys`] gives after field `prev` (the number of fields: at the
    /// start); they are consumed then.
    #[inline(always)]
    fn likely_key(&mut self, def: &StreamDef, prev: usize) -> Option<usize> {
        def.next_keys[prev].into_iter().find(|&i| {
            let key = def.json_key(i);
            let hit = self.b.has_at(self.i, key);
            if hit {
                self.i += key.len();
            }
            hit
        })
    }

    /// Comma-separated items through the `close` byte (the opening one was just read).
    #[inline(always)]
    fn sequence(&mut self, close: u8, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        if self.peek_ws() == close {
            self.i += 1;
            return Some(());
        }
        loop {
            item(self)?;
            match self.peek_ws() {
                b',' => self.i += 1,
                c if c == close => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A number by the JSON grammar, with its digits collected on the way.
    #[inline(always)]
    fn number(&mut self) -> Option<Number<'a>> {
        let start = self.i;
        let negative = self.peek() == b'-';
        if negative {
            self.i += 1;
        }
        let int_start = self.i;
        let (mut mantissa, mut digits) = (0u64, 0usize);
        match self.digits_into(&mut mantissa, &mut digits) {
            0 => return None,
            // No leading zeros.
            n if n > 1 && self.b.at(int_start) == b'0' => return None,
            _ => {}
        }
        let (mut exp10, mut integer) = (0i64, true);
        if self.peek() == b'.' {
            self.i += 1;
            match self.digits_into(&mut mantissa, &mut digits) {
                0 => return None,
                n => exp10 -= n as i64,
            }
            integer = false;
        }
        if let b'e' | b'E' = self.peek() {
            self.i += 1;
            let negative_exp = self.peek() == b'-';
            if let b'+' | b'-' = self.peek() {
                self.i += 1;
            }
            let exp_start = self.i;
            if self.digits() == 0 {
                return None;
            }
            // Saturated: anything this large leaves the fast path anyway.
            let exp = self.text.as_bytes()[exp_start..self.i]
                .iter()
                .fold(0i64, |e, c| (e * 10 + i64::from(c - b'0')).min(1 << 20));
            exp10 += if negative_exp { -exp } else { exp };
            integer = false;
        }
        Some(Number {
            text: self.text.get(start..self.i)?,
            negative,
            mantissa: (digits <= 19).then_some(mantissa),
            exp10,
            integer,
        })
    }

    /// Reads decimal digits into `mantissa` (wrapping past 19 digits: `count` tells) and
    /// returns how many there were.
    fn digits_into(&mut self, mantissa: &mut u64, count: &mut usize) -> usize {
        let start = self.i;
        loop {
            let d = self.peek().wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            *mantissa = mantissa.wrapping_mul(10).wrapping_add(u64::from(d));
            self.i += 1;
        }
        *count += self.i - start;
        self.i - start
    }

    /// The field whose name is the key at `b[start..start + len]`. The key's first word is
    /// loaded straight from the line (zeros past its end).
    #[inline(always)]
    fn field(&self, def: &StreamDef, start: usize, len: usize) -> Option<usize> {
        let key = &self.text.as_bytes()[start..start + len];
        let head = u64::from_le_bytes(self.b.block(start)) & head_mask(len);
        def.field_by_head(key, head)
    }

    /// A value of type `ty`, converted as [`crate::value::validate`] converts it, written into
    /// `slot` (in place: returning it costs a copy that the profile shows). A list or map is
    /// built when `build` is set, and only checked otherwise.
    #[inline(always)]
    fn value<F: Field<'a>>(&mut self, ty: &FieldType, build: bool, slot: &mut F) -> Option<()> {
        let c = self.peek_ws();
        // The common cases first, each written as its own variant: through the general match
        // below, a scalar was tested against every kind of value, then merged into one value
        // written byte run by byte run.
        match (c, ty) {
            (b'"', FieldType::String) => {
                *slot = F::scalar(Scalar::Str(self.string()?));
                return Some(());
            }
            (b'-' | b'0'..=b'9', FieldType::Int64 | FieldType::Float64 | FieldType::Timestamp) => {
                *slot = F::scalar(number(ty, &self.number()?)?);
                return Some(());
            }
            _ => {}
        }
        *slot = match (c, ty) {
            (b'n', _) => self.literal(b"null").map(|()| F::null())?,
            // Only checked: nothing of it is kept, not even the `&str` of a string.
            (b'[', FieldType::List(inner)) if !build => {
                self.i += 1;
                self.elements(|s| s.check_item(inner))?;
                F::nested(None)
            }
            (b'{', FieldType::Map(inner)) if !build => {
                self.i += 1;
                self.members(|s, _, _| s.check_item(inner))?;
                F::nested(None)
            }
            (b'[', FieldType::List(inner)) => {
                self.i += 1;
                let mut items = Vec::new();
                self.elements(|s| {
                    let item = s.item(inner)?;
                    if build {
                        items.push(item.map_or(Value::Null, Value::from));
                    }
                    Some(())
                })?;
                F::nested(build.then_some(Value::List(items)))
            }
            (b'{', FieldType::Map(inner)) => {
                self.i += 1;
                let mut entries: Vec<(Str, Value)> = Vec::new();
                self.members(|s, start, len| {
                    let value = s.item(inner)?;
                    if build {
                        let key = s.text.get(start..start + len)?;
                        let value = value.map_or(Value::Null, Value::from);
                        // A repeated key keeps its last value.
                        match entries.iter_mut().find(|(k, _)| k == key) {
                            Some(slot) => slot.1 = value,
                            None => entries.push((key.into(), value)),
                        }
                    }
                    Some(())
                })?;
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                F::nested(build.then_some(Value::Map(entries)))
            }
            _ => F::scalar(self.scalar(ty)?),
        };
        Some(())
    }

    /// An item of a list or map: null, or a scalar of type `inner` (lists and maps hold
    /// scalars).
    fn item(&mut self, inner: &FieldType) -> Option<Option<Scalar<'a>>> {
        if self.peek_ws() == b'n' {
            return self.literal(b"null").map(|()| None);
        }
        self.scalar(inner).map(Some)
    }

    /// An item of a list or map that is only checked, as [`Scanner::item`] checks it. A string
    /// of a string item needs no more than its quotes: the text is valid UTF-8 and quotes are
    /// ASCII, so what lies between them is a string.
    #[inline(always)]
    fn check_item(&mut self, inner: &FieldType) -> Option<()> {
        match (self.peek_ws(), inner) {
            (b'"', FieldType::String) => self.raw_string().map(drop),
            _ => self.item(inner).map(drop),
        }
    }

    /// A non-null scalar of type `ty`.
    #[inline(always)]
    fn scalar(&mut self, ty: &FieldType) -> Option<Scalar<'a>> {
        Some(match (self.peek(), ty) {
            (b't', FieldType::Bool) => self.literal(b"true").map(|()| Scalar::Bool(true))?,
            (b'f', FieldType::Bool) => self.literal(b"false").map(|()| Scalar::Bool(false))?,
            (b'"', FieldType::String) => Scalar::Str(self.string()?),
            (b'"', FieldType::Timestamp) => Scalar::Timestamp(timestamp_from_str(self.string()?)?),
            (b'-' | b'0'..=b'9', FieldType::Int64 | FieldType::Float64 | FieldType::Timestamp) => {
                number(ty, &self.number()?)?
            }
            _ => return None,
        })
    }
}

/// A number of a numeric field. Integers beyond i64 and non-integers in integer fields are left
/// to the serde path (which reads them as floats).
#[inline(always)]
fn number<'a>(ty: &FieldType, n: &Number) -> Option<Scalar<'a>> {
    match ty {
        FieldType::Int64 if n.integer => n.int().map(Scalar::Int),
        FieldType::Int64 => int_from_f64(n.float()?).map(Scalar::Int),
        FieldType::Float64 => float_from_f64(n.float()?).map(Scalar::Float),
        FieldType::Timestamp if n.integer => timestamp_from_i64(n.int()?).map(Scalar::Timestamp),
        _ => None,
    }
}

/// A JSON number as the scanner read it.
struct Number<'a> {
    text: &'a str,
    negative: bool,
    /// The digits of the integer and fraction parts as one integer, when there are at most 19.
    mantissa: Option<u64>,
    /// The power of ten that scales `mantissa` to the number's magnitude.
    exp10: i64,
    /// No fraction, no exponent.
    integer: bool,
}

/// Powers of ten that an f64 holds exactly.
const EXACT_POWERS_OF_TEN: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
];

impl Number<'_> {
    /// The number as the nearest f64, as `str::parse` gives it. When the digits and the power
    /// of ten are both exact f64s, one multiplication or division rounds correctly to that
    /// nearest value (Clinger's fast path); anything else goes to the general parser.
    #[inline(always)]
    fn float(&self) -> Option<f64> {
        match self.mantissa {
            Some(m) if m <= 1 << 53 && self.exp10.unsigned_abs() <= 22 => {
                let power = EXACT_POWERS_OF_TEN[self.exp10.unsigned_abs() as usize];
                let magnitude = if self.exp10 < 0 {
                    m as f64 / power
                } else {
                    m as f64 * power
                };
                Some(if self.negative { -magnitude } else { magnitude })
            }
            _ => self.text.parse().ok(),
        }
    }

    /// The number, written as an integer, as an i64 (`None` beyond its range).
    #[inline(always)]
    fn int(&self) -> Option<i64> {
        match self.mantissa {
            Some(m) if m <= i64::MAX as u64 => {
                let m = m as i64;
                Some(if self.negative { -m } else { m })
            }
            _ => self.text.parse().ok(),
        }
    }
}

/// Where the text of a string starting at `i` ends: the first `"`, `\` or control character
/// (at the latest the one past the end of the line, see [`Bytes`]), looked for 16 bytes at a time
/// with SSE2 (every x86-64 CPU has it), or 8 at a time.
#[inline(always)]
fn string_end<B: Bytes>(b: B, i: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    if let Some(sse2) = pulp::core_arch::x86::Sse2::try_new() {
        return string_end_sse2(sse2, b, i);
    }
    string_end_words(b, i)
}

/// [`string_end`] 16 bytes at a time: three byte compares and one mask (about 10 instructions
/// where a word of [`string_end_words`] takes 20, and a sensor reading's strings, mostly under
/// 16 bytes, take one block each).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn string_end_sse2<B: Bytes>(sse2: pulp::core_arch::x86::Sse2, b: B, mut i: usize) -> usize {
    use std::arch::x86_64::__m128i;
    loop {
        let v: __m128i = pulp::cast(b.block::<16>(i));
        let quote = sse2._mm_cmpeq_epi8(v, sse2._mm_set1_epi8(b'"' as i8));
        let backslash = sse2._mm_cmpeq_epi8(v, sse2._mm_set1_epi8(b'\\' as i8));
        // Control characters (below 0x20): the bytes that an unsigned minimum with 0x1f leaves
        // as they are.
        let control = sse2._mm_cmpeq_epi8(sse2._mm_min_epu8(v, sse2._mm_set1_epi8(0x1f)), v);
        let hits = sse2._mm_or_si128(sse2._mm_or_si128(quote, backslash), control);
        let mask = sse2._mm_movemask_epi8(hits) as u32;
        if mask != 0 {
            return i + mask.trailing_zeros() as usize;
        }
        i += 16;
    }
}

/// [`string_end`] 8 bytes at a time.
fn string_end_words<B: Bytes>(b: B, mut i: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // The high bit of each zero byte of `x`. Borrows make false hits only above a true one, so
    // the lowest hit is exact; the same holds for the control-character test below.
    let zero_bytes = |x: u64| x.wrapping_sub(ONES) & !x & HIGH;
    loop {
        let w = u64::from_le_bytes(b.block(i));
        let hits = zero_bytes(w ^ (ONES * u64::from(b'"')))
            | zero_bytes(w ^ (ONES * u64::from(b'\\')))
            | (w.wrapping_sub(ONES * 0x20) & !w & HIGH);
        if hits != 0 {
            return i + (hits.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
}

/// Whether two slices of the same length are equal; those of 4 to 16 bytes (object keys with
/// their quotes and colon) are compared as two overlapping words each, which is cheaper than a
/// call to `memcmp`.
#[inline(always)]
fn same_short(a: &[u8], b: &[u8]) -> bool {
    fn word<const N: usize>(s: &[u8], at: usize) -> [u8; N] {
        s[at..at + N].try_into().unwrap_or([0; N])
    }
    let n = a.len();
    match n {
        4..=8 => word::<4>(a, 0) == word::<4>(b, 0) && word::<4>(a, n - 4) == word::<4>(b, n - 4),
        9..=16 => word::<8>(a, 0) == word::<8>(b, 0) && word::<8>(a, n - 8) == word::<8>(b, n - 8),
        _ => a == b,
    }
}

/// The low `len` bytes of a word (all of it from 8 up).
fn head_mask(len: usize) -> u64 {
    if len >= 8 {
        u64::MAX
    } else {
        (1u64 << (len * 8)) - 1
    }
}

#[cfg(test)]
mod tests;
