//! A whole stack of decoder layers for one decode step, in one call.
//!
//! At batch 1 a decoder layer is a dozen small operations (two RMSNorms, four projections,
//! rotary + KV store, attention, SiLU-and-mul). Called one by one from Python each pays an
//! interpreter round trip and a tensor allocation, which on a small CPU adds up to a
//! millisecond or more per token: a sixth of a quantized model's step. Here the same
//! kernels run back to back with the residual stream and the scratch rows kept in Rust.
//!
//! Every step rounds where the Python path (`iron_batch.models.decoder` over `iron_batch.layers`) rounds, through the
//! same kernels, so the two give the same bf16 values; the activations are the new pieces
//! (SiLU an f32 `x / (1 + exp(-x))` with a polynomial `exp` good to about 2 ulp, GELU-tanh
//! torch's formula over a polynomial `tanh` good to about 1 ulp, each rounded to bf16 like
//! torch's, which agree with torch but for the rare value on a rounding boundary).

use crate::attention::{paged_decode_attention, DecodeShape, KernelError, Parallel};
use crate::element::{Bf16, Element};
use crate::elementwise::{add_rms_norm_with, rope_q, rope_store_kv};
use crate::gemv::{gemv_bf16, GEMV_MAX_ROWS};
use crate::kv_int8::{int8_row_len, paged_decode_attention_int8, rope_store_kv_int8};
use crate::moe::SparseMlp;
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
    /// No weights (0 x 0): what a sparse layer holds in place of its dense MLP's
    /// projections, which are then neither read nor checked.
    pub const ABSENT: Projection<'static> = Projection {
        weight: Matrix::Bf16(&[]),
        bias: None,
        n: 0,
        k: 0,
    };

    /// Most activation rows the decode stack gives this projection: one pass of the bf16
    /// GEMV ([`GEMV_MAX_ROWS`], the decode rows it is built for), any number quantized.
    pub fn max_rows(&self) -> usize {
        match self.weight {
            Matrix::Bf16(_) => GEMV_MAX_ROWS,
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
    /// `gelu_tanh(gate) * up` (GeGLU with the tanh approximation: Gemma's).
    GeluTanhMul,
}

impl Activation {
    /// The activation a checkpoint's config names (`hidden_act`), if the stack has it.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "silu" => Some(Self::SiluMul),
            "gelu_pytorch_tanh" | "gelu_tanh" => Some(Self::GeluTanhMul),
            _ => None,
        }
    }

    /// `out = act(gate) * up` per row of `gate_up` (`[rows, 2 * inter]`, gate first).
    pub fn apply(self, out: &mut [Bf16], gate_up: &[Bf16], inter: usize) {
        match self {
            Self::SiluMul => silu_mul(out, gate_up, inter),
            Self::GeluTanhMul => gelu_tanh_mul(out, gate_up, inter),
        }
    }

    /// [`Activation::apply`] over row ranges on up to `threads` of `parallel`'s threads
    /// (each row's result is the same however the rows are split).
    pub fn apply_rows(
        self,
        out: &mut [Bf16],
        gate_up: &[Bf16],
        inter: usize,
        threads: usize,
        parallel: &dyn Parallel,
    ) -> Result<(), KernelError> {
        if inter == 0 || !out.len().is_multiple_of(inter) || gate_up.len() != 2 * out.len() {
            return Err(KernelError(format!(
                "gated activation: out {} / gate_up {} elements for rows of {inter}",
                out.len(),
                gate_up.len()
            )));
        }
        let rows = out.len() / inter;
        let out_addr = out.as_mut_ptr() as usize;
        crate::elementwise::for_row_ranges(
            rows,
            crate::elementwise::split_rows(rows, inter, threads),
            parallel,
            &|lo, hi| {
                // SAFETY: the row ranges are disjoint and inside `out`, which outlives the
                // call.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(
                        (out_addr as *mut Bf16).add(lo * inter),
                        (hi - lo) * inter,
                    )
                };
                self.apply(out, &gate_up[2 * lo * inter..2 * hi * inter], inter);
            },
        );
        Ok(())
    }
}

