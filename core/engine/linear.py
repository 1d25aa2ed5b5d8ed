"""Linear backends as a runtime mechanism for the projections of the target and the drafter model on a CPU.

`[runtime] linear = "onednn"` runs multi-row projections (verification, prefill) through oneDNN's
prepacked GEMM instead of torch's default BLAS; `linear = "skinny"` runs them through SpecPilot's own AVX2
kernel (kernels/cpu/skinny.c) up to SKINNY_MAX_ROWS rows, and through oneDNN above.

Why: a verify step multiplies a few rows by every weight, and the default BLAS (MKL) is slow at such
GEMMs on the AVX2 development machine: over all weight matrices of the demo target (bf16 values loaded in
float32), the skinny kernel takes 2.0-3.4x fewer milliseconds than MKL at 1-12 rows and 1.4x at 33-64
(docs/notebook.md; `python -m specpilot.kernels.cpu.skinny models/demo-target`). It reads each weight matrix as one
sequential stream, in 16 bits when the weights are bfloat16 values (any bf16 checkpoint), which halves
the bytes and lets the demo target's weights stay in the cache.

oneDNN keeps its own packed float32 copy of every weight; onednn keeps the default GEMV for a single row,
which it does not beat. The skinny backend keeps its packed copy (16 or 32 bits per weight) plus oneDNN's.
bfloat16 and float16 models compute in float32 on exact copies of their weights (bf16 matmul is emulated
on a CPU without bf16 units) and round every projection's output back to their dtype. The weights are the
same numbers; only the summation order changes, so greedy output can differ from the reference at
floating-point near-ties only (the forcing gate's tie policy decides).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from specpilot.core.engine.config import ModelLoadError
from specpilot.core.engine.fused import FusedTransformer
from specpilot.core.engine.model import Linear, Transformer, dense
from specpilot.kernels.cpu.skinny import SkinnyUnavailable, SkinnyWeight, bfloat16_exact, library

SKINNY_MAX_ROWS = {16: 256, 32: 48}  # by panel bits: above this many rows oneDNN is as fast or faster (measured)


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available())


def onednn_dense(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A projection that packs `weight` once for oneDNN (in float32) and keeps the default GEMV for one row.

    Several rows of a bfloat16/float16 model compute on float32 copies of the same values and round the
    output back to its dtype: on a CPU without native bf16 matmul that is what the hardware does fast, and
    it differs from the low-precision kernel only in summation order. One row keeps the model's own GEMV
    (half the bytes to read)."""
    dtype = weight.dtype
    w32 = weight.float()
    b32 = None if bias is None else bias.float()
    packed = torch.ops.mkldnn._reorder_linear_weight(w32, None)

    def project(x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1]:
            return F.linear(x, weight, bias)
        out = torch.ops.mkldnn._linear_pointwise(x.float(), packed, b32, "none", [None], "")
        return out if dtype == torch.float32 else out.to(dtype)

    return project


def skinny_dense(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A projection through the skinny kernel (packed once) up to SKINNY_MAX_ROWS rows, oneDNN (or the
    default BLAS without it) above; a bfloat16/float16 model's outputs are rounded back to its dtype."""
    dtype = weight.dtype
    skinny = SkinnyWeight(weight, bias)
    wide = onednn_dense(weight, bias) if onednn_available() else dense(weight, bias)
    most = SKINNY_MAX_ROWS[skinny.bits] * weight.shape[1]

    def project(x: torch.Tensor) -> torch.Tensor:
        if x.numel() > most:
            return wide(x)
        out = skinny(x)
        return out if dtype == torch.float32 else out.to(dtype)

    project.skinny, project.skinny_rows = skinny, SKINNY_MAX_ROWS[skinny.bits]
    return project


def linear_transformer(model: Transformer, backend: str,
                       skinny: Callable[[], Transformer] | None = None) -> Transformer:
    """A copy of `model` sharing its tensors whose projections and LM head use `backend` ("onednn",
    "skinny", or "fused": skinny products inside one C call per layer, float32 only); a one-line
    ModelLoadError says what to change where it cannot run. For "fused", `skinny` returns the model's
    skinny-backend copy to build on (so the two share one set of packed weights); by default one is made."""
    if model.device.type != "cpu":
        raise ModelLoadError(f"runtime.linear = '{backend}' is a CPU backend; this model is on {model.device}, "
                             "so use linear = 'native'")
    if model.weight_format != "native":
        raise ModelLoadError(f"runtime.linear = '{backend}' needs native weights, not {model.weight_format}; set "
                             "weights.format = 'native' or linear = 'native'")
    if backend == "onednn":
        if not onednn_available():
            raise ModelLoadError("this torch build has no oneDNN (mkldnn); use runtime.linear = 'native'")
        return model.with_projections(onednn_dense)
    if backend in ("skinny", "fused"):
        try:
            library()
        except SkinnyUnavailable as e:
            raise ModelLoadError(f"runtime.linear = '{backend}' cannot run here: {e}; use linear = 'onednn' or "
                                 "'native'") from None
        if backend == "fused":
            if model.dtype != torch.float32:
                raise ModelLoadError(f"runtime.linear = 'fused' computes in float32, not {str(model.dtype)[6:]}; "
                                     "use linear = 'skinny' or dtype float32")
            return FusedTransformer.build(skinny() if skinny else linear_transformer(model, "skinny"))
        exact = all(bfloat16_exact(w) for w in model.matrices())
        return model.with_projections(skinny_dense, matrix_bits=16 if exact else None)
    raise ModelLoadError(f"unknown linear backend {backend!r}; use native, onednn, skinny or fused")
