"""The XML tool-call format of Qwen3.5 (and Qwen3-Coder / Qwen3-Next) templates, inside
the usual ``<tool_call>`` tags::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's text is its value: kept as a string where the tool's schema says the
parameter is one, else read as JSON (numbers, booleans, objects, lists), falling back to
the string when it does not parse.
"""

from __future__ import annotations

import json
import re
from typing import Any

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                        re.DOTALL)


def _value(text: str, schema: Any) -> Any:
    # The template writes each value on lines of its own: one newline either side.
    text = text.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and kind == ["string"]):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def xml_calls(body: str, names: set[str], schemas: dict[str, dict[str, Any]]
              ) -> list[tuple[str, dict[str, Any]]] | None:
    """(name, arguments) of each ``<function=...>`` in one tool-call block's body, or None
    when the body is not in this format or names an undeclared tool."""
    body = body.strip()
    if not body.startswith("<function="):
        return None
    calls = []
    for name, inner in _FUNCTION.findall(body):
        name = name.strip()
        if name not in names:
            return None
        properties = (schemas.get(name) or {}).get("properties") or {}
        args = {key.strip(): _value(raw, properties.get(key.strip()))
                for key, raw in _PARAMETER.findall(inner)}
        calls.append((name, args))
    return calls or None
