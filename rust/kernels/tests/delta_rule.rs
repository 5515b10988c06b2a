//! The gated delta rule and its causal convolution against plain float64 references
//! written here token by token: decode steps, and prompts split into chunks at arbitrary
//! points (inside and across the kernel's 64-token blocks), the state carried between them.

use iron_batch_kernels::{
    causal_conv_chunk, causal_conv_decode, delta_rule_chunk, delta_rule_decode, Bf16, DeltaShape,
    Element, ScopedThreads, DELTA_CHUNK,
};

mod common;

use common::Rng;

/// Tokens of one sequence: q and k l2-normalized (as the model feeds them), q scaled by
/// 1/sqrt(dk), log decays in [-2, 0), betas in (0, 1).
struct Tokens {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

fn unit_rows(rng: &mut Rng, rows: usize, d: usize, scale: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * d);
    for _ in 0..rows {
        let row: Vec<f32> = (0..d).map(|_| rng.unit()).collect();
        let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-3);
        out.extend(row.iter().map(|x| x / norm * scale));
    }
    out
}

fn tokens(rng: &mut Rng, t: usize, s: DeltaShape) -> Tokens {
    let rows = t * s.heads;
    Tokens {
        q: unit_rows(rng, rows, s.key_dim, (s.key_dim as f32).powf(-0.5)),
        k: unit_rows(rng, rows, s.key_dim, 1.0),
        v: (0..rows * s.value_dim).map(|_| rng.unit()).collect(),
        g: (0..rows).map(|_| -(rng.unit() + 1.0)).collect(),
        beta: (0..rows)
            .map(|_| 0.5 * (rng.unit() + 1.0) * 0.98 + 0.01)
            .collect(),
    }
}

/// The recurrence token by token in f64: returns outputs [T, H, dv]; `state` [H, dk, dv].
fn reference(x: &Tokens, state: &mut [f64], s: DeltaShape) -> Vec<f64> {
    let (h_n, dk, dv) = (s.heads, s.key_dim, s.value_dim);
    let t_len = x.g.len() / h_n;
    let mut out = vec![0.0; t_len * h_n * dv];
    for t in 0..t_len {
        for h in 0..h_n {
            let st = &mut state[h * dk * dv..(h + 1) * dk * dv];
            let at = t * h_n + h;
            let decay = f64::from(x.g[at]).exp();
            let k = &x.k[at * dk..(at + 1) * dk];
            let q = &x.q[at * dk..(at + 1) * dk];
            let v = &x.v[at * dv..(at + 1) * dv];
            for e in st.iter_mut() {
                *e *= decay;
            }
            for j in 0..dv {
                let predicted: f64 = (0..dk).map(|i| st[i * dv + j] * f64::from(k[i])).sum();
                let u = f64::from(x.beta[at]) * (f64::from(v[j]) - predicted);
                for i in 0..dk {
                    st[i * dv + j] += f64::from(k[i]) * u;
                }
                out[at * dv + j] = (0..dk).map(|i| st[i * dv + j] * f64::from(q[i])).sum();
            }
        }
    }
    out
}

fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(*a) - b).abs() <= tol * (1.0 + b.abs()),
            "{what}[{i}]: {a} vs {b}"
        );
    }
}

/// Rows `lo..hi` of a [T, H, d] tensor.
fn rows(x: &[f32], lo: usize, hi: usize, width: usize) -> Vec<f32> {
    x[lo * width..hi * width].to_vec()
}

const SHAPE: DeltaShape = DeltaShape {
    heads: 3,
    key_dim: 16,
    value_dim: 8,
};

/// Shapes the kernels' tiled and unrolled paths take: Qwen3.5's 128-wide value heads (a
/// key dimension that the 4-row tiles do not divide), and 40 columns (one 32-column tile
/// and a remainder).
const WIDE: [DeltaShape; 2] = [
    DeltaShape {
        heads: 2,
        key_dim: 18,
        value_dim: 128,
    },
    DeltaShape {
        heads: 1,
        key_dim: 8,
        value_dim: 40,
    },
];

#[test]
fn chunked_prefill_matches_the_recurrence_wherever_the_chunks_end() {
    for s in [SHAPE].into_iter().chain(WIDE) {
        chunked_prefill_matches(s);
    }
}

