"""Batch-invariant attention in plain PyTorch: the oracle kernels/cpu/attention.c must equal bit for bit.

Why: q8 numerics promise that speculative decoding gives the bits plain decoding gives. So a query row's
attention output must be a function of its q vector and the SEQUENCE of (k, v) vectors it sees, in slot
order, and of nothing else: not the slots they sit at (a tree's ancestors are scattered; after compaction
they are consecutive), not the other rows of the call (a batch with other cache lengths, a verify chain or
tree, a prompt), not the thread count. SDPA gives none of that (its blocking follows slot numbers and the
shapes of the call). The arithmetic is written down once here, every operation float32 and rounded (no
fused multiply-add); for one query row (b, h, t), whose kv head is h // (H // Hkv):

1. **The visible list.** idx = the slots s < S with visible[b, t, s], in slot order (all slots without a
   mask); n = len(idx). Everything below is indexed by the compacted i = 0..n-1, never by slot. A row that
   sees no slot gets NaN.
2. **Scores.** D is zero-padded to a multiple of 16. dot_i = q . k_idx[i] over 16 lanes (lane l holds
   d = 16c + l): acc = q_0 * k_0 (the first 16 values), then acc = acc + q_c * k_c for c = 1 .. D/16 - 1;
   then the fixed tree `tree16`: a_l + a_(l+8), then + (l+4), then + (l+2), then lane 0 + lane 1.
3. **Weights.** m = max_i dot_i (exact); x_i = (dot_i - m) * cs, where cs = f32(scale) * f32(log2 e)
   rounded to float32 (`softmax_constant`; scale defaults to 1/sqrt(D) of the unpadded D); p_i = exp2(x_i).
4. **exp2** (`exp2`), for x <= 0: xc = max(x, -126); n = rint(xc) (ties to even); f = xc - n (exact,
   |f| <= 1/2); the degree-6 polynomial `EXP2_COEFFS` by Horner from the top, p = c6 * f + c5, p = p * f +
   c4, ..., p * f + c0, each product and sum rounded; times 2^n (exact: built from the exponent bits); 0
   where x < -125, so every non-zero weight is a normal float. Accuracy: at most 1.2 ulp from 2^x (float32
   Horner measured against float64 over every f of the range; tests/test_attention_invariance.py holds it
   below 1.5 ulp on a dense grid). exp2(0) = 1 exactly, so the largest score weighs exactly 1.
5. **The sum.** l: 16 lane sums of p_i (lane i mod 16), chunk after chunk from i = 0 (zeros past n), then
   `tree16`.
6. **The output.** o[d] = (...((0 + p_0 * v_0[d]) + p_1 * v_1[d]) + ...) + p_(n-1) * v_(n-1)[d], in i order
   (one chain per d); out[d] = o[d] / l (one correctly rounded division).

Every step depends on the row's own q and its visible (k, v) in order, and no step's grouping depends on n
except through zeros, which leave float32 sums unchanged (p >= +0, so a lane never holds -0). The C kernel
computes the same on 16-lane vectors (one zmm, or two ymm: both builds give these bits). Slow; meant for
small shapes in tests.
"""

from __future__ import annotations

import math

import numpy as np
import torch

LANES = 16
LOG2E = 1.4426950408889634
# 2^f on [-1/2, 1/2], c0..c6 (float32; c0 = 1 exactly); the same hex floats as C0..C6 in attention.c
EXP2_COEFFS = tuple(float.fromhex(h) for h in (
    "0x1.000000p+0", "0x1.62e430p-1", "0x1.ebfbdcp-3", "0x1.c6aee8p-5", "0x1.3b2d4cp-7", "0x1.5f3e54p-10",
    "0x1.41fbbep-13"))
FLUSH_BELOW = -125.0  # exp2(x) = 0 for x below this
CLAMP = -126.0


def softmax_constant(scale: float | None, head_dim: int) -> float:
    """cs = f32(scale) * f32(log2 e), rounded to float32 (scale None: 1 / sqrt(head_dim))."""
    s = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    return float(np.float32(s) * np.float32(LOG2E))


def exp2(x: torch.Tensor) -> torch.Tensor:
    """2^x for float32 x <= 0 as step 4 of the module docstring computes it (x > 0 is outside its domain)."""
    x = x.float()
    c = torch.tensor(EXP2_COEFFS, dtype=torch.float32)
    xc = torch.clamp(x, min=CLAMP)
    n = torch.round(xc)
    f = xc - n
    p = c[6] * f
    p = p + c[5]
    for j in (4, 3, 2, 1, 0):
        p = p * f
        p = p + c[j]
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(x < FLUSH_BELOW, torch.zeros_like(p), p * scale)


