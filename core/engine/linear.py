"""Linear backends as a runtime mechanism: `[runtime] linear = "onednn"` runs the target's multi-row
projections (verification, prefill) through oneDNN's prepacked GEMM instead of torch's default BLAS.

Why: on a CPU a verify step is compute-bound, and the default BLAS (MKL) is slow at the few-row GEMMs
speculative verification makes (measured on the AVX2 development machine: 1.3-2x slower than oneDNN at
4-16 rows). A single row (plain decoding, drafting) keeps the default GEMV, which oneDNN does not beat.
The weights are the same numbers; only the summation order changes, so greedy output can differ from the
reference at floating-point near-ties only (the forcing gate's tie policy decides).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from core.engine.config import ModelLoadError
from core.engine.model import Linear, Transformer


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available())


def onednn_dense(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A projection that packs `weight` once for oneDNN and keeps the default GEMV for one row."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def project(x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1]:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")

    return project


def onednn_transformer(model: Transformer) -> Transformer:
    """A copy of `model` sharing its tensors whose projections and LM head use oneDNN for several rows."""
    if model.device.type != "cpu":
        raise ModelLoadError(f"runtime.linear = 'onednn' is a CPU backend; this model is on {model.device}, "
                             "so use linear = 'native'")
    if model.dtype != torch.float32:
        raise ModelLoadError(f"runtime.linear = 'onednn' runs float32 models; this one is {model.dtype}, so use "
                             "--dtype float32 or linear = 'native'")
    if model.weight_format != "native":
        raise ModelLoadError(f"runtime.linear = 'onednn' needs native weights, not {model.weight_format}")
    if not onednn_available():
        raise ModelLoadError("this torch build has no oneDNN (mkldnn); use runtime.linear = 'native'")
    copy = object.__new__(Transformer)
    copy.__dict__.update(model.__dict__)
    copy.layers = [dataclasses.replace(
        layer,
        qkv=onednn_dense(layer.raw["qkv"], layer.raw.get("qkv_bias")),
        o=onednn_dense(layer.raw["o"]),
        gate_up=onednn_dense(layer.raw["gate_up"]),
        down=onednn_dense(layer.raw["down"]),
    ) for layer in model.layers]
    copy.lm_head = onednn_dense(model.lm_head_weight)
    return copy
