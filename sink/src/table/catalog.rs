//! The catalog: which metadata file is each table's current one. A SQL catalog keeps that in
//! a SQLite file or a PostgreSQL database; a REST catalog ([`super::rest`]) is a server.
//!
//! The tables are those of the JDBC catalog that Spark, Trino, Flink and pyiceberg's
//! `SqlCatalog` read (`iceberg_tables`, `iceberg_namespace_properties`), so any of them opens the
//! same catalog by its URL and `catalog_name`. A commit is one conditional `UPDATE`: it moves a
//! table's metadata location only from the one the commit was built on, so of two writers
//! building on the same version one wins and the other builds again.

use anyhow::Context;
use iceberg::spec::TableMetadata;
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;

use super::TableConfig;
use super::metadata::Append;
use super::rest::{self, RestCatalog};
use crate::store::ObjectStore;

/// A table's version a commit builds on: its metadata and where the catalog says it is.
#[derive(Debug, Clone)]
pub struct Version {
    pub location: String,
    pub metadata: TableMetadata,
}

/// The catalog of `[table]`: SQL or REST.
#[derive(Debug)]
pub enum Catalog {
    Sql(SqlCatalog),
    Rest(RestCatalog),
}

impl Catalog {
    /// Connects to the catalog `config` names: a REST catalog for an `http(s)://` URL, else a
    /// SQL one.
    pub async fn open(config: &TableConfig) -> anyhow::Result<Catalog> {
        Ok(if rest::is_rest(&config.catalog) {
            Catalog::Rest(RestCatalog::connect(config).await?)
        } else {
            Catalog::Sql(SqlCatalog::connect(&config.catalog, &config.catalog_name).await?)
        })
    }

    /// Makes `namespace` exist.
    pub async fn create_namespace(&self, namespace: &str) -> anyhow::Result<()> {
        match self {
            Catalog::Sql(c) => c.create_namespace(namespace).await,
            Catalog::Rest(c) => c.create_namespace(namespace).await,
        }
    }

    /// The table's current version, `None` when the catalog has no such table. A SQL
    /// catalog's metadata file is read from `store`.
    pub async fn load(
        &self,
        store: &ObjectStore,
        namespace: &str,
        table: &str,
    ) -> anyhow::Result<Option<Version>> {
        match self {
            Catalog::Sql(c) => {
                let Some(location) = c.location(namespace, table).await? else {
                    return Ok(None);
                };
                let metadata = serde_json::from_slice(&super::read_uri(store, &location).await?)
                    .with_context(|| format!("cannot read table metadata {location}"))?;
                Ok(Some(Version { location, metadata }))
            }
            Catalog::Rest(c) => Ok(c
                .load(namespace, table)
                .await?
                .map(|(location, metadata)| Version { location, metadata })),
        }
    }

    /// Registers a new table whose first metadata file is at `location`; `false` when the
    /// catalog has a table of that name already (another sink created it first).
    pub async fn register(
        &self,
        namespace: &str,
        table: &str,
        location: &str,
    ) -> anyhow::Result<bool> {
        match self {
            Catalog::Sql(c) => c.create(namespace, table, location).await,
            Catalog::Rest(c) => c.register(namespace, table, location).await,
        }
    }

    /// Commits `append`, built on `base`, whose manifests are written already: the files
    /// nothing refers to after the commit, for the caller to remove, or `None` when another
    /// writer committed first. A SQL catalog's metadata file is written to `store` and swapped
    /// in; a REST catalog's server is sent the changes and writes its own.
    pub async fn commit(
        &self,
        store: &ObjectStore,
        (namespace, table): (&str, &str),
        base: &Version,
        append: Append,
    ) -> anyhow::Result<Option<Vec<String>>> {
        let mut unreferenced = append.expired_lists;
        let committed = match self {
            Catalog::Sql(c) => {
                let key = store
                    .key_of(&append.metadata_location)
                    .context("metadata location")?;
                store
                    .put_if_absent(
                        &key,
                        bytes::Bytes::from(serde_json::to_vec(&append.metadata)?),
                    )
                    .await?;
                unreferenced.extend(append.expired_metadata);
                c.swap(namespace, table, &base.location, &append.metadata_location)
                    .await?
            }
            // The server keeps (and removes) its own metadata files.
            Catalog::Rest(c) => {
                c.commit(namespace, table, &base.metadata, &append.metadata)
                    .await?
            }
        };
        Ok(committed.then_some(unreferenced))
    }
}

