"""runtime.linear = "skinny": SpecPilot's own AVX2 kernel for few-row projections. Its products match torch's
within float32 rounding (bit for bit between its 16- and 32-bit panels), batched serving and bf16
checkpoints stay lossless, and it is refused clearly where it cannot run. The tests every linear backend
shares (logits vs native, forcing in float32 and bfloat16) are in test_engine_linear.py."""

import os

import pytest
import torch
import torch.nn.functional as F

import tiny_models
from specpilot.core import forcing
from specpilot.core.costmodel.profile import weight_bytes
from specpilot.core.engine import Engine
from specpilot.core.engine.config import ModelLoadError
from specpilot.core.engine.linear import SKINNY_MAX_ROWS
from specpilot.core.recipe import Recipe
from specpilot.kernels.cpu import skinny

SKINNY = {"runtime": {"linear": "skinny"}}


needs_kernel = pytest.mark.skipif(not skinny.available(), reason="no AVX2+FMA or no C compiler here")


@needs_kernel
@pytest.mark.parametrize("n, k, rows", [(1, 8, 1), (13, 20, 1), (640, 384, 7), (5, 1024, 4), (130, 72, 50)])
def test_kernel_matches_torch_with_padding_and_bias(n, k, rows):
    """Odd N (the last panel is partial), K not a multiple of 8 (zero padded), 1 to 50 rows, with a bias."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, b, x = (torch.randn(s, generator=g) for s in ((n, k), (n,), (2, rows, k)))
    for bias in (None, b):
        out = skinny.SkinnyWeight(w, bias)(x)
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert out.shape == (2, rows, n) and out.dtype == torch.float32
        assert (out.double() - ref).abs().max() <= 1e-5 * (x.abs() @ w.abs().T).max()


@needs_kernel
def test_bfloat16_panels_give_the_float32_kernels_bits():
    """bf16-valued weights are stored in 16 bits and widened exactly: the same products, sums and order."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(37, 96, generator=g).bfloat16().float()
    x, b = torch.randn(40, 96, generator=g), torch.randn(37, generator=g)
    half, full = skinny.SkinnyWeight(w, b), skinny.SkinnyWeight(w, b, bits=32)
    assert (half.bits, full.bits) == (16, 32) and half.packed.element_size() == 2
    for rows in (1, 2, 3, 4, 5, 7, 11, 16, 40):  # from 20 rows each bf16 panel is widened once into a scratch
        assert torch.equal(half(x[:rows]), full(x[:rows]))
    assert skinny.SkinnyWeight(w.bfloat16()).bits == 16
    assert skinny.SkinnyWeight(torch.randn(8, 8, generator=g)).bits == 32
    with pytest.raises(ValueError, match="16 .bfloat16 values only."):
        skinny.SkinnyWeight(torch.randn(8, 8, generator=g), bits=16)


@needs_kernel
def test_a_rows_output_does_not_depend_on_the_other_rows():
    """Rows are multiplied in groups of 3 or 2 (or 1), widened in registers or from a scratch by row count: each
    output is still the same sum in the same order, bit for bit, as the row multiplied alone."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(45, 200, generator=g)
    x = torch.randn(26, 200, generator=g)
    for weight in (skinny.SkinnyWeight(w.bfloat16().float()), skinny.SkinnyWeight(w)):
        alone = torch.cat([weight(x[i:i + 1]) for i in range(len(x))])
        for rows in range(2, len(x) + 1):
            assert torch.equal(weight(x[:rows]), alone[:rows]), rows
        assert weight(x[:0]).shape == (0, 45)


@needs_kernel
def test_kernel_cache_is_built_once_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))
    skinny.library.cache_clear()
    try:
        skinny.library()
        built = list((tmp_path / "kernels").glob("skinny-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        skinny.library.cache_clear()
        skinny.library()
        assert built[0].stat().st_mtime_ns == stamp and len(list((tmp_path / "kernels").iterdir())) == 1
    finally:
        skinny.library.cache_clear()


@needs_kernel
def test_a_damaged_cached_build_is_rebuilt(tmp_path):
    """A cached library that does not load is built again (in a fresh process: one that has the library
    loaded keeps its mapping)."""
    import subprocess
    import sys

    code = ("import torch; from specpilot.kernels.cpu import skinny; "
            "print(skinny.SkinnyWeight(torch.eye(8))(torch.arange(8.0)[None]).tolist())")
    env = {**os.environ, "SPECPILOT_CACHE_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 0, first.stderr[-1000:]
    built = next((tmp_path / "kernels").glob("skinny-*.so"))
    (tmp_path / "damaged").write_bytes(b"not a shared library")
    os.replace(tmp_path / "damaged", built)
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0, again.stderr[-1000:]
    assert again.stdout.strip() == str([[float(i) for i in range(8)]]) and built.read_bytes()[:4] == b"\x7fELF"


@needs_kernel
def test_skinny_batched_outputs_equal_single_request_ar(pair_engine, one_thread):
    """Batched verification crosses SKINNY_MAX_ROWS (wide steps go to oneDNN/BLAS): outputs stay AR's."""
    prompts = tiny_models.repeating_prompts([9, 14, 20, 11, 16, 7], seed=5)
    limits = [20, 12, 24, 16, 20, 9]
    recipe = Recipe.from_dict({**SKINNY, "tree": {"policy": "dynamic", "depth": 4, "budget": 10}})
    assert pair_engine.models_for(recipe)[0].matrix_bits is None and 6 * 11 > SKINNY_MAX_ROWS[32]
    ar = [pair_engine.generate([p], [n], speculative=False).tokens[0] for p, n in zip(prompts, limits)]
    out = pair_engine.serve(prompts, limits, recipe, max_batch=6)
    assert out.tokens == ar


