"""`[weights] drafter_format = "q8" | "q4" | "blocks8"`: the drafter model's products in cheaper arithmetic.

Why: on the real pair drafting costs more than verifying (four 0.5B forwards a step against one 1.5B
forward on the GGUF blocks), and a drafter only proposes: the target's verification decides every output
token, so the drafter's arithmetic need not be exact. Its weights requantised to Q8_0 or Q4_0 with 8-bit
activations (kernels/cpu/q8_draft.c) cut a drafting forward; the output stays the target's, which token forcing
checks like any other recipe's. A prompt's prefill (more than q8_draft.MAX_ROWS rows) runs in bfloat16 where
the CPU has bfloat16 matmul units (AMX or AVX-512 BF16), else on the drafter's exact projections, both
cheaper per row there. CPU only.

`blocks8` keeps a GGUF drafter on its own file's blocks and runs it in the q8 numerics' arithmetic
(numerics.q8_transformer: 8-bit activations, VNNI integer products on kernels/cpu/q8_blocks.c, the fixed-order
attention), reading the memory-mapped blocks (and the shared cached repacks) in place: no private copy. Its
LM head keeps the first HEAD_VOCAB ids and the end-of-sequence ids, as the q4/q8 drafters' do, which halves
the 0.5B's 145 MB Q8_0 head.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F

from specpilot.core.engine.config import ModelLoadError
from specpilot.core.engine.model import Transformer

BYTES_PER_WEIGHT = {8: 1 + 4 / 32, 4: 0.5 + 2 / 32}  # the values plus each 32-block's scale
BF16_BYTES = 2.0  # the bfloat16 copy a prompt's products use where the CPU has bfloat16 units
# (weight, blocks or bf16 copy) by (id(weight), what): the drafter's copies on different target formats or
# backends (the cost model profiles several) share them; their exact fallbacks differ
_PACKED: dict[tuple[int, int], tuple[object, dict]] = {}


HEAD_VOCAB = 1 << 16  # a big vocabulary's drafting head keeps its first ids (BPE ranks: the frequent ones)


@functools.lru_cache(maxsize=1)
def fast_bf16() -> bool:
    """Whether bfloat16 matmuls have hardware here (AMX, or AVX-512 BF16 dot products): a prompt's drafter
    products then run in bfloat16, against torch's float32 GEMM 6x as fast on the Xeon's AMX (480 against 93
    GFMA/s, one core) and 3x on the Zen 4's AVX-512 BF16 (86 against 29); elsewhere they stay exact."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


class VocabHead:
    """A drafter's LM head over a subset of the vocabulary (the first HEAD_VOCAB ids and the end-of-sequence
    ids): the rest get -inf, so they are never drafted. Qwen's 151,936-row head is a third of the 0.5B
    drafter's bytes; its first 65,536 ids hold ~97% of the coding requests' tokens, and a token outside them
    ends a draft early, which only the judge's timing can notice."""

    def __init__(self, weight, keep: torch.Tensor, make) -> None:
        self.vocab = int(weight.shape[0])
        self.keep = keep
        self.first = int(HEAD_VOCAB)  # keep = the first ids, then the end-of-sequence ids above them
        self.ends = keep[self.first:]
        self.rows = make(weight[keep])
        self.nbytes = self.rows.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.rows(x).float()
        out = y.new_full((*x.shape[:-1], self.vocab), float("-inf"))
        out[..., : self.first] = y[..., : self.first]  # a contiguous copy, not a 65,536-index scatter
        out[..., self.ends] = y[..., self.first:]
        return out.to(x.dtype)


def quantised_drafter(model: Transformer, bits: int) -> Transformer:
    """A copy of the drafter `model` whose projections and LM head multiply by `bits`-bit blocks of its
    weights (quantised once here, from the float weights the model was loaded with); a prompt's products run
    in bfloat16 where the CPU has bfloat16 units, and a vocabulary over 2 * HEAD_VOCAB is drafted from its first
    HEAD_VOCAB ids (plus end of sequence)."""
    from specpilot.kernels.cpu.q8_draft import Q8Matrix, available, quantize

    fmt = f"q{bits}"
    if model.device.type != "cpu":
        raise ModelLoadError(f"weights.drafter_format = '{fmt}' runs a CPU kernel; on {model.device} use "
                             "drafter_format = 'same'")
    if not available():
        raise ModelLoadError(f"weights.drafter_format = '{fmt}' needs the q8_draft kernel, which does not build "
                             "here (no C compiler or no AVX2/FMA): use drafter_format = 'same'")
    bf16 = fast_bf16()

    def cached(weight: torch.Tensor, what, build):
        key = (id(weight), what)
        if key not in _PACKED:  # the weight is kept with what was built from it, so its id cannot be reused
            _PACKED[key] = (weight, build())
        return _PACKED[key][1]

    def blocks(weight, bias, exact) -> Q8Matrix:
        wide = exact
        if bf16:
            w16 = cached(weight, "bf16", lambda: weight.to(torch.bfloat16))
            b16 = None if bias is None else bias.to(torch.bfloat16)
            wide = lambda x: F.linear(x.to(torch.bfloat16), w16, b16).to(x.dtype)  # noqa: E731
        return Q8Matrix(weight, bias, wide=wide, bits=bits, packed=cached(weight, bits, lambda: quantize(weight, bits)))

    layers = [replace(layer, qkv=blocks(layer.raw["qkv"], layer.raw.get("qkv_bias"), layer.qkv),
                      o=blocks(layer.raw["o"], None, layer.o), gate_up=blocks(layer.raw["gate_up"], None, layer.gate_up),
                      down=blocks(layer.raw["down"], None, layer.down)) for layer in model.layers]
    vocab = model.lm_head_weight.shape[0]
    if vocab > 2 * HEAD_VOCAB:
        ends = [i for i in model.cfg.eos_token_ids if i >= HEAD_VOCAB]
        keep = torch.cat([torch.arange(HEAD_VOCAB), torch.tensor(ends, dtype=torch.long)])
        head = VocabHead(model.lm_head_weight, keep, lambda w: Q8Matrix(w, None, bits=bits))
    else:
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


