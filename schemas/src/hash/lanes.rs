//! Keyed BLAKE3 of many short inputs at once, eight side by side: word `w` of the eight inputs'
//! blocks fills one vector of eight 32-bit lanes, and each step of the compression function
//! works on all eight. The `blake3` crate does this for the chunks of one long input; for short
//! inputs it can only compress one block at a time, where each step waits on the one before
//! (about 85 ns a block on the machines of docs/src/benchmarks.md, whichever instruction
//! set it picks). A sensor reading's canonical encoding is one or two blocks, so its hash was
//! latency-bound; eight lanes take a block of each of eight readings in about the time of
//! two blocks alone.
//!
//! Only single-chunk inputs (up to 1 KiB) go into lanes, grouped by their number of blocks;
//! longer inputs, and groups too small to fill a vector, go to `blake3::keyed_hash`. On x86-64
//! CPUs with AVX2 (picked at run time, so a binary built for any x86-64 uses it where it
//! exists) the compression function is written with AVX2 intrinsics through `pulp`'s checked
//! token, and each input's block is loaded whole and the blocks' words transposed into the
//! vectors with shuffles; its seven rounds are written out, so every message word is picked by
//! a constant index (518 instructions a sensor reading, against 733 with the words put in place
//! one at a time and the rounds looped over the schedule table). Where the CPU also has AVX-512F and VL, the same code runs through the `V4`
//! token with each rotation one instruction (`vprord`) instead of a shuffle or two shifts and
//! an or (the lanes' share of the agent's samples 4.6%, against 5.9% with AVX2). Elsewhere it is
//! plain Rust on arrays that the compiler vectorizes, compiled by [`pulp::Arch`] for the best
//! instruction set the CPU has (NEON on aarch64). x86-64 does not run that portable code: an
//! unrelated change elsewhere in the crate can leave it compiled to scalar code (the same
//! source, vectorized or not as the optimizer's heuristics fall), which costs the edge agent a
//! quarter more CPU. Tests hold every result of both
//! paths equal to `blake3::keyed_hash`.

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
    keyed_hash_many_on(Path::Best, key, buf, ends, order, out);
}

/// Which code hashes the lanes: the best for the CPU, or the portable code (for tests on CPUs
/// where the best is another).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Best,
    /// AVX2 without AVX-512's rotations, where the CPU has both.
    #[cfg_attr(not(test), allow(dead_code))]
    Avx2,
    #[cfg_attr(not(test), allow(dead_code))]
    Portable,
}

/// [`keyed_hash_many`] on `path`.
fn keyed_hash_many_on(
    path: Path,
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
            let hashes = hash_eight(path, &key_words, &inputs, b);
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

/// The hashes' words of eight inputs of `blocks` blocks each (`[w][l]`: word `w` of lane `l`).
fn hash_eight(path: Path, key: &[u32; 8], inputs: &[&[u8]; LANES], blocks: usize) -> [Lanes; 8] {
    #[cfg(target_arch = "x86_64")]
    {
        let eight = (key, inputs, blocks);
        match (path, v4(), v3()) {
            (Path::Best, Some(v4), _) => {
                return vectorized(v4, avx2::Ops(*v4, avx2::Native(v4.avx512f)), eight);
            }
            (Path::Best | Path::Avx2, _, Some(v3)) => {
                return vectorized(v3, avx2::Ops(v3, avx2::Shifts(v3)), eight);
            }
            _ => {}
        }
    }
    let _ = path;
    arch().dispatch(Eight {
        key,
        inputs,
        blocks,
        ops: Portable,
    })
}

fn arch() -> pulp::Arch {
    static ARCH: std::sync::LazyLock<pulp::Arch> = std::sync::LazyLock::new(pulp::Arch::new);
    *ARCH
}

#[cfg(target_arch = "x86_64")]
fn v3() -> Option<pulp::x86::V3> {
    static V3: std::sync::LazyLock<Option<pulp::x86::V3>> =
        std::sync::LazyLock::new(pulp::x86::V3::try_new);
    *V3
}

/// [`hash_eight`]'s key, inputs and block count hashed with `ops`, `simd`'s instructions enabled.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn vectorized<S: pulp::Simd, O: LaneOps>(
    simd: S,
    ops: O,
    (key, inputs, blocks): (&[u32; 8], &[&[u8]; LANES], usize),
) -> [Lanes; 8] {
    pulp::Simd::vectorize(
        simd,
        Eight {
            key,
            inputs,
            blocks,
            ops,
        },
    )
}

