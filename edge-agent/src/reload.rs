//! Reloading the config on SIGHUP (`systemctl reload edge-agent`).
//!
//! The agent reads its config file (with the environment's overrides) and the stream
//! definitions again and checks them as `edge-agent check` does. If they do not load or check,
//! it runs on with the config it has, logs why and sets
//! [`RELOAD_SUCCESSFUL`](crate::metrics::RELOAD_SUCCESSFUL) to 0. If they do, it stops as on
//! SIGTERM (open batches go to the spool, read positions are saved) and the process replaces
//! itself with a new run of the same binary and arguments ([`exec_self`]): the same PID, so a
//! service manager sees no restart, and nothing of the old run stays behind (threads, sockets,
//! the state directory's lock). What the old run left in the spool, the new one delivers.
//!
//! An agent reading stdin does not reload: lines read from the pipe but not yet in the spool
//! would be lost between the runs. It logs that and runs on.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use nix::sys::signal::{SigSet, Signal};
use tokio_util::sync::CancellationToken;

use crate::config::{AgentConfig, SourceConfig};
use crate::metrics::RELOAD_SUCCESSFUL;

/// What a SIGHUP finds: the agent starting (no config in force yet), running on a config that
/// may be reloaded, or reading stdin.
const STARTING: u8 = 0;
const RELOADABLE: u8 = 1;
const READS_STDIN: u8 = 2;

/// Whether a SIGHUP asked for a new run on a changed config.
#[derive(Debug, Clone, Default)]
pub struct Reload {
    state: Arc<AtomicU8>,
    requested: Arc<AtomicBool>,
    /// The running config's `state_dir`, which a reload may not change.
    state_dir: Arc<Mutex<PathBuf>>,
}

impl Reload {
    /// Listens for SIGHUP, first thing at start: from then on a SIGHUP no longer ends the
    /// process (its default action), which matters most in the milliseconds after a reload's
    /// exec. Until [`Reload::running`], a SIGHUP is logged and ignored. After it, each one loads
    /// and checks the config at `path` with `load` and, if it passes, cancels `shutdown` and
    /// marks the reload as requested (for [`Reload::requested`] once the run has stopped).
    pub fn on_sighup<L>(
        path: PathBuf,
        shutdown: CancellationToken,
        load: L,
    ) -> std::io::Result<Reload>
    where
        L: Fn(&Path) -> anyhow::Result<AgentConfig> + Send + 'static,
    {
        let reload = Reload::default();
        let (state, requested) = (reload.state.clone(), reload.requested.clone());
        let state_dir = reload.state_dir.clone();
        service_kit::process::on_sighup(move || {
            if requested.load(Ordering::Acquire) {
                tracing::info!("SIGHUP: a reload is already under way");
                return;
            }
            match state.load(Ordering::Acquire) {
                STARTING => {
                    tracing::info!("SIGHUP while the agent starts: ignored");
                    return;
                }
                READS_STDIN => {
                    tracing::warn!(
                        "SIGHUP: config not reloaded: the agent reads stdin, and lines read but not yet spooled would be lost between two runs; restart it to change its config"
                    );
                    return;
                }
                _ => {}
            }
            let running_dir = state_dir
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            match load(&path).and_then(|config| keeps_state_dir(&running_dir, config)) {
                Ok(config) => {
                    metrics::gauge!(RELOAD_SUCCESSFUL).set(1.0);
                    tracing::info!(
                        config = %path.display(),
                        sources = config.sources.len(),
                        "SIGHUP: the config loads and checks; stopping as on SIGTERM to start again on it in this process"
                    );
                    requested.store(true, Ordering::Release);
                    shutdown.cancel();
                }
                Err(e) => {
                    metrics::gauge!(RELOAD_SUCCESSFUL).set(0.0);
                    tracing::error!(
                        config = %path.display(),
                        error = format!("{e:#}"),
                        "SIGHUP: config not reloaded: it does not load or check; running on with the previous one"
                    );
                }
            }
        })?;
        // A run started by a reload's exec has SIGHUP, SIGTERM and SIGINT blocked (`exec_self`):
        // one that came since waited, and arrives now, at its listener (the caller listens for
        // SIGTERM and SIGINT before this, `service_kit::process::cancel_on_signal`).
        held_over_exec().thread_unblock()?;
        Ok(reload)
    }

