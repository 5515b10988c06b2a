"""Tiny random-weight checkpoints of each supported family, and helpers to run them.

Checkpoints are written once per test session (cached by name) with transformers'
save_pretrained into a temporary folder; the same transformers model then gives the
reference greedy output. Weights are drawn wider than transformers' default init so that
logits are far apart and greedy choices are not decided by float rounding.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections import deque
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from iron_batch import Scheduler
from iron_batch.backends.build import scheduler_config
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.sampling_params import SamplingParams

VOCAB = 320
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

#: name -> (transformers config class name, extra config fields)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA 2:1, untied head, llama3 rope scaling.
    "llama": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0,
    )),
    # Multi-head (no GQA), tied embeddings, linear rope scaling.
    "llama_tied_linear": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )),
    # qkv bias, GQA 4:1, tied.
    "qwen2": ("Qwen2Config", dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
        rope_theta=1000000.0,
    )),
    # q/k norm, explicit head_dim != hidden / heads, GQA 2:1, untied.
    "qwen3": ("Qwen3Config", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
    )),
    # Sliding window shorter than the longer test sequences.
    "mistral": ("MistralConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
        tie_word_embeddings=False,
    )),
    # A sliding and a global layer, GeGLU, sandwich norms, soft caps small enough to bite.
    "gemma2": ("Gemma2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
        query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
    )),
    # q/k norms, a local rope base of its own, linear scaling on the global layer, untied.
    "gemma3": ("Gemma3TextConfig", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=20,
        query_pre_attn_scalar=32, layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
        rope_layers={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                        "rope_theta": 1000000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )),
    # Two sliding and two global layers; the global ones with wider heads, one K/V head,
    # values from the k projection and proportional rope over a quarter of each head; the
    # last two layers share the first two's K/V (with double-wide MLPs); per-layer
    # embeddings; untied head.
    "gemma4": ("Gemma4TextConfig", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, sliding_window=20,
        layer_types=["sliding_attention", "full_attention"] * 2, attention_k_eq_v=True,
        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, final_logit_softcapping=6.0,
        tie_word_embeddings=False,
        rope_layers={"full_attention": {"rope_type": "proportional",
                                        "partial_rotary_factor": 0.25,
                                        "rope_theta": 1000000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )),
    # Fused qkv and gate/up, rotary over 3/4 of each head, LongRoPE (long factors past
    # position 256: test_new_families checks those against transformers separately).
    "phi3": ("Phi3Config", dict(
        num_attention_heads=4, num_key_value_heads=2, original_max_position_embeddings=256,
        rope_scaling={"rope_type": "longrope", "partial_rotary_factor": 0.75,
                      "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]},
    )),
    # Norms after the sublayers, q/k norms over whole projections.
    "olmo2": ("Olmo2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )),
    # The four multipliers.
    "granite": ("GraniteConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=3.0,
        attention_multiplier=0.2, residual_multiplier=0.6, logits_scaling=2.5,
        tie_word_embeddings=True,
    )),
    # The second layer without rotary (NoPE).
    "smollm3": ("SmolLM3Config", dict(
        num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[1, 0],
    )),
}

#: Further checkpoints that only their own tests use (the shared family tests run over
#: ``FAMILIES`` alone): name -> the same (config class name, fields).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Mixture-of-experts families (tests/test_moe.py). Qwen3-MoE: 8 experts, top 2
    # renormalised, the second layer dense.
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1], tie_word_embeddings=False,
    )),
    # A gated shared expert beside 8 routed ones, top 2 not renormalised, q/k/v bias.
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=False,
        tie_word_embeddings=False,
    )),
    # 4 experts, top 2, a sliding window shorter than the longer test sequences.
    "mixtral": ("MixtralConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=64, sliding_window=24,
        tie_word_embeddings=False,
    )),
    # Top 3 of 8, q/k norms over the whole projections.
    "olmoe": ("OlmoeConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
        intermediate_size=32, norm_topk_prob=False, tie_word_embeddings=False,
    )),
    # gpt-oss (tests/test_gpt_oss.py): sliding (window 6) and full layers alternating,
    # attention sinks, YaRN, top 2 of 4 experts with biases and the clamped SwiGLU (a limit
    # the random activations reach).
    "gpt_oss": ("GptOssConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=32, sliding_window=6, swiglu_limit=1.5,
        tie_word_embeddings=False, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                      "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 128},
    )),
}

_GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
               "moe_intermediate_size": 32}
VARIANTS.update({
    # Gemma 4 with experts (tests/test_gemma4_moe.py, test_gemma4.py): the dense test model
    # (sliding and global layers, K/V shared, per-layer embeddings) with 8 experts, top 2,
    # beside every layer's MLP.
    "gemma4_moe": ("Gemma4TextConfig", {**FAMILIES["gemma4"][1], **_GEMMA4_MOE}),
    # As the released mixture-of-experts checkpoint is built: no per-layer embeddings, no
    # K/V sharing, the head the token table.
    "gemma4_moe_plain": ("Gemma4TextConfig", {
        **FAMILIES["gemma4"][1], **_GEMMA4_MOE, "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
        "tie_word_embeddings": True}),
})

_ROOT = Path(tempfile.mkdtemp(prefix="iron_batch_tiny_"))
atexit.register(shutil.rmtree, _ROOT, True)


def _rope_kwargs(cls_name: str, extra: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 moved rope settings into rope_parameters.
    extra = dict(extra)
    per_layer_type = extra.pop("rope_layers", None)
    scaling = extra.pop("rope_scaling", None)
    theta = extra.pop("rope_theta", 10000.0)
    if per_layer_type is not None:  # Gemma 3's rope settings by layer type
        extra["rope_parameters"] = per_layer_type
    elif int(transformers.__version__.split(".")[0]) >= 5:
        params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
        extra["rope_parameters"] = params
    else:
        extra["rope_theta"] = theta
        if scaling:
            extra["rope_scaling"] = scaling
    return extra


@cache
def reference_model(name: str) -> Any:
    """The transformers model (eval, float32) behind checkpoint ``name``."""
    cls_name, extra = FAMILIES[name] if name in FAMILIES else VARIANTS[name]
    return _random_model(name, cls_name, {**_COMMON, **extra})


def _random_model(name: str, cls_name: str, fields: dict[str, Any]) -> Any:
    config = getattr(transformers, cls_name)(**_rope_kwargs(cls_name, fields))
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Gemma 4 attends with scale 1 over q and k normed to unit RMS: norm weights near 1
    # give scores spread by sqrt(head_dim), nearly one-hot attention, and bf16 runs (even
    # transformers' own) that flip between near-tied keys. Smaller q/k norm weights keep
    # the bf16 checks measuring rounding; float32 checks are exact either way.
    soft_qk = config.model_type == "gemma4_text"
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if soft_qk and pname.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.2, 0.6)
            elif pname.endswith(("router.scale", "router.per_expert_scale")):
                p.uniform_(0.5, 1.5)  # Gemma 4's router: scales, like a norm's weight
            elif pname.endswith("router.proj.weight"):
                # Its input is scaled by 1/sqrt(hidden): wider weights keep the experts'
                # scores apart (routing decided by the weights, not by rounding).
                p.normal_(0.0, 1.0)
            elif pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
        for bname, b in model.named_buffers():
            if bname.endswith("layer_scalar"):  # Gemma 4's per-layer output scale
                b.uniform_(0.5, 1.5)
    return model.eval()


@cache
def variant_checkpoint(name: str, changes: tuple[tuple[str, Any], ...]) -> Path:
    """Checkpoint ``name`` with some config fields changed (a value of None drops the
    field: the config class's default applies), written like :func:`checkpoint`."""
    cls_name, extra = FAMILIES[name] if name in FAMILIES else VARIANTS[name]
    fields = {**_COMMON, **extra}
    for key, value in changes:
        if value is None:
            fields.pop(key, None)
        else:
            fields[key] = value
    folder = _ROOT / f"{name}-variant-{len(list(_ROOT.glob(f'{name}-variant-*')))}"
    model = _random_model(name, cls_name, fields)
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder


@cache
def checkpoint(name: str) -> Path:
    """Folder with config.json, model.safetensors and a byte-level tokenizer."""
    folder = _ROOT / name
    model = reference_model(name)
    model.save_pretrained(folder)
    # The scheduler loop under test never stops at eos, so neither may the reference.
    model.generation_config.eos_token_id = None
    write_byte_tokenizer(folder)
    return folder


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE with no merges: ids 0-2 specials, then one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.save(str(folder / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template})
    )


