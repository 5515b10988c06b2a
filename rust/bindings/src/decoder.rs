//! `_DecoderStack`: a model's decoder layers for one-call decode steps (see the kernels
//! crate's `decode_layers`). `iron_batch.layers.decoder_stack` is the only caller: it checks
//! every tensor (device, dtype, contiguity, shape) when it builds the stack and keeps them
//! alive as long as the stack, because the stack holds their addresses, not the tensors.

use iron_batch_kernels::{
    decode_layers, int8_row_len, parse_layout, run_in_team, Activation, CacheGroup, DecodeInputs,
    DecodeShape, DecoderLayer, Int8LayerCache, KernelError, LayerCache, LayerExtras, Matrix,
    PerLayerInput, Projection, RopeTable, Routing, SharedExpert, SparseMlp,
};
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::kernels::{experts_at, qmatrix, run_kernel, slice, slice_mut};

/// A projection as Python describes it: (kind "bf16" | "q4" | "q8" | a GGUF block format
/// such as "q4_k" (the bindings' `qmatrix`), weight or quants,
/// scale, min, bias, n, k); unused addresses and "no bias" are 0.
pub(crate) type ProjectionSpec = (String, usize, usize, usize, usize, usize, usize);
/// A layer: (norms, q_norm, k_norm, [qkv, o, gate_up, down] (a sparse layer: [qkv, o]),
/// activation, attention, residual_scale, extras).
///
/// `norms` are the addresses of the four `hidden`-wide RMSNorm weights (input, attention
/// output, pre-MLP, MLP output; 0: absent); `q_norm`/`k_norm` are (address, length) with
/// length `head_dim` (per head) or the whole projection's width (address 0: absent); the
/// attention is (sliding window (0: every position), rotary_dim, rope_table, scale (None:
/// the step's), softcap (0: off), cache_group); the extras are Gemma 4's (the kernels'
/// `LayerExtras`): (head_dim, kv_heads (0: the stack's), norms round once, v norm, v from
/// k, kv_source, per-layer-embedding block (gate, proj, norm address), layer scalar) and
/// the sparse MLP ([`MoeSpec`]; None: the dense `gate_up` and `down`).
type LayerSpec = (
    [usize; 4],
    (usize, usize),
    (usize, usize),
    Vec<ProjectionSpec>,
    String,
    AttentionSpec,
    f32,
    ExtrasSpec,
);
type ExtrasSpec = (
    usize,
    usize,
    bool,
    bool,
    bool,
    Option<usize>,
    Option<(ProjectionSpec, ProjectionSpec, usize)>,
    Option<f32>,
    Option<MoeSpec>,
);
/// A stacked expert projection: (kind "bf16" | "mxfp4" | a quantized layout, weight or
/// quants, scale, min).
type ExpertsSpec = (String, usize, usize, usize);
/// A sparse MLP: (router `[experts, hidden]`, top_k, renormalize, weights in float,
/// gate_up experts `[experts * 2 * inter, hidden]`, down experts `[experts * hidden,
/// inter]`, experts, inter, shared expert (gate_up, down, sigmoid gate `[1, hidden]`)).
pub(crate) type MoeSpec = (
    ProjectionSpec,
    usize,
    bool,
    bool,
    ExpertsSpec,
    ExpertsSpec,
    usize,
    usize,
    Option<(ProjectionSpec, ProjectionSpec, Option<ProjectionSpec>)>,
);
type AttentionSpec = (usize, usize, usize, Option<f32>, f32, usize);
/// A rotary table: (cos, sin, dim), each `[rows, dim]` bf16.
type RopeSpec = (usize, usize, usize);
/// A cache group's step inputs: slots, block tables, lengths.
type GroupSpec<'py> = (
    PyReadonlyArray1<'py, i64>,
    PyReadonlyArray2<'py, i32>,
    PyReadonlyArray1<'py, i32>,
);

/// The MLP activation a layer names, if the decode stacks have it.
pub(crate) fn parse_activation(name: &str) -> PyResult<Activation> {
    Activation::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "the decode stack has no activation {name:?} (it has: silu, gelu_pytorch_tanh)"
        ))
    })
}

#[derive(Clone)]
pub(crate) struct ProjectionAddrs {
    kind: String,
    weight: usize,
    scale: usize,
    min: usize,
    bias: usize,
    n: usize,
    k: usize,
}

