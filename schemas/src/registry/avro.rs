//! Avro binary values read straight into JSON text: the registered schema is compiled once
//! into a tree of [`Node`]s (checked against the stream's fields), then each value is walked
//! with it, without building Avro values first.

use apache_avro::Schema;

use crate::stream::{FieldDef, FieldType, StreamDef};
use crate::value::write_timestamp;

/// How to read one Avro value.
#[derive(Debug, Clone)]
enum Node {
    Null,
    Boolean,
    /// `int` and `long`, and the logical types over them that are not timestamps.
    Long,
    Float,
    Double,
    /// `bytes`, `fixed` (its size) and the logical types over them: hex text.
    Bytes(Option<usize>),
    /// `string` and `uuid`.
    String,
    Enum(Vec<String>),
    /// A timestamp (`long`) in units of `1 / per_second` seconds.
    Timestamp {
        per_second: i64,
    },
    Union(Vec<Node>),
    Array(Box<Node>),
    Map(Box<Node>),
    Record(Vec<(String, Node)>),
}

impl Node {
    fn of(schema: &Schema) -> Result<Node, String> {
        Ok(match schema {
            Schema::Null => Node::Null,
            Schema::Boolean => Node::Boolean,
            Schema::Int | Schema::Long | Schema::Date | Schema::TimeMillis | Schema::TimeMicros => {
                Node::Long
            }
            Schema::Float => Node::Float,
            Schema::Double => Node::Double,
            Schema::Bytes | Schema::BigDecimal => Node::Bytes(None),
            Schema::Decimal(d) => match &*d.inner {
                Schema::Fixed(f) => Node::Bytes(Some(f.size)),
                _ => Node::Bytes(None),
            },
            Schema::Fixed(f) => Node::Bytes(Some(f.size)),
            Schema::Duration => Node::Bytes(Some(12)),
            Schema::String | Schema::Uuid => Node::String,
            Schema::Enum(e) => Node::Enum(e.symbols.clone()),
            Schema::TimestampMillis | Schema::LocalTimestampMillis => {
                Node::Timestamp { per_second: 1_000 }
            }
            Schema::TimestampMicros | Schema::LocalTimestampMicros => Node::Timestamp {
                per_second: 1_000_000,
            },
            Schema::TimestampNanos | Schema::LocalTimestampNanos => Node::Timestamp {
                per_second: 1_000_000_000,
            },
            Schema::Union(u) => Node::Union(
                u.variants()
                    .iter()
                    .map(Node::of)
                    .collect::<Result<_, _>>()?,
            ),
            Schema::Array(a) => Node::Array(Box::new(Node::of(&a.items)?)),
            Schema::Map(m) => Node::Map(Box::new(Node::of(&m.types)?)),
            Schema::Record(r) => Node::Record(
                r.fields
                    .iter()
                    .map(|f| Ok((f.name.clone(), Node::of(&f.schema)?)))
                    .collect::<Result<_, String>>()?,
            ),
            Schema::Ref { name } => {
                return Err(format!(
                    "it refers to the named type '{}' again, which is not read",
                    name.name
                ));
            }
        })
    }

    /// Whether every value of this node is one the field type takes (null aside).
    fn fits(&self, ty: &FieldType) -> bool {
        match (self, ty) {
            (Node::Null, _) => true,
            (Node::Union(variants), _) => variants.iter().all(|v| v.fits(ty)),
            (Node::String | Node::Enum(_), FieldType::String) => true,
            (Node::Boolean, FieldType::Bool) => true,
            (Node::Long, FieldType::Int64) => true,
            (Node::Long | Node::Float | Node::Double, FieldType::Float64) => true,
            (Node::Timestamp { .. } | Node::String, FieldType::Timestamp) => true,
            (Node::Array(item), FieldType::List(t)) | (Node::Map(item), FieldType::Map(t)) => {
                item.fits(t)
            }
            _ => false,
        }
    }