def gguf_drafter(model: Transformer) -> Transformer:
    """`drafter_format = "blocks8"`: the drafter `model` on its own GGUF file's blocks in the q8 arithmetic
    (numerics.q8_transformer's: 8-bit activations, integer products, the fixed-order attention and SiLU), every
    matrix read through the shared cached repacked copy (Q5_0 and Q8_0 too, which the target's q8 reads as
    stored), its head over the first HEAD_VOCAB ids plus end of sequence where the vocabulary is over
    2 * HEAD_VOCAB. The file is the one the checkpoint was materialised from (`model.checkpoint`, set by the
    Engine); a drafter without one is a one-line error."""
    from specpilot.core.engine import gguf_checkpoint, numerics
    from specpilot.core.engine.gguf_format import on_blocks
    from specpilot.kernels.build import KernelUnavailable
    from specpilot.kernels.cpu import attention
    from specpilot.kernels.cpu.q8_blocks import Q8Matrix
    from specpilot.kernels.reference.gguf_ref import UnsupportedBlockType

    where = getattr(model, "checkpoint", None)
    info = gguf_checkpoint.source(where) if where else None
    if info is None:
        raise ModelLoadError(f"weights.drafter_format = 'blocks8' runs the drafter on its GGUF file's blocks, and "
                             f"{where or 'this drafter'} is not a GGUF checkpoint: pass --drafter FILE.gguf, or use "
                             "drafter_format = 'q4', 'q8' or 'same'")
    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise ModelLoadError("weights.drafter_format = 'blocks8' runs on the CPU in float32 around its integer "
                             "products; use --device cpu --dtype float32, or drafter_format = 'same'")
    try:
        attention.library()
        copy = on_blocks(model, info["gguf"], functools.partial(Q8Matrix, repack=True), numerics.q8_shared_input)
    except (KernelUnavailable, UnsupportedBlockType) as exc:
        raise ModelLoadError(f"weights.drafter_format = 'blocks8' cannot run here ({exc}); use drafter_format = "
                             "'q4', 'q8' or 'same'") from None
    copy.attention = numerics.q8_attend
    copy.silu_mul = attention.silu_mul
    head = copy.lm_head
    if head.n > 2 * HEAD_VOCAB:
        tensors = {t.name: t for t in gguf_checkpoint.reader(info["gguf"]).tensors}
        stored = tensors.get("output.weight") or tensors["token_embd.weight"]
        copy.lm_head = BlocksHead(stored.data, head, model.cfg.eos_token_ids)
        copy.matrix_bytes += copy.lm_head.nbytes - head.nbytes
    copy.weight_format = f"{model.weight_format}+blocks8"
    return copy


class BlocksHead:
    """A q8 LM head over its first HEAD_VOCAB rows (a row slice of the file's memmap, repacked into the shared
    cache like the rest) and the end-of-sequence rows above them; the rest of the vocabulary gets -inf (never
    drafted), as VocabHead. The kept rows' logits are the full head's bits."""

    def __init__(self, stored, head, eos_ids) -> None:
        from specpilot.kernels.cpu.q8_blocks import Q8Matrix

        self.vocab, self.first = head.n, HEAD_VOCAB
        self.rows = Q8Matrix(stored[: self.first], head.qtype, self.first, head.k, head.threads, repack=True)
        ends = sorted(i for i in eos_ids if i >= self.first)
        self.ends = torch.tensor(ends, dtype=torch.long)
        self.tail = Q8Matrix(head.raw[ends].clone(), head.qtype, len(ends), head.k, head.threads) if ends else None
        self.nbytes = self.rows.nbytes + (self.tail.nbytes if self.tail is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq = self.rows.quantize(x)
        y = self.rows.product(xq)
        out = y.new_full((y.shape[0], self.vocab), float("-inf"))
        out[:, : self.first] = y
        if self.tail is not None:
            out[:, self.ends] = self.tail.product(xq)
        return out.view(*x.shape[:-1], self.vocab)
