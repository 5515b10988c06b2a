"""Weight-only quantized projections on CPU (``--quantization``).

Three modes, all with bf16 activations and a bf16 KV cache:

- ``gguf``: a GGUF file's Q8_0, Q4_0 and Q4_1 tensors are kept as they are (their blocks
  regrouped once at load, nothing rounded, where the AVX-512 kernels run; Q8_0 and Q4_1
  in the file's bytes elsewhere), and so are its K-quants (Q4_K, Q5_K, Q6_K) and
  Q5_0/Q5_1 tensors, in the file's own bytes; a fused projection whose parts have different
  types (llama.cpp's quantizer picks one per tensor) stacks their blocks as row ranges.
  Other tensor types (Q2_K, Q3_K, the IQ formats, ...) are dequantized to bf16, with a
  message naming them.
- ``int8``: any checkpoint, weight-only int8 with one scale per output channel; the LM head
  too. Stored as Q8 blocks that all carry their row's scale, so it runs on the Q8_0 kernels.
  (torch's ``_weight_int8pack_mm`` was measured: as fast at batch 1, but its cost grows
  with every row, 3x the dense path at 64.)
- ``int4``: any checkpoint, 4-bit weights in groups of 32 with a scale and a zero point
  each (the Q4_1 layout); the LM head goes to int8 (per channel) as llama.cpp keeps its
  output matrix at 8 bits.

Q4 and Q8_0 matrices run on the Rust kernels (``rust/kernels/src/quant.rs``; the GGUF block
formats ``rust/kernels/src/kquant.rs``): a GEMV that
reads the blocks for up to :data:`GEMV_MAX_ROWS` activation rows, and above that a bf16
dequantization of the matrix followed by a dense GEMM, which wins once there are enough
rows to amortise it.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from iron_batch import _core
from iron_batch.layers import QUANTIZATION_MODES as MODES
from iron_batch.platform.cpu import bf16_gemm_is_native, cpu_info
from iron_batch.platform.openmp import entry_points
from iron_batch.platform.switches import SWITCHES

QBLOCK = 32

#: Activation rows up to which the quantized GEMV runs by default; above it, dequantize +
#: dense GEMM. The GEMV reads Q4 and Q8 weights once per 8 rows and pays each row's
#: arithmetic; the dense path pays one dequantization per call. Measured on SmolLM2's
#: matrices (``benches/quant_cutover.py``), the GEMV still wins at 16 rows.
#: ``IRON_BATCH_QUANT_GEMV_ROWS`` moves it (read at load: see ``platform/switches.py``).
GEMV_MAX_ROWS = int(SWITCHES["quant_gemv_rows"].default)
#: The most rows the GGUF block formats (K-quants, Q5_0, Q5_1) take the GEMV for, whatever
#: the switch says: their kernel reads the weights once per 4 rows with fixed-point
#: activations, and on SmolLM2's matrices the dense path wins from 12 rows
#: (``benches/quant_cutover.py``).
BLOCK_GEMV_MAX_ROWS = 8
#: K-quant matrices (Q4_K, Q5_K, Q6_K, or row ranges of those alone) of at least this many
#: weights take the GEMV up to ``GEMV_MAX_ROWS`` rows, as Q4 and Q8 do: their bf16
#: dequantization no longer fits the caches, and on a Llama-3.2-3B shape's matrices a
#: 16-row Q4_K step took 0.76-0.81x the dense path's time (Q6_K 1.03x; Q5_0, whose kernel
#: pays a float step per block, 1.60x: it stays at ``BLOCK_GEMV_MAX_ROWS``).
KQUANT_WIDE_GEMV_WEIGHTS = 1 << 22
#: Layouts whose GEMV serves up to ``GEMV_MAX_ROWS`` rows (the block formats stop at
#: ``BLOCK_GEMV_MAX_ROWS``).
_WIDE_GEMV_KINDS = ("q4", "q8")
_KQUANT_KINDS = ("q4_k", "q5_k", "q6_k")

_GEMV = getattr(_core, "_gemv_quant", None)
_DEQUANT = getattr(_core, "_dequantize_bf16", None)


class QuantizationError(ValueError):
    """A quantization mode that cannot run here (device, dtype, checkpoint)."""


def check_mode(mode: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, with one line saying why, a mode this device, dtype or build cannot run."""
    if mode is None:
        return
    if mode not in MODES:
        raise QuantizationError(f"unknown quantization {mode!r} (one of {', '.join(MODES)})")
    if device.type != "cpu":
        raise QuantizationError(f"--quantization {mode} runs on CPU only (device {device})")
    if dtype != torch.bfloat16:
        raise QuantizationError(
            f"--quantization {mode} computes with bf16 activations; use --dtype bfloat16 "
            f"(or auto), not {str(dtype).removeprefix('torch.')}"
        )
    if _GEMV is None or _DEQUANT is None:
        raise QuantizationError(f"--quantization {mode}: this build of iron_batch._core has "
                                "no quantized kernels")


