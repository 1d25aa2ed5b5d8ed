"""Batch-invariant attention for q8 numerics: build, load and call attention.c.

Why: speculative decoding under q8 numerics must give the bits plain decoding gives, so a query row's
attention must not depend on which call it is part of (a 1-token step, a verify chain or tree, a batched
serve step with other cache lengths, a prompt) nor on the thread count; SDPA's blocking depends on all of
those. `attend` computes each row over the compacted list of the slots it sees, in a fixed float order
written down in kernels/reference/attention_ref.py (the plain-PyTorch oracle it equals bit for bit).

Wiring into Transformer.forward (in place of F.scaled_dot_product_attention):

    visible = visible_from_mask(step.mask)        # once per step: None, or bool [B, T, span]
    attn = attend(q, keys, values, visible)       # q [B, H, T, D]; keys/values the cache's [:, :, :span]

k and v may be strided slices of the cache (only the last dim must be contiguous: no copy); q may be the
transposed view of the fused projection. The result is a [B, H, T, D] view of a [B, T, H, D] buffer, so
`attn.transpose(1, 2).reshape(B, T, H * D)` is free. Builds: -mavx512f where the CPU has AVX-512F, else
-mavx2; both give the same bits (16-lane vectors either way).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from specpilot.kernels.build import KernelUnavailable, compiled, loads
from specpilot.kernels.reference import attention_ref

SOURCE = Path(__file__).with_name("attention.c")
FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-fopenmp")
ISA_FLAGS = {"avx512": ("-mavx512f", "-mavx2"), "avx2": ("-mavx2",)}
LANES = attention_ref.LANES

__all__ = ["attend", "available", "exp2", "isa", "library", "silu_mul", "use_isa", "visible_from_mask"]


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        cap = torch.backends.cpu.get_cpu_capability()
        return {"AVX2": {"avx2"}, "AVX512": {"avx2", "avx512f"}}.get(cap, set())


def supported_isas() -> tuple[str, ...]:
    """The builds this CPU runs, best first."""
    flags = _cpu_flags()
    return tuple(name for name, need in (("avx512", "avx512f"), ("avx2", "avx2")) if need in flags)


@functools.lru_cache(maxsize=None)
def library(isa_name: str | None = None) -> ctypes.CDLL:
    """The kernel built for `isa_name` ("avx512" or "avx2"; default the best this CPU runs), built on first
    use; KernelUnavailable says why it cannot run here."""
    runs = supported_isas()
    name = isa_name or (runs[0] if runs else "avx2")
    if name not in ISA_FLAGS:
        raise ValueError(f"unknown instruction set {name!r}; have {', '.join(ISA_FLAGS)}")
    if name not in runs:
        raise KernelUnavailable(f"this CPU has no {name.upper()}")
    lib = compiled(f"attention-{name}", (SOURCE,), FLAGS + ISA_FLAGS[name], ("-lm",))
    ptr, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.attn_forward.argtypes = [ptr, n, n, n, ptr, n, n, n, ptr, n, n, n, ptr, n, n, ptr, n, n, n,
                                 n, n, n, n, n, n, ctypes.c_float, i]
    lib.attn_forward.restype = i
    lib.attn_exp2.argtypes = [ptr, ptr, n]
    lib.attn_exp2.restype = None
    lib.attn_silu_mul.argtypes = [ptr, n, ptr, n, ptr, n, n, n, i]
    lib.attn_silu_mul.restype = None
    lib.attn_isa.argtypes = []
    lib.attn_isa.restype = i
    return lib


def available() -> bool:
    """Whether the kernel builds and loads here."""
    return loads(library)


_isa: str | None = None  # the build use_isa chose; None: the default build's


@functools.cache
def _default_isa() -> str:
    """The instruction set of the default build (library()), asked of it once."""
    return "avx512" if library().attn_isa() else "avx2"


def isa() -> str:
    """The build `attend` uses, "avx512" or "avx2" (same bits either way). A pure query: it changes nothing."""
    return _isa or _default_isa()


def use_isa(name: str) -> str:
    """Select the build `attend` uses for the process ("avx512" or "avx2"; KernelUnavailable where this CPU cannot
    run it) and return the one now in use. Why: tests and the kernel bench force a path to check or time each;
    production never calls it (it runs the best build this CPU has)."""
    global _isa
    library(name)  # refuses one this CPU cannot run
    _isa = name
    return _isa


def exp2(x: torch.Tensor) -> torch.Tensor:
    """The kernel's exp2 elementwise (x <= 0; see attention_ref.exp2, which it equals bit for bit)."""
    src = x.detach().float().contiguous()
    out = torch.empty_like(src)
    library(isa()).attn_exp2(src.data_ptr(), out.data_ptr(), src.numel())
    return out


def visible_from_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The model's additive mask [B, 1, T, S] (0 = attend, the dtype's min = blocked; StepInputs.mask) as the
    bool [B, T, S] `attend` takes; None stays None (every slot visible). Other values are refused: a bias
    other than 0 or blocked is not a visibility. Compute it once per step, not per layer."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"expected an additive mask [B, 1, T, S], got {tuple(mask.shape)}")
    visible = mask[:, 0] == 0
    if not (visible | (mask[:, 0] == torch.finfo(mask.dtype).min)).all():
        raise ValueError("the mask holds values other than 0 and the dtype's min; attend takes visibility only")
    return visible


