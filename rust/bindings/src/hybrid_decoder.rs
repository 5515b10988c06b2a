//! `_HybridStack`: a stack of Gated DeltaNet and gated attention layers for one-call decode
//! steps (see the kernels crate's `decode_hybrid_layers`). `iron_batch.layers.hybrid_stack`
//! is the only caller: it checks every tensor (device, dtype, contiguity, shape) when it
//! builds the stack and keeps them alive as long as the stack, which holds their addresses.

use iron_batch_kernels::{
    decode_hybrid_layers, run_in_team, Activation, Bf16, CacheGroup, Element, GatedAttention,
    GatedDelta, HybridInputs, HybridLayer, HybridShape, KernelError, LayerCache, LayerState, Mixer,
    Parallel, Projection, RopeTable,
};
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::decoder::{parse_activation, MoeAddrs, MoeSpec, ProjectionAddrs, ProjectionSpec};
use crate::kernels::{run_kernel, slice, slice_mut};

/// One layer as Python describes it (a dict with these keys). `kind` is "attention" or
/// "delta"; `mix_in` / `mix_out` are the attention's qkv and o or the delta layer's input
/// and output projections (`ProjectionSpec`s). Norm weights are addresses of f32 `1 + w`
/// (`hidden` values; the attention's q/k norms `head_dim`); the delta layer's `norm` is
/// bf16 (`value_dim`), `conv_weight` bf16 `[channels, kernel]`, `neg_a` and `dt_bias` f32
/// (one per value head). Fields of the other kind are 0.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct LayerAddrs {
    /// The dict's `kind`: "attention" (true) or "delta".
    #[pyo3(item("kind"), from_py_with = is_attention)]
    attention: bool,
    input_norm: usize,
    post_norm: usize,
    #[pyo3(from_py_with = projection)]
    mix_in: ProjectionAddrs,
    #[pyo3(from_py_with = projection)]
    mix_out: ProjectionAddrs,
    /// None where the MLP is sparse (`moe`).
    #[pyo3(from_py_with = optional_projection)]
    gate_up: Option<ProjectionAddrs>,
    #[pyo3(from_py_with = optional_projection)]
    down: Option<ProjectionAddrs>,
    #[pyo3(from_py_with = activation)]
    activation: Activation,
    /// The sparse MLP (`MoeSpec`, as the decoder stack takes it); None: `gate_up`, `down`.
    #[pyo3(from_py_with = sparse_mlp)]
    moe: Option<MoeAddrs>,
    q_norm: usize,
    k_norm: usize,
    rotary_dim: usize,
    scale: f32,
    cache: usize,
    conv_weight: usize,
    kernel: usize,
    neg_a: usize,
    dt_bias: usize,
    norm: usize,
    state: usize,
}

/// `kind`: true for "attention", false for "delta".
fn is_attention(kind: &Bound<'_, PyAny>) -> PyResult<bool> {
    match kind.extract::<String>()?.as_str() {
        "attention" => Ok(true),
        "delta" => Ok(false),
        other => Err(PyValueError::new_err(format!(
            "unknown hybrid layer kind {other:?} (attention, delta)"
        ))),
    }
}

fn projection(spec: &Bound<'_, PyAny>) -> PyResult<ProjectionAddrs> {
    ProjectionAddrs::parse(spec.extract::<ProjectionSpec>()?)
}

fn optional_projection(spec: &Bound<'_, PyAny>) -> PyResult<Option<ProjectionAddrs>> {
    if spec.is_none() {
        return Ok(None);
    }
    projection(spec).map(Some)
}

fn sparse_mlp(spec: &Bound<'_, PyAny>) -> PyResult<Option<MoeAddrs>> {
    if spec.is_none() {
        return Ok(None);
    }
    MoeAddrs::parse(spec.extract::<MoeSpec>()?).map(Some)
}

fn activation(name: &Bound<'_, PyAny>) -> PyResult<Activation> {
    parse_activation(&name.extract::<String>()?)
}