#[cfg(target_arch = "x86_64")]
fn v4() -> Option<pulp::x86::V4> {
    static V4: std::sync::LazyLock<Option<pulp::x86::V4>> =
        std::sync::LazyLock::new(pulp::x86::V4::try_new);
    *V4
}

fn word(bytes: &[u8], w: usize) -> u32 {
    u32::from_le_bytes([
        bytes[w * 4],
        bytes[w * 4 + 1],
        bytes[w * 4 + 2],
        bytes[w * 4 + 3],
    ])
}

/// How eight lanes of 32-bit words are held and mixed: [`compress`] is written once over it.
trait LaneOps {
    /// One state word of each lane.
    type Word: Copy;
    fn word(&self, lanes: Lanes) -> Self::Word;
    fn lanes(&self, word: Self::Word) -> Lanes;
    fn xor(&self, a: Self::Word, b: Self::Word) -> Self::Word;
    /// The 16 message words of one block of each lane (`blocks[l]` is lane `l`'s).
    fn message(&self, blocks: &[&[u8; BLOCK_LEN]; LANES]) -> [Self::Word; 16];
    /// The quarter-round on state words `i, j, k, l` with message words `x` and `y`.
    fn g(&self, v: &mut [Self::Word; 16], ijkl: [usize; 4], x: Self::Word, y: Self::Word);
}
/// Eight single-chunk inputs of `blocks` blocks each, hashed side by side.
struct Eight<'a, O> {
    key: &'a [u32; 8],
    inputs: &'a [&'a [u8]; LANES],
    blocks: usize,
    ops: O,
}

impl<O: LaneOps> pulp::WithSimd for Eight<'_, O> {
    /// The hashes' words: `[w][l]` is word `w` of lane `l`'s hash.
    type Output = [Lanes; 8];

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> Self::Output {
        let mut cv: [Lanes; 8] = std::array::from_fn(|w| [self.key[w]; LANES]);
        for b in 0..self.blocks {
            let mut block_len = [0u32; LANES];
            // A whole block is read where it lies; a last, shorter one from a zero-padded copy.
            let mut padded = [[0u8; BLOCK_LEN]; LANES];
            for (l, input) in self.inputs.iter().enumerate() {
                let part = &input[(b * BLOCK_LEN).min(input.len())..];
                let part = &part[..part.len().min(BLOCK_LEN)];
                block_len[l] = part.len() as u32;
                if part.len() < BLOCK_LEN {
                    padded[l][..part.len()].copy_from_slice(part);
                }
            }
            let block: [&[u8; BLOCK_LEN]; LANES] = std::array::from_fn(|l| {
                match self.inputs[l].get(b * BLOCK_LEN..(b + 1) * BLOCK_LEN) {
                    Some(whole) => whole.try_into().expect("a whole block"),
                    None => &padded[l],
                }
            });
            let m = self.ops.message(&block);
            let mut flags = KEYED_HASH;
            if b == 0 {
                flags |= CHUNK_START;
            }
            if b == self.blocks - 1 {
                flags |= CHUNK_END | ROOT;
            }
            compress(&self.ops, &mut cv, m, block_len, [flags; LANES]);
        }
        cv
    }
}

