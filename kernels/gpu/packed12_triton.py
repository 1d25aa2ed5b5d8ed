"""The fused packed12 dequantise-matmul Triton kernel (y = x @ W^T for 1..64 rows).

Why fused: a decode step is memory-bound, so the only way 12-bit storage pays is to read the 12 bits and
rebuild each bf16 in registers right before the MMA; a separate decode pass would write and re-read 16 bits.

Each program owns BLOCK_N weight rows (and a K range when split-K is on) and computes the transposed tile
acc[n, m] = sum_k W[n, k] x[m, k], so the decoded weights are the MMA's A operand straight from registers.
Columns are handled in pairs (2j, 2j+1): one int16 holds both sign/mantissa bytes and one byte both codes;
one lookup of that code byte in the 256-entry pair table (the 16-entry exponent table expanded to both
nibbles, exponent fields pre-shifted) and a few shifts and masks build both bf16 bit patterns in one int32,
which is already the (2j, 2j+1) pair the MMA operand wants. Cost (main-loop SASS for sm_90, compiled ahead
of time without a GPU): ~6.8 thread-instructions per weight, down from 11.4 with two nibble lookups and
separate even/odd dots; weight-tile loads are unmasked when N and K divide the tiles (EVEN).
Escapes decode to +0; after the K loop the program adds them exactly with a small dot per chunk of its rows'
escapes (found through the CSR row offsets), then the bias, then rounds once to the output dtype. With
split-K the partial sums are fp32 and summed on the host side (deterministic, no atomics).

Importing this module imports Triton; TRITON_INTERPRET=1 must be set before that to run on CPU tensors.
The interpreter cannot multiply bfloat16 in tl.dot (it multiplies the raw uint16 storage; upstream
triton-lang/triton#11584), so interpreted runs decode to fp32 and use fp32 dots; compiled runs use bf16 MMA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from specpilot.kernels.gpu.packed12 import MAX_KERNEL_ROWS, Packed12


@triton.jit
def _packed12_kernel(
    x_ptr, sm_ptr, code_ptr, tab_ptr, esc_pos_ptr, esc_val_ptr, esc_row_ptr, bias_ptr, out_ptr,
    M, N, K, KP, stride_xm, stride_om, stride_split, kp_per_split,
    HAS_BIAS: tl.constexpr, PAIRED: tl.constexpr, DOT_BF16: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, ESC_BLOCK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m[None, :] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)

    kp_lo = pid_k * kp_per_split
    kp_hi = tl.minimum(kp_lo + kp_per_split, KP)
    w_rows = offs_n[:, None] * KP
    for kp0 in range(kp_lo, kp_hi, BLOCK_KP):
        offs_kp = kp0 + tl.arange(0, BLOCK_KP)
        offs_k = 2 * kp0 + tl.arange(0, 2 * BLOCK_KP)
        if EVEN:
            c = tl.load(code_ptr + w_rows + offs_kp[None, :]).to(tl.int32)
            p = tl.load(sm_ptr + w_rows + offs_kp[None, :]).to(tl.int32)
            xk = tl.load(x_rows + offs_k[:, None], mask=m_mask[None, :], other=0)
        else:
            w_mask = n_mask[:, None] & (offs_kp < kp_hi)[None, :]
            c = tl.load(code_ptr + w_rows + offs_kp[None, :], mask=w_mask, other=0xFF).to(tl.int32)
            if PAIRED:
                p = tl.load(sm_ptr + w_rows + offs_kp[None, :], mask=w_mask, other=0).to(tl.int32)
            else:
                sm = sm_ptr + offs_n[:, None] * K + 2 * offs_kp[None, :]
                odd_ok = w_mask & (2 * offs_kp + 1 < K)[None, :]
                p = tl.load(sm, mask=w_mask, other=0).to(tl.int32) | (
                    tl.load(sm + 1, mask=odd_ok, other=0).to(tl.int32) << 8)
            k_ok = offs_k < tl.minimum(2 * kp_hi, K)
            xk = tl.load(x_rows + offs_k[:, None], mask=m_mask[None, :] & k_ok[:, None], other=0)
        # both bf16 of the column pair in one int32: sign/mantissa bytes moved into place, exponents from
        # the pair table (bits 7-14 for column 2j, 23-30 for 2j+1)
        w = (p & 0x7F) | ((p << 8) & 0x7F8000) | ((p << 16) & -2147483648) | tl.load(tab_ptr + c)
        if DOT_BF16:
            w_e = w.to(tl.int16).to(tl.bfloat16, bitcast=True)
            w_o = (w >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
            wk = tl.join(w_e, w_o).reshape(BLOCK_N, 2 * BLOCK_KP)
            acc = tl.dot(wk, xk.to(tl.bfloat16), acc)
        else:
            w_e = (w << 16).to(tl.float32, bitcast=True)
            w_o = (w & -65536).to(tl.float32, bitcast=True)
            wk = tl.join(w_e, w_o).reshape(BLOCK_N, 2 * BLOCK_KP)
            acc = tl.dot(wk, xk.to(tl.float32), acc, input_precision="ieee")

    if pid_k == 0:
        n_lo = pid_n * BLOCK_N
        e_start = tl.load(esc_row_ptr + n_lo)
        e_end = tl.load(esc_row_ptr + tl.minimum(n_lo + BLOCK_N, N))
        for e0 in range(e_start, e_end, ESC_BLOCK):
            offs_e = e0 + tl.arange(0, ESC_BLOCK)
            e_mask = offs_e < e_end
            pos = tl.load(esc_pos_ptr + offs_e, mask=e_mask, other=0)
            e_row = pos // K
            e_col = pos - e_row * K
            vbits = tl.load(esc_val_ptr + offs_e, mask=e_mask, other=0).to(tl.int32)
            v = (vbits << 16).to(tl.float32, bitcast=True)
            s = tl.where((offs_n[:, None] == e_row[None, :]) & e_mask[None, :], v[None, :], 0.0)
            xv = tl.load(x_rows + e_col[:, None], mask=m_mask[None, :] & e_mask[:, None], other=0)
            if DOT_BF16:
                acc = tl.dot(s.to(tl.bfloat16), xv.to(tl.bfloat16), acc)
            else:
                acc = tl.dot(s, xv.to(tl.float32), acc, input_precision="ieee")
        if HAS_BIAS:
            b = tl.load(bias_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)
            acc += b[:, None]

    out = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


INTERPRETING = type(_packed12_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters. block_k counts columns per loop iteration (even); split_k splits K across
    programs when there are too few row blocks to fill the GPU."""

    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    esc_block: int = 32


