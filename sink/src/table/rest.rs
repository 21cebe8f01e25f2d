//! A REST catalog (the Iceberg REST catalog protocol: Polaris, Lakekeeper, Nessie, Gravitino,
//! and the REST endpoints of Glue and S3 Tables behind a signing proxy).
//!
//! The sink writes a table's data files, manifests and manifest lists itself, as with a SQL
//! catalog; the catalog server writes the metadata files. A new table is registered from a
//! first metadata file the sink writes (so the field ids are the ones in the Parquet files,
//! not ids the server would assign). A commit sends the difference between the metadata it
//! was built on and the one it makes as the protocol's updates, with requirements that the
//! table is the same table and its `main` branch still at the snapshot the commit was built
//! on: of two writers building on the same snapshot the server takes one and answers the other
//! with 409, and that one builds again.
//!
//! Credentials: a bearer token from a file (read again for every request, so a token rotated on
//! disk is taken up) or `table.token` (`SINK_TABLE__TOKEN`), or an OAuth2 client id and secret
//! (`client_id:client_secret`) from a file or `table.credential` (`SINK_TABLE__CREDENTIAL`),
//! exchanged for a token at the catalog's token endpoint (and again when the catalog answers
//! 401).

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use iceberg::spec::{SnapshotReference, SnapshotRetention, TableMetadata};
use iceberg::{TableRequirement, TableUpdate};
use serde::Deserialize;
use service_kit::config::secret;
use tokio::sync::Mutex;

use super::TableConfig;

pub use super::config::is_rest;

enum Auth {
    None,
    /// A bearer token from a file, read for each request.
    TokenFile(std::path::PathBuf),
    Token(String),
    /// OAuth2 client credentials, the token they were exchanged for last.
    Client {
        endpoint: String,
        id: String,
        secret: String,
        scope: String,
        token: Mutex<Option<String>>,
    },
}

/// A REST catalog: its endpoint with the prefix its configuration gives, and how requests
/// authenticate.
pub struct RestCatalog {
    http: reqwest::Client,
    /// `<uri>/v1/<prefix>`.
    base: String,
    auth: Auth,
}

impl std::fmt::Debug for RestCatalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestCatalog")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

/// What a catalog answered, read far enough to act on.
struct Answer {
    status: reqwest::StatusCode,
    body: bytes::Bytes,
}

impl Answer {
    /// The error the catalog gave (its `error.message`), or the body as text.
    fn message(&self) -> String {
        #[derive(Deserialize)]
        struct Body {
            error: Inner,
        }
        #[derive(Deserialize)]
        struct Inner {
            message: String,
        }
        match serde_json::from_slice::<Body>(&self.body) {
            Ok(b) => b.error.message,
            Err(_) => String::from_utf8_lossy(&self.body[..self.body.len().min(500)]).into_owned(),
        }
    }

    fn fail(&self, what: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "the REST catalog answered {} to {what}: {}",
            self.status,
            self.message()
        )
    }
}

/// A table as the catalog gives it: where its current metadata file is, and the metadata.
#[derive(Deserialize)]
struct LoadTable {
    #[serde(rename = "metadata-location")]
    metadata_location: Option<String>,
    metadata: TableMetadata,
}

