//! Protobuf values in the registry wire format read straight into JSON text: after the schema
//! id come the message indexes (a zigzag varint count, then as many zigzag varint indexes; a
//! single 0 is the first message), then the message in Protobuf's binary encoding. Each message
//! of the registered file is compiled once into a [`Plan`] (its fields checked against the
//! stream's); a value is then walked field by field.

use std::collections::HashMap;

use super::proto::{
    Field, Kind, Label, ProtoFile, ProtoMessage, fields, is_timestamp, take, varint, zigzag,
};
use crate::stream::{FieldType, StreamDef};
use crate::value::write_timestamp;

/// A field's type with its names resolved.
#[derive(Debug, Clone)]
enum Node {
    Scalar(Kind),
    Timestamp,
    Enum(Vec<(i64, String)>),
    Message(Box<Plan>),
    /// A message nested past [`MAX_DEPTH`] (a type that holds itself): its bytes as hex.
    Opaque,
}

/// Nested messages compiled at most this deep.
const MAX_DEPTH: usize = 8;

#[derive(Debug, Clone)]
struct PlanField {
    number: u64,
    /// `"name":`
    key: Vec<u8>,
    label: Label,
    node: Node,
    /// A map's key and value.
    map: Option<(Node, Node)>,
    /// Whether an absent proto3 scalar is written as its default: for the stream's fields (the
    /// value a producer cannot tell from absence); others left out, as a field the stream
    /// lacks must be.
    defaults: bool,
}

/// A message compiled for reading.
#[derive(Debug, Clone)]
struct Plan {
    fields: Vec<PlanField>,
}

fn node(file: &ProtoFile, kind: &Kind, depth: usize) -> Node {
    match kind {
        Kind::Named(name) if is_timestamp(name) => Node::Timestamp,
        Kind::Named(name) => {
            if let Some(e) = file.enum_named(name) {
                Node::Enum(e.values.clone())
            } else if let (Some(m), true) = (file.message_named(name), depth < MAX_DEPTH) {
                Node::Message(Box::new(plan(file, m, depth + 1)))
            } else {
                Node::Opaque
            }
        }
        k => Node::Scalar(k.clone()),
    }
}

fn plan(file: &ProtoFile, message: &ProtoMessage, depth: usize) -> Plan {
    Plan {
        fields: message
            .fields
            .iter()
            .map(|f| {
                let mut key = Vec::with_capacity(f.name.len() + 3);
                let _ = serde_json::to_writer(&mut key, &f.name);
                key.push(b':');
                PlanField {
                    number: f.number,
                    key,
                    label: f.label,
                    node: node(file, &f.kind, depth),
                    map: f
                        .map
                        .as_ref()
                        .map(|(k, v)| (node(file, k, depth), node(file, v, depth))),
                    defaults: depth > 0,
                }
            })
            .collect(),
    }
}

fn scalar_fits(node: &Node, ty: &FieldType) -> bool {
    use Kind::*;
    match (node, ty) {
        (Node::Scalar(String) | Node::Enum(_), FieldType::String) => true,
        (Node::Scalar(Bool), FieldType::Bool) => true,
        (Node::Timestamp | Node::Scalar(String), FieldType::Timestamp) => true,
        (Node::Scalar(k), FieldType::Int64 | FieldType::Timestamp) => matches!(
            k,
            Int64
                | Uint64
                | Int32
                | Uint32
                | Sint32
                | Sint64
                | Fixed32
                | Fixed64
                | Sfixed32
                | Sfixed64
        ),
        (Node::Scalar(k), FieldType::Float64) => !matches!(k, String | Bytes | Bool | Named(_)),
        _ => false,
    }
}

fn name_of(f: &PlanField) -> String {
    String::from_utf8_lossy(&f.key[1..f.key.len() - 2]).into_owned()
}

