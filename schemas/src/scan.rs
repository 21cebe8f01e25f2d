//! A hand-written scanner for the common shape of a record: one JSON object of known keys whose
//! strings carry no escapes. It decodes such a record straight into a typed [`Record`] (with
//! hashing, the decode path went from about 130 to about 200 MB/s per core when it replaced
//! serde_json's visitor path there), and gives up (`None`) on anything else: escapes,
//! unknown keys, wrong types, missing fields, numbers it does not parse itself, malformed JSON.
//! The caller then runs the serde path ([`crate::typed`]), which decides and words the error, so
//! the scanner never has to: it only accepts what that path accepts, with the same result (a
//! property test holds the two equal on valid and invalid input).

use crate::stream::{FieldType, StreamDef};
use crate::value::{
    Record, Str, Value, float_from_f64, int_from_f64, timestamp_from_i64, timestamp_from_str,
};

/// Decodes `bytes` when it is a record of the common shape; `None` sends it to the serde path.
pub(crate) fn decode(def: &StreamDef, bytes: &[u8]) -> Option<Record> {
    decode_verbatim(def, bytes).map(|(record, _)| record)
}

/// [`decode`], and whether every key appeared once (then `bytes` is a plain JSON object of the
/// record: known keys, each once, no escapes).
pub(crate) fn decode_verbatim(def: &StreamDef, bytes: &[u8]) -> Option<(Record, bool)> {
    // One UTF-8 check of the whole line (JSON text outside strings is ASCII anyway) instead of
    // one per string; strings are then sliced out of `text` at quote positions.
    let text = std::str::from_utf8(bytes).ok()?;
    let mut s = Scanner {
        text,
        b: bytes,
        i: 0,
    };
    s.ws();
    s.eat(b'{')?;
    let mut values = Vec::with_capacity(def.fields.len());
    values.resize_with(def.fields.len(), || Value::Null);
    // Keys seen, one bit per field; streams of more than 64 fields never count as verbatim.
    let (mut seen, mut once) = (0u64, def.fields.len() <= 64);
    // Writers mostly keep the schema's order: the field after the last one is tried first.
    let mut next = 0;
    s.members(|s, key| {
        let i = match def.fields.get(next) {
            Some(f) if f.name == key => next,
            _ => def.fields.iter().position(|f| f.name == key)?,
        };
        next = i + 1;
        let bit = 1u64 << (i % 64);
        once &= seen & bit == 0;
        seen |= bit;
        // A repeated key keeps its last value, as on the serde path.
        s.value(&def.fields[i].ty, &mut values[i])
    })?;
    s.ws();
    if s.i != bytes.len() {
        return None;
    }
    let complete = def
        .fields
        .iter()
        .zip(&values)
        .all(|(f, v)| !f.required || !matches!(v, Value::Null));
    complete.then_some((Record { values }, once))
}

struct Scanner<'a> {
    text: &'a str,
    /// `text` as bytes.
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    /// Skips JSON whitespace.
    fn ws(&mut self) {
        let rest = &self.b[self.i..];
        self.i += rest
            .iter()
            .position(|c| !matches!(c, b' ' | b'\n' | b'\r' | b'\t'))
            .unwrap_or(rest.len());
    }

    /// A string without escapes or control characters.
    fn string(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let start = self.i;
        let len = self.b[start..]
            .iter()
            .position(|&c| c == b'"' || c == b'\\' || c < 0x20)?;
        self.i = start + len;
        self.eat(b'"')?;
        self.text.get(start..start + len)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.i + word.len();
        (self.b.get(self.i..end)? == word).then(|| self.i = end)
    }

    fn digits(&mut self) -> usize {
        let rest = &self.b[self.i..];
        let n = rest
            .iter()
            .position(|c| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        self.i += n;
        n
    }

    /// The members of an object whose `{` was just read, through its `}`: `member` reads the
    /// value of each key.
    fn members(&mut self, mut member: impl FnMut(&mut Self, &'a str) -> Option<()>) -> Option<()> {
        self.ws();
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        loop {
            self.ws();
            let key = self.string()?;
            self.ws();
            self.eat(b':')?;
            self.ws();
            member(self, key)?;
            self.ws();
            match self.next()? {
                b',' => {}
                b'}' => return Some(()),
                _ => return None,
            }
        }
    }

    /// A number by the JSON grammar: its text and whether it is an integer (no fraction, no
    /// exponent).
    fn number(&mut self) -> Option<(&'a str, bool)> {
        let start = self.i;
        if self.peek()? == b'-' {
            self.i += 1;
        }
        let int_start = self.i;
        match self.digits() {
            0 => return None,
            // No leading zeros.
            n if n > 1 && self.b[int_start] == b'0' => return None,
            _ => {}
        }
        let mut integer = true;
        if self.peek() == Some(b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return None;
            }
            integer = false;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if self.digits() == 0 {
                return None;
            }
            integer = false;
        }
        Some((self.text.get(start..self.i)?, integer))
    }

    /// A value of type `ty`, converted as [`crate::value::validate`] converts it, written into
    /// `slot` (in place: returning a `Value` costs a copy that the profile shows).
    fn value(&mut self, ty: &FieldType, slot: &mut Value) -> Option<()> {
        *slot = match (self.peek()?, ty) {
            (b'n', _) => self.literal(b"null").map(|()| Value::Null)?,
            (b't', FieldType::Bool) => self.literal(b"true").map(|()| Value::Bool(true))?,
            (b'f', FieldType::Bool) => self.literal(b"false").map(|()| Value::Bool(false))?,
            (b'"', FieldType::String) => Value::Str(self.string()?.into()),
            (b'"', FieldType::Timestamp) => Value::Timestamp(timestamp_from_str(self.string()?)?),
            (b'-' | b'0'..=b'9', FieldType::Int64 | FieldType::Float64 | FieldType::Timestamp) => {
                let (text, integer) = self.number()?;
                number(ty, text, integer)?
            }
            (b'[', FieldType::List(inner)) => {
                self.i += 1;
                let mut items = Vec::new();
                self.ws();
                if self.peek()? == b']' {
                    self.i += 1;
                } else {
                    loop {
                        self.ws();
                        items.push(Value::Null);
                        self.value(inner, items.last_mut()?)?;
                        self.ws();
                        match self.next()? {
                            b',' => {}
                            b']' => break,
                            _ => return None,
                        }
                    }
                }
                Value::List(items)
            }
            (b'{', FieldType::Map(inner)) => {
                self.i += 1;
                let mut entries: Vec<(Str, Value)> = Vec::new();
                self.members(|s, key| {
                    let mut value = Value::Null;
                    s.value(inner, &mut value)?;
                    // A repeated key keeps its last value.
                    match entries.iter_mut().find(|(k, _)| k == key) {
                        Some(slot) => slot.1 = value,
                        None => entries.push((key.into(), value)),
                    }
                    Some(())
                })?;
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                Value::Map(entries)
            }
            _ => return None,
        };
        Some(())
    }
}

/// A number of a numeric field. Integers beyond i64 and non-integers in integer fields are left
/// to the serde path (which reads them as floats).
fn number(ty: &FieldType, text: &str, integer: bool) -> Option<Value> {
    match ty {
        FieldType::Int64 if integer => text.parse().ok().map(Value::Int),
        FieldType::Int64 => int_from_f64(text.parse().ok()?).map(Value::Int),
        FieldType::Float64 => float_from_f64(text.parse().ok()?).map(Value::Float),
        FieldType::Timestamp if integer => {
            timestamp_from_i64(text.parse().ok()?).map(Value::Timestamp)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests;
