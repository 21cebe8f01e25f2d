//! The edge agent: reads records from sources, validates them, drops duplicates by content hash,
//! filters them, batches and compresses them into a durable spool, and delivers the spool to the
//! gateway (or Kafka).
//!
//! ```text
//! sources ──chunks──► pipeline (thread per stream) ──append──► spool ◄──read/ack── delivery (task per stream) ──► output
//!   ▲                      │ parse, dedupe, filter, batch, encode
//!   └── done: position saved / PUBACK / HTTP answer, once the chunk is durable
//! ```

pub mod batch;
pub mod chunk;
pub mod cli;
pub mod config;
pub mod dedupe;
pub mod deliver;
pub mod dictionary;
pub mod filter;
pub mod invalid;
pub mod link;
pub mod live;
pub mod metrics;
pub mod output;
pub mod pipeline;
pub mod rejected;
pub mod reload;
pub mod source;
pub mod spool;
pub mod stats;
pub mod status;
pub mod tls;
pub mod validate;

use std::collections::{BTreeMap, BTreeSet};
use std::io::BufReader;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use schemas::{StreamDef, Streams};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::AgentConfig;

use crate::config::SourceConfig;
use crate::deliver::{Delivery, DeliveryStats};
use crate::invalid::KeptInvalid;
use crate::link::{Link, StreamCap};
use crate::output::Output;
use crate::pipeline::{Pipeline, PipelineStats};
use crate::rejected::RejectedDir;
use crate::source::fields::{StaticFields, TopicFields};
use crate::source::file::{FileSpec, Positions};
use crate::source::mqtt::MqttSpec;
use crate::source::{Feed, Feeds, Verbatim, feed_lines_with};
use crate::spool::{Recovery, Spool, Usage};

/// Chunks queued between the sources and a stream's pipeline (each at most 256 KiB from line
/// sources; MQTT messages and HTTP bodies are single chunks). Reading is much faster than the
/// pipeline, so a few keep it busy; each more is memory.
pub const QUEUED_CHUNKS: usize = 4;

/// What happened to one stream during a run.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct StreamStats {
    pub recovery: Recovery,
    pub pipeline: PipelineStats,
    pub delivery: DeliveryStats,
}

/// What a run did, per stream.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct AgentStats {
    pub streams: BTreeMap<String, StreamStats>,
}

impl AgentStats {
    /// Sums over all streams.
    pub fn total(&self) -> StreamStats {
        let mut t = StreamStats::default();
        for s in self.streams.values() {
            let (p, d) = (&s.pipeline, &s.delivery);
            t.pipeline.read += p.read;
            t.pipeline.invalid += p.invalid;
            t.pipeline.duplicates += p.duplicates;
            t.pipeline.filtered += p.filtered;
            t.pipeline.batched += p.batched;
            t.pipeline.batches += p.batches;
            t.pipeline.spool_dropped += p.spool_dropped;
            t.pipeline.raw_bytes += p.raw_bytes;
            t.pipeline.encoded_bytes += p.encoded_bytes;
            t.pipeline.retried += p.retried;
            t.delivery.batches += d.batches;
            t.delivery.records += d.records;
            t.delivery.accepted += d.accepted;
            t.delivery.duplicates += d.duplicates;
            t.delivery.rejected_records += d.rejected_records;
            t.delivery.rejected_batches += d.rejected_batches;
            t.delivery.wire_bytes += d.wire_bytes;
            t.delivery.raw_bytes += d.raw_bytes;
        }
        t
    }
}

/// Streams the agent runs a pipeline for from the start: those its sources name, every known
/// stream if there is an HTTP source, and any stream with batches left in the spool from an
/// earlier run. An HTTP source starts streams defined later as they are asked for
/// ([`Starter`]).
fn active_streams(config: &AgentConfig, streams: &Streams, spool_root: &Path) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = config
        .sources
        .iter()
        .filter_map(|s| s.stream().map(str::to_owned))
        .collect();
    if config
        .sources
        .iter()
        .any(|s| matches!(s, SourceConfig::Http { .. }))
    {
        names.extend(streams.iter().map(|d| d.name.clone()));
    }
    if let Ok(entries) = std::fs::read_dir(spool_root) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if streams.get(&name).is_some() {
                names.insert(name);
            }
        }
    }
    names
}

