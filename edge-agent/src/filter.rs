//! Per-stream filters: predicates, deadband (report by exception) and downsampling. Every record a
//! filter drops is counted, per filter.
//!
//! Series: deadband and downsampling keep state per series, identified by `key_fields` (default:
//! the partition key and the stream's other required string fields, e.g. `device_id` and
//! `sensor`). Time is the record's event time, so replaying a file gives the same result.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use schemas::{AtOnce, FieldType, Record, Scalar, Scalars, StreamDef, Value};
use serde_json::Value as Json;

mod config;
pub mod late;

pub use config::{Aggregate, CmpOp, FilterConfig};

/// A reading as it reaches the filters: a record built from its text, or a line whose text
/// stands for its record ([`schemas::verbatim_scalars_in`]) with the scalar values the scanner
/// read. A line the filters keep or hold is kept as its text: it is never built into a record,
/// nor encoded again.
#[derive(Debug)]
pub enum Reading<'r, 'a, H> {
    Record(Record),
    Line(&'r Scalars<'a, H>, &'a [u8]),
}

impl Reading<'static, 'static, schemas::ContentHash> {
    /// A record as a reading.
    pub fn record(record: Record) -> Self {
        Reading::Record(record)
    }
}

impl<H> Reading<'_, '_, H> {
    fn scalar(&self, i: usize) -> Option<Scalar<'_>> {
        match self {
            Reading::Record(record) => record.values.get(i)?.as_scalar(),
            Reading::Line(scalars, _) => scalars.get(i),
        }
    }

    /// Field `i` as a number, when it is an int64 or a float64 value.
    fn number(&self, i: usize) -> Option<f64> {
        match self.scalar(i)? {
            Scalar::Int(n) => Some(n as f64),
            Scalar::Float(f) => Some(f),
            _ => None,
        }
    }

    /// The event time in microseconds.
    fn event_time(&self, def: &StreamDef) -> i64 {
        match self.scalar(def.event_time) {
            Some(Scalar::Timestamp(t)) => t,
            _ => 0,
        }
    }

    /// The series the reading belongs to, by the values of `fields`.
    fn series_key(&self, fields: &[usize]) -> u64 {
        let mut h = foldhash::fast::FixedState::with_seed(0x5eed).build_hasher();
        for &i in fields {
            match self.scalar(i) {
                Some(Scalar::Str(s)) => h.write(s.as_bytes()),
                Some(Scalar::Int(n)) => h.write_i64(n),
                Some(Scalar::Bool(b)) => h.write_u8(u8::from(b)),
                _ => h.write_u8(0xff),
            }
            h.write_u8(0);
        }
        h.finish()
    }

    /// The reading as the filters keep it: a line's text is copied out of its chunk.
    fn kept(self) -> Kept {
        match self {
            Reading::Record(record) => Kept::Record(record),
            Reading::Line(_, text) => Kept::Line(text.trim_ascii().to_vec()),
        }
    }

    /// Keeps the reading in `slot` in place of what it held, in the memory of a line held
    /// there: a swinging door or deadband holds each reading of a series in turn.
    fn keep_in(self, slot: &mut Kept) {
        match (self, slot) {
            (Reading::Line(_, text), Kept::Line(held)) => {
                held.clear();
                held.extend_from_slice(text.trim_ascii());
            }
            (reading, slot) => *slot = reading.kept(),
        }
    }
}

/// A reading the filters passed on or held: as it came, a record or the text of a line (which
/// stands for its record).
#[derive(Debug, Clone, PartialEq)]
pub enum Kept {
    Record(Record),
    Line(Vec<u8>),
}

impl Kept {
    /// The reading as a record: a line decoded, or returned as it is when it is no longer
    /// valid (its stream's definition changed while it was held).
    fn into_record(self, def: &StreamDef) -> Result<Record, Kept> {
        match self {
            Kept::Record(record) => Ok(record),
            Kept::Line(text) => match schemas::check_bytes(def, &text) {
                Ok(valid) => Ok(valid.record),
                Err(_) => Err(Kept::Line(text)),
            },
        }
    }

