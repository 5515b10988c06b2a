//! The int8 KV cache's kernels over torch tensor memory: `iron_batch.attention.cpu_kernel`
//! and `iron_batch.layers.cpu_kernels` check every tensor before passing its address.

use iron_batch_kernels::{
    int8_row_len, paged_decode_attention_int8, rope_store_kv_int8, Bf16, DecodeShape, Element,
    KernelError, Parallel,
};
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::kernels::{run_kernel, slice, slice_mut};

/// `_paged_decode_attention` over int8 caches (`[blocks, block_size, kv_heads, head_dim +
/// 4]` bytes each).
#[pyfunction]
#[pyo3(signature = (
    out, q, k_cache, v_cache, block_tables, seq_lens, *, num_heads, num_kv_heads, head_dim,
    block_size, num_blocks, sliding_window, scale, bf16, threads, openmp=None, softcap=0.0
))]
#[allow(clippy::too_many_arguments)]
pub fn _paged_decode_attention_int8(
    py: Python<'_>,
    out: usize,
    q: usize,
    k_cache: usize,
    v_cache: usize,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    num_blocks: usize,
    sliding_window: usize,
    scale: f32,
    bf16: bool,
    threads: usize,
    openmp: Option<(usize, usize, usize)>,
    softcap: f32,
) -> PyResult<()> {
    let dims = block_tables.shape();
    let shape = DecodeShape {
        num_seqs: dims[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max_blocks: dims[1],
        num_blocks,
        sliding_window,
    };
    let (tables, lens) = (block_tables.as_slice()?, seq_lens.as_slice()?);
    fn go<T: Element>(
        addrs: [usize; 4],
        tables: &[i32],
        lens: &[i32],
        shape: &DecodeShape,
        (scale, softcap): (f32, f32),
        threads: usize,
        parallel: &dyn Parallel,
    ) -> Result<(), KernelError> {
        let n = shape.num_seqs * shape.num_heads * shape.head_dim;
        let cache =
            shape.num_blocks * shape.block_size * shape.num_kv_heads * int8_row_len(shape.head_dim);
        // SAFETY: see `kernels::slice`.
        let (out, q, k, v) = unsafe {
            (
                slice_mut::<T>(addrs[0], n),
                slice::<T>(addrs[1], n),
                slice::<i8>(addrs[2], cache),
                slice::<i8>(addrs[3], cache),
            )
        };
        paged_decode_attention_int8(
            out, q, k, v, tables, lens, shape, scale, softcap, threads, parallel,
        )
    }
    let addrs = [out, q, k_cache, v_cache];
    let scores = (scale, softcap);
    run_kernel(py, openmp, |parallel| {
        if bf16 {
            go::<Bf16>(addrs, tables, lens, &shape, scores, threads, parallel)
        } else {
            go::<f32>(addrs, tables, lens, &shape, scores, threads, parallel)
        }
    })
}

/// `_rope_store_kv` into int8 caches (`[num_slots, kv_heads, head_dim + 4]` bytes each).
#[pyfunction]
#[pyo3(signature = (
    q_out, k_cache, v_cache, qkv, cos, sin, slots, *, heads, kv_heads, head_dim, num_slots, bf16,
    rotary_dim=None
))]
#[allow(clippy::too_many_arguments)]
pub fn _rope_store_kv_int8(
    py: Python<'_>,
    q_out: usize,
    k_cache: usize,
    v_cache: usize,
    qkv: usize,
    cos: usize,
    sin: usize,
    slots: PyReadonlyArray1<'_, i64>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    num_slots: usize,
    bf16: bool,
    rotary_dim: Option<usize>,
) -> PyResult<()> {
    fn go<T: Element>(
        addrs: [usize; 6],
        slots: &[i64],
        (heads, kv_heads, head_dim, rd): (usize, usize, usize, usize),
        num_slots: usize,
    ) -> Result<(), KernelError> {
        let tokens = slots.len();
        let cache = num_slots * kv_heads * int8_row_len(head_dim);
        // SAFETY: see `kernels::slice`.
        unsafe {
            rope_store_kv_int8(
                slice_mut::<T>(addrs[0], tokens * heads * head_dim),
                slice_mut::<i8>(addrs[1], cache),
                slice_mut::<i8>(addrs[2], cache),
                slice::<T>(addrs[3], tokens * (heads + 2 * kv_heads) * head_dim),
                slice::<T>(addrs[4], tokens * rd),
                slice::<T>(addrs[5], tokens * rd),
                slots,
                heads,
                kv_heads,
                head_dim,
                rd,
            )
        }
    }
    let slots = slots.as_slice()?;
    let addrs = [q_out, k_cache, v_cache, qkv, cos, sin];
    let dims = (heads, kv_heads, head_dim, rotary_dim.unwrap_or(head_dim));
    run_kernel(py, None, |_| {
        if bf16 {
            go::<Bf16>(addrs, slots, dims, num_slots)
        } else {
            go::<f32>(addrs, slots, dims, num_slots)
        }
    })
}