fn chunked_prefill_matches(s: DeltaShape) {
    let (dk, dv, h) = (s.key_dim, s.value_dim, s.heads);
    let mut rng = Rng(0x5eed_1234);
    let t_len = 3 * DELTA_CHUNK + 17;
    let x = tokens(&mut rng, t_len, s);
    let initial: Vec<f32> = (0..h * dk * dv).map(|_| 0.3 * rng.unit()).collect();
    let mut want_state: Vec<f64> = initial.iter().map(|&e| f64::from(e)).collect();
    let want = reference(&x, &mut want_state, s);
    // Splits: one call; one token at a time; block-sized; and uneven cuts (1, 63, 64, 65,
    // 5, ... tokens) that fall inside and across the kernel's blocks.
    let uneven = [1, 63, 64, 65, 5, 2, 7, 40];
    for (name, sizes) in [
        ("whole", vec![t_len]),
        ("tokens", vec![1; t_len]),
        ("blocks", vec![DELTA_CHUNK; t_len.div_ceil(DELTA_CHUNK)]),
        ("uneven", uneven.to_vec()),
    ] {
        let mut state = initial.clone();
        let mut out = Vec::new();
        let mut at = 0;
        for &n in sizes.iter().cycle() {
            if at == t_len {
                break;
            }
            let hi = (at + n).min(t_len);
            let mut o = vec![0.0f32; (hi - at) * h * dv];
            delta_rule_chunk(
                &mut state,
                &rows(&x.q, at, hi, h * dk),
                &rows(&x.k, at, hi, h * dk),
                &rows(&x.v, at, hi, h * dv),
                &rows(&x.g, at, hi, h),
                &rows(&x.beta, at, hi, h),
                &mut o,
                s,
                2,
                &ScopedThreads,
            )
            .unwrap();
            out.extend(o);
            at = hi;
        }
        close(&out, &want, 2e-4, name);
        close(&state, &want_state, 2e-4, &format!("{name} state"));
    }
}

#[test]
fn decode_updates_each_slot_in_place_like_the_recurrence() {
    for s in [SHAPE].into_iter().chain(WIDE) {
        decode_matches(s);
    }
}

fn decode_matches(s: DeltaShape) {
    let (dk, dv, h) = (s.key_dim, s.value_dim, s.heads);
    let mut rng = Rng(77);
    let per = h * dk * dv;
    let slots_total = 5;
    let slots = [3i64, 0, 4];
    let mut pool: Vec<f32> = (0..slots_total * per).map(|_| 0.3 * rng.unit()).collect();
    let untouched = pool[per..2 * per].to_vec(); // slot 1: no sequence
    let mut want_states: Vec<Vec<f64>> = slots
        .iter()
        .map(|&sl| {
            pool[sl as usize * per..(sl as usize + 1) * per]
                .iter()
                .map(|&e| f64::from(e))
                .collect()
        })
        .collect();
    for step in 0..20 {
        let xs: Vec<Tokens> = slots.iter().map(|_| tokens(&mut rng, 1, s)).collect();
        let cat = |f: fn(&Tokens) -> &Vec<f32>| -> Vec<f32> {
            xs.iter().flat_map(|x| f(x).iter().copied()).collect()
        };
        let mut out = vec![0.0f32; slots.len() * h * dv];
        delta_rule_decode(
            &mut pool,
            &slots,
            &cat(|x| &x.q),
            &cat(|x| &x.k),
            &cat(|x| &x.v),
            &cat(|x| &x.g),
            &cat(|x| &x.beta),
            &mut out,
            s,
            2,
            &ScopedThreads,
        )
        .unwrap();
        for (b, x) in xs.iter().enumerate() {
            let want = reference(x, &mut want_states[b], s);
            close(
                &out[b * h * dv..(b + 1) * h * dv],
                &want,
                1e-4,
                &format!("step {step}"),
            );
        }
    }
    for (b, &sl) in slots.iter().enumerate() {
        close(
            &pool[sl as usize * per..(sl as usize + 1) * per],
            &want_states[b],
            1e-4,
            "state",
        );
    }
    assert_eq!(pool[per..2 * per], untouched[..]);
}

