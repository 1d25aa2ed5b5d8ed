"""Read Hugging Face safetensors checkpoints (single file or sharded) from a local directory.

Float tensors are memory-mapped copy-on-write rather than read into private memory: on this kind of machine
several processes (the judge's reference, a baseline worker, candidate workers) hold the same model, and a
shared mapping of one file costs its size once in the page cache instead of once per process. Tensors of a
shard share one storage, so adjacent rows (a GGUF checkpoint's q/k/v, gate/up) can be fused as views.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from specpilot.core.engine.config import ModelLoadError

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
          "I32": torch.int32, "U8": torch.uint8, "I8": torch.int8, "BOOL": torch.bool, "F64": torch.float64}


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
        state.update(mapped(shard))
    return state


def mapped(shard: Path) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors as views of a copy-on-write memory map of the whole file."""
    size = shard.stat().st_size
    try:
        with open(shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{shard} could not be read ({exc}); the file is corrupt or truncated") from None
    header.pop("__metadata__", None)
    whole = torch.from_numpy(np.memmap(shard, dtype=np.uint8, mode="c")) if size > 8 + n else torch.empty(0, dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    for key, info in header.items():
        start, end = (8 + n + o for o in info["data_offsets"])
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{shard}: tensor {key} has dtype {info['dtype']}, which this loader cannot read")
        if end > size or start > end:
            raise ModelLoadError(f"{shard}: tensor {key} lies past the end of the file; it is truncated: re-download")
        out[key] = whole[start:end].view(dtype).reshape(info["shape"])
    return out
