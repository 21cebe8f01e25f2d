//! A stream's Iceberg table: its schema from the stream definition, the table's first
//! metadata, and the snapshot of each append (manifest, manifest list, metadata), encoded with
//! the `iceberg` crate's writers and stored by the caller.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use iceberg::io::FileIO;
use iceberg::spec::{
    DataContentType, DataFile, DataFileBuilder, DataFileFormat, FormatVersion, ListType,
    ManifestContentType, ManifestFile, ManifestList, ManifestListWriter, ManifestWriterBuilder,
    MapType, NestedField, NestedFieldRef, NullOrder, Operation, PrimitiveType, Schema, Snapshot,
    SortDirection, SortField, SortOrder, Struct, Summary, TableMetadata, TableMetadataBuilder,
    Transform, Type, UnboundPartitionSpec,
};
use schemas::arrow::{
    COL_CONTENT_HASH, COL_INGEST_TS, COL_OFFSET, COL_PARTITION, HashColumn, TABLE_COL_PARTITION,
};
use schemas::{FieldType, StreamDef};

use super::{Landed, Partitioning, stats};

/// The snapshot summary property holding, as JSON, each Kafka partition's next offset: the
/// offset after the last one accounted for by the table's files (`"<topic>:<partition>"` →
/// offset). Every append by a sink carries the whole map forward.
pub const OFFSETS_PROPERTY: &str = "edge-ingest.offsets";

/// Table property naming the columns by field id for files written without ids.
const NAME_MAPPING: &str = "schema.name-mapping.default";

fn scalar(ty: &FieldType) -> PrimitiveType {
    match ty {
        FieldType::String | FieldType::List(_) | FieldType::Map(_) => PrimitiveType::String,
        FieldType::Bool => PrimitiveType::Boolean,
        FieldType::Int64 => PrimitiveType::Long,
        FieldType::Float64 => PrimitiveType::Double,
        FieldType::Timestamp => PrimitiveType::Timestamptz,
    }
}

/// The table schema of a stream's landing files: the definition's fields, then the columns
/// the sink adds, with ids 1, 2, … in that order and the ids of list elements and map keys
/// and values after them.
pub fn schema_of(def: &StreamDef, hash: HashColumn) -> iceberg::Result<Schema> {
    let top = def.fields.len() as i32 + 3 + i32::from(hash != HashColumn::None);
    let mut nested = top;
    let mut fields: Vec<NestedFieldRef> = Vec::new();
    for (i, f) in def.fields.iter().enumerate() {
        let id = i as i32 + 1;
        let ty = match &f.ty {
            FieldType::List(inner) => {
                nested += 1;
                Type::List(ListType::new(Arc::new(NestedField::list_element(
                    nested,
                    Type::Primitive(scalar(inner)),
                    false,
                ))))
            }
            FieldType::Map(inner) => {
                nested += 2;
                Type::Map(MapType::optional(
                    nested - 1,
                    Type::Primitive(PrimitiveType::String),
                    nested,
                    Type::Primitive(scalar(inner)),
                ))
            }
            scalar_type => Type::Primitive(scalar(scalar_type)),
        };
        let field = if f.required {
            NestedField::required(id, &f.name, ty)
        } else {
            NestedField::optional(id, &f.name, ty)
        };
        fields.push(Arc::new(field));
    }
    let next = def.fields.len() as i32;
    let primitive = |t| Type::Primitive(t);
    fields.push(Arc::new(NestedField::required(
        next + 1,
        COL_INGEST_TS,
        primitive(PrimitiveType::Timestamptz),
    )));
    fields.push(Arc::new(NestedField::required(
        next + 2,
        TABLE_COL_PARTITION,
        primitive(PrimitiveType::Int),
    )));
    fields.push(Arc::new(NestedField::required(
        next + 3,
        COL_OFFSET,
        primitive(PrimitiveType::Long),
    )));
    if hash != HashColumn::None {
        fields.push(Arc::new(NestedField::required(
            next + 4,
            COL_CONTENT_HASH,
            primitive(PrimitiveType::Fixed(hash.bytes() as u64)),
        )));
    }
    Schema::builder()
        .with_schema_id(0)
        .with_fields(fields)
        .build()
}

