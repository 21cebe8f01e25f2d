//! The canonical content hash: BLAKE3 over a canonical encoding of a record's hashed fields.
//!
//! The encoding works on validated, normalized values, so JSON key order, number formatting
//! (`1`, `1.0`, `1e0` in a float64 field) and timestamp notation (RFC 3339 or epoch ms/us for
//! the same instant) do not change the hash. Encoding, for each hashed field in name order:
//! the field name (u32 LE length + UTF-8), then the value: a tag byte and a fixed-width
//! little-endian payload; strings and collections carry a u64 LE length first.

use std::fmt;
use std::str::FromStr;

use crate::stream::StreamDef;
use crate::value::{Record, Value};

/// Domain separation: a future change of the encoding gets a new prefix.
const DOMAIN: &[u8] = b"edge-ingest/record/v1\0";

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
    thread_local! {
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.clear();
        buf.extend_from_slice(DOMAIN);
        for &i in &def.hash_fields {
            let name = def.fields[i].name.as_bytes();
            buf.extend_from_slice(&(name.len() as u32).to_le_bytes());
            buf.extend_from_slice(name);
            encode(&mut buf, &record.values[i]);
        }
        ContentHash(*blake3::hash(&buf).as_bytes())
    })
}

fn encode(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Null => out.push(0),
        Value::Bool(b) => out.extend_from_slice(&[1, u8::from(*b)]),
        Value::Int(i) => {
            out.push(2);
            out.extend_from_slice(&i.to_le_bytes());
        }
        Value::Float(f) => {
            // Validation maps -0.0 to 0.0; JSON has no NaN.
            out.push(3);
            out.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::Str(s) => {
            out.push(4);
            encode_bytes(out, s.as_bytes());
        }
        Value::Timestamp(t) => {
            out.push(5);
            out.extend_from_slice(&t.to_le_bytes());
        }
        Value::List(items) => {
            out.push(6);
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                encode(out, item);
            }
        }
        Value::Map(entries) => {
            out.push(7);
            out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
            for (k, v) in entries {
                encode_bytes(out, k.as_bytes());
                encode(out, v);
            }
        }
    }
}

fn encode_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}