/// One decoder layer as the model describes it: its weights (fused q/k/v and gate/up), its
/// norms (each optional), its rotary and attention settings and its MLP's activation. A
/// family built from these parts runs here without new code: pre-norm layers (Llama,
/// Mistral, Qwen2, Qwen3, SmolLM3, Phi-3, Granite: `input_norm` and `post_norm`), norms
/// after each sublayer (OLMo 2: `attn_out_norm` and `mlp_out_norm` only) and both
/// (Gemma 2 and 3: all four).
///
/// Per layer:
///
/// ```text
/// a = input_norm ? input_norm(h) : h
/// d = o(attention(a))                     // q_norm/k_norm, rotary, softcap, window, scale
/// d = attn_out_norm ? attn_out_norm(d) : d
/// h = h + residual_scale * d              // the product rounded first (skipped when 1)
/// m = post_norm ? post_norm(h) : h
/// d = down(act(gate_up(m)))
/// d = mlp_out_norm ? mlp_out_norm(d) : d
/// h = h + residual_scale * d
/// h = h + ple.norm(ple.proj(act(ple.gate(h)) * per_layer[row, layer]))   // extras.ple
/// h = h * layer_scalar                                                     // extras
/// ```
///
/// [`LayerExtras`] holds what Gemma 4 adds (its default: none of it).
#[derive(Clone, Copy)]
pub struct DecoderLayer<'a> {
    /// RMSNorm before the attention (None: the attention reads the residual itself).
    pub input_norm: Option<&'a [Bf16]>,
    /// Fused q, k, v: `n = (heads + 2 * kv_heads) * head_dim`.
    pub qkv: Projection<'a>,
    /// RMSNorms of q and k before the rotation: per head (`head_dim` weights, Qwen3's) or
    /// over the whole projection (`heads * head_dim` / `kv_heads * head_dim`, OLMo 2's).
    pub q_norm: Option<&'a [Bf16]>,
    pub k_norm: Option<&'a [Bf16]>,
    pub o: Projection<'a>,
    /// RMSNorm of the attention output before it joins the residual.
    pub attn_out_norm: Option<&'a [Bf16]>,
    /// RMSNorm before the MLP (None: the MLP reads the residual itself).
    pub post_norm: Option<&'a [Bf16]>,
    /// Fused gate and up: the first half of each output row is the gate.
    pub gate_up: Projection<'a>,
    pub down: Projection<'a>,
    /// RMSNorm of the MLP output before it joins the residual.
    pub mlp_out_norm: Option<&'a [Bf16]>,
    pub activation: Activation,
    /// Keys further back than this many positions are not attended (0: every position):
    /// layers of one model may differ (sliding and global layers).
    pub sliding_window: usize,
    /// Leading dims of each head that are rotated (`head_dim`: all; less: partial rotary;
    /// 0: none). Must be the width of the layer's rotary table.
    pub rotary_dim: usize,
    /// Which of the step's rotary tables ([`DecodeInputs::ropes`]) the layer uses.
    pub rope_table: usize,
    /// The attention scale.
    pub scale: f32,
    /// Attention logit soft-capping (0: off); see [`paged_decode_attention`].
    pub softcap: f32,
    /// The attention and MLP outputs are multiplied by this before they join the residual
    /// (Granite's `residual_multiplier`; 1: skipped).
    pub residual_scale: f32,
    /// Which of the step's cache groups ([`DecodeInputs::groups`]) the layer's KV is in.
    pub cache_group: usize,
    pub extras: LayerExtras<'a>,
}

/// Gemma 4's additions to a layer, and a sparse MLP in place of the dense one; the default
/// has none of them.
#[derive(Clone, Copy, Default)]
pub struct LayerExtras<'a> {
    /// The layer's head width and K/V heads (0: the step's [`DecodeShape`]'s): a model's
    /// sliding and global layers may differ. Query heads are the step's.
    pub head_dim: usize,
    pub kv_heads: usize,
    /// Every norm of the layer rounds once (Gemma 4's: statistics and weight product in
    /// f32, then to bf16; see [`crate::add_rms_norm_once`]).
    pub norms_round_once: bool,
    /// A per-head RMSNorm without a weight on the values.
    pub v_norm: bool,
    /// The values are the k projection's output (normed by the v norm, not rotated): `qkv`
    /// is q and k only, `n = (heads + kv_heads) * head_dim`.
    pub v_from_k: bool,
    /// An earlier layer whose cache this layer attends over (same group and head shape):
    /// `qkv` is q alone (`n = heads * head_dim`), no k/v norms, and the layer stores
    /// nothing (its own cache must be empty).
    pub kv_source: Option<usize>,
    /// The per-layer-embedding block after the MLP.
    pub ple: Option<PerLayerInput<'a>>,
    /// The layer's output residual is multiplied by this (None: by one), rounded to bf16.
    pub layer_scalar: Option<f32>,
    /// The MLP is sparse: a router and experts (with the layer's activation) instead of
    /// `gate_up` and `down`, which are then neither read nor checked.
    pub moe: Option<SparseMlp<'a>>,
}

