//! Sources against real files, a real mosquitto broker and real HTTP clients; delivery to a
//! recording gateway.

mod mqtt;
use crate::support;

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use support::{
    Faults, Running, Stub, assert_exactly_once, config, config_with_root, free_port, readings,
    start, wait_for_port, wait_landed,
};

fn append(path: &Path, lines: &[String]) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    for l in lines {
        writeln!(f, "{l}").unwrap();
    }
}

/// Distinct records of `stream` (sensor_readings or vehicle_telemetry) that hardly compress:
/// each carries 128 hex digits of BLAKE3 output.
fn noisy_lines(stream: &str, n: u64) -> Vec<String> {
    (0..n)
        .map(|n| {
            let noise: String = (0..2u64)
                .map(|k| blake3::hash(&(n * 2 + k).to_le_bytes()).to_hex().to_string())
                .collect();
            let ts = 1_767_225_600_000u64 + n;
            match stream {
                "sensor_readings" => format!(
                    r#"{{"device_id":"d{}","sensor":"s","ts":{ts},"value":{n},"tags":{{"noise":"{noise}"}}}}"#,
                    n % 7
                ),
                _ => format!(
                    r#"{{"vehicle_id":"v{}","recorded_at":{ts},"lat":1,"lon":2,"fault_codes":["{noise}"]}}"#,
                    n % 7
                ),
            }
        })
        .collect()
}

