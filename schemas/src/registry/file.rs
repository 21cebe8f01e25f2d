//! Avro object container files as request bodies (`avro/binary`): the file's own schema read
//! against the stream's definition, its records turned into NDJSON lines that are then checked
//! as any NDJSON body's. Codecs: `null`, `deflate`, `snappy` and `zstandard`, each block
//! decompressed within what is left of the body's decoded-size limit.

use super::avro::{Input, Reader};
use crate::error::DecodeError;
use crate::stream::StreamDef;

const MAGIC: &[u8; 4] = b"Obj\x01";
const SYNC_BYTES: usize = 16;

fn malformed(reason: impl Into<String>) -> DecodeError {
    DecodeError::Avro(reason.into())
}

/// The records of the Avro object container file `body` as NDJSON (one JSON object per
/// line, nulls left out), at most `max_bytes` of it.
pub fn avro_file_to_ndjson(
    def: &StreamDef,
    body: &[u8],
    max_bytes: usize,
) -> Result<Vec<u8>, DecodeError> {
    let rest = body
        .strip_prefix(MAGIC)
        .ok_or_else(|| malformed("not an Avro object container file (no 'Obj' magic)"))?;
    let mut input = Input::value(rest);
    let (mut schema, mut codec) = (None, None);
    loop {
        let n = block_count(&mut input)?;
        if n == 0 {
            break;
        }
        for _ in 0..n {
            let key = input.string().map_err(malformed)?.to_owned();
            let len = input.len().map_err(malformed)?;
            let value = input.take(len).map_err(malformed)?;
            match key.as_str() {
                "avro.schema" => schema = Some(value),
                "avro.codec" => codec = Some(value),
                _ => {}
            }
        }
    }
    let sync = input.take(SYNC_BYTES).map_err(malformed)?.to_owned();
    let schema = std::str::from_utf8(schema.ok_or_else(|| malformed("no avro.schema"))?)
        .map_err(|_| malformed("avro.schema is not UTF-8"))?;
    let reader = Reader::compile(schema, def)
        .map_err(|e| malformed(format!("its schema does not fit the stream: {e}")))?;
    let codec = codec.unwrap_or(b"null");
    let mut out = Vec::new();
    let mut block = Vec::new();
    while !input.bytes.is_empty() {
        let count = block_count(&mut input)?;
        let size = input.len().map_err(malformed)?;
        let data = input.take(size).map_err(malformed)?;
        let left = max_bytes.saturating_sub(out.len());
        let data = decompress(codec, data, left, &mut block)?;
        let mut records = Input {
            bytes: data,
            max_json: max_bytes,
        };
        for _ in 0..count {
            reader.read_record(&mut records, &mut out).map_err(|e| {
                match out.len() > max_bytes {
                    true => DecodeError::TooLarge(max_bytes),
                    false => malformed(format!("a record does not match its schema: {e}")),
                }
            })?;
            out.push(b'\n');
            if out.len() > max_bytes {
                return Err(DecodeError::TooLarge(max_bytes));
            }
        }
        if !records.bytes.is_empty() {
            return Err(malformed("a block holds more than its records"));
        }
        if input.take(SYNC_BYTES).map_err(malformed)? != sync.as_slice() {
            return Err(malformed("a block does not end in the file's sync marker"));
        }
    }
    Ok(out)
}

/// A block's item count (a negative one is followed by the block's size, which is skipped).
fn block_count(input: &mut Input<'_>) -> Result<u64, DecodeError> {
    let n = input.long().map_err(malformed)?;
    if n < 0 {
        input.long().map_err(malformed)?;
    }
    Ok(n.unsigned_abs())
}

/// A block's data as `codec` compressed it, into `scratch` unless stored as it is: an error
/// when it would decompress to more than `limit` bytes.
fn decompress<'a>(
    codec: &[u8],
    data: &'a [u8],
    limit: usize,
    scratch: &'a mut Vec<u8>,
) -> Result<&'a [u8], DecodeError> {
    let too_large = || DecodeError::TooLarge(limit);
    match codec {
        b"null" => return Ok(data),
        b"deflate" => {
            *scratch = miniz_oxide::inflate::decompress_to_vec_with_limit(data, limit).map_err(
                |e| match e.status {
                    miniz_oxide::inflate::TINFLStatus::HasMoreOutput => too_large(),
                    _ => malformed("a deflate block is corrupt"),
                },
            )?;
        }
        b"snappy" => {
            // The block ends in the CRC-32 of its uncompressed data.
            let (compressed, _crc) = data
                .split_last_chunk::<4>()
                .ok_or_else(|| malformed("a snappy block is shorter than its checksum"))?;
            let len = snap::raw::decompress_len(compressed)
                .map_err(|_| malformed("a snappy block is corrupt"))?;
            if len > limit {
                return Err(too_large());
            }
            *scratch = snap::raw::Decoder::new()
                .decompress_vec(compressed)
                .map_err(|_| malformed("a snappy block is corrupt"))?;
        }
        b"zstandard" => {
            scratch.clear();
            let mut decoder = zstd::stream::read::Decoder::new(data)
                .map_err(|_| malformed("a zstandard block is corrupt"))?;
            let read = std::io::Read::read_to_end(
                &mut std::io::Read::take(&mut decoder, limit as u64 + 1),
                scratch,
            )
            .map_err(|_| malformed("a zstandard block is corrupt"))?;
            if read > limit {
                return Err(too_large());
            }
        }
        other => {
            return Err(malformed(format!(
                "codec '{}' is not read (null, deflate, snappy, zstandard are)",
                String::from_utf8_lossy(other)
            )));
        }
    }
    let decompressed: &'a Vec<u8> = scratch;
    Ok(decompressed)
}
