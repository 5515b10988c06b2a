//! A whole stack of decoder layers for one decode step, in one call.
//!
//! At batch 1 a decoder layer is a dozen small operations (two RMSNorms, four projections,
//! rotary + KV store, attention, SiLU-and-mul). Called one by one from Python each pays an
//! interpreter round trip and a tensor allocation, which on a small CPU adds up to a
//! millisecond or more per token: a sixth of a quantized model's step. Here the same
//! kernels run back to back with the residual stream and the scratch rows kept in Rust.
//!
//! Every step rounds where the Python path (`iron_batch.models.decoder` over `iron_batch.layers`) rounds, through the
//! same kernels, so the two give the same bf16 values; SiLU is the one new piece (an f32
//! `x / (1 + exp(-x))` with a polynomial `exp` good to about 2 ulp, rounded to bf16 like
//! torch's, which agrees with torch but for the rare value on a rounding boundary).

use crate::attention::{paged_decode_attention, DecodeShape, KernelError, Parallel};
use crate::element::{Bf16, Element};
use crate::elementwise::{add_rms_norm, rope_store_kv};
use crate::gemv::gemv_bf16;
use crate::quant::{gemv_quant, QMatrix};

/// A projection matrix `[n, k]`: plain bf16 or quantized blocks.
#[derive(Clone, Copy)]
pub enum Matrix<'a> {
    Bf16(&'a [Bf16]),
    Quant(QMatrix<'a>),
}

/// `y = x W^T (+ bias)` for a few activation rows.
#[derive(Clone, Copy)]
pub struct Projection<'a> {
    pub weight: Matrix<'a>,
    pub bias: Option<&'a [Bf16]>,
    pub n: usize,
    pub k: usize,
}

impl Projection<'_> {
    /// Most activation rows [`Projection::apply`] takes: the bf16 GEMV serves 1-2 rows,
    /// the quantized one any number.
    pub fn max_rows(&self) -> usize {
        match self.weight {
            Matrix::Bf16(_) => 2,
            Matrix::Quant(_) => usize::MAX,
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        out: &mut [Bf16],
        x: &[Bf16],
        rows: usize,
        threads: usize,
        parallel: &dyn Parallel,
    ) -> Result<(), KernelError> {
        match self.weight {
            Matrix::Bf16(w) => gemv_bf16(
                out, x, w, self.bias, rows, self.n, self.k, threads, parallel,
            ),
            Matrix::Quant(q) => gemv_quant(
                out, x, q, self.bias, rows, self.n, self.k, threads, parallel,
            ),
        }
    }
}

/// The gated activation between an MLP's gate/up and down projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (SwiGLU).
    SiluMul,
}

impl Activation {
    /// The activation a checkpoint's config names (`hidden_act`), if the stack has it.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "silu" => Some(Self::SiluMul),
            _ => None,
        }
    }
}

/// One pre-norm decoder layer as the model describes it: its weights (fused q/k/v and
/// gate/up; `q_norm` and `k_norm` are per-head RMSNorms applied before the rotation), its
/// MLP's activation and how far back its attention reaches. A family built from these
/// parts (Llama, Mistral, Qwen2, Qwen3, and any whose layers differ only in which parts
/// are present and in each layer's window) runs here without new code.
#[derive(Clone, Copy)]
pub struct DecoderLayer<'a> {
    pub input_norm: &'a [Bf16],
    /// Fused q, k, v: `n = (heads + 2 * kv_heads) * head_dim`.
    pub qkv: Projection<'a>,
    pub q_norm: Option<&'a [Bf16]>,
    pub k_norm: Option<&'a [Bf16]>,
    pub o: Projection<'a>,
    pub post_norm: &'a [Bf16],
    /// Fused gate and up: the first half of each output row is the gate.
    pub gate_up: Projection<'a>,
    pub down: Projection<'a>,
    pub activation: Activation,
    /// Keys further back than this many positions are not attended (0: every position):
    /// layers of one model may differ (sliding and global layers).
    pub sliding_window: usize,
}

/// One layer's paged KV cache: K and V, each `[num_blocks * block_size, kv_heads * head_dim]`.
pub struct LayerCache<'a> {
    pub k: &'a mut [Bf16],
    pub v: &'a mut [Bf16],
}

/// What the step's rows need beyond the layers: one row per decoding sequence.
#[derive(Clone, Copy)]
pub struct DecodeInputs<'a> {
    /// Rotary tables of each row's position, `[rows, head_dim]` (torch's `rope_cos_sin`).
    pub cos: &'a [Bf16],
    pub sin: &'a [Bf16],
    /// Cache slot of each row's new K/V.
    pub slots: &'a [i64],
    /// `[rows, shape.max_blocks]` and `[rows]` (lengths include the new token).
    pub block_tables: &'a [i32],
    pub seq_lens: &'a [i32],
    /// `num_seqs` is the number of rows; each layer attends with its own window (the
    /// shape's `sliding_window` is not read).
    pub shape: DecodeShape,
    pub scale: f32,
    pub eps: f32,
}

