"""Step costs kept per deployment (core/engine/cost_store.py): a second process reads them instead of measuring,
says where they came from, measures again on --remeasure or when the file is corrupt or belongs to another
deployment, and the policies price steps the same from a kept table as from a measured one."""

from __future__ import annotations

import json

import pytest

import specpilot.core.engine.engine as engine_module
from specpilot.core.engine import Engine, cost_store
from specpilot.core.engine.engine import CostKey
from specpilot.core.engine.batching import CostTable
from specpilot.core.recipe import Recipe

RECIPE = Recipe.from_dict({"draft": {"method": "ngram"}, "batching": {"policy": "budget"}})


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Cost tables kept under tmp_path; every measurement counted (one repeat: prices, not benchmarks)."""
    monkeypatch.setenv("SPECPILOT_COSTS_DIR", str(tmp_path / "costs"))
    calls = []
    real = engine_module.measure_costs

    def measure(target, drafter, batch_sizes, *args, **kwargs):
        calls.append(list(batch_sizes))
        return real(target, drafter, batch_sizes, repeats=1)

    monkeypatch.setattr(engine_module, "measure_costs", measure)
    return calls


def test_a_second_engine_reads_the_kept_table_and_says_so(tiny_pair, counted, tmp_path):
    target_dir, drafter_dir, _ = tiny_pair
    first = Engine.load(target_dir, drafter_dir).cost_table(RECIPE, [1, 2], stored=True)
    assert counted == [[1, 2]] and first.source.startswith("measured now, kept in ")
    kept = list((tmp_path / "costs").glob("*.json"))
    assert len(kept) == 1 and str(kept[0]) in first.source
    second = Engine.load(target_dir, drafter_dir).cost_table(RECIPE, [1, 2], stored=True)
    assert counted == [[1, 2]], "the kept table was measured again"
    assert second.source == str(kept[0]) and second.verify == first.verify and second.draft == first.draft
    third = Engine.load(target_dir, drafter_dir).cost_table(RECIPE, [1, 2, 4], stored=True)
    assert counted == [[1, 2], [4]] and (4, 1) in third.verify  # only what is missing is measured
    Engine.load(target_dir, drafter_dir).cost_table(RECIPE, [1, 2], stored=True, remeasure=True)
    assert counted == [[1, 2], [4], [1, 2]]


def test_unstored_tables_touch_no_file(tiny_pair, counted, tmp_path):
    target_dir, drafter_dir, _ = tiny_pair
    table = Engine.load(target_dir, drafter_dir).cost_table(RECIPE, [1])
    assert table.source == "measured now" and not (tmp_path / "costs").exists()


@pytest.mark.parametrize("damage", ["not json", "other deployment", "negative price", "empty"])
def test_a_corrupt_or_foreign_table_is_measured_again_and_rewritten(tiny_pair, counted, damage):
    target_dir, drafter_dir, _ = tiny_pair
    Engine.load(target_dir, drafter_dir).cost_table(RECIPE, [1], stored=True)
    path = next(cost_store.costs_dir().glob("*.json"))
    data = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{not json")
    elif damage == "other deployment":
        data["identity"]["cpu"] = "another CPU"
        path.write_text(json.dumps(data))
    elif damage == "negative price":
        data["table"]["verify"][0][2] = -1.0
        path.write_text(json.dumps(data))
    else:
        path.write_text("")
    table = Engine.load(target_dir, drafter_dir).cost_table(RECIPE, [1], stored=True)
    assert counted == [[1], [1]] and table.source.startswith("measured now")
    assert CostTable.from_dict(json.loads(path.read_text())["table"]).verify == table.verify


def test_the_identity_separates_what_changes_a_price(tiny_pair):
    target_dir, drafter_dir, _ = tiny_pair
    engine = Engine.load(target_dir, drafter_dir)
    target, _ = engine.models_for(RECIPE)
    a = engine._cost_identity(CostKey("native", False, "same", "native", "ngram", 0), target)
    b = engine._cost_identity(CostKey("native", False, "same", "native", "model", 0), target)
    assert cost_store.path_for(a) != cost_store.path_for(b)
    assert a["cpu"] == cost_store.cpu_model() and a["threads"] >= 1 and a["numerics"] == "f32"
    assert a["code"] == cost_store.step_code() and len(a["code"]) == 16  # the sources a step runs, digested


def test_serve_reads_its_kept_costs_on_the_second_start_and_remeasures_when_asked(monkeypatch, tmp_path):
    from serve_helpers import Server

    from specpilot.core.deployment import DEMO_DRAFTER, DEMO_TARGET

    monkeypatch.setenv("SPECPILOT_COSTS_DIR", str(tmp_path / "costs"))
    args = ("--target", str(DEMO_TARGET), "--drafter", str(DEMO_DRAFTER), "--recipe", "batch-budget",
            "--max-batch", "2")
    logs = []
    for extra in ((), (), ("--remeasure",)):
        server = Server(*args, *extra)
        with server:
            r = server.client().completions.create(model=server.client().models.list().data[0].id,
                                                   prompt="def add(a, b):", max_tokens=4, temperature=0)
            assert r.choices[0].text
        logs.append(server.log.decode())
    kept = next((tmp_path / "costs").glob("*.json"))
    assert f"step costs for batching policy 'budget': measured now, kept in {kept}" in logs[0], logs[0]
    assert f"step costs for batching policy 'budget': {kept}" in logs[1], logs[1]
    assert "measured now, kept in" in logs[2], logs[2]


def test_break_even_is_where_drafting_matches_plain_decoding():
    """The acceptance break_even gives makes a drafting step's tokens per ms equal plain decoding's; a width whose
    two-token step costs more than twice one token's has none."""
    from specpilot.core.engine.batching import break_even, expected_accepted, step_price

    table = CostTable({(1, 1): 100.0, (1, 2): 110.0, (1, 3): 120.0, (16, 1): 260.0, (16, 2): 390.0, (16, 3): 540.0},
                      {1: 30.0, 16: 200.0})
    for rows, depth in ((1, 1), (1, 2), (16, 2)):
        alpha = break_even(table, rows, depth)
        if alpha is None:
            assert step_price(table, rows, depth) > (depth + 1) * step_price(table, rows, 0)
            continue
        assert 0 < alpha < 1
        drafting = expected_accepted(alpha, depth) / step_price(table, rows, depth)
        assert drafting == pytest.approx(1 / step_price(table, rows, 0), rel=1e-6)
    assert break_even(table, 1, 1) == pytest.approx((110 + 30) / 100 - 1, rel=1e-6)
    assert break_even(table, 16, 1) is None  # (390 + 200) / 260 > 2: not even every draft accepted pays