/// Creates the state directory and takes its lock, held while the returned file is open: one
/// process at a time works on a state directory.
fn lock_state(state: &Path) -> anyhow::Result<std::fs::File> {
    std::fs::create_dir_all(state)
        .with_context(|| format!("cannot create state directory {}", state.display()))?;
    let lock = std::fs::File::create(state.join("lock"))?;
    if lock.try_lock().is_err() {
        anyhow::bail!(
            "another agent is running with state directory {}",
            state.display()
        );
    }
    Ok(lock)
}

/// What [`resend_rejected`] put back.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Resent {
    pub batches: u64,
    pub records: u64,
}

/// Puts the batches kept under `rejected/` (of `stream`, or of every stream) back into their
/// streams' spools, oldest first, and removes them from `rejected/` once the spool holds them
/// durably: the agent delivers them at its next start, with their own Idempotency-Keys. For
/// once the cause of the refusal is fixed. Refuses while an agent runs on the state directory,
/// and stops at the first batch the spool has no room for (it and the rest stay kept).
pub fn resend_rejected(
    config: &AgentConfig,
    streams: &Streams,
    stream: Option<&str>,
) -> anyhow::Result<Resent> {
    let state = &config.state_dir;
    let _lock = lock_state(state)?;
    let rejected = RejectedDir::new(state.join("rejected"), config.spool.rejected_max_bytes());
    let kept = rejected.list(stream)?;
    let spool_root = state.join("spool");
    // Every stream's spool counts towards the shared limit, not only those taking batches.
    let usage = Arc::new(Usage::default());
    let mut names = active_streams(config, streams, &spool_root);
    names.extend(kept.iter().map(|k| k.stream.clone()));
    let mut spools = BTreeMap::new();
    for name in names {
        if streams.get(&name).is_none() {
            anyhow::bail!(
                "kept batches of stream '{name}', which is not defined in {}",
                config.streams_dir.display()
            );
        }
        let (spool, _) = Spool::open(&spool_root, &name, config.spool.options(), usage.clone())?;
        spools.insert(name, spool);
    }
    let never = AtomicBool::new(false);
    let mut resent = Resent::default();
    for k in kept {
        let spool = &spools[&k.stream];
        if spool.append(&k.batch, spool::Overflow::DropNewest, &never)? == spool::Appended::Dropped
        {
            anyhow::bail!(
                "the spool has no room for batch {} of stream '{}' ({} bytes; spool.max_mb): {} batches were put back, the rest stay under {}",
                k.batch.id,
                k.stream,
                k.batch.body.len(),
                resent.batches,
                rejected.path().display()
            );
        }
        spool.sync(true)?;
        k.remove()
            .with_context(|| format!("cannot remove {} from rejected/", k.note.display()))?;
        tracing::info!(stream = %k.stream, batch = %k.batch.id, records = k.batch.records, status = k.status, "refused batch put back into the spool");
        resent.batches += 1;
        resent.records += u64::from(k.batch.records);
    }
    Ok(resent)
}

struct Running {
    pipeline: std::thread::JoinHandle<Result<PipelineStats, pipeline::PipelineError>>,
    delivery: JoinHandle<anyhow::Result<DeliveryStats>>,
    recovery: Recovery,
}

/// Starts a stream's spool, pipeline (a thread of its own) and delivery (a task): at the start
/// for the streams the agent runs, and later for a stream the local HTTP port is asked for
/// once its definition is in `streams_dir`. What runs is joined when the agent stops.
pub(crate) struct Starter {
    config: AgentConfig,
    spool_root: std::path::PathBuf,
    dedupe_dir: std::path::PathBuf,
    invalid_dir: std::path::PathBuf,
    usage: Arc<Usage>,
    output: Arc<Output>,
    link: Arc<Link>,
    rejected: Arc<RejectedDir>,
    cancel: Arc<AtomicBool>,
    shutdown: CancellationToken,
    live: Arc<live::Live>,
    /// `None` once the agent stops: no stream starts after that.
    running: Mutex<Option<BTreeMap<String, Running>>>,
}

