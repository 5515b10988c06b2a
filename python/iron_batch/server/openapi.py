"""The server's OpenAPI 3.1 document (GET /openapi.json), written by hand.

Hand-written rather than generated because most endpoints are raw ASGI callables with no
annotations to generate from, and because the document is a contract for fuzzers
(schemathesis): each request schema states the ranges the server accepts, and every
status an endpoint can answer is listed, so a fuzzer can tell a documented 4xx from a bug.
"""

from __future__ import annotations

from typing import Any

from iron_batch import __version__
from iron_batch.server import fields, openapi_agent_apis
from iron_batch.server.fields import MAX_REQUEST_ID_LEN, nullable_schema


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_nullable = nullable_schema


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


_AUTH_ERRORS = {"401": _error("Missing or wrong API key (when the server has one).")}
_BODY_ERRORS = {
    "400": _error("Invalid request: malformed JSON or a bad parameter (error.param names it)."),
    "404": _error("Unknown model."),
    "413": _error("Body too large."),
}
_FULL = {
    "503": {
        **_error("The server is full, shutting down or its engine failed; retry after the "
                 "Retry-After header's seconds."),
        "headers": {"Retry-After": {"schema": {"type": "integer"}}},
    },
    "500": _error("The backend failed while generating."),
}

_SAMPLING: dict[str, Any] = {
    "model": _nullable({"type": "string", "description": "Served model name (optional)."}),
    **fields.sampling_schema(nullable=True),
    "n": _nullable(fields.N.schema()),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({
        "type": "object",
        "properties": {"include_usage": _nullable({"type": "boolean"}),
                       "continuous_usage_stats": _nullable({
                           "type": "boolean",
                           "description": "Every chunk carries the usage so far."})},
        "description": "Only with stream: true.",
    }),
    "priority": _nullable(fields.PRIORITY.schema()),
    "cache_salt": _nullable({
        "type": "string", "minLength": 1, "maxLength": fields.MAX_CACHE_SALT_LEN,
        "description": "Requests with different salts never share prefix-cache blocks "
                       "(with several API keys, each key's requests are salted apart too)."}),
    "user": _nullable({"type": "string"}),
    "max_tokens": _nullable(fields.MAX_TOKENS_FIELD.schema()),
}
# OpenAI's default temperature is 1 (/generate's is greedy).
_SAMPLING["temperature"] = _nullable({**fields.TEMPERATURE.schema(), "default": 1})

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

_LOGPROB_TOP: dict[str, Any] = {
    "type": "object",
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number"},
        "bytes": _nullable({"type": "array", "items": {"type": "integer"}}),
    },
    "required": ["token", "logprob"],
}

#: Output constraints both generation endpoints take (see server/openai/structured.py).
_STRUCTURED: dict[str, Any] = {
    "response_format": _nullable({"type": "object", "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {
            "name": {"type": "string"}, "schema": {"type": "object"},
            "strict": {"type": ["boolean", "null"]}}},
    }, "required": ["type"], "description": "json_schema and json_object are enforced by "
        "constrained decoding; an invalid schema is a 400."}),
    "guided_json": _nullable({"type": "object", "description": "vLLM: a JSON schema."}),
    "guided_regex": _nullable({"type": "string", "description": "vLLM: the output matches."}),
    "guided_choice": _nullable({"type": "array", "items": {"type": "string"},
                                "description": "vLLM: the output is one of these."}),
}
_TOOL_CALL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {"type": "object", "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string"}}},
    },
}

