"""The OpenAI Responses API: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``.

A request is read into the chat endpoint's own request (its ``input`` items become chat
messages, its ``tools``, ``tool_choice`` and ``text.format`` the chat fields), so sampling,
limits, tool grammars, reasoning and the template are the chat endpoint's; the answer is
the chat assistant message (:mod:`.output`) written as Responses output items
(``reasoning``, ``message`` with ``output_text``, ``function_call``). Streaming sends the
typed events in the order the ``openai`` SDK's stream state expects.

``store`` (default true) keeps a response in a bounded in-memory store, per tenant (with
several API keys, each key sees only its own responses); ``previous_response_id`` continues
the conversation of a stored one (its instructions do not carry over, as OpenAI's do not).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from iron_batch.server import fields
from iron_batch.server.asgi import (
    Scope,
    Send,
    dumps,
    guarded,
    send_json,
    tenant_id,
)
from iron_batch.server.errors import ApiError
from iron_batch.server.openai.output import OutputStream, assistant_message, splitter
from iron_batch.server.openai.protocol import OpenAIRequest, parse_chat
from iron_batch.server.openai.responses import Choice, request_usage
from iron_batch.server.openai.serving import GenerationEndpoint, OpenAIServer
from iron_batch.stream import RequestStream

#: Responses kept in memory (all tenants together); the oldest goes first.
MAX_STORED_RESPONSES = 1024

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
#: Sampling fields passed on to the chat request as they are.
_SAMPLING = tuple(spec.name for spec in fields.SAMPLING)
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class Stored:
    response: dict[str, Any]
    #: The conversation so far in chat messages, without instructions.
    messages: list[dict[str, Any]]


class ResponseStore:
    """Past responses by (tenant, id), at most ``capacity`` of them."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[str | None, str], Stored] = OrderedDict()

    def put(self, tenant: str | None, stored: Stored) -> None:
        self._items[(tenant, stored.response["id"])] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, tenant: str | None, response_id: str, param: str = "id") -> Stored:
        stored = self._items.get((tenant, response_id))
        if stored is None:
            raise ApiError(f"no stored response with id {response_id!r} (unknown, deleted or "
                           "evicted)", status=404, param=param, code="response_not_found")
        return stored

    def delete(self, tenant: str | None, response_id: str) -> None:
        self.get(tenant, response_id)
        del self._items[(tenant, response_id)]


