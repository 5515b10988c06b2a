//! Paged decode attention with attention sinks (gpt-oss) against a float64 reference: per
//! head a logit in the softmax's denominator, in full and sliding-window layers, on the
//! portable and AVX2 paths (the AVX-512 ones take no sinks and say so).

use iron_batch_kernels::{
    paged_decode_attention_sinks_on, AttentionPath, Bf16, DecodeShape, Element, ScopedThreads,
};

mod common;

use common::Rng;

struct Case {
    shape: DecodeShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    tables: Vec<i32>,
    lens: Vec<i32>,
}

fn case(rng: &mut Rng, heads: usize, kv_heads: usize, lens: &[usize], window: usize) -> Case {
    let (head_dim, block_size) = (64, 4);
    let max_blocks = lens.iter().max().unwrap().div_ceil(block_size);
    let num_blocks = lens.len() * max_blocks;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let cache = num_blocks * block_size * kv_heads * head_dim;
    Case {
        shape: DecodeShape {
            num_seqs: lens.len(),
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            block_size,
            max_blocks,
            num_blocks,
            sliding_window: window,
        },
        q: (0..lens.len() * heads * head_dim)
            .map(|_| rng.unit())
            .collect(),
        k: (0..cache).map(|_| rng.unit() * 2.0).collect(),
        v: (0..cache).map(|_| rng.unit()).collect(),
        tables: ids,
        lens: lens.iter().map(|&l| l as i32).collect(),
    }
}

/// float64: `sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m))` per head.
fn reference(c: &Case, sinks: &[f32], scale: f64) -> Vec<f64> {
    let s = c.shape;
    let (hd, group) = (s.head_dim, s.num_heads / s.num_kv_heads);
    let mut out = vec![0f64; c.q.len()];
    for seq in 0..s.num_seqs {
        let len = c.lens[seq] as usize;
        let start = if s.sliding_window > 0 && len > s.sliding_window {
            len - s.sliding_window
        } else {
            0
        };
        for head in 0..s.num_heads {
            let at = |pos: usize| {
                let block = c.tables[seq * s.max_blocks + pos / s.block_size] as usize;
                ((block * s.block_size + pos % s.block_size) * s.num_kv_heads + head / group) * hd
            };
            let q = &c.q[(seq * s.num_heads + head) * hd..][..hd];
            let scores: Vec<f64> = (start..len)
                .map(|p| {
                    let k = &c.k[at(p)..][..hd];
                    q.iter()
                        .zip(k)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let sink = f64::from(sinks[head]);
            let max = scores.iter().copied().fold(sink, f64::max);
            let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let total = weights.iter().sum::<f64>() + (sink - max).exp();
            for d in 0..hd {
                let sum: f64 = (start..len)
                    .zip(&weights)
                    .map(|(p, w)| w * f64::from(c.v[at(p) + d]))
                    .sum();
                out[(seq * s.num_heads + head) * hd + d] = sum / total;
            }
        }
    }
    out
}

fn run<T: Element>(
    path: AttentionPath,
    c: &Case,
    sinks: Option<&[f32]>,
) -> Result<Vec<f32>, String> {
    let cast = |x: &[f32]| x.iter().map(|&v| T::from_f32(v)).collect::<Vec<T>>();
    let mut out = vec![T::from_f32(0.0); c.q.len()];
    paged_decode_attention_sinks_on(
        path,
        &mut out,
        &cast(&c.q),
        &cast(&c.k),
        &cast(&c.v),
        &c.tables,
        &c.lens,
        &c.shape,
        0.125,
        0.0,
        sinks,
        2,
        &ScopedThreads,
    )
    .map_err(|e| e.0)?;
    Ok(out.iter().map(|x| x.to_f32()).collect())
}

fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| Bf16::from_f32(v).to_f32()).collect()
}

#[test]
fn sinks_join_each_heads_softmax_on_the_portable_and_avx2_paths() {
    let mut rng = Rng(0x51_4b);
    // Sinks far above the scores (most of the weight goes to the sink), among them, and
    // far below (no effect).
    let sinks = [6.0f32, -1.0, 0.3, -40.0, 2.5, 0.0, -3.0, 9.0];
    for (heads, kv_heads, lens, window) in [
        (8, 2, vec![1, 7, 30], 0),
        (8, 8, vec![13, 2, 40], 5),
        (8, 1, vec![3, 17], 6),
    ] {
        let c = case(&mut rng, heads, kv_heads, &lens, window);
        let want = reference(&c, &sinks, 0.125);
        let bf16_case = Case {
            q: round_bf16(&c.q),
            k: round_bf16(&c.k),
            v: round_bf16(&c.v),
            tables: c.tables.clone(),
            lens: c.lens.clone(),
            shape: c.shape,
        };
        let want_bf16 = reference(&bf16_case, &sinks, 0.125);
        for path in [
            AttentionPath::Auto,
            AttentionPath::Portable,
            AttentionPath::Avx2,
        ] {
            if !path.available::<f32>(64) {
                continue;
            }
            let got = run::<f32>(path, &c, Some(&sinks)).unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!((f64::from(*g) - w).abs() < 2e-6, "f32 {path:?}: {g} vs {w}");
            }
            let got = run::<Bf16>(path, &bf16_case, Some(&sinks)).unwrap();
            for (g, w) in got.iter().zip(&want_bf16) {
                let tol = w.abs() / 128.0 + 1e-5;
                assert!(
                    (f64::from(*g) - w).abs() <= tol,
                    "bf16 {path:?}: {g} vs {w}"
                );
            }
        }
        // Without sinks the same call is the plain softmax, which differs.
        let plain = run::<f32>(AttentionPath::Portable, &c, None).unwrap();
        let err = plain
            .iter()
            .zip(&want)
            .map(|(g, w)| (f64::from(*g) - w).abs())
            .fold(0.0, f64::max);
        assert!(err > 1e-3, "the sinks change nothing here");
    }
}

#[test]
fn bad_sinks_and_avx512_paths_are_refused() {
    let mut rng = Rng(7);
    let c = case(&mut rng, 4, 2, &[5], 0);
    assert!(run::<f32>(AttentionPath::Portable, &c, Some(&[0.0; 3])).is_err());
    assert!(run::<f32>(
        AttentionPath::Portable,
        &c,
        Some(&[0.0, f32::NAN, 0.0, 0.0])
    )
    .is_err());
    for path in [AttentionPath::Avx512, AttentionPath::Avx512Bf16] {
        assert!(run::<Bf16>(path, &c, Some(&[0.0; 4])).is_err(), "{path:?}");
    }
}
