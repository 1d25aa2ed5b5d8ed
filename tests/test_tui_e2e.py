"""The real thing under tmux at 80x24: `specpilot-tui` on the shipped demo deployment with local agents,
manual approval. Wait for a candidate that passed every gate, approve it with `a`, find the decision in
store.db, quit with `q` and exit status 0."""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_tui_tmux import TMUX, kill_session, quit_status, tmux, tui_command, wait_for_pane

pytestmark = [pytest.mark.skipif(not Path(TMUX).exists(), reason="tmux is not installed"), pytest.mark.slow,
              pytest.mark.timeout(900)]


def test_real_loop_approve_under_tmux(tmp_path: Path) -> None:
    session = f"specpilot-e2e-{os.getpid()}"
    status = tmp_path / "status"
    db = tmp_path / "store.db"
    env = {"SPECPILOT_CONFIG_DIR": str(tmp_path / "config"), "TERM": "xterm-256color",
           "TOKENIZERS_PARALLELISM": "false"}
    # the two agents whose round-1 candidates the demo deployment approves: either one passing is enough here
    args = ["--db", str(db), "--agents", "local:2", "--local-agents", "drafter-format,runtime", "--rounds", "3",
            "--max-requests", "4"]
    command = (f"cd {shlex.quote(str(tmp_path))} && env {' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())} "
               f"{shlex.join(tui_command() + args)}; echo $? > {shlex.quote(str(status))}")
    tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", command)
    try:
        wait_for_pane(session, "AWAITING APPROVAL", timeout=780)
        cid = _awaiting(db)
        assert cid is not None
        tmux("send-keys", "-t", session, "a")
        deadline = time.monotonic() + 30
        while _decision(db, cid) is None:
            if time.monotonic() > deadline:
                screen = tmux("capture-pane", "-p", "-t", session)
                pytest.fail(f"approval of {cid} did not reach store.db; screen:\n{screen}")
            time.sleep(0.5)
        assert _decision(db, cid) == ("approve", "user")
        assert quit_status(session, status, timeout=60) == "0"
    finally:
        kill_session(session)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    import mini_deployment

    return mini_deployment.build(tmp_path_factory.mktemp("e2e-mini"), requests=3, max_new_tokens=8)


def _launch(session: str, tmp_path: Path, status: Path, args: list[str]) -> None:
    env = {"SPECPILOT_CONFIG_DIR": str(tmp_path / "config"), "TERM": "xterm-256color",
           "TOKENIZERS_PARALLELISM": "false"}
    command = (f"cd {shlex.quote(str(tmp_path))} && env {' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())} "
               f"{shlex.join(tui_command() + args)}; echo $? > {shlex.quote(str(status))}; sleep 600")
    tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", command)


def _app_pid(session: str) -> int:
    """The dashboard's process: the child of the pane's shell."""
    shell = int(tmux("display-message", "-p", "-t", session, "#{pane_pid}").strip())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == shell:
                return int(stat.parent.name)
        time.sleep(0.1)
    raise AssertionError("the dashboard's process never started")


def _wait_rows(db: Path, sql: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if db.exists() and _rows(db, sql)[0][0]:
                return
        except sqlite3.Error:
            pass
        assert time.monotonic() < deadline, f"never true: {sql}"
        time.sleep(0.2)


def _wait_status(status: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not status.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return status.read_text().strip() if status.exists() else ""


def _runs(db: Path) -> str:
    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "specpilot.core.cli", "runs", "--db", str(db)], cwd=root, capture_output=True,
                          text=True, timeout=60).stdout


def test_a_killed_run_is_interrupted_and_resumes_under_tmux(mini, tmp_path: Path) -> None:
    """kill -9 mid-round: `specpilot runs` says interrupted with one finished round; `--resume` in the
    dashboard finishes the run; SIGINT to a dashboard exits 130 and closes its run as interrupted; a
    hang-up (the terminal closed) ends the dashboard and closes its run too."""
    db = tmp_path / "store.db"
    deployment = ["--target", mini["target"], "--drafter", mini["drafter"], "--workload", mini["workload"],
                  "--max-requests", "3", "--max-new-tokens", "8", "--agents", "local:1", "--db", str(db)]
    first, status = f"specpilot-kill-{os.getpid()}", tmp_path / "status-kill"
    _launch(first, tmp_path, status, deployment + ["--rounds", "2", "--auto"])
    try:
        _wait_rows(db, "select count(*) from event where kind = 'round_started' and round = 2")
        os.kill(_app_pid(first), signal.SIGKILL)
        assert _wait_status(status, 30) == str(128 + signal.SIGKILL)
    finally:
        kill_session(first)
    listing = _runs(db)
    row = next(line.split() for line in listing.splitlines() if line.split()[:1] == ["1"])
    assert row[1:3] == ["interrupted", "1"], listing

    second, status = f"specpilot-resume-{os.getpid()}", tmp_path / "status-resume"
    _launch(second, tmp_path, status, ["--db", str(db), "--resume", "1", "--auto"])
    try:
        wait_for_pane(second, "run 1 finished", timeout=300)
        assert quit_status(second, status, timeout=30) == "0"
    finally:
        kill_session(second)
    row = next(line.split() for line in _runs(db).splitlines() if line.split()[:1] == ["1"])
    assert row[1:3] == ["finished", "2"]

    third, status = f"specpilot-sigint-{os.getpid()}", tmp_path / "status-sigint"
    _launch(third, tmp_path, status, deployment + ["--rounds", "3", "--auto"])
    try:
        _wait_rows(db, "select count(*) from event where run_id = 2 and kind = 'round_started' and round = 1")
        os.kill(_app_pid(third), signal.SIGINT)
        assert _wait_status(status, 60) == "130"
        screen = tmux("capture-pane", "-p", "-t", third)
        assert "terminate called" not in screen and "Traceback" not in screen, screen
    finally:
        kill_session(third)
    row = next(line.split() for line in _runs(db).splitlines() if line.split()[:1] == ["2"])
    assert row[1] == "interrupted"

    fourth = f"specpilot-hangup-{os.getpid()}"
    _launch(fourth, tmp_path, tmp_path / "status-hangup", deployment + ["--rounds", "3", "--auto"])
    try:
        _wait_rows(db, "select count(*) from event where run_id = 3 and kind = 'round_started' and round = 1")
        app = _app_pid(fourth)
    finally:
        kill_session(fourth)  # the terminal goes away: SIGHUP
    deadline = time.monotonic() + 60
    while Path(f"/proc/{app}").exists() and (Path(f"/proc/{app}/stat").read_text().split()[2] != "Z"):
        assert time.monotonic() < deadline, "the dashboard outlived its terminal"
        time.sleep(0.2)
    summary = json.loads(_rows(db, "select status, summary from run where id = 3")[0][1])
    assert _rows(db, "select status from run where id = 3")[0][0] == "interrupted" and "SIGHUP" in summary["reason"]


def _rows(db: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _awaiting(db: Path) -> str | None:
    rows = _rows(db, "select payload from event where kind = 'awaiting_decision' order by seq")
    return json.loads(rows[0][0])["cid"] if rows else None


def _decision(db: Path, cid: str) -> tuple[str, str] | None:
    for (payload,) in _rows(db, "select payload from event where kind = 'decision' order by seq"):
        p = json.loads(payload)
        if p["cid"] == cid:
            return p["decision"], p["by"]
    return None
