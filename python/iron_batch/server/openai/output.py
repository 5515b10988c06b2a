"""One choice's generated text as an assistant turn: reasoning, content and tool calls.

The chat endpoint, the Responses API and the Messages API all read a choice through this
module, in the chat shapes (``{"reasoning_content", "content", "tool_calls"}`` messages and
deltas); the other two front ends translate those shapes into their own. The reasoning
split (:mod:`.reasoning`) comes first, tool calls are read from the content after it
(:mod:`.tools`), and a streamed choice gives the same split as the whole text at once.
"""

from __future__ import annotations

from typing import Any

from iron_batch.server.openai.reasoning import ReasoningFormat, ReasoningSplitter
from iron_batch.server.openai.tools import ToolPlan, ToolStream


def splitter(fmt: ReasoningFormat | None, in_reasoning: bool) -> ReasoningSplitter | None:
    return ReasoningSplitter(fmt, in_reasoning) if fmt is not None else None


def assistant_message(
    text: str, finish_reason: str | None, plan: ToolPlan | None,
    reasoning: ReasoningSplitter | None,
) -> tuple[dict[str, Any], str | None]:
    """The assistant message and finish reason of a finished choice's ``text``."""
    thought = None
    if reasoning is not None:
        thought, text = reasoning.split(text)
    if plan is not None:
        message, finish_reason = plan.message(text, finish_reason)
    else:
        message = {"role": "assistant", "content": text}
    if reasoning is not None:
        # vLLM's name, and the one newer clients read.
        message["reasoning_content"] = message["reasoning"] = thought or None
        if thought and not message["content"]:
            message["content"] = None  # all thinking (the limit cut it): no answer
    return message, finish_reason


class OutputStream:
    """One choice's text deltas -> chat deltas (``reasoning_content``/``reasoning``,
    ``content``, ``tool_calls``) and its finish reason."""

    def __init__(self, plan: ToolPlan | None, reasoning: ReasoningSplitter | None) -> None:
        self.reasoning = reasoning
        self.tools = ToolStream(plan) if plan is not None else None

    def feed(
        self, text: str, finished: bool, reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        delta: dict[str, Any] = {}
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, finished)
            if thought:
                delta["reasoning_content"] = delta["reasoning"] = thought
        if self.tools is not None:
            tool_delta, reason = self.tools.feed(text, finished, reason)
            delta.update(tool_delta)
        elif text:
            delta["content"] = text
        return delta, reason
