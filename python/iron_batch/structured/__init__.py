"""Constrained decoding: grammars built from JSON schemas, regexes, choice lists and tool
declarations (:mod:`.grammars`), and the per-step token bitmask that enforces them where
sampling happens (:mod:`.masking`). The grammar engine is llguidance; a grammar travels as
llguidance's own JSON grammar string (``SamplingParams.grammar``), so the server compiles
and validates it once and a remote worker receives it as plain text."""

from iron_batch.structured.grammars import (
    GrammarError,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    regex_grammar,
    strict_schema,
    validate_grammar,
)

__all__ = [
    "GrammarError",
    "choice_grammar",
    "json_object_grammar",
    "json_schema_grammar",
    "regex_grammar",
    "strict_schema",
    "validate_grammar",
]
