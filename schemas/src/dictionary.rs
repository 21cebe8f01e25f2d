//! zstd dictionaries of a stream: trained on the stream's own records, they let small batches
//! compress far better than zstd alone (a 256-byte batch of sensor readings came to about a third
//! of its plain-zstd size). A dictionary is part of a stream's wire format: like the stream
//! definition, it is deployed as a file next to it (`<stream>.zdict` is the one agents compress
//! with; `<stream>.<label>.zdict` are retired ones the gateway still decodes). A zstd frame names
//! its dictionary by the 32-bit id in its header, which the trainer derives from the
//! dictionary's content.

use std::fmt;
use std::sync::Arc;

use zstd::dict::DecoderDictionary;

/// The size agents' dictionaries are trained to by default.
pub const DEFAULT_DICTIONARY_BYTES: usize = 16 * 1024;

/// A dictionary file that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DictionaryError {
    #[error("not a zstd dictionary (no dictionary header with an id)")]
    NotADictionary,
    #[error("cannot train a dictionary: {0}")]
    Training(String),
}

/// One zstd dictionary, with its decoding tables built once.
pub struct ZstdDictionary {
    id: u32,
    bytes: Arc<[u8]>,
    decoder: DecoderDictionary<'static>,
}

impl fmt::Debug for ZstdDictionary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZstdDictionary")
            .field("id", &self.id)
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

impl ZstdDictionary {
    /// A dictionary from the bytes of a `.zdict` file: a zstd dictionary with a non-zero id (raw
    /// content dictionaries have none, so frames could not name them).
    pub fn new(bytes: Vec<u8>) -> Result<ZstdDictionary, DictionaryError> {
        let id = zstd::zstd_safe::get_dict_id_from_dict(&bytes)
            .ok_or(DictionaryError::NotADictionary)?
            .get();
        let decoder = DecoderDictionary::copy(&bytes);
        Ok(ZstdDictionary {
            id,
            bytes: bytes.into(),
            decoder,
        })
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn decoder(&self) -> &DecoderDictionary<'static> {
        &self.decoder
    }
}

/// The dictionary a zstd frame was compressed with, by the id in its header; `None` for a frame
/// without one (or bytes that are not a zstd frame).
pub fn frame_dictionary_id(frame: &[u8]) -> Option<u32> {
    zstd::zstd_safe::get_dict_id_from_frame(frame).map(|id| id.get())
}

/// Trains a dictionary of at most `max_bytes` on `samples` (records, one per sample). zstd
/// wants a few hundred samples and about a hundred times the dictionary's size in all.
pub fn train(samples: &[&[u8]], max_bytes: usize) -> Result<ZstdDictionary, DictionaryError> {
    let bytes = zstd::dict::from_samples(samples, max_bytes)
        .map_err(|e| DictionaryError::Training(e.to_string()))?;
    ZstdDictionary::new(bytes)
}

/// The dictionaries of one stream.
#[derive(Debug, Clone, Default)]
pub struct Dictionaries {
    current: Option<Arc<ZstdDictionary>>,
    all: Vec<Arc<ZstdDictionary>>,
}

impl Dictionaries {
    /// The dictionary agents compress with (`<stream>.zdict`).
    pub fn current(&self) -> Option<&Arc<ZstdDictionary>> {
        self.current.as_ref()
    }

    /// Any of the stream's dictionaries, current or retired, by id.
    pub fn get(&self, id: u32) -> Option<&Arc<ZstdDictionary>> {
        self.all.iter().find(|d| d.id == id)
    }

    pub fn ids(&self) -> Vec<u32> {
        self.all.iter().map(|d| d.id).collect()
    }

    /// Adds a dictionary; `current` makes it the one to compress with. Two dictionaries of a
    /// stream with the same id, or two current ones, are an error.
    pub fn add(&mut self, dictionary: ZstdDictionary, current: bool) -> Result<(), String> {
        if self.get(dictionary.id).is_some() {
            return Err(format!(
                "two dictionaries with id {} (a frame could not tell them apart)",
                dictionary.id
            ));
        }
        if current && self.current.is_some() {
            return Err("two current dictionaries".into());
        }
        let dictionary = Arc::new(dictionary);
        if current {
            self.current = Some(dictionary.clone());
        }
        self.all.push(dictionary);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readings(n: usize, seed: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| {
                let k = i + seed;
                format!(
                    r#"{{"device_id":"dev-{:05}","sensor":"{}","ts":{},"value":{}.{},"unit":"degC","quality":192}}"#,
                    k % 50,
                    ["temperature", "pressure", "vibration"][k % 3],
                    1_767_225_600_000u64 + k as u64 * 10,
                    k % 90,
                    k % 1000
                )
                .into_bytes()
            })
            .collect()
    }

    fn trained() -> ZstdDictionary {
        let samples = readings(2_000, 0);
        let samples: Vec<&[u8]> = samples.iter().map(Vec::as_slice).collect();
        train(&samples, 4096).unwrap()
    }

    #[test]
    fn a_trained_dictionary_shrinks_small_batches_and_frames_name_it() {
        let dictionary = trained();
        assert_ne!(dictionary.id(), 0);
        // Ten records never seen in training.
        let batch = readings(10, 77_777).join(&b'\n');
        let plain = zstd::bulk::compress(&batch, 3).unwrap();
        let with = zstd::bulk::Compressor::with_dictionary(3, dictionary.bytes())
            .unwrap()
            .compress(&batch)
            .unwrap();
        assert!(
            with.len() * 4 < plain.len() * 3,
            "{} bytes with the dictionary, {} without",
            with.len(),
            plain.len()
        );
        assert_eq!(frame_dictionary_id(&with), Some(dictionary.id()));
        assert_eq!(frame_dictionary_id(&plain), None);
        let back = zstd::bulk::Decompressor::with_prepared_dictionary(dictionary.decoder())
            .unwrap()
            .decompress(&with, batch.len())
            .unwrap();
        assert_eq!(back, batch);
    }

    #[test]
    fn bytes_without_a_dictionary_header_are_refused() {
        assert_eq!(
            ZstdDictionary::new(b"just some text".to_vec()).unwrap_err(),
            DictionaryError::NotADictionary
        );
        assert!(ZstdDictionary::new(Vec::new()).is_err());
    }

    #[test]
    fn a_stream_has_one_current_dictionary_and_unique_ids() {
        let mut dictionaries = Dictionaries::default();
        let dictionary = trained();
        let id = dictionary.id();
        dictionaries.add(dictionary, true).unwrap();
        assert_eq!(dictionaries.current().map(|d| d.id()), Some(id));
        assert_eq!(dictionaries.get(id).map(|d| d.id()), Some(id));
        assert!(dictionaries.get(id ^ 1).is_none());
        let again = ZstdDictionary::new(dictionaries.get(id).unwrap().bytes().to_vec()).unwrap();
        assert!(
            dictionaries
                .add(again, false)
                .unwrap_err()
                .contains("two dictionaries")
        );
        let samples = readings(2_000, 5);
        let samples: Vec<&[u8]> = samples.iter().map(Vec::as_slice).collect();
        let other = train(&samples, 2048).unwrap();
        assert!(
            dictionaries
                .add(other, true)
                .unwrap_err()
                .contains("two current")
        );
    }
}
