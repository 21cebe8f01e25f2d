//! The `sink` binary: [`sink::cli`].

/// mimalloc: the decode and encode paths allocate per record.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    sink::cli::main()
}