def tree16(a: torch.Tensor) -> torch.Tensor:
    """The fixed sum of the last dim's 16 lanes: (l + l+8), (l + l+4), (l + l+2), lane 0 + lane 1."""
    a = a[..., :8] + a[..., 8:]
    a = a[..., :4] + a[..., 4:]
    a = a[..., :2] + a[..., 2:]
    return a[..., 0] + a[..., 1]


def dots(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [H, D] . k [H, n, D] -> [H, n] in the 16-lane order (D a multiple of 16)."""
    C = q.shape[-1] // LANES
    prod = q[:, None, :].reshape(q.shape[0], 1, C, LANES) * k.reshape(*k.shape[:2], C, LANES)
    acc = prod[:, :, 0]
    for c in range(1, C):
        acc = acc + prod[:, :, c]
    return tree16(acc)


def lane_sum(p: torch.Tensor) -> torch.Tensor:
    """Σ p [H, n] over n as 16 lane sums (lane i mod 16, chunks in order) and then tree16."""
    H, n = p.shape
    chunks = torch.nn.functional.pad(p, (0, -n % LANES)).reshape(H, -1, LANES)
    acc = torch.zeros(H, LANES, dtype=torch.float32)
    for j in range(chunks.shape[1]):
        acc = acc + chunks[:, j]
    return tree16(acc)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v per row over its visible slots: q [B, H, T, D], k and v [B, Hkv, S, D],
    visible bool [B, T, S] (or [1, T, S]) or None (every slot visible) -> float32 [B, H, T, D]."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"{H} query heads do not split into {Hkv} kv heads")
    cs = softmax_constant(scale, D)
    pad = -D % LANES
    q, k, v = (torch.nn.functional.pad(t.float(), (0, pad)) for t in (q, k, v))
    heads = torch.arange(H) // (H // Hkv)
    out = torch.empty(B, H, T, D + pad, dtype=torch.float32)
    for b in range(B):
        for t in range(T):
            if visible is None:
                idx = torch.arange(S)
            else:
                idx = visible[b if visible.shape[0] > 1 else 0, t].nonzero()[:, 0]
            n = idx.numel()
            if n == 0:
                out[b, :, t] = float("nan")
                continue
            kk, vv = k[b][heads][:, idx], v[b][heads][:, idx]  # [H, n, D]
            dot = dots(q[b, :, t], kk)
            x = (dot - dot.max(dim=1, keepdim=True).values) * torch.tensor(cs, dtype=torch.float32)
            p = exp2(x)
            l = lane_sum(p)
            o = torch.zeros(H, D + pad, dtype=torch.float32)
            for i in range(n):
                o = o + p[:, i:i + 1] * vv[:, i]
            out[b, :, t] = o / l[:, None]
    return out[..., :D]


# ---- silu(gate) * up, one arithmetic for every element (kernels/cpu/attention.c's attn_silu_mul) ----------
# torch's F.silu computes a tensor's vectorised body and its scalar tail differently (about 4% of values differ
# in the last bit), so a value's bits can depend on where it falls in a call (a row width that is not a multiple
# of 32, a thread split inside a row). This one is elementwise float32 ops only, each rounded:
#   expneg(y), y <= 0: yc = max(y, -87); n = rint(yc * f32(log2 e)); r = (yc - n * LN2_HI) - n * LN2_LO;
#   Horner of EXP_COEFFS (c6 * r + c5, then * r + c4, ...); times 2^n; 0 where y < -86.5 (<= 1.3 ulp from e^y);
#   silu(x) = (x < 0 ? x * t : x) / (1 + t) with t = expneg(-|x|); then times up.
LN2_HI = float.fromhex("0x1.62e400p-1")
LN2_LO = float.fromhex("0x1.7f7d1cp-20")
EXP_COEFFS = tuple(float.fromhex(h) for h in (
    "0x1.000000p+0", "0x1.000000p+0", "0x1.fffffcp-2", "0x1.55541ap-3", "0x1.555824p-5", "0x1.1267b4p-7",
    "0x1.6ae702p-10"))


def expneg(y: torch.Tensor) -> torch.Tensor:
    """e^y for float32 y <= 0, as attn_silu_mul computes it."""
    f = lambda c: torch.tensor(c, dtype=torch.float32)  # noqa: E731
    y = y.float()
    yc = torch.clamp(y, min=-87.0)
    n = torch.round(yc * f(LOG2E))
    r = yc - n * f(LN2_HI)
    r = r - n * f(LN2_LO)
    c = torch.tensor(EXP_COEFFS, dtype=torch.float32)
    p = c[6] * r
    p = p + c[5]
    for j in (4, 3, 2, 1, 0):
        p = p * r
        p = p + c[j]
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(y < -86.5, torch.zeros_like(p), p * scale)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up elementwise in float32, in the fixed arithmetic above."""
    x, u = gate.float(), up.float()
    t = expneg(-x.abs())
    d = 1.0 + t
    return torch.where(x < 0, x * t, x) / d * u
