//! Config files (TOML) with environment overrides, and the stream definition directory.

pub mod secret;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use figment::Figment;
use figment::providers::{Env, Format, Toml};
use schemas::dictionary::ZstdDictionary;
use schemas::{Change, StreamDef, Streams};
use serde::de::DeserializeOwned;

/// An error of the configuration (a file, an environment override, a stream definition or a
/// file they name): the process exits with [`crate::process::EXIT_CONFIG`]. It reads as the
/// error it wraps.
pub struct ConfigError(anyhow::Error);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl std::fmt::Debug for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.0, f)
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Marks `error` as a configuration error ([`ConfigError`]).
pub fn invalid(error: anyhow::Error) -> anyhow::Error {
    anyhow::Error::new(ConfigError(error))
}

/// Loads a config: defaults, then the TOML file (if given), then environment variables that start
/// with `env_prefix`. Nested keys are separated by `__`, e.g. `INGEST_GATEWAY_KAFKA__BROKERS`.
///
/// Unknown keys in the file are errors (the config types deny them). The environment holds
/// variables set for other programs, some with our prefix: Kubernetes sets `SINK_PORT`,
/// `SINK_SERVICE_HOST` and more for a Service named `sink`. So a variable is read only when it
/// names a key: one that names none is left out with a warning (Kubernetes' Service variables
/// without one), and one that names a key with a value that does not fit is an error.
/// `<prefix>LOG_FORMAT` is read before the config ([`crate::telemetry::init_tracing`]).
pub fn load_config<T: DeserializeOwned>(
    file: Option<&Path>,
    env_prefix: &str,
) -> anyhow::Result<T> {
    load_config_inner(file, env_prefix).map_err(invalid)
}

fn load_config_inner<T: DeserializeOwned>(
    file: Option<&Path>,
    env_prefix: &str,
) -> anyhow::Result<T> {
    let mut base = Figment::new();
    if let Some(file) = file {
        if !file.is_file() {
            bail!("config file {} does not exist", file.display());
        }
        base = base.merge(Toml::file_exact(file));
    }
    // Dotted keys (`kafka.brokers`), as the environment provider names them.
    let mut left_out: Vec<String> = vec![crate::telemetry::LOG_FORMAT.to_ascii_lowercase()];
    let reserved = left_out.len();
    // Each round leaves out the variables the last one found naming no key; serde reports the
    // first unknown field of a table, so a few rounds may be needed.
    loop {
        let keys: Vec<&str> = left_out.iter().map(String::as_str).collect();
        let env = Env::prefixed(env_prefix).split("__").ignore(&keys);
        let errors = match base.clone().merge(env).extract::<T>() {
            Ok(config) => {
                for key in &left_out[reserved..] {
                    let variable = format!("{env_prefix}{}", key.replace('.', "__").to_uppercase());
                    if is_kubernetes_service_variable(key) {
                        tracing::debug!(%variable, "left out a Kubernetes Service variable");
                    } else {
                        tracing::warn!(%variable, "the environment variable names no configuration key; it is left out");
                    }
                }
                return Ok(config);
            }
            Err(errors) => errors,
        };
        let unknown: Vec<String> = errors
            .clone()
            .into_iter()
            .filter_map(|e| unknown_env_key(&e, env_prefix))
            .filter(|key| !left_out.contains(key))
            .collect();
        if unknown.is_empty() {
            let all: Vec<String> = errors.into_iter().map(|e| e.to_string()).collect();
            bail!("invalid configuration:\n  {}", all.join("\n  "));
        }
        left_out.extend(unknown);
    }
}