    /// The field type of a stream whose values this node's are, null aside: `None` for what a
    /// stream's field cannot hold (bytes, records, unions of two types).
    fn field_type(&self) -> Option<FieldType> {
        Some(match self {
            Node::String | Node::Enum(_) => FieldType::String,
            Node::Boolean => FieldType::Bool,
            Node::Long => FieldType::Int64,
            Node::Float | Node::Double => FieldType::Float64,
            Node::Timestamp { .. } => FieldType::Timestamp,
            Node::Union(variants) => {
                let mut types = variants.iter().filter(|v| !matches!(v, Node::Null));
                let only = types.next()?.field_type()?;
                return types.next().is_none().then_some(only);
            }
            Node::Array(item) => {
                FieldType::List(Box::new(item.field_type().filter(FieldType::is_scalar)?))
            }
            Node::Map(item) => {
                FieldType::Map(Box::new(item.field_type().filter(FieldType::is_scalar)?))
            }
            Node::Null | Node::Bytes(_) | Node::Record(_) => return None,
        })
    }

    /// Whether the node takes null.
    fn nullable(&self) -> bool {
        match self {
            Node::Null => true,
            Node::Union(variants) => variants.iter().any(|v| matches!(v, Node::Null)),
            _ => false,
        }
    }

    /// The Avro type's name, for messages.
    fn name(&self) -> String {
        match self {
            Node::Null => "null".into(),
            Node::Boolean => "boolean".into(),
            Node::Long => "int or long".into(),
            Node::Float => "float".into(),
            Node::Double => "double".into(),
            Node::Bytes(_) => "bytes or fixed".into(),
            Node::String => "string".into(),
            Node::Enum(_) => "enum".into(),
            Node::Timestamp { .. } => "a timestamp".into(),
            Node::Union(v) => format!(
                "union of {}",
                v.iter().map(Node::name).collect::<Vec<_>>().join(", ")
            ),
            Node::Array(item) => format!("array of {}", item.name()),
            Node::Map(item) => format!("map of {}", item.name()),
            Node::Record(_) => "record".into(),
        }
    }
}

/// Parses an Avro schema. The apache-avro crate panics on some invalid ones (a record name
/// that is not a name, found by fuzzing) instead of returning an error; a schema from a
/// client or a registry must get an error like any other invalid one, not take down the
/// thread reading it.
fn parse_schema(text: &str) -> Result<Schema, String> {
    std::panic::catch_unwind(|| Schema::parse_str(text))
        .map_err(|_| "it is not an Avro schema (the Avro parser failed on it)".to_owned())?
        .map_err(|e| format!("it is not an Avro schema: {e}"))
}

/// A registered Avro schema of a record, compiled for one definition of a stream.
#[derive(Debug)]
pub struct Reader {
    /// The record's fields in the writer's order, each with its JSON key (`"name":`).
    fields: Vec<(Vec<u8>, Node)>,
}

impl Reader {
    /// Parses an Avro schema and checks it against `def`: a record whose fields of the
    /// definition's names fit their types, with every required field of the definition.
    pub fn compile(text: &str, def: &StreamDef) -> Result<Reader, String> {
        let schema = parse_schema(text)?;
        let Node::Record(fields) = Node::of(&schema)? else {
            return Err("it is not an Avro record".into());
        };
        for (name, node) in &fields {
            if let Some(i) = def.field_index(name) {
                let field = &def.fields[i];
                if !node.fits(&field.ty) {
                    return Err(format!(
                        "its field '{name}' is {}, the stream's is {}",
                        node.name(),
                        field.ty
                    ));
                }
            }
        }
        if let Some(missing) = def
            .fields
            .iter()
            .find(|f| f.required && !fields.iter().any(|(name, _)| *name == f.name))
        {
            return Err(format!(
                "it lacks the stream's required field '{}'",
                missing.name
            ));
        }
        let fields = fields
            .into_iter()
            .map(|(name, node)| {
                let mut key = Vec::with_capacity(name.len() + 3);
                write_json_str(&mut key, &name);
                key.push(b':');
                (key, node)
            })
            .collect();
        Ok(Reader { fields })
    }

    /// The record in `body` as a JSON object (fields whose value is null left out), or why
    /// the bytes do not match the schema.
    pub fn to_json(&self, body: &[u8]) -> Result<Vec<u8>, String> {
        let mut input = Input::value(body);
        let mut out = Vec::with_capacity(body.len() * 2 + 16);
        self.read_record(&mut input, &mut out)?;
        if !input.bytes.is_empty() {
            return Err(format!(
                "{} bytes are left after the record",
                input.bytes.len()
            ));
        }
        Ok(out)
    }

