"""Hardware probe: measured memory bandwidth and matmul throughput, cached per device and dtype.

The ceiling divides the bytes a verify step must read by the bandwidth measured here, so the figure is a
median over repeats of a large tensor copy (bytes read + written), with its spread kept beside it.
Results are cached in $SPECPILOT_CACHE_DIR (default ~/.cache/specpilot)/probe.json; `refresh=True`
measures again.
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import torch

from specpilot.core.engine.decode import sync
from specpilot.core.engine.model import DTYPES
from specpilot.kernels import cache_dir



def _time(fn, device: torch.device, repeats: int) -> list[float]:
    fn()
    sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _device_key(device: torch.device, dtype: str) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return f"{device}|{name}|{dtype}|threads={torch.get_num_threads()}"


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _matmul_size(device: torch.device, dtype: torch.dtype, largest: int) -> int:
    """The largest power-of-two size up to `largest` whose matmul takes under 50 ms (keeps CPU probes short)."""
    n = 256
    while n < largest:
        a = torch.randn(n, n, device=device).to(dtype)
        if min(_time(lambda: a @ a, device, 3)) * 8 > 0.05:
            break
        n *= 2
    return n


def measure(device: str = "cpu", dtype: str = "float32") -> dict:
    """Measure now: copy bandwidth (GB/s) and square-matmul throughput (TFLOP/s) in `dtype`."""
    dev = torch.device(device)
    tdtype = DTYPES[dtype]
    gpu = dev.type == "cuda"
    copy_bytes = (1 << 30) if gpu else (64 << 20)
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    copies = _time(lambda: dst.copy_(src), dev, 20 if gpu else 9)
    bandwidth = [2 * copy_bytes / s / 1e9 for s in copies]
    del src, dst
    n = _matmul_size(dev, tdtype, 4096 if gpu else 1024)
    a = torch.randn(n, n, device=dev).to(tdtype)
    b = torch.randn(n, n, device=dev).to(tdtype)
    mms = _time(lambda: a @ b, dev, 20 if gpu else 5)
    tflops = [2 * n ** 3 / s / 1e12 for s in mms]
    return {
        "device": str(dev),
        "dtype": dtype,
        "key": _device_key(dev, dtype),
        "bandwidth_gb_s": statistics.median(bandwidth),
        "bandwidth_spread": _spread(bandwidth),
        "copy_bytes": copy_bytes,
        "matmul_tflops": statistics.median(tflops),
        "matmul_spread": _spread(tflops),
        "matmul_size": n,
        "measured_at": time.time(),
    }


def probe(device: str = "cpu", dtype: str = "float32", refresh: bool = False) -> dict:
    """Cached measurement for this device and dtype; measured on first use or when `refresh` is set."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    dev = torch.device(device)
    key = _device_key(dev, dtype)
    path = cache_dir() / "probe.json"
    cached: dict = {}
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError):
            cached = {}
    if not refresh and isinstance(cached.get(key), dict):
        return {**cached[key], "cached": True}
    result = measure(device, dtype)
    cached[key] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cached, indent=2))
    tmp.replace(path)
    return {**result, "cached": False}
