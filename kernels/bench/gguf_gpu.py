"""GPU check for the GGUF Triton kernel: correctness first, then its speed against bf16 torch.matmul.

Why: verification multiplies 1..64 rows by every weight; reading 4.5-6.6-bit blocks instead of 16-bit bf16
can only pay if the in-kernel dequantisation keeps up with memory. Each timing rotates weight copies past the
L2 and replays a CUDA graph (kernels/bench/gpu.Timer). Correctness: identity rows reproduce gguf_ref's
dequantised weights bit for bit, and random rows match the float64 product within 1e-5 relative, output
poisoned with NaN first. Shapes are the Qwen2.5-Coder-1.5B linears (or a GGUF file's with --gguf).

Run on a CUDA machine: `python -m specpilot.kernels.bench.gguf_gpu` (about two minutes). `--smoke` runs the same
flow on tiny shapes on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from specpilot.kernels.bench.gpu import Timer, copy_bandwidth, rel_error
from specpilot.kernels.reference.gguf_ref import FORMATS, dequantize, qtype_id, random_blocks

QWEN15B = [(1536, 1536, "Q4_K"), (256, 1536, "Q4_K"), (8960, 1536, "Q4_K"), (1536, 8960, "Q4_K"),
           (1536, 8960, "Q6_K"), (151936, 1536, "Q6_K"), (2048, 2048, "Q8_0"), (2048, 2048, "Q5_0"),
           (2048, 2048, "Q4_1")]
ROWS = [1, 2, 4, 8, 16, 32, 64]
SMOKE_SHAPES = [(40, 256, "Q4_K"), (24, 512, "Q6_K"), (33, 96, "Q8_0"), (17, 64, "Q5_0"), (20, 96, "Q4_1")]
SMOKE_ROWS = [1, 3]
CONFIGS = [(32, 4), (64, 4), (16, 4), (64, 8)]
PRECISIONS = ["ieee", "tf32x3"]


def gguf_shapes(path: str) -> list[tuple[int, int, str, np.ndarray]]:
    """(N, K, type, raw) of each distinct 2-D weight shape and type of a GGUF file."""
    import gguf

    seen, out = set(), []
    for t in gguf.GGUFReader(path).tensors:
        key = (int(t.shape[1]), int(t.shape[0]), t.tensor_type.name)
        if len(t.shape) == 2 and key not in seen and int(t.tensor_type) in FORMATS:
            seen.add(key)
            out.append((*key, np.asarray(t.data)))
    return out


def main(argv: list[str] | None = None) -> int:
    """Checks and timings; exit status 1 on any correctness failure."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (needs TRITON_INTERPRET=1)")
    ap.add_argument("--gguf", help="time this file's weight shapes (real blocks) instead of random ones")
    ap.add_argument("--budget-s", type=float, default=240.0, help="after this, time the first config only")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    if args.smoke:
        device = torch.device("cpu")
        rows_list, timer = SMOKE_ROWS, Timer(device, 1, 1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: skipping the GGUF GPU check")
            return 0
        device = torch.device("cuda")
        rows_list, timer = ROWS, Timer(device, inner=32, outer=15)
    import specpilot.kernels.gpu.gguf_triton as kt

    if args.smoke and not kt.INTERPRETING:
        print("--smoke needs TRITON_INTERPRET=1 set before the run")
        return 2
    gen = np.random.default_rng(0)
    tgen = torch.Generator(device=device).manual_seed(0)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 64 << 20)
        bw = copy_bandwidth(device)
        print(f"device: {props.name}, L2 {l2 >> 20} MiB, copy bandwidth (read+write) {bw / 1e9:.0f} GB/s, "
              f"torch {torch.__version__}, triton {kt.triton.__version__}", flush=True)
    else:
        l2 = 1 << 12
    if args.gguf:
        shapes = gguf_shapes(args.gguf)
    else:
        shapes = [(n, k, q, random_blocks(q, n, k, gen)) for n, k, q in (SMOKE_SHAPES if args.smoke else QWEN15B)]

    failures: list[str] = []
    head = "".join(f" {p + ' us':>9} {'speedup':>8} {'GB/s':>7}  config" for p in PRECISIONS[:1 if args.smoke else 2])
    print(f"{'N x K':>14} {'type':>5} {'rows':>4} {'bf16 us':>9}{head}")
    for n, k, q, raw_np in shapes:
        t = qtype_id(q)
        raw = torch.from_numpy(np.ascontiguousarray(raw_np)).to(device)
        w = dequantize(raw, t, n, k)
        eye_rows = min(k, 64)
        ident = kt.matmul(torch.eye(k, device=device)[:eye_rows], raw, t, n, k)
        if not torch.equal(ident, w[:, :eye_rows].T):
            failures.append(f"{n}x{k} {q}: identity rows do not reproduce the dequantised weight")
        copies = max(2, math.ceil(4 * l2 / raw.numel()))
        raws = [raw] + [raw.clone() for _ in range(copies - 1)]
        wb = w.to(torch.bfloat16)
        wbs = [wb] + [wb.clone() for _ in range(copies - 1)]
        w64 = w.double()
        del w
        for rows in rows_list:
            x = torch.randn(rows, k, generator=tgen, device=device)
            out = torch.full((rows, n), float("nan"), device=device)
            kt.matmul(x, raw, t, n, k, out=out)
            err = rel_error(out, x.double() @ w64.T)
            if not err <= 1e-5:
                failures.append(f"{n}x{k} {q} rows={rows}: rel err {err:.2e}")
            xb = x.to(torch.bfloat16)
            bf16 = timer(lambda i: F.linear(xb, wbs[i]), copies)
            line = f"{n:>7} x{k:>6} {q:>5} {rows:>4} {bf16:>9.2f}"
            for precision in PRECISIONS[:1] if args.smoke else PRECISIONS:
                if precision != "ieee":  # tensor-core products: reported, not gated
                    out.fill_(float("nan"))
                    kt.matmul(x, raw, t, n, k, precision=precision, out=out)
                    line += f" [{precision} rel err {rel_error(out, x.double() @ w64.T):.1e}]"
                best, best_cfg = math.inf, None
                cands = CONFIGS[:1] if args.smoke or time.monotonic() - t_start > args.budget_s else CONFIGS
                for bn, nw in cands:
                    try:
                        us = timer(lambda i: kt.matmul(x, raws[i], t, n, k, block_n=bn, num_warps=nw,
                                                       precision=precision), copies)
                    except Exception as e:  # a config the compiler rejects is simply not a candidate
                        print(f"  skip n{bn}/w{nw}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                        continue
                    if us < best:
                        best, best_cfg = us, f"n{bn}/w{nw}"
                line += f" {best:>9.2f} {bf16 / best:>8.2f} {raw.numel() / best / 1e3:>7.1f}  {best_cfg}"
            print(line, flush=True)
    print()
    if failures:
        print("CORRECTNESS FAILURES:")
        for f in failures:
            print("  " + f)
        return 1
    print("correctness: all checks passed (identity rows bit-exact, random rows within 1e-5, poisoned outputs)")
    print(f"total {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
