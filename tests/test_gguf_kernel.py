"""GGUF block kernels: bit-exact dequantisation (reference, C, Triton under the interpreter) against gguf-py,
products within float32 rounding, threads and batch invariance, memmaps not copied, unsupported types."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specpilot.kernels.reference import gguf_ref
from specpilot.kernels.reference.gguf_ref import FORMATS, UnsupportedBlockType, random_blocks

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

REPO = Path(__file__).resolve().parents[1]
QUANTS = ["Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
ALL = ["F32", "F16", *QUANTS]
EDGE_SCALES = np.array([0.0, -0.0, 2.0 ** -24, 6.1e-5, 65504.0, -65504.0, -1.5, 0.0123, -3e-3, 1.0],
                       dtype=np.float16)
# the drafter of `specpilot fetch qwen-coder` where it has been fetched (0.5 GB: the suite does not fetch it)
QWEN_DRAFTER = "qwen2.5-coder-0.5b-instruct.gguf"


def gguf_quants():
    return pytest.importorskip("gguf.quants")


def k_for(q: str) -> int:
    block = FORMATS[gguf_ref.qtype_id(q)][1]
    return 512 if block == 256 else 96 if block == 32 else 40


def bits(t: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(t)).contiguous().view(torch.int32)


def blocks_kernel():
    from specpilot.kernels.cpu import gguf_blocks

    if not gguf_blocks.available():
        pytest.skip("the AVX2 GGUF kernel cannot build or run here")
    return gguf_blocks


@pytest.fixture(params=["avx2", "avx512"])
def isa(request: pytest.FixtureRequest):
    """Each of the kernel's two paths in turn (AVX-512 only where the CPU has it), restoring the default."""
    gb = blocks_kernel()
    before = gb.isa()
    if gb.use_isa(request.param) != request.param:
        gb.use_isa(before)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    gb.use_isa(before)


@pytest.mark.parametrize("q", ["Q4_1", "Q5_0", "Q8_0"])
def test_reference_equals_gguf_on_quantized_data(q: str) -> None:
    gq = gguf_quants()
    from gguf import GGMLQuantizationType as T

    data = (np.random.default_rng(1).standard_normal((9, 128)) * np.array([1e-3, 1, 30])[:, None].repeat(3, 0)
            ).astype(np.float32)
    raw = gq.quantize(data, T[q])
    assert torch.equal(bits(gguf_ref.dequantize(raw, q, 9, 128)), bits(gq.dequantize(raw, T[q])))


@pytest.mark.parametrize("q", ALL)
@pytest.mark.parametrize("scales", ["random", "edge"])
def test_dequantize_bit_exact_against_gguf(q: str, scales: str) -> None:
    """Random blocks (finite f16 fields, or the edge scales 0, -0, subnormal, +-65504, negative) over an odd
    number of rows: the reference, the C kernel's full and row-wise dequantisation all equal gguf-py's bits."""
    gq = gguf_quants()
    from gguf import GGMLQuantizationType as T

    n, k = 13, k_for(q)
    raw = random_blocks(q, n, k, np.random.default_rng(2), None if scales == "random" else EDGE_SCALES)
    expected = bits(gq.dequantize(raw, T[q]).reshape(n, k))
    assert torch.equal(bits(gguf_ref.dequantize(raw, q, n, k)), expected)
    m = blocks_kernel().GGUFMatrix(raw, q, n, k)
    assert torch.equal(bits(m.dequantize()), expected)
    ids = torch.tensor([[12, 0], [5, 5]])
    assert torch.equal(bits(m.rows(ids).reshape(4, k)), expected[ids.reshape(-1)])


