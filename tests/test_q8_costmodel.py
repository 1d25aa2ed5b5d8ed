"""The q8 numerics in the cost model, the agents and the batching policies (issue item 7).

- a q8 profile records its numerics (round trip; stored profiles without it read as f32), times the q8 target
  by nodes over 1..64, and never loads a variant q8 refuses (another linear backend, a re-encoded target);
- on the verify curve measured on the 1.5B target under q8 (flat to about 4 rows) the tree and draft-length
  agents price and propose deeper drafts than on the float32 curve, from the curve, not from the numerics'
  name; under q8 no agent proposes a recipe numerics.check_recipe refuses (real cost tools on SmolLM2 too);
- the batching cost table of a q8 engine times the q8 target, and its policies re-plan from it;
- `specpilot serve --numerics q8` answers a chat completion through the openai client with q8 plain decoding.
No assertion here is about speed: only what was measured with what, and the decisions taken from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.local import (DraftLengthAgent, DrafterChoiceAgent, DrafterFormatAgent, MemoryAgent,
                                         RuntimeAgent, TreeShapeAgent, WeightFormatAgent, draft_nodes)
from specpilot.core.agents.local.common import flat_width
from specpilot.core.costmodel import trees
from specpilot.core.costmodel.profile import NODES, Profile, interpolate, profile, variants
from specpilot.core.engine import numerics
from specpilot.core.engine.batching import CostTable, best_uniform_depth
from specpilot.core.engine.tree import static_prefixes
from specpilot.core.recipe import Recipe, builtin

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

# ms per forward of the 1.5B target's linears, 1 thread (the measurements): rows -> ms
Q8 = {1: 29.3, 2: 28.0, 4: 32.7, 5: 36.7, 8: 50.6, 16: 92.7, 32: 181.5, 64: 363.0}
F32 = {1: 66.7, 2: 81.2, 4: 127.0, 5: 115.7, 8: 162.8, 16: 343.0, 32: 687.0, 64: 1374.0}
STEEP = {n: 30.0 * n for n in (1, 2, 4, 8, 16, 32, 64)}  # compute-bound: every row costs a full forward
RANKS = {"model": [0.8, 0.1, 0.04], "ngram": [0.55]}
DRAFT_MS = {"model": 1.0, "ngram": 0.05}  # per drafted level: a drafter cheap beside either target
PROMPTS = [[1, 9690, 30, 12469, 216, 1326, 5353, 30, 14185, 42], [1, 504, 3458, 282, 4649, 314, 216, 216, 216]]


class CurveProfile:
    def __init__(self, curves: dict[str, dict[int, float]]) -> None:
        self.backend_curves = curves
        self.drafter_backend_curves: dict = {}

    def verify_curve_for(self, backend: str) -> dict[int, float]:
        return self.backend_curves[backend]


class CurveTools:
    """A stand-in for CostTools priced on a given verify curve: acceptance from rank frequencies, the step
    the curve's forward at the step's nodes plus a drafter level's cost per level. The profile offers
    cheaper linear backends, so an agent blind to the numerics would propose one."""

    def __init__(self, curve: dict[int, float], numerics_: str = "f32", device: str = "cpu",
                 weight_ms: float = 0.0) -> None:
        self.curve, self.numerics, self.device, self.weight_ms = curve, numerics_, device, weight_ms
        self.batch_size, self.layers, self.drafters = 1, 3, ["model", "ngram"]
        self.profile = CurveProfile({"native": curve, "onednn": {n: ms / 2 for n, ms in curve.items()},
                                     "fused": {n: ms / 3 for n, ms in curve.items()}})

    def verify_ms(self, nodes: int) -> float:
        return interpolate(self.curve, nodes)

    def nodes(self, recipe: Recipe) -> list[tuple[int, ...]]:
        t = recipe.tree
        if t.policy == "chain":
            return static_prefixes([[0] * t.depth])
        if t.policy == "static":
            return static_prefixes(t.paths)
        return static_prefixes(self.best_tree(t.budget, t.depth, recipe.draft.method))

    def best_tree(self, budget: int, max_depth: int, drafter: str | None = None) -> list[list[int]]:
        return trees.leaves(trees.sequoia(RANKS[drafter or "model"], budget, max_depth)[budget]) or [[0]]

    def accepted(self, recipe: Recipe) -> float:
        return trees.expected_length(RANKS[recipe.draft.method], self.nodes(recipe))

    def step_ms(self, recipe: Recipe) -> dict[str, float]:
        nodes = self.nodes(recipe)
        depth = max((len(n) for n in nodes), default=0)
        verify = interpolate(self.profile.backend_curves[recipe.runtime.linear], len(nodes) + 1)
        return {"draft": DRAFT_MS[recipe.draft.method] * depth, "verify": verify, "host": 0.3}

    def predict(self, recipe: Recipe) -> float:
        return 1000 * self.accepted(recipe) / sum(self.step_ms(recipe).values())


def context(tmp_path: Path, tools: Any, numerics_: str, recipe: Recipe | None = None,
            memory: list | None = None) -> AgentContext:
    return AgentContext(deployment={"target": "t", "drafter": "d", "device": "cpu", "numerics": numerics_,
                                    "fingerprint": "here"},
                        recipe=recipe or builtin("stock"), cost_report={}, memory=memory or [],
                        direction="acceptance", workspace=tmp_path, tuning_summary={}, tools=tools)


def run(agent: Any, ctx: AgentContext) -> tuple[Candidate | AgentFailure, str]:
    chunks: list[str] = []
    return agent.propose(ctx, chunks.append), "".join(chunks)


def allowed(out: Candidate | AgentFailure, numerics_: str) -> None:
    """A candidate's recipe passes check_recipe under the numerics; a failure is an honest one."""
    if isinstance(out, Candidate):
        numerics.check_recipe(numerics_, out.recipe.weights.format, out.recipe.runtime.linear)
    else:
        assert out.reason and "Error" not in out.reason, out.reason


