"""``--kv-cache-dtype int8``: K and V kept as int8 rows with a float32 scale per token and
head (``attention/kv_int8.py``). Logits stay within a stated bound of the bf16 cache's on
the tiny families (sliding windows and cache groups included); the one-call decode stack,
the layer-by-layer path and the torch route agree; prefix caching, preemption and chunked
prefill keep their exactness, on a remote worker too; the pool holds the tokens its real
bytes allow, and the page and the banner say so; a bad value is refused."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from conftest import ServerStarter
from iron_batch import Scheduler
from iron_batch.attention import kv_int8, paged
from iron_batch.backends.build import BackendConfigError, scheduler_config
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.flags import MODEL_FLAGS, values
from iron_batch.layers import cpu_kernels
from iron_batch.llm import LLM
from iron_batch.sampling_params import SamplingParams
from iron_batch.server.cli import build_parser
from iron_batch.server.ui import banner
from test_remote_backend import WorkerProcess
from tiny_models import checkpoint, random_prompts, run_scheduler

#: The stated bound: with every step's tokens forced to the bf16 cache's, the int8 cache's
#: logits differ from the bf16 cache's by at most this fraction of the logits' standard
#: deviation (measured: 0.12 to 0.24; a float32 model differs from the bf16 one by 0.10 to
#: 0.40 on the same steps), and their argmax agrees on at least this share of the rows.
MAX_LOGIT_ERROR_STD = 0.35
MIN_ARGMAX_AGREEMENT = 0.95


def _backend(name: str, kv: str, dtype: str = "bfloat16", blocks: int = 96,
             **kw: Any) -> TorchBackend:
    return TorchBackend.from_model(str(checkpoint(name)), device="cpu", dtype=dtype,
                                   total_kv_blocks=blocks, kv_block_size=4, kv_cache_dtype=kv,
                                   **kw)


def _forced_run(be: TorchBackend, prompts: list[list[int]], max_new: int,
                forced: list[np.ndarray] | None = None) -> tuple[list[np.ndarray], torch.Tensor]:
    """Each step's sampled tokens (greedy, or ``forced``'s: the same steps then see the
    same tokens) and every sampled row's logits; every block is free at the end."""
    logits: list[torch.Tensor] = []
    model = be.model
    forward = model._logits

    def keep(h: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        out = forward(h, rows)
        logits.append(out.float().clone())
        return out

    model._logits = keep  # type: ignore[method-assign]
    s = Scheduler(scheduler_config(be, max_batch_tokens=64, max_running_seqs=64))
    for i, p in enumerate(prompts):
        s.add_request(f"r{i}", p, max_new)
    steps: list[np.ndarray] = []
    try:
        while s.has_work():
            batch = s.schedule()
            sampled = np.asarray(be.execute(batch))
            if forced is not None:
                sampled = forced[len(steps)]
            steps.append(sampled)
            s.commit(batch, sampled)
    finally:
        del model._logits
    assert s.num_free_blocks == s.config.total_kv_blocks
    return steps, torch.cat(logits)


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "gemma2", "gemma3", "gemma4"])
def test_int8_cache_logits_stay_within_the_bound_of_the_bf16_cache(name: str) -> None:
    # Prompts longer than the sliding windows (mistral, the Gemmas: sliding and full cache
    # groups); decodes of several sequences at once.
    prompts = random_prompts(3, [40, 7, 19, 3, 28])
    steps, ref = _forced_run(_backend(name, "auto"), prompts, 24)
    be = _backend(name, "int8")
    assert all(c.dtype == torch.int8 for c in be.model.kv_caches)
    _, got = _forced_run(be, prompts, 24, forced=steps)
    assert got.shape == ref.shape
    error = (got - ref).abs().max().item() / ref.std().item()
    assert 0 < error <= MAX_LOGIT_ERROR_STD, error
    # A count over a count: in float32, 19 of 20 would read 0.94999999 and fail 0.95.
    same = got.argmax(-1) == ref.argmax(-1)
    agreement = same.sum().item() / same.numel()
    assert agreement >= MIN_ARGMAX_AGREEMENT, agreement