@pytest.mark.parametrize("model", ["smollm2", "qwen-0.5b"])
def test_real_blocks_bit_exact(model: str, request: pytest.FixtureRequest) -> None:
    """Rows of every block type in a real checkpoint: SmolLM2 (fetched like the suite's other real-model
    tests; Q4_1, Q8_0), and the Qwen 0.5B (Q5_0, Q8_0, Q6_K, Q4_K) where `specpilot fetch qwen-coder` put it."""
    gq = gguf_quants()
    import gguf
    from specpilot.kernels import cache_dir

    if model == "smollm2":
        path = Path(request.getfixturevalue("smollm2_gguf"))
    else:
        path = cache_dir() / "models" / QWEN_DRAFTER
        if not path.exists():
            pytest.skip(f"{path} is not fetched here (`specpilot fetch qwen-coder`)")
    seen = set()
    for t in gguf.GGUFReader(str(path)).tensors:
        if len(t.shape) != 2 or t.tensor_type.name in seen or int(t.tensor_type) not in FORMATS:
            continue
        seen.add(t.tensor_type.name)
        k, rows = int(t.shape[0]), t.data[:17]
        expected = bits(gq.dequantize(rows, t.tensor_type).reshape(17, k))
        assert torch.equal(bits(gguf_ref.dequantize(rows, int(t.tensor_type), 17, k)), expected), t.name
        m = blocks_kernel().GGUFMatrix(t.data, int(t.tensor_type), int(t.shape[1]), k)
        assert torch.equal(bits(m.rows(torch.arange(17))), expected), t.name
    assert seen


@pytest.mark.parametrize("q", ALL)
def test_identity_rows_reproduce_the_weights(q: str, isa: str) -> None:
    gb = blocks_kernel()
    n, k = 11, k_for(q)
    raw = random_blocks(q, n, k, np.random.default_rng(3))
    w = gguf_ref.dequantize(raw, q, n, k)
    m = gb.GGUFMatrix(raw, q, n, k)
    for k0 in range(0, k, 64):
        eye = torch.eye(k)[k0:k0 + 64]
        assert torch.equal(m(eye), w[:, k0:k0 + 64].T)


