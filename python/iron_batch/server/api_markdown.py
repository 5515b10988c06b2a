"""docs/api.md, rendered from the OpenAPI document the server serves at /openapi.json.

The endpoint list, every request field with its type, range and default, and every status
an endpoint answers come from :func:`iron_batch.server.openapi.openapi_schema`, which reads
the field table of :mod:`iron_batch.server.fields`; only the prose at the top is written
here. ``tests/test_docs.py`` checks that the file in the repository is what this renders,
so a field added to the server without regenerating the page fails the tests.

    python -m iron_batch.server.api_markdown --write     # docs/api.md
    python -m iron_batch.server.api_markdown             # to stdout
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from iron_batch.server.openapi import openapi_schema

MODEL = "MODEL"  # the served model's name, as the examples show it

_INTRO = """\
# HTTP API

Every endpoint of `python -m iron_batch.server`, its request fields and the statuses it
answers. This page is generated from the OpenAPI document the server itself serves at
`GET /openapi.json` (`python -m iron_batch.server.api_markdown --write`), which reads the
same field table the request parsers use, so a range stated here is the range enforced.

**Errors.** Every endpoint, `/generate` included, answers an error in one shape, with the
status of the table under each endpoint:

```json
{"error": {"message": "temperature must be in [0, 100], got 300.0", "type": "invalid_request_error",
           "param": "temperature", "code": null}}
```

A rejected request changes nothing: it never reaches the scheduler. `type` follows from
the status: 401 `authentication_error`, 404 `not_found_error`, 5xx `server_error`, any
other 4xx `invalid_request_error`; `param` names the field at fault. `503` carries
`Retry-After` (seconds) when the waiting queue is full (`--max-waiting-requests`,
`--max-waiting-tokens`), while the server drains on SIGTERM, and after a fatal engine fault.

**Auth.** With `--api-key` (or `IRON_BATCH_API_KEY`) every endpoint except `/health` and
the page at `/` needs `Authorization: Bearer KEY`.

**Streaming.** `/generate` streams NDJSON, one line per token, the last with `done: true`
and `finish_reason`. The `/v1` endpoints stream server-sent events with `stream: true`:
`data: {chunk}` events in OpenAI's chunk shape, then `data: [DONE]`. A client that
disconnects has its request aborted and its KV blocks freed.

**Null and unknown fields.** The `/v1` endpoints read an explicit `null` as "not given" and
ignore fields they do not know (several SDKs send both); `/generate` rejects both.

In the tables, `MODEL` stands for the served model's name (`--served-model-name`).
"""


def _ref_name(schema: dict[str, Any]) -> str | None:
    ref = schema.get("$ref")
    return ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None


def _is_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null"


def type_text(schema: dict[str, Any]) -> str:
    """A short type: `integer`, `string or null`, `array of integer`, a schema's name."""
    name = _ref_name(schema)
    if name:
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema:
        parts = [type_text(s) for s in schema["anyOf"] if not _is_null(s)]
        nullable = any(_is_null(s) for s in schema["anyOf"])
        return " or ".join(dict.fromkeys(parts)) + (" or null" if nullable else "")
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        items = schema.get("items")
        return f"array of {type_text(items)}" if isinstance(items, dict) else "array"
    return str(kind) if kind else "any"


def _num(x: float) -> str:
    """An integer as one (2^63 - 1 written out, not 9.2e18), a fraction as it is."""
    if float(x).is_integer():
        n = int(x)
        return {(1 << 63) - 1: "2^63-1", -((1 << 63) - 1): "-(2^63-1)",
                -(1 << 63): "-2^63"}.get(n, str(n))
    return f"{x:g}"


def _bounds(schema: dict[str, Any]) -> str:
    """The range and size limits of a schema, of every branch of an anyOf."""
    if "anyOf" in schema:
        return "; ".join(dict.fromkeys(b for b in map(_bounds, schema["anyOf"]) if b))
    out = []
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if "exclusiveMinimum" in schema:
        lo = None
        bound = f"> {_num(schema['exclusiveMinimum'])}"
        out.append(bound + (f", ≤ {_num(hi)}" if hi is not None else ""))
    elif lo is not None and hi is not None:
        out.append(f"{_num(lo)} to {_num(hi)}")
    elif lo is not None:
        out.append(f"≥ {_num(lo)}")
    elif hi is not None:
        out.append(f"≤ {_num(hi)}")
    for key, word in (("minLength", "length ≥"), ("maxLength", "length ≤"),
                      ("minItems", "items ≥"), ("maxItems", "items ≤")):
        if key in schema:
            out.append(f"{word} {schema[key]}")
    if "pattern" in schema:
        out.append(f"matches `{schema['pattern']}`")
    return ", ".join(out)


