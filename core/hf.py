"""Hugging Face transformers models of a checkpoint: the forcing reference and the side-by-side baselines.

On the CPU in the checkpoint's own dtype, the model's parameters are the same copy-on-write memory map the
engine reads (core/engine/loader.py), assigned into a transformers model built with empty weights: no
private copy of a 7 GB model per process, and the reference still runs transformers' own forward over
bit-identical values. Anywhere else (a GPU, another dtype) it is a plain `from_pretrained`.
"""

from __future__ import annotations

import torch


def hf_model(path: str, dtype: str = "float32", device: str = "cpu"):
    """The transformers causal LM of checkpoint directory `path`, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if device != "cpu":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
    from accelerate import init_empty_weights

    from specpilot.core.engine.loader import load_state_dict

    state = load_state_dict(path)
    if any(t.dtype != torch_dtype for t in state.values() if t.is_floating_point()):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    result = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left or result.unexpected_keys:
        raise ValueError(f"{path}: transformers model left {left[:3]} unset, unexpected {result.unexpected_keys[:3]}")
    return model.eval()