/// The dotted key of an environment variable that `error` reports as naming no key.
fn unknown_env_key(error: &figment::Error, env_prefix: &str) -> Option<String> {
    let figment::error::Kind::UnknownField(field, _) = &error.kind else {
        return None;
    };
    let from_env = error.metadata.as_ref().is_some_and(|m| {
        m.name.contains("environment") && m.name.contains(env_prefix.trim_end_matches('_'))
    });
    if !from_env {
        return None;
    }
    let mut path = error.path.clone();
    if path.last() != Some(field) {
        path.push(field.clone());
    }
    Some(path.join(".").to_ascii_lowercase())
}

/// Whether `key` (after the prefix) is one of the variables Kubernetes sets for a Service whose
/// name is the prefix: `PORT`, `PORT_<port>_<proto>[_ADDR|_PORT|_PROTO]`, `SERVICE_HOST`,
/// `SERVICE_PORT[_<name>]`.
fn is_kubernetes_service_variable(key: &str) -> bool {
    key == "port"
        || key.starts_with("port_")
        || key == "service_host"
        || key == "service_port"
        || key.starts_with("service_port_")
}

/// Loads every `*.toml` file of `dir` as a stream definition. All errors are reported together,
/// as a [`ConfigError`].
pub fn load_streams_dir(dir: &Path) -> anyhow::Result<Streams> {
    load_streams_dir_inner(dir).map_err(invalid)
}

fn load_streams_dir_inner(dir: &Path) -> anyhow::Result<Streams> {
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read stream directory {}", dir.display()))?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "toml") {
            let stem = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default()
                .to_owned();
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            files.push((stem, text));
        }
    }
    files.sort();
    let streams = Streams::from_sources(files.iter().map(|(s, t)| (s.as_str(), t.as_str())))
        .map_err(|errors| {
            let all: Vec<String> = errors.iter().map(ToString::to_string).collect();
            anyhow::anyhow!(
                "invalid stream definitions in {}:\n  {}",
                dir.display(),
                all.join("\n  ")
            )
        })?;
    if streams.is_empty() {
        bail!("no stream definitions (*.toml) in {}", dir.display());
    }
    load_dictionaries(dir, streams, None)
}

/// Loads one stream's definition, `<stream>.toml` of `dir`, with its zstd dictionaries: for a
/// stream defined after a component started. Other files of `dir` are not read, so a broken
/// definition of another stream does not keep this one out. A file being written is read until
/// it parses ([`settled`]).
pub fn load_stream(dir: &Path, stream: &str) -> anyhow::Result<Arc<StreamDef>> {
    schemas::validate_stream_name(stream)?;
    let path = dir.join(format!("{stream}.toml"));
    let (_, streams) = settled(&path, |text| {
        Streams::from_sources([(stream, text)]).map_err(|errors| {
            let all: Vec<String> = errors.iter().map(ToString::to_string).collect();
            anyhow::anyhow!(
                "invalid stream definition in {}: {}",
                dir.display(),
                all.join("; ")
            )
        })
    });
    let streams = load_dictionaries(dir, streams?, Some(stream))?;
    Ok(streams.get(stream).expect("loaded above").clone())
}

