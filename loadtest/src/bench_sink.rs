//! Sink benchmark, all in one run on the same broker and records: a librdkafka consumer that only
//! reads the topic; the sink (a child process, so its peak RSS is its own) writing Parquet to a
//! local directory with every partition of a 64-partition topic assigned; and pyarrow converting
//! the same records from NDJSON to Parquet with zstd.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, bail};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use sink::config::IngestTime;

use crate::bench_gateway::{Kernel, Measure, Throughput, Workload, send_queued};

#[derive(Debug, Clone)]
pub struct SinkBenchOptions {
    pub brokers: String,
    pub records: usize,
    pub partitions: i32,
    /// Rounds of every path in turn; each path's fastest round is reported.
    pub rounds: usize,
    /// The test venv's Python, with pyarrow.
    pub python: PathBuf,
    pub out: PathBuf,
    /// Produce the records as the gateway does, with its headers (`content-hash`,
    /// `schema-version`, `ingest-ts`); without, as a plain producer does.
    pub gateway_headers: bool,
    /// Where the sink takes the ingest time from (`kafka.ingest_time`).
    pub ingest_time: IngestTime,
    /// Run Kafka Connect's Iceberg sink on the same records too, each round.
    pub connect: Option<crate::bench_connect::ConnectOptions>,
    /// Then kill Kafka Connect's worker at random for this long while records flow
    /// ([`crate::bench_connect::kill_loop`]); 0: not.
    pub kill_loop_seconds: u64,
}

/// What the sink child process reports about itself.
#[derive(Debug, Serialize, Deserialize)]
pub struct SinkRun {
    /// CPU time from start until the first record was taken (not in `throughput`).
    pub startup_cpu_seconds: f64,
    /// From the first record taken until every record is in a written file and the sink has
    /// stopped (with a table: its last commit made).
    pub throughput: Throughput,
    pub peak_rss_bytes: u64,
    pub files: u64,
}

#[derive(Debug, Serialize)]
pub struct SinkBenchReport {
    pub records: usize,
    pub raw_bytes: usize,
    pub partitions: i32,
    pub rounds: usize,
    /// Whether the messages carried the gateway's headers.
    pub gateway_headers: bool,
    /// The sink's `kafka.ingest_time`.
    pub ingest_time: IngestTime,
    /// Sink / pyarrow in records per CPU-second, round by round.
    pub round_ratios: Vec<f64>,
    /// The median of `round_ratios` (the upper one of an even count): a round's sink and
    /// pyarrow run one after the other, so this follows the machine's moods less than the ratio
    /// of the fastest rounds, which may come from different rounds.
    pub median_round_ratio: f64,
    /// Sink / pyarrow in user CPU time alone (the kernel's part left out), round by round, and
    /// their median: on a virtual machine the kernel's part follows the memory's history more
    /// than either side's work.
    pub round_user_ratios: Vec<f64>,
    pub median_round_user_ratio: f64,
    pub librdkafka_consumer: Throughput,
    /// The sink's per-record work without Kafka ([`sink_path`]), on one thread, the records
    /// spread over `partitions` files as the topic spreads them.
    pub sink_path: Throughput,
    pub sink: SinkRun,
    /// The same sink committing its files to an Iceberg table every [`TABLE_COMMIT_MS`].
    pub sink_table: SinkRun,
    /// Sink with a table / plain sink in records per CPU-second, round by round (the two run
    /// one after the other), their median, and the ratio of the fastest rounds.
    pub round_table_ratios: Vec<f64>,
    pub median_round_table_ratio: f64,
    pub ratio_table_plain: f64,
    /// The same sink reading the same readings as Avro values in the schema registry wire
    /// format ([`crate::bench_avro`]), and Avro / JSON in records per CPU-second, round by round
    /// (the two run one after the other), their median and the ratio of the fastest rounds.
    pub sink_avro: SinkRun,
    pub round_avro_ratios: Vec<f64>,
    pub median_round_avro_ratio: f64,
    pub ratio_avro_json: f64,
    pub pyarrow: Throughput,
    pub ratio_sink_pyarrow: f64,
    /// pyarrow's CPU time per record over the read-only consumer's and the work without
    /// Kafka's together: what sink / pyarrow would be if putting the two together cost nothing.
    pub ratio_parts_pyarrow: f64,
    /// The last round's landing files against pyarrow writing the same rows
    /// (`scripts/landing_size.py`).
    pub landing: LandingSize,
    /// Kafka Connect's Iceberg sink on the same records into a table committed as often
    /// (fastest round), and our sink with a table / Connect in records per CPU-second, round by
    /// round, with their median; when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connect: Option<crate::bench_connect::ConnectRun>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub round_connect_ratios: Vec<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub median_round_connect_ratio: Option<f64>,
    /// What Kafka Connect's table lost and repeated while its worker was killed at random.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connect_kill_loop: Option<crate::bench_connect::KillLoopReport>,
}

