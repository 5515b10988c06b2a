"""MXFP4 weights (gpt-oss's experts) kept in the checkpoint's bytes: per row of ``k``
weights, ``k / 2`` bytes of FP4 E2M1 codes (byte ``b``: weight ``2b`` in the low nibble,
``2b + 1`` in the high one) and ``k / 32`` E8M0 exponents, ``w = fp4 * 2^(e - 127)``
(``rust/kernels/src/mxfp4.rs``).

A :class:`~iron_batch.layers.quant.QuantWeight` of kind ``"mxfp4"`` (``quants`` the codes
``[n, k / 2]``, ``scale`` the exponents ``[n, k / 32]``). With bf16 activations it runs
like the other quantized layouts: the Rust GEMV for a decode step's rows (and the MoE
kernel over the selected experts), a dequantization into a reused bf16 buffer and a dense
GEMM above; with float32 ones, an exact float32 dequantization into a reused buffer.

llama.cpp's GGUF files store the same numbers in its own blocks (``block_mxfp4`` in
``ggml-common.h``, 17 bytes per 32 weights: the E8M0 exponent, then 16 bytes whose byte
``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its high one):
:func:`from_gguf` reorders those nibbles into the layout above, once at load.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from iron_batch import _core
from iron_batch.layers import quant
from iron_batch.layers.linear import Linear
from iron_batch.layers.quant import QuantWeight
from iron_batch.platform.openmp import entry_points

BLOCK = 32
#: Bytes of one GGUF MXFP4 block: its exponent, then the 32 weights' codes.
GGUF_BLOCK_BYTES = 1 + BLOCK // 2
_DEQUANT_F32 = getattr(_core, "_dequantize_mxfp4_f32", None)


def weight(codes: torch.Tensor, exponents: torch.Tensor) -> QuantWeight:
    """The MXFP4 matrix of ``codes`` uint8 ``[n, k / 32, 16]`` (or ``[n, k / 2]``) and
    ``exponents`` uint8 ``[n, k / 32]``, as a checkpoint's ``*_blocks``/``*_scales``
    hold one matrix of them. Nothing is copied beyond making them contiguous."""
    n, groups = exponents.shape
    if codes.dtype != torch.uint8 or exponents.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks and scales are uint8, not {codes.dtype} / "
                         f"{exponents.dtype}")
    if codes.numel() != n * groups * BLOCK // 2:
        raise ValueError(f"mxfp4 blocks {tuple(codes.shape)} do not fit scales "
                         f"{tuple(exponents.shape)}")
    return QuantWeight(kind="mxfp4", n=n, k=groups * BLOCK,
                       quants=codes.reshape(n, groups * BLOCK // 2).contiguous(),
                       scale=exponents.contiguous(), min=None, source="mxfp4")


def from_gguf(blocks: np.ndarray) -> QuantWeight:
    """The MXFP4 matrix of a GGUF tensor's bytes, uint8 ``[n, k / 32 * 17]`` (rows of
    llama.cpp's ``block_mxfp4``): the exponents as they are and each block's sixteen code
    bytes rearranged into this layout's nibble order. A permutation of 4-bit codes:
    nothing is rounded, the weights are the file's."""
    n, row = blocks.shape
    if blocks.dtype != np.uint8 or row % GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF mxfp4 rows are {GGUF_BLOCK_BYTES}-byte blocks, not "
                         f"{row} bytes of {blocks.dtype}")
    b = np.asarray(blocks).reshape(n, row // GGUF_BLOCK_BYTES, GGUF_BLOCK_BYTES)
    packed = b[..., 1:]
    # The block's 32 codes in weight order: the low nibbles are weights 0-15, the high
    # ones 16-31; then two neighbours a byte, the even one low.
    codes = np.concatenate([packed & 15, packed >> 4], axis=-1)
    ours = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return weight(torch.from_numpy(np.ascontiguousarray(ours).reshape(n, -1)),
                  torch.from_numpy(np.ascontiguousarray(b[..., 0])))


def dequantize_f32(w: QuantWeight, scratch: bool = False) -> torch.Tensor:
    """The exact float32 weights ``[n, k]`` (``scratch``: into this thread's reusable
    buffer, valid until its next use)."""
    if _DEQUANT_F32 is None:
        raise RuntimeError("this build of iron_batch._core has no MXFP4 kernels")
    out = (quant._scratch(w.n * w.k, torch.float32).view(w.n, w.k) if scratch
           else torch.empty(w.n, w.k, dtype=torch.float32))
    _DEQUANT_F32(out.data_ptr(), w.quants.data_ptr(), w.scale.data_ptr(), n=w.n, k=w.k,
                 threads=torch.get_num_threads(), openmp=entry_points())
    return out


class Mxfp4Linear(Linear):
    """A projection over an MXFP4 weight, for activations of any float dtype."""

    weight: QuantWeight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            return super().__call__(x)
        dense = dequantize_f32(self.weight, scratch=True)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, dense if x.dtype == torch.float32 else dense.to(x.dtype), bias)
