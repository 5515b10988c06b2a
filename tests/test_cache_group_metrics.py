"""/metrics (JSON and Prometheus), the banner and the page's snapshots show each cache
group's pool; a server without cache groups shows what it always did."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from conftest import ServerFactory
from iron_batch import CacheGroup
from iron_batch.server.ui import banner

GROUPS = [CacheGroup("sliding", 64, window=8), CacheGroup("full", 48), CacheGroup("state", 6)]


def _generate(url: str, tokens: int) -> int:
    with httpx.stream("POST", f"{url}/generate", headers={"content-type": "application/json"},
                      content=json.dumps({"prompt_tokens": 40, "max_new_tokens": tokens})) as r:
        assert r.status_code == 200
        return sum(1 for line in r.iter_lines() if line)


def test_metrics_and_banner_show_each_cache_group(start_server: ServerFactory) -> None:
    srv = start_server(kv_block_size=4, cache_groups=GROUPS)
    assert _generate(srv.url, 30) == 30
    m = srv.wait_idle()
    groups = m["cache_groups"]
    assert [(g["kind"], g["window"], g["total"]) for g in groups] == [
        ("sliding", 8, 64), ("full", None, 48), ("state", None, 6)]
    # Idle again: nothing held in any group; the finished request's blocks stay cached.
    assert all(g["used"] == 0 and g["free"] == g["total"] for g in groups)
    assert groups[1]["cached"] > 0
    text = httpx.get(f"{srv.url}/metrics", headers={"accept": "text/plain"}).text
    assert 'iron_batch_cache_group_total{group="0",kind="sliding"} 64.0' in text
    assert 'iron_batch_cache_group_used{group="2",kind="state"} 0.0' in text
    info = srv.server.config.app.state.info
    assert "groups   0: sliding 8, 64 blocks; 1: full, 48 blocks; 2: state, 6 slots" in banner(
        info, ["http://h:1/"], ui=False)
    # The page's sampler takes a snapshot about once a second.
    deadline = time.monotonic() + 30
    snaps: list[dict[str, Any]] = []
    while not snaps and time.monotonic() < deadline:
        snaps = httpx.get(f"{srv.url}/ui/api/snapshots").json()["snapshots"]
        time.sleep(0.2)
    assert [g["kind"] for g in snaps[-1]["cache_groups"]] == ["sliding", "full", "state"]


def test_a_server_without_cache_groups_shows_none(start_server: ServerFactory) -> None:
    srv = start_server(kv_block_size=4)
    assert _generate(srv.url, 3) == 3
    assert "cache_groups" not in srv.wait_idle()
    assert "cache_group" not in httpx.get(f"{srv.url}/metrics",
                                          headers={"accept": "text/plain"}).text
    assert "groups" not in banner(srv.server.config.app.state.info, ["http://h:1/"], ui=False)
