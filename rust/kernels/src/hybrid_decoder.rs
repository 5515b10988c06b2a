//! A decode step over a stack that mixes Gated DeltaNet layers (a recurrent state per
//! sequence) with gated full-attention layers (paged KV), in one call: Qwen3.5's layout.
//!
//! Called layer by layer from Python, a Gated DeltaNet layer at batch 1 is some forty small
//! torch operations around its two projections (the convolution's inputs cut out, the
//! L2 norms of q and k, the decay and beta, the gated norm of the output), each an
//! interpreter round trip and an allocation: on a 2-core CPU about a quarter of a
//! 0.8B-parameter model's step. Here they run as plain loops between the same kernels
//! (GEMV, causal convolution, delta rule, paged attention), the residual kept in Rust.
//!
//! The rounding follows the Python path (`iron_batch.models.qwen3_5`,
//! `iron_batch.layers.gated_delta`): every value torch rounds to bf16 is rounded here, the
//! norms' statistics and the delta rule are f32. The f32 reductions (the L2 norms of q and
//! k, the norms' sums of squares) add in another order than torch's, so a value can differ
//! in its last f32 bit before it is rounded; the step is not bit for bit the Python path's,
//! which the tests compare within a tolerance.
//!
//! Per layer (norms are "centred": `x / rms(x) * (1 + w)`, with `1 + w` given in f32 and the
//! product rounded once):
//!
//! ```text
//! a = input_norm(h)
//! d = mixer(a)                     // gated attention or Gated DeltaNet, below
//! h = h + d
//! d = down(silu(gate) * up)        // gate, up = gate_up(post_norm(h)); or the sparse
//! h = h + d                        // MLP (`crate::moe`: router, experts, shared expert)
//! ```

use crate::attention::{DecodeShape, KernelError, Parallel};
use crate::decoder::{Activation, CacheGroup, LayerKv, Projection, RopeTable};
use crate::delta_rule::{causal_conv_decode, delta_rule_decode, DeltaShape};
use crate::element::{Bf16, Element};
use crate::moe::SparseMlp;

/// A gated full-attention layer: the q projection is doubled, each head's q followed by a
/// gate whose sigmoid multiplies that head's attention output.
#[derive(Clone, Copy)]
pub struct GatedAttention<'a> {
    /// `n = (2 * heads + 2 * kv_heads) * head_dim`: per head q then its gate, then k, then v.
    pub qkv: Projection<'a>,
    /// Per-head centred norms of q and k: `1 + w`, `head_dim` values in f32.
    pub q_norm: &'a [f32],
    pub k_norm: &'a [f32],
    pub o: Projection<'a>,
    /// Leading dims of each head that are rotated; the width of the step's rotary table.
    pub rotary_dim: usize,
    pub scale: f32,
    /// Which of the step's KV caches is the layer's.
    pub cache: usize,
}

/// A Gated DeltaNet layer.
#[derive(Clone, Copy)]
pub struct GatedDelta<'a> {
    /// The fused input projection, `n = C + value_heads * value_dim + 2 * value_heads`: the
    /// convolution's `C = 2 * key_heads * key_dim + value_heads * value_dim` channels (q, k,
    /// v), the output gate z, beta's logits, the decay's.
    pub in_proj: Projection<'a>,
    /// The depthwise convolution, `[C, kernel]`.
    pub conv_weight: &'a [Bf16],
    pub kernel: usize,
    /// The decay rate `-exp(A_log)` and the bias of its softplus, one per value head.
    pub neg_a: &'a [f32],
    pub dt_bias: &'a [f32],
    /// The gated RMSNorm's weight, `value_dim` values (not centred).
    pub norm: &'a [Bf16],
    pub out_proj: Projection<'a>,
    /// Which of the step's states is the layer's.
    pub state: usize,
}

/// What a layer mixes its tokens with.
#[derive(Clone, Copy)]
pub enum Mixer<'a> {
    Attention(GatedAttention<'a>),
    Delta(GatedDelta<'a>),
}

/// One layer: the centred norms (`1 + w` in f32, `hidden` values), the mixer and the MLP.
#[derive(Clone, Copy)]
pub struct HybridLayer<'a> {
    pub input_norm: &'a [f32],
    pub mixer: Mixer<'a>,
    pub post_norm: &'a [f32],
    /// Fused gate and up: the first half of each output row is the gate.
    pub gate_up: Projection<'a>,
    pub down: Projection<'a>,
    pub activation: Activation,
    /// The MLP is sparse (Qwen3.5-MoE): a router and experts, with a shared expert, in
    /// place of `gate_up` and `down`, which are then neither read nor checked.
    pub moe: Option<SparseMlp<'a>>,
}