/// Whether a message's fields fit the stream's: every field of a stream's name of a fitting
/// type, every required field of the stream there.
fn check(plan: &Plan, def: &StreamDef) -> Result<(), String> {
    for f in &plan.fields {
        let name = name_of(f);
        let Some(i) = def.field_index(&name) else {
            continue;
        };
        let ty = &def.fields[i].ty;
        let fits = match (&f.map, f.label, ty) {
            (Some((Node::Scalar(Kind::String), v)), _, FieldType::Map(t)) => scalar_fits(v, t),
            (Some(_), ..) => false,
            (None, Label::Repeated, FieldType::List(t)) => scalar_fits(&f.node, t),
            (None, Label::Repeated, _) => false,
            (None, _, ty) => scalar_fits(&f.node, ty),
        };
        if !fits {
            return Err(format!(
                "its field '{name}' is not of a Protobuf type the stream's {ty} takes"
            ));
        }
    }
    match def
        .fields
        .iter()
        .find(|f| f.required && !plan.fields.iter().any(|p| name_of(p) == f.name))
    {
        Some(f) => Err(format!("it lacks the stream's required field '{}'", f.name)),
        None => Ok(()),
    }
}

/// A registered Protobuf schema compiled for one definition of a stream: each message, by its
/// message indexes, with its plan or why it cannot be read into the stream's records.
#[derive(Debug)]
pub struct ProtoReader {
    messages: HashMap<Vec<usize>, Result<Plan, String>>,
}

impl ProtoReader {
    /// Parses the schema and compiles its messages (nested ones too) for `def`: taken when at
    /// least one message fits the stream.
    pub fn compile(text: &str, def: &StreamDef) -> Result<ProtoReader, String> {
        let file = ProtoFile::parse(text)?;
        let mut messages = HashMap::new();
        let mut todo: Vec<(Vec<usize>, &ProtoMessage)> = file
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| (vec![i], m))
            .collect();
        while let Some((path, message)) = todo.pop() {
            for (i, nested) in message.nested.iter().enumerate() {
                let mut p = path.clone();
                p.push(i);
                todo.push((p, nested));
            }
            let mut compiled = plan(&file, message, 0);
            for f in &mut compiled.fields {
                f.defaults = def.field_index(&name_of(f)).is_some();
            }
            let checked = check(&compiled, def).map(|()| compiled);
            messages.insert(path, checked);
        }
        let first = messages.get(&vec![0]).cloned();
        match first {
            Some(Err(reason)) if messages.values().all(Result::is_err) => Err(reason),
            _ => Ok(ProtoReader { messages }),
        }
    }

    /// The message in `body` (message indexes, then the message) as a JSON object.
    pub fn to_json(&self, mut body: &[u8]) -> Result<Vec<u8>, String> {
        let count = zigzag(varint(&mut body)?);
        let indexes = if count == 0 {
            vec![0]
        } else {
            (0..count.min(64))
                .map(|_| Ok(zigzag(varint(&mut body)?) as usize))
                .collect::<Result<Vec<_>, String>>()?
        };
        let plan = match self.messages.get(&indexes) {
            Some(Ok(plan)) => plan,
            Some(Err(reason)) => return Err(format!("message {indexes:?}: {reason}")),
            None => return Err(format!("the schema has no message {indexes:?}")),
        };
        let mut out = Vec::with_capacity(body.len() * 2 + 16);
        read_message(plan, body, &mut out)?;
        Ok(out)
    }
}

