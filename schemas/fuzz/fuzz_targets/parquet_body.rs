//! Hostile Parquet request bodies: decoding one must end in NDJSON or an error, never a panic,
//! and never in more NDJSON than the limit allows.
#![no_main]

use libfuzzer_sys::fuzz_target;

const MAX_BYTES: usize = 1 << 20;

fuzz_target!(
    init: {
        // `parquet_to_ndjson` catches the panics of the parquet crate; libfuzzer-sys's hook would
        // abort on them all the same. A panic that escapes still ends the run and keeps the
        // input (libfuzzer-sys catches it and aborts); FUZZ_SHOW_PANICS=1 prints every panic.
        let show = std::env::var_os("FUZZ_SHOW_PANICS").is_some();
        std::panic::set_hook(Box::new(move |info| {
            if show {
                eprintln!("{info}");
            }
        }));
    },
    |data: &[u8]| {
        let streams = schemas::example_streams();
        for def in streams.iter() {
            let body = bytes::Bytes::copy_from_slice(data);
            if let Ok(ndjson) = schemas::columnar::parquet_to_ndjson(def, body, MAX_BYTES) {
                assert!(ndjson.len() <= MAX_BYTES);
            }
        }
    }
);
