"""The q8 product on GGUF blocks: build, load and call q8_blocks.c (AVX-512 VNNI, or AVX2 elsewhere; AMX int8
tiles for products of 16 rows or more on a Xeon that has them).

Why: q8 numerics (kernels/reference/q8_ref.py, llama.cpp's arithmetic) quantise activations to 8 bits per 256
values and multiply them by the blocks' integer codes, so a product is exact integer work plus one float
combination per weight block; the C kernel gives the oracle's bits for any number of rows, any grouping and
any thread count, reading the caller's blocks in place (a read-only memmap stays shared, never copied).
A caller with one input for several matrices (q/k/v, gate/up) quantises it once (`quantize`) and multiplies
it by each (`Q8Matrix.product`); `Q8Matrix(x)` does both in one foreign call.
Q4_K, Q6_K, Q5_0 and Q8_0 matrices of a GGUF file are read through a repacked copy (q8_blocks.c: each 16-row superblock's dwords transposed, the same bytes): written once per source file into the SpecPilot cache and memory-mapped
read-only, so every process shares one copy through the page cache, as it shares the file itself.
Built once per source version with the system C compiler into the SpecPilot cache, like gguf_blocks.py.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import mmap
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from specpilot.kernels import cache_dir
from specpilot.kernels.build import compiled, loads
from specpilot.kernels.cpu.skinny import SkinnyUnavailable, cpu_supports_avx2_fma
from specpilot.kernels.reference.gguf_ref import FORMATS, UnsupportedBlockType, as_raw, row_bytes
from specpilot.kernels.reference.q8_ref import QA, Q8Activations, check_q8_type

SOURCE = Path(__file__).with_name("q8_blocks.c")
ISA_NAMES = ("avx2", "avx512vnni", "amx")
FLAGS = ("-O3", "-mavx2", "-mf16c", "-ffp-contract=off", "-shared", "-fPIC", "-fopenmp")
REPACKED = ("Q4_K", "Q6_K", "Q5_0", "Q8_0")  # the formats with a repacked layout (q8_repack_bytes > 0)
REPACK_LAYOUT = 1  # bump when q8_repack's layout changes: cached copies of another layout are not read

__all__ = ["Q8Matrix", "UnsupportedBlockType", "available", "block_traits", "isa", "library", "linear_tensors",
           "quantize", "read", "repacked", "use_isa"]


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled kernel, building it on first use; SkinnyUnavailable says why it cannot run here."""
    if not cpu_supports_avx2_fma():
        raise SkinnyUnavailable("this CPU has no AVX2+FMA")
    lib = compiled("q8_blocks", (SOURCE,), FLAGS)
    ptr, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.q8_quantize.argtypes = [ptr, n, n, n, ptr, ptr, ptr]
    lib.q8_quantize.restype = None
    lib.q8_matmul.argtypes = [ptr, ptr, ptr, n, n, ptr, ptr, n, n, i, ptr, n, i]
    lib.q8_matmul.restype = i
    lib.q8_linear.argtypes = [ptr, n, n, n, ptr, ptr, n, n, i, ptr, n, i]
    lib.q8_linear.restype = i
    lib.q8_repack_bytes.argtypes = [i, n, n]
    lib.q8_repack_bytes.restype = n
    lib.q8_repack.argtypes = [ptr, n, n, i, ptr, i]
    lib.q8_repack.restype = i
    lib.q8_read.argtypes = [ptr, n]
    lib.q8_read.restype = n
    lib.q8_isa.argtypes = [i]
    lib.q8_isa.restype = i
    lib.q8_traits.argtypes = [i, ctypes.POINTER(n), ctypes.POINTER(n), ctypes.POINTER(ctypes.c_char_p)]
    lib.q8_traits.restype = i
    return lib


def available() -> bool:
    """Whether the kernel builds and loads here."""
    return loads(library)


def block_traits(qtype: int) -> tuple[str, int, int] | None:
    """(name, values per block, bytes per block) of `qtype` as the C kernel's table has it, or None where the
    kernel does not multiply that type (tests hold it against q8_ref.Q8_TYPES and gguf_ref.FORMATS)."""
    block, size, name = ctypes.c_long(), ctypes.c_long(), ctypes.c_char_p()
    if library().q8_traits(qtype, ctypes.byref(block), ctypes.byref(size), ctypes.byref(name)):
        return None
    return name.value.decode(), block.value, size.value


def isa() -> str:
    """The product's instruction set in use: "amx" (AMX int8 tiles for products of 16 rows or more, AVX-512 VNNI
    below, on a CPU with both), "avx512vnni" or "avx2", the best the CPU has unless use_isa chose one below it.
    All give the same bits. A pure query: it changes nothing."""
    return ISA_NAMES[library().q8_isa(-1)]


