"""Agents that write code: the adaptive draft-length agent fits and writes a plugin, memory re-proposes a
winning plugin from its stored source, every gap is matched to an agent (or named), and a round with no
candidate tries the next gaps' agents, says why, and ends the run early."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import mini_deployment
from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.diffs import apply_unified_diff
from specpilot.core.agents.local import (KNOB_AGENTS, AdaptiveLengthAgent, HybridDrafterAgent, MemoryAgent, adaptive_depth,
                               ngram_runs, templates)
from specpilot.core.agents.registry import local_agents_for, uncovered
from specpilot.core.cli import main
from specpilot.core.costmodel.replay import Trace
from specpilot.core.mechanisms import declared_in, lookup
from specpilot.core.recipe import builtin


class BurstyTools:
    """Replayed acceptance in bursts: long stretches the drafter ranks first, then stretches it misses;
    a step's cost grows with draft depth. A fixed depth pays for misses on the hard stretches."""

    drafters = ["model", "ngram"]
    layers = 2

    def __init__(self) -> None:
        ranks = []
        for _ in range(6):
            ranks += [0] * 30 + [3, 0, 2, 1, 0, 4, 2, 0, 5, 1]
        self.traces = [Trace(list(range(len(ranks) + 5)), 5, len(ranks) - 16, 0, [0] * 5 + ranks)]

    def replay(self, key: str, ngram_max: int = 3) -> Any:
        class Replay:
            traces = self.traces
        return Replay()

    def step_ms(self, recipe: Any) -> dict[str, float]:
        return {"draft": 0.5 * recipe.tree.depth, "verify": 2.0 + 0.2 * recipe.tree.depth, "commit": 0.1,
                "host": 1.0}


def context(tmp_path: Path, recipe: Any = None, tools: Any = None, memory: list | None = None) -> AgentContext:
    return AgentContext(deployment={"fingerprint": "here"}, recipe=recipe or builtin("stock"), cost_report={},
                        memory=memory or [], direction="host", workspace=tmp_path, tuning_summary={}, tools=tools)


def test_adaptive_length_agent_writes_the_plugin_it_fitted(tmp_path):
    ctx = context(tmp_path, tools=BurstyTools())
    chunks: list[str] = []
    out = AdaptiveLengthAgent().propose(ctx, chunks.append)
    assert isinstance(out, Candidate), out
    assert out.kind == "recipe+plugin" and out.predicted_speedup > 1.01
    (path, source), = out.files.items()
    name = out.recipe.draft.length.removeprefix("plugin:")
    assert path == f"plugins/{name}.py" and out.recipe.draft.length.startswith("plugin:")
    (tmp_path / "plugins").mkdir()
    (tmp_path / path).write_text(source)
    assert declared_in(tmp_path / path) == {("draft_length", name)}
    recipe_diff = out.diff[out.diff.index("--- a/recipe.toml"):]
    assert apply_unified_diff(ctx.recipe.to_toml(), recipe_diff, "recipe.toml") == out.recipe.to_toml()
    assert apply_unified_diff("", out.diff[:out.diff.index("--- a/recipe.toml")], path) == source
    assert "".join(chunks).endswith(out.diff)
    exec(compile(source, path, "exec"), {})  # registers it here, as a judge worker would
    written = lookup("draft_length", out.recipe.draft.length)
    w, m = int(name.split("_w")[1].split("_")[0]), int(name.split("_m")[1])
    for recent in ([], [1], [5, 1], [1, 1, 9], [3, 3, 3, 3, 3], [9, 9, 9]):
        assert max(1, min(6, written(6, recent))) == adaptive_depth(6, recent, w, m), recent


def test_adaptive_length_agent_says_why_when_it_does_not_apply(tmp_path):
    out = AdaptiveLengthAgent().propose(context(tmp_path, builtin("dynamic"), BurstyTools()), lambda _: None)
    assert isinstance(out, AgentFailure) and "fitted on a chain" in out.reason


