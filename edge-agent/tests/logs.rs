//! The binaries' logs on stderr (here the agent's, through `service_kit::init_tracing`): plain text
//! without terminal colours when stderr is not a terminal, one JSON object per line with
//! `EDGE_AGENT_LOG_FORMAT=json`, a fatal error too. The environment: Kubernetes' variables for
//! a Service named `edge-agent` do not stop it. And the agent's SIGHUP, which reloads its config.

use crate::support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{
    Stub, assert_exactly_once, config_with_root, file_source_toml, free_port, readings,
    sigterm_and_wait, spawn_agent, wait_landed,
};

/// A config in `dir` reading sensor readings from stdin, its gateway nowhere.
fn stdin_config(dir: &std::path::Path) -> std::path::PathBuf {
    support::write_config(
        dir,
        "http://127.0.0.1:9",
        "",
        "[[sources]]\ntype = \"stdin\"\nstream = \"sensor_readings\"\n",
    )
}

/// Runs the agent on an empty stdin until it ends, with `format` as EDGE_AGENT_LOG_FORMAT (none:
/// unset), and returns its stderr.
fn agent_log(format: Option<&str>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let cfg = stdin_config(dir.path());
    let mut command = Command::new(env!("CARGO_BIN_EXE_edge-agent"));
    command
        .args(["run", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "info")
        .env_remove("EDGE_AGENT_LOG_FORMAT")
        .stdin(Stdio::null());
    if let Some(format) = format {
        command.env("EDGE_AGENT_LOG_FORMAT", format);
    }
    let out = command.output().unwrap();
    let log = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "{log}");
    log
}

#[test]
fn logs_are_plain_text_off_a_terminal_and_json_lines_on_request() {
    let text = agent_log(None);
    assert!(text.contains("stream ready"), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "colour codes in a log file:\n{text}"
    );

    let json = agent_log(Some("json"));
    let lines: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let ready = lines
        .iter()
        .find(|l| l["fields"]["message"] == "stream ready")
        .unwrap_or_else(|| panic!("no 'stream ready' line:\n{json}"));
    assert_eq!(ready["level"], "INFO");
    assert_eq!(ready["fields"]["stream"], "sensor_readings");
    let finished = lines.last().unwrap();
    assert_eq!(finished["fields"]["message"], "run finished", "{json}");
    assert_eq!(finished["fields"]["read"], 0);

    let other = agent_log(Some("xml"));
    assert!(
        other.contains("EDGE_AGENT_LOG_FORMAT is neither text nor json"),
        "{other}"
    );
}

