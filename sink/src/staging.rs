//! Where a sink stages its open files: a folder of its own under the configured staging
//! directory, holding a lock for as long as the process runs. A sink killed (SIGKILL, OOM, a
//! stop timeout) leaves its staged files behind, up to a file target per assigned partition; the
//! next sink on the machine finds their folder's lock free and removes it at start and at every
//! sweep, and never touches the folder of a sink that runs (several may share the directory).

use std::fs::{self, File, TryLockError};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Prefix of the sinks' folders in the staging directory.
const FOLDER_PREFIX: &str = "sink-";
/// The lock of a folder: locked (flock) by its sink while it runs, released by the kernel when
/// the process ends in any way.
const LOCK: &str = ".lock";

/// This sink's staging folder, removed when it is dropped (a graceful stop).
#[derive(Debug)]
pub struct Staging {
    root: PathBuf,
    dir: PathBuf,
    _lock: File,
}

/// What a sweep removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Folders of sinks that are gone.
    pub folders: usize,
    /// Loose staged files past the age limit.
    pub files: usize,
    pub bytes: u64,
}

impl Staging {
    /// Creates a folder of this process under `root` and locks it.
    pub fn create(root: &Path) -> io::Result<Staging> {
        fs::create_dir_all(root)?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let dir = root.join(format!("{FOLDER_PREFIX}{}-{nanos}", std::process::id()));
        fs::create_dir(&dir)?;
        // Locked before it has its name: a sweeper never finds the lock of a running sink free.
        let pending = dir.join(".lock.pending");
        let lock = File::create(&pending)?;
        lock.lock()?;
        fs::rename(&pending, dir.join(LOCK))?;
        Ok(Staging {
            root: root.to_path_buf(),
            dir,
            _lock: lock,
        })
    }

    /// The staging budget: `configured`, or when that is 0, half of the free space of the
    /// staging folder's file system now.
    pub fn budget(&self, configured: u64) -> io::Result<u64> {
        if configured > 0 {
            return Ok(configured);
        }
        let fs = rustix::fs::statvfs(&self.dir)?;
        Ok(fs.f_bavail.saturating_mul(fs.f_frsize) / 2)
    }

    /// The folder to stage files in.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Removes, on the blocking pool, the folders of sinks that are gone (their lock is free),
    /// and loose staged files older than `cutoff` (staged by versions before folders of their
    /// own). Folders without a lock (a sink that died while creating its own) are left.
    pub async fn sweep_in_background(&self, cutoff: SystemTime) -> io::Result<Swept> {
        let (root, dir) = (self.root.clone(), self.dir.clone());
        tokio::task::spawn_blocking(move || sweep(&root, &dir, cutoff))
            .await
            .map_err(io::Error::other)?
    }

    /// [`Staging::sweep_in_background`] here, with loose files of any age.
    #[cfg(test)]
    fn sweep(&self) -> io::Result<Swept> {
        let cutoff = SystemTime::now() + std::time::Duration::from_secs(3600);
        sweep(&self.root, &self.dir, cutoff)
    }
}

fn sweep(root: &Path, own: &Path, cutoff: SystemTime) -> io::Result<Swept> {
    let mut swept = Swept::default();
    for entry in fs::read_dir(root)? {
        let entry = entry?;
        let path = entry.path();
        let meta = entry.metadata()?;
        if meta.is_file() {
            if meta.modified().is_ok_and(|t| t < cutoff) && fs::remove_file(&path).is_ok() {
                swept.files += 1;
                swept.bytes += meta.len();
            }
            continue;
        }
        let ours = path == own;
        let named = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with(FOLDER_PREFIX));
        if ours || !named || !meta.is_dir() {
            continue;
        }
        let lock = match File::open(path.join(LOCK)) {
            Ok(lock) => lock,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        match lock.try_lock() {
            Ok(()) => {
                let bytes = size_of_files(&path);
                fs::remove_dir_all(&path)?;
                tracing::info!(folder = %path.display(), bytes, "removed the staged files of a sink that is gone");
                swept.folders += 1;
                swept.bytes += bytes;
            }
            Err(TryLockError::WouldBlock) => {}
            Err(TryLockError::Error(e)) => return Err(e),
        }
    }
    Ok(swept)
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            tracing::warn!(folder = %self.dir.display(), error = %e, "cannot remove the staging folder");
        }
    }
}

/// Bytes of the files in `dir` (not recursive: staged files are not nested).
fn size_of_files(dir: &Path) -> u64 {
    fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .filter_map(|e| e.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .sum()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A budget set is taken as it is; 0 is half of the file system's free space (checked
    /// against `df`'s count of the same file system, which moves a little between the reads).
    #[test]
    fn the_staging_budget_is_set_or_half_the_free_space() {
        let root = tempfile::tempdir().unwrap();
        let me = Staging::create(root.path()).unwrap();
        assert_eq!(me.budget(123_456).unwrap(), 123_456);
        let auto = me.budget(0).unwrap();
        let df = std::process::Command::new("df")
            .args(["--output=avail", "-B1"])
            .arg(me.path())
            .output()
            .unwrap();
        let free: u64 = String::from_utf8(df.stdout)
            .unwrap()
            .lines()
            .nth(1)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let half = free / 2;
        assert!(
            auto.abs_diff(half) <= half / 100 + (1 << 20),
            "budget {auto}, half of the free space {half}"
        );
    }

    #[test]
    fn a_sweep_removes_the_folders_of_sinks_that_are_gone_only() {
        let root = tempfile::tempdir().unwrap();
        let running = Staging::create(root.path()).unwrap();
        fs::write(running.path().join("staged"), [1u8; 10]).unwrap();
        // What a killed sink leaves: its folder, staged files and a lock nobody holds.
        let gone = root.path().join("sink-1-2");
        fs::create_dir(&gone).unwrap();
        File::create(gone.join(LOCK)).unwrap();
        fs::write(gone.join("staged-a"), [7u8; 1000]).unwrap();
        fs::write(gone.join("staged-b"), [7u8; 500]).unwrap();
        // A sink that died creating its folder, and what is not a sink's.
        fs::create_dir(root.path().join("sink-3-4")).unwrap();
        fs::create_dir(root.path().join("other")).unwrap();
        fs::write(root.path().join("sink-file"), b"x").unwrap();
        // A loose staged file of a version before folders (the test's cutoff: any age).
        fs::write(root.path().join(".tmpAbc"), [3u8; 20]).unwrap();

        let me = Staging::create(root.path()).unwrap();
        assert_eq!(
            me.sweep().unwrap(),
            Swept {
                folders: 1,
                files: 2,
                bytes: 1521
            }
        );
        assert!(!gone.exists());
        assert!(
            running.path().join("staged").exists(),
            "a running sink's files stay"
        );
        assert!(root.path().join("sink-3-4").exists());
        assert!(root.path().join("other").exists());
        assert!(!root.path().join(".tmpAbc").exists());
        assert_eq!(me.sweep().unwrap(), Swept::default());
        // A graceful stop removes its own folder.
        let mine = me.path().to_path_buf();
        drop(me);
        assert!(!mine.exists());
    }
}
