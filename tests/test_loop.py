"""The search loop end to end, offline, on the mini deployment: `specpilot run --json` through the CLI, the
stored event log, memory carried into a second run, and durability (SIGKILL mid-run, corrupt or foreign
store files)."""

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
from specpilot.core.cli import main
from specpilot.core.events import GATES
from specpilot.core.recipe import Recipe
from specpilot.core.store import Store

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

ROOT = Path(__file__).resolve().parent.parent
CANDIDATE_KEYS = {"agent", "title", "gates", "verdict", "reason", "heldout_speedup", "interval"}
INCUMBENT_KEYS = {"recipe", "heldout_speedup_vs_ar", "heldout_speedup_vs_stock", "interval"}


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    return mini_deployment.build(root, requests=3, max_new_tokens=8)


def run_argv(mini: dict, db: Path, *extra: str, rounds: int = 1, agents: str = "local:3") -> list[str]:
    return ["run", "--target", mini["target"], "--drafter", mini["drafter"], "--workload", mini["workload"],
            "--rounds", str(rounds), "--agents", agents, "--db", str(db), "--max-requests", "3",
            "--max-new-tokens", "8", *extra]


def cli(*argv: str, cwd: Path) -> subprocess.Popen:
    """This checkout's `specpilot` (an installed console script may belong to another checkout)."""
    return subprocess.Popen([sys.executable, "-m", "specpilot.core.cli", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def first_run(mini, tmp_path_factory):
    """`specpilot run --auto --headless --json`, one round with three local agents, in a subprocess."""
    work = tmp_path_factory.mktemp("first")
    db = work / "store.db"
    proc = cli(*run_argv(mini, db, "--auto", "--headless", "--json"), cwd=work)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return db, json.loads(out), err, work


def test_cli_prints_the_json_summary(first_run):
    db, summary, _, work = first_run
    assert isinstance(summary["run"], int)
    assert [r["index"] for r in summary["rounds"]] == [1]
    rnd = summary["rounds"][0]
    assert {"index", "largest_gap", "candidates", "incumbent"} <= set(rnd)
    assert rnd["largest_gap"] in {"acceptance", "drafting", "verify", "host", "prompt", "batching"}
    assert rnd["candidates"], "three local agents proposed nothing to judge"
    for c in rnd["candidates"]:
        assert CANDIDATE_KEYS <= set(c)
        assert c["verdict"] in ("win", "fail")
        assert list(c["gates"]) == list(GATES[: len(c["gates"])])
    assert INCUMBENT_KEYS <= set(rnd["incumbent"])
    assert len(rnd["incumbent"]["interval"]) == 2
    store = Store(db)
    assert store.run(summary["run"])["summary"] == summary  # the printed summary is the stored one
    assert (work / ".specpilot" / Path(db).stem / f"run-{summary['run']}").is_dir()  # next to the store, its own


def test_show_prints_each_round(first_run, capsys):
    db, summary, _, _ = first_run
    assert main(["show", str(summary["run"]), "--db", str(db)]) == 0
    out = capsys.readouterr().out.splitlines()
    rnd = summary["rounds"][0]
    assert out[0] == f"run {summary['run']} (finished)"
    assert out[1].startswith(f"round 1: largest gap {rnd['largest_gap']} (ms/token: acceptance ")
    for c in rnd["candidates"]:
        line = next(x for x in out if c["title"][:50] in x)
        assert f" {c['agent']} " in line and ("heldout:ok" in line) == (c["verdict"] == "win")


def test_every_event_is_stored_in_order(first_run):
    db, summary, _, _ = first_run
    events = Store(db).events(summary["run"])
    kinds = [e.kind for e in events]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert kinds[0] == "run_started" and kinds[-2:] == ["run_finished", "state"]
    assert events[-1].payload == {"state": "done"}
    order = [kinds.index(k) for k in ("round_started", "gaps", "agent_started", "candidate", "gate",
                                      "incumbent", "round_finished", "run_finished")]
    assert order == sorted(order)
    assert events[-2].payload["summary"] == summary
    for cid in {e.payload["cid"] for e in events if e.kind == "candidate"}:
        gates = [e.payload["gate"] for e in events if e.kind == "gate" and e.payload["cid"] == cid]
        assert gates == list(GATES[: len(gates)])
        assert any(e.kind == "agent_chunk" and e.payload["cid"] == cid for e in events)


def _round_finished(db: Path, run: int) -> bool:
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            return conn.execute("SELECT count(*) FROM event WHERE kind = 'round_finished' AND run_id = ?",
                                (run,)).fetchone()[0] > 0
        finally:
            conn.close()
    except sqlite3.Error:
        return False


def _remember_a_chain_change(db: Path, summary: dict) -> None:
    """Whether the first run's candidate wins held-out depends on timing on the demo pair, so when none did
    the store is given the entry a win writes (one chain depth off the first run's incumbent): what this test
    checks is that a second run starts from memory, not that the first one won."""
    incumbent = Recipe.from_toml(summary["rounds"][0]["incumbent"]["recipe"])
    depth = incumbent.tree.depth + (1 if incumbent.tree.depth < 6 else -1)
    Store(db).add_memory({"mechanism": f"chain of {depth}", "fingerprint": "first-run", "effect": 1.05,
                          "description": "seeded by the test", "fragment": {"tree": {"depth": depth}},
                          "evidence": {"run": summary["run"], "round": 1}})


def test_second_run_starts_from_memory_and_survives_sigkill(first_run, mini):
    """A second run on the same deployment and store starts from the first run's validated mechanism; it is
    killed with SIGKILL as soon as its first round is stored, and that round survives whole."""
    db, summary, _, work = first_run
    if not Store(db).memory():
        _remember_a_chain_change(db, summary)
    run = summary["run"] + 1
    proc = cli(*run_argv(mini, db, "--auto", "--headless", rounds=3, agents="local:1"), cwd=work)
    try:
        deadline = time.monotonic() + 240
        while not _round_finished(db, run):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "round 1 of the second run never finished"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    store = Store(db)
    # durability: the finished round is there, whole, with its incumbent
    rounds = store.list_rounds(run)
    assert rounds[0]["index"] == 1 and rounds[0]["finished_at"] is not None
    assert {"recipe", "heldout_speedup_vs_ar", "heldout_speedup_vs_stock", "interval"} <= set(rounds[0]["incumbent"])
    events = store.events(run, upto_round=1)
    assert [e.kind for e in events][-2:] == ["incumbent", "round_finished"]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert store.list_rounds(summary["run"])[0]["incumbent"]["recipe"] == summary["rounds"][0]["incumbent"]["recipe"]
    # memory: announced at the start, and the first round's first agent starts from it
    assert events[0].kind == "run_started" and events[0].payload["memory"] >= 1
    assert any(e.kind == "notice" and "memory" in e.payload["message"] for e in events)
    memory_cids = {e.payload["cid"] for e in events if e.kind == "agent_started" and e.payload["agent"] == "memory"}
    assert memory_cids, "round 1 of the second run had no memory agent"
    chunks = "".join(e.payload["text"] for e in events if e.kind == "agent_chunk" and e.payload["cid"] in memory_cids)
    assert "from memory" in chunks
    titles = [e.payload["title"] for e in events if e.kind == "candidate" and e.payload["cid"] in memory_cids]
    assert titles and titles[0].startswith("From memory")


def test_bad_store_files_give_one_line_and_stay_unchanged(mini, tmp_path, capsys):
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"this is not a database\x00" * 50)
    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE people (name TEXT)")
    conn.execute("INSERT INTO people VALUES ('ada')")
    conn.commit()
    conn.close()
    for path in (corrupt, foreign):
        before = path.read_bytes()
        assert main(run_argv(mini, path, "--auto", "--headless")) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("specpilot: error:") and str(path) in lines[0], err
        assert "Traceback" not in err and out == ""
        assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.db", "foreign.db"]


@pytest.mark.parametrize("path", ["../../x.py", "core/judge.py", "/etc/passwd", "plugins/../x.py",
                                  "plugins/sub/x.py", "plugins/x.txt", "recipe.toml", "plugins\\x.py"])
def test_candidate_files_outside_the_allow_list_are_refused(path):
    from specpilot.core.diffs import DiffError
    from specpilot.core.loop import checked_files

    with pytest.raises(DiffError, match="outside the allow-list"):
        checked_files({"plugins/ok.py": "x = 1\n", path: "x = 2\n"})


def test_candidate_plugin_files_are_normalised():
    from specpilot.core.loop import checked_files

    assert checked_files({"./plugins/foo.py": "x = 1\n"}) == {"plugins/foo.py": "x = 1\n"}


def test_time_budget_stops_the_run_and_says_so(mini, tmp_path):
    """A budget spent during round 1 (0.0001 min) starts no round 2: the run is stored as stopped, with why."""
    db = tmp_path / "store.db"
    proc = cli(*run_argv(mini, db, "--auto", "--headless", "--json", "--time-budget", "0.0001", rounds=2,
                         agents="local:1"), cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert len(summary["rounds"]) == 1
    assert summary["stopped_by"].startswith("time budget of 0.0 min spent after round 1")
    run = Store(db).list_runs()[0]
    assert run["status"] == "stopped" and run["summary"]["stopped_by"] == summary["stopped_by"]


def test_stores_in_one_folder_keep_their_workspaces_apart(tmp_path):
    """Run ids restart in every store: two stores side by side must not share run-1/ (a merged winner there
    once picked up another store's plugin files), and a merge holds only its sources' plugins."""
    from specpilot.core.loop import default_workdir
    from specpilot.core.loop.workspace import Workspace

    assert default_workdir(str(tmp_path / "a.db")) != default_workdir(str(tmp_path / "b.db"))
    assert Path(default_workdir(str(tmp_path / "a.db"))).parent == tmp_path / ".specpilot"
    ws = Workspace(Path(default_workdir(str(tmp_path / "a.db"))) / "run-1")
    ws.write("1-r1-c1", {"plugins/kept.py": "x = 1\n"})
    stale = ws / "1-r1-merge" / "plugins"
    stale.mkdir(parents=True)
    (stale / "other_run.py").write_text("y = 2\n")
    merged = ws.merged("1-r1-merge", ["1-r1-c1"])
    assert sorted(p.name for p in (merged / "plugins").iterdir()) == ["kept.py"]
