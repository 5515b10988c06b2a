//! The one-call hybrid decode step against Gated DeltaNet layers written out in f64 from
//! their definition (centred norms, the fused input projection, the causal convolution with
//! its window, L2-normed q and k with key heads shared by value heads, the decay and beta,
//! the delta rule, the gated RMSNorm, the MLP), over several steps of two sequences whose
//! states live in their own slots; and bad calls refused before anything is written.

use iron_batch_kernels::{
    decode_hybrid_layers, Activation, Bf16, CacheGroup, Element, GatedDelta, HybridInputs,
    HybridLayer, HybridShape, LayerCache, LayerState, Matrix, Mixer, Projection, RopeTable,
    ScopedThreads,
};

mod common;

use common::Rng;

const HIDDEN: usize = 32;
const INTER: usize = 48;
const KEY_HEADS: usize = 2;
const VALUE_HEADS: usize = 4;
const DK: usize = 8;
const DV: usize = 8;
const KERNEL: usize = 4;
const CH: usize = 2 * KEY_HEADS * DK + VALUE_HEADS * DV;
const IN_N: usize = CH + VALUE_HEADS * DV + 2 * VALUE_HEADS;
const SLOTS: usize = 3;
const EPS: f32 = 1e-6;

struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    in_proj: Vec<Bf16>,
    conv: Vec<Bf16>,
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Vec<Bf16>,
    out_proj: Vec<Bf16>,
    gate_up: Vec<Bf16>,
    down: Vec<Bf16>,
}

fn bf16s(rng: &mut Rng, len: usize, scale: f32) -> Vec<Bf16> {
    (0..len)
        .map(|_| Bf16::from_f32(rng.unit() * scale))
        .collect()
}

fn layer(rng: &mut Rng) -> Layer {
    let centred = |rng: &mut Rng| (0..HIDDEN).map(|_| 1.0 + 0.3 * rng.unit()).collect();
    Layer {
        input_norm: centred(rng),
        post_norm: centred(rng),
        in_proj: bf16s(rng, IN_N * HIDDEN, 0.4),
        conv: bf16s(rng, CH * KERNEL, 0.6),
        neg_a: (0..VALUE_HEADS)
            .map(|_| -(0.5 + rng.unit().abs()))
            .collect(),
        dt_bias: (0..VALUE_HEADS).map(|_| rng.unit()).collect(),
        norm: bf16s(rng, DV, 1.0),
        out_proj: bf16s(rng, HIDDEN * VALUE_HEADS * DV, 0.3),
        gate_up: bf16s(rng, 2 * INTER * HIDDEN, 0.3),
        down: bf16s(rng, HIDDEN * INTER, 0.2),
    }
}

fn projection(w: &[Bf16], n: usize, k: usize) -> Projection<'_> {
    Projection {
        weight: Matrix::Bf16(w),
        bias: None,
        n,
        k,
    }
}

fn view(l: &Layer, state: usize) -> HybridLayer<'_> {
    HybridLayer {
        input_norm: &l.input_norm,
        mixer: Mixer::Delta(GatedDelta {
            in_proj: projection(&l.in_proj, IN_N, HIDDEN),
            conv_weight: &l.conv,
            kernel: KERNEL,
            neg_a: &l.neg_a,
            dt_bias: &l.dt_bias,
            norm: &l.norm,
            out_proj: projection(&l.out_proj, HIDDEN, VALUE_HEADS * DV),
            state,
        }),
        post_norm: &l.post_norm,
        gate_up: projection(&l.gate_up, 2 * INTER, HIDDEN),
        down: projection(&l.down, HIDDEN, INTER),
        activation: Activation::SiluMul,
        moe: None,
    }
}

fn shape() -> HybridShape {
    HybridShape {
        heads: 1,
        kv_heads: 1,
        head_dim: 8,
        block_size: 4,
        key_heads: KEY_HEADS,
        value_heads: VALUE_HEADS,
        key_dim: DK,
        value_dim: DV,
    }
}

/// The f64 state of one sequence in one layer: its last `KERNEL - 1` convolution inputs
/// (oldest first) and each value head's `[DK, DV]` matrix.
#[derive(Clone)]
struct RefState {
    window: Vec<Vec<f64>>,
    s: Vec<f64>,
}

