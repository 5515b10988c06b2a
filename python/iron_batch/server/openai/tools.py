"""``tools`` and ``tool_choice`` for /v1/chat/completions.

- ``none`` (the default without tools): the tools are not shown to the model and its
  output is never read as calls; it is all content.
- a named function: a grammar makes the whole output that function's arguments, a JSON
  value valid against its ``parameters`` schema.
- ``required``: a grammar makes the output a JSON array of one or more
  ``{"name": ..., "parameters": {...}}`` objects, each naming a declared tool and valid
  against its schema.
- ``auto`` (the default with tools): nothing is constrained; the model's own tool-call
  format is parsed from its text:

  - Hermes-style ``<tool_call>{json}</tool_call>`` blocks: Qwen2/Qwen3, SmolLM3, and the
    instructions given to templates without tool support (such as SmolLM2's, Gemma's);
  - ``<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>``:
    Qwen3.5's XML form (``xml_tool_calls.py``);
  - ``<|tool_call|>[{json}, ...]<|/tool_call|>``: Phi-4-mini;
  - ``<|tool_call>call:NAME{key:<|"|>text<|"|>,...}<tool_call|>``: Gemma 4
    (``gemma4_tool_calls.py``). Its markers are special tokens: ``auto`` requests keep
    them in the decoded text (:data:`KEEP_TOKENS`) while other special tokens are still
    skipped;
  - ``<|tool_call|>[...]`` and ``<tool_call>[...]`` with no closing tag: Granite 3.x, as
    its system prompt asks (a tag's body may be one call or a JSON list of them);
  - bare JSON at the start of the output, ``{"name": ..., "parameters": ...}`` (Llama 3,
    after an optional ``<|python_tag|>``), a list of such objects or ones separated by
    ``;``. This is also what a tagged call is left as where the tag is a special token
    that decoding skipped (Phi-4-mini's, by default).

  Text that does not parse as calls of declared tools stays content.

Templates that know about tools get ``tools`` (and history messages with ``tool_calls``
and ``tool_call_id``) as they are. Phi-4-mini's template reads them from the system
message's ``tools`` (a JSON list of the functions, written between ``<|tool|>`` and
``<|/tool|>``): they are put there, and earlier calls are written in its
``<|tool_call|>`` format. Granite 3.x templates take ``tools`` but write no calls: those
are written in the tag its system prompt names. A template that writes Gemma 4's turns
(``<|turn>``) but no calls gets them, and their results, in Gemma 4's form, results
following the calls inside the model's turn as its own template puts them; where it
takes no ``tools`` either, their declarations (``<|tool>declaration:NAME{...}<tool|>``)
end the system message. For any other template, the tools are
described in the system message and earlier calls and results are written in the Hermes
format.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from iron_batch.server.errors import ApiError
from iron_batch.server.openai import gemma4_tool_calls as gemma4
from iron_batch.server.openai.structured import require_support
from iron_batch.server.openai.xml_tool_calls import xml_calls
from iron_batch.structured import GrammarError, json_schema_grammar

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PHI_OPEN, _PHI_CLOSE = "<|tool_call|>", "<|/tool_call|>"
#: What may start a tagged call (Hermes, SmolLM3, Granite 3.1+; Phi-4-mini, Granite 3.0).
_OPENERS = (_OPEN, _PHI_OPEN)
#: One tagged call's body: up to its closing tag, the next call's tag, or the end.
_BLOCK = re.compile(
    r"(?:<tool_call>|<\|tool_call\|>)(.*?)"
    r"(?:</tool_call>|<\|/tool_call\|>|(?=<tool_call>|<\|tool_call\|>)|$)",
    re.DOTALL,
)
_PYTHON_TAG = "<|python_tag|>"
#: What may start a call in streamed text: the tags above and Gemma 4's.
_STREAM_OPENERS = (*_OPENERS, gemma4.OPEN)
#: Special tokens a call may be written with, kept in the decoded text of ``auto`` output.
KEEP_TOKENS = gemma4.KEEP_TOKENS
#: Gemma 4's turn marker: a template that writes it is Gemma 4's.
_GEMMA4_TURN = "<|turn>"


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    #: The client's declaration, as templates expect it ({"type": "function", ...}).
    declaration: dict[str, Any]


@dataclass
class ToolPlan:
    """How one chat request uses its tools (``none`` has no plan)."""

    tools: list[Tool]
    #: "auto", "required" or "named".
    mode: str
    named: str | None = None
    grammar: str | None = None
    names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.names = {t.name for t in self.tools}

    def declarations(self) -> list[dict[str, Any]]:
        return [t.declaration for t in self.tools]

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a finished output."""
        if self.mode == "named":
            assert self.named is not None
            return None, [_call(self.named, text)]
        if self.mode == "required":
            calls = _json_calls(text, self.names)
            return (text, []) if calls is None else (None, calls)
        return parse_auto(text, self.names, {t.name: t.parameters for t in self.tools})

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message and finish reason of a non-streamed choice."""
        content, calls = self.calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if not calls:
            message["content"] = text
            return message, finish_reason
        message["tool_calls"] = calls
        return message, "tool_calls" if finish_reason == "stop" else finish_reason


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": _call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _as_call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    """A call from ``{"name": ..., "arguments"|"parameters": {...}}``, or None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return _call(obj["name"], args)


