"""packed12: bit-exact packing, the fused Triton kernel under the interpreter, PackedLinear, report/CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specpilot.kernels.gpu.packed12 import (
    Packed12, PackedLinear, main, matmul, matmul_reference, pack, report, unpack,
)

REPO = Path(__file__).resolve().parents[1]
DEMO_MODELS = ["demo-target", "demo-drafter"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def from_bits(values: list[int] | torch.Tensor) -> torch.Tensor:
    b = torch.as_tensor(values, dtype=torch.int32)
    return (b - ((b & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def assert_roundtrip(w: torch.Tensor) -> Packed12:
    p = pack(w)
    out = unpack(p)
    assert out.dtype == torch.bfloat16 and out.shape == w.shape
    assert torch.equal(bits(out), bits(w)), "unpack(pack(w)) is not bit-identical"
    return p


def expected_nbytes(p: Packed12) -> int:
    n, k = p.shape
    e = p.num_escapes
    return n * k + n * ((k + 1) // 2) + 16 + e * p.escape_positions.element_size() + 2 * e


def test_random_normal_roundtrip_and_size() -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16)
    p = assert_roundtrip(w)
    assert p.signman.dtype == torch.uint8 and p.signman.shape == (1024, 1024)
    assert p.codes.dtype == torch.uint8 and p.codes.shape == (1024, 512)
    assert p.exponent_table.shape == (16,) and p.exponent_table[15] == 0
    assert p.escape_positions.dtype == torch.int32 and p.escape_values.dtype == torch.bfloat16
    assert 0 < p.escape_rate < 1e-3
    assert p.nbytes == expected_nbytes(p)
    assert p.index_nbytes == 256 * 4 + (1024 + 1) * p.escape_row_ptr.element_size()
    assert 1.5 < p.bytes_per_weight < 1.51
    assert p.resident_bytes_per_weight == pytest.approx(p.bytes_per_weight + p.index_nbytes / p.numel)


def test_escape_entries_are_exact_and_decode_to_zero_in_the_stream() -> None:
    w = torch.full((4, 12), 0.5, dtype=torch.bfloat16)
    w[1, 2], w[3, 5] = 3.0, -7.5
    for i, e in enumerate(range(110, 140)):
        w.view(-1)[i] = -(2.0 ** (e - 127)) * 1.5
    p = assert_roundtrip(w)
    assert p.num_escapes > 0
    flat = p.escape_positions.long()
    assert torch.equal(bits(p.escape_values), bits(w.view(-1)[flat]))
    assert torch.all(p.signman.view(-1)[flat] == 0)
    assert torch.equal(p.escape_row_ptr[1:] - p.escape_row_ptr[:-1],
                       torch.bincount(flat // 12, minlength=4).to(p.escape_row_ptr.dtype))


def test_all_escape_spread_exponents() -> None:
    exps = torch.arange(256 * 40) % 254 + 1
    signs = torch.where(torch.arange(exps.numel()) % 3 == 0, -1.0, 1.0)
    mant = (torch.arange(exps.numel()) * 37) % 128
    b = (signs < 0).to(torch.int32) << 15 | exps.to(torch.int32) << 7 | mant.to(torch.int32)
    w = from_bits(b).reshape(80, 128)
    p = assert_roundtrip(w)
    assert p.escape_rate > 0.9


def test_every_bf16_bit_pattern() -> None:
    """All 65536 patterns: every NaN payload (quiet, signalling, both signs), +-inf, subnormals, +-0."""
    allb = from_bits(torch.arange(65536))
    assert_roundtrip(allb.reshape(256, 256))
    perm = torch.randperm(65536, generator=torch.Generator().manual_seed(1))
    assert_roundtrip(allb[perm].reshape(512, 128))
    assert_roundtrip(allb[:65535].reshape(255, 257))


def test_specials_as_escapes_and_in_table() -> None:
    specials = [0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFC1, 0x7F81, 0xFF81, 0x7FFF, 0x0001, 0x807F, 0x0000,
                0x8000, 0x7F7F, 0xFF7F, 0x0080, 0x8080]
    g = torch.Generator().manual_seed(2)
    base = (torch.randn(16, 33, generator=g) * 0.02).to(torch.bfloat16)
    rare = base.clone()
    rare.view(-1)[torch.arange(len(specials)) * 31] = from_bits(specials)
    assert_roundtrip(rare)
    frequent = from_bits(torch.tensor(specials).repeat(40)).reshape(20, 32)
    p = assert_roundtrip(frequent)
    assert 0xFF in p.exponent_table.tolist()


@pytest.mark.parametrize("shape", [(1, 1), (7, 1), (5, 3), (33, 127), (2, 4097)])
def test_odd_and_tiny_shapes(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    w.view(-1)[0] = 1e30
    p = assert_roundtrip(w)
    assert p.codes.shape == (shape[0], (shape[1] + 1) // 2)
    if shape[1] % 2:
        assert torch.all(p.codes[:, -1] >> 4 == 15), "the pad nibble of an odd K must be the escape code"


def test_non_contiguous_input_and_errors() -> None:
    w = (torch.randn(64, 32) * 0.02).to(torch.bfloat16)
    assert_roundtrip(w.T)
    with pytest.raises(ValueError, match="bfloat16"):
        pack(w.float())
    with pytest.raises(ValueError, match="2-D"):
        pack(w.reshape(-1))
    p = pack(w.float(), convert=True)
    assert torch.equal(bits(unpack(p)), bits(w))


@pytest.mark.parametrize("model", DEMO_MODELS)
def test_real_trained_weights(model: str) -> None:
    path = REPO / "models" / model / "model.safetensors"
    if not path.exists():
        pytest.skip(f"models/{model} is not trained/committed yet")
    from safetensors.torch import load_file

    state = load_file(str(path))
    matrices = {k: v for k, v in state.items() if v.dim() == 2 and v.dtype == torch.bfloat16}
    assert matrices
    for name, w in matrices.items():
        p = assert_roundtrip(w)
        assert p.escape_rate < 0.05, name
    assert report(state)["overall"]["bytes_per_weight"] < 1.6


def test_matmul_reference_semantics() -> None:
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(48, 40, generator=g) * 0.02).to(torch.bfloat16)
    w[3, 7] = 100.0
    p = pack(w)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(5, 40, generator=g).to(dtype)
        y = matmul_reference(x, p, b)
        want = (x.float() @ w.float().T + b.float()).to(dtype)
        assert y.dtype == dtype and torch.equal(y, want)
        assert torch.equal(matmul(x, p, b), y)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        matmul_reference(torch.randn(2, 40).half(), p)
    with pytest.raises(ValueError, match="columns"):
        matmul_reference(torch.randn(2, 41), p)


def test_packed_linear_exact_on_fp32_accumulated_setting() -> None:
    """Small-integer weights and inputs: every product and sum is exact in fp32, so PackedLinear, the
    reference and the bf16 nn.Linear must agree bit for bit."""
    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(16, 24, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randint(-4, 5, (24, 16), generator=g) / 8)
        lin.bias.copy_(torch.randint(-4, 5, (24,), generator=g) / 4)
    x = torch.randint(-3, 4, (2, 3, 16), generator=g).to(torch.bfloat16)
    pl = PackedLinear.from_linear(lin.weight, lin.bias)
    want = lin(x)
    assert torch.equal(pl(x), want)
    p = pl.packed
    assert torch.equal(matmul_reference(x.reshape(-1, 16), p, pl.bias).reshape(2, 3, 24), want)


def test_packed_linear_matches_nn_linear() -> None:
    g = torch.Generator().manual_seed(6)
    lin = torch.nn.Linear(96, 80, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 96, generator=g) * 0.02)
        lin.weight[0, 0] = 7.0
    pl = PackedLinear.from_linear(lin.weight, lin.bias)
    assert (pl.in_features, pl.out_features) == (96, 80)
    for shape in [(1, 96), (4, 7, 96), (130, 96)]:
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        y = pl(x)
        assert y.shape == (*shape[:-1], 80) and y.dtype == torch.bfloat16
        assert torch.equal(y, lin(x))
        ref = matmul_reference(x.reshape(-1, 96), pl.packed, pl.bias).reshape(y.shape)
        torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-3)
    x32 = torch.randn(3, 96, generator=g)
    assert torch.equal(pl(x32), F.linear(x32, lin.weight.float(), lin.bias.float()))
    nobias = PackedLinear.from_linear(lin.weight, None)
    assert torch.equal(nobias(x32), F.linear(x32, lin.weight.float()))
    pl.to("cpu")
    assert torch.equal(pl(x32), F.linear(x32, lin.weight.float(), lin.bias.float()))
    pl.to(torch.float32)
    assert torch.equal(bits(unpack(pl.packed)), bits(lin.weight.detach())), "a dtype cast must not touch escapes"
    x = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    assert torch.equal(pl(x), lin(x))
    with pytest.raises(ValueError, match="expected input"):
        pl(torch.randn(2, 95))


def test_report_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    tensors = {
        "a.weight": (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16),
        "b.weight": (torch.randn(16, 31, generator=g) * 0.02).to(torch.bfloat16),
        "norm.weight": torch.ones(32, dtype=torch.bfloat16),
        "fp32.weight": torch.randn(8, 8),
    }
    rep = report(tensors)
    assert set(rep["tensors"]) == {"a.weight", "b.weight"}
    assert set(rep["skipped"]) == {"norm.weight", "fp32.weight"}
    o = rep["overall"]
    assert o["numel"] == 64 * 32 + 16 * 31
    assert o["escapes"] == sum(r["escapes"] for r in rep["tensors"].values())
    assert o["bytes_per_weight"] == pytest.approx(o["bytes"] / o["numel"])
    assert rep["tensors"]["a.weight"]["bytes_per_weight"] == pytest.approx(
        pack(tensors["a.weight"]).bytes_per_weight)
    assert "fp32.weight" in report(tensors, convert=True)["tensors"]

    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "overall: 2 matrices" in out and "escape rate" in out and "bytes/weight" in out
    assert main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["overall"]["numel"] == o["numel"]
    assert main([str(tmp_path / "missing")]) == 2


INTERPRETER_CHECK = r"""
import json, torch
from specpilot.kernels.gpu.packed12 import pack, unpack, matmul_reference, matmul_triton
from specpilot.kernels.gpu.packed12_triton import KernelConfig, INTERPRETING
assert INTERPRETING, "TRITON_INTERPRET=1 did not reach triton"

