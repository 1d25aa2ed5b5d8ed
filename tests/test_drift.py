"""Drift from transformers float32 (core/costmodel/drift.py): exact on transformers' own greedy output, a
planted wrong token found where it was planted, `specpilot profile` under q8 and f32, the loop's cost report
measuring it once, and the dashboard's gaps panel. Real models: the SmolLM2 GGUF (`smollm2_gguf`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specpilot.core.cli import main
from specpilot.core.costmodel.drift import Drift, RequestDrift, describe, drift, load_f32_reference

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

PROMPTS = ("Say hi.", "Write a Python function that adds two numbers.")
NEW = 12


@pytest.fixture(scope="module")
def reference(smollm2_dir, one_thread):
    return load_f32_reference(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    from specpilot.core.workload import Request, encode

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [encode(tok, Request(id=str(i), prompt=p, chat=True, max_new_tokens=NEW)) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def hf_greedy(reference, prompts) -> list[list[int]]:
    """transformers' own greedy continuations (float32)."""
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                                   pad_token_id=reference.config.eos_token_id)
            outs.append(y[0, len(ids):].tolist())
    return outs


def test_transformers_own_greedy_output_has_no_drift(reference, prompts, hf_greedy):
    d = drift(reference, prompts, hf_greedy)
    assert all(len(o) > 0 for o in hf_greedy)
    assert d.tokens == sum(map(len, hf_greedy)) and len(d.requests) == len(prompts)
    assert (d.mismatches, d.differing, d.near_ties, d.rate) == (0, 0, 0, 0.0)
    assert all(r.first is None and not r.differs for r in d.requests)


@pytest.mark.parametrize("k", [0, 5])
def test_a_replaced_token_is_a_mismatch_at_its_position(reference, prompts, hf_greedy, k):
    """transformers' greedy token at k is float32's argmax there (the test above), so any other token is not:
    the request differs, first at k; the prefix before k is unchanged, so nothing earlier mismatches."""
    planted = [list(o) for o in hf_greedy]
    planted[1][k] = (planted[1][k] + 1) % reference.config.vocab_size
    d = drift(reference, prompts, planted)
    assert d.requests[0] == RequestDrift(len(planted[0]), 0, 0, None)
    second = d.requests[1]
    assert second.differs and second.first == k and 1 <= second.mismatches <= len(planted[1]) - k
    assert d.differing == 1 and d.mismatches == second.mismatches
    assert d.rate == pytest.approx(second.mismatches / d.tokens)


def test_drift_takes_a_checkpoint_path_and_refuses_unpaired_outputs(smollm2_dir, prompts, hf_greedy):
    d = drift(str(smollm2_dir), prompts[:1], hf_greedy[:1])
    assert d.mismatches == 0 and d.tokens == len(hf_greedy[0])
    with pytest.raises(ValueError, match="one output per prompt"):
        drift(str(smollm2_dir), prompts, hf_greedy[:1])


def test_describe_says_what_it_counts():
    d = Drift([RequestDrift(256, 3, 2, 40), RequestDrift(256, 0, 0, None)] + [RequestDrift(0, 0, 0, None)] * 2)
    assert describe({"numerics": "q8", **d.to_dict()}) == (
        "q8 drift from transformers float32: 1 of 4 requests differ, 3 of 512 tokens (0.59%) mismatch under "
        "forcing (2 near-ties)")
    assert describe(d.to_dict(), short=True) == "q8 drift vs f32: 1/4 requests differ · 3/512 tokens (0.59%) " \
                                                "mismatch · 2 near-ties"


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("drift") / "w.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": PROMPTS[1], "chat": True, "max_new_tokens": 6}) + "\n")
    return str(path)


def profile_argv(target: str, workload: str, *extra: str) -> list[str]:
    return ["profile", "--target", target, "--drafter", "none", "--workload", workload, "--split", "all",
            "--max-requests", "1", "--threads", "1", *extra]


