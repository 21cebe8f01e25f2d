//! Late and repeated readings in deadband and swinging door.
//!
//! A reading whose event time is not after the latest of its series (it came late, or a
//! second time) is passed on as it is and counted (`out_of_order`); the series' state is not
//! moved to it, so the in-order readings keep their bound. The bound is for the series without
//! such readings: a reader that interpolates over every row, late ones included, may be off by
//! many times the band next to one. Such a reader tells them apart by the order the rows
//! leave the agent (one series is in one Kafka partition, so by `_offset`): a row whose event
//! time is not after every one before it is late. For that to hold, the reading a filter
//! holds back (the candidate end of a segment) is let go before the late reading, and kept:
//! a few more rows when readings come late, none otherwise.

/// Rows of one series: event time and value.
pub type Rows<T> = Vec<(i64, T)>;

/// Splits rows of one series, in the order they left the agent, into the in-order ones,
/// which rebuild the series within the band, and the late or repeated ones.
pub fn split<T: Copy>(rows: &[(i64, T)]) -> (Rows<T>, Rows<T>) {
    let (mut in_order, mut late) = (Vec::new(), Vec::new());
    let mut latest = i64::MIN;
    for &row in rows {
        if row.0 > latest {
            latest = row.0;
            in_order.push(row);
        } else {
            late.push(row);
        }
    }
    (in_order, late)
}
