//! `y = W x (+ b)` for one or two activation rows against a bf16 weight matrix.
//!
//! At batch 1 a decoder reads every weight once per token, so the matrix-vector products
//! run at memory speed or not at all. This kernel streams each weight row once, widening
//! bf16 to f32 by a shift, with 16-lane f32 accumulators per activation row, and splits the
//! output rows across the caller's threads. Sums are f32; outputs are rounded to bf16 once.

use crate::attention::{KernelError, Parallel};
use crate::element::{Bf16, Element};
use crate::prefetch::prefetch_ahead;

/// Output rows per part below which a call is not split.
const MIN_ROWS_PER_PART: usize = 256;

/// `out[r][n] = sum_k x[r][k] * weight[n][k] (+ bias[n])` for `r` in `0..rows` (1 or 2).
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
    let sizes_ok = (1..=2).contains(&rows)
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
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let simd = simd_available(k);
    let parts = (n / MIN_ROWS_PER_PART).clamp(1, threads.max(1));
    let out_addr = out.as_mut_ptr() as usize;
    let task = |part: usize| {
        let (lo, hi) = (n * part / parts, n * (part + 1) / parts);
        for row in lo..hi {
            // One weight row at a time: a single sequential stream per thread, which keeps
            // more of its reads in flight than four rows read side by side did. Each
            // 64-byte line read requests the one a fixed distance ahead (see `dot_row`).
            let dots = dot_row(&xf, &weight[row * k..(row + 1) * k], rows, k, simd);
            let b = bias.map_or(0.0, |b| b[row].to_f32());
            for (r, dot) in dots.iter().enumerate().take(rows) {
                // SAFETY: parts own disjoint column ranges [lo, hi) of each output row,
                // and `out` (rows * n elements) outlives the call.
                unsafe {
                    *(out_addr as *mut Bf16).add(r * n + row) = Bf16::from_f32(dot + b);
                }
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

/// Whether [`dot_row`] may take the AVX-512 path for rows of `k` values (checked once per
/// call, not per row).
fn simd_available(k: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        k.is_multiple_of(32)
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = k;
        false
    }
}

/// Activation row `r` . the weight row `w`, for `r` in `0..rows` (1 or 2); `simd` from
/// [`simd_available`].
fn dot_row(xf: &[f32], w: &[Bf16], rows: usize, k: usize, simd: bool) -> [f32; 2] {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` means AVX-512 F/BW and k a multiple of 32; `w` holds k values and
        // `xf` `rows` rows of k.
        return unsafe {
            if rows == 2 {
                avx512::dot_row::<2>(xf, w, k)
            } else {
                let [d] = avx512::dot_row::<1>(xf, w, k);
                [d, 0.0]
            }
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = simd;
    prefetch_ahead(w.as_ptr() as *const u8, std::mem::size_of_val(w));
    let mut dots = [0f32; 2];
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
    /// `xf.len() >= ROWS * k`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn dot_row<const ROWS: usize>(
        xf: &[f32],
        w: &[Bf16],
        k: usize,
    ) -> [f32; ROWS] {
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
        acc.map(|a| _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1])))
    }
}