/// A config, with its state under `dir`, that reads `path` (a file or a directory) into
/// sensor_readings; `batch` and `more` are keys of `[batch]` and of the source.
fn file_source(dir: &Path, stub: &Stub, batch: &str, path: &Path, more: &str) -> String {
    config(
        &dir.join("state"),
        &stub.url(),
        &format!("[batch]\n{batch}\n"),
        &support::file_source_toml(path, more),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tailing_survives_rotation_truncation_and_restarts() {
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    std::fs::create_dir(&logs).unwrap();
    let live = logs.join("readings.ndjson");
    let (lines, expected) = readings(700, 7, 0, 3);
    let cfg = file_source(
        dir.path(),
        &stub,
        "max_age_ms = 50",
        &logs,
        "follow = true\nsuffix = \".ndjson\"\npoll_ms = 50\n",
    );
    append(&live, &lines[..100]);
    let (agent, shutdown) = start(&cfg);
    wait_landed(&stub, 100).await;
    // Rotation by rename: the writer adds lines to the renamed file before it reopens, and the
    // new file under the old name starts empty. `.ndjson.1` does not match the suffix: the agent
    // finishes the renamed file through the handle it holds.
    append(&live, &lines[100..200]);
    std::fs::rename(&live, logs.join("readings.ndjson.1")).unwrap();
    append(&logs.join("readings.ndjson.1"), &lines[200..250]);
    append(&live, &lines[250..350]);
    wait_landed(&stub, 350).await;
    // copytruncate: the file is cut to zero and written again from the start.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&live)
        .unwrap()
        .set_len(0)
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    append(&live, &lines[350..450]);
    wait_landed(&stub, 450).await;
    shutdown.cancel();
    let first = agent.await.unwrap().unwrap().total();
    assert_eq!(first.pipeline.read, 450);
    // The renamed file's position follows it to its new name (so that a crash while it was
    // being finished would find it again).
    let positions = std::fs::read_to_string(dir.path().join("state/positions.json")).unwrap();
    assert!(positions.contains("readings.ndjson.1"), "{positions}");
    // Lines written while the agent is down, then a rotation while it is still down, then a
    // restart: it finds the renamed file by its inode and resumes it at the saved position,
    // and reads the new file under the old name from the start.
    append(&live, &lines[450..520]);
    std::fs::rename(&live, logs.join("readings.ndjson.2")).unwrap();
    append(&live, &lines[520..600]);
    let (agent, shutdown) = start(&cfg);
    wait_landed(&stub, 600).await;
    // A second file appears in the directory.
    append(&logs.join("other.ndjson"), &lines[600..]);
    wait_landed(&stub, 700).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    shutdown.cancel();
    let second = agent.await.unwrap().unwrap().total();
    assert_eq!(
        second.pipeline.read, 250,
        "only new lines were read after the restart"
    );
    assert_eq!(second.pipeline.duplicates, 0);
    assert_exactly_once(&stub.landed(), &expected);
}

/// A single log file rotated the way logrotate numbers its rotations (`.1` becomes `.2`, the
/// live file `.1`). Two rotations while the agent is down, and two between two of its polls,
/// leave a file it never opened between its own rotated file and the live one; it is read too.
/// An older rotation from before the agent's first start, a compressed one and another log
/// whose name starts with the log's are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotations_the_agent_never_saw_are_read() {
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let live = dir.path().join("readings.ndjson");
    let rotated = |n: u32| dir.path().join(format!("readings.ndjson.{n}"));
    // logrotate: every rotation shifts the numbered files up and renames the live file `.1`.
    let rotate = || {
        for n in (1..9).rev() {
            if rotated(n).exists() {
                std::fs::rename(rotated(n), rotated(n + 1)).unwrap();
            }
        }
        std::fs::rename(&live, rotated(1)).unwrap();
    };
    let (lines, expected) = readings(500, 7, 0, 4);
    let (old, _) = readings(20, 3, 0, 99);
    let (other, _) = readings(10, 2, 0, 77);
    // Rotations from before the agent's first start, last written an hour ago.
    let before = dir.path().join("readings.ndjson-20261122");
    append(&before, &old);
    let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(&before)
        .unwrap()
        .set_modified(hour_ago)
        .unwrap();
    std::fs::write(dir.path().join("readings.ndjson.9.gz"), b"not a log").unwrap();
    // The poll is long, so that two rotations in a row fall between two polls.
    let cfg = file_source(
        dir.path(),
        &stub,
        "max_age_ms = 50",
        &live,
        "follow = true\npoll_ms = 1500\n",
    );
    append(&live, &lines[..100]);
    let (agent, shutdown) = start(&cfg);
    wait_landed(&stub, 100).await;
    shutdown.cancel();
    assert_eq!(agent.await.unwrap().unwrap().total().pipeline.read, 100);
    // Down: lines, a rotation, a file the agent never opens, a second rotation, the live file.
    // Beside them another live log, named like the log but not like a rotation of it.
    append(&dir.path().join("readings.ndjson-errors"), &other);
    append(&live, &lines[100..150]);
    rotate();
    append(&live, &lines[150..250]);
    rotate();
    append(&live, &lines[250..300]);
    let (agent, shutdown) = start(&cfg);
    wait_landed(&stub, 300).await;
    // Running: the same two rotations right after a poll, before the next.
    tokio::time::sleep(Duration::from_millis(200)).await;
    append(&live, &lines[300..350]);
    rotate();
    append(&live, &lines[350..450]);
    rotate();
    append(&live, &lines[450..]);
    wait_landed(&stub, 500).await;
    tokio::time::sleep(Duration::from_millis(3000)).await;
    shutdown.cancel();
    let second = agent.await.unwrap().unwrap().total();
    assert_eq!(second.pipeline.read, 400, "every line read once");
    assert_exactly_once(&stub.landed(), &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csv_files_are_typed_by_the_stream() {
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("readings.csv");
    std::fs::write(
        &file,
        "device_id,sensor,ts,value,unit,quality\n\
         d1,temp,2024-05-01T12:00:00Z,21.5,degC,192\n\
         d1,temp,1714564801000,21.75,,\n\
         \"d,2\",rpm,2024-05-01T12:00:02.5Z,1500,rpm,0\n\
         d3,temp,2024-05-01T12:00:03Z,not-a-number,degC,192\n",
    )
    .unwrap();
    let cfg = config(
        &dir.path().join("state"),
        &stub.url(),
        "",
        &format!(
            "[[sources]]\ntype = \"file\"\npath = {file:?}\nformat = \"csv\"\nstream = \"sensor_readings\"\n"
        ),
    );
    let (agent, _shutdown) = start(&cfg);
    let stats = agent.await.unwrap().unwrap().total();
    assert_eq!((stats.pipeline.read, stats.pipeline.invalid), (4, 1));
    let def = schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone();
    let expected: Vec<_> = [
        r#"{"device_id":"d1","sensor":"temp","ts":"2024-05-01T12:00:00Z","value":21.5,"unit":"degC","quality":192}"#,
        r#"{"device_id":"d1","sensor":"temp","ts":1714564801000,"value":21.75}"#,
        r#"{"device_id":"d,2","sensor":"rpm","ts":"2024-05-01T12:00:02.5Z","value":1500,"unit":"rpm","quality":0}"#,
    ]
    .iter()
    .map(|l| schemas::check_bytes(&def, l.as_bytes()).unwrap().hash)
    .collect();
    assert_exactly_once(&stub.landed(), &expected);
}

/// A source's `fields` fill what its records lack, after the CSV cells are typed: NDJSON and CSV
/// files of one machine without its device id land as the complete readings; a record's own
/// value wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sources_fields_fill_what_its_records_lack() {
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let (ndjson, csv) = (dir.path().join("press.ndjson"), dir.path().join("oven.csv"));
    std::fs::write(
        &ndjson,
        "{\"sensor\":\"temp\",\"ts\":1714564800000,\"value\":21.5}\n\
         {\"sensor\":\"temp\",\"ts\":1714564801000,\"value\":21.75,\"quality\":0}\n\
         {\"device_id\":\"own\",\"sensor\":\"rpm\",\"ts\":1714564802000,\"value\":1500}\n",
    )
    .unwrap();
    std::fs::write(&csv, "sensor,ts,value\ntemp,1714564803000,180.5\n").unwrap();
    let source = |path: &Path, format: &str, fields: &str| {
        format!(
            "[[sources]]\ntype = \"file\"\npath = {path:?}\nformat = \"{format}\"\n\
             stream = \"sensor_readings\"\nfields = {fields}\n"
        )
    };
    let cfg = config(
        &dir.path().join("state"),
        &stub.url(),
        "",
        &(source(
            &ndjson,
            "ndjson",
            "{ device_id = \"press-07\", quality = 192 }",
        ) + &source(&csv, "csv", "{ device_id = \"oven-2\" }")),
    );
    let (agent, _shutdown) = start(&cfg);
    let stats = agent.await.unwrap().unwrap().total();
    assert_eq!((stats.pipeline.read, stats.pipeline.invalid), (4, 0));
    let def = schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone();
    let expected: Vec<_> = [
        r#"{"device_id":"press-07","sensor":"temp","ts":1714564800000,"value":21.5,"quality":192}"#,
        r#"{"device_id":"press-07","sensor":"temp","ts":1714564801000,"value":21.75,"quality":0}"#,
        r#"{"device_id":"own","sensor":"rpm","ts":1714564802000,"value":1500,"quality":192}"#,
        r#"{"device_id":"oven-2","sensor":"temp","ts":1714564803000,"value":180.5}"#,
    ]
    .iter()
    .map(|l| schemas::check_bytes(&def, l.as_bytes()).unwrap().hash)
    .collect();
    assert_exactly_once(&stub.landed(), &expected);
}

/// A stub that refuses (400) the batches of dev-3, and a file of 600 readings (`seed`) of six
/// devices in device order: with 100 records a batch, one device per batch, one refused.
async fn one_device_refused(
    seed: u64,
) -> (
    Stub,
    tempfile::TempDir,
    std::path::PathBuf,
    Vec<schemas::ContentHash>,
) {
    let stub = Stub::start(Faults {
        refuse_device: Some("dev-3\""),
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (mut lines, expected) = readings(600, 6, 0, seed);
    lines.sort_by_key(|l| l[..20].to_owned());
    let file = dir.path().join("r.ndjson");
    append(&file, &lines);
    (stub, dir, file, expected)
}

/// [`one_device_refused`], then an agent in batches of 100 (its config returned) run to the end:
/// one batch refused, the other 500 readings landed.
async fn one_device_refused_and_run(
    seed: u64,
) -> (Stub, tempfile::TempDir, String, Vec<schemas::ContentHash>) {
    let (stub, dir, file, expected) = one_device_refused(seed).await;
    let cfg = file_source(dir.path(), &stub, "max_records = 100", &file, "");
    let (agent, _shutdown) = start(&cfg);
    let stats = agent.await.unwrap().unwrap().total();
    assert_eq!(stats.delivery.rejected_batches, 1);
    assert_eq!(stub.landed_total(), 500);
    (stub, dir, cfg, expected)
}

/// Once the cause of a refusal is fixed, `resend-rejected` puts the kept batch back into the
/// spool (and out of `rejected/`), and the agent's next start delivers it: every reading once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_batches_are_resent_once_the_cause_is_fixed() {
    let (stub, dir, cfg, expected) = one_device_refused_and_run(9).await;

    stub.set_faults(Faults::default());
    let config = edge_agent::AgentConfig::parse(&cfg).unwrap();
    let streams = schemas::example_streams();
    // `status` counts the kept batch, and then the batch put back into the spool.
    let waiting_and_refused = || {
        let status = edge_agent::status::status(&config, None).unwrap();
        let s = &status.streams[0];
        assert_eq!(s.stream, "sensor_readings");
        (
            s.spool.batches,
            s.spool.records,
            s.rejected_batches,
            s.rejected_records,
        )
    };
    assert_eq!(waiting_and_refused(), (0, 0, 1, 100));
    assert_eq!(
        edge_agent::resend_rejected(&config, &streams, Some("vehicle_telemetry")).unwrap(),
        edge_agent::Resent::default(),
        "another stream's batches stay"
    );
    let resent = edge_agent::resend_rejected(&config, &streams, None).unwrap();
    assert_eq!((resent.batches, resent.records), (1, 100));
    let rejected = dir.path().join("state/rejected");
    assert_eq!(std::fs::read_dir(&rejected).unwrap().count(), 0);
    assert_eq!(waiting_and_refused(), (1, 100, 0, 0));

    let (agent, _shutdown) = start(&cfg);
    let stats = agent.await.unwrap().unwrap().total();
    assert_eq!(
        (
            stats.pipeline.read,
            stats.delivery.batches,
            stats.delivery.rejected_batches
        ),
        (0, 1, 0),
        "nothing read again; the batch put back is delivered"
    );
    assert_exactly_once(&stub.landed(), &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_batches_are_kept_aside_and_the_rest_goes_on() {
    let (_stub, dir, _, _) = one_device_refused_and_run(0).await;
    let kept: Vec<_> = std::fs::read_dir(dir.path().join("state/rejected"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(kept.len(), 2, "{kept:?}");
    let note = kept.iter().find(|k| k.ends_with(".json")).unwrap();
    let note: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("state/rejected").join(note)).unwrap(),
    )
    .unwrap();
    assert_eq!(note["status"], 400);
    assert_eq!(note["records"], 100);
}

/// A file with lines past `batch.max_line_bytes` (a run of 3 MiB without a line break among
/// them): each is skipped and consumed, every reading around them lands once, and the agent
/// finishes the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_long_lines_are_skipped_and_the_rest_lands() {
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let (mut lines, expected) = readings(300, 5, 0, 8);
    lines.insert(100, "x".repeat(3 << 20));
    lines.insert(200, format!("{{\"device_id\":\"{}\"}}", "d".repeat(5_000)));
    let file = dir.path().join("r.ndjson");
    append(&file, &lines);
    let cfg = file_source(
        dir.path(),
        &stub,
        "max_records = 100\nmax_line_bytes = 4096",
        &file,
        "",
    );
    let (agent, _shutdown) = start(&cfg);
    let stats = agent.await.unwrap().unwrap().total();
    assert_eq!(
        stats.pipeline.read, 300,
        "the two long lines never reach the pipeline"
    );
    assert_exactly_once(&stub.landed(), &expected);
}

/// A refused batch leaves the spool only once it is kept under `rejected/`: while that cannot
/// be written, or is at `spool.rejected_max_mb`, the batch waits first in the spool (not sent
/// again) with the stream's later batches behind it; once there is room it goes aside and the
/// rest lands. Before, a batch that could not be kept was dropped from the spool all the same,
/// and `rejected/` grew without a bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_batch_waits_in_the_spool_until_rejected_has_room() {
    let (stub, dir, file, _) = one_device_refused(7).await;
    // Nothing can be written under rejected/: a file stands where the directory goes.
    let rejected = dir.path().join("state/rejected");
    std::fs::create_dir_all(dir.path().join("state")).unwrap();
    std::fs::write(&rejected, b"").unwrap();
    let cfg = file_source(dir.path(), &stub, "max_records = 100", &file, "")
        .replace("[batch]", "[spool]\nrejected_max_mb = 1\n[batch]");
    let (agent, _shutdown) = start(&cfg);
    let arrived = || stub.recorded.lock().unwrap().arrived.len();
    let deadline = Instant::now() + Duration::from_secs(30);
    while arrived() < 4 {
        assert!(Instant::now() < deadline, "the refused batch never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waits = edge_agent::deliver::REJECTED_RECHECK + Duration::from_millis(500);
    tokio::time::sleep(waits).await;
    assert_eq!(
        arrived(),
        4,
        "a refused batch is not sent again while it waits"
    );
    assert_eq!(stub.landed_total(), 300, "the batches behind it wait");
    assert!(!agent.is_finished());

    // Now a directory, but full: an operator's 1 MiB leftover.
    std::fs::remove_file(&rejected).unwrap();
    std::fs::create_dir(&rejected).unwrap();
    let leftover = rejected.join("leftover.body");
    std::fs::write(&leftover, vec![0u8; 1 << 20]).unwrap();
    tokio::time::sleep(waits).await;
    assert_eq!((arrived(), stub.landed_total()), (4, 300));
    assert!(!agent.is_finished());
    assert_eq!(std::fs::read_dir(&rejected).unwrap().count(), 1);

    // Room made: the batch goes aside and the rest lands.
    std::fs::remove_file(&leftover).unwrap();
    let stats = tokio::time::timeout(Duration::from_secs(30), agent)
        .await
        .expect("the agent finishes once the batch is kept")
        .unwrap()
        .unwrap()
        .total();
    assert_eq!(stats.delivery.rejected_batches, 1);
    assert_eq!(stub.landed_total(), 500);
    let mut kept: Vec<_> = std::fs::read_dir(&rejected)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    kept.sort();
    assert_eq!(kept.len(), 2, "{kept:?}");
    let body = std::fs::read(&kept[0]).unwrap();
    let ndjson = zstd::decode_all(&body[..]).unwrap();
    assert_eq!(ndjson.iter().filter(|&&b| b == b'\n').count(), 100);
    assert!(String::from_utf8_lossy(&ndjson).contains("dev-3\""));
}

/// An agent tailing `n` readings (seed `seed`, batches of 100) into a stub with `faults`, once
/// the stub has had four requests from it. Returns the stub, the agent's directory, the running
/// agent and the distinct readings' hashes.
async fn retried_four_times(
    faults: Faults,
    n: usize,
    seed: u64,
) -> (Stub, tempfile::TempDir, Running, Vec<schemas::ContentHash>) {
    let stub = Stub::start(faults).await;
    let dir = tempfile::tempdir().unwrap();
    let (lines, expected) = readings(n, 5, 0, seed);
    let file = dir.path().join("r.ndjson");
    append(&file, &lines);
    let cfg = file_source(dir.path(), &stub, "max_records = 100", &file, "");
    let (agent, _shutdown) = start(&cfg);
    let deadline = Instant::now() + Duration::from_secs(30);
    while stub.recorded.lock().unwrap().arrived.len() < 4 {
        assert!(Instant::now() < deadline, "the agent stopped retrying");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (stub, dir, agent, expected)
}

/// A 401 is the agent's token, not the batch, and a 407 the credentials of a proxy on the way:
/// every batch would get them. The batch stays in the spool and is retried until the token or
/// the proxy login is accepted, instead of going aside with all the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_or_proxy_login_holds_the_batches_until_accepted() {
    let refusals = [
        Faults {
            unauthorized: true,
            ..Faults::default()
        },
        Faults {
            proxy_auth: true,
            ..Faults::default()
        },
    ];
    for (seed, faults) in (6..).zip(refusals) {
        let (stub, dir, agent, expected) = retried_four_times(faults, 300, seed).await;
        assert_eq!(stub.landed_total(), 0);
        assert!(
            !dir.path().join("state/rejected").exists(),
            "{faults:?}: nothing is put aside"
        );
        assert!(!agent.is_finished());
        stub.set_faults(Faults::default());
        let stats = agent.await.unwrap().unwrap().total();
        assert_eq!(stats.delivery.rejected_batches, 0);
        assert_exactly_once(&stub.landed(), &expected);
    }
}

/// A 429's `Retry-After` (1 s from the stub) sets the wait before the next attempt; the agent's
/// own backoff would try again after 125–375 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_sets_the_wait_before_the_next_attempt() {
    let faults = Faults {
        too_many: 100,
        ..Faults::default()
    };
    let (stub, _dir, agent, expected) = retried_four_times(faults, 50, 7).await;
    let arrived = stub.recorded.lock().unwrap().arrived.clone();
    for pair in arrived.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(gap >= Duration::from_millis(950), "retried after {gap:?}");
    }
    stub.set_faults(Faults::default());
    agent.await.unwrap().unwrap();
    assert_exactly_once(&stub.landed(), &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_http_port_answers_once_records_are_spooled() {
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cfg = support::http_source_config(
        dir.path(),
        &stub.url(),
        port,
        "token = \"local\"\nmax_body_bytes = 100000\n",
    );
    let (agent, shutdown) = start(&cfg);
    let url = format!("http://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    let client = reqwest::Client::new();
    let post = |body: Vec<u8>, ct: &str, ce: &str, token: &str| {
        client
            .post(&url)
            .bearer_auth(token)
            .header("content-type", ct)
            .header("content-encoding", ce)
            .body(body)
            .send()
    };
    wait_for_port(port).await;
    let (lines, expected) = readings(50, 5, 0, 9);
    let mut body = lines[..40].join("\n");
    body.push_str("\n{\"device_id\": 1}\n");
    body.push_str(&lines[0]);
    let r = post(
        zstd::encode_all(body.as_bytes(), 3).unwrap(),
        "application/x-ndjson",
        "zstd",
        "local",
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let answer: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(answer["accepted"], 40);
    assert_eq!(answer["duplicates"], 1);
    assert_eq!(answer["rejected"][0]["index"], 40);
    // A pretty-printed JSON array body.
    let array: Vec<serde_json::Value> = lines[40..]
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let r = post(
        serde_json::to_vec_pretty(&array).unwrap(),
        "application/json",
        "identity",
        "local",
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let answer: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(answer["accepted"], 10);
    // Refusals.
    assert_eq!(
        post(b"{}".to_vec(), "application/x-ndjson", "identity", "wrong")
            .await
            .unwrap()
            .status(),
        401
    );
    let bomb = zstd::encode_all(&vec![b' '; 10_000_000][..], 19).unwrap();
    assert_eq!(
        post(bomb, "application/x-ndjson", "zstd", "local")
            .await
            .unwrap()
            .status(),
        413
    );
    assert_eq!(
        post(b"x".to_vec(), "text/plain", "identity", "local")
            .await
            .unwrap()
            .status(),
        415
    );
    let unknown = client
        .post(format!("http://127.0.0.1:{port}/v1/streams/nope/records"))
        .bearer_auth("local")
        .header("content-type", "application/x-ndjson")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    wait_landed(&stub, 50).await;
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    assert_exactly_once(&stub.landed(), &expected);
}

/// With the gateway down and a 1 MiB spool under `drop_newest`, the local port answers 503
/// `spool_full` once records are dropped, and a retry of the same body is not taken for
/// duplicates (it is dropped again, and answered 503 again). The admin port's `/metrics` counts
/// the dropped records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_http_port_answers_503_when_a_full_spool_drops_records() {
    let stub = Stub::start(Faults {
        unavailable: 100,
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin) = (free_port(), free_port());
    let cfg = format!(
        "admin_listen = \"127.0.0.1:{admin}\"\n{}",
        config(
            &dir.path().join("state"),
            &stub.url(),
            "[spool]\nmax_mb = 1\n[batch]\nmax_age_ms = 100\n\
             [streams.sensor_readings]\noverflow = \"drop_newest\"\n",
            &format!(
                "[[sources]]\ntype = \"http\"\nlisten = \"127.0.0.1:{port}\"\nmax_body_bytes = 4000000\n"
            ),
        )
    );
    let (agent, shutdown) = start(&cfg);
    let url = format!("http://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    wait_for_port(port).await;
    let client = reqwest::Client::new();
    let post = |body: String| {
        client
            .post(&url)
            .header("content-type", "application/x-ndjson")
            .body(body)
            .send()
    };
    // Records that hardly compress (128 random bytes as hex in a tag), 2,000 per request: about
    // 0.3 MiB of spool per request.
    let body = |request: usize| -> String {
        (0..2000)
            .map(|i| {
                let n = request * 2000 + i;
                let mut noise = String::new();
                for k in 0..4u64 {
                    noise.push_str(&blake3::hash(&(n as u64 * 4 + k).to_le_bytes()).to_hex());
                }
                format!(
                    r#"{{"device_id":"d{}","sensor":"s","ts":{},"value":{n},"tags":{{"noise":"{noise}"}}}}"#,
                    n % 7,
                    1_767_225_600_000u64 + n as u64
                ) + "\n"
            })
            .collect()
    };
    let mut refused = None;
    for request in 0..10 {
        let res = post(body(request)).await.unwrap();
        match res.status().as_u16() {
            200 => continue,
            503 => {
                assert!(res.headers().contains_key("retry-after"));
                let answer: serde_json::Value =
                    serde_json::from_slice(&res.bytes().await.unwrap()).unwrap();
                assert_eq!(answer["error"], "spool_full", "{answer}");
                refused = Some(request);
                break;
            }
            other => panic!("unexpected {other}: {}", res.text().await.unwrap()),
        }
    }
    let refused = refused.expect("the 1 MiB spool never filled");
    assert!(refused >= 1, "the first request fits the spool");
    // The same body again: its records are not duplicates, and still do not fit.
    let again = post(body(refused)).await.unwrap();
    assert_eq!(again.status(), 503, "{}", again.text().await.unwrap());
    let metrics = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // Other series exist at zero (registered at start): other streams', and those of agents that
    // other tests run in this process (the recorder is global), under their own policy.
    let dropped: f64 = metrics
        .lines()
        .find(|l| {
            l.starts_with(r#"edge_agent_spool_dropped_records_total{"#)
                && l.contains(r#"stream="sensor_readings""#)
                && l.contains(r#"policy="drop_newest""#)
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no dropped-records counter in:\n{metrics}"));
    assert!(dropped >= 4000.0, "dropped {dropped}");
    assert!(metrics.contains("edge_agent_records_received_total{"));
    shutdown.cancel();
    agent.await.unwrap().unwrap();
}

/// A stream's bandwidth cap holds end to end: records that hardly compress, in batches of 100,
/// reach the gateway no faster than the cap allows (a bucket of one second's bytes, which a
/// batch may overdraw once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_bandwidth_cap_paces_delivery() {
    const CAP: u64 = 15_000;
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.ndjson");
    let lines = noisy_lines("sensor_readings", 1200);
    append(&input, &lines);
    let cfg = config(
        &dir.path().join("state"),
        &stub.url(),
        &format!(
            "[batch]\nmax_records = 100\n[streams.sensor_readings]\nmax_bytes_per_sec = {CAP}\n"
        ),
        &format!("[[sources]]\ntype = \"file\"\npath = {input:?}\nstream = \"sensor_readings\"\n"),
    );
    let started = Instant::now();
    let (agent, shutdown) = start(&cfg);
    wait_landed(&stub, lines.len()).await;
    let elapsed = started.elapsed().as_secs_f64();
    let (bytes, requests) = {
        let r = stub.recorded.lock().unwrap();
        (r.body_bytes, r.arrived.len())
    };
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    assert_eq!(requests, 12, "one request per batch of 100");
    assert_paced(bytes, requests as u64, elapsed, CAP);
}

/// An uplink that carries a batch in longer than `gateway.timeout_ms`: each request's timeout
/// grows by its body's size at `min_upload_bytes_per_sec`, and the batch lands. With the
/// timeout alone (`min_upload_bytes_per_sec = 0`, as before), every attempt was cut off and the
/// batch was sent again for ever, spending the link's bytes each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_slower_to_upload_than_the_timeout_lands_over_a_slow_link() {
    // Slow enough that an attempt cut off at the timeout cannot arrive whole while the test
    // watches (the proxy goes on forwarding what the agent had already handed to the kernel).
    const LINK: u64 = 2_000;
    let stub = Stub::start(Faults::default()).await;
    let front = support::free_port();
    let _link = support::slow_proxy(front, stub.addr.port(), LINK).await;
    let lines = noisy_lines("sensor_readings", 400);
    for (rate, lands) in [(0, false), (1_000, true)] {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.ndjson");
        append(&input, &lines);
        let cfg = config(
            &dir.path().join("state"),
            &format!("http://127.0.0.1:{front}"),
            &format!("min_upload_bytes_per_sec = {rate}\n[batch]\nmax_records = 1000\n"),
            &support::file_source_toml(&input, ""),
        );
        let started = Instant::now();
        let (agent, shutdown) = start(&cfg);
        if lands {
            wait_landed(&stub, lines.len()).await;
            let took = started.elapsed().as_secs_f64();
            let bytes = stub.recorded.lock().unwrap().body_bytes;
            // The test's point: the upload takes longer than the 1 s timeout.
            assert!(
                bytes as f64 / LINK as f64 > 2.0,
                "a {bytes}-byte batch is too small to outlast the timeout"
            );
            assert!(took > 2.0, "landed in {took:.1} s");
        } else {
            tokio::time::sleep(Duration::from_secs(5)).await;
            assert_eq!(stub.landed_total(), 0, "the batch went through in time");
        }
        shutdown.cancel();
        agent.await.unwrap().unwrap();
    }
    assert_eq!(stub.recorded.lock().unwrap().accepted.len(), 1);
}

/// `bytes` in `requests` batches took at least the time a `cap` of bytes per second allows. The
/// bucket starts full (one second's bytes) and the last batch may overdraw it, so at least the
/// bytes beyond those take a second per `cap`.
fn assert_paced(bytes: u64, requests: u64, elapsed: f64, cap: u64) {
    let largest = bytes / requests * 2;
    let floor = bytes.saturating_sub(cap + largest) as f64 / cap as f64;
    assert!(
        floor >= 2.0,
        "the test sends too little to see the cap ({bytes} bytes)"
    );
    assert!(
        elapsed >= floor,
        "{bytes} bytes in {elapsed:.2} s under a {cap} B/s cap (at least {floor:.2} s)"
    );
}

/// The global cap holds end to end over two streams, and under it the stream with the higher
/// priority goes first: while its batches wait, the other stream's do not go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_global_cap_paces_all_streams_and_serves_the_higher_priority_first() {
    const CAP: u64 = 12_000;
    const BATCHES: usize = 10;
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let (low, high) = (
        dir.path().join("low.ndjson"),
        dir.path().join("high.ndjson"),
    );
    let low_lines = noisy_lines("sensor_readings", 50 * BATCHES as u64);
    let high_lines = noisy_lines("vehicle_telemetry", 50 * BATCHES as u64);
    append(&low, &low_lines);
    append(&high, &high_lines);
    let cfg = config_with_root(
        &dir.path().join("state"),
        &stub.url(),
        &format!("max_bytes_per_sec = {CAP}"),
        "[batch]\nmax_records = 50\n\
         [streams.sensor_readings]\npriority = 0\n\
         [streams.vehicle_telemetry]\npriority = 10\n",
        &format!(
            "[[sources]]\ntype = \"file\"\npath = {low:?}\nstream = \"sensor_readings\"\n\
             [[sources]]\ntype = \"file\"\npath = {high:?}\nstream = \"vehicle_telemetry\"\n"
        ),
    );
    let started = Instant::now();
    let (agent, shutdown) = start(&cfg);
    wait_landed(&stub, low_lines.len() + high_lines.len()).await;
    let elapsed = started.elapsed().as_secs_f64();
    let (bytes, arrivals) = {
        let r = stub.recorded.lock().unwrap();
        let streams = r
            .accepted
            .iter()
            .map(|a| a.stream.clone())
            .collect::<Vec<_>>();
        (r.body_bytes, streams)
    };
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    assert_eq!(arrivals.len(), 2 * BATCHES, "one request per batch of 50");
    assert_paced(bytes, arrivals.len() as u64, elapsed, CAP);
    // Priority decides only among streams that wait for the bucket. While the first second's
    // bytes last (about three batches) nobody waits, so either stream may go; after that the
    // high-priority stream goes whenever it waits. Between its first and its last batch, at most
    // the low one's batches of that first second and the one holding the line when the bucket
    // ran dry can go. In arrival order (tickets) the two would alternate: 9 of 10 in between.
    let first_high = arrivals.iter().position(|s| s == "vehicle_telemetry");
    let last_high = arrivals.iter().rposition(|s| s == "vehicle_telemetry");
    let low_between = arrivals[first_high.unwrap()..last_high.unwrap()]
        .iter()
        .filter(|s| *s == "sensor_readings")
        .count();
    assert!(low_between <= 3, "arrival order {arrivals:?}");
}
