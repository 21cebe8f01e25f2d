//! Bounded decompression of request bodies, shared by the gateway and the agent's local HTTP
//! port: a zstd or gzip bomb stops at the limit instead of filling memory.

use std::io::Read;

use schemas::budget::{self, Charge};
use schemas::dictionary::{Dictionaries, frame_dictionary_id};

/// How a body is compressed (`Content-Encoding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Identity,
    Zstd,
    Gzip,
}

impl Encoding {
    /// The encoding a `Content-Encoding` header names (absent: identity); `None` when unsupported.
    pub fn from_header(value: Option<&axum::http::HeaderValue>) -> Option<Encoding> {
        let Some(value) = value else {
            return Some(Encoding::Identity);
        };
        match value.to_str().ok()?.trim().to_ascii_lowercase().as_str() {
            "" | "identity" => Some(Encoding::Identity),
            "zstd" => Some(Encoding::Zstd),
            "gzip" | "x-gzip" => Some(Encoding::Gzip),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecompressError {
    #[error("decompressed body is larger than {0} bytes")]
    TooLarge(usize),
    #[error("{0}")]
    Invalid(String),
    /// The body is compressed with a zstd dictionary this stream does not have (not deployed
    /// here yet, or never): the sender can send it without.
    #[error("zstd dictionary {0} is not known for this stream")]
    UnknownDictionary(u32),
    /// The caller's memory budget did not take the decompressed bytes ([`schemas::budget`]).
    #[error("the decompressed body does not fit in the memory free for requests now")]
    OverBudget,
}

/// Bytes decompressed at a time on the streaming path.
const STEP: usize = 64 << 10;

fn invalid_zstd(e: std::io::Error) -> DecompressError {
    DecompressError::Invalid(format!("invalid zstd body: {e}"))
}

/// A gzip decoder's window.
const GZIP_WINDOW: usize = 32 << 10;

/// Decompresses `body` into `out` (cleared first), stopping as soon as the output passes
/// `limit`. `zstd` is a decompression context kept by the caller between bodies (created on first
/// use). A zstd body compressed with a dictionary is decoded with the stream's dictionary of
/// that id. Every growth of `out` is taken from `charge` before it is allocated
/// ([`DecompressError::OverBudget`] when the budget does not take it; `out` keeps the capacity
/// it had, uncharged).
pub fn decompress_into(
    encoding: Encoding,
    body: &[u8],
    limit: usize,
    zstd: &mut Option<zstd::bulk::Decompressor<'static>>,
    dictionaries: &Dictionaries,
    out: &mut Vec<u8>,
    charge: Charge<'_>,
) -> Result<(), DecompressError> {
    out.clear();
    let dictionary_id = match encoding {
        Encoding::Zstd => frame_dictionary_id(body),
        Encoding::Identity | Encoding::Gzip => None,
    };
    // A streaming zstd decoder keeps a window of the frame's stated size besides the output,
    // filled as it decodes (pages of it that are never written take no memory): charged as it
    // fills, as much as the output at most.
    let (reader, window): (Box<dyn Read + '_>, usize) = match (encoding, dictionary_id) {
        (Encoding::Identity, _) => (Box::new(body), 0),
        (Encoding::Zstd, Some(id)) => {
            let dictionary = dictionaries
                .get(id)
                .ok_or(DecompressError::UnknownDictionary(id))?;
            let decoder =
                zstd::stream::read::Decoder::with_prepared_dictionary(body, dictionary.decoder())
                    .map_err(invalid_zstd)?;
            (Box::new(decoder), limit)
        }
        (Encoding::Zstd, None) => {
            // A single frame that states its size (what zstd tools and libraries write) is
            // decoded in one call into a buffer of exactly that size; a frame that grows past
            // its stated size fails there. Anything else takes the streaming path.
            let stated = zstd::zstd_safe::get_frame_content_size(body).ok().flatten();
            if let Some(size) = stated.and_then(|s| usize::try_from(s).ok()) {
                if size > limit {
                    return Err(DecompressError::TooLarge(limit));
                }
                if zstd.is_none() {
                    *zstd = zstd::bulk::Decompressor::new().ok();
                }
                if let Some(dctx) = zstd.as_mut() {
                    if !budget::reserve(out, size, charge) {
                        return Err(DecompressError::OverBudget);
                    }
                    if dctx.decompress_to_buffer(body, out).is_ok() && out.len() == size {
                        return Ok(());
                    }
                    out.clear();
                }
            }
            let decoder = zstd::stream::read::Decoder::with_buffer(body).map_err(invalid_zstd)?;
            (Box::new(decoder), limit)
        }
        (Encoding::Gzip, _) => (
            Box::new(flate2::read::MultiGzDecoder::new(body)),
            GZIP_WINDOW,
        ),
    };
    // A step at a time through a buffer of its own, so that `out` grows only for bytes the
    // decoder produced.
    let mut reader = reader;
    let mut step = vec![0u8; STEP];
    let mut window_charged = 0;
    loop {
        let read = match reader.read(&mut step) {
            Ok(0) => return Ok(()),
            Ok(read) => read,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(DecompressError::Invalid(format!(
                    "cannot decompress body: {e}"
                )));
            }
        };
        if out.len() + read > limit {
            return Err(DecompressError::TooLarge(limit));
        }
        let window_grows = read.min(window - window_charged);
        if !charge(window_grows) || !budget::reserve(out, read, charge) {
            return Err(DecompressError::OverBudget);
        }
        window_charged += window_grows;
        out.extend_from_slice(&step[..read]);
    }
}