/// Adds the zstd dictionaries of `dir` to their streams (of `only` that stream): `<stream>.zdict`
/// is the one agents compress with, `<stream>.<label>.zdict` are retired ones still decoded.
fn load_dictionaries(
    dir: &Path,
    mut streams: Streams,
    only: Option<&str>,
) -> anyhow::Result<Streams> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read stream directory {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "zdict"))
        .collect();
    files.sort();
    for path in files {
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        let (stream, current) = match name.split_once('.') {
            Some((stream, _label)) => (stream, false),
            None => (name, true),
        };
        if only.is_some_and(|only| only != stream) {
            continue;
        }
        let bytes =
            std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let dictionary =
            ZstdDictionary::new(bytes).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        streams
            .add_dictionary(stream, dictionary, current)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    }
    Ok(streams)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A definition file is read again only when it changed; what the read came to follows the
    /// kind of change, and a file that cannot be read keeps the running definition.
    #[test]
    fn a_definition_file_is_read_again_only_when_it_changed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sensor_readings.toml");
        let shipped = include_str!("../../../streams/sensor_readings.toml");
        std::fs::write(&path, shipped).unwrap();
        let running = StreamDef::from_toml(shipped).unwrap();
        let mut file = DefinitionFile::new(dir.path(), "sensor_readings");
        assert!(file.changed(), "never read");
        assert!(matches!(file.reread(&running), Reread::Same));
        assert!(!file.changed());
        let humid = format!("{shipped}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n");
        std::fs::write(&path, &humid).unwrap();
        assert!(file.changed());
        match file.reread(&running) {
            Reread::Compatible(def) => assert!(def.field_index("humidity").is_some()),
            other => panic!("{other:?}"),
        }
        std::fs::write(
            &path,
            shipped.replace("type = \"int64\"", "type = \"string\""),
        )
        .unwrap();
        assert!(matches!(file.reread(&running), Reread::Refused));
        std::fs::write(&path, "name = ").unwrap();
        assert!(matches!(file.reread(&running), Reread::Failed));
        assert!(
            !file.changed(),
            "a failed read is not retried until the file changes"
        );
        // Replaced by rename, as editors and config maps do, with the same size and time.
        let other = dir.path().join("next.toml");
        std::fs::write(&other, "name = ").unwrap();
        let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
        std::fs::File::options()
            .write(true)
            .open(&other)
            .unwrap()
            .set_modified(modified)
            .unwrap();
        std::fs::rename(&other, &path).unwrap();
        assert!(file.changed(), "a new inode is a change");
        std::fs::remove_file(&path).unwrap();
        assert!(file.changed_since_seen());
        assert!(
            !file.changed_since_seen(),
            "a missing file, once seen, is not a change"
        );
    }

    /// A file read while a program writes it in place, in pieces, is read again until it is
    /// whole: the compatible change is taken, not refused as unreadable. Before, the half read
    /// was logged as a failed read and the record in hand became a dead letter (sink), a
    /// rejection (gateway) or an invalid record (agent). The same for a stream's first load.
    #[test]
    fn a_file_being_written_is_read_once_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sensor_readings.toml");
        let shipped = include_str!("../../../streams/sensor_readings.toml");
        std::fs::write(&path, shipped).unwrap();
        let running = StreamDef::from_toml(shipped).unwrap();
        let humid = format!("{shipped}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n");
        let write_in_two = |path: std::path::PathBuf, text: String| {
            let (head, tail) = text.split_at(text.len() / 2);
            std::fs::write(&path, head).unwrap();
            let tail = tail.to_owned();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                use std::io::Write as _;
                let mut f = std::fs::File::options().append(true).open(&path).unwrap();
                f.write_all(tail.as_bytes()).unwrap();
            })
        };
        let mut file = DefinitionFile::new(dir.path(), "sensor_readings");
        let writer = write_in_two(path.clone(), humid);
        match file.reread(&running) {
            Reread::Compatible(def) => assert!(def.field_index("humidity").is_some()),
            other => panic!("{other:?}"),
        }
        writer.join().unwrap();

        let vehicles = include_str!("../../../streams/vehicle_telemetry.toml");
        let writer = write_in_two(dir.path().join("vehicle_telemetry.toml"), vehicles.into());
        let def = load_stream(dir.path(), "vehicle_telemetry").unwrap();
        assert_eq!(def.name, "vehicle_telemetry");
        writer.join().unwrap();
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Cfg {
        #[serde(default)]
        name: String,
        #[serde(default)]
        inner: Inner,
    }

    #[derive(Debug, Default, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        #[serde(default)]
        port: u16,
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API
    fn file_then_env_unknown_keys_in_the_file_fail_in_the_environment_are_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(&file, "name = \"a\"\n[inner]\nport = 1\n").unwrap();
        figment::Jail::expect_with(|jail| {
            jail.set_env("PLUMBTEST_INNER__PORT", "7");
            let c: Cfg = load_config(Some(&file), "PLUMBTEST_").unwrap();
            assert_eq!((c.name.as_str(), c.inner.port), ("a", 7));
            // Variables that name no key, at the top and in a table: Kubernetes' for a Service
            // named `plumbtest`, a typo, the log format.
            for (name, value) in [
                ("PLUMBTEST_PORT", "tcp://10.0.0.1:9102"),
                ("PLUMBTEST_PORT_9102_TCP", "tcp://10.0.0.1:9102"),
                ("PLUMBTEST_PORT_9102_TCP_ADDR", "10.0.0.1"),
                ("PLUMBTEST_SERVICE_HOST", "10.0.0.1"),
                ("PLUMBTEST_SERVICE_PORT", "9102"),
                ("PLUMBTEST_COLOUR", "red"),
                ("PLUMBTEST_INNER__COLOUR", "blue"),
                ("PLUMBTEST_LOG_FORMAT", "json"),
            ] {
                jail.set_env(name, value);
            }
            let c: Cfg = load_config(Some(&file), "PLUMBTEST_").unwrap();
            assert_eq!((c.name.as_str(), c.inner.port), ("a", 7));
            // A variable that names a key with a value that does not fit is an error.
            jail.set_env("PLUMBTEST_INNER__PORT", "seven");
            let e = load_config::<Cfg>(Some(&file), "PLUMBTEST_").unwrap_err();
            assert!(format!("{e:#}").contains("INNER.PORT"), "{e:#}");
            assert_eq!(
                crate::process::exit_code_of(&e),
                crate::process::EXIT_CONFIG
            );
            Ok(())
        });
        std::fs::write(&file, "nmae = \"a\"\n").unwrap();
        let e = load_config::<Cfg>(Some(&file), "PLUMBTEST2_").unwrap_err();
        assert!(format!("{e:#}").contains("nmae"), "{e:#}");
        assert_eq!(
            crate::process::exit_code_of(&e),
            crate::process::EXIT_CONFIG
        );
    }

    #[test]
    fn streams_dir_loads_shipped_definitions_and_reports_errors() {
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../streams");
        let streams = load_streams_dir(&shipped).unwrap();
        assert!(streams.get("sensor_readings").is_some());
        let dir = tempfile::tempdir().unwrap();
        assert!(
            load_streams_dir(dir.path())
                .unwrap_err()
                .to_string()
                .contains("no stream")
        );
        std::fs::write(dir.path().join("a.toml"), "name = 1").unwrap();
        std::fs::write(dir.path().join("b.toml"), "oops").unwrap();
        let e = load_streams_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("a.toml") && e.contains("b.toml"), "{e}");
    }

    fn dictionary(seed: u64) -> schemas::dictionary::ZstdDictionary {
        let lines: Vec<String> = (seed..seed + 1_000)
            .map(|i| {
                format!(
                    r#"{{"device_id":"d{}","ts":{i},"value":{}}}"#,
                    i % 7,
                    i % 13
                )
            })
            .collect();
        let samples: Vec<&[u8]> = lines.iter().map(|l| l.as_bytes()).collect();
        schemas::dictionary::train(&samples, 2048).unwrap()
    }

    #[test]
    fn streams_dir_loads_current_and_retired_dictionaries() {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in schemas::EXAMPLE_STREAMS {
            std::fs::write(dir.path().join(format!("{name}.toml")), text).unwrap();
        }
        let (current, retired) = (dictionary(0), dictionary(50_000));
        assert_ne!(current.id(), retired.id());
        let write =
            |name: &str, bytes: &[u8]| std::fs::write(dir.path().join(name), bytes).unwrap();
        write("sensor_readings.zdict", current.bytes());
        write("sensor_readings.2025.zdict", retired.bytes());
        let streams = load_streams_dir(dir.path()).unwrap();
        let dictionaries = &streams.get("sensor_readings").unwrap().dictionaries;
        assert_eq!(dictionaries.current().unwrap().id(), current.id());
        assert_eq!(dictionaries.ids().len(), 2);
        assert!(dictionaries.get(retired.id()).is_some());
        let other = &streams.get("vehicle_telemetry").unwrap().dictionaries;
        assert!(other.current().is_none() && other.ids().is_empty());

        // A dictionary of no stream, or a file that is not one, stops the load with its name.
        write("nosuch.zdict", current.bytes());
        let e = load_streams_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("nosuch.zdict") && e.contains("no stream"), "{e}");
        std::fs::remove_file(dir.path().join("nosuch.zdict")).unwrap();
        write("vehicle_telemetry.zdict", b"not a dictionary");
        let e = load_streams_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("vehicle_telemetry.zdict"), "{e}");
    }

    /// One stream loads with its own dictionaries, whatever the other files of the directory
    /// hold; a name that is not a stream's, or a file that defines another stream, does not.
    #[test]
    fn one_stream_loads_alone() {
        let dir = tempfile::tempdir().unwrap();
        let write =
            |name: &str, bytes: &[u8]| std::fs::write(dir.path().join(name), bytes).unwrap();
        let sensor = schemas::EXAMPLE_STREAMS[0];
        assert_eq!(sensor.0, "sensor_readings");
        write("sensor_readings.toml", sensor.1.as_bytes());
        write("broken.toml", b"oops");
        write("nosuch.zdict", b"not a dictionary");
        let current = dictionary(0);
        write("sensor_readings.zdict", current.bytes());
        let def = load_stream(dir.path(), "sensor_readings").unwrap();
        assert_eq!(def.name, "sensor_readings");
        assert_eq!(def.dictionaries.current().unwrap().id(), current.id());
        assert!(
            load_streams_dir(dir.path()).is_err(),
            "the directory as a whole does not load"
        );

        let e = load_stream(dir.path(), "vehicle_telemetry").unwrap_err();
        assert!(format!("{e:#}").contains("vehicle_telemetry.toml"), "{e:#}");
        write("other.toml", sensor.1.as_bytes());
        let e = load_stream(dir.path(), "other").unwrap_err();
        assert!(format!("{e:#}").contains("must be named"), "{e:#}");
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        assert!(load_stream(&dir.path().join("sub"), "../sensor_readings").is_err());
    }
}

