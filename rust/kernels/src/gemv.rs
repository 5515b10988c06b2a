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
    let parts = (n / MIN_ROWS_PER_PART).clamp(1, threads.max(1));
    let out_addr = out.as_mut_ptr() as usize;
    let task = |part: usize| {
        let (lo, hi) = (n * part / parts, n * (part + 1) / parts);
        let mut results = [[0f32; 4]; 2];
        let mut row = lo;
        while row < hi {
            // Four weight rows at a time where the SIMD path has them: four independent
            // streams in flight and one activation load per four rows.
            let take = if hi - row >= 4 { 4 } else { 1 };
            let w = &weight[row * k..(row + take) * k];
            prefetch_ahead(w.as_ptr() as *const u8, take * k * 2);
            dot_rows(&xf, w, rows, k, take, &mut results);
            for (r, values) in results.iter().enumerate().take(rows) {
                for (t, value) in values.iter().enumerate().take(take) {
                    let b = bias.map_or(0.0, |b| b[row + t].to_f32());
                    // SAFETY: parts own disjoint column ranges [lo, hi) of each output
                    // row, and `out` (rows * n elements) outlives the call.
                    unsafe {
                        *(out_addr as *mut Bf16).add(r * n + row + t) = Bf16::from_f32(value + b);
                    }
                }
            }
            row += take;
        }
    };
    if parts == 1 {
        task(0);
    } else {
        parallel.run(parts, &task);
    }
    Ok(())
}

/// `results[r][t]` = activation row `r` . weight row `t`, for the `take` (1 or 4) weight
/// rows in `w`.
fn dot_rows(
    xf: &[f32],
    w: &[Bf16],
    rows: usize,
    k: usize,
    take: usize,
    results: &mut [[f32; 4]; 2],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if k.is_multiple_of(32)
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            // SAFETY: features checked; k is a multiple of 32; `w` holds `take` rows of k
            // and `xf` `rows` rows of k.
            unsafe { avx512::dot_rows(xf, w, rows, k, take, results) };
            return;
        }
    }
    for t in 0..take {
        let wt = &w[t * k..(t + 1) * k];
        for r in 0..rows {
            let x = &xf[r * k..(r + 1) * k];
            let mut lanes = [0f32; 16];
            let whole = k / 16 * 16;
            for (xs, ws) in x[..whole]
                .chunks_exact(16)
                .zip(wt[..whole].chunks_exact(16))
            {
                for i in 0..16 {
                    lanes[i] += xs[i] * ws[i].to_f32();
                }
            }
            let mut sum: f32 = lanes.iter().sum();
            for i in whole..k {
                sum += x[i] * wt[i].to_f32();
            }
            results[r][t] = sum;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::element::Bf16;

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

    #[allow(clippy::needless_range_loop)]
    /// SAFETY: AVX-512 F/BW present; `k % 32 == 0`; `w.len() >= take * k` (take 1 or 4),
    /// `xf.len() >= rows * k` (rows 1 or 2).
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn dot_rows(
        xf: &[f32],
        w: &[Bf16],
        rows: usize,
        k: usize,
        take: usize,
        results: &mut [[f32; 4]; 2],
    ) {
        let wp = w.as_ptr() as *const u16;
        let xp = xf.as_ptr();
        let zero = _mm512_setzero_ps();
        // acc[r][t]: two vectors per (activation row, weight row), summed at the end.
        let mut acc = [[[zero; 2]; 4]; 2];
        let mut i = 0;
        while i < k {
            let x0 = [_mm512_loadu_ps(xp.add(i)), _mm512_loadu_ps(xp.add(i + 16))];
            let x1 = if rows == 2 {
                [
                    _mm512_loadu_ps(xp.add(k + i)),
                    _mm512_loadu_ps(xp.add(k + i + 16)),
                ]
            } else {
                [zero; 2]
            };
            for t in 0..take {
                let (w0, w1) = widen(wp.add(t * k + i));
                acc[0][t][0] = _mm512_fmadd_ps(x0[0], w0, acc[0][t][0]);
                acc[0][t][1] = _mm512_fmadd_ps(x0[1], w1, acc[0][t][1]);
                if rows == 2 {
                    acc[1][t][0] = _mm512_fmadd_ps(x1[0], w0, acc[1][t][0]);
                    acc[1][t][1] = _mm512_fmadd_ps(x1[1], w1, acc[1][t][1]);
                }
            }
            i += 32;
        }
        for r in 0..rows {
            for t in 0..take {
                results[r][t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][t][0], acc[r][t][1]));
            }
        }
    }
}
