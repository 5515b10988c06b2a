"""Token embeddings and the LM head, whole or split by vocabulary rows over the ranks of a
tensor-parallel model (vocab-parallel: ids outside a rank's rows embed as zeros before the
sum over ranks; the head's logit shards are joined on rank 0), tied or not."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from iron_batch.layers.linear import Linear, Weight
from iron_batch.layers.quant import QuantWeight


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
    shards and drops the padding rows."""

    def __init__(
        self, linear: Linear, vocab_size: int, parallel: VocabParallel | None = None
    ) -> None:
        self.linear = linear
        self.vocab_size = vocab_size
        self.parallel = parallel

    def __call__(self, last: torch.Tensor) -> torch.Tensor:
        # Up to 8 rows take the Rust GEMV (Linear's choice), which streams the head one
        # row at a time and beat oneDNN's packed layout on it (Qwen2.5-0.5B's 272 MB head:
        # 3.8-4.0 against 4.0-4.1 ms; SmolLM2's: 0.74-0.86 against 1.0-1.4 ms).
        logits = self.linear(last).float()
        if self.parallel is not None:
            return self.parallel.gather(logits)[:, : self.vocab_size]
        return logits
