//! Object store backends: a local directory and S3. Both create objects only if absent, which
//! is what makes deterministic keys safe under retries, restarts and rebalances.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{ServerSideEncryption, StorageClass};
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

/// A landing file being written: a temporary file in the store's staging directory.
pub type Staged = tempfile::NamedTempFile;

/// Smallest part S3 accepts (all parts but the last).
pub const MIN_PART_BYTES: usize = 5 << 20;

#[derive(Debug, Clone)]
pub enum ObjectStore {
    Local(PathBuf),
    S3 {
        client: aws_sdk_s3::Client,
        bucket: String,
        objects: ObjectSettings,
    },
}

/// What every object the sink creates in S3 is written with.
#[derive(Debug, Clone, Default)]
pub struct ObjectSettings {
    sse: Option<ServerSideEncryption>,
    kms_key_id: Option<String>,
    storage_class: Option<StorageClass>,
}

impl ObjectSettings {
    /// Checks the configured names against the ones S3 knows (a clear error at start rather
    /// than every upload refused).
    fn new(
        sse: Option<&str>,
        kms_key_id: Option<&str>,
        storage_class: Option<&str>,
    ) -> Result<ObjectSettings, StoreError> {
        let config_error = |message: String| StoreError {
            retryable: false,
            message,
        };
        let known = |value: &str, values: &[&str], key: &str| {
            if values.contains(&value) {
                Ok(())
            } else {
                Err(config_error(format!(
                    "store.{key} = {value:?} is not one of {}",
                    values.join(", ")
                )))
            }
        };
        if let Some(sse) = sse {
            known(
                sse,
                ServerSideEncryption::values(),
                "server_side_encryption",
            )?;
        }
        if let Some(class) = storage_class {
            known(class, StorageClass::values(), "storage_class")?;
        }
        if kms_key_id.is_some() && !sse.is_some_and(|s| s.starts_with("aws:kms")) {
            return Err(config_error(
                "store.kms_key_id needs server_side_encryption = \"aws:kms\" or \"aws:kms:dsse\""
                    .into(),
            ));
        }
        Ok(ObjectSettings {
            sse: sse.map(ServerSideEncryption::from),
            kms_key_id: kms_key_id.map(str::to_owned),
            storage_class: storage_class.map(StorageClass::from),
        })
    }
}

/// An HTTPS client (rustls) that trusts the PEM certificates in `path` and nothing else.
fn https_trusting(
    path: &std::path::Path,
) -> Result<aws_sdk_s3::config::SharedHttpClient, StoreError> {
    use aws_smithy_http_client::tls;
    let config_error = |message: String| StoreError {
        retryable: false,
        message,
    };
    let pem = std::fs::read(path)
        .map_err(|e| config_error(format!("cannot read ca_file {}: {e}", path.display())))?;
    service_kit::tls::certificates_in(&pem, path)
        .map_err(|e| config_error(format!("ca_file {e:#}")))?;
    let context = tls::TlsContext::builder()
        .with_trust_store(
            tls::TrustStore::empty()
                .with_native_roots(false)
                .with_pem_certificate(pem),
        )
        .build()
        .map_err(|e| config_error(format!("ca_file {}: {e}", path.display())))?;
    Ok(aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::AwsLc,
        ))
        .tls_context(context)
        .build_https())
}

/// Checks a store's settings as [`ObjectStore::from_config`] reads them, without creating
/// anything or contacting the store: the object settings, the CA file, the endpoint's URL.
pub fn check_config(config: &StoreConfig) -> Result<(), StoreError> {
    let StoreConfig::S3 {
        endpoint,
        ca_file,
        server_side_encryption,
        kms_key_id,
        storage_class,
        ..
    } = config
    else {
        return Ok(());
    };
    ObjectSettings::new(
        server_side_encryption.as_deref(),
        kms_key_id.as_deref(),
        storage_class.as_deref(),
    )?;
    if let Some(path) = ca_file {
        https_trusting(path)?;
    }
    if let Some(endpoint) = endpoint {
        check_endpoint(endpoint)?;
    }
    Ok(())
}