# -- the agents on a flat and a steep curve (no models) ------------------------------------------------------

def test_the_q8_curve_is_flat_to_four_rows_and_the_float32_one_is_not():
    assert flat_width(CurveTools(Q8)) == 4  # 5 rows cost 1.253x one: just past KNEE
    assert flat_width(CurveTools(F32)) == 2
    assert flat_width(CurveTools({1: 10.0, 64: 11.0})) == 64


def test_tree_shape_and_draft_length_draft_deeper_on_the_flat_curve(tmp_path):
    """The same agents, the same acceptance, from a chain of 2, only the curve differs (both labelled f32: the
    depth comes from the curve's shape, not from the numerics' name). On the q8 curve chains to 8 and 16-32-node
    dynamic trees to depth 8 are priced, and a deeper draft wins; on the steep one none of them is priced and
    nothing deeper pays."""
    two = builtin("stock").replace(tree={"depth": 2})
    flat_tools, steep_tools = CurveTools(Q8), CurveTools(STEEP)
    flat, flat_text = run(TreeShapeAgent(), context(tmp_path, flat_tools, "f32", two))
    steep, steep_text = run(TreeShapeAgent(), context(tmp_path, steep_tools, "f32", two))
    assert "flat, so wider and deeper trees" in flat_text and "(to depth 8)" in flat_text
    assert "chain depth 8:" in flat_text and "chain depth 9:" not in flat_text
    assert "dynamic budget 16 depth 8" in flat_text and "dynamic budget 32 depth 8" in flat_text
    assert "depth 10" not in flat_text
    assert "flat" not in steep_text and "chain depth" not in steep_text and "budget 32 depth 8" not in steep_text
    assert isinstance(flat, Candidate) and draft_nodes(flat.recipe) > 2
    assert isinstance(steep, AgentFailure) or draft_nodes(steep.recipe) < 2
    flat, _ = run(DraftLengthAgent(), context(tmp_path, flat_tools, "f32", two))
    steep, _ = run(DraftLengthAgent(), context(tmp_path, steep_tools, "f32", two))
    assert isinstance(flat, Candidate) and isinstance(steep, Candidate)
    assert flat.recipe.tree.depth > 2 > steep.recipe.tree.depth


def test_a_curve_flat_across_a_tree_gets_16_to_32_node_dynamic_trees(tmp_path):
    wide = CurveTools({1: 30.0, 64: 34.0})
    out, text = run(TreeShapeAgent(), context(tmp_path, wide, "q8"))
    assert isinstance(out, Candidate) and "dynamic budget 32 depth 12" in text and "chain depth 12" in text
    assert out.recipe.tree.policy in ("dynamic", "static") and 16 <= draft_nodes(out.recipe) <= 64
    allowed(out, "q8")


