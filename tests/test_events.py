"""Typed events: emit -> store -> replay gives the same events, old stored payloads still replay, an
unknown or malformed stored event is a one-line notice, and a forcing failure's error reaches the screen."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from specpilot.app.app import SpecPilotApp, build_parser
from specpilot.app.state import DashboardState
from specpilot.app.widgets.forcing import ForcingTable
from specpilot.app.widgets.header import StatusLine
from specpilot.core import events as ev
from specpilot.core.deployment import Deployment
from specpilot.core.judge import Judge, JudgeRequest
from specpilot.core.loop.headless import line_for
from specpilot.core.loop.record import EventLog
from specpilot.core.recipe import stock
from specpilot.core.store.db import Store


@pytest.fixture(autouse=True)
def isolated_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dashboard's settings in a temporary folder, never the user's."""
    monkeypatch.setenv("SPECPILOT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("SPECPILOT_LOOP_FACTORY", raising=False)


SAMPLES: list[ev.EventBody] = [
    ev.RunStarted(7, {"target": "models/demo-target", "drafter": None}, ["local:2"], True, 3, 1),
    ev.RoundStarted(2),
    ev.StateChanged("judging"),
    ev.Progress("calibration", "measuring", 3, 12, 4.5, None),
    ev.Gaps(2, 180.5, 410.0, [{"component": "verify", "ms_per_token": 1.25}], "verify"),
    ev.AgentStarted("7-r2-c1", "tree-shape", "verify"),
    ev.AgentChunk("7-r2-c1", "replayed 40 positions\n"),
    ev.AgentDone("7-r2-c1", "tree-shape", "wider tree"),
    ev.CandidateProposed("7-r2-c1", "tree-shape", "wider tree", "cheap nodes", "recipe", "-a\n+b\n",
                         "[tree]\nbudget = 32\n", 1.12),
    ev.CandidateFailed("7-r2-c2", "runtime", "no change predicted to help"),
    ev.GateChecked("7-r2-c1", "forcing", False, "mismatch rate 0.2000 vs threshold 0.0100"),
    ev.Forced("7-r2-c1", 40, None, 1.0, 0.01, False, None, "forcing could not score the outputs: IndexError: x"),
    ev.Evaluated("7-r2-c1", "tuning", 1.08, 1.01, 1.15, True),
    ev.AwaitingDecision("7-r2-c1"),
    ev.Decided("7-r2-c1", "reject", "too risky", "user"),
    ev.NewIncumbent(2.1, 2, "[tree]\n", 1.17, [1.05, 1.3], 3.0, 1.8, "/tmp/ws"),
    ev.RoundFinished(2),
    ev.RunFinished(7, {"reason": "quit during judging"}, "stopped"),
    ev.Notice("resumed"),
    ev.Error("RuntimeError: worker died"),
]


def test_every_kind_has_a_sample_and_a_dashboard_handler() -> None:
    assert sorted(type(b).KIND for b in SAMPLES) == sorted(ev.KINDS)
    assert set(DashboardState()._handlers) == set(ev.KINDS)


def test_emit_store_replay_round_trip(tmp_path: Path) -> None:
    """What the loop emits, what watchers get and what replay reads back are the same typed events."""
    store = Store(tmp_path / "store.db")
    log = EventLog(store)
    log.run_id = store.create_run({}, {})
    log.round = 2
    seen: list[ev.Event] = []
    log.emit_to = seen.append
    for body in SAMPLES:
        log(body)
    store.close()
    replayed = Store(tmp_path / "store.db").events(log.run_id)
    assert [e.body for e in replayed] == SAMPLES
    assert [e.body for e in seen] == SAMPLES
    assert [e.seq for e in replayed] == list(range(1, len(SAMPLES) + 1))


def test_parse_names_the_problem_in_one_line() -> None:
    with pytest.raises(ev.MalformedEvent, match=r"^forcing event without tokens$"):
        ev.parse("forcing", {"cid": "c1"})
    with pytest.raises(ev.MalformedEvent, match=r"^gate event: passed must be bool, got 'yes'$"):
        ev.parse("gate", {"cid": "c1", "gate": "smoke", "passed": "yes"})
    with pytest.raises(ev.MalformedEvent, match=r"^unknown event kind 'budget'$"):
        ev.parse("budget", {})
    assert ev.parse("round_started", {"round": "3", "extra": 1}) == ev.RoundStarted(3)


OLD_EVENTS: list[tuple[str, Any]] = [
    # as earlier versions stored them: fewer keys, the forcing failure without its error
    ("run_started", {"run": 1, "deployment": {"target": "models/demo-target"}, "agents": ["local:2"], "auto": True}),
    ("round_started", {"round": 1}),
    ("agent_started", {"cid": "1-r1-c1", "agent": "local:0", "direction": "verify"}),
    ("candidate", {"cid": "1-r1-c1", "agent": "local:0", "title": "lossy", "rationale": "", "kind": "recipe",
                   "diff": "-a\n+b\n", "recipe": "", "predicted_speedup": None}),
    ("forcing", {"cid": "1-r1-c1", "tokens": 40, "mismatches": None, "rate": 1.0, "near_ties": None,
                 "threshold": 0.01, "passed": False}),
    ("gate", {"cid": "1-r1-c1", "gate": "forcing", "passed": False, "detail": "forcing could not score the outputs"}),
    ("budget_spent", {"minutes": 3}),  # a kind this version does not know
    ("gate", {"cid": "1-r1-c1", "gate": "tuning"}),  # malformed: no verdict
    ("evaluation", ["not", "an", "object"]),
    ("incumbent", {"round": 1, "recipe": "", "heldout_speedup_vs_ar": 2.0, "heldout_speedup_vs_stock": 1.25,
                   "interval": [1.1, 1.4], "ceiling_speedup_vs_ar": 3.0}),
    ("round_finished", {"round": 1}),
    ("run_finished", {"run": 1, "summary": {}}),
]


def old_store(path: Path) -> int:
    """A store holding a run written row by row as an older SpecPilot did (payload JSON as stored)."""
    store = Store(path)
    run = store.create_run({"target": "models/demo-target"}, {})
    store.close()
    conn = sqlite3.connect(path)
    for seq, (kind, payload) in enumerate(OLD_EVENTS, 1):
        conn.execute("INSERT INTO event (run_id, seq, time, round, kind, payload) VALUES (?, ?, ?, ?, ?, ?)",
                     (run, seq, 1_700_000_000.0 + seq, 1, kind, json.dumps(payload)))
    conn.commit()
    conn.close()
    return run


def test_an_old_store_replays_and_what_does_not_parse_is_a_notice(tmp_path: Path) -> None:
    run = old_store(tmp_path / "store.db")
    events = Store(tmp_path / "store.db").events(run)
    assert [e.kind for e in events] == [k for k, _ in OLD_EVENTS]
    state = DashboardState()
    state.apply_all(events)
    assert state.round == 1 and state.run_status == "finished"
    assert state.forcing["1-r1-c1"].mismatches is None and state.forcing["1-r1-c1"].passed is False
    assert state.candidates["1-r1-c1"].state == "failed forcing"
    assert state.incumbents[-1].stock_vs_ar == pytest.approx(1.6)
    warnings = [a.message for a in state.take_alerts() if a.severity == "warning"]
    assert warnings == ["unknown event kind 'budget_spent'; event ignored", "gate event without passed; event ignored",
                        "evaluation event: payload is list, not an object; event ignored"]


def test_headless_output_skips_what_does_not_parse(capsys: pytest.CaptureFixture[str]) -> None:
    from specpilot.core.loop.headless import stderr_progress

    stderr_progress(ev.Event("budget_spent", {"minutes": 3}))
    stderr_progress(ev.Event.of(ev.CandidateFailed("1-r1-c2", "runtime", "no diff")))
    assert capsys.readouterr().err == "  1-r1-c2 runtime: no candidate (no diff)\n"
    assert line_for(ev.GateChecked("c", "smoke", True)) is None


def forcing_failure() -> ev.Forced:
    """The event the loop emits for a judge whose forcing could not score a candidate's outputs."""

    def force(requests: list, outputs: list, recipe: Any) -> dict:
        raise IndexError("token id 70000 is outside the vocabulary of 49152")

    judge = Judge(Deployment(), [], [], force)
    request = JudgeRequest("r0", 0, [1, 2, 3], 8)
    result = judge._forced([(request, [70000] * 8)], stock())
    assert result.error and not result.passed and result.why == result.error
    return ev.Forced.from_result("1-r1-c2", result.record)


def test_a_forcing_failure_shows_its_error_on_screen() -> None:
    body = forcing_failure()
    assert body.mismatches is None and body.passed is False
    app = SpecPilotApp(build_parser().parse_args([]))

    async def go() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            app.live.feed(ev.Event.of(ev.RoundStarted(1)))
            app.live.feed(ev.Event.of(body))
            await pilot.pause()
            line = app.live.query_one(StatusLine).text
            assert "IndexError: token id 70000 is outside the vocabulary" in line
            assert "malformed" not in line and "ignored" not in line
            table = app.live.query_one(ForcingTable)
            assert table.verdicts() == {"1-r1-c2": "FAIL"}
            assert table.get_cell("1-r1-c2", "mismatches").plain == "—"
            assert any("IndexError" in n.message for n in app._notifications)

    asyncio.run(go())
