//! A stream's definition as the schemas a registry serves: an Avro record and a JSON Schema.
//! Optional fields may be null (a union with null first, default null); timestamps are Avro
//! `timestamp-micros` longs and JSON Schema `date-time` strings; lists are arrays and maps are
//! Avro maps or JSON objects of string keys.

use serde_json::{Value as Json, json};

use crate::stream::{FieldType, StreamDef};

/// The namespace of the Avro records a stream's definition becomes.
pub const AVRO_NAMESPACE: &str = "edge_ingest";

/// The definition as an Avro record schema (JSON text), named after the stream.
pub fn avro_schema(def: &StreamDef) -> String {
    let fields: Vec<Json> = def
        .fields
        .iter()
        .map(|f| {
            let ty = avro_type(&f.ty);
            let mut field = if f.required {
                json!({"name": f.name, "type": ty})
            } else {
                json!({"name": f.name, "type": ["null", ty], "default": null})
            };
            if !f.doc.is_empty() {
                field["doc"] = json!(f.doc);
            }
            field
        })
        .collect();
    let mut schema = json!({
        "type": "record",
        "name": def.name,
        "namespace": AVRO_NAMESPACE,
        "fields": fields,
    });
    if !def.description.is_empty() {
        schema["doc"] = json!(def.description);
    }
    schema.to_string()
}

fn avro_type(ty: &FieldType) -> Json {
    match ty {
        FieldType::String => json!("string"),
        FieldType::Bool => json!("boolean"),
        FieldType::Int64 => json!("long"),
        FieldType::Float64 => json!("double"),
        FieldType::Timestamp => json!({"type": "long", "logicalType": "timestamp-micros"}),
        FieldType::List(t) => json!({"type": "array", "items": avro_type(t)}),
        FieldType::Map(t) => json!({"type": "map", "values": avro_type(t)}),
    }
}

/// The definition as a JSON Schema (draft 7, JSON text): an object of the stream's fields, no
/// others, the required ones required.
pub fn json_schema(def: &StreamDef) -> String {
    let properties: serde_json::Map<String, Json> = def
        .fields
        .iter()
        .map(|f| {
            let mut ty = json_type(&f.ty);
            if !f.required {
                ty = json!({"oneOf": [{"type": "null"}, ty]});
            }
            if !f.doc.is_empty() {
                ty["description"] = json!(f.doc);
            }
            (f.name.clone(), ty)
        })
        .collect();
    let required: Vec<&str> = def
        .fields
        .iter()
        .filter(|f| f.required)
        .map(|f| f.name.as_str())
        .collect();
    let mut schema = json!({
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": def.name,
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    });
    if !def.description.is_empty() {
        schema["description"] = json!(def.description);
    }
    schema.to_string()
}

fn json_type(ty: &FieldType) -> Json {
    match ty {
        FieldType::String => json!({"type": "string"}),
        FieldType::Bool => json!({"type": "boolean"}),
        FieldType::Int64 => json!({"type": "integer"}),
        FieldType::Float64 => json!({"type": "number"}),
        FieldType::Timestamp => json!({"type": "string", "format": "date-time"}),
        FieldType::List(t) => json!({"type": "array", "items": json_type(t)}),
        FieldType::Map(t) => json!({"type": "object", "additionalProperties": json_type(t)}),
    }
}

/// Whether a JSON Schema property's `type` may describe values of a field type (a timestamp
/// is RFC 3339 text or epoch milli- or microseconds).
pub(crate) fn json_type_fits(declared: &str, ty: &FieldType) -> bool {
    matches!(
        (declared, ty),
        ("null", _)
            | ("string", FieldType::String | FieldType::Timestamp)
            | ("boolean", FieldType::Bool)
            | (
                "integer",
                FieldType::Int64 | FieldType::Float64 | FieldType::Timestamp
            )
            | ("number", FieldType::Float64)
            | ("array", FieldType::List(_))
            | ("object", FieldType::Map(_))
    )
}
