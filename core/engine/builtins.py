"""The built-in mechanisms, registered through the same `register` call workspace plugins use (marked
`builtin=True`), each with every fact the rest of the system reads about it (core.mechanisms.MechanismSpec):
its memory, its cost-model curve, its constraints on other fields, its stand-in, its presets.

Each kind is defined here with its interface, one short example plugin and the built-in a plugin of it is
priced as; core/mechanisms.py turns them into the documentation agents receive, so the interface and its
documentation have one source. Adding a mechanism (a weight format, say) is one `register` call here
beside its implementation: validation, the memory budget, the cost model, the agents and the presets
read it from there.
"""

from __future__ import annotations

from typing import Any, Callable

from specpilot.core.mechanisms import Needs, Preset, define_kind, register

define_kind("drafter", "draft.method", '''
fn(engine, recipe, target, drafter_model) -> core.engine.drafters.Drafter
Builds the drafter for a recipe: `target` and `drafter_model` are the loaded Transformers (drafter_model
may be None) with the recipe's weight format and linear backend applied. A Drafter (an abstract class; its
docstring gives the lifecycle) implements open/admit/draft(spec, mode, active) -> list[DraftTree]/commit/
move/drop_last, and owed/catch_up where it owes its model work (subclass ModelDrafter or NgramDrafter and
override what you change).''', '''
from specpilot.core.engine.drafters import NgramDrafter
from specpilot.core.mechanisms import register

register("drafter", "ngram5", lambda engine, recipe, target, drafter_model: NgramDrafter(5))''', stand_in="model")

define_kind("tree_policy", "tree.policy", '''
fn(tree) -> list[list[int]] | core.engine.drafters.TreeSpec
The shape to draft. `tree` is the recipe's [tree] section (policy, depth, budget, topk, paths). Rank paths
[[0, 0, 0], [1], [0, 1]] mean the drafter's top-1 chain of depth 3, its 2nd-ranked first token, and the
2nd-ranked child of its top-1 first token (every prefix of a path is a node). Respect tree.budget (nodes)
and tree.depth (levels).''', '''
from specpilot.core.mechanisms import register

def shape(tree) -> list[list[int]]:
    return [[0] * tree.depth] + [[r] for r in range(1, min(tree.topk, tree.budget - tree.depth + 1))]

register("tree_policy", "wide_root", shape)''', stand_in="chain")

define_kind("draft_length", "draft.length", '''
fn(depth: int, recent: list[int]) -> int
How many levels to draft this step, per row: `depth` is the tree's full depth and `recent` the row's
accepted tokens per step so far (bonus included, newest last, at most 16). The result is clamped to
[1, depth]; drafting stops there, so a short step costs less drafting and verification.''', '''
from specpilot.core.mechanisms import register

def adaptive(depth: int, recent: list[int]) -> int:
    if len(recent) < 2:
        return depth
    return max(1, min(depth, round(sum(recent[-4:]) / len(recent[-4:]))))

register("draft_length", "adaptive", adaptive)''', stand_in="fixed")

define_kind("acceptance", "verify.sampling", '''
core.engine.decode.AcceptanceRule(choices, accept, batched=False, packed=None)
choices(logits [B, T, V], trees, ver, req, lengths) -> per-row choices; accept(tree, choice_row, generator)
-> (accepted node path, bonus token); optional packed: the same choices from the real nodes' logits [N, V]
(row by row, each row's list as long as its tree), which spares verify a padded [B, T, V]. The output must
stay token-identical to autoregressive decoding with the same rule (token forcing checks it).''', '''
from specpilot.core.engine.decode import AcceptanceRule
from specpilot.core.engine.tree import accept_path
from specpilot.core.mechanisms import register

def choices(logits, trees, ver, req, lengths):
    return logits.float().argmax(-1).tolist()

register("acceptance", "greedy_fp32", AcceptanceRule(choices, accept_path, batched=True))''', stand_in="greedy")

define_kind("batching", "batching.policy", '''
fn(policy: core.engine.batching.Policy, alphas: list[float]) -> list[int] | None
Per-row chain depths for one continuous-batching step (None = the recipe's tree unchanged). `alphas` are
the rows' acceptance estimates (a row's own, or its draft class's where the drafter classes drafts);
`policy.table` prices steps (verify_ms(rows, tokens), draft[rows]), policy.node_budget / token_cap are the
recipe's [batching] values. policy.owed / policy.left are the tokens each row owes the drafter and has left to
generate; policy.worth_drafting(alphas) says for which rows drafting would pay, catch-up included (a row given
depth 0 is not caught up).''', '''
from specpilot.core.mechanisms import register

def confident(policy, alphas):
    return [4 if a > 0.7 else 1 for a in alphas]

register("batching", "confident", confident)''', stand_in="fixed")

define_kind("weight_format", "weights.format", '''
fn(model: core.engine.model.Transformer, source: str | None, recipe) -> Transformer
A converted copy of a loaded model (`source` is its checkpoint directory or file) whose projections read
the format's weights. A format is lossless: refuse weights it cannot hold exactly.''', '''
from specpilot.core.mechanisms import register

register("weight_format", "same", lambda model, source, recipe: model)''', stand_in="native", drafter_field="weights.drafter")