/// A SQL catalog: a pool of connections and the catalog's name in its tables.
#[derive(Debug, Clone)]
pub struct SqlCatalog {
    pool: AnyPool,
    name: String,
    /// The tables have the `iceberg_type` column (the JDBC catalog's second schema, which
    /// also holds views): new rows are marked `TABLE`.
    typed: bool,
}

/// The URL sqlx opens for `catalog`: a `postgres://` or `sqlite:` URL as given, anything else
/// a SQLite file (created when missing).
pub fn url_of(catalog: &str) -> String {
    if catalog.starts_with("postgres://")
        || catalog.starts_with("postgresql://")
        || catalog.starts_with("sqlite:")
    {
        catalog.to_owned()
    } else {
        format!("sqlite://{catalog}?mode=rwc")
    }
}

const CREATE_TABLES: &str = "CREATE TABLE IF NOT EXISTS iceberg_tables (
    catalog_name VARCHAR(255) NOT NULL,
    table_namespace VARCHAR(255) NOT NULL,
    table_name VARCHAR(255) NOT NULL,
    metadata_location VARCHAR(1000),
    previous_metadata_location VARCHAR(1000),
    iceberg_type VARCHAR(5),
    PRIMARY KEY (catalog_name, table_namespace, table_name))";

const CREATE_NAMESPACES: &str = "CREATE TABLE IF NOT EXISTS iceberg_namespace_properties (
    catalog_name VARCHAR(255) NOT NULL,
    namespace VARCHAR(255) NOT NULL,
    property_key VARCHAR(255) NOT NULL,
    property_value VARCHAR(1000) NOT NULL,
    PRIMARY KEY (catalog_name, namespace, property_key))";

impl SqlCatalog {
    /// Connects and creates the catalog's tables where they are missing.
    pub async fn connect(catalog: &str, name: &str) -> anyhow::Result<SqlCatalog> {
        sqlx::any::install_default_drivers();
        let url = url_of(catalog);
        let pool = AnyPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .map_err(|e| anyhow::anyhow!("cannot open the table catalog {}: {e}", redact(&url)))?;
        for statement in [CREATE_TABLES, CREATE_NAMESPACES] {
            sqlx::query(statement).execute(&pool).await?;
        }
        // A catalog another client created with the first schema has no such column.
        let typed = sqlx::query("SELECT iceberg_type FROM iceberg_tables WHERE 1 = 0")
            .fetch_optional(&pool)
            .await
            .is_ok();
        Ok(SqlCatalog {
            pool,
            name: name.to_owned(),
            typed,
        })
    }

    /// Makes `namespace` exist (a property row, as other catalog clients write it).
    pub async fn create_namespace(&self, namespace: &str) -> anyhow::Result<()> {
        let exists = sqlx::query(
            "SELECT 1 FROM iceberg_namespace_properties WHERE catalog_name = $1 AND namespace = $2",
        )
        .bind(&self.name)
        .bind(namespace)
        .fetch_optional(&self.pool)
        .await?;
        if exists.is_none() {
            // Two sinks starting at once both insert: the loser's row is the winner's.
            let _ = sqlx::query(
                "INSERT INTO iceberg_namespace_properties \
                 (catalog_name, namespace, property_key, property_value) VALUES ($1, $2, 'exists', 'true')",
            )
            .bind(&self.name)
            .bind(namespace)
            .execute(&self.pool)
            .await;
        }
        Ok(())
    }