_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                "required": ["message", "type"],
            }
        },
        "required": ["error"],
    },
    "Usage": {
        "type": "object",
        "properties": {
            "prompt_tokens": {"type": "integer"},
            "completion_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"},
            "prompt_tokens_details": {
                "type": "object", "properties": {"cached_tokens": {"type": "integer"}},
            },
        },
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    },
    "CompletionRequest": {
        "type": "object",
        "properties": {
            **_SAMPLING,
            **_STRUCTURED,
            "prompt": {"anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
            ]},
            "logprobs": _nullable(fields.LOGPROBS.schema()),
            "echo": _nullable({
                "type": "boolean",
                "description": "With logprobs: every prompt token's logprob too (the first "
                               "one's is null), computed without the prefix cache; "
                               "max_tokens 0 then scores the prompt only."}),
            "best_of": _nullable(fields.BEST_OF.schema()),
        },
        "required": ["prompt"],
    },
    "ChatMessage": {
        "type": "object",
        "properties": {
            "role": {"type": "string",
                     "enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": _nullable({"anyOf": [
                {"type": "string"},
                {"type": "array", "items": {
                    "type": "object",
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    "required": ["type", "text"],
                }},
            ]}),
            "name": {"type": "string"},
            "tool_calls": _nullable({"type": "array", "items": _TOOL_CALL}),
            "tool_call_id": _nullable({"type": "string"}),
        },
        "required": ["role"],
    },
    "ChatCompletionRequest": {
        "type": "object",
        "properties": {
            **_SAMPLING,
            **_STRUCTURED,
            "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
            "tools": _nullable({"type": "array", "items": {
                "type": "object",
                "properties": {"type": {"const": "function"}, "function": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                                   "description": {"type": "string"},
                                   "parameters": {"type": "object"}},
                    "required": ["name"]}},
                "required": ["type", "function"]}}),
            "tool_choice": _nullable({"anyOf": [
                {"type": "string", "enum": ["none", "auto", "required"]},
                {"type": "object", "properties": {
                    "type": {"const": "function"},
                    "function": {"type": "object", "properties": {"name": {"type": "string"}},
                                 "required": ["name"]}},
                 "required": ["type", "function"]}],
                "description": "Named and required calls are enforced by constrained "
                "decoding; auto parses the model's own tool-call format."}),
            "parallel_tool_calls": _nullable({"type": "boolean"}),
            "max_completion_tokens": _nullable(fields.MAX_COMPLETION_TOKENS.schema()),
            "logprobs": _nullable({"type": "boolean"}),
            "top_logprobs": _nullable(fields.TOP_LOGPROBS.schema()),
            "add_generation_prompt": _nullable({"type": "boolean"}),
        },
        "required": ["messages"],
    },
    "CompletionLogprobs": {
        "type": "object",
        "properties": {
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {"type": "array", "items": _nullable({"type": "number"})},
            "top_logprobs": {"type": "array", "items": _nullable({
                "type": "object", "additionalProperties": {"type": "number"}})},
            "text_offset": {"type": "array", "items": {"type": "integer"}},
        },
    },
    "ChatLogprobs": {
        "type": "object",
        "properties": {"content": {"type": "array", "items": {
            **_LOGPROB_TOP,
            "properties": {**_LOGPROB_TOP["properties"],
                           "top_logprobs": {"type": "array", "items": _LOGPROB_TOP}},
        }}},
    },
    "Completion": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {
                "type": "object",
                "properties": {
                    "index": {"type": "integer"},
                    "text": {"type": "string"},
                    "logprobs": _nullable(_ref("CompletionLogprobs")),
                    "finish_reason": {"type": ["string", "null"]},
                },
                "required": ["index", "text", "finish_reason"],
            }},
            "usage": _ref("Usage"),
        },
        "required": ["id", "object", "created", "model", "choices", "usage"],
    },
    "ChatCompletion": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {
                "type": "object",
                "properties": {
                    "index": {"type": "integer"},
                    "message": {
                        "type": "object",
                        "properties": {"role": {"const": "assistant"},
                                       "content": {"type": ["string", "null"]},
                                       "tool_calls": {"type": "array", "items": _TOOL_CALL}},
                        "required": ["role", "content"],
                    },
                    "logprobs": _nullable(_ref("ChatLogprobs")),
                    "finish_reason": {"type": ["string", "null"]},
                },
                "required": ["index", "message", "finish_reason"],
            }},
            "usage": _ref("Usage"),
        },
        "required": ["id", "object", "created", "model", "choices", "usage"],
    },
    "Model": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {"type": "integer"},
        },
        "required": ["id", "object", "created", "owned_by"],
    },
    "GenerateRequest": {
        "type": "object",
        "description": "Exactly one of prompt_tokens, prompt_token_ids, prompt. Unknown "
        "fields are rejected.",
        "properties": {
            "prompt_tokens": fields.PROMPT_TOKENS.schema(),
            "prompt_token_ids": _TOKEN_IDS,
            "prompt": {"type": "string", "minLength": 1},
            "max_new_tokens": fields.MAX_NEW_TOKENS.schema(),
            "request_id": {"type": "string", "minLength": 1, "maxLength": MAX_REQUEST_ID_LEN},
            **fields.sampling_schema(nullable=False),
        },
        "additionalProperties": False,
    },
}


def _sse_or_json(schema_name: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {
            "application/json": {"schema": _ref(schema_name)},
            "text/event-stream": {"schema": {
                "type": "string",
                "description": "stream: true. `data: {chunk}` events, then `data: [DONE]`.",
            }},
        },
    }