fn invalid(what: String) -> KernelError {
    KernelError(format!("decode_layers: {what}"))
}

/// Checks every size before anything is written, so a bad call changes nothing.
fn check(
    h: &[Bf16],
    layers: &[DecoderLayer<'_>],
    caches: &[LayerCache<'_>],
    inputs: &DecodeInputs<'_>,
) -> Result<usize, KernelError> {
    let s = inputs.shape;
    let rows = s.num_seqs;
    let Some(first) = layers.first() else {
        return Err(invalid("no layers".into()));
    };
    let hidden = first.input_norm.len();
    let hd = s.head_dim;
    let q_size = s.num_heads * hd;
    let kv_row = s.num_kv_heads * hd;
    if rows == 0 || hidden == 0 || h.len() != rows * hidden {
        return Err(invalid(format!(
            "{} residual values for {rows} rows of {hidden}",
            h.len()
        )));
    }
    if caches.len() != layers.len() {
        return Err(invalid(format!(
            "{} caches for {} layers",
            caches.len(),
            layers.len()
        )));
    }
    let inputs_ok = inputs.slots.len() == rows
        && inputs.seq_lens.len() == rows
        && inputs.cos.len() == rows * hd
        && inputs.sin.len() == rows * hd;
    if !inputs_ok {
        return Err(invalid(
            "slots, lengths and rotary tables need one entry per row".into(),
        ));
    }
    // Every slot and every block the step touches lies in the cache: the first layer
    // writes K/V before the attention would notice a bad block id.
    let slots = s.num_blocks * s.block_size;
    if let Some(bad) = inputs.slots.iter().find(|&&t| t < 0 || t as usize >= slots) {
        return Err(invalid(format!("slot {bad} outside 0..{slots}")));
    }
    if inputs.block_tables.len() != rows * s.max_blocks {
        return Err(invalid("block tables must be [rows, max_blocks]".into()));
    }
    for (r, &len) in inputs.seq_lens.iter().enumerate() {
        let used = (len.max(0) as usize).div_ceil(s.block_size.max(1));
        if len <= 0 || used > s.max_blocks {
            return Err(invalid(format!(
                "sequence length {len} does not fit its block table"
            )));
        }
        let table = &inputs.block_tables[r * s.max_blocks..r * s.max_blocks + used];
        if let Some(bad) = table.iter().find(|&&b| b < 0 || b as usize >= s.num_blocks) {
            return Err(invalid(format!("block {bad} outside 0..{}", s.num_blocks)));
        }
    }
    for (i, (l, c)) in layers.iter().zip(caches).enumerate() {
        let inter = l.gate_up.n / 2;
        let fits = l.input_norm.len() == hidden
            && l.post_norm.len() == hidden
            && (l.qkv.k, l.qkv.n) == (hidden, q_size + 2 * kv_row)
            && (l.o.k, l.o.n) == (q_size, hidden)
            && l.gate_up.k == hidden
            && l.gate_up.n.is_multiple_of(2)
            && (l.down.k, l.down.n) == (inter, hidden)
            && l.q_norm.is_none_or(|w| w.len() == hd)
            && l.k_norm.is_none_or(|w| w.len() == hd)
            && [l.qkv, l.o, l.gate_up, l.down]
                .iter()
                .all(|p| rows <= p.max_rows())
            && c.k.len() == c.v.len()
            && c.k.len() == s.num_blocks * s.block_size * kv_row;
        if !fits {
            return Err(invalid(format!("layer {i}'s sizes do not fit the step")));
        }
    }
    Ok(hidden)
}

/// Runs `layers` over the residual stream `h` (`[rows, hidden]`, the token embeddings on
/// entry) for one decode step: each layer's new K/V goes into its cache, and `h` ends as
/// the last layer's output (before the final norm). The same values as the Python path
/// (see the module docs).
pub fn decode_layers(
    h: &mut [Bf16],
    layers: &[DecoderLayer<'_>],
    caches: &mut [LayerCache<'_>],
    inputs: &DecodeInputs<'_>,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let hidden = check(h, layers, caches, inputs)?;
    let s = inputs.shape;
    let rows = s.num_seqs;
    let hd = s.head_dim;
    let (heads, kv_heads) = (s.num_heads, s.num_kv_heads);
    let width = (heads + 2 * kv_heads) * hd;
    let inter = layers[0].gate_up.n / 2;
    let zeros = |len: usize| vec![Bf16(0); len];
    let (mut x, mut delta) = (zeros(rows * hidden), zeros(rows * hidden));
    let mut qkv = zeros(rows * width);
    let (mut q, mut attn) = (zeros(rows * heads * hd), zeros(rows * heads * hd));
    let (mut gate_up, mut act) = (zeros(rows * 2 * inter), zeros(rows * inter));
    let mut head_row = vec![Bf16(0); heads.max(kv_heads) * hd];
    for (i, (layer, cache)) in layers.iter().zip(caches.iter_mut()).enumerate() {
        // Layer i's input norm also adds layer i-1's MLP output into the residual.
        let previous = (i > 0).then_some(&delta[..]);
        add_rms_norm(
            &mut x,
            h,
            previous,
            layer.input_norm,
            rows,
            inputs.eps,
            threads,
            parallel,
        )?;
        layer.qkv.apply(&mut qkv, &x, rows, threads, parallel)?;
        if let (Some(qn), Some(kn)) = (layer.q_norm, layer.k_norm) {
            for row in qkv.chunks_exact_mut(width) {
                let (q_part, rest) = row.split_at_mut(heads * hd);
                let k_part = &mut rest[..kv_heads * hd];
                for (part, w, n) in [(q_part, qn, heads), (k_part, kn, kv_heads)] {
                    let out = &mut head_row[..n * hd];
                    add_rms_norm(out, part, None, w, n, inputs.eps, 1, parallel)?;
                    part.copy_from_slice(out);
                }
            }
        }
        rope_store_kv(
            &mut q,
            cache.k,
            cache.v,
            &qkv,
            inputs.cos,
            inputs.sin,
            inputs.slots,
            heads,
            kv_heads,
            hd,
        )?;
        let layer_shape = DecodeShape {
            sliding_window: layer.sliding_window,
            ..s
        };
        paged_decode_attention(
            &mut attn,
            &q,
            cache.k,
            cache.v,
            inputs.block_tables,
            inputs.seq_lens,
            &layer_shape,
            inputs.scale,
            threads,
            parallel,
        )?;
        layer.o.apply(&mut delta, &attn, rows, threads, parallel)?;
        add_rms_norm(
            &mut x,
            h,
            Some(&delta),
            layer.post_norm,
            rows,
            inputs.eps,
            threads,
            parallel,
        )?;
        layer
            .gate_up
            .apply(&mut gate_up, &x, rows, threads, parallel)?;
        match layer.activation {
            Activation::SiluMul => silu_mul(&mut act, &gate_up, inter),
        }
        layer
            .down
            .apply(&mut delta, &act, rows, threads, parallel)?;
    }
    // The last layer's MLP output joins the residual (the final norm is the caller's).
    for (r, d) in h.iter_mut().zip(&delta) {
        *r = Bf16::from_f32(r.to_f32() + d.to_f32());
    }
    Ok(())
}

/// `out = silu(gate) * up` per row of `gate_up` (`[rows, 2 * inter]`, gate first), rounded
/// as torch's `F.silu(gate) * up` in bf16: the SiLU to bf16, then the product.
pub fn silu_mul(out: &mut [Bf16], gate_up: &[Bf16], inter: usize) {
    silu_mul_dispatch(out, gate_up, inter);
}

fn silu_mul_dispatch(out: &mut [Bf16], gate_up: &[Bf16], inter: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn wide(out: &mut [Bf16], gate_up: &[Bf16], inter: usize) {
            silu_mul_rows(out, gate_up, inter)
        }
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            // SAFETY: the CPU has the features `wide` is compiled for.
            unsafe { wide(out, gate_up, inter) };
            return;
        }
    }
    silu_mul_rows(out, gate_up, inter)
}

#[inline(always)]
fn silu_mul_rows(out: &mut [Bf16], gate_up: &[Bf16], inter: usize) {
    for (o, row) in out
        .chunks_exact_mut(inter)
        .zip(gate_up.chunks_exact(2 * inter))
    {
        let (gate, up) = row.split_at(inter);
        for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
            let g = g.to_f32();
            let silu = Bf16::from_f32(g / (1.0 + exp(-g))).to_f32();
            *o = Bf16::from_f32(silu * u.to_f32());
        }
    }
}

/// `e^x` in f32 without a branch (so loops over it vectorize): `x = n ln 2 + r` with
/// `|r| <= ln 2 / 2`, a degree-6 polynomial for `e^r`, and `2^n` built in the exponent
/// bits. About 2 ulp; infinity above 88.3 (a little below f32's limit) and 0 below -87.3.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let big = x > 88.3;
    let tiny = x < -87.3;
    let x = x.clamp(-87.3, 88.3);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let e_r = (p * r).mul_add(r, r) + 1.0;
    // n is in -126..=127 after the clamp, so 2^n is a normal f32.
    // SAFETY: n is a finite integer well inside i32's range.
    let pow = f32::from_bits(((unsafe { n.to_int_unchecked::<i32>() } + 127) as u32) << 23);
    let value = e_r * pow;
    if big {
        f32::INFINITY
    } else if tiny {
        0.0
    } else {
        value
    }
}
