"""Gated DeltaNet on CPU by Rust kernels (``rust/kernels/src/delta_rule.rs``): the
delta-rule decode step over each sequence's state slot, the chunked prefill of one
sequence, and the causal convolution with its window. Each function checks its tensors
(device, dtype, contiguity, shapes) before handing their addresses to Rust; the torch
route of ``layers/gated_delta.py`` computes the same values."""

from __future__ import annotations

import numpy as np
import torch

from iron_batch import _core
from iron_batch.platform.openmp import entry_points

_DECODE = getattr(_core, "_delta_rule_decode", None)
_CHUNK = getattr(_core, "_delta_rule_chunk", None)
_CONV = getattr(_core, "_causal_conv", None)


def available() -> bool:
    return _DECODE is not None and _CHUNK is not None and _CONV is not None


def _check(dtype: torch.dtype, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"delta-rule kernels need contiguous CPU {dtype} tensors")


def _state_dtype(state: torch.Tensor) -> torch.dtype:
    if state.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"delta-rule states are float32 or bf16, not {state.dtype}")
    return state.dtype


def _slot_array(slots: torch.Tensor, total: int) -> np.ndarray:
    arr = np.ascontiguousarray(slots.cpu().numpy(), dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= total or len(np.unique(arr)) != arr.size):
        raise ValueError(f"state slots must be distinct and below {total}")
    return arr


def delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor
                      ) -> torch.Tensor:
    """One token per sequence: q, k [B, H, dk], v [B, H, dv], g, beta [B, H] (float32);
    ``states`` [slots, H, dk, dv] (float32 or bf16) updated in place at ``slots``; returns
    o [B, H, dv]."""
    b, heads, dk = q.shape
    dv = v.shape[-1]
    _check(torch.float32, q, k, v, g, beta)
    _check(_state_dtype(states), states)
    if (k.shape != q.shape or v.shape != (b, heads, dv) or g.shape != (b, heads)
            or beta.shape != g.shape or states.shape[1:] != (heads, dk, dv)):
        raise ValueError("delta_rule_decode: mismatched shapes")
    idx = _slot_array(slots, states.shape[0])
    if len(idx) != b:
        raise ValueError("delta_rule_decode: one slot per sequence")
    out = torch.empty_like(v)
    assert _DECODE is not None
    _DECODE(states.data_ptr(), idx, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
            beta.data_ptr(), out.data_ptr(), num_slots=states.shape[0], heads=heads,
            key_dim=dk, value_dim=dv, threads=torch.get_num_threads(),
            state_bf16=states.dtype == torch.bfloat16, openmp=entry_points())
    return out


def delta_rule_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """T tokens of one sequence (q, k [T, H, dk], v [T, H, dv], g, beta [T, H], float32),
    ``state`` [H, dk, dv] (float32 or bf16) carried through them in place; returns o
    [T, H, dv]."""
    t, heads, dk = q.shape
    dv = v.shape[-1]
    _check(torch.float32, q, k, v, g, beta)
    _check(_state_dtype(state), state)
    if (k.shape != q.shape or v.shape != (t, heads, dv) or g.shape != (t, heads)
            or beta.shape != g.shape or state.shape != (heads, dk, dv)):
        raise ValueError("delta_rule_chunk: mismatched shapes")
    out = torch.empty_like(v)
    assert _CHUNK is not None
    _CHUNK(state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
           beta.data_ptr(), out.data_ptr(), tokens=t, heads=heads, key_dim=dk,
           value_dim=dv, threads=torch.get_num_threads(),
           state_bf16=state.dtype == torch.bfloat16, openmp=entry_points())
    return out


def causal_conv(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor,
                slots: torch.Tensor | None) -> torch.Tensor:
    """silu(causal depthwise conv). With ``slots``: x [B, C], one input per sequence,
    ``windows`` the pool [slots, C, K - 1]; without: x [T, C] of one sequence, ``windows``
    its window [C, K - 1]. Windows (float32) are shifted in place; x, weight [C, K] and
    the result are bf16 or float32."""
    channels, kernel = weight.shape
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"causal_conv supports bf16 and float32, not {x.dtype}")
    _check(x.dtype, x, weight)
    _check(torch.float32, windows)
    if x.shape[-1] != channels or windows.shape[-2:] != (channels, kernel - 1):
        raise ValueError("causal_conv: mismatched shapes")
    idx = None
    if slots is not None:
        idx = _slot_array(slots, windows.shape[0])
        if len(idx) != x.shape[0]:
            raise ValueError("causal_conv: one slot per sequence")
    out = torch.empty_like(x)
    assert _CONV is not None
    _CONV(x.data_ptr(), windows.data_ptr(), weight.data_ptr(), out.data_ptr(), idx,
          tokens=x.shape[0], num_slots=windows.shape[0] if slots is not None else 1,
          channels=channels, kernel=kernel, bf16=x.dtype == torch.bfloat16,
          threads=torch.get_num_threads(), openmp=entry_points())
    return out