define_kind("drafter_format", "weights.drafter_format", '''
fn(drafter: core.engine.model.Transformer) -> Transformer
The drafter model (after weights.format and runtime.linear) with its projections and LM head in a cheaper
form. A drafter only proposes tokens that the target verifies, so this format may be approximate: the output
cannot change, only how many drafts are accepted.''', '''
from specpilot.core.mechanisms import register

register("drafter_format", "as_is", lambda drafter: drafter)''', stand_in="same")

define_kind("linear_backend", "runtime.linear", '''
fn(model: core.engine.model.Transformer, skinny: Callable[[], Transformer]) -> Transformer
A copy of `model` whose projections run on this backend (`skinny()` returns the cached skinny-backend
copy to build on). The drafter model runs on it too.''', '''
from specpilot.core.mechanisms import register

register("linear_backend", "same", lambda model, skinny: model)''', stand_in="native")



def _chain(tree: Any) -> list[list[int]]:
    from specpilot.core.engine.tree import chain_paths

    return chain_paths(tree.depth)


def _static(tree: Any) -> list[list[int]]:
    return [list(p) for p in tree.paths]


def _dynamic(tree: Any) -> Any:
    from specpilot.core.engine.drafters import TreeSpec

    return TreeSpec("dynamic", depth=tree.depth, topk=tree.topk, budget=tree.budget)


def _with_paths(recipe: Any) -> str | None:
    if recipe.tree.paths:
        return None
    return "tree.paths must list the tree's paths (lists of ranks) when tree.policy = 'static'"


register("tree_policy", "chain", _chain, "the drafter's top-1 chain of tree.depth", builtin=True,
         presets=(Preset("chain6", changes={"tree": {"depth": 6}}),))
register("tree_policy", "static", _static, "explicit rank paths (tree.paths)", builtin=True,
         constraints=(_with_paths,))
register("tree_policy", "dynamic", _dynamic, "grow by cumulative draft probability, keep the best budget",
         builtin=True, presets=(Preset("dynamic", changes={"tree": {"depth": 6, "budget": 24, "topk": 4}}),))


def _model_drafter(engine: Any, recipe: Any, target: Any, drafter_model: Any) -> Any:
    from specpilot.core.engine.config import ModelLoadError
    from specpilot.core.engine.drafters import ModelDrafter

    if drafter_model is None:
        raise ModelLoadError("draft.method = 'model' needs a drafter checkpoint; pass --drafter DIR or "
                             "use draft.method 'ngram' or 'early_exit'")
    return ModelDrafter(drafter_model)


def _ngram_drafter(engine: Any, recipe: Any, target: Any, drafter_model: Any) -> Any:
    from specpilot.core.engine.drafters import NgramDrafter

    return NgramDrafter(recipe.draft.ngram_max)


def _early_exit_drafter(engine: Any, recipe: Any, target: Any, drafter_model: Any) -> Any:
    from specpilot.core.engine.config import ModelLoadError
    from specpilot.core.engine.drafters import ModelDrafter

    layers = recipe.draft.exit_layers(target.cfg.num_layers)
    if layers >= target.cfg.num_layers:
        raise ModelLoadError(f"draft.exit_layer = {layers} must be below the target's "
                             f"{target.cfg.num_layers} layers")
    return ModelDrafter(target.truncated(layers))


def _without_drafter_model(method: str) -> Callable[[Any], str | None]:
    """The constraint of a drafter that drafts without the drafter checkpoint: no drafter format to apply."""
    def check(recipe: Any) -> str | None:
        form = recipe.weights.drafter_format
        if form == "same":
            return None
        return (f"weights.drafter_format = {form!r} formats a drafter model; draft.method {method!r} has none: "
                "set drafter_format = 'same'")
    return check


def _with_probabilities(recipe: Any) -> str | None:
    if recipe.verify.sampling != "rejection":
        return None
    return ("verify.sampling = 'rejection' needs a drafter with probabilities; draft.method 'ngram' has none "
            "(allowed: model, early_exit)")


register("drafter", "model", _model_drafter, "the deployment's drafter checkpoint", builtin=True)
register("drafter", "ngram", _ngram_drafter, "prompt/context n-gram lookup", builtin=True,
         constraints=(_without_drafter_model("ngram"), _with_probabilities),
         presets=(Preset("ngram", changes={"draft": {"ngram_max": 3}, "tree": {"policy": "chain", "depth": 8}}),
                  Preset("ngram-tree", changes={"draft": {"ngram_max": 3},
                                                "tree": {"policy": "dynamic", "depth": 8, "budget": 16, "topk": 4}})))
register("drafter", "early_exit", _early_exit_drafter, "the target's first E layers", builtin=True,
         constraints=(_without_drafter_model("early_exit"),),
         presets=(Preset("early_exit", changes={"tree": {"policy": "chain", "depth": 4}}),))
