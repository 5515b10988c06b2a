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
//! up to the order and rounding of the additions.

use crate::attention::{KernelError, Parallel};
use crate::element::{Bf16, Element, F16};
use crate::prefetch::prefetch_ahead;
use crate::quant::MAX_ROWS;

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

    /// Row `row`'s format and bytes (a row of `k` weights).
    #[inline]
    fn row(&self, row: usize, k: usize) -> (BlockFormat, &'a [u8]) {
        let mut first = 0;
        for s in self.segments() {
            if row < first + s.rows {
                let bytes = s.format.row_bytes(k);
                let at = (row - first) * bytes;
                return (s.format, &s.data[at..at + bytes]);
            }
            first += s.rows;
        }
        panic!("row {row} past the matrix's {first}");
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
/// [`MAX_ROWS`] activation rows take one pass over the weights.
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
    let kp = interleaved_len(k);
    let xi = if path == Path::Avx512Bf16 {
        interleave(x, rows, k)
    } else {
        Vec::new()
    };
    // Per-group sums of each activation row, for groups of 16 and of 32.
    let sums16: Vec<f32> = xf.chunks_exact(16).map(|c| c.iter().sum()).collect();
    let sums32: Vec<f32> = xf.chunks_exact(32).map(|c| c.iter().sum()).collect();
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
                let take = (rows - first).min(MAX_ROWS);
                let xs = &xf[first * k..(first + take) * k];
                let xb = xi.get(first * kp..(first + take) * kp).unwrap_or(&[]);
                results.clear();
                results.resize(end - chunk, [0.0; MAX_ROWS]);
                for (i, row) in (chunk..end).enumerate() {
                    let (f, w) = weight.row(row, k);
                    let (sums, groups) = if f.group() == 16 {
                        (&sums16, k / 16)
                    } else {
                        (&sums32, k / 32)
                    };
                    let ss = &sums[first * groups..(first + take) * groups];
                    dot_row(f, w, xs, xb, ss, take, k, path, &mut coef, &mut results[i]);
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
                Path::Avx512Bf16 => unsafe { avx512::dequantize_row(f, src, dst) },
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
    /// AVX-512 with its bf16 dot products (`vdpbf16ps`).
    Avx512Bf16,
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
                && has!("f16c")
            {
                return Path::Avx512Bf16;
            }
        }
        if avx2_available() {
            Path::Avx2
        } else {
            Path::Portable
        }
    }
}

