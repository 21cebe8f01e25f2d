//! The agent side of `loadtest bench-agent`: the agent's pipeline over a file, in a process of
//! its own so that its peak RSS is its own. It is a binary of its own because it must allocate
//! as the edge-agent binary does, with the system allocator, while `loadtest` uses mimalloc as
//! the gateway and the sink do (and `unsafe_code` is forbidden, which rules out choosing the
//! allocator at run time).

use std::path::PathBuf;

use clap::Parser;

/// Runs the agent's pipeline (read, parse, validate, dedupe, batch, compress, spool) over an
/// NDJSON file of sensor readings and prints the run as JSON. Started by `loadtest bench-agent`.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// NDJSON input.
    #[arg(long)]
    input: PathBuf,
    /// Directory for the spool and the dedupe log.
    #[arg(long)]
    state: PathBuf,
    /// Batch body encoding: ndjson or parquet.
    #[arg(long)]
    encoding: String,
    /// Dedupe window in records.
    #[arg(long, default_value_t = 1_000_000)]
    dedupe_window: usize,
    /// Runs a swinging-door filter on `value` with this band (absolute).
    #[arg(long)]
    swinging_door: Option<f64>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = loadtest::bench_agent::agent_worker(
        &args.input,
        &args.state,
        &args.encoding,
        args.dedupe_window,
        args.swinging_door,
    )?;
    println!("{}", serde_json::to_string(&run)?);
    Ok(())
}