    /// Runs `f` on the kept reading as a reading again (for the next filter of a chain). A line
    /// is scanned again, or decoded in full where the scanner does not take it; a line that is
    /// no longer valid (its stream's definition changed while it was held) is returned as it is.
    fn reading<R>(
        self,
        def: &StreamDef,
        f: impl FnOnce(Reading<'_, '_, schemas::ContentHash>) -> R,
    ) -> Result<R, Kept> {
        match self {
            Kept::Record(record) => Ok(f(Reading::Record(record))),
            Kept::Line(text) => {
                if let Some(scalars) = schemas::verbatim_scalars_in(def, &text[..], &mut AtOnce) {
                    return Ok(f(Reading::Line(&scalars, &text)));
                }
                Kept::Line(text)
                    .into_record(def)
                    .map(|record| f(Reading::Record(record)))
            }
        }
    }
}

#[derive(Debug)]
struct Band {
    sent: f64,
    sent_at: i64,
    /// The latest event time of the series seen, to tell readings that come late (or again).
    last: i64,
    /// The last reading within the band (and its value), sent before one that breaks it. Its
    /// event time is `last`.
    held: Option<(f64, Kept)>,
}

/// The largest hull a swinging door keeps per series: a segment whose dropped readings need
/// more vertices (a long, smoothly curving one) is closed there.
const MAX_HULL: usize = 256;

/// What a swinging door knows of one series: the last kept reading, the reading held as the
/// candidate end of the segment from it, and what the readings dropped in between allow.
#[derive(Debug)]
struct Door {
    /// The last kept reading: event time (µs) and value.
    at: i64,
    value: f64,
    /// The latest event time of the series seen, to tell readings that come out of order.
    last: i64,
    /// The slopes (value per µs) of a line from the kept reading that is within the band at
    /// every reading dropped since.
    low: f64,
    high: f64,
    /// The latest reading: the segment's end if the next reading does not fit the door.
    held: Option<(i64, f64, Kept)>,
    /// The dropped readings relative to the kept one, `(t - at, v - value)`, as the vertices of
    /// their upper and lower convex hulls: the dropped reading farthest from a line through
    /// the kept reading is one of them.
    upper: Vec<(f64, f64)>,
    lower: Vec<(f64, f64)>,
}

impl Door {
    fn new(at: i64, value: f64) -> Door {
        Door {
            at,
            value,
            last: at,
            low: f64::NEG_INFINITY,
            high: f64::INFINITY,
            held: None,
            upper: Vec::new(),
            lower: Vec::new(),
        }
    }

    /// Takes the held reading at `(x, y)` (relative to the kept one) as dropped.
    fn drop_held(&mut self, (x, y): (f64, f64), (low, high): (f64, f64)) {
        self.low = low;
        self.high = high;
        let cross = |o: (f64, f64), a: (f64, f64), b: (f64, f64)| {
            (a.0 - o.0) * (b.1 - o.1) - (a.1 - o.1) * (b.0 - o.0)
        };
        for (hull, upper) in [(&mut self.upper, true), (&mut self.lower, false)] {
            while let [.., o, a] = hull[..] {
                let turn = cross(o, a, (x, y));
                if (upper && turn >= 0.0) || (!upper && turn <= 0.0) {
                    hull.pop();
                } else {
                    break;
                }
            }
            hull.push((x, y));
        }
    }

    /// Keeps the reading at `(at, value)` as the segment's end and starts the next segment
    /// from it; returns the largest distance of a reading dropped in the segment from the line
    /// between its ends.
    fn keep(&mut self, at: i64, value: f64) -> f64 {
        let slope = (value - self.value) / (at - self.at) as f64;
        let above = self.upper.iter().map(|&(x, y)| y - slope * x);
        let below = self.lower.iter().map(|&(x, y)| slope * x - y);
        let deviation = above.chain(below).fold(0.0, f64::max);
        let last = self.last;
        *self = Door::new(at, value);
        self.last = last;
        deviation
    }
}

/// How far a filter's output strays from its input: the largest distance of a dropped reading
/// from its reconstruction (sample-and-hold for deadband, linear interpolation for swinging
/// door), and the readings that came out of order and were passed on as they are.
#[derive(Debug, Default, Clone, Copy)]
struct Accuracy {
    max_deviation: f64,
    out_of_order: u64,
}

impl Accuracy {
    fn deviation(&mut self, d: f64) {
        self.max_deviation = self.max_deviation.max(d);
    }
}

#[derive(Debug)]
struct Window {
    start: i64,
    /// The window's first reading, which its aggregate replaces.
    template: Kept,
    min: f64,
    max: f64,
    sum: f64,
    count: u64,
}

