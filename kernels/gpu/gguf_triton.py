"""GGUF block-format matmul in Triton (CUDA): y = x @ W^T for 1..64 float32 rows, W read as stored.

The twin of kernels/cpu/gguf_blocks.c with the same semantics: each weight is dequantised with gguf-py's float32
operations in order (launched with enable_fp_fusion=False so that d * q - m stays two roundings) and the
products are accumulated in float32 (tl.dot with input_precision="ieee" by default; "tf32x3" trades the last
bits for tensor-core speed). Each program owns BLOCK_N weight rows and walks K in BLOCK_K steps; every value
of a 32-value-block tile gathers its own quant byte and its block's scale bytes (L1-resident, a header is shared
by 32 values), so the stored blocks are read from memory once per call whatever M is. The K-quants
(Q4_K, Q6_K: most of a Qwen2.5 checkpoint) instead load each 256-value block's bytes as contiguous row slices
and its scales once per sub-block, and spread them to the values with join/permute/reshape.

Importing this module imports Triton; TRITON_INTERPRET=1 must be set before that to run on CPU tensors.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from specpilot.kernels.reference.gguf_ref import FORMATS, as_raw, qtype_id

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
def _spread(v, BN: tl.constexpr, GROUPS: tl.constexpr):
    """[BN, GROUPS] per-group values -> [BN, 256], each repeated over its 256 / GROUPS consecutive values."""
    return tl.broadcast_to(v[:, :, None], (BN, GROUPS, 256 // GROUPS)).reshape(BN, 256)


@triton.jit
def _decode_superblock(w_ptr, row, k0, nm, QTYPE: tl.constexpr, BN: tl.constexpr):
    """One 256-value block per row of the tile (BLOCK_K = 256): the bytes are loaded as contiguous row
    slices and the scales once per sub-block, then spread to the values with join/permute/reshape, so the
    decode costs a few loads per 32 values instead of a gather per value."""
    if QTYPE == 12:  # Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        b = row + (k0 // 256) * 144
        sub = tl.arange(0, 8)[None, :]
        s_lo = _byte(w_ptr, b + 4 + sub % 4, nm)
        s_mid = _byte(w_ptr, b + 8 + sub % 4, nm)
        s_hi = _byte(w_ptr, b + 12 + sub % 4, nm)
        sc = tl.where(sub < 4, s_lo & 63, (s_hi & 15) | ((s_lo >> 2) & 0x30))
        mn = tl.where(sub < 4, s_mid & 63, (s_hi >> 4) | ((s_mid >> 2) & 0x30))
        ds = _f16(w_ptr, b, nm) * sc.to(tl.float32)
        dm = _f16(w_ptr, b + 2, nm) * mn.to(tl.float32)
        v = _byte(w_ptr, b + 16 + tl.arange(0, 128)[None, :], nm)
        # bytes 32c + l hold value 64c + l (low nibble) and 64c + 32 + l (high nibble)
        q = tl.join(v & 15, v >> 4).reshape(BN, 4, 32, 2).permute(0, 1, 3, 2).reshape(BN, 256)
        w = _spread(ds, BN, 8) * q.to(tl.float32) - _spread(dm, BN, 8)
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], f16 d
        b = row + (k0 // 256) * 210
        v = _byte(w_ptr, b + tl.arange(0, 128)[None, :], nm)
        # byte h*64 + t holds value h*128 + t (low nibble) and h*128 + 64 + t (high nibble)
        lo = tl.join(v & 15, v >> 4).reshape(BN, 2, 64, 2).permute(0, 1, 3, 2).reshape(BN, 256)
        x = _byte(w_ptr, b + 128 + tl.arange(0, 64)[None, :], nm)
        # byte h*32 + l holds the high bits of value h*128 + s*32 + l at bits 2s, 2s + 1
        pairs = tl.join(tl.join(x & 3, (x >> 2) & 3), tl.join((x >> 4) & 3, x >> 6))
        hi = pairs.reshape(BN, 2, 32, 2, 2).permute(0, 1, 4, 3, 2).reshape(BN, 256)
        q = ((lo | (hi << 4)) - 32).to(tl.float32)
        scale = ((_byte(w_ptr, b + 192 + tl.arange(0, 16)[None, :], nm) ^ 128) - 128).to(tl.float32)
        w = _spread(_f16(w_ptr, b + 208, nm) * scale, BN, 16) * q
    return w


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
    else:
        tl.static_assert(False, "K-quants decode through _decode_superblock")
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
        if QTYPE == 12 or QTYPE == 14:
            w = _decode_superblock(w_ptr, row, k0, n_mask[:, None], QTYPE, BLOCK_N)
        else:
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
                           "is imported); use kernels.cpu.gguf_blocks or kernels.reference.gguf_ref on the CPU")
    w, stride = weights_view(raw, t, n, k)
    if w.device != x.device:
        raise ValueError(f"x is on {x.device} but the blocks are on {w.device}")
    block = FORMATS[t][1]
    bk = block_k or (256 if block == 256 else 64)
    if bk % min(block, 32) or (block == 256 and bk != 256):
        raise ValueError(f"block_k {bk} must be a multiple of the {FORMATS[t][0]} block (256 for K-quants)")
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


def compile_ahead(qtype: int | str, block_m: int = 16, block_n: int = 32, block_k: int | None = None,
                  num_warps: int = 4, arch: int = 90, precision: str = "ieee") -> dict[str, str]:
    """Compile the kernel for one block type for CUDA sm_`arch` without a GPU (Triton's own ptxas), so that a
    machine with no device still catches what the interpreter does not check; returns Triton's asm dict
    (ttir, ttgir, llir, ptx, cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t = qtype_id(qtype)
    block = FORMATS[t][1]
    w_type = {0: "*fp32", 1: "*fp16"}.get(t, "*u8")
    sig = {"x_ptr": "*fp32", "w_ptr": w_type, "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
           "ROW_STRIDE": "i32", "stride_xm": "i32", "stride_om": "i32", "QTYPE": "constexpr",
           "PRECISION": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    consts = {"QTYPE": t, "PRECISION": precision, "BLOCK_M": block_m, "BLOCK_N": block_n,
              "BLOCK_K": block_k or (256 if block == 256 else 64)}
    src = ASTSource(fn=_gguf_kernel, signature=sig, constexprs=consts)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "enable_fp_fusion": False})
    return kernel.asm