def test_costs_lists_the_kept_tables_and_where_speculation_can_pay(monkeypatch, tmp_path, capsys):
    from specpilot.core.cli import main
    from specpilot.core.engine.batching import break_even

    monkeypatch.setenv("SPECPILOT_COSTS_DIR", str(tmp_path))
    assert main(["costs"]) == 0
    assert "no step costs kept" in capsys.readouterr().out
    table = CostTable({(1, 1): 100.0, (1, 2): 110.0, (4, 1): 150.0, (4, 2): 200.0}, {1: 30.0, 4: 60.0},
                      catch_up=2.0)
    identity = {"target": str(tmp_path / "t"), "drafter": None, "numerics": "q8", "dtype": "torch.float32",
                "device": "cpu", "recipe": ["gguf", True, "q4", "native", "model", 0], "cpu": "a CPU", "threads": 1,
                "torch": "x"}
    path = cost_store.save(identity, table)
    (tmp_path / "broken.json").write_text("{")
    assert main(["costs"]) == 0
    out = capsys.readouterr().out
    assert path.name in out and "numerics q8" in out and "a CPU" in out and "broken" not in out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["4"])
    assert row[1:4] == ["37.5", "1.33", "60.0"] and row[4] == f"{break_even(table, 4, 1):.2f}"
    assert main(["costs", "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert len(kept) == 1 and kept[0]["break_even"]["1"]["1"] == pytest.approx(0.4)