fn matvec(w: &[Bf16], x: &[f64], n: usize) -> Vec<f64> {
    let k = x.len();
    (0..n)
        .map(|i| {
            (0..k)
                .map(|j| f64::from(w[i * k + j].to_f32()) * x[j])
                .sum()
        })
        .collect()
}

fn centred(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| v * inv * f64::from(*w))
        .collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn l2(x: &[f64]) -> Vec<f64> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
    x.iter().map(|v| v * inv).collect()
}

/// One token through one layer, from the definitions.
fn reference_layer(l: &Layer, h: &[f64], st: &mut RefState) -> Vec<f64> {
    let eps = f64::from(EPS);
    let a = centred(h, &l.input_norm, eps);
    let proj = matvec(&l.in_proj, &a, IN_N);
    let mixed = &proj[..CH];
    let conv: Vec<f64> = (0..CH)
        .map(|c| {
            let taps = st.window.iter().map(|w| w[c]).chain([mixed[c]]);
            silu(
                taps.enumerate()
                    .map(|(t, x)| x * f64::from(l.conv[c * KERNEL + t].to_f32()))
                    .sum(),
            )
        })
        .collect();
    st.window.remove(0);
    st.window.push(mixed.to_vec());
    let z = &proj[CH..CH + VALUE_HEADS * DV];
    let mut gated = vec![0.0; VALUE_HEADS * DV];
    for j in 0..VALUE_HEADS {
        let key = j / (VALUE_HEADS / KEY_HEADS);
        let q: Vec<f64> = l2(&conv[key * DK..(key + 1) * DK])
            .iter()
            .map(|v| v / (DK as f64).sqrt())
            .collect();
        let k = l2(&conv[KEY_HEADS * DK + key * DK..KEY_HEADS * DK + (key + 1) * DK]);
        let v = &conv[2 * KEY_HEADS * DK + j * DV..2 * KEY_HEADS * DK + (j + 1) * DV];
        let beta = 1.0 / (1.0 + (-proj[CH + VALUE_HEADS * DV + j]).exp());
        let x = proj[CH + VALUE_HEADS * DV + VALUE_HEADS + j] + f64::from(l.dt_bias[j]);
        let g = f64::from(l.neg_a[j]) * (1.0 + x.exp()).ln();
        let s = &mut st.s[j * DK * DV..(j + 1) * DK * DV];
        s.iter_mut().for_each(|e| *e *= g.exp());
        let u: Vec<f64> = (0..DV)
            .map(|c| beta * (v[c] - (0..DK).map(|r| s[r * DV + c] * k[r]).sum::<f64>()))
            .collect();
        for r in 0..DK {
            for c in 0..DV {
                s[r * DV + c] += k[r] * u[c];
            }
        }
        let o: Vec<f64> = (0..DV)
            .map(|c| (0..DK).map(|r| s[r * DV + c] * q[r]).sum())
            .collect();
        let inv = 1.0 / (o.iter().map(|v| v * v).sum::<f64>() / DV as f64 + eps).sqrt();
        for c in 0..DV {
            let normed = o[c] * inv * f64::from(l.norm[c].to_f32());
            gated[j * DV + c] = normed * silu(z[j * DV + c]);
        }
    }
    let d = matvec(&l.out_proj, &gated, HIDDEN);
    let h1: Vec<f64> = h.iter().zip(&d).map(|(a, b)| a + b).collect();
    let m = centred(&h1, &l.post_norm, eps);
    let gu = matvec(&l.gate_up, &m, 2 * INTER);
    let act: Vec<f64> = (0..INTER).map(|i| silu(gu[i]) * gu[INTER + i]).collect();
    let d = matvec(&l.down, &act, HIDDEN);
    h1.iter().zip(&d).map(|(a, b)| a + b).collect()
}

fn no_kv() -> CacheGroup<'static> {
    CacheGroup {
        slots: &[],
        block_tables: &[],
        seq_lens: &[],
        max_blocks: 0,
        num_blocks: 0,
    }
}

fn no_rope() -> RopeTable<'static> {
    RopeTable {
        cos: &[],
        sin: &[],
        dim: 0,
    }
}

fn pools() -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let conv = vec![vec![0f32; SLOTS * CH * (KERNEL - 1)]; 2];
    let delta = vec![vec![0f32; SLOTS * VALUE_HEADS * DK * DV]; 2];
    (conv, delta)
}

