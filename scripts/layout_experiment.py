"""`python scripts/layout_experiment.py MODEL.gguf` (a GGUF file; the 1.5B after `specpilot fetch qwen-coder`):
what the block kernel's read order costs, by building variants of kernels/cpu/gguf_blocks.c with one line
changed and timing them interleaved over every linear, 1 thread, median of 5.

- "as is": the kernel;
- "prefetch 2 tiles ahead": its software prefetch one tile further ahead;
- "tile-major (emulated)": each 4-row tile's chunks read from one contiguous run, the addresses a tile-major
  repack of the same bytes would give. The values then come from other rows of the same matrix (valid blocks,
  wrong weights), so this variant times the read order only; its outputs are not checked.

Each variant runs the read part alone (`gguf_matmul_part`, PART_READ) and whole passes of 1 and 5 rows. The
prefetch variant's outputs must equal the kernel's bit for bit, and are checked."""
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

from specpilot.kernels.build import compiled
from specpilot.kernels.cpu import gguf_blocks as gb

PREFETCH = "                    for (long b = 0; b < span; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);\n"
ROWS = ("                rows[r] = j->w + (n0 + r < j->n ? n0 + r : n0) * j->row_bytes; "
        "/* past the end: recomputed, unused */\n")
TILE_MAJOR_ROWS = ("                rows[r] = n0 + TILE <= j->n ? j->w + n0 * j->row_bytes + at * TILE + r * span - at\n"
                   "                                            : j->w + (n0 + r < j->n ? n0 + r : n0) * j->row_bytes;\n")
TILE_MAJOR_PREFETCH = PREFETCH.replace("next + b", "(const char *)j->w + (n0 + TILE) * j->row_bytes + at * TILE + "
                                                   "r * span + b")


def variants(src: str) -> dict[str, str]:
    """The kernel's source and its one-line variants (the AVX-512 path's prefetch is the last of the two)."""
    at = src.rindex(PREFETCH)
    assert src.count(ROWS) == 1, "the kernel's row addressing changed; update this experiment"

    def prefetch(line: str) -> str:
        return src[:at] + line + src[at + len(PREFETCH):]

    return {"as is": src,
            "prefetch 2 tiles ahead": prefetch(PREFETCH.replace("next + b", "next + TILE * j->row_bytes + b")),
            "tile-major (emulated)": prefetch(TILE_MAJOR_PREFETCH).replace(ROWS, TILE_MAJOR_ROWS)}


def main(path: str) -> None:
    torch.set_num_threads(1)
    mats = [m for _, m in gb.linear_tensors(path)]
    ptr, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    libs = {}
    for k, (name, text) in enumerate(variants(gb.SOURCE.read_text()).items()):
        src = Path(f"/tmp/gguf_blocks_variant{k}.c")
        src.write_text(text)
        lib = compiled(f"gguf_blocks_variant{k}", (src,), gb.FLAGS, ("-lm",))
        lib.gguf_matmul_part.argtypes = [ptr, n, n, ptr, n, n, n, i, ptr, n, i, i]
        libs[name] = lib
    xs = {r: [torch.randn(r, m.k) for m in mats] for r in (1, 5)}
    ys = {r: [torch.empty(r, m.n) for m in mats] for r in (1, 5)}

    def run(lib, part: int, rows: int) -> None:
        for m, x, y in zip(mats, xs[rows], ys[rows]):
            lib.gguf_matmul_part(x.data_ptr(), rows, m.k, m.raw.data_ptr(), m.n, m.k, m.row_bytes, m.qtype,
                                 y.data_ptr(), m.n, 1, part)

    times: dict[tuple[str, str], list[float]] = {}
    for rep in range(6):
        for name, lib in libs.items():
            for label, part, rows in (("read alone", 1, 1), ("1 row", 0, 1), ("5 rows", 0, 5)):
                t0 = time.perf_counter()
                run(lib, part, rows)
                if rep:
                    times.setdefault((name, label), []).append((time.perf_counter() - t0) * 1e3)
    for (name, label), ms in times.items():
        print(f"{name:<24} {label:<11} {statistics.median(ms):7.1f} ms")
    for m, x in zip(mats[:24], xs[5][:24]):
        y = torch.empty(5, m.n)
        lib = libs["prefetch 2 tiles ahead"]
        lib.gguf_matmul_part(x.data_ptr(), 5, m.k, m.raw.data_ptr(), m.n, m.k, m.row_bytes, m.qtype, y.data_ptr(),
                             m.n, 1, 0)
        assert torch.equal(y, m(x)), "a prefetch changed the output"
    print("the prefetch variant's outputs equal the kernel's")


if __name__ == "__main__":
    main(sys.argv[1])
