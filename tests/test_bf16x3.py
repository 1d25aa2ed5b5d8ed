"""The exact bf16x3 arithmetic for GGUF blocks (kernels/reference/bf16x3.py): the split, refused rows, and the product's
error against float64 within float32's own bound, per block type; on every CPU (it is the oracle a matrix-unit
path is tested against). The model-level check, greedy identity on SmolLM2, is in test_real_deployment.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specpilot.kernels.reference import bf16x3, gguf_ref
from specpilot.kernels.reference.gguf_ref import FORMATS, random_blocks

QUANTS = ["Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
U = 2.0 ** -24  # float32's unit roundoff
FMAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).tiny)  # smallest normal


def k_for(q: str, blocks: int = 3) -> int:
    return blocks * FORMATS[gguf_ref.qtype_id(q)][1]


def exact_sum(pieces: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return sum(p.double() for p in pieces)


def test_split_is_exact_on_values_of_every_scale():
    gen = torch.Generator().manual_seed(0)
    mant = torch.rand(20000, generator=gen) + 0.5
    exps = torch.randint(-102, 120, (20000,), generator=gen)
    sign = torch.where(torch.rand(20000, generator=gen) < 0.5, -1.0, 1.0)
    x = (sign * torch.ldexp(mant, exps)).float()
    hi, mid, lo = bf16x3.split3(x)
    assert hi.dtype == mid.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(exact_sum((hi, mid, lo)), x.double())
    assert torch.equal((hi.float() + mid.float()) + lo.float(), x)  # and in float32, in the units' order
    assert bool((hi.float().abs() <= x.abs()).all())  # truncation, not rounding: the rest keeps x's sign
    # most float32 values need all three pieces
    assert (lo != 0).float().mean() > 0.9


@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, -1.0, FMAX, -FMAX, TINY, -TINY, 1.0 + 2 ** -23,
                                   -(1.0 + 2 ** -23) * 2 ** -100, 3.0e-39, -1.4e-45, 2 ** -130])
def test_split_edge_values(value):
    """Each value alone in a row, shifted as a hardware path shifts it: exact pieces, none subnormal."""
    x = torch.tensor([[value]], dtype=torch.float32)
    shift, refused = bf16x3.row_shift(x)
    if abs(value) > 2.0 ** bf16x3.MAX_EXP:  # no headroom left for sums: the row takes the float32 product
        assert bool(refused[0]) and torch.equal(exact_sum(bf16x3.split3(x)), x.double())
        return
    assert not bool(refused[0])
    xs = torch.ldexp(x, shift.to(torch.int32)[:, None])
    assert torch.equal(torch.ldexp(xs, -shift.to(torch.int32)[:, None]), x)  # the shift is exact both ways
    pieces = bf16x3.split3(xs)
    assert torch.equal(exact_sum(pieces), xs.double())
    assert math.copysign(1.0, float(pieces[0])) == math.copysign(1.0, value)  # -0.0 stays -0.0
    for p in pieces:
        assert float(p) == 0.0 or abs(float(p)) >= TINY
    if abs(value) >= 2 ** -100:
        assert shift[0] == 0  # ordinary values are never shifted


def test_rows_with_subnormal_pieces_are_scaled_and_non_finite_rows_refused():
    x = torch.tensor([[1.0, 0.5, -3.0],            # ordinary: no shift
                      [1e-35, 2e-36, 0.0],         # pieces would be subnormal: shifted up by a power of two
                      [3.0e-39, 0.0, 0.0],         # itself subnormal: shifted
                      [1.0, float("inf"), 0.0],    # refused
                      [float("nan"), 1.0, 2.0],    # refused
                      [1e30, 1e-40, 0.0],          # a range float32 cannot hold once shifted: refused
                      [0.0, 0.0, 0.0]])            # zeros: no shift
    shift, refused = bf16x3.row_shift(x)
    assert refused.tolist() == [False, False, False, True, True, True, False]
    assert shift[0] == 0 and shift[6] == 0 and shift[1] > 0 and shift[2] > shift[1]
    for row in (1, 2):
        scaled = torch.ldexp(x[row], shift[row].to(torch.int32).expand(3))
        pieces = bf16x3.split3(scaled)
        assert torch.equal(exact_sum(pieces), scaled.double())
        for p in pieces:  # every nonzero piece normal after the shift: the units flush subnormals
            nz = p.float()[p.float() != 0]
            assert bool((nz.abs() >= TINY).all())


def bound_check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(the largest error relative to float32's a-priori dot-product bound, the error relative to sum |x w|)."""
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    k = x.shape[1]
    err = (y.double() - ref).abs()
    # gamma_{K+2}: K float32 additions and the factored scale, plus the weight rounding gguf makes
    allowed = (k + 2) * U * mag + 1e-300
    return float((err / allowed).max()), err / mag.clamp_min(1e-300)


@pytest.mark.parametrize("q", QUANTS)
@pytest.mark.parametrize("rows", [1, 3, 5, 16, 17, 48])
def test_product_within_float32_bound_against_float64(q, rows):
    n, k = 37, k_for(q)
    raw = random_blocks(q, n, k, np.random.default_rng(rows))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows))
    x[0, :7] *= 1e-3  # mixed magnitudes within a row
    w = gguf_ref.dequantize(raw, q, n, k)
    y = bf16x3.matmul(x, raw, q, n, k)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    worst, rel = bound_check(y, x, w)
    assert worst <= 1.0, f"{q}: error {worst:.2f}x float32's bound"
    # and of the FMA path's size: a plain float32 product of the same weights
    _, fma_rel = bound_check(x @ w.T, x, w)
    assert float(rel.median()) <= 4 * float(fma_rel.median()) + 4 * U


@pytest.mark.parametrize("q", QUANTS)
def test_codes_and_scales_rebuild_the_weights(q):
    n, k = 5, k_for(q, 2)
    raw = random_blocks(q, n, k, np.random.default_rng(7))
    codes, a, b = bf16x3.codes_and_scales(raw, q, n, k)
    assert torch.equal(codes, codes.round()) and codes.abs().max() <= 128
    assert torch.equal(codes.bfloat16().float(), codes)  # every code exact in bf16
    j = a.shape[1]
    rebuilt = (a.double()[:, :, None] * codes.double().reshape(n, j, -1) - b.double()[:, :, None]).reshape(n, k)
    w = gguf_ref.dequantize(raw, q, n, k).double()
    # gguf rounds a q - b once in float32 (Q4_K, Q4_1); otherwise the weights are the same numbers
    assert bool(((rebuilt - w).abs() <= U * w.abs() + 1e-300).all())
    if q in ("Q5_0", "Q8_0", "Q6_K"):
        assert torch.equal(rebuilt, w)


def test_scaled_and_refused_rows_in_a_product():
    q, n = "Q4_K", 11
    k = k_for(q, 1)
    raw = random_blocks(q, n, k, np.random.default_rng(3))
    w = gguf_ref.dequantize(raw, q, n, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    x[1] *= 1e-36  # every piece subnormal unless scaled
    x[2, 4] = float("inf")
    y = bf16x3.matmul(x, raw, q, n, k)
    worst, _ = bound_check(y[:2], x[:2], w)
    assert worst <= 1.0 and bool((y[1] != 0).any())  # not flushed to zero
    assert torch.equal(torch.isnan(y[2]), torch.isnan(x[2:] @ w.T)[0])  # refused: the float32 product's