/// BLAKE3's compression function on eight lanes, with the block counter 0 (every input is the
/// first chunk); `cv` becomes the new chaining values (the hash, after a `ROOT` block).
#[inline(always)]
fn compress<O: LaneOps>(
    ops: &O,
    cv: &mut [Lanes; 8],
    m: [O::Word; 16],
    block_len: Lanes,
    flags: Lanes,
) {
    let mut v: [O::Word; 16] = std::array::from_fn(|w| {
        ops.word(match w {
            0..8 => cv[w],
            8..12 => [IV[w - 8]; LANES],
            12 | 13 => [0; LANES],
            14 => block_len,
            _ => flags,
        })
    });
    // The seven rounds written out, so that every message word is picked by a constant index:
    // looped over the schedule, each pick was an index loaded from the table and a load from
    // it, the message kept in memory.
    round(ops, &mut v, &m, &MSG_SCHEDULE[0]);
    round(ops, &mut v, &m, &MSG_SCHEDULE[1]);
    round(ops, &mut v, &m, &MSG_SCHEDULE[2]);
    round(ops, &mut v, &m, &MSG_SCHEDULE[3]);
    round(ops, &mut v, &m, &MSG_SCHEDULE[4]);
    round(ops, &mut v, &m, &MSG_SCHEDULE[5]);
    round(ops, &mut v, &m, &MSG_SCHEDULE[6]);
    for (w, cv) in cv.iter_mut().enumerate() {
        *cv = ops.lanes(ops.xor(v[w], v[w + 8]));
    }
}

/// One round of the compression function, message words picked by `s`.
#[inline(always)]
fn round<O: LaneOps>(ops: &O, v: &mut [O::Word; 16], m: &[O::Word; 16], s: &[usize; 16]) {
    ops.g(v, [0, 4, 8, 12], m[s[0]], m[s[1]]);
    ops.g(v, [1, 5, 9, 13], m[s[2]], m[s[3]]);
    ops.g(v, [2, 6, 10, 14], m[s[4]], m[s[5]]);
    ops.g(v, [3, 7, 11, 15], m[s[6]], m[s[7]]);
    ops.g(v, [0, 5, 10, 15], m[s[8]], m[s[9]]);
    ops.g(v, [1, 6, 11, 12], m[s[10]], m[s[11]]);
    ops.g(v, [2, 7, 8, 13], m[s[12]], m[s[13]]);
    ops.g(v, [3, 4, 9, 14], m[s[14]], m[s[15]]);
}

/// [`LaneOps`] as plain Rust on arrays, which the compiler vectorizes (or not).
struct Portable;

impl LaneOps for Portable {
    type Word = Lanes;

    #[inline(always)]
    fn word(&self, lanes: Lanes) -> Lanes {
        lanes
    }

    #[inline(always)]
    fn lanes(&self, word: Lanes) -> Lanes {
        word
    }

    #[inline(always)]
    fn xor(&self, a: Lanes, b: Lanes) -> Lanes {
        std::array::from_fn(|l| a[l] ^ b[l])
    }

    #[inline(always)]
    fn message(&self, blocks: &[&[u8; BLOCK_LEN]; LANES]) -> [Lanes; 16] {
        std::array::from_fn(|w| std::array::from_fn(|l| word(blocks[l], w)))
    }

