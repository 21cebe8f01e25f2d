//! The schema registry wire format (Confluent's, which Apicurio, Karapace and Redpanda's
//! registry speak too): a Kafka value framed as a zero byte, the schema's id as 4 bytes
//! big-endian, then the value encoded under that schema. A JSON value never starts with a zero
//! byte, so one topic may carry both.
//!
//! - [`frame`]: the id and encoded bytes of a framed value;
//! - [`Writer`]: a registered schema made ready to read values into a stream's records, or the
//!   reason it cannot be ([`Writer::compile`]);
//! - [`export`]: a stream's definition as an Avro schema and as a JSON Schema.
//!
//! A value read under a schema becomes the same JSON object the gateway would have produced
//! (timestamps as RFC 3339 text, nulls left out) and is validated and hashed as JSON records
//! are: the same reading sent as JSON and as Avro has one content hash, so it lands once.

mod avro;
pub mod export;
mod file;
mod proto;
mod proto_wire;

pub use avro::added_fields;
pub use file::avro_file_to_ndjson;

use crate::error::RecordError;
use crate::hash::{Hashing, content_hash_in};
use crate::stream::{StreamDef, ValueFormat};
use crate::{Row, RowFields, typed};

/// The first byte of a framed value.
pub const MAGIC: u8 = 0;

/// The schema id and the encoded value of a framed `payload`; `None` when it does not start
/// with [`MAGIC`] (a JSON value), an error when it is too short to hold an id.
pub fn frame(payload: &[u8]) -> Option<Result<(u32, &[u8]), RecordError>> {
    let (&first, rest) = payload.split_first()?;
    if first != MAGIC {
        return None;
    }
    Some(match rest.split_first_chunk::<4>() {
        Some((id, body)) => Ok((u32::from_be_bytes(*id), body)),
        None => Err(RecordError::WireFormat(format!(
            "a registry-framed value holds a 4-byte schema id after its zero byte; this one has {} bytes in all",
            payload.len()
        ))),
    })
}

/// The kind of a registered schema, as the registry API names it in `schemaType` (absent for
/// Avro).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaKind {
    Avro,
    Json,
    Protobuf,
}

impl SchemaKind {
    /// From the registry API's `schemaType`; `None` (absent) is Avro.
    pub fn parse(schema_type: Option<&str>) -> Result<SchemaKind, String> {
        match schema_type.map(str::to_ascii_uppercase).as_deref() {
            None | Some("AVRO") => Ok(SchemaKind::Avro),
            Some("JSON") => Ok(SchemaKind::Json),
            Some("PROTOBUF") => Ok(SchemaKind::Protobuf),
            Some(other) => Err(format!("unknown schemaType '{other}'")),
        }
    }

    /// The registry API's `schemaType`.
    pub fn name(self) -> &'static str {
        match self {
            SchemaKind::Avro => "AVRO",
            SchemaKind::Json => "JSON",
            SchemaKind::Protobuf => "PROTOBUF",
        }
    }

    /// The value format of the stream definition that values of this kind are.
    fn format(self) -> Option<ValueFormat> {
        match self {
            SchemaKind::Avro => Some(ValueFormat::Avro),
            SchemaKind::Json => Some(ValueFormat::JsonSchema),
            SchemaKind::Protobuf => Some(ValueFormat::Protobuf),
        }
    }
}

/// A registered schema, ready to read the values framed with its id into records of one
/// definition of a stream.
#[derive(Debug)]
pub enum Writer {
    /// Avro binary, read as the schema says.
    Avro(avro::Reader),
    /// Protobuf, its message named by the message indexes before it.
    Protobuf(proto_wire::ProtoReader),
    /// A JSON object, checked by the stream's definition as a JSON value is.
    Json,
    /// The schema cannot be read into the stream's records: every value framed with it is a
    /// dead letter with this reason.
    Refused(String),
}

