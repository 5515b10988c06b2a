//! MXFP4 matrices (gpt-oss's experts) read as the checkpoint stores them: per row of `k`
//! weights, `k / 2` bytes of FP4 E2M1 codes (byte `b` holds weight `2b` in its low nibble
//! and `2b + 1` in its high one) and `k / 32` E8M0 exponents, one per block of 32
//! weights: `w = fp4(code) * 2^(e - 127)`. Every such product is exact in f32 and in
//! bf16 (an E2M1 value has two significant bits), so the dequantization is bit for bit
//! transformers' (`transformers.integrations.mxfp4`).
//!
//! A GEMV for a few bf16 activation rows (a decode step's: each weight row decoded once
//! for all of them, per block `2^(e - 127) * sum(fp4 * x)` in f32), portable and built for
//! AVX2 + FMA, and a dequantization (bf16 or f32) for larger batches.

use crate::attention::{KernelError, Parallel};
use crate::element::{Bf16, Element};

/// Weights per E8M0 exponent.
pub const MXFP4_BLOCK: usize = 32;
/// Most activation rows one GEMV call takes.
pub const MXFP4_MAX_ROWS: usize = 8;
/// Output rows per part below which a call is not split.
const MIN_ROWS_PER_PART: usize = 32;

/// The E2M1 values of the 16 codes.
const FP4: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// An `n` x `k` MXFP4 matrix: `packed` `[n, k / 2]` codes, `scale` `[n, k / 32]` exponents.
#[derive(Clone, Copy)]
pub struct Mxfp4<'a> {
    pub packed: &'a [u8],
    pub scale: &'a [u8],
}

/// `2^(e - 127)` in f32 (subnormal for `e` 0; 2^128 overflows to infinity for 255, as
/// `torch.ldexp` gives).
#[inline(always)]
fn exponent(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::INFINITY,
        e => f32::from_bits(u32::from(e) << 23),
    }
}

impl<'a> Mxfp4<'a> {
    /// Whether this holds `n` x `k` weights (`k` a positive multiple of 32).
    pub fn fits(&self, n: usize, k: usize) -> bool {
        k > 0
            && k.is_multiple_of(MXFP4_BLOCK)
            && self.packed.len() == n * k / 2
            && self.scale.len() == n * k / MXFP4_BLOCK
    }

    /// Rows `lo..hi` of a matrix of `k`-weight rows.
    pub fn rows(&self, lo: usize, hi: usize, k: usize) -> Mxfp4<'a> {
        let blocks = k / MXFP4_BLOCK;
        Mxfp4 {
            packed: &self.packed[lo * k / 2..hi * k / 2],
            scale: &self.scale[lo * blocks..hi * blocks],
        }
    }

    /// Weight `j` of row `row`, dequantized.
    pub fn weight(&self, row: usize, j: usize, k: usize) -> f32 {
        let byte = self.packed[row * k / 2 + j / 2];
        let code = if j.is_multiple_of(2) {
            byte & 15
        } else {
            byte >> 4
        };
        FP4[code as usize] * exponent(self.scale[row * (k / MXFP4_BLOCK) + j / MXFP4_BLOCK])
    }

    /// Row `row` dequantized into `dst` (`k` values).
    #[inline(always)]
    fn row_into<T: Element>(&self, row: usize, k: usize, dst: &mut [T]) {
        let blocks = k / MXFP4_BLOCK;
        let packed = &self.packed[row * k / 2..(row + 1) * k / 2];
        let scale = &self.scale[row * blocks..(row + 1) * blocks];
        for ((d, p), &e) in dst
            .chunks_exact_mut(MXFP4_BLOCK)
            .zip(packed.chunks_exact(MXFP4_BLOCK / 2))
            .zip(scale)
        {
            let s = exponent(e);
            for (pair, &byte) in d.chunks_exact_mut(2).zip(p) {
                pair[0] = T::from_f32(FP4[(byte & 15) as usize] * s);
                pair[1] = T::from_f32(FP4[(byte >> 4) as usize] * s);
            }
        }
    }
}