def _default(schema: dict[str, Any]) -> str:
    if "default" in schema:
        return f"`{json.dumps(schema['default'])}`"
    for branch in schema.get("anyOf", []):
        if "default" in branch:
            return f"`{json.dumps(branch['default'])}`"
    return ""


def _description(schema: dict[str, Any]) -> str:
    parts = [schema.get("description", "")]
    parts += [s.get("description", "") for s in schema.get("anyOf", [])]
    return " ".join(p for p in parts if p)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if text else ""


def fields_table(schema: dict[str, Any]) -> list[str]:
    """One row per property: name (required in bold), type, range, default, description."""
    props = schema.get("properties", {})
    required = set(schema.get("required", []))
    lines = ["| field | type | range | default | |", "|---|---|---|---|---|"]
    for name, prop in props.items():
        shown = f"**`{name}`**" if name in required else f"`{name}`"
        lines.append(f"| {shown} | {type_text(prop)} | {_cell(_bounds(prop))} | "
                     f"{_default(prop)} | {_cell(_description(prop))} |")
    return lines


def _body_schema(operation: dict[str, Any], schemas: dict[str, Any]) -> tuple[str | None,
                                                                          dict[str, Any]]:
    content = operation["requestBody"]["content"]["application/json"]
    schema = content["schema"]
    name = _ref_name(schema)
    return name, schemas[name] if name else schema


def _responses(operation: dict[str, Any]) -> list[str]:
    lines = ["| status | |", "|---|---|"]
    for status, response in sorted(operation["responses"].items()):
        media = ", ".join(f"`{m}`" for m in response.get("content", {}))
        text = response["description"]
        if status.startswith("2") and media:  # every error is the one JSON shape
            text += f" ({media})"
        lines.append(f"| {status} | {_cell(text)} |")
    return lines


def render(doc: dict[str, Any] | None = None) -> str:
    """The whole page, from ``doc`` (default: the server's document, with the page's paths)."""
    doc = doc if doc is not None else openapi_schema(MODEL, ui=True)
    schemas = doc["components"]["schemas"]
    out = [_INTRO, "## Endpoints", ""]
    out += ["| method | path | |", "|---|---|---|"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            out.append(f"| {method.upper()} | [`{path}`](#{_anchor(method, path)}) | "
                       f"{_cell(op['summary'])} |")
    out.append("")
    body_schemas: list[str] = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            out += [f"### {method.upper()} {path}", "", op["summary"], ""]
            if op.get("security") == []:
                out += ["Needs no API key.", ""]
            for param in op.get("parameters", []):
                out.append(f"- {param['in']} parameter `{param['name']}` "
                           f"({type_text(param['schema'])}"
                           f"{', required' if param.get('required') else ''})"
                           f"{': ' + param['description'] if 'description' in param else ''}")
            if op.get("parameters"):
                out.append("")
            if "requestBody" in op:
                name, schema = _body_schema(op, schemas)
                if name:
                    body_schemas.append(name)
                    out += [f"Body: [{name}](#{name.lower()}).", ""]
                else:
                    if schema.get("description"):
                        out += [schema["description"], ""]
                    out += [*fields_table(schema), ""]
                example = op["requestBody"]["content"]["application/json"].get("example")
                if example is not None:
                    out += ["```json", json.dumps(example), "```", ""]
            out += [*_responses(op), ""]
    out += ["## Request bodies", ""]
    for name in dict.fromkeys(body_schemas + ["ChatMessage"]):
        schema = schemas[name]
        out += [f"### {name}", ""]
        if schema.get("description"):
            out += [schema["description"], ""]
        out += ["Fields in bold are required.", "", *fields_table(schema), ""]
    out += ["## Response bodies", ""]
    for name in ("Completion", "ChatCompletion", "Usage", "Model", "Error"):
        out += [f"### {name}", "", *fields_table(schemas[name]), ""]
    return "\n".join(out).rstrip() + "\n"


def _anchor(method: str, path: str) -> str:
    """GitHub's anchor for a heading "METHOD /path": lower case, spaces to '-', drop the rest."""
    text = f"{method} {path}".lower()
    return "".join(c if c.isalnum() or c in "-_" else "-" if c == " " else "" for c in text)


DEFAULT_PATH = Path(__file__).resolve().parents[3] / "docs" / "api.md"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m iron_batch.server.api_markdown",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", nargs="?", const=str(DEFAULT_PATH), default=None,
                    metavar="PATH", help=f"write the page here (default {DEFAULT_PATH})")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        Path(args.write).write_text(text, encoding="utf-8")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
