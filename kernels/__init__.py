"""SpecPilot's kernels, by where they run:

- cpu/: the GGUF block-format matmul (gguf_blocks.c), the skinny GEMM and fused layer (skinny.c, layer.c) and the
  drafter's 8-bit products (q8_draft.c), each with its ctypes binding; build.py compiles them on first use;
- gpu/: the Triton twins (gguf_triton, packed12_triton) and the packed12 format;
- reference/: plain-PyTorch references the kernels are tested against (gguf_ref, bf16x3);
- bench/: their benchmarks (`python -m specpilot.kernels.gguf_blocks --bench MODEL.gguf` runs bench/gguf_cpu.py).

Installed, this folder is `specpilot.kernels` and nothing else. Run from the checkout's root (whose folders are on
sys.path then), `import kernels` would find this folder instead of Hugging Face's `kernels` package, which
transformers imports where it is installed; the block below hands that name to Hugging Face's package, or where
none is installed to an empty namespace package, which transformers reads as not installed.
"""

import os
import sys
from pathlib import Path

if __name__ == "kernels":
    # Imported by its folder's name: the checkout's root is on sys.path (python run from it) and something asked
    # for Hugging Face's `kernels` (transformers checks for it). This folder is `specpilot.kernels`, never a
    # top-level module: hand the name to the package it stands in front of, found on the rest of sys.path, or
    # to an empty namespace.
    import importlib.machinery
    import importlib.util

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None or _spec.loader is None:
        # None installed: stand in as an empty namespace package (no file, no names, no submodules), what Python
        # makes of a folder without __init__.py. Raising instead breaks transformers 5.24, whose availability
        # check imports any name find_spec found and reads a module without __file__ as not installed.
        _module = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("kernels", None, is_package=True))
        sys.modules["kernels"] = _module
    else:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # what the import system returns for `import kernels` once this file ends
        _spec.loader.exec_module(_module)


def cache_dir() -> Path:
    """SpecPilot's per-user cache ($SPECPILOT_CACHE_DIR, default ~/.cache/specpilot): probe results and
    compiled kernels."""
    return Path(os.environ.get("SPECPILOT_CACHE_DIR") or Path.home() / ".cache" / "specpilot")
