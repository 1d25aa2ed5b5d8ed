"""GPU check for packed12: correctness of the fused kernel and its speed against torch's bf16 matmul.

Why this shape of benchmark: decode is memory-bound, so the question is whether reading 12 bits per weight
instead of 16 makes the matmul faster at the verification widths (1..64 rows). Each timing therefore
rotates among enough copies of the weight to exceed the L2 cache several times (otherwise it measures
the cache), replays a CUDA graph of many calls (so host launch overhead stays out, as it would in a
graph-captured decode loop), and takes the median over replays. Achieved bytes/s is compared with a
measured device-to-device copy (bytes read + written).

Run on a CUDA machine: `bash scripts/gpu_check.sh` (or `python -m specpilot.kernels.bench.gpu`). `--smoke` runs the
same flow on tiny shapes on the CPU under TRITON_INTERPRET=1 with a wall-clock timer, to check the script
itself where there is no GPU.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch
import torch.nn.functional as F

from specpilot.kernels.gpu.packed12 import Packed12, matmul_reference, pack

LLAMA8B_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]
ROWS = [1, 8, 32, 64]
SMOKE_SHAPES = [(48, 96)]
SMOKE_ROWS = [1, 3]


@dataclass
class Row:
    shape: tuple[int, int]
    rows: int
    bf16_us: float
    packed_us: float
    packed_bytes: int
    bf16_bytes: int
    config: str


class Timer:
    """Median microseconds per call of fn(i) rotating i over `copies` weight copies."""

    def __init__(self, device: torch.device, inner: int, outer: int) -> None:
        self.device = device
        self.inner = inner
        self.outer = outer
        self.warned = False

    def __call__(self, fn: Callable[[int], object], copies: int) -> float:
        calls = max(self.inner, copies)
        for i in range(copies):
            fn(i)
        if self.device.type != "cuda":
            times = []
            for _ in range(self.outer):
                t0 = time.perf_counter()
                for i in range(calls):
                    fn(i % copies)
                times.append((time.perf_counter() - t0) / calls * 1e6)
            return statistics.median(times)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(copies):
                fn(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for i in range(calls):
                    fn(i % copies)
            run = graph.replay
        except RuntimeError as e:
            if not self.warned:
                print(f"  CUDA graph capture failed ({str(e).splitlines()[0][:100]}); timing eagerly")
                self.warned = True

            def run() -> None:
                for i in range(calls):
                    fn(i % copies)
        run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.outer):
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * a.numel() * a.element_size() / statistics.median(times)


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in float64; NaN anywhere (or a NaN mismatch) counts as failure (inf)."""
    y64, r64 = y.double(), ref.double()
    if torch.isnan(y64).any() or torch.isnan(r64).any():
        return float("inf")
    return ((y64 - r64).norm() / r64.norm().clamp_min(1e-30)).item()


