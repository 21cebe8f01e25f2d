//! The binaries' logs on stderr (here the agent's, through `plumbing::init_tracing`): plain text
//! without terminal colours when stderr is not a terminal, one JSON object per line with
//! `LOG_FORMAT=json`.

mod support;

use std::process::{Command, Stdio};

/// A config in `dir` reading sensor readings from stdin, its gateway nowhere.
fn stdin_config(dir: &std::path::Path) -> std::path::PathBuf {
    support::write_config(
        dir,
        "http://127.0.0.1:9",
        "",
        "[[sources]]\ntype = \"stdin\"\nstream = \"sensor_readings\"\n",
    )
}

/// Runs the agent on an empty stdin until it ends, with `format` as LOG_FORMAT (none: unset),
/// and returns its stderr.
fn agent_log(format: Option<&str>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let cfg = stdin_config(dir.path());
    let mut command = Command::new(env!("CARGO_BIN_EXE_edge-agent"));
    command
        .args(["run", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "info")
        .env_remove("LOG_FORMAT")
        .stdin(Stdio::null());
    if let Some(format) = format {
        command.env("LOG_FORMAT", format);
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
        other.contains("LOG_FORMAT is neither text nor json"),
        "{other}"
    );
}

/// SIGHUP does not end the agent: it is logged (there is nothing to reload: definitions are
/// read again as records need them), and the agent goes on until its input ends, then stops
/// as usual. Before, SIGHUP's default action ended it at once, without the graceful stop that
/// emits the filters' open windows.
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
    wait_logged("SIGHUP: nothing to reload");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        agent.try_wait().unwrap().is_none(),
        "SIGHUP ended the agent"
    );
    drop(agent.stdin.take());
    assert!(agent.wait().unwrap().success());
    wait_logged("run finished");
}
