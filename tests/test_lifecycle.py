"""Runs that end are closed: every run ends in a recorded status, a run whose process died reads (and is
marked) interrupted, only finished rounds count, `--resume` continues it, SIGINT shuts down cleanly with its
workers reaped, a run refused before it starts leaves nothing behind, and read-only commands never write.
Also: long steps report progress, and rejections steer later proposals. Real subprocesses, a real store."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mini_deployment
from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.cli import main
from specpilot.core.loop import Loop, LoopConfig, Pending, is_rejection
from specpilot.core.recipe import builtin
from specpilot.core.store import Store
from specpilot.core.store.db import process_gone

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

ROOT = Path(__file__).resolve().parent.parent
NOTE = "fused backend not allowed in prod"


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    return mini_deployment.build(tmp_path_factory.mktemp("life"), requests=3, max_new_tokens=8)


def run_argv(mini: dict, db: Path, *extra: str, rounds: int = 3) -> list[str]:
    return ["run", "--target", mini["target"], "--drafter", mini["drafter"], "--workload", mini["workload"],
            "--rounds", str(rounds), "--agents", "local:1", "--db", str(db), "--max-requests", "3",
            "--max-new-tokens", "8", *extra]


def cli(*argv: str, cwd: Path) -> subprocess.Popen:
    """This checkout's `specpilot` in a subprocess of its own session (so a signal reaches it alone)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "specpilot.core.cli", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def raw(db: Path, sql: str, *params: object) -> list[tuple]:
    """Read the file behind the Store's back (read-only), to see what was actually written."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def wait_for(db: Path, sql: str, proc: subprocess.Popen, what: str, limit: float = 240) -> None:
    deadline = time.monotonic() + limit
    while True:
        try:
            if db.exists() and raw(db, sql)[0][0]:
                return
        except sqlite3.Error:
            pass
        assert proc.poll() is None, f"exited before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.1)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_sigint_closes_the_run_as_interrupted_reaps_workers_and_resume_finishes_it(mini, tmp_path):
    db = tmp_path / "store.db"
    proc = cli(*run_argv(mini, db, "--auto", "--headless", rounds=2), cwd=tmp_path)
    try:
        wait_for(db, "SELECT count(*) FROM event WHERE kind = 'round_started' AND round = 2", proc, "round 2")
        workers = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "terminate called" not in err
    assert workers, "no judge worker was running when SIGINT arrived"
    assert all(process_gone({"pid": w, "host": os.uname().nodename}) for w in workers), "a worker outlived the run"
    run = Store(db, read_only=True).list_runs()[0]
    assert run["status"] == "interrupted" and "SIGINT" in run["summary"]["reason"]
    assert run["rounds"] == 1  # the half-done round 2 does not count
    kinds = [k for (k,) in raw(db, "SELECT kind FROM event WHERE run_id = ? ORDER BY seq", run["id"])]
    assert kinds[-2:] == ["run_finished", "state"]

    # progress: the long steps said what they were doing and how far they had got
    steps = [json.loads(p) for (p,) in raw(db, "SELECT payload FROM event WHERE kind = 'progress'")]
    calibration = [p for p in steps if p["step"].startswith("calibration: A/A noise floor")]
    # the 3 tuning requests, repeated until the A/A comparison has the judge's 12 pairs
    assert calibration and calibration[-1]["done"] == calibration[-1]["total"] == 12
    assert any(p["step"].startswith("gap analysis: cost model") for p in steps)
    assert "calibration: A/A noise floor" in err  # headless output shows them too

    first = raw(db, "SELECT incumbent FROM round WHERE run_id = ? AND \"index\" = 1", run["id"])[0][0]
    done = cli("run", "--resume", str(run["id"]), "--headless", "--db", str(db), cwd=tmp_path)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-3000:]
    assert f"resuming run {run['id']} after round 1 of 2" in err
    resumed = Store(db, read_only=True).run(run["id"])
    assert resumed["status"] == "finished" and resumed["rounds"] == 2
    rounds = raw(db, "SELECT \"index\", finished_at IS NOT NULL FROM round WHERE run_id = ? ORDER BY \"index\"",
                 run["id"])
    assert rounds == [(1, 1), (2, 1)]
    assert raw(db, "SELECT incumbent FROM round WHERE run_id = ? AND \"index\" = 1", run["id"])[0][0] == first


def test_a_killed_run_reads_interrupted_and_the_next_writer_marks_it(tmp_path):
    db = tmp_path / "store.db"
    script = ("import sys; from specpilot.core.store import Store; s = Store(sys.argv[1]); r = s.create_run({}, {}); "
              "done = s.start_round(r, 1, {}); s.finish_round(done, {'heldout_speedup_vs_ar': 1.5}); "
              "s.start_round(r, 2, {})")
    subprocess.run([sys.executable, "-c", script, str(db)], check=True, cwd=ROOT)
    assert raw(db, "SELECT status FROM run") == [("running",)]
    seen = Store(db, read_only=True).list_runs()[0]
    assert (seen["status"], seen["rounds"]) == ("interrupted", 1)
    assert raw(db, "SELECT status FROM run") == [("running",)]  # a reader changes nothing
    Store(db)  # the next writer closes it
    status, summary = raw(db, "SELECT status, summary FROM run")[0]
    assert status == "interrupted" and "ended without closing the run" in json.loads(summary)["reason"]


def test_a_quit_that_leaves_before_its_step_ends_is_stored_as_stopped(tmp_path):
    """`q` twice leaves at once, with the loop still in its step: the run is recorded as stopped there and
    then (a later close by the loop thread changes nothing), never left to read as interrupted."""
    loop = Loop(LoopConfig(db=str(tmp_path / "store.db")))
    loop.run_id, loop.round = loop.store.create_run({}, {}), 2
    loop.abort("quit")
    loop.close_abandoned()
    status, summary = raw(tmp_path / "store.db", "SELECT status, summary FROM run")[0]
    assert status == "stopped" and "left before it ended" in json.loads(summary)["reason"]
    assert "round 2" in json.loads(summary)["reason"]
    signalled = Loop(LoopConfig(db=str(tmp_path / "other.db")))
    signalled.run_id = signalled.store.create_run({}, {})
    signalled.abort("interrupted (SIGTERM)")
    signalled.close_abandoned()
    assert raw(tmp_path / "other.db", "SELECT status FROM run") == [("interrupted",)]
    signalled.store.finish_run(signalled.run_id, "finished", {})
    signalled.close_abandoned()  # already closed by this loop: left as it is
    assert raw(tmp_path / "other.db", "SELECT status FROM run") == [("finished",)]


def test_a_live_run_stays_running(tmp_path):
    store = Store(tmp_path / "store.db")
    run = store.create_run({}, {})
    assert Store(tmp_path / "store.db").run(run)["status"] == "running"


def test_resume_discards_the_half_done_round_and_refuses_a_finished_run(tmp_path):
    store = Store(tmp_path / "store.db")
    run = store.create_run({}, {})
    store.finish_round(store.start_round(run, 1, {}), {"heldout_speedup_vs_ar": 1.2})
    half = store.start_round(run, 2, {})
    store.add_candidate(half, "1-r2-c1", "local", "t", "", "recipe", "", "", None)
    store.set_gate("1-r2-c1", "applies", True, "ok")
    store.finish_run(run, "interrupted", {"reason": "test"})
    store.reopen_run(run)
    assert [r["index"] for r in store.list_rounds(run)] == [1]
    assert store.candidate("1-r2-c1") is None
    assert store.run(run)["status"] == "running"
    store.finish_run(run, "finished", {})
    with pytest.raises(Exception, match="only a stopped or interrupted run can be resumed"):
        store.reopen_run(run)


def test_read_only_commands_write_nothing(tmp_path, capsys):
    db = tmp_path / "store.db"
    store = Store(db)
    run = store.create_run({"target": "t"}, {})
    store.finish_run(run, "finished", {})
    store.close()
    before = db.read_bytes()
    assert main(["runs", "--db", str(db)]) == 0
    assert main(["show", str(run), "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "finished" in out and time.strftime("%Y-%m-%d") in out  # a readable start time, not an epoch
    assert db.read_bytes() == before
    with pytest.raises(Exception):
        Store(db, read_only=True).create_run({}, {})


def test_runs_and_show_work_on_a_read_only_filesystem(tmp_path):
    """The store's folder bind-mounted read-only in a user namespace: nothing can be created next to it."""
    folder = tmp_path / "ro"
    folder.mkdir()
    store = Store(folder / "store.db")
    store.finish_run(store.create_run({"target": "t"}, {}), "finished", {})
    store.close()
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no user namespaces here to mount a read-only filesystem")
    python = f"{sys.executable} -m specpilot.core.cli"
    script = (f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && "
              f"! touch {folder}/probe 2>/dev/null && {python} runs --db {folder}/store.db && "
              f"{python} show 1 --db {folder}/store.db")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "finished" in proc.stdout and "run 1 (finished)" in proc.stdout and proc.stderr == ""