def make_weight(n: int, k: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """N(0, 0.02) bf16 weights plus ~0.01% planted large outliers, so the escape path carries real mass."""
    w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    idx = torch.randint(0, n * k, (max(8, n * k // 10000),), generator=gen, device=device)
    w.view(-1)[idx] = torch.randn(idx.numel(), generator=gen, device=device).mul(64).to(torch.bfloat16)
    return w


def check(launch: Callable[..., torch.Tensor], p: Packed12, rows: int, dtype: torch.dtype, bias: bool,
          device: torch.device, gen: torch.Generator, config: Any = None) -> float:
    """Relative error of the kernel against matmul_reference on fresh inputs, output poisoned first."""
    n, k = p.shape
    x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype) if bias else None
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=device)
    launch(x, p, b, config, out)
    return rel_error(out, matmul_reference(x, p, b))


def autotune(kt: ModuleType, x: torch.Tensor, packs: list[Packed12], timer: Timer,
             candidates: list[Any]) -> tuple[Any, float]:
    """Time each candidate config (compile failures skipped); return the fastest and its time."""
    best, best_t = None, math.inf
    for cfg in candidates:
        try:
            t = timer(lambda i, c=cfg: kt.launch(x, packs[i], None, c), len(packs))
        except Exception as e:  # a config the compiler rejects (resources) is simply not a candidate
            print(f"  skip {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            continue
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError("no packed12 kernel config compiled")
    return best, best_t


def cfg_str(cfg: Any) -> str:
    return f"n{cfg.block_n}/k{cfg.block_k}/w{cfg.num_warps}/s{cfg.split_k}"


def main(argv: list[str] | None = None) -> int:
    """Run the checks and timings; exit status 1 on any correctness failure."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (needs TRITON_INTERPRET=1)")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="after this many seconds, stop autotuning and time the default config only")
    args = ap.parse_args(argv)
    t_start = time.monotonic()

    if args.smoke:
        device = torch.device("cpu")
        shapes, rows_list, timer, tune_timer = SMOKE_SHAPES, SMOKE_ROWS, Timer(device, 2, 1), Timer(device, 1, 1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: skipping packed12 GPU check")
            return 0
        device = torch.device("cuda")
        shapes, rows_list = LLAMA8B_SHAPES, ROWS
        timer, tune_timer = Timer(device, inner=64, outer=25), Timer(device, inner=32, outer=7)
    import specpilot.kernels.gpu.packed12_triton as kt

    if args.smoke and not kt.INTERPRETING:
        print("--smoke needs TRITON_INTERPRET=1 set before the run")
        return 2
    gen = torch.Generator(device=device).manual_seed(0)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 64 << 20)
        print(f"device: {props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB, "
              f"torch {torch.__version__}, triton {kt.triton.__version__}", flush=True)
        bw = copy_bandwidth(device)
        print(f"copy bandwidth (read+write): {bw / 1e9:.0f} GB/s", flush=True)
    else:
        l2, bw = 1 << 12, float("nan")

    failures: list[str] = []
    tol = {torch.bfloat16: 1e-2, torch.float32: 1e-5}

    odd_n, odd_k = (40, 37) if args.smoke else (1000, 999)
    odd = pack(make_weight(odd_n, odd_k, device, gen))
    for rows, dtype, bias in [(3, torch.bfloat16, True), (5, torch.float32, False), (1, torch.bfloat16, False)]:
        err = check(kt.launch, odd, rows, dtype, bias, device, gen)
        if not err <= tol[dtype]:
            failures.append(f"odd K ({odd_n}x{odd_k}) rows={rows} {dtype} bias={bias}: rel err {err:.2e}")
    print(f"odd-K / fp32 / bias checks done ({len(failures)} failures)", flush=True)

    results: list[Row] = []
    for n, k in shapes:
        w = make_weight(n, k, device, gen)
        p = pack(w)
        print(f"[{n}x{k}] escape rate {p.escape_rate:.2e}, {p.bytes_per_weight:.4f} bytes/weight", flush=True)
        copies = max(2, math.ceil(4 * l2 / (2 * n * k)))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        ps = [p] + [p.clone() for _ in range(copies - 1)]
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16)
            if rows <= 16:
                cands = kt.candidate_configs(n, k, rows, device)
            else:
                base = kt.default_config(n, k, rows, device)
                cands = [base] + [c for c in kt.candidate_configs(n, k, rows, device)
                                  if c.block_k == 128 and c.block_n in (32, 128) and c != base]
            if args.smoke:
                cands = cands[:2]
            if time.monotonic() - t_start > args.budget_s:
                cands = [kt.default_config(n, k, rows, device)]
            cfg, _ = autotune(kt, x, ps, tune_timer, cands)
            kt.set_tuned(n, k, rows, x.dtype, cfg)
            first = (n, k) == shapes[0] and rows == rows_list[0]
            for dtype in (torch.bfloat16, torch.float32) if first else (torch.bfloat16,):
                err = check(kt.launch, p, rows, dtype, rows == 1, device, gen, cfg)
                if not err <= tol[dtype]:
                    failures.append(f"{n}x{k} rows={rows} {dtype} cfg={cfg_str(cfg)}: rel err {err:.2e}")
            t_bf16 = timer(lambda i: F.linear(x, ws[i]), copies)
            t_p12 = timer(lambda i: kt.launch(x, ps[i], None, cfg), copies)
            io = x.numel() * x.element_size() + rows * n * 2
            results.append(Row((n, k), rows, t_bf16, t_p12, p.nbytes + p.index_nbytes + io, 2 * n * k + io,
                               cfg_str(cfg)))
            print(f"  rows {rows:2d}: bf16 {t_bf16:8.2f} us  packed12 {t_p12:8.2f} us  ({cfg_str(cfg)})",
                  flush=True)

    print()
    if failures:
        print("CORRECTNESS FAILURES:")
        for f in failures:
            print("  " + f)
    else:
        print("correctness: all checks passed (kernel vs matmul_reference, fresh inputs, poisoned outputs)")
    print(f"total {time.monotonic() - t_start:.0f} s; copy bandwidth {bw / 1e9:.0f} GB/s; times are medians "
          f"per call over CUDA-graph replays, rotating weight copies past L2")
    print(f"{'shape (NxK)':>12} {'rows':>4} {'bf16 us':>9} {'packed12 us':>11} {'speedup':>7} "
          f"{'p12 GB/s':>8} {'%copy':>5} {'bf16 GB/s':>9}  config")
    for r in results:
        gbs = r.packed_bytes / (r.packed_us * 1e-6) / 1e9
        bgbs = r.bf16_bytes / (r.bf16_us * 1e-6) / 1e9
        print(f"{r.shape[0]:>6}x{r.shape[1]:<5} {r.rows:>4} {r.bf16_us:>9.2f} {r.packed_us:>11.2f} "
              f"{r.bf16_us / r.packed_us:>6.2f}x {gbs:>8.0f} {100 * gbs * 1e9 / bw:>4.0f}% {bgbs:>9.0f}  {r.config}")
    small = [r.bf16_us / r.packed_us for r in results if r.rows <= 8]
    if small:
        gm = math.exp(sum(map(math.log, small)) / len(small))
        print(f"geomean speedup at rows <= 8: {gm:.3f}x (target >= 1.2x, ceiling ~1.33x)")
    return 1 if failures else 0

if __name__ == "__main__":
    sys.exit(main())