#[derive(Debug)]
enum Filter {
    Predicate {
        field: usize,
        op: CmpOp,
        /// One value, or the items of `in` and `not_in`, as the field's type holds them.
        literals: Vec<Value>,
    },
    Deadband {
        field: usize,
        series: Vec<usize>,
        band: f64,
        max_silence_micros: i64,
        send_previous: bool,
        state: Series<Band>,
        accuracy: Accuracy,
    },
    SwingingDoor {
        field: usize,
        series: Vec<usize>,
        band: f64,
        max_silence_micros: i64,
        state: Series<Door>,
        /// The latest event time seen of any series: a series silent for `max_silence` before
        /// it has its held reading kept ([`Filter::flush`]).
        latest: i64,
        accuracy: Accuracy,
    },
    Every {
        series: Vec<usize>,
        n: u32,
        seen: Series<u32>,
    },
    Window {
        series: Vec<usize>,
        field: usize,
        micros: i64,
        aggregate: Aggregate,
        open: Series<Window>,
        latest: i64,
    },
}

/// The state of a filter per series, for at most `max` series. Past that, the eighth seen
/// longest ago are forgotten and given back to the filter, which emits or drops what they hold:
/// series without end (a key field that changes with every reading, vehicles passing a roadside
/// box) cannot take the agent's memory, which they did before. A forgotten series starts anew,
/// as after a restart.
#[derive(Debug)]
struct Series<V> {
    /// State and when it was last seen (`tick`).
    /// Keyed by the series key, hashed again with a seed of the map's own (foldhash, quicker
    /// than the default SipHash on a `u64`).
    map: HashMap<u64, (u64, V), foldhash::fast::RandomState>,
    tick: u64,
    max: usize,
    /// Series forgotten since [`FilterChain::take_evicted`] last asked.
    evicted: u64,
}

impl<V> Series<V> {
    fn new(max: usize) -> Result<Series<V>, String> {
        if max == 0 {
            return Err("max_series must be at least 1".into());
        }
        Ok(Series {
            map: HashMap::default(),
            tick: 0,
            max,
            evicted: 0,
        })
    }

    /// The state of `key`, marked as seen.
    fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        self.tick += 1;
        let entry = self.map.get_mut(&key)?;
        entry.0 = self.tick;
        Some(&mut entry.1)
    }

    /// The state of `key`, made by `new` when it has none, marked as seen.
    fn entry(&mut self, key: u64, new: impl FnOnce() -> V) -> &mut V {
        self.tick += 1;
        let entry = self.map.entry(key).or_insert_with(|| (0, new()));
        entry.0 = self.tick;
        &mut entry.1
    }

    fn insert(&mut self, key: u64, state: V) {
        self.tick += 1;
        self.map.insert(key, (self.tick, state));
    }

    fn remove(&mut self, key: u64) -> Option<V> {
        self.map.remove(&key).map(|(_, state)| state)
    }

    /// The states for which `f` (of when a series was last seen, and its state) holds, taken
    /// out.
    fn take_where(&mut self, mut f: impl FnMut(u64, &V) -> bool) -> Vec<V> {
        let keys: Vec<u64> = self
            .map
            .iter()
            .filter(|(_, (tick, state))| f(*tick, state))
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter().filter_map(|k| self.remove(k)).collect()
    }

    /// When more than `max` series are held, forgets the eighth of `max` seen longest ago and
    /// returns their states (the work is done once per `max / 8` new series).
    fn evict(&mut self) -> Vec<V> {
        if self.map.len() <= self.max {
            return Vec::new();
        }
        let keep = self.max - self.max / 8;
        let mut ticks: Vec<u64> = self.map.values().map(|(tick, _)| *tick).collect();
        let forget = ticks.len() - keep;
        // Ticks are distinct: exactly `forget` series were seen at or before the cut.
        let cut = *ticks.select_nth_unstable(forget - 1).1;
        let forgotten = self.take_where(|tick, _| tick <= cut);
        self.evicted += forgotten.len() as u64;
        forgotten
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.map.values_mut().map(|(_, state)| state)
    }
}

