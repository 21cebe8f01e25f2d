//! Protobuf schemas as registries hold them: `.proto` text (what Java and JavaScript clients
//! register) or a base64 `FileDescriptorProto` (what confluent-kafka's Python serializer
//! registers), read into one model of the file's messages ([`ProtoFile`]). Imports are not read
//! but for `google/protobuf/timestamp.proto`, whose `Timestamp` is a timestamp. Protobuf's
//! binary encoding is read field by field by [`fields`], here for descriptors and in
//! `proto_wire` for values.

/// A scalar, enum or message type of a field.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Kind {
    Double,
    Float,
    Int64,
    Uint64,
    Int32,
    Uint32,
    Sint32,
    Sint64,
    Fixed32,
    Fixed64,
    Sfixed32,
    Sfixed64,
    Bool,
    String,
    Bytes,
    /// A message or enum, by its name as written (resolved against the file later).
    Named(String),
}

impl Kind {
    fn scalar(name: &str) -> Option<Kind> {
        Some(match name {
            "double" => Kind::Double,
            "float" => Kind::Float,
            "int64" => Kind::Int64,
            "uint64" => Kind::Uint64,
            "int32" => Kind::Int32,
            "uint32" => Kind::Uint32,
            "sint32" => Kind::Sint32,
            "sint64" => Kind::Sint64,
            "fixed32" => Kind::Fixed32,
            "fixed64" => Kind::Fixed64,
            "sfixed32" => Kind::Sfixed32,
            "sfixed64" => Kind::Sfixed64,
            "bool" => Kind::Bool,
            "string" => Kind::String,
            "bytes" => Kind::Bytes,
            _ => return None,
        })
    }

    /// `FieldDescriptorProto.Type`.
    fn of_descriptor(ty: u64, type_name: &str) -> Option<Kind> {
        Some(match ty {
            1 => Kind::Double,
            2 => Kind::Float,
            3 => Kind::Int64,
            4 => Kind::Uint64,
            5 => Kind::Int32,
            6 => Kind::Fixed64,
            7 => Kind::Fixed32,
            8 => Kind::Bool,
            9 => Kind::String,
            11 | 14 => Kind::Named(type_name.to_owned()),
            12 => Kind::Bytes,
            13 => Kind::Uint32,
            15 => Kind::Sfixed32,
            16 => Kind::Sfixed64,
            17 => Kind::Sint32,
            18 => Kind::Sint64,
            _ => return None,
        })
    }
}

/// How many values a field holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Label {
    /// proto3 without `optional`: absent means the type's default.
    Implicit,
    /// `optional` (or proto2's singular fields): absent means null.
    Optional,
    Repeated,
}

#[derive(Debug, Clone)]
pub(super) struct ProtoField {
    pub name: String,
    pub number: u64,
    pub label: Label,
    pub kind: Kind,
    /// For a `map<K, V>` field: its key and value kinds.
    pub map: Option<(Kind, Kind)>,
}

#[derive(Debug, Clone, Default)]
pub(super) struct ProtoMessage {
    pub name: String,
    pub fields: Vec<ProtoField>,
    pub nested: Vec<ProtoMessage>,
    /// A `map<K, V>` field's entry type (descriptors only).
    pub map_entry: bool,
}

#[derive(Debug, Clone)]
pub(super) struct ProtoEnum {
    pub name: String,
    pub values: Vec<(i64, String)>,
}

#[derive(Debug, Clone, Default)]
pub(super) struct ProtoFile {
    pub messages: Vec<ProtoMessage>,
    pub enums: Vec<ProtoEnum>,
}

impl ProtoFile {
    /// `.proto` text, or a base64 `FileDescriptorProto`.
    pub fn parse(schema: &str) -> Result<ProtoFile, String> {
        use base64::Engine as _;
        let text = schema.trim();
        let base64_alphabet = |c: char| c.is_ascii_alphanumeric() || matches!(c, '+' | '/' | '=');
        if !text.is_empty() && text.chars().all(base64_alphabet) {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(text)
                .map_err(|e| format!("it is not a Protobuf schema (base64: {e})"))?;
            return descriptor::file(&bytes)
                .map_err(|e| format!("it is not a Protobuf schema (a FileDescriptorProto: {e})"));
        }
        text::file(text).map_err(|e| format!("it is not a Protobuf schema: {e}"))
    }

