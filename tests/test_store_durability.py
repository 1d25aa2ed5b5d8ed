"""A writer killed with SIGKILL loses at most the round in flight, never a finished one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from specpilot.core.store import Store

FINISHED = 12

WRITER = """
import sys, time
from specpilot.core.events import Event
from specpilot.core.store import Store

store = Store(sys.argv[1])
run = store.create_run({"target": "durability"}, {})
print("run", run, flush=True)
for index in range(1, 10_000):
    with store.transaction():
        rid = store.start_round(run, index, {"largest_gap": "draft"})
        store.append_event(run, Event("round_started", {"round": index}))
        for c in range(3):
            cid = f"r{index}c{c}"
            store.add_candidate(rid, cid, "local", "title", "why", "recipe", "d" * 500, "name = 'x'", 1.0)
            store.set_gate(cid, "applies", True, "")
            store.add_evaluation(cid, "tuning", {"speedup": 1.0, "low": 0.9, "high": 1.1, "noise_floor": 0.01,
                                                 "passed": False, "samples": [{"request": k, "candidate_s": 0.1,
                                                                              "incumbent_s": 0.1} for k in range(50)]})
            if index == int(sys.argv[2]) + 1 and c == 1:
                print("mid", index, flush=True)
                time.sleep(60)
        store.finish_round(rid, {"heldout_speedup_vs_ar": 1.0 + index / 100})
        store.append_event(run, Event("round_finished", {"round": index}))
    print("done", index, flush=True)
"""


def test_sigkill_mid_round_keeps_finished_rounds(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(FINISHED)], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.split())
            if lines[-1][0] == "mid":
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    run = int(lines[0][1])
    assert lines[-1] == ["mid", str(FINISHED + 1)]
    assert [int(w[1]) for w in lines if w[0] == "done"] == list(range(1, FINISHED + 1))

    store = Store(path)
    rounds = store.list_rounds(run)
    assert [r["index"] for r in rounds] == list(range(1, FINISHED + 1))
    for rnd in rounds:
        assert rnd["finished_at"] is not None and rnd["candidates"] == 3
        cands = store.candidates(rnd["id"])
        assert all(len(c["evaluations"]["tuning"]["samples"]) == 50 for c in cands)
    assert store.candidate(f"r{FINISHED + 1}c0") is None
    events = store.events(run)
    assert [e.seq for e in events] == list(range(1, 2 * FINISHED + 1))
    assert (events[-1].kind, events[-1].round) == ("round_finished", FINISHED)
    assert store.list_runs()[0]["best_heldout_speedup"] == 1.0 + FINISHED / 100
