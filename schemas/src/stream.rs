//! Stream definitions: the typed description of one stream, parsed from a TOML document.
//!
//! One file per stream, named `<stream>.toml`. See `streams/README.md` for the format.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

use serde::Deserialize;

use crate::dictionary::{Dictionaries, ZstdDictionary};
use crate::error::SchemaError;

/// Longest stream or field name, in bytes.
pub const MAX_NAME_LEN: usize = 63;

/// Checks a stream name against `^[a-z][a-z0-9_]{0,62}$`, so that it is safe in topic names,
/// URLs, object keys and log lines.
pub fn validate_stream_name(name: &str) -> Result<(), SchemaError> {
    if is_identifier(name) {
        Ok(())
    } else {
        Err(SchemaError::InvalidName {
            what: "stream",
            name: printable(name),
        })
    }
}

/// `^[a-z][a-z0-9_]{0,62}$`
fn is_identifier(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_NAME_LEN
        && bytes[0].is_ascii_lowercase()
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_')
}

/// A bounded, escaped rendering of untrusted text for error messages and logs.
pub fn printable(text: &str) -> String {
    const MAX: usize = 80;
    let mut out: String = text
        .chars()
        .take(MAX)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().nth(MAX).is_some() {
        out.push('…');
    }
    out
}

/// The type of a field. Lists and maps hold scalar values; map keys are strings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FieldType {
    String,
    Bool,
    Int64,
    Float64,
    /// Stored as microseconds since the Unix epoch, UTC.
    Timestamp,
    List(Box<FieldType>),
    Map(Box<FieldType>),
}

impl FieldType {
    /// Parses `string`, `bool`, `int64`, `float64`, `timestamp`, `list<T>` or `map<T>`.
    pub fn parse(text: &str) -> Result<FieldType, String> {
        let text = text.trim();
        let scalar = |t: &str| match t.trim() {
            "string" => Ok(FieldType::String),
            "bool" => Ok(FieldType::Bool),
            "int64" => Ok(FieldType::Int64),
            "float64" => Ok(FieldType::Float64),
            "timestamp" => Ok(FieldType::Timestamp),
            other => Err(format!(
                "unknown type '{}' (expected string, bool, int64, float64, timestamp, list<T> or map<T>)",
                printable(other)
            )),
        };
        for (prefix, make) in [
            ("list<", FieldType::List as fn(Box<FieldType>) -> FieldType),
            ("map<", FieldType::Map),
        ] {
            if let Some(inner) = text.strip_prefix(prefix) {
                let inner = inner.strip_suffix('>').ok_or_else(|| {
                    format!("type '{}' is missing its closing '>'", printable(text))
                })?;
                return Ok(make(Box::new(scalar(inner).map_err(|e| {
                    format!("{e}; list and map elements must be scalar types")
                })?)));
            }
        }
        scalar(text)
    }

    pub fn is_scalar(&self) -> bool {
        !matches!(self, FieldType::List(_) | FieldType::Map(_))
    }
}

impl fmt::Display for FieldType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FieldType::String => f.write_str("string"),
            FieldType::Bool => f.write_str("bool"),
            FieldType::Int64 => f.write_str("int64"),
            FieldType::Float64 => f.write_str("float64"),
            FieldType::Timestamp => f.write_str("timestamp"),
            FieldType::List(t) => write!(f, "list<{t}>"),
            FieldType::Map(t) => write!(f, "map<{t}>"),
        }
    }
}

/// One field of a stream.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldDef {
    pub name: String,
    pub ty: FieldType,
    /// A required field must be present and not null.
    pub required: bool,
    pub doc: String,
}

