"""Decode steps on CPU with every decoder layer in one Rust call (``decode_layers`` in
``rust/kernels/src/decoder.rs``).

At batch 1 the Python path costs a millisecond or more per token in interpreter round
trips and tensor allocations around a dozen kernels per layer; a quantized SmolLM2 step is
about 6 ms. The stack runs the same kernels back to back, so it gives the Python path's
values (SiLU aside: its own ``exp``, equal but for the rare value on a bf16 rounding
boundary). It serves steps where every row decodes and there are few enough rows for the
GEMV kernels (2 for bf16 weights, ``IRON_BATCH_QUANT_GEMV_ROWS`` for quantized ones); other
steps take the Python path. bf16 only; off with ``IRON_BATCH_CPU_DECODER=0`` (and with
``IRON_BATCH_CPU_ATTENTION=torch``; see ``platform/switches.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from iron_batch import _core
from iron_batch.layers.cpu_kernels import BF16_GEMV_MAX_ROWS
from iron_batch.layers.linear import Linear
from iron_batch.layers.norm import HeadNorm, RMSNorm
from iron_batch.layers.quant import GEMV_MAX_ROWS, QuantWeight
from iron_batch.platform.openmp import entry_points

_STACK = getattr(_core, "_DecoderStack", None)


class _MLP(Protocol):
    gate_up: Linear
    down: Linear
    activation_name: str


class StackLayer(Protocol):
    """What the stack reads of a decoder layer (``models/decoder.py``'s ``DecoderLayer``):
    a pre-norm layer with fused q/k/v, optional per-head q/k norms, a SwiGLU MLP."""

    input_norm: RMSNorm
    qkv: Linear
    q_norm: HeadNorm | None
    k_norm: HeadNorm | None
    o: Linear
    post_norm: RMSNorm
    sliding_window: int | None

    @property
    def mlp(self) -> _MLP: ...


class DecoderStack:
    """A model's decoder layers for one-call decode steps. Holds the tensors whose
    addresses the Rust stack keeps, so they live as long as it does."""

    def __init__(
        self,
        layers: Sequence[StackLayer],
        *,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        quant_gemv_rows: int = GEMV_MAX_ROWS,
    ) -> None:
        self._keep: list[torch.Tensor] = []
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.hidden = hidden
        self.eps = float(eps)
        #: Most rows a step may have: the tightest GEMV over the projections.
        self.max_rows = quant_gemv_rows
        specs = []
        for layer in layers:
            projections = []
            for linear in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down):
                if not isinstance(linear.weight, QuantWeight):
                    self.max_rows = min(self.max_rows, BF16_GEMV_MAX_ROWS)
                projections.append(self._projection(linear.weight, linear.bias))
            q_norm = layer.q_norm.weight if layer.q_norm is not None else None
            k_norm = layer.k_norm.weight if layer.k_norm is not None else None
            specs.append((
                self._address(layer.input_norm.weight, (hidden,)),
                self._address(layer.post_norm.weight, (hidden,)),
                self._address(q_norm, (head_dim,)),
                self._address(k_norm, (head_dim,)),
                projections,
                layer.mlp.activation_name,
                layer.sliding_window or 0,
            ))
        assert _STACK is not None
        self._stack = _STACK(specs, hidden=hidden, heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim)

    def _address(self, t: torch.Tensor | None, shape: tuple[int, ...]) -> int:
        """The address of a checked bf16 CPU tensor of ``shape`` (0 for None)."""
        if t is None:
            return 0
        if (t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous()
                or tuple(t.shape) != shape):
            raise ValueError(f"decoder stack: need a contiguous bf16 CPU tensor {shape}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
        self._keep.append(t)
        return t.data_ptr()

    def _projection(
        self, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None
    ) -> tuple[str, int, int, int, int, int, int]:
        n, k = weight.shape
        bias_at = self._address(bias, (n,))
        if isinstance(weight, QuantWeight):
            self._keep.extend(t for t in (weight.quants, weight.scale, weight.min) if t is not None)
            return (weight.kind, *weight.addresses, bias_at, n, k)
        return ("bf16", self._address(weight, (n, k)), 0, 0, bias_at, n, k)

    def set_caches(self, caches: list[torch.Tensor], block_size: int) -> None:
        """The layers' caches, each ``[2, blocks, block_size, kv_heads, head_dim]``."""
        shape = (2, caches[0].shape[1], block_size, self.kv_heads, self.head_dim)
        for c in caches:
            if c.dtype != torch.bfloat16 or not c.is_contiguous() or tuple(c.shape) != shape:
                raise ValueError("decoder stack: every cache must be contiguous bf16 " + str(shape))
        self._caches = caches
        self._stack.set_caches([(c[0].data_ptr(), c[1].data_ptr()) for c in caches],
                               shape[1], block_size)

    def decode(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        *,
        scale: float,
    ) -> None:
        """Every layer over the residual rows ``h`` [rows, hidden] (in place): each row one
        decoding sequence, its new token's K/V stored at ``slots``; ``block_tables`` and
        ``seq_lens`` (which count the new token) as the attention kernel takes them."""
        rows = h.shape[0]
        if (h.dtype != torch.bfloat16 or not h.is_contiguous()
                or tuple(h.shape) != (rows, self.hidden) or not 0 < rows <= self.max_rows):
            raise ValueError(f"decoder stack: h must be contiguous bf16 [1..{self.max_rows}, "
                             f"{self.hidden}], got {tuple(h.shape)} {h.dtype}")
        cos = cos.reshape(rows, self.head_dim).contiguous()
        sin = sin.reshape(rows, self.head_dim).contiguous()
        if cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16:
            raise ValueError("decoder stack: rotary tables must be bf16")
        self._stack.decode(
            h.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            np.ascontiguousarray(slots, dtype=np.int64),
            np.ascontiguousarray(block_tables, dtype=np.int32),
            np.ascontiguousarray(seq_lens, dtype=np.int32),
            scale=float(scale), eps=self.eps,
            threads=torch.get_num_threads(), openmp=entry_points(),
        )
