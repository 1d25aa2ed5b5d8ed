"""Local agents and the agent registry: diffs that apply, determinism, honest failures, memory, specs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.claude import ClaudeAgent, MissingAPIKey
from specpilot.core.diffs import apply_unified_diff
from specpilot.core.agents.local import (BatchingAgent, DraftLengthAgent, DrafterChoiceAgent, MemoryAgent, RuntimeAgent,
                               TreeShapeAgent, WeightFormatAgent, DrafterFormatAgent, draft_nodes)
from specpilot.core.agents.registry import directions, local_agents_for, make_agents, parse_agents
from specpilot.core.costmodel import trees
from specpilot.core.engine.tree import static_prefixes
from specpilot.core.recipe import Recipe, builtin

RANKS = {"model": [0.6, 0.15, 0.08, 0.05], "ngram": [0.5], "early_exit:1": [0.3, 0.1, 0.05],
         "early_exit:2": [0.5, 0.15, 0.07]}
DRAFT_MS = {"model": 0.4, "ngram": 0.05, "early_exit:1": 0.25, "early_exit:2": 0.5}


class FakeProfile:
    """The part of a Profile the runtime agent reads: the target's forward curve per linear backend."""

    def __init__(self, backend_curves: dict[str, dict[int, float]]) -> None:
        self.backend_curves = backend_curves

    def verify_curve_for(self, backend: str) -> dict[int, float]:
        return self.backend_curves[backend]


class FakeTools:
    """An analytic stand-in for CostTools: acceptance from rank frequencies, a linear verify cost curve.

    It records every recipe it was asked to predict so tests can compare an agent's pick with what it saw.
    """

    def __init__(self, device: str = "cuda", batch_size: int = 1, drafters: tuple[str, ...] = tuple(RANKS),
                 weight_ms: float = 2.0, launch_ms: float = 0.6, node_ms: float = 0.03) -> None:
        self.node_ms = node_ms
        self.device = device
        self.batch_size = batch_size
        self.drafters = list(drafters)
        self.layers = 3  # the target's, as CostTools says: early exits 1 and 2 are below it
        self.weight_ms = weight_ms
        self.launch_ms = launch_ms
        self.backends = {"native": 1.0, "onednn": 0.6} if device == "cpu" else {"native": 1.0}
        self.profile = FakeProfile({b: {n: self.verify_ms(n) * k for n in (1, 4, 8, 16)}
                                    for b, k in self.backends.items()})
        self.report = {"gaps": [{"component": "acceptance", "ms_per_token": 1.2},
                                {"component": "host", "ms_per_token": 0.4}], "largest_gap": "acceptance"}
        self.seen: dict[str, float] = {}

    @staticmethod
    def key(recipe: Recipe) -> str:
        d = recipe.draft
        return f"early_exit:{d.exit_layer}" if d.method == "early_exit" else d.method

    def nodes(self, recipe: Recipe) -> list[tuple[int, ...]]:
        t = recipe.tree
        if t.policy == "chain":
            return static_prefixes([[0] * t.depth])
        if t.policy == "static":
            return static_prefixes(t.paths)
        return static_prefixes(self.tree_for(self.key(recipe), t.budget, t.depth))

    def tree_for(self, key: str, budget: int, max_depth: int) -> list[list[int]]:
        return trees.leaves(trees.sequoia(RANKS[key], budget, max_depth)[budget]) or [[0]]

    def best_tree(self, budget: int, max_depth: int) -> list[list[int]]:
        return self.tree_for("model", budget, max_depth)

    def accepted(self, recipe: Recipe) -> float:
        return trees.expected_length(RANKS[self.key(recipe)], self.nodes(recipe))

    def verify_ms(self, nodes: int) -> float:
        return self.launch_ms + self.weight_ms + self.node_ms * nodes

    def step_ms(self, recipe: Recipe) -> dict[str, float]:
        nodes = self.nodes(recipe)
        depth = max((len(n) for n in nodes), default=0)
        verify = self.verify_ms(len(nodes) + 1) * self.backends[recipe.runtime.linear]
        return {"draft": DRAFT_MS[self.key(recipe)] * depth, "verify": verify, "host": 0.3}

    def predict(self, recipe: Recipe) -> float:
        value = 1000 * self.accepted(recipe) / sum(self.step_ms(recipe).values())
        self.seen[recipe.to_toml()] = value
        return value