/// A predicate's literal as a value of a field of type `ty`: numbers for int64 and float64
/// fields (any number: `quality lt 191.5` is fine), a timestamp as the records give one, a string
/// or a bool; `None` for anything else, and for list and map fields.
fn literal(ty: &FieldType, json: &Json) -> Option<Value> {
    match (ty, json) {
        (FieldType::Int64 | FieldType::Float64, Json::Number(n)) => n.as_f64().map(Value::Float),
        (FieldType::Timestamp, json) => schemas::value::parse_timestamp(json).map(Value::Timestamp),
        (FieldType::String, Json::String(s)) => Some(Value::Str(s.as_str().into())),
        (FieldType::Bool, Json::Bool(b)) => Some(Value::Bool(*b)),
        _ => None,
    }
}

fn compare(v: Option<Scalar<'_>>, literal: &Value) -> Option<Ordering> {
    match (v?, literal) {
        (Scalar::Int(i), Value::Float(l)) => (i as f64).partial_cmp(l),
        (Scalar::Float(f), Value::Float(l)) => f.partial_cmp(l),
        (Scalar::Timestamp(t), Value::Timestamp(l)) => Some(t.cmp(l)),
        (Scalar::Str(s), Value::Str(l)) => Some(s.cmp(l.as_str())),
        (Scalar::Bool(b), Value::Bool(l)) => Some(b.cmp(l)),
        _ => None,
    }
}

/// Whether `v op literals` holds (`literals`: one value, or the items of `in` and `not_in`;
/// `v` is `None` for a null, which equals nothing).
fn holds(v: Option<Scalar<'_>>, op: CmpOp, literals: &[Value]) -> bool {
    let eq = |lit: &Value| compare(v, lit) == Some(Ordering::Equal);
    let ord = || literals.first().and_then(|l| compare(v, l));
    match op {
        CmpOp::Eq => literals.first().is_some_and(eq),
        CmpOp::Ne => !literals.first().is_some_and(eq),
        CmpOp::Lt => ord() == Some(Ordering::Less),
        CmpOp::Le => matches!(ord(), Some(Ordering::Less | Ordering::Equal)),
        CmpOp::Gt => ord() == Some(Ordering::Greater),
        CmpOp::Ge => matches!(ord(), Some(Ordering::Greater | Ordering::Equal)),
        CmpOp::In => literals.iter().any(eq),
        CmpOp::NotIn => !literals.iter().any(eq),
    }
}

