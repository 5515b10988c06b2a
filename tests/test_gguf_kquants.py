"""GGUF K-quants (Q4_K, Q5_K, Q6_K) and the Q5_0/Q5_1 fallbacks, kept in their blocks by
``--quantization gguf``.

Each kernel is held to the ``gguf`` package's own dequantization (``gguf.quants``) of the
same blocks: the bf16 dequantization exactly, the GEMV within the rounding of its f32
sums (of the activations in the fixed point its AVX-512 path multiplies). Then a
tiny Llama written as a GGUF of such blocks, mixed per tensor as llama.cpp's Q4_K_M mixes
them (a fused q/k/v of three types), must give the logits of transformers running the
file's dequantized weights in float32, within the existing GGUF tests' tolerance, on the
prompt path, the one-row path and the one-call decode stack.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import gguf.quants as gguf_quants
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as GGML
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.layers import quant
from safetensors.numpy import load_file
from test_quantization import _decode_logits, _logit_tolerance, _prefill_logits
from tiny_models import random_prompts, variant_checkpoint, write_gguf_byte_vocabulary

#: The formats kept in their own bytes, and the two regrouped ones a stacked matrix mixes in.
RAW = ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"]


def random_blocks(type_name: str, n: int, k: int, seed: int, size: float = 0.15) -> np.ndarray:
    """``n`` rows of ``k`` weights of random valid blocks ``[n, row bytes]``: random quants
    and sub-block scales, the f16 super-scales chosen so that weights are about ``size``
    and roughly centred."""
    rng = np.random.default_rng(seed)
    kind = GGML[type_name]
    values, per_block = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(n * k // values, per_block), dtype=np.uint8)
    count = len(blocks)

    def put(at: int, value: np.ndarray) -> None:
        blocks[:, at:at + 2] = value.astype(np.float16).view(np.uint8).reshape(count, 2)

    jitter = rng.uniform(0.5, 1.5, size=count)
    if type_name in ("Q4_K", "Q5_K"):  # d * sc * q - dmin * m, 6-bit sc and m
        levels = 15 if type_name == "Q4_K" else 31
        d = size / (levels * 32) * jitter
        put(0, d)
        put(2, d * levels / 2)
    elif type_name == "Q6_K":  # d * sc * (q - 32), i8 sc
        put(208, size / (64 * 32) * jitter)
    elif type_name in ("Q5_0", "Q8_0"):  # d * (q - 16), d * q
        put(0, size / (8 if type_name == "Q5_0" else 64) * jitter)
    elif type_name == "Q5_1":  # d * q + m
        d = size / 8 * jitter
        put(0, d)
        put(2, -16 * d)
    else:
        raise ValueError(type_name)
    return blocks.reshape(n, -1)


def reference(type_name: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """gguf's own float32 dequantization of the blocks."""
    values = gguf_quants.dequantize(raw, GGML[type_name])
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(n, k))


def _bound(x: torch.Tensor, exact: torch.Tensor, want: torch.Tensor, dense: bool) -> torch.Tensor:
    """How far the kernel's bf16 output may be from the float64 product.

    The output is one bf16 rounding of an f32 value: 2^-8 of it. That f32 value sums, per
    group of 16 or 32 weights, ``scale * sum(q x) + offset * sum(x)``: every product and
    partial sum is rounded to f32 (2^-24), through at most ``k`` additions, so the error is
    within ``k 2^-24`` of the sum of the terms' magnitudes; ``scale * q`` and ``offset``
    are each within twice the largest weight of their row for these blocks (the offset is
    a weight at ``q = 0``, the scaled quant the difference of two weights), so
    ``2 max|w| sum|x|`` bounds those magnitudes. ``dense``: the step took more rows than
    the matrix's GEMV takes, so the weights were rounded to bf16 first for the dense GEMM:
    2^-8 of each term's magnitude.
    """
    k = exact.shape[1]
    row_max = exact.abs().amax(1).double()
    magnitude = x.double().abs().sum(1, keepdim=True) * (2 * row_max)[None]
    per_term = 2**-8 if dense else k * 2**-24
    terms = x.double().abs() @ exact.double().abs().T
    return 2**-8 * want.abs() + per_term * torch.maximum(magnitude, terms) + 1e-7


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