    /// The enum of a field's type name, found by its last name component.
    pub fn enum_named(&self, name: &str) -> Option<&ProtoEnum> {
        let last = name.rsplit('.').next().unwrap_or(name);
        self.enums.iter().find(|e| e.name == last)
    }

    /// The message of a field's type name, found by its last name component.
    pub fn message_named(&self, name: &str) -> Option<&ProtoMessage> {
        let last = name.rsplit('.').next().unwrap_or(name);
        fn find<'a>(messages: &'a [ProtoMessage], last: &str) -> Option<&'a ProtoMessage> {
            messages
                .iter()
                .find(|m| m.name == last)
                .or_else(|| messages.iter().find_map(|m| find(&m.nested, last)))
        }
        find(&self.messages, last)
    }
}

/// One field of an encoded message.
pub(super) enum Field<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32(u32),
}

pub(super) fn varint(bytes: &mut &[u8]) -> Result<u64, String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = bytes.split_first().ok_or("a varint is cut short")?;
        *bytes = rest;
        value |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("a varint is longer than 10 bytes".into())
}

pub(super) fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
    if n > bytes.len() {
        return Err(format!("{n} bytes needed, {} left", bytes.len()));
    }
    let (head, rest) = bytes.split_at(n);
    *bytes = rest;
    Ok(head)
}

/// The fields of an encoded message, in the order written.
pub(super) fn fields(mut bytes: &[u8]) -> impl Iterator<Item = Result<(u64, Field<'_>), String>> {
    std::iter::from_fn(move || {
        if bytes.is_empty() {
            return None;
        }
        let field = (|| {
            let key = varint(&mut bytes)?;
            let value = match key & 7 {
                0 => Field::Varint(varint(&mut bytes)?),
                1 => Field::Fixed64(u64::from_le_bytes(
                    take(&mut bytes, 8)?.try_into().expect("8"),
                )),
                2 => {
                    let n = usize::try_from(varint(&mut bytes)?).map_err(|_| "a length")?;
                    Field::Bytes(take(&mut bytes, n)?)
                }
                5 => Field::Fixed32(u32::from_le_bytes(
                    take(&mut bytes, 4)?.try_into().expect("4"),
                )),
                w => return Err(format!("wire type {w} is not read")),
            };
            Ok((key >> 3, value))
        })();
        if field.is_err() {
            bytes = &[];
        }
        Some(field)
    })
}

pub(super) fn zigzag(n: u64) -> i64 {
    (n >> 1) as i64 ^ -((n & 1) as i64)
}

/// Messages nested deeper than this are refused (a hostile schema would otherwise take the
/// stack).
const MAX_NESTING: usize = 32;

/// Whether a type name is `google.protobuf.Timestamp`.
pub(super) fn is_timestamp(name: &str) -> bool {
    matches!(
        name.trim_start_matches('.'),
        "google.protobuf.Timestamp" | "Timestamp"
    )
}

/// `.proto` text (proto2 or proto3): messages (nested, with `map<K, V>`, `oneof` and labels),
/// enums; options, `reserved`, `extensions`, services and imports are read past.
mod text {
    use super::*;