/// A name (a namespace of one level, a table) as one path segment.
fn segment(name: &str) -> String {
    url::form_urlencoded::byte_serialize(name.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

impl RestCatalog {
    /// Reads the catalog's configuration (its prefix for `table.warehouse`) and checks that the
    /// credentials are taken.
    pub async fn connect(config: &TableConfig) -> anyhow::Result<RestCatalog> {
        let uri = config.catalog.trim_end_matches('/').to_owned();
        let auth = auth_of(config, &uri)?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(60))
            .build()?;
        let mut catalog = RestCatalog {
            http,
            base: format!("{uri}/v1"),
            auth,
        };
        let mut path = "/config".to_owned();
        if let Some(warehouse) = &config.warehouse {
            path = format!("/config?warehouse={}", segment(warehouse));
        }
        let answer = catalog
            .send(reqwest::Method::GET, &path, None)
            .await
            .with_context(|| format!("cannot read the configuration of the REST catalog {uri}"))?;
        if !answer.status.is_success() {
            return Err(answer.fail("GET /v1/config"));
        }
        #[derive(Deserialize, Default)]
        struct Config {
            #[serde(default)]
            defaults: HashMap<String, String>,
            #[serde(default)]
            overrides: HashMap<String, String>,
        }
        let served: Config = serde_json::from_slice(&answer.body)
            .context("the REST catalog's configuration is not what the protocol says")?;
        let prefix = served
            .overrides
            .get("prefix")
            .or_else(|| served.defaults.get("prefix"));
        if let Some(prefix) = prefix.filter(|p| !p.is_empty()) {
            catalog.base = format!("{uri}/v1/{}", prefix.trim_matches('/'));
        }
        Ok(catalog)
    }

    /// Sends one request, with a new OAuth2 token and once more when the catalog answers 401.
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> anyhow::Result<Answer> {
        let mut fresh = false;
        loop {
            let mut request = self
                .http
                .request(method.clone(), format!("{}{path}", self.base));
            if let Some(token) = self.token(fresh).await? {
                request = request.bearer_auth(token);
            }
            if let Some(body) = &body {
                request = request
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(body.clone());
            }
            let response = request.send().await?;
            let status = response.status();
            let body = response.bytes().await?;
            if status == reqwest::StatusCode::UNAUTHORIZED
                && !fresh
                && matches!(self.auth, Auth::Client { .. })
            {
                fresh = true;
                continue;
            }
            return Ok(Answer { status, body });
        }
    }

    /// The bearer token for the next request; `fresh` exchanges the client credentials again.
    async fn token(&self, fresh: bool) -> anyhow::Result<Option<String>> {
        match &self.auth {
            Auth::None => Ok(None),
            Auth::Token(token) => Ok(Some(token.clone())),
            Auth::TokenFile(path) => {
                let token = tokio::fs::read_to_string(path).await.with_context(|| {
                    format!("cannot read the catalog token file {}", path.display())
                })?;
                Ok(Some(token.trim().to_owned()))
            }
            Auth::Client {
                endpoint,
                id,
                secret,
                scope,
                token,
            } => {
                let mut token = token.lock().await;
                if fresh || token.is_none() {
                    *token = Some(self.exchange(endpoint, id, secret, scope).await?);
                }
                Ok(token.clone())
            }
        }
    }

    /// Exchanges client credentials for a token (OAuth2's client credentials grant).
    async fn exchange(
        &self,
        endpoint: &str,
        id: &str,
        secret: &str,
        scope: &str,
    ) -> anyhow::Result<String> {
        let form = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("grant_type", "client_credentials")
            .append_pair("client_id", id)
            .append_pair("client_secret", secret)
            .append_pair("scope", scope)
            .finish();
        let response = self
            .http
            .post(endpoint)
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .body(form)
            .send()
            .await
            .with_context(|| format!("cannot reach the catalog's token endpoint {endpoint}"))?;
        let status = response.status();
        let body = response.bytes().await?;
        if !status.is_success() {
            #[derive(Deserialize)]
            struct Refusal {
                error: String,
                error_description: Option<String>,
            }
            let why = serde_json::from_slice::<Refusal>(&body)
                .map(|r| format!("{} {}", r.error, r.error_description.unwrap_or_default()))
                .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned());
            anyhow::bail!(
                "the catalog's token endpoint {endpoint} refused the client credentials of {id}: {status} {}",
                why.trim()
            );
        }
        #[derive(Deserialize)]
        struct Granted {
            access_token: String,
        }
        Ok(serde_json::from_slice::<Granted>(&body)
            .context("the token endpoint's answer has no access_token")?
            .access_token)
    }

    /// Makes `namespace` exist.
    pub async fn create_namespace(&self, namespace: &str) -> anyhow::Result<()> {
        let path = format!("/namespaces/{}", segment(namespace));
        let answer = self.send(reqwest::Method::GET, &path, None).await?;
        if answer.status.is_success() {
            return Ok(());
        }
        if answer.status != reqwest::StatusCode::NOT_FOUND {
            return Err(answer.fail(&format!("GET {path}")));
        }
        // Refused as existing: another sink created it first.
        self.post(
            "/namespaces",
            serde_json::json!({ "namespace": [namespace] }),
        )
        .await
        .map(drop)
    }

    /// POSTs `body` to `path`: `true` when the catalog took it, `false` when it answered 409
    /// (the name exists, or the table moved on), an error for any other answer.
    async fn post(&self, path: &str, body: serde_json::Value) -> anyhow::Result<bool> {
        let body = serde_json::to_vec(&body)?;
        let answer = self.send(reqwest::Method::POST, path, Some(body)).await?;
        if answer.status == reqwest::StatusCode::CONFLICT {
            tracing::debug!(path, reason = answer.message(), "REST catalog answered 409");
            return Ok(false);
        }
        if !answer.status.is_success() {
            return Err(answer.fail(&format!("POST {path}")));
        }
        Ok(true)
    }

    /// The table's current metadata location and metadata; `None` when there is no such
    /// table.
    pub async fn load(
        &self,
        namespace: &str,
        table: &str,
    ) -> anyhow::Result<Option<(String, TableMetadata)>> {
        let path = table_path(namespace, table);
        let answer = self.send(reqwest::Method::GET, &path, None).await?;
        if answer.status == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !answer.status.is_success() {
            return Err(answer.fail(&format!("GET {path}")));
        }
        let loaded: LoadTable = serde_json::from_slice(&answer.body).with_context(|| {
            format!("cannot read the table {namespace}.{table} the catalog gave")
        })?;
        Ok(Some((
            loaded.metadata_location.unwrap_or_default(),
            loaded.metadata,
        )))
    }

    /// Registers a table whose first metadata file the sink wrote at `metadata_location`;
    /// `false` when the catalog has a table of that name already.
    pub async fn register(
        &self,
        namespace: &str,
        table: &str,
        metadata_location: &str,
    ) -> anyhow::Result<bool> {
        let path = format!("/namespaces/{}/register", segment(namespace));
        let body = serde_json::json!({
            "name": table,
            "metadata-location": metadata_location,
        });
        self.post(&path, body).await
    }

    /// Commits `new`, built on `base`; `false` when the table moved on meanwhile (409). Any
    /// other failure is an error: when the server may have applied it (a 5xx), the next
    /// commit finds the files in the table by its offsets and does not add them again.
    pub async fn commit(
        &self,
        namespace: &str,
        table: &str,
        base: &TableMetadata,
        new: &TableMetadata,
    ) -> anyhow::Result<bool> {
        let (requirements, updates) = changes(base, new);
        let body = serde_json::json!({
            "identifier": { "namespace": [namespace], "name": table },
            "requirements": requirements,
            "updates": updates,
        });
        self.post(&table_path(namespace, table), body).await
    }
}

