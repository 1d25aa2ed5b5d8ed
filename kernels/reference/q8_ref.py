"""The q8 numerics in plain PyTorch: the oracle the C kernel (kernels/cpu/q8_blocks.c) must equal bit for bit.

q8 is llama.cpp's arithmetic for a GGUF deployment, written down once here:

1. **Activations.** Each row x [K] is quantised per block of QA = 256 values as llama.cpp's `quantize_row_q8_K`
   does (the last block of a row whose K is not a multiple of 256 is shorter; K is a multiple of 32):
   `max` is the value of largest magnitude (the first one, signed); `iscale = -127 / max` (float32 division);
   `q = min(127, nearest_even(iscale * x))` (the product rounded to float32 first); `d = 1 / iscale`
   (float32); a block that is all zeros has d = 0 and q = 0. `bsums` are the sums of each 16 q's.
2. **Products in integers.** A weight block's codes times the activation's q, summed over the block, times
   the block's integer sub-scales, is an exact integer (int32 per 256-superblock or 32-block): its order does
   not matter.
3. **One float combination per weight block**, each operation rounded to float32 (no fused multiply-add):
   - Q4_K (256): t = (dx * d) * f(Σ_j sc_j Σ q·qx) - (dx * dmin) * f(Σ_j m_j (bsum_2j + bsum_2j+1))
   - Q6_K (256): t = (dx * d) * f(Σ_j sc_j Σ (q - 32)·qx)          (16 sub-blocks of 16)
   - Q8_0 (32):  t = (dx * d) * f(Σ q·qx)
   - Q5_0 (32):  t = (dx * d) * f(Σ (q - 16)·qx)
   - Q4_1 (32):  t = (dx * d) * f(Σ q·qx) + (dx * m) * f(Σ qx)
   where d, dmin, m are the block's float16 fields widened to float32, dx is the scale of the activation block
   that holds the weight block, and f() converts an int32 to float32 (round to nearest even).
4. **The sum over a row's blocks** runs in block order from 0.0: y = (((0 + t_0) + t_1) + ...) + t_last.

So a row's result depends on that row alone: never on how many rows share a call, how they are grouped, or
how output rows are split over threads. Everything else in a q8 forward (norms, RoPE, attention, softmax)
stays float32; the LM head is a product like any other and takes this arithmetic too, as in llama.cpp.
F32 and F16 matrices have no integer codes: q8 refuses them (UnsupportedBlockType).
Integer sums run in int64 here (exact); the kernel's int32 cannot overflow: |Σ| < 2^31 for every type.
"""

from __future__ import annotations

import numpy as np
import torch

from specpilot.kernels.reference.gguf_ref import FORMATS, UnsupportedBlockType, f16_values, nibbles, as_raw, \
    q4_k_scales, qtype_id

QA = 256  # activation block: values per scale
Q8_TYPES = {3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}


