"""OpenAI request validation: a JSON body becomes an :class:`OpenAIRequest` (token-id
prompts plus one :class:`SamplingParams` per choice) or an
:class:`~iron_batch.server.errors.ApiError`.

Leniency is deliberate where clients differ: ``null`` means "not given" for every optional
field (several SDKs send explicit nulls), and unknown fields are ignored (clients add
vendor fields freely). Fields we know but cannot honour (functions, logit_bias, suffix, ...)
are 400s rather than silently ignored, so nobody gets a quietly different behaviour.
Field types and ranges are :mod:`iron_batch.server.fields`'s, shared with /generate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from iron_batch.sampling_params import SEED_MAX, SamplingParams
from iron_batch.server import fields
from iron_batch.server.admission import ServerLimits, check_size
from iron_batch.server.errors import ApiError
from iron_batch.server.fields import MAX_CHOICES, MAX_MESSAGES, MAX_PROMPTS
from iron_batch.server.openai import tools as openai_tools
from iron_batch.server.openai.reasoning import ReasoningFormat, opens_reasoning
from iron_batch.server.openai.structured import read_constraint

Kind = Literal["completion", "chat"]


@dataclass
class ModelInfo:
    """What validation needs to know about the served model and this server."""

    name: str
    tokenizer: Any  # iron_batch.tokenizer.Tokenizer or None
    vocab_size: int
    #: Longest sequence (prompt + output) the scheduler accepts: KV pool and model context.
    max_seq_tokens: int
    limits: ServerLimits = field(default_factory=ServerLimits)
    #: The backend enforces grammars (response_format, forced tool calls).
    structured_output: bool = False
    #: How chat output splits into reasoning and answer (None: it does not).
    reasoning: ReasoningFormat | None = None


@dataclass
class OpenAIRequest:
    kind: Kind
    model: str
    #: Token ids of each prompt (completions may batch several; chat has one).
    prompts: list[list[int]]
    #: Prompt text per prompt, for ``echo`` (None when given as token ids).
    prompt_texts: list[str | None]
    #: Sampling settings per prompt and choice: ``params[p][i]``.
    params: list[list[SamplingParams]]
    n: int
    stream: bool = False
    include_usage: bool = False
    #: None: no logprobs; else the number of top alternatives per token.
    logprobs: int | None = None
    echo: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    #: stream_options.continuous_usage_stats: every chunk carries the usage so far.
    continuous_usage: bool = False
    #: echo with logprobs: the prompt tokens' logprobs come first (prompt scoring).
    prompt_logprobs: bool = False
    #: max_tokens 0 with echo and logprobs: one token is computed (the engine samples at
    #: least one per request) but none is returned; only the prompt is scored.
    score_only: bool = False
    #: How a chat request uses its tools (None: no tools, or tool_choice none).
    tool_plan: openai_tools.ToolPlan | None = None
    #: How the output splits into reasoning and answer (chat; None: it does not).
    reasoning: ReasoningFormat | None = None
    #: The rendered prompt opened a thinking block: the output starts inside it.
    reasoning_open: bool = False

    @property
    def num_choices(self) -> int:
        return self.n * len(self.prompts)


def _encode(model: ModelInfo, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    return fields.encode_text(model.tokenizer, text, param, add_special_tokens=add_special_tokens)


def check_model(body: dict[str, Any], model: ModelInfo) -> str:
    name = fields.read_str(body, "model", null_ok=True)
    # Optional here (the official client always sends it): curl users need not know it.
    if name is not None and name != model.name:
        raise ApiError(
            f"the model {name!r} does not exist; this server serves {model.name!r}",
            status=404,
            param="model",
            code="model_not_found",
        )
    return model.name


def _reject_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        value = body.get(name)
        if value not in (None, "", [], {}):
            raise ApiError(f"{name} is not supported by this server", param=name)


def _common_params(body: dict[str, Any], model: ModelInfo) -> SamplingParams:
    """The sampling fields shared by completions and chat, on OpenAI's defaults (its
    temperature is 1; /generate's is greedy)."""
    params = SamplingParams(temperature=1.0)
    fields.read_sampling(body, params, model.tokenizer, model.vocab_size, null_ok=True)
    priority = fields.PRIORITY.read(body, null_ok=True)
    if priority is not None:
        params.priority = priority
    salt = fields.read_str(body, "cache_salt", null_ok=True)
    if salt is not None:
        if not 0 < len(salt) <= fields.MAX_CACHE_SALT_LEN:
            raise ApiError(
                f"cache_salt must be a string of 1 to {fields.MAX_CACHE_SALT_LEN} characters",
                param="cache_salt",
            )
        params.cache_salt = salt
    return params


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    return fields.read_bool(body, name, default, null_ok=True)