impl Filter {
    /// Takes `reading`: returns how many readings were dropped for good, and the reading when it
    /// passes on. Held readings the filter lets go (before this one) are appended to `out`.
    fn apply<'r, 'a, H>(
        &mut self,
        def: &StreamDef,
        reading: Reading<'r, 'a, H>,
        out: &mut Vec<Kept>,
    ) -> (u64, Option<Reading<'r, 'a, H>>) {
        match self {
            Filter::Predicate {
                field,
                op,
                literals,
            } => {
                if holds(reading.scalar(*field), *op, literals) {
                    (0, Some(reading))
                } else {
                    (1, None)
                }
            }
            Filter::Deadband {
                field,
                series,
                band,
                max_silence_micros,
                send_previous,
                state,
                accuracy,
            } => {
                let Some(v) = reading.number(*field) else {
                    return (0, Some(reading));
                };
                let t = reading.event_time(def);
                let key = reading.series_key(series);
                let Some(s) = state.get_mut(key) else {
                    state.insert(
                        key,
                        Band {
                            sent: v,
                            sent_at: t,
                            last: t,
                            held: None,
                        },
                    );
                    // The readings forgotten series held were within the band of a sent one.
                    let evicted = state.evict();
                    let dropped = evicted.into_iter().filter(|s| s.held.is_some()).count();
                    return (dropped as u64, Some(reading));
                };
                if t <= s.last {
                    // Late, or a second reading at one time: passed on as it is, and the series'
                    // reference is not moved to it. The held reading goes first ([`late`]).
                    accuracy.out_of_order += 1;
                    if let Some((held_value, held)) = s.held.take() {
                        (s.sent, s.sent_at) = (held_value, s.last);
                        out.push(held);
                    }
                    return (0, Some(reading));
                }
                s.last = t;
                let breaks = (v - s.sent).abs() > *band || v.is_nan() != s.sent.is_nan();
                let silent_too_long =
                    *max_silence_micros > 0 && t.saturating_sub(s.sent_at) >= *max_silence_micros;
                // A dropped reading is reconstructed as the last one sent before it.
                if breaks || silent_too_long {
                    let mut dropped = 0;
                    if let Some((held_value, held)) = s.held.take() {
                        if breaks && *send_previous {
                            out.push(held);
                        } else {
                            accuracy.deviation((held_value - s.sent).abs());
                            dropped = 1;
                        }
                    }
                    s.sent = v;
                    s.sent_at = t;
                    (dropped, Some(reading))
                } else if let Some((held_value, kept)) = &mut s.held {
                    accuracy.deviation((*held_value - s.sent).abs());
                    *held_value = v;
                    reading.keep_in(kept);
                    (1, None)
                } else {
                    s.held = Some((v, reading.kept()));
                    (0, None)
                }
            }
            Filter::SwingingDoor {
                field,
                series,
                band,
                max_silence_micros,
                state,
                latest,
                accuracy,
            } => {
                let Some(v) = reading.number(*field) else {
                    return (0, Some(reading));
                };
                let t = reading.event_time(def);
                *latest = (*latest).max(t);
                let key = reading.series_key(series);
                let Some(door) = state.get_mut(key) else {
                    state.insert(key, Door::new(t, v));
                    // A forgotten series' held reading is kept: the bound holds to its end.
                    for mut door in state.evict() {
                        if let Some((at, value, held)) = door.held.take() {
                            accuracy.deviation(door.keep(at, value));
                            out.push(held);
                        }
                    }
                    return (0, Some(reading));
                };
                if t <= door.last {
                    // Late, or a second reading at one time: passed on, and the door is not
                    // bent by it. The held reading goes first ([`late`]).
                    accuracy.out_of_order += 1;
                    if let Some((at, value, held)) = door.held.take() {
                        accuracy.deviation(door.keep(at, value));
                        out.push(held);
                    }
                    return (0, Some(reading));
                }
                door.last = t;
                if v.is_nan() || door.value.is_nan() {
                    // No line passes through NaN: the held reading and this one are kept, and
                    // the series starts again from this one.
                    if let Some((at, value, held)) = door.held.take() {
                        accuracy.deviation(door.keep(at, value));
                        out.push(held);
                    }
                    accuracy.deviation(door.keep(t, v));
                    return (0, Some(reading));
                }
                let silence_ok =
                    |from: i64| *max_silence_micros == 0 || t - from <= *max_silence_micros;
                if let Some((at, value, _)) = &door.held {
                    let held = ((at - door.at) as f64, value - door.value);
                    let low = door.low.max((held.1 - *band) / held.0);
                    let high = door.high.min((held.1 + *band) / held.0);
                    let slope = (v - door.value) / (t - door.at) as f64;
                    let room = door.upper.len() < MAX_HULL && door.lower.len() < MAX_HULL;
                    if low <= slope && slope <= high && silence_ok(door.at) && room {
                        // The line to this reading passes within the band of every reading
                        // since the kept one, the held one included: that one is dropped.
                        door.drop_held(held, (low, high));
                        if let Some((at, value, kept)) = &mut door.held {
                            (*at, *value) = (t, v);
                            reading.keep_in(kept);
                        }
                        return (1, None);
                    }
                    let (at, value, held) = door.held.take().expect("held");
                    accuracy.deviation(door.keep(at, value));
                    out.push(held);
                }
                if silence_ok(door.at) {
                    door.held = Some((t, v, reading.kept()));
                    (0, None)
                } else {
                    // No reading came between: the gap is the input's.
                    door.keep(t, v);
                    (0, Some(reading))
                }
            }
            Filter::Every { series, n, seen } => {
                let count = seen.entry(reading.series_key(series), || 0);
                let keep = *count % *n == 0;
                *count = count.wrapping_add(1) % *n;
                seen.evict();
                if keep { (0, Some(reading)) } else { (1, None) }
            }
            Filter::Window {
                series,
                field,
                micros,
                aggregate,
                open,
                latest,
            } => {
                let t = reading.event_time(def);
                *latest = (*latest).max(t);
                let Some(v) = reading.number(*field) else {
                    return (0, Some(reading));
                };
                let start = t - t.rem_euclid(*micros);
                let key = reading.series_key(series);
                let mut dropped = 0;
                if let Some(w) = open.get_mut(key)
                    && w.start != start
                {
                    let w = open.remove(key).expect("present");
                    dropped += close_window(def, *field, *aggregate, w, out);
                }
                let w = open.entry(key, || Window {
                    start,
                    template: reading.kept(),
                    min: f64::INFINITY,
                    max: f64::NEG_INFINITY,
                    sum: 0.0,
                    count: 0,
                });
                w.min = w.min.min(v);
                w.max = w.max.max(v);
                w.sum += v;
                w.count += 1;
                // Windows of forgotten series close early.
                for w in open.evict() {
                    dropped += close_window(def, *field, *aggregate, w, out);
                }
                (dropped, None)
            }
        }
    }

