//! The kernels against plain references. Paged decode attention: gather each sequence's context by its
//! block table, softmax in f64, weighted sum of values.

use std::sync::Mutex;

use iron_batch_kernels::{
    paged_decode_attention, paged_decode_attention_on, run_in_team, AttentionPath, Bf16,
    DecodeShape, Element, Parallel, ScopedThreads,
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

fn case(rng: &mut Rng, seqs: usize, heads: usize, kv_heads: usize, window: usize) -> Case {
    let lens: Vec<usize> = (0..seqs).map(|_| 1 + rng.below(9 * 16)).collect();
    case_with(rng, heads, kv_heads, 64, 16, &lens, window)
}

/// A case with the given row width, block size and context lengths; the tables are as wide
/// as the longest context needs, plus one.
fn case_with(
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
    let num_blocks = seqs * max_blocks + 3;
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
    let cache = num_blocks * block_size * kv_heads * head_dim;
    // Every sequence gets distinct blocks in a shuffled order, so a wrong table lookup shows.
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let lens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    // Unused table entries hold garbage the kernel must never follow.
    let tables: Vec<i32> = (0..seqs * max_blocks)
        .map(|i| {
            let (seq, b) = (i / max_blocks, i % max_blocks);
            if b * block_size < lens[seq] as usize {
                ids[i]
            } else {
                -7
            }
        })
        .collect();
    Case {
        shape,
        q: (0..seqs * heads * head_dim).map(|_| rng.unit()).collect(),
        k: (0..cache).map(|_| rng.unit() * 2.0).collect(),
        v: (0..cache).map(|_| rng.unit()).collect(),
        tables,
        lens,
    }
}

fn reference(c: &Case, q: &[f32], k: &[f32], v: &[f32], scale: f32) -> Vec<f32> {
    reference_capped(c, q, k, v, scale, 0.0)
}

/// The reference with each score soft-capped (`cap * tanh(score / cap)`; 0: off).
fn reference_capped(c: &Case, q: &[f32], k: &[f32], v: &[f32], scale: f32, cap: f64) -> Vec<f32> {
    let s = c.shape;
    let (hd, group) = (s.head_dim, s.num_heads / s.num_kv_heads);
    let mut out = vec![0f32; q.len()];
    for seq in 0..s.num_seqs {
        let len = c.lens[seq] as usize;
        let start = if s.sliding_window > 0 && len > s.sliding_window {
            len - s.sliding_window
        } else {
            0
        };
        for head in 0..s.num_heads {
            let kvh = head / group;
            let qv = &q[(seq * s.num_heads + head) * hd..][..hd];
            let at = |pos: usize| {
                let block = c.tables[seq * s.max_blocks + pos / s.block_size] as usize;
                ((block * s.block_size + pos % s.block_size) * s.num_kv_heads + kvh) * hd
            };
            let scores: Vec<f64> = (start..len)
                .map(|p| {
                    let kv = &k[at(p)..][..hd];
                    qv.iter()
                        .zip(kv)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .map(|x| if cap > 0.0 { cap * (x / cap).tanh() } else { x })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for d in 0..hd {
                let sum: f64 = (start..len)
                    .zip(&weights)
                    .map(|(p, w)| w * v[at(p) + d] as f64)
                    .sum();
                out[(seq * s.num_heads + head) * hd + d] = (sum / total) as f32;
            }
        }
    }
    out
}

fn run<T: Element>(c: &Case, threads: usize) -> Vec<f32> {
    run_on::<T>(AttentionPath::Auto, c, 0.125, threads)
}

fn run_on<T: Element>(path: AttentionPath, c: &Case, scale: f32, threads: usize) -> Vec<f32> {
    run_capped::<T>(path, c, scale, 0.0, threads)
}

fn run_capped<T: Element>(
    path: AttentionPath,
    c: &Case,
    scale: f32,
    softcap: f32,
    threads: usize,
) -> Vec<f32> {
    let cast = |x: &[f32]| x.iter().map(|&v| T::from_f32(v)).collect::<Vec<T>>();
    let mut out = vec![T::from_f32(0.0); c.q.len()];
    paged_decode_attention_on(
        path,
        &mut out,
        &cast(&c.q),
        &cast(&c.k),
        &cast(&c.v),
        &c.tables,
        &c.lens,
        &c.shape,
        scale,
        softcap,
        threads,
        &ScopedThreads,
    )
    .unwrap();
    out.iter().map(|x| x.to_f32()).collect()
}

const PATHS: [AttentionPath; 4] = [
    AttentionPath::Portable,
    AttentionPath::Avx2,
    AttentionPath::Avx512,
    AttentionPath::Avx512Bf16,
];

fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| Bf16::from_f32(v).to_f32()).collect()
}

fn max_err(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn f32_matches_the_reference_for_mha_gqa_and_sliding_windows() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (seqs, heads, kv_heads, window) in [
        (1, 4, 4, 0),
        (5, 9, 3, 0),
        (7, 14, 2, 0),
        (64, 8, 1, 0),
        (6, 6, 2, 20),
        (3, 4, 2, 200),
    ] {
        let c = case(&mut rng, seqs, heads, kv_heads, window);
        let want = reference(&c, &c.q, &c.k, &c.v, 0.125);
        for threads in [1, 2, 5] {
            let got = run::<f32>(&c, threads);
            let err = max_err(&got, &want);
            assert!(
                err < 2e-5,
                "{seqs}x{heads}/{kv_heads} w{window} t{threads}: error {err}"
            );
        }
    }
}

#[test]
fn bf16_matches_the_reference_on_bf16_inputs() {
    let mut rng = Rng(42);
    let c = case(&mut rng, 33, 9, 3, 0);
    // The reference sees the same bf16-rounded inputs; only the output rounding differs.
    let round = |x: &[f32]| {
        x.iter()
            .map(|&v| Bf16::from_f32(v).to_f32())
            .collect::<Vec<_>>()
    };
    let want = reference(&c, &round(&c.q), &round(&c.k), &round(&c.v), 0.125);
    let got = run::<Bf16>(&c, 2);
    let err = max_err(&got, &want);
    assert!(err < 8e-3, "bf16 error {err}");
}

/// Every path this CPU has, for f32 and bf16, over the shapes the tiled bf16 path splits
/// differently: GQA groups of 1, 3, 5 (4 heads per value sweep, then 1), 7 and 8; rows of
/// 32, 64, 96 (an odd chunk) and 128 (80: the f32 vector paths only); blocks of 16 and of 5
/// (tiles of 16 keys across several blocks); contexts of 1 and around multiples of 16;
/// sliding windows that start inside a block; scores large enough to underflow e^x.
#[test]
fn every_path_matches_the_reference_over_tiles_blocks_groups_and_rows() {
    let mut rng = Rng(0x5eed);
    let mut checked = [0usize; 4];
    for (heads, kv_heads, head_dim, block_size, lens, window, scale) in [
        (4, 4, 64, 16, vec![1, 15, 16, 17], 0, 0.125),
        (9, 3, 64, 16, vec![208, 33, 31, 48], 0, 0.125),
        (14, 2, 64, 16, vec![208, 1, 100], 0, 0.125),
        (14, 2, 128, 5, vec![77, 16, 300], 0, 0.088),
        (9, 3, 128, 16, vec![129, 64], 50, 0.088),
        (10, 2, 96, 16, vec![40, 17], 0, 0.1),
        (8, 1, 32, 5, vec![63, 2], 21, 0.17),
        (6, 2, 80, 16, vec![45], 0, 0.11),
        (7, 1, 64, 16, vec![500, 3], 0, 2.0),
    ] {
        let c = case_with(
            &mut rng, heads, kv_heads, head_dim, block_size, &lens, window,
        );
        let want = reference(&c, &c.q, &c.k, &c.v, scale);
        let want_bf16 = reference(
            &c,
            &round_bf16(&c.q),
            &round_bf16(&c.k),
            &round_bf16(&c.v),
            scale,
        );
        for (i, path) in PATHS.into_iter().enumerate() {
            let what =
                format!("{path:?} {heads}/{kv_heads}x{head_dim} b{block_size} {lens:?} w{window}");
            if path.available::<f32>(head_dim) {
                let got = run_on::<f32>(path, &c, scale, 2);
                let err = max_err(&got, &want);
                assert!(err < 2e-5, "f32 {what}: error {err}");
                checked[i] += 1;
            }
            if path.available::<Bf16>(head_dim) {
                let got = run_on::<Bf16>(path, &c, scale, 2);
                // Within the output's rounding to bf16 (half a unit in the last place, 2^-9
                // relative) and a little more for the f32 sums.
                for (k, (g, w)) in got.iter().zip(&want_bf16).enumerate() {
                    let tol = w.abs() / 256.0 + 1e-5;
                    assert!(
                        (g - w).abs() <= tol,
                        "bf16 {what}: element {k}: {g} against {w}"
                    );
                }
                let one = run_on::<Bf16>(path, &c, scale, 1);
                assert_eq!(
                    one,
                    run_on::<Bf16>(path, &c, scale, 5),
                    "bf16 {what}: threads"
                );
                checked[i] += 1;
            }
        }
    }
    // The portable path runs everywhere; the tiled bf16 one wherever the CPU has AVX-512 BF16.
    assert!(checked[0] > 0);
    if AttentionPath::Avx512Bf16.available::<Bf16>(64) {
        assert_eq!(checked[3], 8, "the bf16 path skipped a case it should take");
    }
}

/// Soft-capped scores on every path this CPU has: scores up to ~10x the cap, so the cap
/// changes the weights a lot (an uncapped kernel fails by far more than the tolerance),
/// with a sliding window, GQA groups and tiles that end inside the context.
#[test]
fn every_path_soft_caps_the_scores() {
    let mut rng = Rng(0xcab);
    for (heads, kv_heads, head_dim, block_size, lens, window, scale, cap) in [
        (4, 2, 64, 16, vec![1, 15, 40], 0, 1.5, 5.0),
        (9, 3, 128, 5, vec![77, 33], 20, 1.0, 10.0),
        (8, 1, 32, 16, vec![63, 2], 0, 2.0, 3.0),
    ] {
        let c = case_with(
            &mut rng, heads, kv_heads, head_dim, block_size, &lens, window,
        );
        let rq = round_bf16(&c.q);
        let (rk, rv) = (round_bf16(&c.k), round_bf16(&c.v));
        let want = reference_capped(&c, &c.q, &c.k, &c.v, scale, f64::from(cap));
        let want_bf16 = reference_capped(&c, &rq, &rk, &rv, scale, f64::from(cap));
        let uncapped = reference(&c, &c.q, &c.k, &c.v, scale);
        assert!(
            max_err(&want, &uncapped) > 0.05,
            "the cap changes nothing here"
        );
        for path in PATHS {
            let what = format!("{path:?} {heads}/{kv_heads}x{head_dim} cap {cap}");
            if path.available::<f32>(head_dim) {
                let got = run_capped::<f32>(path, &c, scale, cap, 2);
                let err = max_err(&got, &want);
                assert!(err < 2e-5, "f32 {what}: error {err}");
            }
            if path.available::<Bf16>(head_dim) {
                let got = run_capped::<Bf16>(path, &c, scale, cap, 2);
                for (k, (g, w)) in got.iter().zip(&want_bf16).enumerate() {
                    let tol = w.abs() / 256.0 + 1e-5;
                    assert!(
                        (g - w).abs() <= tol,
                        "bf16 {what}: element {k}: {g} against {w}"
                    );
                }
            }
        }
    }
    // A negative or non-finite cap is refused.
    let c = case_with(&mut rng, 4, 2, 64, 16, &[5], 0);
    let mut out = vec![0f32; c.q.len()];
    for cap in [-1.0, f32::NAN, f32::INFINITY] {
        let r = paged_decode_attention(
            &mut out,
            &c.q,
            &c.k,
            &c.v,
            &c.tables,
            &c.lens,
            &c.shape,
            1.0,
            cap,
            1,
            &ScopedThreads,
        );
        assert!(r.is_err(), "cap {cap}");
    }
}

#[test]
fn paths_the_cpu_or_the_shape_rules_out_are_errors() {
    let mut rng = Rng(5);
    let c = case_with(&mut rng, 4, 2, 80, 16, &[20], 0);
    let mut out = vec![0f32; c.q.len()];
    // The tiled path takes bf16 rows of a multiple of 32 only.
    let r = paged_decode_attention_on(
        AttentionPath::Avx512Bf16,
        &mut out,
        &c.q,
        &c.k,
        &c.v,
        &c.tables,
        &c.lens,
        &c.shape,
        0.125,
        0.0,
        1,
        &ScopedThreads,
    );
    assert!(r.unwrap_err().0.contains("cannot run here"));
    assert!(!AttentionPath::Avx512Bf16.available::<Bf16>(80));
    assert!(!AttentionPath::Avx512Bf16.available::<f32>(64));
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let mut rng = Rng(7);
    let c = case(&mut rng, 40, 8, 2, 0);
    let one = run::<f32>(&c, 1);
    assert_eq!(one, run::<f32>(&c, 2));
    assert_eq!(one, run::<f32>(&c, 16));
}

#[test]
fn threads_already_waiting_split_one_sequence_with_the_same_results() {
    // One sequence of 160 positions, 3 kv heads: below the split size of a call that has
    // to wake threads, above that of threads already waiting (a team in its region).
    // Each part must still give exactly the values one thread gives.
    let mut rng = Rng(11);
    let c = case_with(&mut rng, 9, 3, 64, 16, &[160], 0);
    let cast = |x: &[f32]| x.iter().map(|&v| Bf16::from_f32(v)).collect::<Vec<Bf16>>();
    let (q, k, v) = (cast(&c.q), cast(&c.k), cast(&c.v));
    for path in PATHS.into_iter().filter(|p| p.available::<Bf16>(64)) {
        let one = run_on::<Bf16>(path, &c, 0.125, 1);
        for waiting in [false, true] {
            let recorder = Recorder {
                waiting,
                calls: Mutex::new(Vec::new()),
            };
            let mut out = vec![Bf16::from_f32(0.0); c.q.len()];
            paged_decode_attention_on(
                path, &mut out, &q, &k, &v, &c.tables, &c.lens, &c.shape, 0.125, 0.0, 2, &recorder,
            )
            .unwrap();
            let got: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
            assert_eq!(got, one, "{path:?}, waiting {waiting}");
            let calls = recorder.calls.into_inner().unwrap();
            assert_eq!(calls, if waiting { vec![2] } else { vec![] }, "{path:?}");
        }
        // And in a real team.
        let mut out = vec![Bf16::from_f32(0.0); c.q.len()];
        run_in_team(2, &ScopedThreads, |team| {
            paged_decode_attention_on(
                path, &mut out, &q, &k, &v, &c.tables, &c.lens, &c.shape, 0.125, 0.0, 2, team,
            )
        })
        .unwrap();
        let got: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
        assert_eq!(got, one, "{path:?} in a team");
    }
}

/// Scoped threads that say whether they are `waiting` and record each call's part count.
struct Recorder {
    waiting: bool,
    calls: Mutex<Vec<usize>>,
}

impl Parallel for Recorder {
    fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync)) {
        self.calls.lock().unwrap().push(parts);
        ScopedThreads.run(parts, task)
    }

    fn waiting(&self) -> bool {
        self.waiting
    }
}

