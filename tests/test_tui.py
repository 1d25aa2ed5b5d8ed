"""specpilot-tui: panels from events, decisions and pause reaching the core, replay, themes, errors."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
from fake_core import FakeCore, record, save_run
from textual.widgets import TabbedContent

from specpilot.app.app import SpecPilotApp, build_parser, main
from specpilot.app.bridge import LoopUnavailable, StoreUnavailable, build_handle, open_store
from specpilot.app.commands import SpecPilotCommands
from specpilot.app.screens.diff import DiffScreen
from specpilot.app.screens.help import HelpScreen
from specpilot.app.screens.reject import RejectScreen
from specpilot.app.screens.replay import ReplayScreen, split_round
from specpilot.app.screens.runs import RunsScreen
from specpilot.app.state import DashboardState, GapView
from specpilot.app.widgets.candidates import CandidateTable
from specpilot.app.widgets.dashboard import Dashboard
from specpilot.app.widgets.diffview import DiffView, line_kind
from specpilot.app.widgets.forcing import ForcingTable
from specpilot.app.widgets.gaps import BELOW_FLOOR, GapBars, bar
from specpilot.app.widgets.header import StatusHeader, StatusLine
from specpilot.app.widgets.speedup import SpeedupPlot
from specpilot.core.cli import db_path
from specpilot.core.events import Event
from specpilot.core.store.db import Store

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

WIDE = (160, 50)
SMALL = (80, 24)


@pytest.fixture(autouse=True)
def isolated_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Settings in a temporary folder; colour allowed."""
    monkeypatch.setenv("SPECPILOT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("SPECPILOT_LOOP_FACTORY", raising=False)
    return tmp_path / "config" / "settings.json"


def make_app(core: FakeCore | None = None, argv: tuple[str, ...] = (), **kwargs: Any) -> SpecPilotApp:
    args = build_parser().parse_args(list(argv))
    return SpecPilotApp(args, loop_factory=(lambda: core) if core is not None else None, **kwargs)


def drive(app: SpecPilotApp, script: Callable[[Any], Awaitable[None]], size: tuple[int, int] = SMALL) -> None:
    """Run `script(pilot)` against the app in a headless terminal."""

    async def go() -> None:
        async with app.run_test(size=size) as pilot:
            await script(pilot)

    asyncio.run(go())


async def until(pilot: Any, ready: Callable[[], bool], timeout: float = 10.0) -> None:
    """Let the app run until `ready()`; fail after `timeout` seconds."""
    for _ in range(int(timeout / 0.02)):
        if ready():
            await pilot.pause(0.05)
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached in time")


def notifications(app: SpecPilotApp) -> list[str]:
    return [n.message for n in app._notifications]


def panel_content(dash: Dashboard) -> dict[str, Any]:
    """Everything the panels show, as plain data (for comparing live and replayed dashboards)."""
    cands = dash.query_one(CandidateTable)
    forcing = dash.query_one(ForcingTable)
    return {
        "header": dash.query_one(StatusHeader).text,
        "status": dash.query_one(StatusLine).text,
        "gaps": dash.query_one(GapBars).bars,
        "largest": dash.query_one(GapBars).largest,
        "gaps_title": str(dash.query_one("#gaps-panel").border_title),
        "candidates": [tuple(c.plain for c in cands.get_row(k)) for k in cands.rows],
        "forcing": [tuple(c.plain for c in forcing.get_row(k)) for k in forcing.rows],
        "speedup": dash.query_one(SpeedupPlot).series,
        "diff": dash.query_one("#diff", DiffView).text,
    }


# --- the state model (pure Python) ---------------------------------------------------------------


def test_state_folds_a_round_into_panels() -> None:
    state = DashboardState()
    changed = state.apply_all(record(1))
    assert {"header", "gaps", "candidates", "forcing", "speedup", "status"} <= changed
    assert [c.state for c in state.candidates.values()] == ["approved", "failed forcing", "agent failed"]
    assert state.candidates["c1"].gate_marks == "✓✓✓✓✓"
    assert state.candidates["c2"].gate_marks == "✓✓✗··"
    assert state.candidates["c1"].measured == pytest.approx(1.19)
    assert state.forcing["c2"].passed is False
    point = state.incumbents[-1]
    assert point.stock_vs_ar == pytest.approx(1.80, abs=0.01)
    assert state.best_speedup == pytest.approx(2.142)
    assert state.gaps is not None and state.gaps.largest == "verify"
    assert state.loop_state == "done"


def test_state_refuses_what_the_core_would() -> None:
    state = DashboardState()
    state.apply_all(record(1, until_awaiting=True))
    assert state.refusal("c1", "approve") is None
    assert "forcing gate" in state.refusal("c2", "approve")
    assert "agent failed" in state.refusal("c3", "approve")
    assert "not awaiting" in state.refusal("c2", "reject")
    assert state.refusal(None, "approve") == "no candidate selected"


def test_malformed_event_becomes_a_warning_not_an_exception() -> None:
    state = DashboardState()
    assert state.apply(Event("forcing", {"cid": "x"})) == {"status"}
    assert state.take_alerts()[0].severity == "warning"


def test_bars_and_diff_line_kinds() -> None:
    assert bar(1.0, 2.0, 8) == "████"
    assert bar(2.0, 2.0, 4) == "████"
    assert bar(0.0, 2.0, 4) == ""
    assert [line_kind(x) for x in ("+a", "-b", "@@ -1 +1 @@", "+++ b/x", " c")] == \
        ["add", "del", "hunk", "meta", "plain"]


def test_split_round_keeps_earlier_rounds_as_prefix() -> None:
    events = record(2)
    prefix, own = split_round(events, 2)
    assert own[0].kind == "round_started" and own[0].payload["round"] == 2
    assert prefix + own == events


# --- live dashboard ------------------------------------------------------------------------------


def test_cursor_moves_to_the_candidate_awaiting_a_decision() -> None:
    """The first row failed forcing; when the second starts waiting, `a` approves it without moving the
    cursor by hand, and again in the next round."""
    core = FakeCore(rounds=2, lossy_first=True)
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: app.live.state.awaiting() == ["c2"])
        table = app.live.query_one(CandidateTable)
        assert [str(k.value) for k in table.rows][:2] == ["c1", "c2"]
        assert app.live.current_cid == "c2"
        await pilot.press("a")
        assert core.decisions == [("c2", "approve", "")]
        await until(pilot, lambda: app.live.state.awaiting() == ["c5"])
        assert app.live.current_cid == "c5"
        await pilot.press("a")
        assert core.decisions[-1] == ("c5", "approve", "")
        await pilot.press("q")

    drive(app, script)


