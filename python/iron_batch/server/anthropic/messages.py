"""The Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A request is read into the chat endpoint's own request (``system``, ``messages`` with
``text``/``tool_use``/``tool_result`` blocks, ``tools``, ``tool_choice``, ``stop_sequences``
become chat fields), so the template, tool grammars, reasoning and limits are the chat
endpoint's; the chat assistant message (:mod:`iron_batch.server.openai.output`) comes back
as content blocks (``thinking``, ``text``, ``tool_use``) with Anthropic's ``stop_reason``.
Streaming sends Anthropic's named events. The key may come as ``x-api-key`` (Anthropic's
clients) or ``Authorization: Bearer``; ``anthropic-version`` is accepted and not read.
Errors on these paths use Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

A tool call that the token limit cuts is never given as a ``tool_use`` block when the whole
message is returned (its input would not parse); streamed, its partial JSON has been sent
and the ``max_tokens`` stop reason says it ended there.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from iron_batch.server import fields
from iron_batch.server.asgi import Scope, Send, authorized, dumps, read_json, send_json
from iron_batch.server.errors import ApiError, unauthorized
from iron_batch.server.openai.output import OutputStream, assistant_message, splitter
from iron_batch.server.openai.protocol import OpenAIRequest, parse_chat
from iron_batch.server.openai.responses import Choice
from iron_batch.server.openai.serving import GenerationEndpoint, OpenAIServer
from iron_batch.stream import RequestStream

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def error_payload(exc: ApiError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(exc.status)
    if kind is None:
        kind = "api_error" if exc.status >= 500 else "invalid_request_error"
    message = str(exc)
    if exc.param:
        message = f"{exc.param}: {message}" if exc.param not in message else message
    return {"type": "error", "error": {"type": kind, "message": message}}


async def _send_error(send: Send, exc: ApiError) -> None:
    headers = [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send_json(send, exc.status, dumps(error_payload(exc)), headers)


# ------------------------------------------------------------------------------ request


def _text(blocks: Any, param: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise ApiError(f"{param} must be a string or a list of text blocks", param=param)
    out = []
    for i, block in enumerate(blocks):
        if (not isinstance(block, dict) or block.get("type") != "text"
                or not isinstance(block.get("text"), str)):
            raise ApiError(f"{param}[{i}] must be a text block", param=param)
        out.append(block["text"])
    return "".join(out)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat messages."""
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _text(body["system"], "system")
        if system:
            out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    if len(messages) > fields.MAX_MESSAGES:
        raise ApiError(f"at most {fields.MAX_MESSAGES} messages", param="messages")
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise ApiError(f"{param} must be an object with role user or assistant",
                           param=param)
        role, content = msg["role"], msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(f"{param}.content must be a string or a list of blocks",
                           param=f"{param}.content")
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            bparam = f"{param}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                        and isinstance(block.get("input"), dict)):
                    raise ApiError(f"{bparam}: a tool_use block needs id, name and an input "
                                   "object", param=bparam)
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block["input"])}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ApiError(f"{bparam}.tool_use_id must be a string", param=bparam)
                result = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text(result, f"{bparam}.content")})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier thinking is not shown to the model again
            else:
                raise ApiError(f"{bparam}: block type {kind!r} is not supported in a {role} "
                               "message", param=bparam)
        if text or not calls:
            entry: dict[str, Any] = {"role": role, "content": "".join(text)}
            if calls:
                entry["tool_calls"] = calls
            if text or role == "assistant" or not out or out[-1]["role"] != "tool":
                out.append(entry)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": calls})
    return out