/// A stream's definition file (`<dir>/<stream>.toml`) and how it was when last read. A component
/// that meets a record its definition does not take, in a way a newer one may (a field it lacks,
/// or a required one missing), looks at the file (a `stat`) and reads it again only if it is not
/// as it was ([`DefinitionFile::reread`]), so that a compatible change is taken without a
/// restart.
#[derive(Debug, Clone)]
pub struct DefinitionFile {
    stream: String,
    path: PathBuf,
    read_as: Option<Stamp>,
}

/// What tells a version of a file from another without reading it: its inode, size and
/// modification time (`None` for a file that is not there). A rewrite in place changes the time,
/// a replacement by rename (editors, Kubernetes config maps) the inode too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp(Option<(u64, u64, SystemTime)>);

impl Stamp {
    fn of(path: &Path) -> Stamp {
        use std::os::unix::fs::MetadataExt as _;
        Stamp(std::fs::metadata(path).ok().map(|m| {
            (
                m.ino(),
                m.len(),
                m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            )
        }))
    }
}

/// A definition file that does not parse and was modified less than this ago may be in the
/// middle of being written (a program that writes it in place, in pieces): it is read again.
const SETTLE: Duration = Duration::from_secs(2);
/// How often such a file is read again.
const SETTLE_STEP: Duration = Duration::from_millis(100);
/// For how long at most, whatever the file's time says.
const SETTLE_MAX: Duration = Duration::from_secs(5);