/// A table's path under the catalog's prefix.
fn table_path(namespace: &str, table: &str) -> String {
    format!(
        "/namespaces/{}/tables/{}",
        segment(namespace),
        segment(table)
    )
}

/// How requests to the catalog at `uri` authenticate, from the config and the environment.
fn auth_of(config: &TableConfig, uri: &str) -> anyhow::Result<Auth> {
    let credential = secret::resolve(
        config.credential.as_ref(),
        config.credential_file.as_deref().map(Path::new),
        "table.credential",
    )?;
    if let Some(credential) = credential {
        let (id, secret) = credential.expose().split_once(':').context(
            "table.credential (or the file of table.credential_file) must be client_id:client_secret",
        )?;
        return Ok(Auth::Client {
            endpoint: config
                .oauth2_uri
                .clone()
                .unwrap_or_else(|| format!("{uri}/v1/oauth/tokens")),
            id: id.to_owned(),
            secret: secret.to_owned(),
            scope: config.oauth2_scope.clone(),
            token: Mutex::new(None),
        });
    }
    match (&config.token, &config.token_file) {
        (Some(_), Some(_)) => anyhow::bail!("give table.token or table.token_file, not both"),
        (None, Some(path)) => Ok(Auth::TokenFile(path.into())),
        (Some(token), None) => Ok(Auth::Token(token.expose().to_owned())),
        (None, None) => Ok(Auth::None),
    }
}

