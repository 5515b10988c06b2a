//! `y = W x (+ b)` for any number of activation rows against a bf16 weight matrix.
//!
//! At batch 1 a decoder reads every weight once per token, so the matrix-vector products
//! run at memory speed or not at all. This kernel streams each weight row once, widening
//! bf16 to f32 by a shift, with 16-lane f32 accumulators per activation row, and splits the
//! output rows across the caller's threads. Sums are f32; outputs are rounded to bf16 once.
//!
//! More rows than one pass serves ([`GEMV_MAX_ROWS`]) are taken in passes of that many
//! over a chunk of weight rows held in cache, in blocks of activation rows sized to stay
//! in L2, so the weights still come from memory about once. On a CPU without bf16
//! arithmetic (AVX2) this is several times faster than torch's bf16 GEMM, which converts
//! and multiplies in small tiles, and for prompts it is still ahead of its f32 GEMM over
//! a widened copy.
//!
//! Where the CPU has AVX-512 BF16, each activation row takes one `vdpbf16ps` per 32
//! weights straight from the bf16 values (the products of two bf16 numbers are exact in
//! f32, so the order of the additions differs from the widening path, and the instruction
//! takes denormal inputs and sums as zero): an extra row of
//! a speculative step or a small batch costs one instruction per 32 weights instead of two
//! FMAs, and the weights are not widened at all.
//!
//! A row's result does not depend on how many rows share the call: each activation row has
//! accumulators of its own, filled in the same order whatever the row count, and the path
//! (AVX-512 BF16, AVX-512, AVX2 + FMA or portable) is chosen by the CPU and `k` alone. A speculative
//! decoding step's verification rows therefore give exactly the values a one-row decode
//! step gives (the tests check it bit for bit).

use crate::attention::{KernelError, Parallel};
use crate::element::{Bf16, Element};
use crate::prefetch::prefetch_ahead;

/// Output rows per part below which a call is not split.
const MIN_ROWS_PER_PART: usize = 256;

/// Most activation rows one pass over a weight row takes (a decode step's, or a sequence's
/// last token and its proposed ones): the weights are read once for all of them.
pub const GEMV_MAX_ROWS: usize = 8;

/// Weight rows a thread takes at a time when the activation rows need several passes:
/// they stay in cache from one pass to the next.
const CHUNK_ROWS: usize = 16;

/// f32 values of activation rows one block holds (256 KiB: half of an L2).
const BLOCK_VALUES: usize = 64 * 1024;

