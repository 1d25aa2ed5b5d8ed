"""Random-weight tiny checkpoints of every supported architecture, built with transformers configs."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

ARCHS = {
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
               {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama2": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 24}),
}


def build(path: Path, arch: str = "llama2", vocab: int = 101, hidden: int = 64, layers: int = 2,
          heads: int = 4, kv_heads: int = 2, seed: int = 0, init: float = 0.02, **extra) -> transformers.PreTrainedModel:
    """Save a random tiny model of `arch` to `path` and return the transformers model (float32, eval)."""
    cfg_cls, model_cls, defaults = ARCHS[arch]
    torch.manual_seed(seed)
    cfg = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                  initializer_range=init, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                  **{"max_position_embeddings": 128, **defaults, **extra})
    model = model_cls(cfg).eval()
    model.save_pretrained(path)
    return model


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def repeating_prompts(lengths: list[int], vocab: int = 101, seed: int = 0) -> list[list[int]]:
    """Random prompts that repeat their first half, so n-gram lookup has something to find."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        base = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append(base + base[: length // 2])
    return out
