"""`[weights] format = "gguf"`: the projections and LM head multiply by the GGUF file's own quantised blocks.

Why: decoding reads every weight once per step, and a 1.5B model's float32 weights are 7.1 GB against
1.07 GB of Q4_K/Q6_K blocks. The kernel (kernels/cpu/gguf_blocks.c) dequantises each block in registers to the
exact float32 values the reference uses (bit for bit, `gguf.quants.dequantize`) and reuses it for every row
of a verify step, so verifying several draft tokens costs little more than one; only the summation order
differs from torch's, so greedy output can move only at floating-point near-ties (the forcing gate's tie
policy decides). Activations stay float32 (llama.cpp's CPU path quantises them to 8 bits, which is inexact).
The blocks are the file's read-only memory map: no float32 copy of a projection is ever made, and every
process shares them through the page cache. Norms, biases and the embedding lookup stay native (exact).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from specpilot.core.engine import gguf_checkpoint
from specpilot.core.engine.config import ModelLoadError
from specpilot.core.engine.model import Linear, Transformer


def source_file(checkpoint: str | None) -> str:
    """The GGUF file a checkpoint was materialised from; a plain Hugging Face directory cannot use the format."""
    info = gguf_checkpoint.source(checkpoint) if checkpoint else None
    if info is None:
        raise ModelLoadError(f"weights.format = 'gguf' needs a GGUF checkpoint (--target FILE.gguf); {checkpoint} is "
                             "a Hugging Face directory: use weights.format = 'native'")
    return info["gguf"]


def gguf_transformer(model: Transformer, path: str) -> Transformer:
    """A copy of `model` (loaded from the same GGUF file) whose projections read the file's blocks."""
    from specpilot.kernels.cpu.gguf_blocks import GGUFMatrix

    if model.dtype != torch.float32:
        raise ModelLoadError("weights.format = 'gguf' computes in float32, the dtype its weights are exact in; "
                             "use --dtype float32")
    return on_blocks(model, path, GGUFMatrix, _stacked)


def on_blocks(model: Transformer, path: str, matrix_type: type, stacked: Callable) -> Transformer:
    """A copy of `model` whose projections and LM head are `matrix_type(raw, qtype, n, k)` over the GGUF file's
    tensors; q/k/v and gate/up are joined by `stacked(parts, column_orders, bias)`. Shared by the gguf weight
    format (float32 activations) and the q8 numerics (core/engine/numerics.py)."""
    tensors = {t.name: t for t in gguf_checkpoint.reader(path).tensors}
    cfg = model.cfg
    permuted = cfg.family == "llama"

    def matrix(name: str):
        if name not in tensors:
            raise ModelLoadError(f"{path} has no tensor {name}; it is not the file this checkpoint came from")
        t = tensors[name]
        return matrix_type(t.data, int(t.tensor_type), int(t.shape[1]), int(t.shape[0]))

    def order(rows: int, heads: int) -> torch.Tensor | None:
        """Output columns in Hugging Face order: llama.cpp stores llama's q/k rows rotary-permuted."""
        if not permuted:
            return None
        return torch.from_numpy(gguf_checkpoint.unpermute(np.arange(rows)[:, None], heads)[:, 0].copy())

    stored = 0
    layers = []
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        q, k, v = (matrix(p + f"attn_{n}.weight") for n in "qkv")
        o, gate, up, down = (matrix(p + n) for n in ("attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
                                                      "ffn_down.weight"))
        stored += sum(m.nbytes for m in (q, k, v, o, gate, up, down))
        perms = (order(q.n, cfg.num_heads), order(k.n, cfg.num_kv_heads), None)
        layers.append(replace(layer, qkv=stacked([q, k, v], perms, layer.raw.get("qkv_bias")), o=o,
                              gate_up=stacked([gate, up]), down=down))
    head = matrix("output.weight") if "output.weight" in tensors else matrix("token_embd.weight")
    stored += head.nbytes
    copy = object.__new__(Transformer)
    copy.__dict__.update(model.__dict__)
    copy.layers = layers
    copy.lm_head = head
    copy.weight_format = "gguf"
    copy.matrix_bits = None
    copy.matrix_bytes = stored
    return copy


def _stacked(parts: list, perms: tuple | None = None, bias: torch.Tensor | None = None) -> Linear:
    """One projection whose output is the parts' outputs side by side (the engine's fused q/k/v, gate/up)."""
    perms = perms or (None,) * len(parts)

    def forward(x: torch.Tensor) -> torch.Tensor:
        outs = [m(x) if perm is None else m(x)[..., perm] for m, perm in zip(parts, perms)]
        y = torch.cat(outs, dim=-1)
        return y + bias if bias is not None else y

    return forward
