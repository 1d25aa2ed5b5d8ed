"""SpecPilot's kernels, by where they run:

- cpu/: the GGUF block-format matmul (gguf_blocks.c), the skinny GEMM and fused layer (skinny.c, layer.c) and the
  drafter's 8-bit products (q8_draft.c), each with its ctypes binding; build.py compiles them on first use;
- gpu/: the Triton twins (gguf_triton, packed12_triton) and the packed12 format;
- reference/: plain-PyTorch references the kernels are tested against (gguf_ref, bf16x3);
- bench/: their benchmarks (`python -m specpilot.kernels.gguf_blocks --bench MODEL.gguf` runs bench/gguf_cpu.py).
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    """SpecPilot's per-user cache ($SPECPILOT_CACHE_DIR, default ~/.cache/specpilot): probe results and
    compiled kernels."""
    return Path(os.environ.get("SPECPILOT_CACHE_DIR") or Path.home() / ".cache" / "specpilot")