impl Starter {
    /// Starts the stream `def` names (blocking: it opens the spool and loads the dedupe log) and
    /// gives the feed its sources hand chunks to.
    pub(crate) fn start(&self, def: Arc<StreamDef>) -> anyhow::Result<Feed> {
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(running) = running.as_mut() else {
            anyhow::bail!("the agent is stopping");
        };
        let name = def.name.clone();
        anyhow::ensure!(!running.contains_key(&name), "stream '{name}' runs already");
        let config = &self.config;
        let settings = config.settings(&name);
        metrics::register_stream(&name, settings.overflow.label());
        let (spool, recovery) = Spool::open(
            &self.spool_root,
            &name,
            config.spool.options(),
            self.usage.clone(),
        )?;
        if recovery != Recovery::default() {
            tracing::info!(stream = %name, ?recovery, "spool recovered");
        }
        let spool = Arc::new(spool);
        let mut pipeline = Pipeline::new(
            def,
            &settings,
            config.batch.clone(),
            &config.dedupe,
            spool.clone(),
            &self.dedupe_dir,
        )?
        .follow_definition(service_kit::DefinitionFile::new(&config.streams_dir, &name))
        .report_reductions_in(&config.state_dir)
        .report_live(self.live.stream(&name));
        // `invalid_max_mb = 0` keeps none: invalid records are only counted, as before keeping.
        let max = config.spool.invalid_max_bytes();
        if max > 0 {
            pipeline = pipeline.keep_invalid(KeptInvalid::open(&self.invalid_dir, &name, max)?);
        }
        let def = pipeline.current();
        tracing::info!(stream = %name, dedupe_bytes = pipeline.dedupe_memory_bytes(), "stream ready");
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUED_CHUNKS);
        let feed = Feed::new(tx, &name, config.batch.max_line_bytes);
        let inputs_done = Arc::new(AtomicBool::new(false));
        let pipeline = {
            let (cancel, inputs_done) = (self.cancel.clone(), inputs_done.clone());
            std::thread::Builder::new()
                .name(format!("pipeline-{name}"))
                .spawn(move || {
                    let result = pipeline.run(rx, &cancel);
                    inputs_done.store(true, Ordering::Release);
                    result
                })?
        };
        let delivery = Delivery {
            def,
            spool,
            output: self.output.clone(),
            link: self.link.clone(),
            cap: StreamCap::new(settings.max_bytes_per_sec),
            priority: settings.priority,
            rejected: self.rejected.clone(),
            inputs_done,
            live: self.live.stream(&name),
        };
        let delivery = tokio::spawn(delivery.run(self.shutdown.child_token()));
        running.insert(
            name,
            Running {
                pipeline,
                delivery,
                recovery,
            },
        );
        Ok(feed)
    }

    /// The streams started, to be joined; none starts from now on.
    fn stop_starting(&self) -> BTreeMap<String, Running> {
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        running.take().unwrap_or_default()
    }
}