/// Landed bytes per record, the sink's against pyarrow's best settings on the same rows.
#[derive(Debug, Serialize, Deserialize)]
pub struct LandingSize {
    pub records: u64,
    pub sink_bytes_per_record: f64,
    pub pyarrow_bytes_per_record: BTreeMap<String, f64>,
    pub pyarrow_best: String,
    pub sink_over_pyarrow_best: f64,
}

/// `scripts/landing_size.py` over the landing directory `dir`.
pub fn landing_size(python: &Path, dir: &Path) -> anyhow::Result<LandingSize> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/landing_size.py");
    let out = Command::new(python).arg(script).arg(dir).output()?;
    if !out.status.success() {
        bail!(
            "landing_size.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("landing_size.py output")
}

/// Peak resident set size of this process (`VmHWM`).
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

const PYARROW: &str = r#"
import json, resource, sys, time
import pyarrow as pa, pyarrow.json as pj, pyarrow.parquet as pq
src, dst = sys.argv[1:3]
schema = pa.schema([
    ("device_id", pa.string()), ("sensor", pa.string()),
    ("ts", pa.timestamp("us", tz="UTC")), ("value", pa.float64()), ("unit", pa.string()),
    ("quality", pa.int64()), ("tags", pa.struct([("line", pa.string()), ("site", pa.string())])),
])
wall, cpu = time.perf_counter(), time.process_time()
usage = resource.getrusage(resource.RUSAGE_SELF)
table = pj.read_json(src, parse_options=pj.ParseOptions(explicit_schema=schema))
pq.write_table(table, dst, compression="zstd", compression_level=3)
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"rows": table.num_rows, "seconds": time.perf_counter() - wall,
                  "cpu_seconds": time.process_time() - cpu,
                  "system_seconds": after.ru_stime - usage.ru_stime,
                  "minor_faults": after.ru_minflt - usage.ru_minflt}))
"#;

/// How often the sink with a table commits in the benchmark: sixty times as often as the
/// default, so that commits show in a run of seconds.
pub const TABLE_COMMIT_MS: u64 = 1_000;