/// An endpoint without its scheme (`minio:9000`) is refused at start: the SDK would take it and
/// fail only at the first upload.
fn check_endpoint(endpoint: &str) -> Result<(), StoreError> {
    let scheme = endpoint.split_once("://").map(|(scheme, _)| scheme);
    if matches!(scheme, Some("http" | "https")) {
        return Ok(());
    }
    Err(StoreError {
        retryable: false,
        message: format!("store.endpoint {endpoint}: give http://host:port or https://host:port"),
    })
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
                ca_file,
                server_side_encryption,
                kms_key_id,
                storage_class,
            } => {
                let objects = ObjectSettings::new(
                    server_side_encryption.as_deref(),
                    kms_key_id.as_deref(),
                    storage_class.as_deref(),
                )?;
                let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
                if let Some(path) = ca_file {
                    loader = loader.http_client(https_trusting(path)?);
                }
                if let Some(endpoint) = endpoint {
                    check_endpoint(endpoint)?;
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
                    objects,
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

    /// The URI of the object at `key`, as a table lists it: `s3://bucket/key`, or
    /// `file:///key` under the directory's absolute path.
    pub fn uri(&self, key: &str) -> String {
        match self {
            ObjectStore::Local(root) => {
                let root = std::path::absolute(root).unwrap_or_else(|_| root.clone());
                format!(
                    "file://{}/{key}",
                    root.display().to_string().trim_end_matches('/')
                )
            }
            ObjectStore::S3 { bucket, .. } => format!("s3://{bucket}/{key}"),
        }
    }

    /// The key of an object by its URI ([`ObjectStore::uri`]); `None` for a URI elsewhere. A
    /// local file's URI may also have the form `file:/path` that Hadoop's file system writes
    /// (Spark's files and metadata in a local warehouse).
    pub fn key_of(&self, uri: &str) -> Option<String> {
        let base = self.uri("");
        if let ObjectStore::Local(_) = self
            && let Some(path) = uri.strip_prefix("file:")
            && !path.starts_with("//")
        {
            return format!("file://{path}")
                .strip_prefix(&base)
                .map(str::to_owned);
        }
        uri.strip_prefix(&base).map(str::to_owned)
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
            ObjectStore::S3 {
                client,
                bucket,
                objects,
            } => {
                let result = client
                    .put_object()
                    .bucket(bucket)
                    .key(key)
                    .if_none_match("*")
                    .set_server_side_encryption(objects.sse.clone())
                    .set_ssekms_key_id(objects.kms_key_id.clone())
                    .set_storage_class(objects.storage_class.clone())
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

    /// Where files are staged before they become objects. For a local store it is inside the
    /// store's root (same file system, so a file is linked into place, never copied).
    pub fn staging_dir(&self, configured: &Path) -> PathBuf {
        match self {
            ObjectStore::Local(root) => root.join(".staging"),
            ObjectStore::S3 { .. } => configured.to_path_buf(),
        }
    }

    /// Creates `key` from a staged file unless an object with that key exists. S3 objects of
    /// at least `part_bytes` go up as a multipart upload of equal `part_bytes` parts (the last
    /// may be shorter), completed with `If-None-Match: *`; a failed upload is aborted.
    pub async fn put_file_if_absent(
        &self,
        key: &str,
        staged: &Staged,
        part_bytes: usize,
    ) -> Result<PutOutcome, StoreError> {
        let io = |what: &str, e: std::io::Error| {
            StoreError::retryable(format!("{what} {}: {e}", staged.path().display()))
        };
        let size = staged
            .as_file()
            .metadata()
            .map_err(|e| io("stat", e))?
            .len();
        match self {
            ObjectStore::Local(root) => {
                let (from, to) = (staged.path().to_path_buf(), root.join(key));
                tokio::task::spawn_blocking(move || local_link_if_absent(&from, &to))
                    .await
                    .map_err(|e| StoreError::retryable(e.to_string()))?
            }
            ObjectStore::S3 { .. } if size < part_bytes.max(MIN_PART_BYTES) as u64 => {
                let data = StagedReader::open(staged)
                    .read(size as usize)
                    .await
                    .map_err(|e| io("read", e))?;
                self.put_if_absent(key, data).await
            }
            ObjectStore::S3 {
                client,
                bucket,
                objects,
            } => {
                let part_bytes = part_bytes.max(MIN_PART_BYTES);
                let created = client
                    .create_multipart_upload()
                    .bucket(bucket)
                    .key(key)
                    .set_server_side_encryption(objects.sse.clone())
                    .set_ssekms_key_id(objects.kms_key_id.clone())
                    .set_storage_class(objects.storage_class.clone())
                    .content_type("application/vnd.apache.parquet")
                    .send()
                    .await
                    .map_err(|e| s3_error("create multipart upload", key, e))?;
                let upload_id = created
                    .upload_id()
                    .ok_or_else(|| StoreError::retryable("multipart upload without an id"))?
                    .to_owned();
                let result = self
                    .upload_parts(key, &upload_id, staged, size, part_bytes)
                    .await;
                if !matches!(result, Ok(PutOutcome::Created)) {
                    // Also on a conflict: S3 keeps an upload whose completion failed.
                    self.abort_upload(key, &upload_id).await;
                }
                result
            }
        }
    }

    async fn upload_parts(
        &self,
        key: &str,
        upload_id: &str,
        staged: &Staged,
        size: u64,
        part_bytes: usize,
    ) -> Result<PutOutcome, StoreError> {
        let ObjectStore::S3 { client, bucket, .. } = self else {
            return Err(StoreError::retryable("not an S3 store"));
        };
        let mut parts = Vec::new();
        let mut reader = StagedReader::open(staged);
        let mut offset = 0u64;
        while offset < size {
            let len = part_bytes.min((size - offset) as usize);
            let data = reader.read(len).await.map_err(|e| {
                StoreError::retryable(format!("read {}: {e}", staged.path().display()))
            })?;
            let number = parts.len() as i32 + 1;
            let out = client
                .upload_part()
                .bucket(bucket)
                .key(key)
                .upload_id(upload_id)
                .part_number(number)
                .body(ByteStream::from(data))
                .send()
                .await
                .map_err(|e| s3_error("upload part", key, e))?;
            parts.push(
                aws_sdk_s3::types::CompletedPart::builder()
                    .part_number(number)
                    .set_e_tag(out.e_tag().map(str::to_owned))
                    .build(),
            );
            offset += len as u64;
        }
        let done = client
            .complete_multipart_upload()
            .bucket(bucket)
            .key(key)
            .upload_id(upload_id)
            .if_none_match("*")
            .multipart_upload(
                aws_sdk_s3::types::CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            )
            .send()
            .await;
        match done {
            Ok(_) => Ok(PutOutcome::Created),
            Err(SdkError::ServiceError(e)) if matches!(e.raw().status().as_u16(), 412 | 409) => {
                Ok(PutOutcome::AlreadyExists)
            }
            Err(e) => Err(s3_error("complete multipart upload", key, e)),
        }
    }

    async fn abort_upload(&self, key: &str, upload_id: &str) {
        let ObjectStore::S3 { client, bucket, .. } = self else {
            return;
        };
        let aborted = client
            .abort_multipart_upload()
            .bucket(bucket)
            .key(key)
            .upload_id(upload_id)
            .send()
            .await;
        if let Err(e) = aborted {
            tracing::warn!(key, upload_id, error = %s3_error("abort multipart upload", key, e), "cannot abort a multipart upload; the next sweep retries");
        }
    }

    /// Aborts multipart uploads under `prefix` started more than `older_than` ago: what a sink
    /// that crashed during an upload leaves behind (S3 bills their parts until aborted). A local
    /// store has none (its staged files are swept with the staging directory). Returns how many
    /// it removed.
    pub async fn sweep_abandoned(
        &self,
        prefix: &str,
        older_than: Duration,
    ) -> Result<usize, StoreError> {
        let cutoff = SystemTime::now()
            .checked_sub(older_than)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        match self {
            ObjectStore::Local(_) => Ok(0),
            ObjectStore::S3 { client, bucket, .. } => {
                let mut removed = 0;
                let (mut key_marker, mut id_marker) = (None::<String>, None::<String>);
                loop {
                    let page = client
                        .list_multipart_uploads()
                        .bucket(bucket)
                        .prefix(prefix)
                        .set_key_marker(key_marker.clone())
                        .set_upload_id_marker(id_marker.clone())
                        .send()
                        .await
                        .map_err(|e| s3_error("list multipart uploads", prefix, e))?;
                    for upload in page.uploads() {
                        let started = upload
                            .initiated()
                            .and_then(|t| SystemTime::try_from(*t).ok());
                        if let (Some(key), Some(id), Some(started)) =
                            (upload.key(), upload.upload_id(), started)
                            && started < cutoff
                        {
                            tracing::info!(
                                key,
                                upload_id = id,
                                "aborting an abandoned multipart upload"
                            );
                            self.abort_upload(key, id).await;
                            removed += 1;
                        }
                    }
                    if page.is_truncated() != Some(true) {
                        return Ok(removed);
                    }
                    key_marker = page.next_key_marker().map(str::to_owned);
                    id_marker = page.next_upload_id_marker().map(str::to_owned);
                    if key_marker.is_none() && id_marker.is_none() {
                        return Ok(removed);
                    }
                }
            }
        }
    }

    /// Keys under `prefix` (which ends with `/`), in any order.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let listed = self.list_objects(prefix, false).await?;
        Ok(listed.into_iter().map(|(key, _)| key).collect())
    }

    /// [`ObjectStore::list`] with the time each object appeared under its key, where the store
    /// tells: a local file's status change time (set when the sink moves a finished file into
    /// place), an S3 object's `Last-Modified` (for a multipart upload, when the upload began).
    pub async fn list_with_times(
        &self,
        prefix: &str,
    ) -> Result<Vec<(String, Option<SystemTime>)>, StoreError> {
        self.list_objects(prefix, true).await
    }

    async fn list_objects(
        &self,
        prefix: &str,
        times: bool,
    ) -> Result<Vec<(String, Option<SystemTime>)>, StoreError> {
        match self {
            ObjectStore::Local(root) => {
                let (root, prefix) = (root.clone(), prefix.to_owned());
                tokio::task::spawn_blocking(move || {
                    let mut out = Vec::new();
                    let mut stack = vec![root.join(&prefix)];
                    while let Some(dir) = stack.pop() {
                        let entries = match std::fs::read_dir(&dir) {
                            Ok(e) => e,
                            // No objects under the prefix, as S3 answers: nothing there, or a
                            // file where a folder of the prefix would be.
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::NotFound
                                        | std::io::ErrorKind::NotADirectory
                                ) =>
                            {
                                continue;
                            }
                            Err(e) => {
                                return Err(StoreError::retryable(format!(
                                    "list {}: {e}",
                                    dir.display()
                                )));
                            }
                        };
                        for entry in entries.flatten() {
                            let path = entry.path();
                            // The entry's type comes with it on most file systems (no stat),
                            // but a symbolic link is followed.
                            let is_dir = match entry.file_type() {
                                Ok(t) if !t.is_symlink() => t.is_dir(),
                                _ => path.is_dir(),
                            };
                            if is_dir {
                                stack.push(path);
                            } else if let Ok(rel) = path.strip_prefix(&root) {
                                let time = times
                                    .then(|| std::fs::metadata(&path).ok())
                                    .flatten()
                                    .and_then(|meta| changed_at(&meta));
                                out.push((rel.to_string_lossy().into_owned(), time));
                            }
                        }
                    }
                    Ok(out)
                })
                .await
                .map_err(|e| StoreError::retryable(e.to_string()))?
            }
            ObjectStore::S3 { client, bucket, .. } => {
                let mut out = Vec::new();
                let mut pages = client
                    .list_objects_v2()
                    .bucket(bucket)
                    .prefix(prefix)
                    .into_paginator()
                    .send();
                while let Some(page) = pages.next().await {
                    let page = page.map_err(|e| s3_error("list", prefix, e))?;
                    out.extend(page.contents().iter().filter_map(|o| {
                        let time = o
                            .last_modified()
                            .and_then(|t| SystemTime::try_from(*t).ok());
                        o.key().map(|key| (key.to_owned(), time))
                    }));
                }
                Ok(out)
            }
        }
    }

    /// Removes the object at `key` (nothing when there is none).
    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        match self {
            ObjectStore::Local(root) => match tokio::fs::remove_file(root.join(key)).await {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(StoreError::retryable(
                    format!("remove {}: {e}", root.join(key).display()),
                )),
                _ => Ok(()),
            },
            ObjectStore::S3 { client, bucket, .. } => {
                client
                    .delete_object()
                    .bucket(bucket)
                    .key(key)
                    .send()
                    .await
                    .map_err(|e| s3_error("delete", key, e))?;
                Ok(())
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
            ObjectStore::S3 { client, bucket, .. } => {
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

/// When a local file last changed status (its inode's ctime): a rename or link into place sets
/// it, unlike the modification time, which a rename keeps.
pub fn changed_at(meta: &std::fs::Metadata) -> Option<SystemTime> {
    use std::os::unix::fs::MetadataExt;
    let since_epoch = Duration::new(
        u64::try_from(meta.ctime()).ok()?,
        u32::try_from(meta.ctime_nsec()).ok()?,
    );
    SystemTime::UNIX_EPOCH.checked_add(since_epoch)
}

/// Which bytes of an object [`ObjectStore::get_range`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteRange {
    /// The last n bytes (all of a smaller object).
    Suffix(u64),
    /// From the first offset up to, not including, the second.
    Span(u64, u64),
}

impl ByteRange {
    /// The offsets it covers of an object of `size` bytes.
    fn within(self, size: u64) -> (u64, u64) {
        match self {
            ByteRange::Suffix(n) => (size.saturating_sub(n), size),
            ByteRange::Span(start, end) => (start.min(size), end.min(size)),
        }
    }

    /// The HTTP `Range` header of a non-empty range.
    fn header(self) -> String {
        match self {
            ByteRange::Suffix(n) => format!("bytes=-{n}"),
            ByteRange::Span(start, end) => format!("bytes={start}-{}", end.saturating_sub(1)),
        }
    }
}

impl ObjectStore {
    /// `range` of the object at `key`, and the object's size; `None` when there is no object.
    pub async fn get_range(
        &self,
        key: &str,
        range: ByteRange,
    ) -> Result<Option<(Bytes, u64)>, StoreError> {
        match self {
            ObjectStore::Local(root) => {
                let path = root.join(key);
                let read = tokio::task::spawn_blocking(move || {
                    use std::os::unix::fs::FileExt as _;
                    let file = std::fs::File::open(&path)?;
                    let size = file.metadata()?.len();
                    let (start, end) = range.within(size);
                    let mut data = vec![0; (end - start) as usize];
                    file.read_exact_at(&mut data, start)?;
                    Ok::<_, std::io::Error>((Bytes::from(data), size))
                })
                .await
                .map_err(|e| StoreError::retryable(format!("read {key}: {e}")))?;
                match read {
                    Ok(read) => Ok(Some(read)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(StoreError::retryable(format!("read {key}: {e}"))),
                }
            }
            ObjectStore::S3 { client, bucket, .. } => {
                let request = client
                    .get_object()
                    .bucket(bucket)
                    .key(key)
                    .range(range.header());
                match request.send().await {
                    Ok(out) => {
                        // "bytes 0-99/1234"; a server that sends the whole object has none.
                        let size = out
                            .content_range()
                            .and_then(|r| r.rsplit('/').next())
                            .and_then(|total| total.parse::<u64>().ok());
                        let body = out.body.collect().await.map_err(|e| {
                            StoreError::retryable(format!("read s3://{bucket}/{key}: {e}"))
                        })?;
                        let data = body.into_bytes();
                        let Some(size) = size else {
                            let whole = data.len() as u64;
                            let (start, end) = range.within(whole);
                            return Ok(Some((data.slice(start as usize..end as usize), whole)));
                        };
                        Ok(Some((data, size)))
                    }
                    Err(SdkError::ServiceError(e)) if e.raw().status().as_u16() == 404 => Ok(None),
                    // An empty object has no byte to give.
                    Err(SdkError::ServiceError(e)) if e.raw().status().as_u16() == 416 => {
                        Ok(Some((Bytes::new(), 0)))
                    }
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

/// Reads a staged file from its start, one piece after the other, on the blocking pool (parts
/// are megabytes: not work for the async reactor).
struct StagedReader {
    file: std::io::Result<std::fs::File>,
}

impl StagedReader {
    fn open(staged: &Staged) -> StagedReader {
        StagedReader {
            file: staged.reopen(),
        }
    }

    /// The next `len` bytes.
    async fn read(&mut self, len: usize) -> std::io::Result<Bytes> {
        let taken = std::mem::replace(&mut self.file, Err(std::io::ErrorKind::Other.into()));
        let mut file = taken?;
        let (file, data) = tokio::task::spawn_blocking(move || {
            let mut buf = vec![0; len];
            let read = file.read_exact(&mut buf).map(|()| Bytes::from(buf));
            (file, read)
        })
        .await
        .map_err(std::io::Error::other)?;
        self.file = Ok(file);
        data
    }
}

/// An I/O error on `path`, worth retrying.
fn io_error(path: &Path, what: &str, e: std::io::Error) -> StoreError {
    StoreError::retryable(format!("{what} {}: {e}", path.display()))
}

/// The directory of an object's path, created if missing.
fn object_dir(path: &Path) -> Result<&Path, StoreError> {
    let dir = path
        .parent()
        .ok_or_else(|| StoreError::retryable("object key has no directory"))?;
    std::fs::create_dir_all(dir).map_err(|e| io_error(path, "create directory for", e))?;
    Ok(dir)
}

/// Writes to a temporary file in the target directory, then links it into place.
fn local_put_if_absent(path: &Path, data: &[u8]) -> Result<PutOutcome, StoreError> {
    let io = |what: &str, e: std::io::Error| io_error(path, what, e);
    let dir = object_dir(path)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .tempfile_in(dir)
        .map_err(|e| io("create temporary file for", e))?;
    tmp.write_all(data).map_err(|e| io("write", e))?;
    local_link_if_absent(tmp.path(), path)
}

/// Fsyncs a temporary file, hard-links it to the final name (which fails if the name exists:
/// an atomic create-if-absent) and fsyncs the directory.
fn local_link_if_absent(from: &Path, path: &Path) -> Result<PutOutcome, StoreError> {
    let io = |what: &str, e: std::io::Error| io_error(path, what, e);
    let dir = object_dir(path)?;
    std::fs::File::open(from)
        .and_then(|f| f.sync_all())
        .map_err(|e| io("fsync", e))?;
    let outcome = match std::fs::hard_link(from, path) {
        Ok(()) => PutOutcome::Created,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => PutOutcome::AlreadyExists,
        Err(e) => return Err(io("link", e)),
    };
    if outcome == PutOutcome::Created {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io("fsync directory of", e))?;
    }
    Ok(outcome)
}

/// Backoff for retryable store errors: 200 ms doubling up to 30 s, with ±50 % jitter, so that
/// the sinks of a group do not all retry at once after an outage.
pub fn backoff(attempt: u32) -> Duration {
    service_kit::process::backoff(attempt, Duration::from_millis(200), Duration::from_secs(30))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_keys_are_found_by_either_form_of_file_uri() {
        let store = ObjectStore::Local(PathBuf::from("/var/lib/zone"));
        let key = "landing/s/data/f.parquet";
        assert_eq!(store.uri(key), format!("file:///var/lib/zone/{key}"));
        for uri in [store.uri(key), format!("file:/var/lib/zone/{key}")] {
            assert_eq!(store.key_of(&uri).as_deref(), Some(key), "{uri}");
        }
        assert_eq!(store.key_of("file:/var/lib/other/f.parquet"), None);
        assert_eq!(store.key_of("s3://bucket/f.parquet"), None);
    }

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