#[test]
fn bad_inputs_are_errors_and_write_nothing() {
    let mut rng = Rng(3);
    let c = case(&mut rng, 2, 4, 2, 0);
    let try_with = |tables: &[i32], lens: &[i32], shape: DecodeShape| {
        let mut out = vec![5.0f32; c.q.len()];
        let r = paged_decode_attention(
            &mut out,
            &c.q,
            &c.k,
            &c.v,
            tables,
            lens,
            &shape,
            1.0,
            0.0,
            1,
            &ScopedThreads,
        );
        assert!(out.iter().all(|&x| x == 5.0), "output touched on error");
        r.unwrap_err().0
    };
    let mut tables = c.tables.clone();
    tables[0] = c.shape.num_blocks as i32;
    assert!(try_with(&tables, &c.lens, c.shape).contains("block id"));
    tables[0] = -1;
    assert!(try_with(&tables, &c.lens, c.shape).contains("block id"));
    assert!(try_with(&c.tables, &[0, 5], c.shape).contains("length 0"));
    let too_long = (c.shape.max_blocks * c.shape.block_size + 1) as i32;
    assert!(try_with(&c.tables, &[too_long, 5], c.shape).contains("length"));
    assert!(try_with(
        &c.tables,
        &c.lens,
        DecodeShape {
            num_kv_heads: 3,
            ..c.shape
        }
    )
    .contains("multiple"));
    assert!(try_with(
        &c.tables,
        &c.lens,
        DecodeShape {
            num_blocks: 1,
            ..c.shape
        }
    )
    .contains("caches"));
    assert!(try_with(&c.tables[1..], &c.lens, c.shape).contains("block_tables"));
}

