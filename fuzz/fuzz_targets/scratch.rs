//! What the targets that write files share.

/// A scratch directory in memory where there is one: every run writes files.
pub fn scratch() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir()
        && let Ok(dir) = tempfile::tempdir_in(shm)
    {
        return dir;
    }
    tempfile::tempdir().expect("a scratch directory")
}
