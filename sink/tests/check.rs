//! `sink --check`: the shipped config is valid and names the streams it would consume; a
//! selection that matches no stream, a bad store endpoint or a missing CA file is named, with a
//! non-zero exit, and nothing connects. The sink itself refuses a bad endpoint at start.

use crate::common;

/// Runs `sink --check` on `config` (a file) with `env` overrides; returns whether it passed and
/// what it printed.
fn check_file(config: &std::path::Path, env: &[(&str, &str)]) -> (bool, String) {
    let args = ["--check".as_ref(), "--config".as_ref(), config.as_os_str()];
    common::run_from_root(env!("CARGO_BIN_EXE_sink"), &args, env)
}

/// [`check_file`] on the shipped config.
fn check(env: &[(&str, &str)]) -> (bool, String) {
    check_file(std::path::Path::new("config/sink.toml"), env)
}

#[test]
fn the_check_passes_the_shipped_config_and_names_what_is_wrong() {
    let (ok, text) = check(&[]);
    assert!(ok, "{text}");
    assert!(
        text.contains("configuration is valid: streams sensor_readings, vehicle_telemetry"),
        "{text}"
    );
    let (ok, text) = check(&[("SINK_STREAMS", "[\"vehicle_*\"]")]);
    assert!(ok && text.contains("streams vehicle_telemetry"), "{text}");
    let (ok, text) = check(&[("SINK_STREAMS", "[\"nope*\"]")]);
    assert!(!ok && text.contains("'nope*' selects none"), "{text}");
    // An S3 store instead of the shipped local one.
    let dir = tempfile::tempdir().unwrap();
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/sink.toml");
    let shipped = std::fs::read_to_string(shipped).unwrap();
    let local = "type = \"local\"\npath = \"landing\"\n";
    assert!(shipped.contains(local));
    let s3 = |more: &str| {
        let path = dir.path().join(format!("sink-{}.toml", more.len()));
        let store = format!("type = \"s3\"\nbucket = \"landing\"\n{more}\n");
        std::fs::write(&path, shipped.replace(local, &store)).unwrap();
        check_file(&path, &[])
    };
    let (ok, text) = s3("endpoint = \"http://127.0.0.1:9000\"\nforce_path_style = true");
    assert!(ok, "{text}");
    let cases = [
        ("endpoint = \"minio:9000\"", "give http://host:port"),
        ("ca_file = \"/nonexistent/ca.pem\"", "/nonexistent/ca.pem"),
        (
            "storage_class = \"COLD\"",
            "store.storage_class = \"COLD\" is not one of",
        ),
    ];
    for (more, expected) in cases {
        let (ok, text) = s3(more);
        assert!(!ok && text.contains(expected), "{more}: {text}");
    }
    // The sink itself refuses the endpoint at start too, before it connects to anything
    // (before, the error came with the first upload).
    let bad = dir.path().join("sink-bad-endpoint.toml");
    let store = "type = \"s3\"\nbucket = \"landing\"\nendpoint = \"minio:9000\"\n";
    std::fs::write(&bad, shipped.replace(local, store)).unwrap();
    // Under timeout(1), since a sink that took the endpoint would run on (and fail the assertion).
    let sink = env!("CARGO_BIN_EXE_sink");
    let args = [
        "20".as_ref(),
        sink.as_ref(),
        "--config".as_ref(),
        bad.as_os_str(),
    ];
    let (ok, text) = common::run_from_root("timeout", &args, &[]);
    assert!(!ok && text.contains("give http://host:port"), "{text}");
}

/// The sink's Kafka password comes from a file and shows nowhere: not in `--check`'s output,
/// nor in its log (debug) through a start, a login Kafka refuses (the suite's broker takes no SASL login), a
/// SIGHUP reload and a stop.
#[test]
fn the_kafka_password_comes_from_a_file_and_never_shows() {
    const SECRET: &str = "sink-pw-0c71e9a4";
    let brokers = common::service_env("EDGE_INGEST_KAFKA");
    let dir = tempfile::tempdir().unwrap();
    let password = dir.path().join("kafka-password");
    std::fs::write(&password, format!("{SECRET}\n")).unwrap();
    let config = dir.path().join("sink.toml");
    std::fs::write(
        &config,
        format!(
            "streams_dir = {streams:?}\nadmin_listen = \"127.0.0.1:{admin}\"\n\
             [kafka]\nbrokers = \"{brokers}\"\ngroup_id = \"secret-{id}\"\n\
             sasl = {{ mechanism = \"SCRAM-SHA-512\", username = \"u\", password_file = {password:?} }}\n\
             [store]\ntype = \"local\"\npath = {landing:?}\n",
            streams = common::repo_root().join("streams"),
            admin = common::free_port(),
            id = common::unique_id(),
            landing = dir.path().join("landing"),
        ),
    )
    .unwrap();
    let (passed, printed) = check_file(&config, &[]);
    assert!(passed, "{printed}");
    assert!(!printed.contains(SECRET), "{printed}");

    let log = dir.path().join("sink.log");
    let mut sink = std::process::Command::new(env!("CARGO_BIN_EXE_sink"))
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "debug")
        .stdout(std::fs::File::create(dir.path().join("sink.out")).unwrap())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let logged = |text: &str| std::fs::read_to_string(&log).unwrap().contains(text);
    let wait = |text: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !logged(text) {
            assert!(
                std::time::Instant::now() < deadline,
                "no '{text}' in the log:\n{}",
                std::fs::read_to_string(&log).unwrap()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    wait("sink started");
    wait("Authentication");
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &sink.id().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    wait("SIGHUP: reloaded the config");
    sink.kill().unwrap();
    sink.wait().unwrap();
    let printed = std::fs::read_to_string(&log).unwrap()
        + &std::fs::read_to_string(dir.path().join("sink.out")).unwrap();
    assert!(
        !printed.contains(SECRET),
        "the sink printed its password:\n{printed}"
    );
}

/// Kubernetes sets `SINK_PORT=tcp://…`, `SINK_SERVICE_HOST` and more in every pod of a namespace
/// with a Service named `sink`: they name no key and are left out. A variable that names a key
/// with a value that does not fit is a configuration error, exit code 2.
#[test]
fn kubernetes_service_variables_do_not_stop_the_sink() {
    let (ok, text) = check(&common::kubernetes_service_variables("sink", 9102));
    assert!(ok, "{text}");
    let args = ["--check", "--config", "config/sink.toml"].map(std::ffi::OsStr::new);
    let (code, text) = common::exit_code_from_root(
        env!("CARGO_BIN_EXE_sink"),
        &args,
        &[("SINK_ADMIN_LISTEN", "tcp://10.96.0.12:9102")],
    );
    assert_eq!(code, Some(2), "{text}");
    assert!(text.to_lowercase().contains("admin_listen"), "{text}");
}