/// The name mapping of `schema` (JSON): how a reader finds each column of a Parquet file
/// written without field ids. List elements are also found by the name Arrow gives them, and
/// the Kafka partition by the landing files' name for it.
pub fn name_mapping(schema: &Schema) -> String {
    fn field(f: &NestedField) -> serde_json::Value {
        let mut names = vec![f.name.clone()];
        match f.name.as_str() {
            "element" => names.push("item".to_owned()),
            TABLE_COL_PARTITION => names.push(COL_PARTITION.to_owned()),
            _ => {}
        }
        let children: Vec<serde_json::Value> = match f.field_type.as_ref() {
            Type::List(list) => vec![field(&list.element_field)],
            Type::Map(map) => vec![field(&map.key_field), field(&map.value_field)],
            Type::Struct(s) => s.fields().iter().map(|f| field(f)).collect(),
            Type::Primitive(_) => Vec::new(),
        };
        let mut value = serde_json::json!({ "field-id": f.id, "names": names });
        if !children.is_empty() {
            value["fields"] = serde_json::Value::Array(children);
        }
        value
    }
    serde_json::Value::Array(
        schema
            .as_struct()
            .fields()
            .iter()
            .map(|f| field(f))
            .collect(),
    )
    .to_string()
}

/// The first metadata of a stream's table at `location`: its schema, partitioned by
/// `partitioning` of the ingest time, sorted the way the sink sorts each file's rows (series,
/// then event time).
pub fn create(
    def: &StreamDef,
    hash: HashColumn,
    location: &str,
    partitioning: Partitioning,
) -> iceberg::Result<TableMetadata> {
    let schema = schema_of(def, hash)?;
    let ingest_ts = def.fields.len() as i32 + 1;
    let mut spec = UnboundPartitionSpec::builder();
    let transform = match partitioning {
        Partitioning::Day => Some((Transform::Day, "day")),
        Partitioning::Hour => Some((Transform::Hour, "hour")),
        Partitioning::None => None,
    };
    if let Some((transform, suffix)) = transform {
        spec =
            spec.add_partition_field(ingest_ts, format!("{COL_INGEST_TS}_{suffix}"), transform)?;
    }
    let series = std::iter::once(def.partition_key).chain(
        (0..def.fields.len())
            .filter(|&i| i != def.partition_key && def.fields[i].ty == FieldType::String),
    );
    let mut order = SortOrder::builder();
    for field in series
        .filter(|&i| matches!(def.fields[i].ty, FieldType::String | FieldType::Int64))
        .chain([def.event_time])
    {
        order.with_sort_field(
            SortField::builder()
                .source_id(field as i32 + 1)
                .transform(Transform::Identity)
                .direction(SortDirection::Ascending)
                .null_order(NullOrder::First)
                .build(),
        );
    }
    let properties = HashMap::from([
        (NAME_MAPPING.to_owned(), name_mapping(&schema)),
        ("write.format.default".to_owned(), "parquet".to_owned()),
        ("edge-ingest.stream".to_owned(), def.name.clone()),
    ]);
    let order = order.with_order_id(1).build(&schema)?;
    Ok(TableMetadataBuilder::new(
        schema,
        spec.build(),
        order,
        location.to_owned(),
        FormatVersion::V2,
        properties,
    )?
    .build()?
    .metadata)
}

/// `ty` with fresh ids for the fields it nests (list elements, map keys and values), taken
/// from `next` on.
fn renumbered(ty: &Type, next: &mut i32) -> Type {
    let mut fresh = |f: &NestedField| {
        *next += 1;
        let mut f = f.clone();
        f.id = *next;
        f.field_type = Box::new(renumbered(&f.field_type, next));
        Arc::new(f)
    };
    match ty {
        Type::List(list) => Type::List(ListType::new(fresh(&list.element_field))),
        Type::Map(map) => {
            let key = fresh(&map.key_field);
            Type::Map(MapType::new(key, fresh(&map.value_field)))
        }
        other => other.clone(),
    }
}

