//! The int8 KV cache's kernels against plain float references: attention over the
//! dequantized rows in f64, and the store against the float store followed by the row
//! quantization.

use iron_batch_kernels::{
    dequantize_int8_row, int8_row_len, int8_row_scale, paged_decode_attention_int8,
    quantize_int8_row, rope_store_kv, rope_store_kv_int8, store_kv_int8, Bf16, DecodeShape,
    Element, ScopedThreads,
};

mod common;

use common::Rng;

struct Case {
    shape: DecodeShape,
    q: Vec<f32>,
    /// The float K/V the int8 caches were quantized from, `[slots * kv_heads, hd]`.
    k: Vec<f32>,
    v: Vec<f32>,
    k8: Vec<i8>,
    v8: Vec<i8>,
    tables: Vec<i32>,
    lens: Vec<i32>,
}

fn quantize_all(x: &[f32], hd: usize) -> Vec<i8> {
    let mut out = vec![0i8; x.len() / hd * int8_row_len(hd)];
    for (row, src) in out
        .chunks_exact_mut(int8_row_len(hd))
        .zip(x.chunks_exact(hd))
    {
        quantize_int8_row(row, src);
    }
    out
}

fn dequantize_all(x: &[i8], hd: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len() / int8_row_len(hd) * hd];
    for (dst, row) in out
        .chunks_exact_mut(hd)
        .zip(x.chunks_exact(int8_row_len(hd)))
    {
        dequantize_int8_row(dst, row);
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn case(
    rng: &mut Rng,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    lens: &[usize],
    window: usize,
) -> Case {
    let seqs = lens.len();
    let max_blocks = lens.iter().max().unwrap().div_ceil(block_size) + 1;
    let num_blocks = seqs * max_blocks + 2;
    let shape = DecodeShape {
        num_seqs: seqs,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        block_size,
        max_blocks,
        num_blocks,
        sliding_window: window,
    };
    let values = num_blocks * block_size * kv_heads * head_dim;
    // Distinct blocks in a shuffled order, so that a wrong table lookup shows.
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let lens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let tables: Vec<i32> = (0..seqs * max_blocks)
        .map(|i| {
            let (seq, b) = (i / max_blocks, i % max_blocks);
            if b * block_size < lens[seq] as usize {
                ids[i]
            } else {
                -3 // past the context: never read
            }
        })
        .collect();
    // Rows of very different magnitudes, as real keys have: the scale is per row.
    let k: Vec<f32> = (0..values)
        .map(|i| rng.unit() * (1.0 + (i / head_dim % 5) as f32 * 3.0))
        .collect();
    let v: Vec<f32> = (0..values).map(|_| rng.unit()).collect();
    Case {
        shape,
        q: (0..seqs * heads * head_dim).map(|_| rng.unit()).collect(),
        k8: quantize_all(&k, head_dim),
        v8: quantize_all(&v, head_dim),
        k,
        v,
        tables,
        lens,
    }
}

/// Attention in f64 over float K/V `[slots * kv_heads, hd]` (the plain reference).
fn reference(c: &Case, k: &[f32], v: &[f32], scale: f64, cap: f64) -> Vec<f32> {
    let s = c.shape;
    let (hd, group) = (s.head_dim, s.num_heads / s.num_kv_heads);
    let mut out = vec![0f32; c.q.len()];
    for seq in 0..s.num_seqs {
        let len = c.lens[seq] as usize;
        let start = if s.sliding_window > 0 && len > s.sliding_window {
            len - s.sliding_window
        } else {
            0
        };
        for head in 0..s.num_heads {
            let kvh = head / group;
            let qv = &c.q[(seq * s.num_heads + head) * hd..][..hd];
            let at = |p: usize| {
                let block = c.tables[seq * s.max_blocks + p / s.block_size] as usize;
                ((block * s.block_size + p % s.block_size) * s.num_kv_heads + kvh) * hd
            };
            let scores: Vec<f64> = (start..len)
                .map(|p| {
                    let dot: f64 = qv
                        .iter()
                        .zip(&k[at(p)..][..hd])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    let x = dot * scale;
                    if cap > 0.0 {
                        cap * (x / cap).tanh()
                    } else {
                        x
                    }
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let total: f64 = w.iter().sum();
            for d in 0..hd {
                let sum: f64 = (start..len)
                    .zip(&w)
                    .map(|(p, w)| w * v[at(p) + d] as f64)
                    .sum();
                out[(seq * s.num_heads + head) * hd + d] = (sum / total) as f32;
            }
        }
    }
    out
}

fn run(c: &Case, scale: f32, cap: f32, threads: usize) -> Vec<f32> {
    let mut out = vec![0f32; c.q.len()];
    paged_decode_attention_int8(
        &mut out,
        &c.q,
        &c.k8,
        &c.v8,
        &c.tables,
        &c.lens,
        &c.shape,
        scale,
        cap,
        threads,
        &ScopedThreads,
    )
    .unwrap();
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn attention_over_int8_rows_is_attention_over_their_dequantized_values() {
    let mut rng = Rng(0x5eed_1234);
    // (heads, kv heads, head_dim, block size, lengths, window, softcap)
    type Spec = (usize, usize, usize, usize, &'static [usize], usize, f32);
    let cases: [Spec; 5] = [
        (4, 4, 64, 16, &[1, 17, 100], 0, 0.0),
        (8, 2, 64, 16, &[33, 5, 160, 64], 0, 0.0),
        (6, 3, 48, 8, &[90, 7], 24, 0.0),
        (2, 1, 32, 4, &[13, 40], 0, 20.0),
        (4, 2, 128, 16, &[300], 64, 0.0),
    ];
    for (heads, kv_heads, hd, bs, lens, window, cap) in cases {
        let c = case(&mut rng, heads, kv_heads, hd, bs, lens, window);
        let scale = (hd as f32).powf(-0.5);
        let got = run(&c, scale, cap, 1);
        let (k, v) = (dequantize_all(&c.k8, hd), dequantize_all(&c.v8, hd));
        let want = reference(&c, &k, &v, scale as f64, cap as f64);
        let err = max_diff(&got, &want);
        assert!(err < 2e-5, "{heads}/{kv_heads} heads, hd {hd}: {err}");
    }
}

#[test]
fn int8_attention_stays_close_to_float_attention() {
    // The quantization error alone: against the float K/V the rows were made from.
    let mut rng = Rng(77);
    let c = case(&mut rng, 8, 2, 64, 16, &[200, 31, 64], 0);
    let scale = 0.125;
    let got = run(&c, scale, 0.0, 1);
    let want = reference(&c, &c.k, &c.v, scale as f64, 0.0);
    let err = max_diff(&got, &want);
    assert!(err < 2e-2, "int8 vs float attention: {err}");
    assert!(err > 0.0, "int8 rows should not be exact");
}

#[test]
fn split_calls_give_the_one_part_values() {
    let mut rng = Rng(99);
    let lens: Vec<usize> = (0..12).map(|i| 40 + i * 37).collect();
    let c = case(&mut rng, 8, 2, 64, 16, &lens, 0);
    let one = run(&c, 0.125, 0.0, 1);
    for threads in [2, 3, 8] {
        assert_eq!(run(&c, 0.125, 0.0, threads), one, "{threads} threads");
    }
}

#[test]
fn the_store_quantizes_what_the_float_store_writes() {
    let (heads, kv_heads, hd, rd, tokens, slots) = (4, 2, 32, 32, 3, 10);
    let mut rng = Rng(5);
    let bf = |x: f32| Bf16::from_f32(x);
    let qkv: Vec<Bf16> = (0..tokens * (heads + 2 * kv_heads) * hd)
        .map(|_| bf(rng.unit() * 3.0))
        .collect();
    let cos: Vec<Bf16> = (0..tokens * rd).map(|_| bf(rng.unit())).collect();
    let sin: Vec<Bf16> = (0..tokens * rd).map(|_| bf(rng.unit())).collect();
    let at: Vec<i64> = vec![7, 2, 9];
    let kv_row = kv_heads * hd;
    let (mut kf, mut vf) = (vec![bf(0.0); slots * kv_row], vec![bf(0.0); slots * kv_row]);
    let mut qf = vec![bf(0.0); tokens * heads * hd];
    rope_store_kv(
        &mut qf, &mut kf, &mut vf, &qkv, &cos, &sin, &at, heads, kv_heads, hd, rd,
    )
    .unwrap();
    let row = int8_row_len(hd);
    let (mut k8, mut v8) = (
        vec![9i8; slots * kv_heads * row],
        vec![9i8; slots * kv_heads * row],
    );
    let mut q8 = vec![bf(0.0); tokens * heads * hd];
    rope_store_kv_int8(
        &mut q8, &mut k8, &mut v8, &qkv, &cos, &sin, &at, heads, kv_heads, hd, rd,
    )
    .unwrap();
    assert_eq!(q8, qf, "the rotated queries are the float path's");
    let float = |x: &[Bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    for slot in 0..slots {
        let written = at.contains(&(slot as i64));
        for (float_cache, int8_cache) in [(&kf, &k8), (&vf, &v8)] {
            let got = &int8_cache[slot * kv_heads * row..][..kv_heads * row];
            if written {
                let want = quantize_all(&float(&float_cache[slot * kv_row..][..kv_row]), hd);
                assert_eq!(got, &want[..], "slot {slot}");
            } else {
                assert!(
                    got.iter().all(|&b| b == 9),
                    "slot {slot} was not to be touched"
                );
            }
        }
    }
    // Each written row's scale is its largest magnitude over 127.
    let first = &k8[7 * kv_heads * row..][..row];
    let amax = float(&kf[7 * kv_row..][..hd])
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()));
    assert_eq!(int8_row_scale(first), amax / 127.0);
}

#[test]
fn bad_calls_are_refused_and_write_nothing() {
    let (kv_heads, hd) = (2, 16);
    let row = int8_row_len(hd);
    let (mut k8, mut v8) = (vec![1i8; 4 * kv_heads * row], vec![1i8; 4 * kv_heads * row]);
    let k = vec![0.5f32; 2 * kv_heads * hd];
    let err = store_kv_int8(&mut k8, &mut v8, &k, &k, &[1, 4], kv_heads, hd).unwrap_err();
    assert!(err.0.contains("slot 4"), "{}", err.0);
    assert!(k8.iter().chain(&v8).all(|&b| b == 1));
    let err = store_kv_int8(&mut k8, &mut v8, &k[1..], &k, &[0, 1], kv_heads, hd).unwrap_err();
    assert!(err.0.contains("inconsistent"), "{}", err.0);

    let mut rng = Rng(3);
    let c = case(&mut rng, 2, 1, 16, 4, &[5], 0);
    let mut out = vec![0f32; c.q.len()];
    let short = &c.k8[..c.k8.len() - 1];
    let err = paged_decode_attention_int8(
        &mut out,
        &c.q,
        short,
        &c.v8,
        &c.tables,
        &c.lens,
        &c.shape,
        1.0,
        0.0,
        1,
        &ScopedThreads,
    )
    .unwrap_err();
    assert!(err.0.contains("bytes"), "{}", err.0);
    let mut tables = c.tables.clone();
    tables[0] = c.shape.num_blocks as i32;
    let err = paged_decode_attention_int8(
        &mut out,
        &c.q,
        &c.k8,
        &c.v8,
        &tables,
        &c.lens,
        &c.shape,
        1.0,
        0.0,
        1,
        &ScopedThreads,
    )
    .unwrap_err();
    assert!(err.0.contains("block id"), "{}", err.0);
}
