"""Exact products of float32 activations with GGUF block codes in bfloat16 arithmetic: the plain-PyTorch oracle.

Why: a matrix unit (AMX's TDPBF16PS, AVX-512's VDPBF16PS) multiplies bf16 by bf16 into float32. A GGUF block
stores small integer codes (Q4_K 0..15, Q6_K -32..31, Q5_0 -16..15, Q8_0 -128..127, Q4_1 0..15), every one
exact in bf16, and a float32 x is exactly the sum of three bf16 pieces. A bf16 x bf16 product has at most 16
significant bits, so every product is exact in float32 and only the float32 sums round, as in an FMA loop.

The arithmetic, which a hardware path must match and this module states in plain PyTorch:
- x = hi + mid + lo, each piece bf16 (truncations: hi = x's top 16 bits, mid = (x - hi)'s, lo = the rest);
- per sub-block j of a weight row (32 weights; 16 for Q6_K), S_j = sum over its k of (hi + mid + lo) * q,
  accumulated in float32, and the row's sum sx_j of x;
- y = sum over j of a_j * S_j - b_j * sx_j in float32, where w = a * q - b is the block's own weight
  (a = d * sc, b = dmin * m for Q4_K; both exact in float32).

What may differ from transformers' float32 product with the dequantised weights: the rounding of the sums,
and the scale factored out of a sub-block (a * sum(x q) - b * sum(x) instead of sum(x (a q - b)), whose
weights gguf rounds once more for Q4_K and Q4_1).

The units flush subnormal inputs and outputs to zero, so a row is first scaled by a power of two (exact)
until its smallest piece and every partial sum are normal; a row that cannot be (non-finite values, or a
range wider than float32 allows) is refused and takes the plain float32 product, as the FMA path computes it.
"""

from __future__ import annotations

import numpy as np
import torch

from specpilot.kernels.reference.gguf_ref import QK_K, f16_values, nibbles, as_raw, dequantize, q4_k_scales, qtype_id, FORMATS

MIN_NORMAL_EXP = -126  # float32's and bfloat16's smallest normal exponent
# Every piece of x is a multiple of x's ulp, 2^(e - 23), and so is every exact sum of pieces times integer
# codes: all of them are normal (and the pieces exact in bf16) when e - 23 >= -126.
PIECE_SPAN = 23
MAX_EXP = 100  # headroom under float32's 127 for products with codes up to 128 and K-long sums


def _truncate(x: torch.Tensor) -> torch.Tensor:
    """The bf16 value whose bits are x's top 16 (truncation: x minus it is exact in float32)."""
    return (x.view(torch.int32) & -65536).view(torch.float32)


