"""The OpenAPI description of the Responses API and the Anthropic Messages API (see
:mod:`iron_batch.server.openai.responses_api` and :mod:`iron_batch.server.anthropic.messages`);
:mod:`iron_batch.server.openapi` puts these paths and schemas into the one document."""

from __future__ import annotations

from typing import Any

from iron_batch.server import fields
from iron_batch.server.fields import nullable_schema as _nullable


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _sse_or_json(schema_name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {
        "application/json": {"schema": _ref(schema_name)},
        "text/event-stream": {"schema": {
            "type": "string", "description": "stream: true. Named events (`event: TYPE`, "
            "`data: {...}`) in the order the API's own SDK reads them."}},
    }}


_TEXT_PART = {"type": "object", "properties": {
    "type": {"enum": ["input_text", "output_text", "text"]}, "text": {"type": "string"}},
    "required": ["type", "text"]}
_TEXT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_SCHEMA_OBJECT = {"type": "object", "description": "A JSON Schema."}

_INPUT_ITEM = {"anyOf": [
    {"type": "object", "description": "A message.", "properties": {
        "type": {"const": "message"},
        "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": _TEXT}, "required": ["role", "content"]},
    {"type": "object", "description": "An earlier function call.", "properties": {
        "type": {"const": "function_call"}, "call_id": {"type": "string"},
        "name": {"type": "string"}, "arguments": {"type": "string"}},
     "required": ["type", "call_id", "name", "arguments"]},
    {"type": "object", "description": "The result of a function call.", "properties": {
        "type": {"const": "function_call_output"}, "call_id": {"type": "string"},
        "output": _TEXT}, "required": ["type", "call_id", "output"]},
    {"type": "object", "description": "Earlier reasoning (not shown to the model again).",
     "properties": {"type": {"const": "reasoning"}}, "required": ["type"]},
]}
_SAMPLING = {name: spec for name, spec in fields.sampling_schema(nullable=True).items()
             if name in ("temperature", "top_p", "top_k", "seed")}

SCHEMAS: dict[str, Any] = {
    "ResponseRequest": {
        "type": "object",
        "description": "The OpenAI Responses API. Unknown fields are ignored.",
        "properties": {
            "model": _nullable({"type": "string"}),
            "input": {"anyOf": [{"type": "string"},
                                {"type": "array", "items": _INPUT_ITEM, "minItems": 1}]},
            "instructions": _nullable({"type": "string"}),
            "previous_response_id": _nullable({
                "type": "string", "description": "Continue a stored response's conversation "
                "(404 when unknown, deleted or evicted)."}),
            "store": _nullable({"type": "boolean", "default": True}),
            "stream": _nullable({"type": "boolean"}),
            "max_output_tokens": _nullable({"type": "integer", "minimum": 1}),
            "tools": _nullable({"type": "array", "items": {"type": "object", "properties": {
                "type": {"const": "function"}, "name": {"type": "string"},
                "description": {"type": "string"}, "parameters": _SCHEMA_OBJECT},
                "required": ["type", "name"]}}),
            "tool_choice": _nullable({"anyOf": [
                {"enum": ["none", "auto", "required"]},
                {"type": "object", "properties": {"type": {"const": "function"},
                                                  "name": {"type": "string"}},
                 "required": ["type", "name"]}]}),
            "parallel_tool_calls": _nullable({"type": "boolean"}),
            "text": _nullable({"type": "object", "properties": {"format": {"anyOf": [
                {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}},
                 "required": ["type"]},
                {"type": "object", "properties": {"type": {"const": "json_schema"},
                                                  "name": {"type": "string"},
                                                  "schema": _SCHEMA_OBJECT},
                 "required": ["type", "schema"]}]}}}),
            **_SAMPLING,
        },
        "required": ["input"],
    },
    "Response": {
        "type": "object",
        "properties": {
            "id": {"type": "string"}, "object": {"const": "response"},
            "status": {"enum": ["completed", "incomplete", "in_progress"]},
            "incomplete_details": _nullable({"type": "object"}),
            "output": {"type": "array", "items": {"type": "object", "description":
                       "reasoning, message (output_text parts) or function_call items."}},
            "usage": _nullable({"type": "object"}),
            "previous_response_id": _nullable({"type": "string"}),
        },
        "required": ["id", "object", "status", "output"],
    },
    "MessageRequest": {
        "type": "object",
        "description": "The Anthropic Messages API. Unknown fields are ignored.",
        "properties": {
            "model": _nullable({"type": "string"}),
            "max_tokens": {"type": "integer", "minimum": 1},
            "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
                "type": "object", "properties": {"type": {"const": "text"},
                                                 "text": {"type": "string"}},
                "required": ["type", "text"]}}]},
            "messages": {"type": "array", "minItems": 1, "items": {
                "type": "object", "properties": {
                    "role": {"enum": ["user", "assistant"]},
                    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
                        "type": "object", "description": "text, tool_use (assistant), "
                        "tool_result (user) or thinking (assistant) block.",
                        "properties": {"type": {"enum": ["text", "tool_use", "tool_result",
                                                         "thinking"]}},
                        "required": ["type"]}}]}},
                "required": ["role", "content"]}},
            "tools": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "description": {"type": "string"},
                "input_schema": _SCHEMA_OBJECT}, "required": ["name", "input_schema"]}},
            "tool_choice": {"type": "object", "properties": {
                "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
                "disable_parallel_tool_use": {"type": "boolean"}}, "required": ["type"]},
            "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1},
                               "maxItems": fields.MAX_STOP},
            "stream": {"type": "boolean"},
            "thinking": {"type": "object", "properties": {
                "type": {"enum": ["enabled", "disabled"]}}, "required": ["type"],
                "description": "Sets the chat template's enable_thinking."},
            **_SAMPLING,
        },
        "required": ["max_tokens", "messages"],
    },
    "Message": {
        "type": "object",
        "properties": {
            "id": {"type": "string"}, "type": {"const": "message"},
            "role": {"const": "assistant"},
            "content": {"type": "array", "items": {"type": "object", "description":
                        "thinking, text or tool_use blocks."}},
            "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
            "stop_sequence": _nullable({"type": "string"}),
            "usage": {"type": "object"},
        },
        "required": ["id", "type", "role", "content", "stop_reason", "usage"],
    },
    "AnthropicError": {
        "type": "object",
        "properties": {"type": {"const": "error"}, "error": {
            "type": "object", "properties": {"type": {"type": "string"},
                                             "message": {"type": "string"}},
            "required": ["type", "message"]}},
        "required": ["type", "error"],
    },
}