def close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Within 1e-5 of the float64 product, relative to sum |x||w| (cancellation makes plain relative error
    meaningless for single outputs)."""
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    return bool(((y.double() - ref).abs() <= 1e-5 * scale + 1e-30).all())


@pytest.mark.parametrize("q", QUANTS)
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_matmul_matches_the_reference(q: str, rows: int, isa: str) -> None:
    gb = blocks_kernel()
    n, k = 37, k_for(q)
    raw = random_blocks(q, n, k, np.random.default_rng(4))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = gb.GGUFMatrix(raw, q, n, k)(x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    w = gguf_ref.dequantize(raw, q, n, k)
    assert close(y, x, w)
    scale = x.abs() @ w.abs().T
    assert bool(((y - gguf_ref.matmul(x, raw, q, n, k)).abs() <= 1e-5 * scale).all())


def test_shapes_empty_batched_and_chunked() -> None:
    gb = blocks_kernel()
    raw = random_blocks("Q4_K", 6, 256, np.random.default_rng(5))
    m = gb.GGUFMatrix(raw, "Q4_K", 6, 256)
    assert m(torch.empty(0, 256)).shape == (0, 6)
    x = torch.randn(2, 70, 256)
    y = m(x)
    assert y.shape == (2, 70, 6)
    assert close(y.reshape(-1, 6), x.reshape(-1, 256), m.dequantize())
    with pytest.raises(ValueError, match="features"):
        m(torch.randn(3, 255))


@pytest.mark.parametrize("q", ALL)
def test_threads_and_batch_size_do_not_change_a_bit(q: str, isa: str) -> None:
    """Threads split output rows and every row's sum has a fixed order, so neither the thread count nor the
    other rows in the batch change an output: what lossless verification needs. The row counts take every
    code path (AVX-512: 1-4 rows in registers, 5-8 two stored rows at a time, 9+ through the scratch in
    groups of 8 with a short last group). 301 outputs leave a partial last tile."""
    gb = blocks_kernel()
    n, k = 301, 2048  # big enough that the kernel starts up to 4 threads for 17 rows
    m = gb.GGUFMatrix(random_blocks(q, n, k, np.random.default_rng(6)), q, n, k)
    x = torch.randn(21, k)
    one = m(x, threads=1)
    for t in (2, 3, 16):
        assert torch.equal(m(x, threads=t), one)
    for i in (0, 5, 16, 20):
        assert torch.equal(m(x[i:i + 1]), one[i:i + 1])
    for lo, hi in ((0, 2), (0, 4), (0, 5), (1, 8), (3, 11), (0, 16), (0, 17)):
        assert torch.equal(m(x[lo:hi]), one[lo:hi])
    wide = torch.randn(70, k)  # a prompt's rows: dequantised slabs into torch's GEMM
    assert torch.equal(m(wide, threads=3), m(wide, threads=1))


def test_read_only_memmap_is_used_in_place(tmp_path: Path) -> None:
    gb = blocks_kernel()
    raw = random_blocks("Q6_K", 9, 512, np.random.default_rng(7))
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    m = gb.GGUFMatrix(mm, "Q6_K", 9, 512)
    assert m.raw.data_ptr() == mm.ctypes.data
    assert m.nbytes == raw.size == 9 * 2 * 210
    x = torch.randn(3, 512)
    assert torch.equal(m(x), gb.GGUFMatrix(raw, "Q6_K", 9, 512)(x))


def test_unsupported_type_is_a_one_line_value_error() -> None:
    gb = blocks_kernel()
    for q in (2, 13, "IQ2_XXS"):
        with pytest.raises(UnsupportedBlockType) as e:
            gb.GGUFMatrix(np.zeros((4, 18), np.uint8), q, 4, 32)
        assert isinstance(e.value, ValueError)
        msg = str(e.value)
        assert "\n" not in msg and "supported: F32, F16, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K" in msg
    with pytest.raises(ValueError, match="multiple of the Q4_K block"):
        gb.GGUFMatrix(np.zeros((1, 144), np.uint8), "Q4_K", 1, 255)
    with pytest.raises(ValueError, match="raw bytes"):
        gb.GGUFMatrix(np.zeros((2, 144), np.uint8), "Q4_K", 3, 256)


def test_bench_cli_on_a_tiny_gguf_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocks_kernel()
    gguf = pytest.importorskip("gguf")
    from specpilot.kernels.bench.gguf_cpu import main

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", random_blocks("Q8_0", 10, 64, np.random.default_rng(8)),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", random_blocks("Q4_K", 24, 256, np.random.default_rng(9)),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["--bench", str(path), "--rows", "1,3", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 linears" in out and "GB/s" in out and "streaming the blocks once takes" in out
    assert main(["--bench", str(tmp_path / "missing.gguf")]) == 2
    capsys.readouterr()

    # the command the records cite, as a script would run it
    done = subprocess.run([sys.executable, "-m", "specpilot.kernels.gguf_blocks", "--bench", str(path), "--rows", "1,5",
                           "--repeats", "1", "--threads", "1", "--no-fp32", "--parts", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["isa"] in ("avx2", "avx512") and report["threads"] == 1 and report["linears"] == 2
    assert set(report["rows"]) == {"1", "5"} and all(ms > 0 for ms in report["rows"].values())
    assert report["floor_ms"] == pytest.approx(report["blocks_gb"] / report["copy_gb_s"] * 1e3)
    if report["isa"] == "avx512":  # the parts run on the AVX-512 path only
        assert {"read", "dequant", "fma"} <= set(report["detail"]["5"])


def test_the_c_traits_table_is_the_reference_table_and_gguf_py_s() -> None:
    """Block geometry is written once in gguf_blocks.c (BLOCK_FORMATS); it must agree with the Python
    reference's FORMATS and with gguf-py, and a type it lacks is refused, not read with another's sizes."""
    gb = blocks_kernel()
    constants = pytest.importorskip("gguf.constants")
    for qtype, (name, block, size) in FORMATS.items():
        c_name, c_block, c_size = gb.block_traits(qtype)
        assert c_name == name
        # F32 and F16 are read 8 values at a time; their bytes per value are what matters
        assert c_size / c_block == size / block
        if block > 1:
            assert (c_block, c_size) == (block, size)
        ref_block, ref_size = constants.GGML_QUANT_SIZES[constants.GGMLQuantizationType(qtype)]
        assert c_size / c_block == ref_size / ref_block
    assert gb.block_traits(2) is None  # Q4_0: not one of the kernel's formats
    assert gb.block_traits(99) is None and gb.block_traits(-1) is None


INTERPRETER_CHECK = r"""
import json, numpy as np, torch
from specpilot.kernels.reference import gguf_ref
from specpilot.kernels.reference.gguf_ref import random_blocks
from specpilot.kernels.gpu.gguf_triton import INTERPRETING, GGUFTritonMatrix, matmul
assert INTERPRETING, "TRITON_INTERPRET=1 did not reach triton"
results = []
cases = [("F32", 9, 40, None), ("F16", 9, 40, None), ("Q4_1", 20, 96, None), ("Q5_0", 17, 96, 64),
         ("Q8_0", 33, 96, 32), ("Q4_K", 40, 512, None), ("Q6_K", 24, 512, None), ("Q5_0", 5, 64, 128)]
