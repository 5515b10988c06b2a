"""The page at ``/``: its endpoints over HTTP, and the page itself in headless Chromium.

The browser tests drive the system Chromium (Debian's ``chromium`` package, or the binary
named by ``$IRON_BATCH_CHROMIUM``) through Playwright; nothing is downloaded. They skip,
saying why, when either is missing. Screenshots go to ``$IRON_BATCH_ARTIFACTS`` (default:
``<tmp>/iron-batch-artifacts``), never into the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import (
    CharTokenizer,
    ServerFactory,
    ServerStarter,
    TextMockBackend,
    wait_for,
)
from iron_batch.server.ui import MetricsHistory, banner
from iron_batch.stats import EngineStats

# ---------------------------------------------------------------- without a browser


def test_static_files_are_package_data() -> None:
    static = resources.files("iron_batch.server") / "static"
    for name in ("index.html", "app.js", "style.css"):
        assert (static / name).is_file(), name
    # Offline: the page references nothing outside this server.
    for name in ("index.html", "app.js", "style.css"):
        text = (static / name).read_text()
        assert "http://" not in text and "https://" not in text, name


def test_page_info_and_snapshots(start_server: ServerFactory) -> None:
    server = start_server(total_kv_blocks=64, kv_block_size=8)
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/ui/app.js" in page.text
    assert httpx.get(server.url + "/ui/app.js").status_code == 200
    assert httpx.get(server.url + "/ui/style.css").status_code == 200
    info = httpx.get(server.url + "/ui/api/info").json()
    assert info["backend"] == "mock" and info["model"] == "mock"
    assert info["kv"] == {"blocks": 64, "block_size": 8, "tokens": 512, "bytes": None,
                          "dtype": None}
    assert info["tokenizer"] is False and info["auth"] is False
    status, _ = server.generate({"prompt_tokens": 8, "max_new_tokens": 16})
    assert status == 200

    def moved() -> list[dict[str, Any]]:
        snaps = httpx.get(server.url + "/ui/api/snapshots?after=0").json()["snapshots"]
        return [s for s in snaps if s["tokens_generated"] >= 16]

    snap = wait_for(moved, 10, "a snapshot after the request")[0]
    assert snap["kv_blocks_total"] == 64 and snap["ttft_p50_ms"] is not None
    last = httpx.get(server.url + "/ui/api/snapshots?after=0").json()["snapshots"][-1]["seq"]
    newer = httpx.get(f"{server.url}/ui/api/snapshots?after={last}").json()["snapshots"]
    assert all(s["seq"] > last for s in newer)
    bad = httpx.get(server.url + "/ui/api/snapshots?after=x")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"


def test_no_ui_and_unchanged_endpoints(start_server: ServerFactory) -> None:
    server = start_server(app_options={"ui": False})
    for path in ("/", "/ui/api/info", "/ui/app.js"):
        assert httpx.get(server.url + path).status_code == 404, path
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert "tokens_per_sec" in server.metrics()


def test_ui_data_needs_the_key_the_page_does_not(start_server: ServerFactory) -> None:
    server = start_server(api_key="sekret")
    assert httpx.get(server.url + "/").status_code == 200
    assert httpx.get(server.url + "/ui/app.js").status_code == 200
    for path in ("/ui/api/info", "/ui/api/snapshots"):
        assert httpx.get(server.url + path).status_code == 401, path
        ok = httpx.get(server.url + path, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200, path


def test_history_is_bounded_and_windows_latency() -> None:
    stats = EngineStats()
    history = MetricsHistory(stats, size=5)
    for _ in range(3):
        stats.ttft.observe(0.010)
    first = history.take()
    assert first["ttft_p50_ms"] == pytest.approx(10, rel=0.05)  # everything so far
    second = history.take()
    assert second["ttft_p50_ms"] is None  # nothing new in the window
    stats.ttft.observe(0.5)
    stats.tokens_generated += 10
    third = history.take()
    assert third["ttft_p50_ms"] == pytest.approx(500, rel=0.05)
    assert third["tokens_per_sec"] > 0
    for _ in range(10):
        history.take()
    assert len(history.snapshots) == 5
    assert [s["seq"] for s in history.after(11)] == [12, 13]


def test_banner_names_url_model_pool_and_limits(start_server: ServerFactory) -> None:
    server = start_server(total_kv_blocks=64, kv_block_size=8)
    info = server.server.config.app.state.info
    text = banner(info, ["http://localhost:8080/"], ui=True)
    assert "http://localhost:8080/" in text and "--no-ui" in text
    assert "mock" in text and "64 blocks x 8 tokens = 512 tokens" in text
    assert "waiting requests" in text
    assert "--no-ui" not in banner(info, ["http://h:1/"], ui=False)


def test_cli_prints_the_banner_when_listening() -> None:
    from conftest import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "iron_batch.server", "--addr", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
    finally:
        proc.terminate()
        proc.wait(30)
    assert lines[0].startswith("iron-batch server ready"), lines
    assert f"http://127.0.0.1:{port}/" in lines[1]


# ---------------------------------------------------------------- in a browser


def _chromium() -> str | None:
    env = os.environ.get("IRON_BATCH_CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = _chromium()
    if executable is None:
        pytest.skip("no Chromium installed (apt-get install chromium, or set "
                    "IRON_BATCH_CHROMIUM); the page's browser tests need one")
    from playwright.sync_api import sync_playwright  # in the test extra
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1360, "height": 860})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def artifacts_dir() -> Path:
    path = Path(os.environ.get("IRON_BATCH_ARTIFACTS")
                or Path(tempfile.gettempdir()) / "iron-batch-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


class ChatCharTokenizer(CharTokenizer):
    """CharTokenizer with a "chat template": the user messages' letters, concatenated."""

    chat_template = "letters"

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        return "".join(c for m in messages for c in str(m["content"]) if "a" <= c <= "z")


