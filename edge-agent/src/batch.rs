//! A closed batch: the unit that is spooled, sent and acknowledged.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;

/// How a batch body is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BodyEncoding {
    /// zstd-compressed NDJSON (`application/x-ndjson`, `Content-Encoding: zstd`).
    #[default]
    Ndjson,
    /// A Parquet file with zstd pages (`application/vnd.apache.parquet`), sorted by the
    /// partition key and event time so that delta encodings pay off.
    Parquet,
}

impl BodyEncoding {
    pub fn code(self) -> u8 {
        match self {
            BodyEncoding::Ndjson => 0,
            BodyEncoding::Parquet => 1,
        }
    }

    pub fn from_code(code: u8) -> Option<BodyEncoding> {
        match code {
            0 => Some(BodyEncoding::Ndjson),
            1 => Some(BodyEncoding::Parquet),
            _ => None,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            BodyEncoding::Ndjson => "application/x-ndjson",
            BodyEncoding::Parquet => schemas::decode::PARQUET_CONTENT_TYPE,
        }
    }

    /// The encoding whose [`BodyEncoding::content_type`] this is.
    pub fn from_content_type(content_type: &str) -> Option<BodyEncoding> {
        [BodyEncoding::Ndjson, BodyEncoding::Parquet]
            .into_iter()
            .find(|e| e.content_type() == content_type)
    }

    /// The `Content-Encoding` of the body: Parquet compresses its own pages.
    pub fn content_encoding(self) -> &'static str {
        match self {
            BodyEncoding::Ndjson => "zstd",
            BodyEncoding::Parquet => "identity",
        }
    }
}

/// The id of a batch: BLAKE3 of its uncompressed NDJSON, sent as `Idempotency-Key`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchId(pub [u8; 32]);

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A closed, encoded batch of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub id: BatchId,
    pub encoding: BodyEncoding,
    pub body: Vec<u8>,
    pub records: u32,
    /// Size of the batch as uncompressed NDJSON.
    pub raw_bytes: u32,
    /// When the batch was closed, in milliseconds since the Unix epoch.
    pub created_ms: u64,
}

/// A batch body that cannot be read back (a spool entry written by another version, or damage
/// that slipped past the checksum).
#[derive(Debug, thiserror::Error)]
#[error("unreadable batch body: {0}")]
pub struct UnreadableBatch(String);

impl Batch {
    /// The batch as uncompressed NDJSON, one canonical record per line.
    pub fn ndjson(&self, def: &schemas::StreamDef) -> Result<Vec<u8>, UnreadableBatch> {
        match self.encoding {
            BodyEncoding::Ndjson => self.decompress(def),
            #[cfg(feature = "parquet")]
            BodyEncoding::Parquet => schemas::columnar::parquet_to_ndjson(
                def,
                bytes::Bytes::copy_from_slice(&self.body),
                usize::MAX,
            )
            .map_err(|e| UnreadableBatch(e.to_string())),
            #[cfg(not(feature = "parquet"))]
            BodyEncoding::Parquet => Err(UnreadableBatch(
                "a Parquet batch, and this edge-agent is built without Parquet (cargo feature `parquet`)".into(),
            )),
        }
    }

    /// An NDJSON batch's body decompressed, with the stream's dictionary it names if any.
    fn decompress(&self, def: &schemas::StreamDef) -> Result<Vec<u8>, UnreadableBatch> {
        let unreadable = |e: std::io::Error| UnreadableBatch(e.to_string());
        let capacity = self.raw_bytes as usize;
        match schemas::dictionary::frame_dictionary_id(&self.body) {
            None => zstd::bulk::decompress(&self.body, capacity).map_err(unreadable),
            Some(id) => {
                let dictionary = def.dictionaries.get(id).ok_or_else(|| {
                    UnreadableBatch(format!(
                        "compressed with zstd dictionary {id}, which stream {} no longer has",
                        def.name
                    ))
                })?;
                zstd::bulk::Decompressor::with_prepared_dictionary(dictionary.decoder())
                    .and_then(|mut d| d.decompress(&self.body, capacity))
                    .map_err(unreadable)
            }
        }
    }

    /// The batch body without a dictionary: what is sent to a gateway that does not have the
    /// stream's dictionary.
    pub fn without_dictionary(
        &self,
        def: &schemas::StreamDef,
        level: i32,
    ) -> Result<Vec<u8>, UnreadableBatch> {
        let ndjson = self.decompress(def)?;
        zstd::bulk::compress(&ndjson, level).map_err(|e| UnreadableBatch(e.to_string()))
    }

    /// The batch's records, validated and hashed again.
    pub fn records(
        &self,
        def: &schemas::StreamDef,
    ) -> Result<Vec<schemas::ValidRecord>, UnreadableBatch> {
        let ndjson = self.ndjson(def)?;
        schemas::decode::ndjson_lines(&ndjson)
            .map(|line| schemas::check_bytes(def, line).map_err(|e| UnreadableBatch(e.to_string())))
            .collect()
    }
}

/// Milliseconds since the epoch (0 before it).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
