"""runtime.linear = "fused": each decoder layer of a float32 target in one C call (kernels/cpu/layer.c).

Why: with the skinny kernel, a verify forward of the demo target spent about as long outside its weight
products (dispatch of ~25 small torch ops per layer: norms, RoPE, cache scatter, masked SDPA, SiLU,
residual adds) as in them. The fused layer runs those ops in C on reusable buffers around the same skinny
products, so a forward costs one embedding, one C call per layer, the final norm and the LM head.

Steps wider than the skinny kernel's row limit (long prefills) take the torch path of the same model, whose
projections are the skinny backend's (the same packed weights, oneDNN above the limit).
"""

from __future__ import annotations

import ctypes
import threading

import torch
import torch.nn.functional as F

from specpilot.core.engine.model import KVCache, Transformer, real_tokens

_ptr, _long = ctypes.c_void_p, ctypes.c_long
QUERY_BLOCK = 12  # layer.c's QB: attention scores are computed for this many queries at a time


class LayerParams(ctypes.Structure):
    """Mirror of layer.c's LayerParams."""
    _fields_ = [(name, _ptr) for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "qkv_bias",
                                          "qkv", "o", "gate_up", "down")] + \
               [(name, _long) for name in ("qkv_bits", "o_bits", "gate_up_bits", "down_bits")]