def test_chat_streams_tokens_with_stats(start_server: ServerFactory, page: Any) -> None:
    backend = TextMockBackend(token_latency_us=40_000)  # 25 tok/s: streaming is visible
    backend.tokenizer = ChatCharTokenizer()  # type: ignore[assignment]
    server = start_server(backend)
    page.goto(server.url + "/")
    page.wait_for_selector("#main:not([hidden])")
    assert "mock-text" in page.inner_text("#model-name")
    assert page.is_checked("input[name=mode][value=chat]")
    page.fill("#max_tokens", "24")
    page.fill("#seed", "7")
    page.fill("#prompt", "hello")
    # Every text the reply shows, recorded in the page as the DOM changes.
    page.evaluate("""() => {
        window.__seen = [];
        new MutationObserver(() => {
            const body = document.querySelector('.msg.assistant .body');
            const text = body ? body.innerText : '';
            const seen = window.__seen;
            if (text && (!seen.length || seen[seen.length - 1] !== text)) seen.push(text);
        }).observe(document.body, {subtree: true, childList: true, characterData: true});
    }""")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-done]", timeout=20_000)
    reply = page.locator(".msg.assistant .body")
    seen: list[str] = page.evaluate("window.__seen")
    final = reply.inner_text()
    assert len(final) == 24 and final.isalpha()
    # Streamed: the page showed partial replies that grew into the final one.
    partial = [s for s in seen if 0 < len(s) < 24]
    assert len(partial) >= 2, seen
    assert all(final.startswith(s) for s in seen)
    stats = page.inner_text(".msg.assistant .stats")
    assert "24 tokens" in stats and "TTFT" in stats and "tok/s" in stats, stats
    # The conversation continues: the second turn sends the history too.
    page.fill("#prompt", "more")
    page.click("#send")
    wait_for(lambda: page.locator(".msg.assistant[data-done]").count() == 2, 20, "2nd reply")
    artifacts = artifacts_dir()
    page.screenshot(path=str(artifacts / "ui-chat.png"))


def test_mock_raw_mode_shows_token_ids(start_server: ServerFactory, page: Any) -> None:
    server = start_server(token_latency_us=2000)
    page.goto(server.url + "/")
    page.wait_for_selector("#main:not([hidden])")
    # No tokenizer: raw mode is chosen and chat says why it cannot work.
    assert page.is_checked("input[name=mode][value=raw]")
    page.check("input[name=mode][value=chat]")
    assert "no tokenizer" in page.inner_text("#mode-note")
    assert page.is_disabled("#send")
    page.check("input[name=mode][value=raw]")
    page.fill("#max_tokens", "8")
    page.fill("#prompt", "1 2 3, 4")
    page.click("#send")
    page.wait_for_selector(".msg.completion[data-done]", timeout=20_000)
    tokens = page.locator(".msg.completion .tok.id")
    assert tokens.count() == 8
    first = tokens.first
    assert first.inner_text().isdigit()
    assert f"id {first.inner_text()}" in (first.get_attribute("title") or "")
    assert "8 tokens" in page.inner_text(".msg.completion .stats")
    # Bad token ids are a message on the page, not a request.
    page.fill("#prompt", "one two")
    page.click("#send")
    page.wait_for_selector(".msg.error")


