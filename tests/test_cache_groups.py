"""Cache groups through the Python API: a paged fake model that reads each sequence's
context only through the batch's per-group block tables, table offsets and state slots
stays exact under pools small enough to force preemption, with prefix hits, plain and
overlapped; every block and state slot is free afterwards."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest
from iron_batch import CacheGroup, RequestRejected, Scheduler, SchedulerConfig
from iron_batch._core import split_pool

VOCAB = 1000


def _fold(h: int, tok: int) -> int:
    return ((h ^ tok) * 1099511628211) % 2**64


def next_token(groups: list[CacheGroup], ctx: list[int]) -> int:
    """The model's next token as a function of the plain context: full groups hash all of
    it, sliding groups their last window, the state group folds every token."""
    h = 7
    for g in groups:
        start = max(0, len(ctx) - g.window) if g.kind == "sliding" else 0
        part = 3 if g.kind == "state" else 5
        for t in ctx[start:]:
            part = _fold(part, t)
        h = _fold(h, part)
    return h % VOCAB


class PagedHybridModel:
    """KV per attention group in its own slot space, a folded state per state slot."""

    def __init__(self, groups: list[CacheGroup], block_size: int) -> None:
        self.groups = groups
        self.bs = block_size
        self.kv: list[dict[int, tuple[int, int]]] = [
            {} for g in groups if g.kind != "state"]
        self.states: dict[int, tuple[int, int]] = {}
        self.last = np.zeros(0, dtype=np.int64)

    def _table(self, batch: Any, g: int, row: int) -> tuple[np.ndarray, int]:
        off = int(batch.block_table_offsets[g, row])
        if g == 0:
            return batch.block_tables[row], off
        return batch.group_block_tables[(g - 1) * batch.num_seqs + row], off

    def _slot(self, batch: Any, g: int, row: int, p: int) -> int:
        table, off = self._table(batch, g, row)
        assert p // self.bs >= off, f"group {g} reads position {p} before its offset {off}"
        return int(table[p // self.bs - off]) * self.bs + p % self.bs

    def execute(self, batch: Any) -> np.ndarray:
        ids = batch.input_ids.copy()
        if len(batch.pending_token_indices):
            ids[batch.pending_token_indices] = self.last[batch.pending_sample_rows]
        qsl = batch.query_start_loc
        has_state = len(batch.state_slots) > 0
        for row in range(batch.num_seqs):
            before = int(batch.num_computed_before[row])
            if has_state:
                slot = int(batch.state_slots[row])
                if batch.state_fresh[row]:
                    self.states[slot] = (3, 0)
                if batch.state_restore[row] >= 0:
                    self.states[slot] = self.states[int(batch.state_restore[row])]
                assert self.states[slot][1] == before, "state does not cover the computed tokens"
            for t in range(int(qsl[row]), int(qsl[row + 1])):
                p, tok = int(batch.positions[t]), int(ids[t])
                for g, kv in enumerate(self.kv):
                    slot_g = int(batch.slot_mapping[t] if g == 0
                                 else batch.group_slot_mapping[g - 1, t])
                    assert slot_g == self._slot(batch, g, row, p)
                    kv[slot_g] = (tok, p)
                if has_state:
                    h, n = self.states[slot]
                    self.states[slot] = (_fold(h, tok), n + 1)
            if has_state and batch.state_save[row] >= 0:
                self.states[int(batch.state_save[row])] = self.states[slot]
        out = []
        for row in batch.sample_seq_indices.tolist():
            n = int(batch.seq_lens[row])
            h, attn = 7, 0
            for g in self.groups:
                if g.kind == "state":
                    state, count = self.states[int(batch.state_slots[row])]
                    assert count == n
                    h = _fold(h, state)
                    continue
                part = 5
                for p in range(max(0, n - g.window) if g.kind == "sliding" else 0, n):
                    tok, pos = self.kv[attn][self._slot(batch, attn, row, p)]
                    assert pos == p
                    part = _fold(part, tok)
                h = _fold(h, part)
                attn += 1
            out.append(h % VOCAB)
        self.last = np.asarray(out, dtype=np.int64)
        return self.last


def run(s: Scheduler, model: PagedHybridModel, requests: dict[str, list[int]],
        max_new: int, overlap: bool) -> dict[str, list[int]]:
    for rid, prompt in requests.items():
        s.add_request(rid, prompt, max_new)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    open_steps: deque[tuple[Any, np.ndarray]] = deque()
    steps = 0
    while s.has_work() or open_steps:
        if s.has_work():
            batch = s.schedule(overlap=overlap)
            open_steps.append((batch, model.execute(batch)))
        while len(open_steps) > int(overlap) or (open_steps and not s.has_work()):
            batch, sampled = open_steps.popleft()
            events = s.commit(batch, sampled)
            for rid, tok in zip(events.request_ids, events.token_ids.tolist(), strict=True):
                if tok >= 0:
                    out[rid].append(tok)
        s.check_invariants()
        steps += 1
        assert steps < 5000
    return out


GROUPS = [CacheGroup("sliding", 12, window=5), CacheGroup("full", 16),
          CacheGroup("state", 6)]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_paged_hybrid_model_is_exact_under_tiny_pools(overlap: bool) -> None:
    requests = {f"r{i}": [1, 2, 3, 4, 5, 6] + [10 + i] * (1 + i % 3) for i in range(8)}
    s = Scheduler(SchedulerConfig(kv_block_size=2, max_batch_tokens=6, max_running_seqs=3,
                                  cache_groups=GROUPS, state_checkpoint_interval=1))
    out = run(s, PagedHybridModel(GROUPS, 2), requests, 8, overlap)
    for rid, prompt in requests.items():
        ctx = list(prompt)
        assert len(out[rid]) == 8
        for tok in out[rid]:
            assert tok == next_token(GROUPS, ctx), rid
            ctx.append(tok)
    stats = s.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["sliding_blocks_released"] > 0 and stats["state_checkpoints_saved"] > 0
    for g in s.group_stats():
        assert (g["used"], g["free"]) == (0, g["total"]), g


def test_a_sliding_group_holds_a_bounded_number_of_blocks() -> None:
    # 200 tokens through a window of 8 in blocks of 4: never more than the window and the
    # step's chunk, however long the sequence gets.
    groups = [CacheGroup("sliding", 8, window=8)]
    s = Scheduler(SchedulerConfig(kv_block_size=4, max_batch_tokens=8, cache_groups=groups))
    model = PagedHybridModel(groups, 4)
    s.add_request("a", list(range(100)), 100)
    peak, out = 0, []
    while s.has_work():
        batch = s.schedule()
        events = s.commit(batch, model.execute(batch))
        out.extend(events.token_ids.tolist())
        peak = max(peak, s.group_stats()[0]["used"])
    assert len(out) == 100 and peak <= 4
    ctx = list(range(100))
    for tok in out:
        assert tok == next_token(groups, ctx)
        ctx.append(tok)


def test_cache_group_configs_are_checked() -> None:
    with pytest.raises(ValueError, match="needs a window"):
        CacheGroup("sliding", 4)
    with pytest.raises(ValueError, match="unknown cache group kind"):
        CacheGroup("mamba", 4)
    with pytest.raises(ValueError, match="at most one recurrent-state"):
        Scheduler(SchedulerConfig(cache_groups=[CacheGroup("full", 4), CacheGroup("state", 1),
                                                CacheGroup("state", 1)]))
    s = Scheduler(SchedulerConfig(kv_block_size=4, max_batch_tokens=8,
                                  cache_groups=[CacheGroup("sliding", 4, window=8)]))
    with pytest.raises(RequestRejected, match="needs up to 5 blocks at once in cache group 0"):
        s.add_request("a", [1] * 20, 4)
    assert s.group_stats() == [{"kind": "sliding", "window": 8, "total": 4, "used": 0,
                                "free": 4, "cached": 0, "unit_bytes": 0}]


def test_split_pool_serves_a_gemma_like_pattern_near_its_bound() -> None:
    # 5 sliding layers (window 1024) per global one, 8k context, 1 byte per token per layer.
    # Every layer full: 6 * 8192 bytes a sequence. Exact windows: 8192 + 5 * 1024, so at
    # most 49152 / 13312 = 3.69x as many sequences; blocks of 16 and a decode chunk of 16
    # tokens hold 66 blocks per sliding table, 3.65x.
    pool = 6 * 8192 * 100  # 100 such sequences if every layer kept every token
    groups = split_pool(pool, [("sliding", 1024, 5), ("full", None, 1)], 16, 256, 8192, 16)
    per_seq = [66, 512]  # blocks one sequence holds at most in each
    served = min(g.size // n for g, n in zip(groups, per_seq, strict=True))
    assert 364 <= served <= 369
    assert sum(g.size * g.unit_bytes for g in groups) <= pool
