"""The GGUF block kernel by input rows on the CPU: `python -m specpilot.kernels.gguf_blocks --bench MODEL.gguf`.

One pass is one product with M input rows through every linear of a checkpoint (kernels/cpu/gguf_blocks.py),
against float32 F.linear on dequantised copies. `floor_ms` is the blocks' bytes over a copy bandwidth measured
in the same run (what streaming them once costs here). `--parts` times the AVX-512 path's work one part at a
time (reading the blocks, dequantising them, the FMAs alone from L1) to show where a pass's time goes.
`--json` prints {"isa", "threads", "rows": {M: ms}, "floor_ms", ...} for scripts.

`--numerics q8` times the q8 product instead (kernels/cpu/q8_blocks.py: 8-bit activations, integer dot
products, Q4_K/Q6_K through their cached repacked copies), each pass quantising every linear's input as a
forward would. Its `floor_ms` is a read of the same bytes in the same run (a C loop over every 64-byte line of
what the products read, the repacked copies included), not a copy; its `rows` are the best of the repeats
(the machine is shared), the medians in `detail`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from specpilot.kernels.cpu import q8_blocks
from specpilot.kernels.cpu.gguf_blocks import GGUFMatrix, isa, linear_tensors
from specpilot.kernels.cpu.skinny import SkinnyUnavailable
from specpilot.kernels.reference.gguf_ref import UnsupportedBlockType

PARTS = {"read": 1, "dequant": 2, "fma": 3}  # gguf_blocks.c's PART_READ, PART_DEQUANT, PART_FMA
COPY_BYTES = 1 << 29  # a buffer far past the last-level cache


def copy_gb_s(threads: int, repeats: int = 5) -> float:
    """Best-of-`repeats` GB/s of torch copying a 512 MB buffer on `threads` threads (bytes copied per second)."""
    torch.set_num_threads(threads)
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return COPY_BYTES / best / 1e9


def _part_fn(m: GGUFMatrix, part: int):
    """A pass of only `part` of the kernel's work over matrix m (its output is meaningless)."""
    def run(x: torch.Tensor) -> None:
        out = torch.empty(x.shape[0], m.n)
        rc = m.lib.gguf_matmul_part(x.data_ptr(), x.shape[0], m.k, m.raw.data_ptr(), m.n, m.k, m.row_bytes, m.qtype,
                                    out.data_ptr(), m.n, m.threads, part)
        if rc:
            raise SkinnyUnavailable(f"gguf_matmul_part {part} needs the AVX-512 path ({m.name} [{m.n}, {m.k}])")
    return run


def bench_model(path: str, rows: list[int], repeats: int = 3, threads: int | None = None, fp32: bool = True,
                parts: bool = False, mats: list[tuple[str, GGUFMatrix]] | None = None) -> dict[int, dict[str, float]]:
    """ms of one pass over every linear of a GGUF checkpoint with `rows` input rows: this kernel ("gguf"),
    (fp32) torch F.linear on float32 copies and (parts) each part of the kernel's work alone, median of
    `repeats`; "<name> cpu" is the process CPU time of the pass divided by the threads (on a shared machine
    wall time includes waiting). Every repeat times every row count and system in turn, so a slow spell of
    the machine falls on all of them: "gguf vs 1 row" is the median over repeats of each pass against that
    repeat's 1-row pass. `mats`: the file's linear_tensors, when the caller has them already."""
    mats = mats if mats is not None else linear_tensors(path)
    t = threads or torch.get_num_threads()
    torch.set_num_threads(t)
    for _, m in mats:
        m.threads = t
    systems: dict[str, list] = {"gguf": [m for _, m in mats]}
    if fp32:
        systems["fp32"] = [lambda x, w=m.dequantize(): F.linear(x, w) for _, m in mats]
    if parts:
        systems.update({name: [_part_fn(m, code) for _, m in mats] for name, code in PARTS.items()})
    order = [1] + [r for r in rows if r != 1]
    xs = {m_rows: [torch.randn(m_rows, m.k) for _, m in mats] for m_rows in order}
    times: dict[int, dict[str, list[float]]] = {m_rows: {} for m_rows in order}
    with torch.inference_mode():
        for rep in range(repeats + 1):
            for m_rows in order:
                for name, fns in systems.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    for f, x in zip(fns, xs[m_rows]):
                        f(x)
                    if rep:
                        times[m_rows].setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
                        times[m_rows].setdefault(f"{name} cpu", []).append((time.process_time() - c0) * 1e3 / t)
    out: dict[int, dict[str, float]] = {}
    for m_rows in rows:
        out[m_rows] = {k: statistics.median(v) for k, v in times[m_rows].items()}
        out[m_rows]["gguf vs 1 row"] = statistics.median(
            a / b for a, b in zip(times[m_rows]["gguf"], times[1]["gguf"]))
    return out


