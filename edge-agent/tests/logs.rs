//! The binaries' logs on stderr (here the agent's, through `plumbing::init_tracing`): plain text
//! without terminal colours when stderr is not a terminal, one JSON object per line with
//! `LOG_FORMAT=json`.

mod support;

use std::process::{Command, Stdio};

/// Runs the agent on an empty stdin until it ends, with `format` as LOG_FORMAT (none: unset),
/// and returns its stderr.
fn agent_log(format: Option<&str>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::write_config(
        dir.path(),
        "http://127.0.0.1:9",
        "",
        "[[sources]]\ntype = \"stdin\"\nstream = \"sensor_readings\"\n",
    );
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
