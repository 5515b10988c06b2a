"""The pages a user reads: their commands run with today's flags, docs/api.md is what the
server's own OpenAPI document renders, and ``--help`` groups the server's flags."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def _parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    from iron_batch import bench_client, worker
    from iron_batch.server import cli

    return {
        "iron_batch.server": cli.build_parser,
        "iron-batch-server": cli.build_parser,
        "iron_batch.bench_client": bench_client.build_parser,
        "iron_batch.worker": worker.build_parser,
    }


def shell_blocks(text: str) -> Iterator[str]:
    """The bodies of the page's ```sh (or bash, console) code blocks."""
    for m in re.finditer(r"^```(?:sh|bash|shell|console)\n(.*?)^```", text, re.S | re.M):
        yield m.group(1)


def commands(block: str) -> Iterator[list[str]]:
    """Each simple command of a block: continuation lines joined, comments dropped, split
    at `&&`, `||`, `;`, `|` and `&`."""
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        for token in lexer:
            if set(token) <= set("&|;"):
                if current:
                    yield current
                current = []
            else:
                current.append(token)
        if current:
            yield current


def program_args(argv: list[str], names: set[str]) -> tuple[str, list[str]] | None:
    """(program, its arguments) when the command runs one of ``names``, as ``python -m X``,
    ``torchrun ... -m X`` or the installed script."""
    for i, token in enumerate(argv):
        if token in names and (i == 0 or argv[i - 1] == "-m"):
            return token, argv[i + 1:]
    return None


def documented_commands() -> list[tuple[str, str, list[str]]]:
    names = set(_parsers())
    found = []
    for page in PAGES:
        for block in shell_blocks(page.read_text(encoding="utf-8")):
            for argv in commands(block):
                hit = program_args(argv, names)
                if hit is not None:
                    found.append((page.name, *hit))
    return found


def test_the_command_splitter_finds_each_command() -> None:
    block = ("pip install . && python -m iron_batch.server --addr 127.0.0.1:8080 &\n"
             "# a comment -m iron_batch.server --nope\n"
             "torchrun --nnodes 2 \\\n    -m iron_batch.server --backend torch  # tail\n")
    got = [program_args(c, {"iron_batch.server"}) for c in commands(block)]
    assert got == [None, ("iron_batch.server", ["--addr", "127.0.0.1:8080"]),
                   ("iron_batch.server", ["--backend", "torch"])]


def test_every_documented_server_and_client_command_parses() -> None:
    """A flag renamed or removed without updating the pages fails here, naming the page."""
    parsers = _parsers()
    found = documented_commands()
    shown = {(page, program) for page, program, _ in found}
    # The README shows the server, the bench client and the worker; without them the
    # extraction itself broke and the test below would check nothing.
    for program in ("iron_batch.server", "iron_batch.bench_client", "iron_batch.worker"):
        assert ("README.md", program) in shown, program
    bad = []
    for page, program, args in found:
        parser = parsers[program]()
        parser.exit_on_error = False
        try:
            parser.parse_args(args)
        except (argparse.ArgumentError, SystemExit) as exc:
            bad.append(f"{page}: {program} {shlex.join(args)}: {exc}")
    assert not bad, "\n".join(bad)


def test_api_page_is_what_the_openapi_document_renders() -> None:
    from iron_batch.server.api_markdown import render

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert page == render(), (
        "docs/api.md is out of date: python -m iron_batch.server.api_markdown --write")


def test_api_page_lists_every_endpoint_and_field() -> None:
    from iron_batch.server.openapi import openapi_schema

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    doc = openapi_schema("MODEL", ui=True)
    for path, item in doc["paths"].items():
        for method in item:
            assert f"### {method.upper()} {path}\n" in page
    for name in ("temperature", "max_new_tokens", "response_format", "tool_choice", "echo"):
        assert f"`{name}`" in page
    assert "| 503 |" in page and "| 413 |" in page


def test_help_groups_the_server_flags_and_shows_defaults() -> None:
    out = subprocess.run([sys.executable, "-m", "iron_batch.server", "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    headings = [line[:-1] for line in out.splitlines()
                if line.endswith(":") and not line.startswith(" ")]
    groups = ["model", "memory", "scheduling", "remote worker and tensor parallelism",
              "server", "limits", "auth", "tuning"]
    assert [h for h in headings if h in groups] == groups
    from iron_batch.server.cli import build_parser

    for action in build_parser()._actions:
        if action.option_strings and action.default not in (None, False, "", argparse.SUPPRESS):
            assert "default" in (action.help or ""), action.option_strings
    members = {g.title: {o for a in g._group_actions for o in a.option_strings}
               for g in build_parser()._action_groups}
    for flag, group in (("--model", "model"), ("--total-kv-blocks", "memory"),
                        ("--max-batch-tokens", "scheduling"), ("--api-key", "auth"),
                        ("--tensor-parallel-size", "remote worker and tensor parallelism"),
                        ("--max-body-bytes", "limits"), ("--addr", "server")):
        assert flag in members[group], (flag, group)


WORDS = re.compile(r"\bsessions?\b|\bruns? [A-J](?![/\w])|\b[A-J]-[A-J]\b")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_do_not_tell_how_the_work_was_done(page: Path) -> None:
    """Figures and notes describe the code as it is; its history lives in git."""
    hits = [line for line in page.read_text(encoding="utf-8").splitlines()
            if WORDS.search(line)]
    assert not hits, "\n".join(hits)


#: Written by the model-layer redesign, which lands beside this page set.
def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, spaces to '-', punctuation dropped."""
    out = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    for m in re.finditer(r"^#+ (.*)$", text, re.M):
        text = re.sub(r"[`*]", "", m.group(1)).strip().lower()
        out.add("".join(c for c in text.replace(" ", "-") if c.isalnum() or c in "-_"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_lead_somewhere(page: Path) -> None:
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no such heading")
    assert not bad, "\n".join(bad)