/// The layers of one hybrid model, by address, with their KV caches and state pools.
#[pyclass(name = "_HybridStack", module = "iron_batch._core")]
pub struct HybridStack {
    layers: Vec<LayerAddrs>,
    hidden: usize,
    shape: HybridShape,
    /// (K, V) address per attention layer, each `[num_blocks * block_size, kv_heads *
    /// head_dim]` bf16.
    caches: Vec<(usize, usize)>,
    num_blocks: usize,
    /// (convolution windows, delta matrices) address per delta layer, `num_slots` each.
    states: Vec<(usize, usize)>,
    num_slots: usize,
    /// The delta matrices are bf16 (else f32).
    state_bf16: bool,
}

#[pymethods]
impl HybridStack {
    #[new]
    #[pyo3(signature = (
        layers, *, hidden, heads, kv_heads, head_dim, key_heads, value_heads, key_dim,
        value_dim
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layers: Vec<LayerAddrs>,
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        key_heads: usize,
        value_heads: usize,
        key_dim: usize,
        value_dim: usize,
    ) -> PyResult<Self> {
        Ok(Self {
            layers,
            hidden,
            shape: HybridShape {
                heads,
                kv_heads,
                head_dim,
                block_size: 0,
                key_heads,
                value_heads,
                key_dim,
                value_dim,
            },
            caches: Vec::new(),
            num_blocks: 0,
            states: Vec::new(),
            num_slots: 0,
            state_bf16: false,
        })
    }

    /// The attention layers' (K, V) caches of `num_blocks` blocks, and the delta layers'
    /// (convolution windows, delta matrices) pools of `num_slots` slots, in layer order;
    /// the windows f32, the matrices bf16 if `state_bf16`, else f32.
    #[pyo3(signature = (caches, num_blocks, block_size, states, num_slots, *, state_bf16=false))]
    fn set_caches(
        &mut self,
        caches: Vec<(usize, usize)>,
        num_blocks: usize,
        block_size: usize,
        states: Vec<(usize, usize)>,
        num_slots: usize,
        state_bf16: bool,
    ) -> PyResult<()> {
        let attention = self.layers.iter().filter(|l| l.attention).count();
        if caches.len() != attention || states.len() != self.layers.len() - attention {
            return Err(PyValueError::new_err(
                "one cache per attention layer and one state per delta layer",
            ));
        }
        self.caches = caches;
        self.num_blocks = num_blocks;
        self.shape.block_size = block_size;
        self.states = states;
        self.num_slots = num_slots;
        self.state_bf16 = state_bf16;
        Ok(())
    }

    /// One decode step over the residual rows at `h` (`[rows, hidden]` bf16, in place):
    /// `rope` the attention layers' rotary table (cos, sin, dim), each `[rows, dim]` bf16;
    /// one KV slot, block-table row, length (with the new token) and state slot per row.
    #[pyo3(signature = (
        h, rope, slots, block_tables, seq_lens, state_slots, *, eps, threads, openmp=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &self,
        py: Python<'_>,
        h: usize,
        rope: (usize, usize, usize),
        slots: PyReadonlyArray1<'_, i64>,
        block_tables: PyReadonlyArray2<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        state_slots: PyReadonlyArray1<'_, i64>,
        eps: f32,
        threads: usize,
        openmp: Option<(usize, usize, usize)>,
    ) -> PyResult<()> {
        let attention = self.layers.iter().filter(|l| l.attention).count();
        if self.caches.len() != attention || self.states.len() != self.layers.len() - attention {
            return Err(PyValueError::new_err("decode before set_caches"));
        }
        let rows = state_slots.len();
        let dims = block_tables.shape();
        if slots.len() != rows || dims[0] != rows || seq_lens.len() != rows {
            return Err(PyValueError::new_err(
                "one KV slot, block-table row, length and state slot per row",
            ));
        }
        let kv = CacheGroup {
            slots: slots.as_slice()?,
            block_tables: block_tables.as_slice()?,
            seq_lens: seq_lens.as_slice()?,
            max_blocks: dims[1],
            num_blocks: self.num_blocks,
        };
        let state_slots = state_slots.as_slice()?;
        let s = self.shape;
        let hidden = self.hidden;
        let kv_len = self.num_blocks * s.block_size * s.kv_heads * s.head_dim;
        let channels = 2 * s.key_heads * s.key_dim + s.value_heads * s.value_dim;
        let delta_len = self.num_slots * s.value_heads * s.key_dim * s.value_dim;
        run_kernel(py, openmp, |parallel| {
            // SAFETY: the caller (layers/hybrid_stack.py) checked every tensor behind these
            // addresses and keeps them alive; the sizes are the ones it checked.
            unsafe {
                let layers = self
                    .layers
                    .iter()
                    .map(|l| {
                        let mixer = if l.attention {
                            Mixer::Attention(GatedAttention {
                                qkv: l.mix_in.view()?,
                                q_norm: slice(l.q_norm, s.head_dim),
                                k_norm: slice(l.k_norm, s.head_dim),
                                o: l.mix_out.view()?,
                                rotary_dim: l.rotary_dim,
                                scale: l.scale,
                                cache: l.cache,
                            })
                        } else {
                            Mixer::Delta(GatedDelta {
                                in_proj: l.mix_in.view()?,
                                conv_weight: slice(l.conv_weight, channels * l.kernel),
                                kernel: l.kernel,
                                neg_a: slice(l.neg_a, s.value_heads),
                                dt_bias: slice(l.dt_bias, s.value_heads),
                                norm: slice(l.norm, s.value_dim),
                                out_proj: l.mix_out.view()?,
                                state: l.state,
                            })
                        };
                        let dense = |p: &Option<ProjectionAddrs>| match p {
                            Some(p) => p.view(),
                            None => Ok(Projection::ABSENT),
                        };
                        Ok(HybridLayer {
                            input_norm: slice(l.input_norm, hidden),
                            mixer,
                            post_norm: slice(l.post_norm, hidden),
                            gate_up: dense(&l.gate_up)?,
                            down: dense(&l.down)?,
                            activation: l.activation,
                            moe: l.moe.as_ref().map(|m| m.view()).transpose()?,
                        })
                    })
                    .collect::<Result<Vec<_>, KernelError>>()?;
                let mut caches: Vec<LayerCache<'_>> = self
                    .caches
                    .iter()
                    .map(|&(k, v)| LayerCache {
                        k: slice_mut(k, kv_len),
                        v: slice_mut(v, kv_len),
                    })
                    .collect();
                let (cos, sin, dim) = rope;
                let inputs = HybridInputs {
                    rope: RopeTable {
                        cos: slice(cos, rows * dim),
                        sin: slice(sin, rows * dim),
                        dim,
                    },
                    kv,
                    state_slots,
                    shape: s,
                    eps,
                };
                let h = slice_mut(h, rows * hidden);
                let conv_len =
                    |l: &LayerAddrs| self.num_slots * channels * l.kernel.saturating_sub(1);
                let delta_layers = || {
                    self.layers
                        .iter()
                        .filter(|l| !l.attention)
                        .zip(&self.states)
                };
                let pools: Vec<(usize, usize, usize)> = delta_layers()
                    .map(|(l, &(conv, delta))| (conv, conv_len(l), delta))
                    .collect();
                // One call, with the delta matrices' element type chosen at load.
                macro_rules! step_in {
                    ($s:ty) => {
                        step::<$s>(
                            &pools,
                            delta_len,
                            h,
                            &layers,
                            &mut caches,
                            &inputs,
                            threads,
                            parallel,
                        )
                    };
                }
                if self.state_bf16 {
                    step_in!(Bf16)
                } else {
                    step_in!(f32)
                }
            }
        })
    }
}

/// One step with the delta layers' pools at `pools` (windows, their length, matrices of
/// `delta_len` elements `S` each).
///
/// # Safety
/// Every address is a live pool of that length that nothing else touches during the step.
#[allow(clippy::too_many_arguments)]
unsafe fn step<S: Element>(
    pools: &[(usize, usize, usize)],
    delta_len: usize,
    h: &mut [Bf16],
    layers: &[HybridLayer<'_>],
    caches: &mut [LayerCache<'_>],
    inputs: &HybridInputs<'_>,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let mut states: Vec<LayerState<'_, S>> = pools
        .iter()
        .map(|&(conv, conv_len, delta)| LayerState {
            // SAFETY: the caller's.
            conv: unsafe { slice_mut(conv, conv_len) },
            delta: unsafe { slice_mut(delta, delta_len) },
        })
        .collect();
    // One parallel region for the whole step (see `run_in_team`).
    run_in_team(threads, parallel, |team| {
        decode_hybrid_layers(h, layers, caches, &mut states, inputs, threads, team)
    })
}
