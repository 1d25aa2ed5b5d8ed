"""GGUF weights read as stored: build, load and call the AVX2 / AVX-512 block-format matmul (gguf_blocks.c).

Why: a float32 copy of a quantised checkpoint reads 5-7x more bytes per token than its GGUF blocks; the C
kernel reads each block once per call for up to 64 rows of float32 activations, so verifying several draft
tokens costs about one weight read, and the dequantised weights are gguf-py's bit for bit (kernels/reference/gguf_ref).
Built once per source version with the system C compiler into the SpecPilot cache, like kernels/cpu/skinny.py.
`python -m specpilot.kernels.gguf_blocks --bench MODEL.gguf` times every linear of a checkpoint (kernels/bench/gguf_cpu.py).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from specpilot.kernels.build import compiled, loads
from specpilot.kernels.reference.gguf_ref import FORMATS, UnsupportedBlockType, as_raw, dequantize, qtype_id, row_bytes
from specpilot.kernels.cpu.skinny import SkinnyUnavailable, cpu_supports_avx2_fma

SOURCE = Path(__file__).with_name("gguf_blocks.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-shared", "-fPIC", "-fopenmp")
MAX_ROWS = 64
# rows per kernel call for wide inputs (a prompt): past 32 rows the AVX-512 path's x rows of a long K fall out
# of L1 and a weight costs more per row (Q6_K [1536, 8960]: 0.022 ns a weight a row at 16-32 rows, 0.033 at 64)
CHUNK_ROWS = {"avx2": MAX_ROWS, "avx512": 32}
WIDE_ROWS = 64  # from this many rows (a prompt, not a verify step) the product goes through torch's GEMM
SLAB_WEIGHTS = 1 << 21  # weights dequantised at a time for it (8 MB of float32: L2-sized, reused by every row)

__all__ = ["GGUFMatrix", "UnsupportedBlockType", "available", "block_traits", "library", "linear_tensors"]


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled kernel, building it on first use; SkinnyUnavailable says why it cannot run here."""
    if not cpu_supports_avx2_fma():
        raise SkinnyUnavailable("this CPU has no AVX2+FMA")
    lib = compiled("gguf_blocks", (SOURCE,), FLAGS, ("-lm",))
    ptr, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.gguf_matmul.argtypes = [ptr, n, n, ptr, n, n, n, i, ptr, n, i]
    lib.gguf_matmul.restype = i
    lib.gguf_dequant_rows.argtypes = [ptr, n, i, n, ptr, n, ptr, i]
    lib.gguf_dequant_rows.restype = None
    lib.gguf_matmul_part.argtypes = [ptr, n, n, ptr, n, n, n, i, ptr, n, i, i]
    lib.gguf_matmul_part.restype = i
    lib.gguf_isa.argtypes = [i]
    lib.gguf_isa.restype = i
    lib.gguf_traits.argtypes = [i, ctypes.POINTER(n), ctypes.POINTER(n), ctypes.POINTER(ctypes.c_char_p)]
    lib.gguf_traits.restype = i
    return lib


def block_traits(qtype: int) -> tuple[str, int, int] | None:
    """(name, values per block, bytes per block) of `qtype` as the C kernel's traits table has it, or None
    where the kernel does not read that type (tests hold it against gguf_ref.FORMATS and gguf-py)."""
    block, size, name = ctypes.c_long(), ctypes.c_long(), ctypes.c_char_p()
    if library().gguf_traits(qtype, ctypes.byref(block), ctypes.byref(size), ctypes.byref(name)):
        return None
    return name.value.decode(), block.value, size.value


def isa() -> str:
    """The product's instruction set in use, "avx512" (by default where the CPU has AVX-512F) or "avx2". Each is
    exact; their float32 sums are ordered differently (16 lanes against 8). A pure query: it changes nothing."""
    return "avx512" if library().gguf_isa(-1) else "avx2"


def use_isa(name: str) -> str:
    """Select the product's instruction set for the process ("avx2" or "avx512"; the library holds the choice)
    and return the one now in use, which is "avx2" where "avx512" was asked of a CPU without it. Why: tests and
    the kernel bench force a path to check or time each; production never calls it (it runs the best one)."""
    code = {"avx2": 0, "avx512": 1}[name]
    got = "avx512" if library().gguf_isa(code) else "avx2"
    _chunk_rows.cache_clear()
    return got


@functools.cache
def _chunk_rows() -> int:
    """CHUNK_ROWS of the path in use, asked of the library once per choice (not a C call per product)."""
    return CHUNK_ROWS[isa()]


def available() -> bool:
    """Whether the kernel builds and loads here."""
    return loads(library)


def exact_gemm() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """float32 x @ w.T for a prompt's slab: oneDNN's GEMM where torch has it and computes float32 matmuls in
    float32 (its default; a process that allows bfloat16 or TF32 for them gets torch's default BLAS instead),
    else torch's. On the Zen 4 oneDNN ran a prompt's shapes at 48-50 G FMA/s against MKL's 29-43 (the core's
    peak is 57); both sum the same exact products, in their own orders."""
    if (torch.backends.mkldnn.is_available() and torch.get_float32_matmul_precision() == "highest"
            and torch.backends.mkldnn.matmul.fp32_precision in ("none", "ieee")):
        return _onednn_gemm
    return F.linear