    /// The agent runs on `config`: SIGHUP reloads from now on, unless it reads stdin.
    pub fn running(&self, config: &AgentConfig) {
        metrics::gauge!(RELOAD_SUCCESSFUL).set(1.0);
        let state = if reads_stdin(config) {
            READS_STDIN
        } else {
            RELOADABLE
        };
        *self
            .state_dir
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = config.state_dir.clone();
        self.state.store(state, Ordering::Release);
    }

    /// Whether a SIGHUP found a config that checks and stopped the run for it.
    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::Acquire)
    }
}

/// `config` unless it moves the state directory away from `running`: the new run would read
/// every file source from its start again, forget the digests of what was sent and leave the
/// spool of the old directory undelivered.
fn keeps_state_dir(running: &Path, config: AgentConfig) -> anyhow::Result<AgentConfig> {
    if config.state_dir != running {
        anyhow::bail!(
            "state_dir cannot change at a reload ({} to {}): the new run would read its files from the start and leave the old spool undelivered; stop the agent, move the directory, then start it",
            running.display(),
            config.state_dir.display()
        );
    }
    Ok(config)
}

/// Whether the agent reads stdin (and so cannot stop and start again without losing input).
pub fn reads_stdin(config: &AgentConfig) -> bool {
    config
        .sources
        .iter()
        .any(|s| matches!(s, SourceConfig::Stdin { .. }))
}

/// Replaces this process with a new run of the same binary with the same arguments and
/// environment. On Linux that is the binary running, even if its file was replaced or removed
/// since (a reload is not an upgrade; a restart is). Returns only if the exec fails. Every
/// descriptor the agent opens is close-on-exec, so the new run starts clean.
#[cfg(unix)]
pub fn exec_self() -> std::io::Error {
    use std::os::unix::process::CommandExt;
    let binary = if cfg!(target_os = "linux") {
        PathBuf::from("/proc/self/exe")
    } else {
        match std::env::current_exe() {
            Ok(exe) => exe,
            Err(e) => return e,
        }
    };
    // The signal mask survives the exec, handlers do not: blocked, a SIGHUP, SIGTERM or SIGINT
    // that comes before the new run listens (`Reload::on_sighup`) waits for it instead of ending
    // the process at once (a SIGTERM then stops the new run as it stops any run).
    if let Err(e) = held_over_exec().thread_block() {
        return e.into();
    }
    let mut args = std::env::args_os();
    let argv0 = args.next().unwrap_or_else(|| "edge-agent".into());
    std::process::Command::new(binary)
        .arg0(argv0)
        .args(args)
        .exec()
}

/// The signals a reload's exec holds until the new run listens for them.
fn held_over_exec() -> SigSet {
    let mut set = SigSet::empty();
    for signal in [Signal::SIGHUP, Signal::SIGTERM, Signal::SIGINT] {
        set.add(signal);
    }
    set
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config with `root` keys and `sources`.
    fn config_with(root: &str, sources: &str) -> AgentConfig {
        AgentConfig::parse(&format!(
            "{root}\n[gateway]\nurl = \"http://127.0.0.1:1\"\n{sources}"
        ))
        .unwrap()
    }

    fn config(sources: &str) -> AgentConfig {
        config_with("", sources)
    }

    #[test]
    fn only_an_agent_reading_stdin_refuses_to_reload() {
        let stdin = "[[sources]]\ntype = \"stdin\"\nstream = \"sensor_readings\"\n";
        let file = "[[sources]]\ntype = \"file\"\npath = \"/x\"\nstream = \"sensor_readings\"\n";
        assert!(reads_stdin(&config(stdin)));
        assert!(reads_stdin(&config(&format!("{file}{stdin}"))));
        assert!(!reads_stdin(&config(file)));
    }

    #[test]
    fn a_reload_may_not_move_the_state_directory() {
        let file = "[[sources]]\ntype = \"file\"\npath = \"/x\"\nstream = \"sensor_readings\"\n";
        let same = config_with("state_dir = \"/var/lib/a\"", file);
        assert!(keeps_state_dir(Path::new("/var/lib/a"), same).is_ok());
        let moved = config_with("state_dir = \"/var/lib/b\"", file);
        let e = keeps_state_dir(Path::new("/var/lib/a"), moved).unwrap_err();
        assert!(e.to_string().contains("/var/lib/a to /var/lib/b"), "{e}");
    }
}
