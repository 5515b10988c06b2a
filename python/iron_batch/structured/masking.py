"""The per-step token bitmask: llguidance matchers, one per constrained request.

A matcher is per-request sampling state, like penalty counts or a seeded generator: it
lives in the backend that samples (the worker, for the remote backend), beside the request's
:class:`~iron_batch.sampling.RequestState`, and advances exactly once per token sampled for
the request. The scheduler never discards a sampled token of a live request (a preempted
sequence keeps its tokens and is re-prefilled, then sampled again only at its end), so the
matcher's state is the request's output so far after any preemption.

Cost: only constrained rows get a mask. Masks are computed into one int32 bitmask for
those rows (in parallel by llguidance when there are several), then applied to their
logits with one vectorized ``masked_fill``; rows without a grammar never touch any of this.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from iron_batch.tokenizer import Tokenizer

_BITS = torch.arange(32, dtype=torch.int32)


def llguidance_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llguidance") is not None


class GrammarMasker:
    """Builds matchers for one model's tokenizer and masks logits rows with them."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids) or list(tokenizer.eos_token_ids)
        self._lltok: Any = None
        self._executor: Any = None
        self._words = (vocab_size + 31) // 32

    def _ll_tokenizer(self) -> Any:
        if self._lltok is None:
            # Built on first use (about 0.2 s for a 50k vocabulary), then shared.
            import llguidance

            self._lltok = llguidance.LLTokenizer(
                self._tokenizer.to_info()["json"],
                n_vocab=self.vocab_size,
                eos_token=self._eos or None,
            )
        return self._lltok

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher for ``grammar``; ValueError when llguidance rejects it."""
        import llguidance

        m = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid grammar: {m.get_error()}")
        return m

    def bitmask(self, matchers: list[Any]) -> np.ndarray:
        """[len(matchers), words] int32: bit t of row i set when token t is allowed."""
        out = np.zeros((len(matchers), self._words), dtype=np.int32)
        if len(matchers) == 1:
            m = matchers[0]
            m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        else:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], out.ctypes.data,
                self._words * 4, len(matchers),
            )
        for i, m in enumerate(matchers):
            if m.is_error() or not out[i].any():
                # A matcher that failed (should not happen: every token it consumes came
                # from its own mask) ends the output instead of sampling garbage.
                out[i] = 0
                for t in self._eos:
                    out[i, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
        return out

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Set the disallowed logits of ``rows`` to -inf, in place."""
        mask = torch.from_numpy(self.bitmask(matchers)).to(logits.device)
        allowed = ((mask.unsqueeze(-1) >> _BITS.to(logits.device)) & 1).bool()
        allowed = allowed.reshape(len(rows), -1)[:, : logits.shape[1]]
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))

    @staticmethod
    def advance(matcher: Any, token: int) -> None:
        """Feed the sampled token to its request's matcher (no-op once it has stopped)."""
        if not matcher.is_stopped():
            matcher.consume_token(token)
