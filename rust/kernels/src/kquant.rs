//! GGUF's K-quants (Q4_K, Q5_K, Q6_K) and the 5-bit formats llama.cpp's quantizer falls
//! back to (Q5_0, Q5_1), read in the file's own bytes: a GEMV for a few bf16 activation
//! rows, and a dequantization to bf16 for larger batches.
//!
//! A row of `k` weights is `k / V` blocks of `B` bytes, rows back to back (`V` values a
//! block: 256 for the K-quants, 32 for Q5_0/Q5_1). Every format is, per group of `G`
//! consecutive weights of a block, `w = scale * q + offset` with `q` a small integer:
//!
//! | format | V | B | G | q | scale | offset |
//! |---|---|---|---|---|---|---|
//! | Q4_K | 256 | 144 | 32 | 4 bits | `d * sc` (f16 `d`, 6-bit `sc`) | `-(dmin * m)` (6-bit `m`) |
//! | Q5_K | 256 | 176 | 32 | 5 bits | as Q4_K | as Q4_K |
//! | Q6_K | 256 | 210 | 16 | 6 bits minus 32 | `d * sc` (i8 `sc`) | none |
//! | Q5_0 | 32 | 22 | 32 | 5 bits minus 16 | `d` | none |
//! | Q5_1 | 32 | 24 | 32 | 5 bits | `d` | `m` (f16) |
//! | Q4_1 | 32 | 20 | 32 | 4 bits | `d` | `m` (f16) |
//! | Q8_0 | 32 | 34 | 32 | i8 | `d` | none |
//!
//! Q8_0 and Q4_1 (and Q4_0, which is Q4_1 with `m = -8 d`) have faster layouts of their own
//! in `crate::quant`; they are here for the matrices that stack row ranges of different
//! formats: llama.cpp's quantizer picks a type per tensor, so the fused q/k/v of one layer
//! can be Q5_0, Q5_0 and Q8_0. A [`Blocks`] matrix is up to [`MAX_SEGMENTS`] such row
//! ranges, each in its own format.
//!
//! The dequantization computes each weight in f32 as ggml's reference (and the `gguf`
//! package's `gguf.quants`) does: the f32 product `d * sc`, then `scale * q`, then the
//! offset added, no fused multiply-add; then rounds it to bf16. The GEMV sums in f32 per
//! group `scale * sum(q x) + offset * sum(x)`, which is the dot product with those weights
//! up to the order and rounding of the additions. Its AVX-512 path takes `x` in [`Fixed`]
//! point (each value within half a step, `2^-15` of the largest of the values that share its
//! scale: 256 for the K-quants, 32 for the other formats) so that `sum(q x)` is an integer
//! dot product; the K-quants also apply their sub-block scales in integers.

use crate::attention::{KernelError, Parallel};
use crate::element::{Bf16, Element, F16};
use crate::prefetch::prefetch_ahead;
use crate::quant::MAX_ROWS;

/// Activation rows one pass over a matrix's blocks serves: past four, each row's
/// accumulators and loads no longer fit in the registers beside the unpacked blocks of
/// the 32-value formats (on a Zen 5 core pair a pass of 8 rows took 0.9x to 2.4x the time
/// of two passes of 4, most often more than 1.2x). The AVX-512 K-quant kernel keeps two
/// integer accumulators a row, which leaves the registers for up to [`MAX_ROWS`]: where it
/// serves every row range of a matrix, 5 to 7 rows left take one pass (a block unpacked
/// once for them, not twice), while 8 and more keep passes of 4, which read the same as
/// passes of 8 on a 2-vCPU Emerald Rapids.
const PASS_ROWS: usize = 4;

/// Output rows per part below which a call is not split.
const MIN_ROWS_PER_PART: usize = 64;
/// Output rows per chunk: a chunk's results are written before the next chunk is read.
const CHUNK_ROWS: usize = 128;
/// Most values a block holds (the K-quants' super-block).
const MAX_VALUES: usize = 256;
/// Most scale groups a block holds (Q6_K's 16 groups of 16).
const MAX_GROUPS: usize = 16;

/// A block format kept as GGUF writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockFormat {
    Q4K,
    Q5K,
    Q6K,
    Q5_0,
    Q5_1,
    Q4_1,
    Q8_0,
}

impl BlockFormat {
    /// Every format, for callers that list them.
    pub const ALL: [BlockFormat; 7] = [
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q4_1,
        Self::Q8_0,
    ];

    /// The layout name the bindings and Python use ("q4_k", ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::Q4K => "q4_k",
            Self::Q5K => "q5_k",
            Self::Q6K => "q6_k",
            Self::Q5_0 => "q5_0",
            Self::Q5_1 => "q5_1",
            Self::Q4_1 => "q4_1",
            Self::Q8_0 => "q8_0",
        }
    }

    /// The format a layout name names.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// Weights a block holds.
    pub fn values(self) -> usize {
        match self {
            Self::Q4K | Self::Q5K | Self::Q6K => 256,
            Self::Q5_0 | Self::Q5_1 | Self::Q4_1 | Self::Q8_0 => 32,
        }
    }

    /// Bytes a block takes.
    pub fn bytes(self) -> usize {
        match self {
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    /// Weights that share one scale (and offset).
    pub fn group(self) -> usize {
        match self {
            Self::Q6K => 16,
            _ => 32,
        }
    }

    /// Bytes of a row of `k` weights.
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.values() * self.bytes()
    }
}

/// Most row ranges of different formats one [`Blocks`] matrix stacks (q, k and v).
pub const MAX_SEGMENTS: usize = 3;

/// `rows` consecutive rows in one format: `data` is `rows` rows of `format.row_bytes(k)`.
#[derive(Clone, Copy)]
pub struct Segment<'a> {
    pub format: BlockFormat,
    pub rows: usize,
    pub data: &'a [u8],
}

/// A matrix of GGUF blocks: one to [`MAX_SEGMENTS`] row ranges, each in its own format.
#[derive(Clone, Copy)]
pub struct Blocks<'a> {
    segments: [Segment<'a>; MAX_SEGMENTS],
    count: usize,
}

/// The formats and row counts a layout name gives: "q4_k" (every one of the `n` rows),
/// or row ranges joined by "+", each "format*rows" ("q5_0*576+q5_0*192+q8_0*192").
pub fn parse_layout(name: &str, n: usize) -> Option<Vec<(BlockFormat, usize)>> {
    if let Some(f) = BlockFormat::from_name(name) {
        return Some(vec![(f, n)]);
    }
    let parts: Option<Vec<(BlockFormat, usize)>> = name
        .split('+')
        .map(|part| {
            let (f, rows) = part.split_once('*')?;
            Some((BlockFormat::from_name(f)?, rows.parse().ok()?))
        })
        .collect();
    parts.filter(|p| (1..=MAX_SEGMENTS).contains(&p.len()))
}

impl<'a> Blocks<'a> {
    /// All rows in one format.
    pub fn new(format: BlockFormat, rows: usize, data: &'a [u8]) -> Self {
        Self::stacked(&[Segment { format, rows, data }]).expect("one segment")
    }

    /// Row ranges stacked in order (None: none, or more than [`MAX_SEGMENTS`]).
    pub fn stacked(segments: &[Segment<'a>]) -> Option<Self> {
        if segments.is_empty() || segments.len() > MAX_SEGMENTS {
            return None;
        }
        let mut all = [segments[0]; MAX_SEGMENTS];
        all[..segments.len()].copy_from_slice(segments);
        Some(Blocks {
            segments: all,
            count: segments.len(),
        })
    }

    /// Rows `lo..hi` of a one-format matrix of `k`-weight rows; None where the rows are in
    /// more than one format (a stacked expert matrix is one tensor, so one format).
    pub fn row_range(&self, lo: usize, hi: usize, k: usize) -> Option<Blocks<'a>> {
        if self.count != 1 {
            return None;
        }
        let s = self.segments[0];
        let bytes = s.format.row_bytes(k);
        Some(Blocks::new(
            s.format,
            hi - lo,
            &s.data[lo * bytes..hi * bytes],
        ))
    }

    /// The row ranges, in order.
    pub fn segments(&self) -> &[Segment<'a>] {
        &self.segments[..self.count]
    }

    /// Whether this holds `n` x `k` weights (`k` a positive multiple of every block).
    pub fn fits(&self, n: usize, k: usize) -> bool {
        k > 0
            && self.segments().iter().map(|s| s.rows).sum::<usize>() == n
            && self.segments().iter().all(|s| {
                k.is_multiple_of(s.format.values())
                    && s.data.len() == s.rows * s.format.row_bytes(k)
            })
    }

    /// Rows `rows.start..` up to `rows.end` or the end of `rows.start`'s segment, whichever
    /// comes first: their format, their bytes, and how many they are.
    fn run(&self, rows: std::ops::Range<usize>, k: usize) -> (BlockFormat, &'a [u8], usize) {
        let mut first = 0;
        for s in self.segments() {
            if rows.start < first + s.rows {
                let bytes = s.format.row_bytes(k);
                let count = (first + s.rows).min(rows.end) - rows.start;
                let at = (rows.start - first) * bytes;
                return (s.format, &s.data[at..at + count * bytes], count);
            }
            first += s.rows;
        }
        panic!("row {} past the matrix's {first}", rows.start);
    }

    /// Row `row`'s format and bytes (a row of `k` weights).
    #[inline]
    fn row(&self, row: usize, k: usize) -> (BlockFormat, &'a [u8]) {
        let (f, bytes, _) = self.run(row..row + 1, k);
        (f, bytes)
    }

    /// Weight `j` of row `row`, dequantized (as the dequantization computes it, in f32).
    pub fn weight(&self, row: usize, j: usize, k: usize) -> f32 {
        let (f, data) = self.row(row, k);
        let at = j / f.values() * f.bytes();
        let mut unpacked = Unpacked::new();
        unpack(f, &data[at..at + f.bytes()], &mut unpacked);
        unpacked.weight(f, j % f.values())
    }
}