    /// Emits what is held: windows that ended at least one window before the latest event time
    /// seen (`all`: every window), and (`all`) nothing else. Returns records dropped for good.
    fn flush(&mut self, def: &StreamDef, all: bool, out: &mut Vec<Kept>) -> u64 {
        match self {
            Filter::Window {
                field,
                micros,
                aggregate,
                open,
                latest,
                ..
            } => {
                let horizon = latest.saturating_sub(2 * *micros);
                let mut dropped = 0;
                for w in open.take_where(|_, w| all || w.start <= horizon) {
                    dropped += close_window(def, *field, *aggregate, w, out);
                }
                dropped
            }
            Filter::Deadband { state, .. } if all => {
                // The last reading of each series is sent: the series ends where it ended.
                out.extend(
                    state
                        .values_mut()
                        .filter_map(|s| s.held.take().map(|(_, held)| held)),
                );
                0
            }
            Filter::SwingingDoor {
                state,
                max_silence_micros,
                latest,
                accuracy,
                ..
            } => {
                // The held reading ends its segment when the agent stops, and when its series
                // has been silent for `max_silence` of the others' time.
                let horizon = match *max_silence_micros {
                    0 => i64::MIN,
                    silence => latest.saturating_sub(silence),
                };
                for door in state.values_mut() {
                    let due = door.held.as_ref().is_some_and(|h| all || h.0 <= horizon);
                    if due && let Some((at, value, held)) = door.held.take() {
                        accuracy.deviation(door.keep(at, value));
                        out.push(held);
                    }
                }
                0
            }
            _ => 0,
        }
    }
}

fn close_window(
    def: &StreamDef,
    field: usize,
    aggregate: Aggregate,
    w: Window,
    out: &mut Vec<Kept>,
) -> u64 {
    let value = match aggregate {
        Aggregate::Min => w.min,
        Aggregate::Max => w.max,
        Aggregate::Mean => w.sum / w.count as f64,
    };
    let mut record = match w.template.into_record(def) {
        Ok(record) => record,
        // The definition changed under the window: its first reading goes out as it came.
        Err(kept) => {
            out.push(kept);
            return w.count - 1;
        }
    };
    record.values[field] = match def.fields[field].ty {
        FieldType::Int64 => Value::Int(value.round() as i64),
        _ => Value::Float(value),
    };
    record.values[def.event_time] = Value::Timestamp(w.start);
    out.push(Kept::Record(record));
    w.count - 1
}
/// What one filter of a stream did since the agent started: the reduction report.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Reduction {
    /// The filter's type, as configured.
    pub filter: String,
    /// Readings that reached the filter, and those it passed on (for a windowed downsample,
    /// the windows' aggregates).
    pub readings_in: u64,
    pub kept: u64,
    /// For deadband and swinging door: the band, and the largest distance of a dropped reading
    /// from its reconstruction (the last kept reading before it for deadband, the line between
    /// the kept readings around it for swinging door), which is at most the band.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub band: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_deviation: Option<f64>,
    /// Swinging door: readings that came out of order (or at a time already seen) and were
    /// passed on as they are.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub out_of_order: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The filters of one stream, in order, with their drop counts and reduction reports.