/// `out[r][n] = sum_k x[r][k] * weight[n][k] (+ bias[n])` for `r` in `0..rows` (one or
/// more).
///
/// `x` is `[rows, k]`, `weight` `[n, k]`, `bias` `[n]`, `out` `[rows, n]`.
#[allow(clippy::too_many_arguments)]
pub fn gemv_bf16(
    out: &mut [Bf16],
    x: &[Bf16],
    weight: &[Bf16],
    bias: Option<&[Bf16]>,
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let sizes_ok = rows > 0
        && k > 0
        && x.len() == rows * k
        && weight.len() == n * k
        && out.len() == rows * n
        && bias.is_none_or(|b| b.len() == n);
    if !sizes_ok {
        return Err(KernelError(format!(
            "gemv: x {} / weight {} / out {} elements for {rows} x {k} by {n} x {k}",
            x.len(),
            weight.len(),
            out.len()
        )));
    }
    let simd = simd_path(k);
    // The bf16 dot products read the activations as they are; the others widened once.
    let xf: Vec<f32> = if simd == Simd::Avx512Bf16 {
        Vec::new()
    } else {
        x.iter().map(|v| v.to_f32()).collect()
    };
    let out_addr = out.as_mut_ptr() as usize;
    let write = |r: usize, row: usize, dot: f32| {
        let b = bias.map_or(0.0, |b| b[row].to_f32());
        // SAFETY: tasks own disjoint (activation row, output column) ranges, and `out`
        // (rows * n elements) outlives the call.
        unsafe { *(out_addr as *mut Bf16).add(r * n + row) = Bf16::from_f32(dot + b) };
    };
    // Tasks split the output columns and, when there are more threads than column parts,
    // the activation rows too. Every pass calls `dot_row` on at most GEMV_MAX_ROWS rows,
    // so a row's value is the one it gets alone. Up to GEMV_MAX_ROWS rows there is one
    // pass: each thread streams its weight rows once, in order (each 64-byte line read
    // requests the one a fixed distance ahead, see `prefetch.rs`); with one activation row,
    // two weight rows side by side (see `dot_two_rows`).
    let threads = threads.max(1);
    let col_parts = (n / MIN_ROWS_PER_PART).clamp(1, threads);
    let passes = rows.div_ceil(GEMV_MAX_ROWS);
    let row_parts = (threads / col_parts).clamp(1, passes);
    let block = (BLOCK_VALUES / k / GEMV_MAX_ROWS).max(1) * GEMV_MAX_ROWS;
    let task = |part: usize| {
        let (cp, rp) = (part % col_parts, part / col_parts);
        let (lo, hi) = (n * cp / col_parts, n * (cp + 1) / col_parts);
        let first = passes * rp / row_parts * GEMV_MAX_ROWS;
        let last = (passes * (rp + 1) / row_parts * GEMV_MAX_ROWS).min(rows);
        for start in (first..last).step_by(block) {
            let end = (start + block).min(last);
            // A chunk of weight rows (from memory once per block, then from L2) against
            // each group of activation rows (from L1 or L2) in turn.
            for chunk in (lo..hi).step_by(CHUNK_ROWS) {
                for group in (start..end).step_by(GEMV_MAX_ROWS) {
                    let take = (end - group).min(GEMV_MAX_ROWS);
                    let rows_of = group * k..(group + take) * k;
                    let xs = if xf.is_empty() {
                        &[][..]
                    } else {
                        &xf[rows_of.clone()]
                    };
                    let xb = &x[rows_of];
                    let mut row = chunk;
                    let chunk_end = (chunk + CHUNK_ROWS).min(hi);
                    if take == 1 {
                        // One activation row: two weight rows side by side, each summed as
                        // it is alone, where the vector path has a kernel for it.
                        while row + 2 <= chunk_end {
                            let w = &weight[row * k..(row + 2) * k];
                            let Some(pair) = dot_two_rows(xb, w, k, simd) else {
                                break;
                            };
                            write(group, row, pair[0]);
                            write(group, row + 1, pair[1]);
                            row += 2;
                        }
                    }
                    for row in row..chunk_end {
                        let w = &weight[row * k..(row + 1) * k];
                        let dots = dot_row(xs, xb, w, take, k, simd);
                        for (r, dot) in dots.iter().enumerate().take(take) {
                            write(group + r, row, *dot);
                        }
                    }
                }
            }
        }
    };
    let parts = col_parts * row_parts;
    if parts == 1 {
        task(0);
    } else {
        parallel.run(parts, &task);
    }
    Ok(())
}

/// The vector path [`dot_row`] takes for rows of `k` values (chosen once per call, by the
/// CPU and `k`, never by the row count).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Simd {
    Avx512Bf16,
    Avx512,
    Avx2,
    Portable,
}

fn simd_path(k: usize) -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        if k.is_multiple_of(32)
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            if std::arch::is_x86_feature_detected!("avx512bf16") {
                return Simd::Avx512Bf16;
            }
            return Simd::Avx512;
        }
        if k.is_multiple_of(16)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return Simd::Avx2;
        }
    }
    let _ = k;
    Simd::Portable
}