/// The table's metadata with the schema `def` needs, when it needs another than the current
/// one: a definition's compatible change adds nullable fields (each a new column with new
/// ids, null in the files written before) and makes required ones optional. Columns the
/// definition no longer has stay (their files keep them). A column named `_partition` is
/// renamed [`TABLE_COL_PARTITION`]. The name mapping follows.
pub fn evolved(
    metadata: &TableMetadata,
    def: &StreamDef,
    hash: HashColumn,
) -> iceberg::Result<Option<TableMetadata>> {
    let current = metadata.current_schema();
    let mut fields: Vec<NestedFieldRef> = current.as_struct().fields().to_vec();
    let mut next = metadata.last_column_id();
    let mut changed = false;
    // A table created with the landing files' `_partition` column, which Iceberg reserves,
    // has it renamed (same field id, so its files read as before).
    if let Some(i) = fields.iter().position(|f| f.name == COL_PARTITION) {
        let mut renamed = fields[i].as_ref().clone();
        renamed.name = TABLE_COL_PARTITION.to_owned();
        fields[i] = Arc::new(renamed);
        changed = true;
    }
    for wanted in schema_of(def, hash)?.as_struct().fields() {
        match fields.iter().position(|f| f.name == wanted.name) {
            Some(i) if fields[i].required && !wanted.required => {
                let mut relaxed = fields[i].as_ref().clone();
                relaxed.required = false;
                fields[i] = Arc::new(relaxed);
                changed = true;
            }
            Some(i) => {
                if let (Type::Primitive(had), Type::Primitive(needs)) =
                    (fields[i].field_type.as_ref(), wanted.field_type.as_ref())
                    && had != needs
                {
                    return Err(iceberg::Error::new(
                        iceberg::ErrorKind::DataInvalid,
                        format!(
                            "the table's column {} is {had}, the files' is {needs}: a table cannot change a column's type (landing.content_hash_bytes changed?)",
                            wanted.name
                        ),
                    ));
                }
            }
            None => {
                next += 1;
                let id = next;
                let ty = renumbered(&wanted.field_type, &mut next);
                fields.push(Arc::new(NestedField::optional(id, &wanted.name, ty)));
                changed = true;
            }
        }
    }
    if !changed {
        return Ok(None);
    }
    let schema = Schema::builder()
        .with_schema_id(current.schema_id() + 1)
        .with_fields(fields)
        .build()?;
    let mapping = HashMap::from([(NAME_MAPPING.to_owned(), name_mapping(&schema))]);
    let built = TableMetadataBuilder::new_from_metadata(metadata.clone(), None)
        .add_schema(schema)?
        .set_current_schema(-1)?
        .set_properties(mapping)?
        .build()?;
    Ok(Some(built.metadata))
}

/// Each partition's next offset per the table: the table property [`OFFSETS_PROPERTY`], which
/// every append sets and which other writers' commits (a compaction, a delete) and snapshot
/// expiry leave alone; for a table written before the sink kept it there, the newest snapshot
/// of the current one's ancestry that carries it in its summary. Empty for a table without
/// snapshots. A table that holds files but whose offsets are gone, or unreadable, is an error
/// that names the repair: appending without them could append a file a second time.
pub fn offsets(metadata: &TableMetadata) -> iceberg::Result<BTreeMap<String, i64>> {
    let parse = |json: &str, whence: &str| {
        serde_json::from_str::<BTreeMap<String, i64>>(json).map_err(|e| {
            iceberg::Error::new(
                iceberg::ErrorKind::DataInvalid,
                format!(
                    "the table's {OFFSETS_PROPERTY} ({whence}) is not a map of \"<topic>:<partition>\" to the next offset ({e}); nothing is appended until it is: set it again with ALTER TABLE … SET TBLPROPERTIES ('{OFFSETS_PROPERTY}' = '{{\"<topic>:<partition>\": <next offset>, …}}')"
                ),
            )
        })
    };
    if let Some(json) = metadata.properties().get(OFFSETS_PROPERTY) {
        return parse(json, "table property");
    }
    let mut snapshot = metadata.current_snapshot();
    while let Some(s) = snapshot {
        if let Some(json) = s.summary().additional_properties.get(OFFSETS_PROPERTY) {
            return parse(json, "snapshot summary");
        }
        snapshot = s
            .parent_snapshot_id()
            .and_then(|id| metadata.snapshot_by_id(id));
    }
    match metadata.current_snapshot() {
        None => Ok(BTreeMap::new()),
        Some(_) => Err(iceberg::Error::new(
            iceberg::ErrorKind::DataInvalid,
            format!(
                "the table has snapshots but neither its properties nor the current snapshot's ancestry say which Kafka offsets its files hold ({OFFSETS_PROPERTY}; expired by another tool?): nothing is appended, so that no file is appended twice. Set the table property from the landing files' offset ranges: ALTER TABLE … SET TBLPROPERTIES ('{OFFSETS_PROPERTY}' = '{{\"<topic>:<partition>\": <offset after the last one in the table>, …}}')"
            ),
        )),
    }
}

