//! The filters' configuration, checked and compiled against a stream's definition.

use schemas::{FieldType, StreamDef};
use serde::Deserialize;
use serde_json::Value as Json;

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    /// `value` is a list; the field equals one of its items.
    In,
    NotIn,
}

impl CmpOp {
    /// The operator as the config spells it.
    pub fn name(self) -> &'static str {
        match self {
            CmpOp::Eq => "eq",
            CmpOp::Ne => "ne",
            CmpOp::Lt => "lt",
            CmpOp::Le => "le",
            CmpOp::Gt => "gt",
            CmpOp::Ge => "ge",
            CmpOp::In => "in",
            CmpOp::NotIn => "not_in",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregate {
    Min,
    Max,
    Mean,
}

/// One filter of a stream, as configured.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum FilterConfig {
    /// Keeps the records for which `field op value` holds. `value` is read as the field's type
    /// reads it (a timestamp as an RFC 3339 string or epoch milliseconds or microseconds, as in
    /// the records); a value the field cannot hold is a configuration error. A missing (null)
    /// field satisfies only `ne` and `not_in`.
    Predicate {
        field: String,
        op: CmpOp,
        value: Json,
    },
    /// Report by exception: a reading is sent when it differs from the last sent one of its series
    /// by more than the band (`absolute`, or `percent` of `range`), or when `max_silence_secs`
    /// passed since the last sent one (a heartbeat). With `send_previous` (default), the last
    /// suppressed reading is sent before one that breaks the band, so the step keeps its shape.
    Deadband {
        field: String,
        #[serde(default)]
        key_fields: Option<Vec<String>>,
        #[serde(default)]
        absolute: Option<f64>,
        #[serde(default)]
        percent: Option<f64>,
        /// `[low, high]` of the instrument, for `percent`.
        #[serde(default)]
        range: Option<[f64; 2]>,
        #[serde(default)]
        max_silence_secs: u64,
        #[serde(default = "yes")]
        send_previous: bool,
        /// Series whose state is kept at most; past it, those seen longest ago are forgotten.
        #[serde(default = "default_max_series")]
        max_series: usize,
    },
    /// Swinging-door compression (the "compression" of process historians): a reading of a
    /// series is kept only where drawing a straight line between kept readings would leave the
    /// band (`absolute`, or `percent` of `range`) at a reading dropped between them. Linear
    /// interpolation between the kept readings is then within the band at every reading
    /// dropped; the first reading of a series is kept, and its last when the agent stops.
    /// `max_silence_secs` bounds the time between kept readings (0: unbounded).
    SwingingDoor {
        field: String,
        #[serde(default)]
        key_fields: Option<Vec<String>>,
        #[serde(default)]
        absolute: Option<f64>,
        #[serde(default)]
        percent: Option<f64>,
        /// `[low, high]` of the instrument, for `percent`.
        #[serde(default)]
        range: Option<[f64; 2]>,
        #[serde(default)]
        max_silence_secs: u64,
        /// Series whose state is kept at most; past it, those seen longest ago are forgotten
        /// (their held reading is sent).
        #[serde(default = "default_max_series")]
        max_series: usize,
    },
    /// Keeps every `every`-th record of a series, or sends one record per `window_secs` window
    /// with `field` replaced by the `aggregate` (min, max or mean) of the window.
    Downsample {
        #[serde(default)]
        key_fields: Option<Vec<String>>,
        #[serde(default)]
        every: Option<u32>,
        #[serde(default)]
        window_secs: Option<u64>,
        #[serde(default)]
        aggregate: Option<Aggregate>,
        #[serde(default)]
        field: Option<String>,
        /// Series whose state is kept at most; past it, those seen longest ago are forgotten.
        #[serde(default = "default_max_series")]
        max_series: usize,
    },
}

fn yes() -> bool {
    true
}

/// Series a deadband or downsample filter keeps state for, by default.
pub const DEFAULT_MAX_SERIES: usize = 100_000;

fn default_max_series() -> usize {
    DEFAULT_MAX_SERIES
}

impl FilterConfig {
    pub fn kind(&self) -> &'static str {
        match self {
            FilterConfig::Predicate { .. } => "predicate",
            FilterConfig::Deadband { .. } => "deadband",
            FilterConfig::SwingingDoor { .. } => "swinging_door",
            FilterConfig::Downsample { .. } => "downsample",
        }
    }

    /// Checks the filter against the stream it is configured for.
    pub fn check(&self, def: &StreamDef) -> Result<(), String> {
        self.compile(def).map(|_| ())
    }

