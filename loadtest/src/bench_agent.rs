//! Agent benchmark, all in one run on the same generated file (sensor readings, a fifth of them
//! re-sent): the agent's pipeline (read, parse, validate, dedupe with a 1,000,000-entry window,
//! batch, compress, spool; a child process so its peak RSS is its own) with NDJSON and with
//! Parquet batch bodies, against `zstd -3 -T1` and `gzip -6` of the whole file.

use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use anyhow::{Context, bail};
use edge_agent::batch::BodyEncoding;
use edge_agent::config::{BatchConfig, DedupeConfig, SpoolConfig, StreamSettings};
use edge_agent::pipeline::{Chunk, Pipeline};
use edge_agent::source::{Feed, Verbatim, feed_lines};
use edge_agent::spool::{Spool, Usage};
use serde::{Deserialize, Serialize};

use crate::bench_gateway::{Measure, Throughput};
use crate::bench_sink::peak_rss_bytes;
use crate::fleet::{FleetSpec, sensor_readings, to_ndjson};

#[derive(Debug, Clone)]
pub struct AgentBenchOptions {
    pub records: usize,
    /// Rounds of every path, in turn; each path's fastest round is reported (the others lost
    /// time to the machine, not to the path).
    pub rounds: usize,
    pub out: PathBuf,
}