/// Which implementation runs a call (`Auto`: AVX2 + FMA where the CPU has them).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mxfp4Path {
    Auto,
    Portable,
    Avx2,
}

impl Mxfp4Path {
    pub fn available(self) -> bool {
        match self {
            Mxfp4Path::Auto | Mxfp4Path::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Mxfp4Path::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Mxfp4Path::Avx2 => false,
        }
    }
}

/// `out[r][i] = sum_j x[r][j] * W[i][j] (+ bias[i])` for `rows` (1 to [`MXFP4_MAX_ROWS`])
/// bf16 rows `x` `[rows, k]`; `out` `[rows, n]` bf16, rounded once from the f32 sum.
#[allow(clippy::too_many_arguments)]
pub fn gemv_mxfp4(
    out: &mut [Bf16],
    x: &[Bf16],
    weight: Mxfp4<'_>,
    bias: Option<&[Bf16]>,
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    gemv_mxfp4_on(
        Mxfp4Path::Auto,
        out,
        x,
        weight,
        bias,
        rows,
        n,
        k,
        threads,
        parallel,
    )
}

/// [`gemv_mxfp4`] on a given path; an error if this CPU cannot run it.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn gemv_mxfp4_on(
    path: Mxfp4Path,
    out: &mut [Bf16],
    x: &[Bf16],
    weight: Mxfp4<'_>,
    bias: Option<&[Bf16]>,
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    if !path.available() {
        return Err(KernelError(format!("{path:?} cannot run here")));
    }
    if !weight.fits(n, k)
        || !(1..=MXFP4_MAX_ROWS).contains(&rows)
        || x.len() != rows * k
        || out.len() != rows * n
        || bias.is_some_and(|b| b.len() != n)
    {
        return Err(KernelError(format!(
            "gemv_mxfp4: buffers do not fit {rows} rows of {k} by {n} (k a multiple of 32, \
             at most {MXFP4_MAX_ROWS} rows)"
        )));
    }
    let avx2 = match path {
        Mxfp4Path::Auto => Mxfp4Path::Avx2.available(),
        p => p == Mxfp4Path::Avx2,
    };
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let parts = (n / MIN_ROWS_PER_PART).clamp(1, threads.max(1));
    let out_addr = out.as_mut_ptr() as usize;
    let task = |part: usize| {
        let (lo, hi) = (n * part / parts, n * (part + 1) / parts);
        let mut sums = [0f32; MXFP4_MAX_ROWS];
        for i in lo..hi {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: AVX2 and FMA were detected; shapes checked above.
                unsafe { row_dots_avx2(&weight, i, k, &xf, rows, &mut sums) };
            } else {
                row_dots::<false>(&weight, i, k, &xf, rows, &mut sums);
            }
            #[cfg(not(target_arch = "x86_64"))]
            row_dots::<false>(&weight, i, k, &xf, rows, &mut sums);
            let b = bias.map_or(0.0, |b| b[i].to_f32());
            for (r, s) in sums.iter().enumerate().take(rows) {
                // SAFETY: parts own disjoint column ranges [lo, hi) of each output row, and
                // `out` (rows * n elements) outlives the call.
                unsafe { *(out_addr as *mut Bf16).add(r * n + i) = Bf16::from_f32(s + b) };
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_dots_avx2(
    w: &Mxfp4<'_>,
    row: usize,
    k: usize,
    xf: &[f32],
    rows: usize,
    sums: &mut [f32; MXFP4_MAX_ROWS],
) {
    row_dots::<true>(w, row, k, xf, rows, sums);
}

/// Row `row` of `w` against each of the `rows` f32 activation rows `xf`: per block the
/// 32 codes decoded once, dotted with each row in 8 independent lanes (so the compiler
/// keeps them in vectors), scaled by the block's exponent.
#[inline(always)]
fn row_dots<const FMA: bool>(
    w: &Mxfp4<'_>,
    row: usize,
    k: usize,
    xf: &[f32],
    rows: usize,
    sums: &mut [f32; MXFP4_MAX_ROWS],
) {
    let blocks = k / MXFP4_BLOCK;
    let packed = &w.packed[row * k / 2..(row + 1) * k / 2];
    let scale = &w.scale[row * blocks..(row + 1) * blocks];
    let mut acc = [0f32; MXFP4_MAX_ROWS];
    let mut values = [0f32; MXFP4_BLOCK];
    for (b, (p, &e)) in packed.chunks_exact(MXFP4_BLOCK / 2).zip(scale).enumerate() {
        for (pair, &byte) in values.chunks_exact_mut(2).zip(p) {
            pair[0] = FP4[(byte & 15) as usize];
            pair[1] = FP4[(byte >> 4) as usize];
        }
        let s = exponent(e);
        for (r, a) in acc.iter_mut().enumerate().take(rows) {
            let x = &xf[r * k + b * MXFP4_BLOCK..r * k + (b + 1) * MXFP4_BLOCK];
            let mut lanes = [0f32; 8];
            for (v, xs) in values.chunks_exact(8).zip(x.chunks_exact(8)) {
                for l in 0..8 {
                    lanes[l] = if FMA {
                        v[l].mul_add(xs[l], lanes[l])
                    } else {
                        lanes[l] + v[l] * xs[l]
                    };
                }
            }
            let dot = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
                + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
            *a = if FMA {
                dot.mul_add(s, *a)
            } else {
                *a + dot * s
            };
        }
    }
    sums[..rows].copy_from_slice(&acc[..rows]);
}

/// The whole matrix as `T` (bf16 or f32) `[n, k]`, split by rows over `parallel`.
pub fn dequantize_mxfp4<T: Element>(
    out: &mut [T],
    weight: Mxfp4<'_>,
    n: usize,
    k: usize,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    if !weight.fits(n, k) || out.len() != n * k {
        return Err(KernelError(format!(
            "dequantize_mxfp4: buffers do not fit {n} x {k} (k a multiple of 32)"
        )));
    }
    let parts = (n / (4 * MIN_ROWS_PER_PART)).clamp(1, threads.max(1));
    let out_addr = out.as_mut_ptr() as usize;
    let task = |part: usize| {
        let (lo, hi) = (n * part / parts, n * (part + 1) / parts);
        // SAFETY: parts own disjoint row ranges of `out`, which outlives the call.
        let dst = unsafe {
            std::slice::from_raw_parts_mut((out_addr as *mut T).add(lo * k), (hi - lo) * k)
        };
        for (row, d) in (lo..hi).zip(dst.chunks_exact_mut(k)) {
            weight.row_into(row, k, d);
        }
    };
    if parts == 1 {
        task(0);
    } else {
        parallel.run(parts, &task);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::ScopedThreads;

    fn matrix(n: usize, k: usize, seed: u64) -> (Vec<u8>, Vec<u8>) {
        let mut s = seed;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let packed = (0..n * k / 2).map(|_| next() as u8).collect();
        // Exponents around 1 (e = 127), and the extremes a checkpoint could hold.
        let scale = (0..n * k / MXFP4_BLOCK)
            .map(|i| match i % 17 {
                0 => 1,
                1 => 0,
                _ => 118 + (next() % 14) as u8,
            })
            .collect();
        (packed, scale)
    }

    #[test]
    fn weights_are_the_codes_times_the_exponents() {
        // Low nibble first: codes 0xf, 0x7, then 0x8, 0x1; exponents 2^0 and 2^-127.
        let packed: Vec<u8> = [0x7fu8, 0x18].into_iter().chain([0; 30]).collect();
        let m = Mxfp4 {
            packed: &packed,
            scale: &[127, 0],
        };
        let k = 64;
        assert_eq!(m.weight(0, 0, k), -6.0);
        assert_eq!(m.weight(0, 1, k), 6.0);
        assert_eq!(m.weight(0, 2, k).to_bits(), (-0.0f32).to_bits());
        assert_eq!(m.weight(0, 3, k), 0.5);
        assert_eq!(exponent(0), 2f32.powi(-127));
        assert_eq!(exponent(128), 2.0);
    }

    #[test]
    fn gemv_matches_a_float64_product_on_both_paths() {
        let (n, k) = (70, 96);
        let (packed, scale) = matrix(n, k, 0x9e37);
        let m = Mxfp4 {
            packed: &packed,
            scale: &scale,
        };
        let mut s = 1u64;
        let bias: Vec<Bf16> = (0..n)
            .map(|i| Bf16::from_f32(i as f32 * 0.01 - 0.3))
            .collect();
        for rows in [1, 3, 8] {
            let x: Vec<Bf16> = (0..rows * k)
                .map(|_| {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                    Bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
                })
                .collect();
            for path in [Mxfp4Path::Portable, Mxfp4Path::Avx2] {
                if !path.available() {
                    continue;
                }
                for threads in [1, 3] {
                    let mut out = vec![Bf16::from_f32(0.0); rows * n];
                    gemv_mxfp4_on(
                        path,
                        &mut out,
                        &x,
                        m,
                        Some(&bias),
                        rows,
                        n,
                        k,
                        threads,
                        &ScopedThreads,
                    )
                    .unwrap();
                    for r in 0..rows {
                        for i in 0..n {
                            let want: f64 = (0..k)
                                .map(|j| {
                                    f64::from(x[r * k + j].to_f32()) * f64::from(m.weight(i, j, k))
                                })
                                .sum::<f64>()
                                + f64::from(bias[i].to_f32());
                            let got = f64::from(out[r * n + i].to_f32());
                            // One bf16 rounding of the f32 sum.
                            let tol = want.abs() / 128.0 + 1e-6 * (1.0 + want.abs());
                            assert!(
                                (got - want).abs() <= tol,
                                "{path:?} {r},{i}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn dequantization_is_exact_in_f32_and_bf16() {
        let (n, k) = (9, 64);
        let (packed, scale) = matrix(n, k, 77);
        let m = Mxfp4 {
            packed: &packed,
            scale: &scale,
        };
        let mut f = vec![0f32; n * k];
        let mut b = vec![Bf16::from_f32(0.0); n * k];
        dequantize_mxfp4(&mut f, m, n, k, 2, &ScopedThreads).unwrap();
        dequantize_mxfp4(&mut b, m, n, k, 2, &ScopedThreads).unwrap();
        for row in 0..n {
            for j in 0..k {
                let w = m.weight(row, j, k);
                assert_eq!(f[row * k + j].to_bits(), w.to_bits());
                assert_eq!(b[row * k + j].to_f32().to_bits(), w.to_bits());
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let (packed, scale) = matrix(4, 64, 3);
        let m = Mxfp4 {
            packed: &packed,
            scale: &scale,
        };
        let x = vec![Bf16::from_f32(0.0); 9 * 64];
        let mut out = vec![Bf16::from_f32(0.0); 9 * 4];
        assert!(gemv_mxfp4(&mut out, &x, m, None, 9, 4, 64, 1, &ScopedThreads).is_err());
        assert!(gemv_mxfp4(
            &mut out[..4],
            &x[..64],
            m,
            None,
            1,
            4,
            48,
            1,
            &ScopedThreads
        )
        .is_err());
        assert!(gemv_mxfp4(
            &mut out[..4],
            &x[..64],
            m,
            None,
            1,
            4,
            64,
            1,
            &ScopedThreads
        )
        .is_ok());
    }
}
