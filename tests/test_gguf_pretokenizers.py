"""GGUF byte-level vocabularies (``tokenizer.ggml.model = "gpt2"``) cut text before BPE as
the checkpoints' own tokenizer.json does, by the ``tokenizer.ggml.pre`` name llama.cpp's
converter writes; any other name is refused at load.

The reference for each name is the pre-tokenizer chain of its models' tokenizer.json,
written below as JSON the way those files spell it and run by the ``tokenizers`` library:
GPT-2's and OLMo's files (ByteLevel with its own regex), SmolLM2's and Granite 3's
(single digits, then ByteLevel), Llama 3's (also DBRX's, Phi-4's and SmolLM3's, which
llama.cpp names "dbrx" and "smaug-bpe"), Qwen2.5/Qwen3's, Qwen3.5's, gpt-oss's (o200k)
and Mistral Nemo's (tekken) Split regexes. o200k is also checked against tiktoken's own
pattern run as tiktoken runs it, and, on ASCII text, every name against the regex list
llama.cpp's ``llama-vocab.cpp`` applies for it.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import pytest
import regex
from iron_batch.loader import read_gguf_fields
from iron_batch.tokenizer import GGUF_PRE_TOKENIZERS, Tokenizer
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

#: The pre_tokenizer chains of the checkpoints' tokenizer.json files, as they spell them.
_CHAINS_JSON = r"""
{
  "gpt2": [
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
  ],
  "digits-gpt2": [
    {"type": "Digits", "individual_digits": true},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
  ],
  "llama3": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
  ],
  "qwen2": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
  ],
  "qwen35": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
  ],
  "o200k": [
    {"type": "Split", "pattern": {"Regex": "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
  ],
  "tekken": [
    {"type": "Split", "pattern": {"Regex": "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
  ]
}
"""  # noqa: E501
CHAINS: dict[str, list[dict[str, Any]]] = json.loads(_CHAINS_JSON)

#: tokenizer.ggml.pre -> (its models' chain, whether a piece that is a token is taken whole:
#: as their tokenizer.json says (``ignore_merges``), and for "dbrx" and "smaug-bpe" as
#: llama.cpp does, which is not).
REFERENCE: dict[str, tuple[str, bool]] = {
    "default": ("gpt2", False),  # the tests' own name for GPT-2's split
    "gpt-2": ("gpt2", False),  # openai-community/gpt2
    "olmo": ("gpt2", False),  # allenai/OLMo-1.7-7B-hf, OLMoE (GPT-NeoX's vocabulary)
    "smollm": ("digits-gpt2", False),  # HuggingFaceTB/SmolLM2
    "refact": ("digits-gpt2", False),  # Refact-1.6, Granite 3
    "llama-bpe": ("llama3", True),  # meta-llama/Llama-3.x
    "dbrx": ("llama3", False),  # databricks/dbrx-base, microsoft/phi-4 (cl100k)
    "smaug-bpe": ("llama3", False),  # HuggingFaceTB/SmolLM3-3B (Llama 3's vocabulary)
    "qwen2": ("qwen2", False),  # Qwen2.5, Qwen3
    "qwen35": ("qwen35", False),  # Qwen3.5
    "gpt-4o": ("o200k", True),  # openai/gpt-oss-20b
    "tekken": ("tekken", True),  # mistralai/Mistral-Nemo
}

#: o200k_base's pattern as tiktoken spells it (tiktoken_ext/openai_public.py); tiktoken
#: cuts text into the pattern's matches, one after another.
O200K_TIKTOKEN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

#: The regexes llama.cpp's llama-vocab.cpp applies in turn for each name (its own
#: spellings, written for its regex engine; exact on ASCII text).
_CPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CPP_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_CPP_TAIL = r"\s*[\r\n]+|\s+(?!\S)|\s+"
_CPP_UPPER = r"((?=[\p{L}])([^a-z]))"
_CPP_LOWER = r"((?=[\p{L}])([^A-Z]))"
_CPP_LLAMA3 = [_CPP_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _CPP_TAIL]
LLAMA_CPP: dict[str, list[str]] = {
    "gpt-2": [_CPP_GPT2],
    "olmo": [_CPP_GPT2],
    "smollm": [r"\p{N}", _CPP_GPT2],
    "refact": [r"\p{N}", _CPP_GPT2],
    "llama-bpe": _CPP_LLAMA3,
    "dbrx": _CPP_LLAMA3,  # LLAMA_VOCAB_PRE_TYPE_DBRX: "same as llama3"
    "smaug-bpe": _CPP_LLAMA3,  # LLAMA_VOCAB_PRE_TYPE_SMAUG: likewise
    "qwen2": [_CPP_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _CPP_TAIL],
    "qwen35": [_CPP_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|" + _CPP_TAIL],
    "gpt-4o": [rf"[^\r\n\p{{L}}\p{{N}}]?{_CPP_UPPER}*{_CPP_LOWER}+{_CPP_CONTRACTIONS}?"
               rf"|[^\r\n\p{{L}}\p{{N}}]?{_CPP_UPPER}+{_CPP_LOWER}*{_CPP_CONTRACTIONS}?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _CPP_TAIL],
    "tekken": [rf"[^\r\n\p{{L}}\p{{N}}]?{_CPP_UPPER}*{_CPP_LOWER}+"
               rf"|[^\r\n\p{{L}}\p{{N}}]?{_CPP_UPPER}+{_CPP_LOWER}*"
               r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _CPP_TAIL],
}

#: Text where the splits part ways: digit runs, contractions in both cases, case changes
#: inside words, CJK and other scripts, combining marks, newlines, space runs, punctuation
#: runs, slashes, emoji.
TEXTS = [
    "12345 1234567 3.14159 1,234,567 2024-01-31 x²+½ ٣٤٥ Ⅻ",
    "we'll DON'T I'M she's They'RE you'Ve it'd 'twas rock'n'roll",
    "HelloWorld helloWORLD iPhone McDonald's XMLHttpRequest camelCaseName ABCdef",
    "我想在apple工作1314151天～ こんにちは世界 한국어 нещо на Български",
    "नमस्ते दुनिया e\u0301te\u0301 cafe\u0301 ñandú",
    "\n\n",
    "a\n\nb\r\n\r\nc\n \n  \n   d",
    "one  two   three    four\t\ttabs \t mixed   ",
    "   leading spaces",
    "trailing spaces   ",
    "......!!!!!!?????? ------======= '''''' ```````\"\"\"\"",
    "path/to/file.txt\na/b/c//d http://x.y/z?q=1&r=2",
    "foo() {\n    return bar[0];\n}\n",
    "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 👍🏽",
    "Hello<|endoftext|>world 42",
    "",
    " ",
    "x",
]


# ----------------------------------------------------------------- the vocabulary


@cache
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(piece: str) -> str:
    table = _byte_chars()
    return "".join(table[b] for b in piece.encode("utf-8"))


@cache
def _vocabulary() -> tuple[list[str], list[str]]:
    """Tokens (by id) and merges of a small byte-level BPE learnt from TEXTS over the whole
    text, so that its merges cross every boundary some split keeps."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=900, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(TEXTS * 3, trainer)
    model = json.loads(tok.to_str())["model"]
    by_id = {i: t for t, i in model["vocab"].items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _write(path: Path, pre: str | None, tokens: list[str], merges: list[str]) -> Path:
    """A GGUF holding only a byte-level vocabulary, as llama.cpp's converter writes one."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else
                       gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _ours(tmp_path: Path, pre: str | None, tokens: list[str] | None = None,
          merges: list[str] | None = None) -> Tokenizer:
    if tokens is None or merges is None:
        tokens, merges = _vocabulary()
    path = _write(tmp_path / f"{pre}.gguf", pre, tokens, merges)
    return Tokenizer.from_gguf_fields(read_gguf_fields(path))


def _reference(chain: str, ignore_merges: bool, tokens: list[str],
               merges: list[str]) -> HFTokenizer:
    """A tokenizer.json with the chain and model flags the checkpoints' files have."""
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "added_tokens": [
            {"id": tokens.index("<|endoftext|>"), "content": "<|endoftext|>",
             "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True}],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": CHAINS[chain]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }
    return HFTokenizer.from_str(json.dumps(spec))


def _pieces(tok: Tokenizer | HFTokenizer, text: str) -> list[str]:
    """The pieces the pre-tokenizer cuts ``text`` into (byte-level characters)."""
    hf = HFTokenizer.from_str(tok.to_info()["json"]) if isinstance(tok, Tokenizer) else tok
    assert hf.pre_tokenizer is not None
    return [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(text)]


def _split_in_turn(patterns: list[str], text: str) -> list[str]:
    """llama.cpp's way with a regex list: each regex cuts every piece, keeping its matches
    and the text between them."""
    pieces = [text] if text else []
    for pattern in patterns:
        compiled, cut = regex.compile(pattern), []
        for piece in pieces:
            at = 0
            for m in compiled.finditer(piece):
                if m.start() > at:
                    cut.append(piece[at:m.start()])
                if m.end() > m.start():
                    cut.append(m.group())
                at = m.end()
            if at < len(piece):
                cut.append(piece[at:])
        pieces = cut
    return pieces


# ----------------------------------------------------------------- the tests


def test_every_supported_name_has_a_reference() -> None:
    assert set(GGUF_PRE_TOKENIZERS) == set(REFERENCE)


@pytest.mark.parametrize("pre", sorted(REFERENCE))
def test_pieces_are_the_checkpoints_tokenizer_json_pieces(pre: str, tmp_path: Path) -> None:
    chain, ignore_merges = REFERENCE[pre]
    tokens, merges = _vocabulary()
    ours = _ours(tmp_path, pre)
    ref = _reference(chain, ignore_merges, tokens, merges)
    for text in TEXTS:
        assert _pieces(ours, text) == _pieces(ref, text), text


@pytest.mark.parametrize("pre", sorted(REFERENCE))
def test_ids_are_the_checkpoints_tokenizer_json_ids(pre: str, tmp_path: Path) -> None:
    chain, ignore_merges = REFERENCE[pre]
    tokens, merges = _vocabulary()
    ours = _ours(tmp_path, pre)
    ref = _reference(chain, ignore_merges, tokens, merges)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP))
def test_ascii_pieces_are_llama_cpps(pre: str, tmp_path: Path) -> None:
    """On ASCII text (where llama.cpp's rewritten regexes mean what the originals mean) the
    pieces are the ones llama.cpp's regex list for the name cuts."""
    ours = _ours(tmp_path, pre)
    ascii_texts = [t for t in TEXTS if t.isascii()]
    assert len(ascii_texts) >= 10
    for text in ascii_texts:
        want = [_byte_level(p) for p in _split_in_turn(LLAMA_CPP[pre], text)]
        assert _pieces(ours, text) == want, text


def test_gpt_4o_cuts_as_tiktokens_o200k(tmp_path: Path) -> None:
    ours = _ours(tmp_path, "gpt-4o")
    for text in TEXTS:
        want = [_byte_level(p) for p in regex.findall(O200K_TIKTOKEN, text)]
        if "<|endoftext|>" in text:
            continue  # tiktoken leaves special tokens to its caller
        assert _pieces(ours, text) == want, text


def test_the_splits_differ_where_the_models_differ(tmp_path: Path) -> None:
    """The references are not all one split: each name that is not GPT-2's cuts some text
    otherwise than GPT-2's, and the pairs that differ in one rule part ways on it."""
    tokens, merges = _vocabulary()

    def cut(pre: str, text: str) -> list[str]:
        chain, ignore = REFERENCE[pre]
        return _pieces(_reference(chain, ignore, tokens, merges), text)

    for pre, (chain, _) in REFERENCE.items():
        if chain != "gpt2":
            assert any(cut(pre, t) != cut("default", t) for t in TEXTS), pre
    assert cut("gpt-4o", "HelloWorld") == ["Hello", "World"]
    assert cut("default", "HelloWorld") == ["HelloWorld"]
    assert cut("llama-bpe", "12345") == ["123", "45"]
    assert cut("qwen2", "12345") == ["1", "2", "3", "4", "5"]
    assert cut("default", "12345") == ["12345"]
    assert cut("qwen35", "e\u0301te\u0301") != cut("qwen2", "e\u0301te\u0301")
    assert cut("tekken", "we'll") != cut("gpt-4o", "we'll")
    # and ours follows: gpt-oss's file does not split as the fallback it replaced
    assert _pieces(_ours(tmp_path, "gpt-4o"), "HelloWorld") == ["Hello", "World"]


@pytest.mark.parametrize("pre, whole", [("llama-bpe", True), ("gpt-4o", True),
                                        ("tekken", True), ("qwen2", False),
                                        ("smollm", False)])
def test_a_piece_that_is_a_token_as_the_checkpoint_says(pre: str, whole: bool,
                                                         tmp_path: Path) -> None:
    """Llama 3's, gpt-oss's and tekken's tokenizer.json take a piece that is a token whole
    (``ignore_merges``), whatever their merges make of it; the others follow the merges."""
    tokens = [*_byte_chars().values(), "bc", "abc", "<|endoftext|>"]
    merges = ["b c"]  # "abc" is a token no merge reaches
    ours = _ours(tmp_path, pre, tokens, merges)
    chain, ignore_merges = REFERENCE[pre]
    ref = _reference(chain, ignore_merges, tokens, merges)
    ids = ours.encode("abc", add_special_tokens=False)
    assert ids == ref.encode("abc", add_special_tokens=False).ids
    assert ids == ([tokens.index("abc")] if whole else [tokens.index("a"), tokens.index("bc")])


@pytest.mark.parametrize("pre", ["dbrx", "smaug-bpe"])
def test_llama_cpps_other_names_for_llama_3s_split(pre: str, tmp_path: Path) -> None:
    """"dbrx" (Phi-4's and DBRX's files) and "smaug-bpe" (SmolLM3's) cut as "llama-bpe"
    does, digits in runs of up to three, not as GPT-2's split would; but, as llama.cpp
    sets no ignore_merges for them, a piece that is a token the merges do not reach is
    cut by the merges, where "llama-bpe" takes it whole."""
    ours, llama, gpt2 = (_ours(tmp_path, p) for p in (pre, "llama-bpe", "gpt-2"))
    for text in TEXTS:
        assert _pieces(ours, text) == _pieces(llama, text), text
    assert _pieces(ours, "12345") == ["123", "45"]
    assert _pieces(gpt2, "12345") == ["12345"]
    assert _pieces(ours, "we'll DON'T") != _pieces(gpt2, "we'll DON'T")

    tokens = [*_byte_chars().values(), "bc", "abc", "<|endoftext|>"]
    merges = ["b c"]  # "abc" is a token no merge reaches
    for name, want in [(pre, ["a", "bc"]), ("llama-bpe", ["abc"])]:
        folder = tmp_path / f"whole-{name}"
        folder.mkdir()
        ids = _ours(folder, name, tokens, merges).encode("abc", add_special_tokens=False)
        assert ids == [tokens.index(t) for t in want], name


@pytest.mark.parametrize("pre", ["deepseek-llm", "command-r", "stablelm2", "olmo2",
                                 "smollm3", "deepseek-r1-qwen", "llama3", "phi-2"])
def test_another_name_is_refused_in_one_line(pre: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        _ours(tmp_path, pre)
    message = str(err.value)
    assert repr(pre) in message and "tokenizer.ggml.pre" in message and "\n" not in message
    assert all(repr(name) in message for name in GGUF_PRE_TOKENIZERS)


def test_a_file_without_a_pre_tokenizer_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        _ours(tmp_path, None)
    message = str(err.value)
    assert "without tokenizer.ggml.pre" in message and "\n" not in message
    assert "'gpt-4o'" in message


def test_a_gguf_model_with_an_unknown_pre_tokenizer_is_refused_at_load(
        tmp_path: Path) -> None:
    """Through the backend: a Granite file whose vocabulary names a split not known here
    does not load; with Granite 3's own name it does, and cuts digits one by one where
    GPT-2's split would keep "2024" whole."""
    from iron_batch.backends.torch_backend import TorchBackend
    from test_gguf_families import write_gguf

    tokens = [*_byte_chars().values(), "<|endoftext|>", "20", "24", "2024"]
    merges = ["2 0", "2 4", "20 24"]

    class Bytes:
        size = len(tokens)

        def __init__(self, pre: str) -> None:
            self.pre = pre

        def write(self, w: gguf.GGUFWriter) -> None:
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre(self.pre)
            w.add_token_list(tokens)
            w.add_token_merges(merges)
            w.add_bos_token_id(tokens.index("<|endoftext|>"))
            w.add_eos_token_id(tokens.index("<|endoftext|>"))

    def load(pre: str) -> TorchBackend:
        path = write_gguf("granite", tmp_path / f"granite-{pre}.gguf", vocabulary=Bytes(pre))
        return TorchBackend.from_model(str(path), device="cpu", dtype="float32",
                                       total_kv_blocks=16, kv_block_size=4)

    with pytest.raises(ValueError) as err:
        load("deepseek-llm")
    assert "'deepseek-llm'" in str(err.value) and "\n" not in str(err.value)
    for pre, want in [("refact", ["2", "0", "2", "4"]), ("gpt-2", ["2024"])]:
        tokenizer = load(pre).tokenizer
        assert tokenizer is not None
        assert tokenizer.encode("2024", add_special_tokens=False) == [
            tokens.index(t) for t in want]