/// A layer's per-layer-embedding block: `h += norm(proj(act(gate(h)) * v))`, `v` the row's
/// vector for this layer ([`DecodeInputs::per_layer`]) and `act` the MLP's activation.
#[derive(Clone, Copy)]
pub struct PerLayerInput<'a> {
    /// `[ple_dim, hidden]` and `[hidden, ple_dim]`.
    pub gate: Projection<'a>,
    pub proj: Projection<'a>,
    /// RMSNorm (`hidden` weights) of the projection.
    pub norm: &'a [Bf16],
}

impl DecoderLayer<'_> {
    /// (head width, K/V heads) of the layer in a step of `shape`.
    fn head_shape(&self, shape: &DecodeShape) -> (usize, usize) {
        let e = &self.extras;
        let pick = |own: usize, step: usize| if own == 0 { step } else { own };
        (
            pick(e.head_dim, shape.head_dim),
            pick(e.kv_heads, shape.num_kv_heads),
        )
    }

    /// Widths of the k and v parts of `qkv`: 0, 1 or 2 K/V rows.
    fn kv_parts(&self) -> usize {
        match (self.extras.kv_source, self.extras.v_from_k) {
            (Some(_), _) => 0,
            (None, true) => 1,
            (None, false) => 2,
        }
    }
}

/// One layer's paged KV cache: K and V, each `[num_blocks * block_size, kv_heads * head_dim]`
/// with the `num_blocks` of its layer's cache group.
pub struct LayerCache<'a> {
    pub k: &'a mut [Bf16],
    pub v: &'a mut [Bf16],
}

/// One layer's int8 paged KV cache (see `kv_int8.rs`): K and V, each `[num_blocks *
/// block_size, kv_heads, head_dim + 4]` bytes.
pub struct Int8LayerCache<'a> {
    pub k: &'a mut [i8],
    pub v: &'a mut [i8],
}

/// What a step does with a layer's cache: store the new K/V (rotating q and k), and
/// attend over it. [`decode_layers`] runs over either kind.
pub trait LayerKv {
    /// Whether the cache holds `slots` token slots of `kv_heads` rows of `head_dim`.
    fn holds(&self, slots: usize, kv_heads: usize, head_dim: usize) -> bool;

    /// [`rope_store_kv`] into this cache.
    #[allow(clippy::too_many_arguments)]
    fn rope_store(
        &mut self,
        q_out: &mut [Bf16],
        qkv: &[Bf16],
        cos: &[Bf16],
        sin: &[Bf16],
        slots: &[i64],
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        rotary_dim: usize,
    ) -> Result<(), KernelError>;

    /// [`paged_decode_attention`] over this cache.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        out: &mut [Bf16],
        q: &[Bf16],
        block_tables: &[i32],
        seq_lens: &[i32],
        shape: &DecodeShape,
        scale: f32,
        softcap: f32,
        threads: usize,
        parallel: &dyn Parallel,
    ) -> Result<(), KernelError>;
}

impl LayerKv for LayerCache<'_> {
    fn holds(&self, slots: usize, kv_heads: usize, head_dim: usize) -> bool {
        self.k.len() == self.v.len() && self.k.len() == slots * kv_heads * head_dim
    }

    fn rope_store(
        &mut self,
        q_out: &mut [Bf16],
        qkv: &[Bf16],
        cos: &[Bf16],
        sin: &[Bf16],
        slots: &[i64],
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        rotary_dim: usize,
    ) -> Result<(), KernelError> {
        rope_store_kv(
            q_out, self.k, self.v, qkv, cos, sin, slots, heads, kv_heads, head_dim, rotary_dim,
        )
    }

    fn attend(
        &self,
        out: &mut [Bf16],
        q: &[Bf16],
        block_tables: &[i32],
        seq_lens: &[i32],
        shape: &DecodeShape,
        scale: f32,
        softcap: f32,
        threads: usize,
        parallel: &dyn Parallel,
    ) -> Result<(), KernelError> {
        paged_decode_attention(
            out,
            q,
            self.k,
            self.v,
            block_tables,
            seq_lens,
            shape,
            scale,
            softcap,
            threads,
            parallel,
        )
    }
}