def test_ngram_runs_follow_the_engines_ngram_drafter():
    """On a periodic sequence the n-gram chain copies the last period: from the first repeat on, every
    position's chain matches as far as the copied text reaches."""
    tokens = [1, 2, 3, 4] * 3
    run, walk = ngram_runs(tokens, 5, 6, 3, 8)
    assert walk == (4, 6, 11)
    assert run[4] == 4  # [1, 2, 3, 4, 1]: the 1 at 0 was followed by 2, 3, 4, 1, all right
    assert run[7] == 4 and run[10] == 1  # the copy is as long as what followed the match


def test_memory_reproposes_a_winning_plugin_with_its_source(tmp_path):
    source = "from specpilot.core.mechanisms import register\nregister('draft_length', 'short', lambda d, r: 1)\n"
    entry = {"mechanism": "Adaptive draft length", "fragment": {"draft": {"length": "plugin:short"}},
             "fingerprint": "elsewhere", "effect": 1.2, "evidence": {"plugins": {"plugins/short.py": source}}}
    out = MemoryAgent().propose(context(tmp_path, memory=[entry]), lambda _: None)
    assert isinstance(out, Candidate), out
    assert out.kind == "recipe+plugin" and out.files == {"plugins/short.py": source}
    assert out.recipe.draft.length == "plugin:short" and "+++ b/plugins/short.py" in out.diff


def test_every_gap_has_an_agent_or_is_named():
    report = {"gaps": [{"component": "host", "ms_per_token": 0.9}, {"component": "batching", "ms_per_token": 0.2}],
              "largest_gap": "host", "batch_size": 1}
    assert [a.name for a in local_agents_for(report, 1, [])] == ["adaptive-length"]  # host: the code-writer
    assert uncovered(report, {"local": 4}) == ["batching"]  # batching agents need batch > 1
    assert uncovered(report, {"local": 4, "claude": 1}) == []  # Claude may propose any kind
    assert "adaptive-length" not in KNOB_AGENTS
    assert [a.name for a in local_agents_for(report, 1, [], only=KNOB_AGENTS)] == ["draft-length"]
    # the prompt's prefill is named, never acted on: no recipe field changes it, so the next gap gets the agent
    prompt = {"gaps": [{"component": "prompt", "ms_per_token": 70.0}, {"component": "host", "ms_per_token": 0.9}],
              "largest_gap": "prompt", "batch_size": 1}
    assert uncovered(prompt, {"local": 4}) == ["prompt"]
    assert [a.name for a in local_agents_for(prompt, 1, [])] == ["adaptive-length"]


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    return mini_deployment.build(tmp_path_factory.mktemp("idle"), requests=3, max_new_tokens=8)


