"""Packed12: a lossless 12-bit storage format for bfloat16 weight matrices, with a fused matmul.

Why: decoding one token reads every weight once, so decode speed is bounded by weight bytes. Trained bf16
weights use few distinct exponents, so a weight fits in 12 bits without losing a bit:

* ``signman``  uint8 [N, K]          sign bit (bit 7) and the 7 mantissa bits (bits 0-6) of each weight;
* ``codes``    uint8 [N, ceil(K/2)]  a 4-bit code per weight, column 2j in the low nibble and 2j+1 in the
  high nibble (an odd K pads the last high nibble with 15); code c < 15 means exponent
  ``exponent_table[c]`` (the tensor's 15 most frequent exponents), code 15 means "escape";
* escapes: the flat positions (row-major, ascending) and exact bf16 values of weights whose exponent is not
  in the table; their ``signman`` byte is 0, so with table entry 15 = 0 an escape decodes to +0 and the
  matmul adds its exact contribution as a sparse correction.

Two small derived indexes ride along for the kernel (counted in ``index_nbytes``, not in the format's
``nbytes``): ``decode_table`` (int32 [256], the exponent fields of both columns of a code byte) and
``escape_row_ptr`` (CSR row offsets into the escape list, so a kernel block finds its rows' escapes).

Decoding is bit-exact for every bf16 value (inf, every NaN payload, subnormals, -0): the sign and mantissa
bits are stored verbatim, and an exponent is either in the table or the whole value is kept aside.

``matmul(x, p)`` computes ``x @ W^T`` (fp32 accumulation, output in x's dtype) with the fused Triton kernel
for CUDA tensors and ``matmul_reference`` otherwise. On the CPU the format saves no time: the reference
path decodes the weight (``PackedLinear`` caches the decoded copy) and is there for correctness. The bytes
saving pays only with the fused GPU kernel, which reads 12 bits per weight instead of 16.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from specpilot.kernels.gpu.packed12_triton import KernelConfig

ESCAPE_CODE = 15
TABLE_SIZE = 16
MAX_KERNEL_ROWS = 64
_INT32_LIMIT = 2**31 - 1


@dataclass
class Packed12:
    """One packed [N, K] bf16 matrix. All tensors live on the same device."""

    signman: torch.Tensor
    codes: torch.Tensor
    exponent_table: torch.Tensor
    decode_table: torch.Tensor
    escape_positions: torch.Tensor
    escape_values: torch.Tensor
    escape_row_ptr: torch.Tensor
    shape: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def num_escapes(self) -> int:
        return int(self.escape_positions.numel())

    @property
    def escape_rate(self) -> float:
        """Fraction of weights whose exponent is outside the table (kept aside at 6-12 bytes each)."""
        return self.num_escapes / max(self.numel, 1)

    @property
    def nbytes(self) -> int:
        """Bytes of the format itself: sign/mantissa bytes, codes, exponent table, escape positions/values."""
        return sum(t.numel() * t.element_size() for t in self._tensors()[:5])

    @property
    def index_nbytes(self) -> int:
        """Bytes of the kernel's derived indexes (decode table, escape row offsets), rebuildable from the
        format: small, read once per program, but resident next to it on the device."""
        return sum(t.numel() * t.element_size() for t in self._tensors()[5:])

    @property
    def bytes_per_weight(self) -> float:
        """Format bytes per weight: 1.5 plus the exponent table and escapes (bf16 is 2.0)."""
        return self.nbytes / max(self.numel, 1)

    @property
    def resident_bytes_per_weight(self) -> float:
        """Format plus derived indexes, per weight: what a packed matrix occupies on the device."""
        return (self.nbytes + self.index_nbytes) / max(self.numel, 1)

    @property
    def device(self) -> torch.device:
        return self.signman.device

    def _replace(self, fn: Any) -> "Packed12":
        return Packed12(**{f: fn(getattr(self, f)) for f in self._FIELDS}, shape=self.shape)

    def clone(self) -> "Packed12":
        """An independent copy (benchmarks rotate among copies to defeat the L2 cache)."""
        return self._replace(torch.Tensor.clone)

    def to(self, device: torch.device | str) -> "Packed12":
        """A copy on `device` (the format is device-independent)."""
        return self._replace(lambda t: t.to(device))

    _FIELDS = ("signman", "codes", "exponent_table", "escape_positions", "escape_values", "decode_table",
               "escape_row_ptr")

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f) for f in self._FIELDS)


def _index_dtype(limit: int) -> torch.dtype:
    return torch.int32 if limit <= _INT32_LIMIT else torch.int64


def make_decode_table(exponent_table: torch.Tensor) -> torch.Tensor:
    """int32 [256] indexed by a whole code byte (two nibbles): the exponent of the low nibble at bits 7-14
    and of the high nibble at bits 23-30, i.e. the exponent fields of two bf16 packed in one int32, so the
    kernel decodes a column pair with one lookup."""
    e = exponent_table.to(torch.int32)
    byte = torch.arange(256, device=exponent_table.device)
    return ((e[byte & 0xF] << 7) | (e[byte >> 4] << 23)).contiguous()


def pack(w: torch.Tensor, *, convert: bool = False) -> Packed12:
    """Pack a 2-D bf16 matrix losslessly. Any other dtype raises ValueError unless `convert=True`, which
    rounds to bf16 first (lossy with respect to the original, exact with respect to the bf16 copy)."""
    if w.dim() != 2:
        raise ValueError(f"packed12 packs 2-D [N, K] matrices; got shape {tuple(w.shape)}")
    if w.dtype != torch.bfloat16:
        if not convert:
            raise ValueError(f"packed12 packs bfloat16 weights losslessly; got {w.dtype} "
                             "(pass convert=True to round to bfloat16 first)")
        w = w.to(torch.bfloat16)
    n, k = w.shape
    if n == 0 or k == 0:
        raise ValueError(f"packed12 needs a non-empty matrix; got shape {(n, k)}")
    bits = w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    exponent = (bits >> 7) & 0xFF
    signman = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)

    counts = torch.bincount(exponent.flatten(), minlength=256)
    order = torch.sort(counts, descending=True, stable=True).indices[:ESCAPE_CODE]
    order = order[counts[order] > 0]
    exponent_table = torch.zeros(TABLE_SIZE, dtype=torch.uint8, device=w.device)
    exponent_table[: order.numel()] = order.to(torch.uint8)
    lut = torch.full((256,), ESCAPE_CODE, dtype=torch.int32, device=w.device)
    lut[order] = torch.arange(order.numel(), dtype=torch.int32, device=w.device)
    code = lut[exponent]

    escaped = code == ESCAPE_CODE
    idx = _index_dtype(n * k)
    escape_positions = escaped.flatten().nonzero().squeeze(1)
    escape_values = w.flatten()[escape_positions].contiguous()
    signman[escaped] = 0
    row_ptr = torch.zeros(n + 1, dtype=torch.int64, device=w.device)
    row_ptr[1:] = torch.cumsum(escaped.sum(dim=1), dim=0)

    if k % 2:
        code = F.pad(code, (0, 1), value=ESCAPE_CODE)
    codes = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).contiguous()
    return Packed12(
        signman=signman.contiguous(), codes=codes, exponent_table=exponent_table,
        decode_table=make_decode_table(exponent_table), escape_positions=escape_positions.to(idx),
        escape_values=escape_values, escape_row_ptr=row_ptr.to(_index_dtype(escape_positions.numel())),
        shape=(n, k),
    )


def unpack(p: Packed12) -> torch.Tensor:
    """Decode to the exact bf16 matrix [N, K] (bit-identical to what was packed)."""
    n, k = p.shape
    codes = p.codes.to(torch.int64)
    code = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(n, -1)[:, :k]
    exponent = p.exponent_table.to(torch.int32)[code]
    sm = p.signman.to(torch.int32)
    bits = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
    bits = bits - ((bits & 0x8000) << 1)
    w = bits.to(torch.int16).view(torch.bfloat16)
    if p.num_escapes:
        w.view(-1)[p.escape_positions.to(torch.int64)] = p.escape_values
    return w


def _check_matmul_args(x: torch.Tensor, p: Packed12, bias: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K]; got shape {tuple(x.shape)}")
    if x.shape[1] != p.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns but the packed weight has K={p.shape[1]}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be bfloat16 or float32; got {x.dtype}")
    if bias is not None and bias.shape != (p.shape[0],):
        raise ValueError(f"bias must have shape ({p.shape[0]},); got {tuple(bias.shape)}")


def matmul_reference(x: torch.Tensor, p: Packed12, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) in plain PyTorch: decode W to bf16, accumulate in fp32, round once to x's
    dtype. This is the semantics the Triton kernel must match (up to fp32 summation order)."""
    _check_matmul_args(x, p, bias)
    y = x.float() @ unpack(p).float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@functools.cache