/// One block unpacked: `q` per weight, `scale` and `offset` per group.
struct Unpacked {
    q: [i8; MAX_VALUES],
    scale: [f32; MAX_GROUPS],
    offset: [f32; MAX_GROUPS],
}

impl Unpacked {
    fn new() -> Self {
        Unpacked {
            q: [0; MAX_VALUES],
            scale: [0.0; MAX_GROUPS],
            offset: [0.0; MAX_GROUPS],
        }
    }

    /// Weight `j` of the block: `scale * q`, then the offset added (formats with one).
    #[inline(always)]
    fn weight(&self, f: BlockFormat, j: usize) -> f32 {
        let g = j / f.group();
        let w = self.scale[g] * f32::from(self.q[j]);
        if has_offset(f) {
            w + self.offset[g]
        } else {
            w
        }
    }
}

#[inline(always)]
fn has_offset(f: BlockFormat) -> bool {
    matches!(
        f,
        BlockFormat::Q4K | BlockFormat::Q5K | BlockFormat::Q5_1 | BlockFormat::Q4_1
    )
}

#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    F16(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block's 12 scale bytes (ggml's
/// `get_scale_min_k4`).
#[inline(always)]
fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Block `b` (`f.bytes()` bytes) into `u`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // one index walks several arrays of a block
fn unpack(f: BlockFormat, b: &[u8], u: &mut Unpacked) {
    match f {
        BlockFormat::Q4K | BlockFormat::Q5K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            for g in 0..8 {
                let (sc, m) = scale_min_k4(scales, g);
                u.scale[g] = d * f32::from(sc);
                u.offset[g] = -(dmin * f32::from(m));
            }
            let (qh, qs): (&[u8], &[u8]) = if f == BlockFormat::Q5K {
                (&b[16..48], &b[48..176])
            } else {
                (&[], &b[16..144])
            };
            // Groups by pairs over 32 bytes: low nibbles the first, high the second.
            for pair in 0..4 {
                let bytes = &qs[32 * pair..32 * pair + 32];
                let (lo, hi) = u.q[64 * pair..64 * pair + 64].split_at_mut(32);
                for e in 0..32 {
                    lo[e] = (bytes[e] & 15) as i8;
                    hi[e] = (bytes[e] >> 4) as i8;
                }
            }
            if f == BlockFormat::Q5K {
                // Bit g of qh[e] is the fifth bit of weight e of group g.
                for g in 0..8 {
                    let group = &mut u.q[32 * g..32 * g + 32];
                    for e in 0..32 {
                        group[e] |= (((qh[e] >> g) & 1) << 4) as i8;
                    }
                }
            }
        }
        BlockFormat::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            for g in 0..16 {
                u.scale[g] = d * f32::from(sc[g] as i8);
            }
            // Weight 128 h + 32 u + e: low 4 bits from ql[64 h + 32 (u % 2) + e] (high
            // nibble for u >= 2), high 2 bits from qh[32 h + e] >> 2 u.
            for h in 0..2 {
                for part in 0..4 {
                    let low = &ql[64 * h + 32 * (part % 2)..64 * h + 32 * (part % 2) + 32];
                    let high = &qh[32 * h..32 * h + 32];
                    let dst = &mut u.q[128 * h + 32 * part..128 * h + 32 * part + 32];
                    let shift = 4 * (part / 2) as u32;
                    for e in 0..32 {
                        let v = ((low[e] >> shift) & 15) | (((high[e] >> (2 * part)) & 3) << 4);
                        dst[e] = v as i8 - 32;
                    }
                }
            }
        }
        BlockFormat::Q5_0 | BlockFormat::Q5_1 => {
            let d = f16_at(b, 0);
            let at = if f == BlockFormat::Q5_1 { 4 } else { 2 };
            if f == BlockFormat::Q5_1 {
                u.offset[0] = f16_at(b, 2);
            }
            u.scale[0] = d;
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let qs = &b[at + 4..at + 20];
            let minus = if f == BlockFormat::Q5_0 { 16 } else { 0 };
            for e in 0..16 {
                let low = (qs[e] & 15) | ((((qh >> e) & 1) as u8) << 4);
                let high = (qs[e] >> 4) | ((((qh >> (e + 16)) & 1) as u8) << 4);
                u.q[e] = low as i8 - minus;
                u.q[e + 16] = high as i8 - minus;
            }
        }
        BlockFormat::Q4_1 => {
            u.scale[0] = f16_at(b, 0);
            u.offset[0] = f16_at(b, 2);
            for e in 0..16 {
                u.q[e] = (b[4 + e] & 15) as i8;
                u.q[e + 16] = (b[4 + e] >> 4) as i8;
            }
        }
        BlockFormat::Q8_0 => {
            u.scale[0] = f16_at(b, 0);
            for e in 0..32 {
                u.q[e] = b[2 + e] as i8;
            }
        }
    }
}

/// `out[r][i] = sum_j x[r][j] * W[i][j] (+ bias[i])` for `r` in `0..rows`; `x` is
/// `[rows, k]` bf16, `out` `[rows, n]` bf16 (rounded once from the f32 sum). Every
/// [`PASS_ROWS`] activation rows take one pass over the weights (5 to 7 left: one pass,
/// where the AVX-512 K-quant kernel serves the whole matrix).
#[allow(clippy::too_many_arguments)]
pub fn gemv_blocks(
    out: &mut [Bf16],
    x: &[Bf16],
    weight: Blocks<'_>,
    bias: Option<&[Bf16]>,
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    check(&weight, n, k)?;
    if rows == 0
        || x.len() != rows * k
        || out.len() != rows * n
        || bias.is_some_and(|b| b.len() != n)
    {
        return Err(KernelError(format!(
            "gemv ({}): x {} / out {} elements for {rows} rows of {k} by {n}",
            weight.name(),
            x.len(),
            out.len()
        )));
    }
    let path = Path::detect();
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let formats = || weight.segments().iter().map(|s| s.format.values());
    let wide = formats().any(|v| v == 256);
    let fixed = Fixed::new(&xf, rows, k, wide, formats().any(|v| v == 32));
    // Per-group sums of each activation row (of the values the path multiplies), for
    // groups of 16 and of 32; the fixed-point path reads only Q4_K's and Q5_K's (of 32).
    let plain: [Vec<f32>; 2] = if fixed.is_some() {
        Default::default()
    } else {
        [16, 32].map(|g| xf.chunks_exact(g).map(|c| c.iter().sum()).collect())
    };
    let (sums16, sums32) = match &fixed {
        Some(fixed) => (&[][..], &fixed.sums[..]),
        None => (&plain[0][..], &plain[1][..]),
    };
    // Where the AVX-512 K-quant kernel serves every row range, 5 to 7 rows left take one
    // pass (see PASS_ROWS).
    let wide_pass = fixed.is_some() && formats().all(|v| v == 256);
    let parts = (n / MIN_ROWS_PER_PART).clamp(1, threads.max(1));
    let out_addr = out.as_mut_ptr() as usize;
    let task = |part: usize| {
        let (lo, hi) = (n * part / parts, n * (part + 1) / parts);
        let mut results: Vec<[f32; MAX_ROWS]> = Vec::with_capacity(CHUNK_ROWS);
        let mut coef = vec![0f32; k / 16];
        for chunk in (lo..hi).step_by(CHUNK_ROWS) {
            let end = (chunk + CHUNK_ROWS).min(hi);
            let mut first = 0;
            while first < rows {
                let left = rows - first;
                let take = if wide_pass && left > PASS_ROWS && left < 2 * PASS_ROWS {
                    left
                } else {
                    left.min(PASS_ROWS)
                };
                let xs = &xf[first * k..(first + take) * k];
                let xq = fixed.as_ref().map(|fixed| (fixed, first));
                results.clear();
                results.resize(end - chunk, [0.0; MAX_ROWS]);
                // The sums a row of format `f` reads: of groups of 16 or of 32 (the
                // fixed-point path reads only those of 32).
                let sums_of = |f: BlockFormat| {
                    let (sums, groups) = if f.group() == 16 {
                        (sums16, k / 16)
                    } else {
                        (sums32, k / 32)
                    };
                    if sums.is_empty() {
                        sums
                    } else {
                        &sums[first * groups..(first + take) * groups]
                    }
                };
                match (path, xq) {
                    // Runs of rows in one format, each run in one call of the kernel.
                    #[cfg(target_arch = "x86_64")]
                    (Path::Avx512, Some((fixed, _))) => {
                        let x = fixed.rows(first);
                        let mut row = chunk;
                        while row < end {
                            let (f, w, count) = weight.run(row..end, k);
                            let out = &mut results[row - chunk..row - chunk + count];
                            avx512_rows(f, w, x, sums_of(f), take, k, &mut coef, out);
                            row += count;
                        }
                    }
                    _ => {
                        for (i, row) in (chunk..end).enumerate() {
                            let (f, w) = weight.row(row, k);
                            let ss = sums_of(f);
                            dot_row(f, w, xs, xq, ss, take, k, path, &mut coef, &mut results[i]);
                        }
                    }
                }
                for (row, dots) in (chunk..end).zip(&results) {
                    let b = bias.map_or(0.0, |b| b[row].to_f32());
                    for (r, dot) in dots.iter().enumerate().take(take) {
                        // SAFETY: parts own disjoint column ranges [lo, hi) of each output
                        // row, and `out` (rows * n elements) outlives the call.
                        unsafe {
                            *(out_addr as *mut Bf16).add((first + r) * n + row) =
                                Bf16::from_f32(dot + b);
                        }
                    }
                }
                first += take;
            }
        }
    };
    if parts == 1 {
        task(0);
    } else {
        parallel.run(parts, &task);
    }
    Ok(())
}