def test_live_panels_update_and_approval_reaches_the_core() -> None:
    core = FakeCore(rounds=2)
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: "c1" in core.awaiting)
        content = panel_content(app.live)
        assert "AWAITING APPROVAL" in content["header"]
        assert "demo-target → demo-drafter" in content["header"] and "round 1" in content["header"]
        assert content["gaps"] == [("draft", pytest.approx(1.0)), ("verify", pytest.approx(1.95)),
                                   ("acceptance", 0.95), ("host overhead", 0.42), ("kv copy", 0.18)]
        assert content["largest"] == "verify"
        assert "184.0 tok/s measured" in content["gaps_title"] and "ceiling 331.2" in content["gaps_title"]
        rows = {r[0]: r for r in content["candidates"]}
        assert rows["c1"][1:] == ("local:0", "Wider dynamic tree", "awaiting", "✓✓✓✓✓", "1.18x", "1.19x")
        assert rows["c2"][3:5] == ("✗ forcing", "✓✓✗··")
        assert rows["c3"][3] == "✗ agent"
        assert content["forcing"] == [("c1", "4096", "30", "0.73%", "27", "1.22%", "PASS"),
                                      ("c2", "4096", "82", "2.00%", "9", "1.22%", "FAIL")]
        assert '+policy = "dynamic"' in content["diff"] and content["diff"].startswith("# Wider dynamic tree")
        assert "agent local:2 failed on c3" in content["status"]
        assert content["speedup"] == {}

        await pilot.press("a")
        assert core.decisions == [("c1", "approve", "")]
        await until(pilot, lambda: "c4" in core.awaiting)
        series = app.live.query_one(SpeedupPlot).series
        assert series["incumbent"] == ([1.0], [pytest.approx(2.142)])
        assert series["stock"][1] == [pytest.approx(1.8, abs=0.01)] * 2
        assert series["ceiling"][1] == [3.1, 3.1]
        assert "best 2.14x" in app.live.query_one(StatusHeader).text
        await pilot.press("q")

    drive(app, script)
    assert app.return_code == 0
    assert core.calls[-1] == "stop"