/// One Gated DeltaNet layer's state pools: the convolution windows `[slots, C, kernel - 1]`
/// (f32) and the delta-rule matrices `[slots, value_heads, key_dim, value_dim]`, f32 or
/// bf16 (`S`: every delta layer of a step keeps its matrices in the same type).
pub struct LayerState<'a, S: Element = f32> {
    pub conv: &'a mut [f32],
    pub delta: &'a mut [S],
}

/// The head counts and sizes of both layer kinds.
#[derive(Clone, Copy, Debug)]
pub struct HybridShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

impl HybridShape {
    fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// What the step's rows need beyond the layers: one row per decoding sequence.
#[derive(Clone, Copy)]
pub struct HybridInputs<'a> {
    /// The attention layers' rotary table of each row's position.
    pub rope: RopeTable<'a>,
    /// The attention layers' KV: each row's new slot, block table and length (with the
    /// new token).
    pub kv: CacheGroup<'a>,
    /// Each row's state slot (distinct).
    pub state_slots: &'a [i64],
    pub shape: HybridShape,
    pub eps: f32,
}

fn invalid(what: String) -> KernelError {
    KernelError(format!("decode_hybrid_layers: {what}"))
}

/// Checks every size before anything is written, so a bad call changes nothing. Returns
/// `hidden`.
fn check<S: Element>(
    h: &[Bf16],
    layers: &[HybridLayer<'_>],
    caches: &[impl LayerKv],
    states: &[LayerState<'_, S>],
    inputs: &HybridInputs<'_>,
) -> Result<usize, KernelError> {
    let s = inputs.shape;
    let rows = inputs.state_slots.len();
    let Some(first) = layers.first() else {
        return Err(invalid("no layers".into()));
    };
    let hidden = first.input_norm.len();
    if rows == 0 || hidden == 0 || h.len() != rows * hidden {
        return Err(invalid(format!(
            "{} residual values for {rows} rows of {hidden}",
            h.len()
        )));
    }
    let (hd, hv, dk, dv) = (s.head_dim, s.value_heads, s.key_dim, s.value_dim);
    if s.key_heads == 0 || !hv.is_multiple_of(s.key_heads) || s.kv_heads == 0 {
        return Err(invalid(format!(
            "{} value heads for {} key heads, {} KV heads",
            hv, s.key_heads, s.kv_heads
        )));
    }
    let kv = inputs.kv;
    let uses_kv = layers
        .iter()
        .any(|l| matches!(l.mixer, Mixer::Attention(_)));
    if uses_kv {
        if !inputs.rope.fits(rows, hd) {
            return Err(invalid(
                "the rotary table must be [rows, an even dim up to head_dim]".into(),
            ));
        }
        kv.check(rows, s.block_size)
            .map_err(|what| invalid(format!("KV {what}")))?;
    }
    let channels = s.conv_channels();
    let conv_per = |kernel: usize| channels * kernel.saturating_sub(1);
    let delta_per = hv * dk * dv;
    // The fewest state slots of any delta layer's pools.
    let mut total = usize::MAX;
    for (i, l) in layers.iter().enumerate() {
        let inter = l.gate_up.n / 2;
        let mlp_fits = match l.moe {
            Some(m) => m.fits(hidden, rows),
            None => {
                (l.gate_up.k, l.gate_up.n) == (hidden, 2 * inter)
                    && (l.down.k, l.down.n) == (inter, hidden)
                    && rows <= l.gate_up.max_rows()
                    && rows <= l.down.max_rows()
            }
        };
        let mut fits = l.input_norm.len() == hidden && l.post_norm.len() == hidden && mlp_fits;
        match l.mixer {
            Mixer::Attention(a) => {
                fits &= (a.qkv.k, a.qkv.n) == (hidden, (2 * s.heads + 2 * s.kv_heads) * hd)
                    && (a.o.k, a.o.n) == (s.heads * hd, hidden)
                    && a.q_norm.len() == hd
                    && a.k_norm.len() == hd
                    && a.rotary_dim == inputs.rope.dim
                    && a.scale.is_finite()
                    && rows <= a.qkv.max_rows()
                    && rows <= a.o.max_rows()
                    && caches
                        .get(a.cache)
                        .is_some_and(|c| c.holds(kv.num_blocks * s.block_size, s.kv_heads, hd));
            }
            Mixer::Delta(d) => {
                fits &= (d.in_proj.k, d.in_proj.n) == (hidden, channels + hv * dv + 2 * hv)
                    && (d.out_proj.k, d.out_proj.n) == (hv * dv, hidden)
                    && d.kernel >= 2
                    && d.conv_weight.len() == channels * d.kernel
                    && d.neg_a.len() == hv
                    && d.dt_bias.len() == hv
                    && d.norm.len() == dv
                    && rows <= d.in_proj.max_rows()
                    && rows <= d.out_proj.max_rows();
                let pools = states.get(d.state).and_then(|st| {
                    let per = conv_per(d.kernel);
                    let n = st.conv.len().checked_div(per)?;
                    let ok = per > 0 && st.conv.len() == n * per && st.delta.len() == n * delta_per;
                    ok.then_some(n)
                });
                match pools {
                    Some(n) => total = total.min(n),
                    None => fits = false,
                }
            }
        }
        if !fits {
            return Err(invalid(format!("layer {i}'s sizes do not fit the step")));
        }
    }
    // The state slots: distinct, and inside every delta layer's pools.
    let mut sorted: Vec<i64> = inputs.state_slots.to_vec();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1])
        || sorted.iter().any(|&t| t < 0 || t as usize >= total)
    {
        return Err(invalid(format!(
            "state slots must be distinct and below {total}"
        )));
    }
    Ok(hidden)
}

