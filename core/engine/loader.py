"""Read Hugging Face safetensors checkpoints (single file or sharded) from a local directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from core.engine.config import ModelLoadError


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, keyed by their Hugging Face names."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files; save the model with safe_serialization=True")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        shard = path / name
        if not shard.is_file():
            raise ModelLoadError(f"{path}: shard {name} named in the index is missing; re-download or re-save")
        try:
            state.update(load_file(str(shard)))
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"{shard} could not be read ({exc}); the file is corrupt or truncated") from None
    return state
