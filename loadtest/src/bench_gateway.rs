//! Gateway benchmark: 1 MiB zstd NDJSON batches of the sensor stream posted by concurrent
//! clients, against a librdkafka producer sending the same records straight to the same broker
//! in the same run; plus the decode+validate+hash path alone and latency at half of peak.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use ingest_gateway::GatewayConfig;
use ingest_gateway::api::{Encoding, check_body};
use ingest_gateway::config::LimitsConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};
use schemas::decode::BodyFormat;
use schemas::wire::encode_value;
use serde::Serialize;
use service_kit::http::body::decompress_into;
use service_kit::kafka::{DeliveryGroup, GroupProducer, Messages};
use tokio_util::sync::CancellationToken;

use crate::fleet::{FleetSpec, sensor_readings};

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub brokers: String,
    pub records: usize,
    pub concurrency: usize,
    pub batch_bytes: usize,
    /// Rounds of (direct, gateway), alternated so that both paths see the same machine noise.
    pub rounds: usize,
    /// Rounds run first and not counted: a freshly started broker was slower in the first
    /// rounds (the direct client, which runs first in a round, at half its later speed), so
    /// they favoured the gateway.
    pub warmup_rounds: usize,
    pub out: std::path::PathBuf,
}

#[derive(Debug, Serialize, serde::Deserialize)]
pub struct Throughput {
    pub records: usize,
    pub seconds: f64,
    pub cpu_seconds: f64,
    pub records_per_s: f64,
    pub mb_per_s: f64,
    pub records_per_cpu_s: f64,
    pub mb_per_cpu_s: f64,
    /// The kernel's part of `cpu_seconds` (page faults, system calls).
    #[serde(default)]
    pub system_seconds: f64,
    /// Minor page faults in the same time: first touches of memory, mostly.
    #[serde(default)]
    pub minor_faults: u64,
}

impl Throughput {
    pub(crate) fn new(records: usize, bytes: usize, seconds: f64, cpu_seconds: f64) -> Throughput {
        let mb = bytes as f64 / 1e6;
        Throughput {
            records,
            seconds,
            cpu_seconds,
            records_per_s: records as f64 / seconds,
            mb_per_s: mb / seconds,
            records_per_cpu_s: records as f64 / cpu_seconds.max(1e-9),
            mb_per_cpu_s: mb / cpu_seconds.max(1e-9),
            system_seconds: 0.0,
            minor_faults: 0,
        }
    }

    /// With the kernel's part of the CPU time and the minor page faults.
    pub(crate) fn with_kernel(mut self, kernel: Kernel) -> Throughput {
        self.system_seconds = kernel.system_seconds;
        self.minor_faults = kernel.minor_faults;
        self
    }
}

/// System CPU time and minor page faults of this process (all threads), or between two
/// readings.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Kernel {
    pub(crate) system_seconds: f64,
    pub(crate) minor_faults: u64,
}

