"""Build, load and call the skinny GEMM (skinny.c) for float32 projections of a few rows on an AVX2 CPU.

The library also holds the fused decoder layer (layer.c, runtime.linear = "fused"), which calls the GEMM.
The C files are compiled once per source version with the system C compiler (`$CC`, else cc/gcc) into the
SpecPilot cache (`$SPECPILOT_CACHE_DIR/kernels`, default ~/.cache/specpilot/kernels) and loaded with ctypes:
no torch headers, so the build takes about a second. Concurrent builders (candidate workers) each compile to
a private name and rename into place, so a reader never sees a half-written library.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specpilot.kernels.build import KernelUnavailable, compiled, loads

SOURCES = (Path(__file__).with_name("skinny.c"), Path(__file__).with_name("layer.c"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
LIBS = ("-lm",)


SkinnyUnavailable = KernelUnavailable  # the name the engine catches: a CPU kernel that cannot run here


def cpu_supports_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return "avx2" in flags and "fma" in flags


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled kernel, building it on first use; SkinnyUnavailable says why it cannot run here."""
    if not cpu_supports_avx2_fma():
        raise SkinnyUnavailable("this CPU has no AVX2+FMA")
    lib = compiled("skinny", SOURCES, FLAGS, LIBS)
    ptr, n = ctypes.c_void_p, ctypes.c_long
    lib.skinny_pack.argtypes = [ptr, ptr, n, n, n, ctypes.c_int]
    lib.skinny_gemm.argtypes = [ptr, ptr, ptr, ptr, n, n, n, ctypes.c_int]
    lib.fused_layer.argtypes = [ptr, ptr, ptr, ptr, ptr]
    return lib


def available() -> bool:
    """Whether the kernel builds and loads here."""
    return loads(library)


def bfloat16_exact(weight: torch.Tensor) -> bool:
    """Whether every value is a bfloat16 number (true of any bf16 checkpoint, whatever dtype it loaded in)."""
    w = weight.detach()
    return w.dtype == torch.bfloat16 or torch.equal(w.float().bfloat16().float(), w.float())


class SkinnyWeight:
    """A weight [N, K] packed for skinny_gemm (its own copy; the source tensor is not kept): 16 bits per
    value when every value is a bfloat16 number, else float32 (`bits` forces 32 on such a weight)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, bits: int | None = None) -> None:
        if weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError("skinny weights are 2-D CPU tensors")
        self.lib = library()
        w = weight.detach().float().contiguous()
        self.n, self.k = w.shape
        self.kp = (self.k + 7) // 8 * 8
        exact = bfloat16_exact(weight)
        self.bits = bits or (16 if exact else 32)
        if self.bits not in (16, 32) or (self.bits == 16 and not exact):
            raise ValueError(f"skinny panels hold 16 (bfloat16 values only) or 32 bits, not {self.bits}")
        values = (self.n + 3) // 4 * 4 * self.kp
        self.packed = torch.empty(values, dtype=torch.int16 if self.bits == 16 else torch.float32)
        self.lib.skinny_pack(w.data_ptr(), self.packed.data_ptr(), self.n, self.k, self.kp, self.bits == 16)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (any float dtype) -> float32 [..., N]."""
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.k).float()
        if self.kp != self.k:
            rows = F.pad(rows, (0, self.kp - self.k))
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.n, dtype=torch.float32)
        self.lib.skinny_gemm(rows.data_ptr(), self.packed.data_ptr(),
                             None if self.bias is None else self.bias.data_ptr(), out.data_ptr(),
                             rows.shape[0], self.n, self.kp, self.bits == 16)
        return out.view(*lead, self.n)


def bench_model_dir(model_dir: str, rows: list[int], repeats: int = 6) -> dict[int, dict[str, float]]:
    """ms of one pass over every 2-D weight of a checkpoint (each with `rows` input rows), cycled so that no
    matrix stays in L1/L2: torch's default GEMM, oneDNN's prepacked GEMM and this kernel, interleaved."""
    from safetensors.torch import load_file

    weights = [t.float().contiguous() for f in sorted(Path(model_dir).glob("*.safetensors"))
               for t in load_file(str(f)).values() if t.dim() == 2]
    if not weights:
        raise FileNotFoundError(f"no 2-D weights in {model_dir}/*.safetensors")
    packed = [SkinnyWeight(w) for w in weights]
    systems = {"torch": [lambda x, w=w: F.linear(x, w) for w in weights], "skinny": packed}
    if torch.backends.mkldnn.is_available():
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        systems["onednn"] = [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], "")
                             for p in onednn]
    out: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for m in rows:
            xs = [torch.randn(m, w.shape[1]) for w in weights]
            times: dict[str, list[float]] = {k: [] for k in systems}
            for rep in range(repeats + 1):
                for name, fns in systems.items():
                    t0 = time.perf_counter()
                    for f, x in zip(fns, xs):
                        f(x)
                    if rep:
                        times[name].append((time.perf_counter() - t0) * 1e3)
            out[m] = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: time every 2-D weight of a checkpoint under torch's GEMM, oneDNN and the skinny kernel."""
    ap = argparse.ArgumentParser(prog="python -m specpilot.kernels.cpu.skinny",
                                 description="ms per pass over a checkpoint's weight matrices, by input rows.")
    ap.add_argument("model_dir")
    ap.add_argument("--rows", default="1,3,5,9,12,17,24,33,48,64")
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        result = bench_model_dir(args.model_dir, [int(r) for r in args.rows.split(",")], args.repeats)
    except (FileNotFoundError, SkinnyUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = list(next(iter(result.values())))
    print(f"{'rows':>5}" + "".join(f"{n:>10}" for n in names) + "   (ms per pass, 1 thread)")
    for m, ms in result.items():
        print(f"{m:>5}" + "".join(f"{ms[n]:>10.2f}" for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
