"""SVG snapshots of the main and replay screens at 80x24 and 160x50 (tests/snapshots/).

The content is deterministic: scripted events with fixed times, no clocks on screen, notifications
cleared. Each snapshot is stored as SVG and as plain text (compared first, for a readable diff).
Regenerate after an intended change with SPECPILOT_UPDATE_SNAPSHOTS=1.
"""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
from fake_core import record, save_run
from rich.console import Console

from specpilot.app.app import SpecPilotApp, build_parser
from specpilot.app.screens.replay import ReplayScreen
from specpilot.core.store.db import Store

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("SPECPILOT_UPDATE_SNAPSHOTS") == "1"
SIZES = {"80x24": (80, 24), "160x50": (160, 50)}


@pytest.fixture(autouse=True)
def isolated_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECPILOT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("NO_COLOR", raising=False)


def screen_text(app: SpecPilotApp) -> str:
    """The screen as plain text, rendered the way export_screenshot renders it."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor", record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(styles=False)


def snapshot(app: SpecPilotApp, size: tuple[int, int], prepare: Callable[[Any], Awaitable[None]]) -> tuple[str, str]:
    """Run the app, let `prepare` bring it to the state to capture; return (text, svg)."""
    out: dict[str, str] = {}

    app.animation_level = "none"

    async def go() -> None:
        async with app.run_test(size=size) as pilot:
            await prepare(pilot)
            app.clear_notifications()
            await pilot.pause(0.3)
            await pilot.wait_for_scheduled_animations()
            out["text"] = screen_text(app)
            out["svg"] = app.export_screenshot(title="specpilot-tui")

    asyncio.run(go())
    return out["text"], out["svg"]


def check(name: str, text: str, svg: str, tmp_path: Path) -> None:
    """Compare with the stored snapshot (text first, then SVG), or store it when updating."""
    txt_path, svg_path = SNAPSHOTS / f"{name}.txt", SNAPSHOTS / f"{name}.svg"
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        txt_path.write_text(text)
        svg_path.write_text(svg)
        return
    assert svg_path.is_file(), f"no snapshot {svg_path}; run with SPECPILOT_UPDATE_SNAPSHOTS=1 to create it"
    (tmp_path / f"{name}.svg").write_text(svg)
    assert text == txt_path.read_text(), f"screen text differs from {txt_path}"
    assert svg == svg_path.read_text(), f"SVG differs from {svg_path}; actual: {tmp_path / (name + '.svg')}"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("theme", ["specpilot-dark", "specpilot-mono"])
def test_main_screen(size: str, theme: str, tmp_path: Path) -> None:
    if theme == "specpilot-mono" and size != "80x24":
        pytest.skip("one monochrome snapshot is enough")
    app = SpecPilotApp(build_parser().parse_args(["--theme", theme]))

    async def prepare(pilot: Any) -> None:
        app.live.load(record(1, until_awaiting=True))

    text, svg = snapshot(app, SIZES[size], prepare)
    assert "AWAITING APPROVAL" in text
    check(f"main_{size}" + ("_mono" if theme.endswith("mono") else ""), text, svg, tmp_path)


@pytest.mark.parametrize("size", SIZES)
def test_replay_screen(size: str, tmp_path: Path) -> None:
    store = Store(tmp_path / "store.db")
    save_run(store, record(2))
    store.close()
    app = SpecPilotApp(build_parser().parse_args(["--replay", "1", "--db", str(tmp_path / "store.db")]))

    async def prepare(pilot: Any) -> None:
        for _ in range(200):
            if isinstance(app.screen, ReplayScreen):
                break
            await pilot.pause(0.02)
        assert isinstance(app.screen, ReplayScreen)

    text, svg = snapshot(app, SIZES[size], prepare)
    assert "REPLAY · run 1 · round 2" in text
    check(f"replay_{size}", text, svg, tmp_path)


def _every_state() -> list[Any]:
    """Events that leave one candidate in each state the table can show, row by row."""
    from specpilot.core.events import GATES, Event

    def started(cid: str) -> list[Event]:
        return [Event("agent_started", {"cid": cid, "agent": "local", "direction": "verify"})]

    def proposed(cid: str) -> list[Event]:
        return started(cid) + [Event("candidate", {"cid": cid, "agent": "local", "title": f"change {cid}"})]

    def gates(cid: str, upto: int, fail: bool = False) -> list[Event]:
        return [Event("gate", {"cid": cid, "gate": g, "passed": not (fail and i == upto - 1), "detail": ""})
                for i, g in enumerate(GATES[:upto])]

    events = [Event("run_started", {"run": 1, "deployment": {}, "agents": [], "auto": False}),
              Event("round_started", {"round": 1})]
    events += started("c1")
    events += started("c2") + [Event("agent_done", {"cid": "c2", "agent": "local", "title": "queued one"})]
    events += proposed("c3")
    events += proposed("c4") + gates("c4", 1)
    events += proposed("c5") + gates("c5", 5)
    events += proposed("c6") + gates("c6", 3, fail=True)
    events += started("c7") + [Event("candidate_failed", {"cid": "c7", "agent": "local", "reason": "no diff"})]
    events += proposed("c8") + gates("c8", 5) + [Event("awaiting_decision", {"cid": "c8"})]
    for cid, decision in (("c9", "approve"), ("c10", "reject")):
        events += proposed(cid) + gates(cid, 5) + [Event("decision", {"cid": cid, "decision": decision,
                                                                       "note": "", "by": "user"})]
    return events


def contrast(a: Any, b: Any) -> float:
    """WCAG contrast ratio of two rich colours."""
    def luminance(color: Any) -> float:
        channels = [c / 255 for c in color.get_truecolor()]
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("theme", ["specpilot-dark", "specpilot-light", "specpilot-mono"])
def test_every_state_cell_reads_on_the_highlighted_row(theme: str) -> None:
    """The state cell is what a user checks before pressing `a`: on the highlighted row as on the others,
    in every theme, its text and background differ by at least WCAG AA (4.5:1)."""
    from specpilot.app.widgets.candidates import CandidateTable, state_label

    app = SpecPilotApp(build_parser().parse_args(["--theme", theme]))
    seen: dict[str, list[float]] = {}

    async def go() -> None:
        async with app.run_test(size=SIZES["160x50"]) as pilot:
            app.live.load(_every_state())
            await pilot.pause(0.1)
            table = app.live.query_one(CandidateTable)
            states = {cid: c.state for cid, c in app.live.state.candidates.items()}
            assert len(set(states.values())) == 10, states
            for index, (cid, state) in enumerate(states.items()):
                for cursor in (index, (index + 1) % len(states)):  # highlighted, then not
                    table.move_cursor(row=cursor)
                    await pilot.pause(0.02)
                    line = table.render_line(index + 1)  # the header is line 0
                    label = state_label(state)
                    cell = [seg for seg in line if seg.text.strip() and seg.text.strip() in label]
                    assert cell, f"{label!r} not rendered in {''.join(s.text for s in line)!r}"
                    style = cell[0].style
                    assert style.color is not None and style.bgcolor is not None, (state, style)
                    seen.setdefault(state, []).append(contrast(style.color, style.bgcolor))

    asyncio.run(go())
    low = {state: min(ratios) for state, ratios in seen.items() if min(ratios) < 4.5}
    assert not low, f"state cells below 4.5:1 in {theme}: {low}"