def read_pass_ms(mats: list[tuple[str, q8_blocks.Q8Matrix]], repeats: int) -> float:
    """Best-of-`repeats` ms of one read of every byte the products of `mats` read, nothing else."""
    views = [v for _, m in mats for v in m.views()]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for v in views:
            q8_blocks.read(v)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def bench_q8(mats: list[tuple[str, q8_blocks.Q8Matrix]], rows: list[int], repeats: int = 3,
             threads: int | None = None) -> tuple[dict[int, dict[str, float]], float]:
    """ms of one q8 pass (quantise and multiply) over every linear with `rows` input rows, and the read floor of
    the same bytes: per row count the best ("q8") and median of `repeats`, the CPU time per thread, and the best
    pass against the best 1-row pass. Every repeat times the floor and every row count in turn, so a slow spell
    of the machine falls on all of them; the floor is the best read over all repeats."""
    t = threads or torch.get_num_threads()
    torch.set_num_threads(t)
    for _, m in mats:
        m.threads = t
    order = [1] + [r for r in rows if r != 1]
    xs = {m_rows: [torch.randn(m_rows, m.k) for _, m in mats] for m_rows in order}
    times: dict[int, list[float]] = {m_rows: [] for m_rows in order}
    cpu: dict[int, list[float]] = {m_rows: [] for m_rows in order}
    floor = float("inf")
    with torch.inference_mode():
        for rep in range(repeats + 1):
            floor = min(floor, read_pass_ms(mats, 1))
            for m_rows in order:
                t0, c0 = time.perf_counter(), time.process_time()
                for (_, m), x in zip(mats, xs[m_rows]):
                    m(x)
                if rep:
                    times[m_rows].append((time.perf_counter() - t0) * 1e3)
                    cpu[m_rows].append((time.process_time() - c0) * 1e3 / t)
    out = {m_rows: {"q8": min(times[m_rows]), "q8 median": statistics.median(times[m_rows]),
                    "q8 cpu": statistics.median(cpu[m_rows]), "q8 vs 1 row": min(times[m_rows]) / min(times[1])}
           for m_rows in rows}
    return out, floor