#[test]
fn gemv_matches_a_plain_product_for_any_number_of_rows() {
    use iron_batch_kernels::gemv_bf16;
    let mut rng = Rng(11);
    for (rows, n, k) in [
        (1, 700, 576),
        (1, 301, 96),
        (2, 1000, 64),
        (1, 3, 40),
        (2, 513, 96),
        (3, 300, 48),
        (5, 257, 160),
        (8, 600, 576),
        (7, 9, 40),
        // More rows than one pass takes: passes over cached chunks of weight rows, and
        // (at k 4112) blocks of activation rows.
        (9, 300, 48),
        (37, 513, 96),
        (130, 260, 576),
        (21, 40, 4112),
    ] {
        let x: Vec<Bf16> = (0..rows * k).map(|_| Bf16::from_f32(rng.unit())).collect();
        let w: Vec<Bf16> = (0..n * k).map(|_| Bf16::from_f32(rng.unit())).collect();
        let b: Vec<Bf16> = (0..n).map(|_| Bf16::from_f32(rng.unit())).collect();
        for threads in [1, 2, 3] {
            let mut out = vec![Bf16::default(); rows * n];
            gemv_bf16(
                &mut out,
                &x,
                &w,
                Some(&b),
                rows,
                n,
                k,
                threads,
                &ScopedThreads,
            )
            .unwrap();
            for r in 0..rows {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| x[r * k + i].to_f32() as f64 * w[j * k + i].to_f32() as f64)
                        .sum::<f64>()
                        + b[j].to_f32() as f64;
                    let got = out[r * n + j].to_f32() as f64;
                    // One bf16 rounding of the result (8 bits of mantissa), plus f32 sums.
                    assert!(
                        (got - want).abs() <= want.abs() / 128.0 + 1e-3,
                        "{rows}x{n}x{k}: {got} vs {want}"
                    );
                }
            }
        }
    }
    let mut out = vec![Bf16::default(); 9];
    let bad = gemv_bf16(
        &mut out,
        &[Bf16::default(); 26],
        &[Bf16::default(); 3],
        None,
        9,
        1,
        3,
        1,
        &ScopedThreads,
    );
    assert!(
        bad.is_err(),
        "an activation shorter than rows x k is refused"
    );
}

