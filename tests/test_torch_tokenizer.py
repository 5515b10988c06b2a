"""Tokenizer wrapper, chat templates and the incremental detokenizer."""

from __future__ import annotations

import pytest
import torch  # noqa: F401 - the torch backend's tests must fail, not skip, without torch
from iron_batch.tokenizer import IncrementalDetokenizer, Tokenizer
from tiny_models import checkpoint


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(checkpoint("llama"))


def test_encode_decode_roundtrip(tok: Tokenizer) -> None:
    text = "héllo wörld 😀 ok"
    ids = tok.encode(text)
    assert ids[0] == 1  # <s> from the post-processor
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text
    assert tok.eos_token_ids == [2]
    assert tok.vocab_size == 259


def test_chat_template(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|user|>hi</s><|assistant|>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|user|>hi</s>"


def _stream(tok: Tokenizer, text: str, stop: list[str]) -> tuple[list[str], bool, str]:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], stop=stop)
    deltas, stopped = [], False
    for i in ids:
        delta, stopped = detok.add(i)
        deltas.append(delta)
        if stopped:
            break
    return deltas, stopped, "" if stopped else detok.flush()


def test_detokenizer_never_splits_utf8(tok: Tokenizer) -> None:
    text = "a😀bé"
    deltas, stopped, tail = _stream(tok, text, [])
    assert not stopped and tail == ""
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # The 4 bytes of the emoji arrive as 4 tokens; only the last one releases it.
    assert deltas[1:5] == ["", "", "", "😀"]


def test_detokenizer_stop_string_truncates(tok: Tokenizer) -> None:
    deltas, stopped, _ = _stream(tok, "hello STOP world", ["STOP"])
    assert stopped
    assert "".join(deltas) == "hello "


def test_detokenizer_holds_partial_stop_prefix(tok: Tokenizer) -> None:
    deltas, stopped, tail = _stream(tok, "abc ST", ["STOP"])
    assert not stopped
    assert "".join(deltas) == "abc "  # "ST" might still become "STOP"
    assert tail == "ST"
    deltas, stopped, tail = _stream(tok, "a STx", ["STOP"])
    assert "".join(deltas) + tail == "a STx" and not stopped


def test_detokenizer_earliest_stop_wins(tok: Tokenizer) -> None:
    deltas, stopped, _ = _stream(tok, "xxBAyyAB", ["AB", "BA"])
    assert stopped and "".join(deltas) == "xx"


def test_detokenizer_keeps_the_special_tokens_it_is_told_to() -> None:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    info = Tokenizer.from_folder(checkpoint("llama")).to_info()
    hf = HFTokenizer.from_str(info["json"])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in ("<|call>", "<call|>", "<|q|>")])
    tok = Tokenizer.from_info({**info, "json": hf.to_str()})
    text = "ok <|call>f{a:<|q|>x<|q|>}<call|></s>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == "ok f{a:x}"

    def streamed(keep: list[str] | None, skip: bool = True) -> str:
        detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=skip,
                                       keep_special_tokens=keep)
        return "".join(detok.add(i)[0] for i in ids) + detok.flush()

    assert streamed(None) == "ok f{a:x}"
    # Kept: the named ones; </s> (special too) is still skipped.
    assert streamed(["<|call>", "<call|>", "<|q|>"]) == "ok <|call>f{a:<|q|>x<|q|>}<call|>"
    assert streamed(["<|q|>", "<|unknown|>"]) == "ok f{a:<|q|>x<|q|>}"
    assert streamed(["<|q|>"], skip=False) == text