class Q8Activations:
    """A batch of quantised activation rows: q int8 [M, K], d float32 [M, ceil(K / 256)], bsums int32
    [M, K / 16]."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, bsums: torch.Tensor) -> None:
        self.q, self.d, self.bsums = q, d, bsums

    @property
    def k(self) -> int:
        return self.q.shape[1]


def check_q8_type(qtype: int | str, name: str = "") -> int:
    """The type id if q8 multiplies it in integers; UnsupportedBlockType naming the tensor otherwise."""
    t = qtype_id(qtype)
    if t not in Q8_TYPES:
        where = f"tensor {name} is " if name else ""
        raise UnsupportedBlockType(f"{where}{FORMATS[t][0]}, which numerics q8 does not multiply (it takes "
                                   f"{', '.join(Q8_TYPES.values())}); use --numerics f32")
    return t


def quantize(x: torch.Tensor) -> Q8Activations:
    """x [M, K] float32 (K a multiple of 32) -> its q8 activations, as step 1 of the module docstring."""
    x = x.float().contiguous()
    m, k = x.shape
    if k % 32:
        raise ValueError(f"q8 activations need K a multiple of 32, not {k}")
    nblk = (k + QA - 1) // QA
    q = torch.zeros(m, k, dtype=torch.int8)
    d = torch.zeros(m, nblk, dtype=torch.float32)
    for b in range(nblk):
        xb = x[:, b * QA: min(k, (b + 1) * QA)]
        idx = xb.abs().argmax(dim=1, keepdim=True)  # torch.argmax returns the first maximal index
        mx = xb.gather(1, idx)
        nz = mx != 0
        iscale = torch.where(nz, torch.tensor(-127.0) / torch.where(nz, mx, torch.ones_like(mx)),
                             torch.zeros_like(mx))
        qb = torch.round(iscale * xb).clamp(max=127)
        q[:, b * QA: b * QA + xb.shape[1]] = torch.where(nz, qb, torch.zeros_like(qb)).to(torch.int8)
        d[:, b] = torch.where(nz, torch.tensor(1.0) / torch.where(nz, iscale, torch.ones_like(iscale)),
                              torch.zeros_like(iscale))[:, 0]
    bsums = q.long().view(m, k // 16, 16).sum(-1).to(torch.int32)
    return Q8Activations(q, d, bsums)


def _codes(raw: torch.Tensor, t: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Integer codes [N, nblocks, block] (int64, offsets already subtracted) and the float/int fields of
    every block of a raw weight [N, row_bytes]."""
    name, block, size = FORMATS[t]
    n = raw.shape[0]
    b = raw.reshape(-1, size)
    nb = b.shape[0]
    f: dict[str, torch.Tensor] = {}
    if t == 8:  # Q8_0
        f["d"] = f16_values(b[:, 0:2])[:, 0]
        codes = b[:, 2:34].contiguous().view(torch.int8).long()
    elif t == 6:  # Q5_0
        f["d"] = f16_values(b[:, 0:2])[:, 0]
        qh = b[:, 2:6].long()
        qh = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24
        hi = (qh[:, None] >> torch.arange(32)) & 1
        codes = (nibbles(b[:, 6:22]) | hi << 4) - 16
    elif t == 3:  # Q4_1
        f["d"], f["m"] = f16_values(b[:, 0:2])[:, 0], f16_values(b[:, 2:4])[:, 0]
        codes = nibbles(b[:, 4:20])
    elif t == 12:  # Q4_K
        f["d"], f["dmin"] = f16_values(b[:, 0:2])[:, 0], f16_values(b[:, 2:4])[:, 0]
        f["sc"], f["mn"] = q4_k_scales(b[:, 4:16])
        codes = nibbles(b[:, 16:144].reshape(nb, 4, 32)).reshape(nb, 256)
    elif t == 14:  # Q6_K
        ql = nibbles(b[:, 0:128].reshape(nb, 2, 64)).reshape(nb, 2, 4, 32)
        qh = b[:, 128:192].long().reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4, 1)
        codes = ((ql | (qh & 3) << 4) - 32).reshape(nb, 256)
        f["sc"] = b[:, 192:208].contiguous().view(torch.int8).long()
        f["d"] = f16_values(b[:, 208:210])[:, 0]
    else:
        raise UnsupportedBlockType(f"q8 has no integer product for {name}")
    per_row = nb // n
    return codes.reshape(n, per_row, block), {k_: v.reshape(n, per_row, *v.shape[1:]) for k_, v in f.items()}


def block_terms(xq: Q8Activations, raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int) -> torch.Tensor:
    """Step 3: t [M, N, nblocks] float32, one float combination per weight block."""
    t = check_q8_type(qtype)
    if xq.k != k:
        raise ValueError(f"activations have {xq.k} features; the weight [{n}, {k}] takes {k}")
    _, block, _ = FORMATS[t]
    codes, f = _codes(as_raw(raw, t, n, k), t)
    nb = k // block
    qx = xq.q.long().view(-1, nb, block)  # [M, nb, block]
    dx = xq.d[:, (torch.arange(nb) * block) // QA]  # [M, nb]: the activation block holding each weight block
    # exact integer dot products per sub-block, [M, N, nb, subblocks]
    sub = {12: 32, 14: 16}.get(t, block)
    prod = torch.einsum("mbi,nbi->mnbi", qx, codes).reshape(qx.shape[0], n, nb, block // sub, sub).sum(-1)
    a = dx[:, None, :] * f["d"][None]  # dx * d, float32
    if t == 12:
        isum = (prod * f["sc"][None]).sum(-1)
        bs = xq.bsums.long().view(-1, nb, 16)  # 16 bsums per superblock
        msum = ((bs[:, :, 0::2] + bs[:, :, 1::2])[:, None] * f["mn"][None]).sum(-1)
        return a * isum.float() - (dx[:, None, :] * f["dmin"][None]) * msum.float()
    if t == 14:
        return a * (prod * f["sc"][None]).sum(-1).float()
    isum = prod[..., 0]
    if t == 3:
        xsum = qx.sum(-1)  # [M, nb]
        return a * isum.float() + (dx[:, None, :] * f["m"][None]) * xsum[:, None, :].float()
    return a * isum.float()


def matmul(x: torch.Tensor, raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T in the q8 numerics (module docstring), float32."""
    terms = block_terms(quantize(x.reshape(-1, k)), raw, qtype, n, k)
    acc = torch.zeros(terms.shape[:2], dtype=torch.float32)
    for b in range(terms.shape[2]):
        acc = acc + terms[:, :, b]
    return acc.reshape(*x.shape[:-1], n)