def main_q8(args: argparse.Namespace, threads: int) -> int:
    """--numerics q8: the q8 product over every linear of the file, against a read of the same bytes."""
    try:
        if args.isa and q8_blocks.use_isa(args.isa) != args.isa:
            print(f"error: this CPU has no {args.isa}", file=sys.stderr)
            return 2
        mats = q8_blocks.linear_tensors(args.bench, threads)
        result, floor = bench_q8(mats, [int(r) for r in args.rows.split(",")], args.repeats, threads)
        path = q8_blocks.isa()
    except (FileNotFoundError, SkinnyUnavailable, UnsupportedBlockType) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gb = sum(m.nbytes for _, m in mats) / 1e9
    if args.json:
        print(json.dumps({"isa": path, "numerics": "q8", "threads": threads, "linears": len(mats), "blocks_gb": gb,
                          "read_gb_s": gb / floor * 1e3, "floor_ms": floor,
                          "rows": {str(m): ms["q8"] for m, ms in result.items()},
                          "detail": {str(m): ms for m, ms in result.items()}}))
        return 0
    print(f"{len(mats)} linears, {gb:.3f} GB read a pass, {threads} threads, q8 numerics on the {path} path; reading "
          f"those bytes once takes {floor:.1f} ms ({gb / floor * 1e3:.1f} GB/s); ms per pass, best and median of "
          f"{args.repeats}")
    print(f"{'rows':>5}{'best':>9}{'median':>9}{'cpu':>9}{'vs 1 row':>9}{'vs floor':>9}")
    for m, ms in result.items():
        print(f"{m:>5}{ms['q8']:>9.1f}{ms['q8 median']:>9.1f}{ms['q8 cpu']:>9.1f}{ms['q8 vs 1 row']:>8.2f}x"
              f"{ms['q8'] / floor:>8.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI: time every linear of a GGUF file under this kernel and float32 F.linear, by input rows."""
    ap = argparse.ArgumentParser(prog="python -m specpilot.kernels.gguf_blocks",
                                 description="ms per pass over a GGUF checkpoint's linears, by input rows.")
    ap.add_argument("--bench", metavar="MODEL.gguf", required=True)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-fp32", action="store_true", help="skip the float32 baseline (it needs 4 bytes a weight)")
    ap.add_argument("--parts", action="store_true",
                    help="also time reading, dequantising and the FMAs alone (the AVX-512 path)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--isa", choices=q8_blocks.ISA_NAMES, default=None,
                    help="q8: the instruction set to run (default the best this CPU has; all give the same bits)")
    ap.add_argument("--numerics", choices=("f32", "q8"), default="f32",
                    help="f32: the float32 block kernel (default); q8: the q8 product (kernels/cpu/q8_blocks.py)")
    args = ap.parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    if args.numerics == "q8":
        return main_q8(args, threads)
    try:
        mats = linear_tensors(args.bench)
        result = bench_model(args.bench, [int(r) for r in args.rows.split(",")], args.repeats, threads,
                             not args.no_fp32, args.parts, mats)
        path = isa()
    except (FileNotFoundError, SkinnyUnavailable, UnsupportedBlockType) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gb = sum(m.nbytes for _, m in mats) / 1e9
    bandwidth = copy_gb_s(threads)
    floor = gb / bandwidth * 1e3
    if args.json:
        print(json.dumps({"isa": path, "threads": threads, "linears": len(mats), "blocks_gb": gb,
                          "copy_gb_s": bandwidth, "floor_ms": floor,
                          "rows": {str(m): ms["gguf"] for m, ms in result.items()},
                          "detail": {str(m): ms for m, ms in result.items()}}))
        return 0
    print(f"{len(mats)} linears, {gb:.3f} GB of blocks, {threads} threads, {path} path; copy {bandwidth:.1f} GB/s, "
          f"so streaming the blocks once takes {floor:.1f} ms; ms per pass (wall, and CPU / threads)")
    names = [n for n in next(iter(result.values())) if n != "gguf vs 1 row"]
    print(f"{'rows':>5}" + "".join(f"{n:>12}" for n in names) + f"{'vs 1 row':>9}{'GB/s':>7}{'GB/s cpu':>9}"
          + (f"{'fp32/gguf':>10}" if "fp32" in names else ""))
    for m, ms in result.items():
        line = f"{m:>5}" + "".join(f"{ms[n]:>12.1f}" for n in names) + f"{ms['gguf vs 1 row']:>8.2f}x"
        line += f"{gb / ms['gguf'] * 1e3:>7.1f}{gb / ms['gguf cpu'] * 1e3:>9.1f}"
        line += f"{ms['fp32'] / ms['gguf']:>10.2f}" if "fp32" in ms else ""
        print(line)
    return 0
