//! A recording gateway for the agent's tests: it speaks the gateway's ingest API, honours
//! `Idempotency-Key` like the real one (a repeated key replays the first answer and counts
//! nothing), checks that a repeated key always carries the same body, and misbehaves on demand:
//! 503s, 429s with `Retry-After`, answers slower than the agent's timeout, refusals.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use rand::Rng;
use schemas::api::IngestResponse;
use schemas::{ContentHash, Streams};

// The end-to-end tests' helpers: service addresses, free ports.
#[path = "../../../loadtest/tests/common/mod.rs"]
mod common;
#[allow(unused_imports)] // not every test file uses both
pub use common::{
    KillOnDrop, free_port, kubernetes_service_variables, pki, service_env, slow_proxy,
};

/// How often the stub misbehaves, in percent of requests.
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    pub unavailable: u32,
    pub too_many: u32,
    /// Answer after this long (longer than the agent's timeout) this often.
    pub slow: u32,
    pub slow_for: Duration,
    /// Refuse (400) every batch whose first record has this device id.
    pub refuse_device: Option<&'static str>,
    /// Answer every request 401, as the gateway does for an unknown token.
    pub unauthorized: bool,
    /// Answer every request 407, as a proxy on the way does without (the right) credentials.
    pub proxy_auth: bool,
}

/// An accepted request.
pub struct Accepted {
    pub at: std::time::Instant,
    pub stream: String,
    pub key: String,
    /// Its records' content hashes, in order.
    pub records: Vec<ContentHash>,
}

#[derive(Default)]
pub struct Recorded {
    /// Every accepted request, in the order they arrived (replays not included).
    pub accepted: Vec<Accepted>,
    /// Body hash of every key seen, to check that a key always means the same batch.
    pub keys: HashMap<String, blake3::Hash>,
    pub replays: u32,
    /// When each request arrived (one entry per request).
    pub arrived: Vec<std::time::Instant>,
    pub refused: u32,
    pub content_types: HashMap<String, u32>,
    /// Bytes of every request body, as sent on the wire.
    pub body_bytes: u64,
}

impl Recorded {
    /// Accepted records by content hash: how many times each landed.
    pub fn landed(&self) -> HashMap<ContentHash, u32> {
        let mut landed = HashMap::new();
        for h in self.accepted.iter().flat_map(|a| &a.records) {
            *landed.entry(*h).or_default() += 1;
        }
        landed
    }
}

pub struct Stub {
    pub addr: SocketAddr,
    /// `http` or, served with a certificate, `https`.
    scheme: &'static str,
    pub recorded: Arc<Mutex<Recorded>>,
    pub faults: Arc<Mutex<Faults>>,
    counter: Arc<AtomicU32>,
}

struct Shared {
    streams: Streams,
    recorded: Arc<Mutex<Recorded>>,
    faults: Arc<Mutex<Faults>>,
    counter: Arc<AtomicU32>,
}

impl Stub {
    pub async fn start(faults: Faults) -> Stub {
        Stub::serve(faults, None).await
    }

    /// The stub over HTTPS with `tls` (which may require client certificates).
    pub async fn start_tls(faults: Faults, tls: rustls::ServerConfig) -> Stub {
        Stub::serve(faults, Some(tls)).await
    }

    async fn serve(faults: Faults, tls: Option<rustls::ServerConfig>) -> Stub {
        let recorded = Arc::new(Mutex::new(Recorded::default()));
        let faults = Arc::new(Mutex::new(faults));
        let counter = Arc::new(AtomicU32::new(0));
        let shared = Arc::new(Shared {
            streams: schemas::example_streams(),
            recorded: recorded.clone(),
            faults: faults.clone(),
            counter: counter.clone(),
        });
        let app = Router::new()
            .route("/v1/streams/{stream}/records", post(ingest))
            .with_state(shared);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let scheme = match tls {
            None => {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
                "http"
            }
            Some(config) => {
                let config = axum_server::tls_rustls::RustlsConfig::from_config(Arc::new(config));
                let server = axum_server::from_tcp_rustls(listener, config).unwrap();
                tokio::spawn(async move { server.serve(app.into_make_service()).await.unwrap() });
                "https"
            }
        };
        Stub {
            addr,
            scheme,
            recorded,
            faults,
            counter,
        }
    }

    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme, self.addr)
    }

    pub fn set_faults(&self, faults: Faults) {
        *self.faults.lock().unwrap() = faults;
    }

    pub fn landed(&self) -> HashMap<ContentHash, u32> {
        self.recorded.lock().unwrap().landed()
    }

    pub fn landed_total(&self) -> usize {
        self.recorded
            .lock()
            .unwrap()
            .accepted
            .iter()
            .map(|a| a.records.len())
            .sum()
    }
}

