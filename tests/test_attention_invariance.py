"""q8 numerics need every op of a forward to give a row the same bits however the row is computed: alone (a
1-token decode step), in a verify chain or tree, in a batched serve step next to other cache lengths, inside a
prompt, on 1 or 2 threads. Here: the attention kernel (kernels/cpu/attention.c) equals its plain-PyTorch
oracle (kernels/reference/attention_ref.py) bit for bit and is row-invariant in all those placements, with
masks built by the model's own StepInputs and a tree compacted by KVCache.compact; and the torch ops the
forward uses besides (rms_norm, silu * up on the fused gate/up halves, RoPE, residual adds) are row-invariant
on this CPU at the model's widths, with silu_mul as the fixed-arithmetic replacement where F.silu is not."""

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specpilot.core.engine.model import KVCache, StepInputs
from specpilot.kernels.cpu import attention
from specpilot.kernels.reference import attention_ref

pytestmark = pytest.mark.skipif(not attention.available(), reason="no AVX2 or no C compiler here")

H, HKV, D = 12, 2, 128  # the 1.5B target's attention
ISAS = attention.supported_isas()


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


@contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def kernel_isa(name: str):
    before = attention.isa()
    attention.use_isa(name)
    try:
        yield
    finally:
        attention.use_isa(before)


def ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of float32's spacing at `exact` (float64 tensors)."""
    spacing = torch.from_numpy(np.spacing(exact.float().abs().numpy()).astype(np.float64))
    return (got.double() - exact).abs() / spacing


# ---- exp2 and the oracle ----------------------------------------------------------------------------------

def test_exp2_equals_oracle_and_is_within_1_5_ulp():
    g = torch.Generator().manual_seed(0)
    edges = [0.0, -0.0, -0.5, -1.5, -2.5, -125.0, -125.00001, -126.0, -127.0, -1e4, -float("inf")]
    x = torch.cat([-torch.rand(200_000, generator=g) * 130, -torch.rand(50_000, generator=g), torch.tensor(edges)])
    ref = attention_ref.exp2(x)
    for isa in ISAS:
        with kernel_isa(isa):
            assert same(attention.exp2(x), ref), isa
    normal = x >= attention_ref.FLUSH_BELOW
    assert ulps(ref[normal], torch.exp2(x[normal].double())).max() < 1.5
    assert (ref[~normal] == 0).all() and (ref[normal] >= 2.0 ** -126).all()
    assert attention_ref.exp2(torch.zeros(1)).item() == 1.0


SHAPES = [  # B, H, Hkv, T, S, D
    (1, 4, 2, 1, 37, 64),
    (2, 12, 2, 3, 100, 128),
    (1, 6, 1, 5, 700, 128),
    (3, 4, 4, 2, 65, 64),
    (1, 3, 3, 2, 20, 72),  # D not a multiple of 16: zero-padded
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-Hkv{}-T{}-S{}-D{}".format(*s))
def test_kernel_equals_oracle_bit_for_bit(shape):
    """Random q/k/v (k, v strided slices of a longer cache, q a transposed view), with and without a random
    visibility, on every build this CPU runs and 1 and 2 threads; and close to SDPA."""
    B, Hq, Hkv, T, S, Dh = shape
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(B, T, Hq, Dh, generator=g).transpose(1, 2)
    cache_k, cache_v = (torch.randn(B, Hkv, S + 29, Dh, generator=g) * 2 for _ in range(2))
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]
    visible = torch.rand(B, T, S, generator=g) < 0.6
    visible[..., 0] = True
    for vis in (None, visible):
        ref = attention_ref.attend(q, k, v, vis)
        for isa in ISAS:
            for threads in (1, 2):
                with kernel_isa(isa):
                    out = attention.attend(q, k, v, vis, threads=threads)
                assert same(out, ref), (isa, threads, vis is None)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=None if vis is None else vis[:, None],
                                              enable_gqa=Hq != Hkv)
        assert (sdpa - ref).abs().max() < 1e-5


