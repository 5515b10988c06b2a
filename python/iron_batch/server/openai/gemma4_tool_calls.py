"""Gemma 4's own tool-call format, read from its output and written into its prompts::

    Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

After ``call:`` comes the function's name and its arguments as an object whose keys are
bare words and whose strings sit between two ``<|"|>`` tokens, with no escaping inside;
numbers, ``true``, ``false`` and ``null`` are bare, and objects ``{...}`` and lists
``[...]`` nest the same way. Several calls may follow each other; text around them is
content. A result goes back as ``<|tool_response>response:NAME{...}<tool_response|>``.

All of these markers are special tokens of Gemma 4's tokenizer, which decoding skips by
default: requests whose output may hold such calls keep them (:data:`KEEP_TOKENS`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

OPEN, CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
RESPONSE_OPEN, RESPONSE_CLOSE = "<|tool_response>", "<tool_response|>"
DECLARATION_OPEN, DECLARATION_CLOSE = "<|tool>", "<tool|>"
#: The special tokens a call is written with: kept in decoded text for ``auto`` requests.
KEEP_TOKENS = (OPEN, CLOSE, QUOTE)

_NAME = re.compile(r"call:([A-Za-z0-9_.-]+)\s*")
_KEY = re.compile(r"[A-Za-z0-9_.$-]+")
_BARE = re.compile(r"[^,}\]\s]+")
_SPACE = re.compile(r"\s*")


class _Malformed(ValueError):
    pass


def _skip(text: str, i: int) -> int:
    m = _SPACE.match(text, i)
    return m.end() if m else i


def _string(text: str, i: int) -> tuple[str, int]:
    """The ``<|"|>``-quoted string starting at ``i``."""
    end = text.find(QUOTE, i + len(QUOTE))
    if end == -1:
        raise _Malformed("unclosed string")
    return text[i + len(QUOTE):end], end + len(QUOTE)


def _value(text: str, i: int) -> tuple[Any, int]:
    i = _skip(text, i)
    if text.startswith(QUOTE, i):
        return _string(text, i)
    if text.startswith("{", i):
        return _object(text, i)
    if text.startswith("[", i):
        items: list[Any] = []
        i = _skip(text, i + 1)
        if text.startswith("]", i):
            return items, i + 1
        while True:
            item, i = _value(text, i)
            items.append(item)
            i = _skip(text, i)
            if text.startswith(",", i):
                i += 1
            elif text.startswith("]", i):
                return items, i + 1
            else:
                raise _Malformed("list without its ]")
    if text.startswith('"', i):
        # A JSON string, as the model sometimes writes one.
        try:
            return json.JSONDecoder().raw_decode(text, i)
        except ValueError:
            raise _Malformed("bad JSON string") from None
    m = _BARE.match(text, i)
    if not m:
        raise _Malformed("missing value")
    try:
        value = json.loads(m.group())
    except ValueError:
        raise _Malformed(f"bare value {m.group()!r}") from None
    if isinstance(value, (dict, list, str)) or (
        isinstance(value, float) and not math.isfinite(value)
    ):
        raise _Malformed(f"bare value {m.group()!r}")
    return value, m.end()


def _object(text: str, i: int) -> tuple[dict[str, Any], int]:
    """The ``{key:value,...}`` object starting at ``i``."""
    out: dict[str, Any] = {}
    i = _skip(text, i + 1)
    if text.startswith("}", i):
        return out, i + 1
    while True:
        i = _skip(text, i)
        if text.startswith(QUOTE, i):
            key, i = _string(text, i)
        else:
            m = _KEY.match(text, i)
            if not m:
                raise _Malformed("missing key")
            key, i = m.group(), m.end()
        i = _skip(text, i)
        if not text.startswith(":", i):
            raise _Malformed("key without a value")
        out[key], i = _value(text, i + 1)
        i = _skip(text, i)
        if text.startswith(",", i):
            i += 1
        elif text.startswith("}", i):
            return out, i + 1
        else:
            raise _Malformed("object without its }")


def _block(text: str, i: int, names: set[str]) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """The calls of the block whose body starts at ``i`` and where the text after its
    closing tag (or the end of the text, where the output stops after the last brace)
    starts."""
    calls = []
    while True:
        i = _skip(text, i)
        m = _NAME.match(text, i)
        if not m or m.group(1) not in names:
            raise _Malformed("not a call of a declared tool")
        if not text.startswith("{", m.end()):
            raise _Malformed("call without arguments")
        args, i = _object(text, m.end())
        calls.append((m.group(1), args))
        i = _skip(text, i)
        if text.startswith(CLOSE, i):
            return calls, i + len(CLOSE)
        if i == len(text) or text.startswith(OPEN, i):
            return calls, i
        if text.startswith(",", i):
            i += 1


def gemma4_calls(
    text: str, names: set[str]
) -> tuple[str, list[tuple[str, dict[str, Any]]]] | None:
    """(the text outside the calls, each call's (name, arguments)) of an output holding
    ``<|tool_call>`` blocks, or None when a block does not parse or calls an undeclared
    tool (the whole output is then content)."""
    content: list[str] = []
    calls: list[tuple[str, dict[str, Any]]] = []
    i = 0
    while (start := text.find(OPEN, i)) != -1:
        content.append(text[i:start])
        try:
            found, i = _block(text, start + len(OPEN), names)
        except _Malformed:
            return None
        calls.extend(found)
    content.append(text[i:])
    return "".join(content), calls


# ---------------------------------------------------------------------------- writing


def _format(value: Any) -> str:
    if isinstance(value, str):
        return f"{QUOTE}{value}{QUOTE}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_format(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_format(v) for v in value) + "]"
    return json.dumps(value)


def write_declaration(function: dict[str, Any]) -> str:
    """A tool's declaration (an OpenAI ``function`` object) as Gemma 4 reads one."""
    fields = {k: function[k] for k in ("description", "parameters") if function.get(k)}
    return f"{DECLARATION_OPEN}declaration:{function['name']}{_format(fields)}{DECLARATION_CLOSE}"


def write_call(name: str, arguments: Any) -> str:
    """One call as Gemma 4 writes it (arguments: an object, or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            arguments = {"arguments": arguments}
    if not isinstance(arguments, dict):
        arguments = {"value": arguments}
    return f"{OPEN}call:{name}{_format(arguments)}{CLOSE}"


def write_response(name: str, content: str) -> str:
    """A tool's result (its text) as Gemma 4's own template writes one."""
    return f"{RESPONSE_OPEN}response:{name}{{value:{_format(content)}}}{RESPONSE_CLOSE}"