#: Whether the block GEMV takes its AVX-512 path, which multiplies the activations in 14- or
#: 15-bit fixed point (``Fixed`` in rust/kernels/src/kquant.rs); other CPUs take them as they are.
FIXED_POINT = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
               "f16c"} <= _cpu_flags()


def fixed_point(x: torch.Tensor, span: int) -> torch.Tensor:
    """``x`` [rows, k] as that path holds it, written out here from its definition: per
    ``span`` values (256 for the K-quants, 32 for the other formats; the last of a row may
    be fewer), ``s = max |x| / 16383`` and each value ``round(x * (16383 / max |x|)) * s``
    (to nearest, ties to even), all in float32."""
    rows, k = x.shape
    kp = -(-k // span) * span
    v = torch.nn.functional.pad(x.float(), (0, kp - k)).view(rows, kp // span, span)
    top = v.abs().amax(-1, keepdim=True)
    safe = torch.where(top > 0, top, torch.ones_like(top))
    q = torch.round(v * (16383.0 / safe))
    out = torch.where(top > 0, q * (safe / 16383.0), torch.zeros_like(v))
    return out.view(rows, kp)[:, :k]


def _segments(w: quant.QuantWeight) -> list[tuple[int, int]]:
    """Each row range of ``w`` (``kind`` "q4_k*384+q6_k*128", or one name) as (rows, the
    span its format's fixed point scales together: 256 for the K-quants, 32 for the other
    block formats, 0 for the regrouped "q4"/"q8" layouts, which take bf16 as it is)."""
    out = []
    for part in w.kind.split("+"):
        name, _, count = part.partition("*")
        span = 256 if name in ("q4_k", "q5_k", "q6_k") else 0 if name in ("q4", "q8") else 32
        out.append((int(count) if count else w.n, span))
    return out


def _check_linear(w: quant.QuantWeight, exact: torch.Tensor, rows: int, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randn(rows, w.k).to(torch.bfloat16)
    dense = rows > w.gemv_rows()
    got = w.linear(x).double()
    start = 0
    for n, span in _segments(w):
        part = exact[start:start + n]
        xs = fixed_point(x, span) if FIXED_POINT and span and not dense else x.float()
        want = xs.double() @ part.double().T
        err = (got[:, start:start + n] - want).abs()
        assert bool((err <= _bound(xs, part, want, dense)).all()), err.max().item()
        start += n
    assert start == w.n


@pytest.mark.parametrize("type_name", RAW)
def test_dequantization_is_gguf_s_exactly(type_name: str) -> None:
    """bf16 dequantization (the dense path's buffer) = gguf's float32 values rounded to
    bf16, bit for bit; embedding rows = gguf's float32 values. Rows of an odd number of
    blocks; an odd number of rows, split across threads with a partial last chunk."""
    values = gguf.GGML_QUANT_SIZES[GGML[type_name]][0]
    for n, k in [(259, 3 * values), (7, 18 * 32 if values == 32 else 256)]:
        raw = random_blocks(type_name, n, k, seed=n)
        w = quant.from_gguf_blocks(type_name, raw, n, k)
        assert w is not None and w.kind == type_name.lower()
        assert w.nbytes == raw.nbytes  # the file's bytes, nothing added
        ref = reference(type_name, raw, n, k)
        torch.set_num_threads(2)
        assert torch.equal(w.dequantize(), ref.to(torch.bfloat16))
        assert torch.equal(w.dequantize(scratch=True), ref.to(torch.bfloat16))
        ids = torch.tensor([n - 1, 0, 3, 3])
        assert torch.equal(w.rows(ids, torch.float32), ref[ids])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("type_name", RAW)
def test_gemv_is_the_product_with_gguf_s_weights(type_name: str, rows: int) -> None:
    values = gguf.GGML_QUANT_SIZES[GGML[type_name]][0]
    n, k = 259, 3 * values if values == 256 else 18 * 32
    raw = random_blocks(type_name, n, k, seed=rows)
    w = quant.from_gguf_blocks(type_name, raw, n, k)
    assert w is not None
    torch.set_num_threads(2)
    _check_linear(w, reference(type_name, raw, n, k), rows, seed=rows)


@pytest.mark.parametrize(("type_name", "n", "limit"), [
    ("Q4_K", 67, 8), ("Q6_K", 67, 8), ("Q5_0", 67, 8),
    # At least KQUANT_WIDE_GEMV_WEIGHTS: a K-quant matrix this large takes 16 rows.
    ("Q4_K", 4096, 16), ("Q6_K", 4096, 16), ("Q5_0", 4096, 8),
])
def test_a_step_of_up_to_its_gemv_rows_gives_each_row_what_it_gets_alone(
    type_name: str, n: int, limit: int,
) -> None:
    """A batch of decoding sequences (or a speculative step) over block-format weights
    takes the GEMV up to the matrix's GEMV rows (8; 16 for large K-quant matrices), in
    passes of 4 rows, where each row's output is the bits a one-row step gives it; past
    them the dense path's bf16 weights move them."""
    values = gguf.GGML_QUANT_SIZES[GGML[type_name]][0]
    k = 4 * values if values == 256 else 32 * 32
    w = quant.from_gguf_blocks(type_name, random_blocks(type_name, n, k, seed=5), n, k)
    assert w is not None and w.gemv_rows() == limit
    assert (n * k >= quant.KQUANT_WIDE_GEMV_WEIGHTS) == (n == 4096)
    torch.manual_seed(5)
    x = torch.randn(limit + 1, k).to(torch.bfloat16)
    alone = torch.cat([w.linear(x[i : i + 1]) for i in range(limit + 1)])
    for rows in (3, 5, limit):
        assert torch.equal(w.linear(x[:rows]), alone[:rows]), rows
    assert not torch.equal(w.linear(x), alone)


@pytest.mark.parametrize("types", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K"),
                                   ("Q4_1", "Q5_1", "Q4_0")])
@pytest.mark.parametrize("rows", [1, 4, 5, 9])
def test_a_fused_projection_of_three_types_stacks_their_blocks(
    types: tuple[str, str, str], rows: int
) -> None:
    """q, k and v of different types (llama.cpp picks a type per tensor) fuse into one
    matrix of row ranges, each still in its own blocks; Q8_0 and Q4_x parts go back to
    their GGUF bytes for it."""
    k = 512
    heights = [192, 64, 67]
    parts, refs = [], []
    for i, (type_name, n) in enumerate(zip(types, heights, strict=True)):
        if type_name in RAW:
            raw = random_blocks(type_name, n, k, seed=10 * rows + i)
        else:
            torch.manual_seed(i)
            raw = gguf_quants.quantize((torch.randn(n, k) * 0.1).numpy(), GGML[type_name])
        part = quant.from_gguf_blocks(type_name, raw, n, k)
        assert part is not None
        parts.append(part)
        refs.append(reference(type_name, raw, n, k))
    fused = quant.concat(parts)
    assert fused is not None and fused.n == sum(heights)
    ref = torch.cat(refs)
    assert torch.equal(fused.dequantize(), ref.to(torch.bfloat16))
    assert torch.equal(fused.rows(torch.tensor([0, 200, 300]), torch.float32),
                       ref[[0, 200, 300]])
    torch.set_num_threads(2)
    _check_linear(fused, ref, rows, seed=rows)


def test_a_block_matrix_of_the_wrong_size_is_refused() -> None:
    raw = random_blocks("Q4_K", 4, 512, seed=0)
    assert quant.from_gguf_blocks("Q4_K", raw, 4, 500) is None  # not whole super-blocks
    assert quant.from_gguf_blocks("Q4_K", raw[:, :-1], 4, 512) is None  # bytes missing


# ------------------------------------------------------------------ a K-quant model

#: A tiny Llama whose rows are whole super-blocks (256 weights).
CHANGES = (("hidden_size", 256), ("intermediate_size", 512), ("rope_scaling", None),
           ("tie_word_embeddings", False))

#: Per layer, the type of each projection: llama.cpp's Q4_K_M mixes (Q6_K for v and down
#: in some layers; where a row is not whole super-blocks, Q5_0 and Q8_0).
LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
     "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "Q6_K"},
    {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K",
     "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_K"},
]
TOP_TYPES = {"token_embd": "Q5_K", "output": "Q6_K"}

_HF_PROJ = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (rope pairs interleaved)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _write_kquant_gguf(folder: Path, out: Path) -> dict[str, torch.Tensor]:
    """The GGUF of the checkpoint at ``folder`` with random blocks for every matrix (the
    norms kept), and the HF-named float32 weights those blocks dequantize to."""
    cfg = json.loads((folder / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    for key, value in {
        "block_count": cfg["num_hidden_layers"], "context_length": 512,
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": kv_heads,
        "vocab_size": cfg["vocab_size"], "rope.dimension_count": cfg["hidden_size"] // heads,
    }.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", float(cfg.get("rope_theta") or
                                                 cfg["rope_parameters"]["rope_theta"]))
    w.add_float32("llama.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    vocab = cfg["vocab_size"]
    write_gguf_byte_vocabulary(w, folder, vocab)
    state = load_file(str(folder / "model.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    seed = 0

    def matrix(gguf_name: str, hf_name: str, type_name: str, shape: tuple[int, int],
               permute: int | None = None) -> None:
        nonlocal seed
        seed += 1
        n, k = shape
        raw = random_blocks(type_name, n, k, seed)
        w.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=GGML[type_name])
        dense = reference(type_name, raw, n, k).numpy()
        if permute is not None:  # the file holds interleaved rows; HF's are half split
            dense = (dense.reshape(permute, dense.shape[0] // permute // 2, 2, k)
                     .swapaxes(1, 2).reshape(n, k))
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(dense))

    hidden = cfg["hidden_size"]
    matrix("token_embd.weight", "model.embed_tokens.weight", TOP_TYPES["token_embd"],
           (vocab, hidden))
    for i, types in enumerate(LAYER_TYPES):
        for name, type_name in types.items():
            hf = f"model.layers.{i}.{_HF_PROJ[name]}.weight"
            shape = state[hf].shape
            permute = heads if name == "attn_q" else kv_heads if name == "attn_k" else None
            matrix(f"blk.{i}.{name}.weight", hf, type_name, shape, permute)
        for hf_norm, norm in (("input_layernorm", "attn_norm"),
                              ("post_attention_layernorm", "ffn_norm")):
            value = state[f"model.layers.{i}.{hf_norm}.weight"].astype(np.float32)
            w.add_tensor(f"blk.{i}.{norm}.weight", value)
            weights[f"model.layers.{i}.{hf_norm}.weight"] = torch.from_numpy(value)
    value = state["model.norm.weight"].astype(np.float32)
    w.add_tensor("output_norm.weight", value)
    weights["model.norm.weight"] = torch.from_numpy(value)
    matrix("output.weight", "lm_head.weight", TOP_TYPES["output"], (vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # The interleaving we undid is the converter's: redo it and compare with the file.
    q = weights["model.layers.0.self_attn.q_proj.weight"].numpy()
    reader = gguf.GGUFReader(str(out))
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    back = reference("Q4_K", np.asarray(stored.data), *q.shape).numpy()
    assert np.array_equal(_interleave(q, heads), back)
    return weights


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = variant_checkpoint("llama", CHANGES)
    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    weights = _write_kquant_gguf(folder, path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    missing, unexpected = ref.load_state_dict(weights, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], missing
    ref.generation_config.eos_token_id = None
    return path, ref.eval()


def test_a_kquant_gguf_matches_transformers_on_its_dequantized_weights(
    kquant_model: tuple[Path, Any],
) -> None:
    path, ref = kquant_model
    be = TorchBackend.from_model(str(path), device="cpu", total_kv_blocks=64, kv_block_size=4,
                                 quantization="gguf")
    net = be.model
    # Every matrix kept in its blocks, none dequantized to bf16; the fused q/k/v of the
    # first layer is three formats' row ranges, the second's two.
    assert net.dequantized == []
    qkv = [layer.qkv.weight for layer in net.layers]
    assert all(isinstance(w, quant.QuantWeight) for w in qkv)
    assert qkv[0].kind == "q4_k*384+q6_k*128" and qkv[1].kind == "q5_0*384+q8_0*128"
    assert net.layers[0].mlp.down.weight.kind == "q6_k"
    assert net.decoder is not None  # one-row steps run the one-call stack over the blocks
    for prompt in random_prompts(7, [5, 30]):
        with torch.no_grad():
            tokens = ref.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=32, do_sample=False, pad_token_id=0,
            )[0].tolist()
            want = ref(torch.tensor([tokens])).logits[0]
        tolerance = _logit_tolerance(want)
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance
        assert clear.any()  # some choices are not near-ties (the check below has teeth)
        for got in (_prefill_logits(net, tokens), _decode_logits(net, tokens)):
            assert (got - want).abs().max().item() <= tolerance
            # Greedy: wherever transformers' best logit leads by more than the error can
            # close, ours picks the same token.
            assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