/// A validated stream definition.
#[derive(Debug, Clone)]
pub struct StreamDef {
    pub name: String,
    pub version: u32,
    pub description: String,
    pub fields: Vec<FieldDef>,
    /// Index into `fields` of the event-time field (a required timestamp).
    pub event_time: usize,
    /// Index into `fields` of the partition key field (a required string or int64).
    pub partition_key: usize,
    /// Indices into `fields` of the hashed fields, ordered by field name.
    pub hash_fields: Vec<usize>,
    /// The names of `hash_fields` as the content hash encodes them.
    pub(crate) hash_names: Vec<Box<[u8]>>,
    /// Their bytes together.
    pub(crate) hash_names_bytes: usize,
    /// Whether each field is hashed (`hash_fields` as one flag per field).
    pub(crate) hashed: Vec<bool>,
    index: HashMap<String, usize>,
    /// Each field's name as a JSON object key with its colon (`"name":`), for the encoder.
    json_keys: Vec<Box<[u8]>>,
    /// Each field name's first 8 bytes as a little-endian word (zero-padded), for the scanner's
    /// key lookup ([`crate::scan`]).
    pub(crate) key_heads: Vec<u64>,
    /// The keys the scanner tries first after each field (the last entry: before the first
    /// field): the next field in definition order, then in name order. Producers write keys in
    /// one of those orders (a struct's, or sorted), so a record's keys are usually matched
    /// without being read as strings first.
    pub(crate) next_keys: Vec<[usize; 2]>,
    /// zstd dictionaries of the stream's batches (deployed next to the definition).
    pub dictionaries: Dictionaries,
    /// The formats the stream's topic carries in its values (`value_formats`): JSON by default.
    pub value_formats: Vec<ValueFormat>,
}

/// A format of a stream topic's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueFormat {
    /// A JSON object, as the gateway produces it (`json`).
    Json,
    /// Avro binary under a registry's schema id, in the registry wire format (`avro`).
    Avro,
    /// A JSON object under a registry's JSON Schema id, in the registry wire format
    /// (`json-schema`).
    JsonSchema,
    /// A Protobuf message under a registry's schema id and its message indexes, in the registry
    /// wire format (`protobuf`).
    Protobuf,
}

impl ValueFormat {
    /// Parses `json`, `avro`, `json-schema` or `protobuf`.
    pub fn parse(text: &str) -> Result<ValueFormat, String> {
        match text {
            "json" => Ok(ValueFormat::Json),
            "avro" => Ok(ValueFormat::Avro),
            "json-schema" => Ok(ValueFormat::JsonSchema),
            "protobuf" => Ok(ValueFormat::Protobuf),
            other => Err(format!(
                "unknown value format '{}' (expected json, avro, json-schema or protobuf)",
                printable(other)
            )),
        }
    }

    /// The name a definition gives it.
    pub fn name(self) -> &'static str {
        match self {
            ValueFormat::Json => "json",
            ValueFormat::Avro => "avro",
            ValueFormat::JsonSchema => "json-schema",
            ValueFormat::Protobuf => "protobuf",
        }
    }
}

impl StreamDef {
    /// Parses and validates a definition from TOML text.
    pub fn from_toml(text: &str) -> Result<StreamDef, SchemaError> {
        let raw: RawStream = toml::from_str(text).map_err(|e| SchemaError::Parse(e.to_string()))?;
        raw.validate()
    }

    /// The index of a field by name (the decoders call this for every key of every record).
    pub fn field_index(&self, name: &str) -> Option<usize> {
        self.field_by_head(name.as_bytes(), key_head(name.as_bytes()))
    }

    /// [`StreamDef::field_index`] for a name whose first word ([`key_head`]) the
    /// caller has already. Streams of a few fields are searched in order, comparing each name's
    /// length and first word before its bytes, which is faster than hashing the name.
    #[inline]
    pub(crate) fn field_by_head(&self, name: &[u8], head: u64) -> Option<usize> {
        if self.fields.len() > 16 {
            let name = std::str::from_utf8(name).ok()?;
            return self.index.get(name).copied();
        }
        let tail = name.get(8..);
        self.key_heads.iter().zip(&self.fields).position(|(&h, f)| {
            h == head && f.name.len() == name.len() && f.name.as_bytes().get(8..) == tail
        })
    }

    /// The field's name as JSON object key, colon included: `"name":`.
    pub(crate) fn json_key(&self, field: usize) -> &[u8] {
        &self.json_keys[field]
    }

    pub fn event_time_field(&self) -> &FieldDef {
        &self.fields[self.event_time]
    }

    pub fn partition_key_field(&self) -> &FieldDef {
        &self.fields[self.partition_key]
    }
}