/// `out = x / rms(x) * w` per row of `x` (`w.len()` wide), in f32, rounded once: torch's
/// `(x.float() * rsqrt(mean(x^2) + eps)) * w`. Sums of squares in 16 lanes, as the RMSNorm
/// kernel adds them.
fn centred_norm(out: &mut [Bf16], x: &[Bf16], w: &[f32], eps: f32) {
    let dim = w.len();
    for (o, x) in out.chunks_exact_mut(dim).zip(x.chunks_exact(dim)) {
        let inv = inv_rms(x, eps);
        for ((o, x), w) in o.iter_mut().zip(x).zip(w) {
            *o = Bf16::from_f32(x.to_f32() * inv * w);
        }
    }
}

/// The sum of `value(i)^2` over `0..len`, in 16 lanes and then the tail, as the RMSNorm
/// kernel adds its squares.
#[inline(always)]
fn sum_of_squares(len: usize, value: impl Fn(usize) -> f32) -> f32 {
    let mut lanes = [0f32; 16];
    let whole = len / 16 * 16;
    for start in (0..whole).step_by(16) {
        for (i, lane) in lanes.iter_mut().enumerate() {
            let v = value(start + i);
            *lane += v * v;
        }
    }
    let mut sum: f32 = lanes.iter().sum();
    for i in whole..len {
        let v = value(i);
        sum += v * v;
    }
    sum
}

/// `1 / sqrt(mean(x^2) + eps)` of one row.
fn inv_rms(x: &[Bf16], eps: f32) -> f32 {
    let sum = sum_of_squares(x.len(), |i| x[i].to_f32());
    1.0 / (sum / x.len() as f32 + eps).sqrt()
}