def context(tmp_path: Path, recipe: Recipe | None = None, tools: Any = None, memory: list | None = None,
            seed: int = 0) -> AgentContext:
    return AgentContext(deployment={"target": "t", "drafter": "d", "device": "cuda", "fingerprint": "here"},
                        recipe=recipe or builtin("stock"), cost_report={}, memory=memory or [],
                        direction="acceptance", workspace=tmp_path, tuning_summary={}, seed=seed, tools=tools)


def run(agent: Any, ctx: AgentContext) -> tuple[Candidate | AgentFailure, str]:
    chunks: list[str] = []
    out = agent.propose(ctx, chunks.append)
    return out, "".join(chunks)


def check_candidate(out: Candidate | AgentFailure, ctx: AgentContext) -> Candidate:
    assert isinstance(out, Candidate), out
    old = ctx.recipe.to_toml()
    assert apply_unified_diff(old, out.diff, "recipe.toml") == out.recipe.to_toml()
    assert Recipe.from_toml(out.recipe.to_toml()).validate() == out.recipe
    assert out.kind == "recipe" and out.title and out.rationale
    return out


AGENTS = [TreeShapeAgent, DraftLengthAgent, DrafterChoiceAgent, WeightFormatAgent, RuntimeAgent, BatchingAgent]


@pytest.mark.parametrize("cls", AGENTS)
def test_each_agent_diff_applies_and_validates(cls: type, tmp_path: Path) -> None:
    tools = FakeTools(batch_size=4 if cls is BatchingAgent else 1, device="cpu" if cls is RuntimeAgent else "cuda")
    ctx = context(tmp_path, tools=tools)
    out, text = run(cls(), ctx)
    cand = check_candidate(out, ctx)
    assert cand.predicted_speedup and cand.predicted_speedup > 1.01
    assert "predicted" in text and cand.diff in text


@pytest.mark.parametrize("cls", AGENTS + [MemoryAgent])
def test_deterministic_for_a_seed(cls: type, tmp_path: Path) -> None:
    memory = [{"mechanism": "wide tree", "description": "d", "fragment": {"tree": {"policy": "dynamic"}},
               "fingerprint": "here", "effect": 1.2}]
    outs = [run(cls(), context(tmp_path, tools=FakeTools(batch_size=4), memory=memory, seed=7)) for _ in range(2)]
    assert outs[0][1] == outs[1][1]
    assert repr(outs[0][0]) == repr(outs[1][0])


def test_runtime_agent_prices_the_linear_backend(tmp_path: Path) -> None:
    tools = FakeTools(device="cpu")
    out, text = run(RuntimeAgent(), context(tmp_path, tools=tools))
    cand = check_candidate(out, context(tmp_path))
    assert cand.recipe.runtime.linear == "onednn"
    assert cand.predicted_speedup == pytest.approx(tools.predict(cand.recipe) / tools.predict(builtin("stock")))
    assert "target forward, onednn vs native" in text


def test_tree_shape_picks_the_fastest_it_considered(tmp_path: Path) -> None:
    tools = FakeTools()
    out, text = run(TreeShapeAgent(), context(tmp_path, tools=tools))
    cand = check_candidate(out, context(tmp_path))
    assert tools.seen[cand.recipe.to_toml()] == max(tools.seen.values())
    assert len(tools.seen) >= 10 and "best 16-node tree" in text and "dynamic budget" in text
    assert cand.predicted_speedup == pytest.approx(tools.seen[cand.recipe.to_toml()] / tools.predict(builtin("stock")))