def _json_calls(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """Calls from a JSON object, a JSON array of them, or objects separated by ';'."""
    text = text.strip()
    if text.startswith(_PYTHON_TAG):
        text = text[len(_PYTHON_TAG):].strip()
    if not text.startswith(("{", "[")):
        return None
    try:
        values = [json.loads(text)]
    except ValueError:
        try:
            values = [json.loads(part) for part in text.split(";") if part.strip()]
        except ValueError:
            return None
    if len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    calls = [_as_call(v, names) for v in values]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def parse_auto(
    text: str, names: set[str], schemas: dict[str, dict[str, Any]] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a model's free output; unparseable text stays content.
    ``schemas``: each tool's parameters schema (typed values of Qwen3.5's XML calls)."""
    if gemma4.OPEN in text:
        found = gemma4.gemma4_calls(text, names)
        if found is None:
            return text, []
        content = found[0].strip()
        return content or None, [_call(n, a) for n, a in found[1]]
    if any(tag in text for tag in _OPENERS):
        calls = []
        for body in _BLOCK.findall(text):
            found = _json_calls(body, names)
            if found is None:
                xml = xml_calls(body, names, schemas or {})
                found = None if xml is None else [_call(n, a) for n, a in xml]
            if found is None:
                return text, []
            calls.extend(found)
        content = _BLOCK.sub("", text).strip()
        return content or None, calls
    calls_or_none = _json_calls(text, names)
    if calls_or_none:
        return None, calls_or_none
    return text, []


# ---------------------------------------------------------------------------- request


def _tool(value: Any, i: int) -> Tool:
    param = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type") != "function":
        raise ApiError(f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                       param=param)
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise ApiError(f"{param}.function must be an object", param=param)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(f"{param}.function.name must be 1-64 letters, digits, _ or -",
                       param=f"{param}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ApiError(f"{param}.function.description must be a string", param=param)
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ApiError(f"{param}.function.parameters must be a JSON schema object",
                       param=f"{param}.function.parameters")
    return Tool(name, params, {"type": "function", "function": {**fn, "parameters": params}})


def _grammar(schema: dict[str, Any], param: str) -> str:
    try:
        return json_schema_grammar(schema)
    except GrammarError as exc:
        raise ApiError(str(exc), param=param) from None


def read_tool_list(body: dict[str, Any]) -> list[Tool]:
    """``body["tools"]``, checked (400s name the first bad entry)."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise ApiError("tools must be a list", param="tools")
    tools = [_tool(v, i) for i, v in enumerate(raw or [])]
    if len({t.name for t in tools}) != len(tools):
        raise ApiError("tool names must be unique", param="tools")
    return tools


def read_tools(body: dict[str, Any], supported: bool) -> ToolPlan | None:
    """The request's tool plan (None for ``none`` or no tools); 400s for bad input."""
    tools = read_tool_list(body)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    named: str | None = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(
            fn.get("name"), str
        ):
            raise ApiError(
                "tool_choice must be none, auto, required or "
                "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                param="tool_choice",
            )
        named = fn["name"]
        if named not in {t.name for t in tools}:
            raise ApiError(f"tool_choice names {named!r}, which is not in tools",
                           param="tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise ApiError("tool_choice must be none, auto, required or a named function",
                       param="tool_choice")
    if choice == "none":
        return None
    if not tools:
        raise ApiError(f"tool_choice {choice} needs tools", param="tool_choice")
    if choice == "auto":
        return ToolPlan(tools, "auto")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError("response_format cannot be combined with a forced tool call",
                       param="response_format")
    require_support(supported, "tool_choice")
    if choice == "named":
        tool = next(t for t in tools if t.name == named)
        index = tools.index(tool)
        return ToolPlan(tools, "named", named,
                        _grammar(tool.parameters, f"tools[{index}].function.parameters"))
    one_of = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "parameters": t.parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if body.get("parallel_tool_calls") is False:
        array["maxItems"] = 1
    return ToolPlan(tools, "required", grammar=_grammar(array, "tools"))


# ---------------------------------------------------------------------------- messages


def history_message(msg: dict[str, Any], entry: dict[str, Any], param: str) -> None:
    """Copy a history message's ``tool_calls`` (assistant) or ``tool_call_id`` (tool)."""
    calls = msg.get("tool_calls")
    if entry["role"] == "assistant" and calls is not None:
        if not isinstance(calls, list):
            raise ApiError(f"{param}.tool_calls must be a list", param=param)
        out = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(f"{param}.tool_calls entries need function.name", param=param)
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                # Templates write the arguments with tojson: give them the object.
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise ApiError(f"{param}.tool_calls arguments must be JSON",
                                   param=param) from None
            out.append({"id": call.get("id"), "type": "function",
                        "function": {"name": fn["name"], "arguments": args}})
        entry["tool_calls"] = out
    if entry["role"] == "tool":
        call_id = msg.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise ApiError(f"{param}.tool_call_id must be a string", param=param)
        if call_id is not None:
            entry["tool_call_id"] = call_id


def _describe(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call these functions, declared as JSON signatures inside <tools></tools>:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call one, answer with a JSON object naming it and giving its arguments, "
        "between <tool_call> and </tool_call>:\n"
        '<tool_call>\n{"name": "function name", "arguments": {"argument": "value"}}\n'
        "</tool_call>"
    )


#: How Phi-4-mini's template writes the system message's ``tools``.
_PHI_TOOLS = "'<|tool|>' + message['tools'] + '<|/tool|>'"
#: How Granite 3.x templates write ``tools`` (they know no ``tool_calls``).
_GRANITE_TOOLS = "'<|start_of_role|>tools<|end_of_role|>'"


def _written(calls: list[dict[str, Any]]) -> list[str]:
    return [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                       ensure_ascii=False) for c in calls]


