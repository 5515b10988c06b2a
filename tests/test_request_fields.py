"""Request fields clients already send: ``priority`` (vLLM's: lower runs first),
``cache_salt`` (no prefix sharing across salts; per-tenant salts with several API keys) and
``stream_options.continuous_usage_stats`` (guidellm). Through the official ``openai``
client against the server, with the mock backend: only scheduling and the prefix cache
matter here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from conftest import ServerFactory, ServerHandle, wait_for

PROMPT = list(range(10, 30))  # 20 tokens: four full blocks of 4 before the last token


def client(srv: ServerHandle, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=60)


def cached_tokens(srv: ServerHandle, key: str = "unused", **extra: Any) -> int:
    out = client(srv, key).completions.create(model="mock", prompt=PROMPT, max_tokens=1,
                                              extra_body=extra or None)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return int(out.usage.prompt_tokens_details.cached_tokens or 0)


# ---------------------------------------------------------------------------- priority


def test_a_higher_priority_request_overtakes_lower_ones_in_the_queue(
    start_server: ServerFactory,
) -> None:
    # One sequence runs at a time; 5 ms per step.
    srv = start_server(token_latency_us=5000, max_running_seqs=1)
    c = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0,
                           timeout=60)

    async def run() -> list[str]:
        finished: list[str] = []

        async def one(name: str, priority: int, max_tokens: int) -> None:
            await c.completions.create(model="mock", prompt=[1, 2, 3], max_tokens=max_tokens,
                                       extra_body={"priority": priority, "ignore_eos": True})
            finished.append(name)

        # "busy" holds the only running slot for 10 s, long enough on any machine.
        busy = asyncio.ensure_future(one("busy", 0, 2000))
        await asyncio.to_thread(wait_for, lambda: srv.metrics()["running"] == 1, 10, "busy")
        low = asyncio.ensure_future(one("low", 1, 2))
        await asyncio.to_thread(wait_for, lambda: srv.metrics()["waiting"] == 1, 10, "low")
        high = asyncio.ensure_future(one("high", -1, 2))
        await asyncio.to_thread(wait_for, lambda: srv.metrics()["waiting"] == 2, 10, "high")
        busy.cancel()  # the client leaves: its request is aborted and the slot frees
        await asyncio.gather(low, high)
        return finished

    # Arrival order low, high; the queue admits high first.
    assert asyncio.run(run()) == ["high", "low"]
    srv.wait_idle()


@pytest.mark.parametrize(("value", "message"), [
    ("high", "priority must be an integer"),
    (1.5, "priority must be an integer"),
    (2**63, "priority must be in"),
    (-(2**63) - 1, "priority must be in"),
])
def test_bad_priority_is_a_400(shared_server: ServerHandle, value: Any, message: str) -> None:
    r = httpx.post(f"{shared_server.url}/v1/completions",
                   json={"prompt": [1, 2], "max_tokens": 1, "priority": value}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority"
    assert message in r.json()["error"]["message"]
    shared_server.wait_idle()


def test_extreme_priorities_are_accepted(shared_server: ServerHandle) -> None:
    for value in (-(2**63), 2**63 - 1, None):
        r = httpx.post(f"{shared_server.url}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                             "priority": value}, timeout=10)
        # The mock has no chat template: the request gets past the priority field to that.
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        r = httpx.post(f"{shared_server.url}/v1/completions",
                       json={"prompt": [1, 2], "max_tokens": 1, "priority": value}, timeout=10)
        assert r.status_code == 200, r.text
    shared_server.wait_idle()


# ---------------------------------------------------------------------------- cache salt


def test_the_same_cache_salt_shares_the_prefix_and_another_does_not(
    start_server: ServerFactory,
) -> None:
    srv = start_server(kv_block_size=4)
    assert cached_tokens(srv, cache_salt="alpha") == 0
    assert cached_tokens(srv, cache_salt="alpha") == 16
    assert cached_tokens(srv, cache_salt="beta") == 0
    assert cached_tokens(srv) == 0  # unsalted never meets salted blocks
    assert cached_tokens(srv) == 16
    assert cached_tokens(srv, cache_salt="beta") == 16
    for bad in ("", 5, "x" * 1025):
        r = httpx.post(f"{srv.url}/v1/completions",
                       json={"prompt": PROMPT, "max_tokens": 1, "cache_salt": bad}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", bad
    srv.wait_idle()


def test_each_api_key_is_a_tenant_with_its_own_prefix_cache(
    start_server: ServerFactory,
) -> None:
    srv = start_server(kv_block_size=4, api_key=["key-a", "key-b"])
    srv.headers = {"authorization": "Bearer key-b"}
    assert cached_tokens(srv, "key-a") == 0
    assert cached_tokens(srv, "key-a") == 16
    assert cached_tokens(srv, "key-b") == 0, "tenant b must not hit tenant a's blocks"
    assert cached_tokens(srv, "key-b") == 16
    # A client salt subdivides a tenant's cache, and never reaches into another tenant's.
    assert cached_tokens(srv, "key-a", cache_salt="s") == 0
    assert cached_tokens(srv, "key-b", cache_salt="s") == 0
    assert cached_tokens(srv, "key-a", cache_salt="s") == 16
    with pytest.raises(openai.AuthenticationError):
        cached_tokens(srv, "key-c")
    # /generate is salted by tenant too: tenant a's prompt is not served to tenant b.
    for key in ("key-a", "key-b"):
        status, lines = srv.generate({"prompt_token_ids": [7] * 20, "max_new_tokens": 1},
                                     headers={"authorization": f"Bearer {key}"})
        assert status == 200 and lines[-1]["done"]
    # Nine lookups of 20 tokens; hits: the three 16-token ones above and none since.
    assert srv.metrics()["prefix_cache_hit_rate"] == pytest.approx(48 / 180, abs=1e-4)
    srv.wait_idle()


def test_tenants_share_the_cache_when_the_server_says_so(start_server: ServerFactory) -> None:
    srv = start_server(kv_block_size=4, api_key=["key-a", "key-b"],
                       app_options={"isolate_tenant_caches": False})
    srv.headers = {"authorization": "Bearer key-a"}
    assert cached_tokens(srv, "key-a") == 0
    assert cached_tokens(srv, "key-b") == 16
    srv.wait_idle()


def test_api_keys_come_from_flags_a_file_or_the_environment(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from iron_batch.server.cli import api_keys, build_parser

    parser = build_parser()
    keyfile = tmp_path / "keys"
    keyfile.write_text("# tenants\nkey-b\n\nkey-c\nkey-a\n")
    args = parser.parse_args(["--api-key", "key-a", "--api-key-file", str(keyfile)])
    assert api_keys(args, parser) == ["key-a", "key-b", "key-c"]
    monkeypatch.setenv("IRON_BATCH_API_KEY", "from-env")
    assert api_keys(parser.parse_args([]), parser) == ["from-env"]
    assert api_keys(parser.parse_args(["--api-key", "x"]), parser) == ["x"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(SystemExit):
        api_keys(parser.parse_args(["--api-key-file", str(empty)]), parser)
    with pytest.raises(SystemExit):
        api_keys(parser.parse_args(["--api-key-file", str(tmp_path / "missing")]), parser)


# ---------------------------------------------------------------------------- usage stats


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(
    shared_server: ServerHandle,
) -> None:
    chunks = list(client(shared_server).completions.create(
        model="mock", prompt=[5, 6, 7], max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore
        extra_body={"ignore_eos": True},
    ))
    content = [ch for ch in chunks if ch.choices]
    assert len(content) == 6
    for i, ch in enumerate(content, start=1):
        assert ch.usage is not None
        assert (ch.usage.prompt_tokens, ch.usage.completion_tokens) == (3, i)
        assert ch.usage.total_tokens == 3 + i
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert final.usage.completion_tokens == 6
    # Without it, only the last chunk carries usage (and the others say null).
    plain = list(client(shared_server).completions.create(
        model="mock", prompt=[5, 6, 7], max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    ))
    assert all(ch.usage is None for ch in plain[:-1]) and plain[-1].usage is not None
    shared_server.wait_idle()
