"""A deployment's numerics: the arithmetic of its own plain decoding, which defines what "lossless" means for it.

- `f32` (the default): float32 products, compatible with transformers; the forcing reference is transformers
  float32 with the near-tie policy (core/forcing.py).
- `q8` (GGUF deployments): llama.cpp's arithmetic on the file's blocks, written down once in
  kernels/reference/q8_ref.py: activations quantised to 8 bits per 256 values, products in integers, one float
  combination per block in a fixed order. The LM head is a product like the others and takes it too.
  Norms, RoPE and residuals stay float32 torch ops (row-invariant on their own, tested), attention and SiLU
  run the fixed-order kernels of kernels/cpu/attention.c. Every op gives a row the same bits whatever else
  shares the call, so speculation, trees, batching and prefill reproduce q8 plain decoding bit for bit, and
  the forcing reference is the engine's own q8 plain decoding (zero mismatches allowed).

The target runs the deployment's numerics; a recipe may not change them (core/engine/engine.py refuses
weight formats and linear backends that would). The drafter is free: it only proposes.
"""

from __future__ import annotations

import torch

from specpilot.core.engine import gguf_checkpoint
from specpilot.core.engine.config import ModelLoadError
from specpilot.core.engine.gguf_format import on_blocks
from specpilot.core.engine.model import Linear, Transformer

NUMERICS = {
    "f32": "float32 products, compatible with transformers (the reference; any checkpoint)",
    "q8": "llama.cpp's arithmetic on a GGUF file's blocks: 8-bit activations, integer products (GGUF targets)",
}
DEFAULT = "f32"
# what a recipe may set for the target under each numerics: anything else would change its products
TARGET_FORMATS = {"f32": None, "q8": ("native", "gguf")}
TARGET_BACKENDS = {"f32": None, "q8": ("native",)}


class NumericsError(ModelLoadError):
    """Numerics that do not exist, or that this deployment or recipe cannot run."""


def check(name: str) -> str:
    """`name` if it is a known numerics; else a one-line error listing the known ones."""
    if name not in NUMERICS:
        raise NumericsError(f"unknown numerics {name!r}; use one of: {', '.join(NUMERICS)}")
    return name


def require_gguf(name: str, target_dir: str | None) -> str | None:
    """The GGUF file a `q8` target reads (None for f32); a one-line error when the target has none."""
    check(name)
    if name == "f32":
        return None
    info = gguf_checkpoint.source(target_dir) if target_dir else None
    if info is None:
        raise NumericsError(f"numerics {name} multiplies a GGUF file's quantised blocks, and {target_dir} is a "
                            "float checkpoint; pass --target FILE.gguf, or use --numerics f32")
    return info["gguf"]


def check_recipe(numerics: str, fmt: str, backend: str) -> None:
    """Refuse a recipe whose target weight format or linear backend would change the deployment's numerics."""
    formats, backends = TARGET_FORMATS[numerics], TARGET_BACKENDS[numerics]
    if formats is not None and fmt not in formats:
        raise NumericsError(f"weights.format = {fmt!r} would change the target's products, and numerics {numerics} "
                            f"fixes them; use format {' or '.join(repr(f) for f in formats)} (a recipe never "
                            "changes numerics; the drafter's own format is free)")
    if backends is not None and backend not in backends:
        raise NumericsError(f"runtime.linear = {backend!r} would change the target's products, and numerics "
                            f"{numerics} fixes them; use linear = 'native'")


def q8_transformer(model: Transformer, path: str) -> Transformer:
    """A copy of `model` (loaded from the GGUF file `path`) in the q8 numerics: every projection and the LM head
    multiply the file's blocks by 8-bit activations (kernels/cpu/q8_blocks.c), attention and SiLU are the
    fixed-order kernels. A block type q8 does not multiply is a one-line error naming the tensor."""
    from specpilot.kernels.build import KernelUnavailable
    from specpilot.kernels.cpu import attention
    from specpilot.kernels.cpu.q8_blocks import Q8Matrix
    from specpilot.kernels.reference.gguf_ref import UnsupportedBlockType
    from specpilot.kernels.reference.q8_ref import check_q8_type

    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise NumericsError("numerics q8 runs on the CPU in float32 around its integer products; use --device cpu "
                            "--dtype float32")
    tensors = {t.name: t for t in gguf_checkpoint.reader(path).tensors}
    for name, t in tensors.items():
        if len(t.shape) == 2 and name != "token_embd.weight" or (name == "token_embd.weight"
                                                                  and "output.weight" not in tensors):
            try:
                check_q8_type(int(t.tensor_type), name)
            except UnsupportedBlockType as exc:
                raise NumericsError(str(exc)) from None
    try:
        attention.library()
    except KernelUnavailable as exc:
        raise NumericsError(f"numerics q8 cannot run here: {exc}; use --numerics f32") from None
    copy = on_blocks(model, path, Q8Matrix, q8_shared_input)
    copy.numerics = "q8"
    copy.ragged = True  # a token's products and attention do not depend on what else the pass holds: padding is skipped
    copy.attention = q8_attend
    copy.silu_mul = attention.silu_mul
    return copy


def q8_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step) -> torch.Tensor:
    """A q8 model's attention: the exact kernel, whose sums do not depend on how many queries share a pass."""
    from specpilot.kernels.cpu.attention import attend

    return attend(q, keys, values, step.visible)


def q8_shared_input(parts: list, perms: tuple | None = None, bias: torch.Tensor | None = None) -> Linear:
    """One projection whose output is the parts' side by side, quantising their shared input once."""
    perms = perms or (None,) * len(parts)

    def forward(x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq = parts[0].quantize(x)
        outs = [m.product(xq) if perm is None else m.product(xq)[..., perm] for m, perm in zip(parts, perms)]
        y = torch.cat(outs, dim=-1).view(*lead, -1)
        return y + bias if bias is not None else y

    return forward