/// One value of `node` from a field as JSON text; `Ok(false)` when the wire type does not fit.
fn value(node: &Node, field: &Field<'_>, out: &mut Vec<u8>) -> Result<bool, String> {
    use Kind::*;
    let mut num = itoa::Buffer::new();
    match (node, field) {
        (Node::Scalar(k), Field::Varint(n)) => {
            let n = *n;
            let text = match k {
                Int64 => num.format(n as i64),
                Uint64 => num.format(n),
                Int32 => num.format(n as i64 as i32),
                Uint32 => num.format(n as u32),
                Sint32 | Sint64 => num.format(zigzag(n)),
                Bool => {
                    out.extend_from_slice(if n != 0 { b"true" } else { b"false" });
                    return Ok(true);
                }
                Double | Float => return Ok(false),
                _ => return Ok(false),
            };
            out.extend_from_slice(text.as_bytes());
        }
        (Node::Scalar(k), Field::Fixed64(n)) => match k {
            Fixed64 => out.extend_from_slice(num.format(*n).as_bytes()),
            Sfixed64 => out.extend_from_slice(num.format(*n as i64).as_bytes()),
            Double => float(out, f64::from_bits(*n))?,
            _ => return Ok(false),
        },
        (Node::Scalar(k), Field::Fixed32(n)) => match k {
            Fixed32 => out.extend_from_slice(num.format(*n).as_bytes()),
            Sfixed32 => out.extend_from_slice(num.format(*n as i32).as_bytes()),
            Float => float(out, f64::from(f32::from_bits(*n)))?,
            _ => return Ok(false),
        },
        (Node::Scalar(String), Field::Bytes(b)) => {
            let s = std::str::from_utf8(b).map_err(|_| "a string is not UTF-8")?;
            let _ = serde_json::to_writer(&mut *out, s);
        }
        (Node::Scalar(Bytes) | Node::Opaque, Field::Bytes(b)) => {
            out.push(b'"');
            out.extend_from_slice(hex::encode(b).as_bytes());
            out.push(b'"');
        }
        (Node::Enum(values), Field::Varint(n)) => {
            let n = *n as i64 as i32 as i64;
            match values.iter().find(|(v, _)| *v == n) {
                Some((_, name)) => {
                    let _ = serde_json::to_writer(&mut *out, name);
                }
                None => out.extend_from_slice(num.format(n).as_bytes()),
            }
        }
        (Node::Timestamp, Field::Bytes(b)) => {
            let (mut seconds, mut nanos) = (0i64, 0i64);
            for f in fields(b) {
                match f? {
                    (1, Field::Varint(s)) => seconds = s as i64,
                    (2, Field::Varint(n)) => nanos = n as i64 as i32 as i64,
                    _ => {}
                }
            }
            let micros = seconds
                .checked_mul(1_000_000)
                .and_then(|m| m.checked_add(nanos.div_euclid(1_000)))
                .ok_or("a timestamp is out of range")?;
            out.push(b'"');
            write_timestamp(out, micros);
            out.push(b'"');
        }
        (Node::Message(plan), Field::Bytes(b)) => read_message(plan, b, out)?,
        _ => return Ok(false),
    }
    Ok(true)
}

fn float(out: &mut Vec<u8>, f: f64) -> Result<(), String> {
    if !f.is_finite() {
        return Err(format!("{f} is not a number JSON records hold"));
    }
    serde_json::to_writer(&mut *out, &f).map_err(|e| e.to_string())
}

/// The default JSON of an absent proto3 scalar or enum field (an enum's value 0, by name).
fn default(node: &Node) -> Option<Vec<u8>> {
    Some(match node {
        Node::Scalar(Kind::String) => b"\"\"".to_vec(),
        Node::Scalar(Kind::Bool) => b"false".to_vec(),
        Node::Scalar(Kind::Bytes | Kind::Named(_)) | Node::Message(_) | Node::Timestamp => {
            return None;
        }
        Node::Opaque => return None,
        Node::Enum(values) => {
            let (_, name) = values.iter().find(|(n, _)| *n == 0)?;
            serde_json::to_vec(name).ok()?
        }
        Node::Scalar(_) => b"0".to_vec(),
    })
}

/// A value's JSON text in the buffer of [`read_message`] (start, end), with a map value's
/// after its key's.
type Span = (usize, usize, Option<(usize, usize)>);