    /// Reads one record from `input` as a JSON object appended to `out`.
    pub(super) fn read_record(
        &self,
        input: &mut Input<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), String> {
        out.push(b'{');
        let mut first = true;
        for (key, node) in &self.fields {
            let mark = out.len();
            if !first {
                out.push(b',');
            }
            out.extend_from_slice(key);
            if read(node, input, out)? {
                first = false;
            } else {
                out.truncate(mark);
            }
        }
        out.push(b'}');
        Ok(())
    }
}

/// The fields of an Avro record schema that `def` lacks, as the nullable fields a compatible
/// definition would add: each must take null and be of one type a stream's field can be.
pub fn added_fields(text: &str, def: &StreamDef) -> Result<Vec<FieldDef>, String> {
    let schema = parse_schema(text)?;
    let Schema::Record(record) = &schema else {
        return Err("it is not an Avro record".into());
    };
    let mut added = Vec::new();
    for field in &record.fields {
        if def.field_index(&field.name).is_some() {
            continue;
        }
        let node = Node::of(&field.schema)?;
        let ty = node.field_type().filter(|_| node.nullable()).ok_or_else(|| {
            format!(
                "its field '{}' ({}) is not in stream '{}', and only a field that takes null and is of a stream's type can be added",
                field.name,
                node.name(),
                def.name
            )
        })?;
        added.push(FieldDef {
            name: field.name.clone(),
            ty,
            required: false,
            doc: field.doc.clone().unwrap_or_default(),
        });
    }
    Ok(added)
}

/// The bytes of a value not read yet.
pub(super) struct Input<'a> {
    pub(super) bytes: &'a [u8],
    /// The most JSON the value may become: items of a type that takes no bytes (null, an
    /// empty record, a fixed of size 0) would otherwise let a few bytes of block counts write
    /// without end.
    pub(super) max_json: usize,
}

impl<'a> Input<'a> {
    /// The bytes of one value, which may become at most 16 times their size in JSON and a
    /// MiB: more than any value of a type that takes bytes becomes.
    pub(super) fn value(bytes: &'a [u8]) -> Input<'a> {
        Input {
            bytes,
            max_json: (1 << 20) + bytes.len().saturating_mul(16),
        }
    }
}

impl<'a> Input<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.bytes.len() {
            return Err(format!(
                "it ends early: {n} bytes needed, {} left",
                self.bytes.len()
            ));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    /// A zigzag varint (`int` and `long`).
    pub(super) fn long(&mut self) -> Result<i64, String> {
        let mut value: u64 = 0;
        for shift in (0..70).step_by(7) {
            let byte = self.take(1)?[0];
            if shift == 63 && byte > 1 {
                return Err("a long takes more than 64 bits".into());
            }
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok((value >> 1) as i64 ^ -((value & 1) as i64));
            }
        }
        Err("a long takes more than 10 bytes".into())
    }

    /// A length or count: a long that is not negative and not beyond what is left.
    pub(super) fn len(&mut self) -> Result<usize, String> {
        let n = self.long()?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.bytes.len())
            .ok_or_else(|| format!("a length of {n} with {} bytes left", self.bytes.len()))
    }

    pub(super) fn string(&mut self) -> Result<&'a str, String> {
        let n = self.len()?;
        std::str::from_utf8(self.take(n)?).map_err(|_| "a string is not UTF-8".into())
    }

    /// The item count of an array or map block; a negative count is followed by the block's
    /// size in bytes. 0 ends the blocks.
    fn block(&mut self) -> Result<usize, String> {
        let n = self.long()?;
        if n < 0 {
            self.long()?;
        }
        let n = n.unsigned_abs();
        // An item takes a byte at least, but for nulls: a count beyond the bytes left is false.
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.bytes.len() + 1)
            .ok_or_else(|| format!("a block of {n} items with {} bytes left", self.bytes.len()))
    }
}

