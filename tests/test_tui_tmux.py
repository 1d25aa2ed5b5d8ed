"""End to end under tmux at 80x24: the installed specpilot-tui, driven by keys, read by capture-pane.

The app runs the scripted fake core, named by SPECPILOT_LOOP_FACTORY=fake_core:from_env with tests/ on
PYTHONPATH (app/bridge.py); the package itself ships no test double.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

TMUX = shutil.which("tmux") or "/usr/bin/tmux"
ROOT = Path(__file__).resolve().parent.parent
SOCKET = f"specpilot-test-{os.getpid()}"  # a private tmux server: other tmux sessions are never touched

pytestmark = pytest.mark.skipif(not Path(TMUX).exists(), reason="tmux is not installed")


def tui_command() -> list[str]:
    """This checkout's dashboard (an installed entry point may belong to another checkout), with tests/ importable
    for the scripted core."""
    return ["env", f"PYTHONPATH={ROOT}{os.pathsep}{ROOT / 'tests'}", sys.executable, "-m", "specpilot.app.app"]


def tmux(*args: str) -> str:
    return subprocess.run([TMUX, "-L", SOCKET, *args], check=True, capture_output=True, text=True).stdout


def kill_session(session: str) -> None:
    subprocess.run([TMUX, "-L", SOCKET, "kill-session", "-t", session], capture_output=True)


def wait_for_pane(session: str, *needles: str, timeout: float = 30.0) -> str:
    """Poll capture-pane until every needle is on screen; return the screen."""
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = tmux("capture-pane", "-p", "-t", session)
        if all(n in screen for n in needles):
            return screen
        time.sleep(0.2)
    raise AssertionError(f"{needles} not on screen after {timeout}s:\n{screen}")


def quit_status(session: str, status: Path, timeout: float) -> str:
    """Press `q` and return the exit status the pane's shell wrote to `status` ("" if none in time)."""
    tmux("send-keys", "-t", session, "q")
    deadline = time.monotonic() + timeout
    while not status.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return status.read_text().strip() if status.exists() else ""


def wait_for_gone(session: str, needle: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while needle in tmux("capture-pane", "-p", "-t", session):
        assert time.monotonic() < deadline, f"{needle!r} still on screen after {timeout}s"
        time.sleep(0.2)


def test_live_dashboard_under_tmux(tmp_path: Path) -> None:
    session = f"specpilot-tui-test-{os.getpid()}"
    status = tmp_path / "status"
    env = {"SPECPILOT_LOOP_FACTORY": "fake_core:from_env", "SPECPILOT_CONFIG_DIR": str(tmp_path / "config"),
           "TERM": "xterm-256color"}
    command = (f"cd {shlex.quote(str(ROOT))} && env {' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())} "
               f"{shlex.join(tui_command() + ['--db', str(tmp_path / 'store.db')])}; echo $? > {shlex.quote(str(status))}")
    tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", command)
    try:
        screen = wait_for_pane(session, "AWAITING APPROVAL", "Wider dynamic tree")
        assert "awaiting" in screen, screen
        tmux("send-keys", "-t", session, "a")
        wait_for_pane(session, "round 2", "best 2.14x", "AWAITING APPROVAL")
        tmux("send-keys", "-t", session, "?")
        wait_for_pane(session, "SpecPilot — keys")
        tmux("send-keys", "-t", session, "Escape")
        wait_for_gone(session, "SpecPilot — keys")
        assert quit_status(session, status, timeout=20) == "0"
    finally:
        kill_session(session)
