"""Lossy drafter formats (`[weights] drafter_format = "q8" | "q4"`): the kernel against its plain-PyTorch
oracle on both instruction sets, the quantisation's error bound, the exact fallback for a prompt's rows, and
that a drafter in these formats leaves the target's greedy output identical to transformers'."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from specpilot.core.engine import Engine, draft_format
from specpilot.core.recipe import Recipe, RecipeError

q8_draft = pytest.importorskip("specpilot.kernels.cpu.q8_draft")
if not q8_draft.available():
    pytest.skip("the q8_draft kernel does not build here (no AVX2/FMA or no C compiler)", allow_module_level=True)

ISAS = ["avx2", "vnni"]


@pytest.fixture(params=ISAS)
def isa(request):
    before = q8_draft.isa()
    if q8_draft.use_isa(request.param) != request.param:
        q8_draft.use_isa(before)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    q8_draft.use_isa(before)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows, k", [(1, 64), (3, 96), (16, 896), (2, 40), (5, 32 * 13)])
def test_kernel_matches_its_reference(isa, bits, rows, k):
    """Integer block dots scaled per block: the C result equals the oracle up to float32 summation order."""
    torch.manual_seed(rows * k + bits)
    w = torch.randn(37, k)
    x = torch.randn(rows, k) * 3
    m = q8_draft.Q8Matrix(w, bits=bits)
    ref = q8_draft.reference(x, m.packed)
    got = m(x)
    assert got.shape == (rows, 37)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [8, 4])
def test_threads_do_not_change_a_bit(isa, bits):
    """Threads (the process's OpenMP team) split the output columns and each column's sum keeps its order, so
    the thread count cannot move a bit, inside torch's parallel region or outside it."""
    torch.manual_seed(bits)
    w, x = torch.randn(203, 256), torch.randn(5, 256)
    one = q8_draft.Q8Matrix(w, bits=bits, threads=1)(x)
    for t in (2, 3, 7):
        m = q8_draft.Q8Matrix(w, bits=bits, threads=t, packed=q8_draft.quantize(w, bits))
        assert torch.equal(m(x), one), t
        torch.add(torch.randn(1 << 16), 1)  # a torch op between calls: its team is the one the kernel reuses
        assert torch.equal(m(x), one), t


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_weights_stay_within_half_a_step(bits):
    """q8: |w - w'| <= d / 2 per 32-block; q4 (Q4_0, d = the signed extreme / -8): <= |d| (+8 d clamps to 7)."""
    torch.manual_seed(bits)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]
    packed = q8_draft.quantize(w, bits)
    back = q8_draft.weights_of(packed)
    d = packed["d"].float().abs().repeat_interleave(32, dim=1)
    bound = d / 2 if bits == 8 else d
    assert torch.all((back - w).abs() <= bound * (1 + 1e-3) + 1e-12)
    assert packed["q"].numel() * packed["q"].element_size() == w.numel() * bits // 8


def test_products_approximate_the_float_product():
    """The point of the format: close to x @ W.T (what the drafter would have computed exactly)."""
    torch.manual_seed(0)
    w, x = torch.randn(256, 512), torch.randn(2, 512)
    exact = x @ w.T
    for bits, tol in ((8, 0.02), (4, 0.2)):
        err = (q8_draft.Q8Matrix(w, bits=bits)(x) - exact).norm() / exact.norm()
        assert err < tol, (bits, err)


def test_bias_dtype_and_the_exact_fallback_for_wide_inputs():
    torch.manual_seed(1)
    w, b = torch.randn(24, 64), torch.randn(24)
    calls = []

    def exact(x):
        calls.append(x.shape)
        return torch.nn.functional.linear(x, w, b)

    m = q8_draft.Q8Matrix(w, b, wide=exact, bits=4)
    few = torch.randn(1, 3, 64)
    assert torch.allclose(m(few), q8_draft.reference(few[0], m.packed)[None] + b, atol=1e-4)
    assert not calls
    wide = torch.randn(q8_draft.MAX_ROWS + 1, 64)
    assert torch.equal(m(wide), exact(wide)) and len(calls) == 2
    assert m(few.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="features"):
        m(torch.randn(1, 63))


def test_recipe_refuses_a_drafter_format_without_a_drafter_model():
    with pytest.raises(RecipeError, match="drafter_format = 'q4' formats a drafter model"):
        Recipe.from_dict({"draft": {"method": "ngram"}, "weights": {"drafter_format": "q4"}})
    with pytest.raises(RecipeError, match="weights.drafter_format = 'q2'"):
        Recipe.from_dict({"weights": {"drafter_format": "q2"}})


@pytest.fixture(scope="module")
def pair(tiny_pair, one_thread):
    target_dir, drafter_dir, target = tiny_pair
    return Engine.load(target_dir, drafter_dir), target


