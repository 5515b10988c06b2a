"""CPU weights and KV cache on 2 MiB pages (``platform/huge_pages.py``): the model keeps
the same values and gives the same tokens and logits with the placement on and off; the
memory is in huge pages wherever this Linux offers them (``madvise`` or ``always`` mode)."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.layers.quant import QuantWeight
from iron_batch.platform import huge_pages
from test_cpu_decoder import _logits_run
from tiny_models import FAMILIES, checkpoint, random_prompts

_THP = Path("/sys/kernel/mm/transparent_hugepage")


def _mode() -> str:
    """The kernel's mode for 2 MiB pages of anonymous memory: the size's own setting where
    the kernel has one (``inherit`` defers to the global one), else the global one."""
    try:
        own = (_THP / "hugepages-2048kB" / "enabled").read_text()
        mode = own if "[inherit]" not in own else (_THP / "enabled").read_text()
    except OSError:
        try:
            mode = (_THP / "enabled").read_text()
        except OSError:
            return "never"
    found = re.search(r"\[(\w+)\]", mode)
    return found.group(1) if found else "never"


def _system_gives_huge_pages() -> bool:
    """What the kernel does for an madvised range."""
    return _mode() in ("always", "madvise")


def _place(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    arena = huge_pages.Arena(sum(huge_pages.Arena.size_of(t) for t in tensors))
    return [arena.place(t) for t in tensors]


def test_an_arena_copies_each_tensor_to_its_own_aligned_place_in_one_allocation() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(n, 96).to(torch.bfloat16) for n in (3, 700, 1, 2048)]
    placed = _place(tensors)
    assert len(placed) == len(tensors)
    storages = {t.untyped_storage().data_ptr() for t in placed}
    assert len(storages) == 1
    for src, dst in zip(tensors, placed, strict=True):
        assert dst.shape == src.shape and dst.dtype == src.dtype and dst.is_contiguous()
        assert dst.data_ptr() % 4096 == 0
        assert torch.equal(dst, src)
    # Views of one arena do not overlap: writing one leaves the others alone.
    placed[1].zero_()
    assert torch.equal(placed[0], tensors[0]) and torch.equal(placed[2], tensors[2])
    # Any mix of dtypes: each keeps its own.
    mixed = _place([torch.arange(5, dtype=torch.uint8), torch.full((3, 2), 1.5)])
    assert mixed[0].tolist() == list(range(5)) and mixed[1].dtype == torch.float32
    assert torch.equal(mixed[1], torch.full((3, 2), 1.5)) and mixed[1].data_ptr() % 4096 == 0
    # An arena holds what it was sized for and refuses more.
    full = huge_pages.Arena(4096)
    full.place(torch.zeros(4096, dtype=torch.uint8))
    with pytest.raises(ValueError, match="full"):
        full.place(torch.zeros(1, dtype=torch.uint8))


def test_memory_is_on_huge_pages_where_the_system_offers_them() -> None:
    t = huge_pages.zeros((3, 2 << 20), torch.bfloat16)  # 12 MiB: whole huge pages inside
    assert t.shape == (3, 2 << 20) and int(t.count_nonzero()) == 0
    assert huge_pages.backed_by_huge_pages(t) == _system_gives_huge_pages()
    if _mode() == "madvise":
        # In this mode memory mapped the same way but not marked is not: the marking is what
        # makes the difference. (A fresh mapping, not a heap block: what backs the heap
        # depends on everything the process did before.)
        plain = mmap.mmap(-1, 12 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        unmarked = torch.frombuffer(plain, dtype=torch.uint8)
        unmarked.fill_(1)
        assert not huge_pages.backed_by_huge_pages(unmarked)
        del unmarked
        plain.close()


@pytest.mark.parametrize("quantization", [None, "int4"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_model_gives_the_same_tokens_and_logits_with_and_without_huge_pages(
    name: str, quantization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = random_prompts(5, [33, 6])
    runs = []
    for on in (True, False):
        monkeypatch.setenv("IRON_BATCH_HUGE_PAGES", "1" if on else "0")
        be = TorchBackend.from_model(str(checkpoint(name)), device="cpu", dtype="bfloat16",
                                     total_kv_blocks=96, kv_block_size=4,
                                     quantization=quantization)
        model = be.model
        weights = [lin.weight for layer in model.layers
                   for lin in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)]
        weights.append(model.lm_head.linear.weight)
        tensors = [t for w in weights
                   for t in ([w.quants, w.scale] + ([w.min] if w.min is not None else [])
                             if isinstance(w, QuantWeight) else [w])]
        arenas = {t.untyped_storage().data_ptr() for t in tensors}
        # On: every projection and the head (each of a quantized one's tensors) in one
        # allocation; off: as loaded.
        assert (len(arenas) == 1) == on
        if quantization is not None:
            assert any(isinstance(w, QuantWeight) for w in weights)
        if model.config.tie_word_embeddings and quantization is None:
            assert model.embed.table is model.lm_head.linear.weight  # one tensor, read by both
        rows: list[int] = []
        runs.append([_logits_run(be, [p], rows) for p in prompts])
    for (tokens_on, logits_on), (tokens_off, logits_off) in zip(*runs, strict=True):
        assert tokens_on == tokens_off
        torch.testing.assert_close(logits_on, logits_off, rtol=0, atol=0)