async fn ingest(
    State(shared): State<Arc<Shared>>,
    Path(stream): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let faults = *shared.faults.lock().unwrap();
    shared.counter.fetch_add(1, Ordering::Relaxed);
    let roll = rand::rng().random_range(0..100);
    {
        let mut recorded = shared.recorded.lock().unwrap();
        recorded.arrived.push(std::time::Instant::now());
        recorded.body_bytes += body.len() as u64;
    }
    if faults.unauthorized {
        return (
            StatusCode::UNAUTHORIZED,
            r#"{"error":"unauthorized","message":"unknown token"}"#,
        )
            .into_response();
    }
    if faults.proxy_auth {
        return (
            StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            [("proxy-authenticate", "Basic realm=\"site proxy\"")],
            "<html><body>Proxy Authentication Required</body></html>",
        )
            .into_response();
    }
    if roll < faults.unavailable {
        return (StatusCode::SERVICE_UNAVAILABLE, "try later").into_response();
    }
    if roll < faults.unavailable + faults.too_many {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "1")],
            "slow down",
        )
            .into_response();
    }
    let slow = roll < faults.unavailable + faults.too_many + faults.slow;
    let def = shared.streams.get(&stream).unwrap().clone();
    let content_type = headers
        .get("content-type")
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let key = headers
        .get("idempotency-key")
        .expect("the agent always sends an Idempotency-Key")
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        headers.get("x-request-id").and_then(|v| v.to_str().ok()),
        Some(key.as_str()),
        "the agent names its requests by the batch id"
    );
    let ndjson = match content_type.as_str() {
        "application/x-ndjson" => {
            assert_eq!(headers.get("content-encoding").unwrap(), "zstd");
            zstd::decode_all(&body[..]).unwrap()
        }
        "application/vnd.apache.parquet" => {
            schemas::columnar::parquet_to_ndjson(&def, body.clone(), usize::MAX).unwrap()
        }
        other => panic!("unexpected content type {other}"),
    };
    let records: Vec<ContentHash> = schemas::decode::ndjson_lines(&ndjson)
        .map(|l| schemas::check_bytes(&def, l).unwrap().hash)
        .collect();
    let answer = record(
        &shared,
        &faults,
        &stream,
        content_type,
        key,
        &ndjson,
        &records,
    );
    if slow {
        // Processed, but the answer comes after the agent gave up waiting (an answer lost on
        // the way): the agent's retry must be a replay.
        tokio::time::sleep(faults.slow_for).await;
    }
    answer
}

fn record(
    shared: &Shared,
    faults: &Faults,
    stream: &str,
    content_type: String,
    key: String,
    ndjson: &[u8],
    records: &[ContentHash],
) -> Response {
    let mut r = shared.recorded.lock().unwrap();
    *r.content_types.entry(content_type).or_default() += 1;
    let body_hash = blake3::hash(ndjson);
    if let Some(previous) = r.keys.get(&key) {
        assert_eq!(
            *previous, body_hash,
            "Idempotency-Key {key} reused for another batch"
        );
        r.replays += 1;
        return axum::Json(IngestResponse {
            accepted: records.len(),
            ..IngestResponse::default()
        })
        .into_response();
    }
    if let Some(device) = faults.refuse_device
        && ndjson.windows(device.len()).any(|w| w == device.as_bytes())
    {
        r.refused += 1;
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(serde_json::json!({"error": "refused", "message": "test refusal"})),
        )
            .into_response();
    }
    r.keys.insert(key.clone(), body_hash);
    r.accepted.push(Accepted {
        at: std::time::Instant::now(),
        stream: stream.to_owned(),
        key,
        records: records.to_vec(),
    });
    axum::Json(IngestResponse {
        accepted: records.len(),
        ..IngestResponse::default()
    })
    .into_response()
}

