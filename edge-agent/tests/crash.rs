//! The agent process killed with SIGKILL at random points while it reads, spools and delivers to
//! a gateway that fails, times out and answers 429, while MQTT messages are in flight to it, and
//! while clients post to its local HTTP port: nothing is lost, nothing lands twice.

use crate::support;

use std::process::Stdio;
use std::time::{Duration, Instant};

use rand::Rng;
use support::{
    Faults, Stub, assert_enough_kills, file_source_toml, free_port, mqtt_publish, readings,
    report_and_check, run_with_kills, service_env, sigkill, sigterm_and_wait, spawn_agent,
    spawn_agent_with, wait_for_port, write_config,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_points_loses_nothing_and_lands_nothing_twice() {
    let stub = Stub::start(Faults {
        unavailable: 10,
        too_many: 3,
        slow: 4,
        slow_for: Duration::from_millis(1500),
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    // 60,000 distinct readings and 12,000 re-sent ones.
    let (lines, expected) = readings(60_000, 40, 5, 1);
    let cfg = file_agent(
        dir.path(),
        &stub,
        "[batch]\nmax_records = 400\nmax_age_ms = 100\n",
        &lines,
    );
    let (kills, runs) = run_with_kills(&cfg, dir.path(), (6, 300..2500), 1).await;
    assert_enough_kills(kills);
    report_and_check(&stub, kills, runs, &expected);
}

/// Writes `lines` to `dir/readings.ndjson` and an agent config (`extra` keys) that reads it into
/// `stub`; returns the config's path.
fn file_agent(
    dir: &std::path::Path,
    stub: &Stub,
    extra: &str,
    lines: &[String],
) -> std::path::PathBuf {
    let input = dir.join("readings.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    write_config(dir, &stub.url(), extra, &file_source_toml(&input, ""))
}

/// Once the last agent has delivered everything (or a minute passed) and a second more for
/// anything that would land twice, stops it and checks that `expected` landed exactly once.
async fn settle_and_check(
    stub: &Stub,
    agent: std::process::Child,
    (kills, runs): (usize, usize),
    expected: &[schemas::ContentHash],
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while stub.landed_total() < expected.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    sigkill(agent);
    assert_enough_kills(kills);
    report_and_check(stub, kills, runs, expected);
}

/// QoS 1 messages in flight when the agent dies are sent again by the broker when it is back, and
/// those published while it is down wait in its persistent session: every reading lands once,
/// because a message is acknowledged only once its readings are in the spool and the dedupe
/// window (rebuilt from its log and the spool at start) drops what comes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_mqtt_messages_in_flight_loses_nothing_and_lands_nothing_twice() {
    // Outside the sources test's `plant/+/readings`, which may run at the same time.
    const TOPIC: &str = "crash-test/readings";
    const PACE: Duration = Duration::from_millis(5);
    let broker = service_env("EDGE_INGEST_MQTT");
    let stub = Stub::start(Faults {
        unavailable: 10,
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let client_id = format!("agent-crash-{}", rand::random::<u32>());
    let cfg = write_config(
        dir.path(),
        &stub.url(),
        "[batch]\nmax_records = 100\nmax_age_ms = 100\n",
        &format!(
            "[[sources]]\ntype = \"mqtt\"\nurl = \"mqtt://{broker}\"\ntopics = [\"{TOPIC}\"]\n\
             stream = \"sensor_readings\"\nclient_id = \"{client_id}\"\nqos = 1\n"
        ),
    );
    // 3,000 distinct readings and 300 re-sent ones, two lines a message: about 8 s of publishing.
    let (lines, expected) = readings(3_000, 30, 10, 7);
    let messages: Vec<String> = lines.chunks(2).map(|c| c.join("\n")).collect();
    let mut runs = 1;
    let mut child = spawn_agent(&cfg, dir.path(), runs);
    // The persistent session must exist before the run publishes to it: the first message again
    // until something lands (the window drops the copies).
    let deadline = Instant::now() + Duration::from_secs(20);
    while stub.landed_total() == 0 {
        assert!(
            Instant::now() < deadline,
            "the agent never received anything"
        );
        mqtt_publish(&broker, TOPIC, messages[..1].to_vec(), Duration::ZERO).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let publisher = {
        let (broker, rest) = (broker.clone(), messages[1..].to_vec());
        // About 200 a second.
        tokio::spawn(async move { mqtt_publish(&broker, TOPIC, rest, PACE).await })
    };
    let mut rng = rand::rng();
    let mut kills = 0;
    while !publisher.is_finished() {
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..1500))).await;
        sigkill(child);
        kills += 1;
        // Down for up to 1.2 s: at 200 messages a second, well within mosquitto's queue of 1,000
        // messages per offline client.
        tokio::time::sleep(Duration::from_millis(rng.random_range(50..1200))).await;
        runs += 1;
        child = spawn_agent(&cfg, dir.path(), runs);
    }
    publisher.await.unwrap();
    settle_and_check(&stub, child, (kills, runs), &expected).await;
}

/// Clients post to the agent's local HTTP port and send a request again until it is answered
/// 200, while the agent is SIGKILLed at random points: every reading lands once, because the
/// port answers only once the records are in the spool, and the dedupe window (rebuilt from its
/// log and the spool at start) drops what a client sends again after a kill cut off the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_while_clients_post_to_the_local_port_loses_nothing_and_lands_nothing_twice() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    const CLIENTS: usize = 3;
    let stub = Stub::start(Faults {
        unavailable: 10,
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cfg = write_config(
        dir.path(),
        &stub.url(),
        "[batch]\nmax_records = 200\nmax_age_ms = 100\n",
        &format!("[[sources]]\ntype = \"http\"\nlisten = \"127.0.0.1:{port}\"\n"),
    );
    // 20,000 distinct readings and 2,000 re-sent ones, 50 lines a request.
    let (lines, expected) = readings(20_000, 30, 10, 13);
    let bodies: Arc<Vec<String>> = Arc::new(lines.chunks(50).map(|c| c.join("\n")).collect());
    let mut runs = 1;
    let mut child = spawn_agent(&cfg, dir.path(), runs);
    wait_for_port(port).await;
    let url = format!("http://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    let next = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (bodies, next, url) = (bodies.clone(), next.clone(), url.clone());
            tokio::spawn(async move {
                let client = reqwest::Client::builder()
                    .timeout(Duration::from_secs(10))
                    .build()
                    .unwrap();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(body) = bodies.get(i) else {
                        return;
                    };
                    // Paced, so that the run outlasts several kills.
                    tokio::time::sleep(Duration::from_millis(25)).await;
                    loop {
                        let sent = client
                            .post(&url)
                            .header("content-type", "application/x-ndjson")
                            .body(body.clone())
                            .send()
                            .await;
                        match sent {
                            Ok(r) if r.status() == 200 => break,
                            Ok(r) => assert!(r.status().is_server_error(), "{}", r.status()),
                            Err(_) => {}
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            })
        })
        .collect();
    let mut rng = rand::rng();
    let mut kills = 0;
    while !clients.iter().all(|c| c.is_finished()) {
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..800))).await;
        if kills == 6 || clients.iter().all(|c| c.is_finished()) {
            continue;
        }
        sigkill(child);
        kills += 1;
        tokio::time::sleep(Duration::from_millis(rng.random_range(50..500))).await;
        runs += 1;
        child = spawn_agent(&cfg, dir.path(), runs);
        wait_for_port(port).await;
    }
    for c in clients {
        c.await.unwrap();
    }
    settle_and_check(&stub, child, (kills, runs), &expected).await;
}

/// With the gateway down and the spool full (overflow `block`), the file source waits with lines
/// read but not spooled, and the agent keeps saving its file positions meanwhile. SIGKILLed then,
/// it must not have saved a position past what is in the spool: restarted with the gateway back,
/// it delivers every reading once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_a_full_spool_loses_nothing() {
    stopped_with_a_full_spool(false).await;
}

/// The same with SIGTERM: the agent stops although its pipeline waits for spool room (not after
/// systemd's stop timeout), and saves no position past what is in the spool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_full_spool_stops_and_loses_nothing() {
    stopped_with_a_full_spool(true).await;
}