impl ProjectionAddrs {
    /// A projection spec whose weight kind the kernels know.
    pub(crate) fn parse(spec: ProjectionSpec) -> PyResult<Self> {
        let (kind, weight, scale, min, bias, n, k) = spec;
        if !matches!(kind.as_str(), "bf16" | "q4" | "q8") && parse_layout(&kind, n).is_none() {
            return Err(PyValueError::new_err(format!(
                "unknown weight kind {kind:?}"
            )));
        }
        Ok(Self {
            kind,
            weight,
            scale,
            min,
            bias,
            n,
            k,
        })
    }

    /// SAFETY: the addresses are live tensors of the sizes `n`, `k` and `kind` imply.
    pub(crate) unsafe fn view<'a>(&self) -> Result<Projection<'a>, KernelError> {
        let weight = match self.kind.as_str() {
            "bf16" => Matrix::Bf16(slice(self.weight, self.n * self.k)),
            kind => Matrix::Quant(qmatrix(
                kind,
                self.weight,
                self.scale,
                self.min,
                self.n,
                self.k,
            )?),
        };
        Ok(Projection {
            weight,
            bias: (self.bias != 0).then(|| slice(self.bias, self.n)),
            n: self.n,
            k: self.k,
        })
    }
}

struct LayerAddrs {
    /// input, attention output, pre-MLP and MLP output norms (0: absent).
    norms: [usize; 4],
    /// (address, length); address 0: absent.
    q_norm: (usize, usize),
    k_norm: (usize, usize),
    /// qkv, o, and gate_up, down (absent in a sparse layer).
    projections: Vec<ProjectionAddrs>,
    activation: Activation,
    sliding_window: usize,
    rotary_dim: usize,
    rope_table: usize,
    scale: Option<f32>,
    softcap: f32,
    residual_scale: f32,
    cache_group: usize,
    head_dim: usize,
    kv_heads: usize,
    norms_round_once: bool,
    v_norm: bool,
    v_from_k: bool,
    kv_source: Option<usize>,
    /// gate, proj, and the norm's address (`hidden` weights).
    ple: Option<(ProjectionAddrs, ProjectionAddrs, usize)>,
    layer_scalar: Option<f32>,
    moe: Option<MoeAddrs>,
}

pub(crate) struct MoeAddrs {
    router: ProjectionAddrs,
    routing: Routing,
    gate_up: ExpertsSpec,
    down: ExpertsSpec,
    experts: usize,
    inter: usize,
    shared: Option<(ProjectionAddrs, ProjectionAddrs, Option<ProjectionAddrs>)>,
}

impl MoeAddrs {
    pub(crate) fn parse(spec: MoeSpec) -> PyResult<Self> {
        let (router, top_k, renormalize, weights_in_float, gate_up, down, experts, inter, shared) =
            spec;
        let routing = Routing {
            top_k,
            renormalize,
            weights_in_float,
        };
        if !routing.supports(experts) {
            return Err(PyValueError::new_err(format!(
                "the decode stack's router takes top k of experts with k * 64 > experts, \
                 not top {top_k} of {experts}"
            )));
        }
        let shared = match shared {
            Some((gu, dn, gate)) => Some((
                ProjectionAddrs::parse(gu)?,
                ProjectionAddrs::parse(dn)?,
                gate.map(ProjectionAddrs::parse).transpose()?,
            )),
            None => None,
        };
        Ok(Self {
            router: ProjectionAddrs::parse(router)?,
            routing,
            gate_up,
            down,
            experts,
            inter,
            shared,
        })
    }

    /// SAFETY: as [`ProjectionAddrs::view`], and the experts' addresses hold the sizes
    /// `experts`, `inter` and the router's `k` (hidden) imply.
    pub(crate) unsafe fn view<'a>(&self) -> Result<SparseMlp<'a>, KernelError> {
        let (e, i, h) = (self.experts, self.inter, self.router.k);
        let (gk, gq, gs, gm) = &self.gate_up;
        let (dk, dq, ds, dm) = &self.down;
        let shared = match &self.shared {
            Some((gu, dn, gate)) => Some(SharedExpert {
                gate_up: gu.view()?,
                down: dn.view()?,
                gate: gate.as_ref().map(|g| g.view()).transpose()?,
            }),
            None => None,
        };
        Ok(SparseMlp {
            router: self.router.view()?,
            routing: self.routing,
            gate_up: experts_at(gk, (*gq, *gs, *gm), e * 2 * i, h)?,
            down: experts_at(dk, (*dq, *ds, *dm), e * h, i)?,
            experts: e,
            inter: i,
            shared,
        })
    }
}

