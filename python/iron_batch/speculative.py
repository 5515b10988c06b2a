"""Verification of speculative proposals in the step's one forward.

The scheduler (Rust core) proposes tokens by prompt lookup and puts them after a decoding
sequence's last token as extra query rows (``batch.num_proposed``). The backend takes the
logits of all those rows, and for each row ``j`` picks the token the sampler would pick
there without speculation; it accepts proposals while the pick equals the proposal, then
adds the pick that differed (or the one after the last proposal). So a row yields 1 to
``k + 1`` tokens.

Exactness: the pick at position ``p`` is what a plain decode at ``p`` picks. Greedy is the
argmax. A sampled row uses the sampler's exponential race, ``argmax(probs / E)``, with
``E`` drawn for a seeded request from a generator seeded by (seed, tokens generated so
far): the same noise a plain decode of that position draws, so a seeded request gives the
same tokens with speculation and without, and the distribution is the target's. For a
proposal that is a single token (prompt lookup), accepting when the target's own sample
equals it accepts with probability ``p(proposal)``, which is what rejection sampling with
a one-point draft distribution accepts; on a rejection the token is the target's own
sample, so nothing is lost against rejection sampling.

A draft model (:mod:`iron_batch.draft_model`) proposes greedily: a point-mass draft
distribution too, so the same verification keeps the target's distribution exactly with
its proposals.

Logprobs of the accepted tokens come from the rows that verified them: row ``j``'s logits
are those a plain decode at that position computes, so the values are the same as without
speculation.

Requests that speculate are those ``SamplingParams.allows_speculation`` says: no penalties
(their counts would have to advance inside the run), no grammar (speculation is off for
constrained requests rather than checking proposals against it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from iron_batch.sampling import _filtered_probs, _gather_logprobs, argmax_rows, mix_seed

if TYPE_CHECKING:
    from iron_batch.sampling import RequestState, Sampler
    from iron_batch.sampling_params import SamplingParams
    from iron_batch.stream import StepLogprobs


def verify_rows(
    sampler: Sampler,
    logits: torch.Tensor,
    states: list[RequestState],
    proposals: list[np.ndarray],
) -> tuple[list[int], list[int], StepLogprobs | None]:
    """``logits``: ``1 + len(proposals[i])`` consecutive rows per request ``i`` (the rows
    of its last token and of each proposal). Returns the accepted tokens of every request
    in turn, their count per request, and (when a request asks for them) one logprobs
    entry per accepted token (``(0.0, [])`` for requests that do not ask); advances each
    state's generated count."""
    ks = [len(p) for p in proposals]
    picks = _picks(sampler, logits, states, ks)
    row_logprobs = None
    if any(s.params.logprobs is not None for s in states):
        want = [s.params.logprobs for s, k in zip(states, ks, strict=True) for _ in range(k + 1)]
        row_logprobs = _gather_logprobs(
            torch.log_softmax(logits, dim=-1),
            torch.tensor(picks, dtype=torch.int64, device=logits.device), want)
    tokens: list[int] = []
    counts: list[int] = []
    logprobs: StepLogprobs | None = [] if row_logprobs is not None else None
    at = 0
    for state, prop in zip(states, proposals, strict=True):
        k = len(prop)
        row = picks[at : at + k + 1]
        at += k + 1
        n = 0
        while n < k and row[n] == prop[n]:
            n += 1
        tokens.extend(row[: n + 1])
        if logprobs is not None and row_logprobs is not None:
            if state.params.logprobs is not None:
                logprobs.extend(row_logprobs[at - k - 1 : at - k - 1 + n + 1])
            else:
                logprobs.extend([(0.0, [])] * (n + 1))
        counts.append(n + 1)
        state.num_generated += n + 1
    return tokens, counts, logprobs


def _picks(
    sampler: Sampler, logits: torch.Tensor, states: list[RequestState], ks: list[int]
) -> list[int]:
    """The sampler's pick at every row, each row ``j`` of a request drawn as its
    ``num_generated + j``-th token."""
    if all(s.params.is_greedy for s in states):
        return argmax_rows(logits).tolist()
    expanded: list[SamplingParams] = []
    offsets: list[int] = []
    owners: list[RequestState] = []
    for state, k in zip(states, ks, strict=True):
        for j in range(k + 1):
            expanded.append(state.params)
            offsets.append(j)
            owners.append(state)
    picks = argmax_rows(logits)
    random_rows = [i for i, p in enumerate(expanded) if not p.is_greedy]
    if random_rows:
        device = logits.device
        rows = torch.tensor(random_rows, device=device)
        probs = _filtered_probs(logits[rows], [expanded[i] for i in random_rows], device)
        noise = torch.empty_like(probs)
        for n, i in enumerate(random_rows):
            seed = expanded[i].seed
            if seed is None:
                noise[n].exponential_(generator=sampler._generator)
            else:
                g = torch.Generator(device=device)
                g.manual_seed(mix_seed(seed, owners[i].num_generated + offsets[i]))
                noise[n].exponential_(generator=g)
        picks[rows] = argmax_rows(probs / noise)
    return picks.tolist()
