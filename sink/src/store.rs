//! Object store backends: a local directory and S3. Both create objects only if absent, which
//! is what makes deterministic keys safe under retries, restarts and rebalances.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use thiserror::Error;

use crate::config::StoreConfig;

/// Whether a conditional create made the object or found it there already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Created,
    AlreadyExists,
}

#[derive(Debug, Error)]
#[error("{message}")]
pub struct StoreError {
    /// Worth trying again (network, throttling, 5xx); otherwise a configuration problem.
    pub retryable: bool,
    pub message: String,
}

impl StoreError {
    fn retryable(message: impl Into<String>) -> StoreError {
        StoreError {
            retryable: true,
            message: message.into(),
        }
    }
}

#[derive(Debug, Clone)]
pub enum ObjectStore {
    Local(PathBuf),
    S3 {
        client: aws_sdk_s3::Client,
        bucket: String,
    },
}

impl ObjectStore {
    pub async fn from_config(config: &StoreConfig) -> Result<ObjectStore, StoreError> {
        Ok(match config {
            StoreConfig::Local { path } => {
                std::fs::create_dir_all(path).map_err(|e| StoreError {
                    retryable: false,
                    message: format!("cannot create {}: {e}", path.display()),
                })?;
                ObjectStore::Local(path.clone())
            }
            StoreConfig::S3 {
                bucket,
                endpoint,
                region,
                force_path_style,
            } => {
                let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
                if let Some(endpoint) = endpoint {
                    loader = loader.endpoint_url(endpoint);
                }
                if let Some(region) = region {
                    loader = loader.region(aws_config::Region::new(region.clone()));
                }
                let shared = loader.load().await;
                let mut builder =
                    aws_sdk_s3::config::Builder::from(&shared).force_path_style(*force_path_style);
                if shared.region().is_none() {
                    builder = builder.region(aws_config::Region::new("us-east-1"));
                }
                ObjectStore::S3 {
                    client: aws_sdk_s3::Client::from_conf(builder.build()),
                    bucket: bucket.clone(),
                }
            }
        })
    }

    /// A short description for logs.
    pub fn describe(&self) -> String {
        match self {
            ObjectStore::Local(p) => format!("directory {}", p.display()),
            ObjectStore::S3 { bucket, .. } => format!("s3://{bucket}"),
        }
    }

    /// Creates `key` with `data` unless an object with that key exists.
    pub async fn put_if_absent(&self, key: &str, data: Bytes) -> Result<PutOutcome, StoreError> {
        match self {
            ObjectStore::Local(root) => {
                let path = root.join(key);
                tokio::task::spawn_blocking(move || local_put_if_absent(&path, &data))
                    .await
                    .map_err(|e| StoreError::retryable(e.to_string()))?
            }
            ObjectStore::S3 { client, bucket } => {
                let result = client
                    .put_object()
                    .bucket(bucket)
                    .key(key)
                    .if_none_match("*")
                    .content_type(if key.ends_with(".parquet") {
                        "application/vnd.apache.parquet"
                    } else {
                        "application/x-ndjson"
                    })
                    .body(ByteStream::from(data))
                    .send()
                    .await;
                match result {
                    Ok(_) => Ok(PutOutcome::Created),
                    Err(SdkError::ServiceError(e))
                        if matches!(e.raw().status().as_u16(), 412 | 409) =>
                    {
                        Ok(PutOutcome::AlreadyExists)
                    }
                    Err(e) => Err(s3_error("put", key, e)),
                }
            }
        }
    }