/// The decoder layers of one model, by address, and their KV caches.
#[pyclass(name = "_DecoderStack", module = "iron_batch._core")]
pub struct DecoderStack {
    layers: Vec<LayerAddrs>,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// (K, V) address per layer, each `[num_blocks * block_size, kv_heads * head_dim]`
    /// with its layer's group's `num_blocks` and its layer's head shape (not read for a
    /// layer that attends over another's).
    caches: Vec<(usize, usize)>,
    /// Blocks in each cache of group g: `group_blocks[g]`.
    group_blocks: Vec<usize>,
    block_size: usize,
    /// The caches hold int8 rows with their scales (`kv_int8.rs`), not bf16.
    int8: bool,
}

#[pymethods]
impl DecoderStack {
    #[new]
    #[pyo3(signature = (layers, *, hidden, heads, kv_heads, head_dim))]
    fn new(
        layers: Vec<LayerSpec>,
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> PyResult<Self> {
        let mut parsed = Vec::with_capacity(layers.len());
        for (norms, q_norm, k_norm, projections, activation, attention, residual_scale, extras) in
            layers
        {
            let (sliding_window, rotary_dim, rope_table, scale, softcap, cache_group) = attention;
            let (
                head_dim,
                kv_heads,
                norms_round_once,
                v_norm,
                v_from_k,
                kv_source,
                ple,
                scalar,
                moe,
            ) = extras;
            let moe = moe.map(MoeAddrs::parse).transpose()?;
            let ple = match ple {
                Some((gate, proj, norm)) => Some((
                    ProjectionAddrs::parse(gate)?,
                    ProjectionAddrs::parse(proj)?,
                    norm,
                )),
                None => None,
            };
            let activation = parse_activation(&activation)?;
            let projections: Vec<ProjectionAddrs> = projections
                .into_iter()
                .map(ProjectionAddrs::parse)
                .collect::<PyResult<_>>()?;
            let want = if moe.is_some() { 2 } else { 4 };
            if projections.len() != want {
                return Err(PyValueError::new_err(format!(
                    "a {} layer has {want} projections",
                    if moe.is_some() { "sparse" } else { "dense" }
                )));
            }
            parsed.push(LayerAddrs {
                norms,
                q_norm,
                k_norm,
                projections,
                activation,
                sliding_window,
                rotary_dim,
                rope_table,
                scale,
                softcap,
                residual_scale,
                cache_group,
                head_dim,
                kv_heads,
                norms_round_once,
                v_norm,
                v_from_k,
                kv_source,
                ple,
                layer_scalar: scalar,
                moe,
            });
        }
        Ok(Self {
            layers: parsed,
            hidden,
            heads,
            kv_heads,
            head_dim,
            caches: Vec::new(),
            group_blocks: Vec::new(),
            block_size: 0,
            int8: false,
        })
    }

    /// The layers' KV caches: one (K, V) address pair per layer, and each layer's cache's
    /// block count (the same for every layer of a cache group); `int8`: int8 caches
    /// (`[blocks * block_size, kv_heads, head_dim + 4]` bytes), else bf16.
    #[pyo3(signature = (caches, num_blocks, block_size, int8=false))]
    fn set_caches(
        &mut self,
        caches: Vec<(usize, usize)>,
        num_blocks: Vec<usize>,
        block_size: usize,
        int8: bool,
    ) -> PyResult<()> {
        if caches.len() != self.layers.len() || num_blocks.len() != self.layers.len() {
            return Err(PyValueError::new_err(
                "one (K, V) cache pair and one block count per layer",
            ));
        }
        let groups = self
            .layers
            .iter()
            .map(|l| l.cache_group + 1)
            .max()
            .unwrap_or(0);
        let mut group_blocks: Vec<Option<usize>> = vec![None; groups];
        for (l, &n) in self.layers.iter().zip(&num_blocks) {
            match group_blocks[l.cache_group] {
                Some(m) if m != n => {
                    return Err(PyValueError::new_err(format!(
                        "cache group {}: layers with {m} and {n} blocks",
                        l.cache_group
                    )))
                }
                _ => group_blocks[l.cache_group] = Some(n),
            }
        }
        self.caches = caches;
        // A group no layer uses holds no cache: 0 blocks.
        self.group_blocks = group_blocks.into_iter().map(|n| n.unwrap_or(0)).collect();
        self.block_size = block_size;
        self.int8 = int8;
        Ok(())
    }

    /// One decode step over the residual rows at `h` (`[rows, hidden]` bf16, in place):
    /// `ropes` the rotary tables (cos, sin, dim), each `[rows, dim]` bf16, that layers pick by
    /// `rope_table`; `groups` one (slots, block tables, lengths) per cache group, with one
    /// slot, table row and length per row; `scale` for layers without their own;
    /// `per_layer` the `[rows, layers, ple_dim]` bf16 vectors of the layers'
    /// per-layer-embedding blocks (0: none; needed when a layer has one).
    #[pyo3(signature = (h, ropes, groups, *, scale, eps, threads, openmp=None, per_layer=0))]
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &self,
        py: Python<'_>,
        h: usize,
        ropes: Vec<RopeSpec>,
        groups: Vec<GroupSpec<'_>>,
        scale: f32,
        eps: f32,
        threads: usize,
        openmp: Option<(usize, usize, usize)>,
        per_layer: usize,
    ) -> PyResult<()> {
        if self.caches.len() != self.layers.len() {
            return Err(PyValueError::new_err("decode before set_caches"));
        }
        let Some((first, _, _)) = groups.first() else {
            return Err(PyValueError::new_err("a step needs a cache group"));
        };
        let rows = first.len();
        if groups.len() < self.group_blocks.len() {
            return Err(PyValueError::new_err(format!(
                "{} cache groups for layers in {}",
                groups.len(),
                self.group_blocks.len()
            )));
        }
        let mut cache_groups = Vec::with_capacity(groups.len());
        for (g, (slots, tables, lens)) in groups.iter().enumerate() {
            let dims = tables.shape();
            if slots.len() != rows || dims[0] != rows {
                return Err(PyValueError::new_err(format!(
                    "group {g}: one slot and one block-table row per row"
                )));
            }
            cache_groups.push(CacheGroup {
                slots: slots.as_slice()?,
                block_tables: tables.as_slice()?,
                seq_lens: lens.as_slice()?,
                max_blocks: dims[1],
                num_blocks: self.group_blocks.get(g).copied().unwrap_or(0),
            });
        }
        let shape = DecodeShape {
            num_seqs: rows,
            num_heads: self.heads,
            num_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            // Per group and per layer.
            max_blocks: 0,
            num_blocks: 0,
            sliding_window: 0,
        };
        let hidden = self.hidden;
        let ple_dim = self
            .layers
            .iter()
            .find_map(|l| l.ple.as_ref().map(|(gate, _, _)| gate.n))
            .unwrap_or(0);
        if ple_dim > 0 && per_layer == 0 {
            return Err(PyValueError::new_err(
                "the layers' per-layer-embedding blocks need their per-layer inputs",
            ));
        }
        run_kernel(py, openmp, |parallel| {
            // SAFETY: the caller (layers/decoder_stack.py) checked every tensor behind these addresses
            // and keeps them alive; the sizes are the ones it checked.
            unsafe {
                let norm = |addr: usize| (addr != 0).then(|| slice(addr, hidden));
                let head_norm = |(addr, len): (usize, usize)| (addr != 0).then(|| slice(addr, len));
                let layers = self
                    .layers
                    .iter()
                    .map(|l| {
                        let (qkv, o) = (&l.projections[0], &l.projections[1]);
                        let (gate_up, down) = match &l.projections[..] {
                            [_, _, gu, dn] => (gu.view()?, dn.view()?),
                            _ => (Projection::ABSENT, Projection::ABSENT),
                        };
                        let moe = l.moe.as_ref().map(|m| m.view()).transpose()?;
                        let [input_norm, attn_out_norm, post_norm, mlp_out_norm] = l.norms;
                        let ple = match &l.ple {
                            Some((gate, proj, norm_at)) => Some(PerLayerInput {
                                gate: gate.view()?,
                                proj: proj.view()?,
                                norm: slice(*norm_at, hidden),
                            }),
                            None => None,
                        };
                        Ok(DecoderLayer {
                            input_norm: norm(input_norm),
                            qkv: qkv.view()?,
                            q_norm: head_norm(l.q_norm),
                            k_norm: head_norm(l.k_norm),
                            o: o.view()?,
                            attn_out_norm: norm(attn_out_norm),
                            post_norm: norm(post_norm),
                            gate_up,
                            down,
                            mlp_out_norm: norm(mlp_out_norm),
                            activation: l.activation,
                            sliding_window: l.sliding_window,
                            rotary_dim: l.rotary_dim,
                            rope_table: l.rope_table,
                            scale: l.scale.unwrap_or(scale),
                            softcap: l.softcap,
                            residual_scale: l.residual_scale,
                            cache_group: l.cache_group,
                            extras: LayerExtras {
                                head_dim: l.head_dim,
                                kv_heads: l.kv_heads,
                                norms_round_once: l.norms_round_once,
                                v_norm: l.v_norm,
                                v_from_k: l.v_from_k,
                                kv_source: l.kv_source,
                                ple,
                                layer_scalar: l.layer_scalar,
                                moe,
                            },
                        })
                    })
                    .collect::<Result<Vec<_>, KernelError>>()?;
                // Each layer's cache length in its elements (bf16 values or int8 bytes); a
                // layer that attends over another's has none of its own (its entry in
                // `caches` is that layer's tensor, not to be borrowed twice).
                let lens: Vec<usize> = self
                    .layers
                    .iter()
                    .map(|l| {
                        let hd = if l.head_dim == 0 {
                            self.head_dim
                        } else {
                            l.head_dim
                        };
                        let kv = if l.kv_heads == 0 {
                            self.kv_heads
                        } else {
                            l.kv_heads
                        };
                        let row = if self.int8 {
                            kv * int8_row_len(hd)
                        } else {
                            kv * hd
                        };
                        let own = l.kv_source.is_none();
                        if own {
                            self.group_blocks[l.cache_group] * self.block_size * row
                        } else {
                            0
                        }
                    })
                    .collect();
                let ropes: Vec<RopeTable<'_>> = ropes
                    .iter()
                    .map(|&(cos, sin, dim)| RopeTable {
                        cos: slice(cos, rows * dim),
                        sin: slice(sin, rows * dim),
                        dim,
                    })
                    .collect();
                let per_layer: &[_] = if ple_dim == 0 {
                    &[]
                } else {
                    slice(per_layer, rows * self.layers.len() * ple_dim)
                };
                let inputs = DecodeInputs {
                    ropes: &ropes,
                    groups: &cache_groups,
                    shape,
                    eps,
                    per_layer,
                };
                let h = slice_mut(h, rows * hidden);
                // One parallel region for the whole step (see `run_in_team`).
                run_in_team(threads, parallel, |team| {
                    if self.int8 {
                        let mut caches: Vec<Int8LayerCache<'_>> = self
                            .caches
                            .iter()
                            .zip(&lens)
                            .map(|(&(k, v), &len)| Int8LayerCache {
                                k: own_slice(k, len),
                                v: own_slice(v, len),
                            })
                            .collect();
                        decode_layers(h, &layers, &mut caches, &inputs, threads, team)
                    } else {
                        let mut caches: Vec<LayerCache<'_>> = self
                            .caches
                            .iter()
                            .zip(&lens)
                            .map(|(&(k, v), &len)| LayerCache {
                                k: own_slice(k, len),
                                v: own_slice(v, len),
                            })
                            .collect();
                        decode_layers(h, &layers, &mut caches, &inputs, threads, team)
                    }
                })
            }
        })
    }
}

/// A layer's cache at `addr` (`len` elements), or an empty slice for a layer with none of
/// its own (its address is another layer's cache, already borrowed).
///
/// SAFETY: as `slice_mut` when `len` is positive.
unsafe fn own_slice<'a, T>(addr: usize, len: usize) -> &'a mut [T] {
    if len == 0 {
        &mut []
    } else {
        slice_mut(addr, len)
    }
}