@pytest.mark.parametrize("form", ["q8", "q4"])
def test_a_lossy_drafter_leaves_the_output_identical_to_transformers(pair, form):
    """The drafter's products change (its drafts may too); the target's verification keeps every output
    token equal to transformers' greedy decoding."""
    engine, reference = pair
    recipe = Recipe.from_dict({"tree": {"policy": "chain", "depth": 4}, "weights": {"drafter_format": form}})
    target, drafter = engine.models_for(recipe)
    assert drafter.weight_format == f"native+{form}" and target.weight_format == "native"
    assert engine.packed_bytes(recipe) == 0  # converted once, cached
    prompts = tiny_models.repeating_prompts([12, 20, 9], seed=3)
    for p in prompts:
        ours = engine.generate([p], 24, recipe)
        assert ours.tokens[0] == tiny_models.hf_greedy(reference, p, 24)
        assert any(a > 0 for s in ours.steps for a in s.accepted)


def test_a_big_vocabulary_is_drafted_from_its_first_ids(tiny_pair, monkeypatch, one_thread):
    """Over 2 * HEAD_VOCAB ids the drafting head computes the first HEAD_VOCAB and end of sequence only: the
    others are -inf (never drafted), the kept ones are the q4 product of their rows; the output is still
    transformers'."""
    target_dir, drafter_dir, reference = tiny_pair
    monkeypatch.setattr(draft_format, "HEAD_VOCAB", 40)
    engine = Engine.load(target_dir, drafter_dir)
    engine.drafter_model.cfg.eos_token_ids = [97]
    recipe = Recipe.from_dict({"weights": {"drafter_format": "q4"}})
    _, drafter = engine.models_for(recipe)
    head = drafter.lm_head
    assert isinstance(head, draft_format.VocabHead) and head.keep.tolist() == [*range(40), 97]
    x = torch.randn(2, engine.drafter_model.cfg.hidden_size)
    logits = head(x)
    assert logits.shape == (2, 101)
    assert torch.isinf(logits[:, 40:97]).all() and torch.isinf(logits[:, 98:]).all()
    rows = q8_draft.Q8Matrix(engine.drafter_model.lm_head_weight[head.keep], bits=4)
    assert torch.allclose(logits[:, head.keep], q8_draft.reference(x, rows.packed), rtol=1e-5, atol=1e-4)
    for p in tiny_models.repeating_prompts([14, 9], seed=4):
        assert engine.generate([p], 16, recipe).tokens[0] == tiny_models.hf_greedy(reference, p, 16)


def test_the_drafter_copy_is_budgeted_before_it_is_built(tiny_pair):
    target_dir, drafter_dir, _ = tiny_pair
    engine = Engine.load(target_dir, drafter_dir)
    weights = sum(m.numel() for m in engine.drafter_model.matrices())
    q4 = Recipe.from_dict({"weights": {"drafter_format": "q4"}})
    bf16 = draft_format.BF16_BYTES if draft_format.fast_bf16() else 0.0  # the prompt's copy on an AMX CPU
    assert engine.packed_bytes(q4) == int(weights * (0.5 + 2 / 32 + bf16))
    assert engine.packed_bytes(Recipe()) == 0


def test_plain_decoding_on_a_recipe_builds_no_drafter_copy(tiny_pair):
    """A server decoding plainly on a q4-drafter recipe's target (`ar+...`) must not build the drafter's 4-bit
    copy (reading its float32 weights to do it): only speculation does."""
    target_dir, drafter_dir, _ = tiny_pair
    engine = Engine.load(target_dir, drafter_dir)
    q4 = Recipe.from_dict({"weights": {"drafter_format": "q4"}})
    before = engine.packed_bytes(q4)
    assert before > 0
    engine.target_for(q4)
    engine.scheduler(q4, 2, speculative=False)
    engine.generate([[1, 2, 3]], 4, q4, speculative=False)
    assert engine.packed_bytes(q4) == before  # still to be built
    engine.models_for(q4)
    assert engine.packed_bytes(q4) == 0


def test_smollm2_with_a_q4_copy_of_itself_as_drafter_is_lossless(smollm2_dir, one_thread):
    """A real model: SmolLM2 drafting for itself from 4-bit blocks still gives transformers' float32 greedy
    output, the target on its GGUF blocks."""
    from transformers import AutoTokenizer

    from specpilot.core.hf import hf_model
    from specpilot.core.workload import Request, encode

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = [encode(tok, Request(str(i), p, 24, chat=True)) for i, p in
               enumerate(["Write a Python function that reverses a string.", "What is a prime number?"])]
    reference = hf_model(str(smollm2_dir))
    engine = Engine.load(smollm2_dir, smollm2_dir)
    eos = engine.target.cfg.eos_token_ids[0]
    recipe = Recipe.from_dict({"weights": {"format": "gguf", "drafter": True, "drafter_format": "q4"}})
    for p in prompts:
        with torch.inference_mode():
            ref = reference.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                     pad_token_id=tok.eos_token_id)[0, len(p):].tolist()
        ours = engine.generate([p], 24, recipe).tokens[0]
        cut = lambda t: t[: t.index(eos) + 1] if eos in t else t  # noqa: E731
        assert cut(ours) == cut(ref)
    assert engine.models_for(recipe)[1].weight_format == "gguf+q4"
