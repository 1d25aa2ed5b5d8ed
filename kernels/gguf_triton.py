"""GGUF block-format matmul in Triton (CUDA): y = x @ W^T for 1..64 float32 rows, W read as stored.

The twin of kernels/gguf_blocks.c with the same semantics: each weight is dequantised with gguf-py's float32
operations in order (launched with enable_fp_fusion=False so that d * q - m stays two roundings) and the
products are accumulated in float32 (tl.dot with input_precision="ieee" by default; "tf32x3" trades the last
bits for tensor-core speed). Each program owns BLOCK_N weight rows and walks K in BLOCK_K steps; every value
of the tile gathers its own quant byte and its block's scale bytes (L1-resident, a block's header is shared
by 32-256 values), so the stored blocks are read from memory once per call whatever M is.

Importing this module imports Triton; TRITON_INTERPRET=1 must be set before that to run on CPU tensors.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.gguf_ref import FORMATS, as_raw, qtype_id

MAX_ROWS = 64


@triton.jit
def _f16(ptr, off, mask):
    lo = tl.load(ptr + off, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + off + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _decode(w_ptr, row, kc, wm, QTYPE: tl.constexpr):
    """float32 weights W[rows, kc] of one tile, gguf-py's operations in order."""
    if QTYPE == 0:
        w = tl.load(w_ptr + row + kc, mask=wm, other=0.0)
    elif QTYPE == 1:
        w = tl.load(w_ptr + row + kc, mask=wm, other=0.0).to(tl.float32)
    elif QTYPE == 8:  # Q8_0: f16 d, int8 q[32]
        b = row + (kc // 32) * 34
        q = ((_byte(w_ptr, b + 2 + kc % 32, wm) ^ 128) - 128).to(tl.float32)
        w = q * _f16(w_ptr, b, wm)
    elif QTYPE == 3:  # Q4_1: f16 d, f16 m, nibbles (low: values 0-15, high: 16-31)
        b = row + (kc // 32) * 20
        j = kc % 32
        v = _byte(w_ptr, b + 4 + j % 16, wm)
        q = tl.where(j < 16, v & 15, v >> 4).to(tl.float32)
        w = _f16(w_ptr, b, wm) * q + _f16(w_ptr, b + 2, wm)
    elif QTYPE == 6:  # Q5_0: f16 d, 32 fifth bits, nibbles
        b = row + (kc // 32) * 22
        j = kc % 32
        v = _byte(w_ptr, b + 6 + j % 16, wm)
        hb = (_byte(w_ptr, b + 2 + j // 8, wm) >> (j % 8)) & 1
        q = (tl.where(j < 16, v & 15, v >> 4) | (hb << 4)) - 16
        w = _f16(w_ptr, b, wm) * q.to(tl.float32)
    elif QTYPE == 12:  # Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        b = row + (kc // 256) * 144
        j = kc % 256
        sub = j // 32
        s_lo = _byte(w_ptr, b + 4 + sub % 4, wm)
        s_mid = _byte(w_ptr, b + 8 + sub % 4, wm)
        s_hi = _byte(w_ptr, b + 12 + sub % 4, wm)
        sc = tl.where(sub < 4, s_lo & 63, (s_hi & 15) | ((s_lo >> 2) & 0x30))
        mn = tl.where(sub < 4, s_mid & 63, (s_hi >> 4) | ((s_mid >> 2) & 0x30))
        v = _byte(w_ptr, b + 16 + (sub // 2) * 32 + j % 32, wm)
        q = tl.where(sub % 2 == 0, v & 15, v >> 4).to(tl.float32)
        ds = _f16(w_ptr, b, wm) * sc.to(tl.float32)
        dm = _f16(w_ptr, b + 2, wm) * mn.to(tl.float32)
        w = ds * q - dm
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], f16 d
        b = row + (kc // 256) * 210
        j = kc % 256
        h = j // 128
        s = (j % 128) // 32
        l = j % 32
        v = _byte(w_ptr, b + h * 64 + (s % 2) * 32 + l, wm)
        lo = tl.where(s < 2, v & 15, v >> 4)
        hi = (_byte(w_ptr, b + 128 + h * 32 + l, wm) >> (2 * s)) & 3
        q = ((lo | (hi << 4)) - 32).to(tl.float32)
        scale = ((_byte(w_ptr, b + 192 + j // 16, wm) ^ 128) - 128).to(tl.float32)
        w = (_f16(w_ptr, b + 208, wm) * scale) * q
    return w


@triton.jit
def _gguf_kernel(x_ptr, w_ptr, out_ptr, M, N, K, ROW_STRIDE, stride_xm, stride_om,
                 QTYPE: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    row = offs_n[:, None].to(tl.int64) * ROW_STRIDE
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        w = _decode(w_ptr, row, kk[None, :], n_mask[:, None] & k_mask[None, :], QTYPE)
        xk = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None], mask=m_mask[None, :] & k_mask[:, None],
                     other=0.0)
        acc = tl.dot(w, xk, acc, input_precision=PRECISION)
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc, mask=n_mask[:, None] & m_mask[None, :])


INTERPRETING = type(_gguf_kernel).__name__ == "InterpretedFunction"


def weights_view(raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int) -> tuple[torch.Tensor, int]:
    """The raw blocks as the kernel reads them (bytes; float32/float16 elements for F32/F16) and the row
    stride in those elements."""
    t = qtype_id(qtype)
    r = as_raw(raw, t, n, k)
    if t == 0:
        return r.view(torch.float32), k
    if t == 1:
        return r.view(torch.float16), k
    return r, r.shape[1]


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int | str, n: int, k: int, block_n: int = 32,
           block_k: int | None = None, num_warps: int = 4, precision: str = "ieee",
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 (1 <= M <= 64) @ W.T with W the GGUF blocks `raw` [N, row_bytes] on x's device ->
    float32 [M, N] (written into `out` when given, so checks can poison it first)."""
    t = qtype_id(qtype)
    m = x.shape[0]
    if not 1 <= m <= MAX_ROWS or x.shape[1] != k:
        raise ValueError(f"the GGUF Triton kernel takes [1..{MAX_ROWS}, {k}] rows; got {tuple(x.shape)}")
    if not (x.is_cuda or INTERPRETING):
        raise RuntimeError("the GGUF Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before triton "
                           "is imported); use kernels.gguf_blocks or kernels.gguf_ref on the CPU")
    w, stride = weights_view(raw, t, n, k)
    if w.device != x.device:
        raise ValueError(f"x is on {x.device} but the blocks are on {w.device}")
    block = FORMATS[t][1]
    bk = block_k or (256 if block == 256 else 64)
    if bk % min(block, 32) or (block == 256 and bk % 256):
        raise ValueError(f"block_k {bk} must be a multiple of the {FORMATS[t][0]} block")
    x = x.float().contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    grid = (triton.cdiv(n, block_n),)
    _gguf_kernel[grid](x, w, out, m, n, k, stride, x.stride(0), out.stride(0), QTYPE=t, PRECISION=precision,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, num_warps=num_warps,
                       enable_fp_fusion=False)
    return out


class GGUFTritonMatrix:
    """A weight kept in its GGUF blocks on a CUDA device; calling it on x [..., K] gives float32 [..., N]
    (rows beyond 64 in chunks of 64)."""

    def __init__(self, raw: np.ndarray | torch.Tensor, qtype: int | str, n: int, k: int,
                 device: str | torch.device = "cuda") -> None:
        self.qtype = qtype_id(qtype)
        self.n, self.k = int(n), int(k)
        self.raw = as_raw(raw, self.qtype, self.n, self.k).to(device)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.k).float()
        out = torch.empty(rows.shape[0], self.n, dtype=torch.float32, device=rows.device)
        for m0 in range(0, rows.shape[0], MAX_ROWS):
            chunk = rows[m0:m0 + MAX_ROWS]
            matmul(chunk, self.raw, self.qtype, self.n, self.k, out=out[m0:m0 + MAX_ROWS])
        return out.view(*lead, self.n)