@pytest.fixture(scope="module")
def q8_report(smollm2_gguf, workload) -> dict:
    """`specpilot profile --numerics q8 --json` on the SmolLM2 GGUF, one request of 6 tokens."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(profile_argv(smollm2_gguf, workload, "--numerics", "q8", "--json")) == 0
    return json.loads(out.getvalue())


def test_profile_under_q8_reports_the_drift(q8_report, smollm2_gguf, workload, monkeypatch, capsys):
    d = q8_report["drift"]
    assert d["numerics"] == "q8" and d["reference"] == "transformers float32"
    assert d["requests"] == q8_report["requests"] == 1 and len(d["per_request"]) == 1
    assert 0 <= d["differing"] <= d["requests"] and 0 <= d["near_ties"] <= d["mismatches"] <= d["tokens"]
    assert d["tokens"] == q8_report["tokens"] == sum(r["tokens"] for r in d["per_request"])
    assert d["mismatches"] == sum(r["mismatches"] for r in d["per_request"])
    assert d["differing"] == sum(r["first"] is not None for r in d["per_request"])
    assert d["rate"] == pytest.approx(d["mismatches"] / d["tokens"])
    # the text output prints that report's drift as one line (the same report, not a second profile run)
    monkeypatch.setattr("specpilot.core.costmodel.report.analyse", lambda *a, **k: q8_report)
    assert main(profile_argv(smollm2_gguf, workload, "--numerics", "q8")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == describe(d) and lines[-1].startswith("q8 drift from transformers float32: ")
    assert sum("drift" in line for line in lines) == 1


def test_profile_under_f32_prints_no_drift(workload, capsys):
    """f32 is the reference itself: the real profile (not stubbed; on the shipped demo deployment, an f32 one,
    since SmolLM2's f32 profile takes 35 s here) carries none and prints nothing new."""
    argv = ["profile", "--drafter", "none", "--workload", workload, "--split", "all", "--max-requests", "1",
            "--max-new-tokens", "3", "--threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "numerics f32" in out.splitlines()[0] and "drift" not in out
    assert main([*argv, "--numerics", "f32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["drift"] is None


def test_the_loop_measures_the_drift_once_and_reuses_it(monkeypatch):
    """RunContext.analyse asks the first round's report to measure it, and hands later rounds that dict."""
    from specpilot.core.setup import RunContext

    asked = []

    def analyse(engine, recipe, prompts, limits, ids, drift=False):
        asked.append(drift)
        return {"drift": drift if isinstance(drift, dict) else {"differing": 1}}

    monkeypatch.setattr("specpilot.core.costmodel.report.analyse", analyse)
    monkeypatch.setattr("specpilot.core.setup._materialised", lambda r: r)
    ctx = RunContext(None, None, None, [], [], [])
    first, second = ctx.analyse("r"), ctx.analyse("r")
    assert asked == [True, {"differing": 1}] and first["drift"] is second["drift"] is ctx.drift


# --- the dashboard ------------------------------------------------------------------------------------------


@pytest.fixture()
def isolated_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECPILOT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("SPECPILOT_LOOP_FACTORY", raising=False)


def gaps_panel_lines(events: list[Any]) -> list[list[str]]:
    """The gaps panel's text after each event, live in a headless 160x50 dashboard."""
    from specpilot.app.app import SpecPilotApp, build_parser
    from specpilot.app.widgets.gaps import GapBars

    app = SpecPilotApp(build_parser().parse_args([]))
    seen: list[list[str]] = []

    async def go() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            for event in events:
                app.live.feed(event)
                await pilot.pause(0.05)
                seen.append(app.live.query_one(GapBars).render().plain.splitlines())

    asyncio.run(go())
    return seen


def test_dashboard_shows_a_q8_deployments_drift_under_the_gaps(q8_report, isolated_settings):
    from specpilot.core.events import Event, Gaps, parse

    body = Gaps(1, q8_report["measured_tokens_per_s"], q8_report["ceiling_tokens_per_s"], q8_report["gaps"],
                q8_report["largest_gap"], drift=q8_report["drift"])
    stored = json.loads(json.dumps(body.to_payload()))  # as the store keeps it; replay parses it back
    assert parse("gaps", stored) == body
    f32 = Gaps(2, 10.0, 20.0, q8_report["gaps"], q8_report["largest_gap"])
    q8_lines, f32_lines = gaps_panel_lines([Event("gaps", stored, 1, 1), Event.of(f32, 1, 2)])
    assert q8_lines[-1] == describe(q8_report["drift"], short=True)
    assert q8_lines[-1].startswith("q8 drift vs f32: ") and len(q8_lines) == len(q8_report["gaps"]) + 1
    assert len(f32_lines) == len(q8_report["gaps"]) and not any("drift" in line for line in f32_lines)