/// The snapshot ids the table's branches and tags refer to: expiry keeps them.
pub fn referenced_snapshots(metadata: &TableMetadata) -> Vec<i64> {
    let Ok(json) = serde_json::to_value(metadata) else {
        return metadata.current_snapshot_id().into_iter().collect();
    };
    let mut ids: Vec<i64> = json["refs"]
        .as_object()
        .into_iter()
        .flat_map(|refs| refs.values())
        .filter_map(|r| r["snapshot-id"].as_i64())
        .chain(metadata.current_snapshot_id())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The key of a Kafka partition in [`OFFSETS_PROPERTY`].
pub fn partition_key(topic: &str, partition: i32) -> String {
    format!("{topic}:{partition}")
}

/// A landed file as `table` lists it at `uri`: in its partition of the default spec, with its
/// columns' statistics by the current schema's field ids.
pub fn data_file(table: &TableMetadata, uri: String, file: &Landed) -> iceberg::Result<DataFile> {
    let spec = table.default_partition_spec();
    let partition = match spec.fields() {
        [] => Struct::empty(),
        _ => {
            let hour = stats::ingest_hour_of_key(&file.key).ok_or_else(|| {
                iceberg::Error::new(
                    iceberg::ErrorKind::DataInvalid,
                    format!("{} names no hour of ingest time", file.key),
                )
            })?;
            stats::partition_of(spec, table.current_schema(), hour)?
        }
    };
    data_file_at(table, uri, partition, (file.rows, file.size), &file.stats)
}

/// A Parquet data file of `rows` rows and `size` bytes at `uri`, in `partition` of `table`'s
/// default spec, with its columns' statistics by the current schema's field ids.
pub fn data_file_at(
    table: &TableMetadata,
    uri: String,
    partition: Struct,
    (rows, size): (u64, u64),
    file_stats: &stats::FileStats,
) -> iceberg::Result<DataFile> {
    let mut builder = DataFileBuilder::default();
    builder
        .content(DataContentType::Data)
        .file_path(uri)
        .file_format(DataFileFormat::Parquet)
        .record_count(rows)
        .file_size_in_bytes(size)
        .partition_spec_id(table.default_partition_spec_id())
        .partition(partition);
    file_stats.describe(table.current_schema(), &mut builder);
    builder.build().map_err(|e| {
        iceberg::Error::new(iceberg::ErrorKind::DataInvalid, format!("data file: {e}"))
    })
}

/// What an append makes: the files it writes by location (the manifest and the manifest
/// list), the new metadata and where a SQL catalog's commit writes it.
pub struct Append {
    pub files: Vec<(String, bytes::Bytes)>,
    pub metadata: TableMetadata,
    /// Where the new metadata goes when the sink writes it (a REST catalog's server writes
    /// its own).
    pub metadata_location: String,
    /// The manifest lists of the snapshots it expired, which nothing refers to once it is
    /// committed. (Manifests that only expired snapshots listed are not tracked, and stay.)
    pub expired_lists: Vec<String>,
    /// The metadata files that left its metadata log.
    pub expired_metadata: Vec<String>,
}

/// The size a merged manifest grows to at most (Iceberg's `commit.manifest.target-size-bytes`
/// default): manifests this large are left as they are.
pub const MANIFEST_TARGET_BYTES: i64 = 8 << 20;

/// Small data manifests (the new one included) that an append collects before it merges them
/// into one (Iceberg's `commit.manifest.min-count-to-merge`, lower than Java's 100).
pub const MIN_MANIFESTS_TO_MERGE: usize = 32;

/// Snapshots a table keeps: older ones are expired by the append that passes the count,
/// except those a branch or tag refers to.
pub const KEEP_SNAPSHOTS: usize = 64;

/// Which of the current snapshot's `manifests` an append merges into its new one, as Iceberg's
/// Java writer bins them: the newest data manifests of the default spec, as many as fit in
/// [`MANIFEST_TARGET_BYTES`] together, once they (and the new one) are at least
/// [`MIN_MANIFESTS_TO_MERGE`]; none before that. Delete manifests and manifests of another
/// spec are never merged. So a merge reads and writes at most the target size, however large
/// the table, and full manifests stay untouched.
pub fn to_merge(manifests: &[ManifestFile], default_spec: i32) -> Vec<usize> {
    let mut newest: Vec<usize> = (0..manifests.len())
        .filter(|&i| {
            manifests[i].content == ManifestContentType::Data
                && manifests[i].partition_spec_id == default_spec
        })
        .collect();
    newest.sort_by_key(|&i| std::cmp::Reverse(manifests[i].sequence_number));
    let mut bin = Vec::new();
    let mut bytes = 0;
    for i in newest {
        bytes += manifests[i].manifest_length;
        if bytes > MANIFEST_TARGET_BYTES {
            break;
        }
        bin.push(i);
    }
    if bin.len() + 1 < MIN_MANIFESTS_TO_MERGE {
        bin.clear();
    }
    bin.sort_unstable();
    bin
}

/// The snapshot appending `added` to the table at `metadata_location`, with `offsets` as its
/// offsets property. `kept` are the current snapshot's manifests that the new one lists as
/// they are; `merged` are those whose live entries it takes into its own manifest, with their
/// bytes ([`to_merge`] picks them). Entries of `merged` whose file path is in `removed` are
/// marked deleted instead: a snapshot that removes files is a `replace` (a compaction's,
/// whose `added` hold the same rows).
pub async fn append(
    metadata: &TableMetadata,
    metadata_location: &str,
    (kept, merged): (Vec<ManifestFile>, Vec<(ManifestFile, bytes::Bytes)>),
    added: Vec<DataFile>,
    offsets: &BTreeMap<String, i64>,
    removed: &HashSet<String>,
) -> iceberg::Result<Append> {
    let io = FileIO::new_with_memory();
    let snapshot_id = (uuid::Uuid::new_v4().as_u128() as i64).abs().max(1);
    let sequence = metadata.next_sequence_number();
    let location = metadata.location().trim_end_matches('/');
    let commit = uuid::Uuid::new_v4();
    let manifest_path = format!("{location}/metadata/{commit}-m0.avro");
    let schema = metadata.current_schema().clone();
    let spec = metadata.default_partition_spec().as_ref().clone();
    let mut writer = ManifestWriterBuilder::new(
        io.new_output(&manifest_path)?,
        Some(snapshot_id),
        schema.clone(),
        spec,
    )
    .build_v2_data();
    let (added_rows, added_size) = added.iter().fold((0u64, 0u64), |(r, s), f| {
        (r + f.record_count(), s + f.file_size_in_bytes())
    });
    let added_count = added.len();
    for file in added {
        writer.add_file(file, sequence)?;
    }
    let (mut deleted_count, mut deleted_rows, mut deleted_size) = (0usize, 0u64, 0u64);
    for (listed, bytes) in merged {
        // Entries added by the manifest's own snapshot leave their snapshot id and sequence
        // numbers to be inherited from the manifest list's entry.
        let manifest = iceberg::spec::Manifest::parse_avro(&bytes)?;
        for entry in manifest.entries().iter().filter(|e| e.is_alive()) {
            let file = entry.data_file().clone();
            let sequence = entry.sequence_number().unwrap_or(listed.sequence_number);
            let file_sequence = entry.file_sequence_number.or(Some(listed.sequence_number));
            if removed.contains(file.file_path()) {
                deleted_count += 1;
                deleted_rows += file.record_count();
                deleted_size += file.file_size_in_bytes();
                writer.add_delete_file(file, sequence, file_sequence)?;
            } else {
                writer.add_existing_file(
                    file,
                    entry.snapshot_id().unwrap_or(listed.added_snapshot_id),
                    sequence,
                    file_sequence,
                )?;
            }
        }
    }
    let manifest = writer.write_manifest_file().await?;
    let list_path = format!("{location}/metadata/snap-{snapshot_id}-1-{commit}.avro");
    let parent = metadata.current_snapshot_id();
    let mut list = ManifestListWriter::v2(
        io.new_output(&list_path)?.writer().await?,
        snapshot_id,
        parent,
        sequence,
    );
    list.add_manifests([manifest].into_iter().chain(kept))?;
    list.close().await?;
    let previous = metadata.current_snapshot().map(|s| s.summary());
    let ledger = serde_json::to_string(offsets).unwrap_or_default();
    let total = |key: &str, added: u64, deleted: u64| {
        let before = previous
            .and_then(|s| s.additional_properties.get(key))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        (before + added).saturating_sub(deleted).to_string()
    };
    let mut properties = HashMap::from([
        ("added-data-files".to_owned(), added_count.to_string()),
        ("added-records".to_owned(), added_rows.to_string()),
        ("added-files-size".to_owned(), added_size.to_string()),
        (
            "total-data-files".to_owned(),
            total("total-data-files", added_count as u64, deleted_count as u64),
        ),
        (
            "total-records".to_owned(),
            total("total-records", added_rows, deleted_rows),
        ),
        (
            "total-files-size".to_owned(),
            total("total-files-size", added_size, deleted_size),
        ),
        // Deletes that other writers added stay as they are.
        (
            "total-delete-files".to_owned(),
            total("total-delete-files", 0, 0),
        ),
        (
            "total-position-deletes".to_owned(),
            total("total-position-deletes", 0, 0),
        ),
        (
            "total-equality-deletes".to_owned(),
            total("total-equality-deletes", 0, 0),
        ),
        (OFFSETS_PROPERTY.to_owned(), ledger.clone()),
    ]);
    if deleted_count > 0 {
        properties.extend([
            ("deleted-data-files".to_owned(), deleted_count.to_string()),
            ("deleted-records".to_owned(), deleted_rows.to_string()),
            ("removed-files-size".to_owned(), deleted_size.to_string()),
        ]);
    }
    let snapshot = Snapshot::builder()
        .with_snapshot_id(snapshot_id)
        .with_parent_snapshot_id(parent)
        .with_sequence_number(sequence)
        // Never before the table's last update: a clock behind a peer's cannot commit one.
        .with_timestamp_ms(
            chrono::Utc::now()
                .timestamp_millis()
                .max(metadata.last_updated_ms() + 1),
        )
        .with_manifest_list(list_path.clone())
        .with_summary(Summary {
            operation: if deleted_count > 0 {
                Operation::Replace
            } else {
                Operation::Append
            },
            additional_properties: properties,
        })
        .with_schema_id(schema.schema_id())
        .build();
    let mut builder =
        TableMetadataBuilder::new_from_metadata(metadata.clone(), Some(metadata_location.into()))
            .set_branch_snapshot(snapshot, "main")?
            .set_properties(HashMap::from([(OFFSETS_PROPERTY.to_owned(), ledger)]))?;
    let mut expired_lists = Vec::new();
    let mut snapshots: Vec<(i64, i64)> = metadata
        .snapshots()
        .map(|s| (s.timestamp_ms(), s.snapshot_id()))
        .collect();
    if snapshots.len() >= KEEP_SNAPSHOTS {
        let referenced = referenced_snapshots(metadata);
        let excess = snapshots.len() + 1 - KEEP_SNAPSHOTS;
        snapshots.retain(|(_, id)| !referenced.contains(id));
        snapshots.sort_unstable();
        let expired: Vec<i64> = snapshots.iter().take(excess).map(|&(_, id)| id).collect();
        expired_lists.extend(
            expired
                .iter()
                .filter_map(|&id| metadata.snapshot_by_id(id))
                .map(|s| s.manifest_list().to_owned()),
        );
        builder = builder.remove_snapshots(&expired);
    }
    let built = builder.build()?;
    let expired_metadata = built
        .expired_metadata_logs
        .into_iter()
        .map(|log| log.metadata_file)
        .collect();
    let new = built.metadata;
    let version = metadata_location
        .rsplit('/')
        .next()
        .and_then(|name| name.split('-').next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    let metadata_path = format!(
        "{location}/metadata/{:05}-{}.metadata.json",
        version + 1,
        uuid::Uuid::new_v4()
    );
    let mut files = Vec::new();
    for path in [&manifest_path, &list_path] {
        files.push((path.clone(), io.new_input(path)?.read().await?));
    }
    Ok(Append {
        files,
        metadata: new,
        metadata_location: metadata_path,
        expired_lists,
        expired_metadata,
    })
}

/// The manifests listed by a manifest list's bytes.
pub fn manifests_of(list: &[u8]) -> iceberg::Result<Vec<ManifestFile>> {
    Ok(ManifestList::parse_with_version(list, FormatVersion::V2)?
        .consume_entries()
        .into_iter()
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use iceberg::spec::{SnapshotReference, SnapshotRetention};

    fn stream() -> Arc<StreamDef> {
        Arc::new(
            StreamDef::from_toml(
                r#"
name = "s"
version = 1
event_time_field = "ts"
partition_key_field = "device"
[[fields]]
name = "device"
type = "string"
required = true
[[fields]]
name = "ts"
type = "timestamp"
required = true
"#,
            )
            .unwrap(),
        )
    }

    /// A new table at `mem://t`, unpartitioned.
    fn table() -> TableMetadata {
        create(&stream(), HashColumn::None, "mem://t", Partitioning::None).unwrap()
    }

    /// `metadata` after an append of no files that moves partition 0's next offset to `next`.
    async fn appended(metadata: &TableMetadata, next: i64) -> TableMetadata {
        let offsets = BTreeMap::from([(partition_key("t", 0), next)]);
        append(
            metadata,
            "mem://t/metadata/00001-a.metadata.json",
            (Vec::new(), Vec::new()),
            Vec::new(),
            &offsets,
            &HashSet::new(),
        )
        .await
        .unwrap()
        .metadata
    }

    /// `metadata` with a snapshot of another writer on `main` (no offsets in its summary) and
    /// every older snapshot expired, as Spark's `rewrite_data_files` and `expire_snapshots`
    /// (retain_last 1) leave it.
    fn rewritten_and_expired(metadata: &TableMetadata) -> TableMetadata {
        let foreign = Snapshot::builder()
            .with_snapshot_id(7)
            .with_parent_snapshot_id(metadata.current_snapshot_id())
            .with_sequence_number(metadata.next_sequence_number())
            .with_timestamp_ms(metadata.last_updated_ms() + 1)
            .with_manifest_list("mem://t/metadata/snap-7.avro")
            .with_summary(Summary {
                operation: Operation::Replace,
                additional_properties: HashMap::new(),
            })
            .with_schema_id(0)
            .build();
        let old: Vec<i64> = metadata.snapshots().map(|s| s.snapshot_id()).collect();
        TableMetadataBuilder::new_from_metadata(metadata.clone(), None)
            .set_branch_snapshot(foreign, "main")
            .unwrap()
            .remove_snapshots(&old)
            .build()
            .unwrap()
            .metadata
    }

    #[tokio::test]
    async fn offsets_outlive_foreign_snapshots_and_their_expiry() {
        let empty = table();
        assert_eq!(offsets(&empty).unwrap(), BTreeMap::new());
        let ours = appended(&appended(&empty, 10).await, 25).await;
        let expected = BTreeMap::from([(partition_key("t", 0), 25)]);
        assert_eq!(offsets(&ours).unwrap(), expected);
        let rewritten = rewritten_and_expired(&ours);
        assert_eq!(rewritten.snapshots().len(), 1);
        assert_eq!(offsets(&rewritten).unwrap(), expected);
        // Without the property, the ancestry is read; with neither, nothing is appended.
        let without = |m: &TableMetadata| {
            TableMetadataBuilder::new_from_metadata(m.clone(), None)
                .remove_properties(&[OFFSETS_PROPERTY.to_owned()])
                .unwrap()
                .build()
                .unwrap()
                .metadata
        };
        assert_eq!(offsets(&without(&ours)).unwrap(), expected);
        let gone = offsets(&without(&rewritten)).unwrap_err().to_string();
        assert!(gone.contains("SET TBLPROPERTIES"), "{gone}");
        let malformed = TableMetadataBuilder::new_from_metadata(ours, None)
            .set_properties(HashMap::from([(
                OFFSETS_PROPERTY.to_owned(),
                "{".to_owned(),
            )]))
            .unwrap()
            .build()
            .unwrap()
            .metadata;
        let error = offsets(&malformed).unwrap_err().to_string();
        assert!(error.contains("is not a map"), "{error}");
    }

    #[tokio::test]
    async fn a_snapshot_is_never_older_than_the_tables_last_update() {
        // A peer whose clock is two minutes ahead committed last.
        let mut json = serde_json::to_value(appended(&table(), 10).await).unwrap();
        let ahead = chrono::Utc::now().timestamp_millis() + 120_000;
        json["last-updated-ms"] = ahead.into();
        json["snapshots"][0]["timestamp-ms"] = ahead.into();
        json["snapshot-log"][0]["timestamp-ms"] = ahead.into();
        let skewed: TableMetadata = serde_json::from_value(json).unwrap();
        let next = appended(&skewed, 20).await;
        assert!(next.current_snapshot().unwrap().timestamp_ms() > ahead);
        assert!(next.last_updated_ms() > ahead);
    }

    #[tokio::test]
    async fn expiry_keeps_what_tags_and_branches_refer_to() {
        let mut metadata = appended(&table(), 1).await;
        let first = metadata.current_snapshot_id().unwrap();
        let refer = |kind: SnapshotRetention| SnapshotReference {
            snapshot_id: first,
            retention: kind,
        };
        metadata = TableMetadataBuilder::new_from_metadata(metadata, None)
            .set_ref(
                "audit",
                refer(SnapshotRetention::Tag {
                    max_ref_age_ms: None,
                }),
            )
            .unwrap()
            .set_ref(
                "wap",
                refer(SnapshotRetention::Branch {
                    min_snapshots_to_keep: None,
                    max_snapshot_age_ms: None,
                    max_ref_age_ms: None,
                }),
            )
            .unwrap()
            .build()
            .unwrap()
            .metadata;
        for next in 2..=100 {
            metadata = appended(&metadata, next).await;
        }
        assert_eq!(metadata.snapshots().len(), KEEP_SNAPSHOTS);
        for name in ["audit", "wap"] {
            assert_eq!(
                metadata.snapshot_for_ref(name).map(|s| s.snapshot_id()),
                Some(first),
                "{name}"
            );
        }
    }

    #[test]
    fn a_reserved_partition_column_is_renamed_and_still_found_in_the_files() {
        let mut json = serde_json::to_value(table()).unwrap();
        for field in json["schemas"][0]["fields"].as_array_mut().unwrap() {
            if field["name"] == TABLE_COL_PARTITION {
                field["name"] = COL_PARTITION.into();
            }
        }
        let old: TableMetadata = serde_json::from_value(json).unwrap();
        let id = old
            .current_schema()
            .field_by_name(COL_PARTITION)
            .unwrap()
            .id;
        let new = evolved(&old, &stream(), HashColumn::None).unwrap().unwrap();
        let renamed = new
            .current_schema()
            .field_by_name(TABLE_COL_PARTITION)
            .unwrap();
        assert_eq!(renamed.id, id);
        assert!(new.current_schema().field_by_name(COL_PARTITION).is_none());
        let mapping: serde_json::Value =
            serde_json::from_str(&new.properties()[NAME_MAPPING]).unwrap();
        let entry = mapping
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["field-id"] == id)
            .unwrap();
        assert_eq!(
            entry["names"],
            serde_json::json!([TABLE_COL_PARTITION, COL_PARTITION])
        );
        assert!(
            evolved(&new, &stream(), HashColumn::None)
                .unwrap()
                .is_none()
        );
    }

    fn manifest(sequence: i64, bytes: i64, content: ManifestContentType) -> ManifestFile {
        ManifestFile {
            manifest_path: format!("m{sequence}.avro"),
            manifest_length: bytes,
            partition_spec_id: 0,
            content,
            sequence_number: sequence,
            min_sequence_number: sequence,
            added_snapshot_id: sequence,
            added_files_count: None,
            existing_files_count: None,
            deleted_files_count: None,
            added_rows_count: None,
            existing_rows_count: None,
            deleted_rows_count: None,
            partitions: None,
            key_metadata: None,
            first_row_id: None,
        }
    }

    #[test]
    fn small_data_manifests_are_merged_by_size_and_full_ones_left_alone() {
        let data = ManifestContentType::Data;
        // A full manifest, then small ones: merged once they are enough, the full one never.
        let mut manifests = vec![manifest(1, MANIFEST_TARGET_BYTES - 100, data)];
        for sequence in 2..=MIN_MANIFESTS_TO_MERGE as i64 {
            manifests.push(manifest(sequence, 10_000, data));
        }
        assert_eq!(
            to_merge(&manifests[..manifests.len() - 1], 0),
            Vec::<usize>::new()
        );
        assert_eq!(
            to_merge(&manifests, 0),
            (1..manifests.len()).collect::<Vec<_>>()
        );
        // Delete manifests stay; so do those of another spec.
        manifests[3].content = ManifestContentType::Deletes;
        manifests[4].partition_spec_id = 1;
        let merged = to_merge(&manifests, 0);
        assert!(merged.is_empty(), "{merged:?}");
        // Small ones past the target are left for later merges.
        let many: Vec<ManifestFile> = (1..=100)
            .map(|sequence| manifest(sequence, MANIFEST_TARGET_BYTES / 40, data))
            .collect();
        assert_eq!(to_merge(&many, 0), (60..100).collect::<Vec<_>>());
    }
}