/// `dots[r]` = activation row `r`'s dot with the weight row `w` (its blocks), for the
/// `count` rows of `xs` (`[count, k]` f32; `xb` the same rows in bf16 in [`interleave`]'s
/// order, which only the AVX-512 path reads; `sums` their per-group sums).
#[allow(clippy::too_many_arguments)]
fn dot_row(
    f: BlockFormat,
    w: &[u8],
    xs: &[f32],
    xb: &[Bf16],
    sums: &[f32],
    count: usize,
    k: usize,
    path: Path,
    coef: &mut [f32],
    dots: &mut [f32; MAX_ROWS],
) {
    prefetch_ahead(w.as_ptr(), w.len());
    #[cfg(target_arch = "x86_64")]
    match path {
        // SAFETY: the path's features were detected; the caller checked the shapes.
        Path::Avx512Bf16 => unsafe {
            match count {
                1 => avx512::dot_row::<1>(f, w, xs, xb, sums, k, coef, dots),
                2 => avx512::dot_row::<2>(f, w, xs, xb, sums, k, coef, dots),
                3 => avx512::dot_row::<3>(f, w, xs, xb, sums, k, coef, dots),
                _ => avx512::dot_row::<4>(f, w, xs, xb, sums, k, coef, dots),
            }
            return;
        },
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
    let _ = (path, xb, coef);
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

/// The activations in the order the AVX-512 GEMV reads them: each row padded with zeros to
/// a multiple of 64 ([`interleaved_len`]), and each 64 values `v` stored as `v[0..8]`,
/// `v[16..24]`, `v[32..40]`, `v[48..56]`, then `v[8..16]`, `v[24..32]`, `v[40..48]`,
/// `v[56..64]`: the order in which two byte unpacks (`vpunpcklbw`, `vpunpckhbw`, which
/// work within 16-byte lanes) lay out 64 weights stored in their natural order.
fn interleave(x: &[Bf16], rows: usize, k: usize) -> Vec<Bf16> {
    let kp = interleaved_len(k);
    let mut out = vec![Bf16(0); rows * kp];
    for (src, dst) in x.chunks_exact(k).zip(out.chunks_exact_mut(kp)) {
        // Runs of 8: run `16 lane + 8 half` of a chunk goes to `32 half + 8 lane`.
        for (run, values) in src.chunks(8).enumerate() {
            let (chunk, lane, half) = (run / 8, run % 8 / 2, run % 2);
            let at = chunk * 64 + 32 * half + 8 * lane;
            dst[at..at + values.len()].copy_from_slice(values);
        }
    }
    out
}

/// A row's length in [`interleave`]'s order.
fn interleaved_len(k: usize) -> usize {
    k.div_ceil(64) * 64
}

/// The GEMV with bf16 dot products, 64 weights a step: their stored values (bytes of
/// 0..128: every format's 4, 5 or 6 bits before its own offset) are put in one register in
/// their natural order, and two byte unpacks against the byte 0x43 make 64 bf16 numbers
/// `128 + q` of them (0x4300 is 128.0; the value fills the mantissa), in the order of
/// [`interleave`]. Two `vdpbf16ps` take the 64 products with a row, and one FMA scales
/// them: lanes 0..8 of the products hold the first 32 weights, lanes 8..16 the last 32 (in
/// four lanes a group for Q6_K's groups of 16).
///
/// A row at its end adds the dot of its group sums with each group's `offset - scale *
/// (128 + c)` (`c` the format's own subtrahend: 32 for Q6_K, 16 for Q5_0), collected per
/// group in `coef`. Products of two bf16 numbers are exact in f32: only the sums are
/// rounded. Q8_0 takes f32 FMAs instead (its `i8` values do not fit in the mantissa).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{interleaved_len, BlockFormat, MAX_ROWS};
    use crate::element::Bf16;

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

    /// Eight bytes (low byte first) as eight f32.
    #[inline(always)]
    unsafe fn bytes8(v: u64) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)))
    }

    /// `[a; 8]` then `[b; 8]`.
    #[inline(always)]
    unsafe fn halves(a: f32, b: f32) -> __m512 {
        _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(a), _mm512_set1_ps(b))
    }

    /// The 64 weights whose stored values are the bytes of `q`, times `scale` (per lane of
    /// the products), with `ROWS` activation rows (interleaved, `kp` apart) from element
    /// `at`, into `acc`.
    #[inline(always)]
    unsafe fn step<const ROWS: usize>(
        q: __m512i,
        scale: __m512,
        x: *const Bf16,
        kp: usize,
        at: usize,
        acc: &mut [__m512; ROWS],
    ) {
        let top = _mm512_set1_epi8(0x43);
        let w0: __m512bh = std::mem::transmute(_mm512_unpacklo_epi8(q, top));
        let w1: __m512bh = std::mem::transmute(_mm512_unpackhi_epi8(q, top));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xr = x.add(r * kp + at);
            let x0: __m512bh = std::mem::transmute(_mm512_loadu_si512(xr.cast()));
            let x1: __m512bh = std::mem::transmute(_mm512_loadu_si512(xr.add(32).cast()));
            let s = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w0, x0), w1, x1);
            *acc = _mm512_fmadd_ps(s, scale, *acc);
        }
    }

    /// Q4_K/Q5_K: the block's 8 scales `d * sc` and 8 offsets `-(dmin * m)`.
    ///
    /// The 12 scale bytes hold 8 six-bit scales and 8 six-bit mins (ggml's
    /// `get_scale_min_k4`, four at a time here): the low six bits of bytes 0..4 (scales) and
    /// 4..8 (mins), then the nibbles of bytes 8..12 under the top two bits of bytes 0..4
    /// (scales) and 4..8 (mins).
    #[inline(always)]
    unsafe fn k4_scales(p: *const u8) -> (__m256, __m256) {
        let (d, dmin) = (half(p), half(p.add(2)));
        let (w0, w1, w2) = (word(p.add(4)), word(p.add(8)), word(p.add(12)));
        let six = 0x3f3f_3f3f;
        let (nib, top) = (0x0f0f_0f0f, 0x0303_0303);
        let sc_hi = (w2 & nib) | (((w0 >> 6) & top) << 4);
        let m_hi = ((w2 >> 4) & nib) | (((w1 >> 6) & top) << 4);
        let sc = u64::from(w0 & six) | (u64::from(sc_hi) << 32);
        let m = u64::from(w1 & six) | (u64::from(m_hi) << 32);
        (
            _mm256_mul_ps(_mm256_set1_ps(d), bytes8(sc)),
            _mm256_mul_ps(_mm256_set1_ps(-dmin), bytes8(m)),
        )
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

    /// Q6_K: the block's 16 scales `d * sc`.
    #[inline(always)]
    unsafe fn k6_scales(p: *const u8) -> __m512 {
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(192).cast())));
        _mm512_mul_ps(_mm512_set1_ps(half(p.add(208))), sc)
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

    /// The 32 stored values of a Q5_0, Q5_1 or Q4_1 block at `p` (bytes in weight order),
    /// its scale `d` and its `m` (0 for Q5_0).
    #[inline(always)]
    unsafe fn block32(f: BlockFormat, p: *const u8) -> (__m256i, f32, f32) {
        let d = half(p);
        let (m, qs) = match f {
            BlockFormat::Q5_0 => (0.0, p.add(6)),
            BlockFormat::Q5_1 => (half(p.add(2)), p.add(8)),
            _ => (half(p.add(2)), p.add(4)),
        };
        let bytes = _mm_loadu_si128(qs.cast());
        let low = _mm_set1_epi8(15);
        let mut q = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16::<4>(bytes), low),
            _mm_and_si128(bytes, low),
        );
        if f != BlockFormat::Q4_1 {
            // Bit e of the u32 before the nibbles is weight e's fifth bit.
            q = _mm256_mask_add_epi8(q, word(qs.sub(4)), q, _mm256_set1_epi8(16));
        }
        (q, d, m)
    }

    /// The portable `dot_row` with bf16 dot products: see the module docs. `coef` is
    /// scratch of at least `k / group` values.
    ///
    /// SAFETY: AVX-512 F/BW/VL/BF16 and F16C; `w` is whole blocks of a row of `k`; `xs` is
    /// `ROWS` rows of `k` in f32, `xi` the same rows in bf16 in [`super::interleave`]'s
    /// order; `sums` their `k / group` group sums.
    #[allow(clippy::needless_range_loop)] // `r` indexes the accumulators, `dots` and `sums`
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
    pub(super) unsafe fn dot_row<const ROWS: usize>(
        f: BlockFormat,
        w: &[u8],
        xs: &[f32],
        xi: &[Bf16],
        sums: &[f32],
        k: usize,
        coef: &mut [f32],
        dots: &mut [f32; MAX_ROWS],
    ) {
        let groups = k / f.group();
        debug_assert!(coef.len() >= groups);
        let kp = interleaved_len(k);
        let x = xi.as_ptr();
        let c = coef.as_mut_ptr();
        // Two accumulators a row, steps taking turns, so that no row waits on one chain.
        let mut acc0 = [_mm512_setzero_ps(); ROWS];
        let mut acc1 = [_mm512_setzero_ps(); ROWS];
        match f {
            BlockFormat::Q4K | BlockFormat::Q5K => {
                let five = f == BlockFormat::Q5K;
                // Scale lanes of pair p: eight of group 2 p, then eight of group 2 p + 1.
                let pair_lanes: [__m512i; 4] = std::array::from_fn(|p| {
                    let (a, b) = (2 * p as i32, 2 * p as i32 + 1);
                    _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a)
                });
                for (b, block) in w.chunks_exact(f.bytes()).enumerate() {
                    let p = block.as_ptr();
                    let (scale, offset) = k4_scales(p);
                    _mm256_storeu_ps(
                        c.add(8 * b),
                        _mm256_fmadd_ps(scale, _mm256_set1_ps(-128.0), offset),
                    );
                    let scale = _mm512_castps256_ps512(scale);
                    for (pair, &lanes) in pair_lanes.iter().enumerate() {
                        let q = k4_values(p, five, pair);
                        let scale = _mm512_permutexvar_ps(lanes, scale);
                        let acc = if pair % 2 == 0 { &mut acc0 } else { &mut acc1 };
                        step::<ROWS>(q, scale, x, kp, b * 256 + 64 * pair, acc);
                    }
                }
            }
            BlockFormat::Q6K => {
                for (b, block) in w.chunks_exact(f.bytes()).enumerate() {
                    let p = block.as_ptr();
                    let scale = k6_scales(p);
                    _mm512_storeu_ps(c.add(16 * b), _mm512_mul_ps(scale, _mm512_set1_ps(-160.0)));
                    for chunk in 0..4 {
                        let q = k6_values(p, chunk);
                        // Groups j..j + 4 of 16, four lanes each.
                        let j = 4 * chunk as i32;
                        let lanes = _mm512_set_epi32(
                            j + 3,
                            j + 3,
                            j + 3,
                            j + 3,
                            j + 2,
                            j + 2,
                            j + 2,
                            j + 2,
                            j + 1,
                            j + 1,
                            j + 1,
                            j + 1,
                            j,
                            j,
                            j,
                            j,
                        );
                        let s = _mm512_permutexvar_ps(lanes, scale);
                        let acc = if chunk % 2 == 0 { &mut acc0 } else { &mut acc1 };
                        step::<ROWS>(q, s, x, kp, b * 256 + 64 * chunk, acc);
                    }
                }
            }
            BlockFormat::Q8_0 => {
                // `i8` values widened to f32 against the f32 rows.
                let xf = xs.as_ptr();
                for (b, block) in w.chunks_exact(f.bytes()).enumerate() {
                    let p = block.as_ptr();
                    let d = _mm512_set1_ps(half(p));
                    let v = _mm256_loadu_si256(p.add(2).cast());
                    let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
                    let hi =
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256::<1>(v)));
                    let acc = if b % 2 == 0 { &mut acc0 } else { &mut acc1 };
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let at = xf.add(r * k + 32 * b);
                        let t = _mm512_mul_ps(lo, _mm512_loadu_ps(at));
                        let t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(at.add(16)), t);
                        *acc = _mm512_fmadd_ps(t, d, *acc);
                    }
                }
            }
            BlockFormat::Q5_0 | BlockFormat::Q5_1 | BlockFormat::Q4_1 => {
                let size = f.bytes();
                let p = w.as_ptr();
                let blocks = groups;
                let mut b = 0;
                while b < blocks {
                    // Two blocks are 64 weights in order; a last odd block pairs with zeros
                    // (and meets the zeros padding its activations).
                    let coef = |d: f32, m: f32| {
                        if f == BlockFormat::Q5_0 {
                            -144.0 * d
                        } else {
                            m - 128.0 * d
                        }
                    };
                    let (q0, d0, m0) = block32(f, p.add(b * size));
                    let (q1, d1, m1) = if b + 1 < blocks {
                        block32(f, p.add((b + 1) * size))
                    } else {
                        (_mm256_setzero_si256(), 0.0, 0.0)
                    };
                    *c.add(b) = coef(d0, m0);
                    if b + 1 < blocks {
                        *c.add(b + 1) = coef(d1, m1);
                    }
                    let q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q0), q1);
                    let acc = if b % 4 == 0 { &mut acc0 } else { &mut acc1 };
                    step::<ROWS>(q, halves(d0, d1), x, kp, 32 * b, acc);
                    b += 2;
                }
            }
        }
        let shifted = f != BlockFormat::Q8_0;
        for r in 0..ROWS {
            let mut total = _mm512_add_ps(acc0[r], acc1[r]);
            if shifted {
                // The row's dot of its group sums with `coef`, sixteen groups a vector.
                let row = sums.as_ptr().add(r * groups);
                let mut g = 0;
                while g < groups {
                    let mask: __mmask16 = if groups - g >= 16 {
                        0xffff
                    } else {
                        (1u16 << (groups - g)) - 1
                    };
                    let cv = _mm512_maskz_loadu_ps(mask, c.add(g));
                    let sv = _mm512_maskz_loadu_ps(mask, row.add(g));
                    total = _mm512_fmadd_ps(cv, sv, total);
                    g += 16;
                }
            }
            dots[r] = _mm512_reduce_add_ps(total);
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
                    let (scale, offset) = k4_scales(p);
                    let (mut s, mut m) = ([0f32; 8], [0f32; 8]);
                    _mm256_storeu_ps(s.as_mut_ptr(), scale);
                    _mm256_storeu_ps(m.as_mut_ptr(), offset);
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
                    let (q, d, m) = block32(f, p);
                    let q = _mm512_castsi256_si512(q);
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

    /// Every build of the dot this CPU runs (portable, AVX2, AVX-512 BF16) equals the dot
    /// with the dequantized weights up to f32 summation, for one to four activation rows.
    #[test]
    fn every_dot_path_agrees_with_the_weights() {
        let mut paths = vec![Path::Portable];
        if avx2_available() {
            paths.push(Path::Avx2);
        }
        if Path::detect() == Path::Avx512Bf16 {
            paths.push(Path::Avx512Bf16);
        }
        // Five blocks: an odd count (the 32-value formats take blocks in pairs) and group
        // counts that leave a partial vector of 16 (40 and 80 for the K-quants).
        for (f, k) in BlockFormat::ALL
            .into_iter()
            .flat_map(|f| [(f, 3 * f.values().max(64)), (f, 5 * f.values())])
        {
            let n = 3;
            let data = blocks(f, n, k, 7);
            let m = Blocks::new(f, n, &data);
            let xb: Vec<Bf16> = (0..MAX_ROWS * k)
                .map(|i| Bf16::from_f32((i as f32 * 0.37).sin() * (1.0 + (i % 5) as f32)))
                .collect();
            let xs: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
            let sums: Vec<f32> = xs.chunks_exact(f.group()).map(|c| c.iter().sum()).collect();
            let xi = interleave(&xb, MAX_ROWS, k);
            for row in 0..n {
                let w = &data[row * f.row_bytes(k)..(row + 1) * f.row_bytes(k)];
                for count in 1..=MAX_ROWS {
                    for &path in &paths {
                        let mut got = [f32::NAN; MAX_ROWS];
                        let mut coef = vec![f32::NAN; k / 16];
                        dot_row(f, w, &xs, &xi, &sums, count, k, path, &mut coef, &mut got);
                        for (r, &got) in got.iter().enumerate().take(count) {
                            let (mut exact, mut size) = (0f64, 0f64);
                            for j in 0..k {
                                let t = f64::from(m.weight(row, j, k)) * f64::from(xs[r * k + j]);
                                exact += t;
                                size += t.abs();
                            }
                            let err = (f64::from(got) - exact).abs();
                            assert!(
                                err <= 1e-5 * size + 1e-6,
                                "{f:?} {path:?} row {row} of {count}: {got} vs {exact}"
                            );
                        }
                    }
                }
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
            if Path::detect() == Path::Avx512Bf16 {
                let mut fast = vec![Bf16(0); k];
                // SAFETY: the AVX-512 path's features detected.
                unsafe { avx512::dequantize_row(f, &data, &mut fast) };
                assert_eq!(plain, fast, "{f:?}");
            }
        }
    }
}