/// An agent running in this process.
pub type Running = tokio::task::JoinHandle<anyhow::Result<edge_agent::AgentStats>>;

/// Runs the agent in this process on `cfg` until the token is cancelled (or its sources end).
pub fn start(cfg: &str) -> (Running, tokio_util::sync::CancellationToken) {
    let config = edge_agent::AgentConfig::parse(cfg).unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(edge_agent::run(
        config,
        schemas::example_streams(),
        shutdown.clone(),
    ));
    (task, shutdown)
}

/// Waits until `n` records landed at `stub` (a minute at most).
pub async fn wait_landed(stub: &Stub, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while stub.landed_total() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "only {} of {n} records landed",
            stub.landed_total()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sensor readings as NDJSON lines: `n` distinct ones over `devices` devices, with every
/// `dup_every`-th line repeating an earlier one. Returns the lines and the distinct hashes.
pub fn readings(
    n: usize,
    devices: usize,
    dup_every: usize,
    seed: u64,
) -> (Vec<String>, Vec<ContentHash>) {
    let def = schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone();
    let mut lines = Vec::new();
    let mut hashes = Vec::new();
    for i in 0..n {
        let line = serde_json::json!({
            "device_id": format!("dev-{}", (i + seed as usize) % devices),
            "sensor": (["temp", "pressure", "rpm"][i % 3]),
            "ts": 1_700_000_000_000i64 + (i as i64) * 100 + seed as i64,
            "value": (i as f64 * 0.37).sin() * 50.0 + 20.0,
            "unit": "u",
            "quality": 192,
        })
        .to_string();
        hashes.push(schemas::check_bytes(&def, line.as_bytes()).unwrap().hash);
        lines.push(line);
        if dup_every > 0 && i % dup_every == dup_every - 1 {
            let again = lines[lines.len() / 2].clone();
            lines.push(again);
        }
    }
    (lines, hashes)
}

/// Asserts that every hash landed exactly once and nothing else landed.
pub fn assert_exactly_once(landed: &HashMap<ContentHash, u32>, expected: &[ContentHash]) {
    let twice: Vec<_> = landed.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "{} records landed more than once",
        twice.len()
    );
    let missing = expected.iter().filter(|h| !landed.contains_key(h)).count();
    assert_eq!(
        missing,
        0,
        "{missing} of {} records never landed",
        expected.len()
    );
    assert_eq!(
        landed.len(),
        expected.len(),
        "records landed that were never sent"
    );
}

/// A config (state in `dir/state`) for the local HTTP port on `port`, with `more` keys of that
/// source.
pub fn http_source_config(dir: &std::path::Path, gateway: &str, port: u16, more: &str) -> String {
    config(
        &dir.join("state"),
        gateway,
        "",
        &format!("[[sources]]\ntype = \"http\"\nlisten = \"127.0.0.1:{port}\"\n{more}"),
    )
}

/// A config for the agent: `sources` and `extra` are TOML fragments.
pub fn config(state: &std::path::Path, gateway: &str, extra: &str, sources: &str) -> String {
    config_with_root(state, gateway, "", extra, sources)
}

/// A `[[sources]]` entry tailing `path` into sensor_readings, with `more` keys of the source.
pub fn file_source_toml(path: &std::path::Path, more: &str) -> String {
    format!("[[sources]]\ntype = \"file\"\npath = {path:?}\nstream = \"sensor_readings\"\n{more}")
}

/// Writes [`config`] (state in `dir/state`) to `dir/agent.toml` and returns its path.
pub fn write_config(
    dir: &std::path::Path,
    gateway: &str,
    extra: &str,
    sources: &str,
) -> std::path::PathBuf {
    let path = dir.join("agent.toml");
    std::fs::write(&path, config(&dir.join("state"), gateway, extra, sources)).unwrap();
    path
}