def test_tree_shape_goes_wide_and_deep_only_where_the_verify_curve_is_flat(tmp_path: Path) -> None:
    """A flat curve (a matrix unit: 33 tokens within KNEE x one) gets 16-32-node dynamic trees, deeper ones and
    deeper chains priced, and a wide tree picked; a CPU-like steep curve keeps a small tree and prices none of
    the extra shapes."""
    flat = FakeTools(node_ms=0.005)
    out, text = run(TreeShapeAgent(), context(tmp_path, tools=flat))
    cand = check_candidate(out, context(tmp_path))
    assert "flat, so wider and deeper trees" in text
    assert "dynamic budget 32 depth 12" in text and "chain depth 12" in text
    assert cand.recipe.tree.policy in ("dynamic", "static") and draft_nodes(cand.recipe) >= 16
    assert flat.seen[cand.recipe.to_toml()] == max(flat.seen.values())

    steep = FakeTools(node_ms=1.0)
    out, text = run(TreeShapeAgent(), context(tmp_path, tools=steep))
    cand = check_candidate(out, context(tmp_path))
    assert "flat" not in text and "chain depth" not in text and "depth 12" not in text
    assert draft_nodes(cand.recipe) <= 8


def test_draft_length_streams_the_sweep(tmp_path: Path) -> None:
    out, text = run(DraftLengthAgent(), context(tmp_path, tools=FakeTools()))
    check_candidate(out, context(tmp_path))
    assert "replaying chain depths 1..10:" in text and "predicted tok/s:" in text


def test_draft_length_leaves_the_ngram_length_alone_when_it_predicts_no_gain(tmp_path: Path) -> None:
    """FakeTools predicts every n-gram lookup length the same: a seeded tie-break must not change it."""
    ngram = builtin("ngram").replace(tree={"depth": 2})
    for seed in range(6):
        out, text = run(DraftLengthAgent(), context(tmp_path, ngram, tools=FakeTools(), seed=seed))
        cand = check_candidate(out, context(tmp_path, ngram))
        assert "n-gram lookup lengths at chain" in text
        assert cand.recipe.draft.ngram_max == ngram.draft.ngram_max and cand.recipe.tree.depth != 2


def test_fails_with_reasons_when_nothing_wins(tmp_path: Path) -> None:
    tools = FakeTools()
    best, _ = run(TreeShapeAgent(), context(tmp_path, tools=tools))
    again, _ = run(TreeShapeAgent(), context(tmp_path, best.recipe, tools=tools))
    assert isinstance(again, AgentFailure)
    assert "no tree within budget 64 predicted above the incumbent" in again.reason

    cpu = FakeTools(device="cpu")
    out, _ = run(WeightFormatAgent(), context(tmp_path, tools=cpu))
    assert isinstance(out, AgentFailure) and "correctness path" in out.reason and "slowdown" in out.reason
    out, _ = run(RuntimeAgent(), context(tmp_path, tools=FakeTools(device="cuda")))
    assert isinstance(out, AgentFailure) and "no other linear backend runs here (measured: native" in out.reason
    onednn = builtin("stock").replace(runtime={"linear": "onednn"})
    out, _ = run(RuntimeAgent(), context(tmp_path, onednn, tools=cpu))
    assert isinstance(out, AgentFailure) and "no linear backend predicted above the incumbent" in out.reason
    out, _ = run(BatchingAgent(), context(tmp_path, tools=FakeTools(batch_size=1)))
    assert out == AgentFailure("batching", "batch size 1: no batching gap")
    out, _ = run(WeightFormatAgent(), context(tmp_path, tools=FakeTools(weight_ms=0.01)))
    assert isinstance(out, AgentFailure) and "not weight-bandwidth-bound" in out.reason
    out, _ = run(DrafterChoiceAgent(), context(tmp_path, tools=FakeTools(drafters=("model",))))
    assert isinstance(out, AgentFailure) and "no other drafter differs" in out.reason
    out, _ = run(TreeShapeAgent(), context(tmp_path))
    assert isinstance(out, AgentFailure) and "ctx.tools is None" in out.reason


class FormatTools(FakeTools):
    """FakeTools whose drafter costs depend on weights.drafter_format, as the profile's curves say."""

    SCALE = {"same": 1.0, "q8": 0.8, "q4": 0.5}

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self.profile.drafter_backend_curves = {"native": {"model": {1: 1.0}}, "native+q8": {"model": {1: 0.8}},
                                               "native+q4": {"model": {1: 0.5}}}

    def step_ms(self, recipe: Recipe) -> dict[str, float]:
        step = super().step_ms(recipe)
        return {**step, "draft": step["draft"] * self.SCALE[recipe.weights.drafter_format]}


