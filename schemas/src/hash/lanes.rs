//! Keyed BLAKE3 of many short inputs at once, eight side by side: word `w` of the eight inputs'
//! blocks fills one vector of eight 32-bit lanes, and each step of the compression function
//! works on all eight. The `blake3` crate does this for the chunks of one long input; for short
//! inputs it can only compress one block at a time, where each step waits on the one before
//! (about 85 ns a block on the machines of docs/benchmark-history.md, whichever instruction
//! set it picks). A sensor reading's canonical encoding is one or two blocks, so its hash was
//! latency-bound; eight lanes take a block of each of eight readings in about the time of
//! two blocks alone.
//!
//! Only single-chunk inputs (up to 1 KiB) go into lanes, grouped by their number of blocks;
//! longer inputs, and groups too small to fill a vector, go to `blake3::keyed_hash`. The
//! vector code is plain Rust on arrays that the compiler vectorizes; [`pulp::Arch`] runs it
//! compiled for the best instruction set the CPU has (AVX2 on x86-64, NEON on aarch64), picked
//! at run time, so a binary built for any x86-64 still uses AVX2 where it exists. Tests hold
//! every result equal to `blake3::keyed_hash`.

const LANES: usize = 8;
const BLOCK_LEN: usize = 64;
const CHUNK_LEN: usize = 1024;
const MAX_BLOCKS: usize = CHUNK_LEN / BLOCK_LEN;

/// BLAKE3's domain flags.
const CHUNK_START: u32 = 1;
const CHUNK_END: u32 = 2;
const ROOT: u32 = 8;
const KEYED_HASH: u32 = 16;

/// A group of fewer inputs of one block count is hashed one input at a time: a vector of
/// eight lanes costs about what three inputs alone do.
const MIN_LANES: usize = 3;

const IV: [u32; 8] = [
    0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19,
];

const MSG_SCHEDULE: [[usize; 16]; 7] = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8],
    [3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1],
    [10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6],
    [12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4],
    [9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7],
    [11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13],
];

/// One 32-bit word of each lane.
type Lanes = [u32; LANES];

/// The keyed BLAKE3 hashes of the inputs `ends` cuts `buf` into (input `i` is
/// `buf[ends[i - 1]..ends[i]]`, the first starts at 0), written to `out[i]`. `order` is
/// scratch space.
pub(super) fn keyed_hash_many(
    key: &[u8; 32],
    buf: &[u8],
    ends: &[usize],
    order: &mut Vec<u32>,
    out: &mut [[u8; 32]],
) {
    let input = |i: usize| &buf[if i == 0 { 0 } else { ends[i - 1] }..ends[i]];
    // Inputs ordered by their number of blocks (a counting sort); longer ones are hashed alone.
    let mut counts = [0usize; MAX_BLOCKS + 1];
    for (i, out) in out.iter_mut().enumerate().take(ends.len()) {
        match blocks(input(i).len()) {
            Some(b) => counts[b] += 1,
            None => *out = *blake3::keyed_hash(key, input(i)).as_bytes(),
        }
    }
    let mut starts = [0usize; MAX_BLOCKS + 2];
    for b in 1..=MAX_BLOCKS {
        starts[b + 1] = starts[b] + counts[b];
    }
    order.clear();
    order.resize(starts[MAX_BLOCKS + 1], 0);
    let mut next = starts;
    for i in 0..ends.len() {
        if let Some(b) = blocks(input(i).len()) {
            order[next[b]] = i as u32;
            next[b] += 1;
        }
    }
    let key_words: [u32; 8] = std::array::from_fn(|w| word(key, w));
    for b in 1..=MAX_BLOCKS {
        for group in order[starts[b]..starts[b + 1]].chunks(LANES) {
            if group.len() < MIN_LANES {
                for &i in group {
                    let i = i as usize;
                    out[i] = *blake3::keyed_hash(key, input(i)).as_bytes();
                }
                continue;
            }
            // Lanes past the group's inputs hash its first input again; their results are dropped.
            let inputs: [&[u8]; LANES] =
                std::array::from_fn(|l| input(group[l.min(group.len() - 1)] as usize));
            let hashes = arch().dispatch(Eight {
                key: &key_words,
                inputs: &inputs,
                blocks: b,
            });
            for (l, &i) in group.iter().enumerate() {
                for (w, word) in hashes.iter().enumerate() {
                    out[i as usize][w * 4..w * 4 + 4].copy_from_slice(&word[l].to_le_bytes());
                }
            }
        }
    }
}

/// The number of blocks of a single-chunk input (an empty input is one empty block); `None`
/// for longer inputs.
fn blocks(len: usize) -> Option<usize> {
    (len <= CHUNK_LEN).then(|| len.div_ceil(BLOCK_LEN).max(1))
}

fn arch() -> pulp::Arch {
    static ARCH: std::sync::LazyLock<pulp::Arch> = std::sync::LazyLock::new(pulp::Arch::new);
    *ARCH
}

fn word(bytes: &[u8], w: usize) -> u32 {
    u32::from_le_bytes([
        bytes[w * 4],
        bytes[w * 4 + 1],
        bytes[w * 4 + 2],
        bytes[w * 4 + 3],
    ])
}

/// Eight single-chunk inputs of `blocks` blocks each, hashed side by side.
struct Eight<'a> {
    key: &'a [u32; 8],
    inputs: &'a [&'a [u8]; LANES],
    blocks: usize,
}

