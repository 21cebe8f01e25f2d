//! The process: signals (stop on SIGTERM/SIGINT, SIGHUP handled), the open files limit,
//! per-thread scheduling priority (on Linux the nice value belongs to a thread, and a thread
//! starts with the nice value of the thread that created it), and the start and stop every
//! service shares.

use std::io;

use tokio_util::sync::CancellationToken;

/// The exit status of a run that ended well, or was stopped by SIGTERM or SIGINT after it
/// finished the work in hand.
pub const EXIT_OK: u8 = 0;
/// A runtime error: a service, a store or a peer failed in a way the process does not outlast.
pub const EXIT_RUNTIME: u8 = 1;
/// The configuration, a stream definition, a file they name or the command line is invalid
/// (clap's usage errors exit with 2 too). Starting again unchanged fails again.
pub const EXIT_CONFIG: u8 = 2;
/// Stopped by a signal before the work in hand was done (the graceful shutdown timed out): what
/// was left is taken up at the next start. 128 + SIGINT, as shells report an interrupted command.
pub const EXIT_INTERRUPTED: u8 = 130;

/// Marks an error as a stop before the work in hand was done ([`EXIT_INTERRUPTED`]).
#[derive(Debug, Clone, Copy)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

/// The exit status for `error`: [`EXIT_CONFIG`] for a [`crate::config::ConfigError`],
/// [`EXIT_INTERRUPTED`] for an [`Interrupted`] stop, else [`EXIT_RUNTIME`].
pub fn exit_code_of(error: &anyhow::Error) -> u8 {
    if error.downcast_ref::<crate::config::ConfigError>().is_some() {
        EXIT_CONFIG
    } else if error.downcast_ref::<Interrupted>().is_some() {
        EXIT_INTERRUPTED
    } else {
        EXIT_RUNTIME
    }
}

/// Ends `main`: on an error, reports it (one JSON log event when the logs are JSON, else
/// `Error: ` and its causes, as a `main` returning the error would) and exits with
/// [`exit_code_of`] it.
pub fn exit(result: anyhow::Result<()>) -> std::process::ExitCode {
    let Err(error) = result else {
        return std::process::ExitCode::from(EXIT_OK);
    };
    let code = exit_code_of(&error);
    if crate::telemetry::json_logs() {
        tracing::error!(
            exit_code = code,
            error = format!("{error:#}"),
            "fatal error"
        );
    } else {
        eprintln!("Error: {error:?}");
    }
    std::process::ExitCode::from(code)
}

/// The wait before retry `attempt` (0 for the first retry): `first` doubling up to `max`, then
/// anywhere from half to one and a half times that. The jitter keeps processes that failed
/// together (many sinks after an object store outage, agents after the gateway's) from
/// retrying in lockstep.
pub fn backoff(
    attempt: u32,
    first: std::time::Duration,
    max: std::time::Duration,
) -> std::time::Duration {
    use rand::Rng as _;
    let base = first.saturating_mul(1 << attempt.min(20)).min(max);
    let nanos = base.as_nanos().min(u128::from(u64::MAX)) as u64;
    let jittered = rand::rng().random_range(nanos / 2..=nanos.saturating_add(nanos / 2));
    std::time::Duration::from_nanos(jittered.max(1))
}

/// Raises this process's soft limit on open files to its hard limit, and logs the limit in
/// force. systemd starts services with a soft limit of 1,024 (and a hard one of 524,288) and
/// leaves it to programs that need more to raise it: a sink holds a staged file per partition
/// it writes, a gateway a socket per connection (`limits.max_connections`, 1,024 by default), and
/// past the soft limit both failed with "Too many open files". Returns the soft limit in force
/// (`None`: unlimited).
pub fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let (Some(soft), Some(hard)) = (limit.current, limit.maximum) else {
        return limit.current;
    };
    if soft >= hard {
        return Some(soft);
    }
    let raised = Rlimit {
        current: Some(hard),
        maximum: Some(hard),
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => {
            tracing::info!(from = soft, to = hard, "raised the open files limit");
            Some(hard)
        }
        Err(e) => {
            tracing::warn!(limit = soft, error = %e, "cannot raise the open files limit");
            Some(soft)
        }
    }
}

/// Calls `each` on every SIGHUP, instead of its default action, which ends the process at once
/// without a graceful stop. For the sink and the agent, which have nothing to reload on it: a
/// tool sends it out of habit (a `logrotate` postrotate script, a reload meant for the
/// gateway). `each` logs under its caller's target, which `RUST_LOG` filters name.
#[cfg(unix)]
pub fn on_sighup(mut each: impl FnMut() + Send + 'static) -> std::io::Result<()> {
    let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            each();
        }
    });
    Ok(())
}