def write_gguf_byte_vocabulary(writer: Any, folder: Path, rows: int) -> None:
    """The byte tokenizer of ``folder`` (:func:`write_byte_tokenizer`) as a GGUF file's
    GPT-2 style vocabulary, padded to ``rows`` tokens as llama.cpp's converter pads it:
    ids 0-2 control tokens (1 the BOS, 2 the EOS), the pads unused."""
    import gguf

    tok = json.loads((folder / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(rows)])
    writer.add_token_types([gguf.TokenType.CONTROL if i < 3 else gguf.TokenType.NORMAL
                            if i in by_id else gguf.TokenType.UNUSED for i in range(rows)])
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def uneven_checkpoint(folder: Path) -> Path:
    """A Llama with 6 query / 3 KV heads (2 + 1 KV heads per rank), 129 MLP rows (65 + 64)
    and a vocabulary of 321 (padded to 2 x 161): nothing splits evenly over 2 ranks. Bias on
    every projection, so the row-parallel ones (o, down) must add theirs once."""
    if (folder / "config.json").is_file():
        return folder
    config = transformers.LlamaConfig(
        vocab_size=321, hidden_size=96, intermediate_size=129, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512,
        tie_word_embeddings=False, attention_bias=True, mlp_bias=True, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.5 if name.endswith("bias") else 0.15)
    model.save_pretrained(folder)
    return folder