def test_streamed_chunks_are_buffered_then_drained_in_order() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        dash = app.live
        dash.feed(Event("round_started", {"round": 1}))
        dash.feed(Event("agent_started", {"cid": "c1", "agent": "local:0", "direction": "tree"}))
        await pilot.pause(0.05)
        for piece in ("--- a/recipe.toml\n", "+++ b/recipe.toml\n", "@@ -1 +1 @@\n", "-depth = 4\n+depth = 6\n"):
            dash.feed(Event("agent_chunk", {"cid": "c1", "text": piece}))
        view = dash.query_one("#diff", DiffView)
        assert view.text == "" and len(dash.pending) == 4
        await until(pilot, lambda: not dash.pending)
        assert view.text.endswith("+depth = 6\n")
        dash.feed(Event("agent_chunk", {"cid": "c1", "text": "ignored tail"}))
        dash.feed(Event("candidate", {"cid": "c1", "agent": "local:0", "title": "Deeper", "rationale": "",
                                      "kind": "recipe", "diff": "-depth = 4\n+depth = 6\n", "recipe": "",
                                      "predicted_speedup": 1.1}))
        assert not dash.pending
        assert dash.state.candidates["c1"].stream.endswith("ignored tail")
        assert view.text == "# Deeper\n\n-depth = 4\n+depth = 6\n"

    drive(app, script)


def test_reject_asks_for_a_note_and_reaches_the_core() -> None:
    core = FakeCore(rounds=1)
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: "c1" in core.awaiting)
        await pilot.press("r")
        assert isinstance(app.screen, RejectScreen)
        await pilot.press("escape")
        assert core.decisions == []
        await pilot.press("r")
        await pilot.press(*"too risky")
        await pilot.press("enter")
        await until(pilot, lambda: core.finished.is_set())
        assert core.decisions == [("c1", "reject", "too risky")]
        await until(pilot, lambda: app.live.state.candidates.get("c1") is None
                    or app.live.state.loop_state == "done")

    drive(app, script)


def test_approving_a_failed_candidate_is_refused_by_the_ui() -> None:
    core = FakeCore(rounds=1)
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: "c1" in core.awaiting)
        app.live.query_one(CandidateTable).focus()
        await pilot.press("down")
        assert app.live.current_cid == "c2"
        await pilot.press("a")
        assert core.decisions == []
        assert any("failed the forcing gate" in m for m in notifications(app))
        await pilot.press("down", "a")
        assert any("agent failed" in m for m in notifications(app))
        await pilot.press("r")
        assert not isinstance(app.screen, RejectScreen)
        assert core.decisions == []

    drive(app, script)


def test_a_refusal_from_the_core_is_shown() -> None:
    core = FakeCore(rounds=1, refuse_all=True)
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: "c1" in core.awaiting)
        await pilot.press("a")
        assert "the core refused to approve c1" in notifications(app)
        assert core.decisions == []

    drive(app, script)