impl LayerKv for Int8LayerCache<'_> {
    fn holds(&self, slots: usize, kv_heads: usize, head_dim: usize) -> bool {
        self.k.len() == self.v.len() && self.k.len() == slots * kv_heads * int8_row_len(head_dim)
    }

    fn rope_store(
        &mut self,
        q_out: &mut [Bf16],
        qkv: &[Bf16],
        cos: &[Bf16],
        sin: &[Bf16],
        slots: &[i64],
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        rotary_dim: usize,
    ) -> Result<(), KernelError> {
        rope_store_kv_int8(
            q_out, self.k, self.v, qkv, cos, sin, slots, heads, kv_heads, head_dim, rotary_dim,
        )
    }

    fn attend(
        &self,
        out: &mut [Bf16],
        q: &[Bf16],
        block_tables: &[i32],
        seq_lens: &[i32],
        shape: &DecodeShape,
        scale: f32,
        softcap: f32,
        threads: usize,
        parallel: &dyn Parallel,
    ) -> Result<(), KernelError> {
        paged_decode_attention_int8(
            out,
            q,
            self.k,
            self.v,
            block_tables,
            seq_lens,
            shape,
            scale,
            softcap,
            threads,
            parallel,
        )
    }
}

/// Rotary tables of each row's position, `[rows, dim]` (torch's `rope_cos_sin`).
#[derive(Clone, Copy)]
pub struct RopeTable<'a> {
    pub cos: &'a [Bf16],
    pub sin: &'a [Bf16],
    pub dim: usize,
}

impl RopeTable<'_> {
    /// Whether the table is `[rows, dim]` for an even `dim` up to `head_dim`.
    pub(crate) fn fits(&self, rows: usize, head_dim: usize) -> bool {
        self.dim.is_multiple_of(2)
            && self.dim <= head_dim
            && self.cos.len() == rows * self.dim
            && self.sin.len() == rows * self.dim
    }
}

/// Where one cache group's layers keep this step's K/V and read their context: the
/// group's own block ids (hybrid memory gives sliding-window layers blocks of their own).
#[derive(Clone, Copy)]
pub struct CacheGroup<'a> {
    /// Cache slot of each row's new K/V.
    pub slots: &'a [i64],
    /// `[rows, max_blocks]` and `[rows]` (lengths include the new token).
    pub block_tables: &'a [i32],
    pub seq_lens: &'a [i32],
    pub max_blocks: usize,
    /// Blocks in each cache of this group's layers.
    pub num_blocks: usize,
}

impl CacheGroup<'_> {
    /// Whether the group's step inputs fit `rows` rows and its caches: one slot and one
    /// length per row, every slot and every block a row's length uses inside the caches
    /// (a layer writes K/V before the attention would notice a bad block id).
    pub(crate) fn check(&self, rows: usize, block_size: usize) -> Result<(), String> {
        if self.slots.len() != rows || self.seq_lens.len() != rows {
            return Err("slots and lengths need one entry per row".into());
        }
        let slots = self.num_blocks * block_size;
        if let Some(bad) = self.slots.iter().find(|&&t| t < 0 || t as usize >= slots) {
            return Err(format!("slot {bad} outside 0..{slots}"));
        }
        if self.block_tables.len() != rows * self.max_blocks {
            return Err("block tables must be [rows, max_blocks]".into());
        }
        for (r, &len) in self.seq_lens.iter().enumerate() {
            let used = (len.max(0) as usize).div_ceil(block_size.max(1));
            if len <= 0 || used > self.max_blocks {
                return Err(format!(
                    "sequence length {len} does not fit its block table"
                ));
            }
            let table = &self.block_tables[r * self.max_blocks..][..used];
            if let Some(bad) = table
                .iter()
                .find(|&&b| b < 0 || b as usize >= self.num_blocks)
            {
                return Err(format!("block {bad} outside 0..{}", self.num_blocks));
            }
        }
        Ok(())
    }
}

/// What the step's rows need beyond the layers: one row per decoding sequence.
#[derive(Clone, Copy)]
pub struct DecodeInputs<'a> {
    /// The rotary tables layers pick by `rope_table` (one for most models; Gemma 3 has a
    /// local and a global one).
    pub ropes: &'a [RopeTable<'a>],
    /// The cache groups layers pick by `cache_group` (one for most models; a group no
    /// layer uses is not read).
    pub groups: &'a [CacheGroup<'a>],
    /// `num_seqs` is the number of rows; `max_blocks` and `num_blocks` come from each
    /// layer's group and `sliding_window` from each layer (the shape's are not read);
    /// `head_dim` and `num_kv_heads` are those of layers without their own.
    pub shape: DecodeShape,
    pub eps: f32,
    /// `[rows, layers, ple_dim]`: each row's vector for each layer's per-layer-embedding
    /// block (empty when no layer has one).
    pub per_layer: &'a [Bf16],
}

fn invalid(what: String) -> KernelError {
    KernelError(format!("decode_layers: {what}"))
}

