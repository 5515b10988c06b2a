"""``response_format`` and vLLM's guided-decoding fields -> one grammar for the request.

OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}`` and
``{"type": "json_object"}``, plus vLLM's extras (``guided_json``, ``guided_regex``,
``guided_choice``, or the newer ``structured_outputs: {"json"|"regex"|"choice": ...}``).
A request may ask for one of them; an invalid schema or regex is a 400 here, before
anything is queued, and so is any constraint on a backend that cannot enforce it.
"""

from __future__ import annotations

import json
from typing import Any

from iron_batch.server.errors import ApiError
from iron_batch.structured import (
    GrammarError,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    regex_grammar,
)

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}


def _compile(kind: str, value: Any, param: str) -> str:
    try:
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise GrammarError("the JSON schema is not valid JSON") from None
            return json_schema_grammar(value)
        if kind == "regex":
            return regex_grammar(value)
        return choice_grammar(value)
    except GrammarError as exc:
        raise ApiError(str(exc), param=param) from None


def _response_format(fmt: Any) -> str | None:
    param = "response_format"
    if not isinstance(fmt, dict):
        raise ApiError("response_format must be an object", param=param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        try:
            return json_object_grammar()
        except GrammarError as exc:
            raise ApiError(str(exc), param=param) from None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(
                "response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                "\"schema\": {...}}}",
                param=param,
            )
        return _compile("json", spec["schema"], f"{param}.json_schema.schema")
    raise ApiError(
        "response_format type must be text, json_object or json_schema", param=param
    )


def read_constraint(body: dict[str, Any], supported: bool) -> str | None:
    """The grammar ``body`` asks for (None: free text). ``supported``: whether the backend
    can enforce one (a 400 otherwise)."""
    found: list[tuple[str, str | None]] = []
    if body.get("response_format") is not None:
        found.append(("response_format", _response_format(body["response_format"])))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _compile(kind, body[name], name)))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise ApiError("structured_outputs must be an object", param="structured_outputs")
        for kind in ("json", "regex", "choice"):
            if outputs.get(kind) is not None:
                name = f"structured_outputs.{kind}"
                found.append((name, _compile(kind, outputs[kind], name)))
    grammars = [(name, g) for name, g in found if g is not None]
    if len(grammars) > 1:
        raise ApiError(
            f"ask for one output constraint, not {' and '.join(n for n, _ in grammars)}",
            param=grammars[1][0],
        )
    if not grammars:
        return None
    name, grammar = grammars[0]
    require_support(supported, name)
    return grammar


def require_support(supported: bool, param: str) -> None:
    if not supported:
        raise ApiError(
            f"{param} needs constrained decoding, which this server's backend does not "
            "support (the mock backend has no logits; a torch model with a tokenizer does)",
            param=param,
        )