def test_drafter_format_agent_prices_the_measured_formats(tmp_path: Path) -> None:
    tools = FormatTools()
    ctx = context(tmp_path, tools=tools)
    out, text = run(DrafterFormatAgent(), ctx)
    out = check_candidate(out, ctx)
    assert out.recipe.weights.drafter_format == "q4" and out.predicted_speedup > 1
    assert "q8" in text and "q4" in text  # it streamed both options
    ngram = builtin("stock").replace(draft={"method": "ngram"}, tree={"depth": 8})
    out, _ = run(DrafterFormatAgent(), context(tmp_path, recipe=ngram, tools=tools))
    assert isinstance(out, AgentFailure) and "not a drafter model" in out.reason
    report = {"profile": {"drafter_backend_curves": tools.profile.drafter_backend_curves}}
    assert DrafterFormatAgent.applies(report) is None
    flat = {"native": {"model": {1: 1.0}}, "native+q4": {"model": {1: 0.95}}}  # a tiny drafter: no gain
    assert "no approximate drafter format" in DrafterFormatAgent.applies({"profile": {"drafter_backend_curves": flat}})


def test_memory_agent_proposes_remembered_fragments(tmp_path: Path) -> None:
    paths = [[0, 0, 0], [1]]
    memory = [
        {"mechanism": "already there", "description": "", "fragment": {"tree": {"policy": "chain"}},
         "fingerprint": "here", "effect": 1.5},
        {"mechanism": "static tree", "description": "wider", "fingerprint": "other",
         "fragment": {"tree": {"policy": "static", "paths": paths}}, "effect": {"heldout_speedup": 1.23}},
        {"mechanism": "ngram", "description": "cheap", "fingerprint": "here",
         "fragment": {"draft": {"method": "ngram"}}, "effect": 1.1},
    ]
    ctx = context(tmp_path, memory=memory)
    out, text = run(MemoryAgent(), ctx)
    cand = check_candidate(out, ctx)
    assert cand.recipe.draft.method == "ngram" and cand.recipe.tree.paths == paths
    assert "from memory: static tree (won 1.23x on other); recorded on another deployment" in text
    assert "from memory: ngram (won 1.10x on here)" in text and "already there" not in text
    assert cand.predicted_speedup == pytest.approx(1.1)

    out, _ = run(MemoryAgent(), context(tmp_path, memory=memory[:1]))
    assert isinstance(out, AgentFailure) and "no remembered mechanism applies" in out.reason
    with_tools, _ = run(MemoryAgent(), context(tmp_path, tools=FakeTools(), memory=memory))
    check_candidate(with_tools, ctx)


def test_parse_agents() -> None:
    assert parse_agents("local:4,claude:2") == [("local", 4), ("claude", 2)]
    assert parse_agents(" local : 1 ") == [("local", 1)]
    for bad in ("", "local", "local:x", "robot:2", "local:0", "local:1,local:2", "local:2;claude:1"):
        with pytest.raises(ValueError, match="agents must look like local:4,claude:2"):
            parse_agents(bad)


def test_registry_matches_agents_to_gaps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = {"gaps": [{"component": "host", "ms_per_token": 0.2}, {"component": "drafting", "ms_per_token": 0.9},
                       {"component": "verify", "ms_per_token": 0.5}], "largest_gap": "drafting"}
    names = [a.name for a in local_agents_for(report, 3, [])]
    assert names == ["drafter-choice", "runtime", "adaptive-length"]  # host: the agent that writes a plugin
    on_gpu = {**report, "probe": {"device": "cuda:0"}}
    # on a GPU the CPU-only runtime agent yields the verify gap's slot to the next agent of that gap
    assert [a.name for a in local_agents_for(on_gpu, 3, [])] == ["drafter-choice", "weight-format", "adaptive-length"]
    memory = [{"mechanism": "m", "fragment": {"tree": {"depth": 6}}, "fingerprint": "x", "effect": 1.1}]
    assert [a.name for a in local_agents_for(report, 2, memory, builtin("stock"))] == ["memory", "drafter-choice"]
    assert local_agents_for(report, 2, memory, builtin("chain6"))[0].name == "drafter-choice"
    assert len(local_agents_for(report, 20, [])) == 9
    dirs = directions(report, 4)
    assert dirs[0].startswith("drafting gap (the largest): 0.90 ms/token") and dirs[3].startswith("drafting")
    dispatch = {"gaps": [{"component": "dispatch", "ms_per_token": 0.9}], "largest_gap": "dispatch"}
    assert [a.name for a in local_agents_for(dispatch, 2, [])] == ["runtime", "draft-length"]  # the fused layer

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    with pytest.raises(MissingAPIKey):
        make_agents("local:1,claude:1", 0, "m")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    agents = make_agents("claude:2,local:2", 0, "m", report=report, memory=[], incumbent=builtin("stock"))
    assert [type(a) for a in agents[:2]] == [ClaudeAgent, ClaudeAgent]
    assert [a.name for a in agents] == ["claude-1", "claude-2", "drafter-choice", "runtime"]
    assert make_agents("local:1", 0, "m", memory_nonempty=True)[0].name == "memory"


