"""The built-in mechanisms, registered through the same `register` call workspace plugins use.

Each kind is defined here with its interface and one short example plugin; core/mechanisms.py turns
them into the documentation agents receive, so the interface and its documentation have one source.
"""

from __future__ import annotations

from typing import Any, Callable

from core.mechanisms import define_kind, register

define_kind("drafter", "draft.method", '''
fn(engine, recipe, target, drafter_model) -> core.engine.drafters.Drafter
Builds the drafter for a recipe: `target` and `drafter_model` are the loaded Transformers (drafter_model
may be None) with the recipe's weight format and linear backend applied. A Drafter implements reset,
draft(spec, mode, active) -> list[DraftTree], commit, and for batching open/admit/move/drop_last
(subclass ModelDrafter or NgramDrafter and override what you change).''', '''
from core.engine.drafters import NgramDrafter
from core.mechanisms import register

register("drafter", "ngram5", lambda engine, recipe, target, drafter_model: NgramDrafter(5))''')

define_kind("tree_policy", "tree.policy", '''
fn(tree) -> list[list[int]] | core.engine.drafters.TreeSpec
The shape to draft. `tree` is the recipe's [tree] section (policy, depth, budget, topk, paths). Rank paths
[[0, 0, 0], [1], [0, 1]] mean the drafter's top-1 chain of depth 3, its 2nd-ranked first token, and the
2nd-ranked child of its top-1 first token (every prefix of a path is a node). Respect tree.budget (nodes)
and tree.depth (levels).''', '''
from core.mechanisms import register

def shape(tree) -> list[list[int]]:
    return [[0] * tree.depth] + [[r] for r in range(1, min(tree.topk, tree.budget - tree.depth + 1))]

register("tree_policy", "wide_root", shape)''')

define_kind("draft_length", "draft.length", '''
fn(depth: int, recent: list[int]) -> int
How many levels to draft this step, per row: `depth` is the tree's full depth and `recent` the row's
accepted tokens per step so far (bonus included, newest last, at most 16). The result is clamped to
[1, depth]; drafting stops there, so a short step costs less drafting and verification.''', '''
from core.mechanisms import register

def adaptive(depth: int, recent: list[int]) -> int:
    if len(recent) < 2:
        return depth
    return max(1, min(depth, round(sum(recent[-4:]) / len(recent[-4:]))))

register("draft_length", "adaptive", adaptive)''')

define_kind("acceptance", "verify.sampling", '''
core.engine.decode.AcceptanceRule(choices, accept, batched=False)
choices(logits [B, T, V], trees, ver, req, lengths) -> per-row choices; accept(tree, choice_row, generator)
-> (accepted node path, bonus token). The output must stay token-identical to autoregressive decoding
with the same rule (token forcing checks it).''', '''
from core.engine.decode import AcceptanceRule, _accept
from core.mechanisms import register

def choices(logits, trees, ver, req, lengths):
    return logits.float().argmax(-1).tolist()

register("acceptance", "greedy_fp32", AcceptanceRule(choices, _accept, batched=True))''')

define_kind("batching", "batching.policy", '''
fn(policy: core.engine.serve.Policy, alphas: list[float]) -> list[int] | None
Per-row chain depths for one continuous-batching step (None = the recipe's tree unchanged). `alphas` are
the rows' running acceptance estimates; `policy.table` prices steps (verify_ms(rows, tokens), draft[rows]),
policy.node_budget / token_cap are the recipe's [batching] values.''', '''
from core.mechanisms import register

def confident(policy, alphas):
    return [4 if a > 0.7 else 1 for a in alphas]

register("batching", "confident", confident)''')

define_kind("weight_format", "weights.format", '''
fn(model: core.engine.model.Transformer, source: str | None, recipe) -> Transformer
A converted copy of a loaded model (`source` is its checkpoint directory or file) whose projections read
the format's weights. A format is lossless: refuse weights it cannot hold exactly.''', '''
from core.mechanisms import register

register("weight_format", "same", lambda model, source, recipe: model)''')

define_kind("drafter_format", "weights.drafter_format", '''
fn(drafter: core.engine.model.Transformer) -> Transformer
The drafter model (after weights.format and runtime.linear) with its projections and LM head in a cheaper
form. A drafter only proposes tokens that the target verifies, so this format may be approximate: the output
cannot change, only how many drafts are accepted.''', '''
from core.mechanisms import register

register("drafter_format", "as_is", lambda drafter: drafter)''')

define_kind("linear_backend", "runtime.linear", '''
fn(model: core.engine.model.Transformer, skinny: Callable[[], Transformer]) -> Transformer
A copy of `model` whose projections run on this backend (`skinny()` returns the cached skinny-backend
copy to build on). The drafter model runs on it too.''', '''
from core.mechanisms import register

register("linear_backend", "same", lambda model, skinny: model)''')


def _model_drafter(engine: Any, recipe: Any, target: Any, drafter_model: Any) -> Any:
    from core.engine.config import ModelLoadError
    from core.engine.drafters import ModelDrafter

    if drafter_model is None:
        raise ModelLoadError("draft.method = 'model' needs a drafter checkpoint; pass --drafter DIR or "
                             "use draft.method 'ngram' or 'early_exit'")
    return ModelDrafter(drafter_model)


def _ngram_drafter(engine: Any, recipe: Any, target: Any, drafter_model: Any) -> Any:
    from core.engine.drafters import NgramDrafter

    return NgramDrafter(recipe.draft.ngram_max)