/// A bf16 state pool: each stored value is the f32 result rounded once, so over many
/// steps the outputs stay near the f64 recurrence (which keeps every bit), and the slots
/// no sequence uses are left as they were.
#[test]
fn a_bf16_state_stays_near_the_recurrence_in_decode_and_in_chunks() {
    let s = SHAPE;
    let (dk, dv, h) = (s.key_dim, s.value_dim, s.heads);
    let per = h * dk * dv;
    let mut rng = Rng(0xbf16);
    let initial: Vec<Bf16> = (0..3 * per)
        .map(|_| Bf16::from_f32(0.3 * rng.unit()))
        .collect();
    let slots = [2i64, 0];
    let mut pool = initial.clone();
    let mut want_states: Vec<Vec<f64>> = slots
        .iter()
        .map(|&sl| {
            initial[sl as usize * per..(sl as usize + 1) * per]
                .iter()
                .map(|e| f64::from(e.to_f32()))
                .collect()
        })
        .collect();
    let mut worst = 0.0f64;
    let mut track = |got: &[f32], want: &[f64]| {
        for (a, b) in got.iter().zip(want) {
            worst = worst.max((f64::from(*a) - b).abs() / (1.0 + b.abs()));
        }
    };
    // Decode: 48 steps of both sequences.
    for _ in 0..48 {
        let xs: Vec<Tokens> = slots.iter().map(|_| tokens(&mut rng, 1, s)).collect();
        let cat = |f: fn(&Tokens) -> &Vec<f32>| -> Vec<f32> {
            xs.iter().flat_map(|x| f(x).iter().copied()).collect()
        };
        let mut out = vec![0.0f32; slots.len() * h * dv];
        delta_rule_decode(
            &mut pool,
            &slots,
            &cat(|x| &x.q),
            &cat(|x| &x.k),
            &cat(|x| &x.v),
            &cat(|x| &x.g),
            &cat(|x| &x.beta),
            &mut out,
            s,
            2,
            &ScopedThreads,
        )
        .unwrap();
        for (b, x) in xs.iter().enumerate() {
            let want = reference(x, &mut want_states[b], s);
            track(&out[b * h * dv..(b + 1) * h * dv], &want);
        }
    }
    assert_eq!(
        pool[per..2 * per],
        initial[per..2 * per],
        "slot 1 has no sequence"
    );
    // Then a prompt chunk of the first sequence, split across and inside blocks.
    let t_len = DELTA_CHUNK + 30;
    let x = tokens(&mut rng, t_len, s);
    let want = reference(&x, &mut want_states[0], s);
    let at = slots[0] as usize * per;
    let mut out = Vec::new();
    for (lo, hi) in [(0, 7), (7, t_len)] {
        let mut o = vec![0.0f32; (hi - lo) * h * dv];
        delta_rule_chunk(
            &mut pool[at..at + per],
            &rows(&x.q, lo, hi, h * dk),
            &rows(&x.k, lo, hi, h * dk),
            &rows(&x.v, lo, hi, h * dv),
            &rows(&x.g, lo, hi, h),
            &rows(&x.beta, lo, hi, h),
            &mut o,
            s,
            2,
            &ScopedThreads,
        )
        .unwrap();
        out.extend(o);
    }
    track(&out, &want);
    let state: Vec<f32> = pool[at..at + per].iter().map(|e| e.to_f32()).collect();
    track(&state, &want_states[0]);
    // One bf16 rounding is at most 2^-9 relative; the decay shrinks the old ones, so they
    // do not pile up (4.3e-4 measured). A state not written back, or written to the wrong
    // slot, is off by the size of the values themselves.
    assert!(worst < 3e-3, "worst relative error {worst}");
}

#[test]
fn bad_shapes_and_repeated_slots_are_errors() {
    let s = SHAPE;
    let per = s.heads * s.key_dim * s.value_dim;
    let mut pool = vec![0.0f32; 2 * per];
    let n = 2 * s.heads;
    let qk = vec![0.0f32; n * s.key_dim];
    let v = vec![0.0f32; n * s.value_dim];
    let mut out = v.clone();
    let g = vec![0.0f32; n];
    let err = delta_rule_decode(
        &mut pool,
        &[1, 1],
        &qk,
        &qk,
        &v,
        &g,
        &g,
        &mut out,
        s,
        1,
        &ScopedThreads,
    )
    .unwrap_err();
    assert!(err.0.contains("repeated"), "{}", err.0);
    let mut state = vec![0.0f32; per + 1];
    assert!(delta_rule_chunk(
        &mut state,
        &qk,
        &qk,
        &v,
        &g,
        &g,
        &mut out,
        s,
        1,
        &ScopedThreads
    )
    .is_err());
}