@pytest.fixture(scope="module")
def real_tools(tiny_pair: Any) -> Any:
    """CostTools over the tiny target/drafter pair (one intra-op thread: the CPU is shared)."""
    import torch

    from specpilot.core.costmodel.tools import CostTools
    from specpilot.core.engine import Engine

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    target_dir, drafter_dir, _ = tiny_pair
    engine = Engine.load(target_dir, drafter_dir)
    g = torch.Generator().manual_seed(0)
    prompts = []
    for length in (6, 10, 4):
        base = torch.randint(0, 101, (length,), generator=g).tolist()
        prompts.append(base + base[: length // 2])
    tools = CostTools.from_engine(engine, builtin("stock"), prompts, [20, 16, 24], budgets=(4, 8),
                                  probe_result={"bandwidth_gb_s": 20.0, "matmul_tflops": 0.1}, repeats=1)
    yield tools
    torch.set_num_threads(before)


def test_real_cost_tools_answer_agents(real_tools: Any, tmp_path: Path) -> None:
    tools = real_tools
    stock = builtin("stock")
    assert tools.drafters == ["model", "ngram", "early_exit:1", "early_exit:2"]
    assert tools.device == "cpu" and tools.batch_size == 1 and tools.report["largest_gap"]
    assert tools.accepted(stock) == pytest.approx(tools.report["replay"]["incumbent"])
    assert tools.predict(stock) == pytest.approx(tools.report["predicted_tokens_per_s"])
    paths = tools.best_tree(8, 4)
    assert 1 <= len(static_prefixes(paths)) <= 8 and max(len(p) for p in paths) <= 4
    assert tools.accepted(static_tree_recipe(stock, paths)) >= tools.accepted(stock.replace(tree={"depth": 1}))
    assert set(tools.step_ms(stock)) == {"draft", "verify", "commit", "host"} and tools.weight_ms > 0
    for cls in (TreeShapeAgent, DrafterChoiceAgent, DraftLengthAgent, WeightFormatAgent, RuntimeAgent,
                DrafterFormatAgent):
        ctx = context(tmp_path, tools=tools)
        out, text = run(cls(), ctx)
        assert "tok/s" in text or isinstance(out, AgentFailure), text
        if isinstance(out, Candidate):
            check_candidate(out, ctx)
            assert out.predicted_speedup == pytest.approx(tools.predict(out.recipe) / tools.predict(stock), rel=1e-6)
        else:
            assert out.reason and "Error" not in out.reason, out.reason


def test_cost_tools_replay_a_plugin_incumbents_drafter_with_stand_ins(real_tools: Any) -> None:
    """A round whose incumbent carries a plugin (the loop never imports candidate code) still replays its
    drafter model: the knob agents of the real pair's second round failed on this."""
    from specpilot.core.costmodel.tools import CostTools

    tools = real_tools
    plugged = builtin("stock").replace(draft={"length": "plugin:adaptive_w2_m0"})
    again = CostTools(tools.engine, plugged, tools.report, tools._prompts, tools._limits)
    assert again.accepted(plugged) == pytest.approx(tools.accepted(builtin("stock")))


def static_tree_recipe(recipe: Recipe, paths: list[list[int]]) -> Recipe:
    return recipe.replace(tree={"policy": "static", "paths": paths})