def test_pause_and_resume_reach_the_core() -> None:
    core = FakeCore(rounds=1, delay=0.05)
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: core.events and core.events[-1].kind != "run_started")
        await pilot.press("space")
        assert core.calls == ["pause"]
        await until(pilot, lambda: app.live.state.loop_state == "paused")
        assert "PAUSED" in app.live.query_one(StatusHeader).text
        seen = len(core.events)
        await pilot.pause(0.2)
        assert len(core.events) == seen
        await pilot.press("space")
        assert core.calls == ["pause", "resume"]
        await until(pilot, lambda: "c1" in core.awaiting)

    drive(app, script)


def test_full_diff_modal_and_help() -> None:
    core = FakeCore(rounds=1)
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: "c1" in core.awaiting)
        await pilot.press("enter")
        assert isinstance(app.screen, DiffScreen)
        text = app.screen.query_one(DiffView).text
        assert "✓ forcing: 0.73% <= 1.22%" in text and '+budget = 32' in text
        await pilot.press("escape")
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)

    drive(app, script, SMALL)


def test_command_palette_lists_and_runs_the_actions() -> None:
    core = FakeCore(rounds=1)
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: "c1" in core.awaiting)
        provider = SpecPilotCommands(app.screen)
        names = [hit.display async for hit in provider.discover()]
        assert names == ["Approve selected candidate", "Reject selected candidate", "Pause / resume the loop",
                         "Show the selected candidate's full diff", "Runs and replay", "Next theme", "Help: keys",
                         "Quit SpecPilot"]
        await pilot.press("ctrl+p")
        await pilot.press(*"approve sel")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await until(pilot, lambda: core.decisions == [("c1", "approve", "")])

    drive(app, script)


def test_layout_is_tabs_when_small_and_a_grid_when_large() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        assert app.live.query(TabbedContent)
        await pilot.resize_terminal(*WIDE)
        await until(pilot, lambda: bool(app.live.query("#grid")))
        assert not app.live.query(TabbedContent)
        await pilot.resize_terminal(*SMALL)
        await until(pilot, lambda: bool(app.live.query(TabbedContent)))

    drive(app, script, SMALL)


# --- errors --------------------------------------------------------------------------------------


def test_a_loop_that_cannot_start_leaves_the_ui_usable() -> None:
    def broken() -> FakeCore:
        raise LoopUnavailable("cannot start the loop: target model directory models/x does not exist")

    app = SpecPilotApp(build_parser().parse_args([]), loop_factory=broken)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: app.live.state.status is not None)
        assert "models/x does not exist" in app.live.query_one(StatusLine).text
        assert "FAILED" in app.live.query_one(StatusHeader).text
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape", "space")
        assert any("not running" in m for m in notifications(app))
        await pilot.press("q")

    drive(app, script)
    assert app.return_code == 1  # the run failed to start: a script calling the dashboard must see it


def test_a_loop_that_raises_mid_run_is_reported() -> None:
    core = FakeCore(rounds=1, auto=True, fail_with="CUDA out of memory\nlong traceback text")
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: app.live.state.loop_state == "failed")
        line = app.live.query_one(StatusLine).text
        assert "RuntimeError: CUDA out of memory" in line and "traceback" not in line
        await pilot.press("t")
        assert app.theme == "specpilot-light"

    drive(app, script)


def test_error_events_and_notices_show_in_the_status_line() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        app.live.feed(Event("error", {"message": "judge worker crashed"}))
        assert app.live.query_one(StatusLine).text == " ✗ judge worker crashed"
        await pilot.pause()
        assert "judge worker crashed" in notifications(app)
        app.live.feed(Event("notice", {"message": "round 2 skipped: no gaps left"}))
        assert "round 2 skipped" in app.live.query_one(StatusLine).text

    drive(app, script, SMALL)


def test_build_handle_turns_loop_failures_into_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("specpilot.core.loop")

    def build_loop(args: Any) -> None:
        raise FileNotFoundError("no model at /models/missing\n(details)")

    fake.build_loop = build_loop  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "specpilot.core.loop", fake)
    with pytest.raises(LoopUnavailable, match=r"^cannot start the loop: no model at /models/missing$"):
        build_handle(build_parser().parse_args([]))


