//! Hostile compressed request bodies through the decoder of the gateway and the agent's local
//! HTTP port (`service_kit::http::body::decompress_into`): identity, zstd (with and without a stream
//! dictionary) and gzip, under an output limit and a memory budget.
//!
//! What must hold for every input:
//! - no panic, and no output past the limit;
//! - every byte of the output's capacity was charged to the budget first, and no more than the
//!   budget held was taken;
//! - a body decoded without error is what an independent decoder (zstd's and flate2's streaming
//!   readers) makes of it; a body refused as too large is one that decodes past the limit.
//!
//! The first byte chooses the encoding, the limit and the budget. Mode 3 compresses the rest with
//! the stream's dictionary and then damages one byte of the frame, so that frames naming the
//! dictionary (which the fuzzer could not forge) are decoded too.
#![no_main]

use std::io::Read;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use service_kit::http::body::{DecompressError, Encoding, decompress_into};
use schemas::dictionary::{Dictionaries, ZstdDictionary};

const LIMITS: [usize; 8] = [0, 1, 100, 4096, 65_536, 100_000, 1 << 20, 4 << 20];
const BUDGETS: [usize; 4] = [0, 16 << 10, 1 << 20, usize::MAX];

fn dictionaries() -> &'static Dictionaries {
    static DICTIONARIES: OnceLock<Dictionaries> = OnceLock::new();
    DICTIONARIES.get_or_init(|| {
        let mut dictionaries = Dictionaries::default();
        dictionaries
            .add(dictionary().clone_dictionary(), true)
            .expect("one dictionary");
        dictionaries
    })
}

/// A dictionary trained on sensor readings, the same on every run (zstd's trainer is
/// deterministic), so that the corpus's dictionary frames stay valid.
fn dictionary() -> &'static DictionaryBytes {
    static DICTIONARY: OnceLock<DictionaryBytes> = OnceLock::new();
    DICTIONARY.get_or_init(|| {
        let samples: Vec<Vec<u8>> = (0..2_000)
            .map(|i| {
                format!(
                    "{{\"device_id\":\"dev-{}\",\"sensor\":\"temp\",\"ts\":\"2026-11-27T10:{:02}:{:02}Z\",\"value\":{}.{}}}\n",
                    i % 37,
                    i / 60 % 60,
                    i % 60,
                    i % 90,
                    i % 7
                )
                .into_bytes()
            })
            .collect();
        let refs: Vec<&[u8]> = samples.iter().map(Vec::as_slice).collect();
        let trained = schemas::dictionary::train(&refs, 4096).expect("training");
        DictionaryBytes(trained.bytes().to_vec())
    })
}

struct DictionaryBytes(Vec<u8>);

impl DictionaryBytes {
    fn clone_dictionary(&self) -> ZstdDictionary {
        ZstdDictionary::new(self.0.clone()).expect("a dictionary")
    }
}

/// What an independent streaming decoder makes of `body`, reading at most `limit + 1` bytes;
/// `None` when it fails before that.
fn reference(encoding: Encoding, body: &[u8], limit: usize) -> Option<Vec<u8>> {
    let cap = limit as u64 + 1;
    let mut out = Vec::new();
    let read = match encoding {
        Encoding::Identity => return Some(body[..body.len().min(limit + 1)].to_vec()),
        Encoding::Gzip => flate2::read::MultiGzDecoder::new(body)
            .take(cap)
            .read_to_end(&mut out),
        Encoding::Zstd => {
            let decoder = match schemas::dictionary::frame_dictionary_id(body) {
                Some(_) => zstd::stream::read::Decoder::with_dictionary(
                    std::io::BufReader::new(body),
                    &dictionary().0,
                ),
                None => zstd::stream::read::Decoder::with_buffer(std::io::BufReader::new(body)),
            };
            decoder.and_then(|d| d.take(cap).read_to_end(&mut out))
        }
    };
    read.ok().map(|_| out)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let limit = LIMITS[usize::from(mode >> 2) & 7];
    let budget = BUDGETS[usize::from(mode >> 5) & 3];
    let (encoding, body) = match mode & 3 {
        0 => (Encoding::Identity, rest.to_vec()),
        1 => (Encoding::Zstd, rest.to_vec()),
        2 => (Encoding::Gzip, rest.to_vec()),
        _ => {
            let Some((damage, payload)) = rest.split_at_checked(3) else {
                return;
            };
            let mut compressor =
                zstd::bulk::Compressor::with_dictionary(1, &dictionary().0).expect("compressor");
            let mut frame = compressor.compress(payload).expect("compress");
            let at = usize::from(u16::from_le_bytes([damage[0], damage[1]])) % frame.len();
            frame[at] ^= damage[2];
            (Encoding::Zstd, frame)
        }
    };
    let mut left = budget;
    let mut charged = 0usize;
    let mut charge = |bytes: usize| {
        let taken = bytes <= left;
        if taken {
            left -= bytes;
            charged += bytes;
        }
        taken
    };
    let mut out = Vec::new();
    let mut context = None;
    let result = decompress_into(
        encoding,
        &body,
        limit,
        &mut context,
        dictionaries(),
        &mut out,
        &mut charge,
    );
    assert!(charged <= budget);
    assert!(
        out.capacity() <= charged,
        "{} bytes allocated, {charged} charged",
        out.capacity()
    );
    match result {
        Ok(()) => {
            assert!(out.len() <= limit);
            let expected = reference(encoding, &body, limit)
                .expect("the reference decoder failed where the body was accepted");
            assert!(expected == out, "the decoders disagree");
        }
        Err(DecompressError::TooLarge(n)) => {
            assert_eq!(n, limit);
            if let Some(expected) = reference(encoding, &body, limit) {
                // A zstd frame that states a larger size is refused before it is decoded.
                let stated = zstd::zstd_safe::get_frame_content_size(&body)
                    .ok()
                    .flatten();
                assert!(
                    expected.len() > limit || stated.is_some_and(|s| s > limit as u64),
                    "refused as too large, but decodes to {} bytes",
                    expected.len()
                );
            }
        }
        Err(DecompressError::UnknownDictionary(id)) => {
            assert!(dictionaries().get(id).is_none());
        }
        Err(DecompressError::Invalid(_) | DecompressError::OverBudget) => {}
    }
});