_TUNED: dict[tuple[int, int, int, torch.dtype], KernelConfig] = {}


def block_m_for(rows: int) -> int:
    """The padded row tile: tl.dot needs >= 16, and rows are at most 64."""
    return max(16, triton.next_power_of_2(rows))


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_split(n: int, k: int, cfg: KernelConfig, device: torch.device) -> int:
    """Enough K splits for about two programs per SM, keeping >= 4 loop iterations per program."""
    blocks = triton.cdiv(n, cfg.block_n)
    k_iters = triton.cdiv(k, cfg.block_k)
    split = 1
    while blocks * split * 2 <= 2 * _sm_count(device) and k_iters // (split * 2) >= 4 and split < 8:
        split *= 2
    return split


def default_config(n: int, k: int, rows: int, device: torch.device) -> KernelConfig:
    """A reasonable untuned choice: wide K tiles for GEMV, smaller ones as the row tile grows."""
    cfg = KernelConfig(block_n=64, block_k=256 if rows <= 16 else 128, num_warps=4)
    return replace(cfg, split_k=default_split(n, k, cfg, device))


def candidate_configs(n: int, k: int, rows: int, device: torch.device) -> list[KernelConfig]:
    """The small autotune space for the GEMV / small-M case (BLOCK_N, BLOCK_K, num_warps; split-K derived)."""
    out = []
    for block_n in (32, 64, 128):
        for block_k in (128, 256):
            for num_warps in (4, 8):
                if block_n == 32 and num_warps == 8:
                    continue
                cfg = KernelConfig(block_n=block_n, block_k=block_k, num_warps=num_warps)
                out.append(replace(cfg, split_k=default_split(n, k, cfg, device)))
    return out


def set_tuned(n: int, k: int, rows: int, dtype: torch.dtype, cfg: KernelConfig) -> None:
    """Record the best config for this shape and row tile (used by later launches in this process)."""
    _TUNED[(n, k, block_m_for(rows), dtype)] = cfg


def pick_config(n: int, k: int, rows: int, dtype: torch.dtype, device: torch.device) -> KernelConfig:
    return _TUNED.get((n, k, block_m_for(rows), dtype)) or default_config(n, k, rows, device)


def launch(x: torch.Tensor, p: Packed12, bias: torch.Tensor | None = None,
           config: KernelConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the fused kernel: x [M, K] (1 <= M <= 64, bf16/fp32), output [M, N] in x's dtype (written
    into `out` when given, so checks can poison it first)."""
    m, k = x.shape
    n = p.shape[0]
    if not 1 <= m <= MAX_KERNEL_ROWS:
        raise ValueError(f"the packed12 kernel takes 1..{MAX_KERNEL_ROWS} rows; got {m}")
    if not (x.is_cuda or INTERPRETING):
        raise RuntimeError("the packed12 Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                           "triton is imported); use matmul_reference on the CPU")
    if p.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"x is on {x.device} but the packed weight/bias are elsewhere ({p.device})")
    if n * k > 2**31 - 1:
        raise ValueError("the packed12 kernel indexes with int32; this matrix is too large")
    x = x.contiguous()
    cfg = config or pick_config(n, k, m, x.dtype, x.device)
    if cfg.block_k % 2 or cfg.block_k < 32:
        raise ValueError(f"block_k must be even and >= 32; got {cfg.block_k}")
    block_kp = cfg.block_k // 2
    kp = (k + 1) // 2
    paired = k % 2 == 0
    sm = p.signman.view(torch.int16) if paired else p.signman
    k_blocks = triton.cdiv(kp, block_kp)
    kp_per_split = triton.cdiv(k_blocks, max(1, min(cfg.split_k, k_blocks))) * block_kp
    split = triton.cdiv(kp, kp_per_split)
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {(m, n)}")
    if split == 1:
        dest = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        dest = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    has_esc = p.num_escapes > 0
    esc_pos = p.escape_positions if has_esc else p.decode_table
    esc_val = p.escape_values.view(torch.int16) if has_esc else p.decode_table
    grid = (triton.cdiv(n, cfg.block_n), split)
    _packed12_kernel[grid](
        x, sm, p.codes, p.decode_table, esc_pos, esc_val, p.escape_row_ptr,
        bias if bias is not None else dest, dest,
        m, n, k, kp, x.stride(0), n, m * n, kp_per_split,
        HAS_BIAS=bias is not None, PAIRED=paired, DOT_BF16=x.dtype == torch.bfloat16 and not INTERPRETING,
        EVEN=paired and kp % block_kp == 0 and n % cfg.block_n == 0,
        BLOCK_M=block_m_for(m), BLOCK_N=cfg.block_n, BLOCK_KP=block_kp, ESC_BLOCK=cfg.esc_block,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split == 1:
        return dest
    y = dest.sum(0).to(x.dtype)
    return y if out is None else out.copy_(y)