/// The protocol's requirements and updates that take a table from `base` to `new`: the
/// schemas, properties and snapshots `new` adds, the snapshots it expires and where its `main`
/// branch points; required, that the table is `base`'s and its `main` still at `base`'s
/// snapshot (and its schema still `base`'s when the commit adds one).
pub fn changes(
    base: &TableMetadata,
    new: &TableMetadata,
) -> (Vec<TableRequirement>, Vec<TableUpdate>) {
    let mut requirements = vec![
        TableRequirement::UuidMatch { uuid: base.uuid() },
        TableRequirement::RefSnapshotIdMatch {
            r#ref: "main".into(),
            snapshot_id: base.current_snapshot_id(),
        },
    ];
    let mut updates = Vec::new();
    for schema in new.schemas_iter() {
        if base.schema_by_id(schema.schema_id()).is_none() {
            updates.push(TableUpdate::AddSchema {
                schema: schema.as_ref().clone(),
            });
        }
    }
    if new.current_schema_id() != base.current_schema_id() {
        requirements.push(TableRequirement::CurrentSchemaIdMatch {
            current_schema_id: base.current_schema_id(),
        });
        requirements.push(TableRequirement::LastAssignedFieldIdMatch {
            last_assigned_field_id: base.last_column_id(),
        });
        updates.push(TableUpdate::SetCurrentSchema {
            schema_id: new.current_schema_id(),
        });
    }
    let changed: HashMap<String, String> = new
        .properties()
        .iter()
        .filter(|(k, v)| base.properties().get(*k) != Some(v))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if !changed.is_empty() {
        updates.push(TableUpdate::SetProperties { updates: changed });
    }
    let removed: Vec<String> = base
        .properties()
        .keys()
        .filter(|k| !new.properties().contains_key(*k))
        .cloned()
        .collect();
    if !removed.is_empty() {
        updates.push(TableUpdate::RemoveProperties { removals: removed });
    }
    let mut added: Vec<_> = new
        .snapshots()
        .filter(|s| base.snapshot_by_id(s.snapshot_id()).is_none())
        .collect();
    added.sort_by_key(|s| s.sequence_number());
    for snapshot in added {
        updates.push(TableUpdate::AddSnapshot {
            snapshot: snapshot.as_ref().clone(),
        });
    }
    if let Some(id) = new.current_snapshot_id()
        && Some(id) != base.current_snapshot_id()
    {
        updates.push(TableUpdate::SetSnapshotRef {
            ref_name: "main".into(),
            reference: SnapshotReference {
                snapshot_id: id,
                retention: SnapshotRetention::Branch {
                    min_snapshots_to_keep: None,
                    max_snapshot_age_ms: None,
                    max_ref_age_ms: None,
                },
            },
        });
    }
    let expired: Vec<i64> = base
        .snapshots()
        .map(|s| s.snapshot_id())
        .filter(|&id| new.snapshot_by_id(id).is_none())
        .collect();
    if !expired.is_empty() {
        updates.push(TableUpdate::RemoveSnapshots {
            snapshot_ids: expired,
        });
    }
    (requirements, updates)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rest_settings_are_refused_for_a_sql_catalog() {
        let mut config = TableConfig::new("/var/lib/catalog.db".into());
        config.check().unwrap();
        config.credential_file = Some("/etc/credential".into());
        let e = config.check().unwrap_err().to_string();
        assert!(
            e.contains("table.credential_file is for a REST catalog"),
            "{e}"
        );
        config.catalog = "https://catalog.example/api/catalog".into();
        config.check().unwrap();
    }

    /// A commit that adds a snapshot and a schema to a table with one: the updates add both,
    /// point `main` at the new snapshot, and require `main` and the schema to be where they were.
    #[test]
    fn a_commit_sends_what_it_adds_and_requires_what_it_built_on() {
        let streams = schemas::example_streams();
        let def = streams.get("sensor_readings").unwrap();
        let hash = schemas::arrow::HashColumn::None;
        let base =
            super::super::metadata::create(def, hash, "file:///t", super::super::Partitioning::Day)
                .unwrap();
        let mut wider = def.as_ref().clone();
        wider.version += 1;
        wider.fields.push(schemas::FieldDef {
            name: "humidity".into(),
            ty: schemas::FieldType::Float64,
            required: false,
            doc: String::new(),
        });
        let evolved = super::super::metadata::evolved(&base, &wider, hash)
            .unwrap()
            .unwrap();
        let (requirements, updates) = changes(&base, &evolved);
        let json = serde_json::to_value((&requirements, &updates)).unwrap();
        // What each requirement or update is: its "type" or "action".
        let each = |list: &serde_json::Value, key: &str| -> Vec<String> {
            list.as_array()
                .unwrap()
                .iter()
                .map(|item| item[key].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(
            each(&json[1], "action"),
            ["add-schema", "set-current-schema", "set-properties"]
        );
        assert_eq!(
            each(&json[0], "type"),
            [
                "assert-table-uuid",
                "assert-ref-snapshot-id",
                "assert-current-schema-id",
                "assert-last-assigned-field-id"
            ]
        );
        assert_eq!(json[0][1]["snapshot-id"], serde_json::Value::Null);
        assert!(changes(&base, &base).1.is_empty());
    }
}
