//! The `loadtest` binary: [`loadtest::cli`].

/// mimalloc, as the gateway and the sink it runs in process use.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    service_kit::process::exit(loadtest::cli::main())
}
