"""SpecPilot's kernels: packed12 (GPU, Triton), skinny (CPU, C via ctypes) and the GGUF block-format matmul
(gguf_ref reference, gguf_blocks CPU C kernel, gguf_triton GPU twin)."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """SpecPilot's per-user cache ($SPECPILOT_CACHE_DIR, default ~/.cache/specpilot): probe results and
    compiled kernels."""
    return Path(os.environ.get("SPECPILOT_CACHE_DIR") or Path.home() / ".cache" / "specpilot")
