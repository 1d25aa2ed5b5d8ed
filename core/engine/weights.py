"""Weight formats as an engine mechanism: `[weights] format = "packed12"` swaps every linear projection for
the lossless 12-bit packed form (kernels/gpu/packed12.py). Lossless means bit-exact weights, so the conversion
refuses weights that bfloat16 cannot hold exactly."""

from __future__ import annotations

import torch

from specpilot.core.engine.model import Transformer


PACKED_BITS = 12


class WeightFormatError(ValueError):
    """Weights that a format cannot hold without changing them."""


def _packed(weight: torch.Tensor, bias: torch.Tensor | None = None):
    from specpilot.kernels.gpu.packed12 import PackedLinear

    bf16 = weight.to(torch.bfloat16)
    if not torch.equal(bf16.to(weight.dtype), weight):
        raise WeightFormatError("packed12 needs weights that bfloat16 holds exactly (checkpoints stored in "
                                "bfloat16); this model's weights would be rounded, so use format 'native'")
    return PackedLinear.from_linear(bf16, None if bias is None else bias.to(torch.bfloat16)).to(weight.device)


def pack_transformer(model: Transformer) -> Transformer:
    """A copy of `model` whose projections (and LM head) read packed12 weights; norms stay native."""
    return model.with_projections(lambda w, b: _as_callable(_packed(w, b), model.dtype), "packed12", PACKED_BITS)


def _as_callable(module: torch.nn.Module, dtype: torch.dtype):
    return lambda x: module(x).to(dtype)
