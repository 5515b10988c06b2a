//! Weight-only quantized matrix-vector products: `y = W x (+ b)` for a few bf16 activation
//! rows against a matrix kept in 4-bit or 8-bit blocks of 32 weights, read as they are.
//!
//! At batch 1 a decoder is bound by the weight bytes it reads per token; 4-bit blocks are a
//! quarter of bf16's. Every weight is used as its bf16 rounding (`scale * q + min` computed
//! in f32, a multiply then an add, rounded to the nearest bf16): the weights
//! [`dequantize_bf16`] writes for the dense path of larger batches, so a matrix gives the
//! same products whichever path a step takes. The activations stay bf16 and every sum is
//! f32: the result is the dot product with those weights, up to the order of the additions.
//!
//! Layouts (a row of `k` weights is `k / 32` blocks; `n` rows, row-major):
//! - **Q4** (GGUF Q4_0 and Q4_1, and `int4` with a scale and a zero point per group of 32):
//!   weight `j` of block `b` is `scale[b] * q + min[b]` with `q` in `0..16`. `scale` and
//!   `min` are `[n, k / 32]` f16 (GGUF's own precision); `packed` is `[n, k / 2]` bytes,
//!   where each 32-byte group holds the nibbles of two neighbouring blocks (see
//!   [`q4_nibble`]; `k` must be a multiple of 64).
//! - **Q8** (GGUF Q8_0): weight `j` of block `b` is `scale[b] * q_j`, `q` an `i8`; `quants`
//!   is `[n, k]` i8 and `scale` `[n, k / 32]` f16.
//!
//! The AVX-512 paths dequantize each block once into bf16 weights and take 32 products a
//! block in one `vdpbf16ps` per activation row, straight into the row's accumulators, so a
//! block's scale is applied once however many rows share the pass (each extra row of a
//! speculative step costs one instruction per 32 weights). Q4 builds a pair of blocks'
//! table of 32 possible weights and picks from it by nibble (`vpermw`). Products of two
//! bf16 numbers are exact in f32, so nothing is rounded but the weights and the sums.
//! Without AVX-512 BF16, Q8 runs f32 FMAs on the same rounded weights widened to f32.
//!
//! Up to [`MAX_ROWS`] activation rows share one pass over the weights, and every row is
//! computed the same way whatever the number of rows beside it (the same operations in the
//! same order): a speculative step's verification rows give what one-row decode steps give.

use crate::attention::{KernelError, Parallel};
use crate::element::{Bf16, Element, F16};
use crate::kquant::{dequantize_blocks, gemv_blocks, Blocks};

/// Weights per quantization block.
pub const QBLOCK: usize = 32;
/// Most activation rows one pass over the weights serves.
pub const MAX_ROWS: usize = 8;
/// Output rows per part below which a call is not split.
const MIN_ROWS_PER_PART: usize = 64;

/// A Q4 matrix: see the module docs.
#[derive(Clone, Copy)]
pub struct Q4<'a> {
    pub packed: &'a [u8],
    pub scale: &'a [F16],
    pub min: &'a [F16],
}

/// A Q8 matrix: see the module docs.
#[derive(Clone, Copy)]
pub struct Q8<'a> {
    pub quants: &'a [i8],
    pub scale: &'a [F16],
}