@needs_kernel
def test_a_bfloat16_checkpoint_in_float32_reads_16_bit_panels_and_stays_lossless(tmp_path, one_thread):
    """A bf16 checkpoint loaded in float32: the kernel reads half the bytes (the cost model counts them)
    and greedy output still matches transformers' float32 run of the same checkpoint."""
    hf = tiny_models.build(tmp_path, "llama2", layers=2, init=0.15, seed=4).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    engine = Engine.load(tmp_path, dtype="float32")
    target, _ = engine.models_for(Recipe.from_dict(SKINNY))
    assert engine.target.matrix_bits is None and target.matrix_bits == 16
    assert weight_bytes(engine.target) - weight_bytes(target) == sum(w.numel() * 2 for w in target.matrices())
    reference = forcing.load_reference(str(tmp_path), "float32")
    recipe = Recipe.from_dict({**SKINNY, "draft": {"method": "ngram"}, "tree": {"depth": 5}})
    result = forcing.compare(engine, recipe, tiny_models.repeating_prompts([9, 14, 20], seed=2), [24, 24, 24],
                             reference=reference)
    assert result["passed"] and result["clear_mismatches"] == 0, result


def test_skinny_refusals(tmp_path, monkeypatch):
    tiny_models.build(tmp_path, "llama2", init=0.1).to(torch.bfloat16).save_pretrained(tmp_path)
    engine = Engine.load(tmp_path)
    with pytest.raises(ModelLoadError, match="runtime.linear = 'skinny' needs native weights, not packed12"):
        engine.models_for(Recipe.from_dict({**SKINNY, "weights": {"format": "packed12"}}))
    monkeypatch.setattr(skinny, "cpu_supports_avx2_fma", lambda: False)
    skinny.library.cache_clear()
    try:
        with pytest.raises(ModelLoadError, match=r"^runtime.linear = 'skinny' cannot run here: this CPU has no "
                                                 r"AVX2\+FMA; use linear = 'onednn' or 'native'$"):
            engine.models_for(Recipe.from_dict(SKINNY))
    finally:
        skinny.library.cache_clear()


@needs_kernel
def test_kernel_benchmark_cli(tiny_pair, tmp_path):
    """`python -m specpilot.kernels.cpu.skinny DIR` times every 2-D weight per row count; a directory without weights is a
    one-line error."""
    import subprocess
    import sys

    target_dir, _, _ = tiny_pair
    out = subprocess.run([sys.executable, "-m", "specpilot.kernels.cpu.skinny", str(target_dir), "--rows", "1,4", "--repeats", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-1000:]
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["rows", "torch", "skinny"]
    assert [line.split()[0] for line in lines[1:]] == ["1", "4"]
    assert all(float(v) > 0 for line in lines[1:] for v in line.split()[1:])
    empty = subprocess.run([sys.executable, "-m", "specpilot.kernels.cpu.skinny", str(tmp_path)], capture_output=True, text=True,
                           timeout=120)
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1 and "no 2-D weights" in empty.stderr