def split3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hi, mid, lo) in bfloat16 with hi + mid + lo == x exactly, for finite x whose every nonzero value is at
    least 2^-103 in size (bf16 cannot hold a subnormal float32's low bits): scale a row by `row_shift` first."""
    x = x.float().contiguous()
    hi = _truncate(x)
    rest = x - hi
    mid = _truncate(rest)
    lo = rest - mid
    return hi.bfloat16(), mid.bfloat16(), lo.bfloat16()


def row_shift(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x [M, K]: (the power-of-two exponent s that makes every piece and partial sum of x * 2^s
    normal, whether the row is refused). s is 0 for every row of ordinary activations."""
    x = x.float()
    finite = torch.isfinite(x).all(dim=-1)
    mag = x.abs()
    nonzero = mag > 0
    _, exps = torch.frexp(torch.where(nonzero, mag, torch.ones_like(mag)))
    e = exps.to(torch.int64) - 1  # floor(log2 |x|) for x != 0
    big = torch.iinfo(torch.int64).max
    e_min = torch.where(nonzero, e, torch.full_like(e, big)).min(dim=-1).values
    e_max = torch.where(nonzero, e, torch.full_like(e, -big)).max(dim=-1).values
    any_nonzero = nonzero.any(dim=-1)
    shift = torch.where(any_nonzero, (MIN_NORMAL_EXP + PIECE_SPAN - e_min).clamp(min=0), torch.zeros_like(e_min))
    refused = ~finite | (any_nonzero & (e_max + shift > MAX_EXP))
    return torch.where(refused, torch.zeros_like(shift), shift), refused


def codes_and_scales(raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight's blocks as (codes float32 [N, K] holding integers, a [N, J], b [N, J]) with w = a * q - b per
    sub-block of K / J weights, a and b exact in float32 (products of a float16 and a small integer)."""
    t = qtype_id(qtype)
    name, block, size = FORMATS[t]
    if t in (0, 1):
        raise ValueError(f"{name} has no integer codes; it is multiplied as float32")
    b = as_raw(raw, t, n, k).reshape(-1, size)
    nb = b.shape[0]
    if t == 3:  # Q4_1: w = d q + m
        d, m = f16_values(b[:, 0:2]), f16_values(b[:, 2:4])
        q, a, off = nibbles(b[:, 4:20]).float(), d, -m
    elif t == 6:  # Q5_0: w = d (q - 16)
        qh = b[:, 2:6].long()
        qh = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24
        hi = (qh[:, None] >> torch.arange(32)) & 1
        q = ((nibbles(b[:, 6:22]) | hi << 4) - 16).float()
        a = f16_values(b[:, 0:2])
        off = torch.zeros_like(a)
    elif t == 8:  # Q8_0: w = d q
        q, a = b[:, 2:34].contiguous().view(torch.int8).float(), f16_values(b[:, 0:2])
        off = torch.zeros_like(a)
    elif t == 12:  # Q4_K: w = (d sc) q - dmin m, per 32
        d, dmin = f16_values(b[:, 0:2]), f16_values(b[:, 2:4])
        sc, mn = q4_k_scales(b[:, 4:16])
        a, off = d * sc.float(), dmin * mn.float()
        q = nibbles(b[:, 16:144].reshape(nb, 4, 32)).reshape(nb, QK_K).float()
    elif t == 14:  # Q6_K: w = (d scale) q, per 16
        ql = nibbles(b[:, 0:128].reshape(nb, 2, 64)).reshape(nb, 2, 4, 32)
        qh = b[:, 128:192].long().reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4, 1)
        q = ((ql | (qh & 3) << 4) - 32).reshape(nb, QK_K).float()
        a = f16_values(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()
        off = torch.zeros_like(a)
    else:
        raise ValueError(f"no codes for {name}")
    a, off = a.reshape(n, -1), off.reshape(n, -1)
    return q.reshape(n, k), a, off


class Bf16x3Matrix:
    """A GGUF weight's codes and sub-block scales, decoded once, multiplied by the arithmetic above. The codes
    are kept as float32 integers laid out per sub-block, [J, K / J, N], the operand a batched product takes as
    is: converting and transposing them on every call cost more than the products (a model-level test calls
    each matrix once a token)."""

    def __init__(self, raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int) -> None:
        self.raw, self.qtype, self.n, self.k = raw, qtype, n, k
        q, self.a, self.b = codes_and_scales(raw, qtype, n, k)
        self.j = self.a.shape[1]
        self.codes = q.reshape(n, self.j, k // self.j).permute(1, 2, 0).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """y [M, N] = x [M, K] @ W.T; refused rows take the plain float32 product with the dequantised W."""
        x = x.reshape(-1, self.k).float()
        m, j, c = x.shape[0], self.j, self.k // self.j
        shift, refused = row_shift(x)
        scale = torch.ldexp(torch.ones(m, dtype=torch.float32), shift.to(torch.int32))[:, None]
        xs = torch.where(refused[:, None], torch.zeros_like(x), x * scale)  # exact: a power of two
        sums = torch.zeros(j, m, self.n, dtype=torch.float32)
        for piece in split3(xs):
            sums = sums + torch.bmm(piece.float().reshape(m, j, c).transpose(0, 1), self.codes)
        sums = sums.permute(1, 2, 0)  # [M, N, J]
        sx = xs.reshape(m, j, c).sum(-1)
        y = (self.a[None] * sums - self.b[None] * sx[:, None, :]).sum(-1) / scale  # exact: a power of two
        if bool(refused.any()):
            y[refused] = x[refused] @ dequantize(self.raw, self.qtype, self.n, self.k).T
        return y


def matmul(x: torch.Tensor, raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T by the arithmetic above (see Bf16x3Matrix)."""
    return Bf16x3Matrix(raw, qtype, n, k)(x)
