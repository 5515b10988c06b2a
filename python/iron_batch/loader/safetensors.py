"""An HF checkpoint folder's safetensors files as a ``layers.weights.WeightSource``: each
part read lazily, so a tensor-parallel rank reads only its slices' bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from iron_batch.layers.quant import QuantWeight
from iron_batch.layers.weights import Part


class SafetensorsSource:
    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {folder}")
            weight_map = {}
        self._handles: dict[str, Any] = {
            f: safe_open(str(folder / f), framework="pt") for f in files
        }
        if not weight_map:
            for f, h in self._handles.items():
                for key in h.keys():
                    weight_map[key] = f
        self._where = weight_map

    def tensor(self, part: Part) -> torch.Tensor | None:
        f = self._where.get(part.name)
        if f is None:
            return None
        handle = self._handles[f]
        if part.rows is None and part.cols is None:
            return handle.get_tensor(part.name)
        view = handle.get_slice(part.name)
        if part.cols is not None:
            return view[:, part.cols]
        t = view[part.rows]
        assert part.rows is not None
        want = part.rows.stop - (part.rows.start or 0)
        if t.shape[0] < want:  # the last vocabulary shard's padding rows
            t = torch.cat([t, t.new_zeros((want - t.shape[0], *t.shape[1:]))])
        return t

    def quantized(self, part: Part) -> QuantWeight | None:
        return None  # safetensors checkpoints hold floats
