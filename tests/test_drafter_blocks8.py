"""`[weights] drafter_format = "blocks8"`: a GGUF drafter on its own file's blocks in the q8 arithmetic.

On SmolLM2's GGUF as both target and drafter: the drafter's logits are numerics.q8_transformer's bits on the same
file (its Q8_0 blocks read through the repacked copy), a big vocabulary's head keeps the first ids' bits and
-inf elsewhere, speculation with it equals q8 plain decoding under q8 and transformers' greedy decoding under
f32, it adds no private memory, and a drafter without a GGUF file is a one-line error.
"""

from __future__ import annotations

import pytest
import torch

from specpilot.core.engine import Engine, draft_format
from specpilot.core.engine.config import ModelLoadError
from specpilot.core.recipe import Recipe, presets

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

q8_blocks = pytest.importorskip("specpilot.kernels.cpu.q8_blocks")
if not q8_blocks.available():
    pytest.skip("the q8_blocks kernel does not build here", allow_module_level=True)

PROMPTS = [[1, 9690, 30, 12469, 216, 1326, 5353, 30, 14185, 42],
           [1, 504, 3458, 282, 4649, 314, 216, 216, 216, 216, 216, 216, 216]]
NEW = 20
B8 = {"weights": {"drafter_format": "blocks8"}}


@pytest.fixture(scope="module")
def q8(smollm2_dir, one_thread):
    return Engine.load(smollm2_dir, smollm2_dir, numerics="q8")


def _logits(model, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(tokens) + 4)
    n = len(tokens)
    with torch.inference_mode():
        return model.step(torch.tensor([tokens]), cache, cache.lengths, torch.arange(n)[None],
                          torch.tril(torch.ones(n, n, dtype=torch.bool))[None])[0]


def test_the_drafter_s_logits_are_the_q8_numerics_bits(q8):
    recipe = presets()["stock-gguf-b8"]
    assert recipe.weights.drafter_format == "blocks8"
    target, drafter = q8.models_for(recipe)
    assert drafter.weight_format.endswith("+blocks8") and drafter is not target
    assert drafter.lm_head.packed is not None and target.lm_head.packed is not None  # the tied Q8_0 head, repacked
    assert q8.packed_bytes(Recipe.from_dict(B8)) == 0  # memory-mapped blocks and shared cached repacks
    for p in PROMPTS:
        assert torch.equal(_logits(drafter, p), _logits(target, p))


def test_a_big_vocabulary_head_keeps_the_first_ids_bits(q8, monkeypatch):
    from specpilot.core.engine import gguf_checkpoint

    monkeypatch.setattr(draft_format, "HEAD_VOCAB", 1 << 14)
    head = q8.target.lm_head
    path = gguf_checkpoint.source(q8.target_dir)["gguf"]
    tensors = {t.name: t for t in gguf_checkpoint.reader(path).tensors}
    stored = tensors.get("output.weight") or tensors["token_embd.weight"]
    cut = draft_format.BlocksHead(stored.data, head, [0, 40000])
    x = torch.randn(3, head.k)
    full, got = head(x), cut(x)
    assert got.shape == full.shape == (3, head.n)
    assert torch.equal(got[:, : 1 << 14], full[:, : 1 << 14]) and torch.equal(got[:, 40000], full[:, 40000])
    rest = torch.ones(head.n, dtype=torch.bool)
    rest[: 1 << 14] = False
    rest[40000] = False
    assert torch.isinf(got[:, rest]).all() and cut.rows.packed is not None


def test_speculation_with_it_equals_q8_plain_decoding(q8):
    for depth in (3, 6):
        recipe = Recipe.from_dict({**B8, "tree": {"policy": "chain", "depth": depth}})
        for p in PROMPTS:
            ar = q8.generate([p], [NEW], None, speculative=False).tokens[0]
            ours = q8.generate([p], [NEW], recipe)
            assert ours.tokens[0] == ar
            assert any(a > 0 for s in ours.steps for a in s.accepted)


def test_under_f32_the_output_is_transformers_greedy(smollm2_dir, one_thread):
    from specpilot.core.hf import hf_model

    reference = hf_model(str(smollm2_dir))
    engine = Engine.load(smollm2_dir, smollm2_dir)
    eos = engine.target.cfg.eos_token_ids[0]
    recipe = Recipe.from_dict({**B8, "tree": {"policy": "chain", "depth": 4}})
    cut = lambda t: t[: t.index(eos) + 1] if eos in t else t  # noqa: E731
    for p in PROMPTS:
        with torch.inference_mode():
            ref = reference.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                     pad_token_id=eos)[0, len(p):].tolist()
        assert cut(engine.generate([p], NEW, recipe).tokens[0]) == cut(ref)
    assert engine.models_for(recipe)[1].weight_format == "native+blocks8"


def test_a_drafter_without_a_gguf_file_is_a_one_line_error(tiny_pair, one_thread):
    target_dir, drafter_dir, _ = tiny_pair
    engine = Engine.load(target_dir, drafter_dir)
    with pytest.raises(ModelLoadError, match="not a GGUF checkpoint.*drafter_format = 'q4'") as e:
        engine.models_for(Recipe.from_dict(B8))
    assert "\n" not in str(e.value)