def _chat_tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ApiError("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise ApiError(f"{param}: only client tools (name, input_schema) are supported",
                           param=param)
        if not isinstance(tool.get("input_schema"), dict):
            raise ApiError(f"{param}.input_schema must be a JSON schema object", param=param)
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(value: Any, chat: dict[str, Any]) -> None:
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    if not isinstance(value, dict) or value.get("type") not in (*kinds, "tool"):
        raise ApiError("tool_choice must be {\"type\": auto|any|tool|none}", param="tool_choice")
    if value["type"] == "tool":
        if not isinstance(value.get("name"), str):
            raise ApiError("tool_choice of type tool needs a name", param="tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": value["name"]}}
    else:
        chat["tool_choice"] = kinds[value["type"]]
    if value.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def chat_body(body: dict[str, Any], *, counting: bool = False) -> dict[str, Any]:
    """A Messages request as a chat completions body (``counting``: count_tokens, which
    needs no max_tokens)."""
    chat: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages(body)}
    if not counting:
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ApiError("max_tokens is required: a positive integer", param="max_tokens")
        chat["max_tokens"] = max_tokens
        chat["stream"] = body.get("stream")
        for name in ("temperature", "top_p", "top_k"):
            if body.get(name) is not None:
                chat[name] = body[name]
        if body.get("stop_sequences") is not None:
            chat["stop"] = body["stop_sequences"]
            if not isinstance(chat["stop"], list):
                raise ApiError("stop_sequences must be a list of strings",
                               param="stop_sequences")
    if body.get("tools") is not None:
        chat["tools"] = _chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        _chat_tool_choice(body["tool_choice"], chat)
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
            raise ApiError("thinking must be {\"type\": \"enabled\" | \"disabled\"}",
                           param="thinking")
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    return chat


# ------------------------------------------------------------------------------ response