@dataclass
class QuantWeight:
    """One ``[n, k]`` projection matrix in a quantized layout.

    ``kind`` "q4": ``quants`` uint8 ``[n, k / 2]`` (nibbles placed as the kernel reads
    them, see :func:`_q4_layout`), ``scale`` and ``min`` float16 ``[n, k / 32]`` (GGUF's
    precision). "q8": ``quants`` int8 ``[n, k]``, ``scale`` float16 ``[n, k / 32]``.
    GGUF blocks as the file has them (:data:`GGUF_RAW_BLOCKS`): ``kind`` the format's name
    in lower case ("q4_k") and ``quants`` uint8 ``[n, row bytes]``, or row ranges of several
    formats, ``kind`` "q5_0*576+q8_0*192" and ``quants`` their bytes back to back (1-D);
    ``scale`` is then empty. ``source`` names the format it came from (for humans).
    """

    kind: str
    n: int
    k: int
    quants: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    source: str

    def __post_init__(self) -> None:
        #: The kernels' raw arguments (quants, scale, min addresses), taken once: a decode
        #: step makes ~120 of these calls.
        self.addresses = (
            self.quants.data_ptr(), self.scale.data_ptr(),
            0 if self.min is None else self.min.data_ptr(),
        )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        parts = [self.quants, self.scale] + ([self.min] if self.min is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def gemv_rows(self, limit: int = GEMV_MAX_ROWS) -> int:
        """The most rows this matrix takes the block GEMV for, given the switch's
        ``limit``: the limit itself for Q4 and Q8 and for large K-quant matrices
        (``KQUANT_WIDE_GEMV_WEIGHTS``), else at most ``BLOCK_GEMV_MAX_ROWS``."""
        if self.kind in _WIDE_GEMV_KINDS:
            return limit
        parts = [part.partition("*")[0] for part in self.kind.split("+")]
        if self.n * self.k >= KQUANT_WIDE_GEMV_WEIGHTS and all(
                part in _KQUANT_KINDS for part in parts):
            return limit
        return min(limit, BLOCK_GEMV_MAX_ROWS)

    def linear(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        gemv_rows: int = GEMV_MAX_ROWS,
        widen: bool | None = None,
    ) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for bf16 ``x`` ``[rows, k]``: bf16 ``[rows, n]``; the block
        GEMV up to :meth:`gemv_rows` of ``gemv_rows`` rows, a dequantization and a dense
        GEMM above (in f32 over the widened dequantization if ``widen``; None: where the
        CPU has no bf16 arithmetic)."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"quantized linear: x {tuple(x.shape)} {x.dtype} does not fit "
                             f"[rows, {self.k}] bf16")
        rows = x.shape[0]
        if rows > self.gemv_rows(gemv_rows) or rows == 0:
            dense = self.dequantize(scratch=True)
            if widen is None:
                widen = not bf16_gemm_is_native()
            return widened_linear(x, dense, bias) if widen else F.linear(x, dense, bias)
        if not x.is_contiguous():
            x = x.contiguous()
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (self.n,)):
            raise ValueError(f"quantized linear: bias must be bf16 [{self.n}]")
        out = torch.empty(rows, self.n, dtype=torch.bfloat16)
        _GEMV(
            out.data_ptr(), x.data_ptr(), self.kind, *self.addresses,
            0 if bias is None else bias.contiguous().data_ptr(),
            rows=rows, n=self.n, k=self.k, threads=torch.get_num_threads(),
            openmp=entry_points(),
        )
        return out

    def dequantize(self, scratch: bool = False) -> torch.Tensor:
        """The whole matrix as bf16 ``[n, k]``. ``scratch``: into this thread's reusable
        buffer, valid until its next use (a fresh tensor of an LM head's size costs more in
        page faults than the dequantization itself)."""
        out = _scratch(self.n * self.k).view(self.n, self.k) if scratch else torch.empty(
            self.n, self.k, dtype=torch.bfloat16
        )
        _DEQUANT(
            out.data_ptr(), self.kind, *self.addresses, n=self.n, k=self.k,
            threads=torch.get_num_threads(), openmp=entry_points(),
        )
        return out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows ``ids`` dequantized ``[len(ids), k]`` (an embedding lookup); float32 gives
        the exact values the kernels multiply by."""
        return _dequantize_rows(self, ids).to(dtype)


_local = threading.local()


def widened_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` of bf16 ``x`` and ``weight`` multiplied in f32 over this thread's
    widened copy of the weight, rounded to bf16: on a CPU without bf16 arithmetic (see
    ``platform.cpu.bf16_gemm_is_native``) several times faster than torch's bf16 GEMM for
    prompt-sized steps, and more exact."""
    n, k = weight.shape
    wide = _scratch(n * k, torch.float32).view(n, k)
    wide.copy_(weight)
    return wide_linear(x, wide, bias)