/// Reads one value of `node` as JSON into `out`; `false` for a null (nothing written).
fn read(node: &Node, input: &mut Input<'_>, out: &mut Vec<u8>) -> Result<bool, String> {
    match node {
        Node::Null => return Ok(false),
        Node::Boolean => out.extend_from_slice(match input.take(1)?[0] {
            0 => b"false",
            1 => b"true",
            b => return Err(format!("a boolean byte is {b}")),
        }),
        Node::Long => out.extend_from_slice(itoa::Buffer::new().format(input.long()?).as_bytes()),
        Node::Float => {
            let bytes = input.take(4)?.try_into().expect("4 bytes");
            write_float(out, f64::from(f32::from_le_bytes(bytes)))?;
        }
        Node::Double => {
            let bytes = input.take(8)?.try_into().expect("8 bytes");
            write_float(out, f64::from_le_bytes(bytes))?;
        }
        Node::Bytes(size) => {
            let n = match size {
                Some(n) => *n,
                None => input.len()?,
            };
            out.push(b'"');
            out.extend_from_slice(hex::encode(input.take(n)?).as_bytes());
            out.push(b'"');
        }
        Node::String => write_json_str(out, input.string()?),
        Node::Enum(symbols) => {
            let i = input.long()?;
            let symbol = usize::try_from(i)
                .ok()
                .and_then(|i| symbols.get(i))
                .ok_or_else(|| format!("enum index {i} of {} symbols", symbols.len()))?;
            write_json_str(out, symbol);
        }
        Node::Timestamp { per_second } => {
            let t = input.long()?;
            let micros = match per_second {
                1_000 => t.checked_mul(1_000),
                1_000_000 => Some(t),
                _ => Some(t.div_euclid(1_000)),
            }
            .ok_or_else(|| format!("timestamp {t} is out of range"))?;
            out.push(b'"');
            write_timestamp(out, micros);
            out.push(b'"');
        }
        Node::Union(variants) => {
            let i = input.long()?;
            let variant = usize::try_from(i)
                .ok()
                .and_then(|i| variants.get(i))
                .ok_or_else(|| format!("union branch {i} of {}", variants.len()))?;
            return read(variant, input, out);
        }
        Node::Array(item) => blocks(input, out, b"[]", |input, out| {
            read_or_null(item, input, out)
        })?,
        Node::Map(item) => blocks(input, out, b"{}", |input, out| {
            write_json_str(out, input.string()?);
            out.push(b':');
            read_or_null(item, input, out)
        })?,
        Node::Record(fields) => {
            out.push(b'{');
            for (i, (name, field)) in fields.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_json_str(out, name);
                out.push(b':');
                read_or_null(field, input, out)?;
            }
            out.push(b'}');
        }
    }
    Ok(true)
}

/// One value of `node`, `null` for a null.
fn read_or_null(node: &Node, input: &mut Input<'_>, out: &mut Vec<u8>) -> Result<(), String> {
    if !read(node, input, out)? {
        out.extend_from_slice(b"null");
    }
    Ok(())
}

/// The items of an array's or a map's blocks, each read by `item`, between `brackets` and
/// separated by commas.
fn blocks(
    input: &mut Input<'_>,
    out: &mut Vec<u8>,
    brackets: &[u8; 2],
    mut item: impl FnMut(&mut Input<'_>, &mut Vec<u8>) -> Result<(), String>,
) -> Result<(), String> {
    out.push(brackets[0]);
    let mut first = true;
    loop {
        let n = input.block()?;
        if n == 0 {
            break;
        }
        for _ in 0..n {
            if !first {
                out.push(b',');
            }
            first = false;
            item(input, out)?;
            if out.len() > input.max_json {
                return Err(format!(
                    "it becomes more than {} bytes of JSON",
                    input.max_json
                ));
            }
        }
    }
    out.push(brackets[1]);
    Ok(())
}

fn write_float(out: &mut Vec<u8>, f: f64) -> Result<(), String> {
    if !f.is_finite() {
        return Err(format!("{f} is not a number JSON records hold"));
    }
    serde_json::to_writer(&mut *out, &f).map_err(|e| e.to_string())
}

fn write_json_str(out: &mut Vec<u8>, s: &str) {
    // Serializing a str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}