def _stop(req: OpenAIRequest, choice: Choice, reason: str | None, text: str,
          tokenizer: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    stops = req.params[0][0].stop
    if reason != "stop" or not stops or not choice.token_ids or tokenizer is None:
        return "end_turn", None
    if choice.token_ids[-1] in set(getattr(tokenizer, "eos_token_ids", []) or []) | set(
            req.params[0][0].stop_token_ids):
        return "end_turn", None
    # The text ends before the stop string that matched: find which one follows it.
    full = tokenizer.decode(choice.token_ids)
    found = [(pos, s) for s in stops if (pos := full.find(s, max(0, len(text) - len(s)))) >= 0]
    if not found:
        return "end_turn", None
    return "stop_sequence", min(found)[1]


def _usage(req: OpenAIRequest, choice: Choice) -> dict[str, Any]:
    prompt = len(req.prompts[0])
    return {"input_tokens": prompt - choice.num_cached, "output_tokens": choice.num_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": choice.num_cached}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        try:
            args = json.loads(call["function"]["arguments"])
        except ValueError:
            continue  # cut by the token limit: not a call (stop_reason says max_tokens)
        if isinstance(args, dict):
            blocks.append({"type": "tool_use", "id": call["id"],
                           "name": call["function"]["name"], "input": args})
    return blocks


class MessagesEndpoint(GenerationEndpoint):
    """POST /v1/messages."""

    id_prefix = "msg_"

    def parse(self, body: dict[str, Any], scope: Scope) -> tuple[OpenAIRequest, Any]:
        return parse_chat(chat_body(body), self.server.model), None

    async def send_error(self, send: Send, exc: ApiError) -> None:
        await _send_error(send, exc)

    def _message(self, response_id: str, req: OpenAIRequest) -> dict[str, Any]:
        return {"id": response_id, "type": "message", "role": "assistant", "model": req.model,
                "content": [], "stop_reason": None, "stop_sequence": None}

    async def respond(self, req: OpenAIRequest, context: Any, response_id: str,
                      streams: list[RequestStream], send: Send) -> None:
        tokenizer = self.server.model.tokenizer
        if not req.stream:
            choices = await self.results(streams, send)
            if choices is None:
                return
            (choice,) = choices
            message, reason = assistant_message(
                "".join(choice.text), choice.finish_reason, req.tool_plan,
                splitter(req.reasoning, req.reasoning_open))
            stop_reason, stop_sequence = _stop(req, choice, reason, "".join(choice.text),
                                               tokenizer)
            body = {**self._message(response_id, req), "content": content_blocks(message),
                    "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                    "usage": _usage(req, choice)}
            await send_json(send, 200, dumps(body))
            return
        await self._stream(req, response_id, streams[0], send)

    async def _stream(self, req: OpenAIRequest, response_id: str, stream: RequestStream,
                      send: Send) -> None:
        def sse(kind: str, **payload: Any) -> bytes:
            data = json.dumps({"type": kind, **payload}, separators=(",", ":"))
            return f"event: {kind}\ndata: {data}\n\n".encode()

        choice = Choice()
        output = OutputStream(req.tool_plan, splitter(req.reasoning, req.reasoning_open))
        blocks: list[str] = []  # type of each block started
        by_call: dict[int, int] = {}
        text: list[str] = []
        parts: list[bytes] = []

        def block(kind: str, start: dict[str, Any]) -> int:
            if blocks:  # one block is open at a time
                parts.append(sse("content_block_stop", index=len(blocks) - 1))
            blocks.append(kind)
            parts.append(sse("content_block_start", index=len(blocks) - 1, content_block=start))
            return len(blocks) - 1

        def current(kind: str, start: dict[str, Any]) -> int:
            return len(blocks) - 1 if blocks and blocks[-1] == kind else block(kind, start)

        usage = {"input_tokens": len(req.prompts[0]), "output_tokens": 0}
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            await send({"type": "http.response.body", "more_body": True, "body": sse(
                "message_start", message={**self._message(response_id, req), "usage": usage})})
            async for events in stream:
                for event in events:
                    choice.add(event)
                    failure = choice.failure()
                    if failure is not None:
                        parts.append(sse("error", **{k: v for k, v in
                                                     error_payload(failure).items()
                                                     if k != "type"}))
                        await send({"type": "http.response.body", "body": b"".join(parts),
                                    "more_body": False})
                        return
                    reason = event.finish_reason if event.finished else None
                    delta, reason = output.feed(event.text or "", event.finished, reason)
                    if delta.get("reasoning_content"):
                        i = current("thinking", {"type": "thinking", "thinking": "",
                                                 "signature": ""})
                        parts.append(sse("content_block_delta", index=i, delta={
                            "type": "thinking_delta", "thinking": delta["reasoning_content"]}))
                    if delta.get("content"):
                        text.append(delta["content"])
                        i = current("text", {"type": "text", "text": ""})
                        parts.append(sse("content_block_delta", index=i, delta={
                            "type": "text_delta", "text": delta["content"]}))
                    for call in delta.get("tool_calls") or []:
                        fn = call.get("function") or {}
                        if call.get("id"):
                            by_call[call["index"]] = block("tool_use", {
                                "type": "tool_use", "id": call["id"], "name": fn.get("name"),
                                "input": {}})
                        if fn.get("arguments"):
                            parts.append(sse("content_block_delta", index=by_call[call["index"]],
                                             delta={"type": "input_json_delta",
                                                    "partial_json": fn["arguments"]}))
                    if event.finished:
                        if blocks:
                            parts.append(sse("content_block_stop", index=len(blocks) - 1))
                        stop_reason, stop_sequence = _stop(
                            req, choice, reason, "".join(choice.text),
                            self.server.model.tokenizer)
                        parts.append(sse("message_delta", delta={
                            "stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            usage={"output_tokens": choice.num_tokens}))
                        parts.append(sse("message_stop"))
                if parts:
                    chunk, parts = b"".join(parts), []
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": not choice.done})
        except OSError:
            return  # the connection broke under us; the caller aborts the request


def message_routes(server: OpenAIServer) -> list[Route]:
    """POST /v1/messages and /v1/messages/count_tokens."""

    async def count_tokens(request: Request) -> Response:
        try:
            if not authorized(request.scope, server.api_key):
                raise unauthorized()
            body = await read_json(request, server.admission.limits.max_body_bytes)
            chat = chat_body(body, counting=True)
            req = parse_chat({**chat, "max_tokens": 1}, server.model)
        except ApiError as exc:
            return JSONResponse(error_payload(exc), status_code=exc.status,
                                headers=exc.headers)
        return JSONResponse({"input_tokens": len(req.prompts[0])})

    return [
        Route("/v1/messages", MessagesEndpoint(server), methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