pub async fn run(opts: SinkBenchOptions) -> anyhow::Result<SinkBenchReport> {
    let work = Workload::generate(opts.records, 1 << 20)?;
    let lines: Vec<&[u8]> = work
        .raw
        .iter()
        .flat_map(|(_, b)| b.split(|c| *c == b'\n').filter(|l| !l.is_empty()))
        .collect();
    let id = std::process::id();
    let prefix = format!("benchsink{id}.");
    let topic = format!("{prefix}sensor_readings");

    // The topic and its records.
    let kafka = ingest_gateway::config::KafkaConfig {
        brokers: opts.brokers.clone(),
        topic_prefix: prefix.clone(),
        topic_partitions: opts.partitions,
        ..Default::default()
    };
    ingest_gateway::produce::ensure_topics(&kafka, &schemas::example_streams()).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &opts.brokers)
        .set("compression.type", "zstd")
        .set("linger.ms", "20")
        .create()?;
    let def = schemas::example_streams()
        .get("sensor_readings")
        .cloned()
        .context("sensor_readings stream missing")?;
    // Keys and headers first, so that the records go out as fast with headers as without (a
    // slower loop would close smaller batches, which cost the sink more to decompress).
    let ingest_ts = service_kit::kafka::ingest_ts_now();
    let mut keyed = Vec::with_capacity(lines.len());
    for line in &lines {
        let value: serde_json::Value = serde_json::from_slice(line)?;
        let key = value["device_id"].as_str().unwrap_or_default().to_owned();
        let headers = match opts.gateway_headers {
            true => Some(service_kit::kafka::record_headers(
                &schemas::check_bytes(&def, line)?.hash,
                def.version,
                &ingest_ts,
            )),
            false => None,
        };
        keyed.push((key, headers));
    }
    let avro_headers: Vec<_> = keyed.iter().map(|(_, h)| h.clone()).collect();
    let mut pending = Vec::with_capacity(lines.len());
    for (line, (key, headers)) in lines.iter().zip(keyed) {
        let record = FutureRecord::to(&topic).key(&key).payload(*line);
        let record = match headers {
            Some(headers) => record.headers(headers),
            None => record,
        };
        pending.push(send_queued(&producer, record).await);
    }
    for f in pending {
        f.await?.map_err(|(e, _)| e)?;
    }
    eprintln!("bench: produced {} records to {topic}", lines.len());
    let avro = crate::bench_avro::produce(
        &opts.brokers,
        (&prefix, opts.partitions),
        &lines,
        &avro_headers,
    )
    .await?;

    let dir = tempfile::tempdir()?;
    let src = dir.path().join("records.ndjson");
    let joined: Vec<u8> = work
        .raw
        .iter()
        .flat_map(|(_, b)| b.iter().copied())
        .collect();
    std::fs::write(&src, joined)?;

    // Every path once per round, in turn, so that they share the machine's moods; each path's
    // fastest round is reported (the slower ones lost time to the machine).
    let (mut consumer, mut sink, mut pyarrow, mut path) = (None, None, None, None);
    let (mut round_ratios, mut round_user_ratios) = (Vec::new(), Vec::new());
    let (mut sink_table, mut round_table_ratios) = (None, Vec::new());
    let (mut connect, mut round_connect_ratios) = (None, Vec::new());
    let (mut sink_avro, mut round_avro_ratios) = (None, Vec::new());
    let mut last_landing = None;
    for round in 0..opts.rounds.max(1) {
        // 1. A librdkafka consumer that only reads.
        let (brokers, t, n, parts) = (
            opts.brokers.clone(),
            topic.clone(),
            lines.len(),
            opts.partitions,
        );
        let c = tokio::task::spawn_blocking(move || read_all(&brokers, &t, parts, n)).await??;
        // 2. The sink in a child process, as a new consumer group.
        let sink_run = |prefix: &str, table, registry| {
            tokio::task::block_in_place(|| {
                run_sink_worker(
                    &opts.brokers,
                    (prefix, round),
                    (lines.len(), work.raw_bytes),
                    opts.ingest_time,
                    (table, registry),
                )
            })
        };
        let (s, landing) = sink_run(&prefix, None, None)?;
        last_landing = Some(landing);
        // 2a. The same readings as Avro values in the registry wire format.
        let (sa, _) = sink_run(&avro.prefix, None, Some(avro.registry.as_str()))?;
        let avro_ratio = sa.throughput.records_per_cpu_s / s.throughput.records_per_cpu_s;
        eprintln!(
            "bench: round {}: sink with Avro values {:.0} records/cpu-s, {avro_ratio:.2} of JSON values",
            round + 1,
            sa.throughput.records_per_cpu_s
        );
        round_avro_ratios.push(avro_ratio);
        keep_fastest(&mut sink_avro, sa, |r| r.throughput.cpu_seconds);
        // 2b. The same with an Iceberg table.
        let (st, _) = sink_run(&prefix, Some(TABLE_COMMIT_MS), None)?;
        let table_ratio = st.throughput.records_per_cpu_s / s.throughput.records_per_cpu_s;
        eprintln!(
            "bench: round {}: sink with a table {:.0} records/cpu-s, {table_ratio:.2} of the plain sink",
            round + 1,
            st.throughput.records_per_cpu_s
        );
        round_table_ratios.push(table_ratio);
        // 2c. Kafka Connect's Iceberg sink on the same records.
        if let Some(options) = &opts.connect {
            let run = crate::bench_connect::run(
                options,
                &opts.brokers,
                (&prefix, &topic, round),
                (lines.len(), work.raw_bytes),
                TABLE_COMMIT_MS,
            )
            .await?;
            let ratio = st.throughput.records_per_cpu_s / run.throughput.records_per_cpu_s;
            eprintln!(
                "bench: round {}: Kafka Connect's Iceberg sink {:.0} records/cpu-s, peak RSS {:.0} MiB, {} files; sink with a table / Connect {ratio:.2}",
                round + 1,
                run.throughput.records_per_cpu_s,
                run.peak_rss_bytes as f64 / 1048576.0,
                run.files
            );
            round_connect_ratios.push(ratio);
            keep_fastest(&mut connect, run, |r| r.throughput.cpu_seconds);
        }
        keep_fastest(&mut sink_table, st, |r| r.throughput.cpu_seconds);
        // 3. pyarrow on the same records.
        let p = tokio::task::block_in_place(|| {
            run_pyarrow(&opts.python, &src, lines.len(), work.raw_bytes)
        })?;
        // 4. The sink's per-record work alone, without Kafka.
        let w = tokio::task::block_in_place(|| sink_path(&work, 1, opts.partitions as usize))?;
        let ratio = s.throughput.records_per_cpu_s / p.records_per_cpu_s;
        eprintln!(
            "bench: round {}: sink {:.0} records/cpu-s ({}), pyarrow {:.0} ({}), ratio {ratio:.2}",
            round + 1,
            s.throughput.records_per_cpu_s,
            kernel_text(&s.throughput),
            p.records_per_cpu_s,
            kernel_text(&p),
        );
        round_ratios.push(ratio);
        round_user_ratios.push(user_per_record(&p) / user_per_record(&s.throughput));
        keep_fastest(&mut consumer, c, |t| t.cpu_seconds);
        keep_fastest(&mut sink, s, |r| r.throughput.cpu_seconds);
        keep_fastest(&mut pyarrow, p, |t| t.cpu_seconds);
        keep_fastest(&mut path, w, |t| t.cpu_seconds);
    }
    let (consumer, sink, pyarrow) = (
        consumer.context("no rounds")?,
        sink.context("no rounds")?,
        pyarrow.context("no rounds")?,
    );
    let path = path.context("no rounds")?;
    let sink_table = sink_table.context("no rounds")?;
    let sink_avro = sink_avro.context("no rounds")?;
    let landing = last_landing.context("no rounds")?;
    let connect_kill_loop = match &opts.connect {
        Some(options) if opts.kill_loop_seconds > 0 => Some(
            crate::bench_connect::kill_loop(
                options,
                &opts.brokers,
                &prefix,
                (
                    1_000 * opts.kill_loop_seconds as usize,
                    opts.kill_loop_seconds,
                ),
                TABLE_COMMIT_MS,
            )
            .await?,
        ),
        _ => None,
    };
    let landing = tokio::task::block_in_place(|| landing_size(&opts.python, landing.path()))?;
    let per_record = |t: &Throughput| 1.0 / t.records_per_cpu_s;
    let report = SinkBenchReport {
        landing,
        ratio_parts_pyarrow: per_record(&pyarrow) / (per_record(&consumer) + per_record(&path)),
        records: lines.len(),
        raw_bytes: work.raw_bytes,
        partitions: opts.partitions,
        rounds: round_ratios.len(),
        gateway_headers: opts.gateway_headers,
        ingest_time: opts.ingest_time,
        median_round_ratio: crate::bench_gateway::median_ratio(&round_ratios),
        round_ratios,
        median_round_user_ratio: crate::bench_gateway::median_ratio(&round_user_ratios),
        round_user_ratios,
        ratio_sink_pyarrow: sink.throughput.records_per_cpu_s / pyarrow.records_per_cpu_s,
        ratio_table_plain: sink_table.throughput.records_per_cpu_s
            / sink.throughput.records_per_cpu_s,
        median_round_table_ratio: crate::bench_gateway::median_ratio(&round_table_ratios),
        round_table_ratios,
        ratio_avro_json: sink_avro.throughput.records_per_cpu_s / sink.throughput.records_per_cpu_s,
        median_round_avro_ratio: crate::bench_gateway::median_ratio(&round_avro_ratios),
        round_avro_ratios,
        sink_avro,
        sink_table,
        librdkafka_consumer: consumer,
        sink_path: path,
        sink,
        pyarrow,
        connect,
        median_round_connect_ratio: (!round_connect_ratios.is_empty())
            .then(|| crate::bench_gateway::median_ratio(&round_connect_ratios)),
        round_connect_ratios,
        connect_kill_loop,
    };
    crate::bench_gateway::write_report(&opts.out, &report)?;
    Ok(report)
}

