"""Token embeddings and the LM head, whole or split by vocabulary rows over the ranks of a
tensor-parallel model (vocab-parallel: ids outside a rank's rows embed as zeros before the
sum over ranks; the head's logit shards are joined on rank 0), tied or not."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from iron_batch.layers import cpu_kernels, quant
from iron_batch.layers.linear import Linear, Weight
from iron_batch.layers.quant import QuantWeight
from iron_batch.platform.heap import HEAP_BLOCK

#: Vocabulary rows of each part of a large LM head (see :meth:`LMHead.prepack`).
SLAB_ROWS = 16384
#: Heads of at least this many vocabulary rows are packed in parts.
SLABBED_VOCAB = 65536
#: Steps of up to this many rows write their logits into the head's buffer (a prompt
#: scored at every position gets a fresh block instead of a buffer kept at its size).
BUFFER_MAX_ROWS = 256


class VocabParallel:
    """This rank's vocabulary rows and the collectives that join the ranks' parts."""

    def __init__(
        self,
        start: int,
        rows: int,
        all_reduce: Callable[[torch.Tensor], None],
        gather: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.start = start
        self.rows = rows
        self.all_reduce = all_reduce
        self.gather = gather


class Embedding:
    """Rows of a dense table or of quantized blocks (a tied GGUF head keeps its blocks and
    embeds from them)."""

    def __init__(self, table: Weight, parallel: VocabParallel | None = None) -> None:
        self.table = table
        self.parallel = parallel

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.table, QuantWeight):
            return self.table.rows(ids)
        return F.embedding(ids, self.table)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.parallel
        if p is None:
            return self._rows(ids)
        local = ids - p.start
        outside = (local < 0) | (local >= p.rows)
        h = self._rows(local.masked_fill(outside, 0))
        h.masked_fill_(outside.unsqueeze(-1), 0)
        p.all_reduce(h)
        return h


class LMHead:
    """Float32 logits of the final-normed rows; with vocab parallelism rank 0 joins the
    shards and drops the padding rows.

    A large dense head on the CPU (:data:`SLABBED_VOCAB` rows or more) is packed for
    oneDNN in parts of :data:`SLAB_ROWS` vocabulary rows (or copied in f32 by parts, where
    steps of many rows multiply in f32), and a step of more rows than the
    GEMV takes writes each part's bf16 logits into one float32 buffer the head keeps for
    the next step. A step's logits over a large vocabulary are blocks that glibc maps
    fresh from the kernel at every step on the engine thread (see ``platform/heap.py``:
    64 rows of Gemma 3's 262k are 33.5 MB in bf16 and 67 MB in float32); the parts' are
    2 MiB each, and the buffer is faulted in once. The buffer is only reused for logits of
    at least ``HEAP_BLOCK`` bytes of up to :data:`BUFFER_MAX_ROWS` rows; its values are read
    before the next step (the backend samples and scores a step's logits before it runs
    another)."""

    def __init__(
        self, linear: Linear, vocab_size: int, parallel: VocabParallel | None = None
    ) -> None:
        self.linear = linear
        self.vocab_size = vocab_size
        self.parallel = parallel
        #: (first vocabulary row, oneDNN-packed part) of a head packed in parts; a float32
        #: copy of the part where steps of many rows multiply in f32.
        self.slabs: list[tuple[int, torch.Tensor]] = []
        self._out: torch.Tensor | None = None

    def prepack(self, f32_copy: bool = True) -> None:
        """:meth:`Linear.prepack` for the head, in parts where it is large (f32 copies or
        oneDNN's packed layout, as :meth:`Linear.prepack` chooses)."""
        w = self.linear.weight
        if not isinstance(w, torch.Tensor) or w.shape[0] < SLABBED_VOCAB:
            self.linear.prepack(f32_copy)
            return
        wide = self.linear.widen and self.linear.gemv and f32_copy
        slabs = []
        for lo in range(0, w.shape[0], SLAB_ROWS):
            part = w[lo:lo + SLAB_ROWS]
            packed = part.float() if wide else cpu_kernels.prepack(part)
            if packed is None:
                return
            slabs.append((lo, packed))
        self.slabs = slabs

    def __call__(self, last: torch.Tensor) -> torch.Tensor:
        # Up to 8 rows take the Rust GEMV (Linear's choice), which streams the head one
        # row at a time and beat oneDNN's packed layout on it (Qwen2.5-0.5B's 272 MB head:
        # 3.8-4.0 against 4.0-4.1 ms; SmolLM2's: 0.74-0.86 against 1.0-1.4 ms).
        lin = self.linear
        if self.slabs and not (lin.gemv and last.shape[0] <= lin.dense_gemv_rows):
            logits = self._in_parts(last)
        else:
            logits = lin(last).float()
        if self.parallel is not None:
            return self.parallel.gather(logits)[:, : self.vocab_size]
        return logits

    def _in_parts(self, last: torch.Tensor) -> torch.Tensor:
        rows, n = last.shape[0], self.linear.shape[0]
        if rows * n * 4 < HEAP_BLOCK or rows > BUFFER_MAX_ROWS:
            out = torch.empty(rows, n, dtype=torch.float32)
        else:
            if self._out is None or self._out.shape[0] < rows:
                self._out = torch.empty(rows, n, dtype=torch.float32)
            out = self._out[:rows]
        bias = self.linear.bias
        for lo, packed in self.slabs:
            hi = min(lo + SLAB_ROWS, n)
            b = None if bias is None else bias[lo:hi]
            if packed.dtype == torch.float32:
                part = quant.wide_linear(last, packed, b)
            else:
                part = cpu_kernels.packed_linear(last, packed, b)
            out[:, lo:hi].copy_(part)
        return out