class StepParams(ctypes.Structure):
    """Mirror of layer.c's StepParams."""
    _fields_ = [(name, _long) for name in ("B", "T", "E", "H", "Hkv", "D", "I", "pitch_e", "pitch_a", "pitch_i")] + \
               [("eps", ctypes.c_double), ("scale", ctypes.c_double), ("cos", _ptr), ("sin", _ptr),
                ("positions", _ptr), ("base", _ptr), ("offset", _long), ("ancestors", _ptr), ("A", _long),
                ("span", _long), ("cache_row_stride", _long), ("max_len", _long)] + \
               [(name, _ptr) for name in ("h", "qkv", "attn", "gu", "act", "tmp", "scores")] + \
               [("products", _long), ("sizes", _ptr)]


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedTransformer(Transformer):
    """A float32 Transformer with skinny projections whose narrow steps run each layer in one C call, over
    each row's real tree tokens only when the caller gives their `sizes` (ragged verification)."""

    products = True
    ragged = True

    @classmethod
    def build(cls, model: Transformer) -> "FusedTransformer":
        """From a model whose projections are skinny_dense (they carry their packed SkinnyWeight)."""
        fused = object.__new__(cls)
        fused.__dict__.update(model.__dict__)
        fused._lib = model.lm_head.skinny.lib
        fused._params = [fused._layer_params(layer) for layer in model.layers]
        fused._rows = min(fn.skinny_rows for layer in model.layers
                          for fn in (layer.qkv, layer.o, layer.gate_up, layer.down))
        fused._local = threading.local()
        return fused

    @staticmethod
    def _layer_params(layer) -> LayerParams:
        w = {k: getattr(layer, k).skinny for k in ("qkv", "o", "gate_up", "down")}
        return LayerParams(
            attn_norm=layer.attn_norm.data_ptr(), mlp_norm=layer.mlp_norm.data_ptr(),
            q_norm=_address(layer.q_norm), k_norm=_address(layer.k_norm),
            qkv_bias=_address(w["qkv"].bias), **{k: v.packed.data_ptr() for k, v in w.items()},
            **{f"{k}_bits": v.bits for k, v in w.items()})

    def truncated(self, num_layers: int) -> "FusedTransformer":
        view = super().truncated(num_layers)
        view._params = self._params[:num_layers]
        return view

    def without_products(self) -> "FusedTransformer":
        """A copy whose C layers skip the weight products (zeros) and whose torch path and LM head give
        zeros too: what the dispatch curve times."""
        bare = Transformer.without_products(self)
        copy = object.__new__(FusedTransformer)
        copy.__dict__.update(self.__dict__)
        copy.layers, copy.lm_head, copy.products = bare.layers, bare.lm_head, False
        return copy

    def _workspace(self, rows: int, span: int) -> dict[str, torch.Tensor]:
        """Per-thread buffers for `rows` rows (padding columns stay zero), reused across steps."""
        c = self.cfg
        widths = {"h": _pad8(c.hidden_size), "qkv": (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                  "attn": _pad8(c.num_heads * c.head_dim), "gu": 2 * c.intermediate_size,
                  "act": _pad8(c.intermediate_size), "tmp": c.hidden_size}
        cached = getattr(self._local, "buffers", None)
        if cached is None or cached["h"].shape[0] < rows or cached["scores"].numel() < QUERY_BLOCK * span:
            grow_rows = max(rows, 0 if cached is None else cached["h"].shape[0])
            grow_span = max(QUERY_BLOCK * span, 0 if cached is None else cached["scores"].numel())
            cached = {k: torch.zeros(grow_rows, n) for k, n in widths.items()}
            cached["scores"] = torch.zeros(grow_span)
            self._local.buffers = cached
        return cached

    def step(self, tokens: torch.Tensor, cache: KVCache, base: torch.Tensor, depths: torch.Tensor,
             ancestors: torch.Tensor | None, offset: int = 0,
             logits_at: torch.Tensor | None = None, sizes: list[int] | None = None,
             packed: bool = False) -> torch.Tensor | None:
        """As Transformer.step; steps of up to the skinny row limit run the C layers. With `sizes` (real
        tokens per row, each a prefix of its T) the padding is neither computed nor written to the cache, and
        its logits are zeros (or, `packed`, left out: [N, V])."""
        B, T = tokens.shape
        if sizes is not None and (sum(sizes) == B * T or logits_at is not None):
            sizes = None
        rows = B * T if sizes is None else sum(sizes)
        k, v = cache.k, cache.v
        dense_cache = k.stride(4) == 1 and k.stride(3) == k.shape[4] and k.stride(2) == k.shape[3] * k.shape[4]
        if rows > self._rows or not dense_cache:  # the torch path, padded: wide products may block by row count
            out = super().step(tokens, cache, base, depths, ancestors, offset, logits_at)
            if not packed or logits_at is not None:
                return out
            if sizes is None:
                return out.reshape(B * T, -1)
            return out[real_tokens(sizes, T)]
        c = self.cfg
        base = base.to(torch.long).contiguous()
        positions = (base[:, None] + depths).to(torch.long).contiguous()
        A = offset + T if ancestors is None else ancestors.shape[2]
        span = int(base.max()) + A
        if ancestors is not None:
            ancestors = ancestors.to(torch.bool).contiguous()
        valid = None
        if sizes is not None:
            counts = torch.tensor(sizes, dtype=torch.long)
            valid = real_tokens(sizes, T)
        buffers = self._workspace(rows, span)
        step = StepParams(
            B=B, T=T, E=c.hidden_size, H=c.num_heads, Hkv=c.num_kv_heads, D=c.head_dim, I=c.intermediate_size,
            pitch_e=buffers["h"].shape[1], pitch_a=buffers["attn"].shape[1], pitch_i=buffers["act"].shape[1],
            eps=c.rms_norm_eps, scale=c.head_dim ** -0.5, cos=self.cos.data_ptr(), sin=self.sin.data_ptr(),
            positions=positions.data_ptr(), base=base.data_ptr(), offset=offset,
            ancestors=_address(ancestors), A=A, span=span, cache_row_stride=k.stride(1), max_len=k.shape[3],
            products=int(self.products), sizes=None if valid is None else counts.data_ptr(),
            **{name: t.data_ptr() for name, t in buffers.items()})
        x = F.embedding(tokens if valid is None else tokens[valid], self.embed).contiguous()
        layer_stride = k.stride(0) * k.element_size()
        k_at, v_at = k.data_ptr(), v.data_ptr()
        fused_layer, step_ref = self._lib.fused_layer, ctypes.byref(step)
        for i, params in enumerate(self._params):
            fused_layer(ctypes.byref(params), step_ref, x.data_ptr(), k_at + i * layer_stride, v_at + i * layer_stride)
        if valid is not None:
            logits = self.lm_head(self._norm(x, self.norm))
            if packed:
                return logits
            out = logits.new_zeros(B, T, logits.shape[-1])
            out[valid] = logits
            return out
        if logits_at is not None:
            if logits_at.numel() == 0:
                return None
            x = x.gather(1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(self._norm(x, self.norm))
        return logits.reshape(B * T, -1) if packed and logits_at is None else logits
