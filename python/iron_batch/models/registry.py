"""Which class serves which checkpoint: one line per family, keyed by HF ``model_type``.

Adding a dense family is a model file (a :class:`~iron_batch.models.decoder.DecoderModel`
subclass) and its line here; see ``docs/adding-a-model.md``.
"""

from __future__ import annotations

from typing import Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel
from iron_batch.models.gemma2 import Gemma2ForCausalLM
from iron_batch.models.gemma3 import Gemma3ForCausalLM, Gemma3TextOfMultimodal
from iron_batch.models.gemma4 import Gemma4ForCausalLM
from iron_batch.models.gpt_oss import GptOssForCausalLM
from iron_batch.models.granite import GraniteForCausalLM
from iron_batch.models.llama import LlamaForCausalLM
from iron_batch.models.mistral import MistralForCausalLM
from iron_batch.models.mixtral import MixtralForCausalLM
from iron_batch.models.olmo2 import Olmo2ForCausalLM
from iron_batch.models.olmoe import OlmoeForCausalLM
from iron_batch.models.phi3 import Phi3ForCausalLM
from iron_batch.models.qwen2 import Qwen2ForCausalLM
from iron_batch.models.qwen2_moe import Qwen2MoeForCausalLM
from iron_batch.models.qwen3 import Qwen3ForCausalLM
from iron_batch.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextOfMultimodal
from iron_batch.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextOfMultimodal
from iron_batch.models.qwen3_moe import Qwen3MoeForCausalLM
from iron_batch.models.smollm3 import SmolLM3ForCausalLM

FAMILIES: tuple[type[DecoderModel], ...] = (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextOfMultimodal,
    Gemma4ForCausalLM,
    Phi3ForCausalLM,
    Olmo2ForCausalLM,
    GraniteForCausalLM,
    SmolLM3ForCausalLM,
    Qwen3MoeForCausalLM,
    Qwen2MoeForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    GptOssForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextOfMultimodal,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextOfMultimodal,
)

_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
#: A family whose GGUF files carry another family's architecture name and differ by their
#: experts (Mixtral's are ``llama`` files with ``expert_count``) says so by
#: ``gguf_shares_architecture``.
_BY_GGUF = {f.gguf_architecture: f for f in FAMILIES
            if f.gguf_architecture and not getattr(f, "gguf_shares_architecture", False)}
_BY_GGUF_WITH_EXPERTS = {f.gguf_architecture: f for f in FAMILIES
                         if f.gguf_architecture and getattr(f, "gguf_shares_architecture",
                                                            False)}

#: HF ``model_type`` values served, and llama.cpp architectures read from GGUF files.
SUPPORTED_MODEL_TYPES = tuple(_BY_MODEL_TYPE)
SUPPORTED_GGUF_ARCHS = tuple(_BY_GGUF)


class UnsupportedModel(ValueError):
    """A checkpoint whose architecture no model file serves."""


def family(cfg: dict[str, Any]) -> type[DecoderModel]:
    """The class for an HF config, by ``model_type`` (``architectures`` when it is
    missing); one line naming the supported ones otherwise."""
    model_type = cfg.get("model_type", "")
    found = _BY_MODEL_TYPE.get(model_type)
    archs = cfg.get("architectures") or []
    if found is None and not model_type:
        found = next((_BY_ARCHITECTURE[a] for a in archs if a in _BY_ARCHITECTURE), None)
    if found is None:
        raise UnsupportedModel(
            f"unsupported architecture: model_type={model_type!r} {archs} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return found


def gguf_family(arch: str, experts: int = 0) -> type[DecoderModel]:
    """The class for a GGUF file's ``general.architecture`` (``experts``: its
    ``expert_count``, which tells Mixtral's ``llama`` files from Llama's)."""
    found = (_BY_GGUF_WITH_EXPERTS.get(arch) if experts else None) or _BY_GGUF.get(arch)
    if found is None:
        raise UnsupportedModel(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_GGUF_ARCHS)})"
        )
    return found


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """The architecture settings of an HF ``config.json``, read by its family."""
    found = family(cfg)
    model_type = cfg.get("model_type") or found.model_types[0]
    return found.config_from_hf({**cfg, "model_type": model_type})
