//! Parse, validate, dedupe, batch and compress: the CPU side of the agent, run off the reactor.

use std::sync::Arc;

use schemas::window::HashWindow;
use schemas::wire::encode_value;
use schemas::{RecordError, StreamDef};

use crate::config::BatchConfig;

/// A closed, compressed batch ready to send.
#[derive(Debug, Clone)]
pub struct Batch {
    pub stream: String,
    /// zstd-compressed NDJSON.
    pub body: Vec<u8>,
    /// BLAKE3 of the uncompressed NDJSON, sent as `Idempotency-Key`.
    pub id: String,
    pub records: usize,
    pub raw_bytes: usize,
}

/// Counters of one pipeline.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PipelineStats {
    pub read: u64,
    pub invalid: u64,
    pub duplicates: u64,
    pub batched: u64,
}

pub struct Pipeline {
    def: Arc<StreamDef>,
    config: BatchConfig,
    window: HashWindow,
    buf: Vec<u8>,
    records: usize,
    pub stats: PipelineStats,
}

impl Pipeline {
    pub fn new(def: Arc<StreamDef>, config: BatchConfig, dedupe_window: usize) -> Pipeline {
        Pipeline {
            def,
            config,
            window: HashWindow::new(dedupe_window),
            buf: Vec::new(),
            records: 0,
            stats: PipelineStats::default(),
        }
    }

    /// Adds one NDJSON line. Returns a batch when this line closed one.
    pub fn push_line(&mut self, line: &[u8]) -> Result<Option<Batch>, RecordError> {
        self.stats.read += 1;
        let checked = schemas::check_bytes(&self.def, line);
        let valid = match checked {
            Ok(v) => v,
            Err(e) => {
                self.stats.invalid += 1;
                return Err(e);
            }
        };
        if !self.window.insert(valid.hash) {
            self.stats.duplicates += 1;
            return Ok(None);
        }
        self.buf
            .extend_from_slice(&encode_value(&self.def, &valid.record));
        self.buf.push(b'\n');
        self.records += 1;
        self.stats.batched += 1;
        if self.records >= self.config.max_records || self.buf.len() >= self.config.max_bytes {
            return Ok(self.take_batch());
        }
        Ok(None)
    }

    /// Closes the open batch, if it holds anything.
    pub fn take_batch(&mut self) -> Option<Batch> {
        if self.records == 0 {
            return None;
        }
        let raw = std::mem::take(&mut self.buf);
        let records = std::mem::take(&mut self.records);
        let body = zstd::bulk::compress(&raw, self.config.zstd_level)
            .unwrap_or_else(|_| zstd::bulk::compress(&raw, 3).unwrap_or_default());
        Some(Batch {
            stream: self.def.name.clone(),
            id: blake3::hash(&raw).to_hex().to_string(),
            body,
            records,
            raw_bytes: raw.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipeline(max_records: usize) -> Pipeline {
        let def = schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone();
        let config = BatchConfig {
            max_records,
            ..BatchConfig::default()
        };
        Pipeline::new(def, config, 100)
    }

    fn line(i: usize) -> Vec<u8> {
        format!(r#"{{"device_id":"d","sensor":"s","ts":{i},"value":{i}}}"#).into_bytes()
    }

    #[test]
    fn batches_dedupes_and_ids_are_content_addressed() {
        let mut p = pipeline(2);
        assert!(p.push_line(&line(1)).unwrap().is_none());
        assert!(p.push_line(&line(1)).unwrap().is_none(), "duplicate");
        let b = p.push_line(&line(2)).unwrap().expect("closed at 2 records");
        assert_eq!(b.records, 2);
        assert!(p.push_line(b"{\"nope\":1}").is_err());
        assert_eq!(
            p.stats,
            PipelineStats {
                read: 4,
                invalid: 1,
                duplicates: 1,
                batched: 2
            }
        );
        let raw = zstd::decode_all(&b.body[..]).unwrap();
        assert_eq!(raw.len(), b.raw_bytes);
        assert_eq!(b.id, blake3::hash(&raw).to_hex().to_string());
        let mut q = pipeline(2);
        q.push_line(&line(1)).unwrap();
        let again = q.push_line(&line(2)).unwrap().unwrap();
        assert_eq!(again.id, b.id, "same records, same Idempotency-Key");
        assert!(p.take_batch().is_none());
    }
}
