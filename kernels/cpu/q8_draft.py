"""Lossy 8-bit drafter products: build, load and call q8_draft.c, with the plain-PyTorch oracle beside it.

Why: drafting with the 0.5B costs more than verifying with the 1.5B on the real pair (four 54 ms forwards a
step on the GGUF blocks, a third of each in the LM head), and a drafter's products need not be exact: it
only proposes, and the target's verification decides every output token. Int8 weights with activations
quantised to int8 per call (llama.cpp's Q8_0 x Q8_0) read ~1.1 bytes a weight and multiply in integers.
Only a drafter may use this: the target's products stay exact (kernels/cpu/gguf_blocks.py).
`python -m specpilot.kernels.cpu.q8_draft --bench MODEL.gguf` times a checkpoint's linears both ways.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specpilot.kernels.build import compiled, loads
from specpilot.kernels.cpu.skinny import SkinnyUnavailable, cpu_supports_avx2_fma

SOURCE = Path(__file__).with_name("q8_draft.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC", "-fopenmp")
QK = 32
MAX_ROWS = 16  # more rows than this (a prompt) go to the exact product the matrix falls back to

__all__ = ["Q8Matrix", "available", "isa", "quantize", "reference", "use_isa"]


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled kernel, building it on first use; SkinnyUnavailable says why it cannot run here."""
    if not cpu_supports_avx2_fma():
        raise SkinnyUnavailable("this CPU has no AVX2+FMA")
    lib = compiled("q8_draft", (SOURCE,), FLAGS, ("-lm",))
    ptr, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.q8_matmul.argtypes = [ptr, n, ptr, ptr, n, n, ptr, i]
    lib.q8_matmul.restype = i
    lib.q8_quantize.argtypes = [ptr, n, n, ptr, ptr]
    lib.q8_quantize.restype = None
    lib.q4_matmul.argtypes = [ptr, n, ptr, ptr, n, n, ptr, i]
    lib.q4_matmul.restype = i
    lib.q4_quantize.argtypes = [ptr, n, n, ptr, ptr]
    lib.q4_quantize.restype = None
    lib.q8_isa.argtypes = [i]
    lib.q8_isa.restype = i
    return lib


def available() -> bool:
    """Whether the kernel builds and loads here."""
    return loads(library)


_isa: str | None = None  # what use_isa left in use; None: the default, the best the CPU has


@functools.cache
def _best_isa() -> str:
    """The default: "vnni" where the CPU has AVX-512 VNNI and BW, else "avx2". Only asked while nothing was
    chosen: the library's q8_isa(-1) then sets what its first product would set anyway."""
    return "vnni" if library().q8_isa(-1) else "avx2"


def isa() -> str:
    """The integer dot product in use, "vnni" (AVX-512 VNNI) or "avx2". A pure query: it changes nothing (the
    library's q8_isa(-1) would reset a choice to the default, so the choice is kept here)."""
    return _isa or _best_isa()


def use_isa(name: str) -> str:
    """Select the integer dot product for the process ("avx2" or "vnni") and return the one now in use, which is
    "avx2" where "vnni" was asked of a CPU without it. Why: tests and the kernel bench force a path to check or
    time each; production never calls it (it runs the best one)."""
    global _isa
    _isa = "vnni" if library().q8_isa({"avx2": 0, "vnni": 1}[name]) else "avx2"
    return _isa


def _padded(v: torch.Tensor) -> torch.Tensor:
    k = v.shape[-1]
    return v if k % QK == 0 else F.pad(v, (0, QK - k % QK))


def quantize(weight: torch.Tensor, bits: int = 8) -> dict[str, torch.Tensor]:
    """W [N, K] in blocks of 32 along K (K zero-padded to a multiple of 32). bits 8: q int8 [N, K'] and d
    float32 [N, K'/32], w = d * q. bits 4 (Q4_0): q uint8 [N, K'/2] (a block's weights 0-15 in the low nibbles
    of its 16 bytes, 16-31 in the high ones) and d float16 [N, K'/32], w = d * (q - 8)."""
    if bits not in (4, 8):
        raise ValueError(f"drafter weights are 4 or 8 bits, not {bits}")
    w = _padded(weight.detach().float()).contiguous()
    n, k = w.shape
    if bits == 8:
        q, d = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // QK, dtype=torch.float32)
        library().q8_quantize(w.data_ptr(), n, k, q.data_ptr(), d.data_ptr())
        return {"q": q, "d": d}
    q, d = torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, k // QK, dtype=torch.float16)
    library().q4_quantize(w.data_ptr(), n, k, q.data_ptr(), d.data_ptr())
    return {"q": q, "d": d, "bits": torch.tensor(4)}


