"""The speculative-decoding runtime: models, KV cache, drafters, trees, verification."""

from specpilot.core.engine.config import ModelConfig, ModelLoadError, SUPPORTED_NAMES
from specpilot.core.engine.decode import GenerateResult, GenerationError, StepStats, Verification
from specpilot.core.engine.engine import Engine, tree_spec
from specpilot.core.engine.scheduler import generate

__all__ = ["Engine", "GenerateResult", "GenerationError", "ModelConfig", "ModelLoadError", "StepStats",
           "SUPPORTED_NAMES", "Verification", "generate", "tree_spec"]