fn step(
    layers: &[HybridLayer<'_>],
    h: &mut [Bf16],
    conv: &mut [Vec<f32>],
    delta: &mut [Vec<f32>],
    slots: &[i64],
) -> Result<(), iron_batch_kernels::KernelError> {
    let mut states: Vec<LayerState<'_>> = conv
        .iter_mut()
        .zip(delta.iter_mut())
        .map(|(c, d)| LayerState { conv: c, delta: d })
        .collect();
    let inputs = HybridInputs {
        rope: no_rope(),
        kv: no_kv(),
        state_slots: slots,
        shape: shape(),
        eps: EPS,
    };
    let mut caches: Vec<LayerCache<'_>> = Vec::new();
    decode_hybrid_layers(
        h,
        layers,
        &mut caches,
        &mut states,
        &inputs,
        2,
        &ScopedThreads,
    )
}

#[test]
fn delta_layers_over_several_steps_match_the_rule_written_out_in_f64() {
    let mut rng = Rng(0x5eed_4a11);
    let owned = [layer(&mut rng), layer(&mut rng)];
    let layers: Vec<HybridLayer<'_>> = owned.iter().enumerate().map(|(i, l)| view(l, i)).collect();
    let (mut conv, mut delta) = pools();
    // Two sequences in slots 2 and 0; each layer keeps each sequence's state apart.
    let slots = [2i64, 0];
    let fresh = RefState {
        window: vec![vec![0.0; CH]; KERNEL - 1],
        s: vec![0.0; VALUE_HEADS * DK * DV],
    };
    let mut reference = vec![vec![fresh; 2]; 2];
    let mut worst = 0f64;
    for _ in 0..6 {
        let mut h = bf16s(&mut rng, 2 * HIDDEN, 1.0);
        let mut want = Vec::new();
        for (r, row) in h.chunks(HIDDEN).enumerate() {
            let mut x: Vec<f64> = row.iter().map(|v| f64::from(v.to_f32())).collect();
            for (l, st) in owned.iter().zip(reference.iter_mut()) {
                x = reference_layer(l, &x, &mut st[r]);
            }
            want.extend(x);
        }
        step(&layers, &mut h, &mut conv, &mut delta, &slots).unwrap();
        let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
        for (g, w) in h.iter().zip(&want) {
            worst = worst.max((f64::from(g.to_f32()) - w).abs() / scale);
        }
    }
    // bf16 activations through two layers and six steps of state: a few bf16 steps.
    assert!(worst < 0.03, "worst relative error {worst}");
    // The slot no row used is untouched.
    let per = VALUE_HEADS * DK * DV;
    assert!(delta[0][per..2 * per].iter().all(|&v| v == 0.0));
    assert!(delta[0][..per].iter().any(|&v| v != 0.0));
}

#[test]
fn bad_calls_are_refused_and_write_nothing() {
    let mut rng = Rng(7);
    let owned = [layer(&mut rng), layer(&mut rng)];
    let layers: Vec<HybridLayer<'_>> = owned.iter().enumerate().map(|(i, l)| view(l, i)).collect();
    let (mut conv, mut delta) = pools();
    for p in conv.iter_mut().chain(delta.iter_mut()) {
        p.iter_mut().for_each(|v| *v = rng.unit());
    }
    let h0 = bf16s(&mut rng, 2 * HIDDEN, 1.0);
    let (conv0, delta0) = (conv.clone(), delta.clone());
    let cases: [(&[i64], &str); 3] = [
        (&[1, 1], "distinct"),
        (&[0, 3], "distinct and below 3"),
        (&[-1, 0], "distinct"),
    ];
    for (slots, message) in cases {
        let mut h = h0.clone();
        let err = step(&layers, &mut h, &mut conv, &mut delta, slots).unwrap_err();
        assert!(err.0.contains(message), "{}", err.0);
        assert_eq!(h, h0);
    }
    // A layer naming a state the step does not have.
    let mut h = h0.clone();
    let wrong = [view(&owned[0], 0), view(&owned[1], 2)];
    let err = step(&wrong, &mut h, &mut conv, &mut delta, &[0, 1]).unwrap_err();
    assert!(err.0.contains("layer 1"), "{}", err.0);
    // Rows that are not whole.
    let mut short = h0[..HIDDEN + 3].to_vec();
    assert!(step(&layers, &mut short, &mut conv, &mut delta, &[0, 1]).is_err());
    assert_eq!((conv, delta), (conv0, delta0));
}