impl pulp::WithSimd for Eight<'_> {
    /// The hashes' words: `[w][l]` is word `w` of lane `l`'s hash.
    type Output = [Lanes; 8];

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> Self::Output {
        let mut cv: [Lanes; 8] = std::array::from_fn(|w| [self.key[w]; LANES]);
        for b in 0..self.blocks {
            let mut block_len = [0u32; LANES];
            let mut m = [[0u32; LANES]; 16];
            for (l, input) in self.inputs.iter().enumerate() {
                let part = &input[(b * BLOCK_LEN).min(input.len())..];
                let part = &part[..part.len().min(BLOCK_LEN)];
                block_len[l] = part.len() as u32;
                let mut padded = [0u8; BLOCK_LEN];
                padded[..part.len()].copy_from_slice(part);
                for (w, row) in m.iter_mut().enumerate() {
                    row[l] = word(&padded, w);
                }
            }
            let mut flags = KEYED_HASH;
            if b == 0 {
                flags |= CHUNK_START;
            }
            if b == self.blocks - 1 {
                flags |= CHUNK_END | ROOT;
            }
            compress(&mut cv, &m, block_len, [flags; LANES]);
        }
        cv
    }
}

/// BLAKE3's compression function on eight lanes, with the block counter 0 (every input is the
/// first chunk); `cv` becomes the new chaining values (the hash, after a `ROOT` block).
#[inline(always)]
fn compress(cv: &mut [Lanes; 8], m: &[Lanes; 16], block_len: Lanes, flags: Lanes) {
    let mut v: [Lanes; 16] = [
        cv[0],
        cv[1],
        cv[2],
        cv[3],
        cv[4],
        cv[5],
        cv[6],
        cv[7],
        [IV[0]; LANES],
        [IV[1]; LANES],
        [IV[2]; LANES],
        [IV[3]; LANES],
        [0; LANES],
        [0; LANES],
        block_len,
        flags,
    ];
    for s in &MSG_SCHEDULE {
        g(&mut v, [0, 4, 8, 12], m[s[0]], m[s[1]]);
        g(&mut v, [1, 5, 9, 13], m[s[2]], m[s[3]]);
        g(&mut v, [2, 6, 10, 14], m[s[4]], m[s[5]]);
        g(&mut v, [3, 7, 11, 15], m[s[6]], m[s[7]]);
        g(&mut v, [0, 5, 10, 15], m[s[8]], m[s[9]]);
        g(&mut v, [1, 6, 11, 12], m[s[10]], m[s[11]]);
        g(&mut v, [2, 7, 8, 13], m[s[12]], m[s[13]]);
        g(&mut v, [3, 4, 9, 14], m[s[14]], m[s[15]]);
    }
    for (w, cv) in cv.iter_mut().enumerate() {
        *cv = std::array::from_fn(|l| v[w][l] ^ v[w + 8][l]);
    }
}

/// The quarter-round on state words `a, b, c, d` with message words `x` and `y`.
#[inline(always)]
fn g(v: &mut [Lanes; 16], [a, b, c, d]: [usize; 4], x: Lanes, y: Lanes) {
    v[a] = add(add(v[a], v[b]), x);
    v[d] = xor_rotate(v[d], v[a], 16);
    v[c] = add(v[c], v[d]);
    v[b] = xor_rotate(v[b], v[c], 12);
    v[a] = add(add(v[a], v[b]), y);
    v[d] = xor_rotate(v[d], v[a], 8);
    v[c] = add(v[c], v[d]);
    v[b] = xor_rotate(v[b], v[c], 7);
}

#[inline(always)]
fn add(a: Lanes, b: Lanes) -> Lanes {
    std::array::from_fn(|l| a[l].wrapping_add(b[l]))
}

#[inline(always)]
fn xor_rotate(a: Lanes, b: Lanes, bits: u32) -> Lanes {
    std::array::from_fn(|l| (a[l] ^ b[l]).rotate_right(bits))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    fn check(inputs: &[Vec<u8>], key: &[u8; 32]) {
        let mut buf = Vec::new();
        let ends: Vec<usize> = inputs
            .iter()
            .map(|i| {
                buf.extend_from_slice(i);
                buf.len()
            })
            .collect();
        let mut out = vec![[0u8; 32]; inputs.len()];
        super::keyed_hash_many(key, &buf, &ends, &mut Vec::new(), &mut out);
        for (input, hash) in inputs.iter().zip(&out) {
            assert_eq!(
                hash,
                blake3::keyed_hash(key, input).as_bytes(),
                "{} bytes",
                input.len()
            );
        }
    }

    #[test]
    fn every_length_up_to_past_a_chunk_hashes_as_blake3_does() {
        let key = blake3::derive_key("lanes test", b"");
        // Eight inputs of each length: every length fills whole vectors, at every block count
        // and last-block length, and the lengths past one chunk take the other path.
        let inputs: Vec<Vec<u8>> = (0..=1100usize)
            .flat_map(|len| (0..8u8).map(move |k| (0..len).map(|i| (i * 7) as u8 ^ k).collect()))
            .collect();
        check(&inputs, &key);
    }

    proptest! {
        #[test]
        fn mixed_groups_hash_as_blake3_does(
            inputs in prop::collection::vec(
                prop_oneof![
                    4 => prop::collection::vec(any::<u8>(), 0..200),
                    1 => prop::collection::vec(any::<u8>(), 0..1300),
                ],
                0..40,
            ),
            key in any::<[u8; 32]>(),
        ) {
            check(&inputs, &key);
        }
    }
}