MEMORY = [{"mechanism": "fused layers", "description": "d", "fragment": {"runtime": {"linear": "fused"}},
           "fingerprint": "elsewhere", "effect": 1.5},
          {"mechanism": "packed weights", "description": "d", "fragment": {"weights": {"format": "packed12"}},
           "fingerprint": "elsewhere", "effect": 1.4},
          {"mechanism": "chain 3", "description": "d", "fragment": {"tree": {"depth": 3}}, "fingerprint": "here",
           "effect": 1.1}]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_under_q8_no_agent_proposes_what_check_recipe_refuses(tmp_path, device):
    """Given cheaper backends and a weight-bound step, f32 proposes them (the control); q8 never does."""
    agents = (TreeShapeAgent, DraftLengthAgent, DrafterChoiceAgent, WeightFormatAgent, RuntimeAgent, MemoryAgent,
              DrafterFormatAgent)
    for numerics_ in ("f32", "q8"):
        tools = CurveTools(Q8, numerics_, device, weight_ms=25.0)
        outs = {cls.default_name: run(cls(), context(tmp_path, tools, numerics_, memory=MEMORY)) for cls in agents}
        for name, (out, text) in outs.items():
            allowed(out, numerics_)
        runtime, weights = outs["runtime"][0], outs["weight-format"][0]
        memory = outs["memory"][0]
        if numerics_ == "f32":
            if device == "cpu":
                assert isinstance(runtime, Candidate) and runtime.recipe.runtime.linear == "fused"
            else:
                assert isinstance(weights, Candidate) and weights.recipe.weights.format == "packed12"
            assert isinstance(memory, Candidate) and memory.recipe.runtime.linear == "fused"
            continue
        if device == "cpu":
            assert isinstance(runtime, AgentFailure) and "numerics q8 fixes the target" in runtime.reason
            assert "not pricing onednn, fused" in outs["runtime"][1]
        else:
            assert isinstance(weights, AgentFailure) and "packed12 is not an option under numerics q8" in weights.reason
        assert isinstance(memory, Candidate) and memory.recipe.tree.depth == 3
        assert memory.recipe.runtime.linear == "native" and memory.recipe.weights.format == "native"
        assert "fused layers (won on elsewhere) not applied here" in outs["memory"][1]
    report = {"profile": {"numerics": "q8", "backend_curves": {"native": Q8}}, "probe": {"device": "cpu"}}
    assert "numerics q8 fixes" in RuntimeAgent.applies(report)
    assert RuntimeAgent.applies({**report, "profile": {"backend_curves": {"native": Q8}}}) is None  # old: f32
    assert "numerics q8" in WeightFormatAgent.applies({**report, "probe": {"device": "cuda"}})


def test_the_batching_policies_draft_deeper_on_the_flat_table():
    """best_uniform_depth, which the budget, allocate and cap policies start from, on each curve's table."""
    def table(curve: dict[int, float]) -> CostTable:
        return CostTable(verify={(1, t): interpolate(curve, t) for t in range(1, 10)}, draft={1: 1.0})

    flat, steep = (best_uniform_depth(table(c), 1, 0.8) for c in (Q8, STEEP))
    assert flat > steep >= 0


# -- SmolLM2 in q8 (real) ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q8_engine(smollm2_dir, one_thread):
    from specpilot.core.engine import Engine

    return Engine.load(smollm2_dir, None, numerics="q8")


@pytest.fixture(scope="module")
def q8_profile(q8_engine):
    """A profile of n-gram drafting on the q8 target, recording every recipe the engine was asked to load."""
    asked = []
    models_for = q8_engine.models_for

    def recording(recipe):
        asked.append(recipe)
        return models_for(recipe)

    q8_engine.models_for = recording
    try:
        prof = profile(q8_engine, builtin("ngram"), PROMPTS, [8, 8], repeats=1)
    finally:
        del q8_engine.models_for
    return prof, asked


