"""The CUDA attention backend (``attention/backend.py``'s ``CudaAttention``): on a CUDA
device, float32 greedy tokens equal transformers' under preemption, chunked prefill and
prefix hits, as on CPU. Run with ``pytest -m cuda`` where a GPU is present; elsewhere every
test here skips, saying why."""

from __future__ import annotations

import pytest
import torch
from iron_batch.attention.backend import CudaAttention
from iron_batch.backends.torch_backend import TorchBackend
from tiny_models import FAMILIES, checkpoint, hf_greedy, random_prompts, run_scheduler

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: the CUDA attention backend's tests need one"),
]


def _cuda_backend(name: str, total_kv_blocks: int = 256) -> TorchBackend:
    return TorchBackend.from_model(str(checkpoint(name)), device="cuda", dtype="float32",
                                   total_kv_blocks=total_kv_blocks, kv_block_size=4)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cuda_gives_transformers_greedy_tokens(name: str) -> None:
    be = _cuda_backend(name)
    assert isinstance(be.model.attention, CudaAttention)
    # Prompts longer than the step budget (chunked prefill), a pool small enough to
    # preempt, and a shared prefix (cache hits).
    prompts = random_prompts(7, [33, 5, 21, 12])
    prompts.append(prompts[0][:16] + prompts[1])
    outs, stats = run_scheduler(be, prompts, 10, max_batch_tokens=16, total_kv_blocks=40)
    assert outs == [hf_greedy(name, p, 10) for p in prompts]
    assert stats["free_blocks"] == stats["total_blocks"]