/// Reads `path` and parses it with `parse`; while that fails and the file was modified less
/// than [`SETTLE`] ago, it is read again every [`SETTLE_STEP`], for at most [`SETTLE_MAX`]. So
/// a component that looks at a file while it is written in place reads it whole rather than
/// refusing what it read. Gives how the file was before the last read (blocking).
fn settled<T>(
    path: &Path,
    parse: impl Fn(&str) -> anyhow::Result<T>,
) -> (Stamp, anyhow::Result<T>) {
    let deadline = Instant::now() + SETTLE_MAX;
    loop {
        let stamp = Stamp::of(path);
        let read = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))
            .and_then(|text| parse(&text));
        let fresh = || {
            std::fs::metadata(path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age < SETTLE)
        };
        if read.is_ok() || Instant::now() >= deadline || !fresh() {
            return (stamp, read);
        }
        std::thread::sleep(SETTLE_STEP);
    }
}

/// What reading a definition file again came to ([`DefinitionFile::reread`]).
#[derive(Debug)]
pub enum Reread {
    /// The file holds the running definition (or one that differs only in its docs).
    Same,
    /// A compatible change ([`schemas::Change::Compatible`]): the definition to run with from now
    /// on. It has the running definition's zstd dictionaries.
    Compatible(Box<StreamDef>),
    /// An incompatible change, refused (logged as an error with the reason).
    Refused,
    /// The file cannot be read or is not a valid definition of the stream (logged).
    Failed,
}

