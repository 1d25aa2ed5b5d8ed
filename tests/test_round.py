"""The round as a value (core/loop/summary.py): what one round produced, from which the run's JSON summary is
built, and which matches what the store keeps for the round."""

from __future__ import annotations

import json

import pytest

import mini_deployment
from specpilot.core.agents.base import Candidate
from specpilot.core.cli import build_parser
from specpilot.core.events import GATES
from specpilot.core.judge import Forcing, Gate, Verdict
from specpilot.core.loop import Pending, build_loop
from specpilot.core.loop.summary import Judged, Round, Standing
from specpilot.core.recipe import builtin
from specpilot.core.stats import Comparison
from specpilot.core.store import Store

REPORT = {"largest_gap": "verify", "measured_tokens_per_s": 410.0, "ceiling_tokens_per_s": 900.0,
          "predicted_tokens_per_s": 455.5, "gaps": [{"component": "verify", "ms_per_token": 0.8}],
          "predictions": [{"recipe": "stock", "predicted_tokens_per_s": 455.5}]}


def _pending() -> list[Pending]:
    stock = builtin("stock")
    deeper = stock.replace(tree={"depth": 6})
    won = Verdict(gates={g: Gate(True, "ok") for g in GATES}, forcing=Forcing(True, 0.0, 0.01),
                  heldout=Comparison(1.25, 1.1, 1.4, 0.02, True, 12))
    crashed = Verdict(gates={"applies": Gate(True, "ok"), "smoke": Gate(False, "worker crashed")})
    return [Pending("4-r2-c1", deeper, True, None, won, Candidate("tree", "depth 6", "why", "recipe", "", deeper,
                                                                   predicted_speedup=1.3), decision="approve"),
            Pending("4-r2-c2", stock, False, "smoke", crashed, Candidate("kernel", "fused", "", "recipe", "", stock))]


def test_a_round_is_the_summary_entry_the_cli_and_the_store_read():
    incumbent = builtin("stock").replace(tree={"depth": 6})
    standing = Standing.measured(Comparison(1.8, 1.7, 1.9, 0.02, True, 12), Comparison(1.25, 1.1, 1.4, 0.02, True, 12))
    rnd = Round.of(2, REPORT, _pending(), incumbent, standing, None)
    out = rnd.to_dict()
    assert list(out) == ["index", "largest_gap", "candidates", "incumbent", "gaps", "predicted_tokens_per_s",
                         "measured_tokens_per_s", "idle"]  # the stored summary's shape, key order included
    assert (out["index"], out["largest_gap"], out["gaps"]) == (2, "verify", REPORT["gaps"])
    assert (out["measured_tokens_per_s"], out["predicted_tokens_per_s"], out["idle"]) == (410.0, 455.5, None)
    assert "predictions" not in out and "ceiling_tokens_per_s" not in out
    assert out["incumbent"] == {"recipe": incumbent.to_toml(), "heldout_speedup_vs_ar": 1.8,
                                "heldout_speedup_vs_stock": 1.25, "interval": [1.1, 1.4]}  # the interval vs stock
    won, crashed = out["candidates"]
    assert won == {"cid": "4-r2-c1", "agent": "tree", "title": "depth 6", "gates": {g: True for g in GATES},
                   "verdict": "win", "reason": "passed every gate", "decision": "approve", "predicted_speedup": 1.3,
                   "heldout_speedup": 1.25, "interval": [1.1, 1.4], "forcing_rate": 0.0}
    assert crashed == {"cid": "4-r2-c2", "agent": "kernel", "title": "fused", "gates": {"applies": True, "smoke": False},
                       "verdict": "fail", "reason": "smoke: worker crashed", "decision": None,
                       "predicted_speedup": None, "heldout_speedup": None, "interval": None, "forcing_rate": None}
    assert json.loads(json.dumps(out)) == out  # what the store's JSON column gives back is the same summary


def test_a_judged_candidate_is_a_value_taken_when_decided():
    p = _pending()[0]
    judged = Judged.from_pending(p)
    p.decision, p.verdict.gates["heldout"] = "reject", Gate(False, "late")
    assert judged.decision == "approve" and judged.to_dict()["decision"] == "approve"
    assert judged.to_dict()["gates"]["heldout"] is True


def test_standing_of_stock_and_from_a_stored_incumbent():
    vs_ar = Comparison(1.4, 1.3, 1.5, 0.02, True, 12)
    stock = Standing.of_stock(vs_ar)
    assert (stock.vs_ar, stock.vs_stock, stock.interval) == (1.4, 1.0, [1.3, 1.5])  # stock against itself is 1.0
    payload = {"recipe": "x", "round": 3, "workspace": None, **stock.to_dict(), "stock_speedup_vs_ar": 1.4}
    assert Standing.from_payload(payload) == stock
    assert Standing.from_payload({"heldout_speedup_vs_ar": 2.0, "heldout_speedup_vs_stock": 1.5}).interval is None


@pytest.fixture(scope="module")
def one_round(tmp_path_factory):
    """One round in this process, two local agents, --auto: the loop's Round values and what it stored."""
    root = tmp_path_factory.mktemp("round")
    built = mini_deployment.build(root, requests=3, max_new_tokens=8)
    db = root / "store.db"
    args = build_parser().parse_args([
        "run", "--target", built["target"], "--drafter", built["drafter"], "--workload", built["workload"],
        "--rounds", "1", "--agents", "local:2", "--db", str(db), "--max-requests", "3", "--max-new-tokens", "8",
        "--auto"])
    loop = build_loop(args)
    summary = loop.run()
    return loop, summary, Store(str(db), read_only=True)


def test_the_run_summary_is_built_from_its_rounds(one_round):
    loop, summary, store = one_round
    assert [r.index for r in loop.rounds] == [1]
    rnd = loop.rounds[0]
    assert rnd.idle is None and rnd.candidates  # the agents got the cost model the round's analysis built
    assert summary["rounds"] == [r.to_dict() for r in loop.rounds]
    assert store.run(summary["run"])["summary"] == summary  # stored as returned, through the JSON column
    assert rnd.incumbent is loop.incumbent and rnd.standing == loop.standing


def test_a_stored_round_reads_back_as_the_round(one_round):
    loop, summary, store = one_round
    rnd = loop.rounds[0]
    (row,) = store.list_rounds(summary["run"])
    assert Standing.from_payload(row["incumbent"]) == rnd.standing  # what a resumed run starts from
    assert row["incumbent"]["recipe"] == rnd.incumbent.to_toml()
    assert (row["gaps"]["largest_gap"], row["gaps"]["gaps"]) == (rnd.largest_gap, rnd.gaps)
    assert row["gaps"]["measured_tokens_per_s"] == rnd.measured_tokens_per_s
    stored = store.candidates(row["id"])
    assert [c["cid"] for c in stored] == [c.cid for c in rnd.candidates]
    for c, judged in zip(stored, rnd.candidates):
        assert {g: ok["passed"] for g, ok in c["gates"].items()} == judged.gates
    incumbent = [e.payload for e in store.events(summary["run"]) if e.kind == "incumbent"]
    assert [Standing.from_payload(p) for p in incumbent] == [rnd.standing]