def weight(n, k, seed, planted=()):
    # exactly 15 exponents (2^-15 .. 2^-1), each frequent, so every planted singleton is an escape
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(112, 127, (n * k,), generator=g, dtype=torch.int32)
    b = torch.randint(0, 2, (n * k,), generator=g, dtype=torch.int32) << 15 | e << 7 | torch.randint(
        0, 128, (n * k,), generator=g, dtype=torch.int32)
    w = (b - ((b & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16).reshape(n, k).clone()
    for pos, val in planted:
        w.view(-1)[pos] = val
    return w

def compare(y, r, x, w):
    if y.shape != r.shape or y.dtype != r.dtype:
        return f"shape/dtype {tuple(y.shape)} {y.dtype} vs {tuple(r.shape)} {r.dtype}"
    yd, rd = y.double(), r.double()
    if not torch.equal(torch.isnan(yd), torch.isnan(rd)):
        return "NaN positions differ"
    inf = torch.isinf(rd)
    if not torch.equal(torch.isinf(yd), inf) or not torch.equal(yd[inf], rd[inf]):
        return "inf positions differ"
    fin = torch.isfinite(rd)
    scale = x.double().abs() @ unpack(w).double().abs().T
    rel = 2.0 ** -7 if y.dtype == torch.bfloat16 else 1e-6
    bound = rel * rd.abs() + 1e-5 * scale + 1e-30
    bad = fin & ((yd - rd).abs() > bound)
    return f"{int(bad.sum())} elements off, max err {float((yd - rd)[fin].abs().max())}" if bad.any() else ""

results = []
def case(name, w, m, dtype, cfg=None, bias=False, seed=0, expect_escapes=None):
    g = torch.Generator().manual_seed(100 + seed)
    p = pack(w)
    x = torch.randn(m, w.shape[1], generator=g).to(dtype)
    b = torch.randn(w.shape[0], generator=g).to(dtype) if bias else None
    out = torch.full((m, w.shape[0]), float("nan"), dtype=dtype)
    y = matmul_triton(x, p, b, cfg, out)
    r = matmul_reference(x, p, b)
    err = compare(y, r, x, p)
    if expect_escapes is not None and p.num_escapes != expect_escapes:
        err += f" expected {expect_escapes} escapes, packed {p.num_escapes}"
    results.append({"name": name, "escapes": p.num_escapes, "error": err})

small = KernelConfig(block_n=16, block_k=32, esc_block=16)
esc = [(5, 1e20), (40, -3e-30), (100, 64.0), (1000, -2.0 ** 40), (2047, 5e-38)]
for m in (1, 3):
    for dt in (torch.bfloat16, torch.float32):
        case(f"32x64 m={m} {dt}", weight(32, 64, 0, esc), m, dt, small, expect_escapes=5)
case("bias bf16", weight(32, 64, 1, esc), 3, torch.bfloat16, small, bias=True, expect_escapes=5)
case("bias fp32 default config", weight(32, 64, 2, esc), 2, torch.float32, None, bias=True, expect_escapes=5)
case("odd K=63", weight(32, 63, 3, esc[:4]), 3, torch.bfloat16, small, expect_escapes=4)
case("odd K=5 fp32", weight(20, 5, 4, [(7, 1e10)]), 1, torch.float32, small, expect_escapes=1)
case("split-K even", weight(24, 256, 5, [(9, 1e4), (3000, -1e4)]), 3, torch.bfloat16,
     KernelConfig(block_n=16, block_k=32, split_k=3), expect_escapes=2)
case("split-K ragged", weight(24, 250, 6, [(9, 1e4), (3000, -1e4)]), 2, torch.float32,
     KernelConfig(block_n=32, block_k=64, split_k=2), expect_escapes=2)
case("rows 17", weight(32, 64, 7, esc), 17, torch.bfloat16, small, expect_escapes=5)
case("rows 64", weight(32, 64, 8, esc), 64, torch.float32, small, expect_escapes=5)
spread = torch.arange(32 * 64)
allb = ((spread % 200 + 20) << 7 | (spread * 37) % 128 | (spread % 2) << 15).to(torch.int32)
allesc = (allb - ((allb & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16).reshape(32, 64)
case("mostly escapes, chunks", allesc, 3, torch.float32, small)
specials = [(70, float("inf")), (300, float("nan")), (301, -float("inf"))]
case("inf and nan escapes", weight(32, 64, 9, specials), 2, torch.bfloat16, small, expect_escapes=3)
frequent = weight(32, 64, 10)
frequent.view(-1)[::7] = float("inf")
frequent.view(-1)[3::11] = -float("inf")
case("inf in the table", frequent, 2, torch.float32, small, expect_escapes=None)
print("RESULTS " + json.dumps(results))
"""


def test_triton_kernel_under_interpreter() -> None:
    """The fused kernel on CPU tensors under TRITON_INTERPRET=1 (a fresh process: the variable must be set
    before triton is imported), against matmul_reference, on small shapes and every code path."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_CHECK], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    assert len(results) == 15
    assert any(r["escapes"] > 100 for r in results)
    failed = [f"{r['name']}: {r['error']}" for r in results if r["error"]]
    assert not failed, "\n".join(failed)


def test_gpu_bench_smoke_under_interpreter() -> None:
    """The GPU check's own flow (autotune loop, checks, table) on tiny CPU shapes, so the script that needs a
    GPU is at least exercised here."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "specpilot.kernels.bench.gpu", "--smoke"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "correctness: all checks passed" in proc.stdout
    lines = proc.stdout.strip().splitlines()
    assert any("packed12 us" in ln and "speedup" in ln for ln in lines)
    assert lines[-1].startswith("geomean speedup at rows <= 8")


def test_gpu_check_script_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; the script would run the real benchmark")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines()[-1] == "no CUDA device: skipping packed12 GPU check"
