"""Tensor parallelism (``--tensor-parallel-size``, ``LLM(tensor_parallel_size=...)``) on CPU
with gloo: TP=2 gives TP=1's greedy tokens, through LLM, the server and torchrun; a lost
rank fails requests and the server instead of hanging it; bad world sizes are refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import children, cli_process, free_port, wait_for
from iron_batch.backends.build import BackendConfigError
from iron_batch.llm import LLM
from iron_batch.sampling_params import SamplingParams
from tiny_models import (
    FAMILIES,
    checkpoint,
    random_prompts,
    uneven_checkpoint,
    variant_checkpoint,
)

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SERVER = [sys.executable, "-m", "iron_batch.server"]
TINY = ("--backend", "torch", "--device", "cpu", "--dtype", "float32",
        "--kv-block-size", "4", "--total-kv-blocks", "256", "--no-ui")
CHECKPOINTS = [*FAMILIES, "uneven"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {name: str(checkpoint(name)) for name in FAMILIES}
    out["uneven"] = str(uneven_checkpoint(tmp_path_factory.mktemp("tp") / "uneven"))
    return out


@pytest.fixture(scope="module", params=CHECKPOINTS)
def pair(request: pytest.FixtureRequest, paths: dict[str, str]) -> Iterator[tuple[Any, Any]]:
    """(TP=1 backend, TP=2 backend) of one checkpoint. A process holds one tensor-parallel
    model at a time (one default process group), and pytest runs every test of one
    checkpoint before the next, so each pair's ranks stop before the next pair starts."""
    kw: dict[str, Any] = dict(device="cpu", dtype="float32", total_kv_blocks=256,
                              kv_block_size=4)
    tp1 = LLM(model=paths[request.param], **kw).backend
    tp2 = LLM(model=paths[request.param], tensor_parallel_size=2, **kw)
    yield tp1, tp2.backend
    tp2.close()


def _both(pair: tuple[Any, Any], prompts: list[list[int]], params: SamplingParams = GREEDY,
          **scheduler: Any) -> tuple[list[list[int]], list[list[int]], dict[str, int]]:
    """Outputs of TP=1 and TP=2 under the same scheduler settings, and TP=2's stats."""
    outs = []
    for be in pair:
        llm = LLM(backend=be, kv_block_size=4, **scheduler)
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        stats = llm.engine.scheduler.stats()
        assert stats["free_blocks"] == stats["total_blocks"]  # every KV block is free again
    return outs[0], outs[1], stats


def test_tp2_equals_tp1_on_batched_requests(pair: tuple[Any, Any]) -> None:
    lengths = [1, 2, 3, 5, 8, 11, 16, 17, 23, 31, 4, 9, 40, 6, 27, 12]
    tp1, tp2, _ = _both(pair, random_prompts(20, lengths))
    assert len(tp1) == 16 and all(len(o) == 12 for o in tp1)
    assert tp2 == tp1


def test_tp2_equals_tp1_under_preemption(pair: tuple[Any, Any]) -> None:
    prompts = random_prompts(40, [9, 14, 6, 11, 17, 8, 12, 5])
    params = SamplingParams(max_new_tokens=22, ignore_eos=True)
    tp1, tp2, stats = _both(pair, prompts, params, total_kv_blocks=18,
                            max_running_seqs=8)
    assert stats["preemptions"] > 0
    assert tp2 == tp1


def test_tp2_equals_tp1_with_chunked_prefill(pair: tuple[Any, Any]) -> None:
    tp1, tp2, _ = _both(pair, random_prompts(50, [45, 29, 7, 33]), max_batch_tokens=7)
    assert tp2 == tp1


def test_tp2_equals_tp1_with_prefix_cache_hits(pair: tuple[Any, Any]) -> None:
    prefix = random_prompts(30, [37])[0]
    prompts = [prefix + s for s in random_prompts(31, [3, 5, 1, 9, 4, 2])]
    tp1, tp2, stats = _both(pair, prompts, max_running_seqs=2)
    assert stats["prefix_cache_hit_tokens"] > 0
    assert tp2 == tp1


def test_seeded_sampling_is_the_same_on_tp2(pair: tuple[Any, Any]) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3,
                            ignore_eos=True, repetition_penalty=1.2)
    tp1, tp2, _ = _both(pair, random_prompts(60, [7, 19]), params)
    assert tp2 == tp1


def test_speculation_on_tp2_gives_the_tokens_without_it(pair: tuple[Any, Any]) -> None:
    """Prompt lookup with both ranks verifying the proposals in the same forward: the
    greedy tokens without speculation, and the same proposals accepted as on one rank."""
    prompts = []
    for i in range(3):
        phrase = [(11 * i + 5 * j + 3) % 64 for j in range(6 + i)]
        prompts.append(phrase * 3 + phrase[:2])
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    want, plain, _ = _both(pair, prompts, params)
    assert plain == want
    counts = []
    for be in pair:
        llm = LLM(backend=be, kv_block_size=4, num_speculative_tokens=4)
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        stats = llm.engine.scheduler.stats()
        assert stats["free_blocks"] == stats["total_blocks"]
        counts.append((stats["spec_drafted_tokens"], stats["spec_accepted_tokens"]))
    assert counts[1] == counts[0] and counts[1][0] > 0, counts


