"""The int8 KV cache (``--kv-cache-dtype int8``): each (token, kv head) row of K or V kept
as ``head_dim`` int8 values and the float32 scale they multiply, about half the bytes of a
bf16 row.

A layer's cache is one int8 tensor ``[2, blocks, block_size, kv_heads, head_dim + 4]``:
the row's values, then the four bytes of its scale, as the Rust kernels
(``rust/kernels/src/kv_int8.rs``) read and write it. Quantization is symmetric per row,
``scale = max|x| / 127`` and ``q = round(x / scale)`` (ties to even) in float32, so this
module and the Rust store give the same bytes. The CPU kernels read the rows in place; the
torch route (any device) dequantizes the rows it gathers.
"""

from __future__ import annotations

import torch
from iron_batch.layers import KV_CACHE_DTYPES

#: Bytes after a row's values: its float32 scale.
SCALE_BYTES = 4


def check(kv_cache_dtype: str) -> str:
    """``kv_cache_dtype`` if it is one of :data:`KV_CACHE_DTYPES`; ValueError otherwise."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype {kv_cache_dtype!r} is not one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype


def is_int8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is an int8 cache (rows of values and their scale)."""
    return cache.dtype == torch.int8


def row_bytes(head_dim: int) -> int:
    """Bytes of one quantized row."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` [..., head_dim] (any float dtype) as int8 rows [..., head_dim + 4]."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.round(xf / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-127, 127)
    return torch.cat([q.to(torch.int8), scale.contiguous().view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., head_dim + 4] back to ``dtype`` values [..., head_dim]."""
    hd = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., hd:].contiguous().view(torch.float32)
    return (rows[..., :hd].float() * scale).to(dtype)