# ------------------------------------------------------------------------------ request


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"{param} must be a string or a list of text parts", param=param)
    parts = []
    for i, part in enumerate(content):
        if (not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS
                or not isinstance(part.get("text"), str)):
            raise ApiError(f"{param}[{i}]: only text parts ({', '.join(_TEXT_PARTS)}) are "
                           "supported", param=param)
        parts.append(part["text"])
    return "".join(parts)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` (a string or a list of items) as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError("input must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"{param} must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(f"{param}.role must be user, assistant, system or developer",
                               param=param)
            out.append({"role": role, "content": _text(item.get("content"),
                                                       f"{param}.content")})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and isinstance(name, str)
                    and isinstance(args, str)):
                raise ApiError(f"{param}: a function_call needs call_id, name and arguments "
                               "(strings)", param=param)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ApiError(f"{param}.call_id must be a string", param=param)
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            continue  # a model's earlier thinking is not shown to it again
        else:
            raise ApiError(f"{param}.type {kind!r} is not supported (message, function_call, "
                           "function_call_output, reasoning)", param=param)
    return out


def _chat_tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ApiError("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError(f"tools[{i}]: only function tools are supported", param=f"tools[{i}]")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(value: Any) -> Any:
    if isinstance(value, dict):
        if value.get("type") != "function" or not isinstance(value.get("name"), str):
            raise ApiError("tool_choice must be none, auto, required or "
                           "{\"type\": \"function\", \"name\": ...}", param="tool_choice")
        return {"type": "function", "function": {"name": value["name"]}}
    return value


def _chat_format(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, dict):
        raise ApiError("text must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError("text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError("text.format json_schema needs a schema object", param="text.format")
        return {"type": "json_schema",
                "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise ApiError("text.format type must be text, json_object or json_schema",
                   param="text.format")


@dataclass
class ResponsesContext:
    tenant: str | None
    body: dict[str, Any]
    #: The conversation given (previous response's + input), without instructions.
    messages: list[dict[str, Any]]
    store: bool
    previous_response_id: str | None
    created_at: int = field(default_factory=lambda: int(time.time()))


def parse_responses(body: dict[str, Any], server: OpenAIServer, store: ResponseStore,
                    tenant: str | None) -> tuple[OpenAIRequest, ResponsesContext]:
    if body.get("background"):
        raise ApiError("background responses are not supported", param="background")
    keep = fields.read_bool(body, "store", True, null_ok=True)
    previous = fields.read_str(body, "previous_response_id", null_ok=True)
    history = list(store.get(tenant, previous, "previous_response_id").messages) \
        if previous is not None else []
    if body.get("input") is None:
        raise ApiError("input is required", param="input")
    messages = history + input_messages(body["input"])
    instructions = fields.read_str(body, "instructions", null_ok=True)
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": ([{"role": "system", "content": instructions}] if instructions else [])
        + messages,
        "stream": body.get("stream"),
    }
    for name in (*_SAMPLING, "parallel_tool_calls", "chat_template_kwargs"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
        if not isinstance(chat["max_tokens"], int) or chat["max_tokens"] < 1:
            raise ApiError("max_output_tokens must be a positive integer",
                           param="max_output_tokens")
    if body.get("tools") is not None:
        chat["tools"] = _chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if body.get("text") is not None:
        fmt = _chat_format(body["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    req = parse_chat(chat, server.model)
    return req, ResponsesContext(tenant, body, messages, keep, previous)


# ------------------------------------------------------------------------------ response


def _usage(req: OpenAIRequest, choices: list[Any]) -> dict[str, Any]:
    u = request_usage(req, choices)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _response(ctx: ResponsesContext, response_id: str, model: str, status: str,
              output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    body = ctx.body
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": ctx.created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": ctx.previous_response_id,
        "reasoning": None,
        "store": ctx.store,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "text": {"format": text.get("format") or {"type": "text"}},
        "truncation": "disabled",
        "usage": usage,
        "metadata": body.get("metadata") or {},
    }


class _Items:
    """The output items of one response, built from chat deltas; ``events`` are the
    stream's typed events (kept only when streaming)."""

    def __init__(self, server: OpenAIServer, streaming: bool) -> None:
        self.server = server
        self.streaming = streaming
        self.items: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._open: int | None = None
        self._by_call: dict[int, int] = {}  # tool call index -> output index

    def _emit(self, kind: str, **payload: Any) -> None:
        if self.streaming:
            self.events.append((kind, payload))

    def _start(self, item: dict[str, Any]) -> int:
        self.close()
        index = len(self.items)
        self.items.append(item)
        self._open = index
        self._emit("response.output_item.added", output_index=index, item=dict(item))
        return index

    def _current(self, kind: str) -> int:
        """The open item of ``kind`` (a new one, closing any other)."""
        if self._open is not None and self.items[self._open]["type"] == kind:
            return self._open
        new_id = self.server.new_id
        if kind == "reasoning":
            return self._start({"id": new_id("rs_"), "type": "reasoning", "summary": [],
                                "content": [], "status": "in_progress"})
        index = self._start({"id": new_id("msg_"), "type": "message", "role": "assistant",
                             "status": "in_progress", "content": []})
        self._emit("response.content_part.added", item_id=self.items[index]["id"],
                   output_index=index, content_index=0,
                   part={"type": "output_text", "text": "", "annotations": []})
        return index

    def add(self, delta: dict[str, Any]) -> None:
        thought = delta.get("reasoning_content")
        if thought:
            index = self._current("reasoning")
            item = self.items[index]
            item.setdefault("_text", "")
            item["_text"] += thought
            self._emit("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                       content_index=0, delta=thought)
        content = delta.get("content")
        if content:
            index = self._current("message")
            item = self.items[index]
            item.setdefault("_text", "")
            item["_text"] += content
            self._emit("response.output_text.delta", item_id=item["id"], output_index=index,
                       content_index=0, delta=content, logprobs=[])
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                index = self._start({"id": self.server.new_id("fc_"), "type": "function_call",
                                     "call_id": call["id"], "name": fn.get("name"),
                                     "arguments": "", "status": "in_progress"})
                self._by_call[call["index"]] = index
            index = self._by_call[call["index"]]
            args = fn.get("arguments") or ""
            if args:
                item = self.items[index]
                item["arguments"] += args
                self._emit("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=args)

    def close(self, status: str = "completed") -> None:
        if self._open is None:
            return
        index, self._open = self._open, None
        item = self.items[index]
        item["status"] = status
        kind = item["type"]
        if kind == "message":
            part = {"type": "output_text", "text": item.pop("_text", ""), "annotations": [],
                    "logprobs": []}
            item["content"] = [part]
            self._emit("response.output_text.done", item_id=item["id"], output_index=index,
                       content_index=0, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", item_id=item["id"], output_index=index,
                       content_index=0, part=part)
        elif kind == "reasoning":
            text = item.pop("_text", "")
            item["content"] = [{"type": "reasoning_text", "text": text}]
            self._emit("response.reasoning_text.done", item_id=item["id"], output_index=index,
                       content_index=0, text=text)
        else:
            self._emit("response.function_call_arguments.done", item_id=item["id"],
                       output_index=index, name=item["name"], arguments=item["arguments"])
        self._emit("response.output_item.done", output_index=index, item=dict(item))

    def history(self) -> dict[str, Any]:
        """The response as one chat assistant message (for previous_response_id)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"] or "{}"}}
                 for i in self.items if i["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return message


class ResponsesEndpoint(GenerationEndpoint):
    """POST /v1/responses."""

    id_prefix = "resp_"

    def __init__(self, server: OpenAIServer, store: ResponseStore) -> None:
        super().__init__(server)
        self.store = store

    def parse(self, body: dict[str, Any], scope: Scope) -> tuple[OpenAIRequest, Any]:
        return parse_responses(body, self.server, self.store,
                               tenant_id(scope, self.server.api_key))

    async def respond(self, req: OpenAIRequest, context: Any, response_id: str,
                      streams: list[RequestStream], send: Send) -> None:
        ctx: ResponsesContext = context
        (stream,) = streams
        items = _Items(self.server, req.stream)
        if not req.stream:
            choices = await self.results(streams, send)
            if choices is None:
                return
            message, reason = assistant_message(
                "".join(choices[0].text), choices[0].finish_reason, req.tool_plan,
                splitter(req.reasoning, req.reasoning_open))
            delta = {k: v for k, v in message.items() if k != "tool_calls"}
            delta["tool_calls"] = [{"index": i, **c}
                                   for i, c in enumerate(message.get("tool_calls") or [])]
            items.add(delta)
            body = self._finish(req, ctx, response_id, items, reason, choices)
            await send_json(send, 200, dumps(body))
            return
        await self._stream(req, ctx, response_id, stream, items, send)

    def _finish(self, req: OpenAIRequest, ctx: ResponsesContext, response_id: str,
                items: _Items, reason: str | None, choices: list[Any]) -> dict[str, Any]:
        status = "incomplete" if reason == "length" else "completed"
        items.close(status)
        body = _response(ctx, response_id, req.model, status, items.items,
                         _usage(req, choices))
        if ctx.store:
            self.store.put(ctx.tenant, Stored(body, [*ctx.messages, items.history()]))
        return body

    async def _stream(self, req: OpenAIRequest, ctx: ResponsesContext, response_id: str,
                      stream: RequestStream, items: _Items, send: Send) -> None:
        seq = 0

        def encode(events: list[tuple[str, dict[str, Any]]]) -> bytes:
            nonlocal seq
            out = []
            for kind, payload in events:
                data = json.dumps({"type": kind, "sequence_number": seq, **payload},
                                  separators=(",", ":"))
                out.append(f"event: {kind}\ndata: {data}\n\n".encode())
                seq += 1
            return b"".join(out)

        choice = Choice()
        output = OutputStream(req.tool_plan, splitter(req.reasoning, req.reasoning_open))
        start = _response(ctx, response_id, req.model, "in_progress", [], None)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            await send({"type": "http.response.body", "more_body": True, "body": encode([
                ("response.created", {"response": start}),
                ("response.in_progress", {"response": start}),
            ])})
            async for events in stream:
                for event in events:
                    choice.add(event)
                    failure = choice.failure()
                    if failure is not None:
                        error = {"code": failure.code, "message": str(failure), "param": None}
                        await send({"type": "http.response.body", "more_body": False,
                                    "body": encode([*items.events, ("error", error)])})
                        return
                    reason = event.finish_reason if event.finished else None
                    delta, reason = output.feed(event.text or "", event.finished, reason)
                    items.add(delta)
                    if event.finished:
                        body = self._finish(req, ctx, response_id, items, reason, [choice])
                        kind = ("response.incomplete" if body["status"] == "incomplete"
                                else "response.completed")
                        items.events.append((kind, {"response": body}))
                if items.events:
                    chunk, items.events = encode(items.events), []
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": not choice.done})
        except OSError:
            return  # the connection broke under us; the caller aborts the request


def response_routes(server: OpenAIServer, store: ResponseStore) -> list[Route]:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}."""

    async def get(request: Request) -> Response:
        tenant = tenant_id(request.scope, server.api_key)
        return JSONResponse(store.get(tenant, request.path_params["id"]).response)

    async def delete(request: Request) -> Response:
        tenant = tenant_id(request.scope, server.api_key)
        response_id = request.path_params["id"]
        store.delete(tenant, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    key = server.api_key
    return [
        Route("/v1/responses", ResponsesEndpoint(server, store), methods=["POST"]),
        Route("/v1/responses/{id}", guarded(get, key), methods=["GET"]),
        Route("/v1/responses/{id}", guarded(delete, key), methods=["DELETE"]),
    ]