def test_a_q8_profile_records_its_numerics_and_times_only_what_q8_allows(q8_engine, q8_profile):
    prof, asked = q8_profile
    assert q8_engine.numerics == "q8" and prof.numerics == "q8"
    assert sorted(prof.verify_curve) == list(NODES) and set(range(1, 6)) <= set(NODES) and max(NODES) >= 32
    assert all(ms > 0 for ms in prof.verify_curve.values())
    assert set(prof.backend_curves) == {"native", "gguf"}  # the q8 target itself, under either name
    assert prof.backend_curves["gguf"] == prof.verify_curve
    for recipe in asked:  # nothing the numerics refuse was even loaded
        numerics.check_recipe("q8", recipe.weights.format, recipe.runtime.linear)
    assert set(variants(q8_engine, builtin("ngram"))) == {"native", "gguf"}
    back = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert back == prof and back.numerics == "q8"
    old = prof.to_dict()
    del old["numerics"]
    assert Profile.from_dict(old).numerics == "f32"


def test_real_q8_cost_tools_and_every_agent_keep_to_q8(q8_engine, q8_profile, tmp_path):
    from specpilot.core.costmodel.tools import CostTools

    prof, _ = q8_profile
    report = {"profile": prof.to_dict(), "probe": {"bandwidth_gb_s": 20.0, "device": "cpu"}}
    tools = CostTools(q8_engine, builtin("ngram"), report, PROMPTS, [8, 8])
    assert tools.numerics == "q8"
    assert "runtime.linear = 'fused'" in tools.refused(builtin("ngram").replace(runtime={"linear": "fused"}))
    assert tools.refused(builtin("ngram-gguf")) is None
    tools.drafters = ["ngram", "early_exit:8", "early_exit:15"]  # a few exits: each is a replay
    outs = {}
    for cls in (TreeShapeAgent, DraftLengthAgent, DrafterChoiceAgent, WeightFormatAgent, RuntimeAgent):
        outs[cls] = run(cls(), context(tmp_path, tools, "q8", builtin("ngram")))[0]
        allowed(outs[cls], "q8")
    assert "numerics q8 fixes the target's products" in outs[RuntimeAgent].reason
    assert any(isinstance(out, Candidate) for out in outs.values())  # the agents did price and propose


def test_the_q8_batching_table_times_the_q8_target_and_the_policies_use_it(q8_engine, monkeypatch):
    import specpilot.core.engine.engine as engine_module

    timed = []
    real = engine_module.measure_costs

    def measure(target, drafter, batch_sizes, *args, **kwargs):
        timed.append((target, drafter, list(batch_sizes)))
        return real(target, drafter, batch_sizes, *args, repeats=1)

    monkeypatch.setattr(engine_module, "measure_costs", measure)
    recipe = builtin("ngram").replace(batching={"policy": "budget"})
    sched = q8_engine.scheduler(recipe, 2, 64)
    assert [(t, d, b) for t, d, b in timed] == [(q8_engine.target, None, [2])]
    assert timed[0][0].numerics == "q8" and sched.target is q8_engine.target
    table = sched.policy.table
    assert table is q8_engine.cost_table(recipe, [2]) and len(timed) == 1  # measured once, then cached
    assert sorted(table.verify) == [(2, t) for t in range(1, 10)]
    assert sched.policy.name == "budget" and sched.policy.depths([0.8, 0.8]) is not None
    got = q8_engine.serve(PROMPTS, [8, 8], recipe, 2, table=table).tokens
    assert got == [q8_engine.generate([p], [8], None, speculative=False).tokens[0] for p in PROMPTS]


def test_serve_numerics_q8_answers_a_chat_completion(smollm2_gguf, smollm2_dir, q8_engine):
    from transformers import AutoTokenizer

    from serve_helpers import Server
    from specpilot.core.workload import Request, encode

    chat = "Name three colours."
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = encode(tok, Request("0", chat, 12, chat=True))
    ref = tok.decode(q8_engine.generate([ids], [12], None, speculative=False).tokens[0], skip_special_tokens=True)
    with Server("--target", smollm2_gguf, "--drafter", "none", "--numerics", "q8", "--recipe", "stock",
                "--max-batch", "1", "--served-model-name", "smol-q8") as server:
        r = server.client().chat.completions.create(model="smol-q8", messages=[{"role": "user", "content": chat}],
                                                    max_tokens=12, temperature=0)
        status, models = server.get("/v1/models")
    assert r.choices[0].message.content == ref and r.usage.prompt_tokens == len(ids)
    assert status == 200 and json.loads(models)["data"][0]["numerics"] == "q8"