/// A quantized layout: the two above, or GGUF blocks read as the file has them
/// (K-quants, Q5_0, Q5_1: `crate::kquant`).
#[derive(Clone, Copy)]
pub enum QMatrix<'a> {
    Q4(Q4<'a>),
    Q8(Q8<'a>),
    Blocks(Blocks<'a>),
}

impl QMatrix<'_> {
    fn check(&self, n: usize, k: usize) -> Result<(), KernelError> {
        let blocks = n * (k / QBLOCK);
        let ok = match self {
            QMatrix::Q4(m) => {
                k.is_multiple_of(2 * QBLOCK)
                    && m.packed.len() == n * k / 2
                    && m.scale.len() == blocks
                    && m.min.len() == blocks
            }
            QMatrix::Q8(m) => {
                k.is_multiple_of(QBLOCK) && m.quants.len() == n * k && m.scale.len() == blocks
            }
            QMatrix::Blocks(m) => m.fits(n, k),
        };
        if ok && k > 0 {
            Ok(())
        } else {
            Err(KernelError(format!(
                "quantized matrix does not hold {n} x {k} weights (k a multiple of 64 for Q4, \
                 of 32 for Q8)"
            )))
        }
    }

    /// Weight `j` of row `row`, dequantized (the reference the kernels agree with).
    pub fn weight(&self, row: usize, j: usize, k: usize) -> f32 {
        let b = row * (k / QBLOCK) + j / QBLOCK;
        match self {
            QMatrix::Q4(m) => {
                let (at, high) = q4_nibble(j, k);
                let byte = m.packed[row * k / 2 + at];
                let q = if high { byte >> 4 } else { byte & 15 };
                m.scale[b].to_f32() * f32::from(q) + m.min[b].to_f32()
            }
            QMatrix::Q8(m) => m.scale[b].to_f32() * f32::from(m.quants[row * k + j]),
            QMatrix::Blocks(m) => m.weight(row, j, k),
        }
    }
}

/// Where weight `j` (of `k`) of a Q4 row lives: (byte within the row, high nibble?).
///
/// Blocks go by pairs into 32 bytes: element `e` of either block at byte `e` of the pair,
/// the first block in the low nibble, the second in the high one. (A layout that lets
/// byte interleaves unpack four blocks at once measured the same: per-row work and memory,
/// not unpacking, bound the kernel.)
pub fn q4_nibble(j: usize, k: usize) -> (usize, bool) {
    let _ = k;
    let block = j / QBLOCK;
    ((block / 2) * QBLOCK + j % QBLOCK, block % 2 == 1)
}

/// `out[r][i] = sum_j x[r][j] * W[i][j] (+ bias[i])` for `r` in `0..rows` (any number:
/// every [`MAX_ROWS`] rows take one pass over the weights). `x` is `[rows, k]` bf16,
/// `out` `[rows, n]` bf16, rounded once from the f32 sum.
#[allow(clippy::too_many_arguments)]
pub fn gemv_quant(
    out: &mut [Bf16],
    x: &[Bf16],
    weight: QMatrix<'_>,
    bias: Option<&[Bf16]>,
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    if let QMatrix::Blocks(m) = weight {
        return gemv_blocks(out, x, m, bias, rows, n, k, threads, parallel);
    }
    weight.check(n, k)?;
    if rows == 0
        || x.len() != rows * k
        || out.len() != rows * n
        || bias.is_some_and(|b| b.len() != n)
    {
        return Err(KernelError(format!(
            "gemv_quant: x {} / out {} elements for {rows} rows of {k} by {n}",
            x.len(),
            out.len()
        )));
    }
    let simd = simd_available(&weight);
    let blocks = k / QBLOCK;
    // Per activation row: an f32 copy (the portable path and the f32 Q8 path read it).
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let parts = (n / MIN_ROWS_PER_PART).clamp(1, threads.max(1));
    let out_addr = out.as_mut_ptr() as usize;
    let task = |part: usize| {
        let (lo, hi) = (n * part / parts, n * (part + 1) / parts);
        let mut scales = RowScales::new(blocks);
        let mut results = Vec::with_capacity(CHUNK_ROWS);
        // Chunks of rows: their scales widened in one go, their weights still in cache for
        // the next pass when there are more activation rows than one pass serves.
        for chunk in (lo..hi).step_by(CHUNK_ROWS) {
            let end = (chunk + CHUNK_ROWS).min(hi);
            scales.load(&weight, chunk..end, simd);
            let mut first = 0;
            while first < rows {
                let take = (rows - first).min(MAX_ROWS);
                let xs = Rows {
                    bf16: &x[first * k..(first + take) * k],
                    f32: &xf[first * k..(first + take) * k],
                    count: take,
                };
                dot_chunk(&weight, chunk..end, k, &xs, &scales, simd, &mut results);
                for r in 0..take {
                    // SAFETY: parts own disjoint column ranges [lo, hi) of each output
                    // row, and `out` (rows * n elements) outlives the call.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(
                            (out_addr as *mut Bf16).add((first + r) * n + chunk),
                            end - chunk,
                        )
                    };
                    match bias {
                        Some(bias) => {
                            for ((d, dots), b) in
                                dst.iter_mut().zip(&results).zip(&bias[chunk..end])
                            {
                                *d = Bf16::from_f32(dots[r] + b.to_f32());
                            }
                        }
                        None => {
                            for (d, dots) in dst.iter_mut().zip(&results) {
                                *d = Bf16::from_f32(dots[r]);
                            }
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

/// The whole matrix as bf16 `[n, k]` (for batches large enough that a dense GEMM wins).
pub fn dequantize_bf16(
    out: &mut [Bf16],
    weight: QMatrix<'_>,
    n: usize,
    k: usize,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    if let QMatrix::Blocks(m) = weight {
        return dequantize_blocks(out, m, n, k, threads, parallel);
    }
    weight.check(n, k)?;
    if out.len() != n * k {
        return Err(KernelError(format!(
            "dequantize: out has {} of {n} x {k}",
            out.len()
        )));
    }
    let parts = (n / MIN_ROWS_PER_PART).clamp(1, threads.max(1));
    let out_addr = out.as_mut_ptr() as usize;
    let blocks = k / QBLOCK;
    let simd = simd_dequantize_available();
    let task = |part: usize| {
        let (lo, hi) = (n * part / parts, n * (part + 1) / parts);
        let mut scales = RowScales::new(blocks);
        for row in lo..hi {
            scales.load(&weight, row..row + 1, simd);
            let (scale, min) = scales.row(0);
            // SAFETY: parts own disjoint row ranges of `out`, which outlives the call.
            let dst =
                unsafe { std::slice::from_raw_parts_mut((out_addr as *mut Bf16).add(row * k), k) };
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: `simd` means AVX-512 F/BW/BF16 were detected; shapes checked.
                unsafe { avx512::dequantize_row(&weight, row, k, scale, min, dst) };
                continue;
            }
            match weight {
                QMatrix::Q4(m) => {
                    let packed = &m.packed[row * k / 2..(row + 1) * k / 2];
                    for (j, d) in dst.iter_mut().enumerate() {
                        let (at, high) = q4_nibble(j, k);
                        let q = f32::from(if high {
                            packed[at] >> 4
                        } else {
                            packed[at] & 15
                        });
                        let b = j / QBLOCK;
                        *d = Bf16::from_f32(scale[b] * q + min[b]);
                    }
                }
                QMatrix::Q8(m) => {
                    let quants = &m.quants[row * k..(row + 1) * k];
                    for (j, (d, &q)) in dst.iter_mut().zip(quants).enumerate() {
                        *d = Bf16::from_f32(scale[j / QBLOCK] * f32::from(q));
                    }
                }
                QMatrix::Blocks(_) => unreachable!("dequantize_blocks serves these"),
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

/// Up to [`MAX_ROWS`] activation rows in the forms the paths read.
struct Rows<'a> {
    bf16: &'a [Bf16],
    f32: &'a [f32],
    count: usize,
}

/// `$body` with `$r` a constant equal to `$count` (1 to [`MAX_ROWS`], more taken as
/// [`MAX_ROWS`]): one copy of a kernel's loop per row count, its accumulators in registers.
macro_rules! with_row_count {
    ($count:expr, $r:ident => $body:expr) => {
        match $count {
            1 => with_row_count!(@one 1, $r => $body),
            2 => with_row_count!(@one 2, $r => $body),
            3 => with_row_count!(@one 3, $r => $body),
            4 => with_row_count!(@one 4, $r => $body),
            5 => with_row_count!(@one 5, $r => $body),
            6 => with_row_count!(@one 6, $r => $body),
            7 => with_row_count!(@one 7, $r => $body),
            _ => with_row_count!(@one 8, $r => $body),
        }
    };
    (@one $n:literal, $r:ident => $body:expr) => {{
        const $r: usize = $n;
        $body
    }};
}

fn simd_available(weight: &QMatrix<'_>) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let base = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl");
        match weight {
            QMatrix::Q4(_) => base && std::arch::is_x86_feature_detected!("avx512bf16"),
            QMatrix::Q8(_) => base,
            QMatrix::Blocks(_) => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = weight;
        false
    }
}

/// Whether the AVX-512 Q8 path takes bf16 dot products (the weights widened to bf16, exact
/// for `i8`; the activations as they are) rather than f32 FMAs on widened activations:
/// three instructions a row per block of 32 instead of five, paid by every row of a step
/// (a speculative step's verification rows too).
fn q8_in_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn simd_dequantize_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Rows per chunk of [`RowScales`] (a chunk's widened scales stay in L1/L2).
const CHUNK_ROWS: usize = 128;

/// Some rows' block scales (and mins) widened to f32, in buffers reused chunk after chunk.
struct RowScales {
    blocks: usize,
    scale: Vec<f32>,
    min: Vec<f32>,
}

impl RowScales {
    fn new(blocks: usize) -> Self {
        RowScales {
            blocks,
            scale: Vec::new(),
            min: Vec::new(),
        }
    }

    /// Scales and mins of row `i` of the rows loaded last.
    fn row(&self, i: usize) -> (&[f32], &[f32]) {
        let range = i * self.blocks..(i + 1) * self.blocks;
        let min = if self.min.is_empty() {
            &[][..]
        } else {
            &self.min[range.clone()]
        };
        (&self.scale[range], min)
    }

    fn load(&mut self, weight: &QMatrix<'_>, rows: std::ops::Range<usize>, simd: bool) {
        let range = rows.start * self.blocks..rows.end * self.blocks;
        self.scale.resize(range.len(), 0.0);
        if matches!(weight, QMatrix::Q4(_)) {
            self.min.resize(range.len(), 0.0);
        }
        let (scale, min) = match weight {
            QMatrix::Q4(m) => (&m.scale[range.clone()], Some(&m.min[range])),
            QMatrix::Q8(m) => (&m.scale[range], None),
            QMatrix::Blocks(_) => unreachable!("gemv_blocks serves these"),
        };
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` implies AVX-512 F/BW/VL; lengths match.
            unsafe {
                avx512::widen_f16(scale, &mut self.scale);
                if let Some(min) = min {
                    avx512::widen_f16(min, &mut self.min);
                }
            }
            return;
        }
        let _ = simd;
        for (d, s) in self.scale.iter_mut().zip(scale) {
            *d = s.to_f32();
        }
        for (d, s) in self.min.iter_mut().zip(min.unwrap_or(&[])) {
            *d = s.to_f32();
        }
    }
}

/// `results[i]` = the activation rows' dots with weight row `rows.start + i`.
fn dot_chunk(
    weight: &QMatrix<'_>,
    rows: std::ops::Range<usize>,
    k: usize,
    xs: &Rows<'_>,
    scales: &RowScales,
    simd: bool,
    results: &mut Vec<[f32; MAX_ROWS]>,
) {
    results.clear();
    results.resize(rows.len(), [0.0; MAX_ROWS]);
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` means the features each path needs were detected; shapes were
        // checked by `QMatrix::check` and `gemv_quant`.
        unsafe {
            match weight {
                QMatrix::Q4(m) => avx512::dot_q4_rows(m.packed, rows, k, xs, scales, results),
                QMatrix::Q8(m) if q8_in_bf16() => {
                    avx512::dot_q8_bf16_rows(m.quants, rows, k, xs, scales, results)
                }
                QMatrix::Q8(m) => avx512::dot_q8_rows(m.quants, rows, k, xs, scales, results),
                QMatrix::Blocks(_) => unreachable!("gemv_blocks serves these"),
            }
        }
        return;
    }
    for (i, row) in rows.enumerate() {
        let (scale, min) = scales.row(i);
        dot_row(weight, row, k, xs, scale, min, simd, &mut results[i]);
    }
}

#[allow(clippy::too_many_arguments)]
fn dot_row(
    weight: &QMatrix<'_>,
    row: usize,
    k: usize,
    xs: &Rows<'_>,
    scale: &[f32],
    min: &[f32],
    simd: bool,
    dots: &mut [f32; MAX_ROWS],
) {
    let blocks = k / QBLOCK;
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` means the features each path needs were detected; shapes were
        // checked by `QMatrix::check` and `gemv_quant`.
        unsafe {
            match weight {
                QMatrix::Q4(m) => {
                    let w = &m.packed[row * k / 2..(row + 1) * k / 2];
                    with_row_count!(xs.count, R => avx512::dot_q4::<R>(w, scale, min, xs, k, dots))
                }
                QMatrix::Q8(m) if q8_in_bf16() => {
                    let w = &m.quants[row * k..(row + 1) * k];
                    with_row_count!(xs.count, R => avx512::dot_q8_bf16::<R>(w, scale, xs, k, dots))
                }
                QMatrix::Q8(m) => {
                    let w = &m.quants[row * k..(row + 1) * k];
                    with_row_count!(xs.count, R => avx512::dot_q8::<R>(w, scale, xs, k, dots))
                }
                QMatrix::Blocks(_) => unreachable!("gemv_blocks serves these"),
            }
        }
        return;
    }
    let _ = simd;
    for (r, dot) in dots.iter_mut().enumerate().take(xs.count) {
        let x = &xs.f32[r * k..(r + 1) * k];
        let mut total = 0f32;
        for b in 0..blocks {
            let mut lanes = [0f32; QBLOCK];
            for (j, lane) in lanes.iter_mut().enumerate() {
                let w = weight.weight(row, b * QBLOCK + j, k);
                // Read as their bf16 roundings, as the SIMD paths and `dequantize_bf16`
                // have them.
                let w = Bf16::from_f32(w).to_f32();
                *lane = x[b * QBLOCK + j] * w;
            }
            total += lanes.iter().sum::<f32>();
        }
        *dot = total;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{QMatrix, RowScales, Rows, MAX_ROWS, QBLOCK};
    use crate::prefetch::prefetch_line_ahead_l2;

    /// [`dot_q4`] for each row of `rows` (one call, so the loop runs with the features on).
    ///
    /// SAFETY: as for `dot_q4`, for every row; `scales` holds these rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn dot_q4_rows(
        packed: &[u8],
        rows: std::ops::Range<usize>,
        k: usize,
        xs: &Rows<'_>,
        scales: &RowScales,
        results: &mut [[f32; MAX_ROWS]],
    ) {
        // One copy of the loop per activation row count, its accumulators in registers.
        with_row_count!(xs.count, R => {
            for (i, row) in rows.enumerate() {
                let (scale, min) = scales.row(i);
                let w = packed.get_unchecked(row * k / 2..(row + 1) * k / 2);
                dot_q4::<R>(w, scale, min, xs, k, results.get_unchecked_mut(i));
            }
        })
    }

    /// A row loop over a Q8 kernel: `$kernel` for each row of `rows` (one call, so the loop
    /// runs with the kernel's features on). SAFETY: as for `$kernel`, for every row.
    macro_rules! q8_rows {
        ($name:ident, $kernel:ident, $features:literal) => {
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(
                quants: &[i8],
                rows: std::ops::Range<usize>,
                k: usize,
                xs: &Rows<'_>,
                scales: &RowScales,
                results: &mut [[f32; MAX_ROWS]],
            ) {
                with_row_count!(xs.count, R => {
                    for (i, row) in rows.enumerate() {
                        let w = quants.get_unchecked(row * k..(row + 1) * k);
                        $kernel::<R>(w, scales.row(i).0, xs, k, results.get_unchecked_mut(i));
                    }
                })
            }
        };
    }
    q8_rows!(dot_q8_rows, dot_q8, "avx512f,avx512bw");
    q8_rows!(dot_q8_bf16_rows, dot_q8_bf16, "avx512f,avx512bw,avx512bf16");

    use crate::element::{Bf16, F16};

    /// f16 values to f32, sixteen a conversion. SAFETY: AVX-512 F/BW/VL; equal lengths.
    /// (Without BW/VL enabled here the masked 16-bit load was not inlined: a function
    /// call per sixteen scales, a fifth of a quantized batch-1 step.)
    ///
    /// The next chunk of rows' values follow `src` in memory: each line of them is
    /// requested as the same line of `src` is read, so that the next call finds them in
    /// cache (read cold, this stream stalled a batch-1 step as long as the weights did).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn widen_f16(src: &[F16], dst: &mut [f32]) {
        let mut i = 0;
        while i < src.len() {
            if i % 32 == 0 {
                let next = src.as_ptr().wrapping_add(i + src.len()) as *const i8;
                _mm_prefetch::<_MM_HINT_T0>(next);
            }
            let left = src.len() - i;
            let mask: __mmask16 = if left >= 16 {
                0xffff
            } else {
                (1u16 << left) - 1
            };
            let h = _mm256_maskz_loadu_epi16(mask, src.as_ptr().add(i) as *const i16);
            _mm512_mask_storeu_ps(dst.as_mut_ptr().add(i), mask, _mm512_cvtph_ps(h));
            i += 16;
        }
    }

    /// `scale * q + min` (a multiply and an add, rounded as the portable path rounds)
    /// for 16 values, stored as bf16 (round to nearest even).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn store16(dst: *mut Bf16, q: __m512i, d: __m512, m: __m512) {
        let w = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), d), m);
        _mm256_storeu_si256(
            dst as *mut __m256i,
            std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(w)),
        );
    }

    /// One row of the matrix as bf16 into `dst` (`k` elements).
    ///
    /// SAFETY: AVX-512 F/BW/BF16; `row < n` of a matrix checked for `k`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn dequantize_row(
        weight: &QMatrix<'_>,
        row: usize,
        k: usize,
        scale: &[f32],
        min: &[f32],
        dst: &mut [Bf16],
    ) {
        let blocks = k / QBLOCK;
        let out = dst.as_mut_ptr();
        match weight {
            QMatrix::Q4(m) => {
                let packed = m.packed.as_ptr().add(row * k / 2);
                let low = _mm_set1_epi8(15);
                for b in 0..blocks {
                    let d = _mm512_set1_ps(*scale.get_unchecked(b));
                    let mn = _mm512_set1_ps(*min.get_unchecked(b));
                    let src = packed.add(b / 2 * QBLOCK);
                    for half in 0..2 {
                        let bytes = _mm_loadu_si128(src.add(16 * half) as *const __m128i);
                        let q = if b % 2 == 0 {
                            _mm_and_si128(bytes, low)
                        } else {
                            _mm_and_si128(_mm_srli_epi16::<4>(bytes), low)
                        };
                        store16(
                            out.add(b * QBLOCK + 16 * half),
                            _mm512_cvtepu8_epi32(q),
                            d,
                            mn,
                        );
                    }
                }
            }
            QMatrix::Q8(m) => {
                let quants = m.quants.as_ptr().add(row * k);
                let zero = _mm512_setzero_ps();
                for b in 0..blocks {
                    let d = _mm512_set1_ps(*scale.get_unchecked(b));
                    for half in 0..2 {
                        let at = b * QBLOCK + 16 * half;
                        let q =
                            _mm512_cvtepi8_epi32(_mm_loadu_si128(quants.add(at) as *const __m128i));
                        store16(out.add(at), q, d, zero);
                    }
                }
            }
            QMatrix::Blocks(_) => unreachable!("dequantize_blocks serves these"),
        }
    }

    #[allow(clippy::needless_range_loop)] // `r` indexes `acc`, `dots` and the rows of `xs`
    /// Each pair of blocks is dequantized once into a bf16 table of its 32 possible
    /// weights (`scale * q + min` for `q` in `0..16`, rounded as [`dequantize_row`]
    /// rounds), the nibbles pick from it (`vpermw`), and each row then takes one
    /// `vdpbf16ps` a block straight into its accumulator: the scaling is paid once per
    /// block, not once per block and row.
    ///
    /// The table is built with one fused multiply-add a block. That rounds as a multiply
    /// then an add does: `q` has 4 significant bits and `scale` (an f16 value) 11, so
    /// `scale * q` is exact in f32 and only the sum is rounded either way. The second
    /// block's weights take the table's first 16 words, so that its nibble (`byte >> 4`)
    /// indexes them as it is, and the first block's index `(byte & 15) | 16` is one
    /// `vpternlogd`. At one row the pass is bound by an Intel core's two 512-bit ports, so
    /// the two instructions fewer a pair show (BENCHMARKS.md, "The q4 table in fewer
    /// instructions").
    ///
    /// SAFETY: AVX-512 F/BW/BF16; `packed` is one row (`k / 2` bytes, `k % 64 == 0`),
    /// `scale`/`min` its `k / 32` blocks; `xs` holds `count` rows of `k`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn dot_q4<const ROWS: usize>(
        packed: &[u8],
        scale: &[f32],
        min: &[f32],
        xs: &Rows<'_>,
        k: usize,
        dots: &mut [f32; MAX_ROWS],
    ) {
        let low = _mm512_set1_epi16(15);
        let first = _mm512_set1_epi16(16);
        let iota = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        let xp = xs.bf16.as_ptr() as *const u16;
        let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
        let pairs = k / (2 * QBLOCK);
        for p in 0..pairs {
            if p % 2 == 0 {
                prefetch_line_ahead_l2(packed.as_ptr().add(p * QBLOCK));
            }
            let (b0, b1) = (2 * p, 2 * p + 1);
            let t0 = _mm512_fmadd_ps(
                iota,
                _mm512_set1_ps(*scale.get_unchecked(b0)),
                _mm512_set1_ps(*min.get_unchecked(b0)),
            );
            let t1 = _mm512_fmadd_ps(
                iota,
                _mm512_set1_ps(*scale.get_unchecked(b1)),
                _mm512_set1_ps(*min.get_unchecked(b1)),
            );
            // Words 0..16: the second block's weights; 16..32: the first's.
            let table: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(t0, t1));
            let bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                packed.as_ptr().add(p * QBLOCK) as *const __m256i
            ));
            // (bytes & low) | first, in one instruction.
            let i0 = _mm512_ternarylogic_epi32::<0xEA>(bytes, low, first);
            let i1 = _mm512_srli_epi16::<4>(bytes);
            let w0: __m512bh = std::mem::transmute(_mm512_permutexvar_epi16(i0, table));
            let w1: __m512bh = std::mem::transmute(_mm512_permutexvar_epi16(i1, table));
            for r in 0..ROWS {
                let base = xp.add(r * k + 2 * p * QBLOCK);
                let x0: __m512bh = std::mem::transmute(_mm512_loadu_si512(base as *const __m512i));
                let x1: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(base.add(QBLOCK) as *const __m512i));
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, x0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, x1);
            }
        }
        for r in 0..ROWS {
            dots[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        }
    }

    #[allow(clippy::needless_range_loop)] // `r` indexes `acc`, `dots` and the rows of `xs`
    /// [`dot_q8`] with bf16 dot products: a block's 32 `i8` weights are widened once to
    /// bf16 (exact: every `i8` is a bf16 number), and each row takes one `vdpbf16ps` with
    /// its bf16 activations as they are and one FMA with the block's scale. Products of two
    /// bf16 numbers are exact in f32, so only the sums are rounded, as in [`dot_q8`].
    ///
    /// SAFETY: AVX-512 F/BW/BF16; `quants` is one row of `k` (`k % 32 == 0`), `scale` its
    /// `k / 32` blocks; `xs` holds `count` rows of `k`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn dot_q8_bf16<const ROWS: usize>(
        quants: &[i8],
        scale: &[f32],
        xs: &Rows<'_>,
        k: usize,
        dots: &mut [f32; MAX_ROWS],
    ) {
        let xp = xs.bf16.as_ptr() as *const u16;
        let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
        // Block `b`'s 32 weights `scale * q` as bf16 (rounded as `dequantize_row` rounds
        // them), weights 0..16 in the low half and 16..32 in the high half.
        let widen = |qp: *const i8, d: __m512| {
            let w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qp.cast())));
            let w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qp.add(16).cast())));
            _mm512_cvtne2ps_pbh(_mm512_mul_ps(w1, d), _mm512_mul_ps(w0, d))
        };
        let blocks = k / QBLOCK;
        let mut b = 0;
        // Two blocks a step (one into each accumulator), so that each row's two chains
        // have independent work beside them.
        while b + 2 <= blocks {
            let qp = quants.as_ptr().add(b * QBLOCK);
            prefetch_line_ahead_l2(qp.cast());
            let wa = widen(qp, _mm512_set1_ps(*scale.get_unchecked(b)));
            let wb = widen(qp.add(QBLOCK), _mm512_set1_ps(*scale.get_unchecked(b + 1)));
            for r in 0..ROWS {
                let x = xp.add(r * k + b * QBLOCK);
                let xa: __m512bh = std::mem::transmute(_mm512_loadu_si512(x.cast()));
                let xb: __m512bh = std::mem::transmute(_mm512_loadu_si512(x.add(QBLOCK).cast()));
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wa, xa);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], wb, xb);
            }
            b += 2;
        }
        if b < blocks {
            let w = widen(
                quants.as_ptr().add(b * QBLOCK),
                _mm512_set1_ps(*scale.get_unchecked(b)),
            );
            for r in 0..ROWS {
                let x: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(xp.add(r * k + b * QBLOCK).cast()));
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, x);
            }
        }
        for r in 0..ROWS {
            dots[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        }
    }

    #[allow(clippy::needless_range_loop)] // `r` indexes `acc`, `dots` and the rows of `xs`
    /// SAFETY: AVX-512 F/BW; `quants` is one row of `k` (`k % 32 == 0`), `scale` its
    /// `k / 32` blocks; `xs` holds `count` rows of `k`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn dot_q8<const ROWS: usize>(
        quants: &[i8],
        scale: &[f32],
        xs: &Rows<'_>,
        k: usize,
        dots: &mut [f32; MAX_ROWS],
    ) {
        let rows = ROWS;
        let xp = xs.f32.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
        // `scale * q` rounded to the nearest bf16 (ties to even) and widened back: the
        // weights the bf16 path and `dequantize_row` have.
        let to_bf16 = |w: __m512| {
            let bits = _mm512_castps_si512(w);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
            let up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
            _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(-65536)))
        };
        for b in 0..k / QBLOCK {
            let qp = quants.as_ptr().add(b * QBLOCK);
            if b % 2 == 0 {
                prefetch_line_ahead_l2(qp.cast());
            }
            let d = _mm512_set1_ps(*scale.get_unchecked(b));
            let w0 = to_bf16(_mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qp as *const __m128i))),
                d,
            ));
            let w1 = to_bf16(_mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    qp.add(16) as *const __m128i
                ))),
                d,
            ));
            for r in 0..rows {
                let base = xp.add(r * k + b * QBLOCK);
                let s = _mm512_fmadd_ps(
                    w1,
                    _mm512_loadu_ps(base.add(16)),
                    _mm512_mul_ps(w0, _mm512_loadu_ps(base)),
                );
                acc[r][b & 1] = _mm512_add_ps(s, acc[r][b & 1]);
            }
        }
        for r in 0..rows {
            dots[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The portable path and the SIMD one (where this CPU has it) agree on every row.
    #[test]
    fn portable_and_simd_dots_agree() {
        let (n, k) = (3, 128);
        let blocks = k / QBLOCK;
        let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 37 % 251) as u8).collect();
        let scale: Vec<F16> = (0..n * blocks)
            .map(|i| F16::from_f32(0.01 + i as f32 * 1e-3))
            .collect();
        let min: Vec<F16> = (0..n * blocks)
            .map(|i| F16::from_f32(-0.05 + i as f32 * 7e-3))
            .collect();
        let quants: Vec<i8> = (0..n * k).map(|i| (i * 29 % 255) as i8).collect();
        let x: Vec<Bf16> = (0..2 * k)
            .map(|i| Bf16::from_f32((i as f32 * 0.37).sin()))
            .collect();
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let xs = Rows {
            bf16: &x,
            f32: &xf,
            count: 2,
        };
        for weight in [
            QMatrix::Q4(Q4 {
                packed: &packed,
                scale: &scale,
                min: &min,
            }),
            QMatrix::Q8(Q8 {
                quants: &quants,
                scale: &scale,
            }),
        ] {
            for row in 0..n {
                let (mut portable, mut simd) = ([0f32; MAX_ROWS], [0f32; MAX_ROWS]);
                let fast = simd_available(&weight);
                let (mut plain, mut wide) = (RowScales::new(blocks), RowScales::new(blocks));
                plain.load(&weight, row..row + 1, false);
                wide.load(&weight, row..row + 1, fast);
                assert_eq!(plain.row(0), wide.row(0));
                let (scale, min) = plain.row(0);
                dot_row(&weight, row, k, &xs, scale, min, false, &mut portable);
                dot_row(&weight, row, k, &xs, scale, min, fast, &mut simd);
                for r in 0..2 {
                    let tol = 1e-4 * (1.0 + portable[r].abs());
                    assert!(
                        (portable[r] - simd[r]).abs() <= tol,
                        "{portable:?} vs {simd:?}"
                    );
                }
            }
        }
    }
}
