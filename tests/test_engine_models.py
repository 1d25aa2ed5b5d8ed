"""Our runtime against transformers as the independent reference, per supported architecture."""

import pytest
import torch

import tiny_models
from specpilot.core.engine import Engine
from specpilot.core.engine.model import Transformer


@pytest.mark.parametrize("arch", sorted(tiny_models.ARCHS))
def test_logits_and_greedy_match_transformers(tmp_path, arch):
    hf = tiny_models.build(tmp_path, arch, init=0.1)
    ours = Transformer.load(str(tmp_path))
    ids = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    cache = ours.new_cache(2, 40)
    causal = torch.tril(torch.ones(17, 17, dtype=torch.bool)).expand(2, 17, 17)
    with torch.inference_mode():
        logits = ours.step(ids, cache, cache.lengths, torch.arange(17).expand(2, 17), causal)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)

    engine = Engine(ours)
    prompts = [ids[0, :7].tolist(), ids[1, :11].tolist()]
    result = engine.generate(prompts, 24, speculative=False)
    assert result.tokens == [tiny_models.hf_greedy(hf, p, 24) for p in prompts]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_close(tmp_path, dtype):
    hf = tiny_models.build(tmp_path, "qwen2", init=0.1)
    ours = Transformer.load(str(tmp_path), dtype=dtype)
    ids = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.to(getattr(torch, dtype))(ids).logits.float()
    cache = ours.new_cache(1, 16)
    with torch.inference_mode():
        logits = ours.step(ids, cache, cache.lengths, torch.arange(9)[None],
                           torch.tril(torch.ones(9, 9, dtype=torch.bool))[None]).float()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, atol=0.05, rtol=0.05)


def test_sharded_checkpoint_loads(tmp_path):
    hf = tiny_models.build(tmp_path / "one", "llama2")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = Transformer.load(str(tmp_path / "one"))
    b = Transformer.load(str(tmp_path / "sharded"))
    assert torch.equal(a.layers[1].raw["down"], b.layers[1].raw["down"])
    assert torch.equal(a.embed, b.embed)