/// Checks every size before anything is written, so a bad call changes nothing.
fn check(
    h: &[Bf16],
    layers: &[DecoderLayer<'_>],
    caches: &[impl LayerKv],
    inputs: &DecodeInputs<'_>,
) -> Result<usize, KernelError> {
    let s = inputs.shape;
    let rows = s.num_seqs;
    let Some(first) = layers.first() else {
        return Err(invalid("no layers".into()));
    };
    let hidden = first.o.n;
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
    let widest = layers.iter().map(|l| l.head_shape(&s).0).max().unwrap_or(0);
    for (t, rope) in inputs.ropes.iter().enumerate() {
        if !rope.fits(rows, widest) {
            return Err(invalid(format!(
                "rotary table {t} must be [rows, an even dim up to head_dim]"
            )));
        }
    }
    for (g, group) in inputs.groups.iter().enumerate() {
        // A group no layer uses is not read.
        if !layers.iter().any(|l| l.cache_group == g) {
            continue;
        }
        group
            .check(rows, s.block_size)
            .map_err(|what| invalid(format!("group {g}: {what}")))?;
    }
    // Every per-layer-embedding block reads vectors of one width.
    let ple_dim = layers
        .iter()
        .find_map(|l| l.extras.ple.map(|p| p.gate.n))
        .unwrap_or(0);
    if inputs.per_layer.len() != rows * layers.len() * ple_dim {
        return Err(invalid(format!(
            "{} per-layer input values for {rows} rows of {} layers of {ple_dim}",
            inputs.per_layer.len(),
            layers.len()
        )));
    }
    let norm_fits = |w: Option<&[Bf16]>, len: usize| w.is_none_or(|w| w.len() == len);
    for (i, (l, c)) in layers.iter().zip(caches).enumerate() {
        let Some(group) = inputs.groups.get(l.cache_group) else {
            return Err(invalid(format!(
                "layer {i}'s cache group {} is not in the step's {}",
                l.cache_group,
                inputs.groups.len()
            )));
        };
        let (hd, kv_heads) = l.head_shape(&s);
        if hd == 0 || kv_heads == 0 || !s.num_heads.is_multiple_of(kv_heads) {
            return Err(invalid(format!(
                "layer {i}: {kv_heads} K/V heads of {hd} for {} query heads",
                s.num_heads
            )));
        }
        let rope_fits = l.rotary_dim == 0
            || (l.rotary_dim <= hd
                && inputs
                    .ropes
                    .get(l.rope_table)
                    .is_some_and(|t| t.dim == l.rotary_dim));
        if !rope_fits {
            return Err(invalid(format!(
                "layer {i} rotates {} dims: its rotary table {} does not fit",
                l.rotary_dim, l.rope_table
            )));
        }
        let e = &l.extras;
        if let Some(src) = e.kv_source {
            let source = (src < i).then(|| &layers[src]);
            let shares = source.is_some_and(|o| {
                o.extras.kv_source.is_none()
                    && o.cache_group == l.cache_group
                    && o.head_shape(&s) == (hd, kv_heads)
            });
            if !shares || l.k_norm.is_some() || e.v_norm || e.v_from_k || !c.holds(0, kv_heads, hd)
            {
                return Err(invalid(format!(
                    "layer {i} cannot attend over layer {src}'s K/V (an earlier layer that \
                     stores its own, of the same group and head shape; the sharing layer \
                     has no k/v norms and an empty cache)"
                )));
            }
        } else if !c.holds(group.num_blocks * s.block_size, kv_heads, hd) {
            return Err(invalid(format!("layer {i}'s cache does not fit its group")));
        }
        let q_size = s.num_heads * hd;
        let kv_row = kv_heads * hd;
        // The MLP's width may differ between layers (Gemma 4's double-wide ones).
        let inter = l.gate_up.n / 2;
        let head_norm_fits = |w: Option<&[Bf16]>, heads: usize| {
            w.is_none_or(|w| w.len() == hd || w.len() == heads * hd)
        };
        let ple_fits = e.ple.is_none_or(|p| {
            (p.gate.k, p.gate.n) == (hidden, ple_dim)
                && (p.proj.k, p.proj.n) == (ple_dim, hidden)
                && p.norm.len() == hidden
                && rows <= p.gate.max_rows()
                && rows <= p.proj.max_rows()
        });
        let mlp_fits = match e.moe {
            Some(m) => m.fits(hidden, rows),
            None => {
                (l.gate_up.k, l.gate_up.n) == (hidden, 2 * inter)
                    && (l.down.k, l.down.n) == (inter, hidden)
                    && [l.gate_up, l.down].iter().all(|p| rows <= p.max_rows())
            }
        };
        let fits = norm_fits(l.input_norm, hidden)
            && norm_fits(l.attn_out_norm, hidden)
            && norm_fits(l.post_norm, hidden)
            && norm_fits(l.mlp_out_norm, hidden)
            && (l.qkv.k, l.qkv.n) == (hidden, q_size + l.kv_parts() * kv_row)
            && (l.o.k, l.o.n) == (q_size, hidden)
            && mlp_fits
            && head_norm_fits(l.q_norm, s.num_heads)
            && head_norm_fits(l.k_norm, kv_heads)
            && l.scale.is_finite()
            && l.softcap.is_finite()
            && l.softcap >= 0.0
            && l.residual_scale.is_finite()
            && e.layer_scalar.is_none_or(f32::is_finite)
            && ple_fits
            && [l.qkv, l.o].iter().all(|p| rows <= p.max_rows());
        if !fits {
            return Err(invalid(format!("layer {i}'s sizes do not fit the step")));
        }
    }
    Ok(hidden)
}

/// `h += delta`, rounded to bf16 as torch's `h + d`.
fn add_into(h: &mut [Bf16], delta: &[Bf16]) {
    for (r, d) in h.iter_mut().zip(delta) {
        *r = Bf16::from_f32(r.to_f32() + d.to_f32());
    }
}

/// `delta` through the sublayer-output norm (when there is one; rounded once if `once`),
/// then times `residual_scale` (rounded to bf16, as torch's `d * scale`; skipped when 1),
/// ready to join the residual; `spare` is a scratch buffer of the same size.
#[allow(clippy::too_many_arguments)]
fn finish_delta(
    delta: &mut Vec<Bf16>,
    spare: &mut Vec<Bf16>,
    norm: Option<&[Bf16]>,
    once: bool,
    residual_scale: f32,
    rows: usize,
    eps: f32,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    if let Some(w) = norm {
        add_rms_norm_with(spare, delta, None, w, rows, eps, once, threads, parallel)?;
        std::mem::swap(delta, spare);
    }
    if residual_scale != 1.0 {
        for d in delta.iter_mut() {
            *d = Bf16::from_f32(d.to_f32() * residual_scale);
        }
    }
    Ok(())
}

/// Runs `layers` over the residual stream `h` (`[rows, hidden]`, the token embeddings on
/// entry) for one decode step: each layer's new K/V goes into its cache, and `h` ends as
/// the last layer's output (before the final norm). The same values as the Python path
/// (see the module docs).
pub fn decode_layers(
    h: &mut [Bf16],
    layers: &[DecoderLayer<'_>],
    caches: &mut [impl LayerKv],
    inputs: &DecodeInputs<'_>,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let hidden = check(h, layers, caches, inputs)?;
    let s = inputs.shape;
    let rows = s.num_seqs;
    let eps = inputs.eps;
    let heads = s.num_heads;
    let most = |f: &dyn Fn(usize, usize) -> usize| {
        layers
            .iter()
            .map(|l| {
                let (hd, kv) = l.head_shape(&s);
                f(hd, kv)
            })
            .max()
            .unwrap_or(0)
    };
    let inter = layers.iter().map(|l| l.gate_up.n / 2).max().unwrap_or(0);
    let zeros = |len: usize| vec![Bf16(0); len];
    let (mut x, mut delta) = (zeros(rows * hidden), zeros(rows * hidden));
    // Only layers with a norm after a sublayer (or a per-layer-embedding block) need a
    // second delta buffer.
    let out_norms = layers
        .iter()
        .any(|l| l.attn_out_norm.is_some() || l.mlp_out_norm.is_some() || l.extras.ple.is_some());
    let mut spare = zeros(if out_norms { rows * hidden } else { 0 });
    // The q/k/v rows at their widest (a layer whose values are its keys spreads its
    // q|k projection into q|k|v here).
    let mut qkv = zeros(rows * most(&|hd, kv| (heads + 2 * kv) * hd));
    let q_len = rows * heads * most(&|hd, _| hd);
    let (mut q, mut attn) = (zeros(q_len), zeros(q_len));
    let ple_dim = layers
        .iter()
        .find_map(|l| l.extras.ple.map(|p| p.gate.n))
        .unwrap_or(0);
    // `act` also holds a per-layer-embedding block's gated rows.
    let mut gate_up = zeros(rows * 2 * inter);
    let mut act = zeros(rows * inter.max(ple_dim));
    let mut head_row = zeros(most(&|hd, kv| heads.max(kv) * hd));
    // The v norm's weight: ones (none without a v norm).
    let v_norms = layers.iter().any(|l| l.extras.v_norm);
    let ones = vec![Bf16::from_f32(1.0); if v_norms { most(&|hd, _| hd) } else { 0 }];
    let (mut ple_gate, mut ple_gate_vec) = (zeros(rows * ple_dim), zeros(rows * 2 * ple_dim));
    // Whether `delta` holds the previous sublayer's output, not yet in the residual.
    let mut pending = false;
    for (i, layer) in layers.iter().enumerate() {
        let e = &layer.extras;
        let (hd, kv_heads) = layer.head_shape(&s);
        let once = e.norms_round_once;
        let group = inputs.groups[layer.cache_group];
        // The input norm also adds the previous sublayer's output into the residual.
        let previous = pending.then_some(&delta[..]);
        let attn_in: &[Bf16] = match layer.input_norm {
            Some(w) => {
                add_rms_norm_with(&mut x, h, previous, w, rows, eps, once, threads, parallel)?;
                &x
            }
            None => {
                if let Some(d) = previous {
                    add_into(h, d);
                }
                h
            }
        };
        let q_size = heads * hd;
        let kv_row = kv_heads * hd;
        let proj_width = layer.qkv.n;
        // The row as it is normed and stored: q, then k and v unless the layer shares them.
        let width = q_size + if e.kv_source.is_some() { 0 } else { 2 * kv_row };
        let qkv = &mut qkv[..rows * width];
        layer.qkv.apply(
            &mut qkv[..rows * proj_width],
            attn_in,
            rows,
            threads,
            parallel,
        )?;
        if e.v_from_k {
            // Rows of q|k to rows of q|k|k, the last row first (each moves up, never over
            // a row not yet moved): the raw keys are the values.
            for r in (0..rows).rev() {
                qkv.copy_within(r * proj_width..(r + 1) * proj_width, r * width);
                let k_at = r * width + q_size;
                qkv.copy_within(k_at..k_at + kv_row, k_at + kv_row);
            }
        }
        let v_norm = e.v_norm.then(|| &ones[..hd]);
        if layer.q_norm.is_some() || layer.k_norm.is_some() || v_norm.is_some() {
            for row in qkv.chunks_exact_mut(width) {
                let (q_part, rest) = row.split_at_mut(q_size);
                let (k_part, v_part) = rest.split_at_mut(rest.len().min(kv_row));
                for (part, w) in [
                    (q_part, layer.q_norm),
                    (k_part, layer.k_norm),
                    (v_part, v_norm),
                ] {
                    let Some(w) = w else { continue };
                    // Per head or over the whole projection: `part.len() / w.len()` rows.
                    let out = &mut head_row[..part.len()];
                    let n = part.len() / w.len();
                    add_rms_norm_with(out, part, None, w, n, eps, once, 1, parallel)?;
                    part.copy_from_slice(out);
                }
            }
        }
        let (cos, sin): (&[Bf16], &[Bf16]) = match layer.rotary_dim {
            0 => (&[], &[]),
            _ => {
                let t = inputs.ropes[layer.rope_table];
                (t.cos, t.sin)
            }
        };
        let q = &mut q[..rows * q_size];
        match e.kv_source {
            None => caches[i].rope_store(
                q,
                qkv,
                cos,
                sin,
                group.slots,
                heads,
                kv_heads,
                hd,
                layer.rotary_dim,
            )?,
            Some(_) => rope_q(q, qkv, cos, sin, rows, heads, hd, layer.rotary_dim)?,
        }
        let layer_shape = DecodeShape {
            num_kv_heads: kv_heads,
            head_dim: hd,
            sliding_window: layer.sliding_window,
            max_blocks: group.max_blocks,
            num_blocks: group.num_blocks,
            ..s
        };
        let attn = &mut attn[..rows * q_size];
        caches[e.kv_source.unwrap_or(i)].attend(
            attn,
            q,
            group.block_tables,
            group.seq_lens,
            &layer_shape,
            layer.scale,
            layer.softcap,
            threads,
            parallel,
        )?;
        layer.o.apply(&mut delta, attn, rows, threads, parallel)?;
        finish_delta(
            &mut delta,
            &mut spare,
            layer.attn_out_norm,
            once,
            layer.residual_scale,
            rows,
            eps,
            threads,
            parallel,
        )?;
        let mlp_in: &[Bf16] = match layer.post_norm {
            Some(w) => {
                add_rms_norm_with(
                    &mut x,
                    h,
                    Some(&delta),
                    w,
                    rows,
                    eps,
                    once,
                    threads,
                    parallel,
                )?;
                &x
            }
            None => {
                add_into(h, &delta);
                h
            }
        };
        if let Some(m) = &e.moe {
            m.apply(
                &mut delta,
                mlp_in,
                rows,
                hidden,
                layer.activation,
                threads,
                parallel,
            )?;
        } else {
            let inter = layer.gate_up.n / 2;
            let gate_up = &mut gate_up[..rows * 2 * inter];
            layer
                .gate_up
                .apply(gate_up, mlp_in, rows, threads, parallel)?;
            let act_rows = &mut act[..rows * inter];
            layer.activation.apply(act_rows, gate_up, inter);
            layer
                .down
                .apply(&mut delta, act_rows, rows, threads, parallel)?;
        }
        finish_delta(
            &mut delta,
            &mut spare,
            layer.mlp_out_norm,
            once,
            layer.residual_scale,
            rows,
            eps,
            threads,
            parallel,
        )?;
        pending = true;
        if let Some(p) = e.ple {
            // The block reads the residual with the MLP's output in it.
            add_into(h, &delta);
            p.gate.apply(&mut ple_gate, h, rows, threads, parallel)?;
            // Each row's gate beside its vector for this layer: the activation's layout.
            for (r, pair) in ple_gate_vec.chunks_exact_mut(2 * ple_dim).enumerate() {
                let (g, v) = pair.split_at_mut(ple_dim);
                g.copy_from_slice(&ple_gate[r * ple_dim..][..ple_dim]);
                v.copy_from_slice(&inputs.per_layer[(r * layers.len() + i) * ple_dim..][..ple_dim]);
            }
            let gated = &mut act[..rows * ple_dim];
            layer.activation.apply(gated, &ple_gate_vec, ple_dim);
            p.proj.apply(&mut delta, gated, rows, threads, parallel)?;
            finish_delta(
                &mut delta,
                &mut spare,
                Some(p.norm),
                once,
                1.0,
                rows,
                eps,
                threads,
                parallel,
            )?;
        }
        if let Some(scalar) = e.layer_scalar {
            add_into(h, &delta);
            pending = false;
            for v in h.iter_mut() {
                *v = Bf16::from_f32(v.to_f32() * scalar);
            }
        }
    }
    // The last layer's output joins the residual (the final norm is the caller's).
    if pending {
        add_into(h, &delta);
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

/// `out = gelu_tanh(gate) * up` per row of `gate_up` (`[rows, 2 * inter]`, gate first),
/// rounded as torch's `F.gelu(gate, approximate="tanh") * up` in bf16: the GELU (torch's
/// `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))`, in that order, in f32)
/// to bf16, then the product.
pub fn gelu_tanh_mul(out: &mut [Bf16], gate_up: &[Bf16], inter: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn wide(out: &mut [Bf16], gate_up: &[Bf16], inter: usize) {
            gelu_tanh_mul_rows(out, gate_up, inter)
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
    gelu_tanh_mul_rows(out, gate_up, inter)
}

#[inline(always)]
fn gelu_tanh_mul_rows(out: &mut [Bf16], gate_up: &[Bf16], inter: usize) {
    // torch's constants: sqrt(2) * (2 / sqrt(pi)) * 0.5 in f64, then f32.
    const BETA: f32 = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
    const KAPPA: f32 = 0.044715;
    for (o, row) in out
        .chunks_exact_mut(inter)
        .zip(gate_up.chunks_exact(2 * inter))
    {
        let (gate, up) = row.split_at(inter);
        for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
            let x = g.to_f32();
            let inner = BETA * (x + KAPPA * (x * x * x));
            let gelu = Bf16::from_f32(0.5 * x * (1.0 + tanh(inner))).to_f32();
            *o = Bf16::from_f32(gelu * u.to_f32());
        }
    }
}

/// `tanh(x)` in f32 without a branch (so loops over it vectorize), about 1 ulp: Cephes'
/// `tanhf`, an odd polynomial below 0.625 and `(e^2|x| - 1) / (e^2|x| + 1)` above (both computed,
/// one kept). Saturates to +-1; NaN stays NaN.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let s = x * x;
    let mut p = -5.704_988_7e-3_f32;
    p = p.mul_add(s, 2.063_909e-2);
    p = p.mul_add(s, -5.373_971_6e-2);
    p = p.mul_add(s, 1.333_144_2e-1);
    p = p.mul_add(s, -3.333_328e-1);
    let small = (p * s).mul_add(x, x);
    // `e / (e + 2)` with `e = e^2|x| - 1`, as Sleef's `tanhf` (torch's) has it, so that the
    // last bit near +-1 rounds as torch's does. Past 10, tanh is 1 in f32; the clamp also
    // keeps a NaN out of `exp` (`min` drops it).
    let e = exp(2.0 * a.min(10.0)) - 1.0;
    let large = (e / (e + 2.0)).copysign(x);
    // A NaN takes the polynomial, which keeps it.
    if a < 0.625 || a.is_nan() {
        small
    } else {
        large
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