/// A run's system time, its share of the CPU time and its minor page faults. On a virtual
/// machine these follow the memory's history: a page the hypervisor has taken back costs a
/// fault on the host as well when it is touched again.
fn kernel_text(t: &Throughput) -> String {
    format!(
        "system {:.2} s, {:.0}% of its CPU time, {} minor faults",
        t.system_seconds,
        100.0 * t.system_seconds / t.cpu_seconds.max(1e-9),
        t.minor_faults
    )
}

/// User CPU time (CPU time less the kernel's part) per record.
fn user_per_record(t: &Throughput) -> f64 {
    (t.cpu_seconds - t.system_seconds).max(1e-9) / t.records.max(1) as f64
}

/// The config value of an ingest-time source.
pub fn ingest_time_name(from: IngestTime) -> &'static str {
    match from {
        IngestTime::Header => "header",
        IngestTime::Timestamp => "timestamp",
    }
}

/// Keeps `run` in `best` if it took less CPU time than the run there.
fn keep_fastest<T>(best: &mut Option<T>, run: T, cpu_seconds: impl Fn(&T) -> f64) {
    if best
        .as_ref()
        .is_none_or(|b| cpu_seconds(&run) < cpu_seconds(b))
    {
        *best = Some(run);
    }
}

/// Runs the sink in a child process (so that its peak RSS is its own) as consumer group
/// `<prefix>sink<round>`, until it has written `records` rows; returns its report and its
/// landing directory.
fn run_sink_worker(
    brokers: &str,
    (prefix, round): (&str, usize),
    (records, raw_bytes): (usize, usize),
    ingest_time: IngestTime,
    (table_commit_ms, registry): (Option<u64>, Option<&str>),
) -> anyhow::Result<(SinkRun, tempfile::TempDir)> {
    let landing = tempfile::tempdir()?;
    let group = match table_commit_ms {
        Some(_) => format!("{prefix}sink{round}table"),
        None => format!("{prefix}sink{round}"),
    };
    let mut command = Command::new(std::env::current_exe()?);
    command
        .args([
            "sink-worker",
            "--brokers",
            brokers,
            "--topic-prefix",
            prefix,
        ])
        .args(["--group-id", &group])
        .args(["--records", &records.to_string()])
        .args(["--raw-bytes", &raw_bytes.to_string()])
        .args(["--ingest-time", ingest_time_name(ingest_time)])
        .arg("--landing")
        .arg(landing.path());
    if let Some(ms) = table_commit_ms {
        command.args(["--table-commit-ms", &ms.to_string()]);
    }
    if let Some(registry) = registry {
        command.args(["--registry", registry]);
    }
    let out = command.output()?;
    if !out.status.success() {
        bail!(
            "sink worker failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let run = serde_json::from_slice(&out.stdout).context("sink worker output")?;
    Ok((run, landing))
}

/// pyarrow converting the NDJSON file `src` to Parquet with zstd.
fn run_pyarrow(
    python: &Path,
    src: &Path,
    records: usize,
    raw_bytes: usize,
) -> anyhow::Result<Throughput> {
    let dst = src.with_extension("parquet");
    let out = Command::new(python)
        .args(["-c", PYARROW])
        .arg(src)
        .arg(&dst)
        .output()?;
    if !out.status.success() {
        bail!("pyarrow failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    #[derive(Deserialize)]
    struct Py {
        rows: usize,
        seconds: f64,
        cpu_seconds: f64,
        system_seconds: f64,
        minor_faults: u64,
    }
    let py: Py = serde_json::from_slice(&out.stdout)?;
    if py.rows != records {
        bail!("pyarrow read {} of {records} records", py.rows);
    }
    std::fs::remove_file(&dst)?;
    Ok(
        Throughput::new(py.rows, raw_bytes, py.seconds, py.cpu_seconds).with_kernel(Kernel {
            system_seconds: py.system_seconds,
            minor_faults: py.minor_faults,
        }),
    )
}

/// Reads `n` messages of every partition of `topic` from the beginning.
fn read_all(brokers: &str, topic: &str, partitions: i32, n: usize) -> anyhow::Result<Throughput> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "bench-reader")
        .set("enable.auto.commit", "false")
        .create()?;
    let mut list = TopicPartitionList::new();
    for p in 0..partitions {
        list.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&list)?;
    let m = Measure::start();
    let (mut count, mut bytes) = (0, 0);
    while count < n {
        match consumer.poll(Duration::from_secs(10)) {
            Some(Ok(msg)) => {
                count += 1;
                bytes += rdkafka::Message::payload(&msg).map_or(0, <[u8]>::len) + 1;
            }
            Some(Err(e)) => bail!("consumer error: {e}"),
            None => bail!("the consumer read {count} of {n} records"),
        }
    }
    Ok(m.done(count, bytes))
}

/// The child side: runs a sink over the topics with `prefix` until `records` rows are written,
/// and prints its own throughput and peak RSS.
pub async fn sink_worker(
    brokers: &str,
    (prefix, group_id): (&str, &str),
    (records, raw_bytes): (usize, usize),
    landing: &Path,
    ingest_time: IngestTime,
    consumer: std::collections::BTreeMap<String, String>,
    (table_commit_ms, registry): (Option<u64>, Option<String>),
) -> anyhow::Result<SinkRun> {
    let table = match table_commit_ms {
        Some(ms) => Some(serde_json::from_value(serde_json::json!({
            "catalog": landing.join("catalog.db"),
            "commit_interval_ms": ms,
        }))?),
        None => None,
    };
    let mut config = sink::SinkConfig {
        store: sink::config::StoreConfig::Local {
            path: landing.to_path_buf(),
        },
        table,
        registry: registry.map(|url| {
            serde_json::from_value(serde_json::json!({ "url": url }))
                .expect("a registry config of its URL")
        }),
        ..sink::SinkConfig::default()
    };
    config.rotation.idle_ms = 1_000;
    config.kafka.brokers = brokers.to_owned();
    config.kafka.topic_prefix = prefix.to_owned();
    config.kafka.group_id = group_id.to_owned();
    config.kafka.ingest_time = ingest_time;
    config.kafka.consumer = consumer;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let start = Measure::start();
    let sink = sink::start(config, schemas::example_streams(), shutdown.clone()).await?;
    // Start-up (the consumer, joining the group, warming the dedupe windows) is timed on its
    // own, as pyarrow's import is left out of its time: the throughput counts from the first
    // record taken, less the few taken in the millisecond before it was seen.
    let stats = &sink.stats;
    let mut taken = 0;
    while taken == 0 {
        if sink.task.is_finished() {
            bail!("the sink stopped before taking a record");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        taken = stats.records_received.load(Ordering::Relaxed) as usize;
    }
    let startup = start.done(0, 0);
    let m = Measure::start();
    while stats.records_written.load(Ordering::Relaxed) < records as u64 {
        if sink.task.is_finished() {
            bail!("the sink stopped early");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let task = sink.task.await?;
    task?;
    let counted = records - taken.min(records);
    let throughput = m.done(counted, raw_bytes * counted / records.max(1));
    Ok(SinkRun {
        startup_cpu_seconds: startup.cpu_seconds,
        throughput,
        peak_rss_bytes: peak_rss_bytes(),
        files: sink.stats.files_written.load(Ordering::Relaxed),
    })
}

impl std::fmt::Display for SinkBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "sink benchmark: {} records, {:.1} MB NDJSON, {} partitions, {}; ingest time from the {}",
            self.records,
            self.raw_bytes as f64 / 1e6,
            self.partitions,
            if self.gateway_headers {
                "with the gateway's headers"
            } else {
                "no headers"
            },
            ingest_time_name(self.ingest_time)
        )?;
        let path = format!(
            "sink's work without Kafka (1 thread, {} files)",
            self.partitions
        );
        crate::bench_gateway::write_table(
            f,
            &[
                ("librdkafka consumer (read only)", &self.librdkafka_consumer),
                ("sink (Kafka → Parquet files)", &self.sink.throughput),
                (
                    "sink, Avro values (registry wire format)",
                    &self.sink_avro.throughput,
                ),
                (
                    "sink with an Iceberg table (a commit a second)",
                    &self.sink_table.throughput,
                ),
                ("pyarrow (NDJSON → Parquet)", &self.pyarrow),
                (&path, &self.sink_path),
            ],
        )?;
        writeln!(
            f,
            "sink / pyarrow (records per CPU-second, fastest rounds): {:.2} (by round: {}; \
             median {:.2})",
            self.ratio_sink_pyarrow,
            crate::bench_gateway::ratios_text(&self.round_ratios),
            self.median_round_ratio
        )?;
        writeln!(
            f,
            "sink with a table / plain sink (records per CPU-second, fastest rounds): {:.2} (by \
             round: {}; median {:.2})",
            self.ratio_table_plain,
            crate::bench_gateway::ratios_text(&self.round_table_ratios),
            self.median_round_table_ratio
        )?;
        writeln!(
            f,
            "sink with Avro values / JSON values (records per CPU-second, fastest rounds): {:.2} \
             (by round: {}; median {:.2})",
            self.ratio_avro_json,
            crate::bench_gateway::ratios_text(&self.round_avro_ratios),
            self.median_round_avro_ratio
        )?;
        if let (Some(connect), Some(median)) = (&self.connect, self.median_round_connect_ratio) {
            writeln!(
                f,
                "Kafka Connect's Iceberg sink (a commit a second): {:.0} records/cpu-s, peak RSS \
                 {:.0} MiB, {} files, {} snapshots, {} rows; sink with a table / Connect (records \
                 per CPU-second): {:.2} (fastest rounds; by round: {}; median {median:.2}); peak \
                 RSS sink with a table / Connect: {:.2}",
                connect.throughput.records_per_cpu_s,
                connect.peak_rss_bytes as f64 / 1048576.0,
                connect.files,
                connect.snapshots,
                connect.rows,
                self.sink_table.throughput.records_per_cpu_s / connect.throughput.records_per_cpu_s,
                crate::bench_gateway::ratios_text(&self.round_connect_ratios),
                self.sink_table.peak_rss_bytes as f64 / connect.peak_rss_bytes.max(1) as f64
            )?;
        }
        if let Some(k) = &self.connect_kill_loop {
            writeln!(
                f,
                "Kafka Connect's Iceberg sink killed {} times in {} s while {} readings flowed: \
                 {} rows in its table, {} missing, {} duplicated",
                k.kills, k.seconds, k.produced, k.rows, k.missing, k.duplicated
            )?;
        }
        writeln!(
            f,
            "sink / pyarrow if taking the messages and the work without Kafka added nothing \
             (consumer + work, fastest rounds): {:.2}",
            self.ratio_parts_pyarrow
        )?;
        writeln!(
            f,
            "the kernel's part of the CPU time, fastest rounds: sink {}; pyarrow {}",
            kernel_text(&self.sink.throughput),
            kernel_text(&self.pyarrow)
        )?;
        writeln!(
            f,
            "sink / pyarrow in user CPU time per record alone: {} by round, median {:.2}",
            crate::bench_gateway::ratios_text(&self.round_user_ratios),
            self.median_round_user_ratio
        )?;
        writeln!(
            f,
            "sink: peak RSS {:.0} MiB with {} partitions assigned, {} files; start-up {:.2} CPU-s \
             (not in the table)",
            self.sink.peak_rss_bytes as f64 / (1 << 20) as f64,
            self.partitions,
            self.sink.files,
            self.sink.startup_cpu_seconds
        )?;
        let l = &self.landing;
        write!(
            f,
            "landed bytes per record: sink {:.2}, pyarrow's best on the same rows {:.2} ({}): \
             {:.3}x",
            l.sink_bytes_per_record,
            l.pyarrow_bytes_per_record
                .get(&l.pyarrow_best)
                .copied()
                .unwrap_or_default(),
            l.pyarrow_best,
            l.sink_over_pyarrow_best
        )
    }
}

/// The sink's work on a record without Kafka, on this thread: decode + validate + hash +
/// dedupe (the default window) + Arrow + Parquet (zstd) into staged files, `rounds` times over
/// the records; the fastest round is the result. The records are spread over `partitions`
/// partitions by their device, as the gateway's key spreads them over a topic's partitions, and
/// each partition writes its own file as the sink's writers do. It runs the sink's own
/// per-record code ([`sink::partition::PartitionState::check`] and `append_checked`, a
/// group of records at a time as the worker takes them) and is what to compare with
/// pyarrow's conversion of the same NDJSON, and the target for a profiler.
pub fn sink_path(work: &Workload, rounds: usize, partitions: usize) -> anyhow::Result<Throughput> {
    let config = sink::SinkConfig::default();
    let targets = sink::open_file::FileTargets {
        file_bytes: config.rotation.max_bytes,
        row_group_bytes: config.rotation.row_group_bytes,
    };
    let partitions = partitions.max(1);
    let lines: Vec<(&[u8], usize)> = work
        .raw
        .iter()
        .flat_map(|(_, b)| b.split(|c| *c == b'\n').filter(|l| !l.is_empty()))
        .map(|line| {
            let value: serde_json::Value = serde_json::from_slice(line)?;
            let device = value["device_id"].as_str().unwrap_or_default();
            Ok((line, device_partition(device, partitions)))
        })
        .collect::<anyhow::Result<_>>()?;
    let window = sink::window_capacity(&config, partitions);
    let mut best: Option<Throughput> = None;
    for _ in 0..rounds.max(1) {
        let staging = tempfile::tempdir()?;
        let mut parts: Vec<_> = (0..partitions)
            .map(|p| {
                let state = sink::partition::PartitionState::new(
                    work.def.clone(),
                    "bench".into(),
                    p as i32,
                    window,
                );
                (state, 0i64)
            })
            .collect();
        let m = Measure::start();
        let mut rows = 0;
        // As the sink's worker takes ready messages: a group checked, its content hashes made
        // together, then appended in order.
        let mut hashes = schemas::HashGroup::new();
        let registry = sink::registry::Schemas::default();
        for (g, group) in lines.chunks(sink::READY_GROUP).enumerate() {
            let checked: Vec<_> = group
                .iter()
                .map(|&(line, p)| parts[p].0.check(line, &mut hashes, &registry))
                .collect();
            hashes.finish();
            for (&(_, p), checked) in group.iter().zip(&checked) {
                if let Ok(row) = checked {
                    parts[p].0.prefetch(&hashes.get(row.hash));
                }
            }
            for (k, (&(line, p), checked)) in group.iter().zip(&checked).enumerate() {
                let (part, offset) = &mut parts[p];
                let checked = checked.as_ref().map(|row| (row, hashes.get(row.hash)));
                let appended =
                    part.append_checked(checked, line, *offset, 0, staging.path(), targets)?;
                *offset += 1;
                match appended {
                    sink::partition::Appended::Row { full } => {
                        rows += 1;
                        if full {
                            finish(part, *offset)?;
                        }
                    }
                    other => bail!("record {}: {other:?}", g * sink::READY_GROUP + k),
                }
            }
            hashes.clear();
        }
        for (part, offset) in &mut parts {
            finish(part, *offset)?;
        }
        keep_fastest(&mut best, m.done(rows, work.raw_bytes), |t| t.cpu_seconds);
    }
    best.context("no rounds")
}

/// A device's partition of `partitions`: a stable spread like the producer's key hash.
fn device_partition(device: &str, partitions: usize) -> usize {
    let digest = blake3::hash(device.as_bytes());
    let mut head = [0; 8];
    head.copy_from_slice(&digest.as_bytes()[..8]);
    (u64::from_le_bytes(head) % partitions as u64) as usize
}

/// Closes the partition's open file (up to `next` offset), as a flush does.
fn finish(part: &mut sink::partition::PartitionState, next: i64) -> anyhow::Result<()> {
    let first = part.range_start.map_or(0, |r| r.offset);
    if let Some(file) = part.file.take() {
        let range = sink::parquet_file::OffsetRange {
            first,
            last: next - 1,
        };
        file.finish(&part.topic, part.partition, range)?;
    }
    part.range_start = None;
    Ok(())
}