for q, n, k, bk in cases:
    raw = torch.from_numpy(random_blocks(q, n, k, np.random.default_rng(n)))
    w = gguf_ref.dequantize(raw, q, n, k)
    err = []
    eye = torch.eye(k)[: min(k, 64)]
    if not torch.equal(matmul(eye, raw, q, n, k, block_n=16, block_k=bk), w[:, : eye.shape[0]].T):
        err.append("identity rows differ from the dequantised weight")
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        out = torch.full((m, n), float("nan"))
        y = matmul(x, raw, q, n, k, block_n=16, block_k=bk, out=out)
        ref, scale = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
        if not bool(((y.double() - ref).abs() <= 1e-5 * scale + 1e-30).all()):
            err.append(f"rows {m}: max err {float((y.double() - ref).abs().max())}")
    results.append({"name": f"{q} {n}x{k} bk={bk}", "error": "; ".join(err)})
big = GGUFTritonMatrix(random_blocks("Q8_0", 8, 64, np.random.default_rng(0)), "Q8_0", 8, 64, device="cpu")
x = torch.randn(2, 35, 64, generator=torch.Generator().manual_seed(35))
y = big(x)
wb = gguf_ref.dequantize(big.raw, 8, 8, 64).double()
ok = y.shape == (2, 35, 8) and bool(((y.double() - x.double() @ wb.T).abs() <= 1e-5 * (x.double().abs() @ wb.abs().T)).all())
results.append({"name": "class, 70 rows in chunks", "error": "" if ok else "wrong"})
print("RESULTS " + json.dumps(results))
"""


def test_triton_kernel_under_interpreter() -> None:
    """The Triton twin on CPU tensors under TRITON_INTERPRET=1 (a fresh process: the variable must be set
    before triton is imported): identity rows bit-exact and products within 1e-5, every block type."""
    pytest.importorskip("triton")
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_CHECK], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    assert len(results) == 9
    failed = [f"{r['name']}: {r['error']}" for r in results if r["error"]]
    assert not failed, "\n".join(failed)


def test_gpu_bench_smoke_under_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "specpilot.kernels.bench.gguf_gpu", "--smoke"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "correctness: all checks passed" in proc.stdout
    assert sum(" Q" in ln and "x" in ln for ln in proc.stdout.splitlines()) == 10


AOT_CHECK = r"""
import re
from specpilot.kernels.gpu.gguf_triton import compile_ahead
for q in ("F32", "F16", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"):
    ptx = compile_ahead(q)["ptx"]
    assert ".target sm_90" in ptx, q
    print(q, len(re.findall(r"ld\.global", ptx)), len(re.findall(r"fma\.rn\.f32", ptx)))
"""


def test_triton_kernel_compiles_for_sm90_without_a_gpu() -> None:
    """The compiled path (layouts, reshapes, fp fusion off) is checked ahead of time with Triton's ptxas,
    which the interpreter never exercises; skipped where Triton has no CUDA backend."""
    pytest.importorskip("triton")
    import importlib.util

    nvidia = importlib.util.find_spec("triton.backends.nvidia")
    if nvidia is None or not (Path(nvidia.origin).parent / "bin" / "ptxas").exists():
        pytest.skip("Triton's CUDA backend (ptxas) is not installed here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", AOT_CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = {ln.split()[0]: int(ln.split()[1]) for ln in proc.stdout.splitlines()}
    assert len(counts) == 7
    assert counts["Q4_K"] < 100 and counts["Q6_K"] < 100  # whole-block slices, not a gather per value


@pytest.mark.parametrize("q", ["Q4_K", "Q8_0"])
def test_prompt_wide_products_go_through_exact_slabs(q: str) -> None:
    """From WIDE_ROWS rows (a prompt) the weight is dequantised a slab at a time and multiplied by torch's
    GEMM: still the exact weights (within float32 summation of the float64 product), slabs stitched in the
    right columns; below it every row is the few-row kernel's, bit for bit."""
    gb = blocks_kernel()
    n, k = 300, k_for(q)
    m = gb.GGUFMatrix(random_blocks(q, n, k, np.random.default_rng(8)), q, n, k)
    w = m.dequantize()
    x = torch.randn(gb.WIDE_ROWS + 1, k)
    old = gb.SLAB_WEIGHTS
    try:
        gb.SLAB_WEIGHTS = 7 * k  # several slabs, the last one partial
        wide = m(x)
    finally:
        gb.SLAB_WEIGHTS = old
    assert close(wide, x, w)
    narrow = m(x[: gb.WIDE_ROWS - 1])
    assert torch.equal(narrow[3:4], m(x[3:4]))


def test_wide_products_share_one_slab_across_matrices_and_threads() -> None:
    """The prompt path's slab buffer is reused: a matrix with a wider slab after a narrower one (the buffer
    grows), and the narrower one again, each still gives its own exact product; dequantising on two threads
    gives the same bits as on one."""
    gb = blocks_kernel()
    rng = np.random.default_rng(21)
    small = gb.GGUFMatrix(random_blocks("Q4_K", 70, 256, rng), "Q4_K", 70, 256)
    big = gb.GGUFMatrix(random_blocks("Q6_K", 90, 768, rng), "Q6_K", 90, 768)
    xs, xb = torch.randn(gb.WIDE_ROWS, 256), torch.randn(gb.WIDE_ROWS + 5, 768)
    for m, x in ((small, xs), (big, xb), (small, xs)):
        assert close(m(x), x, m.dequantize())
    ids = torch.arange(90).flip(0)
    one = gb.GGUFMatrix(big.raw, "Q6_K", 90, 768, threads=1).rows(ids)
    two = gb.GGUFMatrix(big.raw, "Q6_K", 90, 768, threads=2).rows(ids)
    assert torch.equal(bits(one), bits(two))
    assert torch.equal(bits(one[0]), bits(big.rows([89])[0]))


def test_prompt_gemm_stays_float32_when_the_process_allows_lower_precision() -> None:
    """oneDNN takes a prompt's slabs only while float32 matmuls are computed in float32; a process that allows
    bfloat16/TF32 for them gets torch's default GEMM for the slabs instead."""
    gb = blocks_kernel()
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert gb.exact_gemm() is (gb._onednn_gemm if torch.backends.mkldnn.is_available()
                                   else torch.nn.functional.linear)
        torch.set_float32_matmul_precision("medium")
        assert gb.exact_gemm() is torch.nn.functional.linear
    finally:
        torch.set_float32_matmul_precision(before)