def use_isa(name: str) -> str:
    """Select the product's instruction set for the process (one of ISA_NAMES; the library holds the choice) and
    return the one now in use: the best the CPU has where it lacks `name`. Why: tests and the kernel bench force
    a path to check or time each; production never calls it (it runs the best one)."""
    code = {"avx2": 0, "avx512vnni": 1, "amx": 2}[name]
    return ISA_NAMES[library().q8_isa(code)]


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features; q8 activations of this product take {k}")
    if k % 32:
        raise ValueError(f"q8 activations need K a multiple of 32, not {k}")
    return x.reshape(-1, k).to(torch.float32).contiguous()


def quantize(x: torch.Tensor) -> Q8Activations:
    """x [M, K] (K a multiple of 32) -> its q8 activations, q8_ref.quantize's bits."""
    rows = _rows(x, x.shape[-1])
    m, k = rows.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, (k + QA - 1) // QA, dtype=torch.float32)
    bsums = torch.empty(m, k // 16, dtype=torch.int32)
    library().q8_quantize(rows.data_ptr(), m, k, k, q.data_ptr(), d.data_ptr(), bsums.data_ptr())
    return Q8Activations(q, d, bsums)


def _source(raw: np.ndarray | torch.Tensor) -> tuple[str, int] | None:
    """(file, byte offset) of blocks that are a view of a file's np.memmap (as gguf-py's tensors are), else None."""
    mm = getattr(raw, "_mmap", None)
    name = getattr(raw, "filename", None)
    if not isinstance(raw, np.memmap) or mm is None or not name or not raw.flags.c_contiguous:
        return None
    start = raw.offset - raw.offset % mmap.ALLOCATIONGRANULARITY  # the file offset the mapping starts at
    return str(name), start + raw.ctypes.data - np.frombuffer(mm, np.uint8).ctypes.data


def _repack_into(raw: torch.Tensor, qtype: int, n: int, k: int, out: np.ndarray | torch.Tensor) -> None:
    dst = out.ctypes.data if isinstance(out, np.ndarray) else out.data_ptr()
    if library().q8_repack(raw.data_ptr(), n, k, qtype, dst, torch.get_num_threads()):
        raise RuntimeError(f"q8_repack refused type {qtype} [{n}, {k}]")


def repacked(raw: torch.Tensor, qtype: int, n: int, k: int, source: tuple[str, int] | None) -> torch.Tensor | None:
    """The repacked layout of blocks raw [n, row_bytes], or None where the format has none: for blocks of a file
    (`source`: path, offset) the shared cached copy, else a private one."""
    size = library().q8_repack_bytes(qtype, n, k)
    if not size:
        return None
    if source is not None:
        return _cached_copy(raw, qtype, n, k, size, *source)
    out = torch.empty(size, dtype=torch.uint8)
    _repack_into(raw, qtype, n, k, out)
    return out


def _cached_copy(raw: torch.Tensor, qtype: int, n: int, k: int, size: int, path: str, offset: int) -> torch.Tensor:
    """The repacked copy for the file's identity (path, size, mtime, inode, offset, shape, layout) in the cache,
    written on first use (each writer to its own temporary file, renamed into place) and mapped read-only."""
    st = os.stat(path)
    key = "|".join(map(str, (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino, offset, qtype, n, k,
                             REPACK_LAYOUT)))
    target = cache_dir() / "q8" / f"{Path(path).stem}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.q8rp"
    if not (target.exists() and target.stat().st_size == size):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".q8rp", dir=target.parent)
        os.close(fd)
        try:
            out = np.memmap(tmp, dtype=np.uint8, mode="w+", shape=(size,))
            _repack_into(raw, qtype, n, k, out)
            out.flush()
            del out
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    with warnings.catch_warnings():  # read-only: nothing here writes to it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.memmap(target, dtype=np.uint8, mode="r", shape=(size,)))


def read(raw: torch.Tensor) -> int:
    """Read every byte of `raw` once (a contiguous uint8 tensor) and nothing else: the floor of a pass."""
    return library().q8_read(raw.data_ptr(), raw.numel())