#[derive(Debug)]
pub struct FilterChain {
    filters: Vec<(&'static str, Filter)>,
    dropped: Vec<u64>,
    /// Readings into and out of each filter.
    through: Vec<(u64, u64)>,
}

impl FilterChain {
    pub fn new(def: &StreamDef, configs: &[FilterConfig]) -> Result<FilterChain, String> {
        let filters = configs
            .iter()
            .map(|c| Ok((c.kind(), c.compile(def)?)))
            .collect::<Result<Vec<_>, String>>()?;
        Ok(FilterChain {
            dropped: vec![0; filters.len()],
            through: vec![(0, 0); filters.len()],
            filters,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.filters.is_empty()
    }

    /// The kinds of the filters that keep state per series (it lives in memory: a start begins
    /// every series afresh).
    pub fn stateful(&self) -> Vec<&'static str> {
        self.filters
            .iter()
            .filter(|(_, f)| !matches!(f, Filter::Predicate { .. }))
            .map(|(kind, _)| *kind)
            .collect()
    }

    /// Runs a reading through every filter; what comes out is appended to `out`, the held
    /// readings a filter lets go before the reading itself. A reading that passes is copied
    /// (a line's text out of its chunk) only when it comes out of the chain or is held.
    pub fn apply<H>(&mut self, def: &StreamDef, reading: Reading<'_, '_, H>, out: &mut Vec<Kept>) {
        let mut current = reading;
        for i in 0..self.filters.len() {
            let start = out.len();
            self.through[i].0 += 1;
            let (dropped, passed) = self.filters[i].1.apply(def, current, out);
            self.dropped[i] += dropped;
            self.through[i].1 += (out.len() - start) as u64 + u64::from(passed.is_some());
            if out.len() > start && i + 1 < self.filters.len() {
                let released: Vec<Kept> = out.drain(start..).collect();
                self.run(def, released, i + 1, out);
            }
            match passed {
                Some(reading) => current = reading,
                None => return,
            }
        }
        out.push(current.kept());
    }

    /// Emits held readings: windows that are over (or, with `all`, every held reading).
    pub fn flush(&mut self, def: &StreamDef, all: bool, out: &mut Vec<Kept>) {
        for start in 0..self.filters.len() {
            let mut released = Vec::new();
            self.dropped[start] += self.filters[start].1.flush(def, all, &mut released);
            self.through[start].1 += released.len() as u64;
            self.run(def, released, start + 1, out);
        }
    }

    /// Runs readings a filter let go through the filters from `from` on.
    fn run(&mut self, def: &StreamDef, mut current: Vec<Kept>, from: usize, out: &mut Vec<Kept>) {
        for i in from..self.filters.len() {
            if current.is_empty() {
                return;
            }
            let mut next = Vec::with_capacity(current.len());
            self.through[i].0 += current.len() as u64;
            for kept in current {
                let filter = &mut self.filters[i].1;
                let taken = kept.reading(def, |reading| {
                    let (dropped, passed) = filter.apply(def, reading, &mut next);
                    next.extend(passed.map(Reading::kept));
                    dropped
                });
                match taken {
                    Ok(dropped) => self.dropped[i] += dropped,
                    // Not a reading of the definition now in use: passed on as it is.
                    Err(kept) => next.push(kept),
                }
            }
            self.through[i].1 += next.len() as u64;
            current = next;
        }
        out.extend(current);
    }

    /// Series forgotten per filter kind (those held at `max_series`) since the last call.
    pub fn take_evicted(&mut self) -> Vec<(&'static str, u64)> {
        self.filters
            .iter_mut()
            .map(|(kind, filter)| {
                let evicted = match filter {
                    Filter::Deadband { state, .. } => &mut state.evicted,
                    Filter::SwingingDoor { state, .. } => &mut state.evicted,
                    Filter::Every { seen, .. } => &mut seen.evicted,
                    Filter::Window { open, .. } => &mut open.evicted,
                    Filter::Predicate { .. } => return (*kind, 0),
                };
                (*kind, std::mem::take(evicted))
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Each filter's reduction report, in order.
    pub fn reductions(&self) -> Vec<Reduction> {
        self.filters
            .iter()
            .zip(&self.through)
            .map(|((kind, filter), &(readings_in, kept))| {
                let (band, accuracy) = match filter {
                    Filter::Deadband { band, accuracy, .. }
                    | Filter::SwingingDoor { band, accuracy, .. } => (Some(*band), Some(*accuracy)),
                    _ => (None, None),
                };
                Reduction {
                    filter: (*kind).to_owned(),
                    readings_in,
                    kept,
                    band,
                    max_deviation: accuracy.map(|a| a.max_deviation),
                    out_of_order: accuracy.map_or(0, |a| a.out_of_order),
                }
            })
            .collect()
    }

    /// Dropped records per filter kind since the last call.
    pub fn take_dropped(&mut self) -> Vec<(&'static str, u64)> {
        self.filters
            .iter()
            .zip(self.dropped.iter_mut())
            .map(|((kind, _), n)| (*kind, std::mem::take(n)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}

#[cfg(test)]
mod tests;
