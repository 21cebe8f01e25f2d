//! `edge-agent status` (and the admin port's `/status`) while the agent runs: what waits in the
//! spool for a gateway that answers 503, and nothing once it takes the batches; the file
//! source's read position.

use crate::support;

use std::time::{Duration, Instant};

use support::{
    Faults, Stub, assert_exactly_once, config_with_root, file_source_toml, free_port, readings,
    start, wait_landed,
};

/// The status of the agent configured in `cfg` (a file), from the edge-agent binary.
fn status_json(cfg: &std::path::Path) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["status", "--json", "--config"])
        .arg(cfg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn waiting(status: &serde_json::Value) -> (u64, u64) {
    let spool = &status["streams"][0]["spool"];
    (
        spool["batches"].as_u64().unwrap(),
        spool["records"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_what_waits_while_the_agent_runs() {
    let stub = Stub::start(Faults {
        unavailable: 100,
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (lines, expected) = readings(500, 5, 0, 47);
    let input = dir.path().join("r.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let cfg_path = dir.path().join("agent.toml");
    let admin = format!("127.0.0.1:{}", free_port());
    let cfg = config_with_root(
        &dir.path().join("state"),
        &stub.url(),
        &format!("admin_listen = \"{admin}\""),
        "[batch]\nmax_records = 100\n",
        &file_source_toml(&input, "follow = true\n"),
    );
    std::fs::write(&cfg_path, &cfg).unwrap();
    let (agent, shutdown) = start(&cfg);

    // Every reading spooled in 5 batches, none delivered, and the read position saved (every
    // second).
    let size = std::fs::metadata(&input).unwrap().len();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        let status = status_json(&cfg_path);
        if waiting(&status) == (5, 500) && status["files"][0]["read_bytes"] == size {
            break status;
        }
        assert!(Instant::now() < deadline, "never spooled: {status:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(stub.landed_total(), 0);
    let stream = &status["streams"][0];
    assert_eq!(stream["stream"], "sensor_readings");
    assert_eq!(stream["rejected_batches"], 0);
    let oldest = stream["spool"]["oldest_created_ms"].as_u64().unwrap();
    assert!(oldest <= status["now_ms"].as_u64().unwrap());
    assert!(status["spool_bytes"].as_u64().unwrap() > 0);
    let file = &status["files"][0];
    assert_eq!(file["path"], input.to_str().unwrap());
    assert_eq!(file["read_bytes"], size);
    assert_eq!(file["size_bytes"], size);

    // The same from the admin port, for tooling where no Prometheus scrapes the box.
    let remote = reqwest::get(format!("http://{admin}/status"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let remote: serde_json::Value = serde_json::from_slice(&remote).unwrap();
    assert_eq!(waiting(&remote), (5, 500), "{remote:#}");
    assert_eq!(remote["files"], status["files"]);

    // The table names the stream and its waiting records.
    let table = std::process::Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["status", "--config"])
        .arg(&cfg_path)
        .output()
        .unwrap();
    let table = String::from_utf8(table.stdout).unwrap();
    let row = table
        .lines()
        .find(|l| l.starts_with("sensor_readings"))
        .unwrap_or_else(|| panic!("no stream row:\n{table}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[1..3], ["5", "500"], "{table}");

    stub.set_faults(Faults::default());
    wait_landed(&stub, expected.len()).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while waiting(&status_json(&cfg_path)) != (0, 0) {
        assert!(
            Instant::now() < deadline,
            "delivered batches still shown as waiting"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    assert_exactly_once(&stub.landed(), &expected);
}

/// A swinging-door filter's reduction report, in `/status` and `edge-agent status` while the
/// agent runs and after it stops: readings in, readings kept (what the gateway got), the band
/// and the largest deviation of a dropped reading, within it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_what_the_filters_reduced() {
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    // A slow oscillation with a little noise, a reading a second.
    let lines: Vec<String> = (0..2_000)
        .map(|i| {
            let noise = if i % 2 == 0 { 0.05 } else { -0.05 };
            serde_json::json!({
                "device_id": "d1",
                "sensor": "temp",
                "ts": 1_700_000_000_000i64 + i * 1_000,
                "value": 20.0 + 5.0 * (i as f64 / 100.0).sin() + noise,
            })
            .to_string()
        })
        .collect();
    let (cfg_path, admin, cfg) = filtered_agent(
        dir.path(),
        &stub.url(),
        &lines,
        "type = \"swinging_door\"\nfield = \"value\"\nabsolute = 0.5\n",
    );
    let (agent, shutdown) = start(&cfg);

    let reduction =
        |status: &serde_json::Value| status["streams"][0]["reduction"]["filters"][0].clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    let report = loop {
        // (The admin port opens once the agent is up.)
        let remote = match reqwest::get(format!("http://{admin}/status")).await {
            Ok(answer) => serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap(),
            Err(_) => serde_json::Value::Null,
        };
        let r = reduction(&remote);
        if r["readings_in"] == 2_000 && r["kept"].as_u64() == Some(stub.landed_total() as u64) {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "no report of every reading ({} landed; state: {:?}): {remote:#}",
            stub.landed_total(),
            std::fs::read_dir(dir.path().join("state"))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(report["filter"], "swinging_door");
    assert_eq!(report["band"], 0.5);
    let kept = report["kept"].as_u64().unwrap();
    assert!((2..200).contains(&kept), "kept {kept} of 2,000");
    let deviation = report["max_deviation"].as_f64().unwrap();
    assert!(deviation > 0.0 && deviation <= 0.5, "{deviation}");
    // The same from the state directory (written at most once a second), and in the table.
    let deadline = Instant::now() + Duration::from_secs(5);
    while reduction(&status_json(&cfg_path)) != report {
        assert!(
            Instant::now() < deadline,
            "{:#} is not {report:#}",
            reduction(&status_json(&cfg_path))
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let table = std::process::Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["status", "--config"])
        .arg(&cfg_path)
        .output()
        .unwrap();
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(
        table.contains(&format!(
            "filter swinging_door: 2000 readings in, {kept} kept ({:.1}%); largest deviation {deviation} of band 0.5",
            100.0 * kept as f64 / 2000.0
        )),
        "{table}"
    );

    // Stopped, the series' held last reading is sent, and the report says so.
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    let last = reduction(&status_json(&cfg_path));
    assert_eq!(last["kept"], kept + 1, "{last:#}");
}

/// The status page on the admin port, in headless Chromium (`EDGE_INGEST_CHROMIUM`), against a
/// running agent: while the gateway answers 503 (the link retrying, the batches in the spool)
/// and after it took them (bytes on the wire), every number the page shows is the one
/// `/status` gives, and the page's screenshot is kept under the target directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_what_status_says() {
    let chromium = std::env::var("EDGE_INGEST_CHROMIUM").expect(
        "EDGE_INGEST_CHROMIUM is not set: run the suite with scripts/test.sh, which installs Chromium",
    );
    let stub = Stub::start(Faults {
        unavailable: u32::MAX,
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (mut lines, expected) = readings(900, 6, 9, 11);
    lines.insert(100, "not a reading".into());
    let (_, admin, cfg) = filtered_agent(
        dir.path(),
        &stub.url(),
        &lines,
        "type = \"deadband\"\nfield = \"value\"\nabsolute = 30.0\nsend_previous = false\n",
    );
    let (agent, shutdown) = start(&cfg);
    let status = || async {
        match reqwest::get(format!("http://{admin}/status")).await {
            Ok(answer) => serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap(),
            Err(_) => serde_json::Value::Null,
        }
    };
    // Every line read, the link in the state wanted, and the counters as they were half a
    // second before (the filters and batches have caught up).
    let counters = |s: &serde_json::Value| {
        let stream = &s["streams"][0];
        (
            stream["live"]["pipeline"].clone(),
            stream["live"]["delivery"].clone(),
            stream["reduction"].clone(),
            stream["spool"]["records"].clone(),
        )
    };
    let total = lines.len();
    let wait_for = |link: &'static str| async move {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut before = None;
        loop {
            let s = status().await;
            let stream = &s["streams"][0];
            let now = counters(&s);
            if stream["live"]["pipeline"]["read"] == total
                && stream["live"]["link"] == link
                && before.as_ref() == Some(&now)
            {
                return s;
            }
            before = Some(now);
            assert!(Instant::now() < deadline, "never settled ({link}): {s:#}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };

    let down = wait_for("retrying").await;
    let stream = &down["streams"][0];
    assert!(stream["spool"]["batches"].as_u64().unwrap() > 0, "{down:#}");
    assert_eq!(stream["live"]["last_error"]["kind"], "5xx");
    assert_eq!(stream["live"]["pipeline"]["invalid"], 1);
    assert!(stream["live"]["pipeline"]["duplicates"].as_u64().unwrap() > 0);
    assert!(
        stream["live"]["pipeline"]["filtered"].as_u64().unwrap() > 0,
        "{down:#}"
    );
    let page = render(&chromium, &admin, dir.path(), None);
    assert_page_matches(&page, &status().await, 14);

    stub.set_faults(Faults::default());
    let up = wait_for("up").await;
    let stream = &up["streams"][0];
    assert_eq!(stream["spool"]["batches"], 0, "{up:#}");
    assert!(stream["live"]["delivery"]["wire_bytes"].as_u64().unwrap() > 0);
    assert_eq!(
        stream["live"]["delivery"]["records"],
        stub.landed_total() as u64
    );
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("agent-status-page.png");
    let page = render(&chromium, &admin, dir.path(), Some(&shot));
    assert_page_matches(&page, &status().await, 14);
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    eprintln!("status page screenshot: {}", shot.display());
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    assert!(stub.landed_total() < expected.len());
}

/// The page at `admin` as headless Chromium leaves it once its script ran: its DOM, and with
/// `screenshot`, a picture of it there.
fn render(
    chromium: &str,
    admin: &str,
    dir: &std::path::Path,
    screenshot: Option<&std::path::Path>,
) -> String {
    let profile = tempfile::tempdir_in(dir).unwrap();
    let mut command = std::process::Command::new(chromium);
    command
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--window-size=1500,520",
            "--virtual-time-budget=3000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()));
    match screenshot {
        Some(path) => {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let _ = std::fs::remove_file(path);
            command.arg(format!("--screenshot={}", path.display()));
        }
        None => {
            command.arg("--dump-dom");
        }
    }
    let out = command.arg(format!("http://{admin}/")).output().unwrap();
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if screenshot.is_some() {
        // The screenshot run prints no DOM: read it again for the numbers.
        return render(chromium, admin, dir, None);
    }
    String::from_utf8(out.stdout).unwrap()
}

/// Every cell of the page that names a `/status` value (`data-field`, a path in the stream's
/// object) shows that value, and there are at least `cells` of them.
fn assert_page_matches(page: &str, status: &serde_json::Value, cells: usize) {
    let attr = |tag: &str, name: &str| -> Option<String> {
        let start = tag.find(&format!("{name}=\""))? + name.len() + 2;
        let end = tag[start..].find('"')? + start;
        Some(
            tag[start..end]
                .replace("&amp;", "&")
                .replace("&quot;", "\""),
        )
    };
    let mut checked = 0;
    for tag in page.split("<td").skip(1) {
        let tag = &tag[..tag.find('>').unwrap_or(tag.len())];
        let (Some(stream), Some(field), Some(shown)) = (
            attr(tag, "data-stream"),
            attr(tag, "data-field"),
            attr(tag, "data-value"),
        ) else {
            continue;
        };
        let of_stream = status["streams"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["stream"] == stream.as_str())
            .unwrap_or_else(|| panic!("the page shows stream {stream}, /status does not"));
        let mut value = of_stream;
        for key in field.split('.') {
            value = match key.parse::<usize>() {
                Ok(i) => &value[i],
                Err(_) => &value[key],
            };
        }
        let expected = match value {
            serde_json::Value::Null => String::new(),
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let same = shown == expected
            || matches!((shown.parse::<f64>(), expected.parse::<f64>()), (Ok(a), Ok(b)) if a == b);
        assert!(
            same,
            "{stream} {field}: the page shows {shown:?}, /status {expected:?}"
        );
        checked += 1;
    }
    assert!(
        checked >= cells,
        "only {checked} cells with values on the page:\n{page}"
    );
}

/// An agent following `lines` (written to a file in `dir`) with one filter of `filter` (the
/// keys of its table), batches of 100 records at most 200 ms old, and an admin port: its
/// config file, the admin address and the config.
fn filtered_agent(
    dir: &std::path::Path,
    gateway: &str,
    lines: &[String],
    filter: &str,
) -> (std::path::PathBuf, String, String) {
    let input = dir.join("r.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let admin = format!("127.0.0.1:{}", free_port());
    let cfg = config_with_root(
        &dir.join("state"),
        gateway,
        &format!("admin_listen = \"{admin}\""),
        &format!(
            "[batch]\nmax_records = 100\nmax_age_ms = 200\n\
             [[streams.sensor_readings.filters]]\n{filter}"
        ),
        &file_source_toml(&input, "follow = true\n"),
    );
    let cfg_path = dir.join("agent.toml");
    std::fs::write(&cfg_path, &cfg).unwrap();
    (cfg_path, admin, cfg)
}
