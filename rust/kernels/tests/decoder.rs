//! The one-call decode step against a decoder layer written out in f64 from its
//! definition (RMSNorm, projections, per-head or whole-projection q/k norms, half-split
//! rotary over all, some or none of each head's dims, attention over the paged context
//! with an optional soft cap, SiLU- or GELU-tanh-and-mul, norms before and after each
//! sublayer, a residual multiplier), with bf16, Q4 and Q8 projections, a bias, two rows
//! with their own block tables, sliding windows (the same in every layer, or one per
//! layer), two rotary tables and two cache groups with blocks of their own. And Gemma 4's
//! additions against equivalent plain layers: values from the keys, K/V attended over
//! from an earlier layer, a per-layer-embedding block and a layer scalar.

use iron_batch_kernels::{
    add_rms_norm, add_rms_norm_once, decode_layers, exp, gelu_tanh_mul, q4_nibble, rope_q,
    rope_store_kv, run_in_team, silu_mul, tanh, Activation, Bf16, CacheGroup, DecodeInputs,
    DecodeShape, DecoderLayer, Element, LayerCache, LayerExtras, Matrix, PerLayerInput, Projection,
    QMatrix, RopeTable, ScopedThreads, F16, Q4, Q8, QBLOCK,
};

mod common;

use common::Rng;

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HD: usize = 16;
const INTER: usize = 128;
const BLOCK: usize = 4;
/// Blocks of group 0's caches; group 1's have `BLOCKS_1`.
const BLOCKS: usize = 8;
const BLOCKS_1: usize = 5;
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

#[derive(Clone, Copy, PartialEq)]
enum QkNorm {
    None,
    PerHead,
    Whole,
}

/// What a test layer has beyond its weights' kinds.
#[derive(Clone, Copy)]
struct Spec {
    kinds: [&'static str; 4],
    bias: bool,
    qk_norm: QkNorm,
    window: usize,
    /// input, attention output, pre-MLP, MLP output.
    norms: [bool; 4],
    activation: Activation,
    rotary_dim: usize,
    rope_table: usize,
    scale: f32,
    softcap: f32,
    residual_scale: f32,
    cache_group: usize,
}

/// Llama's layer: pre-norms, SiLU, full rotary from table 0, group 0.
const LLAMA: Spec = Spec {
    kinds: ["bf16", "bf16", "q4", "q8"],
    bias: false,
    qk_norm: QkNorm::None,
    window: 0,
    norms: [true, false, true, false],
    activation: Activation::SiluMul,
    rotary_dim: HD,
    rope_table: 0,
    scale: 0.25,
    softcap: 0.0,
    residual_scale: 1.0,
    cache_group: 0,
};

struct Layer {
    spec: Spec,
    norms: [Option<Vec<Bf16>>; 4],
    q_norm: Option<Vec<Bf16>>,
    k_norm: Option<Vec<Bf16>>,
    qkv: Proj,
    o: Proj,
    gate_up: Proj,
    down: Proj,
}

impl Layer {
    fn view(&self) -> DecoderLayer<'_> {
        let sp = self.spec;
        let [input_norm, attn_out_norm, post_norm, mlp_out_norm] =
            self.norms.each_ref().map(|n| n.as_deref());
        DecoderLayer {
            input_norm,
            qkv: self.qkv.view(),
            q_norm: self.q_norm.as_deref(),
            k_norm: self.k_norm.as_deref(),
            o: self.o.view(),
            attn_out_norm,
            post_norm,
            gate_up: self.gate_up.view(),
            down: self.down.view(),
            mlp_out_norm,
            activation: sp.activation,
            sliding_window: sp.window,
            rotary_dim: sp.rotary_dim,
            rope_table: sp.rope_table,
            scale: sp.scale,
            softcap: sp.softcap,
            residual_scale: sp.residual_scale,
            cache_group: sp.cache_group,
            extras: Default::default(),
        }
    }
}