def test_scale_argument_and_a_row_that_sees_nothing():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 2, 64, generator=g)
    k, v = torch.randn(2, 1, 1, 9, 64, generator=g)
    vis = torch.ones(1, 2, 9, dtype=torch.bool)
    vis[0, 1] = False
    out = attention.attend(q, k, v, vis, scale=0.3)
    assert same(out[:, :, :1], attention_ref.attend(q, k, v, vis, scale=0.3)[:, :, :1])
    assert torch.isnan(out[:, :, 1]).all()
    sdpa = F.scaled_dot_product_attention(q[:, :, :1], k, v, scale=0.3, enable_gqa=True)
    assert (out[:, :, :1] - sdpa).abs().max() < 1e-5


def test_visible_from_mask_and_bad_arguments():
    assert attention.visible_from_mask(None) is None
    allowed = torch.tensor([[True, False, True], [True, True, False]])
    for dtype in (torch.float32, torch.bfloat16):
        mask = torch.zeros(1, 1, 2, 3, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        assert torch.equal(attention.visible_from_mask(mask), allowed[None])
    with pytest.raises(ValueError, match="other than 0"):
        attention.visible_from_mask(torch.full((1, 1, 2, 3), -5.0))
    q, k = torch.zeros(1, 3, 1, 64), torch.zeros(1, 2, 4, 64)
    with pytest.raises(ValueError):
        attention.attend(q, k, k, None)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError):
        attention.attend(torch.zeros(1, 2, 1, 64), k, k, torch.ones(1, 1, 5, dtype=torch.bool))


# ---- invariance: a row alone == the same row in a chain, a tree, a batch, a prompt -------------------------

def fake_model(max_len: int = 1024) -> SimpleNamespace:
    """What StepInputs reads of a Transformer (its positions' cos/sin are not used here)."""
    return SimpleNamespace(cos=torch.zeros(max_len, D), sin=torch.zeros(max_len, D), dtype=torch.float32,
                           cfg=SimpleNamespace(num_kv_heads=HKV, head_dim=D))