def _max_tokens(body: dict[str, Any], specs: tuple[fields.Number, ...],
                default: int | None) -> tuple[int | None, str]:
    for spec in specs:
        value = spec.read(body, null_ok=True)
        if value is not None:
            return value, spec.name
    return default, specs[-1].name


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of ``stream_options``."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    if not stream:
        raise ApiError("stream_options is only allowed with stream: true",
                       param="stream_options")
    return (_bool(options, "include_usage", False),
            _bool(options, "continuous_usage_stats", False))


def _per_choice(
    base: SamplingParams, prompts: list[list[int]], requested: int | None,
    requested_param: str, n: int, model: ModelInfo, prompt_param: str,
) -> list[list[SamplingParams]]:
    out: list[list[SamplingParams]] = []
    cap = model.limits.max_new_tokens
    for prompt in prompts:
        check_size(model.limits, len(prompt), requested, prompt_param=prompt_param,
                   new_tokens_param=requested_param)
        room = model.max_seq_tokens - len(prompt)
        if room < (1 if requested != 0 else 0):
            raise ApiError(
                f"the prompt has {len(prompt)} tokens; this server fits at most "
                f"{model.max_seq_tokens} tokens (prompt and completion) per sequence",
                param=prompt_param,
                code="context_length_exceeded",
            )
        # Clamped, not rejected: "as much as fits" is what clients asking for a lot mean.
        max_new = room if requested is None else min(requested, room)
        if cap is not None:
            max_new = min(max_new, cap)
        choices = []
        for i in range(n):
            params = dataclasses.replace(
                base, max_new_tokens=max_new, stop=list(base.stop),
                stop_token_ids=list(base.stop_token_ids),
            )
            if base.seed is not None:
                # Distinct but reproducible choices, wrapped into the seed range.
                params.seed = (base.seed + i) % (SEED_MAX + 1)
            choices.append(params)
        out.append(choices)
    fields.check(out[0][0])
    return out


def _n(body: dict[str, Any], num_prompts: int) -> int:
    n = fields.N.read(body, null_ok=True)
    n = 1 if n is None else n
    if n * num_prompts > MAX_CHOICES:
        raise ApiError(f"n times the number of prompts must be at most {MAX_CHOICES}",
                       param="n")
    best_of = fields.BEST_OF.read(body, null_ok=True)
    if best_of is not None and best_of != n:
        raise ApiError("best_of other than n is not supported", param="best_of")
    return n


def _completion_prompts(
    value: Any, model: ModelInfo
) -> tuple[list[list[int]], list[str | None]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of those lists."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise ApiError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists",
            param="prompt",
        )
    if len(items) > MAX_PROMPTS:
        raise ApiError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    prompts: list[list[int]] = []
    texts: list[str | None] = []
    for item in items:
        if isinstance(item, str):
            ids = _encode(model, item, "prompt")
            if not ids:
                raise ApiError("prompt encodes to no tokens", param="prompt")
            prompts.append(ids)
            texts.append(item)
        else:
            ids = fields.token_ids(item, "prompt", model.vocab_size)
            prompts.append(list(ids))
            texts.append(None)
    return prompts, texts


