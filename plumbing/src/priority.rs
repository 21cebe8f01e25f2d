//! Per-thread scheduling priority. On Linux the nice value belongs to a thread, and a thread
//! starts with the nice value of the thread that created it.

use std::io;

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