_slab = threading.local()


def _slab_buffer(numel: int) -> torch.Tensor:
    """This thread's float32 scratch of at least `numel` values, kept between calls (see GGUFMatrix._wide)."""
    buf = getattr(_slab, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _slab.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


def _onednn_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")


class GGUFMatrix:
    """A weight W [N, K] kept in its GGUF blocks (the caller's buffer, not copied: a read-only memmap stays
    shared through the page cache); calling it on x [..., K] gives float32 x @ W.T [..., N]."""

    def __init__(self, raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int,
                 threads: int | None = None) -> None:
        self.qtype = qtype_id(qtype)
        self.name = FORMATS[self.qtype][0]
        self.n, self.k = int(n), int(k)
        self.row_bytes = row_bytes(self.qtype, self.k)
        self.raw = as_raw(raw, self.qtype, self.n, self.k)
        self.threads = threads
        self.lib = library()

    @property
    def nbytes(self) -> int:
        """Bytes of stored blocks one full product reads."""
        return self.n * self.row_bytes

    def _threads(self) -> int:
        return max(1, self.threads or torch.get_num_threads())

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """x [..., K] (any float dtype) -> float32 [..., N]; more rows than CHUNK_ROWS run as chunks. `threads`
        overrides the matrix's (default torch.get_num_threads()); the result's bits do not depend on it."""
        if x.shape[-1] != self.k:
            raise ValueError(f"x has {x.shape[-1]} features; the {self.name} weight [{self.n}, {self.k}] takes "
                             f"{self.k}")
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.k).float().contiguous()
        out = torch.empty(rows.shape[0], self.n, dtype=torch.float32)
        if self.k % 8:  # only F32/F16 rows can be ragged; the blocks' K is a multiple of 32
            return F.linear(rows, self.dequantize()).view(*lead, self.n)  # F32/F16 with K % 8 != 0
        if rows.shape[0] >= WIDE_ROWS:
            return self._wide(rows, out).view(*lead, self.n)
        t = threads or self._threads()
        step = _chunk_rows()
        for m0 in range(0, rows.shape[0], step):
            m = min(step, rows.shape[0] - m0)
            rc = self.lib.gguf_matmul(rows[m0].data_ptr(), m, self.k, self.raw.data_ptr(), self.n, self.k,
                                      self.row_bytes, self.qtype, out[m0].data_ptr(), self.n, t)
            if rc:
                raise RuntimeError(f"gguf_matmul rejected {self.name} [{self.n}, {self.k}] with {m} rows")
        return out.view(*lead, self.n)

    def _wide(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A prompt's many rows: dequantise the weight a slab at a time (the same exact float32 values, into one
        buffer reused for every slab and every matrix, so its pages stay mapped and in cache) and multiply with a
        float32 GEMM, which runs near the core's FMA peak where the block kernel, decoding for every 16 rows,
        does not. A fresh buffer per slab cost more in page faults than the dequantisation itself (0.5-0.8 s
        against 0.18 s a pass over the 1.5B on the Zen 4). No copy of the weight outlives the process's slab."""
        step = max(1, SLAB_WEIGHTS // self.k)
        gemm = exact_gemm()
        buf = _slab_buffer(min(step, self.n) * self.k)
        for n0 in range(0, self.n, step):
            n1 = min(self.n, n0 + step)
            w = buf[: (n1 - n0) * self.k].view(n1 - n0, self.k)
            self._dequantize_into(torch.arange(n0, n1), w)
            out[:, n0:n1] = gemm(rows, w)
        return out

    def rows(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Dequantised rows W[ids] (an embedding lookup): float32 [*ids.shape, K]."""
        idx = torch.as_tensor(ids, dtype=torch.long)
        flat = idx.reshape(-1).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.n):
            raise IndexError(f"row ids must be in [0, {self.n})")
        if self.k % 8:
            return dequantize(self.raw[flat], self.qtype, flat.numel(), self.k).view(*idx.shape, self.k)
        out = torch.empty(flat.numel(), self.k, dtype=torch.float32)
        self._dequantize_into(flat, out)
        return out.view(*idx.shape, self.k)

    def _dequantize_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """W[ids] into `out` (contiguous float32 [len(ids), K]); ids valid, K a multiple of 8."""
        if ids.numel():
            self.lib.gguf_dequant_rows(self.raw.data_ptr(), self.row_bytes, self.qtype, self.k, ids.data_ptr(),
                                       ids.numel(), out.data_ptr(), self._threads() if ids.numel() > 64 else 1)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 [N, K]."""
        return self.rows(torch.arange(self.n))


def linear_tensors(path: str) -> list[tuple[str, GGUFMatrix]]:
    """Every 2-D weight of a GGUF file except the token embedding (an embedding is a lookup, not a product),
    as GGUFMatrix over the file's memmap; a tied head (no output.weight) uses the embedding."""
    import gguf

    reader = gguf.GGUFReader(path)
    mats, embd = [], None
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        m = GGUFMatrix(t.data, int(t.tensor_type), n, k)
        if t.name == "token_embd.weight":
            embd = m
        else:
            mats.append((t.name, m))
    if embd is not None and not any(name == "output.weight" for name, _ in mats):
        mats.append(("output.weight (tied)", embd))
    return mats
