//! The memory budget, the concurrency limit and the Kafka password file, against a running gateway.

use super::processes::{sighup, trickle};
use super::*;

/// A line of /proc/<pid>/status in KiB (`VmRSS`, `VmHWM`).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// A gateway binary on the suite's Kafka with the `[limits]` given, listening on a port of its own.
async fn spawn_limited(brokers: &str, dir: &Path, limits: &str) -> (Child, u16, String) {
    let port = free_port();
    let prefix = format!("gwmem{}.", unique());
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        gateway_toml(
            port,
            brokers,
            &prefix,
            &format!("{prefix}dead-letters"),
            &format!("[limits]\n{limits}\n"),
        ),
    )
    .unwrap();
    let child = spawn_gateway(&config, port, &dir.join("gateway.log")).await;
    (child, port, prefix)
}

/// Many requests at once whose zstd bodies each decompress to the limit (16 MiB of one reading
/// repeated, a few KiB as sent; half with their size in the frame, half without): the gateway
/// takes no more memory than `max_inflight_bytes` (128 MiB) and a fixed overhead, answers the
/// excess 429 with `Retry-After`, produces the reading of every request it accepted once, and
/// serves normally afterwards. Before, every request held its decompressed body whatever the
/// budget said. A request that needs more than the whole budget is answered 413: no retry
/// would do better.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bodies_stay_within_the_inflight_budget() {
    const REQUESTS: i64 = 48;
    const LIMIT: usize = 16 << 20;
    const BUDGET: u64 = 128 << 20;
    // The gateway's own memory besides the budget under this load: its allocator's pages kept
    // for reuse, the blocking threads' stacks and zstd contexts, librdkafka's buffers.
    const OVERHEAD: u64 = 48 << 20;
    let brokers = env("EDGE_INGEST_KAFKA");
    let dir = tempfile::tempdir().unwrap();
    let (mut gateway, port, prefix) = spawn_limited(
        &brokers,
        dir.path(),
        &format!(
            "max_body_bytes = 1048576\nmax_decompressed_bytes = {LIMIT}\n\
             max_inflight_bytes = {BUDGET}\nmax_concurrent_requests = 256\n\
             request_timeout_ms = 60000"
        ),
    )
    .await;
    let url = format!("http://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    let client = reqwest::Client::new();
    // Warmed up: the producer connected and the topic made.
    let warm = post(&client, &url, ndjson(&[reading(-1)]), None).await;
    assert_eq!(warm.status(), 200);
    let baseline = status_kib(gateway.id(), "VmRSS") << 10;

    let bodies: Vec<(i64, Vec<u8>)> = (0..REQUESTS)
        .map(|i| {
            let mut record = reading(i);
            record["tags"] = json!({"pad": "x".repeat(400)});
            let line = format!("{record}\n");
            let plain = line.repeat((LIMIT - 1024) / line.len());
            let body = if i % 2 == 0 {
                zstd::bulk::compress(plain.as_bytes(), 3).unwrap()
            } else {
                zstd::encode_all(plain.as_bytes(), 3).unwrap()
            };
            (i, body)
        })
        .collect();
    let answers = futures::future::join_all(bodies.into_iter().map(|(i, body)| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let answer = client
                .post(&url)
                .bearer_auth(TOKEN)
                .header("content-type", "application/x-ndjson")
                .header("content-encoding", "zstd")
                .body(body)
                .send()
                .await
                .unwrap();
            let retry_after = answer.headers().get("retry-after").cloned();
            let status = answer.status().as_u16();
            let text = answer.text().await.unwrap();
            (i, status, retry_after, text)
        }
    }))
    .await;
    let peak = status_kib(gateway.id(), "VmHWM") << 10;
    let mut accepted = Vec::new();
    for (i, status, retry_after, text) in &answers {
        match status {
            200 => {
                let answer: Value = serde_json::from_str(text).unwrap();
                assert_eq!(answer["accepted"], 1, "{text}");
                accepted.push(*i);
            }
            429 => {
                assert!(retry_after.is_some(), "429 without Retry-After: {text}");
                assert!(text.contains("in-flight bytes"), "{text}");
            }
            other => panic!("request {i}: {other} {text}"),
        }
    }
    assert!(
        !accepted.is_empty() && accepted.len() < REQUESTS as usize,
        "{} of {REQUESTS} accepted",
        accepted.len()
    );
    assert!(
        peak <= baseline + BUDGET + OVERHEAD,
        "peak RSS {} MiB: {} MiB at rest, the budget {} MiB and {} MiB overhead",
        peak >> 20,
        baseline >> 20,
        BUDGET >> 20,
        OVERHEAD >> 20
    );
    eprintln!(
        "peak RSS {} MiB ({} MiB at rest), {} of {REQUESTS} accepted",
        peak >> 20,
        baseline >> 20,
        accepted.len()
    );

    // Served normally afterwards.
    let after = post(&client, &url, ndjson(&[reading(1_000)]), None).await;
    assert_eq!(after.status(), 200);
    // Every accepted request's reading landed once, with the warm-up's and the last one.
    let landed = consume(
        &brokers,
        &format!("{prefix}sensor_readings"),
        accepted.len() + 2,
    );
    let mut got: Vec<i64> = landed
        .iter()
        .map(|(value, _)| {
            let v: Value = serde_json::from_slice(value).unwrap();
            v["ts"].as_i64().unwrap() - 1_767_225_600_000
        })
        .collect();
    got.sort_unstable();
    let mut want = accepted.clone();
    want.extend([-1, 1_000]);
    want.sort_unstable();
    assert_eq!(got, want);
    gateway.kill().unwrap();
    gateway.wait().unwrap();
}