/// Runs the agent: until every source has ended and the spool is delivered (sources that read to
/// an end), or until `shutdown` (then the open batches go to the spool and are delivered at the
/// next start).
pub async fn run(
    config: AgentConfig,
    streams: Streams,
    shutdown: CancellationToken,
) -> anyhow::Result<AgentStats> {
    config.validate(&streams)?;
    let state = &config.state_dir;
    let lock = lock_state(state)?;
    let spool_root = state.join("spool");
    let dedupe_dir = state.join("dedupe");
    std::fs::create_dir_all(&dedupe_dir)?;
    let health = service_kit::Health::default();
    let live = live::Live::new();
    if let Some(addr) = config.admin_listen {
        let local = service_kit::serve_admin_with(
            addr,
            health.clone(),
            status::router(&config, live.clone()),
            shutdown.clone(),
        )
        .await
        .with_context(|| format!("cannot serve admin endpoints on {addr}"))?;
        tracing::info!(%local, "admin endpoints listening");
    }
    let cancel = Arc::new(AtomicBool::new(false));
    {
        let (cancel, shutdown) = (cancel.clone(), shutdown.clone());
        tokio::spawn(async move {
            shutdown.cancelled().await;
            cancel.store(true, Ordering::Relaxed);
        });
    }
    metrics::register(config.spool.options().max_bytes);
    let output = Arc::new(Output::new(config.gateway.as_ref(), config.kafka.as_ref())?);
    if let Some(proxy) = config.gateway.as_ref().and_then(|g| g.proxy.as_ref()) {
        tracing::info!(proxy = %config::redacted_url(&proxy.url), no_proxy = proxy.no_proxy.as_deref().unwrap_or(""), "gateway proxy");
    }
    let rejected = Arc::new(RejectedDir::new(
        state.join("rejected"),
        config.spool.rejected_max_bytes(),
    ));
    ::metrics::gauge!(metrics::REJECTED_BYTES).set(rejected.used().unwrap_or(0) as f64);
    let starter = Arc::new(Starter {
        config: config.clone(),
        spool_root: spool_root.clone(),
        dedupe_dir,
        invalid_dir: state.join("invalid"),
        usage: Arc::new(Usage::default()),
        output,
        link: Arc::new(Link::new(config.max_bytes_per_sec)),
        rejected,
        cancel,
        shutdown: shutdown.clone(),
        live,
        running: Mutex::new(Some(BTreeMap::new())),
    });
    let mut feeds = Feeds::new();
    for name in active_streams(&config, &streams, &spool_root) {
        let def = streams
            .get(&name)
            .expect("active streams are known")
            .clone();
        feeds.insert(name, starter.start(def)?);
    }
    let positions = Arc::new(Positions::load(state)?);
    let saver = {
        let (positions, stop) = (positions.clone(), CancellationToken::new());
        let stop2 = stop.clone();
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop2.cancelled() => return,
                }
                let p = positions.clone();
                if let Ok(Err(e)) = tokio::task::spawn_blocking(move || p.save()).await {
                    tracing::error!(error = %e, "cannot save file positions");
                }
            }
        });
        (task, stop)
    };
    let sources = start_sources(&config, &streams, &feeds, &starter, &positions, &shutdown)?;
    drop(feeds);
    health.set_ready(true);
    let mut failure = None;
    for source in sources {
        match source.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if source::pipeline_closed(&e) => {
                // The stream's pipeline stopped before the source: at shutdown, while the
                // source waited for it (a full spool), or failing, and then its own error is
                // reported below.
                tracing::debug!(error = %format!("{e:#}"), "source stopped with its pipeline");
                shutdown.cancel();
            }
            Ok(Err(e)) => {
                tracing::error!(error = %format!("{e:#}"), "source failed; stopping");
                shutdown.cancel();
                failure.get_or_insert(e);
            }
            Err(e) => {
                shutdown.cancel();
                failure.get_or_insert(e.into());
            }
        }
    }
    let mut stats = AgentStats::default();
    for (name, r) in starter.stop_starting() {
        let pipeline = tokio::task::spawn_blocking(move || r.pipeline.join())
            .await?
            .map_err(|_| anyhow::anyhow!("pipeline of {name} panicked"))?;
        let pipeline = match pipeline {
            Ok(p) => p,
            Err(pipeline::PipelineError::Spool(spool::SpoolError::Cancelled)) => {
                PipelineStats::default()
            }
            Err(e) => {
                shutdown.cancel();
                failure.get_or_insert(anyhow::anyhow!("pipeline of {name}: {e}"));
                PipelineStats::default()
            }
        };
        let delivery = r.delivery.await??;
        stats.streams.insert(
            name,
            StreamStats {
                recovery: r.recovery,
                pipeline,
                delivery,
            },
        );
    }
    saver.1.cancel();
    let _ = saver.0.await;
    if let Err(e) = positions.save() {
        // Files are read again from the last saved positions; dedupe drops what was sent.
        tracing::error!(error = %e, "cannot save file positions");
    }
    drop(lock);
    match failure {
        Some(e) => Err(e),
        None => Ok(stats),
    }
}

