//! The one-call decode step against a decoder layer written out in f64 from its
//! definition (RMSNorm, projections, per-head q/k norms, half-split rotary, attention over
//! the paged context, SiLU-and-mul), with bf16, Q4 and Q8 projections, a bias, two rows
//! with their own block tables, and sliding windows (the same in every layer, or one per
//! layer).

use iron_batch_kernels::{
    decode_layers, exp, q4_nibble, run_in_team, silu_mul, Activation, Bf16, DecodeInputs,
    DecodeShape, DecoderLayer, Element, LayerCache, Matrix, Projection, QMatrix, ScopedThreads,
    F16, Q4, Q8, QBLOCK,
};

mod common;

use common::Rng;

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HD: usize = 16;
const INTER: usize = 128;
const BLOCK: usize = 4;
const BLOCKS: usize = 8;
const EPS: f32 = 1e-5;
const KV_ROW: usize = KV_HEADS * HD;

fn bf16s(rng: &mut Rng, len: usize, scale: f32, offset: f32) -> Vec<Bf16> {
    (0..len)
        .map(|_| Bf16::from_f32(rng.unit() * scale + offset))
        .collect()
}

/// Owned storage of one projection.
enum Store {
    Dense(Vec<Bf16>),
    Q4(Vec<u8>, Vec<F16>, Vec<F16>),
    Q8(Vec<i8>, Vec<F16>),
}

struct Proj {
    store: Store,
    bias: Option<Vec<Bf16>>,
    n: usize,
    k: usize,
}

impl Proj {
    fn new(rng: &mut Rng, kind: &str, n: usize, k: usize, bias: bool) -> Self {
        let blocks = n * k / QBLOCK;
        let scale = |rng: &mut Rng| -> Vec<F16> {
            (0..blocks)
                .map(|_| F16::from_f32(0.01 + rng.unit().abs() * 0.02))
                .collect()
        };
        let store = match kind {
            "bf16" => Store::Dense(bf16s(rng, n * k, 0.15, 0.0)),
            "q4" => {
                let mut packed = vec![0u8; n * k / 2];
                for row in 0..n {
                    for j in 0..k {
                        let (at, high) = q4_nibble(j, k);
                        let q = (rng.next() % 16) as u8;
                        packed[row * k / 2 + at] |= if high { q << 4 } else { q };
                    }
                }
                let mins = (0..blocks)
                    .map(|_| F16::from_f32(-0.1 + rng.unit() * 0.02))
                    .collect();
                Store::Q4(packed, scale(rng), mins)
            }
            _ => {
                let quants = (0..n * k).map(|_| (rng.next() % 255) as i8).collect();
                Store::Q8(quants, scale(rng))
            }
        };
        let bias = bias.then(|| bf16s(rng, n, 0.5, 0.0));
        Proj { store, bias, n, k }
    }

    fn view(&self) -> Projection<'_> {
        let weight = match &self.store {
            Store::Dense(w) => Matrix::Bf16(w),
            Store::Q4(packed, scale, min) => Matrix::Quant(QMatrix::Q4(Q4 { packed, scale, min })),
            Store::Q8(quants, scale) => Matrix::Quant(QMatrix::Q8(Q8 { quants, scale })),
        };
        Projection {
            weight,
            bias: self.bias.as_deref(),
            n: self.n,
            k: self.k,
        }
    }

    /// `x W^T + b` in f64 over the dequantized weights.
    fn apply(&self, x: &[f64]) -> Vec<f64> {
        let view = self.view();
        (0..self.n)
            .map(|i| {
                let dot: f64 = (0..self.k)
                    .map(|j| {
                        let w = match view.weight {
                            Matrix::Bf16(w) => w[i * self.k + j].to_f32(),
                            Matrix::Quant(q) => q.weight(i, j, self.k),
                        };
                        f64::from(w) * x[j]
                    })
                    .sum();
                dot + self.bias.as_ref().map_or(0.0, |b| f64::from(b[i].to_f32()))
            })
            .collect()
    }
}

