//! Quantized GEMV and dequantization against a reference written from the documented
//! layouts (nibble pairs of neighbouring blocks; per-block scale and min), in f64.

use iron_batch_kernels::{
    dequantize_bf16, gemv_quant, q4_nibble, Bf16, BlockFormat, Blocks, Element, QMatrix,
    ScopedThreads, F16, MAX_ROWS, Q4, Q8, QBLOCK,
};

mod common;

use common::Rng;

struct Q4Data {
    packed: Vec<u8>,
    scale: Vec<F16>,
    min: Vec<F16>,
    /// The weights the GEMV reads, [n][k], from the q values drawn (not from the kernel
    /// crate): `scale * q + min` in f32, rounded to bf16.
    dense: Vec<f64>,
    /// The same in f32 (`scale * q + min`, one rounding each), as the kernels compute it.
    dense32: Vec<f32>,
}

fn q4(rng: &mut Rng, n: usize, k: usize) -> Q4Data {
    let blocks = k / QBLOCK;
    let scale: Vec<F16> = (0..n * blocks)
        .map(|_| F16::from_f32(rng.unit().abs() * 0.1 + 0.001))
        .collect();
    let min: Vec<F16> = (0..n * blocks)
        .map(|_| F16::from_f32(rng.unit() * 0.5))
        .collect();
    let mut packed = vec![0u8; n * k / 2];
    let mut dense = vec![0f64; n * k];
    let mut dense32 = vec![0f32; n * k];
    for row in 0..n {
        for j in 0..k {
            let q = (rng.next() % 16) as u8;
            let b = j / QBLOCK;
            let (at, high) = q4_nibble(j, k);
            packed[row * k / 2 + at] |= if high { q << 4 } else { q };
            let s = row * blocks + b;
            let (d, m) = (scale[s].to_f32(), min[s].to_f32());
            dense32[row * k + j] = d * f32::from(q) + m;
            dense[row * k + j] = f64::from(Bf16::from_f32(dense32[row * k + j]).to_f32());
        }
    }
    Q4Data {
        packed,
        scale,
        min,
        dense,
        dense32,
    }
}

fn reference(
    dense: &[f64],
    x: &[Bf16],
    bias: Option<&[Bf16]>,
    rows: usize,
    n: usize,
    k: usize,
) -> Vec<f64> {
    let mut out = vec![0f64; rows * n];
    for r in 0..rows {
        for i in 0..n {
            let mut s: f64 = (0..k)
                .map(|j| f64::from(x[r * k + j].to_f32()) * dense[i * k + j])
                .sum();
            s += bias.map_or(0.0, |b| f64::from(b[i].to_f32()));
            out[r * n + i] = s;
        }
    }
    out
}

fn activations(rng: &mut Rng, len: usize) -> Vec<Bf16> {
    (0..len).map(|_| Bf16::from_f32(rng.unit() * 2.0)).collect()
}

/// bf16 output: one rounding of the f32 sum, so a relative error of 2^-8 plus f32 slack.
fn assert_close(got: &[Bf16], want: &[f64], scale: f64) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = f64::from(g.to_f32());
        let tol = w.abs() / 128.0 + 1e-4 * scale;
        assert!((g - w).abs() <= tol, "element {i}: {g} vs {w} (tol {tol})");
    }
}

#[test]
fn q4_layout_gives_every_weight_its_own_nibble() {
    // Rows of 2, 4, 6 and 18 blocks: only pairs, whole fours, and fours plus a pair.
    for k in [64, 128, 192, 576] {
        let mut seen = vec![[false; 2]; k / 2];
        for j in 0..k {
            let (at, high) = q4_nibble(j, k);
            assert!(
                !seen[at][usize::from(high)],
                "k {k}: weight {j} shares a nibble"
            );
            seen[at][usize::from(high)] = true;
        }
    }
}

#[test]
fn q4_gemv_matches_dequantized_reference_for_any_row_count() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for k in [192, 256] {
        q4_gemv_case(&mut rng, 130, k);
    }
}

fn q4_gemv_case(rng: &mut Rng, n: usize, k: usize) {
    let data = q4(rng, n, k);
    let weight = QMatrix::Q4(Q4 {
        packed: &data.packed,
        scale: &data.scale,
        min: &data.min,
    });
    let bias: Vec<Bf16> = activations(rng, n);
    for rows in [1, 2, 3, 4, 5, 8, 9, 13] {
        for threads in [1, 3] {
            let x = activations(rng, rows * k);
            let mut out = vec![Bf16(0); rows * n];
            gemv_quant(
                &mut out,
                &x,
                weight,
                Some(&bias),
                rows,
                n,
                k,
                threads,
                &ScopedThreads,
            )
            .unwrap();
            let want = reference(&data.dense, &x, Some(&bias), rows, n, k);
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            assert_close(&out, &want, scale);
        }
    }
}

#[test]
fn q8_gemv_matches_dequantized_reference() {
    let mut rng = Rng(12345);
    let (n, k) = (70, 96);
    let blocks = k / QBLOCK;
    let quants: Vec<i8> = (0..n * k).map(|_| (rng.next() % 255) as i8).collect();
    let scale: Vec<F16> = (0..n * blocks)
        .map(|_| F16::from_f32(rng.unit().abs() * 0.01 + 1e-4))
        .collect();
    let dense: Vec<f64> = (0..n * k)
        .map(|i| {
            let d = scale[(i / k) * blocks + (i % k) / QBLOCK].to_f32();
            f64::from(Bf16::from_f32(d * f32::from(quants[i])).to_f32())
        })
        .collect();
    let weight = QMatrix::Q8(Q8 {
        quants: &quants,
        scale: &scale,
    });
    for rows in [1, 4, 6, 8, 9, 13] {
        let x = activations(&mut rng, rows * k);
        let mut out = vec![Bf16(0); rows * n];
        gemv_quant(&mut out, &x, weight, None, rows, n, k, 2, &ScopedThreads).unwrap();
        let want = reference(&dense, &x, None, rows, n, k);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        assert_close(&out, &want, scale);
    }
}