def step_visible(base: list[int], ancestors: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(visible [B, T, span], span) for a step as the model builds its mask."""
    B, T, _ = ancestors.shape
    step = StepInputs(fake_model(), torch.zeros(B, T, dtype=torch.long), torch.tensor(base),
                      torch.zeros(B, T, dtype=torch.long), ancestors)
    return attention.visible_from_mask(step.mask), step.span


@pytest.fixture(scope="module")
def sequence():
    """A sequence's q rows [N, H, D] and its keys/values [Hkv, N, D] in order."""
    g = torch.Generator().manual_seed(11)
    n = 700
    q = torch.randn(n, H, D, generator=g)
    return q, torch.randn(HKV, n, D, generator=g) * 1.5, torch.randn(HKV, n, D, generator=g)


def alone(seq, row: int, threads: int = 1) -> torch.Tensor:
    """Row `row` decoded alone: one query, no mask, the keys 0..row at consecutive slots -> [H, D]."""
    q, k, v = seq
    out = attention.attend(q[row][None, :, None], k[None, :, :row + 1], v[None, :, :row + 1], None, threads=threads)
    return out[0, :, 0]


def placements(seq):
    """Every placement's (name, out [H, D], row alone it must equal), for the current threads and build."""
    q, k, v = seq
    got = []
    th = torch.get_num_threads()

    # a verify chain of 5 after a 300-slot cache, inside a bigger cache (keys are a strided slice of it)
    P, T = 300, 5
    ck, cv = torch.full((1, HKV, 512, D), float("nan")), torch.full((1, HKV, 512, D), float("nan"))
    ck[0, :, :P + T], cv[0, :, :P + T] = k[:, :P + T], v[:, :P + T]
    vis, span = step_visible([P], torch.tril(torch.ones(T, T, dtype=torch.bool))[None])
    out = attention.attend(q[P:P + T].transpose(0, 1)[None], ck[:, :, :span], cv[:, :, :span], vis, threads=th)
    got += [(f"chain row {t}", out[0, :, t], P + t) for t in range(T)]

    # a tree of 6 (parents -1, 0, 1, 0, 2, 3): node 5's path is tree slots 0, 3, 5 (not consecutive)
    parents = [-1, 0, 1, 0, 2, 3]
    anc = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j >= 0:
            anc[i, j], j = True, parents[j]
    cache = KVCache(1, 1, HKV, 512, D, torch.float32, "cpu")
    cache.k[0, 0, :, :P], cache.v[0, 0, :, :P] = k[:, :P], v[:, :P]
    g = torch.Generator().manual_seed(5)
    cache.k[0, 0, :, P:P + 6], cache.v[0, 0, :, P:P + 6] = torch.randn(2, HKV, 6, D, generator=g)
    qt = torch.randn(6, H, D, generator=g)
    for depth, node in enumerate((0, 3, 5)):  # the path carries the sequence's rows P, P+1, P+2
        cache.k[0, 0, :, P + node], cache.v[0, 0, :, P + node] = k[:, P + depth], v[:, P + depth]
        qt[node] = q[P + depth]
    vis, span = step_visible([P], anc[None])
    keys, values = cache.k[0][:, :, :span], cache.v[0][:, :, :span]
    out = attention.attend(qt.transpose(0, 1)[None], keys, values, vis, threads=th)
    got += [(f"tree node {node}", out[0, :, node], P + depth) for depth, node in enumerate((0, 3, 5))]
    # the accepted path compacted to consecutive slots, then a plain 1-token step over them
    cache.compact([0], [[P + 0, P + 3, P + 5]], [P])
    keys, values = cache.k[0][:, :, :P + 3], cache.v[0][:, :, :P + 3]
    out = attention.attend(q[P + 2][None, :, None], keys, values, None, threads=th)
    got.append(("after compact", out[0, :, 0], P + 2))

    # a serve step of 3 requests with cache lengths 300, 263, 350, each verifying a chain of 4; slots past a
    # row's own are NaN (invisible: never read); row 1 holds the sequence, the others noise
    lengths, T = [300, 263, 350], 4
    g = torch.Generator().manual_seed(7)
    bk, bv = torch.randn(2, 3, HKV, 400, D, generator=g)
    bq = torch.randn(3, H, T, D, generator=g)
    for b, n in enumerate(lengths):
        bk[b, :, n + T:], bv[b, :, n + T:] = float("nan"), float("nan")
    n = lengths[1]
    bk[1, :, :n + T], bv[1, :, :n + T] = k[:, :n + T], v[:, :n + T]
    bq[1] = q[n:n + T].transpose(0, 1)
    vis, span = step_visible(lengths, torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(3, T, T))
    out = attention.attend(bq, bk[:, :, :span], bv[:, :, :span], vis, threads=th)
    got += [(f"batch row 1 query {t}", out[1, :, t], n + t) for t in range(T)]

    # a 640-token prompt (causal), from slot 0
    T = 640
    vis, span = step_visible([0], torch.tril(torch.ones(T, T, dtype=torch.bool))[None])
    out = attention.attend(q[:T].transpose(0, 1)[None], k[None, :, :span], v[None, :, :span], vis, threads=th)
    got += [(f"prompt row {t}", out[0, :, t], t) for t in (0, 1, 15, 16, 17, 100, 263, 300, 301, 302, 639)]
    return got


def test_a_row_alone_equals_it_in_a_chain_a_tree_a_batch_and_a_prompt(sequence):
    """Every placement on 1 and 2 threads and every build equals the row decoded alone on 1 thread."""
    reference = {row: alone(sequence, row) for row in range(700)}
    for isa in ISAS:
        for threads in (1, 2):
            with kernel_isa(isa), torch_threads(threads):
                assert same(alone(sequence, 333, threads), reference[333])
                for name, out, row in placements(sequence):
                    assert same(out, reference[row]), f"{name} ({isa}, {threads} threads) != row {row} alone"


# ---- the forward's other float ops ------------------------------------------------------------------------

def rows_invariant(fn, x: torch.Tensor, *others: torch.Tensor) -> None:
    """fn's rows are the same bits computed alone, in 5, in all of x's rows, on 1 and 2 threads."""
    with torch_threads(1):
        ref = fn(x, *others)
    picks = [0, 1, 4, x.shape[0] // 2, x.shape[0] - 1]
    for threads in (1, 2):
        with torch_threads(threads):
            assert same(fn(x, *others), ref), f"all {x.shape[0]} rows, {threads} threads"
            assert same(fn(x[:5], *(o[:5] for o in others)), ref[:5]), f"5 rows, {threads} threads"
            for r in picks:
                assert same(fn(x[r:r + 1], *(o[r:r + 1] for o in others)), ref[r:r + 1]), f"row {r}, {threads} threads"


@pytest.mark.parametrize("width", [128, 576, 1536])
def test_rms_norm_is_row_invariant(width):
    """F.rms_norm as Transformer._norm calls it on float32 [B, T, width] (128: Qwen3's q/k norm per head)."""
    g = torch.Generator().manual_seed(width)
    x, w = torch.randn(600, width, generator=g) * 3, torch.randn(width, generator=g)
    rows_invariant(lambda t: F.rms_norm(t[None], (width,), w, 1e-6)[0], x)


@pytest.mark.parametrize("inter", [8960, 4864])
def test_silu_times_up_on_the_fused_halves_is_row_invariant(inter):
    """F.silu(gate) * up where gate, up = gate_up(x).chunk(2, -1) (strided views), at the 1.5B's and the 0.5B's
    intermediate sizes (multiples of 32: F.silu's vector body covers whole rows)."""
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(600, 2 * inter, generator=g) * 4

    def silu_up(t):
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows_invariant(silu_up, gu)


def test_silu_mul_equals_its_oracle_and_is_invariant_where_f_silu_is_not():
    """F.silu rounds its scalar tail differently from its vector body; at a width that is not a multiple of
    32 a row's bits then depend on the call. silu_mul computes every value one way."""
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(100_000, generator=g) * 6, torch.tensor([0.0, -0.0, -86.4, -86.6, -87.5, -200.0,
                                                                         90.0, 1e-30, -1e-30])])
    up = torch.randn_like(x)
    ref = attention_ref.silu_mul(x, up)
    for isa in ISAS:
        with kernel_isa(isa):
            assert same(attention.silu_mul(x, up), ref), isa
            assert same(attention.silu_mul(x[:13], up[:13]), ref[:13]), isa  # a partial last vector
    exact = x.double() / (1 + torch.exp(-x.double()))
    ones = attention.silu_mul(x, torch.ones_like(x))
    keep = x > -80
    assert ulps(ones[keep], exact[keep]).max() < 4
    gu = torch.randn(64, 2 * 1000, generator=g) * 4
    rows_invariant(lambda t: attention.silu_mul(*t.chunk(2, dim=-1)), gu)
    gate, upv = gu.chunk(2, dim=-1)
    assert same(attention.silu_mul(gate, upv), attention.silu_mul(gate.contiguous(), upv.contiguous()))


def test_rope_and_residual_add_are_row_invariant():
    """`qk * cos + rotated * sin` (Transformer.forward's RoPE on [B, T, H + Hkv, D]) and x + y."""
    g = torch.Generator().manual_seed(2)
    M, half = 600, D // 2
    qk = torch.randn(M, H + 2 * HKV, D, generator=g)[:, :H + HKV]  # a slice of the fused qkv rows
    freqs = torch.outer(torch.arange(M, dtype=torch.float32), 1.0 / 1e6 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]

    def rope(t, c, s):
        t, c, s = t[None], c[None], s[None]
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return (t * c + rotated * s)[0]
    rows_invariant(rope, qk, cos, sin)
    x, y = torch.randn(2, M, 1536, generator=g)
    rows_invariant(lambda a, b: (a[None] + b[None])[0], x, y)
