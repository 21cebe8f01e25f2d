//! The `ingest-gateway` binary: [`ingest_gateway::cli`].

/// mimalloc: the decode and encode paths allocate per record; glibc malloc was a quarter of
/// the gateway's profile.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    service_kit::process::exit(ingest_gateway::cli::main())
}