def _rows(x: torch.Tensor) -> torch.Tensor:
    """float32 with a contiguous last dim (a view when it already is)."""
    if x.dtype != torch.float32:
        x = x.float()
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
           scale: float | None = None, threads: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over each row's visible slots, the same bits however rows are grouped.

    q [B, H, T, D]; k, v [B, Hkv, S, D] (strided slices of a cache are fine: the last dim must be contiguous,
    else it is copied); head h reads kv head h // (H // Hkv). visible: bool [B, T, S] (or [1, T, S]),
    True where query t of row b sees slot s; None: every slot < S is visible to every query. scale defaults
    to 1/sqrt(D). threads: OpenMP threads over (row, query, kv head) items (default torch.get_num_threads());
    the bits do not depend on it. Returns float32 [B, H, T, D], a view of a [B, T, H, D] buffer; a query that
    sees no slot gets NaN. Other dtypes are converted to float32 first (a copy).
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B, H, T, D] and k, v [B, Hkv, S, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if Bk != B or Dk != D or Hkv == 0 or H % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit k/v {tuple(k.shape)} (same B and D; H a multiple of "
                         f"Hkv)")
    cs = attention_ref.softmax_constant(scale, D)
    q, k, v = _rows(q), _rows(k), _rows(v)
    pad = -D % LANES
    if pad:  # zero lanes leave the dots unchanged; rare (head sizes are multiples of 16 in practice)
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    Dp = D + pad
    vis_ptr, visb, vist = None, 0, 0
    if visible is not None:
        if visible.dim() != 3 or visible.shape[0] not in (1, B) or visible.shape[1:] != (T, S):
            raise ValueError(f"visible must be bool [B, T, S] = [{B}, {T}, {S}], got {tuple(visible.shape)}")
        if visible.dtype != torch.bool:
            visible = visible != 0
        if visible.stride(-1) != 1 and S > 1:
            visible = visible.contiguous()
        vis_ptr, visb, vist = visible.data_ptr(), (visible.stride(0) if visible.shape[0] > 1 else 0), visible.stride(1)
    buf = torch.empty(B, T, H, Dp, dtype=torch.float32)
    out = buf.transpose(1, 2)
    if out.numel():
        rc = library(isa()).attn_forward(
            q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
            v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), vis_ptr, visb, vist,
            out.data_ptr(), out.stride(0), out.stride(1), out.stride(2), B, H, Hkv, T, S, Dp, cs,
            max(1, threads or torch.get_num_threads()))
        if rc:
            raise RuntimeError(f"attn_forward failed ({'out of memory' if rc == -2 else 'bad arguments'})")
    return out[..., :D] if pad else out


def _matrix(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as float32 rows [M, N] with a contiguous last dim: a view where strides allow (the halves of
    a fused gate/up output do)."""
    x = _rows(x)
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def silu_mul(gate: torch.Tensor, up: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """silu(gate) * up -> float32, every value by one fixed arithmetic (attention_ref.silu_mul, which it equals
    bit for bit), so a value's bits do not depend on the call's shape or threads; F.silu's do where a row's
    width is not a multiple of 32 (its scalar tail rounds differently from its vector body). gate and up
    [..., N] of one shape; the halves of `gate_up(x).chunk(2, -1)` are taken as views (no copy)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    g, u = _matrix(gate), _matrix(up)
    out = torch.empty(g.shape, dtype=torch.float32)
    if out.numel():
        library(isa()).attn_silu_mul(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(),
                                     out.stride(0), g.shape[0], g.shape[1], max(1, threads or torch.get_num_threads()))
    return out.view(gate.shape)


def _bench(threads: int) -> None:
    """attend against F.scaled_dot_product_attention at the 1.5B's attention (12 q heads, 2 kv heads, D 128)
    with the model's masks (none for a 1-token step, a chain's for T = 5, causal for a prompt)."""
    import time

    torch.set_num_threads(threads)
    heads, kv_heads, dim = 12, 2, 128

    def best_ms(fn, reps: int) -> float:
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) / reps)
        return min(times) * 1e3

    print(f"{threads} thread(s), build {isa()}; ms per call (best of 5)")
    for T, S in [(1, 600), (1, 2000), (5, 600), (5, 2000), (300, 300), (300, 2000)]:
        ck, cv = (torch.randn(1, kv_heads, 4096, dim) for _ in range(2))
        k, v = ck[:, :, :S], cv[:, :, :S]
        q = torch.randn(1, T, heads, dim).transpose(1, 2)
        mask = visible = None
        if T > 1:
            allowed = torch.ones(T, S, dtype=torch.bool)
            allowed[:, S - T:] = torch.tril(torch.ones(T, T, dtype=torch.bool))
            mask = torch.zeros(1, 1, T, S).masked_fill_(~allowed, torch.finfo(torch.float32).min)
            visible = visible_from_mask(mask)
        reps = max(3, 120_000 // (T * S))
        sdpa = best_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), reps)
        ours = best_ms(lambda: attend(q, k, v, visible, threads=threads), reps)
        print(f"T={T:4d} S={S:5d}  sdpa {sdpa:8.3f}  attend {ours:8.3f}  ({ours / sdpa:.2f}x)")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bench", action="store_true", help="time attend against SDPA")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.bench:
        _bench(args.threads or torch.get_num_threads())
