//! Helpers of the end-to-end tests: the service addresses the test script exported, the
//! independent pyarrow reader, and Kafka clusters of a test's own ([`kafka`]).

#![allow(dead_code)]

pub mod kafka;
pub mod pki;
pub mod trino;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

/// A variable exported by `scripts/test.sh`; a test that needs a service fails loudly without.
pub fn service_env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: run the suite with scripts/test.sh, which starts the test services"
        )
    })
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs the binary `exe` with `args` from the repository's root, with `env` overrides and no
/// backtraces; returns whether it succeeded and what it printed (stdout, then stderr).
pub fn run_from_root(exe: &str, args: &[&std::ffi::OsStr], env: &[(&str, &str)]) -> (bool, String) {
    let (code, text) = exit_code_from_root(exe, args, env);
    (code == Some(0), text)
}

/// Whether the calling test, `name` (its path in the test binary), runs in a process of its own.
/// When not, it is run again in one (this test binary, that test alone) and has passed when
/// that one did: for a test that reads process-wide state, such as the metrics recorder, which
/// the other tests of its binary share.
pub fn in_own_process(name: &str) -> bool {
    const MARK: &str = "EDGE_INGEST_OWN_PROCESS";
    if std::env::var_os(MARK).is_some()
        || std::env::var("NEXTEST_EXECUTION_MODE").as_deref() == Ok("process-per-test")
    {
        return true;
    }
    let status = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--test-threads", "1"])
        .env(MARK, "1")
        .status()
        .unwrap_or_else(|e| panic!("cannot run {name} in a process of its own: {e}"));
    assert!(
        status.success(),
        "{name}, run in a process of its own, failed"
    );
    false
}

/// Like [`run_from_root`], with the exit code (`None`: ended by a signal).
pub fn exit_code_from_root(
    exe: &str,
    args: &[&std::ffi::OsStr],
    env: &[(&str, &str)],
) -> (Option<i32>, String) {
    let out = Command::new(exe)
        .args(args)
        .current_dir(repo_root())
        .env("RUST_BACKTRACE", "0")
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {exe}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text)
}