    pub(super) fn compile(&self, def: &StreamDef) -> Result<Filter, String> {
        let field = |name: &str| {
            def.field_index(name)
                .ok_or_else(|| format!("no field '{name}' in stream '{}'", def.name))
        };
        let numeric = |name: &str| {
            let i = field(name)?;
            match def.fields[i].ty {
                FieldType::Int64 | FieldType::Float64 => Ok(i),
                _ => Err(format!("field '{name}' is not int64 or float64")),
            }
        };
        let series = |key_fields: &Option<Vec<String>>| -> Result<Vec<usize>, String> {
            match key_fields {
                Some(names) => names.iter().map(|n| field(n)).collect(),
                None => {
                    let mut key = vec![def.partition_key];
                    key.extend((0..def.fields.len()).filter(|&i| {
                        i != def.partition_key
                            && def.fields[i].required
                            && def.fields[i].ty == FieldType::String
                    }));
                    Ok(key)
                }
            }
        };
        Ok(match self {
            FilterConfig::Predicate {
                field: f,
                op,
                value,
            } => {
                let i = field(f)?;
                let items: Vec<&Json> = match (op, value) {
                    (CmpOp::In | CmpOp::NotIn, Json::Array(items)) => items.iter().collect(),
                    (CmpOp::In | CmpOp::NotIn, _) => {
                        return Err(format!("'{f}' {}: value must be a list", op.name()));
                    }
                    _ => vec![value],
                };
                let ty = &def.fields[i].ty;
                let literals = items
                    .into_iter()
                    .map(|item| {
                        literal(ty, item).ok_or_else(|| {
                            format!("'{f}' {}: {item} is not a value of {ty}", op.name())
                        })
                    })
                    .collect::<Result<_, _>>()?;
                Filter::Predicate {
                    field: i,
                    op: *op,
                    literals,
                }
            }
            FilterConfig::Deadband {
                field: f,
                key_fields,
                absolute,
                percent,
                range,
                max_silence_secs,
                send_previous,
                max_series,
            } => {
                let band = band(self.kind(), *absolute, *percent, *range)?;
                Filter::Deadband {
                    field: numeric(f)?,
                    series: series(key_fields)?,
                    band,
                    max_silence_micros: (*max_silence_secs as i64).saturating_mul(1_000_000),
                    send_previous: *send_previous,
                    state: Series::new(*max_series)?,
                    accuracy: Accuracy::default(),
                }
            }
            FilterConfig::SwingingDoor {
                field: f,
                key_fields,
                absolute,
                percent,
                range,
                max_silence_secs,
                max_series,
            } => Filter::SwingingDoor {
                field: numeric(f)?,
                series: series(key_fields)?,
                band: band(self.kind(), *absolute, *percent, *range)?,
                max_silence_micros: (*max_silence_secs as i64).saturating_mul(1_000_000),
                state: Series::new(*max_series)?,
                latest: i64::MIN,
                accuracy: Accuracy::default(),
            },
            FilterConfig::Downsample {
                key_fields,
                every,
                window_secs,
                aggregate,
                field: f,
                max_series,
            } => {
                let series = series(key_fields)?;
                match (every, window_secs, aggregate, f) {
                    (Some(n), None, None, None) if *n >= 1 => Filter::Every {
                        series,
                        n: *n,
                        seen: Series::new(*max_series)?,
                    },
                    (None, Some(w), Some(agg), Some(f)) if *w >= 1 => Filter::Window {
                        series,
                        field: numeric(f)?,
                        micros: (*w as i64).saturating_mul(1_000_000),
                        aggregate: *agg,
                        open: Series::new(*max_series)?,
                        latest: i64::MIN,
                    },
                    _ => {
                        return Err("downsample needs either every = N (≥ 1), or window_secs, aggregate and field".into());
                    }
                }
            }
        })
    }
}

/// The band of a deadband or swinging-door filter: `absolute`, or `percent` of `range`.
fn band(
    kind: &str,
    absolute: Option<f64>,
    percent: Option<f64>,
    range: Option<[f64; 2]>,
) -> Result<f64, String> {
    match (absolute, percent, range) {
        (Some(a), None, _) if a >= 0.0 && a.is_finite() => Ok(a),
        (None, Some(p), Some([lo, hi])) if p >= 0.0 && hi > lo && (hi - lo).is_finite() => {
            Ok(p / 100.0 * (hi - lo))
        }
        (None, Some(_), _) => Err(format!(
            "{kind} percent needs range = [low, high] with low < high"
        )),
        _ => Err(format!(
            "{kind} needs exactly one of absolute or percent (≥ 0)"
        )),
    }
}