def wide_linear(x: torch.Tensor, wide: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of bf16 ``x`` and the f32 ``wide`` (a bf16 weight's exact widening) in
    f32, rounded to bf16."""
    return F.linear(x.float(), wide, None if bias is None else bias.float()).to(torch.bfloat16)


def _scratch(elements: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """This thread's buffer of ``dtype`` of at least ``elements`` (grown, never shrunk)."""
    name = f"buffer_{dtype}"
    buf: torch.Tensor | None = getattr(_local, name, None)
    if buf is None or buf.numel() < elements:
        # A normal tensor even when made under inference mode, so that torch ops may
        # write into it outside it too.
        with torch.inference_mode(False):
            buf = torch.empty(elements, dtype=dtype)
        setattr(_local, name, buf)
    return buf[:elements]


@functools.cache
def _avx512_quant_kernels() -> bool:
    """Whether the q4/q8 layouts' AVX-512 kernels run here (AVX-512 F/BW/VL and BF16)."""
    info = cpu_info()
    if info is None:
        return True
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= info[1]


def _dequantize_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Float32 rows of ``w`` by torch ops (a handful of rows: no kernel needed)."""
    if w.kind not in ("q4", "q8"):
        return _raw_rows(w, ids)
    quants = w.quants[ids]
    scale = w.scale[ids].float().repeat_interleave(QBLOCK, dim=1)
    if w.kind == "q8":
        return quants.float() * scale
    assert w.min is not None
    at, shift = _q4_layout(w.k)
    q = (quants[:, at] >> shift) & 15
    return q.float() * scale + w.min[ids].float().repeat_interleave(QBLOCK, dim=1)


def concat(parts: list[QuantWeight]) -> QuantWeight | None:
    """The row-wise concatenation (fused q/k/v or gate/up): one layout when the parts share
    it, GGUF blocks stacked as row ranges when they are GGUF types that differ; None when
    neither fits (the caller then falls back to dense)."""
    first = parts[0]
    if any(p.k != first.k for p in parts):
        return None
    if any(p.kind != first.kind for p in parts) or first.kind not in ("q4", "q8"):
        return _stack_raw(parts)
    mins = [p.min for p in parts]
    return QuantWeight(
        kind=first.kind,
        n=sum(p.n for p in parts),
        k=first.k,
        quants=torch.cat([p.quants for p in parts]),
        scale=torch.cat([p.scale for p in parts]),
        min=None if first.min is None else torch.cat([m for m in mins if m is not None]),
        source="+".join(sorted({p.source for p in parts})),
    )


# ------------------------------------------------------------------ building the layouts


@functools.cache
def _q4_layout(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each weight of a ``k``-wide Q4 row: its byte in the row, and the shift (0 or 4)
    of its nibble. The layout is the Rust kernels' (``q4_nibble``), asked, not restated."""
    at, high = _core._q4_layout(k)
    return torch.from_numpy(at), torch.from_numpy(high.astype(np.uint8) * 4)


def _pack_q4(q: np.ndarray) -> np.ndarray:
    """Values ``q`` uint8 ``[n, k]`` in 0..15 to the kernel's bytes ``[n, k / 2]``."""
    n, k = q.shape
    at, shift = (t.numpy() for t in _q4_layout(k))
    packed = np.zeros((n, k // 2), dtype=np.uint8)
    low, high = shift == 0, shift == 4
    packed[:, at[low]] = q[:, low]
    packed[:, at[high]] |= q[:, high] << 4
    return packed


def q4_from_values(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray,
                   source: str) -> QuantWeight:
    """A Q4 matrix from values ``q`` ``[n, k]`` in 0..15 and per-block float16 ``scale`` and
    ``minimum`` ``[n, k / 32]`` (weight = scale * q + min)."""
    n, k = q.shape
    if k % (2 * QBLOCK):
        raise QuantizationError(f"4-bit layout needs rows of a multiple of 64, not {k}")
    packed = _pack_q4(q.astype(np.uint8))
    return QuantWeight(
        kind="q4", n=n, k=k, quants=torch.from_numpy(packed),
        scale=torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float16)),
        min=torch.from_numpy(np.ascontiguousarray(minimum, dtype=np.float16)), source=source,
    )


#: GGUF block formats regrouped into the q4/q8 layouts: name -> bytes per block of 32.
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}

#: GGUF block formats kept in the file's own bytes: name -> (weights, bytes) per block.
GGUF_RAW_BLOCKS = {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
                   "Q5_0": (32, 22), "Q5_1": (32, 24)}

#: Formats a stacked matrix may hold (the regrouped ones go back to their GGUF bytes there).
_STACKABLE = {**GGUF_RAW_BLOCKS, "Q4_1": (32, 20), "Q8_0": (32, 34)}

#: Most row ranges one stacked matrix holds (the kernels' ``MAX_SEGMENTS``).
MAX_SEGMENTS = 3


def gguf_block(type_name: str) -> tuple[int, int] | None:
    """(weights, bytes) per block of a GGUF type kept quantized, or None."""
    if type_name in GGUF_BLOCK_BYTES:
        return (QBLOCK, GGUF_BLOCK_BYTES[type_name])
    return GGUF_RAW_BLOCKS.get(type_name)


def _segments(w: QuantWeight) -> list[tuple[str, int]]:
    """(GGUF type name, rows) of each row range of a raw-block matrix."""
    out = []
    for part in w.kind.split("+"):
        name, _, rows = part.partition("*")
        out.append((name.upper(), int(rows) if rows else w.n))
    return out


def _raw_bytes(w: QuantWeight) -> tuple[list[tuple[str, int]], np.ndarray]:
    """``w`` as GGUF blocks: its row ranges and their bytes (1-D). q4/q8 matrices go back
    to Q4_1/Q8_0 bytes, losslessly (a Q4_0 block is a Q4_1 one with ``m = -8 d``)."""
    if w.kind == "q8":
        scale = w.scale.numpy().view(np.uint8).reshape(w.n, -1, 2)
        q = w.quants.numpy().view(np.uint8).reshape(w.n, -1, QBLOCK)
        return [("Q8_0", w.n)], np.concatenate([scale, q], axis=-1).ravel()
    if w.kind == "q4":
        assert w.min is not None
        at, shift = _q4_layout(w.k)
        q = ((w.quants[:, at] >> shift) & 15).numpy().reshape(w.n, -1, QBLOCK)
        nibbles = q[..., :16] | (q[..., 16:] << 4)
        scale = w.scale.numpy().view(np.uint8).reshape(w.n, -1, 2)
        low = w.min.numpy().view(np.uint8).reshape(w.n, -1, 2)
        return [("Q4_1", w.n)], np.concatenate([scale, low, nibbles], axis=-1).ravel()
    return _segments(w), w.quants.numpy().ravel()


def _raw_weight(segments: list[tuple[str, int]], data: np.ndarray, k: int,
                source: str) -> QuantWeight:
    n = sum(rows for _, rows in segments)
    if len(segments) == 1:
        kind, quants = segments[0][0].lower(), torch.from_numpy(data.reshape(n, -1))
    else:
        kind = "+".join(f"{name.lower()}*{rows}" for name, rows in segments)
        quants = torch.from_numpy(data)
    return QuantWeight(kind=kind, n=n, k=k, quants=quants,
                       scale=torch.empty(0, dtype=torch.float16), min=None, source=source)


def _stack_raw(parts: list[QuantWeight]) -> QuantWeight | None:
    """GGUF-block parts stacked as row ranges (neighbours of one format merged)."""
    segments: list[tuple[str, int]] = []
    chunks = []
    for p in parts:
        if p.source not in _STACKABLE and p.source not in GGUF_BLOCK_BYTES:
            return None
        part_segments, data = _raw_bytes(p)
        for name, rows in part_segments:
            if name not in _STACKABLE:
                return None
            if segments and segments[-1][0] == name:
                segments[-1] = (name, segments[-1][1] + rows)
            else:
                segments.append((name, rows))
        chunks.append(data)
    if len(segments) > MAX_SEGMENTS:
        return None
    return _raw_weight(segments, np.concatenate(chunks), parts[0].k,
                       "+".join(sorted({p.source for p in parts})))


def _raw_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Float32 rows ``ids`` of a raw-block matrix, by ``gguf.quants`` (the values the
    kernels compute)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    segments, data = _raw_bytes(w)
    out = torch.empty(len(ids), w.k, dtype=torch.float32)
    at, first = 0, 0
    wanted = ids.reshape(-1).numpy()
    for name, rows in segments:
        weights, per_block = _STACKABLE[name]
        row_bytes = w.k // weights * per_block
        block = data[at:at + rows * row_bytes].reshape(rows, row_bytes)
        here = np.nonzero((wanted >= first) & (wanted < first + rows))[0]
        if len(here):
            values = dequantize(block[wanted[here] - first], GGMLQuantizationType[name])
            out[torch.from_numpy(here)] = torch.from_numpy(
                np.asarray(values, dtype=np.float32).reshape(len(here), w.k))
        at += rows * row_bytes
        first += rows
    return out


def from_gguf_blocks(type_name: str, raw: np.ndarray, n: int, k: int) -> QuantWeight | None:
    """A GGUF tensor's raw bytes ``[n, row bytes]`` (rows in HF order) as a QuantWeight, or
    None for a type not kept quantized (see :data:`GGUF_BLOCK_BYTES` and
    :data:`GGUF_RAW_BLOCKS`)."""
    if type_name in GGUF_RAW_BLOCKS:
        weights, per_block = GGUF_RAW_BLOCKS[type_name]
        if k % weights or raw.size != n * (k // weights) * per_block:
            return None
        data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1).copy()
        return _raw_weight([(type_name, n)], data, k, type_name)
    if type_name in ("Q8_0", "Q4_1") and not _avx512_quant_kernels() and k % QBLOCK == 0:
        # Without AVX-512 the regrouped layouts' kernels are portable loops; the block
        # kernels of the file's own bytes have an AVX2 path.
        data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1).copy()
        return _raw_weight([(type_name, n)], data, k, type_name)
    per_block = GGUF_BLOCK_BYTES.get(type_name)
    if per_block is None or k % QBLOCK:
        return None
    if type_name != "Q8_0" and k % (2 * QBLOCK):
        return None
    blocks = np.ascontiguousarray(raw).reshape(n, k // QBLOCK, per_block)
    scale = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    if type_name == "Q8_0":
        quants = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return QuantWeight(kind="q8", n=n, k=k, quants=torch.from_numpy(quants.copy()),
                           scale=torch.from_numpy(scale.copy()), min=None, source=type_name)
    if type_name == "Q4_1":
        minimum = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
        nibbles = blocks[..., 4:]
    else:  # Q4_0: weight = d * (q - 8); -8 d is exact in f16
        minimum = (-8 * scale.astype(np.float32)).astype(np.float16)
        nibbles = blocks[..., 2:]
    # GGUF's 16 bytes hold values 0..15 in low nibbles and 16..31 in high nibbles.
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(n, k)
    return q4_from_values(q, scale, minimum, type_name)


def quantize_int4(weight: torch.Tensor) -> QuantWeight:
    """``weight`` [n, k] to 4 bits per group of 32 (GGUF's Q4_1): scale = (max - min) / 15
    and the zero point at min, both float16, then each value rounded to the nearest level
    of the rounded scale and min."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // QBLOCK, QBLOCK)
    lo = w.amin(-1).half()
    scale = ((w.amax(-1) - lo.float()) / 15).half()
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale.float()))
    q = torch.clamp(torch.round((w - lo.float()[..., None]) / safe[..., None]), 0, 15)
    return q4_from_values(q.to(torch.uint8).reshape(n, k).numpy(), scale.numpy(),
                          lo.numpy(), "int4")


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """``weight`` [n, k] to int8 with one symmetric scale per output row (absmax / 127, as
    float16), in the Q8 layout: each block of the row carries the row's scale, so int8 runs
    on the same kernels as GGUF's Q8_0."""
    w = weight.detach().float()
    n, k = w.shape
    scale = w.abs().amax(1) / 127
    # Round the scale first and quantize against the rounded one.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).half()
    q = torch.clamp(torch.round(w / scale.float()[:, None]), -127, 127).to(torch.int8)
    blocks = scale[:, None].expand(n, k // QBLOCK).contiguous()
    return QuantWeight(kind="q8", n=n, k=k, quants=q.contiguous(), scale=blocks, min=None,
                       source="int8")
