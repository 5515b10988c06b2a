"""Reasoning output: the thinking a model writes between tags, split from its answer.

Models such as Qwen3, SmolLM3 and the DeepSeek-R1 distills think in ``<think>...</think>``
before they answer. Gemma 4 thinks in a thought channel, ``<|channel>thought\n...<channel|>``,
whose markers are special tokens of its tokenizer: requests split by that format keep them
in the decoded text (:attr:`ReasoningFormat.keep_tokens`), as tool calls keep theirs. The
parser is chosen from the model's chat template (a template that writes both tags) or its
vocabulary (Gemma 4's channel markers), or by the server's ``reasoning_parser`` setting,
never guessed from the output. Whether the output starts inside the thinking block follows
from the rendered prompt: a template that opens the block itself (R1 distills; Gemma 4's
after a tool result, in some versions) leaves only the closing tag to the model.

:class:`ReasoningSplitter` works on text deltas and holds back anything that may be the
start of a tag, so a tag split across tokens is still found, and the whole text fed at once
(a non-streamed response) splits exactly as the same text fed token by token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Values of the server's ``reasoning_parser`` setting.
REASONING_PARSERS = ("auto", "think", "gemma4", "none")


@dataclass(frozen=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"
    #: Special tokens the tags are written with: kept in the decoded text of the requests
    #: split by this format (decoding skips special tokens otherwise).
    keep_tokens: tuple[str, ...] = ()


THINK = ReasoningFormat()
#: Gemma 4's markers, each one special token.
CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
#: Gemma 4's thought channel. The channel's name ends the start tag; the newline after it
#: is dropped with the other whitespace at the block's start (a block cut short may lack it).
GEMMA4 = ReasoningFormat(f"{CHANNEL_OPEN}thought", CHANNEL_CLOSE, (CHANNEL_OPEN, CHANNEL_CLOSE))


def _has_tokens(tokenizer: Any, *texts: str) -> bool:
    lookup = getattr(tokenizer, "token_to_id", None)
    return lookup is not None and all(lookup(t) is not None for t in texts)


def reasoning_format(chat_template: str | None, setting: str = "auto",
                     tokenizer: Any = None) -> ReasoningFormat | None:
    """The format a model's output is split by: ``think`` and ``gemma4`` always, ``none``
    never, ``auto`` when the chat template writes both think tags, or when the template
    writes both of Gemma 4's channel markers or the vocabulary has them as tokens."""
    if setting not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}")
    if setting == "think":
        return THINK
    if setting == "gemma4":
        return GEMMA4
    if setting == "none":
        return None
    template = chat_template or ""
    if CHANNEL_OPEN in template and CHANNEL_CLOSE in template:
        return GEMMA4
    if _has_tokens(tokenizer, CHANNEL_OPEN, CHANNEL_CLOSE):
        return GEMMA4
    return THINK if THINK.start in template and THINK.end in template else None


def opens_reasoning(fmt: ReasoningFormat, prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the model inside a thinking block."""
    return prompt_text.rstrip().endswith(fmt.start)


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One choice's text deltas -> (reasoning delta, content delta).

    Reasoning is the text of a thinking block that starts the output (or that the prompt
    opened), without the tags and without the whitespace at its ends; content is what
    follows the closing tag, from its first non-space character. Output that does not start
    with the opening tag is all content; a block the token limit cuts is all reasoning.
    """

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool = False) -> None:
        self.fmt = fmt
        self._mode = "reasoning" if in_reasoning else "before"
        self._buf = ""
        self._reasoning_started = False  # leading whitespace of the block is dropped
        self._content_started = False

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self._buf += text
        reasoning, content = "", ""
        while True:
            if self._mode == "before":
                head = self._buf.lstrip()
                if head.startswith(self.fmt.start):
                    self._buf = head[len(self.fmt.start):]
                    self._mode = "reasoning"
                    continue
                if not finished and self.fmt.start.startswith(head):
                    return reasoning, content  # may still become the tag
                self._mode = "content"
                self._content_started = True  # no thinking block: the text is as it is
                continue
            if self._mode == "reasoning":
                if not self._reasoning_started:
                    self._buf = self._buf.lstrip()
                    self._reasoning_started = bool(self._buf)
                end = self._buf.find(self.fmt.end)
                if end != -1:
                    reasoning += self._buf[:end].rstrip()
                    self._buf = self._buf[end + len(self.fmt.end):]
                    self._mode = "content"
                    continue
                if finished:
                    reasoning += self._buf.rstrip()
                    self._buf = ""
                    return reasoning, content
                keep = _tag_prefix_len(self._buf, self.fmt.end)
                ready = self._buf[: len(self._buf) - keep]
                body = ready.rstrip()  # trailing space waits: it may precede the end tag
                reasoning += body
                self._buf = self._buf[len(body):]
                return reasoning, content
            # content
            if not self._content_started:
                self._buf = self._buf.lstrip()
                self._content_started = bool(self._buf)
            content += self._buf
            self._buf = ""
            return reasoning, content

    def split(self, text: str) -> tuple[str, str]:
        """A whole output at once (the same split as feeding it in pieces)."""
        return self.feed(text, True)