    #[derive(Debug, PartialEq)]
    enum Token<'a> {
        Word(&'a str),
        Text(&'a str),
        Symbol(char),
    }

    fn tokens(text: &str) -> Result<Vec<Token<'_>>, String> {
        let mut out = Vec::new();
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            let c = bytes[i] as char;
            if c.is_ascii_whitespace() {
                i += 1;
            } else if text[i..].starts_with("//") {
                i += text[i..].find('\n').unwrap_or(text.len() - i);
            } else if text[i..].starts_with("/*") {
                i += text[i..].find("*/").ok_or("an unclosed comment")? + 2;
            } else if c == '"' || c == '\'' {
                let end = text[i + 1..].find(c).ok_or("an unclosed string")?;
                out.push(Token::Text(&text[i + 1..i + 1 + end]));
                i += end + 2;
            } else if c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-' || c == '+' {
                let start = i;
                while i < bytes.len() {
                    let d = bytes[i] as char;
                    if !(d.is_ascii_alphanumeric() || matches!(d, '_' | '.' | '-' | '+')) {
                        break;
                    }
                    i += 1;
                }
                out.push(Token::Word(&text[start..i]));
            } else {
                out.push(Token::Symbol(c));
                i += 1;
            }
        }
        Ok(out)
    }

    struct Parser<'a> {
        tokens: Vec<Token<'a>>,
        at: usize,
        proto3: bool,
        /// Messages (and `oneof`s) open around the one being read.
        depth: usize,
    }

    impl<'a> Parser<'a> {
        fn next(&mut self) -> Result<&Token<'a>, String> {
            let t = self.tokens.get(self.at).ok_or("it ends early")?;
            self.at += 1;
            Ok(t)
        }

        fn word(&mut self) -> Result<&'a str, String> {
            match self.next()? {
                Token::Word(w) => Ok(w),
                t => Err(format!("expected a name, got {t:?}")),
            }
        }

        fn expect(&mut self, c: char) -> Result<(), String> {
            match self.next()? {
                Token::Symbol(s) if *s == c => Ok(()),
                t => Err(format!("expected '{c}', got {t:?}")),
            }
        }

        fn peek_symbol(&self, c: char) -> bool {
            self.tokens.get(self.at) == Some(&Token::Symbol(c))
        }

        /// Reads past a statement to its `;`, or a block to its closing brace.
        fn skip(&mut self) -> Result<(), String> {
            let mut depth = 0;
            loop {
                match self.next()? {
                    Token::Symbol(';') if depth == 0 => return Ok(()),
                    Token::Symbol('{') => depth += 1,
                    Token::Symbol('}') => {
                        depth -= 1;
                        if depth == 0 {
                            return Ok(());
                        }
                    }
                    _ => {}
                }
            }
        }

        fn number(&mut self) -> Result<i64, String> {
            let w = self.word()?;
            w.parse()
                .map_err(|_| format!("expected a number, got '{w}'"))
        }

        /// Reads `= N [options];` after a field's name.
        fn field_end(&mut self) -> Result<u64, String> {
            self.expect('=')?;
            let n = self.number()?;
            if self.peek_symbol('[') {
                while !matches!(self.next()?, Token::Symbol(']')) {}
            }
            self.expect(';')?;
            u64::try_from(n).map_err(|_| format!("field number {n}"))
        }

        fn enumeration(&mut self, file: &mut ProtoFile) -> Result<(), String> {
            let name = self.word()?.to_owned();
            self.expect('{')?;
            let mut values = Vec::new();
            while !self.peek_symbol('}') {
                let w = self.word()?;
                if matches!(w, "option" | "reserved") {
                    self.skip()?;
                    continue;
                }
                self.expect('=')?;
                let n = self.number()?;
                if self.peek_symbol('[') {
                    while !matches!(self.next()?, Token::Symbol(']')) {}
                }
                self.expect(';')?;
                values.push((n, w.to_owned()));
            }
            self.expect('}')?;
            file.enums.push(ProtoEnum { name, values });
            Ok(())
        }

        fn message(&mut self, file: &mut ProtoFile) -> Result<ProtoMessage, String> {
            if self.depth >= MAX_NESTING {
                return Err(format!("messages nest more than {MAX_NESTING} deep"));
            }
            let mut message = ProtoMessage {
                name: self.word()?.to_owned(),
                ..ProtoMessage::default()
            };
            self.expect('{')?;
            self.depth += 1;
            let body = self.body(file, &mut message);
            self.depth -= 1;
            body.map(|()| message)
        }

        /// A message's body up to and with its closing brace (also a `oneof`'s).
        fn body(&mut self, file: &mut ProtoFile, message: &mut ProtoMessage) -> Result<(), String> {
            loop {
                if self.peek_symbol('}') {
                    self.at += 1;
                    return Ok(());
                }
                if self.peek_symbol(';') {
                    self.at += 1;
                    continue;
                }
                let w = self.word()?;
                match w {
                    "message" => {
                        let nested = self.message(file)?;
                        message.nested.push(nested);
                    }
                    "enum" => self.enumeration(file)?,
                    "oneof" => {
                        self.word()?;
                        self.expect('{')?;
                        if self.depth >= MAX_NESTING {
                            return Err(format!("messages nest more than {MAX_NESTING} deep"));
                        }
                        self.depth += 1;
                        let body = self.body(file, message);
                        self.depth -= 1;
                        body?;
                    }
                    "option" | "reserved" | "extensions" | "extend" => self.skip()?,
                    "map" => {
                        self.expect('<')?;
                        let key = self.word()?;
                        self.expect(',')?;
                        let value = self.word()?;
                        self.expect('>')?;
                        let name = self.word()?.to_owned();
                        let number = self.field_end()?;
                        let kind =
                            |t: &str| Kind::scalar(t).unwrap_or_else(|| Kind::Named(t.into()));
                        message.fields.push(ProtoField {
                            name,
                            number,
                            label: Label::Repeated,
                            kind: Kind::Named(String::new()),
                            map: Some((kind(key), kind(value))),
                        });
                    }
                    _ => {
                        let (label, ty) = match w {
                            "repeated" => (Label::Repeated, self.word()?),
                            "optional" | "required" => (Label::Optional, self.word()?),
                            ty if self.proto3 => (Label::Implicit, ty),
                            ty => (Label::Optional, ty),
                        };
                        let name = self.word()?.to_owned();
                        let number = self.field_end()?;
                        message.fields.push(ProtoField {
                            name,
                            number,
                            label,
                            kind: Kind::scalar(ty).unwrap_or_else(|| Kind::Named(ty.into())),
                            map: None,
                        });
                    }
                }
            }
        }
    }

    pub(super) fn file(text: &str) -> Result<ProtoFile, String> {
        let mut parser = Parser {
            tokens: tokens(text)?,
            at: 0,
            proto3: false,
            depth: 0,
        };
        let mut file = ProtoFile::default();
        while parser.at < parser.tokens.len() {
            match parser.word()? {
                "syntax" => {
                    parser.expect('=')?;
                    parser.proto3 = parser.next()? == &Token::Text("proto3");
                    parser.expect(';')?;
                }
                "message" => {
                    let message = parser.message(&mut file)?;
                    file.messages.push(message);
                }
                "enum" => parser.enumeration(&mut file)?,
                "package" | "import" | "option" | "edition" => parser.skip()?,
                "service" | "extend" => parser.skip()?,
                w => return Err(format!("unexpected '{w}'")),
            }
        }
        if file.messages.is_empty() {
            return Err("it defines no message".into());
        }
        Ok(file)
    }
}