struct Layer {
    window: usize,
    input_norm: Vec<Bf16>,
    post_norm: Vec<Bf16>,
    q_norm: Option<Vec<Bf16>>,
    k_norm: Option<Vec<Bf16>>,
    qkv: Proj,
    o: Proj,
    gate_up: Proj,
    down: Proj,
}

impl Layer {
    fn view(&self) -> DecoderLayer<'_> {
        DecoderLayer {
            input_norm: &self.input_norm,
            qkv: self.qkv.view(),
            q_norm: self.q_norm.as_deref(),
            k_norm: self.k_norm.as_deref(),
            o: self.o.view(),
            post_norm: &self.post_norm,
            gate_up: self.gate_up.view(),
            down: self.down.view(),
            activation: Activation::SiluMul,
            sliding_window: self.window,
        }
    }
}

fn layer(rng: &mut Rng, kinds: [&str; 4], qk_norm: bool, bias: bool, window: usize) -> Layer {
    let norm = |rng: &mut Rng, len| bf16s(rng, len, 0.5, 1.0);
    Layer {
        window,
        input_norm: norm(rng, HIDDEN),
        post_norm: norm(rng, HIDDEN),
        q_norm: qk_norm.then(|| norm(rng, HD)),
        k_norm: qk_norm.then(|| norm(rng, HD)),
        qkv: Proj::new(rng, kinds[0], (HEADS + 2 * KV_HEADS) * HD, HIDDEN, bias),
        o: Proj::new(rng, kinds[1], HIDDEN, HEADS * HD, false),
        gate_up: Proj::new(rng, kinds[2], 2 * INTER, HIDDEN, false),
        down: Proj::new(rng, kinds[3], HIDDEN, INTER, false),
    }
}

fn f64s(v: &[Bf16]) -> Vec<f64> {
    v.iter().map(|x| f64::from(x.to_f32())).collect()
}

fn rms_norm(x: &[f64], w: &[Bf16]) -> Vec<f64> {
    let mean = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (mean + f64::from(EPS)).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| v * inv * f64::from(w.to_f32()))
        .collect()
}

fn rotate(x: &mut [f64], cos: &[f64], sin: &[f64]) {
    let half = x.len() / 2;
    let orig = x.to_vec();
    for i in 0..x.len() {
        let other = if i < half {
            -orig[i + half]
        } else {
            orig[i - half]
        };
        x[i] = orig[i] * cos[i] + other * sin[i];
    }
}

struct Step {
    tables: Vec<i32>,
    lens: Vec<i32>,
    width: usize,
    slots: Vec<i64>,
    cos: Vec<Bf16>,
    sin: Vec<Bf16>,
}

impl Step {
    fn shape(&self) -> DecodeShape {
        DecodeShape {
            num_seqs: self.lens.len(),
            num_heads: HEADS,
            num_kv_heads: KV_HEADS,
            head_dim: HD,
            block_size: BLOCK,
            max_blocks: self.width,
            num_blocks: BLOCKS,
            // Not read by the stack: each layer attends with its own window.
            sliding_window: 0,
        }
    }
}

fn step() -> Step {
    // Row 0: 7 tokens in blocks 3, 5; row 1: 10 tokens in blocks 1, 6, 2.
    let width = 3;
    let tables = vec![3, 5, 0, 1, 6, 2];
    let lens = vec![7, 10];
    let slot = |row: usize| {
        let pos = lens[row] as usize - 1;
        (tables[row * width + pos / BLOCK] as usize * BLOCK + pos % BLOCK) as i64
    };
    let slots = vec![slot(0), slot(1)];
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for &len in &lens {
        let pos = (len - 1) as f32;
        for i in 0..HD {
            let freq = 10_000f32.powf(-((i % (HD / 2)) as f32) * 2.0 / HD as f32);
            cos.push(Bf16::from_f32((pos * freq).cos()));
            sin.push(Bf16::from_f32((pos * freq).sin()));
        }
    }
    Step {
        tables,
        lens,
        width,
        slots,
        cos,
        sin,
    }
}

