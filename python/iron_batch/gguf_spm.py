"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model == "llama"``) as a
``tokenizers`` BPE that splits text the way llama.cpp's SPM tokenizer does.

What llama.cpp does with such a vocabulary, and how it is rebuilt here:

* Tokens it marks control, unknown or user-defined are cut out of the raw text first, whole
  (user-defined ones are stored with real spaces, so they match the text as written). Here
  they are added tokens, matched before any normalization.
* Each stretch of text between them has its spaces written as ``▁`` and, where
  ``tokenizer.ggml.add_space_prefix`` is true (the default; Gemma's files say false), a
  ``▁`` put in front -- of every stretch, also the one right after a control token, and
  also when the text already starts with a space. Here that is the normalizer (which
  ``tokenizers`` runs on each stretch between added tokens); there is no pre-tokenizer:
  SentencePiece does not split on spaces or digits.
* The characters of a stretch are then merged pairwise, always the adjacent pair whose join
  is the vocabulary token of highest score (the leftmost pair on a tie), until no pair joins
  into a token. A BPE whose merges are every split of every token into two tokens, ranked by
  the joined token's score, does the same. (Both build a piece only from characters that
  are tokens themselves, which every SentencePiece BPE vocabulary has: its pieces are
  merges of its characters.)
* A character with no token of its own becomes its UTF-8 bytes, as the ``<0xXX>`` tokens
  (BPE's byte fallback).

Decoding writes ``▁`` back as a space, joins byte tokens into UTF-8 and, where a space
prefix is added, drops the first space of the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

#: llama.cpp's token types (``tokenizer.ggml.token_type``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE = "\u2581"  # ▁, SentencePiece's mark for a space

#: The ids llama.cpp takes where a SentencePiece vocabulary names none.
SPM_DEFAULT_IDS = {"tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
                   "tokenizer.ggml.eos_token_id": 2}

#: Token texts llama.cpp takes for an end of generation wherever a vocabulary has them,
#: whatever the file names as its eos (Gemma's ``<end_of_turn>``, Phi-3's ``<|end|>``).
#: Gemma 4's ends (``<turn|>``, ``<|tool_response>``) are added to any Gemma 4 vocabulary's
#: eos ids by :class:`iron_batch.tokenizer.Tokenizer`, whatever file it came from.
END_OF_TURN_TEXTS = ("<end_of_turn>", "<|end|>", "<|endoftext|>", "<|eot_id|>",
                     "<|im_end|>", "<|eom_id|>", "<EOT>", "<|end_of_text|>")


@dataclass(frozen=True)
class SpmVocabulary:
    """The BPE and what the caller adds around it (BOS/EOS, which ids end generation)."""

    tokenizer: HFTokenizer
    #: The token texts by id, as the BPE knows them.
    tokens: list[str]
    add_bos: bool
    add_eos: bool
    end_ids: list[int]


def spm_tokenizer(fields: dict[str, Any]) -> SpmVocabulary:
    # llama.cpp names an empty token by its id, and looks a text listed twice up as its
    # last id.
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(fields["tokenizer.ggml.tokens"])]
    count = len(tokens)
    scores: Sequence[float] = fields.get("tokenizer.ggml.scores") or [0.0] * count
    types: Sequence[int] = fields.get("tokenizer.ggml.token_type") or [NORMAL] * count
    if len(scores) != count or len(types) != count:
        raise ValueError(
            f"GGUF SentencePiece vocabulary: {count} tokens but {len(scores)} scores and "
            f"{len(types)} token types"
        )
    ids = {text: i for i, text in enumerate(tokens)}

    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < count else None
    bpe = models.BPE(
        vocab=ids, merges=_merges(tokens, scores, ids), unk_token=unk,
        byte_fallback=True, fuse_unk=True,
    )
    tok = HFTokenizer(bpe)
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", SPACE)
    tok.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE), escape])
                      if prefix else escape)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)

    # llama.cpp strips the whitespace after most special tokens of a Phi-3 file (as the
    # model's own tokenizer.json does), picked by the model's name.
    name = str(fields.get("general.name", "")).lower()
    strip_after = "phi-3" in name or "phi3" in name
    keep_space_after = {"<unk>", "<s>", "<|endoftext|>"}
    special, plain = [], []
    for text, kind in zip(tokens, types, strict=True):
        if kind not in (CONTROL, UNKNOWN, USER_DEFINED):
            continue
        rstrip = strip_after and text not in keep_space_after
        added = AddedToken(text, special=kind != USER_DEFINED, normalized=False,
                           rstrip=rstrip)
        (plain if kind == USER_DEFINED else special).append(added)
    tok.add_special_tokens(special)
    tok.add_tokens(plain)

    end_ids = [ids[t] for t in END_OF_TURN_TEXTS if t in ids]
    return SpmVocabulary(
        tokenizer=tok,
        tokens=tokens,
        # llama.cpp's defaults for a SentencePiece vocabulary that does not say.
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", True)),
        add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        end_ids=end_ids,
    )


def _merges(tokens: list[str], scores: Sequence[float],
            ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the joined token's score highest first.

    SentencePiece ranks a pair by the score of the token it makes; pairs that make the same
    score keep the token order of the file, then the longer left piece first."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, text in enumerate(tokens):
        if ids[text] != i or len(text) < 2:
            continue
        score = float(scores[i])
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                ranked.append((-score, i, -cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]
