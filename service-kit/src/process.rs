//! The process: signals (stop on SIGTERM/SIGINT, SIGHUP handled), the open files limit,
//! per-thread scheduling priority (on Linux the nice value belongs to a thread, and a thread
//! starts with the nice value of the thread that created it), and the start and stop every
//! service shares.

use std::io;

use tokio_util::sync::CancellationToken;

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
            Err(_) => anyhow::bail!("graceful shutdown timed out; {lost}"),
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