/// How a definition read again relates to the one in use ([`StreamDef::change_to`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The same records, columns and hashes (its description or docs may differ).
    Same,
    /// Every record the running definition takes, the new one takes too, with the same content
    /// hash: nullable fields added, required fields made optional, fields reordered, the version
    /// raised. Records written under either fit one table (new columns are null in old files).
    Compatible,
    /// Records in Kafka or in landing files would no longer be taken, or would hash otherwise:
    /// a new version of the stream (streams/README.md, "Evolution"). The reason names the field.
    Incompatible(String),
}

impl StreamDef {
    /// Whether `new` may replace this definition while components run (see [`Change`]).
    pub fn change_to(&self, new: &StreamDef) -> Change {
        if let Err(reason) = self.compatible_with(new) {
            return Change::Incompatible(reason);
        }
        let columns = |d: &StreamDef| {
            d.fields
                .iter()
                .map(|f| (f.name.clone(), f.ty.clone(), f.required))
                .collect::<Vec<_>>()
        };
        if self.version == new.version
            && columns(self) == columns(new)
            && self.value_formats == new.value_formats
        {
            Change::Same
        } else {
            Change::Compatible
        }
    }

    fn compatible_with(&self, new: &StreamDef) -> Result<(), String> {
        if new.version < self.version {
            return Err(format!(
                "its version goes back from {} to {}",
                self.version, new.version
            ));
        }
        for (role, old, now) in [
            (
                "event_time_field",
                self.event_time_field(),
                new.event_time_field(),
            ),
            (
                "partition_key_field",
                self.partition_key_field(),
                new.partition_key_field(),
            ),
        ] {
            if old.name != now.name {
                return Err(format!(
                    "{role} changes from '{}' to '{}'",
                    old.name, now.name
                ));
            }
        }
        for (i, old) in self.fields.iter().enumerate() {
            let Some(j) = new.index.get(&old.name).copied() else {
                return Err(format!("field '{}' is removed", old.name));
            };
            let now = &new.fields[j];
            if now.ty != old.ty {
                return Err(format!(
                    "field '{}' changes type from {} to {}",
                    old.name, old.ty, now.ty
                ));
            }
            if now.required && !old.required {
                return Err(format!("field '{}' becomes required", old.name));
            }
            if new.hashed[j] != self.hashed[i] {
                return Err(format!(
                    "field '{}' {} the content hash",
                    old.name,
                    if new.hashed[j] { "joins" } else { "leaves" }
                ));
            }
        }
        if let Some(added) = new
            .fields
            .iter()
            .find(|f| f.required && !self.index.contains_key(&f.name))
        {
            return Err(format!(
                "new field '{}' is required (only nullable fields can be added)",
                added.name
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStream {
    name: String,
    version: u32,
    #[serde(default)]
    description: String,
    event_time_field: String,
    partition_key_field: String,
    #[serde(default)]
    hash_fields: Option<Vec<String>>,
    #[serde(default)]
    value_formats: Option<Vec<String>>,
    fields: Vec<RawField>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawField {
    name: String,
    #[serde(rename = "type")]
    ty: String,
    #[serde(default)]
    required: bool,
    #[serde(default)]
    doc: String,
}

impl RawStream {
    fn validate(self) -> Result<StreamDef, SchemaError> {
        validate_stream_name(&self.name)?;
        let invalid = |reason: String| SchemaError::Invalid {
            stream: self.name.clone(),
            reason,
        };
        if self.version == 0 {
            return Err(invalid("version must be 1 or more".into()));
        }
        if self.fields.is_empty() {
            return Err(invalid("a stream needs at least one field".into()));
        }
        let value_formats = match &self.value_formats {
            None => vec![ValueFormat::Json],
            Some(names) if names.is_empty() => {
                return Err(invalid("value_formats must not be empty".into()));
            }
            Some(names) => names
                .iter()
                .map(|n| ValueFormat::parse(n))
                .collect::<Result<Vec<_>, _>>()
                .map_err(invalid)?,
        };
        let mut fields = Vec::with_capacity(self.fields.len());
        let mut index = HashMap::new();
        for raw in self.fields {
            if !is_identifier(&raw.name) {
                return Err(invalid(format!(
                    "field name '{}' must match ^[a-z][a-z0-9_]{{0,62}}$",
                    printable(&raw.name)
                )));
            }
            let ty = FieldType::parse(&raw.ty)
                .map_err(|e| invalid(format!("field '{}': {e}", raw.name)))?;
            if index.insert(raw.name.clone(), fields.len()).is_some() {
                return Err(invalid(format!("field '{}' is defined twice", raw.name)));
            }
            fields.push(FieldDef {
                name: raw.name,
                ty,
                required: raw.required,
                doc: raw.doc,
            });
        }
        let lookup = |role: &str, name: &str| {
            index.get(name).copied().ok_or_else(|| {
                invalid(format!(
                    "{role} '{}' is not a field of the stream",
                    printable(name)
                ))
            })
        };
        let event_time = lookup("event_time_field", &self.event_time_field)?;
        let f = &fields[event_time];
        if f.ty != FieldType::Timestamp || !f.required {
            return Err(invalid(format!(
                "event_time_field '{}' must be a required timestamp",
                f.name
            )));
        }
        let partition_key = lookup("partition_key_field", &self.partition_key_field)?;
        let f = &fields[partition_key];
        if !matches!(f.ty, FieldType::String | FieldType::Int64) || !f.required {
            return Err(invalid(format!(
                "partition_key_field '{}' must be a required string or int64",
                f.name
            )));
        }
        let mut hash_fields = match self.hash_fields {
            None => (0..fields.len()).collect::<Vec<_>>(),
            Some(names) if names.is_empty() => {
                return Err(invalid("hash_fields must not be empty".into()));
            }
            Some(names) => {
                let mut out = Vec::with_capacity(names.len());
                for name in &names {
                    let i = lookup("hash field", name)?;
                    if out.contains(&i) {
                        return Err(invalid(format!("hash field '{name}' is listed twice")));
                    }
                    out.push(i);
                }
                out
            }
        };
        hash_fields.sort_by(|a, b| fields[*a].name.cmp(&fields[*b].name));
        // Field names are identifiers, so they need no escaping.
        let json_keys = fields
            .iter()
            .map(|f| format!("\"{}\":", f.name).into_bytes().into_boxed_slice())
            .collect();
        let hash_names: Vec<Box<[u8]>> = hash_fields
            .iter()
            .map(|&i| encoded_name(&fields[i].name))
            .collect();
        let hash_names_bytes = hash_names.iter().map(|n| n.len()).sum();
        let hashed = (0..fields.len())
            .map(|i| hash_fields.contains(&i))
            .collect();
        let key_heads = fields.iter().map(|f| key_head(f.name.as_bytes())).collect();
        let next_keys = next_keys(&fields);
        Ok(StreamDef {
            name: self.name,
            version: self.version,
            description: self.description,
            fields,
            event_time,
            partition_key,
            hash_fields,
            hash_names,
            hash_names_bytes,
            hashed,
            index,
            json_keys,
            key_heads,
            next_keys,
            dictionaries: Dictionaries::default(),
            value_formats,
        })
    }
}

/// [`StreamDef::next_keys`]: for each field, and then for the start of a record, the field
/// that follows in definition order and the one that follows in name order (the first field of
/// each order at the start; the last field's successor is the first, which a record never
/// repeats, so trying it costs one comparison).
fn next_keys(fields: &[FieldDef]) -> Vec<[usize; 2]> {
    let n = fields.len();
    let mut by_name: Vec<usize> = (0..n).collect();
    by_name.sort_by(|&a, &b| fields[a].name.cmp(&fields[b].name));
    let mut rank = vec![0; n];
    for (r, &i) in by_name.iter().enumerate() {
        rank[i] = r;
    }
    let mut out: Vec<[usize; 2]> = (0..n)
        .map(|i| [(i + 1) % n, by_name[(rank[i] + 1) % n]])
        .collect();
    out.push([0, by_name[0]]);
    out
}

/// What [`Streams::updated_by`] came to.
#[derive(Debug, Default)]
pub struct Updated {
    pub streams: Streams,
    /// Streams defined anew.
    pub added: Vec<String>,
    /// Streams whose definition changed compatibly.
    pub changed: Vec<String>,
}

/// All stream definitions a component knows, by name.
#[derive(Debug, Clone, Default)]
pub struct Streams {
    by_name: BTreeMap<String, Arc<StreamDef>>,
}

impl Streams {
    /// Builds the set from `(file stem, TOML text)` pairs. The file stem must equal the stream
    /// name. Every problem is reported, not only the first.
    pub fn from_sources<'a>(
        sources: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Streams, Vec<SchemaError>> {
        let mut by_name = BTreeMap::new();
        let mut errors = Vec::new();
        for (stem, text) in sources {
            match StreamDef::from_toml(text) {
                Ok(def) if def.name != stem => errors.push(SchemaError::Invalid {
                    stream: def.name.clone(),
                    reason: format!(
                        "defined in '{}.toml'; the file must be named '{}.toml'",
                        printable(stem),
                        def.name
                    ),
                }),
                Ok(def) => {
                    by_name.insert(def.name.clone(), Arc::new(def));
                }
                Err(e) => errors.push(SchemaError::InFile {
                    file: format!("{}.toml", printable(stem)),
                    source: Box::new(e),
                }),
            }
        }
        if errors.is_empty() {
            Ok(Streams { by_name })
        } else {
            Err(errors)
        }
    }

    pub fn get(&self, name: &str) -> Option<&Arc<StreamDef>> {
        self.by_name.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<StreamDef>> {
        self.by_name.values()
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// The definitions to run with once `loaded` (the directory read again) is in force: streams
    /// new in it are added, changed ones replaced when the change is compatible (see
    /// [`StreamDef::change_to`]; their dictionaries are taken too), and streams no longer in it
    /// are kept, as records of them may still be in flight. An incompatible change fails the
    /// whole update, naming the stream and why.
    pub fn updated_by(&self, loaded: Streams) -> Result<Updated, String> {
        let mut update = Updated {
            streams: self.clone(),
            ..Updated::default()
        };
        for (name, def) in loaded.by_name {
            match self
                .by_name
                .get(&name)
                .map(|running| running.change_to(&def))
            {
                None => update.added.push(name),
                Some(Change::Incompatible(reason)) => {
                    return Err(format!("stream '{name}': {reason}"));
                }
                Some(Change::Compatible) => update.changed.push(name),
                Some(Change::Same) => {}
            }
            update.streams.replace(def);
        }
        Ok(update)
    }

    /// Puts `def` in place of the stream of its name (or adds it).
    pub fn replace(&mut self, def: Arc<StreamDef>) {
        self.by_name.insert(def.name.clone(), def);
    }

    /// Adds `def` unless a stream of its name is there; whether it was added.
    pub fn insert(&mut self, def: Arc<StreamDef>) -> bool {
        match self.by_name.entry(def.name.clone()) {
            std::collections::btree_map::Entry::Occupied(_) => false,
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert(def);
                true
            }
        }
    }

    /// Keeps only the streams for which `keep` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&StreamDef) -> bool) {
        self.by_name.retain(|_, def| keep(def));
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Adds a zstd dictionary to a stream ([`Dictionaries::add`]).
    pub fn add_dictionary(
        &mut self,
        stream: &str,
        dictionary: ZstdDictionary,
        current: bool,
    ) -> Result<(), String> {
        let def = self
            .by_name
            .get_mut(stream)
            .ok_or_else(|| format!("no stream '{}' is defined", printable(stream)))?;
        Arc::make_mut(def).dictionaries.add(dictionary, current)
    }
}

/// A field name's first 8 bytes as a little-endian word, zero-padded: the scanner's first test
/// of a key against the name.
pub(crate) fn key_head(name: &[u8]) -> u64 {
    let mut head = [0u8; 8];
    let n = name.len().min(8);
    head[..n].copy_from_slice(&name[..n]);
    u64::from_le_bytes(head)
}

/// A field name as the content hash encodes it (its length in unsigned LEB128, then its UTF-8
/// bytes), computed once per stream.
pub(crate) fn encoded_name(name: &str) -> Box<[u8]> {
    let mut out = Vec::with_capacity(name.len() + 2);
    let mut n = name.len();
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
    out.extend_from_slice(name.as_bytes());
    out.into_boxed_slice()
}
