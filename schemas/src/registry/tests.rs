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

/// A Protobuf message in Protobuf's encoding, built field by field.
#[derive(Default)]
struct Proto(Vec<u8>);

impl Proto {
    fn varint(&mut self, mut n: u64) -> &mut Self {
        while n >= 0x80 {
            self.0.push(n as u8 | 0x80);
            n >>= 7;
        }
        self.0.push(n as u8);
        self
    }
    fn bytes(&mut self, field: u64, b: &[u8]) -> &mut Self {
        self.varint(field << 3 | 2).varint(b.len() as u64);
        self.0.extend_from_slice(b);
        self
    }
    fn int(&mut self, field: u64, n: u64) -> &mut Self {
        self.varint(field << 3).varint(n)
    }
    fn double(&mut self, field: u64, f: f64) -> &mut Self {
        self.varint(field << 3 | 1);
        self.0.extend_from_slice(&f.to_le_bytes());
        self
    }
}

const PROTO: &str = r#"
syntax = "proto3";
import "google/protobuf/timestamp.proto";
message Reading {
  string device_id = 1;
  google.protobuf.Timestamp ts = 2;
  double value = 3;
  optional int64 quality = 4;
  map<string, string> tags = 5;
  Level level = 6;
}
enum Level { LOW = 0; HIGH = 1; }
"#;

#[test]
fn a_protobuf_value_hashes_as_the_same_json_reading() {
    let def =
        StreamDef::from_toml(&DEF.replace("\"json-schema\"]", "\"json-schema\", \"protobuf\"]"))
            .unwrap();
    let writer = Writer::compile(SchemaKind::Protobuf, PROTO, &def);
    assert!(writer.refused().is_none(), "{writer:?}");
    let ts = Proto::default()
        .int(1, 1_700_000_000)
        .int(2, 123_456_000)
        .0
        .clone();
    let tags = Proto::default()
        .bytes(1, b"site")
        .bytes(2, b"north")
        .0
        .clone();
    let mut message = Proto::default();
    message.varint(0); // message indexes: the first message
    message
        .bytes(1, b"d-1")
        .bytes(2, &ts)
        .double(3, 21.5)
        .int(4, 192)
        .bytes(5, &tags);
    let json = br#"{"device_id":"d-1","ts":"2023-11-14T22:13:20.123456Z","value":21.5,"quality":192,"tags":{"site":"north"}}"#;
    let row = writer
        .check_row_in(&def, 5, &message.0, &mut AtOnce)
        .unwrap();
    assert_eq!(row.hash, check_bytes(&def, json).unwrap().hash);
    // proto3: an absent double is 0, an absent optional field null.
    let mut sparse = Proto::default();
    sparse.varint(0);
    sparse.bytes(1, b"d-1").bytes(2, &ts);
    let json = br#"{"device_id":"d-1","ts":"2023-11-14T22:13:20.123456Z","value":0}"#;
    let row = writer
        .check_row_in(&def, 5, &sparse.0, &mut AtOnce)
        .unwrap();
    assert_eq!(row.hash, check_bytes(&def, json).unwrap().hash);
    // Message indexes naming no message, and bytes cut short.
    let err = writer
        .check_row_in(&def, 5, &[2, 6, 0x0a], &mut AtOnce)
        .unwrap_err();
    assert!(err.to_string().contains("no message [3]"), "{err}");
    let err = writer
        .check_row_in(&def, 5, &message.0[..message.0.len() - 2], &mut AtOnce)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("does not match its Protobuf schema"),
        "{err}"
    );
    // A field of the wrong type refuses the schema.
    let wrong = PROTO.replace("double value = 3;", "string value = 3;");
    let refused = Writer::compile(SchemaKind::Protobuf, &wrong, &def);
    assert!(
        refused.refused().unwrap().contains("'value'"),
        "{refused:?}"
    );
}

#[test]
fn the_exported_proto_file_reads_values_of_the_stream() {
    let def = StreamDef::from_toml(&DEF.replace("\"json-schema\"]", "\"protobuf\"]")).unwrap();
    let text = super::export::proto_schema(&def);
    assert!(text.contains("message Readings {"), "{text}");
    assert!(
        text.contains("  google.protobuf.Timestamp ts = 2;"),
        "{text}"
    );
    assert!(text.contains("  optional int64 quality = 4;"), "{text}");
    assert!(text.contains("  map<string, string> tags = 5;"), "{text}");
    let writer = Writer::compile(SchemaKind::Protobuf, &text, &def);
    assert!(writer.refused().is_none(), "{writer:?}");
}

#[test]
fn a_schema_the_avro_parser_fails_on_is_refused_not_a_panic() {
    let def = def();
    // An invalid record name: the apache-avro crate unwraps its error.
    let bad = r#"{"type": "record", "name": "e,ge", "fields": []}"#;
    let writer = Writer::compile(SchemaKind::Avro, bad, &def);
    assert!(
        writer.refused().unwrap().contains("not an Avro schema"),
        "{writer:?}"
    );
    assert!(super::added_fields(bad, &def).is_err());
    // The same schema in a container file's header.
    let mut file = b"Obj\x01\x02".to_vec();
    file.push(22);
    file.extend_from_slice(b"avro.schema");
    file.push(bad.len() as u8 * 2);
    file.extend_from_slice(bad.as_bytes());
    file.push(0);
    file.extend_from_slice(&[7; 16]);
    let err = avro_file_to_ndjson(&def, &file, 1 << 20).unwrap_err();
    assert!(err.to_string().contains("not an Avro schema"), "{err}");
}

#[test]
fn items_that_take_no_bytes_cannot_write_json_without_end() {
    let def = def();
    // An array of nulls the definition lacks: each block of 40 items takes one count byte.
    let schema = r#"{"type":"record","name":"r","fields":[
        {"name":"device_id","type":"string"},
        {"name":"ts","type":{"type":"long","logicalType":"timestamp-micros"}},
        {"name":"value","type":"double"},
        {"name":"nothing","type":{"type":"array","items":"null"}}]}"#;
    let writer = Writer::compile(SchemaKind::Avro, schema, &def);
    let mut body = encode(
        schema,
        vec![
            ("device_id".into(), Avro::String("d".into())),
            ("ts".into(), Avro::TimestampMicros(0)),
            ("value".into(), Avro::Double(1.0)),
            ("nothing".into(), Avro::Array(vec![])),
        ],
    );
    body.pop(); // the array's end
    body.extend(std::iter::repeat_n(80u8, 300_000)); // zigzag 40, again and again
    body.push(0);
    let err = writer
        .check_row_in(&def, 4, &body, &mut AtOnce)
        .unwrap_err();
    assert!(err.to_string().contains("bytes of JSON"), "{err}");
}