fn layer(rng: &mut Rng, sp: Spec) -> Layer {
    let norm = |rng: &mut Rng, len| bf16s(rng, len, 0.5, 1.0);
    let (q_len, k_len) = match sp.qk_norm {
        QkNorm::Whole => (HEADS * HD, KV_HEADS * HD),
        _ => (HD, HD),
    };
    let has_qk = sp.qk_norm != QkNorm::None;
    Layer {
        spec: sp,
        norms: sp.norms.map(|on| on.then(|| norm(rng, HIDDEN))),
        q_norm: has_qk.then(|| norm(rng, q_len)),
        k_norm: has_qk.then(|| norm(rng, k_len)),
        qkv: Proj::new(
            rng,
            sp.kinds[0],
            (HEADS + 2 * KV_HEADS) * HD,
            HIDDEN,
            sp.bias,
        ),
        o: Proj::new(rng, sp.kinds[1], HIDDEN, HEADS * HD, false),
        gate_up: Proj::new(rng, sp.kinds[2], 2 * INTER, HIDDEN, false),
        down: Proj::new(rng, sp.kinds[3], HIDDEN, INTER, false),
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

/// rotate_half over the first `cos.len()` dims; the others as they are.
fn rotate(x: &mut [f64], cos: &[f64], sin: &[f64]) {
    let rd = cos.len();
    let half = rd / 2;
    let orig = x.to_vec();
    for i in 0..rd {
        let other = if i < half {
            -orig[i + half]
        } else {
            orig[i - half]
        };
        x[i] = orig[i] * cos[i] + other * sin[i];
    }
}

fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// One cache group's step: its rows' block tables, lengths and new slots.
struct GroupStep {
    tables: Vec<i32>,
    lens: Vec<i32>,
    width: usize,
    slots: Vec<i64>,
    blocks: usize,
}

/// A rotary table `[rows, dim]`.
struct Rope {
    cos: Vec<Bf16>,
    sin: Vec<Bf16>,
    dim: usize,
}

struct Step {
    groups: Vec<GroupStep>,
    ropes: Vec<Rope>,
}

impl Step {
    fn shape(&self) -> DecodeShape {
        DecodeShape {
            num_seqs: self.groups[0].lens.len(),
            num_heads: HEADS,
            num_kv_heads: KV_HEADS,
            head_dim: HD,
            block_size: BLOCK,
            // Not read by the stack: each layer's group and window.
            max_blocks: 0,
            num_blocks: 0,
            sliding_window: 0,
        }
    }

    fn rows(&self) -> usize {
        self.groups[0].lens.len()
    }
}

fn group_step(tables: Vec<i32>, width: usize, lens: Vec<i32>, blocks: usize) -> GroupStep {
    let slot = |row: usize| {
        let pos = lens[row] as usize - 1;
        (tables[row * width + pos / BLOCK] as usize * BLOCK + pos % BLOCK) as i64
    };
    let slots = (0..lens.len()).map(slot).collect();
    GroupStep {
        tables,
        lens,
        width,
        slots,
        blocks,
    }
}

/// A table of `dim` dims at each row's position, with rope base `base`.
fn rope(lens: &[i32], dim: usize, base: f32) -> Rope {
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for &len in lens {
        let pos = (len - 1) as f32;
        for i in 0..dim {
            let freq = base.powf(-((i % (dim / 2)) as f32) * 2.0 / dim as f32);
            cos.push(Bf16::from_f32((pos * freq).cos()));
            sin.push(Bf16::from_f32((pos * freq).sin()));
        }
    }
    Rope { cos, sin, dim }
}

/// Group 0: row 0 has 7 tokens in blocks 3, 5; row 1 has 10 in blocks 1, 6, 2. Group 1
/// (fewer blocks, other ids): the same lengths in blocks 4, 0 and 2, 3, 1. Table 0 is
/// full-width with base 10000, table 1 full-width with base 100 (Gemma 3's local and
/// global bases differ), table 2 `rotary_dim` wide for partial rotary.
fn step_with(partial: usize) -> Step {
    let lens = vec![7, 10];
    let mut ropes = vec![rope(&lens, HD, 10_000.0), rope(&lens, HD, 100.0)];
    if partial > 0 && partial < HD {
        ropes.push(rope(&lens, partial, 10_000.0));
    }
    Step {
        groups: vec![
            group_step(vec![3, 5, 0, 1, 6, 2], 3, lens.clone(), BLOCKS),
            group_step(vec![4, 0, -1, 2, 3, 1], 3, lens.clone(), BLOCKS_1),
        ],
        ropes,
    }
}

fn step() -> Step {
    step_with(0)
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
    let rows = s.rows();
    let mut h = f64s(h0);
    let mut caches: Vec<F64Cache> = caches.iter().map(|(k, v)| (f64s(k), f64s(v))).collect();
    for (l, (kc, vc)) in layers.iter().zip(caches.iter_mut()) {
        let sp = l.spec;
        let g = &s.groups[sp.cache_group];
        let [input_norm, attn_out_norm, post_norm, mlp_out_norm] = &l.norms;
        let mut attn_all = Vec::new();
        for r in 0..rows {
            let hr = &h[r * HIDDEN..(r + 1) * HIDDEN];
            let x = input_norm.as_ref().map_or(hr.to_vec(), |w| rms_norm(hr, w));
            let mut qkv = l.qkv.apply(&x);
            if sp.qk_norm == QkNorm::Whole {
                let q = rms_norm(&qkv[..HEADS * HD], l.q_norm.as_ref().unwrap());
                let k = rms_norm(&qkv[HEADS * HD..][..KV_ROW], l.k_norm.as_ref().unwrap());
                qkv[..HEADS * HD].copy_from_slice(&q);
                qkv[HEADS * HD..][..KV_ROW].copy_from_slice(&k);
            }
            let (cos, sin) = match sp.rotary_dim {
                0 => (Vec::new(), Vec::new()),
                rd => {
                    let t = &s.ropes[sp.rope_table];
                    assert_eq!(t.dim, rd);
                    (
                        f64s(&t.cos[r * rd..(r + 1) * rd]),
                        f64s(&t.sin[r * rd..(r + 1) * rd]),
                    )
                }
            };
            let mut heads: Vec<Vec<f64>> = qkv.chunks(HD).map(|c| c.to_vec()).collect();
            for (i, head) in heads.iter_mut().enumerate().take(HEADS + KV_HEADS) {
                let w = if i < HEADS { &l.q_norm } else { &l.k_norm };
                if let (Some(w), QkNorm::PerHead) = (w, sp.qk_norm) {
                    *head = rms_norm(head, w);
                }
                rotate(head, &cos, &sin);
            }
            let slot = g.slots[r] as usize;
            for kvh in 0..KV_HEADS {
                let at = slot * KV_ROW + kvh * HD;
                kc[at..at + HD].copy_from_slice(&heads[HEADS + kvh]);
                vc[at..at + HD].copy_from_slice(&heads[HEADS + KV_HEADS + kvh]);
            }
            let len = g.lens[r] as usize;
            let start = if sp.window > 0 && len > sp.window {
                len - sp.window
            } else {
                0
            };
            let cap = f64::from(sp.softcap);
            for (hq, q) in heads.iter().enumerate().take(HEADS) {
                let kvh = hq / (HEADS / KV_HEADS);
                let at = |pos: usize| {
                    let block = g.tables[r * g.width + pos / BLOCK] as usize;
                    (block * BLOCK + pos % BLOCK) * KV_ROW + kvh * HD
                };
                let scores: Vec<f64> = (start..len)
                    .map(|p| {
                        let s = (0..HD).map(|d| q[d] * kc[at(p) + d]).sum::<f64>()
                            * f64::from(sp.scale);
                        if cap > 0.0 {
                            cap * (s / cap).tanh()
                        } else {
                            s
                        }
                    })
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
        let rs = f64::from(sp.residual_scale);
        for r in 0..rows {
            let mut o = l.o.apply(&attn_all[r * HEADS * HD..(r + 1) * HEADS * HD]);
            if let Some(w) = attn_out_norm {
                o = rms_norm(&o, w);
            }
            let hr = &mut h[r * HIDDEN..(r + 1) * HIDDEN];
            hr.iter_mut().zip(&o).for_each(|(a, b)| *a += rs * b);
            let x = post_norm.as_ref().map_or(hr.to_vec(), |w| rms_norm(hr, w));
            let gu = l.gate_up.apply(&x);
            let act: Vec<f64> = (0..INTER)
                .map(|i| match sp.activation {
                    Activation::SiluMul => gu[i] / (1.0 + (-gu[i]).exp()) * gu[INTER + i],
                    Activation::GeluTanhMul => gelu_tanh(gu[i]) * gu[INTER + i],
                })
                .collect();
            let mut down = l.down.apply(&act);
            if let Some(w) = mlp_out_norm {
                down = rms_norm(&down, w);
            }
            hr.iter_mut().zip(&down).for_each(|(a, b)| *a += rs * b);
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
    layers: Vec<Layer>,
    step: Step,
    h0: Vec<Bf16>,
    caches: Vec<BfCache>,
}

/// Layers as `specs` describe them, random weights and caches (each of its group's size).
fn case_of(seed: u64, specs: &[Spec]) -> Case {
    let mut rng = Rng(seed);
    let layers: Vec<Layer> = specs.iter().map(|&sp| layer(&mut rng, sp)).collect();
    let partial = specs
        .iter()
        .map(|sp| sp.rotary_dim)
        .find(|&rd| rd > 0 && rd < HD)
        .unwrap_or(0);
    let step = step_with(partial);
    let caches = specs
        .iter()
        .map(|sp| {
            let len = step.groups[sp.cache_group].blocks * BLOCK * KV_ROW;
            (
                bf16s(&mut rng, len, 1.0, 0.0),
                bf16s(&mut rng, len, 1.0, 0.0),
            )
        })
        .collect();
    let h0 = bf16s(&mut rng, step.rows() * HIDDEN, 1.0, 0.0);
    Case {
        layers,
        step,
        h0,
        caches,
    }
}

/// Two Llama/Qwen layers attending over `windows` (0: every position).
fn case(windows: [usize; 2]) -> Case {
    let first = Spec {
        window: windows[0],
        ..LLAMA
    };
    let second = Spec {
        kinds: ["q8", "q4", "bf16", "q8"],
        qk_norm: QkNorm::PerHead,
        bias: true,
        window: windows[1],
        ..LLAMA
    };
    case_of(0x5eed_0000 + windows[0] as u64, &[first, second])
}

fn ropes_of(s: &Step) -> Vec<RopeTable<'_>> {
    s.ropes
        .iter()
        .map(|t| RopeTable {
            cos: &t.cos,
            sin: &t.sin,
            dim: t.dim,
        })
        .collect()
}

fn groups_of(s: &Step) -> Vec<CacheGroup<'_>> {
    s.groups
        .iter()
        .map(|g| CacheGroup {
            slots: &g.slots,
            block_tables: &g.tables,
            seq_lens: &g.lens,
            max_blocks: g.width,
            num_blocks: g.blocks,
        })
        .collect()
}

/// The residual stream and the caches after one step run by `run`.
fn run_step(c: &Case, run: Runner) -> (Vec<Bf16>, Vec<BfCache>) {
    let s = &c.step;
    let mut h = c.h0.clone();
    let mut owned = c.caches.clone();
    let views: Vec<DecoderLayer<'_>> = c.layers.iter().map(Layer::view).collect();
    let mut cache_views: Vec<LayerCache<'_>> =
        owned.iter_mut().map(|(k, v)| LayerCache { k, v }).collect();
    let (ropes, groups) = (ropes_of(s), groups_of(s));
    let inputs = DecodeInputs {
        ropes: &ropes,
        groups: &groups,
        shape: s.shape(),
        eps: EPS,
        per_layer: &[],
    };
    run(&mut h, &views, &mut cache_views, &inputs);
    drop(cache_views);
    (h, owned)
}

/// The step against the f64 reference: the residual and every cache within bf16's
/// rounding of the step's values. Returns the residual stream.
fn check_case(c: &Case, what: &str) -> Vec<Bf16> {
    let (want_h, want_caches) = reference(&c.layers, &c.h0, &c.caches, &c.step);
    let (h, owned) = run_step(c, scoped);

    // bf16 rounds every intermediate (about 3 significant digits): a wiring mistake (a
    // wrong half, slot, sign or head) moves values by their own size instead.
    let got = f64s(&h);
    let err: Vec<f64> = got.iter().zip(&want_h).map(|(a, b)| a - b).collect();
    assert!(
        max_abs(&err) <= 0.02 * max_abs(&want_h),
        "{what}: h error {} against values up to {}",
        max_abs(&err),
        max_abs(&want_h)
    );
    for (i, ((k, v), (wk, wv))) in owned.iter().zip(&want_caches).enumerate() {
        for (got, want) in [(f64s(k), wk), (f64s(v), wv)] {
            let err: Vec<f64> = got.iter().zip(want).map(|(a, b)| a - b).collect();
            assert!(
                max_abs(&err) <= 0.02 * max_abs(want),
                "{what}: layer {i}'s cache error {}",
                max_abs(&err)
            );
        }
    }
    h
}

fn run_case(window: [usize; 2]) {
    check_case(&case(window), &format!("windows {window:?}"));
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

/// Each variant against the reference, and against the same layers with the variant's
/// feature taken out: the feature must change the result by more than the tolerance, so
/// a kernel that ignored it would fail.
fn check_variant(seed: u64, specs: &[Spec], plain: &[Spec], what: &str) {
    let got = check_case(&case_of(seed, specs), what);
    let c = case_of(seed, plain);
    let (without, _) = reference(&c.layers, &c.h0, &c.caches, &c.step);
    let got = f64s(&got);
    let diff: Vec<f64> = got.iter().zip(&without).map(|(a, b)| a - b).collect();
    assert!(
        max_abs(&diff) > 0.05 * max_abs(&without),
        "{what}: the feature changes nothing ({} against {})",
        max_abs(&diff),
        max_abs(&without)
    );
}

#[test]
fn soft_capped_attention() {
    // Scores of a few units with scale 1: a cap of 2 bends them hard.
    let capped = Spec {
        scale: 1.0,
        softcap: 2.0,
        ..LLAMA
    };
    let plain = Spec {
        softcap: 0.0,
        ..capped
    };
    check_variant(11, &[capped, capped], &[plain, plain], "softcap");
}

#[test]
fn gelu_tanh_mlp() {
    let gelu = Spec {
        activation: Activation::GeluTanhMul,
        ..LLAMA
    };
    check_variant(12, &[gelu, gelu], &[LLAMA, LLAMA], "gelu");
}

#[test]
fn norms_after_each_sublayer_only() {
    // OLMo 2: no pre-norms, an output norm after each sublayer, whole-projection q/k norms.
    let olmo = Spec {
        norms: [false, true, false, true],
        qk_norm: QkNorm::Whole,
        ..LLAMA
    };
    let pre = Spec {
        norms: [true, false, true, false],
        ..olmo
    };
    check_variant(13, &[olmo, olmo], &[pre, pre], "norms after");
}

#[test]
fn sandwich_norms_gelu_softcap_and_two_rope_tables() {
    // Gemma 2/3: all four norms, per-head q/k norms, GELU-tanh, a softcap; a local
    // sliding layer on table 0 and a global layer on table 1.
    let local = Spec {
        norms: [true; 4],
        qk_norm: QkNorm::PerHead,
        activation: Activation::GeluTanhMul,
        softcap: 3.0,
        scale: 0.5,
        window: 4,
        ..LLAMA
    };
    let global = Spec {
        window: 0,
        rope_table: 1,
        ..local
    };
    let pre_only = |sp: Spec| Spec {
        norms: [true, false, true, false],
        ..sp
    };
    check_variant(
        14,
        &[local, global],
        &[pre_only(local), pre_only(global)],
        "sandwich",
    );
    // The global layer's table matters.
    check_variant(
        15,
        &[local, global],
        &[
            local,
            Spec {
                rope_table: 0,
                ..global
            },
        ],
        "two rope tables",
    );
}

#[test]
fn whole_projection_q_k_norms() {
    let whole = Spec {
        qk_norm: QkNorm::Whole,
        ..LLAMA
    };
    check_variant(16, &[whole, whole], &[LLAMA, LLAMA], "whole q/k norm");
}

#[test]
fn partial_and_no_rotary() {
    for (seed, rd) in [(17, HD / 2), (18, HD * 3 / 4)] {
        let partial = Spec {
            rotary_dim: rd,
            rope_table: 2,
            ..LLAMA
        };
        check_variant(
            seed,
            &[partial, partial],
            &[LLAMA, LLAMA],
            &format!("rotary {rd}"),
        );
    }
    let nope = Spec {
        rotary_dim: 0,
        ..LLAMA
    };
    // SmolLM3: NoPE layers between rotary ones.
    check_variant(19, &[nope, LLAMA], &[LLAMA, LLAMA], "no rotary");
}

#[test]
fn residual_multiplier() {
    let granite = Spec {
        residual_scale: 0.25,
        ..LLAMA
    };
    check_variant(20, &[granite, granite], &[LLAMA, LLAMA], "residual scale");
    // With output norms too: norm first, then the multiplier.
    let both = Spec {
        norms: [true; 4],
        residual_scale: 0.5,
        ..LLAMA
    };
    let unscaled = Spec {
        residual_scale: 1.0,
        ..both
    };
    check_variant(21, &[both, both], &[unscaled, unscaled], "norms and scale");
}

#[test]
fn two_cache_groups_with_their_own_blocks() {
    // A sliding layer in group 1 (fewer blocks, other block ids), a full one in group 0.
    let sliding = Spec {
        window: 4,
        cache_group: 1,
        ..LLAMA
    };
    let full = LLAMA;
    let c = case_of(22, &[sliding, full, sliding]);
    check_case(&c, "cache groups");
    // Group 1's slots were written in group 1's caches only.
    let (_, caches) = run_step(&c, scoped);
    for (i, ((k, _), (k0, _))) in caches.iter().zip(&c.caches).enumerate() {
        let blocks = c.step.groups[c.layers[i].spec.cache_group].blocks;
        assert_eq!(k.len(), blocks * BLOCK * KV_ROW);
        let changed = k.iter().zip(k0).filter(|(a, b)| a != b).count();
        assert!(
            changed > 0 && changed <= 2 * KV_ROW,
            "layer {i}: {changed} changed"
        );
    }
    check_variant(23, &[sliding, full], &[full, full], "group + window");
}

#[test]
fn an_activation_is_named_as_checkpoints_name_it() {
    assert_eq!(Activation::from_name("silu"), Some(Activation::SiluMul));
    assert_eq!(
        Activation::from_name("gelu_pytorch_tanh"),
        Some(Activation::GeluTanhMul)
    );
    assert_eq!(
        Activation::from_name("gelu_tanh"),
        Some(Activation::GeluTanhMul)
    );
    assert_eq!(Activation::from_name("gelu"), None);
}

#[test]
fn bad_steps_are_errors_and_write_nothing() {
    let mut rng = Rng(7);
    let layers = [layer(
        &mut rng,
        Spec {
            kinds: ["q4", "bf16", "q8", "q8"],
            ..LLAMA
        },
    )];
    let s = step();
    let cache_len = BLOCKS * BLOCK * KV_ROW;
    let mut k = bf16s(&mut rng, cache_len, 1.0, 0.0);
    let mut v = bf16s(&mut rng, cache_len, 1.0, 0.0);
    let (k0, v0) = (k.clone(), v.clone());
    let h0 = bf16s(&mut rng, 2 * HIDDEN, 1.0, 0.0);
    let good = layers[0].view();
    let shape = s.shape();
    let g = &s.groups[0];
    let bad_block = vec![3, 5, 0, 1, 60, 2];
    let bad_slot = vec![g.slots[0], (BLOCKS * BLOCK) as i64];
    let too_long = vec![7, 13];
    let ropes = ropes_of(&s);
    let short_norm = vec![Bf16::from_f32(1.0); HD + 1];
    let wrong_qk = vec![Bf16::from_f32(1.0); 2 * HD];
    let short_cos = RopeTable {
        cos: &ropes[0].cos[..HD],
        ..ropes[0]
    };
    let bad_layers: [DecoderLayer<'_>; 7] = [
        DecoderLayer {
            q_norm: Some(&wrong_qk),
            k_norm: Some(&wrong_qk),
            ..good
        },
        DecoderLayer {
            k_norm: Some(&short_norm),
            ..good
        },
        DecoderLayer {
            attn_out_norm: Some(&short_norm),
            ..good
        },
        DecoderLayer {
            rotary_dim: HD / 2,
            ..good
        },
        DecoderLayer {
            rope_table: 5,
            ..good
        },
        DecoderLayer {
            cache_group: 2,
            ..good
        },
        DecoderLayer {
            // This cache is group 0's size.
            cache_group: 1,
            ..good
        },
    ];
    let group = |tables, slots, lens| CacheGroup {
        slots,
        block_tables: tables,
        seq_lens: lens,
        max_blocks: g.width,
        num_blocks: g.blocks,
    };
    let good_group = group(&g.tables, &g.slots, &g.lens);
    let group1 = groups_of(&s)[1];
    let mut cases: Vec<(DecoderLayer<'_>, Vec<CacheGroup<'_>>, Vec<RopeTable<'_>>)> = vec![
        (
            good,
            vec![group(&bad_block, &g.slots, &g.lens)],
            ropes.clone(),
        ),
        (
            good,
            vec![group(&g.tables, &bad_slot, &g.lens)],
            ropes.clone(),
        ),
        (
            good,
            vec![group(&g.tables, &g.slots, &too_long)],
            ropes.clone(),
        ),
        (good, vec![good_group], vec![short_cos]),
        (good, vec![good_group, group1], vec![]),
    ];
    for l in bad_layers {
        cases.push((l, vec![good_group, group1], ropes.clone()));
    }
    for (i, (l, groups, ropes)) in cases.iter().enumerate() {
        let mut h = h0.clone();
        let mut caches = [LayerCache {
            k: &mut k,
            v: &mut v,
        }];
        let inputs = DecodeInputs {
            ropes,
            groups,
            shape,
            eps: EPS,
            per_layer: &[],
        };
        let result = decode_layers(&mut h, &[*l], &mut caches, &inputs, 2, &ScopedThreads);
        assert!(result.is_err(), "case {i} was taken");
        assert_eq!(h, h0, "case {i}");
    }
    assert!(k == k0 && v == v0);
    // And the good layer runs.
    let mut h = h0.clone();
    let mut caches = [LayerCache {
        k: &mut k,
        v: &mut v,
    }];
    let inputs = DecodeInputs {
        ropes: &ropes,
        groups: &[good_group],
        shape,
        eps: EPS,
        per_layer: &[],
    };
    decode_layers(&mut h, &[good], &mut caches, &inputs, 2, &ScopedThreads).unwrap();
    assert_ne!(h, h0);
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

#[test]
fn tanh_is_within_two_ulp_and_saturates() {
    let mut worst = 0f64;
    let mut x = -12.0f32;
    while x < 12.0 {
        let got = f64::from(tanh(x));
        let want = f64::from(x).tanh();
        let ulp = f64::from(f32::EPSILON) * want.abs().max(f64::from(f32::MIN_POSITIVE));
        worst = worst.max((got - want).abs() / ulp);
        x += 0.00137;
    }
    assert!(worst <= 2.0, "worst error {worst} ulp");
    assert_eq!(tanh(50.0), 1.0);
    assert_eq!(tanh(-50.0), -1.0);
    assert_eq!(tanh(0.0), 0.0);
    assert!(tanh(f32::NAN).is_nan());
}

#[test]
fn gelu_tanh_mul_rounds_like_torch() {
    // torch: F.gelu(gate, approximate="tanh") in f32 (its formula, in its order, with an
    // accurate tanh) rounded to bf16, then * up rounded to bf16. At -6 the tanh rounds to
    // -1 in f32 and the GELU to -0, as torch's does.
    let values = [-6.0f32, -3.0, -0.7, -0.01, 0.0, 0.3, 0.5, 2.0, 10.0];
    let n = values.len();
    let mut gate_up: Vec<Bf16> = values.iter().map(|&v| Bf16::from_f32(v)).collect();
    gate_up.extend(values.iter().map(|&v| Bf16::from_f32(1.5 - v / 4.0)));
    let mut out = vec![Bf16(0); n];
    gelu_tanh_mul(&mut out, &gate_up, n);
    for i in 0..n {
        let g = gate_up[i].to_f32();
        let beta = (2.0 / std::f64::consts::PI).sqrt() as f32;
        let inner = beta * (g + 0.044715 * (g * g * g));
        let gelu = Bf16::from_f32(0.5 * g * (1.0 + inner.tanh())).to_f32();
        let want = Bf16::from_f32(gelu * gate_up[n + i].to_f32());
        assert_eq!(out[i], want, "element {i} (gate {g})");
    }
}

/// The step over `views` (the case's layers, changed) and `caches`, with `per_layer`.
fn run_views(
    c: &Case,
    views: &[DecoderLayer<'_>],
    mut caches: Vec<BfCache>,
    per_layer: &[Bf16],
) -> Result<(Vec<Bf16>, Vec<BfCache>), String> {
    let s = &c.step;
    let mut h = c.h0.clone();
    let mut cache_views: Vec<LayerCache<'_>> = caches
        .iter_mut()
        .map(|(k, v)| LayerCache { k, v })
        .collect();
    let (ropes, groups) = (ropes_of(s), groups_of(s));
    let inputs = DecodeInputs {
        ropes: &ropes,
        groups: &groups,
        shape: s.shape(),
        eps: EPS,
        per_layer,
    };
    decode_layers(&mut h, views, &mut cache_views, &inputs, 2, &ScopedThreads).map_err(|e| e.0)?;
    drop(cache_views);
    Ok((h, caches))
}

fn dense(rng: &mut Rng, n: usize, k: usize) -> Vec<Bf16> {
    bf16s(rng, n * k, 0.15, 0.0)
}

fn bf16_projection(w: &[Bf16], n: usize, k: usize) -> Projection<'_> {
    Projection {
        weight: Matrix::Bf16(w),
        bias: None,
        n,
        k,
    }
}

const GEMMA4: Spec = Spec {
    kinds: ["bf16"; 4],
    qk_norm: QkNorm::PerHead,
    activation: Activation::GeluTanhMul,
    scale: 1.0,
    ..LLAMA
};

#[test]
fn values_from_the_keys_are_a_v_projection_that_repeats_k() {
    let c = case_of(0x9e44_0001, &[GEMMA4, GEMMA4]);
    let Store::Dense(w) = &c.layers[1].qkv.store else {
        unreachable!()
    };
    let (q_rows, k_rows) = (HEADS * HD * HIDDEN, KV_ROW * HIDDEN);
    // q|k alone, and q|k|k: the same values, taken from the k projection or a copy of it.
    let q_k = w[..q_rows + k_rows].to_vec();
    let q_k_k = [&w[..q_rows + k_rows], &w[q_rows..q_rows + k_rows]].concat();
    let mut plain = c.layers.iter().map(Layer::view).collect::<Vec<_>>();
    let v_norm = LayerExtras {
        v_norm: true,
        ..Default::default()
    };
    plain[1].qkv = bf16_projection(&q_k_k, (HEADS + 2 * KV_HEADS) * HD, HIDDEN);
    plain[1].extras = v_norm;
    let mut from_k = plain.clone();
    from_k[1].qkv = bf16_projection(&q_k, (HEADS + KV_HEADS) * HD, HIDDEN);
    from_k[1].extras = LayerExtras {
        v_from_k: true,
        ..v_norm
    };
    let want = run_views(&c, &plain, c.caches.clone(), &[]).unwrap();
    let got = run_views(&c, &from_k, c.caches.clone(), &[]).unwrap();
    assert!(got == want);
    // The v norm matters: without it the step differs.
    plain[1].extras = LayerExtras::default();
    assert!(run_views(&c, &plain, c.caches.clone(), &[]).unwrap().0 != want.0);
}

#[test]
fn a_layer_sharing_k_v_attends_its_sources_cache_and_stores_nothing() {
    let c = case_of(0x9e44_0002, &[GEMMA4, GEMMA4, GEMMA4]);
    let Store::Dense(w) = &c.layers[2].qkv.store else {
        unreachable!()
    };
    let q_only = w[..HEADS * HD * HIDDEN].to_vec();
    let mut views = c.layers.iter().map(Layer::view).collect::<Vec<_>>();
    views[2].qkv = bf16_projection(&q_only, HEADS * HD, HIDDEN);
    views[2].k_norm = None;
    views[2].extras.kv_source = Some(0);
    let mut caches = c.caches.clone();
    caches[2] = (Vec::new(), Vec::new());
    let (h, after) = run_views(&c, &views, caches.clone(), &[]).unwrap();
    // The first two layers as a plain step: the same caches, and layer 2 changed h.
    let two = run_views(&c, &views[..2], c.caches[..2].to_vec(), &[]).unwrap();
    assert!(after[..2] == two.1[..] && after[2] == caches[2]);
    assert!(h != two.0);
    // Layer 2 reads layer 0's cache, this step's rows included: another cache there
    // gives another result, and a layer that stores its own K/V there is unaffected.
    let mut other = caches.clone();
    other[0]
        .1
        .iter_mut()
        .for_each(|v| *v = Bf16::from_f32(v.to_f32() * 0.5));
    let (h_other, _) = run_views(&c, &views, other, &[]).unwrap();
    assert!(h_other != h);
    // Refused before the step: a later source, a source that shares,
    // a source in another group, a cache of its own, k norms.
    let mut later = views.clone();
    later[1].extras.kv_source = Some(2);
    later[1].qkv = views[2].qkv;
    later[1].k_norm = None;
    let mut chained = views.clone();
    chained.push(views[2]);
    chained[3].extras.kv_source = Some(2);
    let mut grouped = views.clone();
    grouped[2].cache_group = 1;
    let mut normed = views.clone();
    normed[2].k_norm = views[0].k_norm;
    let mut chained_caches = caches.clone();
    chained_caches.push((Vec::new(), Vec::new()));
    let bad: [(&[DecoderLayer<'_>], Vec<BfCache>); 5] = [
        (&later, {
            let mut cs = caches.clone();
            cs.swap(1, 2);
            cs
        }),
        (&chained, chained_caches),
        (&grouped, caches.clone()),
        (&views, c.caches.clone()),
        (&normed, caches.clone()),
    ];
    for (i, (layers, cs)) in bad.into_iter().enumerate() {
        let err = run_views(&c, layers, cs, &[]).expect_err(&format!("case {i} was taken"));
        assert!(
            err.contains("cannot attend") || err.contains("sizes"),
            "case {i}: {err}"
        );
    }
}

#[test]
fn a_per_layer_embedding_block_and_a_layer_scalar_join_after_the_mlp() {
    const PLE: usize = 8;
    let c = case_of(0x9e44_0003, &[GEMMA4, GEMMA4]);
    let mut rng = Rng(0x9e44_0004);
    let (gate, proj) = (dense(&mut rng, PLE, HIDDEN), dense(&mut rng, HIDDEN, PLE));
    let norm = bf16s(&mut rng, HIDDEN, 0.5, 1.0);
    let rows = c.step.rows();
    let vectors = bf16s(&mut rng, rows * 2 * PLE, 1.0, 0.0);
    let block = PerLayerInput {
        gate: bf16_projection(&gate, PLE, HIDDEN),
        proj: bf16_projection(&proj, HIDDEN, PLE),
        norm: &norm,
    };
    let plain = c.layers.iter().map(Layer::view).collect::<Vec<_>>();
    let mut with = plain.clone();
    for l in &mut with {
        l.extras.ple = Some(block);
    }
    let (h_plain, caches_plain) = run_views(&c, &plain, c.caches.clone(), &[]).unwrap();
    // Zero vectors: the block adds norm(0) = 0, bit for bit the plain step.
    let zeros = vec![Bf16(0); rows * 2 * PLE];
    let (h_zero, _) = run_views(&c, &with, c.caches.clone(), &zeros).unwrap();
    assert!(h_zero == h_plain);
    // The last layer's block against its definition in f64 over the plain step's output
    // (the first layer's block without effect: its vectors zero).
    let mut last_only = vectors.clone();
    for r in 0..rows {
        last_only[r * 2 * PLE..][..PLE].fill(Bf16(0));
    }
    let (h, caches) = run_views(&c, &with, c.caches.clone(), &last_only).unwrap();
    let mut want = Vec::new();
    for r in 0..rows {
        let x = f64s(&h_plain[r * HIDDEN..][..HIDDEN]);
        let g = bf16_apply(&gate, PLE, HIDDEN, &x);
        let v = f64s(&last_only[(r * 2 + 1) * PLE..][..PLE]);
        let gated: Vec<f64> = g.iter().zip(&v).map(|(g, v)| gelu_tanh(*g) * v).collect();
        let d = rms_norm(&bf16_apply(&proj, HIDDEN, PLE, &gated), &norm);
        want.extend(x.iter().zip(&d).map(|(x, d)| x + d));
    }
    let err: Vec<f64> = f64s(&h).iter().zip(&want).map(|(a, b)| a - b).collect();
    assert!(
        max_abs(&err) <= 0.02 * max_abs(&want),
        "error {}",
        max_abs(&err)
    );
    assert!(
        max_abs(&err)
            < 0.2
                * max_abs(
                    &f64s(&h_plain)
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| a - b)
                        .collect::<Vec<_>>()
                )
    );
    assert!(caches == caches_plain);
    // A scalar on each layer's output: the last layer's multiplies the residual, rounded.
    let mut scaled = plain.clone();
    scaled[1].extras.layer_scalar = Some(0.375);
    let (h_scaled, _) = run_views(&c, &scaled, c.caches.clone(), &[]).unwrap();
    let want: Vec<Bf16> = h_plain
        .iter()
        .map(|v| Bf16::from_f32(v.to_f32() * 0.375))
        .collect();
    assert!(h_scaled == want);
    // The vectors must be [rows, layers, ple_dim].
    let err = run_views(&c, &with, c.caches.clone(), &vectors[PLE..]).unwrap_err();
    assert!(err.contains("per-layer input"), "{err}");
}

/// `x W^T` in f64 for a bf16 `[n, k]` weight.
fn bf16_apply(w: &[Bf16], n: usize, k: usize, x: &[f64]) -> Vec<f64> {
    (0..n)
        .map(|i| {
            (0..k)
                .map(|j| f64::from(w[i * k + j].to_f32()) * x[j])
                .sum()
        })
        .collect()
}

#[test]
fn per_layer_head_shapes() {
    // One wide layer (heads of 2 * HD, one K/V head) between two of the step's shape: it
    // matches the same layer run as a step of its own shape.
    let c = case_of(0x9e44_0005, &[GEMMA4]);
    let mut rng = Rng(0x9e44_0006);
    let (hd, kv) = (2 * HD, 1);
    let qkv = dense(&mut rng, (HEADS + 2 * kv) * hd, HIDDEN);
    let o = dense(&mut rng, HIDDEN, HEADS * hd);
    let q_norm = bf16s(&mut rng, hd, 0.5, 1.0);
    let blocks = c.step.groups[0].blocks * BLOCK;
    let cache = (
        bf16s(&mut rng, blocks * kv * hd, 1.0, 0.0),
        bf16s(&mut rng, blocks * kv * hd, 1.0, 0.0),
    );
    let first = c.layers[0].view();
    let wide = DecoderLayer {
        qkv: bf16_projection(&qkv, (HEADS + 2 * kv) * hd, HIDDEN),
        o: bf16_projection(&o, HIDDEN, HEADS * hd),
        q_norm: Some(&q_norm),
        k_norm: Some(&q_norm),
        rotary_dim: 0,
        ..first
    };
    let with_extras = DecoderLayer {
        extras: LayerExtras {
            head_dim: hd,
            kv_heads: kv,
            ..Default::default()
        },
        ..wide
    };
    let caches = vec![c.caches[0].clone(), cache.clone()];
    let (h, after) = run_views(&c, &[first, with_extras], caches, &[]).unwrap();
    // The same two layers as two steps: the first, then the wide one in a step whose
    // shape is its own.
    let (h1, first_cache) = run_views(&c, &[first], vec![c.caches[0].clone()], &[]).unwrap();
    let s = &c.step;
    let mut h2 = h1.clone();
    let mut wide_cache = cache.clone();
    let (ropes, groups) = (ropes_of(s), groups_of(s));
    let inputs = DecodeInputs {
        ropes: &ropes[..0],
        groups: &groups,
        shape: DecodeShape {
            num_kv_heads: kv,
            head_dim: hd,
            ..s.shape()
        },
        eps: EPS,
        per_layer: &[],
    };
    let mut views = [LayerCache {
        k: &mut wide_cache.0,
        v: &mut wide_cache.1,
    }];
    decode_layers(&mut h2, &[wide], &mut views, &inputs, 2, &ScopedThreads).unwrap();
    assert!(h == h2);
    assert!(after == vec![first_cache[0].clone(), wide_cache]);
}

#[test]
fn rope_q_rotates_as_rope_store_kv_does() {
    let mut rng = Rng(0x9e44_0007);
    let (tokens, heads, kv_heads, hd) = (3, 4, 2, 16);
    let width = (heads + 2 * kv_heads) * hd;
    let qkv = bf16s(&mut rng, tokens * width, 1.0, 0.0);
    for rd in [hd, hd / 2, 0] {
        let cos = bf16s(&mut rng, tokens * rd, 1.0, 0.0);
        let sin = bf16s(&mut rng, tokens * rd, 1.0, 0.0);
        let mut want = vec![Bf16(0); tokens * heads * hd];
        let (mut k, mut v) = (
            vec![Bf16(0); tokens * kv_heads * hd],
            vec![Bf16(0); tokens * kv_heads * hd],
        );
        let slots: Vec<i64> = (0..tokens as i64).collect();
        rope_store_kv(
            &mut want, &mut k, &mut v, &qkv, &cos, &sin, &slots, heads, kv_heads, hd, rd,
        )
        .unwrap();
        let q: Vec<Bf16> = qkv
            .chunks_exact(width)
            .flat_map(|r| r[..heads * hd].to_vec())
            .collect();
        let mut got = vec![Bf16(0); tokens * heads * hd];
        rope_q(&mut got, &q, &cos, &sin, tokens, heads, hd, rd).unwrap();
        assert!(got == want, "rotary_dim {rd}");
    }
    let mut out = vec![Bf16(0); 4];
    assert!(rope_q(&mut out, &qkv[..5], &[], &[], 1, 1, 4, 0).is_err());
}

#[test]
fn a_norm_that_rounds_once_rounds_the_weighted_value() {
    let mut rng = Rng(0x9e44_0008);
    let (rows, dim) = (4, 96);
    let x = bf16s(&mut rng, rows * dim, 3.0, 0.0);
    let w = bf16s(&mut rng, dim, 0.5, 1.0);
    let (mut once, mut twice) = (vec![Bf16(0); rows * dim], vec![Bf16(0); rows * dim]);
    add_rms_norm_once(
        &mut once,
        &mut x.clone(),
        None,
        &w,
        rows,
        EPS,
        1,
        &ScopedThreads,
    )
    .unwrap();
    add_rms_norm(
        &mut twice,
        &mut x.clone(),
        None,
        &w,
        rows,
        EPS,
        1,
        &ScopedThreads,
    )
    .unwrap();
    // Each value is the f64 one rounded once (the f32 statistics aside: within an ulp).
    for (r, row) in once.chunks_exact(dim).enumerate() {
        let want = rms_norm(&f64s(&x[r * dim..][..dim]), &w);
        for (got, want) in row.iter().zip(&want) {
            let ulp = Bf16::from_f32(*want as f32).to_f32().abs() / 128.0;
            assert!(
                (f64::from(got.to_f32()) - want).abs() <= f64::from(ulp),
                "{got:?} {want}"
            );
        }
    }
    assert!(once != twice);
    // With a weight of ones the two roundings agree (the v norm's case).
    let ones = vec![Bf16::from_f32(1.0); dim];
    add_rms_norm_once(
        &mut once,
        &mut x.clone(),
        None,
        &ones,
        rows,
        EPS,
        1,
        &ScopedThreads,
    )
    .unwrap();
    add_rms_norm(
        &mut twice,
        &mut x.clone(),
        None,
        &ones,
        rows,
        EPS,
        1,
        &ScopedThreads,
    )
    .unwrap();
    assert!(once == twice);
}