/// The variables Kubernetes sets in every pod of a namespace for a Service named `service`
/// with one TCP port: `SINK_SERVICE_HOST`, `SINK_PORT=tcp://…` and the rest, for `sink`. (Leaked,
/// a few bytes a test, so that they pass where `&str` pairs do.)
pub fn kubernetes_service_variables(service: &str, port: u16) -> Vec<(&'static str, &'static str)> {
    let name = service.to_uppercase().replace('-', "_");
    let (host, tcp) = ("10.96.0.12", format!("{name}_PORT_{port}_TCP"));
    let url = format!("tcp://{host}:{port}");
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    [
        (format!("{name}_SERVICE_HOST"), host.to_owned()),
        (format!("{name}_SERVICE_PORT"), port.to_string()),
        (format!("{name}_SERVICE_PORT_METRICS"), port.to_string()),
        (format!("{name}_PORT"), url.clone()),
        (tcp.clone(), url),
        (format!("{tcp}_PROTO"), "tcp".to_owned()),
        (format!("{tcp}_PORT"), port.to_string()),
        (format!("{tcp}_ADDR"), host.to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (leak(k), leak(v)))
    .collect()
}

/// Runs `scripts/read_landing.py` with the test venv's Python and returns its JSON output.
pub fn pyarrow(args: &[&str]) -> Value {
    let python = service_env("EDGE_INGEST_PYTHON");
    let out = Command::new(python)
        .arg(repo_root().join("scripts/read_landing.py"))
        .args(args)
        .output()
        .expect("cannot run the pyarrow reader");
    assert!(
        out.status.success(),
        "pyarrow reader failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if out.stdout.is_empty() {
        return Value::Null;
    }
    serde_json::from_slice(&out.stdout).expect("pyarrow reader printed invalid JSON")
}

/// Reads the landing files under an S3 prefix with pyarrow.
pub fn pyarrow_s3(endpoint: &str, bucket: &str, prefix: &str) -> Value {
    pyarrow(&[
        "--s3-endpoint",
        endpoint,
        "--bucket",
        bucket,
        "--prefix",
        prefix,
    ])
}

/// Checks that of the files pyarrow read (`landed`), those of `schema_version` `version` have
/// the float `column` and the others do not; returns the schema versions seen and the column's
/// values in the rows that set it.
pub fn column_added_in(
    landed: &Value,
    column: &str,
    version: &str,
) -> (std::collections::HashSet<String>, Vec<f64>) {
    let mut versions = std::collections::HashSet::new();
    for f in landed["files"].as_array().expect("files") {
        let seen = f["metadata"]["schema_version"].as_str().unwrap().to_owned();
        assert_eq!(f["schema"].get(column).is_some(), seen == version, "{f}");
        versions.insert(seen);
    }
    let values = landed["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .filter_map(|r| r.get(column).and_then(Value::as_f64))
        .collect();
    (versions, values)
}

/// A sensor reading reduced to a canonical, comparable form.
fn canonical(
    device: &Value,
    sensor: &Value,
    ts_us: i64,
    value: f64,
    unit: &Value,
    quality: &Value,
    tags: &Value,
) -> String {
    let mut tags: Vec<(String, Value)> = tags
        .as_object()
        .map(|o| o.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    tags.sort_by(|a, b| a.0.cmp(&b.0));
    json!([device, sensor, ts_us, value, unit, quality, tags]).to_string()
}

/// Checks that the landed rows are exactly the distinct sent readings, typed as the schema says.
pub fn assert_landed_exactly(sent: &[Value], landed: &Value) {
    assert_same_records(sent, landed);
    let files = landed["files"].as_array().expect("files");
    assert!(!files.is_empty());
    assert_duckdb_reads_the_same(landed);
    for f in files {
        assert_landing_file(f);
    }
}

/// Checks that the rows a reader found (`landed["rows"]`) are the distinct records of `sent`,
/// each once.
pub fn assert_same_records(sent: &[Value], landed: &Value) {
    let mut expected: Vec<String> = sent
        .iter()
        .map(|r| {
            let ts_ms = r["ts"].as_i64().expect("generated ts is epoch ms");
            canonical(
                &r["device_id"],
                &r["sensor"],
                ts_ms * 1000,
                r["value"].as_f64().unwrap(),
                &r["unit"],
                &r["quality"],
                &r["tags"],
            )
        })
        .collect();
    expected.sort();
    expected.dedup();
    let rows = landed["rows"].as_array().expect("rows");
    let mut got: Vec<String> = rows
        .iter()
        .map(|r| {
            canonical(
                &r["device_id"],
                &r["sensor"],
                r["ts"].as_i64().unwrap(),
                r["value"].as_f64().unwrap(),
                &r["unit"],
                &r["quality"],
                &r["tags"],
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got.len(),
        expected.len(),
        "landed {} rows, sent {} distinct records",
        got.len(),
        expected.len()
    );
    if got != expected {
        let (mut missing, mut extra) = (Vec::new(), Vec::new());
        let (mut i, mut j) = (0, 0);
        while i < expected.len() || j < got.len() {
            match (expected.get(i), got.get(j)) {
                (Some(e), Some(g)) if e == g => (i, j) = (i + 1, j + 1),
                (Some(e), Some(g)) if e < g => (missing.push(e), i += 1).1,
                (Some(e), None) => (missing.push(e), i += 1).1,
                (_, Some(g)) => (extra.push(g), j += 1).1,
                (None, None) => break,
            }
        }
        panic!(
            "landed rows differ from the sent records: {} missing, {} extra or repeated; \
             first missing {:?}, first extra {:?}",
            missing.len(),
            extra.len(),
            missing.iter().take(3).collect::<Vec<_>>(),
            extra.iter().take(3).collect::<Vec<_>>()
        );
    }
}

/// Checks one landing file pyarrow read: its schema, encodings, order, metadata and key.
fn assert_landing_file(f: &Value) {
    let schema = &f["schema"];
    assert_eq!(schema["ts"], "timestamp[us, tz=UTC]", "{f}");
    assert_eq!(schema["_ingest_ts"], "timestamp[us, tz=UTC]");
    assert_eq!(schema["device_id"], "string");
    assert_eq!(schema["value"], "double");
    assert_eq!(schema["quality"], "int64");
    // pyarrow prints the Parquet entries group name after the types.
    assert!(
        schema["tags"]
            .as_str()
            .unwrap()
            .starts_with("map<string, string"),
        "{schema}"
    );
    assert_eq!(schema["_offset"], "int64");
    // The content hash is computed again from the row where needed, not kept by default.
    assert!(schema.get("_content_hash").is_none(), "{schema}");
    assert_eq!(f["nullable"]["device_id"], false);
    assert_eq!(f["nullable"]["unit"], true);
    // Every column zstd with statistics but the partition, one value a file that zstd's
    // frame would only make larger; offsets and times as deltas, values in dictionaries.
    for (column, chunk) in f["columns"].as_object().unwrap() {
        let codec = if column == "_partition" {
            "UNCOMPRESSED"
        } else {
            "ZSTD"
        };
        assert_eq!(chunk["compression"], codec, "{column}: {f}");
        assert_eq!(chunk["statistics"], true, "{column}: {f}");
    }
    for (column, encoding) in [
        ("_offset", "DELTA_BINARY_PACKED"),
        ("ts", "DELTA_BINARY_PACKED"),
        ("value", "RLE_DICTIONARY"),
    ] {
        let encodings = &f["columns"][column]["encodings"];
        assert!(
            encodings.as_array().unwrap().contains(&encoding.into()),
            "{column}: {encodings}"
        );
    }
    // Each row group is sorted by series and time, says so, and is in that order.
    for stated in f["sorting_columns"].as_array().unwrap() {
        assert_eq!(stated, &json!(["device_id", "sensor", "unit", "ts"]), "{f}");
    }
    assert_eq!(f["sorted_as_stated"], true, "{}", f["key"]);
    let meta = &f["metadata"];
    for key in [
        "stream",
        "schema_version",
        "topic",
        "partition",
        "first_offset",
        "last_offset",
        "row_count",
        "min_event_time",
        "max_event_time",
    ] {
        assert!(meta.get(key).is_some(), "file metadata lacks {key}: {meta}");
    }
    assert_eq!(meta["stream"], "sensor_readings");
    assert_eq!(meta["row_count"], f["rows"].as_u64().unwrap().to_string());
    let key = f["key"].as_str().unwrap();
    let name = key.rsplit('/').next().unwrap();
    let expected_name = format!(
        "sensor_readings-p{}-o{:020}.parquet",
        meta["partition"].as_str().unwrap(),
        meta["first_offset"]
            .as_str()
            .unwrap()
            .parse::<i64>()
            .unwrap()
    );
    assert_eq!(name, expected_name);
    assert!(key.contains("sensor_readings/date="), "{key}");
}

/// DuckDB, reading the same files as one hive-partitioned table, finds the rows pyarrow found:
/// as many, the same offsets, and the same non-null values in every column.
pub fn assert_duckdb_reads_the_same(landed: &Value) {
    let rows = landed["rows"].as_array().expect("rows");
    let duckdb = &landed["duckdb"];
    assert_eq!(duckdb["rows"], rows.len(), "{duckdb}");
    let offsets: i64 = rows.iter().map(|r| r["_offset"].as_i64().unwrap()).sum();
    assert_eq!(duckdb["offset_sum"], offsets, "{duckdb}");
    for (column, count) in duckdb["non_null"].as_object().expect("non_null") {
        if matches!(column.as_str(), "date" | "hour") {
            continue;
        }
        let ours = rows.iter().filter(|r| !r[column].is_null()).count();
        assert_eq!(count, &json!(ours), "{column}: {duckdb}");
    }
}

/// A number for names (topics, buckets, groups) no earlier run used.
pub fn unique_id() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        % 1_000_000_000_000
}

/// A loopback port that was free a moment ago.
///
/// It is below Linux's ephemeral range (32768 and up by default), so no client's outgoing
/// connection takes it while nothing listens there. A port from that range (what binding port
/// 0 gives) could be taken during an outage a test makes: a client that keeps reconnecting to
/// the port can connect to itself from it, and the test's listener cannot come back.
pub fn free_port() -> u16 {
    use rand::Rng as _;
    let mut rng = rand::rng();
    loop {
        let port = rng.random_range(10_000..32_000);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A TCP proxy on `port` in front of `target`: stopping it is an outage as clients see it
/// (refused and reset connections), and it can come back on the same port.
pub async fn proxy(port: u16, target: u16) -> tokio_util::sync::CancellationToken {
    relay(port, target, None).await
}

/// A TCP proxy on `port` in front of `target` that carries what clients send at `bytes_per_sec`
/// (a slow uplink); answers come back at full speed.
pub async fn slow_proxy(
    port: u16,
    target: u16,
    bytes_per_sec: u64,
) -> tokio_util::sync::CancellationToken {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    each_connection(port, move |client, token| async move {
        let Ok(upstream) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else {
            return;
        };
        let (mut from_client, mut to_client) = client.into_split();
        let (mut from_upstream, mut to_upstream) = upstream.into_split();
        let up = async move {
            let mut buf = [0u8; 1024];
            while let Ok(n @ 1..) = from_client.read(&mut buf).await {
                let pace = n as f64 / bytes_per_sec as f64;
                tokio::time::sleep(std::time::Duration::from_secs_f64(pace)).await;
                if to_upstream.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = to_upstream.shutdown().await;
        };
        let down = tokio::io::copy(&mut from_upstream, &mut to_client);
        tokio::select! {
            _ = token.cancelled() => {}
            _ = async { tokio::join!(up, down) } => {}
        }
    })
    .await
}

/// Listens on `port` and runs `serve` on each connection, until the token it returns is
/// cancelled (which `serve` is given too).
async fn each_connection<F, Fut>(port: u16, serve: F) -> tokio_util::sync::CancellationToken
where
    F: Fn(tokio::net::TcpStream, tokio_util::sync::CancellationToken) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let stop = tokio_util::sync::CancellationToken::new();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let token = stop.clone();
    tokio::spawn(async move {
        loop {
            let (client, _) = tokio::select! {
                _ = token.cancelled() => return,
                accepted = listener.accept() => accepted.unwrap(),
            };
            tokio::spawn(serve(client, token.clone()));
        }
    });
    stop
}

/// A TLS endpoint on `port` (the certificate of `acceptor`) forwarding the decrypted bytes to
/// `target`. A client that does not trust the certificate ends its handshake here.
pub async fn tls_proxy(
    port: u16,
    target: u16,
    acceptor: tokio_rustls::TlsAcceptor,
) -> tokio_util::sync::CancellationToken {
    relay(port, target, Some(acceptor)).await
}

async fn relay(
    port: u16,
    target: u16,
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> tokio_util::sync::CancellationToken {
    each_connection(port, move |client, token| {
        let tls = tls.clone();
        async move {
            match tls {
                None => pipe(client, target, &token).await,
                Some(acceptor) => {
                    if let Ok(client) = acceptor.accept(client).await {
                        pipe(client, target, &token).await;
                    }
                }
            }
        }
    })
    .await
}

/// Copies between `client` and a new connection to `target` until either ends or `token`.
async fn pipe<S>(mut client: S, target: u16, token: &tokio_util::sync::CancellationToken)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let Ok(mut upstream) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else {
        return;
    };
    tokio::select! {
        _ = token.cancelled() => {}
        _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
    }
}

/// A child process (a service a test started for itself) that goes when the test does, failed
/// or not.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
