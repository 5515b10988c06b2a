//! CPU kernels over torch tensor memory. `iron_batch.models.cpu_attention` is the only
//! caller: it checks device, dtype, contiguity and shapes of every tensor before passing its
//! address here, because a raw address carries none of that.

use iron_batch_kernels::{paged_decode_attention, Bf16, DecodeShape, Element};
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Builds the slices from the caller's addresses and runs the kernel without the GIL.
///
/// SAFETY (upheld by the Python wrapper): each address points at a live, contiguous CPU
/// tensor of `T` with exactly the element count given by `shape`, and `out` aliases none of
/// the inputs.
#[allow(clippy::too_many_arguments)]
unsafe fn run<T: Element>(
    py: Python<'_>,
    out: usize,
    q: usize,
    k_cache: usize,
    v_cache: usize,
    tables: &[i32],
    lens: &[i32],
    shape: DecodeShape,
    scale: f32,
    threads: usize,
) -> PyResult<()> {
    let n = shape.num_seqs * shape.num_heads * shape.head_dim;
    let cache = shape.num_blocks * shape.block_size * shape.num_kv_heads * shape.head_dim;
    let result = py.detach(|| {
        // SAFETY: see the function's contract.
        let (out, q, k, v) = unsafe {
            (
                std::slice::from_raw_parts_mut(out as *mut T, n),
                std::slice::from_raw_parts(q as *const T, n),
                std::slice::from_raw_parts(k_cache as *const T, cache),
                std::slice::from_raw_parts(v_cache as *const T, cache),
            )
        };
        paged_decode_attention(out, q, k, v, tables, lens, &shape, scale, threads)
    });
    result.map_err(|e| PyValueError::new_err(e.0))
}

/// Decode attention read in place from a paged KV cache (see the kernels crate).
#[pyfunction]
#[pyo3(signature = (
    out, q, k_cache, v_cache, block_tables, seq_lens, *, num_heads, num_kv_heads, head_dim,
    block_size, num_blocks, sliding_window, scale, bf16, threads
))]
#[allow(clippy::too_many_arguments)]
pub fn _paged_decode_attention(
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
    let tables = block_tables.as_slice()?;
    let lens = seq_lens.as_slice()?;
    // SAFETY: the Python wrapper upholds `run`'s contract.
    unsafe {
        if bf16 {
            run::<Bf16>(
                py, out, q, k_cache, v_cache, tables, lens, shape, scale, threads,
            )
        } else {
            run::<f32>(
                py, out, q, k_cache, v_cache, tables, lens, shape, scale, threads,
            )
        }
    }
}