/// A layer's K and V cache in f64.
type F64Cache = (Vec<f64>, Vec<f64>);

/// One decode step in f64 over copies of the caches; returns (h, caches).
fn reference(
    layers: &[Layer],
    h0: &[Bf16],
    caches: &[(Vec<Bf16>, Vec<Bf16>)],
    s: &Step,
) -> (Vec<f64>, Vec<F64Cache>) {
    let rows = s.lens.len();
    let mut h = f64s(h0);
    let mut caches: Vec<F64Cache> = caches.iter().map(|(k, v)| (f64s(k), f64s(v))).collect();
    for (l, (kc, vc)) in layers.iter().zip(caches.iter_mut()) {
        let mut attn_all = Vec::new();
        for r in 0..rows {
            let x = rms_norm(&h[r * HIDDEN..(r + 1) * HIDDEN], &l.input_norm);
            let qkv = l.qkv.apply(&x);
            let cos = f64s(&s.cos[r * HD..(r + 1) * HD]);
            let sin = f64s(&s.sin[r * HD..(r + 1) * HD]);
            let mut heads: Vec<Vec<f64>> = qkv.chunks(HD).map(|c| c.to_vec()).collect();
            for (i, head) in heads.iter_mut().enumerate().take(HEADS + KV_HEADS) {
                let w = if i < HEADS { &l.q_norm } else { &l.k_norm };
                if let Some(w) = w {
                    *head = rms_norm(head, w);
                }
                rotate(head, &cos, &sin);
            }
            let slot = s.slots[r] as usize;
            for g in 0..KV_HEADS {
                let at = slot * KV_ROW + g * HD;
                kc[at..at + HD].copy_from_slice(&heads[HEADS + g]);
                vc[at..at + HD].copy_from_slice(&heads[HEADS + KV_HEADS + g]);
            }
            let len = s.lens[r] as usize;
            let start = if l.window > 0 && len > l.window {
                len - l.window
            } else {
                0
            };
            let scale = 1.0 / (HD as f64).sqrt();
            for (hq, q) in heads.iter().enumerate().take(HEADS) {
                let g = hq / (HEADS / KV_HEADS);
                let at = |pos: usize| {
                    let block = s.tables[r * s.width + pos / BLOCK] as usize;
                    (block * BLOCK + pos % BLOCK) * KV_ROW + g * HD
                };
                let scores: Vec<f64> = (start..len)
                    .map(|p| (0..HD).map(|d| q[d] * kc[at(p) + d]).sum::<f64>() * scale)
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|v| (v - max).exp()).collect();
                let total: f64 = e.iter().sum();
                for d in 0..HD {
                    let sum: f64 = (start..len).zip(&e).map(|(p, w)| w * vc[at(p) + d]).sum();
                    attn_all.push(sum / total);
                }
            }
        }
        for r in 0..rows {
            let o = l.o.apply(&attn_all[r * HEADS * HD..(r + 1) * HEADS * HD]);
            let hr = &mut h[r * HIDDEN..(r + 1) * HIDDEN];
            hr.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let x = rms_norm(hr, &l.post_norm);
            let gu = l.gate_up.apply(&x);
            let act: Vec<f64> = (0..INTER)
                .map(|i| gu[i] / (1.0 + (-gu[i]).exp()) * gu[INTER + i])
                .collect();
            let down = l.down.apply(&act);
            hr.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
    }
    (h, caches)
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// How a test runs the step: `decode_layers` on some `Parallel`.
type Runner = fn(&mut [Bf16], &[DecoderLayer<'_>], &mut [LayerCache<'_>], &DecodeInputs<'_>);

fn scoped(h: &mut [Bf16], l: &[DecoderLayer<'_>], c: &mut [LayerCache<'_>], i: &DecodeInputs<'_>) {
    decode_layers(h, l, c, i, 2, &ScopedThreads).unwrap();
}

/// The whole step in one parallel region of three threads (`run_in_team`), as the
/// bindings run it.
fn in_team(h: &mut [Bf16], l: &[DecoderLayer<'_>], c: &mut [LayerCache<'_>], i: &DecodeInputs<'_>) {
    run_in_team(3, &ScopedThreads, |team| decode_layers(h, l, c, i, 3, team)).unwrap();
}

/// A layer's K and V cache.
type BfCache = (Vec<Bf16>, Vec<Bf16>);

struct Case {
    layers: [Layer; 2],
    step: Step,
    h0: Vec<Bf16>,
    caches: Vec<BfCache>,
}

/// Two layers attending over `windows` (0: every position).
fn case(windows: [usize; 2]) -> Case {
    let mut rng = Rng(0x5eed_0000 + windows[0] as u64);
    let layers = [
        layer(
            &mut rng,
            ["bf16", "bf16", "q4", "q8"],
            false,
            false,
            windows[0],
        ),
        layer(&mut rng, ["q8", "q4", "bf16", "q8"], true, true, windows[1]),
    ];
    let step = step();
    let cache_len = BLOCKS * BLOCK * KV_ROW;
    let caches = (0..2)
        .map(|_| {
            (
                bf16s(&mut rng, cache_len, 1.0, 0.0),
                bf16s(&mut rng, cache_len, 1.0, 0.0),
            )
        })
        .collect();
    let h0 = bf16s(&mut rng, step.lens.len() * HIDDEN, 1.0, 0.0);
    Case {
        layers,
        step,
        h0,
        caches,
    }
}

/// The residual stream and the caches after one step run by `run`.
fn run_step(c: &Case, run: Runner) -> (Vec<Bf16>, Vec<BfCache>) {
    let s = &c.step;
    let mut h = c.h0.clone();
    let mut owned = c.caches.clone();
    let views: Vec<DecoderLayer<'_>> = c.layers.iter().map(Layer::view).collect();
    let mut cache_views: Vec<LayerCache<'_>> =
        owned.iter_mut().map(|(k, v)| LayerCache { k, v }).collect();
    let inputs = DecodeInputs {
        cos: &s.cos,
        sin: &s.sin,
        slots: &s.slots,
        block_tables: &s.tables,
        seq_lens: &s.lens,
        shape: s.shape(),
        scale: 1.0 / (HD as f32).sqrt(),
        eps: EPS,
    };
    run(&mut h, &views, &mut cache_views, &inputs);
    drop(cache_views);
    (h, owned)
}

fn run_case(window: [usize; 2]) {
    let c = case(window);
    let (want_h, want_caches) = reference(&c.layers, &c.h0, &c.caches, &c.step);
    let (h, owned) = run_step(&c, scoped);

    // bf16 rounds every intermediate (about 3 significant digits): a wiring mistake (a
    // wrong half, slot, sign or head) moves values by their own size instead.
    let got = f64s(&h);
    let err: Vec<f64> = got.iter().zip(&want_h).map(|(a, b)| a - b).collect();
    assert!(
        max_abs(&err) <= 0.02 * max_abs(&want_h),
        "windows {window:?}: h error {} against values up to {}",
        max_abs(&err),
        max_abs(&want_h)
    );
    for ((k, v), (wk, wv)) in owned.iter().zip(&want_caches) {
        for (got, want) in [(f64s(k), wk), (f64s(v), wv)] {
            let err: Vec<f64> = got.iter().zip(want).map(|(a, b)| a - b).collect();
            assert!(
                max_abs(&err) <= 0.02 * max_abs(want),
                "windows {window:?}: cache error"
            );
        }
    }
}

#[test]
fn a_step_in_one_team_region_gives_the_same_bits() {
    // In a team the attention splits even this small step across threads, and the
    // projections' parts land on whichever thread claims them: no value may change.
    for window in [[0, 0], [5, 5], [5, 0]] {
        let c = case(window);
        let (h, caches) = run_step(&c, scoped);
        for _ in 0..20 {
            let (team_h, team_caches) = run_step(&c, in_team);
            assert_eq!(team_h, h, "windows {window:?}: residual stream");
            assert!(team_caches == caches, "windows {window:?}: caches");
        }
    }
}

#[test]
fn a_decode_step_matches_the_layers_written_out_in_f64() {
    run_case([0, 0]);
}

#[test]
fn a_sliding_window_attends_only_the_last_positions() {
    run_case([5, 5]);
}

#[test]
fn each_layer_attends_with_its_own_window() {
    // A sliding layer before a global one, as Gemma-style models interleave them.
    run_case([5, 0]);
}

#[test]
fn an_activation_is_named_as_checkpoints_name_it() {
    assert_eq!(Activation::from_name("silu"), Some(Activation::SiluMul));
    assert_eq!(Activation::from_name("gelu_pytorch_tanh"), None);
}

#[test]
fn bad_steps_are_errors_and_write_nothing() {
    let mut rng = Rng(7);
    let layers = [layer(&mut rng, ["q4", "bf16", "q8", "q8"], false, false, 0)];
    let s = step();
    let cache_len = BLOCKS * BLOCK * KV_ROW;
    let mut k = bf16s(&mut rng, cache_len, 1.0, 0.0);
    let mut v = bf16s(&mut rng, cache_len, 1.0, 0.0);
    let (k0, v0) = (k.clone(), v.clone());
    let h0 = bf16s(&mut rng, 2 * HIDDEN, 1.0, 0.0);
    let views = [layers[0].view()];
    let shape = s.shape();
    let bad_block = vec![3, 5, 0, 1, 60, 2];
    let bad_slot = vec![s.slots[0], (BLOCKS * BLOCK) as i64];
    let too_long = vec![7, 13];
    let cases: [(&[i32], &[i64], &[i32]); 3] = [
        (&bad_block, &s.slots, &s.lens),
        (&s.tables, &bad_slot, &s.lens),
        (&s.tables, &s.slots, &too_long),
    ];
    for (tables, slots, lens) in cases {
        let mut h = h0.clone();
        let mut caches = [LayerCache {
            k: &mut k,
            v: &mut v,
        }];
        let inputs = DecodeInputs {
            cos: &s.cos,
            sin: &s.sin,
            slots,
            block_tables: tables,
            seq_lens: lens,
            shape,
            scale: 0.25,
            eps: EPS,
        };
        let result = decode_layers(&mut h, &views, &mut caches, &inputs, 2, &ScopedThreads);
        assert!(result.is_err());
        assert_eq!(h, h0);
    }
    assert!(k == k0 && v == v0);
}

#[test]
fn exp_is_within_two_ulp_and_saturates() {
    let mut worst = 0f64;
    let mut x = -87.0f32;
    while x < 88.3 {
        let got = f64::from(exp(x));
        let want = f64::from(x).exp();
        let ulp = f64::from(f32::EPSILON) * want;
        worst = worst.max((got - want).abs() / ulp);
        x += 0.0137;
    }
    assert!(worst <= 2.0, "worst error {worst} ulp");
    assert_eq!(exp(100.0), f32::INFINITY);
    assert_eq!(exp(-100.0), 0.0);
    assert_eq!(exp(0.0), 1.0);
}

#[test]
fn silu_mul_rounds_like_torch() {
    // torch: F.silu(gate) rounded to bf16, then * up rounded to bf16.
    let gate_up: Vec<Bf16> = [-3.0f32, 0.5, 2.0, 10.0, 1.5, -2.0, 0.25, 3.0]
        .iter()
        .map(|&v| Bf16::from_f32(v))
        .collect();
    let mut out = vec![Bf16(0); 4];
    silu_mul(&mut out, &gate_up, 4);
    for i in 0..4 {
        let g = f64::from(gate_up[i].to_f32());
        let silu = Bf16::from_f32((g / (1.0 + (-g).exp())) as f32).to_f32();
        let want = Bf16::from_f32(silu * gate_up[4 + i].to_f32());
        assert_eq!(out[i], want, "element {i}");
    }
}
