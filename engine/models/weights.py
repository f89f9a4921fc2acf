"""Stream tensors out of a Hugging Face folder's (possibly sharded) safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.engine.errors import ModelNotFound


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"no *.safetensors weights in {folder}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelNotFound(f"weight shards listed in the index are missing: {missing}")
    return files


def iter_weights(folder: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) one at a time, converted to `dtype`, so peak memory stays ~one tensor."""
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)