/// Activation row `r` . the weight row `w`, for `r` in `0..rows`; `simd` from
/// [`simd_path`]. The rows come widened (`xf`, empty on the bf16 path) and as they are
/// (`xb`).
fn dot_row(
    xf: &[f32],
    xb: &[Bf16],
    w: &[Bf16],
    rows: usize,
    k: usize,
    simd: Simd,
) -> [f32; GEMV_MAX_ROWS] {
    let mut dots = [0f32; GEMV_MAX_ROWS];
    #[cfg(target_arch = "x86_64")]
    match simd {
        Simd::Avx512Bf16 => {
            // SAFETY: AVX-512 F/BW/BF16 detected and k a multiple of 32; `w` holds k
            // values and `xb` `rows` rows of k.
            unsafe { avx512_bf16::dot_rows(xb, w, rows, k, &mut dots) };
            return dots;
        }
        Simd::Avx512 => {
            // SAFETY: AVX-512 F/BW detected and k a multiple of 32; `w` holds k values and
            // `xf` `rows` rows of k.
            unsafe { avx512::dot_rows(xf, w, rows, k, &mut dots) };
            return dots;
        }
        Simd::Avx2 => {
            // SAFETY: AVX2 and FMA detected and k a multiple of 16; shapes as above.
            unsafe { avx2::dot_rows(xf, w, rows, k, &mut dots) };
            return dots;
        }
        Simd::Portable => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (simd, xb);
    prefetch_ahead(w.as_ptr() as *const u8, std::mem::size_of_val(w));
    for (r, dot) in dots.iter_mut().enumerate().take(rows) {
        let x = &xf[r * k..(r + 1) * k];
        let mut lanes = [0f32; 16];
        let whole = k / 16 * 16;
        for (xs, ws) in x[..whole].chunks_exact(16).zip(w[..whole].chunks_exact(16)) {
            for i in 0..16 {
                lanes[i] += xs[i] * ws[i].to_f32();
            }
        }
        *dot = lanes.iter().sum();
        for i in whole..k {
            *dot += x[i] * w[i].to_f32();
        }
    }
    dots
}

/// One activation row `x` against two adjacent weight rows `w` (`2 * k` values): both
/// dots, each summed exactly as [`dot_row`] sums it alone; `None` where `simd` has no such
/// kernel. Two independent streams and accumulator chains keep more reads in flight than
/// one: at one row over a Qwen3.5-4B shape's MLP matrices, with loads requested into L2,
/// 29 against 26 GB/s.
fn dot_two_rows(x: &[Bf16], w: &[Bf16], k: usize, simd: Simd) -> Option<[f32; 2]> {
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx512Bf16 {
        // SAFETY: AVX-512 F/BW/BF16 detected and k a multiple of 32; `x` holds k values
        // and `w` 2k.
        return Some(unsafe { avx512_bf16::dot_two_rows(x, w, k) });
    }
    let _ = (x, w, k, simd);
    None
}

/// Rows in groups of at most `$group` (a const-generic kernel per group size), each group
/// reading the same weight row (from L1 after the first).
macro_rules! dot_in_groups {
    ($kernel:ident, $group:expr, $xf:expr, $w:expr, $rows:expr, $k:expr, $dots:expr) => {{
        let mut first = 0;
        while first < $rows {
            let take = ($rows - first).min($group);
            let x = &$xf[first * $k..];
            let out = &mut $dots[first..first + take];
            match take {
                1 => $kernel::<1>(x, $w, $k, out),
                2 => $kernel::<2>(x, $w, $k, out),
                3 => $kernel::<3>(x, $w, $k, out),
                _ => $kernel::<4>(x, $w, $k, out),
            }
            first += take;
        }
    }};
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::element::Bf16;
    use crate::prefetch::prefetch_line_ahead;

    /// SAFETY: AVX2 and FMA present; `k % 16 == 0`; `w.len() >= k`, `xf.len() >= rows * k`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_rows(xf: &[f32], w: &[Bf16], rows: usize, k: usize, dots: &mut [f32]) {
        dot_in_groups!(dot_group, 4, xf, w, rows, k, dots);
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen(p: *const u16) -> __m256 {
        let raw = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// Two 8-lane accumulators per activation row (the first and second 8 of every 16
    /// values), summed at the end: the same order for a row whatever `ROWS` is.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_group<const ROWS: usize>(xf: &[f32], w: &[Bf16], k: usize, dots: &mut [f32]) {
        let wp = w.as_ptr() as *const u16;
        let xp = xf.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 2]; ROWS];
        let mut i = 0;
        while i < k {
            if i % 32 == 0 {
                prefetch_line_ahead(wp.add(i) as *const u8);
            }
            let (w0, w1) = (widen(wp.add(i)), widen(wp.add(i + 8)));
            for (r, a) in acc.iter_mut().enumerate() {
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(r * k + i)), w0, a[0]);
                a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(r * k + i + 8)), w1, a[1]);
            }
            i += 16;
        }
        for (d, a) in dots.iter_mut().zip(acc) {
            *d = sum(_mm256_add_ps(a[0], a[1]));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::element::Bf16;
    use crate::prefetch::prefetch_line_ahead;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn widen(p: *const u16) -> (__m512, __m512) {
        let raw = _mm512_loadu_si512(p as *const __m512i);
        let lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw));
        let hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64::<1>(raw));
        (
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(lo)),
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(hi)),
        )
    }

    /// SAFETY: AVX-512 F/BW present; `k % 32 == 0`; `w.len() >= k`,
    /// `xf.len() >= rows * k`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn dot_rows(xf: &[f32], w: &[Bf16], rows: usize, k: usize, dots: &mut [f32]) {
        dot_in_groups!(dot_group, 4, xf, w, rows, k, dots);
    }

    /// Two accumulators per activation row, the same order for a row whatever `ROWS` is.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn dot_group<const ROWS: usize>(xf: &[f32], w: &[Bf16], k: usize, dots: &mut [f32]) {
        let wp = w.as_ptr() as *const u16;
        let xp = xf.as_ptr();
        // Two accumulators per activation row (the first and second 16 of every 32
        // values), summed at the end.
        let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
        let mut i = 0;
        while i < k {
            // Spread through the loop, not issued per row in one burst: a long row (the
            // down projection's 4864 values) in one burst overran the outstanding-miss
            // slots and read at 36-39 GB/s against 44-48 spread (2 threads).
            prefetch_line_ahead(wp.add(i) as *const u8);
            let (w0, w1) = widen(wp.add(i));
            for (r, a) in acc.iter_mut().enumerate() {
                a[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(r * k + i)), w0, a[0]);
                a[1] = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(r * k + i + 16)), w1, a[1]);
            }
            i += 32;
        }
        for (d, a) in dots.iter_mut().zip(acc) {
            *d = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512_bf16 {
    use std::arch::x86_64::*;

    use crate::element::Bf16;
    use crate::prefetch::prefetch_line_ahead_l2;

    /// SAFETY: AVX-512 F/BW/BF16 present; `k % 32 == 0`; `w.len() >= k`,
    /// `x.len() >= rows * k`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn dot_rows(x: &[Bf16], w: &[Bf16], rows: usize, k: usize, dots: &mut [f32]) {
        dot_in_groups!(dot_group, 4, x, w, rows, k, dots);
    }

    /// `dot_group::<1>` of `x` with each of the two rows of `w` (`2 * k` values), the two
    /// interleaved: each row's accumulators take the same values in the same order.
    /// SAFETY: AVX-512 F/BW/BF16 present; `k % 32 == 0`; `x.len() >= k`, `w.len() >= 2k`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn dot_two_rows(x: &[Bf16], w: &[Bf16], k: usize) -> [f32; 2] {
        let wp = w.as_ptr() as *const u16;
        let wq = wp.add(k);
        let xp = x.as_ptr() as *const u16;
        let mut a = [_mm512_setzero_ps(); 2];
        let mut b = [_mm512_setzero_ps(); 2];
        let mut i = 0;
        while i + 64 <= k {
            for p in [wp.add(i), wp.add(i + 32), wq.add(i), wq.add(i + 32)] {
                prefetch_line_ahead_l2(p as *const u8);
            }
            let (x0, x1) = (load(xp.add(i)), load(xp.add(i + 32)));
            a[0] = _mm512_dpbf16_ps(a[0], x0, load(wp.add(i)));
            a[1] = _mm512_dpbf16_ps(a[1], x1, load(wp.add(i + 32)));
            b[0] = _mm512_dpbf16_ps(b[0], x0, load(wq.add(i)));
            b[1] = _mm512_dpbf16_ps(b[1], x1, load(wq.add(i + 32)));
            i += 64;
        }
        if i < k {
            prefetch_line_ahead_l2(wp.add(i) as *const u8);
            prefetch_line_ahead_l2(wq.add(i) as *const u8);
            let x0 = load(xp.add(i));
            a[0] = _mm512_dpbf16_ps(a[0], x0, load(wp.add(i)));
            b[0] = _mm512_dpbf16_ps(b[0], x0, load(wq.add(i)));
        }
        [
            _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1])),
            _mm512_reduce_add_ps(_mm512_add_ps(b[0], b[1])),
        ]
    }

    /// 32 bf16 values from `p`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn load(p: *const u16) -> __m512bh {
        std::mem::transmute(_mm512_loadu_si512(p.cast()))
    }

    /// Two accumulators per activation row (the first and second 32 of every 64 values,
    /// for the instruction's latency), summed at the end: the same order for a row whatever
    /// `ROWS` is.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn dot_group<const ROWS: usize>(x: &[Bf16], w: &[Bf16], k: usize, dots: &mut [f32]) {
        let wp = w.as_ptr() as *const u16;
        let xp = x.as_ptr() as *const u16;
        let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
        let mut i = 0;
        while i + 64 <= k {
            prefetch_line_ahead_l2(wp.add(i) as *const u8);
            prefetch_line_ahead_l2(wp.add(i + 32) as *const u8);
            let (w0, w1) = (load(wp.add(i)), load(wp.add(i + 32)));
            for (r, a) in acc.iter_mut().enumerate() {
                a[0] = _mm512_dpbf16_ps(a[0], load(xp.add(r * k + i)), w0);
                a[1] = _mm512_dpbf16_ps(a[1], load(xp.add(r * k + i + 32)), w1);
            }
            i += 64;
        }
        if i < k {
            prefetch_line_ahead_l2(wp.add(i) as *const u8);
            let w0 = load(wp.add(i));
            for (r, a) in acc.iter_mut().enumerate() {
                a[0] = _mm512_dpbf16_ps(a[0], load(xp.add(r * k + i)), w0);
            }
        }
        for (d, a) in dots.iter_mut().zip(acc) {
            *d = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
        }
    }
}