/// A serialized `FileDescriptorProto`, read with the wire format's own rules.
mod descriptor {
    use super::*;

    fn text(bytes: &[u8]) -> Result<String, String> {
        String::from_utf8(bytes.to_vec()).map_err(|_| "a name is not UTF-8".to_owned())
    }

    fn enumeration(bytes: &[u8]) -> Result<ProtoEnum, String> {
        let mut e = ProtoEnum {
            name: String::new(),
            values: Vec::new(),
        };
        for field in fields(bytes) {
            match field? {
                (1, Field::Bytes(b)) => e.name = text(b)?,
                (2, Field::Bytes(b)) => {
                    let (mut name, mut number) = (String::new(), 0);
                    for f in fields(b) {
                        match f? {
                            (1, Field::Bytes(n)) => name = text(n)?,
                            (2, Field::Varint(n)) => number = n as i32 as i64,
                            _ => {}
                        }
                    }
                    e.values.push((number, name));
                }
                _ => {}
            }
        }
        Ok(e)
    }

    fn message(
        bytes: &[u8],
        file: &mut ProtoFile,
        (proto3, depth): (bool, usize),
    ) -> Result<ProtoMessage, String> {
        if depth >= MAX_NESTING {
            return Err(format!("messages nest more than {MAX_NESTING} deep"));
        }
        let mut m = ProtoMessage::default();
        for field in fields(bytes) {
            match field? {
                (1, Field::Bytes(b)) => m.name = text(b)?,
                (2, Field::Bytes(b)) => {
                    let (mut name, mut number, mut label, mut ty) = (String::new(), 0, 1, 0);
                    let (mut type_name, mut optional3) = (String::new(), false);
                    for f in fields(b) {
                        match f? {
                            (1, Field::Bytes(n)) => name = text(n)?,
                            (3, Field::Varint(n)) => number = n,
                            (4, Field::Varint(n)) => label = n,
                            (5, Field::Varint(n)) => ty = n,
                            (6, Field::Bytes(n)) => type_name = text(n)?,
                            (17, Field::Varint(n)) => optional3 = n != 0,
                            _ => {}
                        }
                    }
                    let kind = Kind::of_descriptor(ty, &type_name).ok_or_else(|| {
                        format!("field '{name}' has type {ty}, which is not read")
                    })?;
                    let label = match label {
                        3 => Label::Repeated,
                        _ if proto3 && !optional3 && !matches!(kind, Kind::Named(_)) => {
                            Label::Implicit
                        }
                        _ => Label::Optional,
                    };
                    m.fields.push(ProtoField {
                        name,
                        number,
                        label,
                        kind,
                        map: None,
                    });
                }
                (3, Field::Bytes(b)) => {
                    let nested = message(b, file, (proto3, depth + 1))?;
                    m.nested.push(nested);
                }
                (4, Field::Bytes(b)) => file.enums.push(enumeration(b)?),
                (7, Field::Bytes(b)) => {
                    for f in fields(b) {
                        if let (7, Field::Varint(n)) = f? {
                            m.map_entry = n != 0;
                        }
                    }
                }
                _ => {}
            }
        }
        // A repeated field of a map entry type is a map.
        let entries: Vec<(String, Kind, Kind)> = m
            .nested
            .iter()
            .filter(|n| n.map_entry)
            .filter_map(|n| {
                let key = n.fields.iter().find(|f| f.number == 1)?.kind.clone();
                let value = n.fields.iter().find(|f| f.number == 2)?.kind.clone();
                Some((n.name.clone(), key, value))
            })
            .collect();
        for f in &mut m.fields {
            if let Kind::Named(name) = &f.kind {
                let last = name.rsplit('.').next().unwrap_or(name);
                if let Some((_, key, value)) = entries.iter().find(|(n, ..)| n == last) {
                    f.map = Some((key.clone(), value.clone()));
                }
            }
        }
        Ok(m)
    }

