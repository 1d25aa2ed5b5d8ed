"""Build a C kernel once per source version into the SpecPilot cache and load it with ctypes.

Shared by the skinny GEMM (skinny.c + layer.c) and the GGUF block kernel (gguf_blocks.c): compiled with the
system C compiler (`$CC`, else cc/gcc/clang) into `$SPECPILOT_CACHE_DIR/kernels/<name>-<hash>.so`, the hash
covering the sources and flags. Concurrent builders (candidate workers) each compile to a private name and
rename into place, so a reader never sees a half-written library; a damaged cached build is rebuilt once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from specpilot.kernels import cache_dir


class KernelUnavailable(RuntimeError):
    """A kernel cannot run here (no AVX2/FMA, no C compiler, or the build failed)."""


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def compiled(name: str, sources: tuple[Path, ...], flags: tuple[str, ...], libs: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The loaded library built from `sources`, compiling it first when this version is not cached."""
    cc = compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler found (set CC or install gcc)")
    source = b"".join(path.read_bytes() for path in sources)
    digest = hashlib.sha256(source + " ".join(flags + libs).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{name}-{digest}.so"
    if not target.exists():
        _build(cc, target, sources, flags, libs)
    try:
        return ctypes.CDLL(str(target))
    except OSError:  # a damaged cached build: build it again, once
        _build(cc, target, sources, flags, libs)
        try:
            return ctypes.CDLL(str(target))
        except OSError as e:
            raise KernelUnavailable(f"the built {target.name} does not load: {e}") from None


def _build(cc: str, target: Path, sources: tuple[Path, ...], flags: tuple[str, ...], libs: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    done = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources), *libs], capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        first = (done.stderr.strip().splitlines() or ["no output"])[0]
        raise KernelUnavailable(f"{cc} failed to build {' and '.join(p.name for p in sources)}: {first}")
    os.replace(tmp, target)


def loads(library) -> bool:
    """Whether a kernel's `library()` builds and loads here."""
    try:
        library()
    except KernelUnavailable:
        return False
    return True