def test_a_run_refused_before_it_starts_leaves_no_run(mini, tmp_path, capsys):
    db = tmp_path / "store.db"
    argv = run_argv(mini, db, "--auto", "--headless")
    argv[argv.index("--target") + 1] = str(tmp_path / "missing")
    assert main(argv) == 2
    assert "specpilot: error:" in capsys.readouterr().err
    assert not db.exists() or Store(db).list_runs() == []


def test_claude_agents_without_a_key_are_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    proc = subprocess.run([sys.executable, "-m", "specpilot.core.cli", "run", "--agents", "claude:2", "--auto", "--headless",
                           "--db", str(tmp_path / "s.db")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "specpilot: error: Claude agents need ANTHROPIC_API_KEY; set it or use --agents local:N"]


def _fused(agent: str = "local", differs: str = "") -> Candidate:
    stock = builtin("stock")
    recipe = stock.replace(runtime={"linear": "fused"})
    return Candidate(agent, "linear backend fused", "faster", "recipe", "", recipe, differs=differs)


def test_a_rejection_is_remembered_and_a_repeat_is_not_judged(tmp_path):
    loop = Loop(LoopConfig(db=str(tmp_path / "store.db")))
    loop.run_id, loop.round = loop.store.create_run({}, {}), 1
    stock = builtin("stock")
    rejected = _fused()
    loop._remember_rejections([Pending("1-r1-c1", rejected.recipe, True, None, candidate=rejected, decision="reject",
                                       recorded=True, note=NOTE)], stock)
    (entry,) = loop.store.memory()
    assert is_rejection(entry) and entry["evidence"]["note"] == NOTE
    assert entry["fragment"] == {"runtime": {"linear": "fused"}}
    again = loop._unless_rejected(_fused(), stock)
    assert isinstance(again, AgentFailure) and NOTE in again.reason
    said = _fused(differs="only for the drafter, which runs on another socket")
    assert loop._unless_rejected(said, stock) is said
    other = Candidate("local", "depth 6", "", "recipe", "", stock.replace(tree={"depth": 6}))
    assert loop._unless_rejected(other, stock) is other


def test_every_agent_kind_sees_the_note(tmp_path):
    from specpilot.core.agents.claude import build_system_prefix
    from specpilot.core.agents.local import LocalAgent, Option

    stock = builtin("stock")
    entry = {"mechanism": "linear backend fused", "fragment": {"runtime": {"linear": "fused"}},
             "evidence": {"decision": "reject", "note": NOTE, "round": 1}}
    ctx = AgentContext({}, stock, {}, [], "verify", tmp_path, {}, rejected=[entry])
    assert f'"{NOTE}"' in build_system_prefix(ctx, {"recipe.toml": stock.to_toml()})
    chunks: list[str] = []
    agent = LocalAgent("runtime")
    base = Option("stock", stock, 2.0, 100.0)
    options = [Option("fused", stock.replace(runtime={"linear": "fused"}), 2.0, 200.0),
               Option("skinny", stock.replace(runtime={"linear": "skinny"}), 2.0, 150.0)]
    from specpilot.core.agents.local import Stream

    out = agent.finish(ctx, base, options, "backend", Stream(chunks.append), "{best.label}")
    assert isinstance(out, Candidate) and out.title == "skinny"
    assert NOTE in "".join(chunks)


def test_show_marks_a_half_done_round_as_not_counted(tmp_path, capsys):
    store = Store(tmp_path / "store.db")
    run = store.create_run({}, {})
    store.finish_round(store.start_round(run, 1, {}), {"heldout_speedup_vs_ar": 1.2})
    store.start_round(run, 2, {})
    store.finish_run(run, "interrupted", {"reason": "test"})
    assert main(["show", str(run), "--db", str(tmp_path / "store.db")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"run {run} (interrupted: test)"
    assert lines[1].startswith("round 1: ") and lines[-1].startswith("round 2 [unfinished: not counted]: ")


def test_a_claude_reply_can_say_what_differs_from_a_rejection(tmp_path):
    from specpilot.core.agents.claude import ClaudeAgent

    stock = builtin("stock")
    reply = ("TITLE: fused again\nRATIONALE: x\nPREDICTED_SPEEDUP: 1.2\nDIFFERS: only on the drafter this time\n\n"
             'FILE: recipe.toml\n```\n<<<<<<< SEARCH\nlinear = "native"\n=======\nlinear = "fused"\n'
             ">>>>>>> REPLACE\n```\n")
    out = ClaudeAgent(client_factory=lambda: None)._candidate(reply, {"recipe.toml": stock.to_toml()})
    assert isinstance(out, Candidate) and out.differs == "only on the drafter this time"