impl Kernel {
    /// This process's so far, from `/proc/self/stat` (zero where it cannot be read).
    pub(crate) fn now() -> Kernel {
        std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| Kernel::parse(&stat))
            .unwrap_or_default()
    }

    /// Fields 10 (`minflt`) and 15 (`stime`, in clock ticks) of a `/proc/<pid>/stat` line. The
    /// command name (field 2) may hold spaces and parentheses, so fields are counted from the
    /// last `)`.
    fn parse(stat: &str) -> Option<Kernel> {
        let rest = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = fields.get(12)?.parse().ok()?;
        Some(Kernel {
            system_seconds: ticks as f64 / rustix::param::clock_ticks_per_second() as f64,
            minor_faults: fields.get(7)?.parse().ok()?,
        })
    }

    fn since(self, start: Kernel) -> Kernel {
        Kernel {
            system_seconds: self.system_seconds - start.system_seconds,
            minor_faults: self.minor_faults.saturating_sub(start.minor_faults),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub raw_bytes: usize,
    pub batches: usize,
    /// The gateway's request check on one thread: decompress, decode, validate, hash and lay
    /// out the Kafka messages (the client's text is the value when it may stand as one).
    pub gateway_check: Throughput,
    /// The median round of each path (by records/s).
    pub direct_librdkafka: Throughput,
    pub gateway: Throughput,
    /// Median gateway records/s over median direct records/s.
    pub ratio_gateway_direct: f64,
    /// Gateway / direct of each counted round.
    pub round_ratios: Vec<f64>,
    /// The median of `round_ratios`: each round pairs the two paths close in time, so this
    /// follows the machine's drift less than the ratio of medians.
    pub median_round_ratio: f64,
    pub warmup_rounds: usize,
    pub half_peak_batches_per_s: f64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
}

/// CPU seconds this process used so far (user + system, all threads), to the nanosecond.
fn cpu_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// Wall-clock and CPU time of this process (with the kernel's part) from a starting point.
pub(crate) struct Measure {
    wall: Instant,
    cpu: f64,
    kernel: Kernel,
}

impl Measure {
    pub(crate) fn start() -> Measure {
        Measure {
            wall: Instant::now(),
            cpu: cpu_seconds(),
            kernel: Kernel::now(),
        }
    }
    pub(crate) fn done(self, records: usize, bytes: usize) -> Throughput {
        Throughput::new(
            records,
            bytes,
            self.wall.elapsed().as_secs_f64(),
            cpu_seconds() - self.cpu,
        )
        .with_kernel(Kernel::now().since(self.kernel))
    }
}

/// Normalized NDJSON lines cut into batches of at most `batch_bytes`.
fn batches(
    records: &[serde_json::Value],
    batch_bytes: usize,
) -> anyhow::Result<Vec<(usize, Vec<u8>)>> {
    let streams = schemas::example_streams();
    let def = streams
        .get("sensor_readings")
        .context("sensor_readings missing")?;
    let mut out = Vec::new();
    let mut cur = Vec::with_capacity(batch_bytes);
    let mut n = 0;
    for r in records {
        let line = encode_value(def, &schemas::check(def, r.clone())?.record);
        if cur.len() + line.len() + 1 > batch_bytes && n > 0 {
            out.push((n, std::mem::take(&mut cur)));
            n = 0;
        }
        cur.extend_from_slice(&line);
        cur.push(b'\n');
        n += 1;
    }
    if n > 0 {
        out.push((n, cur));
    }
    Ok(out)
}

/// The benchmark's records: normalized NDJSON batches and their zstd-3 compressed forms.
pub struct Workload {
    pub def: std::sync::Arc<schemas::StreamDef>,
    pub raw: Vec<(usize, Vec<u8>)>,
    pub compressed: Vec<(usize, Bytes)>,
    pub total: usize,
    pub raw_bytes: usize,
}

impl Workload {
    /// `records` sensor readings from 1,000 devices, no duplicates, cut into batches of at most
    /// `batch_bytes` uncompressed.
    pub fn generate(records: usize, batch_bytes: usize) -> anyhow::Result<Workload> {
        let streams = schemas::example_streams();
        let def = streams
            .get("sensor_readings")
            .context("sensor_readings missing")?
            .clone();
        let fleet = FleetSpec {
            records,
            devices: 1_000,
            duplicate_ratio: 0.0,
            ..FleetSpec::default()
        };
        let raw = batches(&sensor_readings(&fleet), batch_bytes)?;
        let raw_bytes: usize = raw.iter().map(|(_, b)| b.len()).sum();
        let total: usize = raw.iter().map(|(n, _)| n).sum();
        let compressed: Vec<(usize, Bytes)> = raw
            .iter()
            .map(|(n, b)| Ok((*n, Bytes::from(zstd::bulk::compress(b, 3)?))))
            .collect::<anyhow::Result<_>>()?;
        eprintln!(
            "bench: {total} records, {} batches, {:.1} MB NDJSON",
            raw.len(),
            raw_bytes as f64 / 1e6
        );
        Ok(Workload {
            def,
            raw,
            compressed,
            total,
            raw_bytes,
        })
    }

    /// Decompress + decode + validate + hash alone (what the per-core target names), on
    /// this thread, `rounds` times over the batches, as the gateway does it: the record's fields
    /// are scanned, validated and hashed where they lie in the body, no record is built
    /// (`check_bytes_forward_in` on the body's [`schemas::Line`]s, which falls back to building
    /// one for lines the scanner declines).
    pub fn validate_path(&self, rounds: usize) -> anyhow::Result<Throughput> {
        self.count_valid(rounds, |def, line| {
            schemas::check_bytes_forward_in(def, line, &mut schemas::AtOnce).is_ok()
        })
    }

    /// [`Workload::validate_path`] building each record (`check_bytes`): what the sink's dead
    /// letters, the agent's filters and its Parquet batches need.
    pub fn validate_path_records(&self, rounds: usize) -> anyhow::Result<Throughput> {
        self.count_valid(rounds, |def, line| {
            schemas::check_bytes(def, line.bytes()).is_ok()
        })
    }

    /// Decompresses each batch and counts the lines `valid` accepts, `rounds` times.
    fn count_valid(
        &self,
        rounds: usize,
        valid: impl Fn(&schemas::StreamDef, schemas::Line<'_>) -> bool,
    ) -> anyhow::Result<Throughput> {
        let (mut dctx, mut plain) = (None, Vec::new());
        self.time_per_batch("validation", rounds, |body| {
            let limit = LimitsConfig::default().max_decompressed_bytes;
            let dictionaries = &self.def.dictionaries;
            decompress_into(
                Encoding::Zstd,
                body,
                limit,
                &mut dctx,
                dictionaries,
                &mut plain,
                &mut schemas::budget::unlimited,
            )?;
            Ok(schemas::decode::ndjson_lines_in(&plain)
                .filter(|&line| valid(&self.def, line))
                .count())
        })
    }

    /// The gateway's check of a request body (decompress, decode, validate, hash, lay out the
    /// Kafka messages) alone, on this thread, `rounds` times over the batches: what one core
    /// does with a request body before producing it.
    pub fn gateway_check(&self, rounds: usize) -> anyhow::Result<Throughput> {
        let limits = LimitsConfig::default();
        self.time_per_batch("decode path", rounds, |body| {
            Ok(check_body(
                &self.def,
                BodyFormat::Ndjson,
                Encoding::Zstd,
                body.clone(),
                &limits,
                &mut schemas::budget::unlimited,
            )
            .map_or(0, |c| c.prepared.len()))
        })
    }

    /// Runs `accept` (records accepted from one compressed batch) over every batch, `rounds`
    /// times, on this thread; fails unless every record was accepted. The fastest round is the
    /// result: the slower ones lost time to the machine (other processes, a busy hypervisor).
    fn time_per_batch(
        &self,
        what: &str,
        rounds: usize,
        mut accept: impl FnMut(&Bytes) -> anyhow::Result<usize>,
    ) -> anyhow::Result<Throughput> {
        let mut best: Option<Throughput> = None;
        for _ in 0..rounds.max(1) {
            let m = Measure::start();
            let mut ok = 0;
            for (_, body) in &self.compressed {
                ok += accept(body)?;
            }
            if ok != self.total {
                bail!("{what} accepted {ok} of {} records", self.total);
            }
            let t = m.done(self.total, self.raw_bytes);
            if best.as_ref().is_none_or(|b| t.cpu_seconds < b.cpu_seconds) {
                best = Some(t);
            }
        }
        best.context("no rounds")
    }
}

/// Hands a record to librdkafka, waiting while its queue is full.
pub(crate) async fn send_queued<K, P>(
    producer: &FutureProducer,
    mut record: FutureRecord<'_, K, P>,
) -> rdkafka::producer::DeliveryFuture
where
    K: rdkafka::message::ToBytes + ?Sized,
    P: rdkafka::message::ToBytes + ?Sized,
{
    loop {
        match producer.send_result(record) {
            Ok(delivery) => return delivery,
            Err((_, r)) => {
                record = r;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
}

pub async fn run(opts: BenchOptions) -> anyhow::Result<BenchReport> {
    let streams = schemas::example_streams();
    let work = Workload::generate(opts.records, opts.batch_bytes)?;
    let Workload {
        def,
        raw,
        compressed,
        total,
        raw_bytes,
    } = &work;
    let (def, total, raw_bytes) = (def.clone(), *total, *raw_bytes);

    // 1. The gateway's check of the request bodies alone, one thread.
    let check_t = tokio::task::block_in_place(|| work.gateway_check(1))?;

    let id = std::process::id();
    let mut kafka = ingest_gateway::config::KafkaConfig {
        brokers: opts.brokers.clone(),
        create_topics: true,
        ..Default::default()
    };

    // 2. Direct: a librdkafka producer with the gateway's settings, same records, same broker.
    kafka.topic_prefix = format!("bench{id}direct.");
    ingest_gateway::produce::ensure_topics(&kafka, &streams).await?;
    let topic = format!("{}sensor_readings", kafka.topic_prefix);
    // The same producer, message layout and acknowledgement handling as the gateway's; the
    // records' own NDJSON lines are the values.
    let producer = service_kit::kafka::group_producer(&service_kit::kafka::producer_config(
        &opts.brokers,
        kafka.produce_timeout_ms,
    ))?;
    let mut prepared = service_kit::kafka::Messages::new(&def, total, raw_bytes);
    for (_, batch) in raw {
        for line in batch.split(|c| *c == b'\n').filter(|l| !l.is_empty()) {
            prepared.push_forward(&def, &schemas::check_bytes_forward(&def, line)?, line);
        }
    }
    // 3. The gateway, with concurrent clients posting the compressed batches.
    kafka.topic_prefix = format!("bench{id}gw.");
    let mut config = GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        admin_listen: None,
        kafka,
        ..GatewayConfig::default()
    };
    config.auth.allow_anonymous = true;
    let shutdown = CancellationToken::new();
    let (addr, gateway) = spawn_gateway(config, streams.clone(), shutdown.clone()).await?;
    let url = format!("http://{addr}/v1/streams/sensor_readings/records");
    let client = reqwest::Client::new();

    let (mut directs, mut gateways, mut round_ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..opts.warmup_rounds + opts.rounds.max(1) {
        let direct = produce_direct(&producer, &topic, &prepared, total, raw_bytes).await?;
        let gw = post_all(
            &client,
            &url,
            compressed,
            opts.concurrency,
            total,
            raw_bytes,
        )
        .await?;
        let ratio = gw.records_per_s / direct.records_per_s;
        let warmup = round < opts.warmup_rounds;
        eprintln!(
            "round {}{}: direct {:.0} records/s, gateway {:.0} records/s, ratio {ratio:.2}",
            round + 1,
            if warmup {
                " (warm-up, not counted)"
            } else {
                ""
            },
            direct.records_per_s,
            gw.records_per_s
        );
        if warmup {
            continue;
        }
        round_ratios.push(ratio);
        directs.push(direct);
        gateways.push(gw);
    }
    let direct = median_by(directs, |t| t.records_per_s);
    let gw = median_by(gateways, |t| t.records_per_s);

    // 4. Latency at half of the peak request rate.
    let half_rate = compressed.len() as f64 / gw.seconds / 2.0;
    let interval = Duration::from_secs_f64(1.0 / half_rate);
    let mut ticker = tokio::time::interval(interval);
    let mut handles = Vec::new();
    for (_, body) in compressed.iter().cycle().take(compressed.len().max(40)) {
        ticker.tick().await;
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        handles.push(tokio::spawn(async move {
            let started = Instant::now();
            post(&client, &url, body).await.map(|()| started.elapsed())
        }));
    }
    let mut latencies = Vec::new();
    for h in handles {
        latencies.push(h.await??);
    }
    latencies.sort();
    let pct = |p: f64| {
        latencies[((latencies.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1000.0
    };
    shutdown.cancel();
    tokio::task::block_in_place(|| gateway.join())
        .map_err(|_| anyhow::anyhow!("the gateway thread panicked"))??;

    let report = BenchReport {
        raw_bytes,
        batches: compressed.len(),
        ratio_gateway_direct: gw.records_per_s / direct.records_per_s,
        median_round_ratio: median_ratio(&round_ratios),
        round_ratios,
        warmup_rounds: opts.warmup_rounds,
        gateway_check: check_t,
        direct_librdkafka: direct,
        gateway: gw,
        half_peak_batches_per_s: half_rate,
        latency_p50_ms: pct(0.5),
        latency_p99_ms: pct(0.99),
    };
    write_report(&opts.out, &report)?;
    Ok(report)
}

/// Runs the gateway as its binary does: on its own runtime ([`ingest_gateway::runtime`], request
/// workers at `worker_nice`), started from a thread at this process's priority so that its
/// Kafka producer's threads keep that priority, as the direct producer's do.
async fn spawn_gateway(
    config: GatewayConfig,
    streams: schemas::Streams,
    shutdown: CancellationToken,
) -> anyhow::Result<(
    std::net::SocketAddr,
    std::thread::JoinHandle<anyhow::Result<()>>,
)> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let thread = std::thread::Builder::new()
        .name("gateway".into())
        .spawn(move || {
            let runtime = ingest_gateway::runtime(config.worker_nice)?;
            runtime.block_on(async move {
                let gateway = ingest_gateway::start(config, streams, shutdown).await?;
                let _ = tx.send(gateway.addr);
                gateway.task.await?
            })
        })?;
    match rx.await {
        Ok(addr) => Ok((addr, thread)),
        Err(_) => Err(tokio::task::block_in_place(|| thread.join())
            .map_err(|_| anyhow::anyhow!("the gateway thread panicked"))?
            .err()
            .unwrap_or_else(|| anyhow::anyhow!("the gateway stopped before it listened"))),
    }
}

/// The item of median `key` (the upper one of an even count); `items` is not empty.
pub(crate) fn median_by<T>(mut items: Vec<T>, key: impl Fn(&T) -> f64) -> T {
    items.sort_by(|a, b| key(a).total_cmp(&key(b)));
    let mid = items.len() / 2;
    items.swap_remove(mid)
}

/// The median of the rounds' own ratios (the upper one of an even count); `ratios` is not empty.
pub(crate) fn median_ratio(ratios: &[f64]) -> f64 {
    median_by(ratios.to_vec(), |r| *r)
}

/// The rounds' own ratios as the benchmarks print them.
pub(crate) fn ratios_text(ratios: &[f64]) -> String {
    let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
    each.join(", ")
}

/// Sends every prepared record straight to Kafka and waits for all acknowledgements.
async fn produce_direct(
    producer: &GroupProducer,
    topic: &str,
    prepared: &Messages,
    total: usize,
    raw_bytes: usize,
) -> anyhow::Result<Throughput> {
    let m = Measure::start();
    let mut group = DeliveryGroup::new();
    prepared.send(
        producer,
        &mut group,
        topic,
        &service_kit::kafka::ingest_ts_now(),
    )?;
    group.settled().await?;
    Ok(m.done(total, raw_bytes))
}

/// Posts every batch to the gateway from `concurrency` clients.
async fn post_all(
    client: &reqwest::Client,
    url: &str,
    compressed: &[(usize, Bytes)],
    concurrency: usize,
    total: usize,
    raw_bytes: usize,
) -> anyhow::Result<Throughput> {
    let queue = Arc::new(std::sync::Mutex::new(compressed.to_vec()));
    let m = Measure::start();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (queue, client, url) = (queue.clone(), client.clone(), url.to_owned());
        workers.push(tokio::spawn(async move {
            loop {
                let next = queue.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.pop();
                let Some((_, body)) = next else { break };
                post(&client, &url, body).await?;
            }
            anyhow::Ok(())
        }));
    }
    for w in workers {
        w.await??;
    }
    Ok(m.done(total, raw_bytes))
}

async fn post(client: &reqwest::Client, url: &str, body: Bytes) -> anyhow::Result<()> {
    let res = client
        .post(url)
        .header("content-type", "application/x-ndjson")
        .header("content-encoding", "zstd")
        .body(body)
        .send()
        .await?;
    if !res.status().is_success() {
        bail!(
            "gateway answered {}: {}",
            res.status(),
            res.text().await.unwrap_or_default()
        );
    }
    Ok(())
}

pub(crate) fn write_report(path: &Path, report: &impl Serialize) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_vec_pretty(report)?)?;
    Ok(())
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "gateway benchmark: {} batches, {:.1} MB NDJSON (zstd-3 on the wire)",
            self.batches,
            self.raw_bytes as f64 / 1e6
        )?;
        write_table(
            f,
            &[
                ("check (unzstd+decode+validate+hash)", &self.gateway_check),
                ("direct librdkafka", &self.direct_librdkafka),
                ("gateway (HTTP→Kafka)", &self.gateway),
            ],
        )?;
        writeln!(
            f,
            "ratio gateway/direct (records/s): {:.2} for the median rounds; median of the \
             round ratios {:.2} (by round: {}; {} warm-up round(s) not counted)",
            self.ratio_gateway_direct,
            self.median_round_ratio,
            ratios_text(&self.round_ratios),
            self.warmup_rounds
        )?;
        write!(
            f,
            "latency at half peak ({:.1} batches/s): p50 {:.1} ms, p99 {:.1} ms",
            self.half_peak_batches_per_s, self.latency_p50_ms, self.latency_p99_ms
        )
    }
}

/// A table of throughputs, one row per path.
pub(crate) fn write_table(
    f: &mut std::fmt::Formatter<'_>,
    rows: &[(&str, &Throughput)],
) -> std::fmt::Result {
    writeln!(
        f,
        "{:<46} {:>12} {:>9} {:>14} {:>10}",
        "path", "records/s", "MB/s", "records/cpu-s", "MB/cpu-s"
    )?;
    for (name, t) in rows {
        writeln!(
            f,
            "{name:<46} {:>12.0} {:>9.1} {:>14.0} {:>10.1}",
            t.records_per_s, t.mb_per_s, t.records_per_cpu_s, t.mb_per_cpu_s
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Kernel, Measure, median_by, median_ratio, ratios_text};

    #[test]
    fn the_median_is_the_middle_item_or_the_upper_of_the_two() {
        // The session-50 bench-sink run's ten round ratios, in their order.
        let rounds = vec![0.93, 0.84, 1.00, 1.01, 0.95, 0.83, 1.04, 0.97, 1.07, 0.62];
        assert_eq!(median_by(rounds.clone(), |r| *r), 0.97);
        assert_eq!(median_ratio(&rounds), 0.97);
        assert_eq!(ratios_text(&rounds[..3]), "0.93, 0.84, 1.00");
        assert_eq!(median_by(vec![0.5, 0.1, 0.3], |r| *r), 0.3);
        assert_eq!(median_by(vec![2.0], |r| *r), 2.0);
        // Items are kept whole: the median by one field brings the rest with it.
        let runs = vec![("slow", 1.0), ("fast", 3.0), ("mid", 2.0)];
        assert_eq!(median_by(runs, |r| r.1).0, "mid");
    }

    #[test]
    fn kernel_fields_are_counted_from_the_last_parenthesis() {
        // A command name with a space and a parenthesis of its own; minflt 4321, stime 250.
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 4321 0 7 0 120 250 0 0 20 0 3 0";
        let k = Kernel::parse(stat).expect("parsed");
        assert_eq!(k.minor_faults, 4321);
        let hz = rustix::param::clock_ticks_per_second() as f64;
        assert!((k.system_seconds - 250.0 / hz).abs() < 1e-9);
        assert!(Kernel::parse("4242 (cut").is_none());
        assert!(Kernel::parse("4242 (x) S 1").is_none());
    }

    #[test]
    fn a_measure_counts_the_faults_of_fresh_memory() {
        let m = Measure::start();
        // 32 MiB touched page by page: 8,192 first touches of 4 KiB pages, or 16 of 2 MiB
        // pages where the system gives every process transparent huge pages.
        let mut v = vec![0u8; 32 << 20];
        for i in (0..v.len()).step_by(4096) {
            v[i] = 1;
        }
        std::hint::black_box(&v);
        let t = m.done(1, v.len());
        assert!(t.minor_faults >= 16, "{} faults", t.minor_faults);
        assert!(t.system_seconds >= 0.0 && t.system_seconds <= t.cpu_seconds + 0.02);
    }
}