def test_a_round_with_no_candidate_says_why_and_ends_the_run(mini, tmp_path, capsys):
    """Only the CUDA-only weight-format agent on a CPU: round 1 has no candidate, the second pass has no
    other agent to try, and the run stops after round 1 of 3 with the reason."""
    argv = ["run", "--target", mini["target"], "--drafter", mini["drafter"], "--workload", mini["workload"],
            "--rounds", "3", "--agents", "local:2", "--local-agents", "weight-format", "--db",
            str(tmp_path / "s.db"), "--max-requests", "3", "--max-new-tokens", "8", "--auto", "--headless", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert len(summary["rounds"]) == 1
    assert summary["rounds"][0]["idle"].startswith("weight-format: packed12 on cpu")
    assert summary["stopped_early"].startswith("round 1 had no candidate (weight-format:")
    assert "round 1: no candidate: weight-format:" in captured.err
    assert "no agent of this run acts on the" in captured.err


def test_unknown_local_agent_is_a_one_line_error(mini, tmp_path, capsys):
    argv = ["run", "--local-agents", "oracle", "--db", str(tmp_path / "s.db"), "--headless", "--auto"]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--local-agents: unknown agent 'oracle'; known: " in err[0] and "adaptive-length" in err[0]


def test_adaptive_length_agent_on_the_real_cost_model(tiny_pair, tmp_path):
    """The agent reads the real replay (ranks per position) and step prices: a candidate whose plugin the
    recipe names, or a one-line reason."""
    import torch

    from specpilot.core.costmodel.tools import CostTools
    from specpilot.core.engine import Engine

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target_dir, drafter_dir, _ = tiny_pair
        engine = Engine.load(target_dir, drafter_dir)
        g = torch.Generator().manual_seed(0)
        prompts = [(lambda b: b + b[: n // 2])(torch.randint(0, 101, (n,), generator=g).tolist()) for n in (6, 10, 4)]
        tools = CostTools.from_engine(engine, builtin("stock"), prompts, [20, 16, 24], budgets=(4, 8),
                                      probe_result={"bandwidth_gb_s": 20.0, "matmul_tflops": 0.1}, repeats=1)
        chunks: list[str] = []
        out = AdaptiveLengthAgent().propose(context(tmp_path, tools=tools), chunks.append)
        hybrid = HybridDrafterAgent().propose(context(tmp_path, tools=tools), lambda _: None)
    finally:
        torch.set_num_threads(before)
    assert "step ms by draft depth: 1:" in "".join(chunks)
    if isinstance(out, Candidate):
        (path, source), = out.files.items()
        assert out.recipe.draft.length == "plugin:" + Path(path).stem and "register(\"draft_length\"" in source
    else:
        assert out.reason.startswith("no adaptive draft length predicted above the incumbent"), out.reason
    if isinstance(hybrid, Candidate):
        assert hybrid.recipe.draft.method.startswith("plugin:hybrid_m") and len(hybrid.files) == 1
    else:
        assert hybrid.reason.startswith("no two-level drafter predicted above the incumbent"), hybrid.reason


def test_hybrid_drafter_plugin_is_lossless_against_the_reference(pair_engine, tiny_pair, one_thread):
    """The two-level drafter the hybrid agent writes, run by the engine: token forcing against the
    transformers reference passes, and its steps both look up (no model forward) and use the model."""
    from tiny_models import repeating_prompts

    from specpilot.core import forcing
    from specpilot.core.recipe import Recipe

    source = templates.render("hybrid", model_depth=3, name="hybrid_test")
    exec(compile(source, "plugins/hybrid_test.py", "exec"), {})
    recipe = Recipe.from_dict({"draft": {"method": "plugin:hybrid_test"}, "tree": {"depth": 6}})
    prompts, limits = repeating_prompts([6, 11, 4], 101, 1), [24, 17, 20]
    result = forcing.compare(pair_engine, recipe, prompts, limits, tiny_pair[2])
    assert result["passed"] and result["tokens"] == sum(limits), result
    drafter = pair_engine.drafter_for(recipe)
    used = []
    original = drafter.model.draft
    drafter.model.draft = lambda *a: used.append(1) or original(*a)
    steps = pair_engine.generate([prompts[0]], 24, recipe).steps
    assert 0 < len(used) < len(steps)  # some steps looked up, some drafted with the model


def test_hybrid_drafter_agent_fits_and_writes_its_plugin(tmp_path):
    class Tools(BurstyTools):
        def __init__(self) -> None:
            super().__init__()
            period = [7, 8, 9, 10, 11, 12]
            tokens = list(range(100, 140)) + period * 8 + list(range(200, 240))
            ranks = [0] * 40 + [1] * len(period) * 8 + [0] * 40
            self.traces = [Trace(tokens, 5, len(tokens) - 16, 0, ranks)]

    out = HybridDrafterAgent().propose(context(tmp_path, tools=Tools()), lambda _: None)
    assert isinstance(out, Candidate), out
    (path, source), = out.files.items()
    name = out.recipe.draft.method.removeprefix("plugin:")
    assert path == f"plugins/{name}.py" and out.kind == "recipe+plugin" and out.predicted_speedup > 1.01
    (tmp_path / "plugins").mkdir()
    (tmp_path / path).write_text(source)
    assert declared_in(tmp_path / path) == {("drafter", name)}