/// `x * rsqrt(sum(x^2) + 1e-6) * scale` in place (the reference's `l2norm`, then q's scale;
/// a scale of 1 changes nothing).
fn l2_normalize(x: &mut [f32], scale: f32) {
    let inv = 1.0 / (sum_of_squares(x.len(), |i| x[i]) + 1e-6).sqrt();
    for v in x.iter_mut() {
        *v = *v * inv * scale;
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's `softplus` (beta 1, threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `h += delta`, rounded to bf16 as torch's `h + d`.
fn add_into(h: &mut [Bf16], delta: &[Bf16]) {
    for (r, d) in h.iter_mut().zip(delta) {
        *r = Bf16::from_f32(r.to_f32() + d.to_f32());
    }
}

/// Scratch rows of one step, sized for the widest layer.
struct Scratch {
    x: Vec<Bf16>,
    delta: Vec<Bf16>,
    proj: Vec<Bf16>,
    mixed: Vec<Bf16>,
    conv: Vec<Bf16>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    core: Vec<f32>,
    gated: Vec<Bf16>,
    qkv: Vec<Bf16>,
    q_rot: Vec<Bf16>,
    attn: Vec<Bf16>,
    gate_up: Vec<Bf16>,
    act: Vec<Bf16>,
}

/// Runs `layers` over the residual stream `h` (`[rows, hidden]`, the token embeddings on
/// entry) for one decode step, each row one sequence's next token: attention layers store
/// the row's K/V in their cache, delta layers advance the row's state in its slot, and `h`
/// ends as the last layer's output (before the final norm).
pub fn decode_hybrid_layers<S: Element>(
    h: &mut [Bf16],
    layers: &[HybridLayer<'_>],
    caches: &mut [impl LayerKv],
    states: &mut [LayerState<'_, S>],
    inputs: &HybridInputs<'_>,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let hidden = check(h, layers, caches, states, inputs)?;
    let s = inputs.shape;
    let rows = inputs.state_slots.len();
    let eps = inputs.eps;
    let (heads, kv_heads, hd) = (s.heads, s.kv_heads, s.head_dim);
    let (hk, hv, dk, dv) = (s.key_heads, s.value_heads, s.key_dim, s.value_dim);
    let channels = s.conv_channels();
    let widest = |f: &dyn Fn(&HybridLayer<'_>) -> usize| layers.iter().map(f).max().unwrap_or(0);
    let proj_n = widest(&|l| match l.mixer {
        Mixer::Attention(a) => a.qkv.n,
        Mixer::Delta(d) => d.in_proj.n,
    });
    let inter = widest(&|l| if l.moe.is_some() { 0 } else { l.gate_up.n / 2 });
    let zeros = |len: usize| vec![Bf16(0); len];
    let mut t = Scratch {
        x: zeros(rows * hidden),
        delta: zeros(rows * hidden),
        proj: zeros(rows * proj_n),
        mixed: zeros(rows * channels),
        conv: zeros(rows * channels),
        q: vec![0.0; rows * hv * dk],
        k: vec![0.0; rows * hv * dk],
        v: vec![0.0; rows * hv * dv],
        g: vec![0.0; rows * hv],
        beta: vec![0.0; rows * hv],
        core: vec![0.0; rows * hv * dv],
        gated: zeros(rows * hv * dv),
        qkv: zeros(rows * (heads + 2 * kv_heads) * hd),
        q_rot: zeros(rows * heads * hd),
        attn: zeros(rows * heads * hd),
        gate_up: zeros(rows * 2 * inter),
        act: zeros(rows * inter),
    };
    for layer in layers {
        centred_norm(&mut t.x, h, layer.input_norm, eps);
        match layer.mixer {
            Mixer::Attention(a) => {
                let n = a.qkv.n;
                a.qkv
                    .apply(&mut t.proj[..rows * n], &t.x, rows, threads, parallel)?;
                let width = (heads + 2 * kv_heads) * hd;
                for r in 0..rows {
                    let src = &t.proj[r * n..(r + 1) * n];
                    let dst = &mut t.qkv[r * width..(r + 1) * width];
                    for i in 0..heads {
                        let q = &src[i * 2 * hd..i * 2 * hd + hd];
                        centred_norm(&mut dst[i * hd..(i + 1) * hd], q, a.q_norm, eps);
                    }
                    let (k_src, v_src) = src[2 * heads * hd..].split_at(kv_heads * hd);
                    let (k_dst, v_dst) = dst[heads * hd..].split_at_mut(kv_heads * hd);
                    centred_norm(k_dst, k_src, a.k_norm, eps);
                    v_dst.copy_from_slice(v_src);
                }
                let kv = inputs.kv;
                let cache = &mut caches[a.cache];
                cache.rope_store(
                    &mut t.q_rot,
                    &t.qkv,
                    inputs.rope.cos,
                    inputs.rope.sin,
                    kv.slots,
                    heads,
                    kv_heads,
                    hd,
                    a.rotary_dim,
                )?;
                let shape = DecodeShape {
                    num_seqs: rows,
                    num_heads: heads,
                    num_kv_heads: kv_heads,
                    head_dim: hd,
                    block_size: s.block_size,
                    max_blocks: kv.max_blocks,
                    num_blocks: kv.num_blocks,
                    sliding_window: 0,
                };
                cache.attend(
                    &mut t.attn,
                    &t.q_rot,
                    kv.block_tables,
                    kv.seq_lens,
                    &shape,
                    a.scale,
                    0.0,
                    threads,
                    parallel,
                )?;
                // o * sigmoid(gate), each rounded to bf16 as torch's.
                for r in 0..rows {
                    let src = &t.proj[r * n..(r + 1) * n];
                    let o = &mut t.attn[r * heads * hd..(r + 1) * heads * hd];
                    for i in 0..heads {
                        let gate = &src[i * 2 * hd + hd..(i + 1) * 2 * hd];
                        for (o, g) in o[i * hd..(i + 1) * hd].iter_mut().zip(gate) {
                            let sg = Bf16::from_f32(sigmoid(g.to_f32())).to_f32();
                            *o = Bf16::from_f32(o.to_f32() * sg);
                        }
                    }
                }
                a.o.apply(&mut t.delta, &t.attn, rows, threads, parallel)?;
            }
            Mixer::Delta(d) => {
                let n = d.in_proj.n;
                d.in_proj
                    .apply(&mut t.proj[..rows * n], &t.x, rows, threads, parallel)?;
                for r in 0..rows {
                    t.mixed[r * channels..(r + 1) * channels]
                        .copy_from_slice(&t.proj[r * n..r * n + channels]);
                }
                let st = &mut states[d.state];
                causal_conv_decode(
                    &t.mixed,
                    st.conv,
                    inputs.state_slots,
                    d.conv_weight,
                    d.kernel,
                    &mut t.conv,
                    threads,
                    parallel,
                )?;
                let per = hv / hk;
                let q_scale = (dk as f64).powf(-0.5) as f32;
                for r in 0..rows {
                    let conv = &t.conv[r * channels..(r + 1) * channels];
                    let src = &t.proj[r * n..(r + 1) * n];
                    for j in 0..hv {
                        let key = j / per;
                        let at = (r * hv + j) * dk;
                        let q = &mut t.q[at..at + dk];
                        for (q, c) in q.iter_mut().zip(&conv[key * dk..(key + 1) * dk]) {
                            *q = c.to_f32();
                        }
                        l2_normalize(q, q_scale);
                        let k = &mut t.k[at..at + dk];
                        let k_at = hk * dk + key * dk;
                        for (k, c) in k.iter_mut().zip(&conv[k_at..k_at + dk]) {
                            *k = c.to_f32();
                        }
                        l2_normalize(k, 1.0);
                        let v_at = 2 * hk * dk + j * dv;
                        for (v, c) in t.v[(r * hv + j) * dv..(r * hv + j + 1) * dv]
                            .iter_mut()
                            .zip(&conv[v_at..v_at + dv])
                        {
                            *v = c.to_f32();
                        }
                        let b = src[channels + hv * dv + j].to_f32();
                        let a = src[channels + hv * dv + hv + j].to_f32();
                        t.beta[r * hv + j] = Bf16::from_f32(sigmoid(b)).to_f32();
                        t.g[r * hv + j] = d.neg_a[j] * softplus(a + d.dt_bias[j]);
                    }
                }
                delta_rule_decode(
                    st.delta,
                    inputs.state_slots,
                    &t.q,
                    &t.k,
                    &t.v,
                    &t.g,
                    &t.beta,
                    &mut t.core,
                    DeltaShape {
                        heads: hv,
                        key_dim: dk,
                        value_dim: dv,
                    },
                    threads,
                    parallel,
                )?;
                // The gated norm: each head's output (rounded to bf16) RMS-normed, times the
                // weight (a bf16 product), times silu(z) in f32, rounded once.
                let mut head = vec![Bf16(0); dv];
                for r in 0..rows {
                    let z = &t.proj[r * n + channels..r * n + channels + hv * dv];
                    for j in 0..hv {
                        let at = (r * hv + j) * dv;
                        for (c, o) in head.iter_mut().zip(&t.core[at..at + dv]) {
                            *c = Bf16::from_f32(*o);
                        }
                        let inv = inv_rms(&head, eps);
                        let out = &mut t.gated[at..at + dv];
                        for (((o, c), w), z) in
                            out.iter_mut().zip(&head).zip(d.norm).zip(&z[j * dv..])
                        {
                            let normed = Bf16::from_f32(c.to_f32() * inv).to_f32();
                            let weighted = Bf16::from_f32(w.to_f32() * normed).to_f32();
                            let z = z.to_f32();
                            *o = Bf16::from_f32(weighted * (z * sigmoid(z)));
                        }
                    }
                }
                d.out_proj
                    .apply(&mut t.delta, &t.gated, rows, threads, parallel)?;
            }
        }
        add_into(h, &t.delta);
        centred_norm(&mut t.x, h, layer.post_norm, eps);
        if let Some(m) = &layer.moe {
            m.apply(
                &mut t.delta,
                &t.x,
                rows,
                hidden,
                layer.activation,
                threads,
                parallel,
            )?;
            add_into(h, &t.delta);
            continue;
        }
        let inter = layer.gate_up.n / 2;
        let gate_up = &mut t.gate_up[..rows * 2 * inter];
        layer
            .gate_up
            .apply(gate_up, &t.x, rows, threads, parallel)?;
        let act = &mut t.act[..rows * inter];
        layer.activation.apply(act, gate_up, inter);
        layer
            .down
            .apply(&mut t.delta, act, rows, threads, parallel)?;
        add_into(h, &t.delta);
    }
    Ok(())
}