class Q8Matrix:
    """A weight W [N, K] kept in its GGUF blocks (the caller's buffer, not copied), multiplied in q8 numerics:
    calling it on x [..., K] gives float32 [..., N], q8_ref.matmul's bits."""

    def __init__(self, raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int,
                 threads: int | None = None, repack: bool | None = None) -> None:
        """`repack`: read Q4_K/Q6_K/Q5_0/Q8_0 blocks through their repacked layout (None: where the blocks are a
        file's memmap, through the shared cached copy; True: also from memory, through a private copy; False:
        never). The bits are the same either way. The repacked layout is one stream per 16 weight rows instead
        of 16: on a Zen 4 it took the 0.5B drafter's Q5_0/Q8_0 1-row pass from 43 to 24 ms."""
        self.qtype = check_q8_type(qtype)
        self.name = FORMATS[self.qtype][0]
        self.n, self.k = int(n), int(k)
        if self.k % 32:
            raise ValueError(f"q8 needs K a multiple of 32, not {self.k}")
        self.row_bytes = row_bytes(self.qtype, self.k)
        self.raw = as_raw(raw, self.qtype, self.n, self.k)
        self.threads = threads
        self.lib = library()
        source = _source(raw)
        want = repack if repack is not None else source is not None and self.name in REPACKED
        self.packed = repacked(self.raw, self.qtype, self.n, self.k, source) if want else None

    @property
    def nbytes(self) -> int:
        """Bytes one full product reads (the repacked copy pads each Q6_K superblock of 16 rows by 32)."""
        return sum(v.numel() for v in self.views())

    def views(self) -> list[torch.Tensor]:
        """The bytes one full product reads: the repacked copy and the rows past its last tile of 16, or the
        blocks as stored (for a floor that reads what the product reads)."""
        if self.packed is None:
            return [self.raw.reshape(-1)]
        tail = self.raw[self.n // 16 * 16:].reshape(-1)
        return [self.packed] + ([tail] if tail.numel() else [])

    def _packed_ptr(self) -> int | None:
        return None if self.packed is None else self.packed.data_ptr()

    def _threads(self, threads: int | None) -> int:
        return max(1, threads or self.threads or torch.get_num_threads())

    def quantize(self, x: torch.Tensor) -> Q8Activations:
        """x [..., K] -> q8 activations [M, K] for `product` (and any other matrix with this K)."""
        return quantize(_rows(x, self.k))

    def product(self, xq: Q8Activations, threads: int | None = None) -> torch.Tensor:
        """The q8 product of quantised activations (`quantize`) and W: float32 [M, N]."""
        if xq.k != self.k:
            raise ValueError(f"activations have {xq.k} features; the {self.name} weight [{self.n}, {self.k}] takes "
                             f"{self.k}")
        q, d, bs = xq.q.contiguous(), xq.d.contiguous(), xq.bsums.contiguous()
        m = q.shape[0]
        out = torch.empty(m, self.n, dtype=torch.float32)
        rc = self.lib.q8_matmul(q.data_ptr(), d.data_ptr(), bs.data_ptr(), m, self.k, self.raw.data_ptr(),
                                self._packed_ptr(), self.n, self.row_bytes, self.qtype, out.data_ptr(), self.n,
                                self._threads(threads))
        if rc:
            raise RuntimeError(f"q8_matmul rejected {self.name} [{self.n}, {self.k}] with {m} rows")
        return out

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """x [..., K] (any float dtype) -> float32 [..., N]: quantise, then multiply, in one foreign call.
        `threads` overrides the matrix's (default torch.get_num_threads()); the bits do not depend on it."""
        lead = x.shape[:-1]
        rows = _rows(x, self.k)
        m = rows.shape[0]
        out = torch.empty(m, self.n, dtype=torch.float32)
        rc = self.lib.q8_linear(rows.data_ptr(), m, self.k, self.k, self.raw.data_ptr(), self._packed_ptr(), self.n,
                                self.row_bytes, self.qtype, out.data_ptr(), self.n, self._threads(threads))
        if rc:
            raise RuntimeError(f"q8_linear rejected {self.name} [{self.n}, {self.k}] with {m} rows")
        return out.view(*lead, self.n)


def linear_tensors(path: str, threads: int | None = None) -> list[tuple[str, Q8Matrix]]:
    """Every 2-D weight of a GGUF file except the token embedding, as Q8Matrix over the file's memmap (all but
    Q4_1 through their cached repacked copies); a tied head (no output.weight) uses the embedding, as
    gguf_blocks.linear_tensors does. UnsupportedBlockType names a weight q8 does not multiply."""
    import gguf

    reader = gguf.GGUFReader(path)
    mats, embd = [], None
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        if t.name == "token_embd.weight":
            embd = t
            continue
        check_q8_type(int(t.tensor_type), t.name)
        mats.append((t.name, Q8Matrix(t.data, int(t.tensor_type), n, k, threads)))
    if embd is not None and not any(name == "output.weight" for name, _ in mats):
        check_q8_type(int(embd.tensor_type), embd.name)
        k, n = int(embd.shape[0]), int(embd.shape[1])
        mats.append(("output.weight (tied)", Q8Matrix(embd.data, int(embd.tensor_type), n, k, threads)))
    return mats