register("draft_length", "fixed", lambda depth, recent: depth, "always the tree's full depth", builtin=True)


def _rule(name: str) -> Any:
    from specpilot.core.engine import decode
    from specpilot.core.engine.tree import accept_path, accept_rejection

    rules = {
        "greedy": decode.AcceptanceRule(decode.greedy_choices, accept_path, True, decode.greedy_packed),
        "seeded": decode.AcceptanceRule(decode.seeded_choices, accept_path, True, decode.seeded_packed),
        "rejection": decode.AcceptanceRule(decode.rejection_choices, accept_rejection),
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


def _on_a_chain(recipe: Any) -> str | None:
    if recipe.tree.policy == "chain":
        return None
    return "verify.sampling = 'rejection' needs tree.policy = 'chain'; use 'seeded' sampling for trees"


for _name, _checks in (("greedy", ()), ("seeded", ()), ("rejection", (_on_a_chain,))):
    register("acceptance", _name, _Lazy(lambda n=_name: _rule(n)), f"{_name} verification", builtin=True,
             constraints=_checks)


from specpilot.core.engine import batching  # noqa: E402,F401  registers the batching policies beside their code



def _packed12(model: Any, source: str | None, recipe: Any) -> Any:
    from specpilot.core.engine.weights import pack_transformer

    return pack_transformer(model)


def _gguf(model: Any, source: str | None, recipe: Any) -> Any:
    from specpilot.core.engine.gguf_format import gguf_transformer, source_file

    return gguf_transformer(model, source_file(source))


register("weight_format", "native", lambda model, source, recipe: model, "the checkpoint's weights as loaded",
         builtin=True)
register("weight_format", "packed12", _packed12, "lossless 12-bit packed weights (bfloat16-exact checkpoints)",
         builtin=True, memory=1.6)
register("weight_format", "gguf", _gguf, "a GGUF checkpoint's own quantised blocks, dequantised exactly in the kernel",
         builtin=True, curve="gguf", drafter=True,  # memory-mapped blocks, target and drafter: no private copy
         constraints=(Needs("runtime.linear", "native", "runs its own block kernel"),),
         presets=(Preset("stock-gguf"), Preset("ngram-gguf", "ngram"), Preset("ngram-tree-gguf", "ngram-tree")))


def _drafter_blocks(bits: int) -> Callable[[Any], Any]:
    def convert(drafter: Any) -> Any:
        from specpilot.core.engine.draft_format import quantised_drafter

        return quantised_drafter(drafter, bits)

    return convert


def _block_bytes(bits: int) -> Callable[[int], float]:
    """A drafter in `bits`-bit blocks: the values and each 32-block's scale, plus the bfloat16 copy its
    prompt products use where the CPU has bfloat16 units."""
    def memory(weights: int) -> float:
        from specpilot.core.engine.draft_format import BF16_BYTES, BYTES_PER_WEIGHT, fast_bf16

        return (BYTES_PER_WEIGHT[bits] + (BF16_BYTES if fast_bf16() else 0.0)) * weights

    return memory


register("drafter_format", "same", lambda drafter: drafter, "the drafter as weights.format and weights.drafter leave it",
         builtin=True)
register("drafter_format", "q8", _drafter_blocks(8), "approximate 8-bit drafter weights and activations (Q8_0 dot products)",
         builtin=True, memory=_block_bytes(8), curve="q8")
register("drafter_format", "q4", _drafter_blocks(4), "approximate 4-bit drafter weights (Q4_0) with 8-bit activations",
         builtin=True, memory=_block_bytes(4), curve="q4",
         presets=(Preset("stock-gguf-q4", "stock-gguf"),))  # the target exact on its blocks, the drafter lossy


def _drafter_on_blocks(drafter: Any) -> Any:
    from specpilot.core.engine.draft_format import gguf_drafter

    return gguf_drafter(drafter)


register("drafter_format", "blocks8", _drafter_on_blocks,
         "a GGUF drafter on its own file's blocks in the q8 arithmetic (VNNI integer products), its head over the "
         "first 65,536 ids", builtin=True, memory=0.0, curve="b8",  # memory-mapped blocks and shared repacks
         presets=(Preset("stock-gguf-b8", "stock-gguf"),))


def _backend(name: str) -> Callable[[Any, Callable[[], Any]], Any]:
    def build(model: Any, skinny: Callable[[], Any]) -> Any:
        if name == "native":
            return model
        from specpilot.core.engine.linear import linear_transformer

        return linear_transformer(model, name, skinny)
    return build


# memory: private copies per weight of target and drafter (onednn float32; skinny and fused its panels plus
# oneDNN's copy for wide steps)
for _name, _doc, _bytes in (("native", "torch's default matmul", 0.0), ("onednn", "oneDNN prepacked GEMM (CPU)", 4.0),
                            ("skinny", "SpecPilot's AVX2 few-row GEMM (CPU)", 8.0),
                            ("fused", "a whole decoder layer per C call around skinny products (CPU, float32)", 8.0)):
    register("linear_backend", _name, _backend(_name), _doc, builtin=True, memory=_bytes, curve=_name)