def parse_completion(body: dict[str, Any], model: ModelInfo) -> OpenAIRequest:
    name = check_model(body, model)
    _reject_unsupported(body, ("suffix", "logit_bias"))
    if body.get("prompt") is None:
        raise ApiError("prompt is required", param="prompt")
    prompts, texts = _completion_prompts(body["prompt"], model)
    base = _common_params(body, model)
    base.grammar = read_constraint(body, model.structured_output)
    logprobs = fields.LOGPROBS.read(body, null_ok=True)
    base.logprobs = logprobs
    echo = _bool(body, "echo", False)
    scoring = echo and logprobs is not None
    if scoring:
        # Evaluation harnesses score prompts this way: every prompt token's logprob.
        base.prompt_logprobs = logprobs
    stream = _bool(body, "stream", False)
    include_usage, continuous_usage = _stream_options(body, stream)
    n = _n(body, len(prompts))
    # OpenAI's completions default is 16 tokens.
    requested, param = _max_tokens(body, (fields.MAX_TOKENS_FIELD,), 16)
    score_only = scoring and requested == 0
    params = _per_choice(base, prompts, 1 if score_only else requested, param, n, model,
                         "prompt")
    if echo:
        for i, text in enumerate(texts):
            if text is None and model.tokenizer is not None:
                texts[i] = model.tokenizer.decode(prompts[i], skip_special_tokens=False)
    out = OpenAIRequest(
        "completion", name, prompts, texts, params, n, stream, include_usage, logprobs, echo
    )
    out.continuous_usage = continuous_usage
    out.prompt_logprobs = scoring
    out.score_only = score_only
    return out


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def messages_from(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ApiError("messages must be a non-empty list", param="messages")
    if len(value) > MAX_MESSAGES:
        raise ApiError(f"at most {MAX_MESSAGES} messages", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ApiError(f"{param} must be an object", param=param)
        role = msg.get("role")
        if role not in _ROLES:
            raise ApiError(
                f"{param}.role must be one of {', '.join(sorted(_ROLES))}", param=param
            )
        content = msg.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str
                ):
                    raise ApiError(
                        f"{param}.content: only text parts are supported", param=param
                    )
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise ApiError(f"{param}.content must be a string or a list of parts",
                              param=param)
        # Templates written for HF know "system", not OpenAI's newer "developer".
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": text}
        if isinstance(msg.get("name"), str):
            entry["name"] = msg["name"]
        openai_tools.history_message(msg, entry, param)
        out.append(entry)
    return out


#: Variables the server itself gives the chat template.
_TEMPLATE_OWN = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs``: extra variables for the chat template (``enable_thinking``)."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ApiError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    own = [k for k in value if k in _TEMPLATE_OWN]
    if own:
        raise ApiError(f"chat_template_kwargs cannot set {own[0]}",
                       param="chat_template_kwargs")
    return dict(value)


def render_chat(model: ModelInfo, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None,
                kwargs: dict[str, Any] | None = None) -> str:
    tok = model.tokenizer
    if tok is None or getattr(tok, "chat_template", None) is None:
        raise ApiError("this model has no chat template; use /v1/completions",
                          param="messages")
    messages, tools = openai_tools.template_messages(messages, tools, tok.chat_template)
    extra: dict[str, Any] = dict(kwargs or {})
    if tools is not None:
        extra["tools"] = tools
    try:
        return str(tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           **extra))
    except Exception as exc:  # jinja TemplateError (e.g. roles must alternate) and kin
        raise ApiError(f"chat template failed: {exc}", param="messages") from exc


def chat_prompt_ids(model: ModelInfo, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    kwargs: dict[str, Any] | None = None) -> list[int]:
    return chat_prompt(model, messages, add_generation_prompt, tools, kwargs)[0]


def chat_prompt(model: ModelInfo, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None,
                kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
    """(token ids, text) of the rendered conversation."""
    text = render_chat(model, messages, add_generation_prompt, tools, kwargs)
    # The template writes BOS itself where the model wants one.
    return _encode(model, text, "messages", add_special_tokens=False), text


def parse_chat(body: dict[str, Any], model: ModelInfo) -> OpenAIRequest:
    name = check_model(body, model)
    _reject_unsupported(body, ("functions", "logit_bias", "audio", "prediction"))
    tool_plan = openai_tools.read_tools(body, model.structured_output)
    grammar = read_constraint(body, model.structured_output)
    if tool_plan is not None and tool_plan.grammar is not None:
        grammar = tool_plan.grammar
    messages = messages_from(body.get("messages"))
    add_gen = _bool(body, "add_generation_prompt", True)
    prompt, prompt_text = chat_prompt(
        model, messages, add_gen, tool_plan.declarations() if tool_plan is not None else None,
        template_kwargs(body),
    )
    if not prompt:
        raise ApiError("messages render to no tokens", param="messages")
    base = _common_params(body, model)
    base.grammar = grammar
    keep: list[str] = []
    if tool_plan is not None and tool_plan.mode == "auto":
        # Calls written with special tokens (Gemma 4's) must survive decoding.
        keep += openai_tools.KEEP_TOKENS
    # A grammar (forced call, response_format) starts the output at its JSON: no thinking.
    reasoning = model.reasoning if grammar is None else None
    if reasoning is not None:
        keep += reasoning.keep_tokens  # tags written with special tokens (Gemma 4's channel)
    base.keep_special_tokens = keep
    want = _bool(body, "logprobs", False)
    top = fields.TOP_LOGPROBS.read(body, null_ok=True)
    if top is not None and not want:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (top or 0) if want else None
    base.logprobs = logprobs
    stream = _bool(body, "stream", False)
    include_usage, continuous_usage = _stream_options(body, stream)
    n = _n(body, 1)
    requested, param = _max_tokens(
        body, (fields.MAX_COMPLETION_TOKENS, fields.MAX_TOKENS_FIELD), None
    )
    params = _per_choice(base, [prompt], requested, param, n, model, "messages")
    out = OpenAIRequest(
        "chat", name, [prompt], [None], params, n, stream, include_usage, logprobs, False,
        tool_plan=tool_plan,
    )
    out.continuous_usage = continuous_usage
    if reasoning is not None:
        out.reasoning = reasoning
        out.reasoning_open = opens_reasoning(reasoning, prompt_text)
    return out