def triton_available() -> bool:
    """True when the Triton kernel module imports (Triton installed); says nothing about a GPU."""
    try:
        from specpilot.kernels.gpu import packed12_triton  # noqa: F401
    except ImportError:
        return False
    return True


def matmul_triton(x: torch.Tensor, p: Packed12, bias: torch.Tensor | None = None,
                  config: "KernelConfig | None" = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) with the fused dequantise-matmul Triton kernel (x: 1..64 rows). Runs on CUDA
    tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests)."""
    _check_matmul_args(x, p, bias)
    from specpilot.kernels.gpu.packed12_triton import launch

    return launch(x, p, bias, config, out)


def _use_kernel(x: torch.Tensor, p: Packed12) -> bool:
    return (x.is_cuda and 0 < x.shape[0] <= MAX_KERNEL_ROWS and p.numel <= _INT32_LIMIT
            and triton_available())


def matmul(x: torch.Tensor, p: Packed12, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias): the fused kernel for CUDA tensors with up to 64 rows, otherwise decode once and
    use a dense matmul (the CPU path, and GPU prefill where a dense GEMM is compute-bound anyway)."""
    if _use_kernel(x, p):
        return matmul_triton(x, p, bias)
    if x.is_cuda:
        _check_matmul_args(x, p, bias)
        b = None if bias is None else bias.to(x.dtype)
        return F.linear(x, unpack(p).to(x.dtype), b)
    return matmul_reference(x, p, bias)