def _early_exit_drafter(engine: Any, recipe: Any, target: Any, drafter_model: Any) -> Any:
    from core.engine.config import ModelLoadError
    from core.engine.drafters import ModelDrafter

    layers = recipe.draft.exit_layers(target.cfg.num_layers)
    if layers >= target.cfg.num_layers:
        raise ModelLoadError(f"draft.exit_layer = {layers} must be below the target's "
                             f"{target.cfg.num_layers} layers")
    return ModelDrafter(target.truncated(layers))


register("drafter", "model", _model_drafter, "the deployment's drafter checkpoint")
register("drafter", "ngram", _ngram_drafter, "prompt/context n-gram lookup")
register("drafter", "early_exit", _early_exit_drafter, "the target's first E layers")


def _chain(tree: Any) -> list[list[int]]:
    from core.engine.tree import chain_paths

    return chain_paths(tree.depth)


def _static(tree: Any) -> list[list[int]]:
    return [list(p) for p in tree.paths]


def _dynamic(tree: Any) -> Any:
    from core.engine.drafters import TreeSpec

    return TreeSpec("dynamic", depth=tree.depth, topk=tree.topk, budget=tree.budget)


register("tree_policy", "chain", _chain, "the drafter's top-1 chain of tree.depth")
register("tree_policy", "static", _static, "explicit rank paths (tree.paths)")
register("tree_policy", "dynamic", _dynamic, "grow by cumulative draft probability, keep the best budget")
register("draft_length", "fixed", lambda depth, recent: depth, "always the tree's full depth")


def _rule(name: str) -> Any:
    from core.engine import decode

    rules = {
        "greedy": decode.AcceptanceRule(decode.greedy_choices, decode._accept, batched=True),
        "seeded": decode.AcceptanceRule(decode.seeded_choices, decode._accept, batched=True),
        "rejection": decode.AcceptanceRule(decode.rejection_choices, decode._accept_rejection),
    }
    return rules[name]


class _Lazy:
    """An acceptance rule built on first use, so validating a recipe never imports torch."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build, self._value = build, None

    def __getattr__(self, attr: str) -> Any:
        if self._value is None:
            self._value = self._build()
        return getattr(self._value, attr)


for _name in ("greedy", "seeded", "rejection"):
    register("acceptance", _name, _Lazy(lambda n=_name: _rule(n)), f"{_name} verification")


def _batching(name: str) -> Callable[[Any, list[float]], list[int] | None]:
    def policy(p: Any, alphas: list[float]) -> list[int] | None:
        from core.engine.serve import allocate, bend, best_uniform_depth

        if name == "fixed" or p.table is None:
            return None
        n = len(alphas)
        uniform = best_uniform_depth(p.table, n, sum(alphas) / n, overhead_ms=p.overhead_ms.get(n))
        if name == "budget":
            return [uniform] * n
        if name == "allocate":
            return allocate(alphas, p.node_budget or n * uniform)
        cap = p.token_cap or bend(p.table, n)
        return allocate(alphas, min(cap - n, n * max(uniform, 1)))
    return policy


for _name, _doc in (("fixed", "the recipe's tree for every row"),
                    ("budget", "one chain depth for all rows from the measured cost at this batch size"),
                    ("allocate", "a per-step node budget spread over rows by expected acceptance"),
                    ("cap", "allocate under a cap on verified tokens at the bend of the cost curve")):
    register("batching", _name, _batching(_name), _doc)


def _packed12(model: Any, source: str | None, recipe: Any) -> Any:
    from core.engine.weights import pack_transformer

    return pack_transformer(model)


register("weight_format", "native", lambda model, source, recipe: model, "the checkpoint's weights as loaded")
register("weight_format", "packed12", _packed12, "lossless 12-bit packed weights (bfloat16-exact checkpoints)")


def _gguf(model: Any, source: str | None, recipe: Any) -> Any:
    from core.engine.gguf_format import gguf_transformer, source_file

    return gguf_transformer(model, source_file(source))


register("weight_format", "gguf", _gguf, "a GGUF checkpoint's own quantised blocks, dequantised exactly in the kernel")


def _drafter_blocks(bits: int) -> Callable[[Any], Any]:
    def convert(drafter: Any) -> Any:
        from core.engine.draft_format import quantised_drafter

        return quantised_drafter(drafter, bits)

    return convert


register("drafter_format", "same", lambda drafter: drafter, "the drafter as weights.format and weights.drafter leave it")
register("drafter_format", "q8", _drafter_blocks(8), "approximate 8-bit drafter weights and activations (Q8_0 dot products)")
register("drafter_format", "q4", _drafter_blocks(4), "approximate 4-bit drafter weights (Q4_0) with 8-bit activations")


def _backend(name: str) -> Callable[[Any, Callable[[], Any]], Any]:
    def build(model: Any, skinny: Callable[[], Any]) -> Any:
        if name == "native":
            return model
        from core.engine.linear import linear_transformer

        return linear_transformer(model, name, skinny)
    return build


for _name, _doc in (("native", "torch's default matmul"), ("onednn", "oneDNN prepacked GEMM (CPU)"),
                    ("skinny", "SpecPilot's AVX2 few-row GEMM (CPU)"),
                    ("fused", "a whole decoder layer per C call around skinny products (CPU, float32)")):
    register("linear_backend", _name, _backend(_name), _doc)