def weights_of(packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weights [N, K'] a quantised matrix stands for (the values its products use)."""
    if "bits" not in packed:
        return (packed["q"].float().view(packed["q"].shape[0], -1, QK) * packed["d"][..., None]).flatten(1)
    return (_nibbles(packed["q"]).float() * packed["d"].float()[..., None]).flatten(1)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit blocks [N, K'/2] -> signed values q - 8, [N, K'/32, 32] int64."""
    q = q.view(q.shape[0], -1, QK // 2).to(torch.int64)
    return torch.cat([q & 15, q >> 4], dim=-1) - 8


def reference(x: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The kernel's semantics in plain PyTorch (the test oracle): x [M, K'] quantised per 32-block to int8
    by max|x| / 127 with round-half-even, exact integer block dots with the integer weights, each scaled by
    both blocks' scales."""
    xf = _padded(x.float())
    xb = xf.view(x.shape[0], -1, QK)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = (xb * inv[..., None]).round().clamp(-127, 127).to(torch.int64)
    xd = (amax / 127.0).double()
    wq = _nibbles(packed["q"]) if "bits" in packed else packed["q"].view(packed["q"].shape[0], -1, QK).to(torch.int64)
    dots = torch.einsum("mbi,nbi->mnb", xq, wq).double() * (xd[:, None, :] * packed["d"].double()[None])
    return dots.sum(-1).float()


class Q8Matrix:
    """A drafter's weight W [N, K] (+ bias) in 8- or 4-bit blocks; x [..., K] -> approximately x @ W.T + bias.
    More than MAX_ROWS rows (the drafter's prompt prefill) go to `wide`, the projection it replaces, whose
    cost per row is lower there and whose products are exact."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 wide: Callable[[torch.Tensor], torch.Tensor] | None = None, threads: int | None = None,
                 bits: int = 8, packed: dict[str, torch.Tensor] | None = None) -> None:
        self.n, self.k = int(weight.shape[0]), int(weight.shape[1])
        self.bits = bits
        self.packed = packed if packed is not None else quantize(weight, bits)  # given: shared with another copy
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.wide = wide
        self.threads = threads
        self.lib = library()

    @property
    def nbytes(self) -> int:
        """Bytes one full product reads: the quantised values and their scales."""
        return self.packed["q"].numel() * self.packed["q"].element_size() + self.packed["d"].numel() * \
            self.packed["d"].element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.k:
            raise ValueError(f"x has {x.shape[-1]} features; the q{self.bits} weight [{self.n}, {self.k}] takes "
                             f"{self.k}")
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.k)
        if rows.shape[0] > MAX_ROWS and self.wide is not None:
            return self.wide(x)
        rows = _padded(rows.float()).contiguous()
        out = torch.empty(rows.shape[0], self.n, dtype=torch.float32)
        threads = max(1, self.threads or torch.get_num_threads())
        p, kp = self.packed, rows.shape[1]
        if self.bits == 8:
            rc = self.lib.q8_matmul(rows.data_ptr(), rows.shape[0], p["q"].data_ptr(), p["d"].data_ptr(), self.n,
                                    kp, out.data_ptr(), threads)
        else:
            rc = self.lib.q4_matmul(rows.data_ptr(), rows.shape[0], p["q"].data_ptr(), p["d"].data_ptr(), self.n,
                                    kp, out.data_ptr(), threads)
        if rc:
            raise RuntimeError(f"q{self.bits} matmul rejected [{self.n}, {self.k}] with {rows.shape[0]} rows "
                               f"(code {rc})")
        if self.bias is not None:
            out += self.bias
        return out.view(*lead, self.n).to(x.dtype)


def bench_model(path: str, rows: list[int], repeats: int = 5, threads: int = 1) -> list[dict]:
    """Process CPU ms of one product per linear of a GGUF checkpoint: its blocks (exact) against q8."""
    from specpilot.kernels.cpu.gguf_blocks import linear_tensors

    mats = linear_tensors(path)
    q8 = [Q8Matrix(m.dequantize(), threads=threads) for _, m in mats]
    q4 = [Q8Matrix(m.dequantize(), threads=threads, bits=4) for _, m in mats]
    out = []
    for m in rows:
        times = {}
        for name, kind in (("gguf", [g for _, g in mats]), ("q8", q8), ("q4", q4)):
            xs = [torch.randn(m, g.k) for g in kind]
            best = float("inf")
            for _ in range(repeats):
                t = time.process_time()
                for g, x in zip(kind, xs):
                    g(x, threads) if name == "gguf" else g(x)
                best = min(best, time.process_time() - t)
            times[name] = 1e3 * best
        out.append({"rows": m, **times, "q8_bytes": sum(g.nbytes for g in q8),
                    "q4_bytes": sum(g.nbytes for g in q4), "gguf_bytes": sum(g.nbytes for _, g in mats)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specpilot.kernels.cpu.q8_draft", description=__doc__.splitlines()[0])
    ap.add_argument("--bench", metavar="MODEL.gguf", required=True)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"isa {isa()}, {args.threads} thread(s), best of 5, process CPU ms for all linears")
    for r in bench_model(args.bench, [int(v) for v in args.rows.split(",")], threads=args.threads):
        print(f"rows {r['rows']:3d}  gguf {r['gguf']:8.1f}  q8 {r['q8']:8.1f}  q4 {r['q4']:8.1f}  (GB: gguf "
              f"{r['gguf_bytes'] / 1e9:.2f}, q8 {r['q8_bytes'] / 1e9:.2f}, q4 {r['q4_bytes'] / 1e9:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