    /// The current metadata location of a table, `None` when the catalog has no such table.
    pub async fn location(&self, namespace: &str, table: &str) -> anyhow::Result<Option<String>> {
        let row: Option<(Option<String>,)> = sqlx::query_as(
            "SELECT metadata_location FROM iceberg_tables \
             WHERE catalog_name = $1 AND table_namespace = $2 AND table_name = $3",
        )
        .bind(&self.name)
        .bind(namespace)
        .bind(table)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.and_then(|(location,)| location))
    }

    /// Registers a new table at `location`; `false` when the catalog has one of that name
    /// already (another sink created it first).
    pub async fn create(
        &self,
        namespace: &str,
        table: &str,
        location: &str,
    ) -> anyhow::Result<bool> {
        let insert = if self.typed {
            "INSERT INTO iceberg_tables \
             (catalog_name, table_namespace, table_name, metadata_location, previous_metadata_location, iceberg_type) \
             VALUES ($1, $2, $3, $4, NULL, 'TABLE')"
        } else {
            "INSERT INTO iceberg_tables \
             (catalog_name, table_namespace, table_name, metadata_location, previous_metadata_location) \
             VALUES ($1, $2, $3, $4, NULL)"
        };
        let inserted = sqlx::query(insert)
            .bind(&self.name)
            .bind(namespace)
            .bind(table)
            .bind(location)
            .execute(&self.pool)
            .await;
        match inserted {
            Ok(_) => Ok(true),
            Err(e) if self.location(namespace, table).await?.is_some() => {
                tracing::debug!(error = %e, table, "table created by another writer first");
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Moves a table's metadata location from `from` to `to`; `false` when it is no longer at
    /// `from` (another writer committed first).
    pub async fn swap(
        &self,
        namespace: &str,
        table: &str,
        from: &str,
        to: &str,
    ) -> anyhow::Result<bool> {
        let done = sqlx::query(
            "UPDATE iceberg_tables SET metadata_location = $1, previous_metadata_location = $2 \
             WHERE catalog_name = $3 AND table_namespace = $4 AND table_name = $5 \
             AND metadata_location = $6",
        )
        .bind(to)
        .bind(from)
        .bind(&self.name)
        .bind(namespace)
        .bind(table)
        .bind(from)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// `url` without the password it may hold, for errors and logs.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            match credentials.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..scheme + 3],
                    &credentials[..colon],
                    &url[at..]
                ),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_left_out_of_urls_shown() {
        assert_eq!(
            redact("postgres://sink:secret@db:5432/catalog"),
            "postgres://sink:***@db:5432/catalog"
        );
        assert_eq!(redact("postgres://db/catalog"), "postgres://db/catalog");
        assert_eq!(
            url_of("/var/lib/sink/catalog.db"),
            "sqlite:///var/lib/sink/catalog.db?mode=rwc"
        );
        assert_eq!(url_of("postgres://db/c"), "postgres://db/c");
    }

    /// A catalog created by a client of the JDBC catalog's first schema (no `iceberg_type`).
    #[tokio::test]
    async fn tables_are_registered_in_a_catalog_of_the_first_schema() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.db");
        sqlx::any::install_default_drivers();
        let pool = AnyPoolOptions::new()
            .connect(&url_of(path.to_str().unwrap()))
            .await
            .unwrap();
        sqlx::query(&CREATE_TABLES.replace("    iceberg_type VARCHAR(5),\n", ""))
            .execute(&pool)
            .await
            .unwrap();
        let catalog = SqlCatalog::connect(path.to_str().unwrap(), "edge")
            .await
            .unwrap();
        assert!(!catalog.typed);
        assert!(catalog.create("landing", "t", "m1").await.unwrap());
        assert_eq!(
            catalog.location("landing", "t").await.unwrap().as_deref(),
            Some("m1")
        );
    }

    #[tokio::test]
    async fn a_commit_moves_the_location_only_from_the_version_it_was_built_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.db");
        let catalog = SqlCatalog::connect(path.to_str().unwrap(), "edge")
            .await
            .unwrap();
        catalog.create_namespace("landing").await.unwrap();
        assert_eq!(catalog.location("landing", "t").await.unwrap(), None);
        assert!(catalog.create("landing", "t", "m1").await.unwrap());
        assert!(!catalog.create("landing", "t", "other").await.unwrap());
        assert!(catalog.swap("landing", "t", "m1", "m2").await.unwrap());
        assert!(!catalog.swap("landing", "t", "m1", "m3").await.unwrap());
        assert_eq!(
            catalog.location("landing", "t").await.unwrap().as_deref(),
            Some("m2")
        );
        let v1: (Option<String>,) =
            sqlx::query_as("SELECT iceberg_type FROM iceberg_tables WHERE table_name = 't'")
                .fetch_one(&catalog.pool)
                .await
                .unwrap();
        assert_eq!(v1.0.as_deref(), Some("TABLE"));
        // Another catalog name in the same database is another catalog.
        let other = SqlCatalog::connect(path.to_str().unwrap(), "other")
            .await
            .unwrap();
        assert_eq!(other.location("landing", "t").await.unwrap(), None);
    }
}