@cache
def backend(name: str, total_kv_blocks: int = 256, kv_block_size: int = 4) -> TorchBackend:
    return TorchBackend.from_model(
        str(checkpoint(name)), device="cpu", dtype="float32",
        total_kv_blocks=total_kv_blocks, kv_block_size=kv_block_size,
    )


def greedy_on_one_and_two_ranks(
    path: str, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of ``path`` (float32, CPU) on one rank and over two
    (``tensor_parallel_size=2``), the same prompts and pool on each."""
    from iron_batch.llm import LLM

    kw: dict[str, Any] = dict(device="cpu", dtype="float32", total_kv_blocks=256,
                              kv_block_size=4)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    tp1 = [o.token_ids for o in LLM(model=path, **kw).generate(prompts, params)]
    llm = LLM(model=path, tensor_parallel_size=2, **kw)
    try:
        tp2 = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()
    return tp1, tp2


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def hf_greedy(name: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers generate(do_sample=False) continuation of ``prompt``, eos ignored."""
    checkpoint(name)
    model = reference_model(name)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def run_with_config(
    be: TorchBackend,
    cfg: Any,
    prompts: list[list[int]],
    max_new: int,
    on_step: Callable[[Scheduler], None] | None = None,
) -> tuple[list[list[int]], Scheduler]:
    """Greedy tokens of each prompt through a scheduler of ``cfg`` (a ``SchedulerConfig``),
    one step at a time, ``on_step(scheduler)`` after each; also the scheduler at the end."""
    s = Scheduler(cfg)
    ids = [f"r{i}" for i in range(len(prompts))]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid, p in zip(ids, prompts, strict=True):
        s.add_request(rid, p, max_new)
    while s.has_work():
        batch = s.schedule()
        events = s.commit(batch, be.execute(batch))
        for rid, tok in zip(events.request_ids, events.token_ids.tolist(), strict=True):
            if tok >= 0:
                out[rid].append(tok)
        if on_step is not None:
            on_step(s)
        s.check_invariants()
    return [out[rid] for rid in ids], s


def run_scheduler(
    be: TorchBackend,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    *,
    params: SamplingParams | list[SamplingParams] | None = None,
    max_batch_tokens: int = 512,
    max_running_seqs: int = 64,
    total_kv_blocks: int | None = None,
    on_step: Callable[[Any], None] | None = None,
    overlap_depth: int = 0,
    stop_token_ids: list[int] | None = None,
) -> tuple[list[list[int]], dict[str, int]]:
    """Drive the real scheduler with the backend until every request ends. With
    ``overlap_depth`` > 0, that many steps stay submitted (``be.submit``) while the next is
    scheduled over them (placeholders filled in by the backend), as the engine does."""
    # The backend's cache groups (sliding-window layers release their old blocks).
    sched = Scheduler(scheduler_config(
        be, total_kv_blocks=total_kv_blocks, max_batch_tokens=max_batch_tokens,
        max_running_seqs=max_running_seqs,
    ))
    n = len(prompts)
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
    plist = params if isinstance(params, list) else [params or SamplingParams()] * n
    ids = [f"r{i}" for i in range(n)]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid, prompt, limit, p in zip(ids, prompts, limits, plist, strict=True):
        be.add_request(rid, prompt, p)
        sched.add_request(rid, prompt, limit, stop_token_ids=stop_token_ids or [])
    inflight: deque[tuple[Any, Any]] = deque()
    while sched.has_work() or inflight:
        if sched.has_work():
            batch = sched.schedule(overlap=bool(inflight))
            if on_step is not None:
                on_step(batch)
            inflight.append((batch, be.submit(batch)))
        if len(inflight) > overlap_depth or not sched.has_work():
            batch, handle = inflight.popleft()
            events = sched.commit(batch, be.wait(handle).tokens)
            for rid, token, finished in zip(events.request_ids, events.token_ids.tolist(),
                                            events.finished.tolist(), strict=True):
                if token >= 0:
                    outputs[rid].append(token)
                if finished:
                    be.remove_request(rid)
        sched.check_invariants()
    assert sched.num_free_blocks == sched.config.total_kv_blocks
    assert all(g["used"] == 0 for g in sched.group_stats())
    return [outputs[rid] for rid in ids], sched.stats()


def prefix_hit_run(be: TorchBackend, lengths: tuple[int, int] = (37, 45)) -> tuple[
        list[list[int]], list[list[int]]]:
    """Four prompts that share a prefix of ``lengths[0]`` tokens and two that do not (one
    of ``lengths[1]``), run in prompt chunks of at most 7 tokens, three sequences at a
    time, after the first ran alone: (prompts, greedy tokens of 10 each). Asserts that the
    prefix cache hit, the chunks kept their bound and the first prompt's tokens are those
    of its run alone."""
    prefix = random_prompts(30, [lengths[0]])[0]
    prompts = [prefix + s for s in random_prompts(31, [3, 5, 1, 9])] + random_prompts(
        32, [lengths[1], 7])
    first, _ = run_scheduler(be, prompts[:1], 10)
    chunks: list[int] = []
    outs, stats = run_scheduler(be, prompts, 10, max_batch_tokens=7, max_running_seqs=3,
                                on_step=lambda b: chunks.append(b.num_tokens))
    assert stats["prefix_cache_hit_tokens"] > 0
    assert max(chunks) <= 7
    assert outs[0] == first[0]
    return prompts, outs


def sixteen_requests_run(be: TorchBackend) -> tuple[list[list[int]], list[int],
                                                    list[list[int]]]:
    """Sixteen requests of 1 to 40 prompt tokens and 1 to 20 new ones at once: (prompts,
    new tokens asked, greedy tokens). Asserts that some step sampled more than 8 rows
    (wider than one GEMV pass)."""
    lengths = [1, 2, 3, 5, 8, 11, 16, 17, 23, 31, 4, 9, 40, 6, 27, 12]
    max_new = [12, 3, 20, 7, 16, 1, 9, 14, 5, 18, 11, 2, 8, 13, 6, 10]
    prompts = random_prompts(20, lengths)
    widths: list[int] = []
    outs, _ = run_scheduler(be, prompts, max_new,
                            on_step=lambda b: widths.append(len(b.sample_indices)))
    assert max(widths) > 8
    return prompts, max_new, outs