/// The whole matrix as bf16 `[n, k]`, each weight as the module docs compute it.
pub fn dequantize_blocks(
    out: &mut [Bf16],
    weight: Blocks<'_>,
    n: usize,
    k: usize,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    check(&weight, n, k)?;
    if out.len() != n * k {
        return Err(KernelError(format!(
            "dequantize ({}): out has {} of {n} x {k}",
            weight.name(),
            out.len()
        )));
    }
    let path = Path::detect();
    let parts = (n / MIN_ROWS_PER_PART).clamp(1, threads.max(1));
    let out_addr = out.as_mut_ptr() as usize;
    let task = |part: usize| {
        let (lo, hi) = (n * part / parts, n * (part + 1) / parts);
        let mut u = Unpacked::new();
        for row in lo..hi {
            // SAFETY: parts own disjoint row ranges of `out`, which outlives the call.
            let dst =
                unsafe { std::slice::from_raw_parts_mut((out_addr as *mut Bf16).add(row * k), k) };
            let (f, src) = weight.row(row, k);
            #[cfg(target_arch = "x86_64")]
            match path {
                // SAFETY: the path's features were detected; `dst` is the row of `src`.
                Path::Avx512 => unsafe { avx512::dequantize_row(f, src, dst) },
                // SAFETY: as above.
                Path::Avx2 => unsafe { avx2::dequantize_row(f, src, dst, &mut u) },
                Path::Portable => dequantize_row(f, src, dst, &mut u),
            }
            #[cfg(not(target_arch = "x86_64"))]
            dequantize_row(f, src, dst, &mut u);
        }
    };
    if parts == 1 {
        task(0);
    } else {
        parallel.run(parts, &task);
    }
    Ok(())
}

fn check(weight: &Blocks<'_>, n: usize, k: usize) -> Result<(), KernelError> {
    if weight.fits(n, k) {
        Ok(())
    } else {
        Err(KernelError(format!(
            "GGUF block matrix ({}) does not hold {n} x {k} weights",
            weight.name()
        )))
    }
}

impl Blocks<'_> {
    /// The layout name [`parse_layout`] reads.
    pub fn name(&self) -> String {
        let names: Vec<String> = self
            .segments()
            .iter()
            .map(|s| format!("{}*{}", s.format.name(), s.rows))
            .collect();
        names.join("+")
    }
}

/// One row's blocks `src` as bf16 into `dst` (portable; the AVX2 build of the same code
/// is [`avx2::dequantize_row`]).
#[inline(always)]
fn dequantize_row(f: BlockFormat, src: &[u8], dst: &mut [Bf16], u: &mut Unpacked) {
    let (v, g) = (f.values(), f.group());
    for (block, out) in src.chunks_exact(f.bytes()).zip(dst.chunks_exact_mut(v)) {
        unpack(f, block, u);
        for (group, out) in out.chunks_exact_mut(g).enumerate() {
            let (scale, offset) = (u.scale[group], u.offset[group]);
            let q = &u.q[group * g..group * g + g];
            if has_offset(f) {
                for (o, &q) in out.iter_mut().zip(q) {
                    *o = Bf16::from_f32(scale * f32::from(q) + offset);
                }
            } else {
                for (o, &q) in out.iter_mut().zip(q) {
                    *o = Bf16::from_f32(scale * f32::from(q));
                }
            }
        }
    }
}

fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Which build of [`dot_row`] this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Portable,
    Avx2,
    /// AVX-512 with its integer dot products (VNNI's `vpdpbusd`) against [`Fixed`]
    /// activations, and bf16 conversions for the dequantization.
    Avx512,
}

impl Path {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f")
                && has!("avx512bw")
                && has!("avx512vl")
                && has!("avx512bf16")
                && has!("avx512vnni")
                && has!("f16c")
            {
                return Path::Avx512;
            }
        }
        if avx2_available() {
            Path::Avx2
        } else {
            Path::Portable
        }
    }
}

/// The AVX-512 kernel over consecutive weight rows of format `f` (`w`: `out.len()` rows),
/// `count` activation rows of fixed point `x`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn avx512_rows(
    f: BlockFormat,
    w: &[u8],
    x: FixedRows,
    sums: &[f32],
    count: usize,
    k: usize,
    coef: &mut [f32],
    out: &mut [[f32; MAX_ROWS]],
) {
    let rb = f.row_bytes(k);
    // SAFETY: only called on `Path::Avx512`, whose features were detected; `gemv_blocks`
    // checked the shapes.
    unsafe {
        match count {
            1 => avx512::dot_rows::<1>(f, w, rb, x, sums, k, coef, out),
            2 => avx512::dot_rows::<2>(f, w, rb, x, sums, k, coef, out),
            3 => avx512::dot_rows::<3>(f, w, rb, x, sums, k, coef, out),
            4 => avx512::dot_rows::<4>(f, w, rb, x, sums, k, coef, out),
            5 => avx512::dot_rows::<5>(f, w, rb, x, sums, k, coef, out),
            6 => avx512::dot_rows::<6>(f, w, rb, x, sums, k, coef, out),
            7 => avx512::dot_rows::<7>(f, w, rb, x, sums, k, coef, out),
            _ => avx512::dot_rows::<8>(f, w, rb, x, sums, k, coef, out),
        }
    }
}

/// `dots[r]` = activation row `r`'s dot with the weight row `w` (its blocks), for the
/// `count` rows of `xs` (`[count, k]` f32; `fixed` the same rows from the given one in
/// [`Fixed`] point, which only the AVX-512 path reads; `sums` their per-group sums).
#[allow(clippy::too_many_arguments)]
fn dot_row(
    f: BlockFormat,
    w: &[u8],
    xs: &[f32],
    fixed: Option<(&Fixed, usize)>,
    sums: &[f32],
    count: usize,
    k: usize,
    path: Path,
    coef: &mut [f32],
    dots: &mut [f32; MAX_ROWS],
) {
    if path != Path::Avx512 {
        // The AVX-512 path requests its lines itself, into L2, a block at a time as it
        // reads them (`prefetch_line_ahead_l2`): a row's requests at once, into L1, filled
        // the line buffers and stalled it (32768 x 8192 Q4_K, Q6_K, Q5_0 and Q8_0 matrices
        // from memory on two threads of a Xeon: 1.1x to 1.5x the time), while requests
        // spread through the loop into L2 cut a one-row Q4_K GEMV over 3B-shaped layers to
        // 0.48-0.60x the time of none at all (a 2-vCPU Xeon whose copy bandwidth read
        // 26 GB/s).
        prefetch_ahead(w.as_ptr(), w.len());
    }
    // Only the AVX-512 K-quant kernel takes more than PASS_ROWS rows (see `gemv_blocks`).
    debug_assert!(
        count <= PASS_ROWS || (path == Path::Avx512 && f.values() == 256 && fixed.is_some())
    );
    #[cfg(target_arch = "x86_64")]
    match path {
        Path::Avx512 => {
            if let Some((fixed, first)) = fixed {
                // A run of one row.
                let x = fixed.rows(first);
                avx512_rows(f, w, x, sums, count, k, coef, std::slice::from_mut(dots));
                return;
            }
        }
        // SAFETY: as above.
        Path::Avx2 => unsafe {
            match count {
                1 => avx2::dot_row::<1>(f, w, xs, sums, k, dots),
                2 => avx2::dot_row::<2>(f, w, xs, sums, k, dots),
                3 => avx2::dot_row::<3>(f, w, xs, sums, k, dots),
                _ => avx2::dot_row::<4>(f, w, xs, sums, k, dots),
            }
            return;
        },
        Path::Portable => {}
    }
    let _ = (path, fixed, coef);
    let (v, g) = (f.values(), f.group());
    let groups = k / g;
    let mut u = Unpacked::new();
    let mut acc = [0f32; MAX_ROWS];
    for (b, block) in w.chunks_exact(f.bytes()).enumerate() {
        unpack(f, block, &mut u);
        for group in 0..v / g {
            let at = b * v + group * g;
            let q = &u.q[group * g..group * g + g];
            for (r, acc) in acc.iter_mut().enumerate().take(count) {
                let x = &xs[r * k + at..r * k + at + g];
                let s: f32 = q.iter().zip(x).map(|(&q, &x)| f32::from(q) * x).sum();
                *acc += u.scale[group] * s;
                if has_offset(f) {
                    *acc += u.offset[group] * sums[r * groups + at / g];
                }
            }
        }
    }
    dots[..count].copy_from_slice(&acc[..count]);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{has_offset, unpack, BlockFormat, Unpacked, MAX_ROWS};
    use crate::element::Bf16;

    /// The portable dequantization compiled for AVX2 (the compiler widens its loops).
    ///
    /// SAFETY: AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dequantize_row(
        f: BlockFormat,
        src: &[u8],
        dst: &mut [Bf16],
        u: &mut Unpacked,
    ) {
        super::dequantize_row(f, src, dst, u);
    }

    /// Eight `q` values from `p` as f32.
    #[inline(always)]
    unsafe fn q8(p: *const i8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// The portable `dot_row` with the group sums in 8-lane FMAs, the `q` of each group
    /// widened once for all `ROWS` activation rows.
    ///
    /// SAFETY: AVX2 and FMA; `w` is whole blocks of a row of `k`, `xs` `ROWS` rows of `k`,
    /// `sums` their `k / group` group sums.
    #[allow(clippy::needless_range_loop)] // `r` indexes `acc`, `dots` and the rows of `xs`
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_row<const ROWS: usize>(
        f: BlockFormat,
        w: &[u8],
        xs: &[f32],
        sums: &[f32],
        k: usize,
        dots: &mut [f32; MAX_ROWS],
    ) {
        match f {
            BlockFormat::Q4K => dot::<ROWS, 256, 32, true>(f, w, xs, sums, k, dots),
            BlockFormat::Q5K => dot::<ROWS, 256, 32, true>(f, w, xs, sums, k, dots),
            BlockFormat::Q6K => dot::<ROWS, 256, 16, false>(f, w, xs, sums, k, dots),
            BlockFormat::Q5_0 => dot::<ROWS, 32, 32, false>(f, w, xs, sums, k, dots),
            BlockFormat::Q5_1 | BlockFormat::Q4_1 => {
                dot::<ROWS, 32, 32, true>(f, w, xs, sums, k, dots)
            }
            BlockFormat::Q8_0 => dot::<ROWS, 32, 32, false>(f, w, xs, sums, k, dots),
        }
    }

    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn dot<const ROWS: usize, const V: usize, const G: usize, const OFFSET: bool>(
        f: BlockFormat,
        w: &[u8],
        xs: &[f32],
        sums: &[f32],
        k: usize,
        dots: &mut [f32; MAX_ROWS],
    ) {
        debug_assert_eq!(has_offset(f), OFFSET);
        let groups = k / G;
        let mut u = Unpacked::new();
        let mut acc = [_mm256_setzero_ps(); ROWS];
        let mut off = [0f32; ROWS];
        let xp = xs.as_ptr();
        for (b, block) in w.chunks_exact(f.bytes()).enumerate() {
            unpack(f, block, &mut u);
            for group in 0..V / G {
                let at = b * V + group * G;
                let qp = u.q.as_ptr().add(group * G);
                let mut q = [_mm256_setzero_ps(); 4];
                for v in 0..G / 8 {
                    q[v] = q8(qp.add(8 * v));
                }
                let scale = _mm256_set1_ps(u.scale[group]);
                for r in 0..ROWS {
                    let x = xp.add(r * k + at);
                    let mut t = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
                    for v in 1..G / 8 {
                        t = _mm256_fmadd_ps(q[v], _mm256_loadu_ps(x.add(8 * v)), t);
                    }
                    acc[r] = _mm256_fmadd_ps(t, scale, acc[r]);
                    if OFFSET {
                        off[r] += u.offset[group] * *sums.get_unchecked(r * groups + at / G);
                    }
                }
            }
        }
        for r in 0..ROWS {
            dots[r] = hsum(acc[r]) + off[r];
        }
    }
}

