"""A draft model for speculative decoding (``--speculative-method draft``): a second,
smaller checkpoint with the target's tokenizer, run by the same backend, that fills the
proposal rows the scheduler reserved.

The scheduler (Rust core, ``DraftModelProposer``) puts ``k`` placeholder rows after a
decoding sequence's last token (``batch.num_proposed``). Before the verification forward,
:meth:`DraftRunner.fill` runs the draft over the batch's other rows (prompt chunks and
decode rows alike, so the draft's KV covers every position the target computes) and takes
its greedy pick after each speculating sequence's last token as the first proposal; then
``k - 1`` one-row steps, each on the previous proposal, give the rest. The draft's KV lives
in its own cache tensor, indexed by the target's block tables and slots: the scheduler
needs nothing new for memory, and the draft KV of a rejected proposal is overwritten later,
as the target's is.

One position is left to fill: when every proposal is accepted, the draft never ran on the
last one (its pick was the end of the run). The backend notes it (:meth:`note_accepted`)
and the next step's first draft forward takes that token as one more row in front of the
sequence's decode row.

Exactness: a greedy draft proposes with a point mass, so the verification of
:mod:`iron_batch.speculative` (greedy: argmax equality; seeded sampling: the sampler's own
draw must equal the proposal) keeps the target's distribution exactly, and greedy output
is the same with the draft as without it. The draft decides only how many tokens a step
yields: a draft that is wrong (or whose KV is stale) costs speed, never a token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from iron_batch.sampling import argmax_rows

if TYPE_CHECKING:
    from iron_batch.models.decoder import DecoderModel
    from iron_batch.tokenizer import Tokenizer


class DraftModelError(ValueError):
    """A draft model that cannot serve the target (another vocabulary, cache layout)."""


def check_draft(
    target: DecoderModel, target_tok: Tokenizer | None,
    draft: DecoderModel, draft_tok: Tokenizer | None,
) -> None:
    """Refuse, in one line, a draft whose vocabulary differs from the target's, or that
    the shared block tables cannot serve."""
    if target_tok is not None and draft_tok is not None:
        if target_tok.vocab() != draft_tok.vocab():
            raise DraftModelError(
                f"the draft model's vocabulary ({draft_tok.vocab_size} tokens) differs from "
                f"the target's ({target_tok.vocab_size} tokens): a draft needs the same "
                "tokenizer")
    elif draft.config.vocab_size != target.config.vocab_size:
        raise DraftModelError(
            f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from "
            f"the target's ({target.config.vocab_size} tokens): a draft needs the same "
            "tokenizer")
    for name, net in (("target", target), ("draft", draft)):
        if net.cache_groups != [("full", None)]:
            raise DraftModelError(
                f"the {name} model has sliding-window or recurrent-state layers: a draft "
                "model shares the target's block tables, which needs full attention in both")


class DraftRunner:
    """Runs the draft model beside the target over each batch (see the module doc)."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        # Per request: (position, token) of an accepted proposal the draft never ran on.
        self._unfilled: dict[str, tuple[int, int]] = {}

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.model.allocate_kv_cache(num_blocks, block_size)

    def remove_request(self, request_id: str) -> None:
        self._unfilled.pop(request_id, None)

    def note_accepted(self, request_id: str, position: int, token: int) -> None:
        """Every proposal of ``request_id`` was accepted, the last ``token`` at
        ``position``: the draft's KV lacks it until the next step."""
        self._unfilled[request_id] = (position, token)

    def fill(
        self, batch: Any, input_ids: np.ndarray | torch.Tensor, vocab_size: int
    ) -> np.ndarray:
        """The batch's input ids with its proposal rows filled by the draft (int64 on the
        host; a pick past the target's ``vocab_size``, from a draft with a larger head,
        becomes a token the target may reject). Runs the draft over the batch's other
        rows even when nothing is proposed, so that its KV stays complete."""
        ids = (input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor)
               else np.asarray(input_ids)).astype(np.int64, copy=True)
        starts = np.asarray(batch.query_start_loc, dtype=np.int64)
        num_seqs = len(starts) - 1
        if num_seqs == 0:
            return ids
        proposed = np.zeros(num_seqs, dtype=np.int64)
        rid_of_seq: dict[int, str] = {}
        sample_seq = np.asarray(batch.sample_seq_indices, dtype=np.int64)
        num_prop = getattr(batch, "num_proposed", None)
        for r, (s, rid) in enumerate(zip(sample_seq.tolist(), batch.sample_request_ids,
                                         strict=True)):
            rid_of_seq[s] = rid
            if num_prop is not None and len(num_prop):
                proposed[s] = int(num_prop[r])
        positions = np.asarray(batch.positions, dtype=np.int64)
        slots = np.asarray(batch.slot_mapping, dtype=np.int64)
        tables = np.asarray(batch.block_tables)
        bs = self.model.block_size
        # The first forward: every sequence's rows but its proposals, behind the one
        # position an earlier step left unfilled, if any.
        rows_ids, rows_pos, rows_slot, lens = [], [], [], []
        extra = np.zeros(num_seqs, dtype=np.int64)
        for s in range(num_seqs):
            a, b = int(starts[s]), int(starts[s + 1]) - int(proposed[s])
            rid = rid_of_seq.get(s)
            gap = self._unfilled.pop(rid, None) if rid is not None else None
            if gap is not None and b > a and gap[0] == positions[a] - 1:
                p, tok = gap
                rows_ids.append(np.array([tok], dtype=np.int64))
                rows_pos.append(np.array([p], dtype=np.int64))
                rows_slot.append(np.array([int(tables[s, p // bs]) * bs + p % bs],
                                          dtype=np.int64))
                extra[s] = 1
            rows_ids.append(ids[a:b])
            rows_pos.append(positions[a:b])
            rows_slot.append(slots[a:b])
            lens.append(b - a + int(extra[s]))
        q = np.asarray(lens, dtype=np.int64)
        qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        seq_lens = np.asarray(batch.seq_lens, dtype=np.int64) - proposed
        before = np.asarray(batch.num_computed_before, dtype=np.int64) - extra
        spec = np.flatnonzero(proposed > 0)
        picks = self._forward(
            np.concatenate(rows_ids), np.concatenate(rows_pos), np.concatenate(rows_slot),
            qsl, seq_lens, before, tables, qsl[spec + 1].astype(np.int64) - 1)
        if not len(spec):
            return ids
        picks = np.minimum(picks, vocab_size - 1)
        # Row of each speculating sequence's last token in the batch; its proposals follow.
        last = starts[spec + 1] - proposed[spec] - 1
        for j in range(int(proposed[spec].max())):
            ids[last[proposed[spec] > j] + 1 + j] = picks[proposed[spec] > j]
            more = proposed[spec] > j + 1
            if j + 1 == int(proposed[spec].max()) or not more.any():
                break
            # One row per sequence with more to propose: the proposal just made.
            rows = last[more] + 1 + j
            n = len(rows)
            ones = np.arange(n + 1, dtype=np.int32)
            step_picks = self._forward(
                ids[rows], positions[rows], slots[rows], ones, positions[rows] + 1,
                positions[rows], tables[spec[more]], np.arange(n, dtype=np.int64))
            picks = np.zeros(len(spec), dtype=np.int64)
            picks[more] = np.minimum(step_picks, vocab_size - 1)
        return ids

    def _forward(
        self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
        query_start_loc: np.ndarray, seq_lens: np.ndarray, before: np.ndarray,
        tables: np.ndarray, sample: np.ndarray,
    ) -> np.ndarray:
        """The draft's greedy pick at each row of ``sample``, after one forward that writes
        the KV of every row."""
        logits = self.model.forward(
            input_ids=ids, positions=positions, slot_mapping=slots,
            query_start_loc=query_start_loc, seq_lens=seq_lens.astype(np.int32),
            num_computed_before=before.astype(np.int32), block_tables=tables,
            sample_indices=sample)
        if not len(sample):
            return np.zeros(0, dtype=np.int64)
        return argmax_rows(logits).cpu().numpy().astype(np.int64)