def _calls_as_text(
    messages: list[dict[str, Any]], calls: Callable[[list[str]], str],
    result: Callable[[str], str] | None = None,
) -> list[dict[str, Any]]:
    """``messages`` with each assistant message's calls written after its text by
    ``calls`` (a list of JSON objects to text) and each tool result by ``result``."""
    out = []
    for m in messages:
        m = dict(m)
        m.pop("tool_call_id", None)
        if m.get("tool_calls"):
            text = calls(_written(m.pop("tool_calls")))
            m["content"] = f"{m['content']}\n{text}" if m["content"] else text
        if m["role"] == "tool" and result is not None:
            m["content"] = result(m["content"])
        out.append(m)
    return out


def _gemma4_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with calls and results written as Gemma 4 writes them. As in its own
    template, results follow the calls in the model's turn; each is named after the call
    its ``tool_call_id`` names (else the latest call)."""
    names: dict[str, str] = {}
    latest = "unknown"
    out: list[dict[str, Any]] = []
    answering = False  # the last message out is a model turn whose calls these answer
    for m in messages:
        m = dict(m)
        call_id = m.pop("tool_call_id", None)
        calls = m.pop("tool_calls", None)
        if calls:
            written = []
            for c in calls:
                latest = c["function"]["name"]
                if c.get("id"):
                    names[c["id"]] = latest
                written.append(gemma4.write_call(latest, c["function"]["arguments"]))
            m["content"] = m["content"] + "".join(written)
        if m["role"] == "tool":
            name = names.get(call_id or "") or m.get("name") or latest
            response = gemma4.write_response(name, m["content"])
            if answering:
                out[-1] = {**out[-1], "content": out[-1]["content"] + response}
                continue
            m["content"] = response
        answering = bool(calls) and m["role"] == "assistant"
        out.append(m)
    return out


def _with_system(messages: list[dict[str, Any]], default: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": default}, *messages]


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render with ``template``: as they are where the template
    knows tools and calls, else in its family's text format or Hermes' (see the module
    docstring)."""
    if "tool_calls" in template and (tools is None or "tools" in template):
        return messages, tools
    if _GEMMA4_TURN in template or gemma4.OPEN in template:
        out = _gemma4_history(messages)
        if tools and "tools" not in template:
            out = _with_system(out, "")
            declared = "".join(gemma4.write_declaration(t["function"]) for t in tools)
            out[0] = {**out[0], "content": out[0]["content"] + declared}
            return out, None
        return out, tools
    if _PHI_TOOLS in template:
        out = _calls_as_text(messages, lambda js: f"{_PHI_OPEN}[{', '.join(js)}]{_PHI_CLOSE}")
        if tools:
            # Ollama's Phi-4-mini template says this where the client gave no system text.
            out = _with_system(out, "You are a helpful assistant with some tools.")
            functions = [t["function"] for t in tools]
            out[0] = {**out[0], "tools": json.dumps(functions, ensure_ascii=False)}
        return out, None
    if _GRANITE_TOOLS in template:
        # Its system prompt asks for <|tool_call|> (3.0, 3.2) or <tool_call> (3.1) and
        # a JSON list; results keep the tool role.
        tag = _PHI_OPEN if _PHI_OPEN in template else _OPEN
        return _calls_as_text(messages, lambda js: f"{tag}[{', '.join(js)}]"), tools
    out = _calls_as_text(
        messages, lambda js: "\n".join(f"{_OPEN}\n{j}\n{_CLOSE}" for j in js),
        lambda text: f"<tool_response>\n{text}\n</tool_response>",
    )
    if tools:
        text = _describe(tools)
        out = _with_system(out, "")
        content = out[0]["content"]
        out[0] = {**out[0], "content": f"{content}\n\n{text}" if content else text}
    return out, None