/// Activation rows in fixed point, as the AVX-512 GEMV multiplies them, in two forms. Each
/// row is padded with zeros to a multiple of 256 values ([`padded_len`]).
///
/// - For the K-quants, 14 bits: each 256 values `x` (a super-block's span) have a scale
///   `s = max |x| / 16383` and store each value as the `i16` `round(x / s)`, which VNNI's
///   `vpdpwssd` multiplies with the weights' stored values widened to `i16`, 32 products
///   an instruction, exact in i32. A value is off by at most `s / 2`, `2^-15` of the
///   largest of its 256.
/// - For the 32-value formats, 15 bits: each block of 32 has a scale `s = max |x| / 16383`
///   and stores each value as `round(x / s) = 128 hi + lo`, `hi` an `i8` and `lo` in
///   `0..128`: two byte planes that `vpdpbusd` multiplies with unsigned weight bytes, 64
///   products an instruction. A value is off by at most `2^-15` of its block's largest.
///
/// bf16 itself rounds each value to `2^-9` of its own size, so either form adds less to a
/// dot product's error than the bf16 activations have already. 8 bits a value (llama.cpp's
/// `Q8_K` and `Q8_0` rows) doubled SmolLM2 Q4_K_M's logit error against transformers'
/// float32 on the same weights.
struct Fixed {
    v: Vec<i16>,
    /// Per 256 values, their `s`.
    scale: Vec<f32>,
    hi: Vec<i8>,
    lo: Vec<u8>,
    /// Per 64 values, 16 lanes: the first block's `s` in lanes 0..8, the second's in 8..16
    /// (the lanes of `vpdpbusd`'s sums of four products).
    lanes: Vec<f32>,
    /// Per 4 values (a lane of `vpdpbusd`'s sums), their sum in the 15-bit point: what a
    /// lane's offset multiplies.
    spread: Vec<f32>,
    /// Each row's sums of its 14-bit values per 32, rows back to back: what the offsets of
    /// Q4_K and Q5_K (the only formats on this path that read group sums) multiply.
    sums: Vec<f32>,
    /// A padded row's length.
    kp: usize,
}

/// Pointers to one row of [`Fixed`] and the distances to the next.
#[derive(Clone, Copy)]
struct FixedRows {
    v: *const i16,
    scale: *const f32,
    hi: *const i8,
    lo: *const u8,
    lanes: *const f32,
    spread: *const f32,
    kp: usize,
}

impl FixedRows {
    /// Row `r`'s values from value `at`.
    #[inline(always)]
    unsafe fn at(self, r: usize, at: usize) -> *const i16 {
        self.v.add(r * self.kp + at)
    }

    /// Row `r`'s scale of the 256 values from `256 c`.
    #[inline(always)]
    unsafe fn scale(self, r: usize, c: usize) -> f32 {
        *self.scale.add(r * self.kp / 256 + c)
    }
}

impl Fixed {
    /// `rows` rows of `k` (a multiple of 32) in fixed point, where the CPU has the AVX-512
    /// path that reads them: the 14-bit form if `wide` (K-quants), the 15-bit one if
    /// `narrow` (32-value formats). The group sums are the 14-bit form's (zeros without it:
    /// only the K-quants read them).
    fn new(x: &[f32], rows: usize, k: usize, wide: bool, narrow: bool) -> Option<Self> {
        if Path::detect() != Path::Avx512 || !k.is_multiple_of(32) || x.len() != rows * k {
            return None;
        }
        let kp = padded_len(k);
        let sized = |on: bool, len: usize| if on { len } else { 0 };
        let mut fixed = Fixed {
            v: vec![0; sized(wide, rows * kp)],
            scale: vec![0.0; sized(wide, rows * kp / 256)],
            hi: vec![0; sized(narrow, rows * kp)],
            lo: vec![0; sized(narrow, rows * kp)],
            lanes: vec![0.0; sized(narrow, rows * kp / 4)],
            spread: vec![0.0; sized(narrow, rows * kp / 4)],
            sums: vec![0.0; rows * k / 32],
            kp,
        };
        #[cfg(target_arch = "x86_64")]
        for (r, row) in x.chunks_exact(k).enumerate() {
            // SAFETY: the path's features were detected; each slice holds row r's part.
            unsafe {
                if wide {
                    avx512::fix_row(
                        row,
                        &mut fixed.v[r * kp..],
                        &mut fixed.scale[r * kp / 256..],
                        &mut fixed.sums[r * k / 32..],
                    );
                }
                if narrow {
                    avx512::fix_row_narrow(
                        row,
                        &mut fixed.hi[r * kp..],
                        &mut fixed.lo[r * kp..],
                        &mut fixed.lanes[r * kp / 4..],
                        &mut fixed.spread[r * kp / 4..],
                    );
                }
            };
        }
        Some(fixed)
    }

    /// Value `j` of row `r` as the fixed point holds it for format `f`.
    #[cfg(test)]
    fn value(&self, f: BlockFormat, r: usize, j: usize) -> f32 {
        let at = r * self.kp + j;
        if f.values() == 256 {
            self.scale[at / 256] * f32::from(self.v[at])
        } else {
            let q = 128 * i32::from(self.hi[at]) + i32::from(self.lo[at]);
            self.lanes[at / 4] * q as f32
        }
    }

    fn rows(&self, first: usize) -> FixedRows {
        let at = first * self.kp;
        FixedRows {
            // A form that was not made is never read: its pointers only keep the shape.
            v: self.v.as_ptr().wrapping_add(at),
            scale: self.scale.as_ptr().wrapping_add(at / 256),
            hi: self.hi.as_ptr().wrapping_add(at),
            lo: self.lo.as_ptr().wrapping_add(at),
            lanes: self.lanes.as_ptr().wrapping_add(at / 4),
            spread: self.spread.as_ptr().wrapping_add(at / 4),
            kp: self.kp,
        }
    }
}

/// A row's length in [`Fixed`] point.
fn padded_len(k: usize) -> usize {
    k.div_ceil(256) * 256
}