impl Writer {
    /// Prepares the schema `text` of `kind` for `def`. A schema whose fields the definition
    /// cannot take (a type that does not fit, a required field it lacks) or of a format the
    /// stream does not take is [`Writer::Refused`]. Fields the definition lacks are read,
    /// and a record that sets one is invalid as a JSON record setting it is (a newer
    /// definition may add the field).
    pub fn compile(kind: SchemaKind, text: &str, def: &StreamDef) -> Writer {
        let takes = kind
            .format()
            .is_some_and(|f| def.value_formats.contains(&f));
        if !takes {
            return Writer::Refused(format!(
                "stream '{}' takes {} values, not {} ones (value_formats)",
                def.name,
                formats_text(def),
                kind.name()
            ));
        }
        let compiled = match kind {
            SchemaKind::Avro => avro::Reader::compile(text, def).map(Writer::Avro),
            SchemaKind::Json => check_json_schema(text, def).map(|()| Writer::Json),
            SchemaKind::Protobuf => {
                proto_wire::ProtoReader::compile(text, def).map(Writer::Protobuf)
            }
        };
        compiled.unwrap_or_else(Writer::Refused)
    }

    /// Whether values framed with this schema can be read at all.
    pub fn refused(&self) -> Option<&str> {
        match self {
            Writer::Refused(reason) => Some(reason),
            _ => None,
        }
    }

    /// Reads `body` (a framed value after its id) into a row of `def`, its content hash made
    /// as `hashing` makes hashes.
    pub fn check_row_in<'a, H: Hashing>(
        &self,
        def: &StreamDef,
        id: u32,
        body: &[u8],
        hashing: &mut H,
    ) -> Result<Row<'a, H::Hash>, RecordError> {
        let json;
        let text = match self {
            Writer::Refused(reason) => {
                return Err(RecordError::Schema {
                    id,
                    reason: reason.clone(),
                });
            }
            Writer::Json => body,
            Writer::Avro(reader) => {
                json = reader.to_json(body).map_err(|reason| RecordError::Schema {
                    id,
                    reason: format!("the value does not match its Avro schema: {reason}"),
                })?;
                &json
            }
            Writer::Protobuf(reader) => {
                json = reader.to_json(body).map_err(|reason| RecordError::Schema {
                    id,
                    reason: format!("the value does not match its Protobuf schema: {reason}"),
                })?;
                &json
            }
        };
        let record = typed::decode_record_serde(def, text)?;
        Ok(Row {
            hash: content_hash_in(def, &record, hashing),
            fields: RowFields::Record(record),
        })
    }
}

/// The stream's value formats, for messages: `json, avro`.
fn formats_text(def: &StreamDef) -> String {
    def.value_formats
        .iter()
        .map(|f| f.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A value the stream's definition reads as JSON (the gateway's, or a JSON Schema value
/// after its frame) or refuses: one framed with a registry schema id goes to `framed`, any other
/// must be JSON that the stream takes.
pub fn unframed_taken(def: &StreamDef, payload: &[u8]) -> Result<(), RecordError> {
    if def.value_formats.contains(&ValueFormat::Json) {
        return Ok(());
    }
    Err(RecordError::WireFormat(format!(
        "stream '{}' takes {} values in the registry wire format (a zero byte, then a 4-byte schema id); this value starts with byte 0x{:02x}",
        def.name,
        formats_text(def),
        payload.first().copied().unwrap_or_default()
    )))
}

/// Checks a JSON Schema against a stream's definition: a JSON object whose `properties` (if
/// given) are fields of the stream, with each required field of the stream among them, and
/// whose `type`s (where a property gives one) fit the fields' types.
fn check_json_schema(text: &str, def: &StreamDef) -> Result<(), String> {
    let schema: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("the JSON Schema is not JSON: {e}"))?;
    let Some(properties) = schema.get("properties").and_then(|p| p.as_object()) else {
        return Ok(());
    };
    for (name, property) in properties {
        let Some(i) = def.field_index(name) else {
            return Err(format!(
                "its property '{name}' is not a field of stream '{}'",
                def.name
            ));
        };
        let ty = &def.fields[i].ty;
        if let Some(declared) = property.get("type").and_then(|t| t.as_str())
            && !export::json_type_fits(declared, ty)
        {
            return Err(format!(
                "its property '{name}' is of type {declared}, the stream's field is {ty}"
            ));
        }
    }
    match def
        .fields
        .iter()
        .find(|f| f.required && !properties.contains_key(&f.name))
    {
        Some(f) => Err(format!("it lacks the stream's required field '{}'", f.name)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests;