# ---------------------------------------------------------------------------- streaming


class ToolStream:
    """Turns one choice's text deltas into OpenAI chat deltas with ``tool_calls``.

    A named call streams its arguments as they come. ``required`` and ``auto`` output is
    parsed when it ends; until then ``auto`` streams content up to anything that may
    start a call (a ``<tool_call>``, ``<|tool_call|>`` or ``<|tool_call>`` tag, or JSON at
    the very start) and holds the rest.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._text = ""  # everything generated
        self._sent = 0  # chars of _text sent as content (auto)
        self._held = plan.mode != "auto"
        self._id: str | None = None

    def feed(
        self, text: str, finished: bool, reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """(delta, finish reason) for one event's text."""
        self._text += text
        plan = self.plan
        if plan.mode == "named":
            delta: dict[str, Any] = {}
            if text or (finished and self._id is None):
                entry: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
                if self._id is None:
                    self._id = _call_id()
                    entry = {"index": 0, "id": self._id, "type": "function",
                             "function": {"name": plan.named, "arguments": text}}
                delta["tool_calls"] = [entry]
            return delta, ("tool_calls" if finished and reason == "stop" else reason)
        if not finished:
            return self._content_delta(), None
        _, calls = plan.calls(self._text)
        rest = self._text[self._sent:]
        if not calls:
            return ({"content": rest} if rest else {}), reason
        delta = {}
        leftover = None
        if gemma4.OPEN in rest:
            found = gemma4.gemma4_calls(rest, plan.names)
            leftover = found[0] if found is not None else None
        elif any(tag in rest for tag in _OPENERS):
            leftover = _BLOCK.sub("", rest)
        if leftover is not None and leftover.strip():
            delta["content"] = leftover
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        return delta, ("tool_calls" if reason == "stop" else reason)

    def _content_delta(self) -> dict[str, Any]:
        if self._held:
            return {}
        text = self._text
        if not text[self._sent:].strip() and self._sent == 0:
            return {}  # leading whitespace: wait to see whether JSON follows
        if self._sent == 0 and text.lstrip().startswith(("{", "[", _PYTHON_TAG)):
            self._held = True
            return {}
        starts = [i for i in (text.find(tag, self._sent) for tag in _STREAM_OPENERS)
                  if i != -1]
        if starts:
            end = min(starts)
            self._held = True
        else:
            # Hold back a tail that may be the start of a tag.
            end = len(text) - max(
                (n for tag in _STREAM_OPENERS
                 for n in range(1, min(len(tag), len(text) - self._sent + 1))
                 if text.endswith(tag[:n])), default=0)
        out = text[self._sent:end]
        self._sent = end
        return {"content": out} if out else {}
