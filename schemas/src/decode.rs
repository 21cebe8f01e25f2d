//! Splitting request bodies into JSON records: NDJSON and JSON arrays.

use serde_json::Value as Json;
use serde_json::value::RawValue;

use crate::error::{DecodeError, RecordError};
use crate::scan::Line;

/// The media type of a columnar body.
pub const PARQUET_CONTENT_TYPE: &str = "application/vnd.apache.parquet";

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// The body formats the gateway accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFormat {
    /// One JSON object per line (`application/x-ndjson`).
    Ndjson,
    /// One JSON array of objects (`application/json`).
    JsonArray,
    /// A Parquet file of the stream's fields (`application/vnd.apache.parquet`), see
    /// [`crate::columnar`].
    Parquet,
    /// An Avro object container file of records (`avro/binary`), see `registry::file`.
    Avro,
}

/// The media type of an Avro object container file body.
pub const AVRO_CONTENT_TYPE: &str = "avro/binary";

impl BodyFormat {
    /// Maps a `Content-Type` header value (parameters ignored) to a format.
    pub fn from_content_type(content_type: &str) -> Option<BodyFormat> {
        let essence = content_type
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match essence.as_str() {
            "application/x-ndjson" | "application/ndjson" | "application/jsonl" => {
                Some(BodyFormat::Ndjson)
            }
            "application/json" => Some(BodyFormat::JsonArray),
            PARQUET_CONTENT_TYPE => Some(BodyFormat::Parquet),
            AVRO_CONTENT_TYPE | "application/avro" | "application/vnd.apache.avro.file" => {
                Some(BodyFormat::Avro)
            }
            _ => None,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            BodyFormat::Ndjson => "application/x-ndjson",
            BodyFormat::JsonArray => "application/json",
            BodyFormat::Parquet => PARQUET_CONTENT_TYPE,
            BodyFormat::Avro => AVRO_CONTENT_TYPE,
        }
    }
}

/// The non-blank lines of an NDJSON body, without a leading byte-order mark and without `\r\n`
/// or `\n` terminators. The position in the iterator is the record index.
pub fn ndjson_lines(body: &[u8]) -> impl Iterator<Item = &[u8]> {
    ndjson_lines_in(body).map(Line::bytes)
}

/// [`ndjson_lines`] as [`Line`]s of the body, which the scanner reads without bounds checks
/// (a line near the body's end, without a whole window after it, is read as a slice).
pub fn ndjson_lines_in(body: &[u8]) -> impl Iterator<Item = Line<'_>> {
    let body = body.strip_prefix(BOM).unwrap_or(body);
    let mut start = 0;
    let ends = memchr::memchr_iter(b'\n', body).chain(std::iter::once(body.len()));
    ends.map(move |end| {
        let line = (start, end);
        start = end + 1;
        line
    })
    .map(|(start, end)| match body[start..end].last() {
        Some(b'\r') => (start, end - 1),
        _ => (start, end),
    })
    .map(|(start, end)| Line::within(body, start, end))
    .filter(|line| !line.bytes().iter().all(u8::is_ascii_whitespace))
}

/// Parses one NDJSON line.
pub fn parse_line(line: &[u8]) -> Result<Json, RecordError> {
    serde_json::from_slice(line).map_err(|e| RecordError::Malformed(e.to_string()))
}

/// Splits a body into the raw text of its records, without parsing the records themselves.
/// NDJSON: the non-blank lines. JSON array: the elements (the array must be well-formed).
/// A Parquet body must first be turned into NDJSON with [`crate::columnar::parquet_to_ndjson`].
pub fn split_body(format: BodyFormat, body: &[u8]) -> Result<Vec<&[u8]>, DecodeError> {
    match format {
        BodyFormat::Ndjson => Ok(ndjson_lines(body).collect()),
        BodyFormat::Parquet | BodyFormat::Avro => Err(DecodeError::Malformed(
            "a Parquet or Avro body must be converted to NDJSON first".into(),
        )),
        BodyFormat::JsonArray => {
            let body = body.strip_prefix(BOM).unwrap_or(body);
            match body.iter().find(|b| !b.is_ascii_whitespace()) {
                Some(b'[') => {}
                Some(b'{') => return Err(DecodeError::NotAnArray("an object".into())),
                None => return Err(DecodeError::Malformed("empty body".into())),
                Some(_) => {
                    return Err(match serde_json::from_slice::<Json>(body) {
                        Ok(_) => DecodeError::NotAnArray("a scalar".into()),
                        Err(e) => DecodeError::Malformed(e.to_string()),
                    });
                }
            }
            let items: Vec<&RawValue> =
                serde_json::from_slice(body).map_err(|e| DecodeError::Malformed(e.to_string()))?;
            Ok(items.into_iter().map(|r| r.get().as_bytes()).collect())
        }
    }
}

/// [`split_body_in`] of at most `max` records (`None` past that), the memory of the lines
/// taken from `charge` before it is allocated. NDJSON lines are split one at a time, so that
/// a body of many short lines is refused before it allocates them all; a JSON array is parsed
/// whole first and its elements charged then.
pub fn split_body_charged<'a>(
    format: BodyFormat,
    body: &'a [u8],
    max: usize,
    charge: crate::budget::Charge<'_>,
) -> Result<Option<Vec<Line<'a>>>, DecodeError> {
    let mut lines = Vec::new();
    let mut add = |line: Line<'a>| -> Result<bool, DecodeError> {
        if lines.len() == max {
            return Ok(false);
        }
        if !crate::budget::reserve(&mut lines, 1, &mut *charge) {
            return Err(DecodeError::OverBudget);
        }
        lines.push(line);
        Ok(true)
    };
    match format {
        BodyFormat::Ndjson => {
            for line in ndjson_lines_in(body) {
                if !add(line)? {
                    return Ok(None);
                }
            }
        }
        _ => {
            for item in split_body(format, body)? {
                if !add(Line::from(item))? {
                    return Ok(None);
                }
            }
        }
    }
    Ok(Some(lines))
}

/// [`split_body`] as [`Line`]s: an NDJSON body's lines read through windows on the body
/// ([`ndjson_lines_in`]), a JSON array's elements as slices.
pub fn split_body_in(format: BodyFormat, body: &[u8]) -> Result<Vec<Line<'_>>, DecodeError> {
    match format {
        BodyFormat::Ndjson => Ok(ndjson_lines_in(body).collect()),
        _ => Ok(split_body(format, body)?
            .into_iter()
            .map(Line::from)
            .collect()),
    }
}

/// Decodes a body into records. NDJSON yields one result per non-blank line, so a malformed line
/// rejects only itself; a JSON array body must parse as a whole.
pub fn decode_body(
    format: BodyFormat,
    body: &[u8],
) -> Result<Vec<Result<Json, RecordError>>, DecodeError> {
    Ok(split_body(format, body)?
        .into_iter()
        .map(parse_line)
        .collect())
}
