//! Gated DeltaNet kernels over torch tensor memory. `iron_batch.layers.gated_delta` is the
//! only caller: it checks device, dtype, contiguity and shapes of every tensor before
//! passing its address here (see `kernels::slice`).

use iron_batch_kernels::{
    causal_conv_chunk, causal_conv_decode, delta_rule_chunk, delta_rule_decode, Bf16, DeltaShape,
    Element, KernelError, Parallel,
};
use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

use crate::kernels::{run_kernel, slice, slice_mut};

/// One token of each sequence: q, k `[B, H, dk]`, v and out `[B, H, dv]`, g and beta
/// `[B, H]` (float32); `states` the layer's pool `[num_slots, H, dk, dv]` (bf16 if
/// `state_bf16`, else float32), updated in place at `slots`.
#[pyfunction]
#[pyo3(signature = (
    states, slots, q, k, v, g, beta, out, *, num_slots, heads, key_dim, value_dim, threads,
    state_bf16=false, openmp=None
))]
#[allow(clippy::too_many_arguments)]
pub fn _delta_rule_decode(
    py: Python<'_>,
    states: usize,
    slots: PyReadonlyArray1<'_, i64>,
    q: usize,
    k: usize,
    v: usize,
    g: usize,
    beta: usize,
    out: usize,
    num_slots: usize,
    heads: usize,
    key_dim: usize,
    value_dim: usize,
    threads: usize,
    state_bf16: bool,
    openmp: Option<(usize, usize, usize)>,
) -> PyResult<()> {
    let slots = slots.as_slice()?;
    let b = slots.len();
    let shape = DeltaShape {
        heads,
        key_dim,
        value_dim,
    };
    let pool_len = num_slots * heads * key_dim * value_dim;
    run_kernel(py, openmp, |parallel| {
        // SAFETY: see `kernels::slice`.
        let (q, k, v, g, beta, out) = unsafe {
            (
                slice::<f32>(q, b * heads * key_dim),
                slice::<f32>(k, b * heads * key_dim),
                slice::<f32>(v, b * heads * value_dim),
                slice::<f32>(g, b * heads),
                slice::<f32>(beta, b * heads),
                slice_mut::<f32>(out, b * heads * value_dim),
            )
        };
        if state_bf16 {
            // SAFETY: as above.
            let pool = unsafe { slice_mut::<Bf16>(states, pool_len) };
            delta_rule_decode(pool, slots, q, k, v, g, beta, out, shape, threads, parallel)
        } else {
            // SAFETY: as above.
            let pool = unsafe { slice_mut::<f32>(states, pool_len) };
            delta_rule_decode(pool, slots, q, k, v, g, beta, out, shape, threads, parallel)
        }
    })
}

/// `tokens` tokens of one sequence, float32: q, k `[T, H, dk]`, v and out `[T, H, dv]`,
/// g and beta `[T, H]`; `state` `[H, dk, dv]` (bf16 if `state_bf16`, else float32),
/// carried through them in place.
#[pyfunction]
#[pyo3(signature = (
    state, q, k, v, g, beta, out, *, tokens, heads, key_dim, value_dim, threads,
    state_bf16=false, openmp=None
))]
#[allow(clippy::too_many_arguments)]
pub fn _delta_rule_chunk(
    py: Python<'_>,
    state: usize,
    q: usize,
    k: usize,
    v: usize,
    g: usize,
    beta: usize,
    out: usize,
    tokens: usize,
    heads: usize,
    key_dim: usize,
    value_dim: usize,
    threads: usize,
    state_bf16: bool,
    openmp: Option<(usize, usize, usize)>,
) -> PyResult<()> {
    let shape = DeltaShape {
        heads,
        key_dim,
        value_dim,
    };
    let t = tokens;
    run_kernel(py, openmp, |parallel| {
        // SAFETY: see `kernels::slice`.
        let (q, k, v, g, beta, out) = unsafe {
            (
                slice::<f32>(q, t * heads * key_dim),
                slice::<f32>(k, t * heads * key_dim),
                slice::<f32>(v, t * heads * value_dim),
                slice::<f32>(g, t * heads),
                slice::<f32>(beta, t * heads),
                slice_mut::<f32>(out, t * heads * value_dim),
            )
        };
        let len = heads * key_dim * value_dim;
        if state_bf16 {
            // SAFETY: as above.
            let s = unsafe { slice_mut::<Bf16>(state, len) };
            delta_rule_chunk(s, q, k, v, g, beta, out, shape, threads, parallel)
        } else {
            // SAFETY: as above.
            let s = unsafe { slice_mut::<f32>(state, len) };
            delta_rule_chunk(s, q, k, v, g, beta, out, shape, threads, parallel)
        }
    })
}

/// The causal convolution and SiLU. With `slots` (decode): `x` and `out` `[B, C]`, one
/// input per sequence, `windows` the pool `[num_slots, C, K - 1]`. Without (one sequence's
/// chunk): `x` and `out` `[tokens, C]`, `windows` that sequence's window `[C, K - 1]`.
/// `x`, `weight` `[C, K]` and `out` are bf16 or float32 (`bf16`); windows float32.
#[pyfunction]
#[pyo3(signature = (
    x, windows, weight, out, slots=None, *, tokens, num_slots, channels, kernel, bf16,
    threads, openmp=None
))]
#[allow(clippy::too_many_arguments)]
pub fn _causal_conv(
    py: Python<'_>,
    x: usize,
    windows: usize,
    weight: usize,
    out: usize,
    slots: Option<PyReadonlyArray1<'_, i64>>,
    tokens: usize,
    num_slots: usize,
    channels: usize,
    kernel: usize,
    bf16: bool,
    threads: usize,
    openmp: Option<(usize, usize, usize)>,
) -> PyResult<()> {
    let slots = match &slots {
        Some(s) => Some(s.as_slice()?),
        None => None,
    };
    fn go<T: Element>(
        addrs: [usize; 4],
        slots: Option<&[i64]>,
        (tokens, num_slots, ch, kernel): (usize, usize, usize, usize),
        threads: usize,
        parallel: &dyn Parallel,
    ) -> Result<(), KernelError> {
        let rows = slots.map_or(tokens, <[i64]>::len);
        let windows = slots.map_or(1, |_| num_slots) * ch * (kernel.max(1) - 1);
        // SAFETY: see `kernels::slice`.
        let (x, win, w, out) = unsafe {
            (
                slice::<T>(addrs[0], rows * ch),
                slice_mut::<f32>(addrs[1], windows),
                slice::<T>(addrs[2], ch * kernel),
                slice_mut::<T>(addrs[3], rows * ch),
            )
        };
        match slots {
            Some(slots) => causal_conv_decode(x, win, slots, w, kernel, out, threads, parallel),
            None => causal_conv_chunk(x, win, w, kernel, out, threads, parallel),
        }
    }
    let addrs = [x, windows, weight, out];
    let dims = (tokens, num_slots, channels, kernel);
    run_kernel(py, openmp, |parallel| {
        if bf16 {
            go::<Bf16>(addrs, slots, dims, threads, parallel)
        } else {
            go::<f32>(addrs, slots, dims, threads, parallel)
        }
    })
}
