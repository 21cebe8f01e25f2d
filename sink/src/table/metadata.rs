//! A stream's Iceberg table: its schema from the stream definition, the table's first
//! metadata, and the snapshot of each append (manifest, manifest list, metadata), encoded with
//! the `iceberg` crate's writers and stored by the caller.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use iceberg::io::FileIO;
use iceberg::spec::{
    DataContentType, DataFile, DataFileBuilder, DataFileFormat, FormatVersion, ListType,
    ManifestFile, ManifestList, ManifestListWriter, ManifestWriterBuilder, MapType, NestedField,
    NestedFieldRef, NullOrder, Operation, PrimitiveType, Schema, Snapshot, SortDirection,
    SortField, SortOrder, Struct, Summary, TableMetadata, TableMetadataBuilder, Transform, Type,
    UnboundPartitionSpec,
};
use schemas::arrow::{COL_CONTENT_HASH, COL_INGEST_TS, COL_OFFSET, COL_PARTITION, HashColumn};
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
        COL_PARTITION,
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
/// written without field ids. List elements are also found by the name Arrow gives them.
pub fn name_mapping(schema: &Schema) -> String {
    fn field(f: &NestedField) -> serde_json::Value {
        let mut names = vec![f.name.clone()];
        if f.name == "element" {
            names.push("item".to_owned());
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
/// definition no longer has stay (their files keep them). The name mapping follows.
pub fn evolved(
    metadata: &TableMetadata,
    def: &StreamDef,
    hash: HashColumn,
) -> iceberg::Result<Option<TableMetadata>> {
    let current = metadata.current_schema();
    let mut fields: Vec<NestedFieldRef> = current.as_struct().fields().to_vec();
    let mut next = metadata.last_column_id();
    let mut changed = false;
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

/// Each partition's next offset per the table: from the newest snapshot that carries them
/// (others' snapshots, such as a compaction's, are walked past). Empty for a new table.
pub fn offsets(metadata: &TableMetadata) -> BTreeMap<String, i64> {
    let mut snapshot = metadata.current_snapshot();
    while let Some(s) = snapshot {
        if let Some(json) = s.summary().additional_properties.get(OFFSETS_PROPERTY) {
            return serde_json::from_str(json).unwrap_or_default();
        }
        snapshot = s
            .parent_snapshot_id()
            .and_then(|id| metadata.snapshot_by_id(id));
    }
    BTreeMap::new()
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
    let mut builder = DataFileBuilder::default();
    builder
        .content(DataContentType::Data)
        .file_path(uri)
        .file_format(DataFileFormat::Parquet)
        .record_count(file.rows)
        .file_size_in_bytes(file.size)
        .partition_spec_id(table.default_partition_spec_id())
        .partition(partition);
    file.stats.describe(table.current_schema(), &mut builder);
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

/// Manifests of one snapshot past which an append merges them into one.
pub const MAX_MANIFESTS: usize = 32;

/// Snapshots a table keeps: older ones are expired by the append that passes the count.
pub const KEEP_SNAPSHOTS: usize = 64;

/// The snapshot appending `added` to the table at `metadata_location`, with `offsets` as its
/// offsets property. `manifests` are those of the current snapshot (read by the caller from
/// its manifest list); `merged`, their bytes in the same order, merges them into one with the
/// added files (the caller gives them past [`MAX_MANIFESTS`]).
pub async fn append(
    metadata: &TableMetadata,
    metadata_location: &str,
    manifests: Vec<ManifestFile>,
    added: Vec<DataFile>,
    offsets: &BTreeMap<String, i64>,
    merged: Option<Vec<bytes::Bytes>>,
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
    let mut kept = manifests;
    if let Some(old) = merged {
        for (listed, bytes) in kept.iter().zip(old) {
            // Entries added by the manifest's own snapshot leave their snapshot id and
            // sequence numbers to be inherited from the manifest list's entry.
            let manifest = iceberg::spec::Manifest::parse_avro(&bytes)?;
            for entry in manifest.entries().iter().filter(|e| e.is_alive()) {
                writer.add_existing_file(
                    entry.data_file().clone(),
                    entry.snapshot_id().unwrap_or(listed.added_snapshot_id),
                    entry.sequence_number().unwrap_or(listed.sequence_number),
                    entry.file_sequence_number.or(Some(listed.sequence_number)),
                )?;
            }
        }
        kept.clear();
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
    list.add_manifests(kept.into_iter().chain([manifest]))?;
    list.close().await?;
    let previous = metadata.current_snapshot().map(|s| s.summary());
    let total = |key: &str, added: u64| {
        let before = previous
            .and_then(|s| s.additional_properties.get(key))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        (before + added).to_string()
    };
    let properties = HashMap::from([
        ("added-data-files".to_owned(), added_count.to_string()),
        ("added-records".to_owned(), added_rows.to_string()),
        ("added-files-size".to_owned(), added_size.to_string()),
        (
            "total-data-files".to_owned(),
            total("total-data-files", added_count as u64),
        ),
        (
            "total-records".to_owned(),
            total("total-records", added_rows),
        ),
        (
            "total-files-size".to_owned(),
            total("total-files-size", added_size),
        ),
        ("total-delete-files".to_owned(), "0".to_owned()),
        ("total-position-deletes".to_owned(), "0".to_owned()),
        ("total-equality-deletes".to_owned(), "0".to_owned()),
        (
            OFFSETS_PROPERTY.to_owned(),
            serde_json::to_string(offsets).unwrap_or_default(),
        ),
    ]);
    let snapshot = Snapshot::builder()
        .with_snapshot_id(snapshot_id)
        .with_parent_snapshot_id(parent)
        .with_sequence_number(sequence)
        .with_timestamp_ms(chrono::Utc::now().timestamp_millis())
        .with_manifest_list(list_path.clone())
        .with_summary(Summary {
            operation: Operation::Append,
            additional_properties: properties,
        })
        .with_schema_id(schema.schema_id())
        .build();
    let mut builder =
        TableMetadataBuilder::new_from_metadata(metadata.clone(), Some(metadata_location.into()))
            .set_branch_snapshot(snapshot, "main")?;
    let mut expired_lists = Vec::new();
    let mut snapshots: Vec<(i64, i64)> = metadata
        .snapshots()
        .map(|s| (s.timestamp_ms(), s.snapshot_id()))
        .collect();
    if snapshots.len() >= KEEP_SNAPSHOTS {
        snapshots.sort_unstable();
        let expired: Vec<i64> = snapshots[..snapshots.len() + 1 - KEEP_SNAPSHOTS]
            .iter()
            .map(|&(_, id)| id)
            .filter(|&id| Some(id) != parent)
            .collect();
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
