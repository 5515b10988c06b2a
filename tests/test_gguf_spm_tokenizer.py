"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model = "llama"``: Gemma, Phi-3,
Llama 2 files) tokenize as llama.cpp tokenizes them, and as transformers' own GGUF
tokenizer does where the two agree; a Gemma 3 GGUF with such a vocabulary is served.

Each file is written here with a small vocabulary laid out as llama.cpp's converter lays
out a SentencePiece model: control tokens, the 256 ``<0xXX>`` byte tokens, pieces ranked by
score (SentencePiece's merge order), and user-defined tokens. For Gemma the converter says
``add_space_prefix = false`` and stores Gemma's whitespace-run tokens as user-defined
tokens of real spaces, score -1000.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest
from conftest import ServerFactory
from iron_batch.backends.build import scheduler_config
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.loader import read_gguf_fields
from iron_batch.tokenizer import IncrementalDetokenizer, Tokenizer
from test_gguf_families import VARIANTS, write_gguf
from tiny_models import variant_checkpoint

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPACE = "\u2581"

CORPUS = """\
The quick brown fox jumps over the lazy dog.
Hello world, hello there! How are you doing today?
In the beginning the universe was created.
Tokenizers split the text into pieces, and the pieces are numbered.
Something, nothing, everything: one thing at a time.
Running, jumping, talking and walking are things people do.
The thinking machines are learning to read and to write.
Numbers 0 1 2 3 4 5 6 7 8 9 10 42 123 2024 and 3.14159 too.
"""

#: Gemma 2's chat template (it has no system role: the server folds a system message).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content']"
    " + '<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
    "{% endif %}"
)

#: Text each vocabulary must split as llama.cpp does.
TEXTS = [
    "Hello world",
    " Hello  world",
    "   three leading spaces",
    "trailing spaces  ",
    "the\nquick\n\nbrown\n\n\n\nfox\tjumps",
    "something   everything    thing",
    "héllo wörld, ça va? 日本語",
    "emoji 😀👍🏽 ok",
    "digits 0 42 123 2024 3.14159",
    "<|user|>\nHow are you?<|end|>\n<|assistant|>\n",
    "<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n",
    "a<tool>b <tool> c",
    "x<h1>y",
    "an <unk> here",
    "",
    " ",
    "\n",
]
#: A run of spaces longer than Gemma's longest whitespace token: llama.cpp cuts out the
#: longest whitespace token first (as SentencePiece matches user-defined pieces), where
#: transformers' GGUF conversion respells those tokens as ``▁`` runs and merges them as BPE
#: pairs (6 + 3 spaces here against its 4 + 5). This follows llama.cpp.
LONG_SPACE_RUN = "one" + " " * 9 + "two"


@dataclasses.dataclass
class SpmVocabulary:
    """A SentencePiece vocabulary as llama.cpp's converter writes it into a GGUF."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    add_space_prefix: bool | None
    bos: int
    eos: int
    unk: int
    chat_template: str
    pad: int | None = None

    @property
    def size(self) -> int:
        return len(self.tokens)

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(self.tokens)
        w.add_token_scores(self.scores)
        w.add_token_types(self.types)
        w.add_bos_token_id(self.bos)
        w.add_eos_token_id(self.eos)
        w.add_unk_token_id(self.unk)
        if self.pad is not None:
            w.add_pad_token_id(self.pad)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        if self.add_space_prefix is not None:
            w.add_add_space_prefix(self.add_space_prefix)
        w.add_chat_template(self.chat_template)


@cache
def _pieces() -> tuple[str, ...]:
    """Word pieces in SentencePiece's merge order (``▁`` marking a space), learnt from
    CORPUS by a BPE that splits at spaces as SentencePiece does."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(SPACE, prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    return tuple(t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]))


def _bytes() -> list[str]:
    return [f"<0x{b:02X}>" for b in range(256)]


