"""GGUF block formats in plain PyTorch: the reference the C and Triton kernels are tested against.

Each dequantisation mirrors gguf-py's `gguf.quants` operation by operation in float32 (a scale times a quant,
then plus or minus a min, is two roundings, never a fused multiply-add), so its values are bit-identical to
`gguf.quants.dequantize`; gguf itself is not imported, so this module works without it.
Raw weights are uint8 [N, row_bytes]: N output rows, each K / block_size blocks stored back to back
(GGUF order: K is the contiguous dim, shape[0] of the GGUF tensor).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

QK_K = 256

# GGML type id -> (name, values per block, bytes per block).
FORMATS: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", QK_K, 144),
    14: ("Q6_K", QK_K, 210),
}
SUPPORTED = ", ".join(name for name, _, _ in FORMATS.values())


class UnsupportedBlockType(ValueError):
    """A GGML block type these kernels do not decode."""


def qtype_id(qtype: int | str) -> int:
    """The GGML type id of `qtype` (an id, a `gguf.GGMLQuantizationType`, or a name such as "Q4_K")."""
    if isinstance(qtype, str):
        for i, (name, _, _) in FORMATS.items():
            if name == qtype.upper():
                return i
        raise UnsupportedBlockType(f"unsupported GGUF block type {qtype!r}; supported: {SUPPORTED}")
    i = int(qtype)
    if i not in FORMATS:
        label = getattr(qtype, "name", str(i))
        raise UnsupportedBlockType(f"unsupported GGUF block type {label}; supported: {SUPPORTED}")
    return i


def row_bytes(qtype: int | str, k: int) -> int:
    """Bytes of one stored row of K values; K must be a whole number of blocks."""
    name, block, size = FORMATS[qtype_id(qtype)]
    if k % block:
        raise ValueError(f"K = {k} is not a multiple of the {name} block size {block}")
    return k // block * size


def as_raw(raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int) -> torch.Tensor:
    """`raw` as a uint8 tensor [N, row_bytes] sharing its memory (a read-only memmap is not copied)."""
    rb = row_bytes(qtype, k)
    if isinstance(raw, torch.Tensor):
        t = raw.view(torch.uint8) if raw.dtype != torch.uint8 else raw
    else:
        a = np.ascontiguousarray(raw).view(np.uint8)
        with warnings.catch_warnings():  # read-only memmapped weights: nothing here writes to them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(a)
    if t.numel() != n * rb:
        raise ValueError(f"{t.numel()} raw bytes, expected {n} x {rb} for {FORMATS[qtype_id(qtype)][0]} [{n}, {k}]")
    return t.reshape(n, rb)


def f16_values(b: torch.Tensor) -> torch.Tensor:
    """Two bytes (last dim) as float16 widened to float32 (exact)."""
    return b.contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., L] -> [..., 2L]: all low nibbles, then all high nibbles (gguf's order)."""
    q = qs.long()
    return torch.cat([q & 15, q >> 4], dim=-1)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = f16_values(b[:, 0:2]), f16_values(b[:, 2:4])
    q = nibbles(b[:, 4:20]).float()
    return d * q + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = f16_values(b[:, 0:2])
    qh = b[:, 2:6].long()
    qh = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24
    hi = (qh[:, None] >> torch.arange(32, device=b.device)) & 1
    q = (nibbles(b[:, 6:22]) | hi << 4) - 16
    return d * q.float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = f16_values(b[:, 0:2])
    return b[:, 2:34].contiguous().view(torch.int8).float() * d


def q4_k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed scale bytes of Q4_K blocks -> (6-bit scales, 6-bit mins), each [blocks, 8]."""
    s = s.long()
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = f16_values(b[:, 0:2]), f16_values(b[:, 2:4])
    sc, mn = q4_k_scales(b[:, 4:16])
    ds = (d * sc.float())[:, :, None]
    dm = (dmin * mn.float())[:, :, None]
    q = nibbles(b[:, 16:144].reshape(nb, 4, 32)).reshape(nb, 8, 32).float()
    return (ds * q - dm).reshape(nb, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql = nibbles(b[:, 0:128].reshape(nb, 2, 64)).reshape(nb, 2, 4, 32)
    qh = b[:, 128:192].long().reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], device=b.device).reshape(1, 1, 4, 1)
    q = ((ql | (qh & 3) << 4) - 32).reshape(nb, 16, 16).float()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = f16_values(b[:, 208:210])
    return ((d * scales)[:, :, None] * q).reshape(nb, QK_K)


_DEQUANT = {3: _q4_1, 6: _q5_0, 8: _q8_0, 12: _q4_k, 14: _q6_k}


def dequantize(raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int) -> torch.Tensor:
    """float32 [N, K] of the stored blocks, bit-identical to `gguf.quants.dequantize`."""
    t = qtype_id(qtype)
    r = as_raw(raw, t, n, k)
    if t == 0:
        return r.contiguous().view(torch.float32).reshape(n, k).clone()
    if t == 1:
        return r.contiguous().view(torch.float16).reshape(n, k).float()
    _, block, size = FORMATS[t]
    return _DEQUANT[t](r.reshape(-1, size)).reshape(n, k)


def matmul(x: torch.Tensor, raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int) -> torch.Tensor:
    """x [M, K] float32 @ W.T with W the dequantised [N, K]: the plain float32 product the kernels approximate
    to float32 rounding."""
    return x.float() @ dequantize(raw, qtype, n, k).T


def random_blocks(qtype: int | str, n: int, k: int, gen: np.random.Generator,
                  scales: np.ndarray | None = None) -> np.ndarray:
    """Random raw blocks uint8 [N, row_bytes] whose float16 fields are finite (random normal, or `scales`
    cycled over every f16 field): for tests and benchmarks of types gguf-py cannot quantise to."""
    t = qtype_id(qtype)
    name, block, size = FORMATS[t]
    if t == 0:
        return gen.standard_normal((n, k)).astype(np.float32).view(np.uint8)
    if t == 1:
        return gen.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    nb = n * (k // block)
    raw = gen.integers(0, 256, (nb, size), dtype=np.uint8)
    fields = {3: (0, 2), 6: (0,), 8: (0,), 12: (0, 2), 14: (208,)}[t]
    for i, off in enumerate(fields):
        if scales is None:
            v = gen.standard_normal(nb).astype(np.float16)
        else:
            v = np.resize(np.roll(np.asarray(scales, dtype=np.float16), i), nb)
        raw[:, off:off + 2] = v.view(np.uint8).reshape(nb, 2)
    return raw.reshape(n, -1)
