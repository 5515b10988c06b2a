"""Text <-> token ids for the torch backend, from an HF folder or from GGUF metadata.

Wraps the ``tokenizers`` library; chat templates are rendered with jinja2 the way HF does
(sandboxed, trim_blocks/lstrip_blocks). For GGUF we build the tokenizer ourselves from the
vocabulary stored in the file, so transformers is not needed at run time: a byte-level BPE
from the merges of a ``gpt2`` vocabulary, or a SentencePiece-style BPE from the scores of a
``llama`` one (Gemma, Phi-3, Llama 2 files; see :mod:`iron_batch.gguf_spm`).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (llama.cpp): control tokens are special, user-defined ones are added.
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# The regexes that cut text into pieces before byte-level BPE, by the GGUF
# "tokenizer.ggml.pre" name llama.cpp's converter writes. Each is spelled as in the
# checkpoints' own tokenizer.json (llama.cpp rewrites some for its own regex engine).
#: GPT-2's split: the one the ``tokenizers`` ByteLevel pre-tokenizer applies itself.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
#: cl100k's split as Llama 3's tokenizer.json writes it: digits in runs of up to three.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Qwen2 (and Qwen2.5, Qwen3): Llama 3's with one digit a piece.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
#: Qwen3.5: Qwen2's with combining marks kept with their letters.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
    r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: o200k (gpt-oss, Phi-4-mini): letter runs cut where lower case turns upper
#: ("HelloWorld": "Hello", "World"), each with a contraction; digits in runs of up to three.
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Mistral's tekken (Mistral Nemo): o200k's letter runs without the
#: contractions, one digit a piece.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` -> the regexes that split the text, applied in turn (each cuts
#: every piece the one before left, keeping what it matches and what lies between), as
#: llama.cpp applies its list for the name. Any other name is refused at load.
GGUF_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    # llama.cpp's converter writes "default" only for SentencePiece vocabularies (and
    # llama.cpp gives a byte-level one so named a split of its own); here it is GPT-2's.
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "olmo": (_GPT2_SPLIT,),  # OLMo 1.7, OLMoE (GPT-NeoX's vocabulary)
    # Digits one by one, then GPT-2's split: SmolLM/SmolLM2, and Granite 3's vocabulary.
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    # Llama 3's split under the names llama.cpp's converter writes when a vocabulary's
    # test encoding hashes as DBRX's (cl100k: DBRX, Phi-4) or as Smaug's (Llama 3's
    # vocabulary encoded with no BOS: SmolLM3, some Llama 3.x conversions); llama.cpp
    # cuts both with Llama 3's regex and sets no ignore_merges for them (see below).
    "dbrx": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "qwen35": (_QWEN35_SPLIT,),
    "gpt-4o": (_O200K_SPLIT,),
    "tekken": (_TEKKEN_SPLIT,),
}
#: Vocabularies converted from tiktoken ranks (Llama 3, gpt-oss, tekken): a piece that is a
#: token is that token, whatever the merges would make of it, as their tokenizer.json says
#: (``ignore_merges``; llama.cpp does so for the first and the last). "dbrx" and
#: "smaug-bpe" follow the merges, as llama.cpp does for those names, although Llama 3's
#: tokenizer.json, whose vocabulary SmolLM3's files carry, sets ``ignore_merges`` (whether
#: SmolLM3's own file does is not checked here): where a piece is a token the merges do
#: not reach, a smaug-bpe file can then cut it otherwise than its checkpoint.
_GGUF_IGNORE_MERGES = frozenset({"llama-bpe", "gpt-4o", "tekken"})

#: A vocabulary with this token is Gemma 4's.
_GEMMA4_TURN = "<|turn>"
#: Where Gemma 4 ends its output: the end of its turn, and after a tool call the opening of
#: the tool's result, which is the caller's to write. Its checkpoints list both in
#: generation_config.json; a GGUF file may name neither.
_GEMMA4_ENDS = ("<turn|>", "<|tool_response>")


def _with_turn_ends(tokenizer: HFTokenizer, eos_ids: list[int]) -> list[int]:
    """``eos_ids`` and, for Gemma 4's vocabulary, the ids of :data:`_GEMMA4_ENDS`."""
    if tokenizer.token_to_id(_GEMMA4_TURN) is None:
        return eos_ids
    ends = [tokenizer.token_to_id(t) for t in _GEMMA4_ENDS]
    return list(dict.fromkeys([*eos_ids, *(i for i in ends if i is not None)]))


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | None,
        eos_token_ids: list[int],
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool = False,
        pad_token: str | None = None,
        add_eos: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.eos_token_ids = _with_turn_ends(tokenizer, eos_token_ids)
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Only for tokenizers whose post-processor does not add BOS (or EOS) itself (GGUF).
        self._add_bos = add_bos
        self._add_eos = add_eos
        self._bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self._eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self._template: Any = None
        self._special: frozenset[int] | None = None

    def to_info(self) -> dict[str, Any]:
        """Everything :meth:`from_info` needs: tokenizers' own JSON, no code (a worker
        sends it to the server in its INFO reply)."""
        return {
            "json": self._tok.to_str(),
            "chat_template": self.chat_template,
            "eos_token_ids": list(self.eos_token_ids),
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos": bool(self._add_bos),
            "add_eos": bool(self._add_eos),
            "pad_token": self.pad_token,
        }

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> Tokenizer:
        return cls(
            HFTokenizer.from_str(info["json"]),
            chat_template=info.get("chat_template"),
            eos_token_ids=[int(i) for i in info.get("eos_token_ids", [])],
            bos_token=info.get("bos_token"),
            eos_token=info.get("eos_token"),
            add_bos=bool(info.get("add_bos", False)),
            pad_token=info.get("pad_token"),
            add_eos=bool(info.get("add_eos", False)),
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token (added ones too) and its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and self._bos_id is not None:
            if not ids or ids[0] != self._bos_id:
                ids = [self._bos_id, *ids]
        if add_special_tokens and self._add_eos and self._eos_id is not None:
            ids = [*ids, self._eos_id]
        return ids

    def special_ids(self) -> frozenset[int]:
        """Ids of the tokens ``skip_special_tokens`` drops."""
        if self._special is None:
            self._special = frozenset(
                i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        return self._special

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               keep: frozenset[int] = frozenset()) -> str:
        """``keep``: ids of special tokens written out even when skipping the others."""
        if skip_special_tokens and keep:
            special = self.special_ids()
            ids = [i for i in ids if i in keep or i not in special]
            return self._tok.decode(ids, skip_special_tokens=False)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The template rendered; ``template_kwargs`` are extra variables it reads (such as
        Qwen3's ``enable_thinking``), which never replace the ones set here.

        A template without a system role (Gemma 2's raises "System role not supported")
        still takes a leading system message: where rendering raises, that message is
        folded into the first user turn (see :func:`fold_system`) and the conversation
        rendered again. Template errors without a leading system message to fold, and
        those the folded conversation still raises, reach the caller."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        from jinja2.exceptions import TemplateError

        def render(msgs: list[dict[str, Any]]) -> str:
            return str(
                self._template.render(
                    **template_kwargs,
                    messages=msgs,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                    # HF passes tool declarations as ``tools`` (None when there are none).
                    tools=tools,
                )
            )

        try:
            return render(messages)
        except TemplateError:
            folded = fold_system(messages)
            if folded is None:
                raise
        # What the folded conversation raises (roles must alternate, ...) is what is left
        # to fix once the system message has a place: that error is the one to report.
        return render(folded)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (folder / "chat_template.jinja").is_file():  # transformers >= 4.51 layout
            template = (folder / "chat_template.jinja").read_text()
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        eos_ids: list[int] = []
        if eos is not None and tok.token_to_id(eos) is not None:
            eos_ids.append(tok.token_to_id(eos))
        gen = folder / "generation_config.json"
        if gen.is_file():
            value = json.loads(gen.read_text()).get("eos_token_id")
            for i in [value] if isinstance(value, int) else value or []:
                if i not in eos_ids:
                    eos_ids.append(int(i))
        return cls(tok, chat_template=template, eos_token_ids=eos_ids, bos_token=bos,
                   eos_token=eos, pad_token=_token_text(cfg.get("pad_token")))

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        kind = fields.get("tokenizer.ggml.model")
        if kind == "llama":
            return cls._from_gguf_spm(fields)
        if kind != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model): supported "
                "are 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)"
            )
        pre = fields.get("tokenizer.ggml.pre")
        splits = GGUF_PRE_TOKENIZERS.get(pre) if isinstance(pre, str) else None
        if splits is None:
            said = ("a GGUF byte-level vocabulary without tokenizer.ggml.pre (its text split "
                    "is unknown)" if pre is None
                    else f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre)")
            known = ", ".join(repr(n) for n in GGUF_PRE_TOKENIZERS)
            raise ValueError(f"{said}: supported are {known}")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     ignore_merges=pre in _GGUF_IGNORE_MERGES))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types, strict=True) if ty == _GGUF_CONTROL]
        )
        tok.add_tokens(
            [AddedToken(t, special=False, normalized=False)
             for t, ty in zip(tokens, types, strict=True) if ty == _GGUF_USER_DEFINED]
        )

        def text(key: str) -> str | None:
            i = fields.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        eos_id = fields.get("tokenizer.ggml.eos_token_id")
        eot_id = fields.get("tokenizer.ggml.eot_token_id")
        eos_ids = [int(i) for i in (eos_id, eot_id) if isinstance(i, int)]
        return cls(
            tok,
            chat_template=fields.get("tokenizer.chat_template"),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            bos_token=text("tokenizer.ggml.bos_token_id"),
            eos_token=text("tokenizer.ggml.eos_token_id"),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def _from_gguf_spm(cls, fields: dict[str, Any]) -> Tokenizer:
        from iron_batch.gguf_spm import SPM_DEFAULT_IDS, spm_tokenizer

        fields = {**SPM_DEFAULT_IDS, **fields}
        spm = spm_tokenizer(fields)
        tokens = spm.tokens

        def text(key: str) -> str | None:
            i = fields.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        # The ids the file names, then the end-of-turn tokens llama.cpp finds by their text.
        named = [fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos_ids = [int(i) for i in named if isinstance(i, int)] + spm.end_ids
        return cls(
            spm.tokenizer,
            chat_template=fields.get("tokenizer.chat_template"),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            bos_token=text("tokenizer.ggml.bos_token_id"),
            eos_token=text("tokenizer.ggml.eos_token_id"),
            add_bos=spm.add_bos,
            add_eos=spm.add_eos,
            pad_token=text("tokenizer.ggml.padding_token_id"),
        )


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` with a leading system message folded into the first user turn the
    way Gemma 3's template does it (the system text, a blank line, the user text), or
    None where there is no leading system message of plain text to fold."""
    if not messages or messages[0].get("role") != "system":
        return None
    system, rest = messages[0].get("content"), list(messages[1:])
    if not isinstance(system, str):
        return None
    if rest and rest[0].get("role") == "user" and isinstance(rest[0].get("content"), str):
        rest[0] = {**rest[0], "content": f"{system}\n\n{rest[0]['content']}"}
    else:
        rest.insert(0, {"role": "user", "content": system})
    return rest


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _compile_template(source: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas that are safe to show.

    A delta never ends inside a UTF-8 character (the decoder yields U+FFFD for an incomplete
    byte sequence, so such text is held back), and never ends with text that might still
    become the start of a stop string. ``add`` returns (delta, stopped); once a stop string
    matches, the delta is cut just before it.
    """

    # Prompt tokens decoded along with the output, so the first output token gets the
    # leading space that tokenizers (SentencePiece style) only produce mid-text.
    _CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        keep_special_tokens: list[str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._stop = [s for s in stop or [] if s]
        self._skip = skip_special_tokens
        # Tokenizers that know no special tokens (test doubles) have nothing to keep.
        lookup = getattr(tokenizer, "token_to_id", None)
        ids = [lookup(t) for t in keep_special_tokens or ()] if lookup else []
        self._keep = frozenset(i for i in ids if i is not None)
        self._ids = list(prompt_token_ids[-self._CONTEXT :])
        self._prefix = 0  # decode window start
        self._read = len(self._ids)  # ids before this are already in _text
        self._text = ""  # all output text decoded so far
        self._emitted = 0  # chars of _text already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        if self._keep and self._skip:
            return self._tok.decode(ids, True, self._keep)
        return self._tok.decode(ids, self._skip)

    def add(self, token_id: int) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release()

    def flush(self) -> str:
        """Everything still held back (call when generation ended without a stop match)."""
        if self.stopped:
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text):
            self._text += new_text[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        out = self._text[self._emitted :]
        self._emitted = len(self._text)
        return out

    @property
    def text(self) -> str:
        """Output text returned so far."""
        return self._text[: self._emitted]

    def _release(self) -> tuple[str, bool]:
        start = self._emitted
        if not self._stop:
            self._emitted = len(self._text)
            return self._text[start:], False
        # A match can only start in text not yet released (released text never ends with
        # a partial stop string, see below).
        best = -1
        for s in self._stop:
            i = self._text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best = i
        if best != -1:
            self.stopped = True
            self._emitted = best
            return self._text[start:best], True
        # Hold back the longest tail that is a proper prefix of some stop string.
        end = len(self._text)
        for s in self._stop:
            for n in range(min(len(s) - 1, end - start), 0, -1):
                if self._text.endswith(s[:n]):
                    end = min(end, len(self._text) - n)
                    break
        self._emitted = end
        return self._text[start:end], False
