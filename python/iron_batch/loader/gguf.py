"""Read a llama.cpp GGUF checkpoint: metadata as an HF-style config and tensors by HF name
(each family declares the names: ``models/decoder.py``'s ``GGUF_NAMES`` for the Llama-style
ones; what its architecture's metadata adds, in its ``hf_config_from_gguf``).

Tensors are dequantized to float32 at load, or kept in their blocks for ``--quantization
gguf``. llama.cpp's converter permutes the rows of Q and K for the architectures it runs with
interleaved rope pairs (instead of HF's half split: a family's ``gguf_permutes_qk``); we undo
it here so the model code has a single rope layout.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from iron_batch.layers import quant
from iron_batch.layers.quant import QuantWeight
from iron_batch.layers.weights import Part

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
#: One expert of a stacked expert tensor, in an HF name.
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def read_fields(reader: Any) -> dict[str, Any]:
    """All GGUF metadata as Python values (strings decoded, arrays as lists)."""
    import gguf

    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if not f.types:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            if len(f.types) > 1 and f.types[1] == gguf.GGUFValueType.STRING:
                out[key] = [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
            else:
                out[key] = [f.parts[i].tolist()[0] for i in f.data]
        elif f.types[0] == gguf.GGUFValueType.STRING:
            out[key] = bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
        else:
            out[key] = f.parts[f.data[0]].tolist()[0]
    return out


class GGUFMetadata:
    """A GGUF file's metadata and its tensors by GGUF name, as a family reads them to say
    what its architecture adds to the HF-style config (``hf_config_from_gguf`` of the
    family's class)."""

    def __init__(self, fields: dict[str, Any], tensors: dict[str, Any]) -> None:
        self.fields = fields
        self.tensors = tensors
        self.arch: str = fields.get("general.architecture", "")

    def key(self, key: str) -> str:
        """The full name of an architecture key (``rope.freq_base`` -> ``gemma3.rope...``)."""
        return f"{self.arch}.{key}"

    def get(self, key: str, default: Any = None) -> Any:
        """An architecture key's value (``default`` when the file has none)."""
        return self.fields.get(self.key(key), default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file has no {self.key(key)} (this architecture needs it)")
        return value

    def refuse(self, key: str, value: Any, supported: str) -> ValueError:
        """The one-line error for a key whose value this implementation does not run."""
        return ValueError(f"unsupported GGUF {self.key(key)} = {value!r} (supported: {supported})")

    def rows(self, name: str) -> int | None:
        """The number of rows of a 2-D tensor (None: no such tensor)."""
        t = self.tensors.get(name)
        return None if t is None else int(t.shape[-1])

    def floats(self, name: str) -> list[float] | None:
        """A 1-D tensor's values (None: no such tensor)."""
        from gguf.quants import dequantize

        t = self.tensors.get(name)
        if t is None:
            return None
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).ravel().tolist()


#: Tensors of llama.cpp that carry rope settings (Llama 3's per-frequency factors): read by
#: the ``llama`` family, refused in every other architecture.
_UNREAD_ROPE_TENSORS = ("rope_freqs.weight",)


def hf_config_from_gguf(fields: dict[str, Any], tensors: dict[str, Any],
                        family: Any) -> dict[str, Any]:
    """An HF-style config of a GGUF file's metadata: the keys every llama.cpp architecture
    writes the same way (``TextModel.set_gguf_parameters`` of its converter), then what the
    family's ``hf_config_from_gguf`` adds for its own. ``tensors``: the file's tensors by
    GGUF name; ``family``: the class serving ``general.architecture`` (from the registry).
    A key whose value this implementation does not run is refused by name."""
    meta = GGUFMetadata(fields, tensors)
    get = meta.get
    heads = int(meta.require("attention.head_count"))
    hidden = int(meta.require("embedding_length"))
    # The embedding's rows are the vocabulary (Gemma 3's converter cuts the rows the
    # tokenizer does not use, and writes no vocab_size key).
    vocab = (meta.rows("token_embd.weight") or get("vocab_size")
             or len(fields.get("tokenizer.ggml.tokens", [])))
    cfg: dict[str, Any] = {
        "model_type": family.model_types[0] if family.model_types else meta.arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        # A file whose every layer is experts (qwen35moe) may have no dense MLP size.
        "intermediate_size": int(get("feed_forward_length")
                                 or get("expert_feed_forward_length")
                                 or meta.require("feed_forward_length")),
        "num_hidden_layers": int(meta.require("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }
    value_length = get("attention.value_length")
    if value_length is not None and int(value_length) != cfg["head_dim"]:
        raise meta.refuse("attention.value_length", value_length,
                          f"the key length, {cfg['head_dim']}")
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none", *family.gguf_rope_scaling_types):
        raise meta.refuse("rope.scaling.type", scaling_type,
                          ", ".join(("none", "linear", *family.gguf_rope_scaling_types)))
    if meta.arch != "llama":
        for name in _UNREAD_ROPE_TENSORS:
            if name in tensors:
                raise ValueError(f"unsupported GGUF tensor {name} (per-frequency rope "
                                 f"factors) in a {meta.arch} file")
    cfg = family.hf_config_from_gguf(cfg, meta)
    rope_dims = get("rope.dimension_count")
    if (rope_dims is not None and int(rope_dims) != cfg["head_dim"]
            and "partial_rotary_factor" not in cfg):
        raise meta.refuse("rope.dimension_count", rope_dims, f"the head size, {cfg['head_dim']}")
    return cfg


def unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert's ``permute(w, n_head, n_head_kv)`` on Q or K rows.

    The converter maps each head's rows from [2, dim/2] (HF half split) to [dim/2, 2]
    (interleaved pairs) via reshape(n_head, 2, d/2, ...).swapaxes(1, 2); we swap back.
    """
    shape = weight.shape
    half = shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


class GGUFSource:
    """A GGUF file's tensors by HF name (``layers.weights.WeightSource``): dequantized to
    float32, or kept in their blocks where a kernel reads the type. The family's name map
    (``gguf_names``) says which GGUF tensor is which."""

    #: Read by the decoder: norm weights of a family whose converter adds the norm offset
    #: (``gguf_norm_offset_applied``) come from here with it added already.
    is_gguf = True

    def __init__(
        self, reader: Any, config: dict[str, Any], names: dict[str, str], permutes_qk: bool
    ) -> None:
        self._by_hf_name: dict[str, Any] = {}
        for t in reader.tensors:
            hf = _hf_name(t.name, names)
            if hf is not None:
                self._by_hf_name[hf] = t
        self._heads = config["num_attention_heads"]
        self._kv_heads = config["num_key_value_heads"]
        self._permuted = permutes_qk

    def _heads_of(self, name: str) -> int | None:
        """How many heads' rows llama.cpp permuted in this tensor (None: not permuted)."""
        if not self._permuted:
            return None
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return self._heads
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return self._kv_heads
        return None

    def _find(self, name: str) -> tuple[Any, Any, list[int]] | None:
        """(tensor, its data, its shape in HF order) for an HF name; one expert's slice of
        llama.cpp's stacked ``[experts, rows, cols]`` tensor for a per-expert name
        (``...experts.E...``: the family maps the stacked tensor to ``experts.{e}``)."""
        t = self._by_hf_name.get(name)
        if t is not None:
            return t, t.data, [int(d) for d in reversed(t.shape)]
        m = _EXPERT.search(name)
        if m is None:
            return None
        t = self._by_hf_name.get(name[: m.start()] + ".experts.{e}." + name[m.end() :])
        if t is None or len(t.shape) != 3:
            return None
        e = int(m.group(1))
        shape = [int(d) for d in reversed(t.shape)]
        if e >= shape[0]:
            return None
        return t, t.data[e], shape[1:]

    def tensor(self, part: Part) -> torch.Tensor | None:
        from gguf.quants import dequantize

        found = self._find(part.name)
        if found is None:
            return None
        t, data, shape = found
        arr = dequantize(data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        heads = self._heads_of(part.name)
        if heads is not None:
            arr = unpermute_rope_rows(arr, heads)
        if part.rows is not None:
            arr = _pad_rows(arr[part.rows], part.rows, arr.shape[0])
        if part.cols is not None:
            arr = arr[:, part.cols]
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # float tensors come back as views of the mmap
            arr = arr.copy()
        return torch.from_numpy(arr)

    def blocks(self, name: str) -> tuple[str, np.ndarray] | None:
        """A whole tensor as the file stores it: its GGUF type name and its bytes, uint8
        ``[..., rows, row bytes]`` with the dimensions in HF order (a family reads them
        itself where no kernel here takes the type as it is: gpt-oss's MXFP4 experts);
        None when the file has no such tensor."""
        t = self._by_hf_name.get(name)
        if t is None:
            return None
        shape = [int(d) for d in reversed(t.shape)]
        data = np.asarray(t.data).view(np.uint8).reshape(*shape[:-1], -1)
        return t.tensor_type.name, data

    def quantized(self, part: Part) -> QuantWeight | None:
        found = self._find(part.name)
        if found is None or len(found[2]) != 2:
            return None
        t, raw, (n, k) = found
        type_name = t.tensor_type.name
        data = np.asarray(raw).view(np.uint8).reshape(n, -1)
        heads = self._heads_of(part.name)
        if heads is not None:
            data = unpermute_rope_rows(data, heads)
        if part.rows is not None:
            # Rows past the end (the last vocabulary shard's padding) are zero bytes: a
            # block whose scale is zero holds zeros in every format kept here.
            data = _pad_rows(data[part.rows], part.rows, n)
            n = data.shape[0]
        if part.cols is not None:
            start, stop = part.cols.start or 0, k if part.cols.stop is None else part.cols.stop
            block = quant.gguf_block(type_name)
            # A row-parallel slice keeps its blocks only when it starts and ends on them.
            if block is None or start % block[0] or stop % block[0]:
                return None
            weights, per_block = block
            blocks = data.reshape(n, k // weights, per_block)
            data = blocks[:, start // weights : stop // weights].reshape(n, -1)
            k = stop - start
        return quant.from_gguf_blocks(type_name, data, n, k)


def _pad_rows(arr: np.ndarray, rows: slice, total: int) -> np.ndarray:
    """``arr`` (rows ``rows`` of a tensor of ``total`` rows) with zero rows for the part of
    ``rows`` past the end."""
    want = (rows.stop if rows.stop is not None else total) - (rows.start or 0)
    if arr.shape[0] >= want:
        return arr
    pad = np.zeros((want - arr.shape[0], *arr.shape[1:]), dtype=arr.dtype)
    return np.concatenate([arr, pad])


def _hf_name(gguf_name: str, names: dict[str, str]) -> str | None:
    if gguf_name in names:
        return names[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m:
        template = names.get("blk.{i}." + m.group(2))
        if template is not None:
            return template.format(i=m.group(1), e="{e}")
    return None
