//! Bounded decompression of request bodies, shared by the gateway and the agent's local HTTP
//! port: a zstd or gzip bomb stops at the limit instead of filling memory.

use std::io::Read;

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
}

/// Decompresses `body` into `out` (cleared first), stopping as soon as the output passes
/// `limit`. `zstd` is a decompression context kept by the caller between bodies (created on first
/// use). A zstd body compressed with a dictionary is decoded with the stream's dictionary of
/// that id.
pub fn decompress_into(
    encoding: Encoding,
    body: &[u8],
    limit: usize,
    zstd: &mut Option<zstd::bulk::Decompressor<'static>>,
    dictionaries: &Dictionaries,
    out: &mut Vec<u8>,
) -> Result<(), DecompressError> {
    out.clear();
    let dictionary_id = match encoding {
        Encoding::Zstd => frame_dictionary_id(body),
        Encoding::Identity | Encoding::Gzip => None,
    };
    let reader: Box<dyn Read + '_> = match (encoding, dictionary_id) {
        (Encoding::Identity, _) => Box::new(body),
        (Encoding::Zstd, Some(id)) => {
            let dictionary = dictionaries
                .get(id)
                .ok_or(DecompressError::UnknownDictionary(id))?;
            Box::new(
                zstd::stream::read::Decoder::with_prepared_dictionary(body, dictionary.decoder())
                    .map_err(|e| DecompressError::Invalid(format!("invalid zstd body: {e}")))?,
            )
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
                    out.reserve(size);
                    if dctx.decompress_to_buffer(body, out).is_ok() && out.len() == size {
                        return Ok(());
                    }
                    out.clear();
                }
            }
            Box::new(
                zstd::stream::read::Decoder::with_buffer(body)
                    .map_err(|e| DecompressError::Invalid(format!("invalid zstd body: {e}")))?,
            )
        }
        (Encoding::Gzip, _) => Box::new(flate2::read::MultiGzDecoder::new(body)),
    };
    out.reserve(body.len().saturating_mul(4).min(limit));
    reader
        .take(limit as u64 + 1)
        .read_to_end(out)
        .map_err(|e| DecompressError::Invalid(format!("cannot decompress body: {e}")))?;
    if out.len() > limit {
        return Err(DecompressError::TooLarge(limit));
    }
    Ok(())
}