/// What the agent child process reports.
#[derive(Debug, Serialize, Deserialize)]
pub struct AgentRun {
    pub encoding: String,
    pub throughput: Throughput,
    pub peak_rss_bytes: u64,
    pub read: u64,
    pub duplicates: u64,
    pub batches: u64,
    pub wire_bytes: u64,
    pub dedupe_window: usize,
    /// With a filter: the readings it kept.
    #[serde(default)]
    pub kept: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct Tool {
    pub name: String,
    pub seconds: f64,
    /// MB of input per wall-clock second.
    pub mb_per_s: f64,
    /// User and system CPU time of the tool's process, all its threads.
    pub cpu_seconds: f64,
    /// MB of input per CPU-second: the per-core speed the agent's is compared with.
    pub mb_per_cpu_s: f64,
    pub output_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct AgentBenchReport {
    pub records: usize,
    pub raw_bytes: u64,
    pub rounds: usize,
    /// Agent (NDJSON bodies) over `zstd -3` throughput of each round, both per CPU-second.
    pub round_ratios_ndjson: Vec<f64>,
    /// The median of `round_ratios_ndjson` (the upper one of an even count): each round's two
    /// runs follow each other, so a slow or fast stretch of the machine moves both, where the
    /// headline ratio divides the fastest rounds, which may come from different stretches.
    pub median_round_ratio_ndjson: f64,
    pub zstd: Tool,
    pub gzip: Tool,
    pub agent_ndjson: AgentRun,
    pub agent_parquet: AgentRun,
    /// The part of the agent's work that the issue fixes and no pipeline can leave out.
    pub floor: Floor,
    /// Agent MB per CPU-second over `zstd -3 -T1` MB per CPU-second (NDJSON and Parquet
    /// bodies).
    pub ratio_ndjson_zstd: f64,
    pub ratio_parquet_zstd: f64,
    /// Agent MB per CPU-second (NDJSON bodies) over `zstd -3 -T1` MB per wall-clock second: the
    /// ratio as sessions up to 40 reported it. `-T1` compresses on a thread of its own beside
    /// the one that reads and writes, so its wall-clock speed is more than one core's work.
    pub ratio_ndjson_zstd_wall: f64,
    /// Wire bytes over `gzip -6` of the whole file.
    pub wire_ndjson_gzip: f64,
    pub wire_parquet_gzip: f64,
    /// The floor's MB per CPU-second over `zstd -3 -T1` MB per CPU-second: the most agent/zstd
    /// could reach if reading, parsing, validating, the dedupe window and the spool cost
    /// nothing.
    pub ratio_floor_zstd: f64,
    /// The agent (NDJSON bodies) with a swinging-door filter on `value`
    /// ([`SWINGING_DOOR_BAND`]), and its MB per CPU-second over the agent's with filters off:
    /// the fastest rounds, and each round's own ratio with their median.
    pub agent_swinging_door: AgentRun,
    pub ratio_door_off: f64,
    pub round_ratios_door: Vec<f64>,
    pub median_round_ratio_door: f64,
    /// Swinging door against deadband on process-like series ([`reduction_rows`]).
    pub reduction: Vec<ReductionRow>,
}

/// The band of the swinging door in the throughput run, on the fleet's readings (temperatures
/// near 21, pressures near 4.2, rpm near 1,450).
pub const SWINGING_DOOR_BAND: f64 = 0.5;

/// Readings of each shape in the reduction rows.
pub const REDUCTION_READINGS: usize = 20_000;

/// One shape of [`crate::process`]: readings kept by swinging door and by deadband (with
/// `send_previous`) at a band of 0.5% of the range, and the largest error of each
/// reconstruction measured against every reading.
#[derive(Debug, Serialize)]
pub struct ReductionRow {
    pub shape: String,
    pub readings: usize,
    pub band: f64,
    pub swinging_door_kept: u64,
    pub deadband_kept: u64,
    pub swinging_door_max_error: f64,
    pub deadband_max_error: f64,
}

/// Swinging door against deadband on [`REDUCTION_READINGS`] readings of each benchmark shape,
/// then on all of them together (the row `all`), through the agent's own filters.
pub fn reduction_rows() -> anyhow::Result<Vec<ReductionRow>> {
    use crate::process::{RANGE, Reconstruction, Shape, fidelity, readings, series};
    use edge_agent::filter::{FilterChain, Kept, Reading};
    let def = schemas::example_streams()
        .get("sensor_readings")
        .context("sensor_readings")?
        .clone();
    let band = 0.005 * (RANGE[1] - RANGE[0]);
    let mut rows = Vec::new();
    for (i, shape) in Shape::BENCHMARK.into_iter().enumerate() {
        let input = series(shape, REDUCTION_READINGS, 0, i as u64);
        let mut kept = Vec::new();
        for (kind, how) in [
            ("swinging_door", Reconstruction::Linear),
            ("deadband", Reconstruction::Hold),
        ] {
            let config = serde_json::from_value(serde_json::json!({
                "type": kind, "field": "value", "percent": 0.5, "range": RANGE,
            }))?;
            let mut chain = FilterChain::new(&def, &[config]).map_err(anyhow::Error::msg)?;
            let mut out = Vec::new();
            for reading in readings(shape.name(), &input) {
                let record =
                    schemas::validate(&def, reading).map_err(|e| anyhow::anyhow!("{e:?}"))?;
                chain.apply(&def, Reading::record(record), &mut out);
            }
            chain.flush(&def, true, &mut out);
            let points = out
                .iter()
                .map(|kept| {
                    // Records in, records out: a line would have lost a reading from the count.
                    let Kept::Record(r) = kept else {
                        anyhow::bail!("{kind}: the filters gave a line for records");
                    };
                    let value = match r.values[def.field_index("value").unwrap_or(3)] {
                        schemas::Value::Float(v) => v,
                        _ => f64::NAN,
                    };
                    Ok((r.event_time(&def) / 1_000, value))
                })
                .collect::<anyhow::Result<Vec<(i64, f64)>>>()?;
            let f = fidelity(&input, &points, how).map_err(|e| anyhow::anyhow!("{kind}: {e}"))?;
            kept.push((points.len() as u64, f.max_error));
        }
        rows.push(ReductionRow {
            shape: shape.name().into(),
            readings: input.len(),
            band,
            swinging_door_kept: kept[0].0,
            deadband_kept: kept[1].0,
            swinging_door_max_error: kept[0].1,
            deadband_max_error: kept[1].1,
        });
    }
    let all = ReductionRow {
        shape: "all".into(),
        readings: rows.iter().map(|r| r.readings).sum(),
        band,
        swinging_door_kept: rows.iter().map(|r| r.swinging_door_kept).sum(),
        deadband_kept: rows.iter().map(|r| r.deadband_kept).sum(),
        swinging_door_max_error: rows
            .iter()
            .map(|r| r.swinging_door_max_error)
            .fold(0.0, f64::max),
        deadband_max_error: rows
            .iter()
            .map(|r| r.deadband_max_error)
            .fold(0.0, f64::max),
    };
    rows.push(all);
    Ok(rows)
}

/// The work the issue fixes for every reading, timed alone on one thread over the same file:
/// the BLAKE3 content hash of each reading's canonical encoding (32 readings hashed together, as
/// the agent's pipeline hashes them), the BLAKE3 batch id of each
/// batch, and zstd (the agent's level) of the deduplicated NDJSON batches. Decoding the lines
/// and finding the duplicates are done beforehand and not timed.
#[derive(Debug, Serialize)]
pub struct Floor {
    pub content_hash_cpu_s: f64,
    pub batch_id_cpu_s: f64,
    pub zstd_cpu_s: f64,
    pub mb_per_cpu_s: f64,
    /// Readings left after the duplicates were dropped.
    pub distinct: u64,
    pub batches: u64,
    pub wire_bytes: u64,
}

/// Runs a compression CLI over the file, timing it by the wall clock and by its CPU time.
/// The CPU time is what counts: `zstd -T1` compresses on a thread of its own while its main
/// thread reads and writes, so it takes 1.2–1.3 cores and its wall-clock speed is not one
/// core's.
fn tool(name: &str, args: &[&str], input: &Path, raw: u64) -> anyhow::Result<Tool> {
    let cpu_before = children_cpu_seconds()?;
    let started = Instant::now();
    let mut child = Command::new(name)
        .args(args)
        .arg(input)
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {name}"))?;
    let mut out = child.stdout.take().context("no stdout")?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = out.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    if !child.wait()?.success() {
        bail!("{name} failed");
    }
    let seconds = started.elapsed().as_secs_f64();
    // This process waits for no other child meanwhile, so the difference is the tool's alone.
    let cpu_seconds = children_cpu_seconds()? - cpu_before;
    let mb = raw as f64 / 1e6;
    Ok(Tool {
        name: format!("{name} {}", args.join(" ")),
        seconds,
        mb_per_s: mb / seconds,
        cpu_seconds,
        mb_per_cpu_s: mb / cpu_seconds.max(1e-9),
        output_bytes: total,
    })
}

/// User and system CPU seconds of every child process this one has waited for.
fn children_cpu_seconds() -> anyhow::Result<f64> {
    use nix::sys::resource::{UsageWho, getrusage};
    let usage = getrusage(UsageWho::RUSAGE_CHILDREN).context("getrusage")?;
    let seconds = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    Ok(seconds(usage.user_time()) + seconds(usage.system_time()))
}

/// The `loadtest-agent-worker` binary next to this one: it runs the agent's pipeline with the
/// system allocator, as the edge-agent binary does.
fn worker_exe() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?.with_file_name(WORKER_BIN);
    if !exe.exists() {
        bail!(
            "{} is missing: build it with `cargo build --release -p loadtest --bins` \
             (scripts/bench.sh agent does)",
            exe.display()
        );
    }
    Ok(exe)
}

/// bench-agent's child binary (src/bin/loadtest-agent-worker.rs).
const WORKER_BIN: &str = "loadtest-agent-worker";

pub fn run(opts: AgentBenchOptions) -> anyhow::Result<AgentBenchReport> {
    std::fs::create_dir_all(&opts.out)?;
    let input = opts.out.join("agent-input.ndjson");
    let spec = FleetSpec {
        records: opts.records,
        devices: 200,
        ..FleetSpec::default()
    };
    std::fs::write(&input, to_ndjson(&sensor_readings(&spec)))?;
    let raw = std::fs::metadata(&input)?.len();
    let worker_exe = worker_exe()?;
    let worker = |encoding: &str, swinging_door: Option<f64>| -> anyhow::Result<AgentRun> {
        let state = opts.out.join(format!("agent-state-{encoding}"));
        let _ = std::fs::remove_dir_all(&state);
        let mut command = Command::new(&worker_exe);
        command
            .args(["--encoding", encoding, "--input"])
            .arg(&input)
            .arg("--state")
            .arg(&state);
        if let Some(band) = swinging_door {
            command.args(["--swinging-door", &band.to_string()]);
        }
        let output = command.output()?;
        if !output.status.success() {
            bail!(
                "agent worker failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let _ = std::fs::remove_dir_all(&state);
        Ok(serde_json::from_slice(&output.stdout)?)
    };
    let mut best: Option<(Tool, Tool, AgentRun, AgentRun, Floor)> = None;
    let mut round_ratios_ndjson = Vec::new();
    let (mut round_ratios_door, mut best_door) = (Vec::new(), None);
    for round in 0..opts.rounds.max(1) {
        let zstd = tool("zstd", &["-3", "-T1", "-q", "-c"], &input, raw)?;
        let gzip = tool("gzip", &["-6", "-c"], &input, raw)?;
        let ndjson = worker("ndjson", None)?;
        let parquet = worker("parquet", None)?;
        let door = worker("ndjson", Some(SWINGING_DOOR_BAND))?;
        let door_ratio = door.throughput.mb_per_cpu_s / ndjson.throughput.mb_per_cpu_s;
        eprintln!(
            "round {}: agent with swinging door {:.0} MB/cpu-s, {door_ratio:.2} of filters off",
            round + 1,
            door.throughput.mb_per_cpu_s
        );
        round_ratios_door.push(door_ratio);
        best_door = Some(match best_door {
            None => door,
            Some(d) => faster_run(d, door),
        });
        let floor = floor(&input, raw)?;
        if floor.distinct != ndjson.read - ndjson.duplicates {
            bail!(
                "the floor kept {} readings, the agent {}: they did not compress the same records",
                floor.distinct,
                ndjson.read - ndjson.duplicates
            );
        }
        let ratio = ndjson.throughput.mb_per_cpu_s / zstd.mb_per_cpu_s;
        eprintln!(
            "round {}: zstd -3 {:.0} MB/cpu-s ({:.0} MB/s by the wall clock), agent {:.0} (ndjson) and {:.0} (parquet) MB/cpu-s, ratio {ratio:.2} (ndjson); floor {:.0} MB/cpu-s ({:.2})",
            round + 1,
            zstd.mb_per_cpu_s,
            zstd.mb_per_s,
            ndjson.throughput.mb_per_cpu_s,
            parquet.throughput.mb_per_cpu_s,
            floor.mb_per_cpu_s,
            floor.mb_per_cpu_s / zstd.mb_per_cpu_s,
        );
        round_ratios_ndjson.push(ratio);
        best = Some(match best {
            None => (zstd, gzip, ndjson, parquet, floor),
            Some((z, g, n, p, f)) => (
                faster_tool(z, zstd),
                faster_tool(g, gzip),
                faster_run(n, ndjson),
                faster_run(p, parquet),
                if floor.mb_per_cpu_s > f.mb_per_cpu_s {
                    floor
                } else {
                    f
                },
            ),
        });
    }
    let (zstd, gzip, agent_ndjson, agent_parquet, floor) = best.context("no rounds")?;
    let agent_swinging_door: AgentRun = best_door.context("no rounds")?;
    let report = AgentBenchReport {
        records: opts.records,
        raw_bytes: raw,
        rounds: opts.rounds.max(1),
        median_round_ratio_ndjson: crate::bench_gateway::median_ratio(&round_ratios_ndjson),
        round_ratios_ndjson,
        ratio_ndjson_zstd: agent_ndjson.throughput.mb_per_cpu_s / zstd.mb_per_cpu_s,
        ratio_parquet_zstd: agent_parquet.throughput.mb_per_cpu_s / zstd.mb_per_cpu_s,
        ratio_ndjson_zstd_wall: agent_ndjson.throughput.mb_per_cpu_s / zstd.mb_per_s,
        wire_ndjson_gzip: agent_ndjson.wire_bytes as f64 / gzip.output_bytes as f64,
        wire_parquet_gzip: agent_parquet.wire_bytes as f64 / gzip.output_bytes as f64,
        ratio_floor_zstd: floor.mb_per_cpu_s / zstd.mb_per_cpu_s,
        ratio_door_off: agent_swinging_door.throughput.mb_per_cpu_s
            / agent_ndjson.throughput.mb_per_cpu_s,
        median_round_ratio_door: crate::bench_gateway::median_ratio(&round_ratios_door),
        round_ratios_door,
        agent_swinging_door,
        reduction: reduction_rows()?,
        floor,
        zstd,
        gzip,
        agent_ndjson,
        agent_parquet,
    };
    let _ = std::fs::remove_file(&input);
    crate::bench_gateway::write_report(&opts.out.join("agent.json"), &report)?;
    Ok(report)
}

/// CPU seconds of the calling thread so far.
fn thread_cpu_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// Times [`Floor`]'s work over `input`, a chunk of lines at a time.
fn floor(input: &Path, raw: u64) -> anyhow::Result<Floor> {
    let def = schemas::example_streams()
        .get("sensor_readings")
        .context("sensor_readings")?
        .clone();
    let batch = BatchConfig::default();
    let text = std::fs::read(input)?;
    let mut seen = schemas::hash::HashSetOfHashes::default();
    let mut compressor = zstd::bulk::Compressor::new(batch.zstd_level)?;
    let (mut hash_s, mut id_s, mut zstd_s) = (0.0, 0.0, 0.0);
    let (mut distinct, mut batches, mut wire_bytes) = (0u64, 0u64, 0u64);
    let mut body: Vec<u8> = Vec::with_capacity(batch.max_bytes);
    let mut rows = 0;
    let mut close = |body: &mut Vec<u8>| -> anyhow::Result<()> {
        let t = thread_cpu_seconds();
        std::hint::black_box(blake3::hash(body));
        id_s += thread_cpu_seconds() - t;
        let t = thread_cpu_seconds();
        wire_bytes += compressor.compress(body)?.len() as u64;
        zstd_s += thread_cpu_seconds() - t;
        batches += 1;
        body.clear();
        Ok(())
    };
    let lines: Vec<&[u8]> = text
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    let mut group = schemas::HashGroup::new();
    let mut pending = Vec::new();
    for chunk in lines.chunks(20_000) {
        let records = chunk
            .iter()
            .map(|line| schemas::typed::decode_record(&def, line))
            .collect::<Result<Vec<_>, _>>()?;
        let t = thread_cpu_seconds();
        // 32 readings hashed together, as the agent's pipeline hashes them.
        let mut hashes = Vec::with_capacity(records.len());
        for records in records.chunks(32) {
            pending.extend(
                records
                    .iter()
                    .map(|r| schemas::content_hash_in(&def, r, &mut group)),
            );
            group.finish();
            hashes.extend(pending.drain(..).map(|p| group.get(p)));
            group.clear();
        }
        hash_s += thread_cpu_seconds() - t;
        for (line, hash) in chunk.iter().zip(hashes) {
            if !seen.insert(hash) {
                continue;
            }
            if body.len() + line.len() + 1 > batch.max_bytes || rows == batch.max_records {
                close(&mut body)?;
                rows = 0;
            }
            body.extend_from_slice(line);
            body.push(b'\n');
            rows += 1;
            distinct += 1;
        }
    }
    if !body.is_empty() {
        close(&mut body)?;
    }
    let cpu = hash_s + id_s + zstd_s;
    Ok(Floor {
        content_hash_cpu_s: hash_s,
        batch_id_cpu_s: id_s,
        zstd_cpu_s: zstd_s,
        mb_per_cpu_s: raw as f64 / 1e6 / cpu,
        distinct,
        batches,
        wire_bytes,
    })
}

fn faster_tool(a: Tool, b: Tool) -> Tool {
    if b.mb_per_cpu_s > a.mb_per_cpu_s {
        b
    } else {
        a
    }
}

/// The faster of two agent runs; the peak RSS is the larger of the two.
fn faster_run(a: AgentRun, b: AgentRun) -> AgentRun {
    let rss = a.peak_rss_bytes.max(b.peak_rss_bytes);
    let mut run = if b.throughput.mb_per_cpu_s > a.throughput.mb_per_cpu_s {
        b
    } else {
        a
    };
    run.peak_rss_bytes = rss;
    run
}

/// The agent's pipeline over a file, with no output: read, parse, validate, dedupe, batch,
/// compress and spool (fsync per batch, as by default).
pub fn agent_worker(
    input: &Path,
    state: &Path,
    encoding: &str,
    dedupe_window: usize,
    swinging_door: Option<f64>,
) -> anyhow::Result<AgentRun> {
    let encoding = match encoding {
        "ndjson" => BodyEncoding::Ndjson,
        "parquet" => BodyEncoding::Parquet,
        other => bail!("unknown encoding {other}"),
    };
    let def = schemas::example_streams()
        .get("sensor_readings")
        .context("sensor_readings")?
        .clone();
    std::fs::create_dir_all(state)?;
    let spool_config = SpoolConfig {
        max_mb: 4096,
        ..SpoolConfig::default()
    };
    let (spool, _) = Spool::open(
        &state.join("spool"),
        &def.name,
        spool_config.options(),
        Arc::new(Usage::default()),
    )?;
    let dedupe = DedupeConfig {
        window_records: dedupe_window,
        ..DedupeConfig::default()
    };
    let batch = BatchConfig {
        encoding,
        ..BatchConfig::default()
    };
    let max_line = batch.max_line_bytes;
    let mut settings = StreamSettings::default();
    if let Some(band) = swinging_door {
        settings.filters = vec![serde_json::from_value(serde_json::json!({
            "type": "swinging_door", "field": "value", "absolute": band,
        }))?];
    }
    let pipeline = Pipeline::new(
        def.clone(),
        &settings,
        batch,
        &dedupe,
        Arc::new(spool),
        state,
    )?;
    let measure = Measure::start();
    let raw = std::fs::metadata(input)?.len();
    let (tx, rx) = std::sync::mpsc::sync_channel::<Chunk>(edge_agent::QUEUED_CHUNKS);
    let file = std::fs::File::open(input)?;
    let feed = Feed::new(tx, &def.name, max_line);
    let reader = std::thread::spawn(move || -> std::io::Result<u64> {
        let mut reader = BufReader::with_capacity(256 * 1024, file);
        feed_lines(&mut reader, &feed, 0, true, |_| None, Verbatim)
    });
    let stats = pipeline.run(rx, &AtomicBool::new(false))?;
    reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))??;
    let throughput = measure.done(stats.read as usize, raw as usize);
    Ok(AgentRun {
        encoding: format!("{encoding:?}").to_lowercase(),
        kept: stats.reductions.first().map(|r| r.kept),
        throughput,
        peak_rss_bytes: peak_rss_bytes(),
        read: stats.read,
        duplicates: stats.duplicates,
        batches: stats.batches,
        wire_bytes: stats.encoded_bytes,
        dedupe_window: dedupe.window_records,
    })
}

impl std::fmt::Display for AgentBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "agent benchmark: {} readings (a fifth re-sent), {:.1} MB NDJSON, best of {} rounds",
            self.records,
            self.raw_bytes as f64 / 1e6,
            self.rounds
        )?;
        writeln!(
            f,
            "{:<28} {:>12} {:>14} {:>12} {:>12}",
            "path", "MB/cpu-s", "wire bytes", "wire/raw", "peak RSS"
        )?;
        for t in [&self.zstd, &self.gzip] {
            writeln!(
                f,
                "{:<28} {:>12.1} {:>14} {:>12.3} {:>12}",
                t.name,
                t.mb_per_cpu_s,
                t.output_bytes,
                t.output_bytes as f64 / self.raw_bytes as f64,
                "-"
            )?;
        }
        for a in [&self.agent_ndjson, &self.agent_parquet] {
            writeln!(
                f,
                "{:<28} {:>12.1} {:>14} {:>12.3} {:>9.1} MiB",
                format!("agent ({} bodies)", a.encoding),
                a.throughput.mb_per_cpu_s,
                a.wire_bytes,
                a.wire_bytes as f64 / self.raw_bytes as f64,
                a.peak_rss_bytes as f64 / (1 << 20) as f64
            )?;
        }
        writeln!(
            f,
            "{:<28} {:>12.1} {:>14} {:>12.3} {:>12}",
            "floor (hashes + zstd only)",
            self.floor.mb_per_cpu_s,
            self.floor.wire_bytes,
            self.floor.wire_bytes as f64 / self.raw_bytes as f64,
            "-"
        )?;
        writeln!(
            f,
            "zstd -3 -T1 by the wall clock: {:.1} MB/s ({:.2} cores: it compresses on a thread \
             of its own beside the one that reads and writes)",
            self.zstd.mb_per_s,
            self.zstd.cpu_seconds / self.zstd.seconds.max(1e-9)
        )?;
        writeln!(
            f,
            "agent/zstd -3 throughput per CPU-second: {:.2} (ndjson), {:.2} (parquet); target ≥ 0.5 \
             (against zstd's wall-clock speed: {:.2})",
            self.ratio_ndjson_zstd, self.ratio_parquet_zstd, self.ratio_ndjson_zstd_wall
        )?;
        writeln!(
            f,
            "the rounds' own ratios (ndjson): {} (median {:.2})",
            crate::bench_gateway::ratios_text(&self.round_ratios_ndjson),
            self.median_round_ratio_ndjson
        )?;
        writeln!(
            f,
            "floor/zstd -3: {:.2} (content hashes {:.2} s, batch ids {:.2} s, zstd {:.2} s of CPU): \
             the most the agent could reach if reading, parsing, validating, the dedupe window \
             and the spool cost nothing",
            self.ratio_floor_zstd,
            self.floor.content_hash_cpu_s,
            self.floor.batch_id_cpu_s,
            self.floor.zstd_cpu_s
        )?;
        writeln!(
            f,
            "wire bytes / gzip -6: {:.3} (ndjson), {:.3} (parquet); target ≤ 0.5",
            self.wire_ndjson_gzip, self.wire_parquet_gzip
        )?;
        writeln!(
            f,
            "agent with swinging door (band {SWINGING_DOOR_BAND}) / filters off, MB per CPU-second: \
             {:.2} (fastest rounds; by round {}, median {:.2}); target ≥ 0.9; it kept {} of {} readings",
            self.ratio_door_off,
            crate::bench_gateway::ratios_text(&self.round_ratios_door),
            self.median_round_ratio_door,
            self.agent_swinging_door.kept.unwrap_or_default(),
            self.agent_swinging_door.read - self.agent_swinging_door.duplicates
        )?;
        writeln!(
            f,
            "{:<14} {:>9} {:>14} {:>14} {:>8} {:>16} {:>16}",
            "shape",
            "readings",
            "door kept",
            "deadband kept",
            "ratio",
            "door max error",
            "deadband error"
        )?;
        for r in &self.reduction {
            writeln!(
                f,
                "{:<14} {:>9} {:>14} {:>14} {:>8.3} {:>16.4} {:>16.4}",
                r.shape,
                r.readings,
                r.swinging_door_kept,
                r.deadband_kept,
                r.swinging_door_kept as f64 / r.deadband_kept.max(1) as f64,
                r.swinging_door_max_error,
                r.deadband_max_error
            )?;
        }
        write!(
            f,
            "band {} (0.5% of the range); target: swinging door keeps ≤ 0.5× deadband over all \
             shapes, with its largest error ≤ the band",
            self.reduction.first().map_or(0.0, |r| r.band)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reduction rows are counts, not timings: both reconstructions stay within the band
    /// on every shape, and over all of them swinging door keeps at most half what deadband
    /// keeps.
    #[test]
    fn swinging_door_keeps_at_most_half_of_deadband_within_the_band() {
        let rows = reduction_rows().unwrap();
        for r in &rows {
            eprintln!("{r:?}");
            assert!(r.swinging_door_max_error <= r.band * (1.0 + 1e-9), "{r:?}");
            assert!(r.deadband_max_error <= r.band, "{r:?}");
        }
        let all = rows.last().unwrap();
        assert_eq!(all.shape, "all");
        assert!(
            all.swinging_door_kept * 2 <= all.deadband_kept,
            "swinging door kept {} against deadband's {}",
            all.swinging_door_kept,
            all.deadband_kept
        );
    }

    #[test]
    fn the_floor_hashes_every_reading_and_compresses_the_distinct_ones() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.ndjson");
        let spec = FleetSpec {
            records: 5_000,
            devices: 20,
            ..FleetSpec::default()
        };
        std::fs::write(&input, to_ndjson(&sensor_readings(&spec))).unwrap();
        let text = std::fs::read(&input).unwrap();
        let def = schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone();
        let lines: Vec<&[u8]> = text
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .collect();
        let distinct: std::collections::HashSet<_> = lines
            .iter()
            .map(|l| schemas::check_bytes(&def, l).unwrap().hash)
            .collect();
        assert!(
            distinct.len() < lines.len(),
            "the generator re-sends readings"
        );
        let floor = floor(&input, text.len() as u64).unwrap();
        assert_eq!(floor.distinct, distinct.len() as u64);
        assert!(floor.batches >= 1);
        assert!(floor.wire_bytes > 0 && floor.wire_bytes < text.len() as u64 / 4);
        assert!(floor.content_hash_cpu_s > 0.0 && floor.zstd_cpu_s > 0.0);
    }

    #[test]
    fn a_tool_is_timed_by_its_own_cpu_not_by_the_benchmark_s() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in");
        std::fs::write(&input, b"x").unwrap();
        // The child burns CPU while this process waits on its output; `sh -c` takes the input
        // path as `$0`.
        let busy = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; echo done";
        let t = tool("sh", &["-c", busy], &input, 1_000_000).unwrap();
        assert_eq!(t.output_bytes, 5);
        assert!(
            t.cpu_seconds > 0.05 && t.cpu_seconds < t.seconds * 2.0 + 0.05,
            "{t:?}"
        );
        assert!((t.mb_per_cpu_s - 1.0 / t.cpu_seconds).abs() < 1e-6, "{t:?}");
        // Tools run after it are timed apart.
        let quick = tool("sh", &["-c", "echo done"], &input, 1_000_000).unwrap();
        assert!(
            quick.cpu_seconds < t.cpu_seconds / 2.0,
            "{quick:?} after {t:?}"
        );
    }
}