#[test]
fn dequantize_gives_every_weight_rounded_to_bf16() {
    let mut rng = Rng(777);
    let (n, k) = (65, 128);
    let data = q4(&mut rng, n, k);
    let weight = QMatrix::Q4(Q4 {
        packed: &data.packed,
        scale: &data.scale,
        min: &data.min,
    });
    let mut out = vec![Bf16(0); n * k];
    dequantize_bf16(&mut out, weight, n, k, 2, &ScopedThreads).unwrap();
    for (i, (g, w)) in out.iter().zip(&data.dense32).enumerate() {
        assert_eq!(*g, Bf16::from_f32(*w), "weight {i}");
    }
}

#[test]
fn shapes_that_do_not_fit_are_errors_not_reads_out_of_bounds() {
    let packed = vec![0u8; 4 * 32];
    let scale = vec![F16(0); 8];
    let weight = QMatrix::Q4(Q4 {
        packed: &packed,
        scale: &scale,
        min: &scale,
    });
    let x = vec![Bf16(0); 64];
    let mut out = vec![Bf16(0); 4];
    // k = 64 fits; k = 32 is not a whole pair of blocks; a short x is refused.
    assert!(gemv_quant(&mut out, &x, weight, None, 1, 4, 64, 1, &ScopedThreads).is_ok());
    let q32 = QMatrix::Q4(Q4 {
        packed: &packed[..64],
        scale: &scale[..4],
        min: &scale[..4],
    });
    assert!(gemv_quant(&mut out, &x[..32], q32, None, 1, 4, 32, 1, &ScopedThreads).is_err());
    assert!(gemv_quant(
        &mut out,
        &x[..63],
        weight,
        None,
        1,
        4,
        64,
        1,
        &ScopedThreads
    )
    .is_err());
    let mut short = vec![Bf16(0); 3 * 64];
    assert!(dequantize_bf16(&mut short, weight, 4, 64, 1, &ScopedThreads).is_err());
}

/// A row's output is the same, bit for bit, whichever rows share the call, in every
/// quantized layout: a speculative step verifies its proposals as rows beside the decode
/// row, and must give what a one-row decode gives. The row counts cover one pass over the
/// weights ([`MAX_ROWS`] rows), several, and a last pass of every size.
#[test]
fn quantized_rows_do_not_depend_on_the_rows_beside_them() {
    let mut rng = Rng(4242);
    let (n, k) = (70, 512);
    let q4 = q4(&mut rng, n, k);
    let quants: Vec<i8> = (0..n * k).map(|_| (rng.next() % 255) as i8).collect();
    let q8_scale: Vec<F16> = (0..n * k / QBLOCK)
        .map(|_| F16::from_f32(rng.unit().abs() * 0.01 + 1e-4))
        .collect();
    // GGUF blocks of every format: random bytes, with small finite f16 scales.
    let blocks: Vec<(BlockFormat, Vec<u8>)> = BlockFormat::ALL
        .iter()
        .map(|&f| {
            let mut data: Vec<u8> = (0..f.row_bytes(k) * n).map(|_| rng.next() as u8).collect();
            let halves: &[usize] = match f {
                BlockFormat::Q4K | BlockFormat::Q5K | BlockFormat::Q5_1 | BlockFormat::Q4_1 => {
                    &[0, 2]
                }
                BlockFormat::Q6K => &[208],
                BlockFormat::Q5_0 | BlockFormat::Q8_0 => &[0],
            };
            for block in data.chunks_exact_mut(f.bytes()) {
                for &at in halves {
                    let v = F16::from_f32(0.002 + rng.unit().abs() * 0.01);
                    block[at..at + 2].copy_from_slice(&v.0.to_le_bytes());
                }
            }
            (f, data)
        })
        .collect();
    let mut layouts = vec![
        (
            "q4".to_string(),
            QMatrix::Q4(Q4 {
                packed: &q4.packed,
                scale: &q4.scale,
                min: &q4.min,
            }),
        ),
        (
            "q8".to_string(),
            QMatrix::Q8(Q8 {
                quants: &quants,
                scale: &q8_scale,
            }),
        ),
    ];
    for (f, data) in &blocks {
        layouts.push((
            f.name().to_string(),
            QMatrix::Blocks(Blocks::new(*f, n, data)),
        ));
    }
    let most = 3 * MAX_ROWS + 3;
    let x = activations(&mut rng, most * k);
    for (name, weight) in layouts {
        let run = |rows: usize| {
            let mut out = vec![Bf16(0); rows * n];
            gemv_quant(
                &mut out,
                &x[..rows * k],
                weight,
                None,
                rows,
                n,
                k,
                2,
                &ScopedThreads,
            )
            .unwrap();
            out
        };
        let together = run(most);
        for rows in 1..most {
            let got = run(rows);
            for r in 0..rows {
                assert!(
                    got[r * n..(r + 1) * n] == together[r * n..(r + 1) * n],
                    "{name}: row {r} of {rows} differs from the same row among {most}"
                );
            }
        }
    }
}