def openapi_schema(model_name: str, *, ui: bool = False) -> dict[str, Any]:
    """The whole document; ``model_name`` appears in descriptions and examples."""
    auth_gen = {**_AUTH_ERRORS, **_BODY_ERRORS, **_FULL}
    auth_body = {**_AUTH_ERRORS, **_BODY_ERRORS}
    paths: dict[str, Any] = {
        "/v1/models": {"get": {
            "operationId": "listModels",
            "summary": "The served model.",
            "responses": {
                "200": _json({"type": "object", "properties": {
                    "object": {"const": "list"},
                    "data": {"type": "array", "items": _ref("Model")},
                }, "required": ["object", "data"]}, "Model list."),
                **_AUTH_ERRORS,
            },
        }},
        "/v1/models/{model}": {"get": {
            "operationId": "getModel",
            "summary": "One model by name.",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {"200": _json(_ref("Model"), "The model."),
                          "404": _error("Unknown model."), **_AUTH_ERRORS},
        }},
        "/v1/completions": {"post": {
            "operationId": "createCompletion",
            "summary": "OpenAI-compatible text completion.",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": _ref("CompletionRequest"),
                "example": {"model": model_name, "prompt": "Once upon a time",
                            "max_tokens": 16},
            }}},
            "responses": {"200": _sse_or_json("Completion", "The completion."), **auth_gen},
        }},
        "/v1/chat/completions": {"post": {
            "operationId": "createChatCompletion",
            "summary": "OpenAI-compatible chat completion (the checkpoint's chat template).",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": _ref("ChatCompletionRequest"),
                "example": {"model": model_name,
                            "messages": [{"role": "user", "content": "Hello!"}]},
            }}},
            "responses": {"200": _sse_or_json("ChatCompletion", "The completion."),
                          **auth_gen},
        }},
        "/tokenize": {"post": {
            "operationId": "tokenize",
            "summary": "Text (or chat messages through the template) to token ids.",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object",
                "description": "Exactly one of prompt and messages.",
                "properties": {
                    "model": _SAMPLING["model"],
                    "prompt": {"type": "string"},
                    "messages": {"type": "array", "items": _ref("ChatMessage"),
                                 "minItems": 1},
                    "add_special_tokens": {"type": "boolean", "default": True},
                    "add_generation_prompt": {"type": "boolean", "default": True},
                },
            }}}},
            "responses": {
                "200": _json({"type": "object", "properties": {
                    "tokens": {"type": "array", "items": {"type": "integer"}},
                    "count": {"type": "integer"},
                    "max_model_len": {"type": "integer"},
                }, "required": ["tokens", "count"]}, "Token ids."),
                **auth_body,
            },
        }},
        "/tokenizer_info": {"get": {
            "operationId": "tokenizerInfo",
            "summary": "The tokenizer's special tokens, chat template and context length.",
            "responses": {
                "200": _json({"type": "object", "properties": {
                    "eos_token": _nullable({"type": "string"}),
                    "bos_token": _nullable({"type": "string"}),
                    "pad_token": _nullable({"type": "string"}),
                    "chat_template": _nullable({"type": "string"}),
                    "model_max_length": {"type": "integer"},
                }, "required": ["eos_token", "bos_token", "pad_token", "chat_template",
                                "model_max_length"]}, "Tokenizer settings."),
                "404": _error("The model has no tokenizer."),
                **_AUTH_ERRORS,
            },
        }},
        "/detokenize": {"post": {
            "operationId": "detokenize",
            "summary": "Token ids to text.",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object",
                "properties": {"model": _SAMPLING["model"],
                               "tokens": {"type": "array",
                                          "items": {"type": "integer", "minimum": 0}}},
                "required": ["tokens"],
            }}}},
            "responses": {
                "200": _json({"type": "object", "properties": {"prompt": {"type": "string"}},
                              "required": ["prompt"]}, "The text."),
                **auth_body,
            },
        }},
        "/generate": {"post": {
            "operationId": "generate",
            "summary": "Native streaming endpoint: one JSON line per token.",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": _ref("GenerateRequest"),
                "example": {"prompt_tokens": 128, "max_new_tokens": 64},
            }}},
            "responses": {
                "200": {"description": "NDJSON: one line per token, the last with "
                        "done: true and finish_reason.",
                        "content": {"application/x-ndjson": {"schema": {"type": "string"}}}},
                "400": _error("Invalid request."),
                "409": _error("request_id is already live."),
                "413": _error("Body too large."),
                "503": _FULL["503"],
                **_AUTH_ERRORS,
            },
        }},
        "/metrics": {"get": {
            "operationId": "metrics",
            "summary": "Engine metrics: JSON, or Prometheus text when Accept asks for text.",
            "responses": {
                "200": {"description": "Metrics.", "content": {
                    "application/json": {"schema": {"type": "object"}},
                    "text/plain": {"schema": {"type": "string"}},
                }},
                **_AUTH_ERRORS,
            },
        }},
        "/health": {"get": {
            "operationId": "health",
            "summary": "200 while the engine thread runs steps; never needs the API key.",
            "security": [],
            "responses": {
                "200": _json({"type": "object", "properties": {"status": {"type": "string"}}},
                             "Healthy."),
                "503": _json({"type": "object", "properties": {"status": {"type": "string"}}},
                             "Engine stopped or stalled."),
            },
        }},
        "/openapi.json": {"get": {
            "operationId": "openapi",
            "summary": "This document.",
            "responses": {"200": _json({"type": "object"}, "OpenAPI document."),
                          **_AUTH_ERRORS},
        }},
    }
    paths.update(openapi_agent_apis.paths(model_name, auth_gen))
    paths["/v1/embeddings"] = {"post": {
        "operationId": "createEmbedding",
        "summary": "Pooled final hidden states of each input (a torch model's backend).",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object",
            "properties": {
                "model": _SAMPLING["model"],
                "input": {"anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1},
                     "minItems": 1, "maxItems": fields.MAX_CHOICES},
                    _TOKEN_IDS,
                    {"type": "array", "items": _TOKEN_IDS, "minItems": 1,
                     "maxItems": fields.MAX_CHOICES}]},
                "encoding_format": _nullable({"enum": ["float", "base64"]}),
                "dimensions": _nullable({"type": "integer", "minimum": 1,
                                         "description": "Keep the first components "
                                         "(renormalised); at most the hidden size."}),
                "user": _nullable({"type": "string"}),
            },
            "required": ["input"],
        }, "example": {"model": model_name, "input": "Hello!"}}}},
        "responses": {"200": _json({"type": "object", "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"type": "object", "properties": {
                "object": {"const": "embedding"}, "index": {"type": "integer"},
                "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}},
                                        {"type": "string"}]}}}},
            "usage": {"type": "object"}}, "required": ["object", "data"]}, "Embeddings."),
            **auth_gen},
    }}
    if ui:
        paths.update(_ui_paths())
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "iron-batch",
            "version": __version__,
            "description": f"Continuous-batching LLM server serving {model_name!r}. "
            "OpenAI-compatible under /v1 (chat, completions, the Responses API), and the "
            "Anthropic Messages API at /v1/messages.",
        },
        "paths": paths,
        "components": {
            "schemas": {**_SCHEMAS, **openapi_agent_apis.SCHEMAS},
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x_api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        # Only enforced when the server was started with --api-key.
        "security": [{"bearer": []}, {"x_api_key": []}, {}],
    }