    /// Keys under `prefix` (which ends with `/`), in any order.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        match self {
            ObjectStore::Local(root) => {
                let (root, prefix) = (root.clone(), prefix.to_owned());
                tokio::task::spawn_blocking(move || {
                    let mut out = Vec::new();
                    let mut stack = vec![root.join(&prefix)];
                    while let Some(dir) = stack.pop() {
                        let entries = match std::fs::read_dir(&dir) {
                            Ok(e) => e,
                            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                            Err(e) => {
                                return Err(StoreError::retryable(format!(
                                    "list {}: {e}",
                                    dir.display()
                                )));
                            }
                        };
                        for entry in entries.flatten() {
                            let path = entry.path();
                            if path.is_dir() {
                                stack.push(path);
                            } else if let Ok(rel) = path.strip_prefix(&root) {
                                out.push(rel.to_string_lossy().into_owned());
                            }
                        }
                    }
                    Ok(out)
                })
                .await
                .map_err(|e| StoreError::retryable(e.to_string()))?
            }
            ObjectStore::S3 { client, bucket } => {
                let mut out = Vec::new();
                let mut pages = client
                    .list_objects_v2()
                    .bucket(bucket)
                    .prefix(prefix)
                    .into_paginator()
                    .send();
                while let Some(page) = pages.next().await {
                    let page = page.map_err(|e| s3_error("list", prefix, e))?;
                    out.extend(
                        page.contents()
                            .iter()
                            .filter_map(|o| o.key().map(str::to_owned)),
                    );
                }
                Ok(out)
            }
        }
    }

    /// Reads a whole object; `None` when it does not exist.
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>, StoreError> {
        match self {
            ObjectStore::Local(root) => {
                let path = root.join(key);
                match tokio::fs::read(&path).await {
                    Ok(data) => Ok(Some(Bytes::from(data))),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(StoreError::retryable(format!(
                        "read {}: {e}",
                        path.display()
                    ))),
                }
            }
            ObjectStore::S3 { client, bucket } => {
                match client.get_object().bucket(bucket).key(key).send().await {
                    Ok(out) => {
                        let body = out.body.collect().await.map_err(|e| {
                            StoreError::retryable(format!("read s3://{bucket}/{key}: {e}"))
                        })?;
                        Ok(Some(body.into_bytes()))
                    }
                    Err(SdkError::ServiceError(e)) if e.raw().status().as_u16() == 404 => Ok(None),
                    Err(e) => Err(s3_error("get", key, e)),
                }
            }
        }
    }
}

fn s3_error<E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static>(
    op: &str,
    key: &str,
    e: SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
) -> StoreError {
    let (retryable, detail) = match &e {
        SdkError::ServiceError(se) => {
            let status = se.raw().status().as_u16();
            let code = se.err().code().unwrap_or("unknown");
            (
                status >= 500 || status == 429 || code == "SlowDown",
                format!("{status} {code}"),
            )
        }
        SdkError::ConstructionFailure(_) => (false, format!("{e:?}")),
        _ => (true, aws_sdk_s3::error::DisplayErrorContext(&e).to_string()),
    };
    StoreError {
        retryable,
        message: format!("s3 {op} {key}: {detail}"),
    }
}

/// Writes to a temporary file in the target directory, fsyncs it, hard-links it to the final
/// name (which fails if the name exists: an atomic create-if-absent) and fsyncs the directory.
fn local_put_if_absent(path: &Path, data: &[u8]) -> Result<PutOutcome, StoreError> {
    let io = |what: &str, e: std::io::Error| {
        StoreError::retryable(format!("{what} {}: {e}", path.display()))
    };
    let dir = path
        .parent()
        .ok_or_else(|| StoreError::retryable("object key has no directory"))?;
    std::fs::create_dir_all(dir).map_err(|e| io("create directory for", e))?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .tempfile_in(dir)
        .map_err(|e| io("create temporary file for", e))?;
    tmp.write_all(data).map_err(|e| io("write", e))?;
    tmp.as_file().sync_all().map_err(|e| io("fsync", e))?;
    let outcome = match std::fs::hard_link(tmp.path(), path) {
        Ok(()) => PutOutcome::Created,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => PutOutcome::AlreadyExists,
        Err(e) => return Err(io("link", e)),
    };
    drop(tmp);
    if outcome == PutOutcome::Created {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io("fsync directory of", e))?;
    }
    Ok(outcome)
}

/// Backoff for retryable store errors: 200 ms doubling up to 30 s.
pub fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(200u64.saturating_mul(1 << attempt.min(8))).min(Duration::from_secs(30))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn local_store_creates_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = ObjectStore::Local(dir.path().to_path_buf());
        let key = "landing/s/date=2024-01-01/hour=00/s-p0-o00000000000000000000.parquet";
        let first = store
            .put_if_absent(key, Bytes::from_static(b"one"))
            .await
            .unwrap();
        let second = store
            .put_if_absent(key, Bytes::from_static(b"two"))
            .await
            .unwrap();
        assert_eq!(
            (first, second),
            (PutOutcome::Created, PutOutcome::AlreadyExists)
        );
        assert_eq!(
            store.get(key).await.unwrap().unwrap(),
            Bytes::from_static(b"one")
        );
        assert!(store.get("landing/none").await.unwrap().is_none());
        let leftovers: Vec<_> = std::fs::read_dir(dir.path().join(key).parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            leftovers.len(),
            1,
            "temporary files were left behind: {leftovers:?}"
        );
    }
}
