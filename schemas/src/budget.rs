//! Memory a decoder takes for a request, asked for before it is allocated: a decoder calls
//! [`Charge`] with the bytes a buffer is about to grow by, and stops when the caller's budget
//! (the gateway's in-flight bytes) does not take them, so a request that would pass the budget
//! is refused before it allocates.

/// Takes `bytes` from the caller's budget; `false` when the budget does not have them.
pub type Charge<'a> = &'a mut dyn FnMut(usize) -> bool;

/// A [`Charge`] without a budget: takes every request.
pub fn unlimited(_bytes: usize) -> bool {
    true
}

/// Makes room for `additional` more items in `out`, as a `Vec` grows (at least doubling), once
/// `charge` took the growth of its capacity in bytes. `false`, and `out` unchanged, when it did
/// not.
pub fn reserve<T>(out: &mut Vec<T>, additional: usize, charge: Charge<'_>) -> bool {
    let (len, capacity) = (out.len(), out.capacity());
    let needed = len.saturating_add(additional);
    if needed <= capacity {
        return true;
    }
    let item = std::mem::size_of::<T>().max(1);
    let grown = needed
        .max(capacity.saturating_mul(2))
        .max(MIN_CAPACITY_BYTES / item);
    if !charge((grown - capacity).saturating_mul(item)) {
        return false;
    }
    out.reserve_exact(grown - len);
    true
}

/// The smallest buffer [`reserve`] allocates, in bytes.
const MIN_CAPACITY_BYTES: usize = 8 << 10;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_is_charged_before_it_is_allocated() {
        let mut charged = Vec::new();
        let mut budget = 40_000usize;
        let mut charge = |bytes: usize| {
            charged.push(bytes);
            let taken = bytes <= budget;
            if taken {
                budget -= bytes;
            }
            taken
        };
        let mut out: Vec<u8> = Vec::new();
        assert!(reserve(&mut out, 100, &mut charge));
        assert_eq!(out.capacity(), MIN_CAPACITY_BYTES);
        out.resize(8_000, 0);
        assert!(reserve(&mut out, 100, &mut charge), "fits: nothing charged");
        out.resize(MIN_CAPACITY_BYTES, 0);
        assert!(reserve(&mut out, 1, &mut charge));
        assert_eq!(out.capacity(), 2 * MIN_CAPACITY_BYTES);
        out.resize(2 * MIN_CAPACITY_BYTES, 0);
        // Doubling takes 16 KiB more (the budget has 40,000 - 16,384 = 23,616 left), then
        // 32 KiB, past what is left.
        assert!(reserve(&mut out, 1, &mut charge));
        out.resize(4 * MIN_CAPACITY_BYTES, 0);
        assert!(!reserve(&mut out, 1, &mut charge), "past the budget");
        assert_eq!(out.capacity(), 4 * MIN_CAPACITY_BYTES, "nothing allocated");
        assert_eq!(
            charged,
            [
                MIN_CAPACITY_BYTES,
                MIN_CAPACITY_BYTES,
                2 * MIN_CAPACITY_BYTES,
                4 * MIN_CAPACITY_BYTES
            ]
        );
        // A large step takes what it needs at once.
        let mut big: Vec<u8> = Vec::new();
        assert!(reserve(&mut big, 1 << 20, &mut unlimited));
        assert!(big.capacity() >= 1 << 20);
        // Items are charged by their size.
        let mut charged = 0;
        let mut wide: Vec<[u64; 4]> = Vec::new();
        assert!(reserve(&mut wide, 1_000, &mut |bytes| {
            charged += bytes;
            true
        }));
        assert_eq!(charged, wide.capacity() * 32);
    }
}