/// Reads a message into a JSON object appended to `out`; fields without a value (and without
/// a proto3 default) are left out, as nulls.
fn read_message(plan: &Plan, bytes: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
    // Each field's values as JSON texts, in the order read (the last one of a singular field
    // counts), into one buffer.
    let mut texts: Vec<Vec<Span>> = vec![Vec::new(); plan.fields.len()];
    let mut buffer = Vec::new();
    for field in fields(bytes) {
        let (number, field) = field?;
        let Some(i) = plan.fields.iter().position(|f| f.number == number) else {
            continue;
        };
        let f = &plan.fields[i];
        if let Some((key, val)) = &f.map {
            let Field::Bytes(entry) = field else {
                return Err(format!("map field {number} is not length-delimited"));
            };
            let (k0, mut k1, mut v) = (buffer.len(), buffer.len(), None);
            for e in fields(entry) {
                match e? {
                    (1, kf) => {
                        buffer.truncate(k0);
                        value(key, &kf, &mut buffer)?;
                        k1 = buffer.len();
                    }
                    (2, vf) => {
                        let v0 = buffer.len();
                        value(val, &vf, &mut buffer)?;
                        v = Some((v0, buffer.len()));
                    }
                    _ => {}
                }
            }
            texts[i].push((k0, k1, v));
            continue;
        }
        let start = buffer.len();
        if value(&f.node, &field, &mut buffer)? {
            texts[i].push((start, buffer.len(), None));
            continue;
        }
        // Packed repeated numbers.
        let (Label::Repeated, Field::Bytes(packed), Node::Scalar(k)) = (f.label, field, &f.node)
        else {
            return Err(format!(
                "field {number} has a wire type its schema's type does not take"
            ));
        };
        let mut packed = packed;
        while !packed.is_empty() {
            let item = match k {
                Kind::Double | Kind::Fixed64 | Kind::Sfixed64 => Field::Fixed64(
                    u64::from_le_bytes(take(&mut packed, 8)?.try_into().expect("8")),
                ),
                Kind::Float | Kind::Fixed32 | Kind::Sfixed32 => Field::Fixed32(u32::from_le_bytes(
                    take(&mut packed, 4)?.try_into().expect("4"),
                )),
                _ => Field::Varint(varint(&mut packed)?),
            };
            let start = buffer.len();
            if !value(&f.node, &item, &mut buffer)? {
                return Err(format!(
                    "packed field {number} holds what its type does not"
                ));
            }
            texts[i].push((start, buffer.len(), None));
        }
    }
    out.push(b'{');
    let mut first = true;
    for (f, values) in plan.fields.iter().zip(&texts) {
        let (is_map, repeated) = (f.map.is_some(), f.label == Label::Repeated);
        let absent_default =
            (values.is_empty() && f.label == Label::Implicit && !is_map && f.defaults)
                .then(|| default(&f.node))
                .flatten();
        if values.is_empty() && absent_default.is_none() {
            continue;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_slice(&f.key);
        if is_map {
            out.push(b'{');
            for (j, (k0, k1, v)) in values.iter().enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                // Map keys are strings in JSON.
                let key = &buffer[*k0..*k1];
                if key.first() == Some(&b'"') {
                    out.extend_from_slice(key);
                } else {
                    let _ = serde_json::to_writer(&mut *out, &String::from_utf8_lossy(key));
                }
                out.push(b':');
                match v {
                    Some((v0, v1)) => out.extend_from_slice(&buffer[*v0..*v1]),
                    None => out.extend_from_slice(
                        &default(val_node(f)).unwrap_or_else(|| b"null".to_vec()),
                    ),
                }
            }
            out.push(b'}');
        } else if repeated {
            out.push(b'[');
            for (j, (s, e, _)) in values.iter().enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(&buffer[*s..*e]);
            }
            out.push(b']');
        } else if let Some((s, e, _)) = values.last() {
            out.extend_from_slice(&buffer[*s..*e]);
        } else if let Some(d) = absent_default {
            out.extend_from_slice(&d);
        }
    }
    out.push(b'}');
    Ok(())
}

fn val_node(f: &PlanField) -> &Node {
    f.map.as_ref().map_or(&f.node, |(_, v)| v)
}