def test_gemma4_layers_whose_kv_heads_a_rank_cannot_follow_are_refused() -> None:
    # 6 query heads: 3 per rank, which pair with the sliding layers' 2 KV heads (one KV
    # head each) but would take one and a half of the global layers' 3 KV heads.
    model = str(variant_checkpoint("gemma4", (("num_attention_heads", 6),
                                              ("num_global_key_value_heads", 3))))
    with pytest.raises(BackendConfigError) as info:
        LLM(model=model, tensor_parallel_size=2, device="cpu")
    assert str(info.value).endswith(
        "cannot split gemma4_text over 2 ranks: layer 1's 6 query heads share 3 KV heads, "
        "and rank 0's query heads 0-2 would not divide evenly among the KV heads they "
        "attend to")
    assert "\n" not in str(info.value)
    # The same checkpoint in one process runs.
    assert len(LLM(model=model, device="cpu", total_kv_blocks=32).generate(
        [[5, 6, 7]], GREEDY)[0].token_ids) == 12


def test_a_world_size_the_heads_cannot_be_split_by_is_refused(paths: dict[str, str]) -> None:
    # llama: 4 query heads, 2 KV heads; 3 ranks cannot share 2 KV heads evenly.
    with pytest.raises(BackendConfigError, match="cannot split") as info:
        LLM(model=paths["llama"], tensor_parallel_size=3, device="cpu")
    assert "\n" not in str(info.value)
    with pytest.raises(BackendConfigError, match="more ranks than query heads"):
        LLM(model=paths["llama"], tensor_parallel_size=8, device="cpu")
    result = subprocess.run([*SERVER, *TINY, "--model", paths["llama"],
                             "--tensor-parallel-size", "3"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--tensor-parallel-size 3: cannot split llama" in result.stderr.splitlines()[-1]


# ---------------------------------------------------------------- the server


@contextlib.contextmanager
def _server(*args: str, boot_s: float = 60) -> Iterator[tuple[subprocess.Popen[str], str]]:
    with cli_process(*args, startup_s=boot_s) as (proc, port):
        yield proc, f"http://127.0.0.1:{port}"


def _generate(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line]


def test_server_tp2_on_smollm2_matches_tp1() -> None:
    prompts = ["The quick brown fox", "def fibonacci(n):\n", "Paris is the capital of"]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    reference = LLM(model="smollm2-135m", device="cpu", total_kv_blocks=64)
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    args = ("--backend", "torch", "--model", "smollm2-135m", "--device", "cpu",
            "--total-kv-blocks", "64", "--tensor-parallel-size", "2", "--no-ui")
    with _server(*args, boot_s=120) as (proc, url):
        ranks = children(proc.pid)
        assert len(ranks) == 1  # the server spawned rank 1 itself
        results: list[list[int]] = [[] for _ in prompts]

        def run(i: int) -> None:
            lines = _generate(url, {"prompt": prompts[i], "max_new_tokens": 16,
                                    "ignore_eos": True, "temperature": 0})
            results[i] = [x["token_id"] for x in lines]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == expected
        metrics = httpx.get(f"{url}/metrics", timeout=10).json()
        assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"] == 64
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        wait_for(lambda: not Path(f"/proc/{ranks[0]}").exists()
                 or "Z" in Path(f"/proc/{ranks[0]}/stat").read_text().split()[2],
                 10, "rank 1 to exit")


def test_a_rank_lost_while_idle_ends_the_server(paths: dict[str, str]) -> None:
    args = (*TINY, "--model", paths["llama"], "--tensor-parallel-size", "2",
            "--tp-timeout", "10")
    with _server(*args) as (proc, _):
        (rank1,) = children(proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert proc.wait(30) == 1
        assert proc.stdout is not None
        assert "rank 1 exited with status -9" in proc.stdout.read()


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_rank_fails_requests_and_the_server_exits(paths: dict[str, str],
                                                         how: str) -> None:
    args = (*TINY, "--model", paths["llama"], "--tensor-parallel-size", "2",
            "--tp-timeout", "10")
    with _server(*args) as (proc, url):
        (rank1,) = children(proc.pid)
        body = {"prompt_token_ids": [5, 6, 7], "max_new_tokens": 500, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = json.loads(next(lines))
            assert first["token_id"] is not None
            os.kill(rank1, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            rest = [json.loads(line) for line in lines if line]
        last = rest[-1]
        assert last["finish_reason"] == "error"
        assert "tensor-parallel" in last["error"]
        assert len(rest) < 499  # it stopped early, not after the whole generation
        assert proc.wait(30) == 1
        assert proc.stdout is not None
        assert "fatal engine fault" in proc.stdout.read()


def test_torchrun_two_nodes_on_loopback(paths: dict[str, str]) -> None:
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = random_prompts(70, [11])[0]
    reference = LLM(model=paths["qwen2"], device="cpu", dtype="float32",
                    total_kv_blocks=256, kv_block_size=4)
    expected = reference.generate([prompt], params)[0].token_ids
    master, http = free_port(), free_port()
    nodes = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr",
               "127.0.0.1", "--master-port", str(master), "-m", "iron_batch.server", *TINY,
               "--model", paths["qwen2"], "--tensor-parallel-size", "2", "--addr",
               f"127.0.0.1:{http}"]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    try:
        def up() -> bool:
            for n in nodes:
                if n.poll() is not None:
                    raise AssertionError(f"a node exited: {n.stderr.read() if n.stderr else ''}")
            try:
                return httpx.get(f"http://127.0.0.1:{http}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 90, "rank 0's server")
        lines = _generate(f"http://127.0.0.1:{http}",
                          {"prompt_token_ids": prompt, "max_new_tokens": 12, "ignore_eos": True})
        assert [x["token_id"] for x in lines] == expected
        # Rank 0's server is the only child of node 0's torchrun agent; stopping it ends
        # rank 1 (told to stop), and then both agents end with success.
        (server,) = children(nodes[0].pid)
        os.kill(server, signal.SIGTERM)
        assert [n.wait(60) for n in nodes] == [0, 0]
    finally:
        for n in nodes:
            for pid in children(n.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if n.poll() is None:
                n.kill()
            n.wait(10)
            if n.stderr:
                n.stderr.close()
