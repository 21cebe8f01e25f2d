//! What the targets over decoders that catch a crate's panics share.

/// Replaces libfuzzer-sys's panic hook, which aborts on every panic, even one the decoder
/// catches (the parquet and apache-avro crates panic on some malformed input, and the decoders
/// turn that into an error). A panic that escapes still ends the run and keeps the input
/// (libfuzzer-sys catches it and aborts); `FUZZ_SHOW_PANICS=1` prints every panic.
pub fn let_decoders_catch_panics() {
    let show = std::env::var_os("FUZZ_SHOW_PANICS").is_some();
    std::panic::set_hook(Box::new(move |info| {
        if show {
            eprintln!("{info}");
        }
    }));
}