def test_store_problems_are_one_line_messages(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailable, match="no store at"):
        open_store(tmp_path / "missing.db")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"definitely not sqlite" * 10)
    with pytest.raises(StoreUnavailable, match="not an SQLite database") as info:
        open_store(junk)
    assert "\n" not in str(info.value)
    app = make_app(argv=("--db", str(junk)))

    async def script(pilot: Any) -> None:
        await pilot.press("R")
        assert not isinstance(app.screen, RunsScreen)
        assert any("not an SQLite database" in m for m in notifications(app))

    drive(app, script, SMALL)


# --- replay --------------------------------------------------------------------------------------


def stored(tmp_path: Path, events: list[Event]) -> Path:
    path = tmp_path / "store.db"
    store = Store(path)
    save_run(store, events)
    store.close()
    return path


def test_replay_renders_a_round_as_the_live_run_showed_it(tmp_path: Path) -> None:
    core = FakeCore(rounds=2, hold_after_round=1)
    live_app = make_app(core)
    seen: dict[str, Any] = {}

    async def live(pilot: Any) -> None:
        await until(pilot, lambda: "c1" in core.awaiting)
        await pilot.press("a")
        await until(pilot, lambda: core.held.is_set())
        await until(pilot, lambda: not live_app.live.pending and live_app.live.state.round == 1
                    and live_app.live.state.events_seen == len(core.events))
        seen["round1"] = panel_content(live_app.live)
        core.release.set()
        await until(pilot, lambda: "c4" in core.awaiting)
        await pilot.press("a")
        await until(pilot, lambda: core.finished.is_set())
        await until(pilot, lambda: live_app.live.state.events_seen == len(core.events))
        seen["end"] = panel_content(live_app.live)

    drive(live_app, live, SMALL)
    db = stored(tmp_path, core.events)
    app = make_app(argv=("--replay", "--db", str(db)))

    async def replay(pilot: Any) -> None:
        await until(pilot, lambda: isinstance(app.screen, RunsScreen))
        runs = app.screen
        assert runs.rounds == [1, 2]
        await pilot.press("enter")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ReplayScreen))
        screen = app.screen
        assert screen.index == 1
        assert panel_content(screen.dashboard) == seen["round1"]
        await pilot.press("3", "p")
        await until(pilot, lambda: not screen.playing and screen.dashboard.query_one(CandidateTable).row_count == 3)
        assert panel_content(screen.dashboard) == seen["round1"]
        await pilot.press("right_square_bracket")
        assert screen.index == 2
        replayed = panel_content(screen.dashboard)
        assert replayed["candidates"] == seen["end"]["candidates"]
        assert replayed["speedup"] == seen["end"]["speedup"]
        await pilot.press("escape")
        assert isinstance(app.screen, RunsScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, RunsScreen)

    drive(app, replay, SMALL)


def test_replay_streams_the_diff_at_the_chosen_speed(tmp_path: Path) -> None:
    db = stored(tmp_path, record(1))
    app = make_app(argv=("--replay", "1", "--db", str(db)))

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: isinstance(app.screen, ReplayScreen))
        screen = app.screen
        final = panel_content(screen.dashboard)
        await pilot.press("1", "p")
        await until(pilot, lambda: screen.dashboard.state.candidates.get("c1") is not None
                    and screen.dashboard.state.candidates["c1"].state == "streaming"
                    and screen.dashboard.query_one("#diff", DiffView).text != "")
        partial_text = screen.dashboard.query_one("#diff", DiffView).text
        assert partial_text.startswith("Looking at the tree gap.") and "+budget = 32" not in partial_text
        await until(pilot, lambda: not screen.playing, timeout=20)
        assert panel_content(screen.dashboard) == final

    drive(app, script, SMALL)


def test_replay_of_an_unknown_run_says_so(tmp_path: Path) -> None:
    db = stored(tmp_path, record(1))
    app = make_app(argv=("--replay", "99", "--db", str(db)))

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: isinstance(app.screen, RunsScreen))
        await until(pilot, lambda: any("no run 99" in m for m in notifications(app)))
        assert isinstance(app.screen, RunsScreen)

    drive(app, script, SMALL)


