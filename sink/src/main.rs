//! The `sink` binary: [`sink::cli`].

/// mimalloc: the decode and encode paths allocate per record.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    service_kit::process::exit(sink::cli::main())
}