    #[inline(always)]
    fn g(&self, v: &mut [Lanes; 16], ijkl: [usize; 4], x: Lanes, y: Lanes) {
        g(v, ijkl, x, y);
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

/// [`LaneOps`] with AVX2: a vector of eight 32-bit lanes per state word, rotated with AVX2
/// alone ([`avx2::Shifts`]) or with AVX-512VL ([`avx2::Native`]).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::__m256i;

    use pulp::core_arch::x86::Avx512f;
    use pulp::x86::V3;

    use super::{BLOCK_LEN, LANES, Lanes};

    /// The CPU's AVX2, checked, and its rotations.
    pub(super) struct Ops<R>(pub(super) V3, pub(super) R);

    impl<R: Rotations> super::LaneOps for Ops<R> {
        type Word = __m256i;

        #[inline(always)]
        fn word(&self, lanes: Lanes) -> __m256i {
            pulp::cast(lanes)
        }

        #[inline(always)]
        fn lanes(&self, word: __m256i) -> Lanes {
            pulp::cast(word)
        }

        #[inline(always)]
        fn xor(&self, a: __m256i, b: __m256i) -> __m256i {
            self.0.avx2._mm256_xor_si256(a, b)
        }

        /// Each lane's block loaded as two vectors of eight words, and the two 8 × 8 squares of
        /// words transposed with shuffles, as BLAKE3's own AVX2 code does: word by word, the
        /// lanes' words were stored one at a time and loaded back as a vector, a load the CPU
        /// cannot forward from the narrower stores.
        #[inline(always)]
        fn message(&self, blocks: &[&[u8; BLOCK_LEN]; LANES]) -> [__m256i; 16] {
            let half = |l: usize, h: usize| -> __m256i {
                let bytes: &[u8; 32] = blocks[l][h * 32..h * 32 + 32].try_into().expect("32 bytes");
                pulp::cast(*bytes)
            };
            let low = self.transpose(std::array::from_fn(|l| half(l, 0)));
            let high = self.transpose(std::array::from_fn(|l| half(l, 1)));
            std::array::from_fn(|w| if w < 8 { low[w] } else { high[w - 8] })
        }

        /// Always inlined, and the intrinsics with it: as a closure it stayed a function of
        /// its own, compiled without AVX2, and each intrinsic became a call.
        #[inline(always)]
        fn g(&self, v: &mut [__m256i; 16], [i, j, k, l]: [usize; 4], x: __m256i, y: __m256i) {
            let (a, r) = (self.0.avx2, self.1);
            v[i] = a._mm256_add_epi32(a._mm256_add_epi32(v[i], v[j]), x);
            v[l] = r.ror16(a._mm256_xor_si256(v[l], v[i]));
            v[k] = a._mm256_add_epi32(v[k], v[l]);
            v[j] = r.ror12(a._mm256_xor_si256(v[j], v[k]));
            v[i] = a._mm256_add_epi32(a._mm256_add_epi32(v[i], v[j]), y);
            v[l] = r.ror8(a._mm256_xor_si256(v[l], v[i]));
            v[k] = a._mm256_add_epi32(v[k], v[l]);
            v[j] = r.ror7(a._mm256_xor_si256(v[j], v[k]));
        }
    }

    /// The quarter-round's four rotations of eight 32-bit lanes to the right.
    pub(super) trait Rotations: Copy {
        fn ror16(self, x: __m256i) -> __m256i;
        fn ror12(self, x: __m256i) -> __m256i;
        fn ror8(self, x: __m256i) -> __m256i;
        fn ror7(self, x: __m256i) -> __m256i;
    }

    /// AVX2's: by 16 and 8 bits as byte shuffles (one instruction where shifts take three), by
    /// 12 and 7 as two shifts and an or, as BLAKE3's own AVX2 code does.
    #[derive(Clone, Copy)]
    pub(super) struct Shifts(pub(super) V3);

    impl Shifts {
        /// `x` with its bytes picked by `table` within each 128-bit half.
        #[inline(always)]
        fn shuffled(self, x: __m256i, table: Lanes) -> __m256i {
            self.0.avx2._mm256_shuffle_epi8(x, pulp::cast(table))
        }

        /// `x` shifted right by `R` bits or'ed with `x` shifted left by `L` (`R + L` = 32).
        #[inline(always)]
        fn shifted<const R: i32, const L: i32>(self, x: __m256i) -> __m256i {
            let a = self.0.avx2;
            a._mm256_or_si256(a._mm256_srli_epi32::<R>(x), a._mm256_slli_epi32::<L>(x))
        }
    }

    impl Rotations for Shifts {
        #[inline(always)]
        fn ror16(self, x: __m256i) -> __m256i {
            self.shuffled(x, ROT16)
        }

        #[inline(always)]
        fn ror12(self, x: __m256i) -> __m256i {
            self.shifted::<12, 20>(x)
        }

        #[inline(always)]
        fn ror8(self, x: __m256i) -> __m256i {
            self.shuffled(x, ROT8)
        }

        #[inline(always)]
        fn ror7(self, x: __m256i) -> __m256i {
            self.shifted::<7, 25>(x)
        }
    }

    /// AVX-512's (with its 256-bit forms, AVX-512VL): one instruction each.
    #[derive(Clone, Copy)]
    pub(super) struct Native(pub(super) Avx512f);

    impl Rotations for Native {
        #[inline(always)]
        fn ror16(self, x: __m256i) -> __m256i {
            self.0._mm256_ror_epi32::<16>(x)
        }

        #[inline(always)]
        fn ror12(self, x: __m256i) -> __m256i {
            self.0._mm256_ror_epi32::<12>(x)
        }

        #[inline(always)]
        fn ror8(self, x: __m256i) -> __m256i {
            self.0._mm256_ror_epi32::<8>(x)
        }

        #[inline(always)]
        fn ror7(self, x: __m256i) -> __m256i {
            self.0._mm256_ror_epi32::<7>(x)
        }
    }

    impl<R> Ops<R> {
        /// Rows of eight words in, columns out: word `w` of row `r` becomes lane `r` of
        /// vector `w`.
        #[inline(always)]
        fn transpose(&self, r: [__m256i; 8]) -> [__m256i; 8] {
            let a = self.0.avx2;
            // Rows interleaved in pairs by word: 01 01 01 01 of words 0, 1 | 4, 5 (`lo`) and
            // 2, 3 | 6, 7 (`hi`), for the row pairs (0, 1), (2, 3), (4, 5), (6, 7).
            let lo: [__m256i; 4] =
                std::array::from_fn(|p| a._mm256_unpacklo_epi32(r[2 * p], r[2 * p + 1]));
            let hi: [__m256i; 4] =
                std::array::from_fn(|p| a._mm256_unpackhi_epi32(r[2 * p], r[2 * p + 1]));
            // Then by pairs of words: words 0, 1, 2, 3 of four rows in the low 128 bits, words
            // 4, 5, 6, 7 in the high ones, of rows 0–3 (`x` = 0) or 4–7 (`x` = 2).
            let quads = |x: usize| {
                [
                    a._mm256_unpacklo_epi64(lo[x], lo[x + 1]),
                    a._mm256_unpackhi_epi64(lo[x], lo[x + 1]),
                    a._mm256_unpacklo_epi64(hi[x], hi[x + 1]),
                    a._mm256_unpackhi_epi64(hi[x], hi[x + 1]),
                ]
            };
            let (first, second) = (quads(0), quads(2));
            std::array::from_fn(|w| {
                if w < 4 {
                    a._mm256_permute2x128_si256::<0x20>(first[w], second[w])
                } else {
                    a._mm256_permute2x128_si256::<0x31>(first[w - 4], second[w - 4])
                }
            })
        }
    }

    /// The byte shuffles that rotate each 32-bit lane right by 16 and by 8 bits.
    const ROT16: Lanes = byte_rotation(2);
    const ROT8: Lanes = byte_rotation(1);

    /// The byte shuffle that rotates each 32-bit lane right by `bytes` bytes: byte `k` of a lane
    /// takes byte `(k + bytes) % 4` (indices count within each 128-bit half).
    const fn byte_rotation(bytes: usize) -> Lanes {
        let mut out = [0u32; LANES];
        let mut lane = 0;
        while lane < LANES {
            let mut k = 0;
            while k < 4 {
                out[lane] |= (((lane % 4) * 4 + (k + bytes) % 4) as u32) << (8 * k);
                k += 1;
            }
            lane += 1;
        }
        out
    }
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
        for path in [super::Path::Best, super::Path::Avx2, super::Path::Portable] {
            let mut out = vec![[0u8; 32]; inputs.len()];
            super::keyed_hash_many_on(path, key, &buf, &ends, &mut Vec::new(), &mut out);
            for (input, hash) in inputs.iter().zip(&out) {
                assert_eq!(
                    hash,
                    blake3::keyed_hash(key, input).as_bytes(),
                    "{path:?}, {} bytes",
                    input.len()
                );
            }
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