/// A row's output is the same, bit for bit, whichever rows share the call: speculative
/// decoding verifies proposals with several rows and must reproduce a one-row decode.
#[test]
fn gemv_rows_do_not_depend_on_the_rows_beside_them() {
    use iron_batch_kernels::gemv_bf16;
    let mut rng = Rng(29);
    // k multiples of 64, of 32 only (the bf16 dot products' last 32 values alone), of 16
    // only, and of neither: every vector path this CPU has. n 45 and 1031 leave a weight
    // row without a partner when one activation row takes them in pairs (1031 on each of
    // two threads). k 4112 and 4128 make blocks of
    // 8 activation rows; the row counts cover one pass, several, and a last pass of 1 to 7
    // rows.
    for (n, k) in [
        (300, 576),
        (90, 96),
        (45, 96),
        (1031, 576),
        (260, 48),
        (70, 40),
        (20, 4112),
        (20, 4128),
    ] {
        let most = 27;
        let x: Vec<Bf16> = (0..most * k).map(|_| Bf16::from_f32(rng.unit())).collect();
        let w: Vec<Bf16> = (0..n * k).map(|_| Bf16::from_f32(rng.unit())).collect();
        let run = |x: &[Bf16], rows: usize| {
            let mut out = vec![Bf16::default(); rows * n];
            gemv_bf16(&mut out, x, &w, None, rows, n, k, 2, &ScopedThreads).unwrap();
            out
        };
        let alone: Vec<Vec<Bf16>> = (0..most).map(|r| run(&x[r * k..(r + 1) * k], 1)).collect();
        for rows in (1..=12).chain([16, 17, 25, 27]) {
            let together = run(&x[..rows * k], rows);
            for (r, want) in alone.iter().enumerate().take(rows) {
                let got = &together[r * n..(r + 1) * n];
                assert!(
                    got == want.as_slice(),
                    "k {k}: row {r} of {rows} differs from the row alone"
                );
            }
        }
    }
}
