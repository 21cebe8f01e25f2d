use apache_avro::types::Value as Avro;
use apache_avro::{Schema, to_avro_datum};

use super::export::{avro_schema, json_schema};
use super::*;
use crate::{AtOnce, check_bytes};

const DEF: &str = r#"
name = "readings"
version = 1
event_time_field = "ts"
partition_key_field = "device_id"
value_formats = ["json", "avro", "json-schema"]
[[fields]]
name = "device_id"
type = "string"
required = true
[[fields]]
name = "ts"
type = "timestamp"
required = true
[[fields]]
name = "value"
type = "float64"
required = true
[[fields]]
name = "quality"
type = "int64"
[[fields]]
name = "tags"
type = "map<string>"
"#;

fn def() -> StreamDef {
    StreamDef::from_toml(DEF).unwrap()
}

/// The reading as Avro values of the definition's exported schema.
fn reading(quality: Option<i64>) -> Vec<(String, Avro)> {
    let tags = [("site".to_owned(), Avro::String("north".into()))];
    vec![
        ("device_id".into(), Avro::String("d-1".into())),
        ("ts".into(), Avro::TimestampMicros(1_700_000_000_123_456)),
        ("value".into(), Avro::Double(21.5)),
        (
            "quality".into(),
            match quality {
                Some(q) => Avro::Union(1, Box::new(Avro::Long(q))),
                None => Avro::Union(0, Box::new(Avro::Null)),
            },
        ),
        (
            "tags".into(),
            Avro::Union(1, Box::new(Avro::Map(tags.into_iter().collect()))),
        ),
    ]
}

fn encode(schema: &str, fields: Vec<(String, Avro)>) -> Vec<u8> {
    let schema = Schema::parse_str(schema).unwrap();
    to_avro_datum(&schema, Avro::Record(fields)).unwrap()
}

#[test]
fn an_avro_value_hashes_as_the_same_json_reading() {
    let def = def();
    let schema = avro_schema(&def);
    let writer = Writer::compile(SchemaKind::Avro, &schema, &def);
    assert!(writer.refused().is_none(), "{writer:?}");
    let json = br#"{"device_id":"d-1","ts":"2023-11-14T22:13:20.123456Z","value":21.5,"quality":192,"tags":{"site":"north"}}"#;
    let expected = check_bytes(&def, json).unwrap().hash;
    let row = writer
        .check_row_in(&def, 7, &encode(&schema, reading(Some(192))), &mut AtOnce)
        .unwrap();
    assert_eq!(row.hash, expected);
    // A null optional field is left out, as a JSON record without it.
    let json = br#"{"device_id":"d-1","ts":"2023-11-14T22:13:20.123456Z","value":21.5,"tags":{"site":"north"}}"#;
    let row = writer
        .check_row_in(&def, 7, &encode(&schema, reading(None)), &mut AtOnce)
        .unwrap();
    assert_eq!(row.hash, check_bytes(&def, json).unwrap().hash);
}

#[test]
fn millisecond_timestamps_and_int_values_are_read_as_the_stream_types() {
    let def = def();
    let schema = r#"{"type":"record","name":"r","fields":[
        {"name":"device_id","type":"string"},
        {"name":"ts","type":{"type":"long","logicalType":"timestamp-millis"}},
        {"name":"value","type":"int"}]}"#;
    let writer = Writer::compile(SchemaKind::Avro, schema, &def);
    let body = encode(
        schema,
        vec![
            ("device_id".into(), Avro::String("d-1".into())),
            ("ts".into(), Avro::TimestampMillis(1_700_000_000_123)),
            ("value".into(), Avro::Int(21)),
        ],
    );
    let json = br#"{"device_id":"d-1","ts":"2023-11-14T22:13:20.123Z","value":21.0}"#;
    let row = writer.check_row_in(&def, 1, &body, &mut AtOnce).unwrap();
    assert_eq!(row.hash, check_bytes(&def, json).unwrap().hash);
}