impl DefinitionFile {
    pub fn new(dir: &Path, stream: &str) -> DefinitionFile {
        DefinitionFile {
            stream: stream.to_owned(),
            path: dir.join(format!("{stream}.toml")),
            read_as: None,
        }
    }

    /// Whether the file is not as it was when last read (or was never read through this).
    pub fn changed(&self) -> bool {
        self.read_as != Some(Stamp::of(&self.path))
    }

    /// [`DefinitionFile::changed`], and takes the file as seen: for a caller that reads it by
    /// other means (the whole directory), or not at all when it is not there.
    pub fn changed_since_seen(&mut self) -> bool {
        let now = Some(Stamp::of(&self.path));
        std::mem::replace(&mut self.read_as, now) != now
    }

    /// A compatible change of `running` in the file, if it changed since it was last read
    /// ([`DefinitionFile::reread`]; a refused or failed read is logged there).
    pub fn compatible_change(&mut self, running: &StreamDef) -> Option<StreamDef> {
        if !self.changed() {
            return None;
        }
        match self.reread(running) {
            Reread::Compatible(def) => Some(*def),
            _ => None,
        }
    }

    /// Reads the file (blocking) and compares its definition with `running`. How the file was
    /// is taken before it is read, so that a change while it is read is read again next time.
    pub fn reread(&mut self, running: &StreamDef) -> Reread {
        let (stamp, read) = settled(&self.path, |text| {
            let def = StreamDef::from_toml(text)?;
            anyhow::ensure!(def.name == self.stream, "it defines stream '{}'", def.name);
            Ok(def)
        });
        self.read_as = Some(stamp);
        let (stream, file) = (&self.stream, self.path.display());
        let mut def = match read {
            Ok(def) => def,
            Err(e) => {
                tracing::warn!(stream, %file, error = %format!("{e:#}"), "cannot read the stream's definition again; the running one stays");
                return Reread::Failed;
            }
        };
        match running.change_to(&def) {
            Change::Same => Reread::Same,
            Change::Incompatible(reason) => {
                tracing::error!(stream, %file, %reason, "the stream's definition changed incompatibly (a new version of a stream needs a new stream): the running one stays until a restart");
                Reread::Refused
            }
            Change::Compatible => {
                tracing::info!(stream, %file, version = def.version, "the stream's definition changed compatibly: it is in force from now on");
                def.dictionaries = running.dictionaries.clone();
                Reread::Compatible(Box::new(def))
            }
        }
    }
}
