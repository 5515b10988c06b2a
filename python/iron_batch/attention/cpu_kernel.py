"""Decode attention on CPU read in place from the paged KV cache, by the Rust kernel.

The torch route (``attention/paged.py``, ``_decode_attention``) gathers every decode's KV blocks
into a fresh tensor, transposes them and runs two batched matmuls around a softmax: per
layer that copies the whole context of the batch, and at batch 1 it is a dozen small ops.
The kernel (``rust/kernels``) reads each key and value once from the cache blocks, in f32
arithmetic. Large calls are split across the calling thread's OpenMP team, the one torch's
own ops run on: right after an op its workers are still spinning, and fresh OS threads
would have to share the cores with them.

``IRON_BATCH_CPU_ATTENTION=torch`` (``platform/switches.py``) takes the torch route instead,
for comparison.
"""

from __future__ import annotations

import numpy as np
import torch
from iron_batch import _core
from iron_batch.attention import kv_int8
from iron_batch.platform.openmp import entry_points

_KERNEL = getattr(_core, "_paged_decode_attention", None)
_KERNEL_INT8 = getattr(_core, "_paged_decode_attention_int8", None)
_DTYPES = {torch.bfloat16: True, torch.float32: False}


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    sliding_window: int | None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [S, heads, hd] -> [S, heads * hd]; ``cache`` [2, blocks, block_size, kv_heads, hd]
    (or an int8 cache, ``attention/kv_int8.py``, its last dim ``hd + 4``);
    ``block_tables`` int32 [S, width] and ``seq_lens`` int32 [S] of the decoding sequences
    (lengths include the new token, whose K/V is already in the cache). With ``softcap``
    (Gemma 2's ``attn_logit_softcapping``) each score ``s = scale * q.k`` becomes
    ``softcap * tanh(s / softcap)`` before the softmax; None or 0: off. ``sinks``
    (float32 [heads], gpt-oss): each head's logit joins its softmax's denominator (the
    kernel's portable and AVX2 paths; an int8 cache takes none)."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_blocks, block_size, kv_heads, cache_hd = cache.shape
    int8 = kv_int8.is_int8(cache)
    # The kernel trusts these: it gets addresses, not tensors.
    if (q.dtype != cache.dtype and not int8) or q.dtype not in _DTYPES:
        raise TypeError(f"q {q.dtype} and cache {cache.dtype} must both be bf16 or float32 "
                        "(or the cache int8)")
    if q.device.type != "cpu" or cache.device.type != "cpu" or not cache.is_contiguous():
        raise ValueError("the CPU attention kernel needs a contiguous CPU cache")
    row = kv_int8.row_bytes(head_dim) if int8 else head_dim
    if cache_hd != row or cache.shape[0] != 2:
        raise ValueError(f"cache shape {tuple(cache.shape)} does not fit q {tuple(q.shape)}")
    tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    lens = np.ascontiguousarray(seq_lens, dtype=np.int32)
    if tables.ndim != 2 or tables.shape[0] != num_seqs or lens.shape != (num_seqs,):
        raise ValueError("block_tables must be [seqs, width] and seq_lens [seqs]")
    cap = float(softcap or 0.0)
    if not cap >= 0.0 or cap == float("inf"):
        raise ValueError(f"softcap must be positive (or None), not {softcap}")
    q = q.contiguous()
    out = torch.empty(num_seqs, num_heads * head_dim, dtype=q.dtype)
    if sinks is not None:
        if int8:
            raise ValueError("attention sinks need a bf16 or float32 KV cache, not int8")
        if sinks.dtype != torch.float32 or sinks.shape != (num_heads,) or (
                sinks.device.type != "cpu"):
            raise ValueError(f"sinks must be float32 [{num_heads}] on the CPU")
        sinks = sinks.contiguous()
        _KERNEL(
            out.data_ptr(), q.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), tables,
            lens, num_heads=num_heads, num_kv_heads=kv_heads, head_dim=head_dim,
            block_size=block_size, num_blocks=num_blocks, sliding_window=sliding_window or 0,
            scale=float(scale), bf16=q.dtype == torch.bfloat16,
            threads=torch.get_num_threads(), openmp=entry_points(), softcap=cap,
            sinks=sinks.data_ptr(),
        )
        return out
    (_KERNEL_INT8 if int8 else _KERNEL)(
        out.data_ptr(), q.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), tables, lens,
        num_heads=num_heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        num_blocks=num_blocks, sliding_window=sliding_window or 0, scale=float(scale),
        bf16=q.dtype == torch.bfloat16, threads=torch.get_num_threads(),
        openmp=entry_points(), softcap=cap,
    )
    return out