#[test]
fn schemas_the_definition_cannot_take_are_refused_with_the_field() {
    let def = def();
    let wrong_type = r#"{"type":"record","name":"r","fields":[
        {"name":"device_id","type":"string"},{"name":"ts","type":"long"},
        {"name":"value","type":"string"}]}"#;
    let refused = |kind, text: &str| {
        Writer::compile(kind, text, &def)
            .refused()
            .map(str::to_owned)
            .unwrap_or_default()
    };
    assert!(
        refused(SchemaKind::Avro, wrong_type).contains("field 'ts' is int or long"),
        "{}",
        refused(SchemaKind::Avro, wrong_type)
    );
    let lacking = r#"{"type":"record","name":"r","fields":[{"name":"device_id","type":"string"}]}"#;
    assert!(refused(SchemaKind::Avro, lacking).contains("required field 'ts'"));
    assert!(refused(SchemaKind::Avro, r#""string""#).contains("not an Avro record"));
    assert!(refused(SchemaKind::Avro, "{").contains("not an Avro schema"));
    assert!(refused(SchemaKind::Protobuf, "syntax = \"proto3\";").contains("not PROTOBUF ones"));
    let json_only = StreamDef::from_toml(
        &DEF.replace(r#"value_formats = ["json", "avro", "json-schema"]"#, ""),
    )
    .unwrap();
    let writer = Writer::compile(SchemaKind::Avro, &avro_schema(&json_only), &json_only);
    assert!(
        writer
            .refused()
            .unwrap()
            .contains("takes json values, not AVRO")
    );
    let err = writer
        .check_row_in(&json_only, 9, b"", &mut AtOnce)
        .unwrap_err();
    assert_eq!(err.code(), "schema");
    assert!(err.to_string().starts_with("schema id 9: "), "{err}");
}

#[test]
fn bytes_that_do_not_match_their_schema_are_invalid_with_a_reason() {
    let def = def();
    let schema = avro_schema(&def);
    let writer = Writer::compile(SchemaKind::Avro, &schema, &def);
    let body = encode(&schema, reading(Some(1)));
    for (bytes, reason) in [
        (&body[..body.len() - 3], "with 3 bytes left"),
        (&[body.as_slice(), b"x"].concat()[..], "1 bytes are left"),
        (&[0xff; 12][..], "more than"),
    ] {
        let err = writer
            .check_row_in(&def, 3, bytes, &mut AtOnce)
            .unwrap_err();
        assert!(matches!(err, RecordError::Schema { id: 3, .. }), "{err}");
        assert!(err.to_string().contains(reason), "{err}");
    }
}

#[test]
fn a_value_is_framed_by_a_zero_byte_and_a_four_byte_id() {
    assert_eq!(frame(b"{\"a\":1}"), None);
    assert_eq!(frame(&[0, 0, 0, 1, 2, 9]), Some(Ok((258, &[9][..]))));
    let err = frame(&[0, 0, 1]).unwrap().unwrap_err();
    assert_eq!(err.code(), "wire_format");
    let json_only = StreamDef::from_toml(&DEF.replace("\"json\", ", "")).unwrap();
    assert!(unframed_taken(&def(), b"{").is_ok());
    let err = unframed_taken(&json_only, b"{").unwrap_err();
    assert!(err.to_string().contains("starts with byte 0x7b"), "{err}");
}

#[test]
fn json_schema_values_are_checked_by_the_definition() {
    let def = def();
    let writer = Writer::compile(SchemaKind::Json, &json_schema(&def), &def);
    assert!(writer.refused().is_none(), "{writer:?}");
    let json = br#"{"device_id":"d-1","ts":"2023-11-14T22:13:20Z","value":1.5}"#;
    let row = writer.check_row_in(&def, 2, json, &mut AtOnce).unwrap();
    assert_eq!(row.hash, check_bytes(&def, json).unwrap().hash);
    let wrong = r#"{"properties":{"device_id":{"type":"integer"},"ts":{},"value":{}}}"#;
    let refused = Writer::compile(SchemaKind::Json, wrong, &def);
    assert!(
        refused
            .refused()
            .unwrap()
            .contains("'device_id' is of type integer")
    );
    let unknown = r#"{"properties":{"device_id":{},"ts":{},"value":{},"x":{}}}"#;
    let refused = Writer::compile(SchemaKind::Json, unknown, &def);
    assert!(refused.refused().unwrap().contains("'x' is not a field"));
}

#[test]
fn the_exported_avro_schema_parses_and_names_optional_fields_nullable() {
    let def = def();
    let schema = Schema::parse_str(&avro_schema(&def)).unwrap();
    let Schema::Record(record) = schema else {
        panic!("not a record")
    };
    assert_eq!(record.name.name, "readings");
    assert!(matches!(record.fields[1].schema, Schema::TimestampMicros));
    assert!(matches!(record.fields[3].schema, Schema::Union(_)));
}

#[test]
fn avro_container_files_of_every_codec_become_ndjson_records() {
    use apache_avro::{Codec, DeflateSettings, Writer as FileWriter, ZstandardSettings};
    let def = def();
    let schema = Schema::parse_str(&avro_schema(&def)).unwrap();
    let json = br#"{"device_id":"d-1","ts":"2023-11-14T22:13:20.123456Z","value":21.5,"quality":192,"tags":{"site":"north"}}"#;
    let expected = check_bytes(&def, json).unwrap().hash;
    for codec in [
        Codec::Null,
        Codec::Deflate(DeflateSettings::default()),
        Codec::Snappy,
        Codec::Zstandard(ZstandardSettings::default()),
    ] {
        let mut writer = FileWriter::with_codec(&schema, Vec::new(), codec);
        for _ in 0..3 {
            writer.append(Avro::Record(reading(Some(192)))).unwrap();
        }
        let file = writer.into_inner().unwrap();
        let ndjson = avro_file_to_ndjson(&def, &file, 1 << 20).unwrap();
        let lines: Vec<&[u8]> = ndjson
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .collect();
        assert_eq!(lines.len(), 3, "{codec:?}");
        for line in lines {
            assert_eq!(check_bytes(&def, line).unwrap().hash, expected, "{codec:?}");
        }
        // The decoded size is bounded, and a cut file is malformed.
        assert!(matches!(
            avro_file_to_ndjson(&def, &file, 50),
            Err(crate::DecodeError::TooLarge(50))
        ));
        let cut = avro_file_to_ndjson(&def, &file[..file.len() - 5], 1 << 20).unwrap_err();
        assert!(cut.to_string().starts_with("malformed Avro body"), "{cut}");
    }
    let not_avro = avro_file_to_ndjson(&def, b"PAR1", 1 << 20).unwrap_err();
    assert!(
        not_avro.to_string().contains("no 'Obj' magic"),
        "{not_avro}"
    );
}