    pub(super) fn file(bytes: &[u8]) -> Result<ProtoFile, String> {
        let mut syntax = String::new();
        for field in fields(bytes) {
            if let (12, Field::Bytes(b)) = field? {
                syntax = text(b)?;
            }
        }
        let proto3 = syntax == "proto3";
        let mut file = ProtoFile::default();
        for field in fields(bytes) {
            match field? {
                (4, Field::Bytes(b)) => {
                    let m = message(b, &mut file, (proto3, 0))?;
                    file.messages.push(m);
                }
                (5, Field::Bytes(b)) => file.enums.push(enumeration(b)?),
                _ => {}
            }
        }
        if file.messages.is_empty() {
            return Err("it defines no message".into());
        }
        Ok(file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proto_text_is_read_with_labels_maps_enums_and_nested_messages() {
        let file = ProtoFile::parse(
            r#"
            syntax = "proto3";
            package plant; // a comment
            import "google/protobuf/timestamp.proto";
            option java_package = "x.y";
            /* a block
               comment */
            message Reading {
              string device_id = 1;
              google.protobuf.Timestamp ts = 2 [deprecated = true];
              optional double value = 3;
              repeated int64 samples = 4;
              map<string, string> tags = 5;
              Quality quality = 6;
              oneof extra { string note = 7; }
              reserved 9, 10;
              message Inner { bool ok = 1; }
            }
            enum Quality { BAD = 0; GOOD = 192; }
            "#,
        )
        .unwrap();
        let reading = &file.messages[0];
        let labels: Vec<_> = reading
            .fields
            .iter()
            .map(|f| (f.name.as_str(), f.number, f.label))
            .collect();
        assert_eq!(
            labels,
            [
                ("device_id", 1, Label::Implicit),
                ("ts", 2, Label::Implicit),
                ("value", 3, Label::Optional),
                ("samples", 4, Label::Repeated),
                ("tags", 5, Label::Repeated),
                ("quality", 6, Label::Implicit),
                ("note", 7, Label::Implicit),
            ]
        );
        assert_eq!(reading.fields[4].map, Some((Kind::String, Kind::String)));
        assert_eq!(file.messages[0].nested[0].name, "Inner");
        assert_eq!(
            file.enum_named(".plant.Quality").unwrap().values[1],
            (192, "GOOD".into())
        );
        assert!(ProtoFile::parse("syntax = \"proto3\";").is_err());
        let deep = "message A { ".repeat(40) + &"}".repeat(40);
        assert!(
            ProtoFile::parse(&deep)
                .unwrap_err()
                .contains("nest more than 32")
        );
        assert!(ProtoFile::parse("message {").is_err());
    }
}