def _ui_paths() -> dict[str, Any]:
    """The page at / and the two JSON endpoints it reads (see iron_batch.server.ui)."""
    return {
        "/": {"get": {
            "operationId": "page",
            "summary": "The chat playground and live dashboard (off with --no-ui); holds no "
            "data itself, so it never needs the API key.",
            "security": [],
            "responses": {"200": {"description": "The page.",
                                  "content": {"text/html": {"schema": {"type": "string"}}}}},
        }},
        "/ui/api/info": {"get": {
            "operationId": "ui_info",
            "summary": "The server's configuration: model, dtype, device, backend, KV pool, "
            "scheduler and request limits.",
            "responses": {"200": _json({"type": "object"}, "Configuration."), **_AUTH_ERRORS},
        }},
        "/ui/api/snapshots": {"get": {
            "operationId": "ui_snapshots",
            "summary": "Metric snapshots (one a second, the last 300 kept) newer than `after`.",
            "parameters": [{
                "name": "after", "in": "query", "required": False,
                "description": "The seq of the last snapshot already seen (default 0: all).",
                "schema": {"type": "integer"},
            }],
            "responses": {
                "200": _json({"type": "object", "properties": {
                    "snapshots": {"type": "array", "items": {"type": "object"}}}},
                    "Snapshots, oldest first."),
                "400": _error("after is not an integer."),
                **_AUTH_ERRORS,
            },
        }},
    }