@pytest.mark.parametrize("name", ["llama", "gemma3", "gemma4"])
def test_one_call_decode_reads_the_int8_cache_as_the_layer_path_does(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = random_prompts(5, [30, 9])
    runs = []
    for fused in ("1", "0"):
        monkeypatch.setenv("IRON_BATCH_CPU_DECODER", fused)
        be = _backend(name, "int8")
        assert (be.model.decoder is not None) == (fused == "1")
        runs.append(_forced_run(be, prompts, 16))
    (stack_steps, stack_logits), (layer_steps, layer_logits) = runs
    assert [s.tolist() for s in stack_steps] == [s.tolist() for s in layer_steps]
    torch.testing.assert_close(stack_logits, layer_logits, rtol=0, atol=0)


def test_the_torch_route_dequantizes_what_the_kernels_read(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # The torch route (also CUDA's) gathers int8 rows and dequantizes them; the CPU
    # kernels read them in place: the same K/V, so the logits agree to rounding.
    prompts = random_prompts(6, [33, 12, 5])
    steps, kernel = _forced_run(_backend("qwen3", "int8", dtype="float32"), prompts, 12)
    monkeypatch.setenv("IRON_BATCH_CPU_ATTENTION", "torch")
    be = _backend("qwen3", "int8", dtype="float32")
    assert be.model.attention.name == "torch"
    _, route = _forced_run(be, prompts, 12, forced=steps)
    torch.testing.assert_close(route, kernel, rtol=0, atol=5e-3)


def test_torch_and_rust_store_the_same_bytes() -> None:
    torch.manual_seed(0)
    heads, kv_heads, hd, tokens = 4, 2, 32, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd).to(torch.bfloat16) * 3
    pos = torch.arange(tokens)[:, None].float()
    freq = 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.cat([pos * freq, pos * freq], dim=-1)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    slots = np.array([9, 0, 4, 13, 6], dtype=np.int64)
    rust = torch.zeros(2, 4, 4, kv_heads, hd + 4, dtype=torch.int8)
    cpu_kernels.rope_store_kv(qkv, cos, sin, slots, rust, heads, kv_heads, hd)
    # The float route: the same rotation into a bf16 cache, quantized by torch ops.
    float_cache = torch.zeros(2, 4, 4, kv_heads, hd, dtype=torch.bfloat16)
    cpu_kernels.rope_store_kv(qkv, cos, sin, slots, float_cache, heads, kv_heads, hd)
    flat = float_cache.view(2, -1, kv_heads, hd)
    want = torch.zeros_like(rust)
    plan = type("Plan", (), {"slot_mapping": torch.from_numpy(slots)})()
    paged.write_kv(want, plan, flat[0][slots], flat[1][slots])  # type: ignore[arg-type]
    assert torch.equal(rust, want)
    # Each stored row dequantizes to its value within half a quantization step.
    rows = kv_int8.dequantize(rust.view(2, -1, kv_heads, hd + 4)[:, slots], torch.float32)
    exact = flat[:, slots].float()
    step = exact.abs().amax(-1, keepdim=True) / 127
    assert ((rows - exact).abs() <= step / 2 + 1e-6).all()


def test_prefix_caching_preemption_and_chunked_prefill_keep_int8_outputs() -> None:
    # A float32 model: its greedy tokens do not hang on rounding, so each way of running
    # the same requests (a plain roomy run; a tight pool that preempts; small chunks; a
    # shared prefix served from the cache) must give the same tokens.
    shared = random_prompts(11, [24])[0]
    prompts = [shared + p for p in random_prompts(12, [6, 9, 3, 11])]
    roomy = _backend("llama", "int8", dtype="float32", blocks=256)
    want, _ = run_scheduler(roomy, prompts, 20, max_batch_tokens=512)
    tight = _backend("llama", "int8", dtype="float32", blocks=26)
    got, stats = run_scheduler(tight, prompts, 20, max_batch_tokens=512)
    assert got == want and stats["preemptions"] > 0
    # Chunks of 8 tokens: a prompt's later chunks read its earlier ones from the cache,
    # and the prompts after the first find the shared prefix's blocks cached.
    chunked, stats = run_scheduler(roomy, prompts, 20, max_batch_tokens=8)
    assert chunked == want and stats["prefix_cache_hit_tokens"] >= 3 * 24
    # run_scheduler asserts that every block is free after each run.


def test_the_pool_holds_the_tokens_its_real_bytes_allow() -> None:
    # qwen3: 2 layers x 2 KV heads x head_dim 32. bf16: 2 (K, V) x 2 x 32 x 2 bytes = 256
    # bytes per token and layer; int8: 2 x 2 x (32 + 4) = 144 bytes (values and scale).
    budget = 1 / 64  # GiB
    pools = {}
    for kv in ("auto", "int8"):
        llm = LLM(model=str(checkpoint("qwen3")), device="cpu", dtype="bfloat16",
                  kv_block_size=4, kv_cache_memory_gb=budget, kv_cache_dtype=kv)
        pools[kv] = llm.engine.config.total_kv_blocks
        out = llm.generate([[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=4,
                                                               ignore_eos=True))
        assert [len(o.token_ids) for o in out] == [4, 4]
        stats = llm.engine.scheduler.stats()
        assert stats["free_blocks"] == stats["total_blocks"]
    per_block = {"auto": 2 * 256 * 4, "int8": 2 * 144 * 4}
    for kv, blocks in pools.items():
        assert blocks == int(budget * 2**30) // per_block[kv], kv
    assert pools["int8"] / pools["auto"] == pytest.approx(256 / 144, rel=1e-3)


def test_the_page_and_the_banner_show_the_dtype_and_the_tokens() -> None:
    be = _backend("llama", "int8", blocks=64)
    starter = ServerStarter()
    try:
        server = starter(be, total_kv_blocks=64, kv_block_size=4)
        info = httpx.get(server.url + "/ui/api/info").json()
        # llama: 2 layers x 2 KV heads x head_dim 16: 2 x 2 x 2 x (16 + 4) = 160 bytes a token.
        assert info["kv"] == {"blocks": 64, "block_size": 4, "tokens": 256, "dtype": "int8",
                              "bytes": 64 * 4 * 160}
        text = banner(info, ["http://localhost:1/"], ui=True)
        assert "= 256 tokens (40.0 KiB, int8 K/V)" in text
        status, lines = server.generate({"prompt_token_ids": [5, 6, 7], "max_new_tokens": 3})
        assert status == 200 and lines[-1]["done"] is True
        idle = server.wait_idle()  # every block free again
        assert idle["kv_blocks_free"] == idle["kv_blocks_total"] == 64
    finally:
        starter.close()
    bf16 = _backend("llama", "auto", blocks=8).describe()
    assert bf16.kv_cache_dtype == "bfloat16"


def test_the_flag_is_shared_and_bad_values_are_refused() -> None:
    args = build_parser().parse_args(["--kv-cache-dtype", "int8"])
    assert values(args, MODEL_FLAGS)["kv_cache_dtype"] == "int8"
    bad = subprocess.run([sys.executable, "-m", "iron_batch.server", "--kv-cache-dtype",
                          "fp8"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'fp8'" in bad.stderr
    assert "Traceback" not in bad.stderr
    mock = subprocess.run([sys.executable, "-m", "iron_batch.server", "--kv-cache-dtype",
                           "int8"], capture_output=True, text=True, timeout=60)
    assert mock.returncode == 2 and "--kv-cache-dtype only applies to --backend torch" in (
        mock.stderr)
    with pytest.raises(BackendConfigError, match="'fp8' is not one of auto, int8"):
        LLM(model=str(checkpoint("llama")), kv_cache_dtype="fp8")


@pytest.fixture
def int8_worker() -> Iterator[WorkerProcess]:
    w = WorkerProcess("--model", str(checkpoint("llama")), "--device", "cpu", "--dtype",
                      "float32", "--total-kv-blocks", "18", "--kv-block-size", "4",
                      "--kv-cache-dtype", "int8")
    try:
        yield w.start()
    finally:
        w.kill()


def test_a_remote_worker_serves_an_int8_cache(int8_worker: WorkerProcess) -> None:
    from iron_batch import Engine
    from iron_batch.backends.remote import RemoteBackend

    w = int8_worker
    prompts = random_prompts(40, [9, 14, 6, 11, 17, 8])
    max_new = [14, 10, 16, 12, 9, 15]
    ref, _ = run_scheduler(_backend("llama", "int8", dtype="float32", blocks=18), prompts,
                           max_new)
    be = RemoteBackend(w.url)
    described = be.describe()
    assert described.kv_cache_dtype == "int8"
    assert described.kv_bytes_per_block == 4 * 160  # 4 tokens of 2 x 2 x 2 x (16 + 4) bytes
    engine = Engine(be, scheduler_config(be, max_batch_tokens=64, max_running_seqs=8))
    for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=n, ignore_eos=True))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for ev in engine.step():
            assert ev.error is None
            if ev.token_id is not None:
                got[ev.request_id].append(ev.token_id)
    assert [got[f"r{i}"] for i in range(len(prompts))] == ref
    stats = engine.scheduler.stats()
    assert stats["preemptions"] > 0 and stats["free_blocks"] == stats["total_blocks"]
