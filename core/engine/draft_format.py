"""`[weights] drafter_format = "q8" | "q4"`: the drafter model's products in lossy 8- or 4-bit blocks.

Why: on the real pair drafting costs more than verifying (four 0.5B forwards a step against one 1.5B
forward on the GGUF blocks), and a drafter only proposes: the target's verification decides every output
token, so the drafter's arithmetic need not be exact. Its weights requantised to Q8_0 or Q4_0 with 8-bit
activations (kernels/q8_draft.c) cut a drafting forward; the output stays the target's, which token forcing
checks like any other recipe's. Prompt prefill (more than q8_draft.MAX_ROWS rows) keeps the drafter's
exact projections, which are cheaper per row there. CPU only.
"""

from __future__ import annotations

from dataclasses import replace

from core.engine.config import ModelLoadError
from core.engine.model import Transformer

BYTES_PER_WEIGHT = {8: 1 + 4 / 32, 4: 0.5 + 2 / 32}  # the values plus each 32-block's scale
# (weight, blocks) by (id(weight), bits): the drafter's copies on different target formats or backends (the
# cost model profiles several) share one set of blocks; their exact fallbacks differ
_PACKED: dict[tuple[int, int], tuple[object, dict]] = {}


def quantised_drafter(model: Transformer, bits: int) -> Transformer:
    """A copy of the drafter `model` whose projections and LM head multiply by `bits`-bit blocks of its
    weights (quantised once here, from the float weights the model was loaded with)."""
    from kernels.q8_draft import Q8Matrix, available, quantize

    fmt = f"q{bits}"
    if model.device.type != "cpu":
        raise ModelLoadError(f"weights.drafter_format = '{fmt}' runs a CPU kernel; on {model.device} use "
                             "drafter_format = 'same'")
    if not available():
        raise ModelLoadError(f"weights.drafter_format = '{fmt}' needs the q8_draft kernel, which does not build "
                             "here (no C compiler or no AVX2/FMA): use drafter_format = 'same'")

    def blocks(weight, bias, exact) -> Q8Matrix:
        key = (id(weight), bits)
        if key not in _PACKED:  # the weight is kept with its blocks, so its id cannot be reused
            _PACKED[key] = (weight, quantize(weight, bits))
        return Q8Matrix(weight, bias, wide=exact, bits=bits, packed=_PACKED[key][1])

    layers = [replace(layer, qkv=blocks(layer.raw["qkv"], layer.raw.get("qkv_bias"), layer.qkv),
                      o=blocks(layer.raw["o"], None, layer.o), gate_up=blocks(layer.raw["gate_up"], None, layer.gate_up),
                      down=blocks(layer.raw["down"], None, layer.down)) for layer in model.layers]
    head = blocks(model.lm_head_weight, None, model.lm_head)
    copy = object.__new__(Transformer)
    copy.__dict__.update(model.__dict__)
    copy.layers = layers
    copy.lm_head = head
    copy.weight_format = f"{model.weight_format}+{fmt}"
    copy.matrix_bits = None
    copy.matrix_bytes = head.nbytes + sum(m.nbytes for layer in layers for m in (layer.qkv, layer.o, layer.gate_up,
                                                                              layer.down))
    return copy
