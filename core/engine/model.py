"""A compact Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) with a tree-aware KV cache.

The hot path is written for small batches on any device: one fused QKV and one fused gate/up matmul per
layer, RoPE applied to q and k together, cache writes by scatter, and everything that depends only on the
step (positions, mask, write indices) built once per forward, not per layer.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import warnings
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from specpilot.core.engine.config import ModelConfig, ModelLoadError
from specpilot.core.engine.loader import load_state_dict

Linear = Callable[[torch.Tensor], torch.Tensor]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dense(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A linear projection as a plain callable (no nn.Module dispatch on the hot path)."""
    if bias is None:
        return lambda x: F.linear(x, weight)
    return lambda x: F.linear(x, weight, bias)


def real_tokens(sizes: list[int], width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, width] bool: the first sizes[b] tokens of row b are real, the rest padding (a ragged step's layout)."""
    return torch.arange(width, device=device)[None, :] < torch.tensor(sizes, device=device)[:, None]


def rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along rows: a view when they already lie one after another in one storage (a
    memory-mapped GGUF checkpoint lays q/k/v and gate/up out so), else a concatenated copy."""
    first = parts[0]
    offset = first.storage_offset()
    adjacent = all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                   and p.dtype == first.dtype and p.shape[1:] == first.shape[1:] for p in parts)
    if adjacent:
        for p in parts:
            adjacent = adjacent and p.storage_offset() == offset
            offset += p.numel()
    if not adjacent:
        return torch.cat(parts)
    shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape, first.stride())


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    raw: dict[str, torch.Tensor]


class KVCache:
    """Pre-allocated keys and values [layers, batch, kv_heads, max_len, head_dim] with per-row lengths.

    `lazy` (CPU): the storage is reserved address space whose pages the kernel provides, zeroed, on first
    write, and `release_row` hands a row's pages back. A server's cache then takes memory for the positions
    its requests hold, not for every row at full context, while every row keeps its dense, fixed address."""

    def __init__(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, lazy: bool = False) -> None:
        shape = (layers, batch, kv_heads, max_len, head_dim)
        self._maps: list[mmap.mmap] = []
        if lazy and torch.device(device).type == "cpu":
            self.k, self.v = self._reserved(shape, dtype), self._reserved(shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len

    def _reserved(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Address space for `shape`, between two inaccessible guard pages: the kernel then never merges it with
        a neighbouring mapping, so /proc/self/smaps reports its pages alone."""
        count, page = math.prod(shape), mmap.PAGESIZE
        data = -(-count * dtype.itemsize // page) * page
        buf = mmap.mmap(-1, data + 2 * page,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
        self._maps.append(buf)
        with warnings.catch_warnings():  # the tensor does not own the map: the cache keeps it alive
            warnings.simplefilter("ignore", UserWarning)
            base = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            for at in (base, base + page + data):
                if libc.mprotect(at, page, 0) != 0:  # PROT_NONE
                    raise OSError(ctypes.get_errno(), "mprotect failed on a KV cache guard page")
            return torch.frombuffer(buf, dtype=dtype, count=count, offset=page).view(shape)

    def resident_bytes(self) -> int:
        """Memory the keys and values hold now: for a lazy cache the pages written and not given back (the
        kernel's count of its private pages in /proc/self/smaps; pages only read map the shared zero page and
        cost nothing), the whole allocation otherwise."""
        if not self._maps:
            return 2 * self.k.numel() * self.k.element_size()
        starts = {self.k.data_ptr(), self.v.data_ptr()}
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    inside = int(head.split("-")[0], 16) in starts
                elif inside and head == "Anonymous:":
                    total += int(line.split()[1]) * 1024
        return total

    def release_row(self, row: int) -> None:
        """Give back the pages of row `row` (a request has left it); they read as zeros after. A no-op for a
        cache that is not lazy."""
        if not self._maps:
            return
        layers, batch, heads, max_len, dim = self.k.shape
        page = mmap.PAGESIZE
        slab = max_len * dim * self.k.element_size()
        for buf in self._maps:
            for layer in range(layers):
                for head in range(heads):
                    start = page + ((layer * batch + row) * heads + head) * slab  # past the low guard page
                    first, end = -(-start // page) * page, (start + slab) // page * page
                    if end > first:
                        buf.madvise(mmap.MADV_DONTNEED, first, end - first)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def reset(self) -> None:
        self.lengths.zero_()

    def row(self, index: int) -> "KVCache":
        """One row as a batch-1 cache sharing this one's storage (to prefill a joining request alone)."""
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, index:index + 1], self.v[:, index:index + 1]
        view.lengths, view.max_len, view._maps = self.lengths[index:index + 1], self.max_len, []
        return view

    def view(self, rows: int) -> "KVCache":
        """The first `rows` rows as a cache sharing this one's storage (active requests stay packed there)."""
        view = object.__new__(KVCache)
        view.k, view.v, view.lengths, view.max_len = self.k[:, :rows], self.v[:, :rows], self.lengths[:rows], self.max_len
        view._maps = []  # a view never gives pages back: its offsets are not the storage's
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Copy one request's keys, values and length to another row (used to keep active rows packed)."""
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n

    def compact(self, rows: list[int], src: list[list[int]], dst_start: list[int]) -> None:
        """Move the slots `src[i]` of row `rows[i]` to consecutive slots from `dst_start[i]` (accepted path)."""
        moves = [(r, s, d) for r, ss, d0 in zip(rows, src, dst_start) for d, s in enumerate(ss, d0) if s != d]
        if not moves:
            return
        dev = self.k.device
        r = torch.tensor([m[0] for m in moves], device=dev)
        s = torch.tensor([m[1] for m in moves], device=dev)
        d = torch.tensor([m[2] for m in moves], device=dev)
        for t in (self.k, self.v):
            t[:, r, :, d] = t[:, r, :, s]


class StepInputs:
    """Everything a forward needs that depends on the step, computed once and shared by all layers.

    Row b sees every slot below `base[b]` plus the tree slots base[b] + j with ancestors[b, i, j]; the
    step's T queries are written at slots base[b] + offset + arange(T) and sit at positions base[b] + depths.
    """

    def __init__(self, model: "Transformer", tokens: torch.Tensor, base: torch.Tensor, depths: torch.Tensor,
                 ancestors: torch.Tensor | None, offset: int = 0) -> None:
        B, T = tokens.shape
        self.tokens = tokens
        positions = base[:, None] + depths
        self.cos = model.cos[positions].unsqueeze(2)
        self.sin = model.sin[positions].unsqueeze(2)
        slots = base[:, None] + offset + torch.arange(T, device=tokens.device)
        self.write_index = slots[:, None, :, None].expand(B, model.cfg.num_kv_heads, T, model.cfg.head_dim)
        A = offset + T if ancestors is None else ancestors.shape[2]
        self.span = int(base.max().item()) + A
        self.mask = None
        if ancestors is not None:
            rel = torch.arange(self.span, device=tokens.device)[None, :] - base[:, None]
            in_tree = (rel >= 0) & (rel < A)
            tree = ancestors.gather(2, rel.clamp(0, A - 1)[:, None, :].expand(B, T, self.span))
            allowed = (rel < 0)[:, None, :] | (tree & in_tree[:, None, :])
            mask = torch.zeros(B, 1, T, self.span, dtype=model.dtype, device=tokens.device)
            self.mask = mask.masked_fill_(~allowed[:, None], torch.finfo(model.dtype).min)
        self._visible: torch.Tensor | None = None
        self._real: torch.Tensor | None = None

    @property
    def visible(self) -> torch.Tensor | None:
        """The mask as bool [B, T, span] (None: every slot visible), for the fixed-order attention; built once
        per step, on first use."""
        if self._visible is None and self.mask is not None:
            self._visible = self.mask[:, 0] == 0
            if self._real is not None:
                self._visible &= self._real[:, :, None]
        return self._visible

    def skip_padding(self, real: torch.Tensor) -> None:
        """Let the queries that are padding (`real` [B, T] False) see no slot: the fixed-order attention then
        skips them (their output is NaN, and dropped, as their projections are). Padded, a row of one token
        beside a row of five attended to its whole context five times: at 4 rows on the Xeon, one row drafting
        4 tokens cost 235 ms against 207 for every row drafting 1, the same 8 tokens. SDPA reads `mask`, which
        is unchanged (and `visible` is built only for the attention that reads it); a real query's visible slots
        are unchanged, and so are its bits."""
        self._real, self._visible = real, None


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: StepInputs) -> torch.Tensor:
    """torch's attention (the f32 numerics): its blocking may depend on the call's shape."""
    gqa = q.shape[1] != keys.shape[1]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask, enable_gqa=gqa)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """torch's SwiGLU product (the f32 numerics)."""
    return F.silu(gate) * up


class Transformer:
    """Weights plus a forward over (tokens, per-row lengths, tree ancestry) that writes the KV cache."""

    ragged = False  # whether step() computes only each row's real tokens when given their sizes
    numerics = "f32"  # the arithmetic of this model's products (core/engine/numerics.py)
    attention = staticmethod(sdpa)  # (q, keys, values, step) -> attention output; q8 sets a fixed-order one
    silu_mul = staticmethod(silu_mul)

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str, num_layers: int | None = None) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = num_layers or cfg.num_layers
        self.weight_format = "native"
        self.matrix_bits: int | None = None  # bits per weight-matrix value the projections read, if not the dtype's
        self.matrix_bytes: int | None = None  # or the bytes all weight matrices are stored in (gguf blocks)

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = state.get(name)
            if t is None:
                if required:
                    raise ModelLoadError(f"checkpoint is missing tensor {name}; it is incomplete or not a "
                                         f"{cfg.family} checkpoint")
                return None
            return t.to(device=self.device, dtype=dtype)

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        head = take("lm_head.weight", required=False)
        self.lm_head_weight = head if head is not None else self.embed
        self.layers: list[LayerWeights] = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            qkv_w = rows([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_b = None
            if state.get(p + "self_attn.q_proj.bias") is not None:
                qkv_b = rows([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            gate_up_w = rows([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            raw = {"qkv": qkv_w, "qkv_bias": qkv_b, "o": take(p + "self_attn.o_proj.weight"), "gate_up": gate_up_w,
                   "down": take(p + "mlp.down_proj.weight")}
            self.layers.append(LayerWeights(
                attn_norm=take(p + "input_layernorm.weight"),
                mlp_norm=take(p + "post_attention_layernorm.weight"),
                qkv=dense(qkv_w, qkv_b), o=dense(raw["o"]), gate_up=dense(gate_up_w), down=dense(raw["down"]),
                q_norm=take(p + "self_attn.q_norm.weight", required=cfg.qk_norm),
                k_norm=take(p + "self_attn.k_norm.weight", required=cfg.qk_norm),
                raw=raw,
            ))
        self.lm_head = dense(self.lm_head_weight)
        positions = torch.arange(cfg.max_position_embeddings + 256, dtype=torch.float32)
        freqs = torch.outer(positions, cfg.inv_freq())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=self.device, dtype=dtype)
        self.sin = emb.sin().to(device=self.device, dtype=dtype)

    @classmethod
    def load(cls, path: str, dtype: str | torch.dtype = "float32", device: str = "cpu") -> "Transformer":
        """Load a Hugging Face checkpoint directory."""
        cfg = ModelConfig.from_dir(path)
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ModelLoadError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
            dtype = DTYPES[dtype]
        return cls(cfg, load_state_dict(path), dtype, device)

    def truncated(self, num_layers: int) -> "Transformer":
        """A view of the first `num_layers` layers sharing this model's weights (early-exit drafting)."""
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.num_layers = num_layers
        view.layers = self.layers[:num_layers]
        return view

    def with_projections(self, make: Callable[[torch.Tensor, torch.Tensor | None], Linear],
                         weight_format: str = "native", matrix_bits: int | None = None) -> "Transformer":
        """A copy sharing this model's tensors whose projections and LM head are `make(weight, bias)` (a
        weight format or a linear backend, reading `matrix_bits` per weight value when that is not the
        dtype's); norms, embeddings and the cache layout stay as they are."""
        copy = object.__new__(Transformer)
        copy.__dict__.update(self.__dict__)
        copy.layers = [replace(layer, qkv=make(layer.raw["qkv"], layer.raw.get("qkv_bias")),
                               o=make(layer.raw["o"], None), gate_up=make(layer.raw["gate_up"], None),
                               down=make(layer.raw["down"], None)) for layer in self.layers]
        copy.lm_head = make(self.lm_head_weight, None)
        copy.weight_format = weight_format
        copy.matrix_bits = matrix_bits
        return copy

    def without_products(self) -> "Transformer":
        """A copy whose projections and LM head output zeros of the right shape: its forward times everything
        but the weight products (zeros, not uninitialised memory, so no NaN or denormal slows what remains)."""
        def make(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
            return lambda x: x.new_zeros(*x.shape[:-1], weight.shape[0])

        return self.with_projections(make, self.weight_format, self.matrix_bits)

    def matrices(self) -> list[torch.Tensor]:
        """The weight matrices the projections and LM head multiply by (what a weight format stores)."""
        return [self.lm_head_weight, *(layer.raw[k] for layer in self.layers for k in ("qkv", "o", "gate_up", "down"))]

    def new_cache(self, batch: int, max_len: int, lazy: bool = False) -> KVCache:
        c = self.cfg
        return KVCache(self.num_layers, batch, c.num_kv_heads, max_len, c.head_dim, self.dtype, self.device, lazy)

    def kv_bytes_per_token(self) -> int:
        """Bytes one position of one row takes in this model's KV cache (keys and values, every layer)."""
        c = self.cfg
        return 2 * self.num_layers * c.num_kv_heads * c.head_dim * self.dtype.itemsize

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.cfg.rms_norm_eps).to(x.dtype)

    def forward(self, step: StepInputs, cache: KVCache, logits_at: torch.Tensor | None = None,
                real: torch.Tensor | None = None, packed: bool = False) -> torch.Tensor | None:
        """Run all layers on the step's tokens, write their K/V, return logits [B, T', V] or None.

        `logits_at` ([B, T'] indices into the step) picks the positions whose logits are needed; by
        default all of them. `real` ([B, T] bool) marks the tokens to compute; the others are padding (a
        `ragged` model's: its ops on a token do not depend on the other tokens in the pass, so the real ones
        keep their bits). The real tokens then flow through the layers packed, [N, E]: projections, norms,
        residuals and the LM head see them alone, and only RoPE, the cache writes and attention see the
        [B, T] layout, with zeros for the padding, whose queries attend to nothing. The padding's logits are
        zeros; with `packed` the result is [N, V] instead, the real tokens' logits alone in row order.
        """
        c = self.cfg
        B, T = step.tokens.shape
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        flat = None
        if real is not None:
            step.skip_padding(real)
            flat = real.reshape(-1).nonzero().squeeze(1)

        def spread(y: torch.Tensor) -> torch.Tensor:
            """Packed rows [N, W] into the step's layout [B, T, W], zeros in the padding."""
            if flat is None:
                return y
            return y.new_zeros(B * T, y.shape[-1]).index_copy_(0, flat, y).view(B, T, -1)

        def pack(y: torch.Tensor) -> torch.Tensor:
            """The step's layout [B, T, W] back to the real rows [N, W] (the identity when nothing is padding)."""
            return y if flat is None else y.reshape(B * T, -1).index_select(0, flat)

        x = F.embedding(step.tokens if flat is None else step.tokens.reshape(-1)[flat], self.embed)
        span = step.span
        for i, layer in enumerate(self.layers):
            qkv = spread(layer.qkv(self._norm(x, layer.attn_norm))).view(B, T, H + 2 * Hkv, D)
            qk, v = qkv[:, :, : H + Hkv], qkv[:, :, H + Hkv:]
            if layer.q_norm is not None:
                qk = torch.cat([self._norm(qk[:, :, :H], layer.q_norm), self._norm(qk[:, :, H:], layer.k_norm)], 2)
            half = D // 2
            rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
            qk = qk * step.cos + rotated * step.sin
            q = qk[:, :, :H].transpose(1, 2)
            cache.k[i].scatter_(2, step.write_index, qk[:, :, H:].transpose(1, 2))
            cache.v[i].scatter_(2, step.write_index, v.transpose(1, 2))
            keys, values = cache.k[i][:, :, :span], cache.v[i][:, :, :span]
            attn = self.attention(q, keys, values, step)
            x = x + layer.o(pack(attn.transpose(1, 2).reshape(B, T, H * D)))
            gate, up = layer.gate_up(self._norm(x, layer.mlp_norm)).chunk(2, dim=-1)
            x = x + layer.down(self.silu_mul(gate, up))
        if logits_at is not None:
            if logits_at.numel() == 0:
                return None
            x = spread(x)
            x = x.gather(1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
            return self.lm_head(self._norm(x, self.norm))
        logits = self.lm_head(self._norm(x, self.norm))
        return logits.reshape(-1, logits.shape[-1]) if packed else spread(logits)

    def prefill_row(self, cache: KVCache, row: int, tokens: list[int]) -> None:
        """Write `tokens` into row `row` from slot 0 (other rows untouched) and set its length."""
        cache.row(row).lengths.zero_()
        self.extend_row(cache, row, tokens)

    def extend_row(self, cache: KVCache, row: int, tokens: list[int]) -> None:
        """Append `tokens` to row `row` after the slots it holds, in one forward (other rows untouched)."""
        if not tokens:
            return
        view = cache.row(row)
        n, dev = len(tokens), self.device
        self.step(torch.tensor([tokens], device=dev), view, view.lengths, torch.arange(n, device=dev)[None],
                  torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev))[None],
                  logits_at=torch.zeros(1, 0, dtype=torch.long, device=dev))
        view.lengths += n

    def step(self, tokens: torch.Tensor, cache: KVCache, base: torch.Tensor, depths: torch.Tensor,
             ancestors: torch.Tensor | None, offset: int = 0,
             logits_at: torch.Tensor | None = None, sizes: list[int] | None = None,
             packed: bool = False) -> torch.Tensor | None:
        """Forward `tokens` [B, T] against the cache; see StepInputs for the placement rules.

        `ancestors` may be None only when every slot below base + offset + T is visible to every query
        (batch 1, one token). `sizes` (real tokens per row, each a prefix of its T, the rest padding) lets a
        `ragged` model skip the padding: it computes the real tokens alone, and the padding's logits are
        zeros. With `packed` (and `sizes`, no `logits_at`) the result is the real tokens' logits alone, [N, V]
        in row order, on any model: a step of rows of mixed depths then never builds its [B, T, V] (at 16 rows
        on the Xeon, 48 MB of zeros and an argmax over them, ~45 ms of a ~450 ms step).
        """
        B, T = tokens.shape
        real = None
        if sizes is not None and sum(sizes) < B * T:
            real = real_tokens(sizes, T, tokens.device)
        step = StepInputs(self, tokens, base, depths, ancestors, offset)
        if self.ragged or real is None:
            return self.forward(step, cache, logits_at, real, packed)
        logits = self.forward(step, cache, logits_at)
        return logits[real] if packed and logits_at is None else logits
