//! Hostile columnar (Parquet) request bodies through the gateway's decoder
//! (`schemas::columnar::parquet_to_ndjson_charged`): decoding one must end in NDJSON or an error,
//! never a panic, never in more NDJSON than the limit allows, and never in memory the budget
//! was not charged for first.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "caught.rs"]
mod caught;

const MAX_BYTES: usize = 1 << 20;
const BUDGET: usize = 4 << 20;

fuzz_target!(
    init: {
        // `parquet_to_ndjson_charged` catches the panics of the parquet crate.
        caught::let_decoders_catch_panics();
    },
    |data: &[u8]| {
        let streams = schemas::example_streams();
        for def in streams.iter() {
            let body = bytes::Bytes::copy_from_slice(data);
            let mut left = BUDGET;
            let mut charge = |bytes: usize| {
                let taken = bytes <= left;
                if taken {
                    left -= bytes;
                }
                taken
            };
            if let Ok(ndjson) =
                schemas::columnar::parquet_to_ndjson_charged(def, body, MAX_BYTES, &mut charge)
            {
                assert!(ndjson.len() <= MAX_BYTES);
                assert!(ndjson.capacity() <= BUDGET - left, "allocated past the charge");
            }
        }
    }
);
