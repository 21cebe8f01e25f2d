use thiserror::Error;

/// A problem with a stream definition.
#[derive(Debug, Error)]
pub enum SchemaError {
    #[error("invalid {what} name '{name}': must match ^[a-z][a-z0-9_]{{0,62}}$")]
    InvalidName { what: &'static str, name: String },
    #[error("cannot parse stream definition: {0}")]
    Parse(String),
    #[error("stream '{stream}': {reason}")]
    Invalid { stream: String, reason: String },
    #[error("{file}: {source}")]
    InFile {
        file: String,
        #[source]
        source: Box<SchemaError>,
    },
}

/// Why one record was rejected. The message names the field, what was expected and what came.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RecordError {
    #[error("malformed JSON: {0}")]
    Malformed(String),
    #[error("record must be a JSON object, got {got}")]
    NotAnObject { got: String },
    #[error("field '{field}' is required but missing or null")]
    Missing { field: String },
    #[error("field '{field}' is not part of the stream's schema")]
    Unknown { field: String },
    #[error("field '{field}': expected {expected}, got {got}")]
    Type {
        field: String,
        expected: String,
        got: String,
    },
    /// Not in a value format the stream takes, or not in the registry wire format as framed
    /// (a truncated schema id).
    #[error("{0}")]
    WireFormat(String),
    /// The registry's schema of the value: unknown to the registry, not one the stream's
    /// definition can take, or a value its bytes do not match.
    #[error("schema id {id}: {reason}")]
    Schema { id: u32, reason: String },
    /// The schema id is not loaded yet: the sink fetches it from the registry and checks the
    /// record again. Never a dead letter's reason.
    #[error("schema id {0} is not loaded yet")]
    SchemaNotLoaded(u32),
}

impl RecordError {
    /// Whether a compatible newer definition of the stream may take the record: it sets a field
    /// the definition lacks (a nullable field added since), or lacks a required one (made
    /// optional since). Malformed records and wrong types stay invalid under any.
    pub fn newer_definition_may_take(&self) -> bool {
        matches!(
            self,
            RecordError::Unknown { .. } | RecordError::Missing { .. }
        )
    }

    /// A short, fixed reason code for metrics labels and dead-letter headers.
    pub fn code(&self) -> &'static str {
        match self {
            RecordError::Malformed(_) => "malformed",
            RecordError::NotAnObject { .. } => "not_an_object",
            RecordError::Missing { .. } => "missing_field",
            RecordError::Unknown { .. } => "unknown_field",
            RecordError::Type { .. } => "wrong_type",
            RecordError::WireFormat(_) => "wire_format",
            RecordError::Schema { .. } | RecordError::SchemaNotLoaded(_) => "schema",
        }
    }
}

/// A body that cannot be split into records at all.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum DecodeError {
    #[error("malformed JSON body: {0}")]
    Malformed(String),
    /// An Avro object container body that cannot be read.
    #[error("malformed Avro body: {0}")]
    Avro(String),
    #[error("a JSON body must be an array of records, got {0}")]
    NotAnArray(String),
    #[error("decoded body is larger than {0} bytes")]
    TooLarge(usize),
    /// A column of a Parquet body that the stream's definition lacks (a field a newer,
    /// compatible definition may have added).
    #[error("Parquet body: column '{0}' is not a field of the stream")]
    UnknownColumn(String),
    /// The caller's memory budget did not take the decoded body ([`crate::budget`]).
    #[error("the decoded body does not fit in the memory free for requests now")]
    OverBudget,
}

impl DecodeError {
    /// Whether a compatible newer definition of the stream may take the body (see
    /// [`RecordError::newer_definition_may_take`]).
    pub fn newer_definition_may_take(&self) -> bool {
        matches!(self, DecodeError::UnknownColumn(_))
    }
}