def test_dashboard_moves_under_load(start_server: ServerFactory, page: Any) -> None:
    server = start_server(token_latency_us=3000, total_kv_blocks=512, kv_block_size=16)
    page.goto(server.url + "/")
    page.wait_for_selector("#main:not([hidden])")
    assert "512 blocks × 16 tokens" in page.inner_text("#config")
    wait_for(lambda: page.inner_text("#stat-tokens") == "0", 10, "first snapshot")
    client = subprocess.Popen(
        [sys.executable, "-m", "iron_batch.bench_client", "--url", server.url,
         "--concurrency", "32", "--total-requests", "320", "--prompt-tokens", "64",
         "--max-new-tokens", "64", "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        def busy() -> bool:
            running = page.inner_text("#stat-running")
            return running.isdigit() and int(running) > 0
        wait_for(busy, 20, "running sequences on the dashboard")
        wait_for(lambda: page.inner_text("#stat-tok-s") not in ("–", "0.0"), 20, "tok/s")
        tokens_a = int(page.inner_text("#stat-tokens").replace(",", ""))
        wait_for(lambda: int(page.inner_text("#stat-tokens").replace(",", "")) > tokens_a,
                 10, "tokens generated to grow")
        wait_for(lambda: page.inner_text("#stat-ttft") != "– / –", 10, "TTFT percentiles")
        assert page.inner_text("#stat-kv").endswith("%")

        def drawn() -> int:
            """Non-background pixels of the tok/s plot."""
            return int(page.evaluate("""() => {
                const c = document.getElementById('chart-tok-s');
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++;
                return n; }"""))

        # The plots drew something: a canvas with non-background pixels.
        wait_for(lambda: drawn() > 100, 10, "points on the tok/s plot")
        assert drawn() > 100
        page.screenshot(path=str(artifacts_dir() / "ui-dashboard.png"))
    finally:
        client.terminate()
        _, err = client.communicate(timeout=30)
    assert client.returncode in (0, -15), err


def test_api_key_prompt_and_no_data_without_it(start_server: ServerFactory, page: Any) -> None:
    server = start_server(api_key="sekret", token_latency_us=500)
    page.goto(server.url + "/")
    page.wait_for_selector("#auth:not([hidden])")
    assert page.is_hidden("#main")
    assert page.inner_text("#config") == ""
    assert page.inner_text("#stat-tokens") == "–"
    assert "mock" not in page.inner_text("header")
    page.fill("#auth-key", "wrong")
    page.click("#auth-form button")
    page.wait_for_selector("#auth-error:not([hidden])")
    assert page.is_hidden("#main")
    page.fill("#auth-key", "sekret")
    page.click("#auth-form button")
    page.wait_for_selector("#main:not([hidden])")
    assert "mock" in page.inner_text("#model-name")
    assert "required" in page.inner_text("#config")
    # Kept in this tab only: session storage, not local storage or a cookie.
    assert page.evaluate("() => sessionStorage.getItem('iron-batch-api-key')") == "sekret"
    assert page.evaluate("() => localStorage.length") == 0
    assert page.context.cookies() == []
    # The playground sends it too.
    page.fill("#max_tokens", "4")
    page.fill("#prompt", "5 6 7")
    page.click("#send")
    page.wait_for_selector(".msg.completion[data-done]", timeout=20_000)
    assert page.locator(".msg.completion .tok.id").count() == 4
    # Forgetting it locks the page again.
    page.click("#forget-key")
    page.wait_for_selector("#auth:not([hidden])")
    assert page.is_hidden("#main")


@pytest.fixture(scope="module")
def torch_server() -> Iterator[Any]:
    """One server on the tiny torch checkpoint (byte tokenizer, chat template) per module."""
    from iron_batch.backends.torch_backend import TorchBackend
    from tiny_models import checkpoint

    backend = TorchBackend.from_model(
        str(checkpoint("llama")), device="cpu", dtype="float32",
        total_kv_blocks=64, kv_block_size=4,
    )
    starter = ServerStarter()
    yield starter(backend, total_kv_blocks=64, kv_block_size=4)
    starter.close()


def test_torch_info_names_dtype_device_and_kv_bytes(torch_server: Any) -> None:
    server = torch_server
    info = httpx.get(server.url + "/ui/api/info").json()
    assert info["backend"] == "torch"
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["tokenizer"] is True and info["chat_template"] is True
    assert info["kv"]["bytes"] > 0
    text = banner(info, ["http://localhost:1/"], ui=True)
    assert "torch backend, float32 on cpu" in text and "KiB" in text


def test_torch_chat_and_raw_text_in_the_browser(torch_server: Any, page: Any) -> None:
    server = torch_server
    page.goto(server.url + "/")
    page.wait_for_selector("#main:not([hidden])")
    assert "float32 on cpu" in page.inner_text("#model-name")
    page.fill("#max_tokens", "6")
    page.fill("#prompt", "Hello there")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-done]", timeout=30_000)
    assert "6 tokens" in page.inner_text(".msg.assistant .stats")
    page.check("input[name=mode][value=raw]")
    page.fill("#prompt", "Once upon")
    page.click("#send")
    page.wait_for_selector(".msg.completion[data-done]", timeout=30_000)
    tokens = page.locator(".msg.completion .tok")
    assert tokens.count() == 6
    assert (tokens.first.get_attribute("title") or "").startswith("token 0: id ")