# --- themes and the command line -----------------------------------------------------------------


def test_theme_cycles_and_is_remembered(isolated_settings: Path) -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        assert app.theme == "specpilot-dark"
        await pilot.press("t")
        assert app.theme == "specpilot-light"
        await pilot.press("t")
        assert app.theme == "specpilot-mono"
        await pilot.pause(0.1)

    drive(app, script, SMALL)
    assert json.loads(isolated_settings.read_text())["theme"] == "specpilot-mono"
    again = make_app()

    async def check(pilot: Any) -> None:
        assert again.theme == "specpilot-mono"
        await pilot.press("t")
        assert again.theme == "specpilot-dark"

    drive(again, check, SMALL)


def test_theme_option_no_color_and_unknown_names(isolated_settings: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(argv=("--theme", "specpilot-light"))
    drive(app, lambda pilot: pilot.pause(0.1), SMALL)
    assert app.theme == "specpilot-light"
    assert json.loads(isolated_settings.read_text())["theme"] == "specpilot-light"
    isolated_settings.unlink()
    monkeypatch.setenv("NO_COLOR", "1")
    mono = make_app()
    drive(mono, lambda pilot: pilot.pause(0.1), SMALL)
    assert mono.theme == "specpilot-mono"
    assert not isolated_settings.exists()
    unknown = make_app(argv=("--theme", "neon"))

    async def check(pilot: Any) -> None:
        assert unknown.theme == "specpilot-mono"
        assert "unknown theme 'neon'" in unknown.live.query_one(StatusLine).text

    drive(unknown, check, SMALL)


def test_mono_theme_marks_results_without_colour() -> None:
    app = make_app(argv=("--theme", "specpilot-mono"))

    async def script(pilot: Any) -> None:
        app.live.load(record(1))
        await pilot.pause(0.1)
        table = app.live.query_one(ForcingTable)
        assert table.verdicts() == {"c1": "PASS", "c2": "FAIL"}
        assert table.get_cell("c2", "result").style.reverse
        gaps = app.live.query_one(GapBars)
        assert "◀ largest" in gaps.render().plain
        assert gaps.get_component_rich_style("gaps--largest").underline

    drive(app, script, WIDE)


def test_a_negative_gap_says_it_is_under_its_floor() -> None:
    """The real pair's round 1 measured verify at -17.6 ms/token (under the bandwidth floor): an empty bar
    would read as zero, so the row says what the sign means and keeps its value."""
    app = make_app()

    async def script(pilot: Any) -> None:
        app.live.state.gaps = GapView(1, 2.0, 9.0, [("weights", 213.0), ("verify", -17.6), ("host", 74.0)],
                                      "weights")
        gaps = app.live.query_one(GapBars)
        gaps.sync()
        await pilot.pause(0.1)
        lines = gaps.render().plain.splitlines()
        assert BELOW_FLOOR in lines[1] and "-17.60 ms/tok" in lines[1]
        assert BELOW_FLOOR not in lines[0] + lines[2] and "█" in lines[2]

    drive(app, script, WIDE)


def test_parser_matches_specpilot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECPILOT_DB", "/tmp/elsewhere.db")
    args = build_parser().parse_args([])
    assert (args.rounds, args.agents, db_path(args), args.auto, args.replay) == (3, "local:4", "/tmp/elsewhere.db",
                                                                                False, None)
    assert build_parser().parse_args(["--max-requests", "2", "--device", "cpu"]).max_requests == 2
    assert build_parser().parse_args(["--replay"]).replay == ""
    assert build_parser().parse_args(["--replay", "7", "--auto"]).replay == "7"
    with pytest.raises(SystemExit):
        main(["--rounds", "many"])


# --- progress, quitting, signals, the run's end ----------------------------------------------------


class SlowCore(FakeCore):
    """A core stuck in one long step until it is aborted, as the real loop is in a measurement."""

    def __init__(self) -> None:
        super().__init__(rounds=1)
        self.aborted: list[str] = []
        self.waiting_for = "calibration: A/A noise floor"

    def run(self, emit: Any) -> None:
        self._emit = emit
        self._raw("run_started", {"run": 1, "deployment": {}, "agents": [], "auto": False})
        self._raw("state", {"state": "measuring"})
        self._raw("progress", {"state": "measuring", "step": self.waiting_for, "done": 12, "total": 40,
                               "elapsed_s": 62.0, "eta_s": 190.0})
        try:
            self._wait_for(lambda: False)
        except Exception:
            self._raw("state", {"state": "stopped"})
        finally:
            self.finished.set()

    def abort(self, why: str) -> None:
        self.aborted.append(why)
        self.stop()


def test_progress_of_a_long_step_shows_while_measuring() -> None:
    """Requests done of total, elapsed and ETA on the status line; between events the clock runs on."""
    core = SlowCore()
    app = make_app(core)
    now = [1000.0]

    async def script(pilot: Any) -> None:
        line = app.live.query_one(StatusLine)
        await until(pilot, lambda: "12/40" in line.text)
        app.live.state.clock = lambda: now[0]
        app.live.feed(Event("progress", {"state": "measuring", "step": "calibration: A/A noise floor", "done": 12,
                                         "total": 40, "elapsed_s": 62.0, "eta_s": 190.0}))
        await pilot.pause(0.05)
        assert line.text.strip() == "⏳ measuring: calibration: A/A noise floor 12/40 requests, 1m02s, ETA 3m10s"
        assert "measuring" in app.live.query_one(StatusHeader).text
        now[0] += 10
        await until(pilot, lambda: "1m12s" in line.text)
        assert line.text.strip().endswith("12/40 requests, 1m12s, ETA 3m00s")
        app.live.feed(Event("state", {"state": "proposing"}))
        await pilot.pause(0.05)
        assert "12/40" not in line.text  # the step is over once the next phase begins
        core.abort("test over")

    drive(app, script)


def test_quit_during_a_step_says_what_it_waits_for_then_stops_it() -> None:
    core = SlowCore()
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: app.live.state.progress is not None)
        await pilot.press("q")
        await until(pilot, lambda: app.return_code is not None)
        assert core.aborted == ["quit"] and core.finished.is_set()
        assert "quitting: stopping calibration: A/A noise floor" in " ".join(notifications(app) + [
            app.live.query_one(StatusLine).text])

    drive(app, script)
    assert app.return_code == 0