/// Cancels `token` on Ctrl-C or SIGTERM.
///
/// On Unix the handlers are in place when this returns, so that a caller may then unblock the
/// signals (the agent's reload keeps them blocked across its exec).
pub fn cancel_on_signal(token: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let listeners = signal(SignalKind::terminate()).and_then(|term| {
            let interrupt = signal(SignalKind::interrupt())?;
            Ok((term, interrupt))
        });
        tokio::spawn(async move {
            match listeners {
                Ok((mut term, mut interrupt)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = interrupt.recv() => {}
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM");
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
            tracing::info!("shutdown requested");
            token.cancel();
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutdown requested");
        token.cancel();
    });
}

/// The options the gateway and the sink share.
#[derive(Debug, clap::Args)]
pub struct ServiceArgs {
    /// Config file (TOML).
    #[arg(long, short, global = true)]
    pub config: Option<std::path::PathBuf>,
    /// Seconds to wait on shutdown for the work in hand to finish: the gateway's requests in
    /// flight and its producer (default 30), the sink's files to be written and committed
    /// (default 60).
    #[arg(long)]
    pub graceful_shutdown_timeout: Option<u64>,
    /// Check the config, the stream definitions and the files they name (tokens, certificates),
    /// then exit (0 when valid) without connecting to Kafka or the object store.
    #[arg(long)]
    pub check: bool,
}

impl ServiceArgs {
    /// The grace period asked for, or `default_secs`.
    pub fn grace(&self, default_secs: u64) -> std::time::Duration {
        std::time::Duration::from_secs(self.graceful_shutdown_timeout.unwrap_or(default_secs))
    }
}

/// A service process running: the metrics recorder installed, the open files limit raised and
/// a shutdown token that SIGTERM and SIGINT cancel. The gateway and the sink start this way.
pub struct Service {
    pub shutdown: CancellationToken,
}

impl Service {
    pub fn start() -> Self {
        crate::telemetry::install_metrics();
        raise_open_files_limit();
        let shutdown = CancellationToken::new();
        cancel_on_signal(shutdown.clone());
        Self { shutdown }
    }

    /// Waits until `task` ends or shutdown is requested; then gives the task `grace` to finish
    /// what it holds. `what` names the task in errors; `lost` says what a timed-out stop leaves
    /// undone.
    pub async fn run_until_stopped(
        &self,
        mut task: tokio::task::JoinHandle<anyhow::Result<()>>,
        grace: std::time::Duration,
        what: &str,
        lost: &str,
    ) -> anyhow::Result<()> {
        use anyhow::Context as _;
        tokio::select! {
            result = &mut task => return result.with_context(|| format!("{what} task failed"))?,
            _ = self.shutdown.cancelled() => {}
        }
        match tokio::time::timeout(grace, task).await {
            Ok(result) => result.with_context(|| format!("{what} task failed"))?,
            Err(_) => {
                Err(anyhow::anyhow!("graceful shutdown timed out; {lost}").context(Interrupted))
            }
        }
    }
}

/// The calling thread's nice value (0 when it cannot be read).
pub fn thread_nice() -> i32 {
    rustix::process::getpriority_process(None).unwrap_or(0)
}

/// The nice value of thread `tid` of this process, if it still runs.
pub fn nice_of(tid: i32) -> Option<i32> {
    let pid = rustix::process::Pid::from_raw(tid)?;
    rustix::process::getpriority_process(Some(pid)).ok()
}

/// Sets the calling thread's nice value. Raising it (a lower priority) is always allowed;
/// lowering it below where it was needs privileges, so a thread lowered once stays there.
pub fn set_thread_nice(nice: i32) -> io::Result<()> {
    rustix::process::setpriority_process(None, nice).map_err(io::Error::from)
}

/// The calling thread's id, as [`nice_of`] takes it.
pub fn thread_id() -> i32 {
    rustix::thread::gettid().as_raw_nonzero().get()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The waits double from `first` up to `max`, each within ±50 % of its step, and differ
    /// between calls.
    #[test]
    fn backoff_doubles_up_to_its_limit_with_jitter() {
        use std::time::Duration;
        let (first, max) = (Duration::from_millis(200), Duration::from_secs(30));
        for attempt in 0..12 {
            let step = (first * 2u32.pow(attempt)).min(max);
            let waits: Vec<Duration> = (0..50).map(|_| backoff(attempt, first, max)).collect();
            for wait in &waits {
                assert!(
                    *wait >= step / 2 && *wait <= step * 3 / 2,
                    "{attempt}: {wait:?}"
                );
            }
            let distinct: std::collections::BTreeSet<_> = waits.iter().collect();
            assert!(distinct.len() > 40, "{attempt}: {distinct:?}");
        }
        assert!(backoff(u32::MAX, first, max) <= max * 3 / 2);
    }

    #[test]
    fn a_thread_lowers_its_own_priority_and_no_other() {
        let base = thread_nice();
        let target = (base + 3).min(19);
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || {
            set_thread_nice(target).unwrap();
            tx.send((thread_id(), thread_nice())).unwrap();
            done_rx.recv().unwrap();
        });
        let (tid, seen_inside) = rx.recv().unwrap();
        assert_eq!(seen_inside, target);
        assert_eq!(nice_of(tid), Some(target), "read from another thread");
        assert_eq!(thread_nice(), base, "the calling thread keeps its priority");
        assert_eq!(nice_of(thread_id()), Some(base));
        done_tx.send(()).unwrap();
        other.join().unwrap();
    }
}