def paths(model_name: str, openai_errors: dict[str, Any]) -> dict[str, Any]:
    """The paths; ``openai_errors`` are the OpenAI endpoints' error responses."""

    def anthropic(description: str) -> dict[str, Any]:
        return _json(_ref("AnthropicError"), description)

    anthropic_errors = {
        "400": anthropic("Invalid request."), "401": anthropic("Missing or wrong API key."),
        "404": anthropic("Unknown model."), "413": anthropic("Body too large."),
    }
    response_id = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "/v1/responses": {"post": {
            "operationId": "createResponse",
            "summary": "OpenAI Responses API (input items, function tools, text.format, "
            "previous_response_id, streaming events).",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": _ref("ResponseRequest"),
                "example": {"model": model_name, "input": "Hello!"}}}},
            "responses": {"200": _sse_or_json("Response", "The response."),
                          **openai_errors},
        }},
        "/v1/responses/{id}": {
            "get": {"operationId": "getResponse", "summary": "A stored response (this API "
                    "key's own).", "parameters": response_id,
                    "responses": {"200": _json(_ref("Response"), "The response."),
                                  **{k: openai_errors[k] for k in ("401", "404")}}},
            "delete": {"operationId": "deleteResponse", "summary": "Forget a stored response.",
                       "parameters": response_id,
                       "responses": {"200": _json({"type": "object", "properties": {
                           "id": {"type": "string"}, "deleted": {"const": True}}}, "Deleted."),
                           **{k: openai_errors[k] for k in ("401", "404")}}},
        },
        "/v1/messages": {"post": {
            "operationId": "createMessage",
            "summary": "Anthropic Messages API (content blocks, tools, stop_sequences, "
            "streaming events); the key may come as x-api-key.",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": _ref("MessageRequest"),
                "example": {"model": model_name, "max_tokens": 64,
                            "messages": [{"role": "user", "content": "Hello!"}]}}}},
            "responses": {"200": _sse_or_json("Message", "The message."), **anthropic_errors,
                          "500": anthropic("The backend failed while generating."),
                          "503": anthropic("The server is full or shutting down.")},
        }},
        "/v1/messages/count_tokens": {"post": {
            "operationId": "countMessageTokens",
            "summary": "Prompt tokens of a Messages request (max_tokens not needed).",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {**SCHEMAS["MessageRequest"], "required": ["messages"]}}}},
            "responses": {"200": _json({"type": "object", "properties": {
                "input_tokens": {"type": "integer"}}, "required": ["input_tokens"]},
                "The count."), **anthropic_errors},
        }},
    }
