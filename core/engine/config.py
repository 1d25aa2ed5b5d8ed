"""Model configuration read from a Hugging Face config.json, for the Llama family only."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_NAMES = "Llama 2/3, Mistral, Qwen2/2.5, Qwen3 (" + ", ".join(SUPPORTED) + ")"


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message says what to do."""


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory {path} does not exist; pass a local Hugging Face checkpoint "
                                 "directory (config.json + *.safetensors)")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{path} has no config.json; pass a Hugging Face checkpoint directory")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{cfg_path} is not valid JSON ({exc.msg}); re-save the checkpoint") from None
        return cls.from_dict(raw, source=str(cfg_path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        archs = raw.get("architectures") or []
        family = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
        if family is None:
            found = ", ".join(archs) or raw.get("model_type", "unknown")
            raise ModelLoadError(f"{source}: architecture {found} is not supported; supported: {SUPPORTED_NAMES}")
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        gen = Path(source).parent / "generation_config.json" if source.endswith("config.json") else None
        if gen is not None and gen.is_file():
            try:
                g = json.loads(gen.read_text()).get("eos_token_id")
                eos_ids += [g] if isinstance(g, int) else list(g or [])
            except json.JSONDecodeError:
                pass
        return cls(
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=raw.get("tie_word_embeddings", family != "llama" or False),
            attention_bias=raw.get("attention_bias", family == "qwen2"),
            qk_norm=family == "qwen3",
            eos_token_ids=sorted(set(eos_ids)),
        )

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, with Llama 3 / linear scaling applied as transformers does."""
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return inv
        if kind == "linear":
            return inv / scaling["factor"]
        if kind == "llama3":
            factor = scaling["factor"]
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            old_ctx = scaling["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        raise ModelLoadError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")