type SourceTask = tokio::sync::oneshot::Receiver<anyhow::Result<()>>;

/// Runs `f` on a thread of its own (a blocked read of stdin must not hold up the runtime's
/// shutdown); the receiver reports its end.
fn on_thread(
    name: &str,
    f: impl FnOnce() -> anyhow::Result<()> + Send + 'static,
) -> anyhow::Result<SourceTask> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let _ = tx.send(f());
        })?;
    Ok(rx)
}

fn on_task(f: impl Future<Output = anyhow::Result<()>> + Send + 'static) -> SourceTask {
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let _ = tx.send(f.await);
    });
    rx
}

fn start_sources(
    config: &AgentConfig,
    streams: &Streams,
    feeds: &Feeds,
    starter: &Arc<Starter>,
    positions: &Arc<Positions>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Vec<SourceTask>> {
    let mut tasks = Vec::new();
    for source in &config.sources {
        let feed = source.stream().map(|s| {
            feeds
                .get(s)
                .expect("every source stream has a pipeline")
                .clone()
        });
        let def = source.stream().and_then(|s| streams.get(s)).cloned();
        let fields = match (source.fields(), &def) {
            (Some(fields), Some(def)) if !fields.is_empty() => {
                Some(StaticFields::new(fields, def)?)
            }
            _ => None,
        };
        let shutdown = shutdown.clone();
        let secret = source.secret()?;
        tasks.push(match source.clone() {
            SourceConfig::File {
                path,
                format,
                follow,
                suffix,
                poll_ms,
                ..
            } => {
                let spec = FileSpec {
                    path,
                    format,
                    follow,
                    suffix,
                    poll: Duration::from_millis(poll_ms),
                    fields,
                };
                let (feed, def, positions) = (
                    feed.expect("file source"),
                    def.expect("file source"),
                    positions.clone(),
                );
                on_thread("source-file", move || {
                    source::file::run(&spec, &def, &feed, &positions, &shutdown)
                        .with_context(|| format!("file source {}", spec.path.display()))
                })?
            }
            SourceConfig::Stdin { .. } => {
                let feed: Feed = feed.expect("stdin source");
                on_thread("source-stdin", move || {
                    // Read through a descriptor of its own, not std's buffered handle: a wait for
                    // input must see what is buffered.
                    let stdin = std::fs::File::from(std::io::stdin().as_fd().try_clone_to_owned()?);
                    let mut reader = BufReader::with_capacity(
                        64 * 1024,
                        source::UntilStopped::new(stdin, &shutdown),
                    );
                    feed_lines_with(
                        &mut reader,
                        &feed,
                        0,
                        true,
                        |_| None,
                        fields.as_ref(),
                        Verbatim,
                    )?;
                    Ok(())
                })?
            }
            SourceConfig::Mqtt {
                url,
                topics,
                client_id,
                qos,
                username,
                max_unacked,
                tls,
                topic_fields,
                ..
            } => {
                let topic_fields = match (topic_fields, &def) {
                    (Some(pattern), Some(def)) => Some(TopicFields::parse(&pattern, def)?),
                    _ => None,
                };
                let spec = MqttSpec {
                    url,
                    topics,
                    client_id,
                    qos,
                    username,
                    password: secret,
                    max_unacked,
                    tls,
                    topic_fields,
                    fields,
                };
                on_task(source::mqtt::run(
                    spec,
                    feed.expect("mqtt source"),
                    shutdown,
                ))
            }
            SourceConfig::Http {
                listen,
                max_body_bytes,
                tls,
                ..
            } => {
                let starter = starter.clone();
                let router = source::http::router(
                    streams.clone(),
                    &config.streams_dir,
                    feeds.clone(),
                    Arc::new(move |def| starter.start(def)),
                    secret
                        .as_ref()
                        .map(service_kit::config::secret::Secret::expose),
                    max_body_bytes,
                );
                on_task(source::http::serve(listen, router, tls, shutdown))
            }
        });
    }
    Ok(tasks)
}