class PackedLinear(torch.nn.Module):
    """Drop-in for a bf16 weight matrix (nn.Linear or the engine's dense projections) stored as packed12.

    On CUDA, inputs with <= 64 rows (decode and verification widths) go through the fused kernel, which
    never materialises the bf16 weight; longer inputs (prefill) decode once into a temporary and use a dense
    GEMM. On the CPU the decoded weight is cached per dtype and used with F.linear, so the result is
    identical to nn.Linear over the original weight: a correctness path, not a faster one.
    """

    def __init__(self, packed: Packed12, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.shape = packed.shape
        self.register_buffer("signman", packed.signman)
        self.register_buffer("codes", packed.codes)
        self.register_buffer("exponent_table", packed.exponent_table)
        self.register_buffer("decode_table", packed.decode_table)
        self.register_buffer("escape_positions", packed.escape_positions)
        self.register_buffer("escape_bits", packed.escape_values.view(torch.int16))
        self.register_buffer("escape_row_ptr", packed.escape_row_ptr)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._decoded: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    @classmethod
    def from_linear(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        """Pack a bf16 [out_features, in_features] weight (and keep the bias as given)."""
        return cls(pack(weight.detach()), bias)

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def packed(self) -> Packed12:
        """The format view over the current buffers (follows .to(device); escape values are kept as int16
        bits so that a dtype cast of the module cannot round them)."""
        return Packed12(self.signman, self.codes, self.exponent_table, self.decode_table,
                        self.escape_positions, self.escape_bits.view(torch.bfloat16), self.escape_row_ptr,
                        self.shape)

    def _apply(self, fn: Any, recurse: bool = True) -> "PackedLinear":
        self._decoded.clear()
        return super()._apply(fn, recurse)

    def decoded_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The decoded weight in `dtype`, cached (meant for the CPU path only)."""
        key = (self.signman.device, dtype)
        if key not in self._decoded:
            self._decoded[key] = unpack(self.packed).to(dtype)
        return self._decoded[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W^T + b for x [..., in_features] (bf16 or fp32), output in x's dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input [..., {self.in_features}]; got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        packed = self.packed
        if _use_kernel(x2, packed):
            y = matmul_triton(x2, packed, self.bias)
        else:
            if x.dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"PackedLinear takes bfloat16 or float32 input; got {x.dtype}")
            b = None if self.bias is None else self.bias.to(x.dtype)
            w = self.decoded_weight(x.dtype) if not x2.is_cuda else unpack(packed).to(x.dtype)
            y = F.linear(x2, w, b)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        p = self.packed
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, escapes={p.num_escapes}, "
                f"bytes_per_weight={p.bytes_per_weight:.4f}")


def _distinct_exponents(t: torch.Tensor) -> int:
    bits = t.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int32)
    return int((torch.bincount(((bits >> 7) & 0xFF).flatten(), minlength=256) > 0).sum().item())


def _report_items(items: Iterable[tuple[str, torch.Tensor]], convert: bool = False) -> dict[str, Any]:
    tensors: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    numel = escapes = nbytes = index_nbytes = 0
    for name, t in items:
        if t.dim() != 2:
            skipped[name] = f"{t.dim()}-D"
            continue
        if t.dtype != torch.bfloat16 and not convert:
            skipped[name] = f"dtype {str(t.dtype).removeprefix('torch.')}"
            continue
        p = pack(t, convert=convert)
        tensors[name] = {
            "shape": list(p.shape), "numel": p.numel, "escapes": p.num_escapes,
            "escape_rate": p.escape_rate, "bytes_per_weight": p.bytes_per_weight,
            "resident_bytes_per_weight": p.resident_bytes_per_weight,
            "distinct_exponents": _distinct_exponents(t),
        }
        numel += p.numel
        escapes += p.num_escapes
        nbytes += p.nbytes
        index_nbytes += p.index_nbytes
    overall = {
        "tensors": len(tensors), "numel": numel, "escapes": escapes,
        "escape_rate": escapes / numel if numel else 0.0,
        "bytes": nbytes, "bytes_per_weight": nbytes / numel if numel else 0.0,
        "resident_bytes_per_weight": (nbytes + index_nbytes) / numel if numel else 0.0,
        "bf16_bytes": 2 * numel, "ratio_vs_bf16": (2 * numel) / nbytes if nbytes else 0.0,
    }
    return {"tensors": tensors, "overall": overall, "skipped": skipped}


def report(tensors: dict[str, torch.Tensor], convert: bool = False) -> dict[str, Any]:
    """Per-tensor and overall escape rate and bytes per weight for the 2-D bf16 tensors of `tensors`
    (others are listed under "skipped"; `convert=True` rounds non-bf16 matrices to bf16 first)."""
    return _report_items(tensors.items(), convert)


def report_model_dir(model_dir: str | Path, convert: bool = False) -> dict[str, Any]:
    """`report` over every *.safetensors file of a Hugging Face model directory, one tensor at a time."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")

    def items() -> Iterable[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)

    return _report_items(items(), convert)


def main(argv: list[str] | None = None) -> int:
    """CLI: print the packed12 report for a model directory."""
    ap = argparse.ArgumentParser(prog="python -m specpilot.kernels.gpu.packed12",
                                 description="Escape rate and bytes per weight of a model's 2-D weights in packed12.")
    ap.add_argument("model_dir")
    ap.add_argument("--convert", action="store_true", help="round non-bf16 matrices to bf16 before packing")
    ap.add_argument("--json", action="store_true", help="print the full report as JSON")
    args = ap.parse_args(argv)
    try:
        rep = report_model_dir(args.model_dir, convert=args.convert)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    for name, r in rep["tensors"].items():
        print(f"{name:60s} {str(tuple(r['shape'])):>16s} escapes {r['escape_rate']:.3e} "
              f"bytes/weight {r['bytes_per_weight']:.4f}")
    if rep["skipped"]:
        print(f"skipped {len(rep['skipped'])} tensors (not 2-D bf16)")
    o = rep["overall"]
    print(f"overall: {o['tensors']} matrices, {o['numel']} weights, escape rate {o['escape_rate']:.3e}, "
          f"bytes/weight {o['bytes_per_weight']:.4f} (bf16 2.0, {o['ratio_vs_bf16']:.3f}x smaller; "
          f"{o['resident_bytes_per_weight']:.4f} with the kernel's indexes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