/// [`config`] with top-level keys (`root`), which TOML takes only before the first table.
pub fn config_with_root(
    state: &std::path::Path,
    gateway: &str,
    root: &str,
    extra: &str,
    sources: &str,
) -> String {
    format!(
        r#"
{root}
streams_dir = {streams:?}
state_dir = {state:?}
[gateway]
url = "{gateway}"
timeout_ms = 1000
max_backoff_ms = 400
{extra}
{sources}
"#,
        streams = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../streams"),
    )
}

/// Starts the edge-agent binary on `cfg`, its log in `dir/agent-<run>.log`.
pub fn spawn_agent(
    cfg: &std::path::Path,
    dir: &std::path::Path,
    run: usize,
) -> std::process::Child {
    spawn_agent_with(
        cfg,
        dir,
        run,
        std::process::Stdio::inherit(),
        "edge_agent=info",
    )
}

/// [`spawn_agent`] with `stdin` as the agent's standard input and `filter` as its `RUST_LOG`.
pub fn spawn_agent_with(
    cfg: &std::path::Path,
    dir: &std::path::Path,
    run: usize,
    stdin: std::process::Stdio,
    filter: &str,
) -> std::process::Child {
    let log = std::fs::File::create(dir.join(format!("agent-{run}.log"))).unwrap();
    std::process::Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["run", "--config"])
        .arg(cfg)
        .env("RUST_LOG", filter)
        .stdin(stdin)
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// SIGKILL, and waits for the process to be gone.
pub fn sigkill(mut child: std::process::Child) {
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Sends SIGTERM to the agent and waits for its exit, at most `limit` (`why` names the
/// situation in the failure message). Asserts a successful exit; its log is
/// `dir/agent-<run>.log`.
pub async fn sigterm_and_wait(
    child: &mut std::process::Child,
    limit: Duration,
    why: &str,
    (dir, run): (&std::path::Path, usize),
) {
    let asked = std::time::Instant::now();
    assert!(
        std::process::Command::new("kill")
            .arg(child.id().to_string())
            .status()
            .unwrap()
            .success()
    );
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            asked.elapsed() < limit,
            "no exit {limit:?} after SIGTERM {why}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let log = std::fs::read_to_string(dir.join(format!("agent-{run}.log"))).unwrap();
    assert!(status.success(), "{status}: {log}");
}

/// Runs the agent on `cfg` until it finishes (a file source at its end), SIGKILLing it up to
/// `max_kills` times, each time at a random point `kill_after_ms` after its start; the runs'
/// logs are `dir/agent-<run>.log` from `first_run` on. Asserts that the last run succeeded;
/// returns the kills and the last run's number.
pub async fn run_with_kills(
    cfg: &std::path::Path,
    dir: &std::path::Path,
    (max_kills, kill_after_ms): (usize, std::ops::Range<u64>),
    first_run: usize,
) -> (usize, usize) {
    let mut rng = rand::rng();
    let (mut kills, mut runs) = (0, first_run - 1);
    loop {
        runs += 1;
        let mut child = spawn_agent(cfg, dir, runs);
        let deadline = std::time::Instant::now()
            + Duration::from_millis(rng.random_range(kill_after_ms.clone()));
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if kills < max_kills && std::time::Instant::now() > deadline {
                break None;
            }
            assert!(runs < first_run + 40, "the agent never finished");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        match status {
            Some(status) => {
                let log = std::fs::read_to_string(dir.join(format!("agent-{runs}.log")));
                assert!(status.success(), "agent failed: {status}\n{log:?}");
                break;
            }
            None => {
                sigkill(child);
                kills += 1;
            }
        }
    }
    (kills, runs)
}

pub fn assert_enough_kills(kills: usize) {
    assert!(
        kills >= 3,
        "only {kills} kills: the run was too short to test anything"
    );
}

/// Prints what a killed agent sent to `stub`, and asserts that `expected` landed exactly once.
pub fn report_and_check(stub: &Stub, kills: usize, runs: usize, expected: &[ContentHash]) {
    let recorded = stub.recorded.lock().unwrap();
    eprintln!(
        "{kills} kills over {runs} runs; {} requests, {} replayed by Idempotency-Key",
        recorded.arrived.len(),
        recorded.replays
    );
    let landed = recorded.landed();
    // Which requests carried a record that landed twice: a re-sent batch has the same records
    // in the same places, a re-sent record in a new batch does not.
    for (h, _) in landed.iter().filter(|(_, n)| **n > 1).take(5) {
        eprintln!("landed more than once: {h:?}");
        let first = recorded.accepted[0].at;
        for (i, a) in recorded.accepted.iter().enumerate() {
            if let Some(at) = a.records.iter().position(|r| r == h) {
                eprintln!(
                    "  request {i} at {:?}, key {}, record {at} of {}",
                    a.at - first,
                    a.key,
                    a.records.len()
                );
            }
        }
    }
    drop(recorded);
    assert_exactly_once(&landed, expected);
}

/// Publishes `messages` to `topic` with QoS 1, one every `pace`, and returns once the broker
/// acknowledged every one.
pub async fn mqtt_publish(
    broker: &str,
    topic: &'static str,
    messages: Vec<String>,
    pace: Duration,
) {
    let messages = messages
        .into_iter()
        .map(|m| (topic.to_owned(), m))
        .collect();
    mqtt_publish_to(broker, messages, pace).await;
}

/// Publishes (topic, payload) messages with QoS 1, `pace` apart, and waits for every PUBACK.
pub async fn mqtt_publish_to(broker: &str, messages: Vec<(String, String)>, pace: Duration) {
    let (host, port) = broker.rsplit_once(':').unwrap();
    let id = format!("pub-{}", rand::random::<u32>());
    let mut options = rumqttc::MqttOptions::new(id, host, port.parse().unwrap());
    options.set_keep_alive(Duration::from_secs(5));
    let (client, mut events) = rumqttc::AsyncClient::new(options, 64);
    let n = messages.len();
    let sender = tokio::spawn(async move {
        for (topic, m) in messages {
            client
                .publish(topic, rumqttc::QoS::AtLeastOnce, false, m)
                .await
                .unwrap();
            if !pace.is_zero() {
                tokio::time::sleep(pace).await;
            }
        }
        client
    });
    let mut acked = 0;
    while acked < n {
        if let rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_)) = events.poll().await.unwrap() {
            acked += 1;
        }
    }
    let _ = sender.await;
}

