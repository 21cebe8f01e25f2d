//! A stream's definition as the schemas a registry serves: an Avro record, a JSON Schema and a
//! proto3 message.
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

/// The definition as a proto3 file (`.proto` text): one message named after the stream
/// (`sensor_readings` is `SensorReadings`) in the package `edge_ingest`, its fields numbered in
/// the definition's order from 1, optional ones `optional`, timestamps
/// `google.protobuf.Timestamp`, lists `repeated` and maps `map<string, T>`.
pub fn proto_schema(def: &StreamDef) -> String {
    let message: String = def
        .name
        .split('_')
        .map(|part| {
            let mut chars = part.chars();
            chars
                .next()
                .map(|c| c.to_ascii_uppercase().to_string() + chars.as_str())
                .unwrap_or_default()
        })
        .collect();
    let mut out = String::from("syntax = \"proto3\";\n\npackage edge_ingest;\n\n");
    let timestamps = |t: &FieldType| match t {
        FieldType::List(t) | FieldType::Map(t) => **t == FieldType::Timestamp,
        t => *t == FieldType::Timestamp,
    };
    if def.fields.iter().any(|f| timestamps(&f.ty)) {
        out.push_str("import \"google/protobuf/timestamp.proto\";\n\n");
    }
    for line in def.description.lines() {
        out.push_str(&format!("// {line}\n"));
    }
    out.push_str(&format!("message {message} {{\n"));
    for (i, f) in def.fields.iter().enumerate() {
        for line in f.doc.lines() {
            out.push_str(&format!("  // {line}\n"));
        }
        let ty = match &f.ty {
            FieldType::List(t) => format!("repeated {}", proto_type(t)),
            FieldType::Map(t) => format!("map<string, {}>", proto_type(t)),
            t if !f.required && *t != FieldType::Timestamp => format!("optional {}", proto_type(t)),
            t => proto_type(t).to_owned(),
        };
        out.push_str(&format!("  {ty} {} = {};\n", f.name, i + 1));
    }
    out.push_str("}\n");
    out
}

fn proto_type(ty: &FieldType) -> &'static str {
    match ty {
        FieldType::String => "string",
        FieldType::Bool => "bool",
        FieldType::Int64 => "int64",
        FieldType::Float64 => "double",
        FieldType::Timestamp => "google.protobuf.Timestamp",
        FieldType::List(_) | FieldType::Map(_) => "bytes",
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
