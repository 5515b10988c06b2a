"""The Rust decode-attention kernel through its Python wrapper, against plain torch math."""

from __future__ import annotations

import numpy as np
import pytest
import torch  # these tests must fail, not skip, without torch
from iron_batch.attention import cpu_kernel as cpu_attention
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.platform import cpu, switches
from tiny_models import checkpoint, random_prompts, reference_model


def _reference(q, cache, tables, lens, scale, window):
    """float64 attention of each sequence's one query over its context, gathered by table."""
    seqs, heads, hd = q.shape
    _, _, block_size, kv_heads, _ = cache.shape
    group = heads // kv_heads
    out = torch.empty(seqs, heads, hd, dtype=torch.float64)
    for s in range(seqs):
        n = int(lens[s])
        pos = torch.arange(n)
        slots = torch.from_numpy(tables[s].astype(np.int64))[pos // block_size] * block_size + (
            pos % block_size
        )
        flat = cache.double().reshape(2, -1, kv_heads, hd)
        keys, values = flat[0][slots], flat[1][slots]  # [n, kvh, hd]
        if window:
            keys, values = keys[max(0, n - window):], values[max(0, n - window):]
        for h in range(heads):
            scores = keys[:, h // group] @ q[s, h].double() * scale
            out[s, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out.reshape(seqs, heads * hd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "hd", "window"),
                         [(4, 4, 64, None), (9, 3, 64, None), (8, 2, 32, 20), (2, 1, 24, None)])
def test_kernel_matches_torch(dtype, heads, kv_heads, hd, window) -> None:
    if not cpu.select(torch.device("cpu"), dtype, switches.read()).attention:
        pytest.fail("the Rust attention kernel is not available in this build")
    g = torch.Generator().manual_seed(0)
    block_size, width, seqs = 16, 6, 11
    num_blocks = seqs * width
    cache = torch.randn(2, num_blocks, block_size, kv_heads, hd, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).numpy().astype(np.int32)
    tables = perm.reshape(seqs, width)
    lens = np.array([1, 2, 15, 16, 17, 33, 50, 64, 80, 95, 96], dtype=np.int32)
    q = torch.randn(seqs, heads, hd, generator=g).to(dtype)
    got = cpu_attention.paged_decode_attention(q, cache, tables, lens, hd**-0.5, window)
    assert got.dtype == dtype and got.shape == (seqs, heads * hd)
    want = _reference(q, cache, tables, lens, hd**-0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_bad_inputs_raise_before_the_kernel_runs() -> None:
    cache = torch.zeros(2, 4, 16, 2, 64)
    q = torch.zeros(1, 4, 64)
    tables = np.zeros((1, 4), dtype=np.int32)
    with pytest.raises(TypeError, match="bf16 or float32"):
        cpu_attention.paged_decode_attention(q.double(), cache, tables, np.array([3]), 1.0, None)
    with pytest.raises(ValueError, match="block id"):
        cpu_attention.paged_decode_attention(
            q, cache, np.full((1, 4), 9, dtype=np.int32), np.array([3]), 1.0, None
        )
    with pytest.raises(ValueError, match="length"):
        cpu_attention.paged_decode_attention(q, cache, tables, np.array([65]), 1.0, None)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_attention.paged_decode_attention(torch.zeros(1, 4, 32), cache, tables,
                                             np.array([3]), 1.0, None)


def _chunked_logits(model, seqs: list[list[int]], chunks: list[int]) -> list[torch.Tensor]:
    """Float32 logits at every position of each sequence, run together through ``model``:
    sequence i takes ``chunks[i]`` tokens a step (1: it decodes), each step one forward
    over all of them with every row sampled; each sequence has its own cache blocks."""
    block, width = 4, 32
    model.allocate_kv_cache(len(seqs) * width, block)
    done = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        ids, pos, slots, qsl, lens, before, tables, owner = [], [], [], [0], [], [], [], []
        for i, (seq, n) in enumerate(zip(seqs, chunks, strict=True)):
            take = min(n, len(seq) - done[i])
            if take == 0:
                continue
            span = np.arange(done[i], done[i] + take)
            ids += seq[done[i]:done[i] + take]
            pos += span.tolist()
            slots += ((i * width + span // block) * block + span % block).tolist()
            qsl.append(qsl[-1] + take)
            lens.append(done[i] + take)
            before.append(done[i])
            tables.append(np.arange(i * width, (i + 1) * width))
            owner += [i] * take
            done[i] += take
        logits = model.forward(
            input_ids=np.array(ids), positions=np.array(pos), slot_mapping=np.array(slots),
            query_start_loc=np.array(qsl, np.int32), seq_lens=np.array(lens, np.int32),
            num_computed_before=np.array(before, np.int32),
            block_tables=np.array(tables, np.int32), sample_indices=np.arange(len(ids)),
        )
        for row, i in enumerate(owner):
            out[i].append(logits[row])
    return [torch.stack(o) for o in out]


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_prompt_rows_through_the_kernel_match_transformers(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 prompt rows attend through the kernel, each over its own prefix: fresh chunks,
    chunks behind cached context, past mistral's 24-token sliding window, in the same
    forward as another sequence's decodes. Every position's logits stay as close to
    transformers' float32 model as SDPA's route does (bf16 activations: ~0.15 here)."""
    seqs = random_prompts(13, [40, 30])
    ref = reference_model(name).to(torch.float32)
    with torch.no_grad():
        want = [ref(torch.tensor([s])).logits[0] for s in seqs]
    errors = {}
    for route in ("kernel", "sdpa"):
        monkeypatch.setenv("IRON_BATCH_CPU_PREFILL_ATTENTION", route)
        be = TorchBackend.from_model(str(checkpoint(name)), device="cpu", dtype="bfloat16",
                                     total_kv_blocks=96, kv_block_size=4)
        # The first sequence in chunks of 7 (the first fresh, the rest behind cached
        # context), the second decoding one token a step beside it.
        got = _chunked_logits(be.model, seqs, [7, 1])
        errors[route] = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
    assert errors["kernel"] <= 0.3, errors
    assert errors["kernel"] <= 2 * errors["sdpa"], errors