def test_sigint_stops_the_step_and_exits_130() -> None:
    import os
    import signal

    core = SlowCore()
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: app.live.state.progress is not None)
        os.kill(os.getpid(), signal.SIGINT)
        await until(pilot, lambda: app.return_code is not None)  # the app leaves by itself

    drive(app, script)
    assert core.aborted == ["interrupted (SIGINT)"]
    assert app.return_code == 130


def test_the_dashboard_exits_non_zero_after_a_failed_run() -> None:
    core = FakeCore(rounds=1, auto=True, fail_with="the judge's worker died")
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: app.live.state.loop_state == "failed")
        await pilot.press("q")
        await until(pilot, lambda: app.return_code is not None)

    drive(app, script)
    assert app.return_code == 1


def _two_waiting() -> list[Event]:
    events = [Event("run_started", {"run": 1, "deployment": {}, "agents": [], "auto": False}),
              Event("round_started", {"round": 1})]
    for cid in ("c1", "c2", "c3"):
        events += [Event("agent_started", {"cid": cid, "agent": "local", "direction": "verify"}),
                   Event("candidate", {"cid": cid, "agent": "local", "title": f"change {cid}", "diff": "-a\n+b\n"})]
        events += [Event("gate", {"cid": cid, "gate": g, "passed": True, "detail": "ok"}) for g in
                   ("applies", "smoke", "forcing", "tuning", "heldout")]
    return events + [Event("awaiting_decision", {"cid": cid}) for cid in ("c1", "c2", "c3")]


