//! `_DecoderStack`: a model's decoder layers for one-call decode steps (see the kernels
//! crate's `decode_layers`). `iron_batch.layers.decoder_stack` is the only caller: it checks
//! every tensor (device, dtype, contiguity, shape) when it builds the stack and keeps them
//! alive as long as the stack, because the stack holds their addresses, not the tensors.

use iron_batch_kernels::{
    decode_layers, run_in_team, Activation, DecodeInputs, DecodeShape, DecoderLayer, KernelError,
    LayerCache, Matrix, Projection,
};
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::kernels::{qmatrix, run_kernel, slice, slice_mut};

/// A projection as Python describes it: (kind "bf16" | "q4" | "q8", weight or quants,
/// scale, min, bias, n, k); unused addresses and "no bias" are 0.
type ProjectionSpec = (String, usize, usize, usize, usize, usize, usize);
/// A layer: (input_norm, post_norm, q_norm, k_norm, [qkv, o, gate_up, down], activation,
/// sliding window); norms of 0 are absent (q_norm and k_norm only), a window of 0 attends
/// every position.
type LayerSpec = (
    usize,
    usize,
    usize,
    usize,
    Vec<ProjectionSpec>,
    String,
    usize,
);

#[derive(Clone)]
struct ProjectionAddrs {
    kind: String,
    weight: usize,
    scale: usize,
    min: usize,
    bias: usize,
    n: usize,
    k: usize,
}

impl ProjectionAddrs {
    /// SAFETY: the addresses are live tensors of the sizes `n`, `k` and `kind` imply.
    unsafe fn view<'a>(&self) -> Result<Projection<'a>, KernelError> {
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
    input_norm: usize,
    post_norm: usize,
    q_norm: usize,
    k_norm: usize,
    /// qkv, o, gate_up, down.
    projections: [ProjectionAddrs; 4],
    activation: Activation,
    sliding_window: usize,
}

/// The decoder layers of one model, by address, and their KV caches.
#[pyclass(name = "_DecoderStack", module = "iron_batch._core")]
pub struct DecoderStack {
    layers: Vec<LayerAddrs>,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// (K, V) address per layer, each `[num_blocks * block_size, kv_heads * head_dim]`.
    caches: Vec<(usize, usize)>,
    num_blocks: usize,
    block_size: usize,
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
        for (input_norm, post_norm, q_norm, k_norm, projections, activation, sliding_window) in
            layers
        {
            let activation = Activation::from_name(&activation).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "the decode stack has no activation {activation:?} (it has: silu)"
                ))
            })?;
            let projections: Vec<ProjectionAddrs> = projections
                .into_iter()
                .map(|(kind, weight, scale, min, bias, n, k)| {
                    if !matches!(kind.as_str(), "bf16" | "q4" | "q8") {
                        return Err(PyValueError::new_err(format!(
                            "unknown weight kind {kind:?}"
                        )));
                    }
                    Ok(ProjectionAddrs {
                        kind,
                        weight,
                        scale,
                        min,
                        bias,
                        n,
                        k,
                    })
                })
                .collect::<PyResult<_>>()?;
            let projections: [ProjectionAddrs; 4] = projections
                .try_into()
                .map_err(|_| PyValueError::new_err("a layer has four projections"))?;
            parsed.push(LayerAddrs {
                input_norm,
                post_norm,
                q_norm,
                k_norm,
                projections,
                activation,
                sliding_window,
            });
        }
        Ok(Self {
            layers: parsed,
            hidden,
            heads,
            kv_heads,
            head_dim,
            caches: Vec::new(),
            num_blocks: 0,
            block_size: 0,
        })
    }

    /// The layers' KV caches: one (K, V) address pair per layer.
    fn set_caches(
        &mut self,
        caches: Vec<(usize, usize)>,
        num_blocks: usize,
        block_size: usize,
    ) -> PyResult<()> {
        if caches.len() != self.layers.len() {
            return Err(PyValueError::new_err("one (K, V) cache pair per layer"));
        }
        self.caches = caches;
        self.num_blocks = num_blocks;
        self.block_size = block_size;
        Ok(())
    }

    /// One decode step over the residual rows at `h` (`[rows, hidden]` bf16, in place);
    /// `cos`/`sin` `[rows, head_dim]` bf16; one slot, table row and length per row.
    #[pyo3(signature = (
        h, cos, sin, slots, block_tables, seq_lens, *, scale, eps, threads, openmp=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &self,
        py: Python<'_>,
        h: usize,
        cos: usize,
        sin: usize,
        slots: PyReadonlyArray1<'_, i64>,
        block_tables: PyReadonlyArray2<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        scale: f32,
        eps: f32,
        threads: usize,
        openmp: Option<(usize, usize, usize)>,
    ) -> PyResult<()> {
        if self.caches.len() != self.layers.len() {
            return Err(PyValueError::new_err("decode before set_caches"));
        }
        let (slots, tables, lens) = (
            slots.as_slice()?,
            block_tables.as_slice()?,
            seq_lens.as_slice()?,
        );
        let dims = block_tables.shape();
        let rows = slots.len();
        let shape = DecodeShape {
            num_seqs: rows,
            num_heads: self.heads,
            num_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            max_blocks: dims[1],
            num_blocks: self.num_blocks,
            // Each layer attends with its own window.
            sliding_window: 0,
        };
        if dims[0] != rows {
            return Err(PyValueError::new_err("one block-table row per slot"));
        }
        let cache_len = self.num_blocks * self.block_size * self.kv_heads * self.head_dim;
        let hd = self.head_dim;
        run_kernel(py, openmp, |parallel| {
            // SAFETY: the caller (layers/decoder_stack.py) checked every tensor behind these addresses
            // and keeps them alive; the sizes are the ones it checked.
            unsafe {
                let layers = self
                    .layers
                    .iter()
                    .map(|l| {
                        let [qkv, o, gate_up, down] = &l.projections;
                        Ok(DecoderLayer {
                            input_norm: slice(l.input_norm, self.hidden),
                            qkv: qkv.view()?,
                            q_norm: (l.q_norm != 0).then(|| slice(l.q_norm, hd)),
                            k_norm: (l.k_norm != 0).then(|| slice(l.k_norm, hd)),
                            o: o.view()?,
                            post_norm: slice(l.post_norm, self.hidden),
                            gate_up: gate_up.view()?,
                            down: down.view()?,
                            activation: l.activation,
                            sliding_window: l.sliding_window,
                        })
                    })
                    .collect::<Result<Vec<_>, KernelError>>()?;
                let mut caches: Vec<LayerCache<'_>> = self
                    .caches
                    .iter()
                    .map(|&(k, v)| LayerCache {
                        k: slice_mut(k, cache_len),
                        v: slice_mut(v, cache_len),
                    })
                    .collect();
                let inputs = DecodeInputs {
                    cos: slice(cos, rows * hd),
                    sin: slice(sin, rows * hd),
                    slots,
                    block_tables: tables,
                    seq_lens: lens,
                    shape,
                    scale,
                    eps,
                };
                let h = slice_mut(h, rows * self.hidden);
                // One parallel region for the whole step (see `run_in_team`).
                run_in_team(threads, parallel, |team| {
                    decode_layers(h, &layers, &mut caches, &inputs, threads, team)
                })
            }
        })
    }
}
