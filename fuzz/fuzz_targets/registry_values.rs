//! Hostile input through the decoders of the schema registry wire format: an Avro object
//! container body (`schemas::registry::avro_file_to_ndjson`, the gateway's `avro/binary`), and
//! a registry-framed value read under the stream's own Avro and Protobuf schemas
//! (`Writer::check_row_in`, the sink). Each must end in records or an error, never a panic, and
//! a body never in more NDJSON than the limit allows.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "caught.rs"]
mod caught;
use schemas::registry::export::{avro_schema, proto_schema};
use schemas::registry::{SchemaKind, Writer, avro_file_to_ndjson};

const MAX_BYTES: usize = 1 << 20;

fuzz_target!(
    init: {
        // Avro schemas are parsed with the apache-avro crate's panics caught.
        caught::let_decoders_catch_panics();
    },
    |data: &[u8]| {
        let streams = schemas::example_streams();
        for def in streams.iter() {
            if let Ok(ndjson) = avro_file_to_ndjson(def, data, MAX_BYTES) {
                assert!(ndjson.len() <= MAX_BYTES);
            }
            for (kind, schema) in [
                (SchemaKind::Avro, avro_schema(def)),
                (SchemaKind::Protobuf, proto_schema(def)),
            ] {
                let writer = Writer::compile(kind, &schema, def);
                let _ = writer.check_row_in(def, 1, data, &mut schemas::AtOnce);
            }
        }
    }
);
