"""Grammar strings for llguidance from what clients ask for, validated before anything runs.

Every builder returns llguidance's JSON grammar text, or raises :class:`GrammarError` with a
message fit for a 400. Validation needs no tokenizer, so the server checks a request's
grammar at parse time even when the model runs in a remote worker.
"""

from __future__ import annotations

import json
from typing import Any

#: JSON layout the grammar allows: no free whitespace (a small model would otherwise pad
#: forever), and the separators models see most in training text.
_JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A schema, regex or choice list that cannot become a grammar."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise GrammarError(
            "structured output needs the llguidance package (pip install llguidance)"
        ) from None
    return llguidance


def validate_grammar(grammar: str) -> str:
    """``grammar`` if llguidance accepts it, else GrammarError with its reason."""
    llg = _llguidance()
    try:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None
    if is_error:
        raise GrammarError(messages[0] if messages else "invalid grammar")
    return grammar


#: Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE_SCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: What lets an object schema take properties it does not list.
_OPEN_OBJECT = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def strict_schema(schema: Any, *, closable: bool = True) -> Any:
    """``schema`` with every object that lists its ``properties`` closed to other names.

    JSON Schema lets an object carry properties it never declared, and a small model under
    such a grammar invents them (a forced tool call grows a ``"weather": "..."`` argument
    until the token limit cuts the JSON). Generated output keeps to the declared names
    unless the schema opens the object itself (``additionalProperties`` true or a schema,
    ``patternProperties``). An object that declares no properties (``{"type": "object"}``)
    stays open. ``allOf`` members are left open: closing each would forbid the others'
    names. The client's schema is not modified.
    """
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ONE_SCHEMA and not isinstance(value, list):
            out[key] = strict_schema(value)
        elif key in (*_SCHEMA_LISTS, "items") and isinstance(value, list):  # old-style items
            out[key] = [strict_schema(v) for v in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [strict_schema(v, closable=False) for v in value]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: strict_schema(v) for name, v in value.items()}
        else:
            out[key] = value
    if closable and isinstance(schema.get("properties"), dict) and not any(
        k in schema for k in _OPEN_OBJECT
    ):
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema: Any) -> str:
    """Output that is one JSON value valid against ``schema`` (a JSON Schema object),
    keeping to the properties it declares (see :func:`strict_schema`)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    try:
        schema = strict_schema(schema)
    except RecursionError:
        raise GrammarError("invalid JSON schema: nested too deeply") from None
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_LAYOUT)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None
    try:
        return validate_grammar(grammar)
    except GrammarError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    """Output that matches ``pattern`` whole."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError("a regex must be a non-empty string")
    llg = _llguidance()
    try:
        return validate_grammar(llg.LLMatcher.grammar_from_regex(pattern))
    except GrammarError as exc:
        raise GrammarError(f"invalid regex: {exc}") from None


def choice_grammar(choices: Any) -> str:
    """Output that is exactly one of ``choices`` (non-empty strings)."""
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise GrammarError("choices must be a non-empty list of non-empty strings")
    # Lark string literals are JSON strings; one alternative per choice.
    alternatives = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    llg = _llguidance()
    return validate_grammar(llg.LLMatcher.grammar_from_lark(f"start: {alternatives}\n"))