def phi3_vocabulary(add_space_prefix: bool | None = None) -> SpmVocabulary:
    """Phi-3's layout (Llama 2's, with Phi-3's chat tokens appended)."""
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [UNKNOWN, CONTROL, CONTROL]
    tokens += _bytes()
    scores += [0.0] * 256
    types += [BYTE] * 256
    runs = [SPACE * 2, SPACE * 4, SPACE * 3]  # Llama 2 ranks these early
    pieces = runs + [p for p in _pieces() if p not in runs]
    tokens += pieces
    scores += [-float(i) for i in range(len(pieces))]
    types += [NORMAL] * len(pieces)
    for text, kind in [("<|endoftext|>", CONTROL), ("<|assistant|>", CONTROL),
                       ("<|end|>", CONTROL), ("<|user|>", CONTROL), ("<|system|>", CONTROL),
                       ("<tool>", USER_DEFINED)]:
        tokens.append(text)
        scores.append(-1000.0)
        types.append(kind)
    return SpmVocabulary(tokens, scores, types, add_space_prefix, bos=1, eos=2, unk=0,
                         chat_template=PHI3_TEMPLATE)


def gemma_vocabulary() -> SpmVocabulary:
    """Gemma's layout: its control tokens first, user-defined whitespace runs (real spaces)
    and newline runs, the byte tokens, then the pieces; no space prefix."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN, USER_DEFINED, CONTROL, CONTROL]
    scores = [0.0] * len(tokens)
    user = [" " * n for n in range(2, 7)] + ["\n\n", "\n\n\n", "<h1>"]
    tokens += user
    scores += [-1000.0] * len(user)
    types += [USER_DEFINED] * len(user)
    tokens += _bytes()
    scores += [0.0] * 256
    types += [BYTE] * 256
    pieces = ["\n", "\t", *_pieces()]
    tokens += pieces
    scores += [-float(i) for i in range(len(pieces))]
    types += [NORMAL] * len(pieces)
    return SpmVocabulary(tokens, scores, types, False, bos=2, eos=1, unk=3, pad=0,
                         chat_template=GEMMA_TEMPLATE)


def write_tokenizer_gguf(path: Path, arch: str, vocab: SpmVocabulary,
                         name: str = "tiny") -> Path:
    """A GGUF with ``vocab`` and the few architecture keys transformers reads for a config
    (no weights but the embedding)."""
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(256)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    vocab.write(w)
    w.add_tensor("token_embd.weight", np.zeros((vocab.size, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _ours(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_fields(read_gguf_fields(path))


def _transformers(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                         local_files_only=True)


# ------------------------------------------------- llama.cpp's SPM tokenizer, transcribed


def llama_cpp_tokenize(vocab: SpmVocabulary, text: str, *, add_space_prefix: bool,
                       strip_after_special: bool = False) -> list[int]:
    """``llama_tokenize(..., add_special=false, parse_special=true)`` of llama.cpp
    (``llama-vocab.cpp``) for a SentencePiece vocabulary, written out plainly: control,
    unknown and user-defined tokens cut out of the text, longest first; a space in front of
    each stretch of text that starts the text or follows such a token (where the file asks
    for a space prefix); spaces as ``▁``; then the best-scoring adjacent pair merged while
    any pair joins into a token (the leftmost on a tie), and characters with no token of
    their own as their UTF-8 byte tokens. ``strip_after_special``: the whitespace after such
    tokens dropped (llama.cpp's rule for a file whose name says Phi-3)."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    specials = [i for i, k in enumerate(vocab.types) if k in (UNKNOWN, CONTROL, USER_DEFINED)]
    specials.sort(key=lambda i: -len(vocab.tokens[i].encode()))
    keep_space = {"<unk>", "<s>", "<|endoftext|>"}
    parts: list[str | int] = [text]
    for sid in specials:
        needle = vocab.tokens[sid]
        rstrip = strip_after_special and needle not in keep_space
        cut: list[str | int] = []
        for part in parts:
            if isinstance(part, int):
                cut.append(part)
                continue
            start = 0
            while (hit := part.find(needle, start)) != -1:
                if hit > start:
                    cut.append(part[start:hit])
                cut.append(sid)
                start = hit + len(needle)
                while rstrip and start < len(part) and part[start].isspace():
                    start += 1
            if start < len(part):
                cut.append(part[start:])
        parts = cut
    out: list[int] = []
    after_special = True
    for part in parts:
        if isinstance(part, int):
            out.append(part)
            after_special = True
            continue
        piece = (" " if add_space_prefix and after_special else "") + part
        out += _spm_merge(vocab, ids, piece.replace(" ", SPACE))
        after_special = False
    return out


def _spm_merge(vocab: SpmVocabulary, ids: dict[str, int], text: str) -> list[int]:
    symbols = list(text)
    while True:
        best: tuple[float, int] | None = None
        for i in range(len(symbols) - 1):
            joined = ids.get(symbols[i] + symbols[i + 1])
            if joined is not None and (best is None or vocab.scores[joined] > best[0]):
                best = (vocab.scores[joined], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out: list[int] = []
    for s in symbols:
        if s in ids:
            out.append(ids[s])
        else:
            out += [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out


# ----------------------------------------------------------------- the tests


@pytest.mark.parametrize("arch", ["phi3", "gemma3"])
def test_ids_and_text_equal_transformers_gguf_tokenizer(arch: str, tmp_path: Path) -> None:
    """transformers, loading the same file, gives the same ids and decodes them to the same
    text (BOS added as both add it; specials skipped and kept)."""
    vocab = phi3_vocabulary() if arch == "phi3" else gemma_vocabulary()
    path = write_tokenizer_gguf(tmp_path / f"{arch}.gguf", arch, vocab)
    ours, hf = _ours(path), _transformers(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ids[0] == vocab.bos
        assert ours.encode(text, add_special_tokens=False) == ids[1:], text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip), (text, skip)


@pytest.mark.parametrize(("arch", "name"), [
    ("phi3", "tiny"),
    ("llama", "tiny"),  # the architecture does not change how llama.cpp splits text
    ("phi3", "Phi-3 Mini 4k Instruct"),  # whitespace after the chat tokens dropped
    ("gemma3", "tiny"),
    ("gemma2", "tiny"),
])
def test_ids_equal_llama_cpp(arch: str, name: str, tmp_path: Path) -> None:
    vocab = gemma_vocabulary() if arch.startswith("gemma") else phi3_vocabulary()
    tok = _ours(write_tokenizer_gguf(tmp_path / "t.gguf", arch, vocab, name))
    prefix = not arch.startswith("gemma")
    strip = any(p in name.lower() for p in ("phi-3", "phi3"))  # llama.cpp's test of the name
    for text in [*TEXTS, LONG_SPACE_RUN]:
        want = llama_cpp_tokenize(vocab, text, add_space_prefix=prefix,
                                  strip_after_special=strip)
        assert tok.encode(text, add_special_tokens=False) == want, text


def test_phi3_named_file_drops_whitespace_after_chat_tokens(tmp_path: Path) -> None:
    vocab = phi3_vocabulary()
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "phi3", vocab, "Phi-3-mini-4k-instruct")
    tok = _ours(path)
    ids = tok.encode("<|user|>\nHi<|end|>\n<|assistant|>\n", add_special_tokens=False)
    user, end, assistant = (vocab.tokens.index(t) for t in ("<|user|>", "<|end|>",
                                                            "<|assistant|>"))
    assert ids[0] == user and ids[-2:] == [end, assistant]
    assert tok.decode(ids[1:-2]) == "Hi"  # "▁Hi": the newline went, the prefix came
    assert vocab.tokens.index("<0x0A>") not in ids
    # Named otherwise, the file keeps the newlines.
    plain = _ours(write_tokenizer_gguf(tmp_path / "u.gguf", "phi3", vocab, "tiny"))
    kept = plain.encode("<|user|>\nHi<|end|>\n<|assistant|>\n", add_special_tokens=False)
    assert kept.count(vocab.tokens.index("<0x0A>")) == 3


def test_merges_follow_the_scores_not_the_file_order(tmp_path: Path) -> None:
    """llama.cpp ranks pairs by the scores the file gives (transformers ranks a Gemma file's
    pieces by their order instead); with scores out of file order, the scores decide."""
    vocab = gemma_vocabulary()
    normal = [i for i, k in enumerate(vocab.types) if k == NORMAL]
    shuffled = [vocab.scores[i] for i in normal]
    random.Random(7).shuffle(shuffled)
    scores = list(vocab.scores)
    for i, s in zip(normal, shuffled, strict=True):
        scores[i] = s
    vocab = dataclasses.replace(vocab, scores=scores)
    tok = _ours(write_tokenizer_gguf(tmp_path / "t.gguf", "gemma3", vocab))
    first = llama_cpp_tokenize(gemma_vocabulary(), CORPUS, add_space_prefix=False)
    want = llama_cpp_tokenize(vocab, CORPUS, add_space_prefix=False)
    assert want != first  # the shuffle changes the split
    assert tok.encode(CORPUS, add_special_tokens=False) == want


@pytest.mark.parametrize("arch", ["phi3", "gemma3"])
def test_decode_gives_the_text_back(arch: str, tmp_path: Path) -> None:
    """Byte tokens joined into UTF-8, ``▁`` back to spaces, the prefix space dropped."""
    vocab = phi3_vocabulary() if arch == "phi3" else gemma_vocabulary()
    tok = _ours(write_tokenizer_gguf(tmp_path / "t.gguf", arch, vocab))
    plain = [t for t in [*TEXTS, LONG_SPACE_RUN, CORPUS] if "<" not in t]
    # Kept, BOS is the first token: the prefix space after it stays (as in llama.cpp).
    bos = vocab.tokens[vocab.bos] + (" " if arch == "phi3" else "")
    for text in plain:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, text
        if text:
            assert tok.decode(ids, skip_special_tokens=False) == bos + text
    # Bytes of one character over several tokens only make text together.
    ids = tok.encode("😀", add_special_tokens=False)
    assert sum(vocab.types[i] == BYTE for i in ids) == 4  # ("▁" first, with the prefix)
    assert tok.decode(ids) == "😀"


def test_special_ids_and_the_wire_form(tmp_path: Path) -> None:
    """BOS/EOS/pad by the file's ids; generation also ends at ``<end_of_turn>`` (llama.cpp
    finds it by its text); what a worker sends tokenizes the same."""
    vocab = gemma_vocabulary()
    tok = _ours(write_tokenizer_gguf(tmp_path / "t.gguf", "gemma3", vocab))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert tok.eos_token_ids == [1, vocab.tokens.index("<end_of_turn>")]
    assert tok.vocab_size == vocab.size
    assert tok.chat_template == GEMMA_TEMPLATE
    again = Tokenizer.from_info(tok.to_info())
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
        assert again.decode(tok.encode(text)) == tok.decode(tok.encode(text))


def test_add_eos_and_missing_keys_take_llama_cpp_defaults(tmp_path: Path) -> None:
    vocab = phi3_vocabulary()
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "phi3", vocab)
    fields = read_gguf_fields(path)
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id"):
        del fields[key]
    fields["tokenizer.ggml.add_eos_token"] = True
    tok = Tokenizer.from_gguf_fields(fields)
    ids = tok.encode("Hello world")
    assert ids[0] == 1 and ids[-1] == 2  # <s> ... </s>
    assert tok.encode("Hello world", add_special_tokens=False) == ids[1:-1]
    # <|end|> and <|endoftext|> end generation by their text, after the default eos.
    assert tok.eos_token_ids == [2, vocab.tokens.index("<|end|>"),
                                 vocab.tokens.index("<|endoftext|>")]


@pytest.mark.parametrize("kind", ["bert", "t5", "rwkv"])
def test_other_tokenizer_models_are_refused_at_load_by_name(kind: str, tmp_path: Path) -> None:
    class Other(SpmVocabulary):
        def write(self, w: gguf.GGUFWriter) -> None:
            w.add_tokenizer_model(kind)
            w.add_token_list(self.tokens)

    vocab = phi3_vocabulary()
    folder = _gemma3_checkpoint(vocab.size)
    other = Other(**dataclasses.asdict(vocab))
    path = write_gguf("gemma3", tmp_path / "other.gguf", folder=folder, vocabulary=other)
    with pytest.raises(ValueError) as err:
        TorchBackend.from_model(str(path), device="cpu", dtype="float32",
                                total_kv_blocks=16, kv_block_size=4)
    message = str(err.value)
    assert repr(kind) in message and "'llama'" in message and "\n" not in message


@cache
def _gemma3_checkpoint(vocab_size: int) -> Path:
    changes = {**VARIANTS["gemma3"], "vocab_size": vocab_size}
    return variant_checkpoint("gemma3", tuple(sorted(changes.items())))


def test_gemma3_gguf_serves_a_chat_with_a_system_message(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    """A Gemma 3 GGUF with its SentencePiece vocabulary behind the server: the system
    message folded into the first user turn, the prompt tokenized as llama.cpp does, the
    answer the text of the greedy tokens, every KV block free afterwards."""
    vocab = gemma_vocabulary()
    path = write_gguf("gemma3", tmp_path / "gemma3.gguf",
                      folder=_gemma3_checkpoint(vocab.size), vocabulary=vocab)
    backend = TorchBackend.from_model(str(path), device="cpu", dtype="float32",
                                      total_kv_blocks=64, kv_block_size=4)
    cfg = scheduler_config(backend)  # a cache group for the sliding layers, one for the rest
    srv = start_server(backend, total_kv_blocks=cfg.total_kv_blocks,
                       kv_block_size=cfg.kv_block_size, max_model_len=cfg.max_model_len,
                       cache_groups=cfg.cache_groups)
    model = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"]
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "How are you doing today?"}]
    prompt = httpx.post(f"{srv.url}/tokenize", json={"model": model, "messages": messages},
                        timeout=30).json()["tokens"]
    rendered = ("<bos><start_of_turn>user\nAnswer in one word.\n\nHow are you doing today?"
                "<end_of_turn>\n<start_of_turn>model\n")
    assert prompt == [vocab.bos, *llama_cpp_tokenize(vocab, rendered[len("<bos>"):],
                                                     add_space_prefix=False)]
    reply = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["prompt_tokens"] == len(prompt)
    content = body["choices"][0]["message"]["content"]
    # The prompt's text back, without the control tokens.
    text = httpx.post(f"{srv.url}/detokenize", json={"model": model, "tokens": prompt},
                      timeout=30).json()["prompt"]
    assert text == "user\nAnswer in one word.\n\nHow are you doing today?\nmodel\n"
    # The same prompt through /generate: its greedy tokens, decoded as they stream, are the
    # answer (the random model's bytes need not make UTF-8: each delta is what decoding had
    # made of it when it came), with no piece or byte token spelled out in it.
    status, lines = srv.generate({"prompt_token_ids": prompt, "max_new_tokens": 12,
                                  "temperature": 0})
    assert status == 200
    ids = [line["token_id"] for line in lines if "token_id" in line]
    assert len(ids) == body["usage"]["completion_tokens"]
    tok = backend.tokenizer
    assert tok is not None
    detok = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(detok.add(i)[0] for i in _until_end(ids, tok.eos_token_ids))
    assert content == streamed + detok.flush()
    assert content and SPACE not in content and "<0x" not in content
    srv.wait_idle()


def _until_end(ids: Sequence[int], ends: Sequence[int]) -> list[int]:
    out = []
    for i in ids:
        if i in ends:
            break
        out.append(i)
    return out
