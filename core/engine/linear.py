"""Linear backends as a runtime mechanism: `[runtime] linear = "onednn"` runs the target's multi-row
projections (verification, prefill) through oneDNN's prepacked GEMM instead of torch's default BLAS.

Why: on a CPU a verify step is compute-bound, and the default BLAS (MKL) is slow at the few-row GEMMs
speculative verification makes (measured on the AVX2 development machine: 1.3-2x slower than oneDNN at
4-16 rows). A single row (plain decoding, drafting) keeps the default GEMV, which oneDNN does not beat.
oneDNN keeps its own packed float32 copy of every weight (2x the weight memory of a float32 model).
bfloat16 and float16 models run several rows in float32 on that exact copy of their weights (3x their
weight memory; bf16 matmul is emulated on a CPU without bf16 units) and round every projection's output
back to their dtype. The weights are the same numbers; only the summation order changes, so greedy output can
differ from the reference at floating-point near-ties only (the forcing gate's tie policy decides).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.engine.config import ModelLoadError
from core.engine.model import Linear, Transformer


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


def onednn_transformer(model: Transformer) -> Transformer:
    """A copy of `model` sharing its tensors whose projections and LM head use oneDNN for several rows."""
    if model.device.type != "cpu":
        raise ModelLoadError(f"runtime.linear = 'onednn' is a CPU backend; this model is on {model.device}, "
                             "so use linear = 'native'")
    if model.weight_format != "native":
        raise ModelLoadError(f"runtime.linear = 'onednn' needs native weights, not {model.weight_format}; set "
                             "weights.format = 'native' or linear = 'native'")
    if not onednn_available():
        raise ModelLoadError("this torch build has no oneDNN (mkldnn); use runtime.linear = 'native'")
    return model.with_projections(onednn_dense)
