"""Attention backends: how one layer's queries meet the paged KV cache on a device.

A backend builds the per-forward metadata once (:meth:`AttentionBackend.plan`, an
:class:`~iron_batch.attention.paged.AttentionPlan` every layer reuses), stores each
layer's new K/V and computes its attention. Model code calls these and never branches on
the device:

- :class:`TorchAttention`: torch ops (SDPA for prompts, batched matmuls for decodes); any
  device, and the reference for the others.
- :class:`CudaAttention`: the torch route on a CUDA device (SDPA picks its fused kernels
  there).
- :class:`CpuKernelAttention`: the Rust kernels read the cache in place (decodes, and bf16
  prompt rows), and a decode-only step rotates q/k and stores K/V in one call.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from iron_batch.attention import paged
from iron_batch.attention.paged import AttentionPlan
from iron_batch.layers import cpu_kernels
from iron_batch.layers.rotary import apply_rope
from iron_batch.platform.cpu import CpuKernels

#: A per-head transform of q or k [T, heads, head_dim] (a q/k norm).
HeadTransform = Callable[[torch.Tensor], torch.Tensor]


class AttentionBackend:
    """The torch route; subclasses replace what they do better."""

    name = "torch"
    #: Decodes read the cache in place through the Rust kernel.
    cpu_kernel = False
    #: Prompt rows too (bf16).
    prefill_kernel = False
    #: A decode-only step rotates and stores K/V in one Rust call.
    fused_rope = False

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    def plan(
        self,
        *,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        num_computed_before: np.ndarray,
        block_tables: np.ndarray,
        slot_mapping: np.ndarray,
        block_size: int,
        group: int,
        sliding_window: int | None,
    ) -> AttentionPlan:
        slots = torch.from_numpy(np.ascontiguousarray(slot_mapping, dtype=np.int64))
        plan = AttentionPlan(
            query_start_loc=np.asarray(query_start_loc),
            seq_lens=np.asarray(seq_lens),
            num_computed_before=np.asarray(num_computed_before),
            block_tables=np.asarray(block_tables),
            slot_mapping=slots.to(self.device),
            block_size=block_size,
            group=group,
            sliding_window=sliding_window,
            device=self.device,
            dtype=self.dtype,
            use_cpu_kernel=self.cpu_kernel,
            prefill_kernel=self.prefill_kernel,
            host_slot_mapping=slot_mapping,
        )
        return plan

    def rotate_and_store(
        self,
        qkv: torch.Tensor,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        q_norm: HeadTransform | None,
        k_norm: HeadTransform | None,
        cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Split the fused projection ``qkv`` [T, (heads + 2 kv_heads) * hd], norm and
        rotate q and k (the tables' width of each head: partial rotary; not at all when
        ``cos`` is None), store K/V at the plan's slots; returns (q, k, v) with k and v None
        where attention needs only the cache."""
        full_rotary = cos is not None and cos.shape[-1] == head_dim
        if self.fused_rope and full_rotary and q_norm is None and plan.decodes is not None and (
            plan.decodes.all_rows
        ):
            # A decode-only step: every row's K/V goes to the cache, and attention reads
            # only the cache.
            q = cpu_kernels.rope_store_kv(qkv, cos, sin, plan.host_slots, cache, heads,
                                          kv_heads, head_dim)
            return q, None, None
        n = qkv.shape[0]
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        v = qkv[:, q_size + kv_size :].view(n, kv_heads, head_dim)
        if q_norm is not None and k_norm is not None:
            q = q_norm(qkv[:, :q_size].view(n, heads, head_dim))
            k = k_norm(qkv[:, q_size : q_size + kv_size].view(n, kv_heads, head_dim))
            if cos is not None and sin is not None:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif cos is None or sin is None:
            q = qkv[:, :q_size].view(n, heads, head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(n, kv_heads, head_dim)
        else:
            # One rotation over q and k heads together: half the elementwise calls,
            # which on a small CPU cost more in dispatch than in arithmetic.
            qk = apply_rope(qkv[:, : q_size + kv_size].view(n, -1, head_dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        k, v = paged.write_kv(cache, plan, k, v)
        return q, k, v

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        cache: torch.Tensor,
        plan: AttentionPlan,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, heads * hd] attention outputs of this step's queries (``softcap``: scores
        become ``softcap * tanh(score / softcap)`` before the mask and softmax; ``sinks``:
        float32 [heads] logits in each head's softmax denominator)."""
        return paged.paged_attention(q, k, v, cache, plan, scale, softcap, sinks)


class TorchAttention(AttentionBackend):
    name = "torch"


class CudaAttention(AttentionBackend):
    name = "cuda-sdpa"


class CpuKernelAttention(AttentionBackend):
    name = "cpu-kernel"
    cpu_kernel = True

    def __init__(self, device: torch.device, dtype: torch.dtype, kernels: CpuKernels) -> None:
        super().__init__(device, dtype)
        self.prefill_kernel = kernels.prefill_attention
        self.fused_rope = kernels.fused


def select(device: torch.device, dtype: torch.dtype, kernels: CpuKernels) -> AttentionBackend:
    """The backend for this device and dtype, with the kernels the switches allow."""
    if device.type == "cuda":
        return CudaAttention(device, dtype)
    if kernels.attention:
        return CpuKernelAttention(device, dtype, kernels)
    return TorchAttention(device, dtype)