/// silu(sum_j w[c, j] * history[t + j]) in f64 over the zero-padded (or given) history.
fn conv_reference(x: &[f64], window: &[f64], weight: &[f64], ch: usize, k: usize) -> Vec<f64> {
    let t_len = x.len() / ch;
    let w = k - 1;
    let mut out = vec![0.0; x.len()];
    for c in 0..ch {
        let hist: Vec<f64> = window[c * w..(c + 1) * w]
            .iter()
            .copied()
            .chain((0..t_len).map(|t| x[t * ch + c]))
            .collect();
        for t in 0..t_len {
            let z: f64 = (0..k).map(|j| hist[t + j] * weight[c * k + j]).sum();
            out[t * ch + c] = z / (1.0 + (-z).exp());
        }
    }
    out
}

#[test]
fn the_convolution_carries_its_window_through_chunks_and_decodes() {
    // Qwen3.5's kernel of 4, over fewer channels than one block of the chunk path and over
    // several blocks split between two threads; and a kernel of 2.
    for (ch, k) in [(70, 4), (600, 4), (33, 2)] {
        conv_through_chunks_and_decodes(ch, k);
    }
}

fn conv_through_chunks_and_decodes(ch: usize, k: usize) {
    let mut rng = Rng(9);
    let t_len = 23;
    let x: Vec<f32> = (0..t_len * ch).map(|_| rng.unit()).collect();
    let weight: Vec<f32> = (0..ch * k).map(|_| rng.unit()).collect();
    let f64s = |v: &[f32]| v.iter().map(|&e| f64::from(e)).collect::<Vec<_>>();
    let want = conv_reference(&f64s(&x), &vec![0.0; ch * (k - 1)], &f64s(&weight), ch, k);
    // Chunks of 2, 9 and 1 tokens, then the rest as decodes in slot 2 of a pool of 3.
    let mut window = vec![0.0f32; ch * (k - 1)];
    let mut got = Vec::new();
    let mut at = 0;
    for n in [2, 9, 1] {
        let mut o = vec![0.0f32; n * ch];
        causal_conv_chunk(
            &x[at * ch..(at + n) * ch],
            &mut window,
            &weight,
            k,
            &mut o,
            2,
            &ScopedThreads,
        )
        .unwrap();
        got.extend(o);
        at += n;
    }
    let mut pool = vec![0.0f32; 3 * ch * (k - 1)];
    pool[2 * ch * (k - 1)..].copy_from_slice(&window);
    while at < t_len {
        let mut o = vec![0.0f32; ch];
        causal_conv_decode(
            &x[at * ch..(at + 1) * ch],
            &mut pool,
            &[2],
            &weight,
            k,
            &mut o,
            2,
            &ScopedThreads,
        )
        .unwrap();
        got.extend(o);
        at += 1;
    }
    close(&got, &want, 1e-5, "conv");
    assert!(pool[..2 * ch * (k - 1)].iter().all(|&e| e == 0.0));
}

#[test]
fn the_bf16_convolution_rounds_its_sum_then_its_silu() {
    let (ch, k) = (8, 4);
    let mut rng = Rng(11);
    let x: Vec<Bf16> = (0..3 * ch).map(|_| Bf16::from_f32(rng.unit())).collect();
    let weight: Vec<Bf16> = (0..ch * k).map(|_| Bf16::from_f32(rng.unit())).collect();
    let mut window = vec![0.0f32; ch * (k - 1)];
    let mut out = vec![Bf16(0); 3 * ch];
    causal_conv_chunk(&x, &mut window, &weight, k, &mut out, 1, &ScopedThreads).unwrap();
    for t in 0..3 {
        for c in 0..ch {
            let mut z = 0.0f32;
            for j in 0..k {
                if t + j >= k - 1 {
                    z += x[(t + j + 1 - k) * ch + c].to_f32() * weight[c * k + j].to_f32();
                }
            }
            let zr = Bf16::from_f32(z).to_f32();
            let want = Bf16::from_f32(zr / (1.0 + (-zr).exp()));
            assert_eq!(out[t * ch + c], want, "t {t} c {c}");
        }
    }
}
