"""The real thing under tmux at 80x24: `specpilot-tui` on the shipped demo deployment with local agents,
manual approval. Wait for a candidate that passed every gate, approve it with `a`, find the decision in
store.db, quit with `q` and exit status 0."""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from test_tui_tmux import TMUX, quit_status, tmux, tui_command, wait_for_pane

pytestmark = [pytest.mark.skipif(not Path(TMUX).exists(), reason="tmux is not installed"), pytest.mark.slow,
              pytest.mark.timeout(900)]


def test_real_loop_approve_under_tmux(tmp_path: Path) -> None:
    session = f"specpilot-e2e-{os.getpid()}"
    status = tmp_path / "status"
    db = tmp_path / "store.db"
    env = {"SPECPILOT_CONFIG_DIR": str(tmp_path / "config"), "TERM": "xterm-256color",
           "TOKENIZERS_PARALLELISM": "false"}
    args = ["--db", str(db), "--agents", "local:4", "--rounds", "3", "--max-requests", "4"]
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
        subprocess.run([TMUX, "kill-session", "-t", session], capture_output=True)


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