async fn stopped_with_a_full_spool(graceful: bool) {
    let stub = Stub::start(Faults {
        unavailable: 100,
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    // 22 MB of NDJSON, about 3 MB as batches: 1 MiB of spool holds a third of it.
    let (lines, expected) = readings(200_000, 1000, 0, 17);
    let cfg = file_agent(
        dir.path(),
        &stub,
        "[batch]\nmax_records = 1000\nzstd_level = 1\n[spool]\nmax_mb = 1\n",
        &lines,
    );
    let mut child = spawn_agent(&cfg, dir.path(), 1);
    // The spool fills within a second; the positions are saved every second.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(stub.landed_total(), 0, "the gateway was down");
    if graceful {
        let why = "with the spool full";
        sigterm_and_wait(&mut child, Duration::from_secs(30), why, (dir.path(), 1)).await;
    } else {
        sigkill(child);
    }
    stub.set_faults(Faults::default());
    let (kills, runs) = run_with_kills(&cfg, dir.path(), (0, 0..1), 2).await;
    report_and_check(&stub, kills + 1, runs, &expected);
}

/// SIGTERM while a request to the gateway hangs (the gateway answers after a minute, the
/// agent's request timeout is 30 s): the agent gives the request up and stops at once, instead
/// of waiting out the timeout. The batch stays spooled: restarted with the gateway well, the
/// agent delivers every reading once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_hanging_request_stops_at_once_and_loses_nothing() {
    let stub = Stub::start(Faults {
        slow: 100,
        slow_for: Duration::from_secs(60),
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (lines, expected) = readings(5_000, 100, 0, 23);
    let cfg = file_agent(dir.path(), &stub, "[batch]\nmax_records = 1000\n", &lines);
    // The shipped request timeout (30 s), not the tests' 1 s.
    let text = std::fs::read_to_string(&cfg).unwrap();
    assert!(text.contains("timeout_ms = 1000\n"));
    std::fs::write(
        &cfg,
        text.replace("timeout_ms = 1000\n", "timeout_ms = 30000\n"),
    )
    .unwrap();
    let mut child = spawn_agent(&cfg, dir.path(), 1);
    // The gateway takes the first batch and holds back its answer.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let why = "with a request hanging";
    sigterm_and_wait(&mut child, Duration::from_secs(15), why, (dir.path(), 1)).await;
    stub.set_faults(Faults::default());
    let (kills, runs) = run_with_kills(&cfg, dir.path(), (0, 0..1), 2).await;
    report_and_check(&stub, kills + 1, runs, &expected);
}

/// An agent reading its standard input (a pipe whose writer runs on) into `stub`, with `batch`
/// keys: its config (state in `dir/state`), started as run 1 on `stdin`.
fn stdin_agent(
    dir: &std::path::Path,
    stub: &Stub,
    batch: &str,
    stdin: std::io::PipeReader,
) -> (std::path::PathBuf, std::process::Child) {
    let source = "[[sources]]\ntype = \"stdin\"\nstream = \"sensor_readings\"\n";
    let cfg = write_config(dir, &stub.url(), &format!("[batch]\n{batch}"), source);
    let child = spawn_agent_with(&cfg, dir, 1, stdin.into(), "edge_agent=info");
    (cfg, child)
}

/// SIGTERM while the agent waits for more of its standard input, whose writer keeps the pipe
/// open (`producer | edge-agent run`, stopped by systemd): the agent stops at once, not when
/// the writer ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_stdin_stays_open_stops_at_once() {
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let (lines, expected) = readings(2_000, 50, 0, 29);
    let (reader, mut writer) = std::io::pipe().unwrap();
    let (_, mut child) = stdin_agent(dir.path(), &stub, "max_records = 1000\n", reader);
    std::io::Write::write_all(&mut writer, (lines.join("\n") + "\n").as_bytes()).unwrap();
    support::wait_landed(&stub, expected.len()).await;
    let why = "with its standard input open";
    sigterm_and_wait(&mut child, Duration::from_secs(5), why, (dir.path(), 1)).await;
    drop(writer);
    support::assert_exactly_once(&stub.landed(), &expected);
}

/// SIGTERM while the agent reads its standard input as fast as it can: stdin cannot be read
/// again, so every reading the agent took from the pipe must be spooled before it exits (none
/// left in the queue to its pipeline). Measured: what the agent took is what the test wrote
/// less what is still in the pipe afterwards; every reading wholly in it lands once after a
/// restart, and nothing else does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_reading_stdin_spools_everything_it_read() {
    let stub = Stub::start(Faults {
        // Nothing is delivered in the first run: the agent only reads and spools.
        unavailable: 100,
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (lines, hashes) = readings(300_000, 1000, 0, 31);
    let text = lines.join("\n") + "\n";
    let (reader, writer) = std::io::pipe().unwrap();
    let left = reader.try_clone().unwrap();
    // Compression at level 19 makes the pipeline slower than reading: chunks queue up for it.
    let batch = "max_records = 1000\nzstd_level = 19\n";
    let (cfg, mut child) = stdin_agent(dir.path(), &stub, batch, reader);
    let written = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writing = {
        let (written, stop, text) = (written.clone(), stop.clone(), text.clone());
        std::thread::spawn(move || {
            use std::sync::atomic::Ordering::SeqCst;
            let mut writer = writer;
            for piece in text.as_bytes().chunks(4096) {
                if stop.load(SeqCst) {
                    break;
                }
                std::io::Write::write_all(&mut writer, piece).unwrap();
                written.fetch_add(piece.len(), SeqCst);
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Level 19 makes the last batches slow to close, the more so on a busy machine: this test
    // is about what is spooled, the one above about how soon the agent stops.
    let why = "while reading its standard input";
    sigterm_and_wait(&mut child, Duration::from_secs(15), why, (dir.path(), 1)).await;
    // What the agent did not take is still in the pipe: read it out (the writer ends).
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut rest = Vec::new();
    std::io::Read::read_to_end(&mut &left, &mut rest).unwrap();
    writing.join().unwrap();
    let taken = written.load(std::sync::atomic::Ordering::SeqCst) - rest.len();
    assert!(
        taken > 0 && taken < text.len(),
        "the agent took {taken} of {} bytes: the stop came too early or too late to test",
        text.len()
    );
    let whole = text.as_bytes()[..taken]
        .iter()
        .filter(|b| **b == b'\n')
        .count();
    // Restarted on an empty input with the gateway well, the agent delivers its spool and ends.
    stub.set_faults(Faults::default());
    let mut again = spawn_agent_with(&cfg, dir.path(), 2, Stdio::null(), "edge_agent=info");
    let status = tokio::task::spawn_blocking(move || again.wait())
        .await
        .unwrap();
    assert!(status.unwrap().success());
    eprintln!("the agent took {taken} bytes, {whole} whole readings");
    support::assert_exactly_once(&stub.landed(), &hashes[..whole]);
}
