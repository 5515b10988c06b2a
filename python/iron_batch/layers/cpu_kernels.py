"""Fused decoder-layer steps on CPU, by Rust kernels (``rust/kernels/src/elementwise.rs``).

At decode batch sizes a layer's elementwise work is a few dozen tiny torch ops whose
dispatch costs more than their arithmetic: an RMSNorm alone is eight (cast, square, mean,
add, rsqrt, multiply, cast back, scale). Each function here is one call that rounds where
the torch chain rounds, so bf16 outputs equal the torch ones bit for bit (float32 ones up
to the order of a sum). Which of them a model uses is decided at load (``platform/cpu.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from iron_batch import _core
from iron_batch.platform.openmp import entry_points

_RMS = getattr(_core, "_add_rms_norm", None)
_ROPE = getattr(_core, "_rope_store_kv", None)
_ROPE_INT8 = getattr(_core, "_rope_store_kv_int8", None)
_GEMV = getattr(_core, "_gemv_bf16", None)
_ACT = getattr(_core, "_gated_activation", None)

#: Activation rows one pass of the bf16 GEMV serves (the Rust kernel's ``GEMV_MAX_ROWS``):
#: the weights are read once for all of them. It takes more rows in passes of that many,
#: and each row's result is the one it would get alone (a speculative step's verification
#: rows reproduce one-row decoding bit for bit).
BF16_GEMV_MAX_ROWS = 8


def _check(*tensors: torch.Tensor) -> None:
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("fused CPU kernels need contiguous CPU tensors of one dtype")
    if dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"fused CPU kernels support bf16 and float32, not {dtype}")


def add_rms_norm_(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
    *, round_once: bool = False,
) -> torch.Tensor:
    """``residual += delta`` in place (when given), then return ``weight * rms_norm(residual)``.
    ``residual`` and ``delta`` are [rows, dim]; ``weight`` [dim]. ``round_once``: Gemma 4's
    rounding, the normalized value times the weight in float32 and rounded once (else the
    normalized value is rounded, then multiplied)."""
    rows, dim = residual.shape
    tensors = [residual, weight] + ([delta] if delta is not None else [])
    _check(*tensors)
    if weight.shape != (dim,) or (delta is not None and delta.shape != residual.shape):
        raise ValueError("rms_norm: weight must be [dim] and delta like the input")
    out = torch.empty_like(residual)
    _RMS(
        out.data_ptr(), residual.data_ptr(), 0 if delta is None else delta.data_ptr(),
        weight.data_ptr(), rows=rows, dim=dim, eps=float(eps),
        bf16=residual.dtype == torch.bfloat16, threads=torch.get_num_threads(),
        openmp=entry_points(), round_once=round_once,
    )
    return out


def rope_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: np.ndarray,
    cache: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Rotate q and k of the fused projection ``qkv`` [T, (heads + 2 kv_heads) * hd] with
    ``cos``/``sin`` [T, rotary_dim], store K and V at ``slot_mapping`` in ``cache``
    [2, blocks, block_size, kv_heads, hd], and return the rotated q [T, heads, hd].
    ``rotary_dim`` (default ``head_dim``): the leading dims of each head that rotate
    (half-split within them); the rest pass through (partial rotary, Phi-3's)."""
    tokens = qkv.shape[0]
    rd = head_dim if rotary_dim is None else rotary_dim
    if rd % 2 or not 0 <= rd <= head_dim:
        raise ValueError(f"rope_store_kv: rotary_dim {rd} must be even and at most {head_dim}")
    cos = cos.reshape(tokens, rd)
    sin = sin.reshape(tokens, rd)
    int8 = cache.dtype == torch.int8  # int8 rows and their scales (attention/kv_int8.py)
    _check(qkv, cos, sin, *([] if int8 else [cache]))
    if int8 and (cache.device.type != "cpu" or not cache.is_contiguous()):
        raise ValueError("rope_store_kv: the int8 cache must be contiguous on the CPU")
    slots = np.ascontiguousarray(slot_mapping, dtype=np.int64)
    if qkv.shape != (tokens, (heads + 2 * kv_heads) * head_dim) or slots.shape != (tokens,):
        raise ValueError("rope_store_kv: qkv must be [T, (heads + 2 kv_heads) * hd]")
    row = head_dim + 4 if int8 else head_dim
    if cache.shape[0] != 2 or cache.shape[-2:] != (kv_heads, row):
        raise ValueError(f"rope_store_kv: cache shape {tuple(cache.shape)} does not fit")
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype)
    (_ROPE_INT8 if int8 else _ROPE)(
        q.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), qkv.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), slots, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, num_slots=cache.shape[1] * cache.shape[2],
        bf16=qkv.dtype == torch.bfloat16, rotary_dim=rd,
    )
    return q


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of bf16 ``gate_up`` [rows, 2 * inter] (the gate first) ->
    [rows, inter], by the decode stack's own kernel: ``activation`` "silu" (SwiGLU) or
    "gelu_pytorch_tanh" / "gelu_tanh" (GeGLU), rounded as the torch chain rounds (the
    activation to bf16, then the product)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gated activation: gate_up must be [rows, 2 * inter], got "
                         f"{tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    _check(gate_up)
    if gate_up.dtype != torch.bfloat16:
        raise TypeError(f"gated activation: bf16 only, not {gate_up.dtype}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    _ACT(out.data_ptr(), gate_up.data_ptr(), rows=rows, inter=inter, activation=activation,
         threads=torch.get_num_threads(), openmp=entry_points())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` in bf16 by the Rust kernel (see :func:`gated_activation`)."""
    return gated_activation(gate_up, "silu")


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.gelu(gate, approximate="tanh") * up`` in bf16 by the Rust kernel (see
    :func:`gated_activation`)."""
    return gated_activation(gate_up, "gelu_pytorch_tanh")


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a [out, in] weight, made once at load.

    ``F.linear`` on CPU lets oneDNN reorder the plain weight into its blocked layout inside
    every call; packing once saves that pass over the weights and made SmolLM2's batch-64
    projections 1.2-2x faster, bit-identical. The plain weight is kept for the batch-1 GEMV
    and the embedding, so packed projections cost their size in memory a second time.
    None when this torch build cannot pack.
    """
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    except (RuntimeError, AttributeError):
        return None


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` with a weight from :func:`prepack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of bf16 rows by the Rust GEMV: each weight row streamed once per pass
    of ``BF16_GEMV_MAX_ROWS`` rows by all of torch's threads, f32 sums, one rounding to
    bf16 (other shapes and dtypes: ``F.linear``)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if rows == 0 or x.dtype != torch.bfloat16:
        return torch.nn.functional.linear(x, weight, bias)
    x = x.contiguous()
    n, k = weight.shape
    tensors = [x, weight] + ([bias] if bias is not None else [])
    _check(*tensors)
    if x.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"linear: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    out = torch.empty(rows, n, dtype=x.dtype)
    _GEMV(
        out.data_ptr(), x.data_ptr(), weight.data_ptr(),
        0 if bias is None else bias.data_ptr(), rows=rows, n=n, k=k,
        threads=torch.get_num_threads(), openmp=entry_points(),
    )
    return out

