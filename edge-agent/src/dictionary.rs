//! Training a stream's zstd dictionary on its own records (`edge-agent train-dictionary`) and
//! installing it next to the stream's definition, where agents and gateways load it.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use schemas::StreamDef;
use schemas::dictionary::{ZstdDictionary, train};

/// What training used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trained {
    pub samples: usize,
    pub sample_bytes: usize,
    /// Lines of the input that are not valid records of the stream (not used).
    pub invalid: usize,
}

/// Trains a dictionary of at most `max_bytes` on the valid records of `ndjson` (at most
/// `max_samples` of them, the first ones).
pub fn train_dictionary(
    def: &StreamDef,
    ndjson: &[u8],
    max_bytes: usize,
    max_samples: usize,
) -> anyhow::Result<(ZstdDictionary, Trained)> {
    let mut samples = Vec::new();
    let mut invalid = 0;
    for line in schemas::decode::ndjson_lines(ndjson) {
        if samples.len() == max_samples {
            break;
        }
        match schemas::check_bytes(def, line) {
            Ok(_) => samples.push(line),
            Err(_) => invalid += 1,
        }
    }
    if samples.len() < 100 {
        bail!(
            "only {} valid records of stream {} to train on; zstd needs a few hundred at least",
            samples.len(),
            def.name
        );
    }
    let dictionary = train(&samples, max_bytes)?;
    let trained = Trained {
        samples: samples.len(),
        sample_bytes: samples.iter().map(|s| s.len()).sum(),
        invalid,
    };
    Ok((dictionary, trained))
}

/// Where an installed dictionary went, and where the one it replaced went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    pub path: PathBuf,
    pub retired: Option<PathBuf>,
}

/// Writes `dictionary` as `<dir>/<stream>.zdict` (temporary file, fsync, rename). A current
/// dictionary there is kept as `<stream>.<its id>.zdict`, so that gateways still decode batches
/// compressed with it.
pub fn install_dictionary(
    dir: &Path,
    stream: &str,
    dictionary: &ZstdDictionary,
) -> anyhow::Result<Installed> {
    let path = dir.join(format!("{stream}.zdict"));
    let retired = match std::fs::read(&path) {
        Ok(old) => {
            let old = ZstdDictionary::new(old)
                .with_context(|| format!("{} is not a zstd dictionary", path.display()))?;
            if old.id() == dictionary.id() {
                bail!("{} is this dictionary already", path.display());
            }
            let retired = dir.join(format!("{stream}.{}.zdict", old.id()));
            std::fs::rename(&path, &retired)
                .with_context(|| format!("cannot rename {}", path.display()))?;
            Some(retired)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let mut file = tempfile::NamedTempFile::new_in(dir)?;
    std::io::Write::write_all(&mut file, dictionary.bytes())?;
    file.as_file().sync_all()?;
    file.persist(&path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(Installed { path, retired })
}
