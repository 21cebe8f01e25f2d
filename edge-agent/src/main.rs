//! The `edge-agent` binary: [`edge_agent::cli`].
//!
//! It runs on the system allocator, not mimalloc as the gateway and the sink do: the agent's
//! pipeline allocates little per record (a line goes into its batch as read), glibc's malloc
//! takes fewer instructions on it, and mimalloc's freed pages, purged a second later, put
//! bench-agent's peak RSS with Parquet bodies some 20 MiB above its 64 MiB target.

fn main() -> std::process::ExitCode {
    service_kit::process::exit(edge_agent::cli::main())
}