def test_after_a_reject_the_cursor_moves_to_the_next_waiting_candidate() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        for event in _two_waiting():
            app.live.feed(event)
        await pilot.pause(0.1)
        assert app.live.current_cid == "c1"
        app.live.feed(Event("decision", {"cid": "c1", "decision": "reject", "note": "no", "by": "user"}))
        await pilot.pause(0.1)
        assert app.live.current_cid == "c2"
        app.live.feed(Event("decision", {"cid": "c2", "decision": "approve", "note": "", "by": "user"}))
        await pilot.pause(0.1)
        assert app.live.current_cid == "c3"

    drive(app, script)


def test_a_proposal_waiting_for_the_judge_is_queued_with_its_title() -> None:
    state = DashboardState()
    state.apply_all([Event("agent_started", {"cid": "c1", "agent": "local", "direction": "verify"}),
                     Event("agent_done", {"cid": "c1", "agent": "local", "title": "linear backend fused"})])
    assert (state.candidates["c1"].state, state.candidates["c1"].title) == ("queued", "linear backend fused")


def test_first_focus_is_the_candidate_table_and_keys_1_to_4_pick_panels() -> None:
    core = FakeCore(rounds=1)
    app = make_app(core)

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: "c1" in core.awaiting)
        assert isinstance(app.focused, CandidateTable)
        await pilot.press("down")
        assert app.live.current_cid == "c2"  # arrows move the cursor at once, no Tab first
        tabs = app.live.query_one(TabbedContent)
        for key, pane in (("3", "tab-forcing"), ("2", "tab-gaps"), ("4", "tab-speedup"), ("1", "tab-candidates")):
            await pilot.press(key)
            assert tabs.active == pane
        assert isinstance(app.focused, CandidateTable)
        await pilot.press("q")

    drive(app, script)


def test_empty_panels_say_what_they_wait_for() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        note = app.live.query_one("#forcing-empty")
        assert note.display and "no forcing result yet" in str(note.render())
        assert "no proposals yet" in app.live.query_one("#diff", DiffView).placeholder
        app.live.load(record(1, until_awaiting=True))
        await pilot.pause(0.05)
        assert not app.live.query_one("#forcing-empty").display

    drive(app, script)


def test_screenshot_goes_to_the_working_directory_without_downloads(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    app = make_app()

    async def script(pilot: Any) -> None:
        app.action_screenshot()
        await pilot.pause(0.05)

    drive(app, script)
    saved = list(tmp_path.glob("*.svg"))
    assert len(saved) == 1 and any(str(saved[0]) in m for m in notifications(app))


def test_replay_counts_what_it_plays_and_says_when_there_is_no_next_round(tmp_path: Path) -> None:
    db = stored(tmp_path, record(2))
    app = make_app(argv=("--replay", "1", "--db", str(db)))

    async def script(pilot: Any) -> None:
        await until(pilot, lambda: isinstance(app.screen, ReplayScreen))
        screen = app.screen
        _, own = split_round(screen.events, 2)
        bar = screen.query_one("#replay-bar")
        assert f"· {len(own)} events ·" in str(bar.render())
        await pilot.press("4", "p")
        await until(pilot, lambda: not screen.playing)
        assert f"played {len(own)}/{len(own)}" in str(bar.render())
        await pilot.press("right_square_bracket")
        assert any("round 2 is the last round of run 1" in m for m in notifications(app))

    drive(app, script)


def test_notices_stay_on_the_status_line_and_only_problems_toast() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        for i in range(4):
            app.live.feed(Event("notice", {"message": f"notice {i}"}))
        app.live.feed(Event("candidate_failed", {"cid": "c1", "agent": "local", "reason": "no diff"}))
        await pilot.pause(0.1)
        assert not any(m.startswith("notice") for m in notifications(app))
        assert any("failed on c1" in m for m in notifications(app))
        app.live.feed(Event("notice", {"message": "notice 4"}))
        await pilot.pause(0.05)
        assert "notice 4" in app.live.query_one(StatusLine).text

    drive(app, script)