/// Waits until the agent's local HTTP port answers.
pub async fn wait_for_port(port: u16) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while reqwest::get(format!("http://127.0.0.1:{port}/"))
        .await
        .is_err()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the local port never opened"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A forward proxy (tinyproxy, from Debian) on a free loopback port. With `credentials` it asks
/// for Basic credentials (407 without them, 401 for wrong ones). It logs every request it
/// forwards and every tunnel it opens to [`Proxy::log`].
pub struct Proxy {
    pub url: String,
    log: std::path::PathBuf,
    _process: KillOnDrop,
}

impl Proxy {
    pub async fn start(dir: &std::path::Path, credentials: Option<(&str, &str)>) -> Proxy {
        let port = free_port();
        let (conf, log) = (
            dir.join(format!("tinyproxy-{port}.conf")),
            dir.join(format!("tinyproxy-{port}.log")),
        );
        let auth = credentials.map_or(String::new(), |(u, p)| format!("BasicAuth {u} {p}\n"));
        std::fs::write(
            &conf,
            format!(
                "Port {port}\nListen 127.0.0.1\nAllow 127.0.0.1\nTimeout 60\nLogLevel Info\n\
                 LogFile \"{}\"\n{auth}",
                log.display()
            ),
        )
        .unwrap();
        let process = std::process::Command::new(service_env("EDGE_INGEST_TINYPROXY"))
            .arg("-d")
            .arg("-c")
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("cannot start tinyproxy");
        let process = KillOnDrop(process);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "tinyproxy did not open port {port}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Proxy {
            url: format!("http://127.0.0.1:{port}"),
            log,
            _process: process,
        }
    }

    /// What the proxy logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// How many of the agent's requests for `stub` (plain HTTP) reached the proxy.
    pub fn posts_to(&self, stub: &Stub) -> usize {
        let request = format!(
            "POST http://{}/v1/streams/sensor_readings/records",
            stub.addr
        );
        self.log().matches(&request).count()
    }
}
