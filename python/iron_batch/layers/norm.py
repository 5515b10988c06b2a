"""RMSNorm over the last dimension, plain or with the residual add before it, the
per-head form (Qwen3's and Gemma 3's q/k norms) and the whole-projection form (OLMo 2's).

Statistics are taken in float32 like the reference implementations whatever the compute
dtype. On CPU with the fused kernels (``platform/cpu.py``) one Rust call does the add and
the norm, rounding where the torch chain rounds (bf16 outputs equal bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from iron_batch.layers import cpu_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` by torch ops, the statistics in float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float, *, fused: bool = False) -> None:
        self.weight = weight
        self.eps = float(eps)
        self.fused = fused

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return cpu_kernels.add_rms_norm_(x, None, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add(
        self, residual: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + delta`` and its norm. The fused kernel adds in place into
        ``residual``; the torch route makes a new tensor. Returns (residual, normed)."""
        if self.fused:
            return residual, cpu_kernels.add_rms_norm_(residual, delta, self.weight, self.eps)
        residual = residual + delta
        return residual, rms_norm(residual, self.weight, self.eps)


class HeadNorm:
    """RMSNorm of each head of ``x`` [T, heads, head_dim] by one weight [head_dim]."""

    def __init__(self, weight: torch.Tensor, eps: float, *, fused: bool = False) -> None:
        self.weight = weight
        self.eps = float(eps)
        self.fused = fused

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return rms_norm(x, self.weight, self.eps)
        t, heads, hd = x.shape
        flat = x.reshape(t * heads, hd).contiguous()
        return cpu_kernels.add_rms_norm_(flat, None, self.weight, self.eps).view(t, heads, hd)


class ProjectionNorm:
    """RMSNorm of a whole q or k projection (OLMo 2): ``x`` [T, heads, head_dim] normed
    over all its heads at once. A tensor-parallel rank holds some heads: ``all_reduce``
    then sums the squares over the ranks, and ``width`` is the full projection's."""

    def __init__(
        self,
        weight: torch.Tensor,
        eps: float,
        *,
        width: int,
        all_reduce: Callable[[torch.Tensor], None] | None = None,
        fused: bool = False,
    ) -> None:
        self.weight = weight
        self.eps = float(eps)
        self.width = width
        self.all_reduce = all_reduce
        self.fused = fused and all_reduce is None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t, heads, hd = x.shape
        flat = x.reshape(t, heads * hd)
        if self.fused:
            out = cpu_kernels.add_rms_norm_(flat.contiguous(), None, self.weight, self.eps)
            return out.view(t, heads, hd)
        xf = flat.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.all_reduce is not None:
            self.all_reduce(squares)
        xf = xf * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * xf.to(x.dtype)).view(t, heads, hd)