/// The GEMV with integer dot products, 64 weights a step: their stored values (bytes: every
/// format's 4, 5 or 6 bits before its own offset; Q8_0's `i8` plus 128) are put in their
/// natural order.
///
/// - The K-quants widen them to two registers of 32 `i16` and multiply them by their
///   sub-block scales (`sc q` is at most 4096 in size, Q6_K's `q` less its 32). Two
///   `vpdpwssd` a row take their products with the row's 14-bit [`Fixed`] values, so that
///   the row's products add up in integers over a whole super-block: 16 products a lane of
///   at most `4096 * 16383`, within i32. One conversion and one FMA a row per 256 weights
///   apply `d` times the activations' scale. The offsets of Q4_K and Q5_K (`-dmin m` per
///   group) are collected in `coef` and multiplied with the row's group sums at its end.
///   Against a 15-bit point with a float FMA per 32 weights, this took 0.5-0.7x the time
///   of a step of 4 to 8 rows and 0.9-1.0x of one row (`benches/quant_rows.py`).
/// - The 32-value formats keep their bytes in one register. Two `vpdpbusd` take their
///   products with the row's 15-bit `hi` and `lo` planes (the first shifted up by 7 bits
///   before the second adds to it), exact in i32; lanes 0..8 then hold the first block's
///   sums, lanes 8..16 the second's. One conversion to f32 and one FMA apply each lane's
///   `d` times its activation scale, and each lane's offset (`-16 d` for Q5_0, `m` for
///   Q5_1 and Q4_1, `-128 d` for Q8_0) times its sum of four values (`Fixed::spread`) is
///   added per step.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{BlockFormat, FixedRows, MAX_ROWS};
    use crate::element::Bf16;
    use crate::prefetch::prefetch_line_ahead_l2;

    /// The f16 at `p` as f32.
    #[inline(always)]
    unsafe fn half(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }

    #[inline(always)]
    unsafe fn word(p: *const u8) -> u32 {
        u32::from_le_bytes(std::ptr::read_unaligned(p.cast()))
    }

    /// `[a; 8]` then `[b; 8]`.
    #[inline(always)]
    unsafe fn halves(a: f32, b: f32) -> __m512 {
        _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(a), _mm512_set1_ps(b))
    }

    /// The low and high 32 bytes of `q` as `i16` (unsigned bytes).
    #[inline(always)]
    unsafe fn widen_u8(q: __m512i) -> (__m512i, __m512i) {
        (
            _mm512_cvtepu8_epi16(_mm512_castsi512_si256(q)),
            _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(q)),
        )
    }

    /// 64 weights' `i16` values `w0` (the first 32) and `w1` into each row's integer
    /// accumulators `acc[r][0]` and `acc[r][1]`, with the rows' values from `at`. Integer
    /// sums are exact in any order, so how many accumulators a row has changes no bit of
    /// its result; two leave the registers for eight rows a pass.
    #[inline(always)]
    unsafe fn step<const ROWS: usize>(
        w0: __m512i,
        w1: __m512i,
        x: FixedRows,
        at: usize,
        acc: &mut [[__m512i; 2]; ROWS],
    ) {
        for (r, acc) in acc.iter_mut().enumerate() {
            let v = x.at(r, at);
            acc[0] = _mm512_dpwssd_epi32(acc[0], w0, _mm512_loadu_si512(v.cast()));
            acc[1] = _mm512_dpwssd_epi32(acc[1], w1, _mm512_loadu_si512(v.add(32).cast()));
        }
    }

    /// A super-block's integer sums, times `d` and each row's scale of chunk `c`, into
    /// `total`.
    #[inline(always)]
    unsafe fn fold<const ROWS: usize>(
        acc: &[[__m512i; 2]; ROWS],
        d: f32,
        x: FixedRows,
        c: usize,
        total: &mut [__m512; ROWS],
    ) {
        for r in 0..ROWS {
            let a = &acc[r];
            let sum = _mm512_add_epi32(a[0], a[1]);
            let s = _mm512_set1_ps(d * x.scale(r, c));
            total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, total[r]);
        }
    }

    /// Two blocks of Q5_0, Q5_1 or Q4_1 at `p` (the second absent if `!both`): their 64
    /// stored values in order, their scales `d` (lanes 0..8 the first block's, 8..16 the
    /// second's) and their offsets per stored value's unit (`-16 d` for Q5_0, `m` else).
    ///
    /// One masked load reads both blocks (48 bytes at most), and 16-bit permutes place
    /// their nibbles (every field starts at an even byte) and their f16 `d` and `m`.
    #[inline(always)]
    unsafe fn pair32(f: BlockFormat, p: *const u8, both: bool) -> (__m512i, __m512, __m512) {
        let size = f.bytes();
        let (qs, qh) = match f {
            BlockFormat::Q5_0 => (6, Some(2)),
            BlockFormat::Q5_1 => (8, Some(4)),
            _ => (4, None),
        };
        let len = if both { 2 * size } else { size };
        // Two blocks are at most 68 bytes: two line requests cover them.
        prefetch_line_ahead_l2(p);
        prefetch_line_ahead_l2(p.add(len - 1));
        let v = _mm512_maskz_loadu_epi8((1u64 << len) - 1, p.cast());
        // 16-bit lanes 0..8 and 8..16 the first block's nibbles, 16..32 the second's.
        let (a, b) = ((qs / 2) as i16, ((size + qs) / 2) as i16);
        let nibbles: [i16; 32] = std::array::from_fn(|i| if i < 16 { a } else { b } + i as i16 % 8);
        let nibbles = _mm512_loadu_si512(nibbles.as_ptr().cast());
        let bytes = _mm512_permutexvar_epi16(nibbles, v);
        let four = 0x0004_0004_0004_0004;
        let shift = _mm512_set_epi64(four, four, 0, 0, four, four, 0, 0);
        let mut q = _mm512_and_si512(_mm512_srlv_epi16(bytes, shift), _mm512_set1_epi8(15));
        if let Some(h) = qh {
            let second = if both {
                u64::from(word(p.add(size + h)))
            } else {
                0
            };
            let fifth = u64::from(word(p.add(h))) | (second << 32);
            q = _mm512_mask_add_epi8(q, fifth, q, _mm512_set1_epi8(16));
        }
        // The f16 words `d` (0 and size / 2) and `m` (1 and size / 2 + 1), eight each.
        let pick = |w: i16| {
            let at = _mm512_mask_blend_epi16(
                0xff00,
                _mm512_set1_epi16(w),
                _mm512_set1_epi16(size as i16 / 2 + w),
            );
            _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(at, v)))
        };
        let d = pick(0);
        let offset = if f == BlockFormat::Q5_0 {
            _mm512_mul_ps(d, _mm512_set1_ps(-16.0))
        } else {
            pick(1)
        };
        (q, d, offset)
    }

    /// `blocks` Q4_K (Q5_K if `five`) blocks at `p`: their offsets into `coef`, 8 a block,
    /// and their products into `total`.
    #[inline(always)]
    unsafe fn k4_blocks<const ROWS: usize>(
        p: *const u8,
        five: bool,
        blocks: usize,
        x: FixedRows,
        coef: *mut f32,
        total: &mut [__m512; ROWS],
    ) {
        let size = if five { 176 } else { 144 };
        for b in 0..blocks {
            let p = p.add(size * b);
            for line in (0..size).step_by(64) {
                prefetch_line_ahead_l2(p.add(line));
            }
            let mut numbers = [0u8; 16];
            _mm_storeu_si128(numbers.as_mut_ptr().cast(), k4_numbers(p));
            let mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(
                _mm_loadu_si128(numbers.as_ptr().cast()),
            )));
            let minus_dmin = _mm256_set1_ps(-half(p.add(2)));
            _mm256_storeu_ps(coef.add(8 * b), _mm256_mul_ps(minus_dmin, mins));
            // The eight scales as `i16` in every 128-bit lane; a byte shuffle spreads one.
            let sc =
                _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_loadu_si128(numbers.as_ptr().cast())));
            let spread = |j: i8| {
                let pick = _mm512_set1_epi16(i16::from_le_bytes([2 * j as u8, 2 * j as u8 + 1]));
                _mm512_shuffle_epi8(sc, pick)
            };
            let mut acc = [[_mm512_setzero_si512(); 2]; ROWS];
            for pair in 0..4 {
                let (w0, w1) = k4_words(p, five, pair);
                let w0 = _mm512_mullo_epi16(w0, spread(2 * pair as i8));
                let w1 = _mm512_mullo_epi16(w1, spread(2 * pair as i8 + 1));
                step::<ROWS>(w0, w1, x, b * 256 + 64 * pair, &mut acc);
            }
            fold::<ROWS>(&acc, half(p), x, b, total);
        }
    }

    /// `blocks` Q6_K blocks at `p`, their products into `total`.
    #[inline(always)]
    unsafe fn k6_blocks<const ROWS: usize>(
        p: *const u8,
        blocks: usize,
        x: FixedRows,
        total: &mut [__m512; ROWS],
    ) {
        let to_signed = _mm512_set1_epi16(32);
        for b in 0..blocks {
            let p = p.add(210 * b);
            for line in (0..210).step_by(64) {
                prefetch_line_ahead_l2(p.add(line));
            }
            let sc = p.add(192) as *const i8;
            // The scales of groups g and g + 1 of 16, over 32 `i16` lanes.
            let pair = |g: usize| {
                _mm512_mask_blend_epi16(
                    0xffff_0000,
                    _mm512_set1_epi16(i16::from(*sc.add(g))),
                    _mm512_set1_epi16(i16::from(*sc.add(g + 1))),
                )
            };
            let mut acc = [[_mm512_setzero_si512(); 2]; ROWS];
            for chunk in 0..4 {
                let (w0, w1) = widen_u8(k6_values(p, chunk));
                let w0 = _mm512_mullo_epi16(_mm512_sub_epi16(w0, to_signed), pair(4 * chunk));
                let w1 = _mm512_mullo_epi16(_mm512_sub_epi16(w1, to_signed), pair(4 * chunk + 2));
                step::<ROWS>(w0, w1, x, b * 256 + 64 * chunk, &mut acc);
            }
            fold::<ROWS>(&acc, half(p.add(208)), x, b, total);
        }
    }

    /// The 64 weights whose stored values are the bytes of `q`, times `scale` (per lane of
    /// the products), with `ROWS` rows of `x` in their 15-bit point from value `at`, into
    /// `acc`.
    #[inline(always)]
    unsafe fn narrow_step<const ROWS: usize>(
        q: __m512i,
        scale: __m512,
        x: FixedRows,
        at: usize,
        acc: &mut [__m512; ROWS],
    ) {
        for (r, acc) in acc.iter_mut().enumerate() {
            let hi = _mm512_loadu_si512(x.hi.add(r * x.kp + at).cast());
            let lo = _mm512_loadu_si512(x.lo.add(r * x.kp + at).cast());
            let t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, hi);
            let t = _mm512_dpbusd_epi32(_mm512_slli_epi32::<7>(t), q, lo);
            let s = _mm512_mul_ps(scale, _mm512_loadu_ps(x.lanes.add((r * x.kp + at) / 4)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, *acc);
        }
    }

    /// [`step`] for the formats with an offset per block of 32: `offset` (per lane) times
    /// each lane's sum of activations is added too.
    #[inline(always)]
    unsafe fn step_offset<const ROWS: usize>(
        q: __m512i,
        scale: __m512,
        offset: __m512,
        x: FixedRows,
        at: usize,
        acc: &mut [__m512; ROWS],
    ) {
        narrow_step::<ROWS>(q, scale, x, at, acc);
        for (r, acc) in acc.iter_mut().enumerate() {
            let spread = _mm512_loadu_ps(x.spread.add((r * x.kp + at) / 4));
            *acc = _mm512_fmadd_ps(offset, spread, *acc);
        }
    }

    /// `blocks` blocks of 32, two at a time from `pair(b, both)` (blocks `b` and `b + 1`, the
    /// second absent if `!both`: it pairs with zeros, and meets the zeros padding the
    /// activations), pairs taking turns between the accumulators.
    #[inline(always)]
    unsafe fn pairs32<const ROWS: usize>(
        blocks: usize,
        x: FixedRows,
        acc0: &mut [__m512; ROWS],
        acc1: &mut [__m512; ROWS],
        pair: impl Fn(usize, bool) -> (__m512i, __m512, __m512),
    ) {
        let mut b = 0;
        while b + 4 <= blocks {
            let (q, d, offset) = pair(b, true);
            step_offset::<ROWS>(q, d, offset, x, 32 * b, acc0);
            let (q, d, offset) = pair(b + 2, true);
            step_offset::<ROWS>(q, d, offset, x, 32 * b + 64, acc1);
            b += 4;
        }
        while b < blocks {
            let (q, d, offset) = pair(b, b + 1 < blocks);
            step_offset::<ROWS>(q, d, offset, x, 32 * b, acc0);
            b += 2;
        }
    }

    /// Row `x` (whole blocks of 32) in the 15-bit point of the 32-value formats: its `hi`,
    /// `lo`, `lanes` and `spread` (see [`Fixed`](super::Fixed)). The slices start at the
    /// row; a zero block leaves them as they are (zeros).
    ///
    /// SAFETY: AVX-512 F/BW/VL/VNNI; each slice holds the row's part.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn fix_row_narrow(
        x: &[f32],
        hi: &mut [i8],
        lo: &mut [u8],
        lanes: &mut [f32],
        spread: &mut [f32],
    ) {
        let low = _mm512_set1_epi32(127);
        for (b, block) in x.chunks_exact(32).enumerate() {
            let v0 = _mm512_loadu_ps(block.as_ptr());
            let v1 = _mm512_loadu_ps(block.as_ptr().add(16));
            let top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            if top == 0.0 {
                continue;
            }
            let s = top / 16383.0;
            let inv = _mm512_set1_ps(16383.0 / top);
            // To nearest (even), at most 16383 in size.
            let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
            let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
            let at = 32 * b;
            for (i, q) in [q0, q1].into_iter().enumerate() {
                let h = _mm512_cvtepi32_epi8(_mm512_srai_epi32::<7>(q));
                let l = _mm512_cvtepi32_epi8(_mm512_and_si512(q, low));
                _mm_storeu_si128(hi.as_mut_ptr().add(at + 16 * i).cast(), h);
                _mm_storeu_si128(lo.as_mut_ptr().add(at + 16 * i).cast(), l);
            }
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * b), _mm256_set1_ps(s));
            // Sums of four: 128 times those of `hi` plus those of `lo`.
            let ones = _mm256_set1_epi8(1);
            let h = _mm256_loadu_si256(hi.as_ptr().add(at).cast());
            let l = _mm256_loadu_si256(lo.as_ptr().add(at).cast());
            let four = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, h);
            let four = _mm256_dpbusd_epi32(_mm256_slli_epi32::<7>(four), ones, l);
            let four = _mm256_mul_ps(_mm256_cvtepi32_ps(four), _mm256_set1_ps(s));
            _mm256_storeu_ps(spread.as_mut_ptr().add(8 * b), four);
        }
    }

    /// Row `x` (whole blocks of 32) in the 14-bit point of the K-quants (see
    /// [`Fixed`](super::Fixed)): its values, its scales and its sums per 32 values. The
    /// slices start at the row; 256 zero values leave them as they are (zeros).
    ///
    /// SAFETY: AVX-512 F/BW/VL; each slice holds the row's part.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn fix_row(x: &[f32], v: &mut [i16], scale: &mut [f32], sums: &mut [f32]) {
        let chunks = x.len().div_ceil(256);
        for (c, scale) in scale.iter_mut().enumerate().take(chunks) {
            let at = 256 * c;
            // Up to sixteen vectors of 16 (an even number: the row is whole blocks).
            let vecs = (x.len() - at).min(256) / 16;
            let load = |i: usize| _mm512_loadu_ps(x.as_ptr().add(at + 16 * i));
            let mut top = _mm512_setzero_ps();
            for i in 0..vecs {
                top = _mm512_max_ps(top, _mm512_abs_ps(load(i)));
            }
            let top = _mm512_reduce_max_ps(top);
            if top == 0.0 {
                continue;
            }
            let s = top / 16383.0;
            let inv = _mm512_set1_ps(16383.0 / top);
            *scale = s;
            let mut pair = 0;
            for i in 0..vecs {
                // To nearest (even), at most 16383 in size.
                let q = _mm512_cvtps_epi32(_mm512_mul_ps(load(i), inv));
                let out = v.as_mut_ptr().add(at + 16 * i);
                _mm256_storeu_si256(out.cast(), _mm512_cvtepi32_epi16(q));
                let sum = _mm512_reduce_add_epi32(q);
                if i % 2 == 0 {
                    pair = sum;
                } else {
                    sums[(at + 16 * i) / 32] = s * (pair + sum) as f32;
                }
            }
        }
    }

    /// Q4_K/Q5_K: the block's 8 six-bit scales `sc` (bytes 0..8) and 8 mins `m` (bytes 8..16).
    ///
    /// The 12 scale bytes `q` hold 8 six-bit scales and 8 six-bit mins (ggml's
    /// `get_scale_min_k4`): the low six bits of `q[0..4]` (scales 0..4) and `q[4..8]` (mins
    /// 0..4), then the nibbles of `q[8..12]` (low: scales 4..8, high: mins 4..8) under the
    /// top two bits of `q[0..4]` (scales) and `q[4..8]` (mins). Two byte shuffles put each
    /// of the 16 numbers' parts in its own byte.
    #[inline(always)]
    unsafe fn k4_numbers(p: *const u8) -> __m128i {
        let q = _mm_loadu_si128(p.add(4).cast());
        // Bytes: q[0..4], q[8..12], q[4..8], q[8..12] (nibbles shifted down for the mins).
        let low = _mm_shuffle_epi8(
            q,
            _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11),
        );
        let low = _mm_blend_epi32::<0b1000>(low, _mm_srli_epi16::<4>(low));
        let keep = _mm_setr_epi8(
            63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15,
        );
        // The top two bits of q[0..4] and q[4..8] as bits 4 and 5 of numbers 4..8 and 12..16.
        let top = _mm_shuffle_epi8(
            q,
            _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7),
        );
        let top = _mm_and_si128(_mm_srli_epi16::<2>(top), _mm_set1_epi8(0x30));
        _mm_or_si128(_mm_and_si128(low, keep), top)
    }

    /// Q4_K/Q5_K: the block's 8 scales `d * sc` (lanes 0..8) and 8 offsets `-(dmin * m)`
    /// (lanes 8..16), for the dequantization.
    #[inline(always)]
    unsafe fn k4_scales(p: *const u8) -> __m512 {
        let numbers = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k4_numbers(p)));
        // `d` in lanes 0..8, `-dmin` in lanes 8..16.
        let dd = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(word(p) as i32)));
        let pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        let d = _mm512_permutexvar_ps(pick, dd);
        let d = _mm512_mask_sub_ps(d, 0xff00, _mm512_setzero_ps(), d);
        _mm512_mul_ps(d, numbers)
    }

    /// Q4_K/Q5_K: [`k4_values`] as two registers of 32 `i16` (groups `2 pair` and `2 pair
    /// + 1`): one widening of the 32 bytes, then their low and high nibbles.
    #[inline(always)]
    unsafe fn k4_words(p: *const u8, five: bool, pair: usize) -> (__m512i, __m512i) {
        let qs = p.add(if five { 48 } else { 16 } + 32 * pair);
        let bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(qs.cast()));
        let mut w0 = _mm512_and_si512(bytes, _mm512_set1_epi16(15));
        let mut w1 = _mm512_srli_epi16::<4>(bytes);
        if five {
            // Bit 2 pair (2 pair + 1) of `qh[e]` is the fifth bit of weight e of the first
            // (second) group.
            let qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(16).cast()));
            let fifth = |bit: usize| {
                let on = _mm512_srlv_epi16(qh, _mm512_set1_epi16(bit as i16));
                _mm512_slli_epi16::<4>(_mm512_and_si512(on, _mm512_set1_epi16(1)))
            };
            w0 = _mm512_or_si512(w0, fifth(2 * pair));
            w1 = _mm512_or_si512(w1, fifth(2 * pair + 1));
        }
        (w0, w1)
    }

    /// Q6_K: the block's 16 scales `d * sc`, for the dequantization.
    #[inline(always)]
    unsafe fn k6_scales(p: *const u8) -> __m512 {
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(192).cast())));
        _mm512_mul_ps(_mm512_set1_ps(half(p.add(208))), sc)
    }

    /// Q4_K/Q5_K: the stored values of weights `64 pair..64 pair + 64` of the block at `p`,
    /// in order. Group 2 pair is the low nibbles of 32 bytes, group 2 pair + 1 their high
    /// nibbles; bit g of `qh[e]` is the fifth bit of weight e of group g.
    #[inline(always)]
    unsafe fn k4_values(p: *const u8, five: bool, pair: usize) -> __m512i {
        let qs = p.add(if five { 48 } else { 16 } + 32 * pair);
        let bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.cast()));
        // Shifts by 0 for the low 32 bytes and by 4 for the high 32 (16-bit lanes).
        let shift = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
        let q = _mm512_and_si512(_mm512_srlv_epi16(bytes, shift), _mm512_set1_epi8(15));
        if !five {
            return q;
        }
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(16).cast()));
        let bits = _mm512_inserti64x4::<1>(
            _mm512_set1_epi8(1 << (2 * pair)),
            _mm256_set1_epi8(2 << (2 * pair)),
        );
        let on = _mm512_test_epi8_mask(qh, bits);
        _mm512_mask_add_epi8(q, on, q, _mm512_set1_epi8(16))
    }

    /// Q6_K: the stored values (0..64, before the subtracted 32) of weights `64 c..64 c +
    /// 64` of the block at `p`, in order. Weight 128 h + 32 part + e has its low four bits
    /// in byte 32 (part % 2) + e of the h-th 64 bytes (the high nibble for parts 2 and 3)
    /// and its top two in bits 2 part of byte 128 + 32 h + e; `c` is 2 h + part / 2.
    #[inline(always)]
    unsafe fn k6_values(p: *const u8, c: usize) -> __m512i {
        let (h, upper) = (c / 2, c % 2);
        let ql = _mm512_loadu_si512(p.add(64 * h).cast());
        let l = if upper == 0 {
            ql
        } else {
            _mm512_srli_epi16::<4>(ql)
        };
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * h).cast()));
        let shift = _mm512_inserti64x4::<1>(
            _mm512_set1_epi16(4 * upper as i16),
            _mm256_set1_epi16(4 * upper as i16 + 2),
        );
        let t = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), _mm512_set1_epi8(3));
        _mm512_or_si512(
            _mm512_and_si512(l, _mm512_set1_epi8(15)),
            _mm512_slli_epi16::<4>(t),
        )
    }

    /// [`dot_row`] for consecutive weight rows of one format (`w`: `results.len()` rows of
    /// `row_bytes`), in one call, so that the kernel is inlined into the loop (a call per
    /// row into a `target_feature` function cannot be): SmolLM2's 576-wide Q5_0 rows took
    /// 0.92-0.93x the time of a call per row at one activation row (`quant_rows.py`).
    ///
    /// SAFETY: as for `dot_row`, for every row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn dot_rows<const ROWS: usize>(
        f: BlockFormat,
        w: &[u8],
        row_bytes: usize,
        x: FixedRows,
        sums: &[f32],
        k: usize,
        coef: &mut [f32],
        results: &mut [[f32; MAX_ROWS]],
    ) {
        for (i, dots) in results.iter_mut().enumerate() {
            let row = w.get_unchecked(i * row_bytes..(i + 1) * row_bytes);
            dot_row::<ROWS>(f, row, x, sums, k, coef, dots);
        }
    }

    /// The portable `dot_row` with integer dot products: see the module docs. `coef` is
    /// scratch of at least `k / 32` values.
    ///
    /// SAFETY: AVX-512 F/BW/VL/VNNI and F16C; `w` is whole blocks of a row of `k`; `x` is
    /// `ROWS` rows of `k` in fixed point; `sums` their `k / group` group sums.
    #[allow(clippy::needless_range_loop)] // `r` indexes the accumulators
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    pub(super) unsafe fn dot_row<const ROWS: usize>(
        f: BlockFormat,
        w: &[u8],
        x: FixedRows,
        sums: &[f32],
        k: usize,
        coef: &mut [f32],
        dots: &mut [f32; MAX_ROWS],
    ) {
        let groups = k / f.group();
        debug_assert!(coef.len() >= k / 32);
        let c = coef.as_mut_ptr();
        let mut total = [_mm512_setzero_ps(); ROWS];
        // The 32-value formats' two accumulators a row, steps taking turns, so that no row
        // waits on one chain.
        let mut acc0 = [_mm512_setzero_ps(); ROWS];
        let mut acc1 = [_mm512_setzero_ps(); ROWS];
        let p = w.as_ptr();
        // Each arm passes its format as a constant, so the loops are built once per format.
        match f {
            BlockFormat::Q4K => k4_blocks::<ROWS>(p, false, k / 256, x, c, &mut total),
            BlockFormat::Q5K => k4_blocks::<ROWS>(p, true, k / 256, x, c, &mut total),
            BlockFormat::Q6K => k6_blocks::<ROWS>(p, k / 256, x, &mut total),
            BlockFormat::Q8_0 => pairs32::<ROWS>(groups, x, &mut acc0, &mut acc1, |b, both| {
                // The `i8` values plus 128.
                let values = |b: usize| {
                    let v = _mm256_loadu_si256(p.add(34 * b + 2).cast());
                    _mm256_xor_si256(v, _mm256_set1_epi8(-128))
                };
                let (q1, d1) = if both {
                    (values(b + 1), half(p.add(34 * (b + 1))))
                } else {
                    (_mm256_setzero_si256(), 0.0)
                };
                let q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(values(b)), q1);
                let d = halves(half(p.add(34 * b)), d1);
                (q, d, _mm512_mul_ps(d, _mm512_set1_ps(-128.0)))
            }),
            BlockFormat::Q5_0 => pairs32::<ROWS>(groups, x, &mut acc0, &mut acc1, |b, both| {
                pair32(BlockFormat::Q5_0, p.add(22 * b), both)
            }),
            BlockFormat::Q5_1 => pairs32::<ROWS>(groups, x, &mut acc0, &mut acc1, |b, both| {
                pair32(BlockFormat::Q5_1, p.add(24 * b), both)
            }),
            BlockFormat::Q4_1 => pairs32::<ROWS>(groups, x, &mut acc0, &mut acc1, |b, both| {
                pair32(BlockFormat::Q4_1, p.add(20 * b), both)
            }),
        }
        for r in 0..ROWS {
            total[r] = _mm512_add_ps(total[r], _mm512_add_ps(acc0[r], acc1[r]));
        }
        // The 32-value formats added their offsets per step; Q6_K's is in its weights.
        let offsets = matches!(f, BlockFormat::Q4K | BlockFormat::Q5K);
        for (r, dot) in dots.iter_mut().enumerate().take(ROWS) {
            let mut sum = total[r];
            // The row's dot of its group sums with `coef`, sixteen groups a vector.
            let row = sums.as_ptr().add(r * groups);
            let mut g = if offsets { 0 } else { groups };
            while g < groups {
                let mask: __mmask16 = if groups - g >= 16 {
                    0xffff
                } else {
                    (1u16 << (groups - g)) - 1
                };
                let cv = _mm512_maskz_loadu_ps(mask, c.add(g));
                let sv = _mm512_maskz_loadu_ps(mask, row.add(g));
                sum = _mm512_fmadd_ps(cv, sv, sum);
                g += 16;
            }
            *dot = _mm512_reduce_add_ps(sum);
        }
    }

    /// Bytes `16 i..16 i + 16` of `q` as i32 lanes, minus `c`.
    #[inline(always)]
    unsafe fn widen(q: __m512i, i: usize, c: i32) -> __m512i {
        let part = match i {
            0 => _mm512_extracti32x4_epi32::<0>(q),
            1 => _mm512_extracti32x4_epi32::<1>(q),
            2 => _mm512_extracti32x4_epi32::<2>(q),
            _ => _mm512_extracti32x4_epi32::<3>(q),
        };
        _mm512_sub_epi32(_mm512_cvtepu8_epi32(part), _mm512_set1_epi32(c))
    }

    /// 16 weights `scale * q`, then `offset` added where the format has one, rounded to
    /// bf16 (to nearest even) at `dst`: the portable dequantization's operations in order.
    #[inline(always)]
    unsafe fn store16(dst: *mut Bf16, q: __m512i, scale: f32, offset: Option<f32>) {
        let mut w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(scale));
        if let Some(o) = offset {
            w = _mm512_add_ps(w, _mm512_set1_ps(o));
        }
        let bf: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(w));
        _mm256_storeu_si256(dst.cast(), bf);
    }

    /// One row's blocks `src` as bf16 into `dst`, bit for bit the portable
    /// `dequantize_row`.
    ///
    /// SAFETY: AVX-512 F/BW/VL/BF16 and F16C; `dst` holds the weights of `src`'s blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
    pub(super) unsafe fn dequantize_row(f: BlockFormat, src: &[u8], dst: &mut [Bf16]) {
        let out = dst.as_mut_ptr();
        for (b, block) in src.chunks_exact(f.bytes()).enumerate() {
            let p = block.as_ptr();
            let o = out.add(b * f.values());
            match f {
                BlockFormat::Q4K | BlockFormat::Q5K => {
                    let mut sm = [0f32; 16];
                    _mm512_storeu_ps(sm.as_mut_ptr(), k4_scales(p));
                    let (s, m) = sm.split_at(8);
                    for pair in 0..4 {
                        let q = k4_values(p, f == BlockFormat::Q5K, pair);
                        for i in 0..4 {
                            let g = 2 * pair + i / 2;
                            store16(o.add(64 * pair + 16 * i), widen(q, i, 0), s[g], Some(m[g]));
                        }
                    }
                }
                BlockFormat::Q6K => {
                    let mut s = [0f32; 16];
                    _mm512_storeu_ps(s.as_mut_ptr(), k6_scales(p));
                    for chunk in 0..4 {
                        let q = k6_values(p, chunk);
                        for i in 0..4 {
                            let g = 4 * chunk + i;
                            store16(o.add(16 * g), widen(q, i, 32), s[g], None);
                        }
                    }
                }
                BlockFormat::Q8_0 => {
                    let d = half(p);
                    for i in 0..2 {
                        let v = _mm_loadu_si128(p.add(2 + 16 * i).cast());
                        store16(o.add(16 * i), _mm512_cvtepi8_epi32(v), d, None);
                    }
                }
                BlockFormat::Q5_0 | BlockFormat::Q5_1 | BlockFormat::Q4_1 => {
                    let (q, d, m) = pair32(f, p, false);
                    let (d, m) = (_mm512_cvtss_f32(d), _mm512_cvtss_f32(m));
                    let (c, offset) = if f == BlockFormat::Q5_0 {
                        (16, None)
                    } else {
                        (0, Some(m))
                    };
                    for i in 0..2 {
                        store16(o.add(16 * i), widen(q, i, c), d, offset);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 33) as u8
            })
            .collect()
    }

    /// Random blocks whose f16 fields are small finite numbers.
    fn blocks(f: BlockFormat, n: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut data = random_bytes(n * f.row_bytes(k), seed);
        let halves: &[usize] = match f {
            BlockFormat::Q4K | BlockFormat::Q5K => &[0, 2],
            BlockFormat::Q6K => &[208],
            BlockFormat::Q5_0 => &[0],
            BlockFormat::Q5_1 | BlockFormat::Q4_1 => &[0, 2],
            BlockFormat::Q8_0 => &[0],
        };
        for (i, block) in data.chunks_exact_mut(f.bytes()).enumerate() {
            for &at in halves {
                let v = F16::from_f32(0.001 + (i % 7) as f32 * 0.0007)
                    .0
                    .to_le_bytes();
                block[at..at + 2].copy_from_slice(&v);
            }
        }
        data
    }

    /// Activations for the tests: bf16 rows of `k` with values of several sizes in each block
    /// of 32, and zero blocks (from value 64 of row 1).
    fn activations(k: usize) -> Vec<f32> {
        (0..MAX_ROWS * k)
            .map(|i| {
                let v =
                    (i as f32 * 0.37).sin() * (1.0 + (i % 5) as f32) * 3f32.powi((i % 7) as i32);
                let zero = i / k == 1 && (64..128).contains(&(i % k));
                Bf16::from_f32(if zero { 0.0 } else { v }).to_f32()
            })
            .collect()
    }

    /// Both fixed-point forms are within half a step of each activation (exact for the zero
    /// values and for the largest of each span that shares a scale), the 15-bit one's low
    /// byte plane is in range, and the group sums are the 14-bit form's values'.
    #[test]
    fn fixed_point_activations_are_within_half_a_step() {
        // Rows of 7 blocks of 32 (less than one chunk of 256), and of 9.
        for k in [224, 288] {
            check_fixed_point(k);
        }
    }

    fn check_fixed_point(k: usize) {
        let x = activations(k);
        let Some(fixed) = Fixed::new(&x, MAX_ROWS, k, true, true) else {
            // Only the AVX-512 path reads fixed point, and only its CPUs make it.
            assert_ne!(Path::detect(), Path::Avx512);
            return;
        };
        let g = 32;
        for (i, &sum) in fixed.sums.iter().enumerate() {
            let (r, at) = (i / (k / g), i % (k / g) * g);
            let value = |j| fixed.value(BlockFormat::Q4K, r, j);
            let want: f32 = (at..at + g).map(value).sum();
            // The f32 sum here rounds by up to g ulps of the sizes it adds, whatever the
            // size of the total.
            let size: f32 = (at..at + g).map(|j| value(j).abs()).sum();
            assert!((sum - want).abs() <= 1e-5 * size.max(1.0), "sum {i} of {g}");
        }
        for f in [BlockFormat::Q4K, BlockFormat::Q5_0] {
            let mut exact = 0;
            for r in 0..MAX_ROWS {
                for j in 0..padded_len(k) {
                    assert!((0..128).contains(&fixed.lo[r * fixed.kp + j]));
                    let v = if j < k { x[r * k + j] } else { 0.0 };
                    let top = span_top(f, &x[r * k..(r + 1) * k], j);
                    let got = fixed.value(f, r, j);
                    assert!(
                        (got - v).abs() <= top / 16383.0 * 0.5001,
                        "{f:?} row {r} value {j}: {got} for {v}"
                    );
                    if v.abs() == top {
                        assert_eq!(got, v, "the largest of a span is kept exactly");
                        exact += 1;
                    }
                }
            }
            let spans = if f == BlockFormat::Q4K {
                k.div_ceil(256)
            } else {
                k / 32
            };
            assert!(exact >= MAX_ROWS * spans, "{f:?}");
        }
    }

    /// The largest size among the values of `row` that share value `j`'s scale in the fixed
    /// point of format `f`: its 256 (K-quants) or its block of 32.
    fn span_top(f: BlockFormat, row: &[f32], j: usize) -> f32 {
        let span = if f.values() == 256 { 256 } else { 32 };
        let at = (j / span * span).min(row.len());
        row[at..(at + span).min(row.len())]
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
    }

    /// Every build of the dot this CPU runs (portable, AVX2, AVX-512 VNNI) equals the dot
    /// with the dequantized weights up to f32 summation, for one to four activation rows
    /// (to eight for the AVX-512 K-quant kernel):
    /// of the activations themselves, and for the AVX-512 path of their fixed point, which
    /// is within half a step of them.
    #[test]
    fn every_dot_path_agrees_with_the_weights() {
        let mut paths = vec![Path::Portable];
        if avx2_available() {
            paths.push(Path::Avx2);
        }
        if Path::detect() == Path::Avx512 {
            paths.push(Path::Avx512);
        }
        // Five blocks: an odd count (the 32-value formats take blocks in pairs) and group
        // counts that leave a partial vector of 16 (40 and 80 for the K-quants); nine: a
        // pair of blocks of 32 that starts the second 256 activations' scale, unpaired.
        for (f, k) in BlockFormat::ALL.into_iter().flat_map(|f| {
            [
                (f, 3 * f.values().max(64)),
                (f, 5 * f.values()),
                (f, 9 * f.values()),
            ]
        }) {
            let n = 3;
            let data = blocks(f, n, k, 7);
            let m = Blocks::new(f, n, &data);
            let xs = activations(k);
            let fixed = Fixed::new(&xs, MAX_ROWS, k, true, true);
            for row in 0..n {
                let w = &data[row * f.row_bytes(k)..(row + 1) * f.row_bytes(k)];
                for count in 1..=MAX_ROWS {
                    for &path in &paths {
                        // Passes of more than PASS_ROWS: the AVX-512 K-quant kernel only.
                        if count > PASS_ROWS && (path != Path::Avx512 || f.values() != 256) {
                            continue;
                        }
                        let sums: Vec<f32> = if path == Path::Avx512 {
                            // Only Q4_K's and Q5_K's offsets (groups of 32) read them.
                            if f.group() == 32 {
                                fixed.as_ref().unwrap().sums.clone()
                            } else {
                                Vec::new()
                            }
                        } else {
                            xs.chunks_exact(f.group()).map(|c| c.iter().sum()).collect()
                        };
                        let mut got = [f32::NAN; MAX_ROWS];
                        let mut coef = vec![f32::NAN; k / 16];
                        let xq = fixed.as_ref().map(|fixed| (fixed, 0));
                        dot_row(f, w, &xs, xq, &sums, count, k, path, &mut coef, &mut got);
                        for (r, &got) in got.iter().enumerate().take(count) {
                            let (mut exact, mut size, mut step) = (0f64, 0f64, 0f64);
                            for j in 0..k {
                                let wj = f64::from(m.weight(row, j, k));
                                let x = if path == Path::Avx512 {
                                    let top = span_top(f, &xs[r * k..(r + 1) * k], j);
                                    step += wj.abs() * f64::from(top) / 16383.0 * 0.5;
                                    fixed.as_ref().unwrap().value(f, r, j)
                                } else {
                                    xs[r * k + j]
                                };
                                let t = wj * f64::from(x);
                                exact += t;
                                size += t.abs();
                            }
                            let err = (f64::from(got) - exact).abs();
                            assert!(
                                err <= 1e-5 * size + 1e-6,
                                "{f:?} {path:?} row {row} of {count}: {got} vs {exact}"
                            );
                            let plain: f64 = (0..k)
                                .map(|j| f64::from(m.weight(row, j, k)) * f64::from(xs[r * k + j]))
                                .sum();
                            assert!(
                                (f64::from(got) - plain).abs() <= 1e-5 * size + step + 1e-6,
                                "{f:?} {path:?} row {row} of {count}: {got} vs {plain}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Stacked matrices (two K-quants' row ranges, with and without a 32-value format's)
    /// multiplied with 1 to 11 activation rows, on two threads: every row's output is bit
    /// for bit the output it gets alone, whichever pass serves it (on the AVX-512 path the
    /// K-quants alone take 5 to 7 rows in one pass). A speculative step's verification
    /// rows rely on this.
    #[test]
    fn gemv_rows_do_not_depend_on_the_rows_beside_them() {
        let k = 512;
        let all = [
            (BlockFormat::Q4K, 70),
            (BlockFormat::Q6K, 66),
            (BlockFormat::Q5_0, 67),
        ];
        for formats in [&all[..2], &all[..]] {
            check_rows_alone(formats, k);
        }
    }

    fn check_rows_alone(formats: &[(BlockFormat, usize)], k: usize) {
        use crate::attention::ScopedThreads;
        let data: Vec<Vec<u8>> = formats
            .iter()
            .enumerate()
            .map(|(i, &(f, n))| blocks(f, n, k, 20 + i as u64))
            .collect();
        let segments: Vec<Segment<'_>> = formats
            .iter()
            .zip(&data)
            .map(|(&(format, rows), data)| Segment { format, rows, data })
            .collect();
        let n: usize = formats.iter().map(|&(_, rows)| rows).sum();
        let rows = 11;
        let x: Vec<Bf16> = (0..rows * k)
            .map(|i| Bf16::from_f32(((i as f32) * 0.61).sin() * (1.0 + (i % 3) as f32)))
            .collect();
        let run = |x: &[Bf16], count: usize| {
            let weight = Blocks::stacked(&segments).unwrap();
            let mut out = vec![Bf16(0); count * n];
            gemv_blocks(&mut out, x, weight, None, count, n, k, 2, &ScopedThreads).unwrap();
            out
        };
        let alone: Vec<Vec<Bf16>> = (0..rows).map(|r| run(&x[r * k..(r + 1) * k], 1)).collect();
        for count in 1..=rows {
            let out = run(&x[..count * k], count);
            for (r, want) in alone.iter().enumerate().take(count) {
                assert_eq!(
                    &out[r * n..(r + 1) * n],
                    &want[..],
                    "{formats:?}: row {r} of {count}"
                );
            }
        }
    }

    /// The AVX2 and AVX-512 dequantizations give the portable one's bits.
    #[test]
    fn dequantization_paths_agree() {
        for f in BlockFormat::ALL {
            let k = 2 * f.values();
            let data = blocks(f, 1, k, 11);
            let mut u = Unpacked::new();
            let mut plain = vec![Bf16(0); k];
            dequantize_row(f, &data, &mut plain, &mut u);
            let m = Blocks::new(f, 1, &data);
            for (j, p) in plain.iter().enumerate() {
                assert_eq!(*p, Bf16::from_f32(m.weight(0, j, k)), "{f:?} weight {j}");
            }
            #[cfg(target_arch = "x86_64")]
            if avx2_available() {
                let mut fast = vec![Bf16(0); k];
                // SAFETY: AVX2 and FMA detected.
                unsafe { avx2::dequantize_row(f, &data, &mut fast, &mut u) };
                assert_eq!(plain, fast, "{f:?}");
            }
            #[cfg(target_arch = "x86_64")]
            if Path::detect() == Path::Avx512 {
                let mut fast = vec![Bf16(0); k];
                // SAFETY: the AVX-512 path's features detected.
                unsafe { avx512::dequantize_row(f, &data, &mut fast) };
                assert_eq!(plain, fast, "{f:?}");
            }
        }
    }
}