/// Past `max_concurrent_requests` a request is answered 429 with `Retry-After` at once, while
/// the requests in progress (slow uplinks) finish, and the gateway serves normally afterwards.
/// A request that needs more memory than the whole `max_inflight_bytes` is answered 413 (no
/// retry would do better), not 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_concurrency_limit_are_answered_429_and_the_rest_served() {
    let brokers = env("EDGE_INGEST_KAFKA");
    let dir = tempfile::tempdir().unwrap();
    let (mut gateway, port, _) = spawn_limited(
        &brokers,
        dir.path(),
        "max_concurrent_requests = 2\nrequest_timeout_ms = 30000\nmax_inflight_bytes = 4194304",
    )
    .await;
    let url = format!("http://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    let client = reqwest::Client::new();
    assert_eq!(
        post(&client, &url, ndjson(&[reading(0)]), None)
            .await
            .status(),
        200
    );
    let big: Vec<Value> = (0..60_000).map(|i| reading(10_000 + i)).collect();
    let refused = post(&client, &url, ndjson(&big), None).await;
    assert_eq!(refused.status(), 413);
    let text = refused.text().await.unwrap();
    assert!(text.contains("max_inflight_bytes"), "{text}");
    // Two slow uplinks hold both slots for about 2 s.
    let slow: Vec<_> = (0..2)
        .map(|n| {
            let body = ndjson(&(n * 100 + 1..n * 100 + 60).map(reading).collect::<Vec<_>>());
            tokio::spawn(async move { trickle(port, &body, 2_000).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let refused = post(&client, &url, ndjson(&[reading(500)]), None).await;
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().contains_key("retry-after"));
    let text = refused.text().await.unwrap();
    assert!(text.contains("concurrent requests"), "{text}");
    for s in slow {
        assert_eq!(s.await.unwrap(), 200);
    }
    assert_eq!(
        post(&client, &url, ndjson(&[reading(500)]), None)
            .await
            .status(),
        200
    );
    gateway.kill().unwrap();
    gateway.wait().unwrap();
}

/// The gateway's Kafka password comes from a file and shows nowhere: not in `--check`'s
/// output, nor in its log (debug) through a start, a login and a request that Kafka refuses
/// (the suite's broker takes no SASL login), a SIGHUP reload and a stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_password_comes_from_a_file_and_never_shows() {
    const SECRET: &str = "kafka-pw-5e8d20b3";
    let brokers = env("EDGE_INGEST_KAFKA");
    let dir = tempfile::tempdir().unwrap();
    let password = dir.path().join("kafka-password");
    std::fs::write(&password, format!("{SECRET}\n")).unwrap();
    let port = free_port();
    let prefix = format!("gwsecret{}.", unique());
    let config = dir.path().join("gateway.toml");
    let toml = gateway_toml(port, &brokers, &prefix, &format!("{prefix}dead-letters"), "")
        // Topics made at start would wait for the login, which never succeeds here.
        .replace(
            "create_topics = true\n",
            &format!(
                "create_topics = false\nsasl = {{ mechanism = \"SCRAM-SHA-512\", username = \"u\", password_file = {password:?} }}\n"
            ),
        )
        .replace("produce_timeout_ms = 10000", "produce_timeout_ms = 2000");
    std::fs::write(&config, toml).unwrap();
    let check = Command::new(env!("CARGO_BIN_EXE_ingest-gateway"))
        .args(["--check", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(check.status.success(), "{check:?}");
    assert!(!format!("{check:?}").contains(SECRET), "{check:?}");

    let log = dir.path().join("gateway.log");
    let mut gateway = Command::new(env!("CARGO_BIN_EXE_ingest-gateway"))
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "debug")
        .stdout(std::fs::File::create(dir.path().join("gateway.out")).unwrap())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    listening(port).await;
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    let answer = post(&client, &url, ndjson(&[reading(1)]), None).await;
    assert_eq!(answer.status(), 503, "Kafka takes no login here");
    sighup(&gateway, &log, "SIGHUP: reloaded", 1);
    gateway.kill().unwrap();
    gateway.wait().unwrap();
    let printed = std::fs::read_to_string(&log).unwrap()
        + &std::fs::read_to_string(dir.path().join("gateway.out")).unwrap();
    assert!(printed.contains("SIGHUP: reloaded"));
    assert!(
        printed.contains("Authentication"),
        "the login was tried:\n{printed}"
    );
    assert!(
        !printed.contains(SECRET),
        "the gateway printed its password:\n{printed}"
    );
}
