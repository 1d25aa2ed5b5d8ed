"""runtime.linear = "fused": each layer in one C call (kernels/cpu/layer.c) around the skinny products. Its logits
match the torch path of the same model on batched tree steps (per-row bases, offsets, masks, GQA, Qwen's
q/k norms and biases), its cache writes are the torch path's, wide steps fall back, the dispatch probe skips
its products, batched serving (the model drafter on the fused layer too) equals single-request AR, and a bf16
model is refused in one line."""

import pytest
import torch

import tiny_models
from specpilot.core.engine import Engine
from specpilot.core.engine.config import ModelLoadError
from specpilot.core.engine.fused import FusedTransformer
from specpilot.core.engine.linear import linear_transformer
from specpilot.core.recipe import Recipe
from specpilot.kernels.cpu import skinny

pytestmark = pytest.mark.skipif(not skinny.available(), reason="no AVX2+FMA or no C compiler")
FUSED = {"runtime": {"linear": "fused"}}


def tree_step(model, cache, tokens, base, depths, ancestors, offset=0):
    with torch.inference_mode():
        return model.step(tokens, cache, base, depths, ancestors, offset)


def random_tree(batch: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row random trees: node i's parent is a random earlier node (or none); depths and ancestry."""
    g = torch.Generator().manual_seed(seed)
    anc = torch.zeros(batch, width, width, dtype=torch.bool)
    depths = torch.zeros(batch, width, dtype=torch.long)
    for b in range(batch):
        for i in range(width):
            anc[b, i, i] = True
            if i:
                parent = int(torch.randint(0, i, (1,), generator=g))
                anc[b, i] |= anc[b, parent]
                depths[b, i] = depths[b, parent] + 1
    return depths, anc


@pytest.mark.parametrize("arch,heads,extra", [
    ("llama2", 6, {}), ("qwen2", 6, {}), ("qwen3", 6, {}), ("mistral", 6, {}),
    ("llama2", 4, {"head_dim": 64}),  # value blocks of 1, 2 and 3 queries over 32 columns
    ("qwen3", 6, {"head_dim": 40}),   # one 32-column value block and a scalar tail
])
def test_fused_logits_and_cache_match_the_torch_path(tmp_path, arch, heads, extra, one_thread):
    tiny_models.build(tmp_path, arch, layers=2, init=0.1, seed=7, heads=heads, kv_heads=2, hidden=96, **extra)
    model = Engine.load(tmp_path).target
    torch_path, fused = linear_transformer(model, "skinny"), linear_transformer(model, "fused")
    assert isinstance(fused, FusedTransformer) and not isinstance(torch_path, FusedTransformer)
    prompts = tiny_models.repeating_prompts([9, 17, 5], seed=1)
    caches = []
    for m in (torch_path, fused):
        cache = m.new_cache(3, 64)
        for row, prompt in enumerate(prompts):
            m.prefill_row(cache, row, prompt)
        caches.append(cache)
    torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(3)
    for width, offset in ((1, 0), (7, 0), (5, 2)):
        depths, anc = random_tree(3, width, seed=width)
        if offset:  # queries after `offset` already-written tree slots: each sees them as its ancestors
            anc = torch.cat([torch.ones(3, width, offset, dtype=torch.bool), anc], 2)
            depths = depths + offset
        tokens = torch.randint(0, 101, (3, width), generator=g)
        out = [tree_step(m, c, tokens, c.lengths, depths, anc, offset) for m, c in zip((torch_path, fused), caches)]
        assert out[1].shape == (3, width, 101)
        torch.testing.assert_close(out[1], out[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[1].v, caches[0].v, rtol=1e-5, atol=1e-5)
        assert (out[1] - out[0]).abs().max() < (out[0] - out[0].roll(1, -1)).abs().max() * 1e-3


def test_ragged_steps_compute_only_the_real_tokens(pair_engine, one_thread):
    """With `sizes`, each row's padding is skipped: real tokens' logits match the padded torch step, the
    padding's logits are zeros and its cache slots are never written."""
    torch_path, fused = (linear_transformer(pair_engine.target, b) for b in ("skinny", "fused"))
    prompts = tiny_models.repeating_prompts([9, 17, 5], seed=2)
    sizes = [3, 7, 1]
    depths, anc = random_tree(3, 7, seed=11)
    for b, n in enumerate(sizes):  # padding nodes see only themselves, as batch_tensors builds them
        anc[b, n:] = torch.eye(7, dtype=torch.bool)[n:]
        depths[b, n:] = 0
    tokens = torch.randint(0, 101, (3, 7), generator=torch.Generator().manual_seed(4))
    out, caches = [], []
    for m, kw in ((torch_path, {}), (fused, {"sizes": sizes})):
        cache = m.new_cache(3, 40)
        for row, prompt in enumerate(prompts):
            m.prefill_row(cache, row, prompt)
        with torch.inference_mode():
            out.append(m.step(tokens, cache, cache.lengths, depths, anc, **kw))
        caches.append(cache)
    for b, n in enumerate(sizes):
        torch.testing.assert_close(out[1][b, :n], out[0][b, :n], rtol=1e-4, atol=1e-4)
        assert not out[1][b, n:].any() and (n == 7 or out[0][b, n:].abs().sum() > 0)
        base = len(prompts[b])
        torch.testing.assert_close(caches[1].k[:, b, :, :base + n], caches[0].k[:, b, :, :base + n],
                                   rtol=1e-5, atol=1e-5)
        assert not caches[1].k[:, b, :, base + n:].any() and (n == 7 or caches[0].k[:, b, :, base + n:].any())
    real = torch.arange(7)[None, :] < torch.tensor(sizes)[:, None]
    for m, padded in ((torch_path, out[0]), (fused, out[1])):  # `packed`: the real tokens' logits alone, in row order
        cache = m.new_cache(3, 40)
        for row, prompt in enumerate(prompts):
            m.prefill_row(cache, row, prompt)
        with torch.inference_mode():
            packed = m.step(tokens, cache, cache.lengths, depths, anc, sizes=sizes, packed=True)
        assert packed.shape == (sum(sizes), padded.shape[-1]) and torch.equal(packed, padded[real])


def test_a_wide_ragged_step_falls_back_and_still_packs(pair_engine, one_thread):
    """More real tokens than the C layers take: the step runs the padded torch path, and `packed` still returns the
    real tokens' logits alone, those of the same padded step."""
    fused = linear_transformer(pair_engine.target, "fused")
    width = fused._rows
    sizes = [width, width // 2 + 1]
    assert sum(sizes) > fused._rows
    prompts = tiny_models.repeating_prompts([9, 17], seed=5)
    tokens = torch.randint(0, 101, (2, width), generator=torch.Generator().manual_seed(6))
    depths = torch.arange(width).expand(2, width)
    anc = torch.tril(torch.ones(width, width, dtype=torch.bool)).expand(2, width, width)
    out = []
    for packed in (False, True):
        cache = fused.new_cache(2, 40 + width)
        for row, prompt in enumerate(prompts):
            fused.prefill_row(cache, row, prompt)
        with torch.inference_mode():
            out.append(fused.step(tokens, cache, cache.lengths, depths, anc, sizes=sizes, packed=packed))
    real = torch.arange(width)[None, :] < torch.tensor(sizes)[:, None]
    assert out[1].shape == (sum(sizes), out[0].shape[-1]) and torch.equal(out[1], out[0][real])


def test_wide_steps_take_the_torch_path_and_agree(pair_engine, one_thread):
    fused = linear_transformer(pair_engine.target, "fused")
    rows = fused._rows
    prompt = tiny_models.repeating_prompts([rows + 10])[0]
    assert len(prompt) > rows
    logits = []
    for m in (pair_engine.target, fused):
        cache = m.new_cache(1, len(prompt) + rows + 8)
        m.prefill_row(cache, 0, prompt)  # one step wider than the C path takes
        n = len(prompt)
        tokens = torch.tensor([prompt[:rows + 1]])
        logits.append(tree_step(m, cache, tokens, cache.lengths, torch.arange(rows + 1)[None],
                                torch.tril(torch.ones(rows + 1, rows + 1, dtype=torch.bool))[None]))
        assert int(cache.lengths[0]) == n
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_dispatch_probe_skips_the_products(pair_engine, one_thread):
    """The bare copy runs the C layers without products (zero logits); the fused model itself is untouched."""
    from specpilot.core.costmodel.profile import without_products

    fused = linear_transformer(pair_engine.target, "fused")
    bare = without_products(fused)
    assert isinstance(bare, FusedTransformer) and not bare.products and fused.products
    for m, nonzero in ((bare, False), (fused, True)):
        cache = m.new_cache(1, 16)
        logits = tree_step(m, cache, torch.tensor([[3, 4, 5]]), cache.lengths, torch.arange(3)[None],
                           torch.tril(torch.ones(3, 3, dtype=torch.bool))[None])
        assert logits.shape == (1, 3, 101) and bool(logits.any()) == nonzero
        assert bool(cache.k.any()) == nonzero  # no products: q, k, v are zero, so are the written keys
    early = fused.truncated(1)
    assert isinstance(early, FusedTransformer) and len(early._params) == 1 == len(early.layers)


def test_fused_batched_serving_equals_single_request_ar(pair_engine, one_thread):
    """Ragged verification under every batching policy (allocate and cap give rows different depths)."""
    prompts = tiny_models.repeating_prompts([9, 14, 20, 11, 16, 7], seed=5)
    limits = [20, 12, 24, 16, 20, 9]
    ar = [pair_engine.generate([p], [n], speculative=False).tokens[0] for p, n in zip(prompts, limits)]
    fused, drafter = pair_engine.models_for(Recipe.from_dict(FUSED))
    assert fused.ragged and not pair_engine.target.ragged
    assert isinstance(drafter, FusedTransformer)  # the runtime is the deployment's: the drafter runs on it too
    skinny = pair_engine.models_for(Recipe.from_dict({"runtime": {"linear": "skinny"}}))[0]
    assert fused.layers[0].qkv is skinny.layers[0].qkv  # one set of packed weights for both backends
    for extra in ({"tree": {"policy": "dynamic", "depth": 4, "budget": 10}},
                  {"draft": {"method": "early_exit", "exit_layer": 1}, "tree": {"depth": 3}},
                  {"draft": {"method": "ngram"}, "tree": {"depth": 6}, "batching": {"policy": "allocate"}},
                  {"draft": {"method": "ngram"}, "tree": {"depth": 6}, "batching": {"policy": "cap"}}):
        recipe = Recipe.from_dict({**FUSED, **extra})
        assert pair_engine.serve(prompts, limits, recipe, max_batch=4).tokens == ar


def test_fused_refuses_bfloat16_in_one_line(tmp_path):
    tiny_models.build(tmp_path, "llama2", init=0.1).to(torch.bfloat16).save_pretrained(tmp_path)
    engine = Engine.load(tmp_path, dtype="bfloat16")
    with pytest.raises(ModelLoadError, match=r"^runtime.linear = 'fused' computes in float32, not bfloat16; use "
                                             r"linear = 'skinny' or dtype float32$"):
        engine.models_for(Recipe.from_dict(FUSED))
