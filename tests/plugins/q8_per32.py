"""Test-only candidate whose arithmetic differs from q8's: importing it makes every q8 product quantise its
activations per 32 values instead of per 256 (what a candidate might try to buy accuracy or speed), and it
registers a harmless draft length so that a recipe can name it. No recipe field can change a deployment's
numerics, so this is the way such a change would arrive: code in a worker. Token forcing against the judge's
own q8 plain decoding (which never imports this) must catch it. `install()`/`uninstall()` let an in-process
test patch and restore."""

import torch

from specpilot.core.mechanisms import register
from specpilot.kernels.cpu import q8_blocks
from specpilot.kernels.reference import gguf_ref

_original = {}
_dequantised = {}


def per32(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] quantised and dequantised per 32 values (llama.cpp's Q8_0 rule, float scale)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(blocks))
    return (q * d).reshape(x.shape)


def _product(self, x: torch.Tensor, threads=None) -> torch.Tensor:
    if id(self) not in _dequantised:
        _dequantised[id(self)] = gguf_ref.dequantize(self.raw, self.qtype, self.n, self.k)
    lead = x.shape[:-1]
    return (per32(x.reshape(-1, self.k)) @ _dequantised[id(self)].T).view(*lead, self.n)


class _Per32Activations:
    def __init__(self, x: torch.Tensor) -> None:
        self.x, self.k = x, x.shape[-1]


def install() -> None:
    if _original:
        return
    _original.update(quantize=q8_blocks.Q8Matrix.quantize, product=q8_blocks.Q8Matrix.product,
                     call=q8_blocks.Q8Matrix.__call__)
    q8_blocks.Q8Matrix.quantize = lambda self, x: _Per32Activations(x.reshape(-1, self.k))
    q8_blocks.Q8Matrix.product = lambda self, xq, threads=None: _product(self, xq.x)
    q8_blocks.Q8Matrix.__call__ = _product


def uninstall() -> None:
    if _original:
        q8_blocks.Q8Matrix.quantize = _original.pop("quantize")
        q8_blocks.Q8Matrix.product = _original.pop("product")
        q8_blocks.Q8Matrix.__call__ = _original.pop("call")
    _dequantised.clear()


def length(depth, recent):
    return depth


install()
register("draft_length", "q8_per32", length)
