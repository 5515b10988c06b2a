"""Gated activations of an MLP's fused gate/up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[rows, 2 * inter]`` (the gate first): SwiGLU."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, tanh approximation) * up`` (GeGLU: Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


#: Activation name in a checkpoint's config -> the gated function.
GATED_ACTIVATIONS = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
}