/// Kubernetes' variables for a Service named `edge-agent` (`EDGE_AGENT_PORT=tcp://…` and the
/// rest) name no key of the agent's: it starts and runs. A variable that names a key with a
/// value that does not fit stops it with a configuration error (exit code 2), one JSON object
/// with JSON logs; a run that ends well exits with 0.
#[test]
fn kubernetes_service_variables_do_not_stop_the_agent_and_a_fatal_error_is_json() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = stdin_config(dir.path());
    let run = |env: &[(&str, &str)]| {
        Command::new(env!("CARGO_BIN_EXE_edge-agent"))
            .args(["run", "--config"])
            .arg(&cfg)
            .env("EDGE_AGENT_LOG_FORMAT", "json")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = run(&support::kubernetes_service_variables("edge-agent", 9103));
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = run(&[("EDGE_AGENT_MAX_BYTES_PER_SEC", "fast")]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let log = String::from_utf8(out.stderr).unwrap();
    let fatal: serde_json::Value = serde_json::from_str(log.trim()).expect(&log);
    assert_eq!(fatal["level"], "ERROR", "{log}");
    assert_eq!(fatal["fields"]["exit_code"], 2, "{log}");
    let error = fatal["fields"]["error"].as_str().unwrap();
    assert!(error.to_lowercase().contains("max_bytes_per_sec"), "{log}");
}

/// SIGHUP does not end an agent that reads stdin, nor reload it (lines read but not yet spooled
/// would be lost between two runs): it is logged, and the agent goes on until its input ends,
/// then stops as usual. Before, SIGHUP's default action ended it at once, without the graceful
/// stop that emits the filters' open windows.
#[test]
fn sighup_is_logged_and_does_not_end_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = stdin_config(dir.path());
    let mut agent = support::spawn_agent_with(&cfg, dir.path(), 0, Stdio::piped(), "info");
    let log = dir.path().join("agent-0.log");
    let wait_logged = |text: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !std::fs::read_to_string(&log).unwrap().contains(text) {
            assert!(
                std::time::Instant::now() < deadline,
                "no '{text}' in the log"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    wait_logged("stream ready");
    let status = Command::new("kill")
        .args(["-HUP", &agent.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    wait_logged("SIGHUP: config not reloaded: the agent reads stdin");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        agent.try_wait().unwrap().is_none(),
        "SIGHUP ended the agent"
    );
    drop(agent.stdin.take());
    assert!(agent.wait().unwrap().success());
    wait_logged("run finished");
}

/// Waits until `log` holds `text` `times` times (20 s at most).
fn wait_logged_times(log: &std::path::Path, text: &str, times: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let found = std::fs::read_to_string(log).unwrap().matches(text).count();
        if found >= times {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "'{text}' {found} times in the log, not {times}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of the agent's reload gauge on its admin port.
async fn reload_gauge(admin: u16) -> String {
    let text = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("edge_agent_config_last_reload_successful "))
        .unwrap_or_else(|| panic!("no reload gauge in:\n{text}"))
        .to_owned()
}

/// SIGHUP reloads the config file. One that does not load (an unknown key), or that moves the
/// state directory, is refused: the agent runs on with the config it has, says why and sets its
/// reload gauge to 0. One that
/// checks takes effect in the same process (same PID, not ended): here it adds a second file
/// source and a smaller batch size. The first file's reading goes on from its saved position,
/// so every reading of both files lands exactly once, also through a burst of SIGHUPs (reloads
/// one after the other; a SIGHUP that reaches a new run while it starts is ignored, where its
/// default action would end the process). Before, SIGHUP was only logged and a
/// config change took a restart, which a config that does not check leaves stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_a_config_that_checks_and_refuses_one_that_does_not() {
    let stub = Stub::start(support::Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (dir.path().join("a.ndjson"), dir.path().join("b.ndjson"));
    let (lines, expected) = readings(900, 7, 0, 61);
    let write = |path: &std::path::Path, lines: &[String]| {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        file.write_all((lines.join("\n") + "\n").as_bytes())
            .unwrap();
    };
    write(&first, &lines[..300]);
    write(&second, &lines[300..500]);
    let admin = free_port();
    let config_in = |state: &str, batch: &str, sources: &str| {
        config_with_root(
            &dir.path().join(state),
            &stub.url(),
            &format!("admin_listen = \"127.0.0.1:{admin}\""),
            &format!("[batch]\nmax_age_ms = 100\n{batch}"),
            sources,
        )
    };
    let config = |batch: &str, sources: &str| config_in("state", batch, sources);
    let cfg = dir.path().join("agent.toml");
    let only_first = file_source_toml(&first, "follow = true\npoll_ms = 50\n");
    std::fs::write(&cfg, config("", &only_first)).unwrap();
    let mut agent = spawn_agent(&cfg, dir.path(), 0);
    let log = dir.path().join("agent-0.log");
    wait_landed(&stub, 300).await;
    let hangup = |agent: &std::process::Child| {
        let status = Command::new("kill")
            .args(["-HUP", &agent.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };

    // A config that does not load: refused, the agent runs on as it was.
    std::fs::write(&cfg, format!("bogus = 1\n{}", config("", &only_first))).unwrap();
    hangup(&agent);
    wait_logged_times(&log, "config not reloaded: it does not load or check", 1);
    assert!(
        std::fs::read_to_string(&log).unwrap().contains("bogus"),
        "the log does not say what is wrong"
    );
    assert_eq!(reload_gauge(admin).await, "0");
    // Nor may a reload move the state directory (the files would be read again from the start).
    std::fs::write(&cfg, config_in("elsewhere", "", &only_first)).unwrap();
    hangup(&agent);
    wait_logged_times(&log, "state_dir cannot change at a reload", 1);
    write(&first, &lines[500..600]);
    wait_landed(&stub, 400).await;
    assert!(agent.try_wait().unwrap().is_none(), "the agent ended");
    assert_eq!(
        stub.landed_total(),
        400,
        "the second file is read before its config is"
    );

    // A config that checks: a second source and smaller batches, in the same process.
    let both = format!(
        "{only_first}{}",
        file_source_toml(&second, "follow = true\npoll_ms = 50\n")
    );
    std::fs::write(&cfg, config("max_records = 50\n", &both)).unwrap();
    let batches_before = stub.recorded.lock().unwrap().accepted.len();
    hangup(&agent);
    wait_logged_times(&log, "starting again on the reloaded config", 1);
    // The new run's stream is ready: the old one's was logged once.
    wait_logged_times(&log, "stream ready", 2);
    wait_landed(&stub, 600).await;
    write(&first, &lines[600..750]);
    write(&second, &lines[750..800]);
    wait_landed(&stub, 800).await;

    // A burst of SIGHUPs: reloads one after the other, some of the signals arriving while a
    // new run starts, none of which may end the process.
    for _ in 0..20 {
        hangup(&agent);
        std::thread::sleep(Duration::from_millis(3));
    }
    std::thread::sleep(Duration::from_millis(500));
    if let Some(status) = agent.try_wait().unwrap() {
        panic!("a SIGHUP of the burst ended the agent: {status}");
    }
    write(&second, &lines[800..]);
    wait_landed(&stub, 900).await;
    assert!(
        agent.try_wait().unwrap().is_none(),
        "the reload ended the process"
    );
    assert_eq!(reload_gauge(admin).await, "1");
    let sizes: Vec<usize> = (stub.recorded.lock().unwrap().accepted.iter())
        .map(|a| a.records.len())
        .collect();
    assert!(sizes[0] > 50, "batch sizes {sizes:?}");
    assert!(
        sizes[batches_before..].iter().all(|&n| n <= 50),
        "batches after the reload are not of the new size: {sizes:?}"
    );
    sigterm_and_wait(
        &mut agent,
        Duration::from_secs(20),
        "after a reload",
        (dir.path(), 0),
    )
    .await;
    assert_exactly_once(&stub.landed(), &expected);
    let log = std::fs::read_to_string(&log).unwrap();
    let runs = log.matches("run finished").count();
    assert!(runs >= 3, "{runs} runs: {log}");
    assert_eq!(
        log.matches("starting again on the reloaded config").count(),
        runs - 1,
        "{log}"
    );
}

/// Writes `dir/agent.toml`: state in `dir/state`, a gateway that is not there, `root` and
/// `gateway` settings and `sources`.
fn unreachable_gateway_config(
    dir: &std::path::Path,
    root: &str,
    gateway: &str,
    sources: &str,
) -> std::path::PathBuf {
    let cfg = dir.join("agent.toml");
    let text = config_with_root(
        &dir.join("state"),
        "http://127.0.0.1:9",
        root,
        gateway,
        sources,
    );
    std::fs::write(&cfg, text).unwrap();
    cfg
}

/// A SIGTERM that comes while a reload starts the agent again (between its exec and the new run
/// listening) stops the new run as any SIGTERM does: it waits, blocked, instead of ending the
/// process at once by the signal's default action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_during_a_reload_stops_the_new_run_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let readings = dir.path().join("readings.ndjson");
    std::fs::write(&readings, "").unwrap();
    let cfg = unreachable_gateway_config(
        dir.path(),
        "",
        "",
        &file_source_toml(&readings, "follow = true\npoll_ms = 50"),
    );
    let mut agent = support::spawn_agent_with(&cfg, dir.path(), 0, Stdio::null(), "info");
    let log = dir.path().join("agent-0.log");
    wait_logged_times(&log, "stream ready", 1);
    let signal = |name: &str, pid: u32| {
        let status = Command::new("kill")
            .args([name, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    signal("-HUP", agent.id());
    // The SIGTERM goes as soon as the old run says it starts again: the exec follows at once,
    // and the new run takes milliseconds to listen.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&log)
        .unwrap()
        .contains("starting again on the reloaded config")
    {
        assert!(Instant::now() < deadline, "no reload");
        std::thread::sleep(Duration::from_millis(1));
    }
    signal("-TERM", agent.id());
    let status = tokio::task::spawn_blocking(move || agent.wait().unwrap())
        .await
        .unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{status}: {text}");
    assert_eq!(text.matches("run finished").count(), 2, "{text}");
}

/// The agent's secrets (its gateway token, an MQTT login's password, its local port's token)
/// come from files, and none shows in what it prints: `check`'s output, a config that does not
/// check, its log (debug) through a start, failing deliveries and MQTT connections, a SIGHUP
/// reload and a stop, nor its metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_come_from_files_and_never_show() {
    const SECRETS: [&str; 3] = ["gw-9f3a1c77", "mq-41bd02e5", "lp-c4d2a8f1"];
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, secret: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("{secret}\n")).unwrap();
        path
    };
    let (gateway_token, mqtt_password, port_token) = (
        file("gateway-token", SECRETS[0]),
        file("mqtt-password", SECRETS[1]),
        file("port-token", SECRETS[2]),
    );
    let (port, admin) = (free_port(), free_port());
    let readings = dir.path().join("readings.ndjson");
    std::fs::write(&readings, "").unwrap();
    let sources = format!(
        "{}\n[[sources]]\ntype = \"mqtt\"\nurl = \"mqtt://127.0.0.1:9\"\ntopics = [\"t\"]\n\
         stream = \"sensor_readings\"\nusername = \"u\"\npassword_file = {mqtt_password:?}\n\
         [[sources]]\ntype = \"http\"\nlisten = \"127.0.0.1:{port}\"\ntoken_file = {port_token:?}\n",
        file_source_toml(&readings, "follow = true\npoll_ms = 50"),
    );
    let cfg = unreachable_gateway_config(
        dir.path(),
        &format!("admin_listen = \"127.0.0.1:{admin}\""),
        &format!("token_file = {gateway_token:?}"),
        &sources,
    );
    let shown = |what: &str, text: &str| {
        for secret in SECRETS {
            assert!(!text.contains(secret), "{what} shows {secret}:\n{text}");
        }
    };

    let check = Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(check.status.success(), "{check:?}");
    shown("check", &format!("{check:?}"));
    // A secret given twice is refused, naming the setting, not the value.
    let twice = dir.path().join("twice.toml");
    std::fs::write(
        &twice,
        std::fs::read_to_string(&cfg).unwrap().replace(
            "token_file = ",
            &format!("token = \"{}\"\ntoken_file = ", SECRETS[0]),
        ),
    )
    .unwrap();
    let refused = Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["check", "--config"])
        .arg(&twice)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let refusal = String::from_utf8_lossy(&refused.stderr);
    assert!(refusal.contains("gateway.token_file"), "{refusal}");
    shown("a refused config", &refusal);

    let mut agent = support::spawn_agent_with(&cfg, dir.path(), 0, Stdio::null(), "debug");
    let log = dir.path().join("agent-0.log");
    wait_logged_times(&log, "stream ready", 1);
    // The local port checks its token: a wrong one is refused, the right one taken.
    let url = format!("http://127.0.0.1:{port}/v1/streams/sensor_readings/records");
    let client = reqwest::Client::new();
    let post = |token: &'static str| {
        client
            .post(&url)
            .bearer_auth(token)
            .header("content-type", "application/x-ndjson")
            .body(r#"{"device_id":"d","sensor":"t","ts":1767225600000,"value":1.5}"#)
            .send()
    };
    assert_eq!(post("wrong").await.unwrap().status(), 401);
    assert_eq!(post(SECRETS[2]).await.unwrap().status(), 200);
    // Deliveries to a gateway that is not there fail and are logged.
    wait_logged_times(&log, "127.0.0.1:9", 2);
    let metrics = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    shown("/metrics", &metrics);
    let served = reqwest::get(format!("http://127.0.0.1:{admin}/status"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(served.contains("sensor_readings"), "{served}");
    shown("/status", &served);
    for json in [false, true] {
        let mut status = Command::new(env!("CARGO_BIN_EXE_edge-agent"));
        status.args(["status", "--config"]).arg(&cfg);
        if json {
            status.arg("--json");
        }
        let out = status.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        shown("edge-agent status", &format!("{out:?}"));
    }
    let status = Command::new("kill")
        .args(["-HUP", &agent.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    wait_logged_times(&log, "starting again on the reloaded config", 1);
    // Both streams of the new run are ready (the first run's were logged twice too).
    wait_logged_times(&log, "stream ready", 4);
    sigterm_and_wait(
        &mut agent,
        Duration::from_secs(30),
        "stopping",
        (dir.path(), 0),
    )
    .await;
    shown("the log", &std::fs::read_to_string(&log).unwrap());
}

/// `hash-token` takes the token on its standard input (so that it shows in no process list),
/// or as its argument, and prints the BLAKE3 hash the gateway's `auth.tokens` take.
#[test]
fn hash_token_reads_the_token_from_standard_input() {
    use std::io::Write as _;
    let expected = blake3::hash(b"tok-3b1f").to_hex().to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .arg("hash-token")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"tok-3b1f\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), expected);
    let out = Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["hash-token", "tok-3b1f"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), expected);
    let empty = Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .arg("hash-token")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!empty.status.success(), "an empty token is refused");
}
